// Low-latency mode (ll_buffers.cu, ll_dispatch.cu, ll_combine.cu): decode-sized batches received
// straight into per-expert padded buffers. Layout contract: epbench/backends/base.py.
//
// One cudaMalloc region per rank, exported and mapped with the normal mode's IPC code
// (ep_ipc_handle / ep_open_peers in buffers.cu, on the EpContext that ep_ll_base returns); every
// rank computes the same offsets, so a peer's buffer = peer_base[peer] + offset.
// E = experts per rank, C = world * T_max (T_max = max tokens per rank), ns = hidden / 128 (fp8).
//   shared part (peers write it over NVLink; x, scales, pair are written by the receiver itself)
//     x          [E, C, row_bytes]       row of source s for local expert e at slot s * T_max + j
//     scales     [E, C, ns] f32          fp8 only
//     pair       [E, C] i32              t * topk + k of the row's source token
//     stage      [world, T_max, row_bytes]  dispatch: source s's token t, sent once to every rank
//                                        holding one of its experts (row s * T_max + t)
//     sscales    [world, T_max, ns] f32  its fp8 scales
//     cnt        [world, E] i32          dispatch: rows source s has for each of my experts
//     dflags     [world] u64             dispatch: (epoch << 32) | T_s, stored by source s into [s]
//                                        (release pattern) by the last of its warps to finish
//                                        sending to me (ll_arrive): its stage rows, tmap / tw
//                                        entries and counts for me have landed
//     tmap       [world, T_max, topk] u64  dispatch: (epoch << 32) | slot (= le * C + s * T_max + j)
//                                        of source s's token t, k-th expert, when that expert is
//                                        mine; entries of older epochs are stale (never cleared)
//     tw         [world, T_max, topk] f32  the matching routing weight w[t, k]
//     crows      [T_max, world, hidden] bf16  combine: rank d's partial sum for my token t
//                                        (sum over t's experts on d of w * y) lands in row t * world + d
//     cflags     [world] i32             combine: epoch, stored by rank d into [d] (release pattern)
//                                        by the last of d's warps to push to me (ll_arrive)
//   local part
//     y          [E, C, hidden] bf16     combine input, filled by the caller
//     out        [T_max, hidden] bf16    combine result
//     counts     [E] i64, src_counts [E, world] i32, src_tokens [world] i32   written by the
//                                        dispatch receive phase
//     epochs     i32 [2][kLlEpochSlots]  calls done (dispatch, combine), one slot per block index:
//                                        block b reads slot b (+ 1 = its epoch) and at its end
//                                        stores the epoch into slots b, b + grid, b + 2 grid, ...,
//                                        so every slot advances whatever the grid size and no
//                                        block waits for another; a replayed CUDA graph advances
//                                        them on the device (ll_epoch_begin / ll_epoch_end)
//     counters   u32 [16]                warp arrivals per destination rank: [d] dispatch sends,
//                                        [8 + d] combine pushes (ll_arrive; reset by the last)
//     dev_error  i32                     nonzero once any wait timed out: every spin loop bails
//     probe      64 bytes                ep_ll_probe's own flag, block counter, epoch (measuring aid)
#pragma once

#include "common.cuh"

enum LlPhase { kPhaseLlDispatch = 5, kPhaseLlCombine = 6 };  // continue EpPhase (common.cuh)

struct LlParams {
  int t_max, capacity, experts, num_experts;  // capacity = world * t_max; experts = per rank
  size_t off_x, off_scales, off_pair, off_stage, off_sscales, off_cnt, off_dflags, off_tmap, off_tw, off_crows, off_cflags;
  uint16_t* y;
  uint16_t* out;
  long long* counts;
  int* src_counts;
  int* src_tokens;  // [world] tokens of each source in the last dispatch (from its dflags)
  int* epochs;
  unsigned* counters;
  int sys_scope;  // 1: some peer is another GPU (system-scope fences and flags), 0: all on this GPU
  // Measuring aids (ep_ll_set_probe, notes/LATENCY.md). stamps: null (default) or u64
  // [gridDim.x, kLlStamps]: thread 0 of each block stores %globaltimer at each LlStamp point.
  // variant: LL_VARIANT_* bits (0 = the default kernels) bringing back the pre-issue-24 sync code.
  unsigned long long* stamps;
  int variant;
};

// Phase boundaries stamped per block (thread 0, after a block barrier: ll_stamp_block) when
// LlParams::stamps is set. Dispatch: staged = ids in shared memory; sent = rows / slots for the
// other ranks issued and the warps' arrivals counted; released = my own experts' rows issued
// (bypass); waited = every other source's flag seen; received = their rows placed; end = counts
// and epoch stored. Combine: sent = pushes issued and arrivals counted; released = waited = sent
// (nothing between); received = my tokens reduced (their flag waits inside); end = every peer's
// flag seen and the epoch stored. The probe kernel (ep_ll_probe) uses start, sent (end of its
// measured part A) and end.
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

struct LlContext {
  EpContext* ep;  // region, device, peers and the timeout record, as in normal mode
  LlParams lp;
  int sm_count;  // read once here: launches may be captured into a CUDA graph
  size_t off_y, off_out, off_counts, off_src_counts, off_src_tokens, off_epochs, off_counters, off_dev_error;
  int scope_known;  // lp.sys_scope decided (ll_check_launch, once the peers are mapped)
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

// LlParams::variant bits: each brings back one piece of the synchronisation as it was before issue
// 24, so that one probe run (epbench/llprobe.py) compares them; 0 = the default kernels.
// Bits 1 and 4 concern the grid handshake that only the probe kernel (ep_ll_probe, `sync`) still runs.
enum LlVariant {
  LL_VARIANT_THREAD_FENCE = 1,  // every thread of every block fences at system scope in ll_last_block
  LL_VARIANT_SPIN_CHECKS = 2,   // every spin iteration also loads dev_error and reads the clock
  LL_VARIANT_FINISH_FENCE = 4,  // ll_finish_launch fences (gpu scope) before counting the block
  LL_VARIANT_SYS_SCOPE = 8,     // system-scope fences and flags even when every peer is on this GPU
  LL_VARIANT_NO_BYPASS = 16,    // my own rank is served like a peer: staged rows, counters and flags
  LL_VARIANT_ALL = 31,
};

constexpr int kLlEpochSlots = 1024;  // >= any grid (ll_check_launch)
constexpr int kLlCounters = 16;

// Spins until ready() (which must contain the flag's acquire load) holds. Gives up (false) when
// another wait already failed or after p.timeout_ns, recording (rank, peer, phase) for the host.
// The error word and the clock are looked at every 64th iteration only: each look is a dependent
// round trip that would otherwise double the time between two polls of the flag.
template <typename Ready>
__device__ __forceinline__ bool ll_spin(const EpParams& p, const LlParams& lp, int peer, int phase, Ready ready) {
  const unsigned long long start = globaltimer();
  const unsigned every = (lp.variant & LL_VARIANT_SPIN_CHECKS) ? 1u : 64u;
  for (unsigned n = 1;; ++n) {
    if (ready()) return true;
    if (n % every != 0) continue;
    if (ld_volatile(p.dev_error) != 0) return false;
    if (globaltimer() - start > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return false;
    }
  }
}

// Spins until the flag's epoch (high word) reaches `epoch`; returns the flag (0 on give-up).
__device__ __forceinline__ unsigned long long ll_wait_epoch_u64(const EpParams& p, const LlParams& lp,
                                                                const unsigned long long* flag, int epoch, int peer,
                                                                int phase) {
  unsigned long long v = 0;
  const bool ok = ll_spin(p, lp, peer, phase, [&] {
    v = ld_acquire_sys_u64(flag);
    return (int)(v >> 32) - epoch >= 0;
  });
  return ok ? v : 0;
}

// Spins until *flag >= expected (an i32 epoch); false on give-up.
__device__ __forceinline__ bool ll_wait_i32(const EpParams& p, const LlParams& lp, const int* flag, int expected,
                                            int peer, int phase) {
  return ll_spin(p, lp, peer, phase, [&] { return ld_acquire_sys(flag) - expected >= 0; });
}

// ---- the probe's grid handshake (ep_ll_probe `sync`; the kernels no longer use it) ----
// Every thread of every block calls it once its stores to peers are issued; returns true (in every
// thread) in the last block of the grid to get here, whose release stores that follow then order
// every block's stores before them. The last block resets the counter.
// Memory-model argument (PTX ISA, memory consistency model), default path: a thread's stores precede
// the block barrier (bar.sync synchronises the block's threads), which precedes thread 0's
// fence.acq_rel.sys F_b and its atomicAdd A_b on the counter (relaxed, gpu scope). The last block's
// thread 0 reads the value of every other block's atomicAdd (they form one RMW chain on the counter),
// then executes fence.acq_rel.sys F_last: each F_b synchronises with F_last (release pattern F_b; A_b,
// acquire pattern A_last; F_last; the atomics are morally strong: same GPU, gpu scope). A second block
// barrier orders F_last before the st.release.sys of the flags by threads < world; a receiver's
// ld.acquire.sys that reads a flag therefore follows every block's stores in causality order, and
// causality order is cumulative (it carries the other threads' stores, not only thread 0's). So one
// fence per block is enough: the grid-wide barrier of cooperative groups relies on the same pattern.
// LL_VARIANT_THREAD_FENCE: every thread fences first, and every thread of the last block again.
__device__ __forceinline__ bool ll_last_block(const LlParams& lp, unsigned* counter) {
  __shared__ int last;
  const bool every_thread = lp.variant & LL_VARIANT_THREAD_FENCE;
  if (every_thread) fence_acq_rel_sys();
  __syncthreads();
  ll_stamp(lp, kLlSent);
  if (threadIdx.x == 0) {
    if (!every_thread) fence_acq_rel_sys();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      atomicExch(counter, 0u);
      if (!every_thread) fence_acq_rel_sys();
    }
  }
  __syncthreads();
  if (last && every_thread) fence_acq_rel_sys();
  return last;
}

// Every thread of every block calls it last. The last block of the grid resets the block counter
// and stores `epoch` as the number of calls done, for the next launch: kernel completion orders it
// before the next launch on the stream, so no fence is needed (LL_VARIANT_FINISH_FENCE puts one back).
__device__ __forceinline__ void ll_finish_launch(const LlParams& lp, unsigned* counter, int* epochs_slot, int epoch) {
  __syncthreads();
  ll_stamp(lp, kLlReceived);
  if (threadIdx.x == 0) {
    if (lp.variant & LL_VARIANT_FINISH_FENCE) __threadfence();
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {
      atomicExch(counter, 0u);
      atomicExch(epochs_slot, epoch);
    }
  }
  ll_stamp(lp, kLlEnd);
}


// ---- the kernels' synchronisation (notes/LATENCY.md, "Phase 2") ----
// Scope: .sys when some peer is another GPU, else .gpu (ranks sharing one GPU, world 1).
__device__ __forceinline__ bool ll_sys(const LlParams& lp) {
  return lp.sys_scope != 0 || (lp.variant & LL_VARIANT_SYS_SCOPE) != 0;
}

__device__ __forceinline__ void ll_fence(bool sys) {
  if (sys)
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  else
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ unsigned long long ll_ld_acquire_u64(const unsigned long long* p, bool sys) {
  unsigned long long v;
  if (sys)
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ll_ld_acquire_i32(const int* p, bool sys) {
  int v;
  if (sys)
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Strong (relaxed) stores: after ll_arrive's fence they complete a release pattern.
__device__ __forceinline__ void ll_st_relaxed_u64(unsigned long long* p, unsigned long long v, bool sys) {
  if (sys)
    asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void ll_st_relaxed_i32(int* p, int v, bool sys) {
  if (sys)
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  else
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// One warp's arrival for one destination: lane d calls it (after the warp's __syncwarp) with n =
// the units this warp finished for destination d, out of `expected` units for d in the whole grid.
// Returns true in the one lane (of the whole grid) whose arrival completes `expected`; that lane
// then stores the destination's flag with a strong relaxed store. The counter is reset there: every
// other arrival of this launch came before, the next launch's come after (stream order).
// Memory model (PTX ISA, memory consistency model): the warp's stores (every lane) precede
// bar.warp.sync, which orders them before lane d's fence.acq_rel F_w, which precedes its atomicAdd
// A_w (relaxed, gpu scope: all arrivals are on this GPU, so the atomics are morally strong and
// form one RMW chain on the counter). The last arrival's A_l reads a value that every other A_w
// contributed to; its fence F_l after A_l makes each F_w synchronise with F_l (release pattern
// F_w; A_w, acquire pattern A_l; F_l). F_l followed by the strong flag store is a release pattern,
// so a receiver's ld.acquire (same scope) that reads the flag synchronises with it; causality order
// is cumulative, so every store that preceded any F_w (any lane of any warp that arrived) is
// visible to the receiver after its acquire. One fence per warp and destination, one more in the
// last: no block barrier, no grid barrier.
__device__ __forceinline__ bool ll_arrive(unsigned* counter, unsigned n, unsigned expected, bool sys) {
  ll_fence(sys);
  if (atomicAdd(counter, n) + n != expected) return false;
  atomicExch(counter, 0u);
  ll_fence(sys);
  return true;
}

// Every lane of a warp calls it: lane l waits while bit l of `pending` is set and ready() (its own
// flag's acquire load) is false. True once every pending lane is ready; false on give-up (another
// wait failed, or p.timeout_ns passed: the lowest lane still waiting reports itself as the peer).
// The error word and the clock are looked at every 64th poll only (LL_VARIANT_SPIN_CHECKS: each).
template <typename Ready>
__device__ __forceinline__ bool ll_warp_wait(const EpParams& p, const LlParams& lp, unsigned pending, int phase,
                                             Ready ready) {
  const int lane = threadIdx.x & 31;
  const unsigned long long start = globaltimer();
  const unsigned every = (lp.variant & LL_VARIANT_SPIN_CHECKS) ? 1u : 64u;
  for (unsigned n = 1;; ++n) {
    const bool waiting = ((pending >> lane) & 1u) && !ready();
    pending = __ballot_sync(0xffffffffu, waiting);
    if (pending == 0) {
      __syncwarp();  // bar.warp.sync orders every lane's later loads after the lanes' acquires
      return true;
    }
    if (n % every != 0) continue;
    if (__any_sync(0xffffffffu, lane == 0 && ld_volatile(p.dev_error) != 0)) return false;
    if (__any_sync(0xffffffffu, lane == 0 && globaltimer() - start > p.timeout_ns)) {
      if (lane == __ffs(pending) - 1) report_timeout(p.dev_error, p.host_error, p.rank, lane, phase);
      return false;
    }
  }
}

// Inclusive prefix over the warp's lanes of n (lane l's count); the total is lane 31's value.
__device__ __forceinline__ int ll_warp_prefix(int n) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, n, o);
    if (lane >= o) n += v;
  }
  return n;
}

// Unit index `st` < total over a lane prefix `incl` (ll_warp_prefix): its lane (source) and the
// index within that lane's count. Warp-uniform.
__device__ __forceinline__ int ll_find_lane(int incl, int n, int st, int* within) {
  const int s = __popc(__ballot_sync(0xffffffffu, incl <= st));
  *within = st - (__shfl_sync(0xffffffffu, incl, s) - __shfl_sync(0xffffffffu, n, s));
  return s;
}

// Per-block epoch slots (layout above): slots = dispatch's (epochs) or combine's (epochs +
// kLlEpochSlots). Thread 0 reads the block's own slot before the block's first barrier.
__device__ __forceinline__ int ll_epoch_begin(const int* slots) { return ld_volatile(slots + blockIdx.x) + 1; }

// Any thread order: slot b of this block is only read by this block's thread 0 before its first
// barrier; the other slots written here are read by blocks of later launches only (stream order).
__device__ __forceinline__ void ll_epoch_end(int* slots, int epoch) {
  for (int i = blockIdx.x + threadIdx.x * gridDim.x; i < kLlEpochSlots; i += blockDim.x * gridDim.x) slots[i] = epoch;
}

// Expert e's rows among the staged ids of chunk c (tokens c * 32 + lane): `mine` = ballot of the
// chunk's tokens that picked e, `before` = such tokens in earlier chunks, `total` = all of them,
// *k = the position of e in this lane's token's top-k (-1: not picked). Warp-uniform but *k.
// Costs chunks x topk shared loads per lane.
__device__ __forceinline__ void ll_scan_expert(const int* s_idx, int T, int topk, int chunks, int e, int c,
                                               unsigned* mine, int* before, int* total, int* k) {
  const int lane = threadIdx.x & 31;
  int b = 0, n = 0, kk = -1;
  unsigned m = 0;
  for (int cc = 0; cc < chunks; ++cc) {
    const int t = cc * 32 + lane;
    int hit = -1;
    if (t < T) {
      for (int q = 0; q < topk; ++q) hit = s_idx[t * topk + q] == e ? q : hit;
    }
    const unsigned bal = __ballot_sync(0xffffffffu, hit >= 0);
    if (cc < c) b += __popc(bal);
    if (cc == c) {
      m = bal;
      kk = hit;
    }
    n += __popc(bal);
  }
  *mine = m;
  *before = b;
  *total = n;
  *k = kk;
}

// Stamps at phase boundaries need the whole block there: with stamps on (a probe), a block
// barrier first (uniform: lp.stamps is a kernel parameter); with stamps off, nothing.
__device__ __forceinline__ void ll_stamp_block(const LlParams& lp, int which) {
  if (lp.stamps == nullptr) return;
  __syncthreads();
  ll_stamp(lp, which);
}

int ll_check_launch(LlContext* ctx, int num_tokens, int num_sms, int warps);
