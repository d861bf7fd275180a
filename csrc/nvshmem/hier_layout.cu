// Hierarchical kernels, steps 1 and 2 of a dispatch (layout, count exchange); hier_common.cuh has the design.
#include "hier_common.cuh"

namespace {

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

}  // namespace

int eph::launch_layout(const HierParams& p, const int64_t* topk_idx, int num_tokens, long long epoch, cudaStream_t s) {
  hier_layout_kernel<<<p.world + p.N, kLayoutThreads, 4 * p.E, s>>>(p, topk_idx, num_tokens);
  EPH_CUDA(cudaGetLastError());
  hier_exchange_kernel<<<1, 1024, 0, s>>>(p, epoch);
  EPH_CUDA(cudaGetLastError());
  return 0;
}

cudaError_t eph::allow_layout_smem(int bytes) {
  return cudaFuncSetAttribute(hier_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}
