// Low-latency dispatch: one kernel, a send phase then a receive phase; no layout pass, no host
// synchronisation, the epoch read from device memory (CUDA-graph capturable). Layout and flags:
// ll_common.cuh; the placement contract: epbench/backends/base.py (ll_slots).
//
// Work unit = (global expert e, chunk c of 32 tokens), chunk-major so that neighbouring warps
// take different experts (and so different destinations). Warp g of the grid takes units
// g, g + G, ... (G = all warps). Every block first stages topk_idx as int32 in shared memory.
// For its unit a warp:
//   1. scans the staged ids of all chunks, one token per lane: a ballot per chunk says which
//      tokens picked e; `before` = such tokens in earlier chunks, `total` = in all chunks. So
//      token t's slot j among my tokens routed to e is computed here, by the source alone.
//   2. for each token of chunk c that picked e (lowest first), copies its row straight into
//      x[le, me * T_max + j] on the rank d owning e (16-byte loads, all in flight, then 16-byte
//      stores over NVLink), the fp8 scales, pair = t * topk + k (lane 0), and for combine the
//      token map entry tmap[me, t, k] = (epoch << 32) | slot (lane 1) and w[t, k] (lane 2).
//   3. fences at system scope; lane 0 counts the unit done in expert_done[e]. The last of e's
//      units resets that counter and stores dflags[le, me] = (epoch << 32) | (T << 16) | total
//      into rank d with st.release.sys: every row this rank sends to e (and its tmap entry) has
//      landed before the flag does.
// Receive phase: thread i < E of the grid waits (bounded, wait_epoch_u64) until every source's
// dflags[i, s] carries this epoch, then writes src_counts[i, s] and counts[i] (thread 0 also
// src_tokens[s], the source's token count, for combine). The kernel ends
// only when every row addressed to this rank's experts has landed.
// Last block of the grid stores the epoch back (ll_finish_launch) for the next launch.
//
// Buffer reuse is safe without another barrier: a source starts call n + 1 only after its
// combine n, which waited for every rank's combine pushes, which each rank sends only after its
// own dispatch n (and the caller's use of x) is done.
#include "ll_common.cuh"

namespace {

struct LlDispatchArgs {
  const uint8_t* x;         // [T, row_bytes]
  const float* x_scales;    // [T, ns] (fp8 only)
  const int64_t* topk_idx;  // [T, topk]
  const float* topk_w;      // [T, topk]
  int num_tokens;
};

constexpr int kU = 8;  // 16-byte vectors per lane in flight

__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int vectors, int lane) {
  for (int v0 = 0; v0 < vectors; v0 += 32 * kU) {
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < vectors) buf[u] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < vectors) st_v4(dst + i, buf[u]);
    }
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(EpParams p, LlParams lp, LlDispatchArgs a) {
  extern __shared__ int s_idx[];  // [T * topk] expert ids
  __shared__ int s_epoch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int T = a.num_tokens, topk = p.topk, world = p.world, E = lp.experts, NE = lp.num_experts;
  if (threadIdx.x == 0) s_epoch = ld_volatile(lp.epochs) + 1;
  for (int i = threadIdx.x; i < T * topk; i += blockDim.x) s_idx[i] = (int)a.topk_idx[i];
  __syncthreads();
  const int epoch = s_epoch;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int chunks = T > 0 ? (T + 31) / 32 : 1;  // one empty chunk still publishes "0 rows"
  const int units = NE * chunks;
  const int G = gridDim.x * nwarps;
  const int V = p.row_bytes >> 4, ns = p.num_scales;

  for (int u = blockIdx.x * nwarps + warp; !aborted && u < units; u += G) {
    const int c = u / NE, e = u - c * NE;
    int before = 0, total = 0, kk = -1;
    unsigned mine = 0;
    for (int cc = 0; cc < chunks; ++cc) {
      const int t = cc * 32 + lane;
      int hit = -1;
      if (t < T) {
        for (int k = 0; k < topk; ++k) hit = s_idx[t * topk + k] == e ? k : hit;
      }
      const unsigned m = __ballot_sync(0xffffffffu, hit >= 0);
      if (cc < c) before += __popc(m);
      if (cc == c) {
        mine = m;
        kk = hit;
      }
      total += __popc(m);
    }
    const int d = e / E, le = e - d * E;
    uint8_t* pb = p.peer_base[d];
    const size_t slot0 = (size_t)le * lp.capacity + (size_t)p.rank * lp.t_max + before;
    for (unsigned todo = mine; todo != 0; todo &= todo - 1) {
      const int b = __ffs(todo) - 1;
      const size_t slot = slot0 + __popc(mine & ((1u << b) - 1));
      const int t = c * 32 + b;
      const int k = __shfl_sync(0xffffffffu, kk, b);
      copy_row(reinterpret_cast<int4*>(pb + lp.off_x + slot * p.row_bytes),
               reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes), V, lane);
      if (ns) {
        float* dst = reinterpret_cast<float*>(pb + lp.off_scales) + slot * ns;
        const float* src = a.x_scales + (size_t)t * ns;
        for (int i = lane; i < ns; i += 32) dst[i] = src[i];
      }
      const size_t tk = ((size_t)p.rank * lp.t_max + t) * topk + k;
      if (lane == 0) reinterpret_cast<int*>(pb + lp.off_pair)[slot] = t * topk + k;
      if (lane == 1)
        reinterpret_cast<unsigned long long*>(pb + lp.off_tmap)[tk] =
            ((unsigned long long)(unsigned)epoch << 32) | (unsigned long long)slot;
      if (lane == 2) reinterpret_cast<float*>(pb + lp.off_tw)[tk] = a.topk_w[(size_t)t * topk + k];
    }
    fence_acq_rel_sys();
    __syncwarp();
    if (lane == 0) {
      const unsigned prev = atomicAdd(lp.expert_done + e, 1u);
      if (prev == (unsigned)chunks - 1) {
        atomicExch(lp.expert_done + e, 0u);
        fence_acq_rel_sys();
        unsigned long long* flag = reinterpret_cast<unsigned long long*>(pb + lp.off_dflags) + (size_t)le * world + p.rank;
        st_release_sys_u64(flag, ((unsigned long long)(unsigned)epoch << 32) | ((unsigned)T << 16) | (unsigned)total);
      }
    }
  }

  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < E && !aborted) {
    const unsigned long long* flags =
        reinterpret_cast<const unsigned long long*>(p.peer_base[p.rank] + lp.off_dflags) + (size_t)i * world;
    long long sum = 0;
    for (int s = 0; s < world; ++s) {
      const unsigned long long v = wait_epoch_u64(p, flags + s, epoch, s, kPhaseLlDispatch);
      const int n = (int)(v & 0xffffu);
      lp.src_counts[i * world + s] = n;
      if (i == 0) lp.src_tokens[s] = (int)((v >> 16) & 0xffffu);
      sum += n;
    }
    lp.counts[i] = sum;
  }
  ll_finish_launch(lp.counters + 0, lp.epochs + 0, epoch);
}

}  // namespace

extern "C" int ep_ll_dispatch(void* vctx, const void* x, const void* x_scales, const void* topk_idx,
                              const void* topk_w, int num_tokens, int num_sms, int warps, void* vstream) {
  LlContext* ctx = (LlContext*)vctx;
  if (ll_check_launch(ctx, num_tokens, num_sms, warps) != 0) return -1;
  const EpParams& p = ctx->ep->p;
  if (p.num_scales > 0 && x_scales == nullptr && num_tokens > 0) {
    ep_set_error("fp8 dispatch needs x_scales");
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->ep->device));
  LlDispatchArgs a;
  a.x = (const uint8_t*)x;
  a.x_scales = (const float*)x_scales;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  const size_t smem = (size_t)num_tokens * p.topk * sizeof(int);  // <= 48 KB, checked in ep_ll_create
  ll_dispatch_kernel<512><<<num_sms, warps * 32, smem, (cudaStream_t)vstream>>>(p, ctx->lp, a);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
