// Combine (pull): every rank reads its own tokens' rows back from the combine_in buffers of the
// ranks that received them, and reduces them in fp32 registers as they arrive; no staging
// buffer, no second pass, no weights on the wire (the source keeps its topk_weights).
//
// 1. Block 0, threads d < world: store ready[me] = epoch into rank d's signals
//    (st.release.sys): my caller has filled my combine_in, peers may pull from it.
// 2. Every block, threads s < world: wait until ready[s] == epoch in my signals.
// 3. Warp g of the grid takes tokens g, g + G, ... (G = all warps). For token t it reads the
//    rows of t on every rank (base[d] + slot_map[t][d], kept from the matching dispatch),
//    computes w(t, d) = sum of t's topk weights whose experts live on d (a warp reduction), then
//    streams the row in chunks of 32 * kU vectors: kMaxWorld * kU 16-byte loads in flight per
//    lane, fp32 fma, one bf16 16-byte store per vector into out[t].
// 4. grid_release_and_wait on pulled[]: the last block stores pulled[me] = epoch into every
//    rank and waits for every rank's pulled[] flag, so the call ends only when no peer still
//    reads my combine_in (the caller may overwrite it right after).
#include <cuda_bf16.h>

#include "common.cuh"

namespace {

struct CombineArgs {
  uint4* out;
  const int64_t* topk_idx;
  const float* topk_w;
  int num_tokens;
};

template <int kMaxWorld, int kU>
__global__ void __launch_bounds__(512, 1) combine_pull_kernel(EpParams p, CombineArgs a, int epoch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = p.experts_per_rank;

  if (blockIdx.x == 0 && threadIdx.x < world) {
    fence_acq_rel_sys();
    st_release_sys(signal_ptr(p, threadIdx.x, p.sig.ready_off + p.rank), epoch);
  }
  if (threadIdx.x < world) {
    wait_flag(p, signal_ptr(p, p.rank, p.sig.ready_off + threadIdx.x), epoch, threadIdx.x, kPhaseCombineReady);
  }
  __syncthreads();

  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int my_base = lane < world ? p.base[lane] : 0;
  const int V = p.hidden >> 3;  // 16-byte vectors per bf16 row
  const size_t row_bytes = (size_t)p.hidden * 2;
  const int total_warps = gridDim.x * nwarps;
  for (int t = blockIdx.x * nwarps + warp; !aborted && t < a.num_tokens; t += total_warps) {
    const int slot = lane < world ? p.slot_map[(size_t)t * world + lane] : -1;
    const int my_row = slot >= 0 ? my_base + slot : -1;
    long long e = -1;
    float w = 0.f;
    if (lane < topk) {
      e = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const int owner = (e >= 0 && e < (long long)world * E) ? (int)(e / E) : -1;
    int rows[kMaxWorld];
    float wd[kMaxWorld];
    const int4* src[kMaxWorld];
#pragma unroll
    for (int d = 0; d < kMaxWorld; ++d) {
      rows[d] = __shfl_sync(0xffffffffu, my_row, d);
      wd[d] = warp_sum(owner == d ? w : 0.f);
      src[d] = reinterpret_cast<const int4*>(p.peer_base[d < world ? d : 0] + p.off_combine_in +
                                             (size_t)(rows[d] >= 0 ? rows[d] : 0) * row_bytes);
    }
    uint4* dst = a.out + (size_t)t * V;
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      int4 buf[kMaxWorld][kU];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        if (rows[d] < 0) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[d][u] = ld_nc_v4(src[d] + i);
        }
      }
      float acc[kU][8];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.f;
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        if (rows[d] < 0) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) fma_bf16x8(acc[u], buf[d][u], wd[d]);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) {
          const int4 v = pack_bf16x8(acc[u]);
          dst[i] = make_uint4(v.x, v.y, v.z, v.w);
        }
      }
    }
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

template <int kMaxWorld, int kU>
int launch_combine(const EpParams& p, const CombineArgs& a, int num_sms, int warps, int epoch, cudaStream_t stream) {
  combine_pull_kernel<kMaxWorld, kU><<<num_sms, warps * 32, 0, stream>>>(p, a, epoch);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace

extern "C" int ep_combine(void* vctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens,
                          int num_sms, int warps, int epoch, void* vstream) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  cudaStream_t stream = (cudaStream_t)vstream;
  if (!ctx->peers_open) {
    ep_set_error("peers not opened: call ep_open_peers first");
    return -1;
  }
  if (num_tokens < 0 || num_tokens > p.max_tokens) {
    ep_set_error("num_tokens %d outside 0..max_tokens %d", num_tokens, p.max_tokens);
    return -1;
  }
  if (num_sms < 1 || warps < 1 || warps > 16) {
    ep_set_error("num_sms must be >= 1 and warps 1..16 (got %d, %d)", num_sms, warps);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  CombineArgs a;
  a.out = (uint4*)out;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  if (p.world <= 2) return launch_combine<2, 4>(p, a, num_sms, warps, epoch, stream);
  if (p.world <= 4) return launch_combine<4, 4>(p, a, num_sms, warps, epoch, stream);
  return launch_combine<8, 2>(p, a, num_sms, warps, epoch, stream);
}
