// Low-latency dispatch (v3, issue 24 phase 2): one kernel, no grid-wide handshake, no host
// synchronisation, the epoch read from per-block slots in device memory (CUDA-graph capturable).
// Layout and flags: ll_common.cuh; the placement contract: epbench/backends/base.py (ll_slots).
//
// Every block stages topk_idx as int32 in shared memory; then each warp runs, strided over all
// warps of the grid (G = grid x warps), these unit loops one after another:
//   1. rows for the other ranks: unit (token t, destination index i), d = (me + 1 + i) % world
//      over the ranks other than me. If t has an expert on d, the warp copies its row into
//      stage[me, t] on d (16-byte loads, all in flight, then stores) and its fp8 scales.
//   2. slots for the other ranks' experts: unit (expert e, chunk c of 32 tokens): a ballot scan of
//      the staged ids (ll_scan_expert) gives token t's slot j among my tokens routed to e, known by
//      the source alone; lane t stores tmap[me, t, k] = (epoch << 32) | (le * C + me * T_max + j)
//      and tw[me, t, k] on d; the chunk-0 unit stores cnt[me, le] = rows for e.
//   Release: each warp counts the units it did per destination (even those that wrote nothing)
//      and arrives once per destination (ll_arrive: fence, atomicAdd on counter d); the arrival
//      that completes d's T + E x chunks units stores dflags[me] = (epoch << 32) | T on d. The
//      memory-model argument (which fence synchronises with which) is at ll_arrive.
//   3. my own experts (bypass): unit (local expert le, chunk c, row part h): the same scan, then
//      part h of each row picked by e is copied from x straight into its slot here (4 rows' loads
//      in flight), with scales, pair and my own tmap / tw entries (combine reads them): no staging,
//      no flag. So at world 1 nothing waits for anything.
//   4. rows from the other ranks: each warp waits (bounded, lanes in parallel: ll_warp_wait) for
//      every other source's flag of this epoch, which carries T_s; then unit (source s, token
//      t < T_s, part c): lane k reads tmap[s, t, k] (another epoch: not my expert) and the warp
//      copies part c of stage[s, t] into each valid slot (for c = 0 the scales and pair too).
//   5. counts: warp le (strided) writes src_counts[le, s] (s = me: its own scan; else cnt[s, le])
//      and counts[le]; warp 0 writes src_tokens.
//   6. the block stores its epoch slots (ll_epoch_end): no counter, no fence.
// The kernel ends when every row addressed to my experts is in place (each warp saw every flag).
// LL_VARIANT_NO_BYPASS serves my own rank through steps 1, 2 and 4 like a peer (the multi-rank
// path, measurable at world 1); LL_VARIANT_SYS_SCOPE forces system-scope fences and flags.
// Phase stamps (LlParams::stamps, LlStamp) mark the steps per block when a probe asks.
//
// Buffer reuse without another barrier: a source s writes my stage / tmap / tw / cnt for call
// n + 1 only after its combine n, which waited (ll_combine.cu, its last step) for my combine n's
// flag; I release that after my dispatch n (the only reader of stage / cnt) and after my pushes
// for s (the only reader of tmap[s] / tw[s]). Flags compare epochs with >= (wrapping difference).
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

constexpr int kR = 4;  // rows whose part is loaded at once in the own-expert copy (kR x kS vectors per lane)

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(EpParams p, LlParams lp, LlDispatchArgs a) {
  extern __shared__ int s_idx[];  // [T * topk] expert ids
  __shared__ int s_epoch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int T = a.num_tokens, topk = p.topk, world = p.world, E = lp.experts, NE = lp.num_experts;
  const int me = p.rank, Tm = lp.t_max, ns = p.num_scales, V = p.row_bytes >> 4;
  ll_stamp(lp, kLlStart);
  if (threadIdx.x == 0) s_epoch = ll_epoch_begin(lp.epochs);
  for (int i = threadIdx.x; i < T * topk; i += blockDim.x) s_idx[i] = (int)a.topk_idx[i];
  __syncthreads();
  ll_stamp(lp, kLlStaged);
  const int epoch = s_epoch;
  const unsigned long long tag = (unsigned long long)(unsigned)epoch << 32;
  const bool sys = ll_sys(lp);
  const int self = (lp.variant & LL_VARIANT_NO_BYPASS) ? -1 : me;  // served without staging or flags
  const int others = world - (self >= 0 ? 1 : 0);                  // ranks served through flags
  const long long G = (long long)gridDim.x * nwarps, gw = (long long)blockIdx.x * nwarps + warp;
  const int chunks = T > 0 ? (T + 31) / 32 : 1;  // one empty chunk still publishes "0 rows"
  const int nch = (V + 32 * kS - 1) / (32 * kS);  // row parts of 32 x kS vectors
  uint8_t* mybase = p.peer_base[me];
  uint8_t* xr = mybase + lp.off_x;
  float* xs = reinterpret_cast<float*>(mybase + lp.off_scales);
  int* pair = reinterpret_cast<int*>(mybase + lp.off_pair);
  bool aborted = ld_volatile(p.dev_error) != 0;
  unsigned sent = 0;  // lane d: units this warp did for destination d

  // 1. rows: each token once per other rank that holds one of its experts
  for (long long u = gw; !aborted && u < (long long)T * others; u += G) {
    const int t = (int)(u / others), d = (me + 1 + (int)(u - (long long)t * others)) % world;
    if (lane == d) ++sent;
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

  // 2. slots of the other ranks' experts, computed by the source
  const int rexp = others * E;  // experts of the ranks served through flags, from rank me + 1 on
  for (long long u = gw; !aborted && u < (long long)rexp * chunks; u += G) {
    const int c = (int)(u / rexp), e = (int)(((long long)(me + 1) * E + (u - (long long)c * rexp)) % NE);
    const int d = e / E, le = e - d * E;
    if (lane == d) ++sent;
    unsigned mine;
    int before, total, kk;
    ll_scan_expert(s_idx, T, topk, chunks, e, c, &mine, &before, &total, &kk);
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

  // release: per destination, the warp whose arrival completes its units stores the flag there
  __syncwarp();
  if (lane < world && sent != 0 &&
      ll_arrive(lp.counters + lane, sent, (unsigned)(T + E * chunks), sys))
    ll_st_relaxed_u64(reinterpret_cast<unsigned long long*>(p.peer_base[lane] + lp.off_dflags) + me,
                      tag | (unsigned)T, sys);
  ll_stamp_block(lp, kLlSent);

  // 3. my own experts: part h of each row straight from x into its slot
  const int own_units = self >= 0 ? E * chunks * nch : 0;
  for (long long u = gw; !aborted && u < own_units; u += G) {
    const int h = (int)(u % nch), rest = (int)(u / nch), c = rest / E, le = rest - c * E;
    unsigned mine;
    int before, total, kk;
    ll_scan_expert(s_idx, T, topk, chunks, me * E + le, c, &mine, &before, &total, &kk);
    if (mine == 0) continue;
    const int j = before + __popc(mine & ((1u << lane) - 1));
    const int slot = le * lp.capacity + me * Tm + j;
    if (h == 0 && ((mine >> lane) & 1u)) {
      const int t = c * 32 + lane;
      const size_t tk = ((size_t)me * Tm + t) * topk + kk;
      pair[slot] = t * topk + kk;
      reinterpret_cast<unsigned long long*>(mybase + lp.off_tmap)[tk] = tag | (unsigned long long)slot;
      reinterpret_cast<float*>(mybase + lp.off_tw)[tk] = a.topk_w[(size_t)t * topk + kk];
    }
    for (unsigned todo = mine; todo != 0;) {
      int lanes[kR];
#pragma unroll
      for (int g = 0; g < kR; ++g) {
        lanes[g] = todo != 0 ? __ffs(todo) - 1 : -1;
        if (todo != 0) todo &= todo - 1;
      }
      int4 buf[kR][kS];
#pragma unroll
      for (int g = 0; g < kR; ++g) {
        if (lanes[g] < 0) continue;
        const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)(c * 32 + lanes[g]) * p.row_bytes);
#pragma unroll
        for (int q = 0; q < kS; ++q) {
          const int i = h * 32 * kS + q * 32 + lane;
          if (i < V) buf[g][q] = ld_nc_v4(src + i);
        }
      }
#pragma unroll
      for (int g = 0; g < kR; ++g) {
        if (lanes[g] < 0) continue;
        const int sl = __shfl_sync(0xffffffffu, slot, lanes[g]);
        int4* dst = reinterpret_cast<int4*>(xr + (size_t)sl * p.row_bytes);
#pragma unroll
        for (int q = 0; q < kS; ++q) {
          const int i = h * 32 * kS + q * 32 + lane;
          if (i < V) st_v4(dst + i, buf[g][q]);
        }
        if (h == 0 && ns) {
          const float* src = a.x_scales + (size_t)(c * 32 + lanes[g]) * ns;
          for (int i = lane; i < ns; i += 32) xs[(size_t)sl * ns + i] = src[i];
        }
      }
    }
  }
  ll_stamp_block(lp, kLlReleased);

  // 4. rows from the other sources: wait for their flags (lane s polls source s), then place them
  const unsigned long long* flags = reinterpret_cast<const unsigned long long*>(mybase + lp.off_dflags);
  const unsigned pending = ((1u << world) - 1u) & ~(self >= 0 ? 1u << self : 0u);
  unsigned long long fv = 0;
  if (!aborted)
    aborted = !ll_warp_wait(p, lp, pending, kPhaseLlDispatch, [&] {
      fv = ll_ld_acquire_u64(flags + lane, sys);
      return (int)(fv >> 32) - epoch >= 0;
    });
  ll_stamp_block(lp, kLlWaited);
  const int ts = ((pending >> lane) & 1u) ? (int)(fv & 0xffffffffu) : 0;  // T_s in lane s
  const int incl = ll_warp_prefix(ts), total_rows = __shfl_sync(0xffffffffu, incl, 31);
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tmap);
  for (long long u = gw; !aborted && u < (long long)total_rows * nch; u += G) {
    const int st = (int)(u / nch), c = (int)(u - (long long)st * nch);
    int t;
    const int s = ll_find_lane(incl, ts, st, &t);
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
  ll_stamp_block(lp, kLlReceived);

  // 5. counts: every source's rows per local expert (the flags above cover cnt)
  const int* cnt = reinterpret_cast<const int*>(mybase + lp.off_cnt);
  for (long long le = gw; !aborted && le < E; le += G) {
    int n = 0;
    if (self >= 0) {
      unsigned mine;
      int before, kk;
      ll_scan_expert(s_idx, T, topk, chunks, me * E + (int)le, 0, &mine, &before, &n, &kk);
    }
    if (lane < world) {
      if (lane != self) n = cnt[lane * E + le];
      lp.src_counts[le * world + lane] = n;
    }
    const int sum = __reduce_add_sync(0xffffffffu, lane < world ? n : 0);
    if (lane == 0) lp.counts[le] = sum;
  }
  if (gw == 0 && !aborted && lane < world) lp.src_tokens[lane] = lane == self ? T : ts;
  ll_epoch_end(lp.epochs, epoch);
  ll_stamp(lp, kLlEnd);
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
