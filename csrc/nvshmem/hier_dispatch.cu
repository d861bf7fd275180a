// Hierarchical kernels, step 3 of a dispatch (send to the relays, forward over NVLink); hier_common.cuh has
// the design.
#include "hier_common.cuh"

namespace {

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

}  // namespace

extern "C" int eph_dispatch(void* vctx, const void* x, const void* scales, const void* topk_idx, const void* topk_w,
                            int num_tokens, int num_sms, int send_blocks, int chunk, long long epoch, void* stream) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return epn_fail("eph_dispatch: null context");
  HierParams& p = ctx->p;
  char msg[160];
  const CallArgs args{"eph_dispatch", num_tokens, p.max_tokens, p.N, num_sms, send_blocks, chunk, p.num_scales > 0,
                      scales != nullptr};
  if (check_call(args, &send_blocks, msg, sizeof(msg))) return epn_fail("%s", msg);
  p.chunk = chunk;
  auto s = static_cast<cudaStream_t>(stream);
  if (eph::launch_layout(p, static_cast<const int64_t*>(topk_idx), num_tokens, epoch, s) != 0) return -1;
  const DispatchIn in{static_cast<const uint8_t*>(x), static_cast<const float*>(scales),
                      static_cast<const int64_t*>(topk_idx), static_cast<const float*>(topk_w)};
  hier_dispatch_kernel<kCopyU><<<num_sms, kThreads, 0, s>>>(p, in, send_blocks, epoch);
  EPH_CUDA(cudaGetLastError());
  return 0;
}
