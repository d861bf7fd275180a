// Combine: every rank reads its own tokens' rows back from the combine_in buffers of the ranks that
// received them and reduces them in fp32 as they arrive; no staging buffer on the sender, no second
// pass, no weights on the wire (the source keeps its topk_weights).
//
// 1. Block 0, threads d < world: store ready[me] = epoch into rank d's signals
//    (st.release.sys): my caller has filled my combine_in, peers may pull from it.
// 2. Every block, threads s < world: wait until ready[s] == epoch in my signals.
// 3. combine_tma_kernel: pulls with the SM's bulk-copy unit (linkbench: at 8 blocks bulk
//    pulls from peers reach ~323 GB/s of egress, register pulls ~276; a register-pull kernel lost at
//    8 SMs and tied from 16 on, so it was deleted). Work unit = (token, chunk of its row; 1 / 2 / 4 KiB);
//    warp g takes its tokens g, g + G, ... chunk by chunk. Each warp owns S stages of world x chunk in
//    shared memory; lane d loads unit j's chunk from holder d's combine_in into stage j % S (cp.async.bulk,
//    one mbarrier per stage counting the bytes), S units ahead of the reduction; the whole warp waits on
//    the stage, sums the holders' chunks in fp32 with w(t, d), stores bf16 into out[t] and issues the
//    loads of unit j + S into the freed stage. Rows and weights of the warp's tokens are computed 32
//    tokens at a time (one lane per token) into a double-buffered per-warp table, one batch ahead.
//    Or (EP_OPT_PULL_KERNEL 1, or 2 where ep_pull_auto picks it; rank-major, world <= 4)
//    combine_ce_bulk_kernel<true>: the copy-engine combine's
//    loading warps and summing warps (below) pulling every holder's row from its combine_in after step 2.
// Expert-major (align >= 1): combine_in holds one row per slot (the caller's expert outputs). Phase R
// (em_reduce_kernel, launched right before the combine kernel on its grid, or on em_sms blocks of 16 warps
// where ep_set_option EP_OPT_EM_SMS asks) runs before step 1: warp g
// takes received rows g, g + G, ... and sums each row's slots (em_slot, written by the dispatch) times the
// row's weight for that expert (recv_w) in fp32 into one bf16 row of combine_red, rank-major; step 1 then
// releases ready[me] as in rank-major, and step 3 pulls combine_red with weight 1 per holder instead of
// combine_in with w(t, d). So a row still crosses the link once per (token, rank) and nothing unpermutes the
// buffer apart from this read.
// own_rows ce: my own row of token t is row t of my combine_in (the notify kernel leaves base[me] = 0 and
// slot_map[t][me] = t), read through the same table as every holder's; padding rows (my tokens not routed to
// me) have no slot and are never read.
// combine_ce (ep_config.combine_ce, own_rows all only): every source's rows sit at rows [s * max_tokens + t] on each
// holder, so a holder's rows of source s are one range. ep_combine pushes them with the copy engine (at 2 ranks on
// ce_streams streams alternating; at 3+ chunk-major in ring order, chunk c on stream c % ce_streams) into s's staging buffer at
// rows [h * max_tokens + t], in the chunks of
// p.ce_bound (even, or growing: buffers.cu ce_set_bounds), each followed by cstage[h][c] = epoch in s's signals (cuStreamWriteValue32: written after the
// chunk's copy completed, fenced first). Step 1-2 become a check that every holder pushed at least my T rows (the
// num_tokens word of its notify row), and step 3 is, at 2 ranks (and beyond 4), combine_ce_kernel: registers, no
// shared memory (the pull's TMA kernel with local sources measured no faster than its pulls at 2 rows a token):
// lane d finds holder d's row of the token (my combine_in for d == me, my staging buffer for a peer), waiting once
// per chunk for cstage[d][c], and the warp sums the rows with every holder's loads in flight before the FMAs; at
// 3-4 ranks combine_ce_bulk_kernel (below): the same sum fed by TMA bulk copies, a loading warp and its summers,
// faster at 3-4 rows a token. So the SMs read and write local memory only; the link carries the same rows, moved by copy engines.
// No ready handshake is needed: no peer reads my combine_in, and my staging buffer is free because every peer's
// previous combine ended only after my pulled flag, stored once my last block had read it (step 4).
// 4. grid_release_and_wait on pulled[]: the last block stores pulled[me] = epoch into every
//    rank and waits for every rank's pulled[] flag, so the call ends only when no peer still
//    reads my combine_in (the caller may overwrite it right after).
#include <cuda_bf16.h>

#include <algorithm>

#include "common.cuh"

namespace {

struct CombineArgs {
  uint4* out;
  const int64_t* topk_idx;
  const float* topk_w;
  int num_tokens;
};

// Expert-major phase R (above): combine_red[r] = sum over r's slots of w * combine_in[slot], in pieces of kU
// 16-byte vectors per lane (fp32 accumulators for 8 kU elements). The loads of a batch of up to kS slots are
// all issued before the first FMA: kS x kU = 8 vectors in flight per lane, 4 KiB per warp (16 spilled).
// Before, each vector's load sat in one `if` with its FMAs, so a warp waited one round trip per vector
// (notes/KERNELS.md, expert-major at world 1, H1). The FMAs run in the slots' k order, batch after batch:
// the same fmaf chain per element as one slot at a time.
template <int kS, int kU>
__device__ __forceinline__ void em_reduce_row(const int4* __restrict__ y, int4* red_row, int V, int slot, float w,
                                              unsigned mine, int lane) {
  for (int v0 = 0; v0 < V; v0 += 32 * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    for (unsigned m = mine; m;) {  // warp-uniform
      int s[kS];
      float wk[kS];
#pragma unroll
      for (int j = 0; j < kS; ++j) {  // the batch's slots: the next kS set bits of m, -1 past the last
        const int k = __ffs(m) - 1;
        s[j] = __shfl_sync(0xffffffffu, slot, k & 31);
        wk[j] = __shfl_sync(0xffffffffu, w, k & 31);
        if (k < 0) s[j] = -1;
        m &= m - 1;
      }
      int4 x[kS][kU];
#pragma unroll
      for (int j = 0; j < kS; ++j)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (s[j] >= 0 && i < V) x[j][u] = ld_nc_v4(y + (size_t)s[j] * V + i);
        }
#pragma unroll
      for (int j = 0; j < kS; ++j)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (s[j] >= 0 && v0 + u * 32 + lane < V) fma_bf16x8(acc[u], x[j][u], wk[j]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (v0 + u * 32 + lane < V) red_row[v0 + u * 32 + lane] = pack_bf16x8(acc[u]);
  }
}

// A row of one slot (wide only): the batch above for kS = 1, kU = 4 without the accumulators of the whole
// batch held live: each vector's fmaf(w, x, 0) and rounding right after the loads, the same bits. (kU = 8, or
// 2 x 4 batches for rows of two slots, spill in this kernel: 48-608 bytes by ptxas, beside the 124 registers
// the default batches take.)
__device__ __forceinline__ void em_scale_row(const int4* __restrict__ y, int4* red_row, int V, int slot, float w,
                                             unsigned mine, int lane) {
  constexpr int kU = 4;
  const int k = __ffs(mine) - 1;
  const int s = __shfl_sync(0xffffffffu, slot, k);
  const float wk = __shfl_sync(0xffffffffu, w, k);
  for (int v0 = 0; v0 < V; v0 += 32 * kU) {
    int4 x[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (v0 + u * 32 + lane < V) x[u] = ld_nc_v4(y + (size_t)s * V + v0 + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (v0 + u * 32 + lane >= V) continue;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      fma_bf16x8(acc, x[u], wk);
      red_row[v0 + u * 32 + lane] = pack_bf16x8(acc);
    }
  }
}

// Warp g of the grid takes received rows g, g + G, ...: rows with up to 4 of my experts in batches of 4 slots
// x 2 vectors, more in batches of 8 x 1. kWide (em_push 2, wide): rows of 1 slot by em_scale_row, 4 vectors a
// lane in flight where the 4 x 2 batch leaves them 2: at 4 ranks 29 % of the rows have 1 slot, so phase R's
// dependent load round trips per row fall from ~15 to ~13 (notes/KERNELS.md, "Expert-major: wide copy pass").
// Every variant runs the same fmaf chain per element (slots in k order, from 0).
template <bool kWide>
__device__ __forceinline__ void em_reduce_rows(const EpParams& p) {
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5, topk = p.topk;
  const int V = p.hidden >> 3;  // 16-byte vectors per bf16 row
  const long long n = *reinterpret_cast<volatile long long*>(p.num_recv);
  const int* em_slot = reinterpret_cast<const int*>(p.peer_base[p.rank] + p.off_em_slot);
  const float* recv_w = reinterpret_cast<const float*>(p.peer_base[p.rank] + p.off_recv_w);
  const int4* y = reinterpret_cast<const int4*>(p.peer_base[p.rank] + p.off_combine_in);
  int4* red = reinterpret_cast<int4*>(p.peer_base[p.rank] + p.off_combine_red);
  for (long long r = blockIdx.x * nwarps + (threadIdx.x >> 5); r < n; r += (long long)gridDim.x * nwarps) {
    const int slot = lane < topk ? em_slot[r * topk + lane] : -1;
    const float w = lane < topk ? recv_w[r * topk + lane] : 0.f;
    const unsigned mine = __ballot_sync(0xffffffffu, slot >= 0);
    const int n_slots = __popc(mine);  // warp-uniform
    if (kWide && n_slots == 1) {
      em_scale_row(y, red + (size_t)r * V, V, slot, w, mine, lane);
    } else if (n_slots <= 4) {
      em_reduce_row<4, 2>(y, red + (size_t)r * V, V, slot, w, mine, lane);
    } else {
      em_reduce_row<8, 1>(y, red + (size_t)r * V, V, slot, w, mine, lane);
    }
  }
}

// w(t, d) for d < N: the sum of token t's routing weights of experts on rank d (0 where it has none), in k order.
template <int N>
__device__ __forceinline__ void holder_weights(const CombineArgs& a, int t, int topk, int world, int E, float (&wd)[N]) {
#pragma unroll
  for (int d = 0; d < N; ++d) wd[d] = 0.f;
  for (int kk = 0; kk < topk; ++kk) {
    const long long e = a.topk_idx[(size_t)t * topk + kk];
    const float w = a.topk_w[(size_t)t * topk + kk];
    const int owner = (e >= 0 && e < (long long)world * E) ? (int)(e / E) : -1;
#pragma unroll
    for (int d = 0; d < N; ++d) wd[d] += owner == d ? w : 0.f;
  }
}

// One 16-byte output vector of a combine: bf16 of the fp32 sum over holders d (in rank order, fmaf from 0) of
// w[d] x vector u of holder d's row, holders without the token skipped.
template <int N, int kU>
__device__ __forceinline__ uint4 holders_sum(const int4 (&x)[N][kU], int u, const bool (&have)[N], const float (&w)[N]) {
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.f;
#pragma unroll
  for (int d = 0; d < N; ++d)
    if (have[d]) fma_bf16x8(acc, x[d][u], w[d]);
  const int4 o = pack_bf16x8(acc);
  return make_uint4(o.x, o.y, o.z, o.w);
}

// Steps 1 and 2: tell every peer my combine_in (expert-major: combine_red, filled by em_reduce_kernel before this
// kernel) is filled, wait until every peer's is.
__device__ __forceinline__ void combine_ready(const EpParams& p, int epoch) {
  if (blockIdx.x == 0 && threadIdx.x < p.world) {
    fence_acq_rel_sys();
    st_release_sys(signal_ptr(p, threadIdx.x, p.sig.ready_off + p.rank), epoch);
  }
  if (threadIdx.x < p.world) {
    wait_flag(p, signal_ptr(p, p.rank, p.sig.ready_off + threadIdx.x), epoch, threadIdx.x, kPhaseCombineReady);
  }
  __syncthreads();
}

// combine_ce, instead of steps 1 and 2: every holder d pushed its own T_d rows of my segment (the num_tokens word of
// its notify row, from the dispatch this combine follows); one that holds fewer than my T would leave rows unpushed,
// so the rank stops at once, naming it (its peers are not kept waiting: step 4 still releases my pulled flag).
__device__ __forceinline__ void combine_ce_check(const EpParams& p, int num_tokens) {
  const int d = threadIdx.x;
  if (d < p.world && d != p.rank) {
    const int td = ld_volatile(signal_ptr(p, p.rank, p.sig.notify_off + d * p.sig.notify_stride + 1 + p.world +
                                                         p.experts_per_rank));
    if (td < num_tokens) report_timeout(p.dev_error, p.host_error, p.rank, d, kPhaseCombineTokens);
  }
  __syncthreads();
}

// Expert-major phase R as its own kernel, launched on the combine's grid right before it (em_sms > 0: on em_sms
// blocks of 16 warps, the combine's warp count being set by its shared memory, which phase R does not use): its registers are
// not the pull's (inlined into combine_tma_kernel, the batched loads spilled), and the kernel boundary is
// what orders R before the ready release, so no block waits for another.
template <bool kWide>
__global__ void __launch_bounds__(512, 1) em_reduce_kernel(EpParams p) {
  if (ld_volatile(p.dev_error) != 0) return;
  em_reduce_rows<kWide>(p);
}

// Per-warp shared memory of combine_tma_kernel: S mbarriers (128 B), the token table (2 batches x 32
// tokens x world rows, then as many weights), S stages of world x kCtChunk bytes (kCtChunk 1, 2 or
// 4 KiB, EP_OPT_COMBINE_CHUNK; smaller chunks fit more warps, so more warps share the reduction).
__host__ __device__ __forceinline__ size_t ct_table_bytes(int world) { return (size_t)2 * 32 * world * 8; }
__host__ __device__ __forceinline__ size_t ct_warp_bytes(int world, int stages, int chunk) {
  return 128 + ct_table_bytes(world) + (size_t)stages * world * chunk;
}

template <int S, int kMaxWorld, int kCtChunk>
__global__ void __launch_bounds__(512, 1) combine_tma_kernel(EpParams p, CombineArgs a, int epoch) {
  extern __shared__ __align__(128) uint8_t ct_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = p.experts_per_rank;
  combine_ready(p, epoch);

  uint8_t* mine = ct_smem + (size_t)warp * ct_warp_bytes(world, S, kCtChunk);
  uint64_t* bars = reinterpret_cast<uint64_t*>(mine);
  int* trow = reinterpret_cast<int*>(mine + 128);                                 // [2][32][world]
  float* tw = reinterpret_cast<float*>(mine + 128 + ct_table_bytes(world) / 2);  // [2][32][world]
  uint8_t* stages = mine + 128 + ct_table_bytes(world);
  const int row_bytes = p.hidden * 2;
  const int nch = (row_bytes + kCtChunk - 1) / kCtChunk;
  const int g = blockIdx.x * nwarps + warp, G = gridDim.x * nwarps, T = a.num_tokens;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int ntok = (!aborted && g < T) ? (T - g + G - 1) / G : 0;  // my tokens g + k * G, k < ntok
  const long long nunits = (long long)ntok * nch;
  const size_t pull_off = p.align > 0 ? p.off_combine_red : p.off_combine_in;

  // rows of my tokens 32b .. 32b + 31 on every rank (-1: not there) and w(t, d), one lane per token
  auto fill_table = [&](int b) {
    const int k = 32 * b + lane;
    int* rr = trow + ((b & 1) * 32 + lane) * world;
    float* ww = tw + ((b & 1) * 32 + lane) * world;
    if (k >= ntok) return;
    const int t = g + k * G;
    float wd[EP_MAX_WORLD];
    holder_weights<EP_MAX_WORLD>(a, t, topk, world, E, wd);
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) {
      if (d >= world) break;
      const int slot = p.slot_map[(size_t)t * world + d];
      rr[d] = slot >= 0 ? p.base[d] + slot : -1;
      ww[d] = p.align > 0 ? 1.f : wd[d];  // expert-major: the holder applied the weights (phase R)
    }
  };
  // unit j's chunk from every holder into stage j % S; lane d < world loads holder d's (in parallel:
  // 3-7% faster at 8 SMs than lane 0 issuing them one after another), lane 0 arms the stage's barrier with the total (a
  // copy that lands before the arming only takes the transaction count below zero for a moment: the
  // phase cannot complete without lane 0's arrival).
  auto issue = [&](long long j) {
    const int k = (int)(j / nch), c = (int)(j % nch), s = (int)(j % S);
    const int* rr = trow + (((k >> 5) & 1) * 32 + (k & 31)) * world;
    const uint32_t bytes = (uint32_t)min(kCtChunk, row_bytes - c * kCtChunk);
    // No proxy fence before reusing the stage: the warp's reads of it have completed (their values were
    // consumed before the __syncwarp that precedes this call). A fence here
    // (fence.proxy.async.shared::cta) made every unit wait for the previous one's loads.
    const int my_row = lane < world ? rr[lane] : -1;
    const unsigned holders = __ballot_sync(0xffffffffu, my_row >= 0);
    if (lane == 0) mbar_expect_tx(bars + s, (uint32_t)__popc(holders) * bytes);
    if (my_row >= 0)
      bulk_load(stages + ((size_t)s * world + lane) * kCtChunk,
                p.peer_base[lane] + pull_off + (size_t)my_row * row_bytes + (size_t)c * kCtChunk, bytes,
                bars + s);
  };

  if (ntok > 0) {
    if (lane == 0) {
      for (int s = 0; s < S; ++s) mbar_init(bars + s, 1);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    fill_table(0);
    if (ntok > 32) fill_table(1);
    __syncwarp();
    for (long long j = 0; j < S && j < nunits; ++j) issue(j);
    // Reconverge before every wait: lanes 1-31 suspended in mbarrier.try_wait while lane 0 still has to
    // issue would delay the issue until the wait gives up (measured without it: ~3.4 us per unit and warp,
    // whatever S, as if one unit at a time were in flight).
    __syncwarp();
    for (long long j = 0; j < nunits; ++j) {
      const int k = (int)(j / nch), c = (int)(j % nch), s = (int)(j % S);
      if (c == 0 && (k & 31) == 0 && k > 0 && k + 32 < ntok) {
        // entering batch k / 32: every unit of the previous batch is loaded, its table half is free
        fill_table(k / 32 + 1);
        __syncwarp();
      }
      mbar_wait(bars + s, (uint32_t)((j / S) & 1));
      // The sum, with the holders unrolled (kMaxWorld) and held in registers: two vectors' loads from
      // every holder's chunk in flight before their FMAs. (A loop over world at run time,
      // reading rows and weights from shared memory inside the loop, measured ~3.4 us per unit and warp.)
      const int* rr = trow + (((k >> 5) & 1) * 32 + (k & 31)) * world;
      const float* ww = tw + (((k >> 5) & 1) * 32 + (k & 31)) * world;
      bool have[kMaxWorld];
      float wd[kMaxWorld];
      const int4* src[kMaxWorld];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        have[d] = d < world && rr[d] >= 0;
        wd[d] = d < world ? ww[d] : 0.f;
        src[d] = reinterpret_cast<const int4*>(stages + ((size_t)s * world + (d < world ? d : 0)) * kCtChunk);
      }
      const int nv = min(kCtChunk, row_bytes - c * kCtChunk) >> 4;
      const int t = g + k * G;
      uint4* dst = a.out + (size_t)t * (row_bytes >> 4) + (size_t)c * (kCtChunk >> 4);
#pragma unroll
      for (int i = 0; i < kCtChunk / 16 / 32; i += 2) {
        int4 x[kMaxWorld][2];
#pragma unroll
        for (int d = 0; d < kMaxWorld; ++d)
#pragma unroll
          for (int u = 0; u < 2; ++u)
            if (have[d] && lane + 32 * (i + u) < nv) x[d][u] = src[d][lane + 32 * (i + u)];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int v = lane + 32 * (i + u);
          if (v < nv) dst[v] = holders_sum(x, u, have, wd);
        }
      }
      __syncwarp();
      if (j + S < nunits) issue(j + S);  // warp-uniform
      __syncwarp();
    }
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

template <int C>
auto pick_combine_tma(int world, int S) -> decltype(&combine_tma_kernel<2, 4, C>) {
  if (world <= 4) return S == 2 ? combine_tma_kernel<2, 4, C> : S == 3 ? combine_tma_kernel<3, 4, C> : combine_tma_kernel<4, 4, C>;
  return S == 2 ? combine_tma_kernel<2, 8, C> : S == 3 ? combine_tma_kernel<3, 8, C> : combine_tma_kernel<4, 8, C>;
}

// Token t's row on each holder d < world (-1: no expert of the token there; rows[d] for d >= world left as they are).
// combine_ce: my combine_in row for me, row t of d's part of my staging buffer for a peer; kPull: row base[d] + slot
// of d's combine_in for every holder, as fill_table finds it.
template <bool kPull = false, int N>
__device__ __forceinline__ void ce_holder_rows(const EpParams& p, int t, int (&rows)[N]) {
#pragma unroll
  for (int d = 0; d < N; ++d) {
    if (d >= p.world) break;
    const int slot = p.slot_map[(size_t)t * p.world + d];
    rows[d] = slot < 0 ? -1 : kPull || d == p.rank ? p.base[d] + slot : t;
  }
}

// combine_ce's sum (see the header): warp g takes my tokens g, g + G, ..., 32 at a time: lane i first finds token i's
// row on each holder (-1: no expert of the token there; my combine_in row for me, the token's row of my staging
// buffer for a peer) and w(t, d), as fill_table does (one lane per token, so the metadata's load latency is paid once
// per 32 tokens, not per token). Then, token by token, lane d waits for holder d's chunk flag the first time the warp
// needs that chunk (a warp's tokens only grow) and __syncwarp orders that acquire before every lane's loads of the
// row; the row is summed kU vectors a lane at a time, every holder's kU loads issued before the FMAs, holders in
// rank order from 0 with fmaf from 0 (combine_tma_kernel's chain: the same bits), and stored bf16 into out[t].
template <int kMaxWorld, int kU>
__global__ void __launch_bounds__(512, 1) combine_ce_kernel(EpParams p, CombineArgs a, int epoch) {
  combine_ce_check(p, a.num_tokens);
  const int lane = threadIdx.x & 31, world = p.world, topk = p.topk, E = p.experts_per_rank, me = p.rank;
  const int G = gridDim.x * (blockDim.x >> 5), T = ld_volatile(p.dev_error) != 0 ? 0 : a.num_tokens;
  const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int ntok = g < T ? (T - g + G - 1) / G : 0;  // my tokens g + k G, k < ntok
  const int V = p.hidden >> 3;  // 16-byte vectors per bf16 row
  const size_t rb = (size_t)p.hidden * 2;
  const uint8_t* own = p.peer_base[me] + p.off_combine_in;
  const uint8_t* stage = p.peer_base[me] + p.off_combine_stage;
  int seen = -1;  // lane d: the last chunk of holder d seen pushed
  for (int k0 = 0; k0 < ntok; k0 += 32) {
    int rows[kMaxWorld];
    float ws[kMaxWorld];
#pragma unroll
    for (int d = 0; d < kMaxWorld; ++d) rows[d] = -1, ws[d] = 0.f;
    if (k0 + lane < ntok) {
      const int t = g + (k0 + lane) * G;
      holder_weights<kMaxWorld>(a, t, topk, world, E, ws);
      ce_holder_rows(p, t, rows);
    }
    const int nb = min(32, ntok - k0);
    for (int i = 0; i < nb; ++i) {
      const int t = g + (k0 + i) * G;
      const int4* src[kMaxWorld];
      float wd[kMaxWorld];
      bool wait_here = false;
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        const int r = __shfl_sync(0xffffffffu, rows[d], i);
        wd[d] = __shfl_sync(0xffffffffu, ws[d], i);
        src[d] = r < 0 ? nullptr
                       : reinterpret_cast<const int4*>(d == me ? own + (size_t)r * rb
                                                               : stage + ((size_t)d * p.max_tokens + r) * rb);
        wait_here |= d == lane && d != me && r >= 0;
      }
      if (wait_here && t >= p.ce_bound[seen + 1]) {  // given up: the sum reads stale rows, the host raises the timeout
        seen = ce_chunk_from(p, t, seen < 0 ? 0 : seen);
        wait_flag(p, signal_ptr(p, me, p.sig.cstage_off + lane * kCeChunks + seen), epoch, lane, kPhaseCombineStaged);
      }
      __syncwarp();
      bool have[kMaxWorld];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) have[d] = src[d] != nullptr;
      uint4* dst = a.out + (size_t)t * V;
      for (int v0 = 0; v0 < V; v0 += 32 * kU) {
        int4 x[kMaxWorld][kU];
#pragma unroll
        for (int d = 0; d < kMaxWorld; ++d)
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (src[d] != nullptr && v0 + u * 32 + lane < V) x[d][u] = ld_v4_na(src[d] + v0 + u * 32 + lane);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int v = v0 + u * 32 + lane;
          if (v < V) dst[v] = holders_sum(x, u, have, wd);
        }
      }
    }
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

// combine_ce at 3-4 ranks: the same sum (holders in rank order from 0, w(t, d), fmaf from 0: the same bits) with
// every holder's piece brought into shared memory by TMA bulk copies, in kCbPairs pairs of warps a block, as the
// local-sum ceiling's bulk shape (csrc/ceiling.cu sum_bulk_kernel): summing 3-4 rows a token, register loads ran
// slower than their own loads and stores timed apart, the pairs 17-30 % faster (python -m epbench.smmem, one H200,
// 2026-11-27). Pair l of block b takes tokens P, P + G, ... (P = b * kCbPairs + l, G = gridDim.x * kCbPairs), a
// unit being one kCbPiece piece of a token's row: the loader (warp l) finds each token's holders 32 tokens at a
// time (lane i token i), lane d waits once per chunk for holder d's flag (a peer's), then lane d loads holder d's
// piece (my combine_in for me, my staging buffer for a peer) into slot j of the pair's stage (j: d's place among
// the token's holders), lane 0 arming the stage with the pieces' bytes; each summer (warps kCbPairs + l, 2 kCbPairs + l, ...) finds the
// same holders and weights, sums the stage's n pieces (n a constant in its loop) and stores them, then frees the
// stage. kCbStages stages a pair; kCbSummers summers a pair (summer s: vectors lane + 32 (s + kCbSummers i) of each piece,
// the stage freed when all have arrived), as the ceiling's kBsSummers (72 registers a thread, no spill, at 896
// threads). At <= 2 ranks a token has at most 2 holders, so a stage holds 2 pieces and a pair has 4 stages in the
// same shared memory (kCbHolders2, kCbStages2): the pull at 2 ranks and 8 SMs took 319 -> 236 us (dsv3x2), 383 -> 273
// (h8192x2), 230 -> 170 (qwen3 shape), a stage's load over the link (~1.6 us) outlasting its sum (~0.6) and 2 stages
// not hiding it (4 x H200, 2026-11-27, notes/LATENCY-NEXT.md "4 stages of 2 holders at 2 ranks").
constexpr int kCbPiece = 3584;  // bytes of a piece: a quarter of a 7168-wide bf16 row, 7 vectors a lane
constexpr int kCbPairs = 7;     // 7 pairs x 2 stages x 4 holders x 3.5 KiB = 196 KiB of shared memory a block
constexpr int kCbStages = 2;    // a pair's stages at 3-4 ranks: one summed while the other loads
constexpr int kCbHolders = 4;
constexpr int kCbStages2 = 4;   // ... and at <= 2 ranks, of kCbHolders2 pieces each
constexpr int kCbHolders2 = 2;
static_assert(kCbStages2 * kCbHolders2 == kCbStages * kCbHolders, "both shapes fill the same shared memory");
constexpr int kCbSummers = 3;
constexpr int kCbThreads = kCbPairs * 32 * (1 + kCbSummers);

__host__ __device__ __forceinline__ size_t cb_smem_bytes() { return (size_t)kCbPairs * kCbStages * kCbHolders * kCbPiece; }

// n pieces (slots 0..kN-1 of a stage, kCbPiece bytes apart) weighted by w[0..kN-1] in order, stored bf16 at dst:
// summer s's share of the vectors. fold (the counting instantiation under EP_OPT_CB_SKIP's kCbSkipStores): the sums
// XOR-folded into the value returned instead of stored (0 returned otherwise); regs too (kCbSkipSmem): the pieces'
// words made in registers from the vector's index (4 integer ops a row for its 16-byte shared-memory load), not read.
template <int kN, bool kRegs = false>
__device__ __forceinline__ unsigned cb_sum_piece(uint4* dst, const int4* x0, const float (&w)[kCbHolders], int nv,
                                                 int lane, int s, bool fold = false) {
  unsigned folded = 0;
#pragma unroll
  for (int i = 0; i < ((kCbPiece >> 4) + 32 * kCbSummers - 1) / (32 * kCbSummers); ++i) {
    const int v = lane + 32 * (s + kCbSummers * i);
    if (v >= nv) break;
    int4 x[kN > 0 ? kN : 1];
#pragma unroll
    for (int h = 0; h < kN; ++h)
      x[h] = kRegs ? make_int4(v ^ (0x3f803f80 + h), v ^ (0x3c003c00 + h), v ^ (0x40404040 + h), v ^ (0x3e003e00 + h))
                  : x0[h * (kCbPiece >> 4) + v];
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int h = 0; h < kN; ++h) fma_bf16x8(acc, x[h], w[h]);
    const int4 o = pack_bf16x8(acc);
    if (fold)
      folded ^= (unsigned)(o.x ^ o.y ^ o.z ^ o.w);
    else
      dst[v] = make_uint4(o.x, o.y, o.z, o.w);
  }
  return folded;
}

// cb_sum_piece<n, kRegs> for a token's n holders (0..kCbHolders), n made a constant by one switch.
template <bool kRegs>
__device__ __forceinline__ unsigned cb_sum_n(int n, uint4* dst, const int4* x0, const float (&w)[kCbHolders], int nv,
                                             int lane, int s, bool fold) {
  switch (n) {
    case 0: return cb_sum_piece<0, kRegs>(dst, x0, w, nv, lane, s, fold);
    case 1: return cb_sum_piece<1, kRegs>(dst, x0, w, nv, lane, s, fold);
    case 2: return cb_sum_piece<2, kRegs>(dst, x0, w, nv, lane, s, fold);
    case 3: return cb_sum_piece<3, kRegs>(dst, x0, w, nv, lane, s, fold);
    default: return cb_sum_piece<4, kRegs>(dst, x0, w, nv, lane, s, fold);
  }
}

// kDirect (pull_kernel bulk): the same loaders and summers pulling every holder's row straight from its combine_in
// over the link, after steps 1-2 (combine_ready), as combine_tma_kernel does: no push, no staging, no chunk flags.
// kWaits (debug stamps on; its own instantiation, the other unchanged): each warp counts the clock64 cycles of its
// waits, its work (a loader's issue of a unit's copies, a summer's sum, stores and release of a stage), its
// preparation (the batch's holder lookups and each token's holders), its start (the bulk pull's ready handshake or
// the ce path's token check, to the block barrier) and its whole run into p.stamps[kStampCb*] (where a 4-SM bulk
// pull loses against the local sum); there EP_OPT_CB_SKIP may leave the summers' stores out (kCbSkipStores: the
// sums XOR-folded into kStampCbFold), their shared-memory reads too (kCbSkipSmem: the same sums of words made in
// registers) or their reads and sums too (kCbSkipReads: a full stage freed at once), to time the loaders' copies
// with and without the rest (outputs unwritten; never in a verified call). kH pieces a stage
// (at least the token's holders), kS stages a pair.
template <bool kDirect, bool kWaits = false, int kH = kCbHolders, int kS = kCbStages>
__global__ void __launch_bounds__(kCbThreads, 1) combine_ce_bulk_kernel(EpParams p, CombineArgs a, int epoch) {
  const long long t_start = kWaits ? clock64() : 0;
  long long t_wait = 0;
  unsigned t_prep = 0, t_work = 0;  // kWaits: cycles by kind (see the stamps; 32 bits: a warp's ~2 s at most)
  extern __shared__ __align__(128) uint8_t cb_ring[];
  __shared__ uint64_t full[kCbPairs * kS], empty[kCbPairs * kS];
  __shared__ int aborted;  // read once for the block: a pair's two warps must agree on their units
  if (kDirect) {
    combine_ready(p, epoch);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk copies read what the peers' release published
  } else {
    combine_ce_check(p, a.num_tokens);
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, l = w % kCbPairs;
  const bool loader = w < kCbPairs;
  const int sw = loader ? 0 : (w - kCbPairs) / kCbPairs;  // a summer's share
  const int world = p.world, topk = p.topk, E = p.experts_per_rank, me = p.rank;
  const int P = blockIdx.x * kCbPairs + l, G = gridDim.x * kCbPairs;
  const int row_bytes = p.hidden * 2, V = p.hidden >> 3;
  const int pieces = (row_bytes + kCbPiece - 1) / kCbPiece;
  const size_t rb = (size_t)row_bytes;
  const uint8_t* own = p.peer_base[me] + p.off_combine_in;
  const uint8_t* staged = p.peer_base[me] + p.off_combine_stage;
  const int skip = kWaits ? p.cb_skip : 0;  // measuring aid: only the counting instantiation reads it
  unsigned fold = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kCbPairs * kS; ++s) mbar_init(full + s, 1), mbar_init(empty + s, kCbSummers);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    aborted = ld_volatile(p.dev_error) != 0;
  }
  __syncthreads();
  if (kWaits && lane == 0)  // added now, not held in a register to the end (the ce instantiation spilled)
    atomicAdd(p.stamps + kStampCbReady, (unsigned long long)(clock64() - t_start));
  const int T = aborted ? 0 : a.num_tokens;
  const int ntok = P < T ? (T - P + G - 1) / G : 0;  // the pair's tokens P + k G, k < ntok
  int seen = -1;     // loader lane d: the last chunk of holder d seen pushed
  uint32_t j = 0;    // the pair's units so far: stage j % kS, lap j / kS
  for (int k0 = 0; k0 < ntok; k0 += 32) {
    long long t_prep0 = kWaits ? clock64() : 0;  // the batch's lookups, then each token's holders up to its flag wait
    int rows[kH];
    float ws[kH];
#pragma unroll
    for (int d = 0; d < kH; ++d) rows[d] = -1, ws[d] = 0.f;
    if (k0 + lane < ntok) {
      const int t = P + (k0 + lane) * G;
      if (!loader) holder_weights<kH>(a, t, topk, world, E, ws);
      ce_holder_rows<kDirect>(p, t, rows);
    }
    const int nb = min(32, ntok - k0);
    for (int i = 0; i < nb; ++i) {
      if (kWaits && i > 0) t_prep0 = clock64();
      const int t = P + (k0 + i) * G;
      float wd[kCbHolders] = {0.f, 0.f, 0.f, 0.f};
      int n = 0, my_slot = -1, my_row = -1;  // the token's holders; lane d's place among them and its row
#pragma unroll
      for (int d = 0; d < kH; ++d) {
        const int rd = __shfl_sync(0xffffffffu, rows[d], i);
        const float wv = __shfl_sync(0xffffffffu, ws[d], i);
        if (rd >= 0) {
          if (d == lane) my_slot = n, my_row = rd;
#pragma unroll
          for (int h = 0; h < kCbHolders; ++h)
            if (h == n) wd[h] = wv;  // compacted in rank order (no array indexed at run time: registers)
          ++n;
        }
      }
      if (kWaits) {
        __syncwarp();
        t_prep += (unsigned)(clock64() - t_prep0);
      }
      const long long t_flag = kWaits ? clock64() : 0;
      if (!kDirect && loader && lane < world && lane != me && my_row >= 0 && t >= p.ce_bound[seen + 1]) {
        // given up: the sum reads stale rows, the host raises the timeout
        seen = ce_chunk_from(p, t, seen < 0 ? 0 : seen);
        wait_flag(p, signal_ptr(p, me, p.sig.cstage_off + lane * kCeChunks + seen), epoch, lane, kPhaseCombineStaged);
        asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk copies below read what the flag published
      }
      if (kWaits && !kDirect && loader) {
        __syncwarp();
        t_wait += clock64() - t_flag;
      }
      if (loader) __syncwarp();
      for (int q = 0; q < pieces; ++q, ++j) {
        const int bytes = min(kCbPiece, row_bytes - q * kCbPiece);
        const int st = l * kS + (int)(j % kS);
        const uint32_t lap = j / kS;
        uint8_t* stage = cb_ring + (size_t)st * kH * kCbPiece;
        if (loader) {
          const long long t_arm = kWaits ? clock64() : 0;
          ring_stage_arm(full, empty, st, lap, lane, (uint32_t)(n * bytes));  // after the summers freed its last unit
          const long long t_issue = kWaits ? clock64() : 0;
          if (kWaits) t_wait += t_issue - t_arm;
          if (my_slot >= 0) {
            const uint8_t* src = kDirect       ? p.peer_base[lane] + p.off_combine_in + (size_t)my_row * rb
                                 : lane == me ? own + (size_t)my_row * rb
                                              : staged + ((size_t)lane * p.max_tokens + my_row) * rb;
            bulk_load(stage + (size_t)my_slot * kCbPiece, src + (size_t)q * kCbPiece, (uint32_t)bytes, full + st);
          }
          __syncwarp();
          if (kWaits) t_work += (unsigned)(clock64() - t_issue);
          continue;
        }
        const long long t_full = kWaits ? clock64() : 0;
        mbar_wait(full + st, lap & 1u);
        const long long t_sum = kWaits ? clock64() : 0;
        if (kWaits) t_wait += t_sum - t_full;
        const int4* x0 = reinterpret_cast<const int4*>(stage);
        uint4* dst = a.out + (size_t)t * V + (size_t)q * (kCbPiece >> 4);
        const int nv = (kWaits && (skip & kCbSkipReads)) ? 0 : bytes >> 4;
        // the holder count a constant in the loop; the measuring aid's smem mode (register words) an instantiation
        // of its own (one loop choosing per word spilled)
        fold ^= (kWaits && (skip & kCbSkipSmem))
                    ? cb_sum_n<kWaits>(n, dst, x0, wd, nv, lane, sw, true)
                    : cb_sum_n<false>(n, dst, x0, wd, nv, lane, sw, kWaits && (skip & kCbSkipStores));
        __syncwarp();  // the warp's reads of the stage are done (their values consumed) before it is freed
        if (lane == 0) mbar_arrive(empty + st);
        if (kWaits) t_work += (unsigned)(clock64() - t_sum);
      }
    }
  }
  if (kWaits && lane == 0) {
    unsigned long long* s = p.stamps;
    atomicAdd(s + (loader ? kStampCbLoaderWait : kStampCbSummerWait), (unsigned long long)t_wait);
    atomicAdd(s + (loader ? kStampCbLoaderBusy : kStampCbSummerBusy), (unsigned long long)(clock64() - t_start));
    if (loader) atomicAdd(s + kStampCbUnits, (unsigned long long)j);
    atomicAdd(s + (loader ? kStampCbLoaderPrep : kStampCbSummerPrep), (unsigned long long)t_prep);
    atomicAdd(s + (loader ? kStampCbLoaderIssue : kStampCbSummerSum), (unsigned long long)t_work);
  }
  if (kWaits && (skip & (kCbSkipStores | kCbSkipSmem)) && !loader) {
    for (int o = 16; o > 0; o >>= 1) fold ^= __shfl_xor_sync(0xffffffffu, fold, o);
    if (lane == 0) atomicXor(p.stamps + kStampCbFold, (unsigned long long)fold);
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

// Debug stamps on: the bulk kernel's wait counters zeroed on `stream` before its launch, and true (the counting
// instantiation runs); off: false.
bool cb_waits_zeroed(const EpParams& p, cudaStream_t stream) {
  if (p.stamps == nullptr) return false;
  CUDA_CHECK(cudaMemsetAsync(p.stamps + kStampCbLoaderWait, 0,
                             (kStampCbFold + 1 - kStampCbLoaderWait) * sizeof(unsigned long long), stream));
  return true;
}

// The copy streams combine_ce's push forks, uses and joins: ce_streams a peer at 2 ranks, ce_streams in all at 3 or
// more (chunk c's copies to every peer on stream c % ce_streams, in ring order).
int ce_push_streams(const EpContext* ctx) {
  return ctx->p.world > 2 ? ctx->ce_streams_used : ctx->ce_streams_used * (ctx->p.world - 1);
}

// combine_ce: my combine_in rows of each peer s (rows [s * max_tokens, + num_tokens)) into s's staging buffer at rows
// [me * max_tokens, ...), chunk by chunk (at 2 ranks on the peer's ce_streams streams in turn; at 3+ chunk-major in
// ring order, chunk c's copies on stream c % ce_streams; forked from `stream` here: after my caller filled combine_in), each chunk
// followed by its flag cstage[me][c] in s's signals. *pushed: whether the streams forked
// (the caller joins them after the kernel). Nothing after a wait of mine has timed out (no peer waits correctly then).
int push_rows_by_ce(EpContext* ctx, int num_tokens, int epoch, cudaStream_t stream, bool* pushed) {
  const EpParams& p = ctx->p;
  *pushed = false;
  if (p.world == 1 || num_tokens == 0 || ctx->host_error->flag) return 0;
  const size_t rb = (size_t)p.hidden * 2, T = (size_t)num_tokens;
  // chunk c of peer i: stream i + (c % per_peer) (world - 1) at 2 ranks, c % per_peer at 3+
  const int per_peer = ctx->ce_streams_used, nstreams = ce_push_streams(ctx);
  CUDA_CHECK(cudaEventRecord(ctx->ce_fork, stream));
  for (int i = 0; i < nstreams; ++i) CUDA_CHECK(cudaStreamWaitEvent(ctx->ce_streams[i], ctx->ce_fork, 0));
  *pushed = true;
  bool failed = false;
  for (int c = 0; c < kCeChunks && (size_t)p.ce_bound[c] < T && !failed; ++c) {  // chunk c to every peer, then c + 1
    const size_t r0 = (size_t)p.ce_bound[c], n = std::min((size_t)p.ce_bound[c + 1], T) - r0;
    for (int i = 0; i + 1 < p.world; ++i) {
      const int s = (p.rank + 1 + i) % p.world;
      // 3+ ranks: chunk-major in ring order, a chunk's copies on one stream (a GPU's copy engine runs its copies one
      // at a time; streams of their own per peer made two holders write one destination at once,
      // notes/LATENCY-NEXT.md); chunks alternating over ce_streams streams so a chunk's flag writes overlap the next's copies
      cudaStream_t cs = p.world > 2 ? ctx->ce_streams[c % per_peer] : ctx->ce_streams[i + (c % per_peer) * (p.world - 1)];
      CUDA_CHECK(cudaMemcpyAsync(p.peer_base[s] + p.off_combine_stage + ((size_t)p.rank * p.max_tokens + r0) * rb,
                                 p.peer_base[p.rank] + p.off_combine_in + ((size_t)s * p.max_tokens + r0) * rb, n * rb,
                                 cudaMemcpyDefault, cs));
      int* flag = reinterpret_cast<int*>(p.peer_base[s] + p.off_signals) + p.sig.cstage_off + p.rank * kCeChunks + c;
      const int rc = ctx->write_value32(cs, (unsigned long long)(uintptr_t)flag, (unsigned)epoch, 0);
      if (rc != 0) {
        ep_set_error("combine_ce: cuStreamWriteValue32 into rank %d's chunk flag failed (CUresult %d)", s, rc);
        failed = true;  // the streams still join `stream` below: nothing of this call is left running unjoined
        break;
      }
    }
  }
  for (int i = 0; i < nstreams; ++i) CUDA_CHECK(cudaEventRecord(ctx->ce_done[i], ctx->ce_streams[i]));
  if (failed) {  // joined here: the caller returns before its own join
    for (int i = 0; i < nstreams; ++i) CUDA_CHECK(cudaStreamWaitEvent(stream, ctx->ce_done[i], 0));
    return -1;
  }
  return 0;
}

}  // namespace

extern "C" int ep_combine(void* vctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens,
                          int num_sms, int warps, int epoch, void* vstream) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  cudaStream_t stream = (cudaStream_t)vstream;
  if (ep_check_call(ctx, num_tokens, num_sms, warps, 16) != 0) return -1;
  CUDA_CHECK(cudaSetDevice(ctx->device));
  CombineArgs a;
  a.out = (uint4*)out;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  if (p.combine_ce) {
    bool pushed = false;  // the peers' rows by copy engines, the sum from local memory in registers (see the header)
    if (push_rows_by_ce(ctx, num_tokens, epoch, stream, &pushed) != 0) return -1;
    int wc = std::min(warps, 16);
    if (p.world <= 2) {
      combine_ce_kernel<2, 8><<<num_sms, wc * 32, 0, stream>>>(p, a, epoch);
    } else if (p.world <= kCbHolders && (size_t)ctx->max_smem_optin >= cb_smem_bytes()) {
      auto kernel = cb_waits_zeroed(p, stream) ? combine_ce_bulk_kernel<false, true> : combine_ce_bulk_kernel<false, false>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cb_smem_bytes()));
      wc = kCbThreads / 32;
      kernel<<<num_sms, kCbThreads, cb_smem_bytes(), stream>>>(p, a, epoch);
    } else if (p.world <= 4) {
      combine_ce_kernel<4, 4><<<num_sms, wc * 32, 0, stream>>>(p, a, epoch);
    } else {
      combine_ce_kernel<8, 1><<<num_sms, wc * 32, 0, stream>>>(p, a, epoch);
    }
    CUDA_CHECK(cudaGetLastError());
    for (int i = 0; pushed && i < ce_push_streams(ctx); ++i)
      CUDA_CHECK(cudaStreamWaitEvent(stream, ctx->ce_done[i], 0));
    ep_effective& eff = ctx->effective;
    eff.combine_impl = EP_COMBINE_CE;
    eff.combine_warps = wc;
    eff.combine_sms = num_sms;
    eff.combine_stages = 0;
    eff.combine_chunk = 0;
    eff.combine_em_wide = false;
    return 0;
  }
  const bool bulk = ctx->pull_bulk == 1 ||
                    (ctx->pull_bulk == 2 && ep_pull_auto(p.world, num_sms, p.align) &&
                     (size_t)ctx->max_smem_optin >= cb_smem_bytes());
  if (bulk) {  // EP_OPT_PULL_KERNEL 1 (or 2 where chosen): the loaders / summers pulling over the link (rank-major, world <= 4)
    if (p.world > kCbHolders || p.align > 0 || (size_t)ctx->max_smem_optin < cb_smem_bytes()) {
      ep_set_error("combine: pull_kernel bulk takes rank-major rows at <= %d ranks with %zu bytes of shared memory "
                   "(world %d, align %d, %d bytes)", kCbHolders, cb_smem_bytes(), p.world, p.align,
                   ctx->max_smem_optin);
      return -1;
    }
    const bool waits = cb_waits_zeroed(p, stream), two = p.world <= kCbHolders2;  // two: 2 holders a stage, 4 stages
    auto kernel = two ? (waits ? combine_ce_bulk_kernel<true, true, kCbHolders2, kCbStages2>
                               : combine_ce_bulk_kernel<true, false, kCbHolders2, kCbStages2>)
                      : (waits ? combine_ce_bulk_kernel<true, true> : combine_ce_bulk_kernel<true, false>);
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cb_smem_bytes()));
    kernel<<<num_sms, kCbThreads, cb_smem_bytes(), stream>>>(p, a, epoch);
    CUDA_CHECK(cudaGetLastError());
    ep_effective& eff = ctx->effective;
    eff.combine_impl = EP_COMBINE_BULK;
    eff.combine_warps = kCbThreads / 32;
    eff.combine_sms = num_sms;
    eff.combine_stages = two ? kCbStages2 : kCbStages;
    eff.combine_chunk = kCbPiece;
    eff.combine_em_wide = false;
    return 0;
  }
  // as many warps (up to `warps`) as the per-warp stages fit in shared memory; none fitting is an error
  const int S = ctx->combine_stages, C = ctx->combine_chunk;
  const int fit = (int)((size_t)ctx->max_smem_optin / ct_warp_bytes(p.world, S, C));
  const int w = std::min(warps, fit);
  if (w < 1) {
    ep_set_error("combine: %d stages of %d x %d bytes do not fit in %d bytes of shared memory", S, p.world, C,
                 ctx->max_smem_optin);
    return -1;
  }
  const size_t smem = (size_t)w * ct_warp_bytes(p.world, S, C);
  auto kernel = pick_combine_tma<4096>(p.world, S);
  if (C == 2048) kernel = pick_combine_tma<2048>(p.world, S);
  if (C == 1024) kernel = pick_combine_tma<1024>(p.world, S);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  if (p.align > 0 && num_sms > 0) {  // phase R (expert-major), stream-ordered before the pull
    // em_sms: phase R on blocks of its own count, 16 warps each (its launch bound)
    const int blocks = p.em_sms > 0 ? p.em_sms : num_sms, threads = p.em_sms > 0 ? 512 : w * 32;
    if (p.em_push >= 2)  // wide or auto: the batches sized to each row's slots
      em_reduce_kernel<true><<<blocks, threads, 0, stream>>>(p);
    else
      em_reduce_kernel<false><<<blocks, threads, 0, stream>>>(p);
    CUDA_CHECK(cudaGetLastError());
  }
  kernel<<<num_sms, w * 32, smem, stream>>>(p, a, epoch);
  CUDA_CHECK(cudaGetLastError());
  ep_effective& eff = ctx->effective;
  eff.combine_impl = EP_COMBINE_TMA;
  eff.combine_warps = w;
  eff.combine_sms = num_sms;
  eff.combine_stages = S;
  eff.combine_chunk = C;
  eff.combine_em_wide = p.align > 0 && p.em_push >= 2;
  return 0;
}
