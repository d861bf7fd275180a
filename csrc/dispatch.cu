// Dispatch: after the notify kernel (layout.cu) has produced slot_map and base, num_sms blocks
// push every token row once to every rank that holds one of its experts, straight into that
// rank's recv buffers (row base[d] + slot_map[t][d]), then signal completion.
//
// One kernel, dispatch_lean_kernel, in the two forms measured to win (notes/KERNELS.md v6, v12d):
//   lean (EP_DISPATCH_LEAN): warp w of block b is global warp g = b * warps + w and copies tokens
//     g, g + G, g + 2G, ... (G = all warps of the grid): blocks never wait on each other.
//   lean_dyn (EP_DISPATCH_LEAN_DYN, default): lane 0 of each warp takes its next token from a counter,
//     one token ahead, so blocks on faster SMs take more tokens.
// Per token every lane issues its loads first (kU 16-byte vectors of the row, the slot_map row, topk ids,
// weights, the first 64 fp8 scales), then stores the same registers to every destination row and the
// metadata after it. 16 warps: kU = 8; 17..32 warps: kU = 4 (the same bytes in flight per SM).
//
// Completion (grid_release_and_wait in common.cuh): every thread fences at system scope; the
// last block to finish stores done[me] = epoch into every rank's signals with st.release.sys,
// then waits until done[s] == epoch for every source s in my signals, so the kernel ends only
// when every row addressed to this rank has landed.
#include "common.cuh"

namespace {

struct DispatchArgs {
  const uint8_t* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_w;
  int num_tokens;
};

template <int kU, bool kDyn>
__device__ __forceinline__ void lean_rows(const EpParams& p, const DispatchArgs& a, int first, int step, int lane) {
  const int world = p.world, topk = p.topk, ns = p.num_scales;
  const int my_base = lane < world ? p.base[lane] : 0;
  const int V = p.row_bytes >> 4;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  unsigned* work = p.counters + kCounterDispatchWork;
  int t = first;
  if (kDyn) {
    unsigned g = 0;
    if (lane == 0) g = atomicAdd(work, 1u);
    t = (int)__shfl_sync(0xffffffffu, g, 0);
  }
  for (; !aborted && t < a.num_tokens;) {
    unsigned next = 0;
    if (kDyn && lane == 0) next = atomicAdd(work, 1u);
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = u * 32 + lane;
      if (i < V) buf[u] = ld_nc_v4(src + i);
    }
    const int slot = lane < world ? p.slot_map[(size_t)t * world + lane] : -1;
    long long idx = 0;
    float w = 0.f, sc0 = 0.f, sc1 = 0.f;
    if (lane < topk) {
      idx = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const float* scales = a.x_scales + (size_t)t * ns;
    if (lane < ns) sc0 = scales[lane];
    if (lane + 32 < ns) sc1 = scales[lane + 32];
    const int my_row = slot >= 0 ? my_base + slot : -1;
    int rows[EP_MAX_WORLD];
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) rows[d] = __shfl_sync(0xffffffffu, my_row, d);
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      if (v0 > 0) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[u] = ld_nc_v4(src + i);
        }
      }
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (rows[d] < 0) continue;
        int4* dst = reinterpret_cast<int4*>(p.peer_base[d] + p.off_recv_x + (size_t)rows[d] * p.row_bytes);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) st_v4(dst + i, buf[u]);
        }
      }
    }
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) {
      if (rows[d] < 0) continue;
      uint8_t* pb = p.peer_base[d];
      if (lane < topk) {
        reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)rows[d] * topk + lane] = idx;
        reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)rows[d] * topk + lane] = w;
      }
      float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)rows[d] * ns;
      if (lane < ns) dst_scales[lane] = sc0;
      if (lane + 32 < ns) dst_scales[lane + 32] = sc1;
      for (int j = lane + 64; j < ns; j += 32) dst_scales[j] = scales[j];
    }
    t = kDyn ? (int)__shfl_sync(0xffffffffu, next, 0) : t + step;
  }
}

template <int kU, int kThreads, bool kDyn>
__global__ void __launch_bounds__(kThreads, 1) dispatch_lean_kernel(EpParams p, DispatchArgs a, int epoch) {
  griddep_wait();  // slot_map and base come from the notify kernel
  stamp_sm(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int total_warps = gridDim.x * nwarps;
  lean_rows<kU, kDyn>(p, a, blockIdx.x * nwarps + warp, total_warps, lane);
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch, kDyn ? kCounterDispatchWork : -1);
}

}  // namespace

extern "C" int ep_dispatch(void* vctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                           int num_tokens, int num_sms, int impl, int warps, int epoch, void* vstream) {
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
  if (impl != EP_DISPATCH_LEAN && impl != EP_DISPATCH_LEAN_DYN) {
    ep_set_error("dispatch impl %d unknown (EP_DISPATCH_LEAN %d, EP_DISPATCH_LEAN_DYN %d)", impl, EP_DISPATCH_LEAN,
                 EP_DISPATCH_LEAN_DYN);
    return -1;
  }
  if (num_sms < 1 || warps < 1 || warps > 32) {
    ep_set_error("num_sms must be >= 1 and warps 1..32 (got %d, %d)", num_sms, warps);
    return -1;
  }
  if (p.num_scales > 0 && x_scales == nullptr && num_tokens > 0) {
    ep_set_error("fp8 dispatch needs x_scales");
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  if (ep_launch_notify(ctx, (const int64_t*)topk_idx, num_tokens, num_sms, epoch, stream) != 0) return -1;

  DispatchArgs a;
  a.x = (const uint8_t*)x;
  a.x_scales = (const float*)x_scales;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  const bool dyn = impl == EP_DISPATCH_LEAN_DYN;
  auto kernel = warps <= 16 ? (dyn ? dispatch_lean_kernel<8, 512, true> : dispatch_lean_kernel<8, 512, false>)
                            : (dyn ? dispatch_lean_kernel<4, 1024, true> : dispatch_lean_kernel<4, 1024, false>);
  CUDA_CHECK(launch_dependent(kernel, num_sms, warps * 32, 0, stream, p, a, epoch));
  ep_effective& eff = ctx->effective;
  eff.dispatch_impl = impl;
  eff.dispatch_warps = warps;
  eff.dispatch_sms = num_sms;
  return 0;
}
