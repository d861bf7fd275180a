// Plain SM-store ceiling: the fastest that `num_blocks` SMs move a rank's all-to-all bytes into
// its peers' buffers with ordinary 16-byte stores (no layout, no flags, no verification). Used by
// epbench/ceiling.py so every result can show its percent of what SM-driven copies reach at the
// same SM count.
//
// Grid: num_blocks blocks (one per SM) x `threads` threads. Block b starts at destination
// b % ndst and walks the destinations round-robin, so all links are busy from the first store;
// within a destination the blocks stride over 16-byte vectors together, each thread keeping
// kUnroll loads in flight before it stores them. Tail bytes past the last full 16-byte vector
// are not copied (rows are multiples of 16 bytes for bf16; fp8 rows lose < 16 bytes per peer).
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kMaxDst = EP_MAX_WORLD;
constexpr int kUnroll = 4;

struct StoreCeilingArgs {
  int4* dst[kMaxDst];
  long long vecs[kMaxDst];  // 16-byte vectors to write into dst[d]
  const int4* src;
  int ndst;
};

__global__ void store_ceiling_kernel(StoreCeilingArgs a) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (int k = 0; k < a.ndst; ++k) {
    const int d = (blockIdx.x + k) % a.ndst;
    int4* dst = a.dst[d];
    const long long n = a.vecs[d];
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = ld_nc_v4(a.src + i + u * stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) st_v4(dst + i + u * stride, v[u]);
    }
    for (; i < n; i += stride) st_v4(dst + i, ld_nc_v4(a.src + i));
  }
}

}  // namespace

extern "C" int ep_store_ceiling(const unsigned long long* dst_ptrs, const long long* bytes, int ndst,
                                const void* src, int num_blocks, int threads, void* stream) {
  if (ndst < 0 || ndst > kMaxDst || num_blocks < 1 || threads < 32 || threads > 1024 ||
      ((uintptr_t)src & 15)) {
    ep_set_error("ep_store_ceiling: bad arguments (ndst %d, blocks %d, threads %d)", ndst, num_blocks,
                 threads);
    return -1;
  }
  StoreCeilingArgs a = {};
  a.src = static_cast<const int4*>(src);
  a.ndst = ndst;
  for (int d = 0; d < ndst; ++d) {
    if (dst_ptrs[d] & 15) {
      ep_set_error("ep_store_ceiling: destination %d is not 16-byte aligned", d);
      return -1;
    }
    a.dst[d] = reinterpret_cast<int4*>(dst_ptrs[d]);
    a.vecs[d] = bytes[d] / 16;
  }
  if (ndst == 0) return 0;
  store_ceiling_kernel<<<num_blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
