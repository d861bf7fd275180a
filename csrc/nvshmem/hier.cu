// Hierarchical dispatch/combine for N nodes x G GPUs (issue #5): NVLink inside a node, NVSHMEM
// puts between nodes. Rank r = node n * G + local l. A token crosses the network at most once per
// destination node m != n, always to rank (m, l) (same rail: its "relay"), which forwards it over
// NVLink to the GPUs of node m that hold its experts. Combine is the mirror image: the relay sums
// the rows of one token from its node's GPUs (fp32, weighted) and puts one bf16 partial per
// (token, node) back to the source, which adds its partials (one extra bf16 rounding per remote
// node, as in DeepEP's and Hybrid-EP's internode combines). Receiver contract: as the intranode
// kernels (epbench/backends/base.py): rows in (source rank, token) order, full topk ids/weights.
// API: api_nvshmem.h (eph_*). Buffers and their owners:
//
//   symmetric (nvshmem_malloc; peers write or read them)
//     recv_x/recv_scales/recv_idx/recv_w [W * T_max rows]   written by the relays of my node (NVLink)
//     combine_in  [W * T_max, H] bf16                        filled by the caller, pulled by my node's relays
//     msg_send    [N][T_max] messages                        my packed rows for node m (put source)
//     msg_recv    [N][T_max] messages                        rows of rank (n', l) for my node, by source node
//     part_send   [N][T_max, H] bf16                         partials for the source ranks of node n' (put source)
//     part_recv   [N][T_max, H] bf16                         partials of my tokens from node m
//     my_row      [row_ints] i32                             this call's counts (put source)
//     cnt_mat     [2][W][row_ints] i32                       every rank's counts, by epoch parity
//     cnt_sig [2][W], msg_sig [N][T_max], part_sig [N][T_max] u64   NVSHMEM signals (= epoch)
//     flags       [2][G] i32                                 done / ready flags of my node (NVLink stores)
//   local (cudaMalloc)
//     pos [T_max][W] i32      token t's row among my rows to rank d (-1: not sent)
//     jn  [T_max][N] i32      token t's index among my rows to node m (-1: not sent)
//     tok_of [N][T_max] i32   inverse of jn
//     off [W][G] i32          first row of source s in GPU (my node, g)'s receive buffer
//     to_node [N], from_node [N] i32   my rows to node m; rows that rank (n', l) sends my node
//
// A message (one row for one destination node): [x row | fp8 scales | topk ids i64 | weights f32 |
// pos on the G GPUs of that node i32], each part 16-byte aligned.
//
// Per dispatch (epoch e, all on the caller's stream, nothing on the host):
//   1. layout (W + N blocks): pos / jn / tok_of and my count row: rows per destination rank, rows
//      per destination node, rows per (destination rank, its local expert).
//   2. exchange (1 block): my row -> cnt_mat[e & 1][me] on every PE (put-with-signal), wait for every
//      PE's row of epoch e. This is also the barrier that makes every buffer safe to reuse: a rank
//      passes it only after every rank finished call e - 1 (dispatch and combine, stream order).
//      Then num_recv, expert_counts, off, from_node.
//   3. dispatch (num_sms blocks): blocks [0, S) send: per chunk of `chunk` rows for node m, a warp
//      packs the messages and puts them to relay (m, l) with one put-with-signal (signal = e).
//      Blocks [S, num_sms) forward: per chunk of rows for my node (from my own input for n' = n,
//      else from msg_recv once its signal says e), a warp stores each row into the receive buffer
//      of every GPU of my node that holds one of its experts (NVLink), at off[src][g] + pos[g]. The
//      last forwarding block stores done[l] = e into every GPU of my node and waits for done[*].
// Per combine (same epoch):
//   block 0 stores ready[l] = e into every GPU of my node; every block waits for ready[*].
//   Blocks [0, S): for each message of source node n' != n: sum over my node's GPUs g holding the
//   token of w(t, g) * combine_in_g[row] in fp32, bf16 into part_send; per chunk one put-with-signal
//   to the source rank. Blocks [S, num_sms): warp per own token: my node's rows (pulled over NVLink,
//   fp32) + the remote partials (wait for their chunk's signal), bf16 into out[t].
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>
#include <cstring>

#include "../common.cuh"
#include "api_nvshmem.h"
#include "epn_internal.h"

namespace {

constexpr int kMaxG = 8;       // GPUs per node
constexpr int kMaxNodes = 16;  // nodes
constexpr int kMaxTopk = 32;
constexpr int kThreads = 512;  // dispatch / combine blocks
constexpr int kWarps = kThreads / 32;
constexpr int kLayoutThreads = 512;
constexpr int kDone = 0, kReady = 1;  // flags[which * G + g]

enum HierPhase { kPhCounts = 11, kPhRows = 12, kPhDone = 13, kPhReady = 14, kPhPartials = 15 };

struct HierParams {
  int rank, world, G, N, node, local;
  int hidden, row_bytes, num_scales, topk, E, max_tokens, chunk;
  // Direct transport (peer reachable by NVLink load/store, as on virtual nodes or a multi-node
  // NVLink domain): the rail peer's msg_recv on node m / the source's part_recv on node n', written
  // in place with SM stores and then signalled (nvshmemx_signal_op), with no local staging copy and no
  // put. Null: pack locally and put-with-signal (the network path). EphConfig.transport picks.
  uint8_t* direct_msg_recv[kMaxNodes];
  __nv_bfloat16* direct_part_recv[kMaxNodes];
  int msg_bytes, msg_off_scales, msg_off_idx, msg_off_w, msg_off_pos;
  int row_ints;  // my_row / cnt_mat row: [W rank counts | N node counts | W * E expert counts]
  unsigned long long timeout_ns;
  uint8_t* recv_x;
  float* recv_scales;
  int64_t* recv_idx;
  float* recv_w;
  __nv_bfloat16* combine_in;
  uint8_t *msg_send, *msg_recv;
  __nv_bfloat16 *part_send, *part_recv;
  int *my_row, *cnt_mat, *flags;
  uint64_t *cnt_sig, *msg_sig, *part_sig;
  // the same symmetric buffers on GPU g of my node (NVLink pointers from nvshmem_ptr)
  uint8_t* peer_recv_x[kMaxG];
  float* peer_recv_scales[kMaxG];
  int64_t* peer_recv_idx[kMaxG];
  float* peer_recv_w[kMaxG];
  const __nv_bfloat16* peer_combine_in[kMaxG];
  int* peer_flags[kMaxG];
  int *pos, *jn, *tok_of, *off, *to_node, *from_node;
  long long *num_recv, *expert_counts;
  unsigned* counters;  // [0]: forwarding blocks done (dispatch)
  int* dev_error;
  EpErrorInfo* host_error;
};

struct HierContext {
  HierParams p;
  int device;
  EpErrorInfo* host_error;
  void* sym[16];  // every nvshmem_malloc, for eph_destroy
  int n_sym;
  void* loc[16];  // every cudaMalloc
  int n_loc;
  size_t cap_rows;
};

// ---- waits (bounded: a silent peer ends in a recorded (rank, peer, phase), never a hang) ----
__device__ __forceinline__ bool error_seen(const HierParams& p) { return ld_volatile(p.dev_error) != 0; }

// NVSHMEM signal >= epoch. nvshmem_uint64_test also runs NVSHMEM's consistency step for proxy
// (network) transports once the condition holds.
__device__ __noinline__ bool wait_signal(const HierParams& p, uint64_t* sig, long long epoch, int peer, int phase) {
  const unsigned long long t0 = globaltimer();
  while (!nvshmem_uint64_test(sig, NVSHMEM_CMP_GE, static_cast<uint64_t>(epoch))) {
    if (error_seen(p)) return false;
    if (globaltimer() - t0 > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return false;
    }
  }
  __threadfence();
  return true;
}

// An NVLink flag (st.release.sys by a GPU of my node) >= epoch.
__device__ __noinline__ bool wait_local_flag(const HierParams& p, const int* flag, int epoch, int peer, int phase) {
  const unsigned long long t0 = globaltimer();
  while (ld_acquire_sys(flag) - epoch < 0) {
    if (error_seen(p)) return false;
    if (globaltimer() - t0 > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return false;
    }
  }
  return true;
}

// Warp copy of `bytes` (a multiple of 16, 16-byte aligned) from src to each of the `n` dsts: kU
// 16-byte loads in flight per lane (kU = 8: a 16 KiB row is 4 rounds of 4 KiB per warp), then the
// stores. kCopyU = 8: 16 measured no faster (2026-11-21, notes/NVSHMEM.md).
constexpr int kCopyU = 8;
template <int kU>
__device__ __forceinline__ void warp_copy16_u(uint8_t* const* dst, int n, const uint8_t* src, int bytes, int lane,
                                              bool src_remote_written) {
  const int nv = bytes >> 4;
  const int4* s = reinterpret_cast<const int4*>(src);
  for (int v0 = lane; v0 < nv; v0 += 32 * kU) {
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32;
      if (i < nv) buf[u] = src_remote_written ? __ldcg(s + i) : ld_nc_v4(s + i);
    }
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g >= n) break;
      int4* d = reinterpret_cast<int4*>(dst[g]);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32;
        if (i < nv) st_v4(d + i, buf[u]);
      }
    }
  }
}

// ---- 1. layout ----
// Block b < W: destination rank b (pos[:, b], its row count and its per-expert counts); block W + m:
// destination node m (jn[:, m], tok_of[m], its row count). Token order is kept by a block-wide scan.
__global__ void __launch_bounds__(kLayoutThreads) hier_layout_kernel(HierParams p, const int64_t* idx, int T) {
  extern __shared__ int s_experts[];  // [E] (rank blocks)
  __shared__ int warp_hits[kLayoutThreads / 32];
  __shared__ int running;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int W = p.world, N = p.N, K = p.topk;
  const bool rank_block = blockIdx.x < W;
  const int target = rank_block ? blockIdx.x : blockIdx.x - W;
  const long long span = rank_block ? p.E : static_cast<long long>(p.E) * p.G;  // experts of the target
  const long long lo = target * span;
  if (rank_block)
    for (int e = tid; e < p.E; e += blockDim.x) s_experts[e] = 0;
  if (tid == 0) running = 0;
  __syncthreads();
  for (int base = 0; base < T; base += blockDim.x) {
    const int t = base + tid;
    bool hit = false;
    if (t < T) {
      for (int k = 0; k < K; ++k) {
        const long long e = idx[static_cast<size_t>(t) * K + k] - lo;
        if (e >= 0 && e < span) {
          hit = true;
          if (rank_block) atomicAdd(&s_experts[e], 1);
        }
      }
    }
    const unsigned m = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_hits[warp] = __popc(m);
    __syncthreads();
    int before = running;
    for (int w = 0; w < warp; ++w) before += warp_hits[w];
    const int j = before + __popc(m & ((1u << lane) - 1u));
    if (t < T) {
      if (rank_block) {
        p.pos[static_cast<size_t>(t) * W + target] = hit ? j : -1;
      } else {
        p.jn[static_cast<size_t>(t) * N + target] = hit ? j : -1;
        if (hit) p.tok_of[static_cast<size_t>(target) * p.max_tokens + j] = t;
      }
    }
    __syncthreads();
    if (tid == 0)
      for (int w = 0; w < (int)(blockDim.x >> 5); ++w) running += warp_hits[w];
    __syncthreads();
  }
  if (rank_block) {
    for (int e = tid; e < p.E; e += blockDim.x) p.my_row[W + N + target * p.E + e] = s_experts[e];
    if (tid == 0) p.my_row[target] = running;
  } else if (tid == 0) {
    p.my_row[W + target] = running;
    p.to_node[target] = running;
  }
}

// ---- 2. count exchange (also the per-call barrier, see the top of the file) ----
__global__ void __launch_bounds__(1024) hier_exchange_kernel(HierParams p, long long epoch) {
  const int tid = threadIdx.x, W = p.world, N = p.N, G = p.G, ri = p.row_ints;
  const int par = static_cast<int>(epoch & 1);
  if (tid < W) {
    const int pe = (p.rank + tid) % W;  // staggered
    nvshmem_putmem_signal_nbi(p.cnt_mat + (static_cast<size_t>(par) * W + p.rank) * ri, p.my_row, ri * sizeof(int),
                              p.cnt_sig + par * W + p.rank, static_cast<uint64_t>(epoch), NVSHMEM_SIGNAL_SET, pe);
    nvshmem_quiet();
    wait_signal(p, p.cnt_sig + par * W + pe, epoch, pe, kPhCounts);
  }
  __syncthreads();
  if (error_seen(p)) return;
  const int* mat = p.cnt_mat + static_cast<size_t>(par) * W * ri;
  if (tid == 0) {
    long long n = 0;
    for (int s = 0; s < W; ++s) n += __ldcg(mat + s * ri + p.rank);
    *p.num_recv = n;
  }
  for (int e = tid; e < p.E; e += blockDim.x) {
    long long c = 0;
    for (int s = 0; s < W; ++s) c += __ldcg(mat + s * ri + W + N + p.rank * p.E + e);
    p.expert_counts[e] = c;
  }
  if (tid < G) {
    const int d = p.node * G + tid;
    int acc = 0;
    for (int s = 0; s < W; ++s) {
      p.off[s * G + tid] = acc;
      acc += __ldcg(mat + s * ri + d);
    }
  }
  if (tid < N) p.from_node[tid] = __ldcg(mat + (tid * G + p.local) * ri + W + p.node);
}

// ---- 3. dispatch ----
struct DispatchIn {
  const uint8_t* x;
  const float* scales;
  const int64_t* idx;
  const float* w;
};

// Lanes copy `n` 4-byte words (small parts of a row: scales, ids, weights, positions).
__device__ __forceinline__ void warp_copy4(uint32_t* dst, const uint32_t* src, int n, int lane) {
  for (int i = lane; i < n; i += 32) dst[i] = src[i];
}

// The warp's stores into a peer (direct transport) are made visible, then `sig` on `pe` := epoch.
__device__ __forceinline__ void signal_after_warp_stores(uint64_t* sig, long long epoch, int pe, int lane) {
  __threadfence_system();  // every lane: its own stores first
  __syncwarp();
  if (lane == 0) nvshmemx_signal_op(sig, static_cast<uint64_t>(epoch), NVSHMEM_SIGNAL_SET, pe);
  __syncwarp();
}

template <int kU>
__device__ void send_rows(const HierParams& p, const DispatchIn& in, int send_blocks, long long epoch) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = send_blocks * kWarps;
  const int C = p.chunk, T_max = p.max_tokens, K = p.topk, G = p.G;
  for (int k = 1; k < p.N; ++k) {
    const int m = (p.node + k) % p.N;
    const int rows = p.to_node[m], nch = (rows + C - 1) / C;
    uint8_t* direct = p.direct_msg_recv[m];
    for (int c = gw; c < nch; c += nw) {
      const int j0 = c * C, j1 = min(rows, j0 + C);
      for (int j = j0; j < j1; ++j) {
        const int t = p.tok_of[static_cast<size_t>(m) * T_max + j];
        uint8_t* msg = direct ? direct + (static_cast<size_t>(p.node) * T_max + j) * p.msg_bytes
                              : p.msg_send + (static_cast<size_t>(m) * T_max + j) * p.msg_bytes;
        uint8_t* dst[kMaxG] = {msg};
        warp_copy16_u<kU>(dst, 1, in.x + static_cast<size_t>(t) * p.row_bytes, p.row_bytes, lane, false);
        if (p.num_scales)
          warp_copy4(reinterpret_cast<uint32_t*>(msg + p.msg_off_scales),
                     reinterpret_cast<const uint32_t*>(in.scales + static_cast<size_t>(t) * p.num_scales),
                     p.num_scales, lane);
        warp_copy4(reinterpret_cast<uint32_t*>(msg + p.msg_off_idx),
                   reinterpret_cast<const uint32_t*>(in.idx + static_cast<size_t>(t) * K), 2 * K, lane);
        warp_copy4(reinterpret_cast<uint32_t*>(msg + p.msg_off_w),
                   reinterpret_cast<const uint32_t*>(in.w + static_cast<size_t>(t) * K), K, lane);
        warp_copy4(reinterpret_cast<uint32_t*>(msg + p.msg_off_pos),
                   reinterpret_cast<const uint32_t*>(p.pos + static_cast<size_t>(t) * p.world + m * G), G, lane);
      }
      if (direct) {
        signal_after_warp_stores(p.msg_sig + static_cast<size_t>(p.node) * T_max + c, epoch, m * G + p.local, lane);
        continue;
      }
      __syncwarp();
      __threadfence();  // the packed bytes are visible to whatever engine reads them for the put
      const size_t first = static_cast<size_t>(j0) * p.msg_bytes;
      nvshmemx_putmem_signal_nbi_warp(p.msg_recv + static_cast<size_t>(p.node) * T_max * p.msg_bytes + first,
                                      p.msg_send + static_cast<size_t>(m) * T_max * p.msg_bytes + first,
                                      static_cast<size_t>(j1 - j0) * p.msg_bytes,
                                      p.msg_sig + static_cast<size_t>(p.node) * T_max + c,
                                      static_cast<uint64_t>(epoch), NVSHMEM_SIGNAL_SET, m * G + p.local);
    }
  }
  __syncwarp();
  if (lane == 0) nvshmem_quiet();  // msg_send may be rewritten by the next call
}

template <int kU>
__device__ void forward_rows(const HierParams& p, const DispatchIn& in, int fwd_block, int fwd_blocks,
                             long long epoch) {
  const int lane = threadIdx.x & 31;
  const int gw = fwd_block * kWarps + (threadIdx.x >> 5), nw = fwd_blocks * kWarps;
  const int C = p.chunk, T_max = p.max_tokens, K = p.topk, G = p.G, W = p.world;
  for (int k = 0; k < p.N; ++k) {
    const int n2 = (p.node + k) % p.N;  // my own rows first: they need no signal
    const bool own = n2 == p.node;
    const int src = n2 * G + p.local;
    const int rows = p.from_node[n2], nch = (rows + C - 1) / C;
    for (int c = gw; c < nch; c += nw) {
      if (!own) {
        int ok = 1;
        if (lane == 0)
          ok = wait_signal(p, p.msg_sig + static_cast<size_t>(n2) * T_max + c, epoch, src, kPhRows);
        if (!__shfl_sync(0xffffffffu, ok, 0)) return;
      }
      const int j1 = min(rows, (c + 1) * C);
      for (int j = c * C; j < j1; ++j) {
        const uint8_t* row;
        const uint32_t *sc, *ids, *wts;
        const int* pos;
        if (own) {
          const size_t t = p.tok_of[static_cast<size_t>(p.node) * T_max + j];
          row = in.x + t * p.row_bytes;
          sc = reinterpret_cast<const uint32_t*>(in.scales + t * p.num_scales);
          ids = reinterpret_cast<const uint32_t*>(in.idx + t * K);
          wts = reinterpret_cast<const uint32_t*>(in.w + t * K);
          pos = p.pos + t * W + p.node * G;
        } else {
          const uint8_t* msg = p.msg_recv + (static_cast<size_t>(n2) * T_max + j) * p.msg_bytes;
          row = msg;
          sc = reinterpret_cast<const uint32_t*>(msg + p.msg_off_scales);
          ids = reinterpret_cast<const uint32_t*>(msg + p.msg_off_idx);
          wts = reinterpret_cast<const uint32_t*>(msg + p.msg_off_w);
          pos = reinterpret_cast<const int*>(msg + p.msg_off_pos);
        }
        const int my_pos = lane < G ? (own ? pos[lane] : __ldcg(pos + lane)) : -1;
        const unsigned gmask = __ballot_sync(0xffffffffu, my_pos >= 0);
        const int my_row = my_pos >= 0 ? p.off[src * G + lane] + my_pos : 0;
        uint8_t* dst[kMaxG];
        int rows_at[kMaxG];
        int n = 0;
#pragma unroll
        for (int g = 0; g < kMaxG; ++g) {
          const int r = __shfl_sync(0xffffffffu, my_row, g);
          if (g < G && ((gmask >> g) & 1u)) {
            rows_at[n] = r;
            dst[n++] = p.peer_recv_x[g] + static_cast<size_t>(r) * p.row_bytes;
          }
        }
        warp_copy16_u<kU>(dst, n, row, p.row_bytes, lane, !own);
        // scales, ids, weights: lanes over (destination, word)
        int gi = 0;
        for (int g = 0; g < G; ++g) {
          if (!((gmask >> g) & 1u)) continue;
          const size_t r = rows_at[gi++];
          for (int i = lane; i < p.num_scales; i += 32)
            reinterpret_cast<uint32_t*>(p.peer_recv_scales[g] + r * p.num_scales)[i] = own ? sc[i] : __ldcg(sc + i);
          for (int i = lane; i < 2 * K; i += 32)
            reinterpret_cast<uint32_t*>(p.peer_recv_idx[g] + r * K)[i] = own ? ids[i] : __ldcg(ids + i);
          for (int i = lane; i < K; i += 32)
            reinterpret_cast<uint32_t*>(p.peer_recv_w[g] + r * K)[i] = own ? wts[i] : __ldcg(wts + i);
        }
      }
    }
  }
}

template <int kU>
__global__ void __launch_bounds__(kThreads, 1) hier_dispatch_kernel(HierParams p, DispatchIn in, int send_blocks,
                                                                    long long epoch) {
  if (static_cast<int>(blockIdx.x) < send_blocks) {
    send_rows<kU>(p, in, send_blocks, epoch);
    return;
  }
  const int fwd_block = blockIdx.x - send_blocks, fwd_blocks = gridDim.x - send_blocks;
  forward_rows<kU>(p, in, fwd_block, fwd_blocks, epoch);
  // The last forwarding block tells every GPU of my node that my rows are in, then waits for theirs.
  __shared__ int is_last;
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(p.counters, 1u);
    is_last = prev == static_cast<unsigned>(fwd_blocks - 1);
    if (is_last) atomicExch(p.counters, 0u);
  }
  __syncthreads();
  if (!is_last) return;
  fence_acq_rel_sys();
  const int g = threadIdx.x;
  if (g < p.G) {
    st_release_sys(p.peer_flags[g] + kDone * p.G + p.local, static_cast<int>(epoch));
    wait_local_flag(p, p.flags + kDone * p.G + g, static_cast<int>(epoch), p.node * p.G + g, kPhDone);
  }
}

// ---- 4. combine ----
// w(t, g): the sum of the token's topk weights whose experts live on GPU g of node `node`.
__device__ __forceinline__ float weight_on(const HierParams& p, const uint32_t* ids, const uint32_t* wts, int d,
                                           bool remote_written) {
  float s = 0.f;
  for (int k = 0; k < p.topk; ++k) {
    const long long e = remote_written ? __ldcg(reinterpret_cast<const long long*>(ids) + k)
                                       : reinterpret_cast<const long long*>(ids)[k];
    if (e >= 0 && e / p.E == d)
      s += __uint_as_float(remote_written ? __ldcg(wts + k) : wts[k]);
  }
  return s;
}

// The rows one output row is summed from: up to G rows of my node's GPUs (weight w(t, g)) and up to
// N - 1 bf16 partials from other nodes (weight 1). Built per warp in shared memory.
constexpr int kMaxSrc = kMaxG + kMaxNodes;
struct SrcList {
  const int4* ptr[kMaxSrc];
  float w[kMaxSrc];
};

// Lanes with `mine` set add (ptr, w) to the warp's list after the `base` entries already there;
// returns the new count (all lanes).
__device__ __forceinline__ int add_sources(SrcList& list, int base, bool mine, const void* ptr, float w, int lane) {
  const unsigned m = __ballot_sync(0xffffffffu, mine);
  if (mine) {
    const int at = base + __popc(m & ((1u << lane) - 1u));
    list.ptr[at] = static_cast<const int4*>(ptr);
    list.w[at] = w;
  }
  __syncwarp();
  return base + __popc(m);
}

// dst (bf16 row) = sum over the list of w * row, fp32: kRedU vectors per lane and two rows at a time,
// so 2 x kRedU 16-byte loads are in flight per lane.
constexpr int kRedU = 4;
__device__ __forceinline__ void reduce_row(const HierParams& p, int4* dst, const SrcList& list, int ns, int lane) {
  const int V = p.hidden >> 3;
  for (int v0 = lane; v0 < V; v0 += 32 * kRedU) {
    float acc[kRedU][8];
#pragma unroll
    for (int u = 0; u < kRedU; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
    for (int s0 = 0; s0 < ns; s0 += 2) {
      int4 b[2][kRedU];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int u = 0; u < kRedU; ++u)
          if (s0 + a < ns && v0 + u * 32 < V) b[a][u] = __ldcg(list.ptr[s0 + a] + v0 + u * 32);
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int u = 0; u < kRedU; ++u)
          if (s0 + a < ns && v0 + u * 32 < V) fma_bf16x8(acc[u], b[a][u], list.w[s0 + a]);
    }
#pragma unroll
    for (int u = 0; u < kRedU; ++u)
      if (v0 + u * 32 < V) st_v4(dst + v0 + u * 32, pack_bf16x8(acc[u]));
  }
}

__device__ void send_partials(const HierParams& p, int send_blocks, long long epoch) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = send_blocks * kWarps;
  const int C = p.chunk, T_max = p.max_tokens, G = p.G, H = p.hidden;
  __shared__ SrcList lists[kWarps];
  SrcList& list = lists[threadIdx.x >> 5];
  for (int k = 1; k < p.N; ++k) {
    const int n2 = (p.node + k) % p.N;
    const int src = n2 * G + p.local;
    const int rows = p.from_node[n2], nch = (rows + C - 1) / C;
    __nv_bfloat16* direct = p.direct_part_recv[n2];
    for (int c = gw; c < nch; c += nw) {
      const int j0 = c * C, j1 = min(rows, j0 + C);
      for (int j = j0; j < j1; ++j) {
        const uint8_t* msg = p.msg_recv + (static_cast<size_t>(n2) * T_max + j) * p.msg_bytes;
        const int my_pos = lane < G ? __ldcg(reinterpret_cast<const int*>(msg + p.msg_off_pos) + lane) : -1;
        const bool has = my_pos >= 0;
        const float my_w = has ? weight_on(p, reinterpret_cast<const uint32_t*>(msg + p.msg_off_idx),
                                           reinterpret_cast<const uint32_t*>(msg + p.msg_off_w), p.node * G + lane, true)
                               : 0.f;
        const void* row = has ? p.peer_combine_in[lane] + static_cast<size_t>(p.off[src * G + lane] + my_pos) * H
                              : nullptr;
        const int ns = add_sources(list, 0, has, row, my_w, lane);
        __nv_bfloat16* dst = direct ? direct + (static_cast<size_t>(p.node) * T_max + j) * H
                                    : p.part_send + (static_cast<size_t>(n2) * T_max + j) * H;
        reduce_row(p, reinterpret_cast<int4*>(dst), list, ns, lane);
        __syncwarp();
      }
      if (direct) {
        signal_after_warp_stores(p.part_sig + static_cast<size_t>(p.node) * T_max + c, epoch, src, lane);
        continue;
      }
      __syncwarp();
      __threadfence();
      const size_t first = static_cast<size_t>(j0) * H;
      nvshmemx_putmem_signal_nbi_warp(p.part_recv + static_cast<size_t>(p.node) * T_max * H + first,
                                      p.part_send + static_cast<size_t>(n2) * T_max * H + first,
                                      static_cast<size_t>(j1 - j0) * H * sizeof(__nv_bfloat16),
                                      p.part_sig + static_cast<size_t>(p.node) * T_max + c,
                                      static_cast<uint64_t>(epoch), NVSHMEM_SIGNAL_SET, src);
    }
  }
  __syncwarp();
  if (lane == 0) nvshmem_quiet();
}

__device__ void finish_tokens(const HierParams& p, __nv_bfloat16* out, const int64_t* idx, const float* w, int T,
                              int fin_block, int fin_blocks, long long epoch) {
  const int lane = threadIdx.x & 31;
  const int gw = fin_block * kWarps + (threadIdx.x >> 5), nw = fin_blocks * kWarps;
  const int G = p.G, N = p.N, T_max = p.max_tokens, H = p.hidden, K = p.topk;
  __shared__ SrcList lists[kWarps];
  SrcList& list = lists[threadIdx.x >> 5];
  for (int t = gw; t < T; t += nw) {
    const int* pos = p.pos + static_cast<size_t>(t) * p.world + p.node * G;
    const int my_pos = lane < G ? pos[lane] : -1;
    const bool has = my_pos >= 0;
    const float my_w = has ? weight_on(p, reinterpret_cast<const uint32_t*>(idx + static_cast<size_t>(t) * K),
                                       reinterpret_cast<const uint32_t*>(w + static_cast<size_t>(t) * K),
                                       p.node * G + lane, false)
                           : 0.f;
    const void* row = has ? p.peer_combine_in[lane] + static_cast<size_t>(p.off[p.rank * G + lane] + my_pos) * H
                          : nullptr;
    // remote partials: lane m waits for the chunk that holds token t's partial from node m
    const int jm = (lane < N && lane != p.node) ? p.jn[static_cast<size_t>(t) * N + lane] : -1;
    int ok = 1;
    if (jm >= 0)
      ok = wait_signal(p, p.part_sig + static_cast<size_t>(lane) * T_max + jm / p.chunk, epoch, lane * G + p.local,
                       kPhPartials);
    if (!__all_sync(0xffffffffu, ok)) return;
    int ns = add_sources(list, 0, has, row, my_w, lane);
    ns = add_sources(list, ns, jm >= 0, p.part_recv + (static_cast<size_t>(lane) * T_max + (jm < 0 ? 0 : jm)) * H,
                     1.f, lane);
    reduce_row(p, reinterpret_cast<int4*>(out + static_cast<size_t>(t) * H), list, ns, lane);
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads, 1) hier_combine_kernel(HierParams p, __nv_bfloat16* out,
                                                                   const int64_t* idx, const float* w, int T,
                                                                   int send_blocks, long long epoch) {
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid < p.G) {
    fence_acq_rel_sys();  // my caller's writes to combine_in (earlier kernels) before the flag
    st_release_sys(p.peer_flags[tid] + kReady * p.G + p.local, static_cast<int>(epoch));
  }
  if (tid < p.G) wait_local_flag(p, p.flags + kReady * p.G + tid, static_cast<int>(epoch), p.node * p.G + tid, kPhReady);
  __syncthreads();
  if (error_seen(p)) return;
  if (static_cast<int>(blockIdx.x) < send_blocks)
    send_partials(p, send_blocks, epoch);
  else
    finish_tokens(p, out, idx, w, T, blockIdx.x - send_blocks, gridDim.x - send_blocks, epoch);
}

// ---- host side ----
size_t align16(size_t n) { return (n + 15) & ~static_cast<size_t>(15); }

// The symmetric allocations, in order (the same on every PE): sizes from the config alone.
struct SymSizes {
  size_t recv_x, recv_scales, recv_idx, recv_w, combine_in, msg, part, my_row, cnt_mat, cnt_sig, chunk_sig, flags;
  size_t total() const {
    return recv_x + recv_scales + recv_idx + recv_w + combine_in + 2 * msg + 2 * part + my_row + cnt_mat + cnt_sig +
           2 * chunk_sig + flags;
  }
};

int message_layout(const EphConfig& c, HierParams& p) {
  const int N = c.world / c.gpus_per_node;
  p.row_bytes = c.fp8 ? c.hidden : 2 * c.hidden;
  p.num_scales = c.fp8 ? c.hidden / 128 : 0;
  p.msg_off_scales = static_cast<int>(align16(p.row_bytes));
  p.msg_off_idx = p.msg_off_scales + static_cast<int>(align16(4 * p.num_scales));
  p.msg_off_w = p.msg_off_idx + static_cast<int>(align16(8 * c.topk));
  p.msg_off_pos = p.msg_off_w + static_cast<int>(align16(4 * c.topk));
  p.msg_bytes = p.msg_off_pos + static_cast<int>(align16(4 * c.gpus_per_node));
  p.row_ints = c.world + N + c.world * c.experts_per_rank;
  return N;
}

SymSizes sym_sizes(const EphConfig& c) {
  HierParams p{};
  const int N = message_layout(c, p);
  const size_t T = c.max_tokens, cap = static_cast<size_t>(c.world) * T;
  SymSizes s{};
  // never 0 bytes (max_tokens 0): nvshmem_malloc(0) returns null, which would read as a full heap
  auto some = [](size_t n) { return align16(n > 16 ? n : 16); };
  s.recv_x = some(cap * p.row_bytes);
  s.recv_scales = some(cap * 4 * (p.num_scales ? p.num_scales : 1));
  s.recv_idx = some(cap * 8 * c.topk);
  s.recv_w = some(cap * 4 * c.topk);
  s.combine_in = some(cap * 2 * c.hidden);
  s.msg = N > 1 ? some(static_cast<size_t>(N) * T * p.msg_bytes) : 16;
  s.part = N > 1 ? some(static_cast<size_t>(N) * T * 2 * c.hidden) : 16;
  s.my_row = align16(4 * static_cast<size_t>(p.row_ints));
  s.cnt_mat = align16(2 * static_cast<size_t>(c.world) * p.row_ints * 4);
  s.cnt_sig = 2 * static_cast<size_t>(c.world) * 8;
  s.chunk_sig = static_cast<size_t>(N) * (T > 0 ? T : 1) * 8;  // room for chunk = 1
  s.flags = align16(2 * static_cast<size_t>(c.gpus_per_node) * 4);
  return s;
}

int check_config(const EphConfig* c) {
  if (c == nullptr) return epn_fail("eph: null config");
  if (c->gpus_per_node < 1 || c->gpus_per_node > kMaxG) return epn_fail("eph: %d GPUs per node (1..%d)", c->gpus_per_node, kMaxG);
  if (c->world < 1 || c->world % c->gpus_per_node) return epn_fail("eph: world %d is not nodes x %d", c->world, c->gpus_per_node);
  if (c->world / c->gpus_per_node > kMaxNodes) return epn_fail("eph: %d nodes (at most %d)", c->world / c->gpus_per_node, kMaxNodes);
  if (c->topk < 1 || c->topk > kMaxTopk) return epn_fail("eph: topk %d (1..%d)", c->topk, kMaxTopk);
  if (c->hidden < 8 || c->hidden % (c->fp8 ? 128 : 8)) return epn_fail("eph: hidden %d must be a multiple of %d", c->hidden, c->fp8 ? 128 : 8);
  if (c->max_tokens < 0 || c->experts_per_rank < 1) return epn_fail("eph: max_tokens %d, experts_per_rank %d", c->max_tokens, c->experts_per_rank);
  return 0;
}

void release(HierContext* ctx) {
  for (int i = ctx->n_sym - 1; i >= 0; --i) nvshmem_free(ctx->sym[i]);
  for (int i = 0; i < ctx->n_loc; ++i) cudaFree(ctx->loc[i]);
  if (ctx->host_error) cudaFreeHost(ctx->host_error);
  delete ctx;
}

}  // namespace

#define EPH_CUDA(call)                                                                   \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) return epn_fail("%s: %s", #call, cudaGetErrorString(err_)); \
  } while (0)

extern "C" long long eph_symmetric_bytes(const EphConfig* cfg) {
  if (check_config(cfg)) return -1;
  return static_cast<long long>(sym_sizes(*cfg).total());
}

extern "C" int eph_create(const EphConfig* cfg, void** out) {
  if (out == nullptr) return epn_fail("eph_create: null output");
  *out = nullptr;
  if (check_config(cfg)) return -1;
  if (cfg->transport < 0 || cfg->transport > 2) return epn_fail("eph_create: transport %d (0 auto, 1 put, 2 direct)", cfg->transport);
  if (epn_my_pe() != cfg->rank || epn_n_pes() != cfg->world)
    return epn_fail("eph_create: NVSHMEM is PE %d of %d, the config says rank %d of %d (call epn_init first)",
                    epn_my_pe(), epn_n_pes(), cfg->rank, cfg->world);
  const EphConfig& c = *cfg;
  auto* ctx = new HierContext{};
  HierParams& p = ctx->p;
  p.rank = c.rank;
  p.world = c.world;
  p.G = c.gpus_per_node;
  p.N = message_layout(c, p);
  p.node = c.rank / p.G;
  p.local = c.rank % p.G;
  p.hidden = c.hidden;
  p.topk = c.topk;
  p.E = c.experts_per_rank;
  p.max_tokens = c.max_tokens;
  p.chunk = 8;
  p.timeout_ns = static_cast<unsigned long long>((c.timeout_s > 0 ? c.timeout_s : 10.0) * 1e9);
  ctx->device = c.device;
  int rc = 0;
  auto fail_free = [&](int r) {
    release(ctx);
    return r;
  };
  if (cudaSetDevice(c.device) != cudaSuccess) return fail_free(epn_fail("eph_create: cudaSetDevice(%d) failed", c.device));

  const SymSizes s = sym_sizes(c);
  // nvshmem_malloc is collective: every PE makes the same calls in the same order.
  auto sym = [&](size_t bytes) -> void* {
    void* ptr = nvshmem_malloc(bytes);
    if (ptr != nullptr) {
      ctx->sym[ctx->n_sym++] = ptr;
      if (cudaMemset(ptr, 0, bytes) != cudaSuccess) rc = -1;
    } else {
      rc = -1;
    }
    return ptr;
  };
  p.recv_x = static_cast<uint8_t*>(sym(s.recv_x));
  p.recv_scales = static_cast<float*>(sym(s.recv_scales));
  p.recv_idx = static_cast<int64_t*>(sym(s.recv_idx));
  p.recv_w = static_cast<float*>(sym(s.recv_w));
  p.combine_in = static_cast<__nv_bfloat16*>(sym(s.combine_in));
  p.msg_send = static_cast<uint8_t*>(sym(s.msg));
  p.msg_recv = static_cast<uint8_t*>(sym(s.msg));
  p.part_send = static_cast<__nv_bfloat16*>(sym(s.part));
  p.part_recv = static_cast<__nv_bfloat16*>(sym(s.part));
  p.my_row = static_cast<int*>(sym(s.my_row));
  p.cnt_mat = static_cast<int*>(sym(s.cnt_mat));
  p.cnt_sig = static_cast<uint64_t*>(sym(s.cnt_sig));
  p.msg_sig = static_cast<uint64_t*>(sym(s.chunk_sig));
  p.part_sig = static_cast<uint64_t*>(sym(s.chunk_sig));
  p.flags = static_cast<int*>(sym(s.flags));
  if (rc)
    return fail_free(epn_fail("eph_create: nvshmem_malloc of %.2f GiB failed: raise NVSHMEM_SYMMETRIC_SIZE "
                              "(it must be set before NVSHMEM starts)", s.total() / 1073741824.0));
  for (int g = 0; g < p.G; ++g) {
    const int pe = p.node * p.G + g;
    p.peer_recv_x[g] = static_cast<uint8_t*>(nvshmem_ptr(p.recv_x, pe));
    p.peer_recv_scales[g] = static_cast<float*>(nvshmem_ptr(p.recv_scales, pe));
    p.peer_recv_idx[g] = static_cast<int64_t*>(nvshmem_ptr(p.recv_idx, pe));
    p.peer_recv_w[g] = static_cast<float*>(nvshmem_ptr(p.recv_w, pe));
    p.peer_combine_in[g] = static_cast<const __nv_bfloat16*>(nvshmem_ptr(p.combine_in, pe));
    p.peer_flags[g] = static_cast<int*>(nvshmem_ptr(p.flags, pe));
    if (!p.peer_recv_x[g] || !p.peer_recv_scales[g] || !p.peer_recv_idx[g] || !p.peer_recv_w[g] ||
        !p.peer_combine_in[g] || !p.peer_flags[g])
      return fail_free(epn_fail("eph_create: PE %d (node %d) cannot reach PE %d of its own node by NVLink "
                                "load/store (nvshmem_ptr is null)", p.rank, p.node, pe));
  }

  for (int m = 0; m < p.N; ++m) {  // rail peers on every node (my own never used)
    const int pe = m * p.G + p.local;
    const bool rows_direct = c.transport == 2 && m != p.node, partials_direct = c.transport != 1 && m != p.node;
    p.direct_msg_recv[m] = rows_direct ? static_cast<uint8_t*>(nvshmem_ptr(p.msg_recv, pe)) : nullptr;
    p.direct_part_recv[m] = partials_direct ? static_cast<__nv_bfloat16*>(nvshmem_ptr(p.part_recv, pe)) : nullptr;
  }

  const size_t T = c.max_tokens > 0 ? c.max_tokens : 1;
  auto loc = [&](size_t bytes) -> void* {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, bytes ? bytes : 16) != cudaSuccess) {
      rc = -1;
      return nullptr;
    }
    ctx->loc[ctx->n_loc++] = ptr;
    if (cudaMemset(ptr, 0, bytes ? bytes : 16) != cudaSuccess) rc = -1;
    return ptr;
  };
  p.pos = static_cast<int*>(loc(T * c.world * 4));
  p.jn = static_cast<int*>(loc(T * p.N * 4));
  p.tok_of = static_cast<int*>(loc(T * p.N * 4));
  p.off = static_cast<int*>(loc(static_cast<size_t>(c.world) * p.G * 4));
  p.to_node = static_cast<int*>(loc(p.N * 4));
  p.from_node = static_cast<int*>(loc(p.N * 4));
  p.num_recv = static_cast<long long*>(loc(8));
  p.expert_counts = static_cast<long long*>(loc(8 * static_cast<size_t>(p.E)));
  p.counters = static_cast<unsigned*>(loc(16));
  p.dev_error = static_cast<int*>(loc(16));
  if (rc) return fail_free(epn_fail("eph_create: cudaMalloc failed"));
  void* host = nullptr;
  if (cudaHostAlloc(&host, sizeof(EpErrorInfo), cudaHostAllocMapped) != cudaSuccess)
    return fail_free(epn_fail("eph_create: cudaHostAlloc failed"));
  memset(host, 0, sizeof(EpErrorInfo));
  ctx->host_error = static_cast<EpErrorInfo*>(host);
  void* alias = nullptr;
  if (cudaHostGetDevicePointer(&alias, host, 0) != cudaSuccess)
    return fail_free(epn_fail("eph_create: cudaHostGetDevicePointer failed"));
  p.host_error = static_cast<EpErrorInfo*>(alias);
  if (cudaFuncSetAttribute(hier_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * p.E) != cudaSuccess &&
      4 * p.E > 48 * 1024)
    return fail_free(epn_fail("eph_create: %d experts per rank need too much shared memory", p.E));
  if (cudaDeviceSynchronize() != cudaSuccess) return fail_free(epn_fail("eph_create: set-up failed"));
  nvshmem_barrier_all();  // nobody signals before every PE zeroed its signals
  ctx->cap_rows = static_cast<size_t>(c.world) * c.max_tokens;
  *out = ctx;
  return 0;
}

extern "C" int eph_region(void* vctx, int which, void** ptr, long long* bytes) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr || ptr == nullptr || bytes == nullptr) return epn_fail("eph_region: null argument");
  const HierParams& p = ctx->p;
  const size_t cap = ctx->cap_rows;
  switch (which) {
    case EPH_RECV_X: *ptr = p.recv_x; *bytes = cap * p.row_bytes; break;
    case EPH_RECV_SCALES: *ptr = p.recv_scales; *bytes = cap * 4 * p.num_scales; break;
    case EPH_RECV_IDX: *ptr = p.recv_idx; *bytes = cap * 8 * p.topk; break;
    case EPH_RECV_W: *ptr = p.recv_w; *bytes = cap * 4 * p.topk; break;
    case EPH_COMBINE_IN: *ptr = p.combine_in; *bytes = cap * 2 * p.hidden; break;
    case EPH_NUM_RECV: *ptr = p.num_recv; *bytes = 8; break;
    case EPH_EXPERT_COUNTS: *ptr = p.expert_counts; *bytes = 8 * static_cast<long long>(p.E); break;
    default: return epn_fail("eph_region: unknown region %d", which);
  }
  return 0;
}

extern "C" int eph_dispatch(void* vctx, const void* x, const void* scales, const void* topk_idx, const void* topk_w,
                            int num_tokens, int num_sms, int send_blocks, int chunk, long long epoch, void* stream) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return epn_fail("eph_dispatch: null context");
  HierParams& p = ctx->p;
  if (num_tokens < 0 || num_tokens > p.max_tokens)
    return epn_fail("eph_dispatch: %d tokens (0..%d)", num_tokens, p.max_tokens);
  if (chunk < 1 || chunk > 1024) return epn_fail("eph_dispatch: chunk %d (1..1024)", chunk);
  if (p.N > 1 && (send_blocks < 1 || send_blocks >= num_sms))
    return epn_fail("eph_dispatch: %d sending blocks of %d: need 1 .. num_sms - 1", send_blocks, num_sms);
  if (p.N == 1) send_blocks = 0;
  if (num_sms < 1 + send_blocks) return epn_fail("eph_dispatch: num_sms %d", num_sms);
  if (p.num_scales && scales == nullptr) return epn_fail("eph_dispatch: fp8 needs scales");
  p.chunk = chunk;
  auto s = static_cast<cudaStream_t>(stream);
  hier_layout_kernel<<<p.world + p.N, kLayoutThreads, 4 * p.E, s>>>(p, static_cast<const int64_t*>(topk_idx), num_tokens);
  EPH_CUDA(cudaGetLastError());
  hier_exchange_kernel<<<1, 1024, 0, s>>>(p, epoch);
  EPH_CUDA(cudaGetLastError());
  const DispatchIn in{static_cast<const uint8_t*>(x), static_cast<const float*>(scales),
                      static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w)};
  hier_dispatch_kernel<kCopyU><<<num_sms, kThreads, 0, s>>>(p, in, send_blocks, epoch);
  EPH_CUDA(cudaGetLastError());
  return 0;
}

extern "C" int eph_combine(void* vctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens,
                           int num_sms, int send_blocks, long long epoch, void* stream) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return epn_fail("eph_combine: null context");
  const HierParams& p = ctx->p;
  if (num_tokens < 0 || num_tokens > p.max_tokens)
    return epn_fail("eph_combine: %d tokens (0..%d)", num_tokens, p.max_tokens);
  if (p.N > 1 && (send_blocks < 1 || send_blocks >= num_sms))
    return epn_fail("eph_combine: %d sending blocks of %d: need 1 .. num_sms - 1", send_blocks, num_sms);
  if (p.N == 1) send_blocks = 0;
  if (num_sms < 1 + send_blocks) return epn_fail("eph_combine: num_sms %d", num_sms);
  hier_combine_kernel<<<num_sms, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, static_cast<__nv_bfloat16*>(out), static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w),
      num_tokens, send_blocks, epoch);
  EPH_CUDA(cudaGetLastError());
  return 0;
}

extern "C" void* eph_error_flag_ptr(void* vctx) {
  auto* ctx = static_cast<HierContext*>(vctx);
  return ctx ? (void*)&ctx->host_error->flag : nullptr;
}

extern "C" int eph_poll_error(void* vctx, int* rank, int* peer, int* phase) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr || !ctx->host_error->flag) return 0;
  *rank = ctx->host_error->rank;
  *peer = ctx->host_error->peer;
  *phase = ctx->host_error->phase;
  return 1;
}

extern "C" int eph_destroy(void* vctx) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return 0;
  cudaError_t err = cudaDeviceSynchronize();
  nvshmem_barrier_all();  // nobody frees while a peer may still put into it
  release(ctx);
  if (err != cudaSuccess) return epn_fail("eph_destroy: %s", cudaGetErrorString(err));
  return 0;
}
