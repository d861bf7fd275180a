// Notify kernel (the routing's per-rank and per-expert counts and every row's place): one block
// of 1024 threads, launched first in every dispatch.
//
// 1. Every thread takes 4 consecutive tokens per round (rounds of 4 * blockDim tokens), loads
//    all their expert ids at once and builds each token's destination-rank bitmask; duplicate
//    expert ids in one token count once. Per-expert counts go to shared memory (aggregated per
//    warp with __match_any_sync when there are <= 64 experts). A block-wide exclusive scan of the
//    bitmasks (8 destinations packed as 16-bit fields in two 64-bit words) gives each token its
//    slot among my tokens bound for rank d: slot_map[t][d] = slot, or -1 when t does not go to d.
// 2. Warp d (d < world) writes my row into rank d's signals: [flag, my count to every rank,
//    my count per local expert of d]; each lane fences, lane 0 releases flag = epoch.
// 3. Thread s (s < world) waits until rank s's row in my signals carries this epoch. Having
//    every peer's row for this epoch means every peer has entered this dispatch, i.e. finished
//    with the buffers of the previous one: this is the barrier that makes buffer reuse safe.
// 4. From the world x world count matrix: base[d] = rows that ranks < me send to d (my first
//    row on d), num_recv = rows sent to me, expert_counts[e] = sum over sources.
// own_rows ce (p.own_ce): rank d's buffer starts with d's own T_d rows by token index (the caller's copy
// engine fills them), then every other source's packed rows in rank order. So base[d] = T_d + rows that
// ranks < me other than d send to d, base[me] = 0 with slot_map[t][me] = t (the combine then reads token t's
// own row at row t), num_recv = T_me + rows the peers send me; and the thread that writes slot_map[t] also
// writes recv_key[t]: me << 32 | t where t is routed to me, else -1 (padding). The published row is the
// same in both modes (its count to myself stays in it, unused here; T_d is its num_tokens word).
// own_rows all (p.own_ce == 2): every source's rows by token index at s * max_tokens, so base[d] = me * max_tokens,
// slot_map[t][d] = t where t goes to d, num_recv = world * max_tokens (rows no token fills are keyed -1 by the
// senders' key kernel, dispatch.cu); no key is written here.
// Expert-major layout (align >= 1): each row also carries the source's counts for every global expert,
// so in step 4 warp d lays out rank d's segments (counts padded to align, a warp scan over its experts)
// and stores em_base[g] = segment start of g on d + the rows that sources before me send to g: with the
// ordinal of each token among my tokens routed to g (em_ordinal_kernel, launched before this kernel) the
// dispatch knows every slot without another exchange. Warp `me` also stores my own segment table.
#include <algorithm>

#include "common.cuh"

namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kTokensPerThread = 4;

// Destination bitmask as 16-bit counters: ranks 0-3 in one word, 4-7 in the other.
__device__ __forceinline__ unsigned long long pack_lo(unsigned mask) {
  unsigned long long w = 0;
#pragma unroll
  for (int d = 0; d < 4; ++d) w |= (unsigned long long)((mask >> d) & 1u) << (16 * d);
  return w;
}

__device__ __forceinline__ unsigned long long pack_hi(unsigned mask) { return pack_lo(mask >> 4); }

// own_rows ce: my slot for token t on rank d (slot_map), given that t goes to d and that `packed` is its slot
// among my tokens bound for d: token t itself on my own rank (row t of my own segment, base[me] = 0).
__device__ __forceinline__ int slot_on(const EpParams& p, int d, int t, int packed) {
  return p.own_ce == 2 || (p.own_ce == 1 && d == p.rank) ? t : packed;
}

// own_rows ce: the key of my own row t (recv_key, a DispatchOutput.row_key): mine where my mask says so.
__device__ __forceinline__ void store_own_key(const EpParams& p, int t, unsigned mask) {
  long long* key = reinterpret_cast<long long*>(p.peer_base[p.rank] + p.off_recv_key);
  key[t] = ((mask >> p.rank) & 1u) ? ((long long)p.rank << 32 | t) : -1ll;
}

// own_rows ce in the direct kernel (a fallback): token t's slot on my own rank becomes t, and its key. Out of
// line (inlined into the slot loop it tripled that kernel's spills) and without the EpParams reference, so the
// parameter block stays in param space.
static __device__ __noinline__ void own_row_first(int* slots, long long* key, int rank, int t, unsigned mask) {
  const bool mine = (mask >> rank) & 1u;
  if (mine) slots[rank] = t;
  key[t] = mine ? ((long long)rank << 32 | t) : -1ll;
}

__device__ __forceinline__ int field16(unsigned long long lo, unsigned long long hi, int d) {
  const unsigned long long w = d < 4 ? lo : hi;
  return (int)((w >> (16 * (d & 3))) & 0xffffull);
}

// Block-wide exclusive scan of per-thread packed counts (pack_lo / pack_hi: one 16-bit field per
// destination): ex_lo / ex_hi = the sum over the threads before this one; afterwards warp_incl[nwarps - 1]
// holds the block's totals. Every thread of the block calls it (two __syncthreads).
__device__ __forceinline__ void block_scan_packed(unsigned long long lo, unsigned long long hi, int lane, int warp,
                                                  int nwarps, unsigned long long (*warp_incl)[2],
                                                  unsigned long long& ex_lo, unsigned long long& ex_hi) {
  unsigned long long lo_in = lo, hi_in = hi;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const unsigned long long a = __shfl_up_sync(0xffffffffu, lo_in, off);
    const unsigned long long b = __shfl_up_sync(0xffffffffu, hi_in, off);
    if (lane >= off) {
      lo_in += a;
      hi_in += b;
    }
  }
  if (lane == 31) {
    warp_incl[warp][0] = lo_in;
    warp_incl[warp][1] = hi_in;
  }
  __syncthreads();
  if (warp == 0) {
    unsigned long long a = lane < nwarps ? warp_incl[lane][0] : 0;
    unsigned long long b = lane < nwarps ? warp_incl[lane][1] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const unsigned long long x = __shfl_up_sync(0xffffffffu, a, off);
      const unsigned long long y = __shfl_up_sync(0xffffffffu, b, off);
      if (lane >= off) {
        a += x;
        b += y;
      }
    }
    if (lane < nwarps) {
      warp_incl[lane][0] = a;
      warp_incl[lane][1] = b;
    }
  }
  __syncthreads();
  ex_lo = lo_in - lo + (warp ? warp_incl[warp - 1][0] : 0ull);
  ex_hi = hi_in - hi + (warp ? warp_incl[warp - 1][1] : 0ull);
}

// Warp d (< world) stores my notify row into rank d's signals: [flag, counts per destination (counts[]),
// my tokens per expert of rank d, num_tokens], then releases the flag.
__device__ __forceinline__ void publish_row(const EpParams& p, int d, int lane, const int* counts,
                                            const int* expert_cnt, int num_tokens, int epoch) {
  const int world = p.world, E = p.experts_per_rank;
  int* row = signal_ptr(p, d, p.sig.notify_off + p.rank * p.sig.notify_stride);
  for (int j = lane; j < world; j += 32) row[1 + j] = counts[j];
  for (int e = lane; e < E; e += 32) row[1 + world + e] = expert_cnt[d * E + e];
  if (lane == 0) row[1 + world + E] = num_tokens;  // the pull dispatch's token range of this source
  if (p.align > 0)
    for (int g = lane; g < world * E; g += 32) row[2 + world + E + g] = expert_cnt[g];
  fence_acq_rel_sys();
  __syncwarp();
  if (lane == 0) st_release_sys(row, epoch);
}

// Warp d: the segments of rank d's experts from every source's full counts (rows = my notify rows), and
// em_base of d's experts for my tokens; for d == me also my segment table (em_offsets, em_num_slots).
__device__ __forceinline__ void em_segments(const EpParams& p, const int* rows, int d, int lane) {
  const int world = p.world, E = p.experts_per_rank, stride = p.sig.notify_stride, align = p.align;
  long long carry = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane, g = d * E + e;
    int c = 0, before = 0;
    for (int s = 0; s < world && e < E; ++s) {
      const int v = ld_volatile(rows + s * stride + 2 + world + E + g);
      c += v;
      before += s < p.rank ? v : 0;
    }
    const int padded = (c + align - 1) / align * align;
    const int incl = warp_inclusive_sum(padded);
    const long long start = carry + incl - padded;
    if (e < E) {
      p.em_base[g] = (int)start + before;
      if (d == p.rank) p.em_offsets[e] = start;
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (d == p.rank && lane == 0) *p.em_num_slots = carry;
}

// The whole block: wait for every rank's row, then my offsets on every destination (base), the rows I
// receive (num_recv) and my experts' counts.
__device__ __forceinline__ void wait_rows_and_offsets(const EpParams& p, int epoch) {
  const int tid = threadIdx.x, world = p.world, E = p.experts_per_rank, stride = p.sig.notify_stride;
  if (tid < world) {
    wait_flag(p, signal_ptr(p, p.rank, p.sig.notify_off + tid * stride), epoch, tid, kPhaseNotify);
  }
  __syncthreads();
  if (ld_volatile(p.dev_error)) return;
  if (tid == 0) stamp(p, kStampPeersSeen);
  const int* rows = signal_ptr(p, p.rank, p.sig.notify_off);
  // own_rows ce: rank d's own segment (T_d = the num_tokens word of d's row) comes first, d's count to itself
  // never counts
  if (tid < world) {
    int b = 0;
    for (int s = 0; s < p.rank; ++s) b += p.own_ce && s == tid ? 0 : ld_volatile(rows + s * stride + 1 + tid);
    if (p.own_ce == 1) b = tid == p.rank ? 0 : b + ld_volatile(rows + tid * stride + 1 + world + E);
    if (p.own_ce == 2) b = p.rank * p.max_tokens;  // own_rows all: my segment, on every rank
    p.base[tid] = b;
  }
  if (tid == 32) {
    long long n = 0;
    for (int s = 0; s < world; ++s)
      n += ld_volatile(rows + s * stride + (p.own_ce && s == p.rank ? 1 + world + E : 1 + p.rank));
    *p.num_recv = p.own_ce == 2 ? (long long)world * p.max_tokens : n;
  }
  for (int e = tid; e < E; e += blockDim.x) {
    long long c = 0;
    for (int s = 0; s < world; ++s) c += ld_volatile(rows + s * stride + 1 + world + e);
    p.expert_counts[e] = c;
  }
  if (p.align > 0 && (tid >> 5) < world) em_segments(p, rows, tid >> 5, tid & 31);
  if (tid == 0) stamp(p, kStampNotifyEnd);
}

// One group of (up to) 8 expert ids per token, for each of a thread's kTokens tokens [t0, t0 + kTokens):
// every distinct valid id counts once (against the group's earlier ids and the token's ids of
// earlier groups, read back from topk_idx), into the token's destination-rank mask and the shared
// per-expert counts (one atomic per distinct id in the warp where `aggregate`: few experts, many
// lanes on one counter). Tokens at or past t_end hold only -1 ids. Shared by both notify kernels.
template <int kTokens>
__device__ __forceinline__ void count_id_group(const int (&ids)[kTokens][8], unsigned (&masks)[kTokens],
                                               const int64_t* __restrict__ topk_idx, int t0, int t_end,
                                               int topk, int k0, int E, bool aggregate, int lane,
                                               int* expert_cnt) {
#pragma unroll
  for (int u = 0; u < kTokens; ++u) {
    const int64_t* row = topk_idx + (size_t)(t0 + u < t_end ? t0 + u : 0) * topk;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      int e = ids[u][v];
#pragma unroll
      for (int w = 0; w < v; ++w) e = (ids[u][w] == e) ? -1 : e;  // duplicates count once
      for (int j = 0; j < k0 && e >= 0; ++j) e = (row[j] == e) ? -1 : e;
      if (e >= 0) masks[u] |= 1u << (e / E);
      if (aggregate) {
        const unsigned same = __match_any_sync(0xffffffffu, e);
        if (e >= 0 && lane == __ffs(same) - 1) atomicAdd(&expert_cnt[e], __popc(same));
      } else if (e >= 0) {
        atomicAdd(&expert_cnt[e], 1);
      }
    }
  }
}

__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_kernel(EpParams p, const int64_t* __restrict__ topk_idx, int num_tokens, int epoch) {
  extern __shared__ int expert_cnt[];  // [world * E]: my tokens per global expert
  __shared__ unsigned long long warp_incl[32][2];
  __shared__ int running[EP_MAX_WORLD];
  __shared__ int aborted;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, E = p.experts_per_rank, topk = p.topk;
  const long long num_experts = (long long)world * E;

  if (tid == 0) aborted = ld_volatile(p.dev_error);
  for (int i = tid; i < num_experts; i += blockDim.x) expert_cnt[i] = 0;
  if (tid < EP_MAX_WORLD) running[tid] = 0;
  __syncthreads();
  if (aborted) return;
  if (tid == 0) stamp(p, kStampNotifyStart);
  if (tid < 3 && p.stamps != nullptr) p.stamps[kStampSmMask + tid] = 0;  // the data kernel's SMs

  // Let the data kernel (launched with programmatic stream serialization) get resident now; it
  // waits in griddepcontrol.wait until this grid has completed and its writes are visible.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // ---- 1. masks, expert counts, slots ----
  // A round covers blockDim * kTokensPerThread tokens; thread i takes kTokensPerThread
  // consecutive tokens, so one block scan per round orders them all.
  const bool aggregate = num_experts <= 64;  // few experts: many lanes hit one counter
  for (int r0 = 0; r0 < num_tokens; r0 += blockDim.x * kTokensPerThread) {
    const int t0 = r0 + tid * kTokensPerThread;
    int ids[kTokensPerThread][8];
    unsigned masks[kTokensPerThread];
#pragma unroll
    for (int u = 0; u < kTokensPerThread; ++u) masks[u] = 0;
    for (int k0 = 0; k0 < topk; k0 += 8) {
      // all loads of this group first (independent, in flight together), then the bookkeeping
#pragma unroll
      for (int u = 0; u < kTokensPerThread; ++u) {
        const bool valid = t0 + u < num_tokens;
        const int64_t* row = topk_idx + (size_t)(valid ? t0 + u : 0) * topk;
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          const long long e = (valid && k0 + v < topk) ? (long long)row[k0 + v] : -1;
          ids[u][v] = (e < 0 || e >= num_experts) ? -1 : (int)e;
        }
      }
      count_id_group<kTokensPerThread>(ids, masks, topk_idx, t0, num_tokens, topk, k0, E, aggregate, lane,
                                       expert_cnt);
    }
    unsigned long long lo = 0, hi = 0;
#pragma unroll
    for (int u = 0; u < kTokensPerThread; ++u) {
      lo += pack_lo(masks[u]);
      hi += pack_hi(masks[u]);
    }
    unsigned long long cur_lo, cur_hi;
    block_scan_packed(lo, hi, lane, warp, nwarps, warp_incl, cur_lo, cur_hi);
#pragma unroll
    for (int u = 0; u < kTokensPerThread; ++u) {
      if (t0 + u < num_tokens) {
        int* slots = p.slot_map + (size_t)(t0 + u) * world;
        for (int d = 0; d < world; ++d)
          slots[d] = ((masks[u] >> d) & 1u) ? running[d] + field16(cur_lo, cur_hi, d) : -1;
        if (p.own_ce)  // 1 only: ep_launch_notify never runs this kernel for own_rows all
          own_row_first(slots, reinterpret_cast<long long*>(p.peer_base[p.rank] + p.off_recv_key), p.rank, t0 + u,
                        masks[u]);
      }
      cur_lo += pack_lo(masks[u]);
      cur_hi += pack_hi(masks[u]);
    }
    __syncthreads();
    if (tid < world) running[tid] += field16(warp_incl[nwarps - 1][0], warp_incl[nwarps - 1][1], tid);
    __syncthreads();
  }

  if (tid == 0) stamp(p, kStampCounted);

  // ---- 2. publish my row to every rank ----
  if (warp < world) publish_row(p, warp, lane, running, expert_cnt, num_tokens, epoch);
  if (tid == 0) {
    stamp(p, kStampPublished);
    stamp(p, kStampSlots);
  }

  wait_rows_and_offsets(p, epoch);
}

// ---- staged notify ----
// Same results as notify_kernel, in three passes:
//   A. Per round of 4 * blockDim tokens, warp w owns tokens [128 w, 128 w + 128) of the round and
//      lane l tokens 4 l .. 4 l + 3 of those (the same assignment as notify_kernel). The ids are
//      loaded coalesced (32 consecutive int64 per warp instruction, in groups of 8 per token)
//      into a per-warp shared stage as u16, then each lane reads its own tokens back from shared
//      memory. Masks go to slot_map[t][0] (scratch, rewritten in pass C by the same thread),
//      counts per expert to shared memory, counts per destination to total[].
//   B. Publish my row to every rank (as notify_kernel step 2): the peers' rows travel while C runs.
//   C. Per round: each thread reads back its masks, block scan, slot_map written with 16-byte
//      stores (4 tokens x world ints per thread are contiguous).
// Then the wait and the offsets exactly as notify_kernel steps 3-4.
//
// EP_NOTIFY_GRID: the same kernel on nb > 1 blocks (nb ~ the data kernel's SM count; block-uniform
// ranges of `chunk` tokens, a multiple of 128, so every int4 slot store stays aligned). A block takes its
// range index from a counter in arrival order (so it only ever waits for blocks that are running). After
// A it stores its per-destination counts, adds its expert counts into a global accumulator, releases its
// flag and takes a ticket; the block with the last ticket sums every block's counts (and zeroes the
// accumulator and both counters for the next call) and does B, the peers' wait and the offsets. In C,
// block b starts its running slots at the counts of the blocks before it (waiting for their flags).
// One block (nb = 1) is EP_NOTIFY_STAGED: no scratch, no tickets.
// ids of one k group staged per warp: 32 * kTPT tokens x 8
__host__ __device__ constexpr int stage_ids_per_warp(int tpt) { return 32 * tpt * 8; }
constexpr uint16_t kNoExpert = 0xffff;

__host__ __device__ __forceinline__ size_t staged_cnt_bytes(int num_experts) {
  return ((size_t)num_experts * sizeof(int) + 15) / 16 * 16;
}

// kTPT tokens per thread: 4 (staged, one block) or 1 (grid: a warp's A is 4x shorter; 32 tokens per warp)
template <int kTPT>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_staged_kernel(EpParams p, const int64_t* __restrict__ topk_idx, int num_tokens, int chunk, int epoch) {
  extern __shared__ __align__(16) uint8_t dyn[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, E = p.experts_per_rank, topk = p.topk;
  const int num_experts = world * E;
  int* expert_cnt = reinterpret_cast<int*>(dyn);
  uint16_t* stage = reinterpret_cast<uint16_t*>(dyn + staged_cnt_bytes(num_experts)) + warp * stage_ids_per_warp(kTPT);
  __shared__ unsigned long long warp_incl[32][2];
  __shared__ int running[EP_MAX_WORLD];
  __shared__ int total[EP_MAX_WORLD];
  __shared__ int aborted, blk, is_last;
  const int nb = gridDim.x;
  int* blk_flag = p.notify_scratch;                               // [kMaxNotifyBlocks]
  int* blk_cnt = blk_flag + kMaxNotifyBlocks;                     // [kMaxNotifyBlocks][EP_MAX_WORLD]
  int* expert_acc = blk_cnt + kMaxNotifyBlocks * EP_MAX_WORLD;  // [num_experts]

  if (tid == 0) {
    aborted = ld_volatile(p.dev_error);
    blk = nb > 1 ? (int)atomicAdd(p.counters + kCounterNotifyTile, 1u) : 0;
    is_last = nb == 1;
  }
  for (int i = tid; i < num_experts; i += blockDim.x) expert_cnt[i] = 0;
  if (tid < EP_MAX_WORLD) {
    running[tid] = 0;
    total[tid] = 0;
  }
  __syncthreads();
  // An aborted call leaves the range / ticket counters and the accumulator dirty; that is safe only because
  // dev_error is never cleared (a context that timed out stays failed). A range index past the grid means
  // the counters were not reset: give up like an abort instead of indexing out of the scratch area.
  if (aborted || blk >= nb) return;
  const int b = blk;
  const int t_begin = min(num_tokens, b * chunk), t_end = min(num_tokens, t_begin + chunk);
  if (tid == 0 && b == 0) stamp(p, kStampNotifyStart);
  if (tid < 3 && b == 0 && p.stamps != nullptr) p.stamps[kStampSmMask + tid] = 0;  // the data kernel's SMs
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  const int round_tokens = blockDim.x * kTPT;
  const bool aggregate = num_experts <= 64;
  // ---- A. masks and counts ----
  for (int r0 = t_begin; r0 < t_end; r0 += round_tokens) {
    const int tw0 = r0 + warp * 32 * kTPT;  // first token of this warp
    const int t0 = tw0 + lane * kTPT;       // first token of this lane
    unsigned masks[kTPT];
#pragma unroll
    for (int u = 0; u < kTPT; ++u) masks[u] = 0;
    for (int k0 = 0; k0 < topk; k0 += 8) {
      // stage ids [tw0, tw0 + 128) x [k0, k0 + 8): element j = token * 8 + k
      constexpr int kPer = 8 * kTPT, kBatch = kPer < 16 ? kPer : 16;  // loads per lane, in flight at once
#pragma unroll
      for (int h0 = 0; h0 < kPer; h0 += kBatch) {
        int v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int j = (h0 + i) * 32 + lane;
          const int t = tw0 + (j >> 3), k = k0 + (j & 7);
          const long long e = (t < t_end && k < topk) ? (long long)topk_idx[(size_t)t * topk + k] : -1;
          v[i] = (e < 0 || e >= num_experts) ? -1 : (int)e;
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) stage[(h0 + i) * 32 + lane] = v[i] < 0 ? kNoExpert : (uint16_t)v[i];
      }
      __syncwarp();
      int ids[kTPT][8];
#pragma unroll
      for (int u = 0; u < kTPT; ++u) {
        const uint4 q = reinterpret_cast<const uint4*>(stage)[lane * kTPT + u];
        const uint32_t w4[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const uint32_t a = w4[h] & 0xffffu, b = w4[h] >> 16;
          ids[u][2 * h] = a == kNoExpert ? -1 : (int)a;
          ids[u][2 * h + 1] = b == kNoExpert ? -1 : (int)b;
        }
      }
      __syncwarp();  // the stage is refilled by the next k group
      count_id_group<kTPT>(ids, masks, topk_idx, t0, t_end, topk, k0, E, aggregate, lane, expert_cnt);
    }
    unsigned long long lo = 0, hi = 0;
#pragma unroll
    for (int u = 0; u < kTPT; ++u) {
      if (t0 + u < t_end) p.slot_map[(size_t)(t0 + u) * world] = (int)masks[u];
      lo += pack_lo(masks[u]);
      hi += pack_hi(masks[u]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // <= 128 tokens per warp: no 16-bit field overflows
      lo += __shfl_xor_sync(0xffffffffu, lo, off);
      hi += __shfl_xor_sync(0xffffffffu, hi, off);
    }
    if (lane < world) atomicAdd(&total[lane], field16(lo, hi, lane));
  }
  __syncthreads();
  if (tid == 0) stamp(p, kStampBlockCounted);  // every block: the last one to finish A stays

  // ---- grid: hand-off between blocks (nb > 1) ----
  if (nb > 1) {
    if (tid < world) blk_cnt[b * EP_MAX_WORLD + tid] = total[tid];
    for (int e = tid; e < num_experts; e += blockDim.x)
      if (expert_cnt[e] != 0) atomicAdd(expert_acc + e, expert_cnt[e]);
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      st_release_gpu(blk_flag + b, epoch);
      is_last = atomicAdd(p.counters + kCounterNotifyDone, 1u) == (unsigned)(nb - 1);
    }
    __syncthreads();
    if (is_last) {
      __threadfence();  // every block's counts and expert adds precede its ticket
      if (warp < world) {
        int c = 0;
        for (int j = lane; j < nb; j += 32) c += ld_volatile(blk_cnt + j * EP_MAX_WORLD + warp);
        c = warp_sum_int(c);
        if (lane == 0) total[warp] = c;
      }
      for (int e = tid; e < num_experts; e += blockDim.x) expert_cnt[e] = atomicExch(expert_acc + e, 0);
      if (tid == 0) {  // every block has taken its range and its ticket: ready for the next call
        atomicExch(p.counters + kCounterNotifyTile, 0u);
        atomicExch(p.counters + kCounterNotifyDone, 0u);
      }
      __syncthreads();
    }
  }
  if (tid == 0 && is_last) stamp(p, kStampCounted);

  // ---- B. publish my row to every rank ----
  if (is_last && warp < world) publish_row(p, warp, lane, total, expert_cnt, num_tokens, epoch);
  if (tid == 0 && is_last) stamp(p, kStampPublished);

  // ---- C. slots ----
  if (nb > 1 && b > 0) {  // my first slot on rank d = tokens of blocks 0 .. b-1 bound for d
    for (int j = tid; j < b; j += blockDim.x) wait_flag(p, blk_flag + j, epoch, p.rank, kPhaseNotify);
    __syncthreads();
    if (warp < world) {
      int c = 0;
      for (int j = lane; j < b; j += 32) c += ld_volatile(blk_cnt + j * EP_MAX_WORLD + warp);
      c = warp_sum_int(c);
      if (lane == 0) running[warp] = c;
    }
    __syncthreads();
  }
  for (int r0 = t_begin; r0 < t_end; r0 += round_tokens) {
    const int t0 = r0 + tid * kTPT;
    unsigned masks[kTPT];
    unsigned long long lo = 0, hi = 0;
#pragma unroll
    for (int u = 0; u < kTPT; ++u) {
      masks[u] = t0 + u < t_end ? (unsigned)p.slot_map[(size_t)(t0 + u) * world] : 0u;
      lo += pack_lo(masks[u]);
      hi += pack_hi(masks[u]);
    }
    unsigned long long cur_lo[kTPT], cur_hi[kTPT];
    block_scan_packed(lo, hi, lane, warp, nwarps, warp_incl, cur_lo[0], cur_hi[0]);
#pragma unroll
    for (int u = 1; u < kTPT; ++u) {
      cur_lo[u] = cur_lo[u - 1] + pack_lo(masks[u - 1]);
      cur_hi[u] = cur_hi[u - 1] + pack_hi(masks[u - 1]);
    }
    int run[EP_MAX_WORLD];
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) run[d] = d < world ? running[d] : 0;
    // value of flat entry i = u * world + d of this thread's 4 tokens
    auto slot_of = [&](int i) -> int {
      const int u = i / world, d = i - u * world;
      unsigned m = 0;
      unsigned long long l = 0, h = 0;
#pragma unroll
      for (int uu = 0; uu < kTPT; ++uu) {
        if (uu == u) {
          m = masks[uu];
          l = cur_lo[uu];
          h = cur_hi[uu];
        }
      }
      int r = 0;
#pragma unroll
      for (int dd = 0; dd < EP_MAX_WORLD; ++dd) r = dd == d ? run[dd] : r;
      return ((m >> d) & 1u) ? slot_on(p, d, t0 + u, r + field16(l, h, d)) : -1;
    };
    int* slots = p.slot_map + (size_t)t0 * world;
    if (kTPT == 4 && t0 + kTPT <= t_end) {
      // 4 * world ints starting at a multiple of 16 bytes: world 16-byte stores
      for (int q = 0; q < world; ++q)
        reinterpret_cast<int4*>(slots)[q] = make_int4(slot_of(4 * q), slot_of(4 * q + 1), slot_of(4 * q + 2),
                                                      slot_of(4 * q + 3));
    } else if (t0 < t_end) {  // this thread's tokens t0 .. min(t0 + kTPT, t_end) - 1 only
      for (int i = 0; i < min(kTPT, t_end - t0) * world; ++i) slots[i] = slot_of(i);
    }
    if (p.own_ce == 1) {
#pragma unroll
      for (int u = 0; u < kTPT; ++u)
        if (t0 + u < t_end) store_own_key(p, t0 + u, masks[u]);
    }
    __syncthreads();
    if (tid < world) running[tid] += field16(warp_incl[nwarps - 1][0], warp_incl[nwarps - 1][1], tid);
    __syncthreads();
  }
  if (!is_last) return;  // block-uniform
  if (tid == 0) stamp(p, kStampSlots);

  wait_rows_and_offsets(p, epoch);
}

// Expert-major: em_ord[t][k] = tokens t' < t of mine whose top-k holds topk_idx[t][k], for the first
// position k of each valid expert id of t (a repeated id is skipped by the dispatch, its entry unused).
// Warp w of the grid takes global experts w, w + W, ... and walks my tokens kOrdTok x 32 at a time, one token
// per lane and sub-step: all the sub-steps' ids are loaded first (one round trip per step, not per 32 tokens:
// notes/KERNELS.md, expert-major at world 1, H3), then per sub-step in token order a ballot says which of the
// 32 picked the expert and its popcount below the lane is the ordinal within the group. Cost: experts x
// tokens / 32 warp steps of topk loads, kOrdTok of them in flight.
constexpr int kOrdTok = 4;
__global__ void __launch_bounds__(512) em_ordinal_kernel(EpParams p, const int64_t* __restrict__ topk_idx,
                                                         int num_tokens) {
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  const int topk = p.topk, num_experts = p.world * p.experts_per_rank;
  if (ld_volatile(p.dev_error) != 0) return;
  for (int g = blockIdx.x * nwarps + (threadIdx.x >> 5); g < num_experts; g += gridDim.x * nwarps) {
    int before = 0;
    for (int t0 = 0; t0 < num_tokens; t0 += 32 * kOrdTok) {
      int first[kOrdTok];
#pragma unroll
      for (int u = 0; u < kOrdTok; ++u) first[u] = -1;
      for (int k = topk - 1; k >= 0; --k) {
#pragma unroll
        for (int u = 0; u < kOrdTok; ++u) {  // a token past the end reads the last one's ids, never picks
          const int t = t0 + u * 32 + lane;
          const int64_t e = topk_idx[(size_t)min(t, num_tokens - 1) * topk + k];
          first[u] = (t < num_tokens && e == g) ? k : first[u];
        }
      }
#pragma unroll
      for (int u = 0; u < kOrdTok; ++u) {
        const int t = t0 + u * 32 + lane;
        const unsigned hit = __ballot_sync(0xffffffffu, first[u] >= 0);
        if (first[u] >= 0) p.em_ord[(size_t)t * topk + first[u]] = before + __popc(hit & ((1u << lane) - 1u));
        before += __popc(hit);
      }
    }
  }
}

}  // namespace

int ep_launch_em_ordinal(EpContext* ctx, const int64_t* topk_idx, int num_tokens, int num_sms, cudaStream_t stream) {
  const int num_experts = ctx->p.world * ctx->p.experts_per_rank;
  const int blocks = std::max(1, std::min(num_sms, (num_experts + 15) / 16));
  if (num_tokens == 0) return 0;
  em_ordinal_kernel<<<blocks, 512, 0, stream>>>(ctx->p, topk_idx, num_tokens);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

int ep_launch_notify(EpContext* ctx, const int64_t* topk_idx, int num_tokens, int num_sms, int epoch,
                     cudaStream_t stream) {
  const int num_experts = ctx->p.world * ctx->p.experts_per_rank;
  {
    // grid: ranges of whole 128-token warp groups, at most one block per data SM (kMaxNotifyBlocks)
    const bool grid = ctx->p.notify_impl == EP_NOTIFY_GRID;
    int nb = 1, chunk = num_tokens, threads = kNotifyThreads;
    if (grid) {
      const int want = std::max(1, std::min({num_sms, kMaxNotifyBlocks, (num_tokens + 127) / 128}));
      chunk = std::max(128, ((num_tokens + want - 1) / want + 127) / 128 * 128);
      nb = std::max(1, (num_tokens + chunk - 1) / chunk);
      // one token per thread, one round when it fits; never fewer than 8 warps (B needs world warps)
      threads = std::min(kNotifyThreads, std::max(256, chunk));
    }
    const int tpt = grid ? 1 : kTokensPerThread;
    const size_t smem = staged_cnt_bytes(num_experts) + (size_t)(threads / 32) * stage_ids_per_warp(tpt) * sizeof(uint16_t);
    // u16 ids need < 65535 experts; too many experts for the stage: the direct kernel below
    if (num_experts < kNoExpert && smem <= (size_t)ctx->max_smem_optin) {
      auto kernel = grid ? notify_staged_kernel<1> : notify_staged_kernel<kTokensPerThread>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      kernel<<<nb, threads, smem, stream>>>(ctx->p, topk_idx, num_tokens, chunk, epoch);
      CUDA_CHECK(cudaGetLastError());
      ctx->effective.notify_impl = ctx->p.notify_impl;
      ctx->effective.notify_blocks = nb;
      return 0;
    }
  }
  if (ctx->p.own_ce == 2) {  // its slot loop stays as it is (an own_rows all branch there spilled registers)
    ep_set_error("own_rows all needs the staged or grid notify kernel; %d experts do not fit their id stage",
                 num_experts);
    return -1;
  }
  const size_t smem = (size_t)num_experts * sizeof(int);
  if (smem > 48 * 1024) {
    if (smem > (size_t)ctx->max_smem_optin) {
      ep_set_error("world * experts_per_rank = %zu experts exceeds the notify kernel's shared memory", smem / 4);
      return -1;
    }
    CUDA_CHECK(cudaFuncSetAttribute(notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  // the recorded fallback (ep_effective_config): the staged / grid kernels' id stage does not fit
  notify_kernel<<<1, kNotifyThreads, smem, stream>>>(ctx->p, topk_idx, num_tokens, epoch);
  CUDA_CHECK(cudaGetLastError());
  ctx->effective.notify_impl = EP_NOTIFY_DIRECT;
  ctx->effective.notify_blocks = 1;
  return 0;
}
