// Low-latency dispatch (v2, staged): one kernel, a send phase then a receive phase; no layout
// pass, no host synchronisation, the epoch read from device memory (CUDA-graph capturable).
// Layout and flags: ll_common.cuh; the placement contract: epbench/backends/base.py (ll_slots).
//
// A token crosses NVLink once per destination rank (not once per expert): the receiver copies it
// into each of its experts' slots locally, which costs HBM bandwidth instead of NVLink bandwidth
// (DeepSeek-V3 on 4 ranks: ~2.7 remote rows per token instead of ~6).
// Send phase (every block first stages topk_idx as int32 in shared memory):
//   rows: unit (token t, destination index i), strided over all warps; destination
//      d = (me + 1 + i) % world, so neighbouring warps write to different ranks. If t has an
//      expert on d, the warp copies its row into stage[me, t] on d (16-byte loads, all in flight,
//      then 16-byte stores over NVLink), and its fp8 scales into sscales.
//   slots: unit (global expert e, chunk c of 32 tokens). The warp scans the staged ids of all
//      chunks, one token per lane: a ballot per chunk says which tokens picked e; `before` =
//      such tokens in earlier chunks, so token t's slot j among my tokens routed to e is known
//      here, by the source alone. Each lane whose token picked e (as its k-th expert) stores
//      tmap[me, t, k] = (epoch << 32) | (le * C + me * T_max + j) and tw[me, t, k] = w[t, k] on d;
//      the chunk-0 unit stores cnt[me, le] = rows for e.
//   release: one system-scope fence per block after its barrier (the memory-model argument is at
//      ll_last_block, ll_common.cuh); the last block of the grid (block counter 3) stores
//      dflags[me] = (epoch << 32) | T into every rank with st.release.sys.
// Receive phase: thread s < world of every block waits (bounded) for dflags[s] of this epoch;
// block 0 writes counts / src_counts / src_tokens from cnt; then unit (source s, token t < T_s,
// chunk c of the row): lane k reads tmap[s, t, k] (another epoch: that expert is not mine), and
// the warp copies chunk c of stage[s, t] into x at each valid slot (and, for c = 0, the scales and
// pair = t * topk + k). The kernel ends when every row addressed to my experts is in place.
// Last block of the grid stores the epoch back (ll_finish_launch, block counter 0).
// Phase stamps (LlParams::stamps, LlStamp) mark each of these steps per block when a probe asks.
//
// Buffer reuse is safe without another barrier: a source writes my stage / tmap / tw / cnt for
// call n + 1 only after its combine n, which waited for my combine n's flag, which I release after
// my dispatch n (the only reader of stage / cnt) and my combine n push phase (of tmap / tw).
#include "ll_common.cuh"

namespace {

struct LlDispatchArgs {
  const uint8_t* x;         // [T, row_bytes]
  const float* x_scales;    // [T, ns] (fp8 only)
  const int64_t* topk_idx;  // [T, topk]
  const float* topk_w;      // [T, topk]
  int num_tokens;
};

constexpr int kU = 8;  // 16-byte vectors per lane in flight when sending a row
constexpr int kS = 4;  // 16-byte vectors per lane in a scatter unit's chunk

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
  __shared__ int s_pre[EP_MAX_WORLD + 1];  // prefix of the sources' token counts
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int T = a.num_tokens, topk = p.topk, world = p.world, E = lp.experts, NE = lp.num_experts;
  const int me = p.rank, Tm = lp.t_max, ns = p.num_scales, V = p.row_bytes >> 4;
  ll_stamp(lp, kLlStart);
  if (threadIdx.x == 0) s_epoch = ld_volatile(lp.epochs) + 1;
  for (int i = threadIdx.x; i < T * topk; i += blockDim.x) s_idx[i] = (int)a.topk_idx[i];
  __syncthreads();
  ll_stamp(lp, kLlStaged);
  const int epoch = s_epoch;
  const unsigned long long tag = (unsigned long long)(unsigned)epoch << 32;
  const long long G = (long long)gridDim.x * nwarps, gw = (long long)blockIdx.x * nwarps + warp;
  bool aborted = ld_volatile(p.dev_error) != 0;

  // rows: each token once per destination rank that holds one of its experts
  for (long long u = gw; !aborted && u < (long long)T * world; u += G) {
    const int t = (int)(u / world), d = (me + 1 + (int)(u - (long long)t * world)) % world;
    bool hit = false;
    if (lane < topk) {
      const int e = s_idx[t * topk + lane];
      hit = e >= d * E && e < (d + 1) * E;
    }
    if (!__any_sync(0xffffffffu, hit)) continue;
    uint8_t* pb = p.peer_base[d];
    const size_t srow = (size_t)me * Tm + t;
    copy_row(reinterpret_cast<int4*>(pb + lp.off_stage + srow * p.row_bytes),
             reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes), V, lane);
    if (ns) {
      float* dst = reinterpret_cast<float*>(pb + lp.off_sscales) + srow * ns;
      const float* src = a.x_scales + (size_t)t * ns;
      for (int i = lane; i < ns; i += 32) dst[i] = src[i];
    }
  }

  // slots: where each (token, expert) pair goes, computed by the source
  const int chunks = T > 0 ? (T + 31) / 32 : 1;  // one empty chunk still publishes "0 rows"
  for (long long u = gw; !aborted && u < (long long)NE * chunks; u += G) {
    const int c = (int)(u / NE), e = (int)(u - (long long)c * NE);
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
    if ((mine >> lane) & 1u) {
      const int t = c * 32 + lane;
      const size_t slot = (size_t)le * lp.capacity + (size_t)me * Tm + before + __popc(mine & ((1u << lane) - 1));
      const size_t tk = ((size_t)me * Tm + t) * topk + kk;
      reinterpret_cast<unsigned long long*>(pb + lp.off_tmap)[tk] = tag | (unsigned long long)slot;
      reinterpret_cast<float*>(pb + lp.off_tw)[tk] = a.topk_w[(size_t)t * topk + kk];
    }
    if (c == 0 && lane == 0) reinterpret_cast<int*>(pb + lp.off_cnt)[me * E + le] = total;
  }

  // release: the last block to finish sending tells every rank
  if (ll_last_block(lp, lp.counters + 3) && threadIdx.x < world)
    st_release_sys_u64(reinterpret_cast<unsigned long long*>(p.peer_base[threadIdx.x] + lp.off_dflags) + me,
                       tag | (unsigned)T);
  ll_stamp(lp, kLlReleased);

  // receive: wait for every source, then place the staged rows into the experts' slots
  const uint8_t* mybase = p.peer_base[me];
  if (threadIdx.x < world) {
    const unsigned long long* flags = reinterpret_cast<const unsigned long long*>(mybase + lp.off_dflags);
    s_pre[threadIdx.x + 1] = (int)(ll_wait_epoch_u64(p, lp, flags + threadIdx.x, epoch, threadIdx.x,
                                                     kPhaseLlDispatch) &
                                   0xffffffffu);
  }
  __syncthreads();
  ll_stamp(lp, kLlWaited);
  if (threadIdx.x == 0) {
    s_pre[0] = 0;
    for (int s = 0; s < world; ++s) s_pre[s + 1] += s_pre[s];
  }
  __syncthreads();
  aborted = ld_volatile(p.dev_error) != 0;
  const int* cnt = reinterpret_cast<const int*>(mybase + lp.off_cnt);
  if (blockIdx.x == 0 && !aborted) {
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
      long long sum = 0;
      for (int s = 0; s < world; ++s) {
        const int n = cnt[s * E + i];
        lp.src_counts[i * world + s] = n;
        sum += n;
      }
      lp.counts[i] = sum;
    }
    if (threadIdx.x < world) lp.src_tokens[threadIdx.x] = s_pre[threadIdx.x + 1] - s_pre[threadIdx.x];
  }
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tmap);
  const int nch = (V + 32 * kS - 1) / (32 * kS);
  uint8_t* xr = p.peer_base[me] + lp.off_x;
  float* xs = reinterpret_cast<float*>(p.peer_base[me] + lp.off_scales);
  int* pair = reinterpret_cast<int*>(p.peer_base[me] + lp.off_pair);
  for (long long u = gw; !aborted && u < (long long)s_pre[world] * nch; u += G) {
    const int st = (int)(u / nch), c = (int)(u - (long long)st * nch);
    int s = 0;
    while (st >= s_pre[s + 1]) ++s;
    const int t = st - s_pre[s];
    const size_t srow = (size_t)s * Tm + t;
    unsigned long long ent = 0;
    if (lane < topk) ent = tmap[srow * topk + lane];
    const bool valid = lane < topk && (int)(ent >> 32) == epoch;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    if (mask == 0) continue;  // no expert of this token here (warp-uniform)
    const int slot = valid ? (int)(ent & 0xffffffffu) : 0;
    const int4* src = reinterpret_cast<const int4*>(mybase + lp.off_stage + srow * p.row_bytes);
    int4 buf[kS];
#pragma unroll
    for (int q = 0; q < kS; ++q) {
      const int i = c * 32 * kS + q * 32 + lane;
      if (i < V) buf[q] = src[i];  // written by a peer during this kernel: no .nc
    }
    for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
      const int b = __ffs(todo) - 1;
      const size_t sl = (size_t)__shfl_sync(0xffffffffu, slot, b);
      int4* dst = reinterpret_cast<int4*>(xr + sl * p.row_bytes);
#pragma unroll
      for (int q = 0; q < kS; ++q) {
        const int i = c * 32 * kS + q * 32 + lane;
        if (i < V) dst[i] = buf[q];
      }
      if (c == 0) {
        const float* ssrc = reinterpret_cast<const float*>(mybase + lp.off_sscales) + srow * ns;
        for (int i = lane; i < ns; i += 32) xs[sl * ns + i] = ssrc[i];
        if (lane == 0) pair[sl] = t * topk + b;
      }
    }
  }
  ll_finish_launch(lp, lp.counters + 0, lp.epochs + 0, epoch);
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
