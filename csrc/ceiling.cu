// Plain SM-store ceiling: the fastest that `num_blocks` SMs move a rank's all-to-all bytes into
// its peers' buffers with ordinary 16-byte stores (no layout, no flags, no verification). Used by
// epbench/ceiling.py so every result can show its percent of what SM-driven copies reach at the
// same SM count.
//
// Grid: num_blocks blocks (one per SM) x `threads` threads, the pattern of the link
// micro-benchmark's fastest mode (csrc/bench.cu, mode 4 `push`): the work unit is a 4 KiB chunk
// (32 lanes x kUnroll 16-byte vectors, all loads in flight before the stores), and consecutive
// units go to different destinations (unit u -> destination u % ndst, chunk u / ndst), so every
// link is busy all the time and each warp's stores spread over all peers. Tail bytes past the last
// full 16-byte vector are not copied (rows are multiples of 16 bytes for bf16; fp8 rows lose
// < 16 bytes per peer).
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kMaxDst = EP_MAX_WORLD;
constexpr int kUnroll = 8;
constexpr int kChunk = 32 * kUnroll;  // vectors per unit

struct StoreCeilingArgs {
  int4* dst[kMaxDst];
  long long vecs[kMaxDst];  // 16-byte vectors to write into dst[d]
  const int4* src;
  int ndst;
};

__global__ void store_ceiling_kernel(StoreCeilingArgs a, long long max_chunks) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const long long units = max_chunks * a.ndst;
  for (long long u = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < units; u += warps) {
    const int d = (int)(u % a.ndst);
    const long long base = (u / a.ndst) * kChunk, n = a.vecs[d];
    if (base >= n) continue;
    int4* dst = a.dst[d];
    int4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < n) v[k] = ld_nc_v4(a.src + i);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < n) st_v4(dst + i, v[k]);
    }
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
  long long max_chunks = 0;
  a.src = static_cast<const int4*>(src);
  a.ndst = ndst;
  for (int d = 0; d < ndst; ++d) {
    if (dst_ptrs[d] & 15) {
      ep_set_error("ep_store_ceiling: destination %d is not 16-byte aligned", d);
      return -1;
    }
    a.dst[d] = reinterpret_cast<int4*>(dst_ptrs[d]);
    a.vecs[d] = bytes[d] / 16;
    max_chunks = a.vecs[d] / kChunk + 1 > max_chunks ? a.vecs[d] / kChunk + 1 : max_chunks;
  }
  if (ndst == 0) return 0;
  store_ceiling_kernel<<<num_blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(a, max_chunks);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
