// Low-latency combine: one kernel, a push phase then a reduce phase; the epoch read from device
// memory (CUDA-graph capturable). Layout and flags: ll_common.cuh; the formula:
// epbench/backends/base.py (one term per expert, fp32 accumulation).
//
// Push phase (expert side): the slots of y [E, C] are taken 32 at a time, one per lane: warp g
// of the grid takes slots 32g .. 32g + 31, then 32(g + G) ... (G = all warps). A lane's slot
// (le, s * T_max + j) is valid when j < src_counts[le, s] (from the matching dispatch); for each
// valid slot the warp copies the bf16 output row into crows[pair] of source rank s (pair = t * topk
// + k as received), with 16-byte loads then 16-byte stores over NVLink.
// Release: every thread fences at system scope; the last block of the grid (block counter 1)
// stores cflags[me] = epoch into every rank with st.release.sys.
// Reduce phase (source side): in every block, thread s < world waits (bounded, wait_flag) for
// cflags[s] == epoch in my region, so all rows for my tokens have landed; then warp g takes
// tokens g, g + G, ...: lane k < topk holds w[t, k] (0 for an id outside 0..num_experts), and
// each lane accumulates sum_k w_k * crows[t * topk + k] in fp32 over its 16-byte vectors, then
// stores bf16 into out[t].
// The reduce waits on a flag that the last block of this same grid releases: every block must be
// resident at once (num_sms <= SM count, one 512-thread block per SM; ll_check_launch).
// Last block of the grid stores the epoch back (ll_finish_launch, block counter 2).
//
// Reuse: a peer pushes into my crows for call n only after its dispatch n, which needed my
// dispatch n, which started after my combine n - 1 had finished reading crows.
#include <cuda_bf16.h>

#include "ll_common.cuh"

namespace {

struct LlCombineArgs {
  const int64_t* topk_idx;  // [T, topk] as given to the matching dispatch
  const float* topk_w;      // [T, topk]
  int num_tokens;
};

constexpr int kU = 8;  // vectors per lane in flight when pushing
constexpr int kR = 4;  // vectors per lane per row when reducing

__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int vectors, int lane) {
  for (int v0 = 0; v0 < vectors; v0 += 32 * kU) {
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < vectors) buf[u] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < vectors) st_v4(dst + i, buf[u]);
    }
  }
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v, float w) {
  const uint32_t words[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = fmaf(w, __uint_as_float(words[i] << 16), acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, __uint_as_float(words[i] & 0xffff0000u), acc[2 * i + 1]);
  }
}

__device__ __forceinline__ int4 to_bf16x8(const float (&acc)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    words[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_int4((int)words[0], (int)words[1], (int)words[2], (int)words[3]);
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(EpParams p, LlParams lp, LlCombineArgs a) {
  __shared__ int s_epoch;
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = lp.experts, C = lp.capacity, Tm = lp.t_max;
  if (threadIdx.x == 0) s_epoch = ld_volatile(lp.epochs + 1) + 1;
  __syncthreads();
  const int epoch = s_epoch;
  const int G = gridDim.x * nwarps;
  const size_t row = (size_t)p.hidden * 2;
  const int V = p.hidden >> 3;  // 16-byte vectors per bf16 row
  const int slots = E * C;
  const int* pairs = reinterpret_cast<const int*>(p.peer_base[p.rank] + lp.off_pair);

  bool aborted = ld_volatile(p.dev_error) != 0;
  for (int q0 = (blockIdx.x * nwarps + warp) * 32; !aborted && q0 < slots; q0 += G * 32) {
    const int q = q0 + lane;
    int src = 0, pair = 0;
    bool valid = false;
    if (q < slots) {
      const int le = q / C, rem = q - le * C;
      src = rem / Tm;
      valid = rem - src * Tm < lp.src_counts[le * world + src];
      if (valid) pair = pairs[q];
    }
    for (unsigned todo = __ballot_sync(0xffffffffu, valid); todo != 0; todo &= todo - 1) {
      const int b = __ffs(todo) - 1;
      const int s = __shfl_sync(0xffffffffu, src, b);
      const int pr = __shfl_sync(0xffffffffu, pair, b);
      copy_row(reinterpret_cast<int4*>(p.peer_base[s] + lp.off_crows + (size_t)pr * row),
               reinterpret_cast<const int4*>(reinterpret_cast<const uint8_t*>(lp.y) + (size_t)(q0 + b) * row), V,
               lane);
    }
  }

  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(lp.counters + 1, 1u) == gridDim.x - 1;
    if (is_last) atomicExch(lp.counters + 1, 0u);
  }
  __syncthreads();
  if (is_last && threadIdx.x < world) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<int*>(p.peer_base[threadIdx.x] + lp.off_cflags) + p.rank, epoch);
  }
  if (threadIdx.x < world) {
    wait_flag(p, reinterpret_cast<const int*>(p.peer_base[p.rank] + lp.off_cflags) + threadIdx.x, epoch,
              threadIdx.x, kPhaseLlCombine);
  }
  __syncthreads();

  aborted = ld_volatile(p.dev_error) != 0;
  const uint8_t* crows = p.peer_base[p.rank] + lp.off_crows;
  for (int t = blockIdx.x * nwarps + warp; !aborted && t < a.num_tokens; t += G) {
    float w = 0.f;
    bool ok = false;
    if (lane < topk) {
      const long long e = a.topk_idx[(size_t)t * topk + lane];
      ok = e >= 0 && e < lp.num_experts;
      w = ok ? a.topk_w[(size_t)t * topk + lane] : 0.f;
    }
    const unsigned used = __ballot_sync(0xffffffffu, ok);
    const int4* rows = reinterpret_cast<const int4*>(crows + (size_t)t * topk * row);
    int4* dst = reinterpret_cast<int4*>(lp.out + (size_t)t * p.hidden);
    for (int v0 = 0; v0 < V; v0 += 32 * kR) {
      float acc[kR][8];
#pragma unroll
      for (int u = 0; u < kR; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
      for (int k = 0; k < topk; ++k) {
        const float wk = __shfl_sync(0xffffffffu, w, k);
        if (!((used >> k) & 1u)) continue;  // warp-uniform
        int4 buf[kR];
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[u] = rows[(size_t)k * V + i];  // peers wrote these during this kernel: no .nc
        }
#pragma unroll
        for (int u = 0; u < kR; ++u) {
          if (v0 + u * 32 + lane < V) add_bf16x8(acc[u], buf[u], wk);
        }
      }
#pragma unroll
      for (int u = 0; u < kR; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) dst[i] = to_bf16x8(acc[u]);
      }
    }
  }
  ll_finish_launch(lp.counters + 2, lp.epochs + 1, epoch);
}

}  // namespace

extern "C" int ep_ll_combine(void* vctx, const void* topk_idx, const void* topk_w, int num_tokens, int num_sms,
                             int warps, void* vstream) {
  LlContext* ctx = (LlContext*)vctx;
  if (ll_check_launch(ctx, num_tokens, num_sms, warps) != 0) return -1;
  CUDA_CHECK(cudaSetDevice(ctx->ep->device));
  LlCombineArgs a;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  ll_combine_kernel<512><<<num_sms, warps * 32, 0, (cudaStream_t)vstream>>>(ctx->ep->p, ctx->lp, a);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
