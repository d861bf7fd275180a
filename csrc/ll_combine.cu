// Low-latency combine: one kernel, a push phase then a reduce phase; the epoch read from device
// memory (CUDA-graph capturable). Layout and flags: ll_common.cuh. The result is the contract's
// sum_k w[t, k] * y_{e_k}(t) (epbench/backends/base.py), computed in two fp32 steps: each rank
// first sums a token's experts that live on it (its partial), then the source adds the partials.
//
// Push phase (expert side, pre-reduced: one row per (token, rank), not per (token, expert)):
// work unit = (source s, token t < T_s, chunk c of kV x 32 16-byte vectors), units strided over all
// warps of the grid in the order LlParams::combine_order names (push_unit: source-major in rank order,
// c fastest; or rotated, destinations from me + 1 on taking turns). Lane k < topk reads tmap[s, t, k]
// and tw[s, t, k] (written by s's dispatch; an entry of another epoch means expert k of t is not on
// this rank); for the valid k, up to kG at a time, the warp loads chunk c of y[slot_k] (all loads in
// flight), adds w_k * y in fp32, and stores the bf16 partial into crows[t * world + me] of rank s over
// NVLink.
// A token with no expert here costs one 8-byte load per lane and is skipped.
// Release: one system-scope fence per block after its barrier (the memory-model argument is at
// ll_last_block, ll_common.cuh); the last block of the grid (block counter 1) stores cflags[me] =
// epoch into every rank with st.release.sys.
// Phase stamps (LlParams::stamps, LlStamp) mark each step per block when a probe asks.
// Reduce phase (source side): in every block, thread s < world waits (bounded, ll_wait_i32) for
// cflags[s] == epoch in my region, so all partials for my tokens have landed; then unit (t, c):
// the ranks holding t's experts (from topk_idx) give a bit mask, the warp loads chunk c of each
// of those partials (all in flight), sums them in fp32 and stores bf16 into out[t].
// The reduce waits on a flag that the last block of this same grid releases: every block must be
// resident at once (num_sms <= SM count, one 512-thread block per SM; ll_check_launch).
// Last block of the grid stores the epoch back (ll_finish_launch, block counter 2).
//
// Reuse: a peer pushes into my crows for call n only after its dispatch n, which needed my
// dispatch n, which started after my combine n - 1 had finished reading crows. A source rewrites
// my tmap / tw in its dispatch n + 1 only after its combine n saw my cflags, which I release
// after my push phase n (the only reader of tmap / tw) is done. With dispatch_place inline no source writes
// my tmap / tw: my own dispatch's receive does, before this kernel (stream order).
//
// Token sync (ll_sync = token, ll_combine_token_kernel): no grid-wide step. Epoch from eslots[1][b]
// + 1, the dispatch's from eslots[0][b]; stored back into slots b, b + G, ... at the end.
// Push: unit (peer s != me, token t < T_s, chunk c) as above (push_partial_chunk, push_unit; with a small
// buffer every t < t_max, the units past T_s finding no entry of this epoch: `spec` in the kernel), then
// __syncwarp and lane 0 stores tcflags[t, me, c] on s = epoch << 32 with st.release.sys (cumulative,
// as in dispatch). A token with no expert here stores nothing: s waits only for the ranks t's
// topk_idx names. combine_release batch (LlCombineRelease): a warp keeps the flags of up to
// kLlReleaseBatchUnits pushed units in registers and releases them together: __syncwarp, lane 0's
// fence.acq_rel.sys, then a relaxed system-scope store of each flag (fence then relaxed store is a
// release pattern; bar.warp.sync puts every lane's stores before the fence, as in ll_last_block).
// Reduce: unit (my token t, chunk c): lane k < topk names t's expert e_k; for e_k on my rank the
// warp reads y[slot] straight from tmap / tw (my own dispatch wrote them; no crows, no flag); for
// each peer d that t names, the first such lane acquires tcflags[t, d, c] (bounded) and stands for
// d's partial (weight 1); a __syncwarp then orders every lane's loads after those acquires. The
// own experts are summed in fp32 with the partials (one bf16 rounding less than the grid path).
// A peer cannot be at a later combine epoch for my token: its combine n + 1 pushes t only after
// its dispatch n + 1 received t from me, which I send after this combine.
#include <cuda_bf16.h>
#include <stdlib.h>

#include "ll_common.cuh"

namespace {

struct LlCombineArgs {
  const int64_t* topk_idx;  // [T, topk] as given to the matching dispatch
  int num_tokens;
};

// kV: 16-byte vectors per lane in a unit's chunk (4: 128 vectors = 2 KiB of bf16; 2: 1 KiB), the `chunk`
// argument of ep_ll_combine. Which is faster depends on the batch (the backend's combine_chunk auto picks;
// measurements in notes/LATENCY.md and notes/KERNELS.md).
// rows whose chunk is loaded at once: kG x kV = 16 loads of 16 bytes in flight per lane (kV 4: 4 rows a
// batch, two dependent batches for a top-8 token; kV 2: all 8 rows in one batch)
template <int kV>
__host__ __device__ constexpr int rows_in_flight() { return 16 / kV; }

// acc += sum over the rows selected by `mask` (bit b = lane b's row) of w_b * rows_b[v0 + 32 u + lane].
// `row_of(b)` gives lane b's row base (already shuffled), `w` lane b's weight (shuffled inside).
template <int kV, typename RowOf>
__device__ __forceinline__ void accumulate(float (&acc)[kV][8], unsigned mask, float w, int v0, int V, int lane,
                                           RowOf row_of) {
  constexpr int kG = rows_in_flight<kV>();
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

// dst[v0 + 32 u + lane] = bf16(sum over the rows in `mask` of w_b * row_b[...]) for one chunk.
template <int kV, typename RowOf>
__device__ __forceinline__ void sum_chunk(int4* dst, unsigned mask, float w, int v0, int V, int lane, RowOf row_of) {
  float acc[kV][8];
#pragma unroll
  for (int uu = 0; uu < kV; ++uu)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[uu][i] = 0.f;
  accumulate<kV>(acc, mask, w, v0, V, lane, row_of);
#pragma unroll
  for (int uu = 0; uu < kV; ++uu) {
    const int i = v0 + uu * 32 + lane;
    if (i < V) st_v4(dst + i, pack_bf16x8(acc[uu]));
  }
}

// Expert-side unit (source s, token t, chunk c): lane k < topk reads tmap[s, t, k] and tw[s, t, k]
// (an entry of another epoch than `depoch`: expert k of t is not on this rank); the warp sums chunk c
// of w_k * y[slot_k] over the valid k in fp32 and stores the bf16 partial into crows[t * world + me]
// of rank s. Returns false (warp-uniform) when no expert of t is here: nothing was stored. Both syncs.
template <int kV>
__device__ __forceinline__ bool push_partial_chunk(const EpParams& p, const LlParams& lp, int s, int t, int c,
                                                   int depoch, int lane) {
  const int topk = p.topk, V = p.hidden >> 3;
  const size_t row = (size_t)p.hidden * 2;
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(p.peer_base[p.rank] + lp.off_tmap);
  const float* tw = reinterpret_cast<const float*>(p.peer_base[p.rank] + lp.off_tw);
  const uint8_t* y = reinterpret_cast<const uint8_t*>(lp.y);
  unsigned long long ent = 0;
  float w = 0.f;
  if (lane < topk) {
    const size_t tk = ((size_t)s * lp.t_max + t) * topk + lane;
    ent = tmap[tk];
    w = tw[tk];
  }
  const bool valid = lane < topk && (int)(ent >> 32) == depoch;
  const unsigned mask = __ballot_sync(0xffffffffu, valid);
  if (mask == 0) return false;  // no expert of this token here (warp-uniform)
  const int slot = valid ? (int)(ent & 0xffffffffu) : 0;
  int4* dst = reinterpret_cast<int4*>(p.peer_base[s] + lp.off_crows + ((size_t)t * p.world + p.rank) * row);
  sum_chunk<kV>(dst, mask, w, c * 32 * kV, V, lane, [&](int b) {
    const int sl = __shfl_sync(0xffffffffu, slot, b);
    return reinterpret_cast<const int4*>(y + (size_t)sl * row);
  });
  return true;
}

// The push units of both kernels, in either order (LlCombineOrder). prefix [world + 1]: prefix sums in
// rank order of the tokens pushed to each rank (T_s; 0 for a rank not pushed to); np: the ranks pushed to,
// me + 1, me + 2, ... (mod world): the token kernel's world - 1 peers, the grid kernel's world ranks, itself
// last. nch: chunks per row.
//   source:  unit u -> (s, t, c) with st = u / nch, c = u % nch, s the rank whose prefix range holds st,
//            t = st - prefix[s]: every warp of a wave pushes to the lowest ranks first. prefix[world] x nch units.
//   rotated: unit u -> i = u % np, k = u / np, s = (me + 1 + i) % world, t = k / nch, c = k % nch, and no unit
//            where t >= T_s: consecutive units go to different ranks, each rank's links take their share of
//            every wave. np x max_s T_s x nch units, the ones past a short rank's T_s skipped.
// Both name every (s, t, c) with s pushed to, t < T_s, c < nch exactly once. Outputs are bit-identical
// between the orders: a unit's partial depends on (s, t, c) alone (tmap, tw and y are not written during
// the push; the fp32 sum runs over t's experts in lane order within the unit), its bytes
// (crows[t * world + me] of s, chunk c) and its token-sync flag (tcflags[t, me, c] of s) are that unit's
// alone, the grid kernel's cflags release waits for every block whatever each pushed, and the reduce
// reads nothing before those flags. The order moves when a byte lands, never which byte or its value.
__device__ __forceinline__ long long push_unit_count(int order, const int* prefix, int np, int nch, int me,
                                                     int world) {
  if (order != kLlOrderRotated) return (long long)prefix[world] * nch;
  int tmax = 0;
  for (int i = 0; i < np; ++i) {
    const int s = (me + 1 + i) % world;
    tmax = max(tmax, prefix[s + 1] - prefix[s]);
  }
  return (long long)np * tmax * nch;
}

// The rotated order's unit u -> (s, t, c), whether or not t < T_s.
__device__ __forceinline__ void rotated_unit(long long u, int np, int nch, int me, int world, int& s, int& t, int& c) {
  const long long k = u / np;
  s = (me + 1 + (int)(u - k * np)) % world;
  t = (int)(k / nch);
  c = (int)(k - (long long)t * nch);
}

// Unit u -> (s, t, c); false (warp-uniform: a warp holds one u) where the rotated order's u names no unit.
__device__ __forceinline__ bool push_unit(long long u, int order, const int* prefix, int np, int nch, int me,
                                          int world, int& s, int& t, int& c) {
  if (order == kLlOrderRotated) {
    rotated_unit(u, np, nch, me, world, s, t, c);
    return t < prefix[s + 1] - prefix[s];
  }
  const int st = (int)(u / nch);
  c = (int)(u - (long long)st * nch);
  s = 0;
  while (st >= prefix[s + 1]) ++s;
  t = st - prefix[s];
  return true;
}

template <int kThreads, int kV>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(EpParams p, LlParams lp, LlCombineArgs a) {
  __shared__ int s_epoch, s_depoch;
  __shared__ int s_tokens[EP_MAX_WORLD + 1];  // prefix of the sources' token counts
  __shared__ long long s_units;                // push units (push_unit_count)
  ll_stamp(lp, kLlStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = lp.experts, order = lp.combine_order;
  const int V = p.hidden >> 3;           // 16-byte vectors per bf16 row
  const int nch = (V + 32 * kV - 1) / (32 * kV);  // chunks per row
  if (threadIdx.x == 0) {
    s_epoch = ld_volatile(lp.epochs + 1) + 1;
    s_depoch = ld_volatile(lp.epochs);  // the matching dispatch's epoch (stream order)
    int acc = 0;
    for (int s = 0; s < world; ++s) {
      s_tokens[s] = acc;
      acc += lp.src_tokens[s];
    }
    s_tokens[world] = acc;
    s_units = push_unit_count(order, s_tokens, world, nch, p.rank, world);  // every rank, itself last
  }
  __syncthreads();
  ll_stamp(lp, kLlStaged);
  const int epoch = s_epoch, depoch = s_depoch;
  const long long G = (long long)gridDim.x * nwarps;
  const size_t row = (size_t)p.hidden * 2;

  bool aborted = ld_volatile(p.dev_error) != 0;
  for (long long u = blockIdx.x * nwarps + warp; !aborted && u < s_units; u += G) {
    int s, t, c;
    if (push_unit(u, order, s_tokens, world, nch, p.rank, world, s, t, c))
      push_partial_chunk<kV>(p, lp, s, t, c, depoch, lane);
  }

  if (ll_last_block(lp, lp.counters + 1) && threadIdx.x < world)
    st_release_sys(reinterpret_cast<int*>(p.peer_base[threadIdx.x] + lp.off_cflags) + p.rank, epoch);
  ll_stamp(lp, kLlReleased);
  if (threadIdx.x < world) {
    ll_wait_i32(p, reinterpret_cast<const int*>(p.peer_base[p.rank] + lp.off_cflags) + threadIdx.x, epoch, threadIdx.x,
                kPhaseLlCombine);
  }
  __syncthreads();
  ll_stamp(lp, kLlWaited);

  aborted = ld_volatile(p.dev_error) != 0;
  const uint8_t* crows = p.peer_base[p.rank] + lp.off_crows;
  const long long red_units = (long long)a.num_tokens * nch;
  for (long long u = blockIdx.x * nwarps + warp; !aborted && u < red_units; u += G) {
    const int t = (int)(u / nch), c = (int)(u - (long long)t * nch);
    int d = -1;
    if (lane < topk) {
      const long long e = a.topk_idx[(size_t)t * topk + lane];
      if (e >= 0 && e < lp.num_experts) d = (int)(e / E);
    }
    // bit d set when some expert of t lives on rank d; lane d of the mask loads rank d's partial
    const unsigned ranks = __reduce_or_sync(0xffffffffu, d >= 0 ? 1u << d : 0u);
    sum_chunk<kV>(reinterpret_cast<int4*>(lp.out + (size_t)t * p.hidden), ranks, 1.f, c * 32 * kV, V, lane,
              [&](int b) { return reinterpret_cast<const int4*>(crows + ((size_t)t * world + b) * row); });
  }
  ll_finish_launch(lp, lp.counters + 2, lp.epochs + 1, epoch);
}

// ---- ll_sync = token (protocol: "Token sync" at the top of the file) ----
// kBatch: combine_release batch (its own instantiation, so the per-unit kernels keep their registers)
template <int kThreads, int kV, bool kBatch>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_token_kernel(EpParams p, LlParams lp, LlCombineArgs a) {
  __shared__ int s_epoch, s_depoch;
  __shared__ int s_tokens[EP_MAX_WORLD + 1];  // prefix over peers of their tokens (mine: 0)
  __shared__ long long s_units;                // push units (push_unit_count)
  ll_stamp(lp, kLlStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = lp.experts, me = p.rank, cch = lp.cflag_chunks;
  const int order = lp.combine_order;
  const int V = p.hidden >> 3;
  const int nch = (V + 32 * kV - 1) / (32 * kV);
  const bool aborted = ld_volatile(p.dev_error) != 0;  // issued with the epochs: one round trip for both
  // A small buffer (t_max <= kLlSpecTokens, the same on every rank) in rotated order, with a warp for every unit
  // (else a warp would walk units past the peers' counts one dependent tmap load after another: few SMs, many
  // ranks): every thread loads the two epochs itself and the units run over every (peer, token < t_max, chunk),
  // without the peers' token counts, so no block barrier and no dependent load stand before a unit's tmap loads; a
  // unit past a peer's count finds tmap entries of an older epoch (none of this one can exist there) and pushes
  // nothing. Block-uniform; chunk 2 is auto at such buffers.
  const long long spec_units = (long long)(world - 1) * lp.t_max * nch;
  const bool spec = kV == 2 && order == kLlOrderRotated && lp.t_max <= kLlSpecTokens &&
                    spec_units <= (long long)gridDim.x * nwarps;
  int r_epoch = 0, r_depoch = 0;
  if (spec) {
    r_depoch = ld_volatile(lp.eslots + blockIdx.x);  // the matching dispatch's epoch (stream order)
    r_epoch = ld_volatile(lp.eslots + lp.eslot_count + blockIdx.x) + 1;
  } else {
    if (threadIdx.x == 0) {
      s_epoch = ld_volatile(lp.eslots + lp.eslot_count + blockIdx.x) + 1;
      s_depoch = ld_volatile(lp.eslots + blockIdx.x);  // the matching dispatch's epoch (stream order)
      int acc = 0;
      for (int s = 0; s < world; ++s) {
        s_tokens[s] = acc;
        acc += s == me ? 0 : lp.src_tokens[s];
      }
      s_tokens[world] = acc;
      s_units = push_unit_count(order, s_tokens, world - 1, nch, me, world);  // the peers
    }
    __syncthreads();
  }
  ll_stamp(lp, kLlStaged);
  const int epoch = spec ? r_epoch : s_epoch, depoch = spec ? r_depoch : s_depoch;
  const unsigned long long tag = (unsigned long long)(unsigned)epoch << 32;
  // units dealt block-major (u -> block u % blocks): a small batch's loads spread over many SMs
  const long long G = (long long)gridDim.x * nwarps, gw = (long long)warp * gridDim.x + blockIdx.x;
  const size_t row = (size_t)p.hidden * 2;
  const int fstep = kV / 2;  // flag chunks (of 64 vectors) per work chunk: flag index c * fstep

  // push: peers' tokens only (my own experts' share of my tokens is summed in the reduce below)
  // batch: the flags of pushed units not yet released, as (rank s, index into s's tcflags): 32-bit indices
  // and 4 bits of rank each (EP_MAX_WORLD <= 16), so the held flags stay in a few registers
  static_assert(EP_MAX_WORLD <= 16 && kLlReleaseBatchUnits * 4 <= 32, "held ranks: 4 bits each");
  unsigned held[kLlReleaseBatchUnits] = {};
  unsigned held_rank = 0;
  int nheld = 0;
  auto release_held = [&]() {  // warp-uniform: every lane holds the same flags
    __syncwarp();  // every lane's stores of the held chunks before lane 0's fence
    if (lane == 0) {
      fence_acq_rel_sys();
#pragma unroll
      for (int i = 0; i < kLlReleaseBatchUnits; ++i)
        if (i < nheld)
          st_relaxed_sys_u64(reinterpret_cast<unsigned long long*>(p.peer_base[(held_rank >> (4 * i)) & 15u] +
                                                                   lp.off_tcflags) + held[i],
                             tag);
    }
    nheld = 0;
    held_rank = 0;
  };
  for (long long u = gw; !aborted && u < (spec ? spec_units : s_units); u += G) {
    int s, t, c;
    if (spec) {  // the rotated order over t_max tokens a peer
      rotated_unit(u, world - 1, nch, me, world, s, t, c);
    } else if (!push_unit(u, order, s_tokens, world - 1, nch, me, world, s, t, c)) {
      continue;
    }
    if (!push_partial_chunk<kV>(p, lp, s, t, c, depoch, lane)) continue;
    const size_t fi = ((size_t)t * world + me) * cch + c * fstep;  // the unit's flag in s's tcflags
    if constexpr (kBatch) {
#pragma unroll
      for (int i = 0; i < kLlReleaseBatchUnits; ++i)  // held[nheld] = fi, in registers
        if (i == nheld) held[i] = (unsigned)fi;
      held_rank |= (unsigned)s << (4 * nheld);
      if (++nheld == kLlReleaseBatchUnits) release_held();
      continue;
    }
    __syncwarp();  // every lane's stores of the chunk before lane 0's flag
    if (lane == 0) st_release_sys_u64(reinterpret_cast<unsigned long long*>(p.peer_base[s] + lp.off_tcflags) + fi, tag);
  }
  if (kBatch && nheld > 0) release_held();
  ll_stamp(lp, kLlSent);
  ll_stamp(lp, kLlReleased);
  ll_stamp(lp, kLlWaited);

  // reduce: token t's experts on my rank straight from y, plus one partial per peer t names
  const uint8_t* mybase = p.peer_base[me];
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tmap);
  const float* tw = reinterpret_cast<const float*>(mybase + lp.off_tw);
  const unsigned long long* tcflags = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tcflags);
  const uint8_t* crows = mybase + lp.off_crows;
  const uint8_t* y = reinterpret_cast<const uint8_t*>(lp.y);
  for (long long u = gw; !aborted && u < (long long)a.num_tokens * nch; u += G) {
    const int t = (int)(u / nch), c = (int)(u - (long long)t * nch);
    int d = -1;
    const int4* src = nullptr;  // lane k's row: y[slot] for an expert of mine, rank d's partial once per d
    float w = 0.f;
    // lane k's expert id, slot entry and weight loaded together (none depends on another's value:
    // issued back to back, one round trip instead of three)
    unsigned long long ent = 0;
    float wk = 0.f;
    if (lane < topk) {
      const size_t tk = ((size_t)me * lp.t_max + t) * topk + lane;
      const long long e = a.topk_idx[(size_t)t * topk + lane];
      ent = tmap[tk];
      wk = tw[tk];
      if (e >= 0 && e < lp.num_experts) d = (int)(e / E);
    }
    const unsigned same = __match_any_sync(0xffffffffu, d);
    if (d == me) {
      if ((int)(ent >> 32) == depoch) {
        src = reinterpret_cast<const int4*>(y + (size_t)(ent & 0xffffffffu) * row);
        w = wk;
      }
    } else if (d >= 0 && (same & ((1u << lane) - 1u)) == 0) {  // the first of t's experts on rank d
      // this lane waits for rank d's chunk; the warp barrier below orders every lane's loads after it
      ll_wait_epoch_u64(p, tcflags + ((size_t)t * world + d) * cch + c * fstep, epoch, d, kPhaseLlCombine);
      src = reinterpret_cast<const int4*>(crows + ((size_t)t * world + d) * row);
      w = 1.f;
    }
    __syncwarp();
    const unsigned mask = __ballot_sync(0xffffffffu, src != nullptr);
    sum_chunk<kV>(reinterpret_cast<int4*>(lp.out + (size_t)t * p.hidden), mask, w, c * 32 * kV, V, lane,
                  [&](int b) { return reinterpret_cast<const int4*>(__shfl_sync(0xffffffffu, (unsigned long long)src, b)); });
  }
  ll_stamp(lp, kLlReceived);
  // spec: every thread loaded the epoch slot itself; none may read it after thread 0 stores this call's below
  if (spec) __syncthreads();
  ll_store_epoch_slots(lp, lp.eslots + lp.eslot_count, lp.epochs + 1, epoch);
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
  ctx->launched = true;
  cudaStream_t stream = (cudaStream_t)vstream;
  const bool batch = ctx->lp.combine_release == kLlReleaseBatch;
  if (ctx->sync == kLlSyncToken && chunk == 4 && batch)
    ll_combine_token_kernel<512, 4, true><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  else if (ctx->sync == kLlSyncToken && chunk == 4)
    ll_combine_token_kernel<512, 4, false><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  else if (ctx->sync == kLlSyncToken && batch)
    ll_combine_token_kernel<512, 2, true><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  else if (ctx->sync == kLlSyncToken)
    ll_combine_token_kernel<512, 2, false><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  else if (chunk == 4)
    ll_combine_kernel<512, 4><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  else
    ll_combine_kernel<512, 2><<<num_sms, warps * 32, 0, stream>>>(ctx->ep->p, ctx->lp, a);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
