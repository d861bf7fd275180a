// NVLink micro-benchmark (a measuring aid, not used by dispatch/combine): how many bytes per
// second an SM moves over NVLink when it only stores into peers, only loads from peers, or does
// both at once. Every rank launches it at the same time (the caller aligns them with a
// collective); it moves 16-byte vectors between this rank's region and its world - 1 peers'.
//
// Work unit: a chunk of 32 * kU vectors (4 KiB) of one peer; chunk c goes to peer c % (world - 1).
// Bytes crossing NVLink per rank are the same in every mode: (world - 1) * bytes_per_peer, half
// stored and half loaded in the mixed modes. Since every rank does the same, a rank's egress
// (own stores + what peers load from it) equals those bytes over its kernel time.
//   0 store     every warp stores register data into peers (recv_x, my segment)
//   1 load      every warp loads from peers (combine_in), values folded into a checksum
//   2 split     even warps store (mode 0), odd warps load (mode 1), half the chunks each
//   3 interleave every warp, per chunk: issues its loads, then its stores, then consumes the loads
//   4 push      like 0 with the data loaded from local memory first (the dispatch pattern)
//   5 pull      like 1 with the loaded data stored to local memory (the combine pattern)
//   6 split-real  even warps mode 4, odd warps mode 5
//   7 interleave-real  every warp: remote loads + local loads, remote stores + local stores
#include <algorithm>

#include "common.cuh"

namespace {

constexpr int kBU = 8;
constexpr int kChunkVec = 32 * kBU;

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) link_bench_kernel(EpParams p, int mode, long long chunks_per_peer,
                                                             size_t seg_bytes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int npeer = p.world - 1;
  if (npeer < 1) return;
  const long long total = chunks_per_peer * npeer;
  const bool real = mode >= 4;
  const int m = mode & 3;
  bool push = true, pull = true;
  long long n = total, first = (long long)blockIdx.x * nwarps + warp, step = (long long)gridDim.x * nwarps;
  if (m == 0) pull = false;
  if (m == 1) push = false;
  if (m == 2) {  // split roles, half the chunks each
    push = (warp & 1) == 0;
    pull = !push;
    n = total / 2;
    first = (long long)blockIdx.x * (nwarps / 2) + warp / 2;
    step = (long long)gridDim.x * (nwarps / 2);
  }
  if (m == 3) n = total / 2;
  unsigned acc = 0;
  for (long long c = first; c < n; c += step) {
    const int j = (int)(c % npeer);
    const int peer = (p.rank + 1 + j) % p.world;
    const size_t off = (size_t)(c / npeer) * kChunkVec * 16;
    int4 lbuf[kBU], sbuf[kBU];
    if (pull) {
      const int4* src = reinterpret_cast<const int4*>(p.peer_base[peer] + p.off_combine_in + p.rank * seg_bytes + off);
#pragma unroll
      for (int u = 0; u < kBU; ++u) lbuf[u] = ld_nc_v4(src + u * 32 + lane);
    }
    if (push) {
      const int4* lsrc = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in + peer * seg_bytes + off);
#pragma unroll
      for (int u = 0; u < kBU; ++u)
        sbuf[u] = real ? ld_nc_v4(lsrc + u * 32 + lane) : make_int4((int)c, u, lane, j);
      int4* dst = reinterpret_cast<int4*>(p.peer_base[peer] + p.off_recv_x + p.rank * seg_bytes + off);
#pragma unroll
      for (int u = 0; u < kBU; ++u) st_v4(dst + u * 32 + lane, sbuf[u]);
    }
    if (pull) {
      if (real) {
        int4* ldst = reinterpret_cast<int4*>(p.peer_base[p.rank] + p.off_recv_x + peer * seg_bytes + off);
#pragma unroll
        for (int u = 0; u < kBU; ++u) st_v4(ldst + u * 32 + lane, lbuf[u]);
      } else {
#pragma unroll
        for (int u = 0; u < kBU; ++u) acc ^= (unsigned)(lbuf[u].x ^ lbuf[u].y ^ lbuf[u].z ^ lbuf[u].w);
      }
    }
  }
  if (acc == 0x9e3779b9u) p.counters[3] = acc;  // keeps the loads alive
}

}  // namespace

extern "C" int ep_bench_link(void* vctx, int mode, int num_blocks, int warps, long long bytes_per_peer,
                             void* vstream) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  if (!ctx->peers_open) {
    ep_set_error("peers not opened: call ep_open_peers first");
    return -1;
  }
  const size_t seg = std::min((size_t)p.max_tokens * p.row_bytes, (size_t)p.max_tokens * p.hidden * 2);
  if (mode < 0 || mode > 7 || num_blocks < 1 || warps < 2 || warps > 32 || (warps & 1) || bytes_per_peer <= 0 ||
      bytes_per_peer % (kChunkVec * 16 * 2) != 0 || (size_t)bytes_per_peer > seg) {
    ep_set_error("ep_bench_link: bad mode %d, blocks %d, warps %d or bytes %lld (max %zu, multiple of %d)", mode,
                 num_blocks, warps, bytes_per_peer, seg, kChunkVec * 32);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  const long long chunks = bytes_per_peer / (kChunkVec * 16);
  if (warps <= 16)  // 128 registers: both buffers of the interleaved modes fit
    link_bench_kernel<512><<<num_blocks, warps * 32, 0, (cudaStream_t)vstream>>>(p, mode, chunks, seg);
  else  // 64 registers: the interleaved modes spill, the split ones do not need both buffers
    link_bench_kernel<1024><<<num_blocks, warps * 32, 0, (cudaStream_t)vstream>>>(p, mode, chunks, seg);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
