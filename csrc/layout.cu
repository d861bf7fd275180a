// Notify / layout kernel: one block of 1024 threads, launched first in every dispatch.
//
// 1. Every thread takes one token per round (rounds of blockDim tokens, in token order) and
//    builds the token's destination-rank bitmask from its topk_idx; duplicate expert ids in one
//    token count once. Per-expert counts are aggregated per warp (__match_any_sync) into shared
//    memory. A block-wide exclusive scan of the bitmasks (8 destinations packed as 16-bit fields
//    in two 64-bit words) gives each token its slot among my tokens bound for rank d:
//    slot_map[t][d] = slot, or -1 when t does not go to d.
// 2. Warp d (d < world) writes my row into rank d's signals: [flag, my count to every rank,
//    my count per local expert of d]; each lane fences, lane 0 releases flag = epoch.
// 3. Thread s (s < world) waits until rank s's row in my signals carries this epoch. Having
//    every peer's row for this epoch means every peer has entered this dispatch, i.e. finished
//    with the buffers of the previous one: this is the barrier that makes buffer reuse safe.
// 4. From the world x world count matrix: base[d] = rows that ranks < me send to d (my first
//    row on d), num_recv = rows sent to me, expert_counts[e] = sum over sources.
#include "common.cuh"

namespace {

constexpr int kNotifyThreads = 1024;

__device__ __forceinline__ int field16(unsigned long long lo, unsigned long long hi, int d) {
  const unsigned long long w = d < 4 ? lo : hi;
  return (int)((w >> (16 * (d & 3))) & 0xffffull);
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

  // ---- 1. masks, expert counts, slots ----
  for (int r0 = 0; r0 < num_tokens; r0 += blockDim.x) {
    const int t = r0 + tid;
    const bool valid = t < num_tokens;
    const int64_t* row = topk_idx + (size_t)(valid ? t : 0) * topk;
    unsigned mask = 0;
    for (int k0 = 0; k0 < topk; k0 += 8) {
      long long ids[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) ids[u] = (valid && k0 + u < topk) ? (long long)row[k0 + u] : -1;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        long long e = ids[u];
        if (e < 0 || e >= num_experts) e = -1;
#pragma unroll
        for (int v = 0; v < u; ++v) e = (ids[v] == e) ? -1 : e;
        for (int j = 0; j < k0 && e >= 0; ++j) e = (row[j] == e) ? -1 : e;
        if (e >= 0) mask |= 1u << (int)(e / E);
        const unsigned same = __match_any_sync(0xffffffffu, (int)e);  // 32-bit match: ids < 2^31
        if (e >= 0 && lane == __ffs(same) - 1) atomicAdd(&expert_cnt[e], __popc(same));
      }
    }
    unsigned long long lo = 0, hi = 0;
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      lo |= (unsigned long long)((mask >> d) & 1u) << (16 * d);
      hi |= (unsigned long long)((mask >> (d + 4)) & 1u) << (16 * d);
    }
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
    const unsigned long long ex_lo = lo_in - lo + (warp ? warp_incl[warp - 1][0] : 0ull);
    const unsigned long long ex_hi = hi_in - hi + (warp ? warp_incl[warp - 1][1] : 0ull);
    if (valid) {
      int* slots = p.slot_map + (size_t)t * world;
      for (int d = 0; d < world; ++d) slots[d] = ((mask >> d) & 1u) ? running[d] + field16(ex_lo, ex_hi, d) : -1;
    }
    __syncthreads();
    if (tid < world) running[tid] += field16(warp_incl[nwarps - 1][0], warp_incl[nwarps - 1][1], tid);
    __syncthreads();
  }

  // ---- 2. publish my row to every rank ----
  const int stride = p.sig.notify_stride;
  if (warp < world) {
    const int d = warp;
    int* row = signal_ptr(p, d, p.sig.notify_off + p.rank * stride);
    for (int j = lane; j < world; j += 32) row[1 + j] = running[j];
    for (int e = lane; e < E; e += 32) row[1 + world + e] = expert_cnt[d * E + e];
    fence_acq_rel_sys();
    __syncwarp();
    if (lane == 0) st_release_sys(row, epoch);
  }

  // ---- 3. wait for every rank's row ----
  if (tid < world) {
    wait_flag(p, signal_ptr(p, p.rank, p.sig.notify_off + tid * stride), epoch, tid, kPhaseNotify);
  }
  __syncthreads();
  if (ld_volatile(p.dev_error)) return;

  // ---- 4. offsets and counts ----
  const int* rows = signal_ptr(p, p.rank, p.sig.notify_off);
  if (tid < world) {
    int b = 0;
    for (int s = 0; s < p.rank; ++s) b += ld_volatile(rows + s * stride + 1 + tid);
    p.base[tid] = b;
  }
  if (tid == 32) {
    long long n = 0;
    for (int s = 0; s < world; ++s) n += ld_volatile(rows + s * stride + 1 + p.rank);
    *p.num_recv = n;
  }
  for (int e = tid; e < E; e += blockDim.x) {
    long long c = 0;
    for (int s = 0; s < world; ++s) c += ld_volatile(rows + s * stride + 1 + world + e);
    p.expert_counts[e] = c;
  }
}

}  // namespace

int ep_launch_notify(EpContext* ctx, const int64_t* topk_idx, int num_tokens, int epoch, cudaStream_t stream) {
  const size_t smem = (size_t)ctx->p.world * ctx->p.experts_per_rank * sizeof(int);
  if (smem > 48 * 1024) {
    if (smem > (size_t)ctx->max_smem_optin) {
      ep_set_error("world * experts_per_rank = %zu experts exceeds the notify kernel's shared memory", smem / 4);
      return -1;
    }
    CUDA_CHECK(cudaFuncSetAttribute(notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  notify_kernel<<<1, kNotifyThreads, smem, stream>>>(ctx->p, topk_idx, num_tokens, epoch);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
