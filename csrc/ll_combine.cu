// Low-latency combine (v3, issue 24 phase 2): one kernel, no grid-wide handshake, the epoch read
// from per-block slots in device memory (CUDA-graph capturable). Layout and flags: ll_common.cuh.
// The result is the contract's sum_k w[t, k] * y_{e_k}(t) (epbench/backends/base.py), in fp32:
// my own experts' terms are added directly; each other rank d first sums t's experts that live on
// d (its partial, rounded to bf16 once) and pushes it; the source adds the partials.
//
// Steps of each warp, units strided over all warps of the grid:
//   1. pushes (expert side, one row per (token, rank)): unit (source s != me, token t < T_s, part c
//      of kV x 32 16-byte vectors): lane k < topk reads tmap[s, t, k] and tw[s, t, k] (written by s's
//      dispatch; another epoch: expert k of t is not here); the warp loads part c of the valid
//      experts' y rows, kG at a time, adds w_k * y in fp32 and stores the bf16 partial into
//      crows[t * world + me] on rank s.
//   Release: each warp arrives once per destination with the units it did (ll_arrive, the
//      memory-model argument is there); the arrival completing T_s x parts stores cflags[me] =
//      epoch on s; for T_s = 0 warp 0 stores it at once (nothing to cover).
//   2. reduce (source side): unit (token t < T, part c): lane k takes t's k-th expert; for mine it
//      reads the slot and weight from my own tmap / tw (my dispatch wrote them) and loads that row;
//      for rank d's it sets bit d, and the lowest lane with an expert on d loads d's partial. The
//      warp waits (bounded, lanes in parallel) for the flags of the ranks in that
//      mask it has not yet seen, then sums w_k * y (mine) and the partials (theirs) into out[t].
//   3. warp 0 waits for every other rank's flag (so that no source rewrites my tmap / tw / stage /
//      cnt before my pushes for it are done: ll_dispatch.cu, buffer reuse), then every block stores
//      its epoch slots (ll_epoch_end).
// At world 1 nothing waits for anything: the whole call is step 2 over my own experts.
// LL_VARIANT_NO_BYPASS pushes my own partials through crows and flags like a peer's.
//
// Reuse of crows: a peer pushes into my crows for call n only after its dispatch n, which waited
// for my dispatch n's flag, which I release after my combine n - 1 had finished reading crows.
#include <cuda_bf16.h>
#include <stdlib.h>

#include "ll_common.cuh"

namespace {

struct LlCombineArgs {
  const int64_t* topk_idx;  // [T, topk] as given to the matching dispatch
  int num_tokens;
};

// kV: 16-byte vectors per lane in a unit's chunk (4: 128 vectors = 2 KiB of bf16, the default; 2: 1 KiB),
// a template parameter measured both ways (the `chunk` argument of ep_ll_combine, 2|4; 2026-11-21, 128 tokens, 4 x H200:
// 4 took 39.2 / 40.3 us at 132 / 64 SMs against 40.3 / 44.0 for 2, notes/KERNELS.md).
constexpr int kG = 4;  // rows whose chunk is loaded at once (kG x kV loads in flight per lane)

// acc += sum over the rows selected by `mask` (bit b = lane b's row) of w_b * rows_b[v0 + 32 u + lane].
// `row_of(b)` gives lane b's row base (already shuffled), `w` lane b's weight (shuffled inside).
template <int kV, typename RowOf>
__device__ __forceinline__ void accumulate(float (&acc)[kV][8], unsigned mask, float w, int v0, int V, int lane,
                                           RowOf row_of) {
  while (mask != 0) {
    int lanes[kG];
    int n = 0;
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      lanes[g] = mask != 0 ? __ffs(mask) - 1 : -1;
      if (mask != 0) {
        mask &= mask - 1;
        ++n;
      }
    }
    int4 buf[kG][kV];
    float wg[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const int b = lanes[g] < 0 ? 0 : lanes[g];
      wg[g] = __shfl_sync(0xffffffffu, w, b);
      const int4* row = row_of(b);
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        const int i = v0 + u * 32 + lane;
        if (g < n && i < V) buf[g][u] = row[i];  // written by peers during this call or the caller: no .nc
      }
    }
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      if (g < n) {
#pragma unroll
        for (int u = 0; u < kV; ++u)
          if (v0 + u * 32 + lane < V) fma_bf16x8(acc[u], buf[g][u], wg[g]);
      }
    }
  }
}

template <int kV>
__device__ __forceinline__ void store_chunk(int4* dst, const float (&acc)[kV][8], int v0, int V, int lane) {
#pragma unroll
  for (int uu = 0; uu < kV; ++uu) {
    const int i = v0 + uu * 32 + lane;
    if (i < V) st_v4(dst + i, pack_bf16x8(acc[uu]));
  }
}

template <int kThreads, int kV>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(EpParams p, LlParams lp, LlCombineArgs a) {
  __shared__ int s_epoch, s_depoch;
  ll_stamp(lp, kLlStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = lp.experts, me = p.rank;
  if (threadIdx.x == 0) {
    s_epoch = ll_epoch_begin(lp.epochs + kLlEpochSlots);
    s_depoch = ld_volatile(lp.epochs + blockIdx.x);  // the matching dispatch's epoch (stream order)
  }
  __syncthreads();
  ll_stamp(lp, kLlStaged);
  const int epoch = s_epoch, depoch = s_depoch;
  const bool sys = ll_sys(lp);
  const int self = (lp.variant & LL_VARIANT_NO_BYPASS) ? -1 : me;
  const long long G = (long long)gridDim.x * nwarps, gw = (long long)blockIdx.x * nwarps + warp;
  const size_t row = (size_t)p.hidden * 2;
  const int V = p.hidden >> 3;                     // 16-byte vectors per bf16 row
  const int nch = (V + 32 * kV - 1) / (32 * kV);  // parts per row
  uint8_t* mybase = p.peer_base[me];
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tmap);
  const float* tw = reinterpret_cast<const float*>(mybase + lp.off_tw);
  const uint8_t* y = reinterpret_cast<const uint8_t*>(lp.y);
  int* cflags = reinterpret_cast<int*>(mybase + lp.off_cflags);
  const unsigned others = ((1u << world) - 1u) & ~(self >= 0 ? 1u << self : 0u);

  bool aborted = ld_volatile(p.dev_error) != 0;
  // 1. pushes for the other sources' tokens (lane s: T_s)
  const int ts = ((others >> lane) & 1u) ? lp.src_tokens[lane] : 0;
  const int incl = ll_warp_prefix(ts), total_rows = __shfl_sync(0xffffffffu, incl, 31);
  unsigned sent = 0;
  for (long long u = gw; !aborted && u < (long long)total_rows * nch; u += G) {
    const int st = (int)(u / nch), c = (int)(u - (long long)st * nch);
    int t;
    const int s = ll_find_lane(incl, ts, st, &t);
    if (lane == s) ++sent;
    unsigned long long ent = 0;
    float w = 0.f;
    if (lane < topk) {
      const size_t tk = ((size_t)s * lp.t_max + t) * topk + lane;
      ent = tmap[tk];
      w = tw[tk];
    }
    const bool valid = lane < topk && (int)(ent >> 32) == depoch;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    if (mask == 0) continue;  // no expert of this token here (warp-uniform)
    const int slot = valid ? (int)(ent & 0xffffffffu) : 0;
    float acc[kV][8] = {};
    accumulate<kV>(acc, mask, w, c * 32 * kV, V, lane, [&](int b) {
      const int sl = __shfl_sync(0xffffffffu, slot, b);
      return reinterpret_cast<const int4*>(y + (size_t)sl * row);
    });
    store_chunk<kV>(reinterpret_cast<int4*>(p.peer_base[s] + lp.off_crows + ((size_t)t * world + me) * row), acc,
                    c * 32 * kV, V, lane);
  }
  __syncwarp();
  if (lane < world && sent != 0 && ll_arrive(lp.counters + 8 + lane, sent, (unsigned)(ts * nch), sys))
    ll_st_relaxed_i32(reinterpret_cast<int*>(p.peer_base[lane] + lp.off_cflags) + me, epoch, sys);
  if (gw == 0 && !aborted && ((others >> lane) & 1u) && ts == 0)
    ll_st_relaxed_i32(reinterpret_cast<int*>(p.peer_base[lane] + lp.off_cflags) + me, epoch, sys);
  ll_stamp_block(lp, kLlSent);
  ll_stamp(lp, kLlReleased);
  ll_stamp(lp, kLlWaited);

  // 2. reduce my tokens: my experts' rows directly, the other ranks' partials once their flag is seen
  const uint8_t* crows = mybase + lp.off_crows;
  unsigned seen = 0;  // ranks whose flag this warp has seen (warp-uniform)
  for (long long u = gw; !aborted && u < (long long)a.num_tokens * nch; u += G) {
    const int t = (int)(u / nch), c = (int)(u - (long long)t * nch);
    int d = -1;
    unsigned long long ent = 0;
    float w = 0.f;
    if (lane < topk) {
      const long long e = a.topk_idx[(size_t)t * topk + lane];
      if (e >= 0 && e < lp.num_experts) d = (int)(e / E);
      if (d >= 0 && d == self) {
        const size_t tk = ((size_t)me * lp.t_max + t) * topk + lane;
        ent = tmap[tk];
        w = tw[tk];
      }
    }
    const bool local = d >= 0 && d == self && (int)(ent >> 32) == depoch;
    // bit d set when some expert of t lives on rank d (not me); the lowest such lane loads d's partial
    const bool remote = d >= 0 && d != self;
    const unsigned ranks = __reduce_or_sync(0xffffffffu, remote ? 1u << d : 0u);
    const bool rep = remote && __ffs(__match_any_sync(0xffffffffu, d)) - 1 == lane;
    const unsigned need = ranks & ~seen;
    if (need != 0) {
      if (!ll_warp_wait(p, lp, need, kPhaseLlCombine,
                        [&] { return ll_ld_acquire_i32(cflags + lane, sys) - epoch >= 0; })) {
        aborted = true;
        break;
      }
      seen |= need;
    }
    // one term per lane: my expert's row (weight w) or rank d's partial (weight 1)
    const uint8_t* rp = local ? y + (size_t)(ent & 0xffffffffu) * row
                              : crows + ((size_t)t * world + (rep ? d : 0)) * row;
    float acc[kV][8] = {};
    accumulate<kV>(acc, __ballot_sync(0xffffffffu, local || rep), local ? w : 1.f, c * 32 * kV, V, lane, [&](int b) {
      return reinterpret_cast<const int4*>(__shfl_sync(0xffffffffu, (unsigned long long)rp, b));
    });
    store_chunk<kV>(reinterpret_cast<int4*>(lp.out + (size_t)t * p.hidden), acc, c * 32 * kV, V, lane);
  }
  ll_stamp_block(lp, kLlReceived);

  // 3. every other rank's flag seen by one warp, then the epoch slots
  if (gw == 0 && !aborted && (others & ~seen) != 0)
    ll_warp_wait(p, lp, others & ~seen, kPhaseLlCombine,
                 [&] { return ll_ld_acquire_i32(cflags + lane, sys) - epoch >= 0; });
  ll_epoch_end(lp.epochs + kLlEpochSlots, epoch);
  ll_stamp(lp, kLlEnd);
}

}  // namespace

extern "C" int ep_ll_combine(void* vctx, const void* topk_idx, int num_tokens, int num_sms, int warps, int chunk,
                             void* vstream) {
  LlContext* ctx = (LlContext*)vctx;
  if (ll_check_launch(ctx, num_tokens, num_sms, warps) != 0) return -1;
  if (chunk != 2 && chunk != 4) {
    ep_set_error("low-latency combine: chunk must be 2 or 4 vectors per lane (got %d)", chunk);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->ep->device));
  LlCombineArgs a;
  a.topk_idx = (const int64_t*)topk_idx;
  a.num_tokens = num_tokens;
  if (chunk == 4)
    ll_combine_kernel<512, 4><<<num_sms, warps * 32, 0, (cudaStream_t)vstream>>>(ctx->ep->p, ctx->lp, a);
  else
    ll_combine_kernel<512, 2><<<num_sms, warps * 32, 0, (cudaStream_t)vstream>>>(ctx->ep->p, ctx->lp, a);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
