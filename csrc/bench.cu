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
// v7, the steps from the plain push (4) towards the dispatch data phase, one difference at a time
// (link_push_rows_kernel; local combine_in -> peers' recv_x, same bytes per peer as mode 4):
//   8 push-fan       one 4 KiB local load feeds the stores of that chunk to every peer (dispatch's fan-out)
//   9 push-row       a warp copies 4 consecutive chunks (a 16 KiB row) to one peer before its next unit
//  10 push-fan-row   16 KiB rows, each chunk loaded once and stored to every peer (dispatch minus metadata)
//  11 push-fan-row-meta  10 plus dispatch's per-row metadata stores (64 B ids + 32 B weights per peer)
//  12 reduce-local   no NVLink: rows of max_tokens x 16 KiB, each the fp32 sum of world local bf16 rows,
//                    written locally (the local pass a push-based combine would add); time only
// v9 (the spread dispatch and the own-rank rows; 16 KiB rows from one local segment, as in 10 / 11):
//  13 push-spread       (row, peer) pairs over warps: pair q -> row q / npeer, peer index (q % npeer + row / tpi)
//                       % npeer (tpi = rows per grid iteration): one load per store, peers balanced at every
//                       iteration, each row reloaded (L2) per peer (dispatch_spread_kernel's pattern)
//  14 push-spread-meta  13 plus the 64 B id + 32 B weight stores per row and peer (compare with 11)
//  15 push-fan-row-meta-self  11 plus dispatch's own-rank copy: each row also stored (with metadata) into
//                       my own recv_x (my rank's segment, which no peer writes); same NVLink bytes
//  16 push-spread-meta-self   14 with my own rank as one more destination in the rotation (the spread
//                       kernel with own rows, compare with 15)
// v11 (does the SM's bulk-copy unit move NVLink bytes faster per SM than register loads / stores?): lane 0
// of every warp streams units through its own TmaRing (common.cuh), global -> shared -> global; unit u of
// ring r goes to / comes from peer u % (world - 1) as in modes 4 / 5; `warps` = rings per block.
//  17 tma-pull      4 KiB units, peer combine_in -> my recv_x (the combine's direction), 8 stages, 4 ahead
//  18 tma-push      4 KiB units, my combine_in -> peer recv_x (the dispatch's direction)
//  19 tma-pull-16k  16 KiB units, 4 stages, 2 ahead
//  20 tma-push-16k
// v13: 22 store-local  mode 0 with my own rank as the destination (segment j of my recv_x): local stores only
//      23 copy-local   mode 4 likewise (local loads -> local stores): what an SM writes per second with no NVLink
// v13: 21 push-reduce  (see link_push_reduce_kernel) 3/4 of the warps push 16 KiB rows as mode 9, 1/4 run mode 12
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
  const bool self = mode >= 22;  // 22 / 23: modes 0 / 4 into my own recv_x (local stores only)
  const bool real = mode >= 4 && mode != 22;
  const int m = self ? 0 : mode & 3;
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
    const int peer = self ? p.rank : (p.rank + 1 + j) % p.world;
    const size_t off = (size_t)(c / npeer) * kChunkVec * 16;
    int4 lbuf[kBU], sbuf[kBU];
    if (pull) {
      const int4* src = reinterpret_cast<const int4*>(p.peer_base[peer] + p.off_combine_in + p.rank * seg_bytes + off);
#pragma unroll
      for (int u = 0; u < kBU; ++u) lbuf[u] = ld_nc_v4(src + u * 32 + lane);
    }
    if (push) {
      // self: segment j of my buffers (j < world - 1), else the peer's segment; the store goes to segment j /
      // my rank's segment of the destination's recv_x
      const size_t src_seg = (size_t)(self ? j : peer) * seg_bytes, dst_seg = (size_t)(self ? j : p.rank) * seg_bytes;
      const int4* lsrc = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in + src_seg + off);
#pragma unroll
      for (int u = 0; u < kBU; ++u)
        sbuf[u] = real ? ld_nc_v4(lsrc + u * 32 + lane) : make_int4((int)c, u, lane, j);
      int4* dst = reinterpret_cast<int4*>(p.peer_base[peer] + p.off_recv_x + dst_seg + off);
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
  if (acc == 0x9e3779b9u) p.counters[kCounterBenchSink] = acc;  // keeps the loads alive
}


// Modes 8-11: work unit = a row of kRowChunks chunks; with kFan the unit is stored to every peer
// (rows_per_peer units), else unit u goes to peer u % npeer (rows_per_peer * npeer units).
// The loop of modes 8-11 / 15 over units first, first + step, ... (also mode 21's pushing warps).
template <bool kFan, int kRowChunks, bool kMeta, bool kSelf = false>
__device__ __forceinline__ void push_rows(const EpParams& p, long long chunks_per_peer, size_t seg_bytes,
                                          long long first, long long step, int lane) {
  const int npeer = p.world - 1;
  const long long rows_per_peer = chunks_per_peer / kRowChunks;
  const long long n = kFan ? rows_per_peer : rows_per_peer * npeer;
  const size_t unit_bytes = (size_t)kRowChunks * kChunkVec * 16;
  for (long long c = first; c < n; c += step) {
    const long long r = kFan ? c : c / npeer;
    const int j0 = kFan ? 0 : (int)(c % npeer);
    // without fan-out each peer's rows come from their own segment (no L2 reuse across peers)
    const int4* lsrc = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in +
                                                     (kFan ? 0 : (size_t)j0 * seg_bytes) + r * unit_bytes);
#pragma unroll 1
    for (int k = 0; k < kRowChunks; ++k) {
      int4 buf[kBU];
#pragma unroll
      for (int u = 0; u < kBU; ++u) buf[u] = ld_nc_v4(lsrc + k * kChunkVec + u * 32 + lane);
      for (int j = j0; j < (kFan ? npeer + (kSelf ? 1 : 0) : j0 + 1); ++j) {
        const int peer = (p.rank + 1 + j) % p.world;  // j == npeer (kSelf): my own rank
        int4* dst = reinterpret_cast<int4*>(p.peer_base[peer] + p.off_recv_x + p.rank * seg_bytes + r * unit_bytes);
#pragma unroll
        for (int u = 0; u < kBU; ++u) st_v4(dst + k * kChunkVec + u * 32 + lane, buf[u]);
      }
    }
    if (kMeta) {
      for (int j = j0; j < (kFan ? npeer + (kSelf ? 1 : 0) : j0 + 1); ++j) {
        const int peer = (p.rank + 1 + j) % p.world;
        const size_t row = (size_t)p.rank * p.max_tokens + (size_t)(r % p.max_tokens);
        if (lane < p.topk) {
          reinterpret_cast<long long*>(p.peer_base[peer] + p.off_recv_idx)[row * p.topk + lane] = r + lane;
          reinterpret_cast<float*>(p.peer_base[peer] + p.off_recv_w)[row * p.topk + lane] = (float)lane;
        }
      }
    }
  }
}

template <int kThreads, bool kFan, int kRowChunks, bool kMeta, bool kSelf = false>
__global__ void __launch_bounds__(kThreads, 1) link_push_rows_kernel(EpParams p, long long chunks_per_peer,
                                                                 size_t seg_bytes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (p.world < 2) return;
  push_rows<kFan, kRowChunks, kMeta, kSelf>(p, chunks_per_peer, seg_bytes, (long long)blockIdx.x * nwarps + warp,
                                            (long long)gridDim.x * nwarps, lane);
}

// Modes 13, 14, 16: (row, destination) pairs spread over warps (see the header); kSelf adds my own rank as
// destination index npeer (a local copy into my segment of my recv_x).
template <int kThreads, bool kMeta, bool kSelf>
__global__ void __launch_bounds__(kThreads, 1) link_push_spread_kernel(EpParams p, long long chunks_per_peer,
                                                                   size_t seg_bytes) {
  constexpr int kRowChunks = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int npeer = p.world - 1;
  if (npeer < 1) return;
  const int ndest = npeer + (kSelf ? 1 : 0);
  const long long rows = chunks_per_peer / kRowChunks;
  const long long G = (long long)gridDim.x * nwarps;
  const long long tpi = G / ndest > 0 ? G / ndest : 1;
  const size_t unit_bytes = (size_t)kRowChunks * kChunkVec * 16;
  for (long long q = (long long)blockIdx.x * nwarps + warp; q < rows * ndest; q += G) {
    const long long r = q / ndest;
    const int k = (int)((q % ndest + r / tpi) % ndest);
    const int dest = (p.rank + 1 + k) % p.world;  // k == npeer (kSelf): my own rank
    const int4* lsrc = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in + r * unit_bytes);
    int4* dst = reinterpret_cast<int4*>(p.peer_base[dest] + p.off_recv_x + p.rank * seg_bytes + r * unit_bytes);
#pragma unroll 1
    for (int c = 0; c < kRowChunks; ++c) {
      int4 buf[kBU];
#pragma unroll
      for (int u = 0; u < kBU; ++u) buf[u] = ld_nc_v4(lsrc + c * kChunkVec + u * 32 + lane);
#pragma unroll
      for (int u = 0; u < kBU; ++u) st_v4(dst + c * kChunkVec + u * 32 + lane, buf[u]);
    }
    if (kMeta && lane < p.topk) {
      const size_t row = (size_t)p.rank * p.max_tokens + (size_t)(r % p.max_tokens);
      reinterpret_cast<long long*>(p.peer_base[dest] + p.off_recv_idx)[row * p.topk + lane] = r + lane;
      reinterpret_cast<float*>(p.peer_base[dest] + p.off_recv_w)[row * p.topk + lane] = (float)lane;
    }
  }
}

// Mode 12: out[r] = sum over h < world of in_h[r] (bf16 rows of 16 KiB, fp32 sums), all local; rows
// first, first + step, ... (also mode 21's reducing warps).
__device__ __forceinline__ void reduce_rows(const EpParams& p, long long rows, size_t seg_bytes, long long first,
                                            long long step, int lane) {
  constexpr int kU = 4;
  const int V = 1024;  // 16 KiB rows
  for (long long r = first; r < rows; r += step) {
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      int4 buf[4][kU];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        if (h >= p.world) continue;
        const int4* src = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in + h * seg_bytes +
                                                        r * 16384);
#pragma unroll
        for (int u = 0; u < kU; ++u) buf[h][u] = ld_nc_v4(src + v0 + u * 32 + lane);
      }
      float acc[kU][8];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.f;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        if (h >= p.world) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const uint32_t w4[4] = {(uint32_t)buf[h][u].x, (uint32_t)buf[h][u].y, (uint32_t)buf[h][u].z,
                                  (uint32_t)buf[h][u].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[u][2 * i] += __uint_as_float(w4[i] << 16);
            acc[u][2 * i + 1] += __uint_as_float(w4[i] & 0xffff0000u);
          }
        }
      }
      int4* dst = reinterpret_cast<int4*>(p.peer_base[p.rank] + p.off_recv_x + r * 16384);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        int4 o;
        o.x = (int)((__float_as_uint(acc[u][0]) >> 16) | (__float_as_uint(acc[u][1]) & 0xffff0000u));
        o.y = (int)((__float_as_uint(acc[u][2]) >> 16) | (__float_as_uint(acc[u][3]) & 0xffff0000u));
        o.z = (int)((__float_as_uint(acc[u][4]) >> 16) | (__float_as_uint(acc[u][5]) & 0xffff0000u));
        o.w = (int)((__float_as_uint(acc[u][6]) >> 16) | (__float_as_uint(acc[u][7]) & 0xffff0000u));
        st_v4(dst + v0 + u * 32 + lane, o);
      }
    }
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) reduce_local_kernel(EpParams p, long long rows, size_t seg_bytes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  reduce_rows(p, rows, seg_bytes, (long long)blockIdx.x * nwarps + warp, (long long)gridDim.x * nwarps, lane);
}

// Mode 21 (v13, would a push combine's local reduction hide behind its pushes?): the last nwarps / 4 warps of
// every block run mode 12's reduction (max_tokens rows) while the others push as mode 9 (16 KiB rows, each to
// one peer: the combine's holder -> source direction). Time = both done; compare with modes 9 and 12 alone.
template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) link_push_reduce_kernel(EpParams p, long long chunks_per_peer,
                                                                   size_t seg_bytes, long long rows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int nred = nwarps / 4, npush = nwarps - nred;
  if (p.world < 2) return;
  if (warp < npush)
    push_rows<false, 4, false>(p, chunks_per_peer, seg_bytes, (long long)blockIdx.x * npush + warp,
                               (long long)gridDim.x * npush, lane);
  else
    reduce_rows(p, rows, seg_bytes, (long long)blockIdx.x * nred + (warp - npush), (long long)gridDim.x * nred, lane);
}

// Modes 17-20: one TmaRing per warp (lane 0), units of kUnitBytes.
template <int kUnitBytes, int S, int L, bool kPull>
__global__ void __launch_bounds__(1024, 1) link_tma_kernel(EpParams p, long long units_per_peer, size_t seg_bytes) {
  extern __shared__ __align__(128) uint8_t tma_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int npeer = p.world - 1;
  if (npeer < 1 || lane != 0) return;
  TmaRing<S, L> ring;
  ring.init(tma_smem + (size_t)warp * (TmaRing<S, L>::kHeader + (size_t)S * kUnitBytes), kUnitBytes);
  const long long total = units_per_peer * npeer, step = (long long)gridDim.x * nwarps;
  for (long long u = (long long)blockIdx.x * nwarps + warp; u < total; u += step) {
    const int peer = (p.rank + 1 + (int)(u % npeer)) % p.world;
    const size_t off = (size_t)(u / npeer) * kUnitBytes;
    if (kPull) {
      ring.push(p.peer_base[peer] + p.off_combine_in + p.rank * seg_bytes + off,
                p.peer_base[p.rank] + p.off_recv_x + peer * seg_bytes + off, kUnitBytes);
    } else {
      ring.push(p.peer_base[p.rank] + p.off_combine_in + peer * seg_bytes + off,
                p.peer_base[peer] + p.off_recv_x + p.rank * seg_bytes + off, kUnitBytes);
    }
  }
  ring.drain();
}

template <int kUnitBytes, int S, int L, bool kPull>
int launch_link_tma(const EpContext* ctx, int blocks, int rings, long long bytes_per_peer, size_t seg,
                    cudaStream_t st) {
  const size_t smem = (size_t)rings * (TmaRing<S, L>::kHeader + (size_t)S * kUnitBytes);
  if (smem > (size_t)ctx->max_smem_optin || bytes_per_peer % kUnitBytes != 0) {
    ep_set_error("ep_bench_link: %d rings of %d x %d B need %zu B of shared memory (max %d)", rings, S, kUnitBytes,
                 smem, ctx->max_smem_optin);
    return -1;
  }
  CUDA_CHECK(cudaFuncSetAttribute(link_tma_kernel<kUnitBytes, S, L, kPull>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  link_tma_kernel<kUnitBytes, S, L, kPull><<<blocks, rings * 32, smem, st>>>(ctx->p, bytes_per_peer / kUnitBytes, seg);
  CUDA_CHECK(cudaGetLastError());
  return 0;
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
  if (mode < 0 || mode > 23 || num_blocks < 1 || warps < 1 || warps > 32 || ((mode == 2 || mode == 6) && (warps & 1)) || bytes_per_peer <= 0 ||
      bytes_per_peer % (kChunkVec * 16 * 2) != 0 || (size_t)bytes_per_peer > seg) {
    ep_set_error("ep_bench_link: bad mode %d, blocks %d, warps %d or bytes %lld (max %zu, multiple of %d)", mode,
                 num_blocks, warps, bytes_per_peer, seg, kChunkVec * 32);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  const long long chunks = bytes_per_peer / (kChunkVec * 16);
  cudaStream_t st = (cudaStream_t)vstream;
  if (mode == 17) return launch_link_tma<4096, 8, 4, true>(ctx, num_blocks, warps, bytes_per_peer, seg, st);
  if (mode == 18) return launch_link_tma<4096, 8, 4, false>(ctx, num_blocks, warps, bytes_per_peer, seg, st);
  if (mode == 19) return launch_link_tma<16384, 4, 2, true>(ctx, num_blocks, warps, bytes_per_peer, seg, st);
  if (mode == 20) return launch_link_tma<16384, 4, 2, false>(ctx, num_blocks, warps, bytes_per_peer, seg, st);
  if (mode >= 8 && mode <= 21) {
    if (warps > 16) {
      ep_set_error("ep_bench_link: modes 8-16 and 21 take at most 16 warps");
      return -1;
    }
    const int thr = warps * 32;
    if (mode == 8) link_push_rows_kernel<512, true, 1, false><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 9) link_push_rows_kernel<512, false, 4, false><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 10) link_push_rows_kernel<512, true, 4, false><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 11) link_push_rows_kernel<512, true, 4, true><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 13) link_push_spread_kernel<512, false, false><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 14) link_push_spread_kernel<512, true, false><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 15) link_push_rows_kernel<512, true, 4, true, true><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 16) link_push_spread_kernel<512, true, true><<<num_blocks, thr, 0, st>>>(p, chunks, seg);
    if (mode == 12 || mode == 21) {
      // rows of 16 KiB that fit every source segment: the h200x4 combine has max_tokens rows
      const long long rows = std::min<long long>(p.max_tokens, (long long)(seg / 16384));
      if (p.hidden * 2 != 16384 || p.world > 4 || (mode == 21 && warps < 4)) {
        ep_set_error("ep_bench_link: reduce-local / push-reduce need hidden 8192, world <= 4 (and >= 4 warps)");
        return -1;
      }
      if (mode == 12) reduce_local_kernel<512><<<num_blocks, thr, 0, st>>>(p, rows, seg);
      if (mode == 21) link_push_reduce_kernel<512><<<num_blocks, thr, 0, st>>>(p, chunks, seg, rows);
    }
    CUDA_CHECK(cudaGetLastError());
    return 0;
  }
  if (warps <= 16)  // 128 registers: both buffers of the interleaved modes fit
    link_bench_kernel<512><<<num_blocks, warps * 32, 0, (cudaStream_t)vstream>>>(p, mode, chunks, seg);
  else  // 64 registers: the interleaved modes spill, the split ones do not need both buffers
    link_bench_kernel<1024><<<num_blocks, warps * 32, 0, (cudaStream_t)vstream>>>(p, mode, chunks, seg);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
