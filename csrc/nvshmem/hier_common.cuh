// Hierarchical dispatch/combine for N nodes x G GPUs: NVLink inside a node, NVSHMEM
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
//
// Files, one per role as in csrc/: hier_common.cuh (this: parameters, bounded waits, copy helpers),
// hier_layout.cu (steps 1-2), hier_dispatch.cu (3), hier_combine.cu (combine), hier_buffers.cu (the
// symmetric and local buffers: create / region / poll / destroy), hier_args.h (the host checks of a
// dispatch's or combine's arguments, CUDA-free so that a CPU test compiles them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>
#include <cstring>

#include "../common.cuh"
#include "api_nvshmem.h"
#include "epn_internal.h"
#include "hier_args.h"

namespace eph {

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


// Launches the layout and count-exchange kernels of one dispatch (hier_layout.cu).
int launch_layout(const HierParams& p, const int64_t* topk_idx, int num_tokens, long long epoch, cudaStream_t s);
// Lets the layout kernel use `bytes` of dynamic shared memory (4 per expert of a rank).
cudaError_t allow_layout_smem(int bytes);

}  // namespace eph

#define EPH_CUDA(call)                                                                   \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) return epn_fail("%s: %s", #call, cudaGetErrorString(err_)); \
  } while (0)

namespace {  // device helpers: one copy per file that uses them
using namespace eph;

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

// The warp's stores into a peer (direct transport) are made visible, then `sig` on `pe` := epoch.
__device__ __forceinline__ void signal_after_warp_stores(uint64_t* sig, long long epoch, int pe, int lane) {
  __threadfence_system();  // every lane: its own stores first
  __syncwarp();
  if (lane == 0) nvshmemx_signal_op(sig, static_cast<uint64_t>(epoch), NVSHMEM_SIGNAL_SET, pe);
  __syncwarp();
}
}  // namespace
