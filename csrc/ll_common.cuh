// Low-latency mode (ll_buffers.cu, ll_dispatch.cu, ll_combine.cu): decode-sized batches received
// straight into per-expert padded buffers. Layout contract: epbench/backends/base.py.
//
// One cudaMalloc region per rank, exported and mapped with the normal mode's IPC code
// (ep_ipc_handle / ep_open_peers in buffers.cu, on the EpContext that ep_ll_base returns); every
// rank computes the same offsets, so a peer's buffer = peer_base[peer] + offset.
// E = experts per rank, C = world * T_max (T_max = max tokens per rank), ns = hidden / 128 (fp8).
//   shared part (peers write it over NVLink; x, scales, pair are written by the receiver itself, and with
//   dispatch_place slot also by a source: a row into the slot of its token's first expert here)
//     x          [E, C, row_bytes]       row of source s for local expert e at slot s * T_max + j
//     scales     [E, C, ns] f32          fp8 only
//     pair       [E, C] i32              t * topk + k of the row's source token
//     stage      [world, T_max, row_bytes]  dispatch: source s's token t, sent once to every rank
//                                        holding one of its experts (row s * T_max + t)
//     sscales    [world, T_max, ns] f32  its fp8 scales
//     cnt        [world, E] i32          dispatch: rows source s has for each of my experts
//     dflags     [world] u64             dispatch: (epoch << 32) | T_s, stored by source s into [s]
//                                        with st.release.sys once all its stage rows, tmap / tw
//                                        entries and counts for me have landed
//     tmap       [world, T_max, topk] u64  dispatch: (epoch << 32) | slot (= le * C + s * T_max + j)
//                                        of source s's token t, k-th expert, when that expert is
//                                        mine; entries of older epochs are stale (never cleared)
//     tw         [world, T_max, topk] f32  the matching routing weight w[t, k]
//     crows      [T_max, world, hidden] bf16  combine: rank d's partial sum for my token t
//                                        (sum over t's experts on d of w * y) lands in row t * world + d
//     cflags     [world] i32             combine: epoch, stored by rank d into [d] with
//                                        st.release.sys once all of d's pushes to me landed
//     (ll_sync = token only, LlSync; the kernels' header comments give the protocol)
//     tflags     [world, T_max, tfc] u64 dispatch: (epoch << 32) | hit, stored by source s into
//                                        [s, t, c] once chunk c of its row t (if hit) and tmap / tw
//                                        are here (dispatch_units row: c = 0 for the whole row;
//                                        tfc = chunks of kLlRowChunkV x 32 vectors per row)
//     dwords     [world, E + 1] u64      dispatch: (epoch << 32) | rows source s has for my
//                                        expert le at [s, le], (epoch << 32) | kind bits | T_s at
//                                        [s, E] (ll_units_bits: chunk units, slot, inline or line placement)
//     tcflags    [T_max, world, cch] u64 combine: epoch << 32, stored by rank d into [t, d, c]
//                                        once chunk c of its partial for my token t landed
//                                        (cch = chunks of a bf16 row at 1 KiB per chunk)
//     lstage     [world, T_max, Lw] u64  dispatch_place inline / line: source s's token t as inline words
//                                        (LlInlineRow), each 4 bytes of payload beside the epoch (line: the
//                                        head words only); no flag (zeroed at creation: a word of epoch 0 is
//                                        never current)
//     lline      [world, T_max, Lb] u64  dispatch_place line / line128: source s's row t as 64-byte or
//                                        128-byte tagged lines (LlLineRow; Lb = the larger row, 128-byte
//                                        aligned); a region of its own, so no line word is ever read as an
//                                        inline word or the reverse (zeroed at creation)
//   local part
//     y          [E, C, hidden] bf16     combine input, filled by the caller
//     out        [T_max, hidden] bf16    combine result
//     counts     [E] i64, src_counts [E, world] i32, src_tokens [world] i32   written by the
//                                        dispatch receive phase
//     epochs     i32 [2]                 calls done (dispatch, combine): each kernel uses epoch + 1
//                                        and its last block stores it, so a replayed CUDA graph
//                                        advances them on the device
//     counters   u32 [4]                 blocks finished: 0 dispatch end, 1 combine pushes, 2 combine
//                                        end, 3 dispatch sends
//                                        (each reset by the last block)
//     eslots     i32 [2, sm_count]       ll_sync = token: calls done (dispatch, combine); block b of
//                                        a launch of G blocks reads slot b and stores its epoch
//                                        into slots b, b + G, b + 2G, ... (all agree afterwards)
//     dev_error  i32                     nonzero once any wait timed out: every spin loop bails
//     probe      64 bytes                ep_ll_probe's own flag, block counter, epoch (measuring aid)
#pragma once

#include "common.cuh"

// continue EpPhase (common.cuh); kPhaseLlUnitsMismatch / kPhaseLlPlaceMismatch: a peer's dispatch_units /
// dispatch_place differ from this rank's (reported at once, from the T word's kind bits)
enum LlPhase { kPhaseLlDispatch = 5, kPhaseLlCombine = 6, kPhaseLlUnitsMismatch = 7, kPhaseLlPlaceMismatch = 8 };

struct LlParams {
  int t_max, capacity, experts, num_experts;  // capacity = world * t_max; experts = per rank
  size_t off_x, off_scales, off_pair, off_stage, off_sscales, off_cnt, off_dflags, off_tmap, off_tw, off_crows, off_cflags;
  size_t off_tflags, off_dwords, off_tcflags;  // ll_sync = token only
  size_t off_lstage;                           // inline words (dispatch_place inline; line: head words)
  size_t off_lline;                            // 64-byte tagged lines (dispatch_place line)
  int lrow_head, lrow_words;                   // LlInlineRow: words before the row's, and in all
  int line_count;                              // LlLineRow: lines per row
  int cflag_chunks;                            // cch: combine flags per (token, rank), hidden / 512 rounded up
  int tflag_chunks;                            // tfc: dispatch flags per (source, token): row chunks
  int* eslots;                                 // [2, eslot_count]: token-sync epochs (dispatch, combine)
  int eslot_count;                             // = the GPU's SM count (the largest grid)
  uint16_t* y;
  uint16_t* out;
  long long* counts;
  int* src_counts;
  int* src_tokens;  // [world] tokens of each source in the last dispatch (from its dflags)
  int* epochs;
  unsigned* counters;
  // Measuring aid (ep_ll_set_probe, notes/LATENCY.md): null (default) or u64 [gridDim.x, kLlStamps]:
  // thread 0 of each block stores %globaltimer at each LlStamp point.
  unsigned long long* stamps;
  int combine_order;  // LlCombineOrder (ep_ll_set_combine_order): the order of the combine's push units
  int dispatch_units;  // LlDispatchUnits (ep_ll_set_dispatch_units): a token dispatch's peer units
  int dispatch_place;  // LlDispatchPlace (ep_ll_set_dispatch_place): where a token dispatch's peer rows land
  int combine_release;  // LlCombineRelease (ep_ll_set_combine_release): the token combine's flag releases
  int probe_skip;  // measuring aid (ep_ll_set_probe_skip): 0, or LlProbeSkip bits the token dispatch leaves out
  int line128_count, lline_words;  // LlLineRow<128>: lines per row; lline words per (source, token), either size
};

// Measuring aid (ep_ll_set_probe_skip; epbench probe's variants token-noown / token-norecv / token-peers): parts
// of the token dispatch left out, to time what the rest costs. Its outputs are then wrong by design (the probe
// times such a dispatch alone, unverified, and never runs a combine after it); 0, the default, leaves out nothing.
// kLlSkipOwnRows: the own-row units (a token's row into my own experts' slots); kLlSkipReceive: the receive
// copies (each flag is still waited for; with dispatch_place inline each chunk's row words); kLlSkipSmallStores: the scales and the tmap / tw entries a peer unit
// stores beside its row, with dispatch_place slot its pair entry (a receiver then finds no slot to copy into), with
// inline its scale and weight words (never its slot words, which say whether a row follows); kLlSkipFence: a peer
// unit's flag stored relaxed, without the release (fence) that orders its row's stores before it (a receiver may
// then copy a row before it has landed; inline words have no fence to leave out).
enum LlProbeSkip { kLlSkipOwnRows = 1, kLlSkipReceive = 2, kLlSkipSmallStores = 4, kLlSkipFence = 8, kLlSkipAll = 15 };

// Phase boundaries stamped per block (thread 0) when LlParams::stamps is set. Dispatch: staged =
// ids in shared memory; sent = the block's rows / slots issued (after the block barrier); released =
// the block counted itself (the last block: its release stores issued); waited = every source's flag
// seen (token dispatch: warp 0 has every source's T word); received = the block's copies issued; end =
// the block counted done. Combine: the same, with pushes for sends and the reduce for the receive
// copies. The probe kernel (ep_ll_probe) uses start, sent (end of its measured part A) and end.
enum LlStamp {
  kLlStart = 0,
  kLlStaged = 1,
  kLlSent = 2,
  kLlReleased = 3,
  kLlWaited = 4,
  kLlReceived = 5,
  kLlEnd = 6,
  kLlStamps = 8,
};

__device__ __forceinline__ void ll_stamp(const LlParams& lp, int which) {
  if (lp.stamps != nullptr && threadIdx.x == 0) lp.stamps[blockIdx.x * kLlStamps + which] = globaltimer();
}

// Which synchronisation both kernels use (ep_ll_set_sync, backend option ll_sync): kLlSyncGrid, the
// grid-wide handshakes (release through a last-block counter, then a wait; finish through a
// counter); kLlSyncToken, per-token flags and per-block epoch slots, no grid-wide step.
enum LlSync { kLlSyncGrid = 0, kLlSyncToken = 1 };

// In which order both combine kernels deal their push units (ep_ll_set_combine_order, backend option
// combine_order): kLlOrderSource, destination-major in rank order (every rank pushes to the lowest rank
// first); kLlOrderRotated, destination-minor from me + 1 (consecutive units go to different ranks, as the
// dispatch's peer units do). Only the order of independent pushes differs: same units, same bytes, same flags.
enum LlCombineOrder { kLlOrderSource = 0, kLlOrderRotated = 1 };

// What one peer unit of the token dispatch sends (ep_ll_set_dispatch_units, backend option dispatch_units):
// kLlUnitsRow, a whole row per (token, peer), one warp, one flag; kLlUnitsChunk, one unit per (token, peer,
// chunk of kLlRowChunkV x 32 vectors), each its own warp and flag, so a row's chunks travel in parallel and the
// receiver's chunk c waits for chunk c alone. Same bytes in the same places either way. Every rank must use the
// same value (the receiver waits on the flags its peers store). The grid dispatch ignores it.
enum LlDispatchUnits { kLlUnitsRow = 0, kLlUnitsChunk = 1 };
// Buffers of at most this many tokens a rank: the token combine's push units run over every token of the buffer
// without waiting for the peers' counts (ll_combine.cu, `spec`).
constexpr int kLlSpecTokens = 16;
constexpr int kLlRowChunkV = 4;  // 16-byte vectors per lane in a dispatch chunk (2 KiB a warp)

// Where a token dispatch's peer row lands on the receiver (ep_ll_set_dispatch_place, backend option
// dispatch_place): kLlPlaceStage, stage[source, token] (the receiver copies it into each of its experts'
// slots); kLlPlaceSlot, the slot of the token's first expert there (the lowest topk index among them), with its
// scales and pair entry (the receiver copies it into the others' slots only). Same outputs either way. Every
// rank must use the same value; the grid dispatch ignores it.
// kLlPlaceInline: lstage[source, token], every 4 bytes of the row, its scales, slots and weights in a word of its
// own beside the epoch (LlInlineRow), so the receiver reads each word as it lands: no sender fence, no flag, twice
// the bytes on the link.
// kLlPlaceLine: the inline placement's slot, weight and scale words, but the row in 64-byte lines of 56 bytes of
// payload and an 8-byte tag with the call's epoch (LlLineRow, region lline): 14 % more bytes than the row instead
// of twice as many, no fence, no flag. It relies on the 4 lanes' aligned 64-byte store of a line becoming visible
// on the peer whole and a warp's load of it seeing one version, which the PTX memory model does not promise (it
// promises 8 bytes): every run of it is verified like any other. Lines of 128 bytes (NCCL's LL128 size) tore on 2 x
// H200: the first 64 bytes of a line read stale beside a current tag (notes/LATENCY-NEXT.md). Row units only.
// kLlPlaceLine128: 128-byte lines of 120 bytes and the tag (7 % more bytes than the row), each receive batch loaded
// once more after its tags were all current: the tear above showed a line's first 64 bytes landing before its tag
// half, so a load issued after the tag was seen finds them (no wrong row in 1,600 calls of the loop that found
// hundreds without it). Outside the PTX model too; verified like any other run. Row units only.
enum LlDispatchPlace { kLlPlaceStage = 0, kLlPlaceSlot = 1, kLlPlaceInline = 2, kLlPlaceLine = 3, kLlPlaceLine128 = 4 };

// The token dispatch's T word (dwords[source][E]) carries the sender's kind in its five high bits, so a receiver
// of another kind stops at once (kPhaseLlUnitsMismatch / kPhaseLlPlaceMismatch) instead of copying what it did not
// wait for, or from where nothing was put: bit 31 chunk units, bit 30 slot placement, bit 29 inline placement, bit
// 28 line placement, bit 27 line128 placement (T < 2^27).
constexpr unsigned kLlUnitsBitsMask = 0xf8000000u;
__host__ __device__ __forceinline__ unsigned ll_units_bits(const LlParams& lp) {
  return (lp.dispatch_units == kLlUnitsChunk ? 0x80000000u : 0u) | (lp.dispatch_place == kLlPlaceSlot ? 0x40000000u : 0u) |
         (lp.dispatch_place == kLlPlaceInline ? 0x20000000u : 0u) | (lp.dispatch_place == kLlPlaceLine ? 0x10000000u : 0u) |
         (lp.dispatch_place == kLlPlaceLine128 ? 0x08000000u : 0u);
}

// How the token combine releases its push units' flags (ep_ll_set_combine_release, backend option
// combine_release): kLlReleaseUnit, a __syncwarp and st.release.sys after every unit (the next unit waits for
// the fence); kLlReleaseBatch, up to kLlReleaseBatchUnits units pushed back to back, then one __syncwarp, one
// fence.acq_rel.sys and a relaxed system-scope store of each unit's flag. Same flags, values and bytes. The
// grid combine releases once per grid and ignores it.
enum LlCombineRelease { kLlReleaseUnit = 0, kLlReleaseBatch = 1 };
constexpr int kLlReleaseBatchUnits = 2;

// Inline words (dispatch_place inline): word = (epoch << 32) | 4 bytes of payload, stored with
// st.relaxed.sys (8-byte aligned: single-copy atomic, so a reader sees the old word or the new one whole, never a
// mix) and read with ld.relaxed.sys until its epoch is current. A word carries its own proof of arrival, so no
// fence orders it and no flag follows it: the receiver's wait is the link's one-way latency, not the sender's
// fence round trip plus the flag's trip. Zeroed at creation (epochs start at 1). Pairs of words move as one
// 16-byte access (.v2.u64): two 8-byte accesses, each atomic, each checked on its own.
// LlInlineRow (dispatch, [world, T_max] of lrow_words words): [0, topk) the slot on the receiver of the token's
// k-th expert, or 0xffffffff when that expert is not the receiver's (every (token, peer) stores these, hit or
// not: they tell the receiver whether a row follows); [topk, 2 topk) its weight (float bits, hit only); then ns
// scale words; from lrow_head (a multiple of 4) 4 words per 16-byte vector of the row.
constexpr unsigned kLlNoSlot = 0xffffffffu;
__host__ __device__ inline int ll_inline_head(int topk, int ns) { return (2 * topk + ns + 3) / 4 * 4; }
// LlLineRow<kBytes> (dispatch_place line: 64, line128: 128; lline[source, token], Lc x kWords words apart, so
// kBytes-aligned: the head words stay in lstage's LlInlineRow): ll_line_count<kBytes> lines of kWords words; line L holds
// payload bytes [kPayload L, kPayload (L + 1)) of the row (zero past its end) in its first kWords - 1 words and its
// tag, (epoch << 32) | kLlLineMark, in the last. Lane l of a warp handles part l % kParts (16 bytes) of line
// kPerPass p + l / kParts of pass p: one warp instruction, kPerPass whole lines.
template <int kBytes>
struct LlLineRow {
  static_assert(kBytes == 64 || kBytes == 128, "64- or 128-byte lines");
  static constexpr int kWords = kBytes / 8;
  static constexpr int kParts = kBytes / 16;     // lanes per line
  static constexpr int kPerPass = 32 / kParts;   // lines per warp instruction
  static constexpr int kPayload = kBytes - 8;
  static constexpr bool kReread = kBytes == 128;  // line128: the batch loaded once more after its tags
};
constexpr unsigned kLlLineMark = 0x4c494e45u;  // "LINE"
template <int kBytes>
__host__ __device__ inline int ll_line_count(int row_bytes) {
  return (row_bytes + LlLineRow<kBytes>::kPayload - 1) / LlLineRow<kBytes>::kPayload;
}

__device__ __forceinline__ void st_relaxed_sys_v2u64(unsigned long long* p, unsigned long long a, unsigned long long b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ void ld_relaxed_sys_v2u64(const unsigned long long* p, unsigned long long& a,
                                                     unsigned long long& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// One 16-byte vector as four inline words at w (32-byte aligned).
__device__ __forceinline__ void st_inline_v4(unsigned long long* w, const int4& v, unsigned long long tag) {
  st_relaxed_sys_v2u64(w, tag | (unsigned)v.x, tag | (unsigned)v.y);
  st_relaxed_sys_v2u64(w + 2, tag | (unsigned)v.z, tag | (unsigned)v.w);
}

struct LlContext {
  EpContext* ep;  // region, device, peers and the timeout record, as in normal mode
  LlParams lp;
  int sm_count;  // read once here: launches may be captured into a CUDA graph
  int sync;      // LlSync; fixed before the first launch (the two keep different flags and epochs)
  bool launched;
  size_t token_smem;  // dynamic shared memory the token dispatch needs at max_tokens (ll_token_smem_bytes)
  size_t off_y, off_out, off_counts, off_src_counts, off_src_tokens, off_epochs, off_counters, off_dev_error;
  size_t off_eslots;
  size_t off_probe;  // ep_ll_probe's scratch (kLlProbeBytes, zeroed): flag, counter, epoch, chase words
};

__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A word that carries its own epoch (no data behind it to order): strong, no fence.
__device__ __forceinline__ void st_relaxed_sys_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Spins until ready() (which must contain the flag's acquire load) holds. Gives up (false) when
// another wait already failed or after p.timeout_ns, recording (rank, peer, phase) for the host.
// The error word and the clock are looked at every 64th iteration only: each look is a dependent
// round trip that would otherwise double the time between two polls of the flag.
template <typename Ready>
__device__ __forceinline__ bool ll_spin(const EpParams& p, int peer, int phase, Ready ready) {
  const unsigned long long start = globaltimer();
  for (unsigned n = 1;; ++n) {
    if (ready()) return true;
    if (n % 64 != 0) continue;
    if (ld_volatile(p.dev_error) != 0) return false;
    if (globaltimer() - start > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return false;
    }
  }
}

// ll_spin for a warp that polls together: ready() must be called by every lane and return the same value in every
// lane (built from warp votes); the give-up decision is lane 0's, broadcast, so the warp leaves together.
template <typename Ready>
__device__ __forceinline__ bool ll_spin_warp(const EpParams& p, int peer, int phase, int lane, Ready ready) {
  const unsigned long long start = globaltimer();
  for (unsigned n = 1;; ++n) {
    if (ready()) return true;
    if (n % 64 != 0) continue;
    int stop = 0;
    if (lane == 0) {
      if (ld_volatile(p.dev_error) != 0) {
        stop = 1;
      } else if (globaltimer() - start > p.timeout_ns) {
        report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
        stop = 1;
      }
    }
    if (__shfl_sync(0xffffffffu, stop, 0) != 0) return false;
  }
}

// Spins until the flag's epoch (high word) reaches `epoch`; returns the flag (0 on give-up). kAcquire false: an
// inline word, read relaxed (it carries its payload; nothing is ordered behind it).
template <bool kAcquire = true>
__device__ __forceinline__ unsigned long long ll_wait_epoch_u64(const EpParams& p, const unsigned long long* flag,
                                                                int epoch, int peer, int phase) {
  unsigned long long v = 0;
  const bool ok = ll_spin(p, peer, phase, [&] {
    v = kAcquire ? ld_acquire_sys_u64(flag) : ld_relaxed_sys_u64(flag);
    return (int)(v >> 32) - epoch >= 0;
  });
  return ok ? v : 0;
}

// Spins until *flag >= expected (an i32 epoch); false on give-up.
__device__ __forceinline__ bool ll_wait_i32(const EpParams& p, const int* flag, int expected, int peer, int phase) {
  return ll_spin(p, peer, phase, [&] { return ld_acquire_sys(flag) - expected >= 0; });
}

// Every thread of every block calls it once its stores to peers are issued; returns true (in every
// thread) in the last block of the grid to get here, whose release stores that follow then order
// every block's stores before them. The last block resets the counter.
// Memory-model argument (PTX ISA, memory consistency model): a thread's stores precede
// the block barrier (bar.sync synchronises the block's threads), which precedes thread 0's
// fence.acq_rel.sys F_b and its atomicAdd A_b on the counter (relaxed, gpu scope). The last block's
// thread 0 reads the value of every other block's atomicAdd (they form one RMW chain on the counter),
// then executes fence.acq_rel.sys F_last: each F_b synchronises with F_last (release pattern F_b; A_b,
// acquire pattern A_last; F_last; the atomics are morally strong: same GPU, gpu scope). A second block
// barrier orders F_last before the st.release.sys of the flags by threads < world; a receiver's
// ld.acquire.sys that reads a flag therefore follows every block's stores in causality order, and
// causality order is cumulative (it carries the other threads' stores, not only thread 0's). So one
// fence per block is enough: the grid-wide barrier of cooperative groups relies on the same pattern.
__device__ __forceinline__ bool ll_last_block(const LlParams& lp, unsigned* counter) {
  __shared__ int last;
  __syncthreads();
  ll_stamp(lp, kLlSent);
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      atomicExch(counter, 0u);
      fence_acq_rel_sys();
    }
  }
  __syncthreads();
  return last;
}

// Every thread of every block calls it last. The last block of the grid resets the block counter
// and stores `epoch` as the number of calls done, for the next launch: kernel completion orders it
// before the next launch on the stream, so no fence is needed.
__device__ __forceinline__ void ll_finish_launch(const LlParams& lp, unsigned* counter, int* epochs_slot, int epoch) {
  __syncthreads();
  ll_stamp(lp, kLlReceived);
  if (threadIdx.x == 0) {
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {
      atomicExch(counter, 0u);
      atomicExch(epochs_slot, epoch);
    }
  }
  ll_stamp(lp, kLlEnd);
}

// Token sync: every block of a launch of gridDim.x blocks stores its epoch into its slots b, b + G, ...
// of `slots` ([eslot_count]), so any later grid size reads the same value from its own slot; block 0
// also mirrors it into `epochs_slot` (the EP_LL_EPOCHS view). Stream order hands it to the next launch.
__device__ __forceinline__ void ll_store_epoch_slots(const LlParams& lp, int* slots, int* epochs_slot, int epoch) {
  if (threadIdx.x != 0) return;
  for (int i = blockIdx.x; i < lp.eslot_count; i += gridDim.x) slots[i] = epoch;
  if (blockIdx.x == 0) *epochs_slot = epoch;
}

// Dynamic shared memory of the token dispatch at `tokens` tokens: the staged ids (T x topk int32)
// and the per-(chunk of 32 tokens, global expert) 32-bit token masks plus a totals row
// ((ceil(T / 32) + 1) x num_experts int32). Mirrored in epbench/backends/epbench_ll.py.
inline size_t ll_token_smem_bytes(int tokens, int topk, int num_experts) {
  return ((size_t)tokens * topk + (size_t)((tokens + 31) / 32 + 1) * num_experts) * sizeof(int);
}

int ll_check_launch(const LlContext* ctx, int num_tokens, int num_sms, int warps);
int ll_dispatch_token_smem_attr(int bytes);  // ll_dispatch.cu: allows `bytes` of dynamic shared memory
