// Hierarchical combine (partials per node, then the source's sum); hier_common.cuh has the design.
#include "hier_common.cuh"

namespace {

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

}  // namespace

extern "C" int eph_combine(void* vctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens,
                           int num_sms, int send_blocks, long long epoch, void* stream) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return epn_fail("eph_combine: null context");
  const HierParams& p = ctx->p;
  char msg[160];
  const CallArgs args{"eph_combine", num_tokens, p.max_tokens, p.N, num_sms, send_blocks, 1, false, false};
  if (check_call(args, &send_blocks, msg, sizeof(msg))) return epn_fail("%s", msg);
  hier_combine_kernel<<<num_sms, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, static_cast<__nv_bfloat16*>(out), static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w),
      num_tokens, send_blocks, epoch);
  EPH_CUDA(cudaGetLastError());
  return 0;
}
