// Low-latency dispatch (staged): one kernel, a send phase then a receive phase; no layout
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
// my dispatch n (the only reader of stage / cnt) and my combine n push phase (of tmap / tw). With
// dispatch_place slot a source writes rows into my x slots too, by the same argument only once my
// combine n has pushed: dispatch n's x stays valid until this rank's combine n (not its dispatch n + 1).
// With dispatch_place inline a source writes its slot words into my lstage for every token, hit or not: one with no
// token for me in call n may write n + 1's before I read n's, and I then read "no slot" (n) or a later epoch (n + 1),
// both "not mine", as they are; one with a token for me waits, as above, for my combine n before its dispatch n + 1.
//
// Token sync (ll_sync = token, ll_dispatch_token_kernel; LlContext::sync): no grid-wide step.
//   epoch: block b reads eslots[0][b] + 1 and at its end stores it into slots b, b + G, ... (G = grid
//      size), so every slot agrees after a launch whatever grid the next launch has.
//   stage: every block stages topk_idx in shared memory and builds, redundantly and identically, the
//      per-(chunk of 32 tokens, global expert) token masks (shared atomicOr, bit = token in its chunk)
//      and a totals row: token t's slot j for expert e = popcounts of e's masks of earlier chunks +
//      those of t's own chunk below t (token_rank: per lane, no ballot, no loop over topk). Slots are
//      the contract's (base.py ll_slots).
//      Block 0 stores dwords[me][E] = (epoch << 32) | kind bits | T on every peer first (bit 31 dispatch_units
//      chunk, bit 30 dispatch_place slot, bit 29 inline, bit 28 line; a receiver of another kind reports kPhaseLlUnitsMismatch or
//      kPhaseLlPlaceMismatch), then dwords[me][le] =
//      (epoch << 32) | rows for its expert le (strong relaxed stores: each word carries its epoch).
//   send: per token nx x ng own-chunk units (chunk of kS x 32 vectors straight into the slots of my
//      experts k with k % ng == g, ng = how many times the units fit the warps, 1..topk, so a small
//      batch's stores spread over many SMs; scales and pair; tmap / tw of those experts with the first
//      chunk; no stage, no flag: kernel completion orders them for the caller and for combine) and
//      one unit per peer d: if t has an
//      expert on d, its row into stage[me, t] on d (dispatch_place slot: into the slot of t's first expert on
//      d, with its scales and pair entry), tmap / tw for those experts; then __syncwarp and
//      lane 0 stores tflags[me, t] on d = (epoch << 32) | hit with st.release.sys (hit 0: relaxed,
//      nothing behind it), so d can wait for every token of every source. With dispatch_units chunk
//      (LlDispatchUnits) a peer unit is (token, peer, chunk c of kS x 32 vectors): chunk c of the row into
//      stage[me, t] on d (chunk 0 also the scales), tmap / tw of t's experts on d (every chunk unit
//      stores the same entries, so each flag covers them), then tflags[me, t, c] as above; the units of
//      a token go peer-minor (consecutive units, different peers).
//   receive (no block barrier): lane s < world of every receiving warp (and of each block's warp 0) waits
//      (bounded) for dwords[s][E] of this epoch (T_s) and the warp sums them over its lanes; small batches are
//      received by the warps that hold no send unit, right after their stage, else by every warp after its
//      own sends; block 0 waits for the count words and writes counts / src_counts / src_tokens; unit (source
//      s, token t < T_s, chunk c): lane 0 acquires tflags[s, t, 0] (row units) or [s, t, c] (chunk
//      units), a __syncwarp orders the other lanes' later loads of tmap and the row after it, then the
//      warp copies chunk c as the grid path does.
//   dispatch_place inline (LlDispatchPlace, kernel instantiation kWords 1): a peer unit stores, into lstage[me, t]
//      on d, t's slot words (one per expert, kLlNoSlot when not d's), weight and scale words and its row (chunk)
//      as inline words (LlInlineRow, ll_common.cuh), every 4 bytes beside the epoch; no tmap / tw, no fence, no
//      flag. The receive unit (s, t, c) waits for the slot words, then for its chunk's words, copies the chunk into
//      each of its slots and writes its own tmap / tw / pair entries. T word bit 29.
//   dispatch_place line (kWords 2, row units only): the inline head words, then the row as 64-byte lines of 56
//      bytes and an epoch tag in lline (LlLineRow; send_line / receive_line); the receive unit (s, t, c) takes
//      batch c of 8 x kLinePasses lines once the warp has seen every tag of it current. T word bit 28.
//   dispatch_place line128 (kWords 3): the same with 128-byte lines of 120 bytes, each batch of 4 x kLinePasses
//      loaded once more after its tags were current (LlLineRow<128>::kReread). T word bit 27.
//   Measuring aid: LlParams::probe_skip (0 unless epbench probe asks) leaves out the own-row units, the
//   receive copies, the small stores beside a peer row or the fence before a peer row's flag (LlProbeSkip,
//   ll_common.cuh); outputs then wrong.
//   Units are dealt block-major (unit u -> block u % blocks), so a few units land on as many SMs:
//   a warp's send is bound by what its SM stores (measured: notes/LATENCY.md).
//   Memory model: a unit's lanes store, then bar.warp.sync (which orders the participating threads'
//   memory accesses), then lane 0's st.release.sys; release is cumulative over what precedes it in
//   causality order, so the receiver's ld.acquire.sys that reads the flag sees every lane's stores;
//   on the receiver, lane 0's acquire, then bar.warp.sync, then the other lanes' loads: they see them too.
//   A flag, T word or count word of a LATER epoch than mine (32-bit wrap-safe compare) means the
//   source already began dispatch n + 1, so it finished combine n; had any of its tokens hit me in n,
//   that combine would have waited for my partial, which I push only after this dispatch n ends.
//   So nothing of it is mine in n: treat as no hit / 0 tokens / 0 rows. The same argument makes reuse
//   safe: a source overwrites my stage / tmap / tw / tflags for n + 1 only after its combine n, which
//   (for every token that hit me) waited for my combine n's flag, released after my reads of them.
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
constexpr int kS = kLlRowChunkV;  // 16-byte vectors per lane in a scatter unit's chunk (and a chunk peer unit's)

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

// A row's fp8 scales copied into several slots: the first 128 are loaded once into registers (4 per
// lane) before the slots' stores, so no store waits for a load of its own: the compiler cannot move a
// load across stores that may alias it, so a load inside the slot loop would add two dependent round
// trips per slot (notes/LATENCY.md, RowScales).
struct RowScales {
  static constexpr int kRegs = 4;
  float v[kRegs];
  __device__ __forceinline__ void load(const float* src, int ns, int lane) {
#pragma unroll
    for (int q = 0; q < kRegs; ++q)
      if (lane + 32 * q < ns) v[q] = src[lane + 32 * q];
  }
  __device__ __forceinline__ void store(float* dst, const float* src, int ns, int lane) const {
#pragma unroll
    for (int q = 0; q < kRegs; ++q)
      if (lane + 32 * q < ns) dst[lane + 32 * q] = v[q];
    for (int i = 32 * kRegs + lane; i < ns; i += 32) dst[i] = src[i];  // hidden > 16384 only
  }
};

// Receive unit (source s, token t, chunk c of kS x 32 vectors): lane k < topk reads tmap[s, t, k]
// (another epoch: that expert is not mine) and the warp copies chunk c of stage[s, t] into x at
// each valid slot (for c = 0 also the scales and pair = t * topk + k). Both syncs. from_slot (token
// sync, dispatch_place slot): the source put the row, its scales and its pair entry straight into the
// slot of the lowest valid lane's expert; the warp copies chunk c from there into the other valid slots.
__device__ __forceinline__ void place_staged_chunk(const EpParams& p, const LlParams& lp, int s, int t, int c,
                                                   int epoch, int lane, bool from_slot = false) {
  const int topk = p.topk, ns = p.num_scales, V = p.row_bytes >> 4;
  const uint8_t* mybase = p.peer_base[p.rank];
  const unsigned long long* tmap = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tmap);
  uint8_t* xr = p.peer_base[p.rank] + lp.off_x;
  float* xs = reinterpret_cast<float*>(p.peer_base[p.rank] + lp.off_scales);
  int* pair = reinterpret_cast<int*>(p.peer_base[p.rank] + lp.off_pair);
  const size_t srow = (size_t)s * lp.t_max + t;
  unsigned long long ent = 0;
  if (lane < topk) ent = tmap[srow * topk + lane];
  const bool valid = lane < topk && (int)(ent >> 32) == epoch;
  const unsigned mask = __ballot_sync(0xffffffffu, valid);
  if (mask == 0) return;  // no expert of this token here (warp-uniform)
  const int slot = valid ? (int)(ent & 0xffffffffu) : 0;
  const int first = __ffs(mask) - 1;
  const size_t fslot = from_slot ? (size_t)__shfl_sync(0xffffffffu, slot, first) : 0;  // from_slot: warp-uniform
  const unsigned todo0 = from_slot ? mask & (mask - 1) : mask;  // slot placement: the first slot holds it already
  if (todo0 == 0) return;  // warp-uniform
  const int4* src = reinterpret_cast<const int4*>(
      from_slot ? xr + fslot * p.row_bytes : mybase + lp.off_stage + srow * p.row_bytes);
  int4 buf[kS];
#pragma unroll
  for (int q = 0; q < kS; ++q) {
    const int i = c * 32 * kS + q * 32 + lane;
    if (i < V) buf[q] = src[i];  // written by a peer during this kernel: no .nc
  }
  const float* ssrc = from_slot ? xs + fslot * ns : reinterpret_cast<const float*>(mybase + lp.off_sscales) + srow * ns;
  RowScales sc;
  if (c == 0) sc.load(ssrc, ns, lane);
  for (unsigned todo = todo0; todo != 0; todo &= todo - 1) {
    const int b = __ffs(todo) - 1;
    const size_t sl = (size_t)__shfl_sync(0xffffffffu, slot, b);
    int4* dst = reinterpret_cast<int4*>(xr + sl * p.row_bytes);
#pragma unroll
    for (int q = 0; q < kS; ++q) {
      const int i = c * 32 * kS + q * 32 + lane;
      if (i < V) dst[i] = buf[q];
    }
    if (c == 0) {
      sc.store(xs + sl * ns, ssrc, ns, lane);
      if (lane == 0) pair[sl] = t * topk + b;
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
    s_pre[threadIdx.x + 1] =
        (int)(ll_wait_epoch_u64(p, flags + threadIdx.x, epoch, threadIdx.x, kPhaseLlDispatch) & 0xffffffffu);
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
  const int nch = (V + 32 * kS - 1) / (32 * kS);
  for (long long u = gw; !aborted && u < (long long)s_pre[world] * nch; u += G) {
    const int st = (int)(u / nch), c = (int)(u - (long long)st * nch);
    int s = 0;
    while (st >= s_pre[s + 1]) ++s;
    const int t = st - s_pre[s];
    place_staged_chunk(p, lp, s, t, c, epoch, lane);
  }
  ll_finish_launch(lp, lp.counters + 0, lp.epochs + 0, epoch);
}

// ---- ll_sync = token (header comment of this part: see "Token sync" at the top of the file) ----

// Rank of token t among this source's tokens routed to expert e, in token order, from the stage's
// per-(chunk, expert) token masks: the tokens of e in earlier chunks plus those below t in its own.
// Per lane (no warp collective), so every hit lane of a unit gets its slot at once.
__device__ __forceinline__ int token_rank(const int* s_mask, int NE, int t, int e) {
  const int c = t >> 5;
  int j = __popc((unsigned)s_mask[c * NE + e] & ((1u << (t & 31)) - 1u));
  for (int cc = 0; cc < c; ++cc) j += __popc((unsigned)s_mask[cc * NE + e]);
  return j;
}

// Source me's slot on rank d for its token t's expert e (on d): the contract's (base.py ll_slots).
__device__ __forceinline__ int token_slot(const LlParams& lp, const int* s_mask, int NE, int me, int t, int e, int d) {
  return (e - d * lp.experts) * lp.capacity + me * lp.t_max + token_rank(s_mask, NE, t, e);
}

// The slots a unit of token t (warp-uniform) needs: lane k's slot for its expert e on d where `want`, 0 elsewhere.
__device__ __forceinline__ int unit_slot(const LlParams& lp, const int* s_mask, int NE, int me, int t, int e, int d,
                                         bool want) {
  return want ? token_slot(lp, s_mask, NE, me, t, e, d) : 0;
}

// dispatch_place line / line128 (LlLineRow<kBytes>, ll_common.cuh; 64: P = 4 lanes a line, 8 lines a pass, 56
// payload bytes; 128: P = 8, 4, 120): lane l holds part j = l % P of line L0 + (32 / P) q + l / P of each of a batch's
// kP passes (LineParts<kP>): payload bytes [payload L + 16 j, + 16) of the row, and for j = P - 1 the 8 bytes before
// the line's payload ends and the line's tag. The P lanes of a line store it, and a receiver's P lanes load it, in
// one warp instruction.
constexpr int kLinePasses = 4;       // a receive unit's batch: 32 lines of 64 bytes (1792 payload bytes) or 16 of 128 (1920)
constexpr int kLineSendPasses = 8;   // a sender's lines in flight: 64 or 32 (a 7 KiB row in two rounds, as copy_row)
template <int kBytes>
__device__ __forceinline__ int line_count_of(const LlParams& lp) {
  return kBytes == 64 ? lp.line_count : lp.line128_count;
}
template <int kP>
struct LineParts {
  unsigned long long lo[kP], hi[kP];
};

// The row's payload of lines [L0, L0 + (32 / P) kP) below Lc into the lane's parts (zero past the row's end).
template <int kBytes, int kP>
__device__ __forceinline__ void load_line_parts(const uint8_t* row, int R, int Lc, int L0, int lane,
                                                unsigned long long tag, LineParts<kP>& lp) {
  using Line = LlLineRow<kBytes>;
  const int j = lane % Line::kParts;
#pragma unroll
  for (int q = 0; q < kP; ++q) {
    const int L = L0 + Line::kPerPass * q + lane / Line::kParts, off = Line::kPayload * L + 16 * j;
    const bool in = L < Lc;
    lp.lo[q] = in && off < R ? __ldg(reinterpret_cast<const unsigned long long*>(row + off)) : 0ull;
    lp.hi[q] = j == Line::kParts - 1 ? (tag | kLlLineMark)
                                     : (in && off + 8 < R ? __ldg(reinterpret_cast<const unsigned long long*>(row + off + 8)) : 0ull);
  }
}

// The head words of an inline or line row (LlInlineRow): lane k < topk the slot word (hit: `slot`, else kLlNoSlot)
// and, hit, its weight word; when mask != 0 the ns scale words (neither with kLlSkipSmallStores).
__device__ __forceinline__ void send_head_words(unsigned long long* lr, int topk, int ns, int lane, unsigned long long tag,
                                                bool hit, unsigned mask, int slot, float w, bool small,
                                                const RowScales& sc, const float* ssrc) {
  if (lane < topk) {
    st_relaxed_sys_u64(lr + lane, tag | (hit ? (unsigned)slot : kLlNoSlot));
    if (hit && small) st_relaxed_sys_u64(lr + topk + lane, tag | __float_as_uint(w));
  }
  if (mask == 0 || !small) return;  // warp-uniform
#pragma unroll
  for (int q = 0; q < RowScales::kRegs; ++q)
    if (lane + 32 * q < ns) st_relaxed_sys_u64(lr + 2 * topk + lane + 32 * q, tag | __float_as_uint(sc.v[q]));
  for (int i = 32 * RowScales::kRegs + lane; i < ns; i += 32)  // hidden > 16384 only
    st_relaxed_sys_u64(lr + 2 * topk + i, tag | __float_as_uint(ssrc[i]));
}

// Peer unit of the inline placement (kLlPlaceInline): chunk pc of token t's row (pnx 1: the whole row) as inline
// words into lstage[me, t] on d (LlInlineRow); the chunk-0 unit also stores the slot word of each of t's experts
// (lane k's, from slot_of: unit_slot; kLlNoSlot for one not on d: the receiver learns from these whether a row follows) and, when t has an expert
// on d, the weight and scale words (neither with the probe's kLlSkipSmallStores). The unit's first kU x 32 vectors,
// its scales and its weight are loaded before its first store (a load after a store that may alias it waits for
// the store; a row of more than kU x 32 vectors loads each later batch after the stores before it), and nothing is
// fenced or flagged: each word carries its epoch.
template <typename SlotOf>
__device__ __forceinline__ void send_inline(const EpParams& p, const LlParams& lp, const LlDispatchArgs& a, uint8_t* pb,
                                            int t, bool hit, unsigned mask, float w, int pc, int pnx, int lane,
                                            unsigned long long tag, SlotOf slot_of) {
  const int topk = p.topk, ns = p.num_scales, V = p.row_bytes >> 4, me = p.rank;
  unsigned long long* lr =
      reinterpret_cast<unsigned long long*>(pb + lp.off_lstage) + ((size_t)me * lp.t_max + t) * lp.lrow_words;
  const float* ssrc = a.x_scales + (size_t)t * ns;
  RowScales sc;
  if (pc == 0 && mask != 0) sc.load(ssrc, ns, lane);
  const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
  int4 buf[kU];
  const int v0 = pnx == 1 ? 0 : pc * 32 * kS, v1 = pnx == 1 ? V : min(V, (pc + 1) * 32 * kS);
  if (mask != 0) {  // the first kU x 32 vectors of the unit's range: in flight before the slot words go out
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = v0 + u * 32 + lane;
      if (i < v1) buf[u] = ld_nc_v4(src + i);
    }
  }
  const bool small = !(lp.probe_skip & kLlSkipSmallStores);  // measuring aid (LlProbeSkip); true when verified
  if (pc == 0) send_head_words(lr, topk, ns, lane, tag, hit, mask, slot_of(), w, small, sc, ssrc);
  if (mask == 0) return;  // warp-uniform
  unsigned long long* rw = lr + lp.lrow_head;
  for (int b0 = v0;; ) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = b0 + u * 32 + lane;
      if (i < v1) st_inline_v4(rw + 4 * (size_t)i, buf[u], tag);
    }
    b0 += 32 * kU;
    if (b0 >= v1) break;  // warp-uniform
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = b0 + u * 32 + lane;
      if (i < v1) buf[u] = ld_nc_v4(src + i);
    }
  }
}

// Peer unit of the line placements (kLlPlaceLine / kLlPlaceLine128, row units): token t's head words as
// send_inline's, then, when t has an expert on d, its row as Lc lines of kBytes into lline[me, t] on d, (32 / P) x
// kLineSendPasses lines at a time, each batch's loads issued before its stores; no fence and no flag: each line
// carries its tag.
template <int kBytes, typename SlotOf>
__device__ __forceinline__ void send_line(const EpParams& p, const LlParams& lp, const LlDispatchArgs& a, uint8_t* pb,
                                          int t, bool hit, unsigned mask, float w, int lane, unsigned long long tag,
                                          SlotOf slot_of) {
  using Line = LlLineRow<kBytes>;
  const int topk = p.topk, ns = p.num_scales, R = p.row_bytes, Lc = line_count_of<kBytes>(lp);
  unsigned long long* lr =
      reinterpret_cast<unsigned long long*>(pb + lp.off_lstage) + ((size_t)p.rank * lp.t_max + t) * lp.lrow_words;
  const float* ssrc = a.x_scales + (size_t)t * ns;
  const uint8_t* row = a.x + (size_t)t * R;
  RowScales sc;
  LineParts<kLineSendPasses> parts;
  if (mask != 0) {  // the first lines and the scales in flight before the head words go out
    sc.load(ssrc, ns, lane);
    load_line_parts<kBytes>(row, R, Lc, 0, lane, tag, parts);
  }
  const int slot = slot_of();  // unit_slot
  send_head_words(lr, topk, ns, lane, tag, hit, mask, slot, w, !(lp.probe_skip & kLlSkipSmallStores), sc, ssrc);
  if (mask == 0) return;  // warp-uniform
  unsigned long long* lw =
      reinterpret_cast<unsigned long long*>(pb + lp.off_lline) + ((size_t)p.rank * lp.t_max + t) * Lc * Line::kWords;
  for (int L0 = 0;;) {
#pragma unroll
    for (int q = 0; q < kLineSendPasses; ++q) {
      const int L = L0 + Line::kPerPass * q + lane / Line::kParts;
      if (L < Lc) st_relaxed_sys_v2u64(lw + Line::kWords * (size_t)L + 2 * (lane % Line::kParts), parts.lo[q], parts.hi[q]);
    }
    L0 += Line::kPerPass * kLineSendPasses;
    if (L0 >= Lc) break;  // warp-uniform
    load_line_parts<kBytes>(row, R, Lc, L0, lane, tag, parts);
  }
}

// Source s's token t's LlInlineRow in my lstage (srow = s * T_max + t).
__device__ __forceinline__ const unsigned long long* inline_row(const LlParams& lp, const uint8_t* mybase, size_t srow) {
  return reinterpret_cast<const unsigned long long*>(mybase + lp.off_lstage) + srow * lp.lrow_words;
}

// Slot sl's scales (ns words: the first 32 kRegs as loaded into sraw, any beyond waited for one at a time from the
// row's scale words sw) and pair entry, by an inline or line receive unit.
__device__ __forceinline__ void put_scales_pair(const EpParams& p, float* xs, int* pair, size_t sl, int ns, int lane,
                                                const unsigned long long (&sraw)[RowScales::kRegs],
                                                const unsigned long long* sw, int epoch, int s, int pair_value) {
#pragma unroll
  for (int q = 0; q < RowScales::kRegs; ++q)
    if (lane + 32 * q < ns) xs[sl * ns + lane + 32 * q] = __uint_as_float((unsigned)sraw[q]);
  for (int i = 32 * RowScales::kRegs + lane; i < ns; i += 32) {  // hidden > 16384 only: one word at a time
    const unsigned long long v = ll_wait_epoch_u64<false>(p, sw + i, epoch, s, kPhaseLlDispatch);
    xs[sl * ns + i] = __uint_as_float((unsigned)v);
  }
  if (lane == 0) pair[sl] = pair_value;
}

// Where my combine's push finds pair (srow, lane)'s slot and weight: its tmap and tw entries.
__device__ __forceinline__ void put_tmap_tw(const LlParams& lp, uint8_t* mybase, size_t srow, int topk, int lane,
                                            int epoch, int slot, unsigned long long wraw) {
  reinterpret_cast<unsigned long long*>(mybase + lp.off_tmap)[srow * topk + lane] =
      ((unsigned long long)(unsigned)epoch << 32) | (unsigned)slot;
  reinterpret_cast<float*>(mybase + lp.off_tw)[srow * topk + lane] = __uint_as_float((unsigned)wraw);
}

// The slot words of an inline or line row (LlInlineRow's first topk words): lane k < topk waits for word k and
// gets the slot of the token's k-th expert here (`valid`: this epoch's, and mine); returns the valid lanes.
__device__ __forceinline__ unsigned wait_slot_words(const EpParams& p, const unsigned long long* lr, int topk, int epoch,
                                                    int s, int lane, int& slot, bool& valid) {
  unsigned long long sw = 0;
  if (lane < topk) sw = ll_wait_epoch_u64<false>(p, lr + lane, epoch, s, kPhaseLlDispatch);
  valid = lane < topk && (int)(sw >> 32) == epoch && (unsigned)sw != kLlNoSlot;
  slot = valid ? (int)(unsigned)sw : 0;
  return __ballot_sync(0xffffffffu, valid);
}

// Receive unit (source s, token t, batch c of (32 / P) x kLinePasses lines) of the line placements: the slot words
// as receive_inline waits for them; then the warp polls the batch's lines until every line's tag is of this epoch or
// later (one vote: the tag is lane j = P - 1's, the other lanes' parts of a line were loaded by the same
// instruction); line128 then loads the batch once more (LlLineRow::kReread: a 128-byte line's first half may have
// been read before it landed); then stores them into each valid slot with 8-byte stores; c = 0 then waits for the
// scale and weight words (sent before the lines) and stores them, pair and this rank's tmap / tw entries as
// receive_inline does (nothing, if a wait gave up). `copy` false: waits, copies nothing.
template <int kBytes>
__device__ __forceinline__ void receive_line(const EpParams& p, const LlParams& lp, int s, int t, int c, int epoch,
                                             int lane, bool copy) {
  using Line = LlLineRow<kBytes>;
  const int topk = p.topk, ns = p.num_scales, R = p.row_bytes, Lc = line_count_of<kBytes>(lp);
  uint8_t* mybase = p.peer_base[p.rank];
  const size_t srow = (size_t)s * lp.t_max + t;
  const unsigned long long* lr = inline_row(lp, mybase, srow);
  int slot;
  bool valid;
  const unsigned mask = wait_slot_words(p, lr, topk, epoch, s, lane, slot, valid);
  if (mask == 0) return;  // warp-uniform
  const int L0 = Line::kPerPass * kLinePasses * c, L1 = min(Lc, L0 + Line::kPerPass * kLinePasses);
  const int j = lane % Line::kParts;
  const unsigned long long* lw =
      reinterpret_cast<const unsigned long long*>(mybase + lp.off_lline) + srow * Lc * Line::kWords;
  uint8_t* xr = mybase + lp.off_x;
  LineParts<kLinePasses> parts;
  const auto load_batch = [&] {
#pragma unroll
    for (int q = 0; q < kLinePasses; ++q) {  // every load of the batch issued before any is looked at
      const int L = L0 + Line::kPerPass * q + lane / Line::kParts;
      if (L < L1) ld_relaxed_sys_v2u64(lw + Line::kWords * (size_t)L + 2 * j, parts.lo[q], parts.hi[q]);
    }
  };
  const bool ok = ll_spin_warp(p, s, kPhaseLlDispatch, lane, [&] {
    load_batch();
    bool here = true;
#pragma unroll
    for (int q = 0; q < kLinePasses; ++q)
      if (j == Line::kParts - 1 && L0 + Line::kPerPass * q + lane / Line::kParts < L1)
        here = here && (unsigned)parts.hi[q] == kLlLineMark && (int)(parts.hi[q] >> 32) - epoch >= 0;
    return __all_sync(0xffffffffu, here);
  });
  if (!ok || !copy) return;  // gave up (the error is recorded; warp-uniform), or measuring
  if constexpr (Line::kReread) load_batch();  // after every tag was seen current: a line's first half is there too
  for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
    uint8_t* dst = xr + (size_t)__shfl_sync(0xffffffffu, slot, __ffs(todo) - 1) * R;
#pragma unroll
    for (int q = 0; q < kLinePasses; ++q) {
      const int L = L0 + Line::kPerPass * q + lane / Line::kParts, off = Line::kPayload * L + 16 * j;
      if (L >= L1) break;  // (the later passes' lines are further on)
      if (off < R) *reinterpret_cast<unsigned long long*>(dst + off) = parts.lo[q];
      if (j < Line::kParts - 1 && off + 8 < R) *reinterpret_cast<unsigned long long*>(dst + off + 8) = parts.hi[q];
    }
  }
  if (c != 0) return;
  float* xs = reinterpret_cast<float*>(mybase + lp.off_scales);
  int* pair = reinterpret_cast<int*>(mybase + lp.off_pair);
  unsigned long long wraw = 0, sraw[RowScales::kRegs];
  if (valid) wraw = ll_wait_epoch_u64<false>(p, lr + topk + lane, epoch, s, kPhaseLlDispatch);
  bool lost = valid && wraw == 0;  // a wait that gave up returns 0 (a word of epoch >= 1 never is)
#pragma unroll
  for (int q = 0; q < RowScales::kRegs; ++q)
    if (lane + 32 * q < ns) {
      sraw[q] = ll_wait_epoch_u64<false>(p, lr + 2 * topk + lane + 32 * q, epoch, s, kPhaseLlDispatch);
      lost = lost || sraw[q] == 0;
    }
  if (__ballot_sync(0xffffffffu, lost) != 0) return;  // the error is recorded: store nothing of this call
  for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
    const int b = __ffs(todo) - 1;
    const size_t sl = (size_t)__shfl_sync(0xffffffffu, slot, b);
    put_scales_pair(p, xs, pair, sl, ns, lane, sraw, lr + 2 * topk, epoch, s, t * topk + b);
  }
  if (valid) put_tmap_tw(lp, mybase, srow, topk, lane, epoch, slot, wraw);
}

// Receive unit (source s, token t, chunk c of kS x 32 vectors) of the inline placement: lane k < topk waits for
// the slot word of t's k-th expert (kLlNoSlot: not mine); if any is mine, every lane waits for its vectors of
// chunk c (and, for c = 0, its scale words and its weight word) and the warp stores the chunk into each valid
// slot, with c = 0 also the scales, pair = t * topk + k and this rank's own tmap / tw entries (which the stage and
// slot placements receive from the source). With `copy` false (LlProbeSkip kLlSkipReceive) it still waits for
// the chunk's words (they are the proof of arrival here, as the flag is for the other placements) but copies
// nothing and waits for no scale or weight word (the token-peers variant also leaves those unsent).
// Row and scale words are taken at their epoch or a later one: with a combine between dispatches a later epoch
// cannot reach them (the file header's reuse argument); in a chain of dispatches without one (the probe's
// dispatch-only backend, chained graphs) a source may be one call ahead, whose words carry the same inputs there.
__device__ __forceinline__ void receive_inline(const EpParams& p, const LlParams& lp, int s, int t, int c, int epoch,
                                               int lane, bool copy) {
  const int topk = p.topk, ns = p.num_scales, V = p.row_bytes >> 4;
  uint8_t* mybase = p.peer_base[p.rank];
  const size_t srow = (size_t)s * lp.t_max + t;
  const unsigned long long* lr = inline_row(lp, mybase, srow);
  int slot;
  bool valid;
  const unsigned mask = wait_slot_words(p, lr, topk, epoch, s, lane, slot, valid);
  if (mask == 0) return;  // warp-uniform
  const unsigned long long* rw = lr + lp.lrow_head;
  unsigned long long raw[kS][4], sraw[RowScales::kRegs], wraw = 0;  // the words as last loaded
  const bool meta = copy && c == 0;  // the scale and weight words too
  const bool ok = ll_spin(p, s, kPhaseLlDispatch, [&] {
#pragma unroll
    for (int q = 0; q < kS; ++q) {  // every load of the poll issued before any is looked at
      const int i = c * 32 * kS + q * 32 + lane;
      if (i < V) {
        ld_relaxed_sys_v2u64(rw + 4 * (size_t)i, raw[q][0], raw[q][1]);
        ld_relaxed_sys_v2u64(rw + 4 * (size_t)i + 2, raw[q][2], raw[q][3]);
      }
    }
#pragma unroll
    for (int q = 0; q < RowScales::kRegs; ++q)
      if (meta && lane + 32 * q < ns) sraw[q] = ld_relaxed_sys_u64(lr + 2 * topk + lane + 32 * q);
    if (meta && valid) wraw = ld_relaxed_sys_u64(lr + topk + lane);
    bool all = true;
#pragma unroll
    for (int q = 0; q < kS; ++q)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (c * 32 * kS + q * 32 + lane < V) all = all && (int)(raw[q][j] >> 32) - epoch >= 0;
#pragma unroll
    for (int q = 0; q < RowScales::kRegs; ++q)
      if (meta && lane + 32 * q < ns) all = all && (int)(sraw[q] >> 32) - epoch >= 0;
    if (meta && valid) all = all && (int)(wraw >> 32) - epoch >= 0;
    return all;
  });
  if (__ballot_sync(0xffffffffu, !ok) != 0 || !copy) return;  // gave up (the error is recorded), or measuring
  uint8_t* xr = mybase + lp.off_x;
  float* xs = reinterpret_cast<float*>(mybase + lp.off_scales);
  int* pair = reinterpret_cast<int*>(mybase + lp.off_pair);
  for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
    const int b = __ffs(todo) - 1;
    const size_t sl = (size_t)__shfl_sync(0xffffffffu, slot, b);
    int4* dst = reinterpret_cast<int4*>(xr + sl * p.row_bytes);
#pragma unroll
    for (int q = 0; q < kS; ++q) {
      const int i = c * 32 * kS + q * 32 + lane;
      if (i < V)
        dst[i] = make_int4((int)(unsigned)raw[q][0], (int)(unsigned)raw[q][1], (int)(unsigned)raw[q][2],
                           (int)(unsigned)raw[q][3]);
    }
    if (c == 0) put_scales_pair(p, xs, pair, sl, ns, lane, sraw, lr + 2 * topk, epoch, s, t * p.topk + b);
  }
  if (c == 0 && valid) put_tmap_tw(lp, mybase, srow, topk, lane, epoch, slot, wraw);
}

// Source s's token count for this epoch from its T word (dwords[s][E], stored first by the sender's block 0): 0 for
// a later epoch (nothing of it is mine) or a wait given up; a T word of another kind (units or placement bits)
// records the mismatch, naming the option, which stops every wait.
__device__ __forceinline__ int tword_tokens(const EpParams& p, const LlParams& lp, const unsigned long long* dwords,
                                            int s, int E, int epoch) {
  const unsigned long long v = ll_wait_epoch_u64(p, dwords + (size_t)s * (E + 1) + E, epoch, s, kPhaseLlDispatch);
  const unsigned lo = (unsigned)(v & 0xffffffffu);
  if ((int)(v >> 32) != epoch) return 0;
  const unsigned differ = (lo ^ ll_units_bits(lp)) & kLlUnitsBitsMask;
  if (differ != 0) {  // abort every wait, naming the option that differs
    report_timeout(p.dev_error, p.host_error, p.rank, s,
                   (differ & 0x80000000u) ? kPhaseLlUnitsMismatch : kPhaseLlPlaceMismatch);
    return 0;
  }
  return (int)(lo & ~kLlUnitsBitsMask);
}

// kWords: 0 the flagged placements (stage, slot), 1 inline, 2 line, 3 line128 (each its own instantiation, so the
// flagged kernel keeps its registers)
template <int kThreads, int kWords>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_token_kernel(EpParams p, LlParams lp, LlDispatchArgs a) {
  extern __shared__ int s_dyn[];  // s_idx [T * topk], then s_mask [(chunks + 1) * NE] (last row: totals)
  __shared__ int s_epoch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int T = a.num_tokens, topk = p.topk, world = p.world, E = lp.experts, NE = lp.num_experts;
  const int me = p.rank, Tm = lp.t_max, ns = p.num_scales, V = p.row_bytes >> 4;
  const int chunks = (T + 31) / 32;
  int* s_idx = s_dyn;
  int* s_mask = s_dyn + T * topk;
  int* totals = s_mask + chunks * NE;
  ll_stamp(lp, kLlStart);
  // every global load of the stage issued before the first wait on any of them
  bool aborted = ld_volatile(p.dev_error) != 0;
  if (threadIdx.x == 0) s_epoch = ld_volatile(lp.eslots + blockIdx.x) + 1;
  for (int i = threadIdx.x; i < T * topk; i += blockDim.x) s_idx[i] = (int)a.topk_idx[i];
  for (int i = threadIdx.x; i < (chunks + 1) * NE; i += blockDim.x) s_mask[i] = 0;
  __syncthreads();
  const int epoch = s_epoch;
  const unsigned long long tag = (unsigned long long)(unsigned)epoch << 32;
  unsigned long long* dwords_of_me = nullptr;  // my row of dwords on a peer: + (size_t)me * (E + 1)
  if (blockIdx.x == 0 && threadIdx.x < world && threadIdx.x != me && !aborted) {
    dwords_of_me = reinterpret_cast<unsigned long long*>(p.peer_base[threadIdx.x] + lp.off_dwords) + (size_t)me * (E + 1);
    // first: the receivers' blocks wait for it; bits 31 / 30 / 29 / 28 / 27 say chunk units / slot / inline / line / line128 placement (T < 2^27), so a
    // receiver set to another kind stops with an error instead of copying what it did not wait for
    st_relaxed_sys_u64(dwords_of_me + E, tag | ll_units_bits(lp) | (unsigned)T);
  }
  for (int i = threadIdx.x; i < T * topk; i += blockDim.x) {
    const int e = s_idx[i], t = i / topk;
    if (e >= 0 && e < NE) atomicOr(reinterpret_cast<unsigned*>(&s_mask[(t >> 5) * NE + e]), 1u << (t & 31));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < NE; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) run += __popc((unsigned)s_mask[c * NE + e]);
    totals[e] = run;
  }
  __syncthreads();
  ll_stamp(lp, kLlStaged);
  if (blockIdx.x == 0 && !aborted) {  // counts for each peer's experts, epoch-tagged
    for (int i = threadIdx.x; i < NE; i += blockDim.x) {
      const int d = i / E;
      if (d != me)
        st_relaxed_sys_u64(reinterpret_cast<unsigned long long*>(p.peer_base[d] + lp.off_dwords) +
                               (size_t)me * (E + 1) + (i - d * E),
                           tag | (unsigned)totals[i]);
    }
  }

  // send: per token nx x ng own-chunk units (rows straight into my experts' slots), then pnx units per
  // peer (1: the whole row; nx: a chunk each)
  const int nx = (V + 32 * kS - 1) / (32 * kS);
  const int pnx = lp.dispatch_units == kLlUnitsChunk ? nx : 1, tfc = lp.tflag_chunks;
  const long long G = (long long)gridDim.x * nwarps, gw = (long long)warp * gridDim.x + blockIdx.x;
  const long long base_units = (long long)T * (nx + (world - 1) * pnx);
  const int ng = base_units > 0 ? (int)max(1LL, min((long long)topk, G / base_units)) : 1;
  const int own_units = nx * ng;
  const int per_token = own_units + (world - 1) * pnx;
  uint8_t* mybase = p.peer_base[me];
  for (long long u = gw; !aborted && u < (long long)T * per_token; u += G) {
    const int t = (int)(u / per_token), r = (int)(u - (long long)t * per_token);
    const bool own = r < own_units;
    if (own && (lp.probe_skip & kLlSkipOwnRows)) continue;  // measuring aid (LlProbeSkip): warp-uniform
    const int pr = own || world == 1 ? 0 : r - own_units;  // peer unit: peer-minor, then chunk
    const int d = own ? me : (me + 1 + pr % (world - 1)) % world;
    const int pc = own || world == 1 ? 0 : pr / (world - 1);  // the row's chunk (chunk units; 0 for a row)
    const int rc = own ? r / ng : 0;  // own: chunk of the row, and group g = r % ng of t's experts
    int e = -1;
    if (lane < topk) e = s_idx[t * topk + lane];
    const bool hit = lane < topk && e >= d * E && e < (d + 1) * E && (!own || lane % ng == r - rc * ng);
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (own && mask == 0) continue;
    const bool pair_entry = hit && rc == 0;  // this unit stores lane k's tmap / tw entry
    float w = 0.f;
    if (pair_entry) w = a.topk_w[(size_t)t * topk + lane];  // loaded before any store of the unit
    uint8_t* pb = p.peer_base[d];
    if (kWords != 0 && !own) {
      const auto slot_of = [&] { return unit_slot(lp, s_mask, NE, me, t, e, d, hit); };
      if constexpr (kWords == 2) send_line<64>(p, lp, a, pb, t, hit, mask, w, lane, tag, slot_of);
      else if constexpr (kWords == 3) send_line<128>(p, lp, a, pb, t, hit, mask, w, lane, tag, slot_of);
      else send_inline(p, lp, a, pb, t, hit, mask, w, pc, pnx, lane, tag, slot_of);
      continue;
    }
    if (own) {
      // chunk rc of row t into the slots of this unit's experts
      int4 buf[kS];
      const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
#pragma unroll
      for (int q = 0; q < kS; ++q) {
        const int i = rc * 32 * kS + q * 32 + lane;
        if (i < V) buf[q] = ld_nc_v4(src + i);
      }
      const float* ssrc = a.x_scales + (size_t)t * ns;
      RowScales sc;
      if (rc == 0) sc.load(ssrc, ns, lane);
      const int slot = unit_slot(lp, s_mask, NE, me, t, e, d, hit);
      float* xs = reinterpret_cast<float*>(mybase + lp.off_scales);
      int* pair = reinterpret_cast<int*>(mybase + lp.off_pair);
      for (unsigned todo = mask; todo != 0; todo &= todo - 1) {
        const int b = __ffs(todo) - 1;
        const size_t sl = (size_t)__shfl_sync(0xffffffffu, slot, b);
        int4* dst = reinterpret_cast<int4*>(mybase + lp.off_x + sl * p.row_bytes);
#pragma unroll
        for (int q = 0; q < kS; ++q) {
          const int i = rc * 32 * kS + q * 32 + lane;
          if (i < V) st_v4(dst + i, buf[q]);
        }
        if (rc == 0) {
          sc.store(xs + sl * ns, ssrc, ns, lane);
          if (lane == 0) pair[sl] = t * topk + b;
        }
      }
      if (pair_entry) {  // where my combine's reduce finds the pair's slot and weight
        const size_t tk = ((size_t)me * Tm + t) * topk + lane;
        reinterpret_cast<unsigned long long*>(mybase + lp.off_tmap)[tk] = tag | (unsigned)slot;
        reinterpret_cast<float*>(mybase + lp.off_tw)[tk] = w;
      }
      continue;
    }
    // where the row lands on d: stage[me, t] (place stage), or the slot of t's first expert on d (place slot:
    // the lowest hit lane's; d copies it from there into the others' slots, so a row with one expert on d
    // needs no copy at all). Stage placement computes the slots after the row's stores, beside them in flight.
    const bool in_slot = lp.dispatch_place == kLlPlaceSlot;  // warp-uniform
    const bool entries = !(lp.probe_skip & kLlSkipSmallStores);  // the pair's tmap / tw entries (below)
    int slot = 0;
    if (in_slot && hit) slot = token_slot(lp, s_mask, NE, me, t, e, d);
    if (mask != 0) {
      const int first = __ffs(mask) - 1;
      const size_t fslot = in_slot ? (size_t)__shfl_sync(0xffffffffu, slot, first) : 0;
      const size_t srow = (size_t)me * Tm + t;
      int4* dst = reinterpret_cast<int4*>(in_slot ? pb + lp.off_x + fslot * p.row_bytes
                                                  : pb + lp.off_stage + srow * p.row_bytes);
      const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
      if (pnx == 1) {
        copy_row(dst, src, V, lane);
      } else {  // chunk pc: every load in flight before the stores
        int4 buf[kS];
#pragma unroll
        for (int q = 0; q < kS; ++q) {
          const int i = pc * 32 * kS + q * 32 + lane;
          if (i < V) buf[q] = ld_nc_v4(src + i);
        }
#pragma unroll
        for (int q = 0; q < kS; ++q) {
          const int i = pc * 32 * kS + q * 32 + lane;
          if (i < V) st_v4(dst + i, buf[q]);
        }
      }
      if (ns && pc == 0 && !(lp.probe_skip & kLlSkipSmallStores)) {
        float* dst = in_slot ? reinterpret_cast<float*>(pb + lp.off_scales) + fslot * ns
                             : reinterpret_cast<float*>(pb + lp.off_sscales) + srow * ns;
        for (int i = lane; i < ns; i += 32) dst[i] = a.x_scales[(size_t)t * ns + i];
      }
      if (in_slot && pc == 0 && lane == 0 && !(lp.probe_skip & kLlSkipSmallStores))
        reinterpret_cast<int*>(pb + lp.off_pair)[fslot] = t * topk + first;
    }
    if (hit && entries) {  // the pair's slot and weight, where d's combine reads them
      const size_t tk = ((size_t)me * Tm + t) * topk + lane;
      if (!in_slot) slot = token_slot(lp, s_mask, NE, me, t, e, d);
      reinterpret_cast<unsigned long long*>(pb + lp.off_tmap)[tk] = tag | (unsigned)slot;
      reinterpret_cast<float*>(pb + lp.off_tw)[tk] = w;
    }
    __syncwarp();  // every lane's stores of this unit before lane 0's flag (bar.warp.sync orders memory)
    unsigned long long* flag =
        reinterpret_cast<unsigned long long*>(pb + lp.off_tflags) + ((size_t)me * Tm + t) * tfc + pc;
    if (lane == 0) {
      if (mask != 0 && !(lp.probe_skip & kLlSkipFence)) st_release_sys_u64(flag, tag | 1u);
      else st_relaxed_sys_u64(flag, tag | (mask != 0 ? 1u : 0u));  // nothing behind it (or measuring): no fence
    }
  }
  ll_stamp(lp, kLlSent);
  ll_stamp(lp, kLlReleased);

  // receive: how many tokens each peer sends this epoch, then each staged row chunk by chunk, no block barrier.
  // Units are dealt warp-major, so the warps that hold no send unit are the grid's warps [units, G) in that order.
  // Where they are at least three quarters of the grid (`beside`, the same on every block: small batches), they
  // alone receive, as soon as their block's stage is done, so a row is copied into its experts' slots as it lands
  // while the few others still send; else every warp receives once its own sends are issued. (With a quarter of the
  // grid idle, at 128 tokens on 4 ranks, receiving beside the send was 1.7-2.4 us slower on 4 x H200: the idle
  // warps' polls slowed the sends more than the overlap gained; notes/LATENCY-NEXT.md.) Either way a receiving
  // warp learns the peers' token counts itself (lane s waits for source s's T word, stored first by its block 0)
  // and sums them over its lanes. A receiver waits only for peers' sends, which wait for nothing but their own
  // block's stage: no cycle.
  const unsigned long long* dwords = reinterpret_cast<const unsigned long long*>(mybase + lp.off_dwords);
  const long long units = (long long)T * per_token, idle = G - units;
  const bool beside = units * 4 <= G;  // grid-uniform
  const bool receiver = !beside || gw >= units;
  static_assert(EP_MAX_WORLD <= 32, "a warp's lanes hold the sources' token counts");
  int n = 0, incl = 0;  // lane s: source s's tokens, and those of sources 0..s
  if (receiver || warp == 0) {  // warp 0 always, for the stamp below and block 0's src_tokens
    if (lane < world && lane != me && !aborted) n = tword_tokens(p, lp, dwords, lane, E, epoch);
    incl = warp_inclusive_sum(n);
  }
  const int total = __shfl_sync(0xffffffffu, incl, world - 1);
  ll_stamp(lp, kLlWaited);
  // a wait above (world > 1 only) may have given up: look again (lane 0's view, so the warp agrees); at world 1
  // nothing waited
  if (world > 1) aborted = __shfl_sync(0xffffffffu, (int)(aborted || ld_volatile(p.dev_error) != 0), 0) != 0;
  if (blockIdx.x == 0 && !aborted) {
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
      long long sum = 0;
      for (int s = 0; s < world; ++s) {
        int c = totals[me * E + i];
        if (s != me) {
          const unsigned long long v =
              ll_wait_epoch_u64(p, dwords + (size_t)s * (E + 1) + i, epoch, s, kPhaseLlDispatch);
          c = (int)(v >> 32) == epoch ? (int)(v & 0xffffffffu) : 0;
        }
        lp.src_counts[i * world + s] = c;
        sum += c;
      }
      lp.counts[i] = sum;
    }
    if (warp == 0 && lane < world) lp.src_tokens[lane] = lane == me ? T : n;
  }
  const unsigned long long* tflags = reinterpret_cast<const unsigned long long*>(mybase + lp.off_tflags);
  // receive units per row: nx chunks of kS x 32 vectors, or (line / line128) one per batch of (8 or 4) x kLinePasses
  // lines
  constexpr int kBatch = (kWords == 3 ? LlLineRow<128>::kPerPass : LlLineRow<64>::kPerPass) * kLinePasses;
  const int nxr = kWords == 2 ? (lp.line_count + kBatch - 1) / kBatch
                              : kWords == 3 ? (lp.line128_count + kBatch - 1) / kBatch : nx;
  const long long rx_stride = beside ? idle : G;
  for (long long u = beside ? gw - units : gw; receiver && !aborted && u < (long long)total * nxr; u += rx_stride) {
    const int st = (int)(u / nxr), c = (int)(u - (long long)st * nxr);
    const int s = __popc(__ballot_sync(0xffffffffu, lane < world && incl <= st));  // the sources wholly before st
    const int t = st - (__shfl_sync(0xffffffffu, incl, s) - __shfl_sync(0xffffffffu, n, s));
    if constexpr (kWords == 1) {  // every word waited for on its own, no flag
      receive_inline(p, lp, s, t, c, epoch, lane, !(lp.probe_skip & kLlSkipReceive));
      continue;
    } else if constexpr (kWords >= 2) {  // every line waited for by its tag, no flag
      receive_line<kWords == 2 ? 64 : 128>(p, lp, s, t, c, epoch, lane, !(lp.probe_skip & kLlSkipReceive));
      continue;
    }
    // lane 0 alone polls (one ld.acquire.sys per poll, not 32: the pollers share the L2 with the rows
    // arriving); the warp barrier then orders every lane's later loads of tmap and the row after lane 0's
    // acquire (bar.warp.sync orders memory among its threads; causality order is transitive)
    unsigned long long v = 0;
    if (lane == 0)
      v = ll_wait_epoch_u64(p, tflags + ((size_t)s * Tm + t) * tfc + (pnx == 1 ? 0 : c), epoch, s, kPhaseLlDispatch);
    v = __shfl_sync(0xffffffffu, v, 0);
    __syncwarp();
    if ((int)(v >> 32) != epoch || (v & 1u) == 0) continue;  // not for me (or a later epoch, or given up)
    if (lp.probe_skip & kLlSkipReceive) continue;  // measuring aid (LlProbeSkip): the flag waited for, no copy
    place_staged_chunk(p, lp, s, t, c, epoch, lane, lp.dispatch_place == kLlPlaceSlot);
  }
  ll_stamp(lp, kLlReceived);
  ll_store_epoch_slots(lp, lp.eslots, lp.epochs + 0, epoch);
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
  const int place = ctx->lp.dispatch_place;
  if (ctx->sync == kLlSyncToken && (place == kLlPlaceLine || place == kLlPlaceLine128) &&
      ctx->lp.dispatch_units != kLlUnitsRow) {
    ep_set_error("low-latency dispatch place line / line128 needs row units (dispatch_units row)");
    return -1;
  }
  ctx->launched = true;
  if (ctx->sync == kLlSyncToken) {
    const size_t smem = ll_token_smem_bytes(num_tokens, p.topk, ctx->lp.num_experts);  // <= ctx->token_smem
    using Kernel = void (*)(EpParams, LlParams, LlDispatchArgs);
    static const Kernel kernels[4] = {ll_dispatch_token_kernel<512, 0>, ll_dispatch_token_kernel<512, 1>,
                                      ll_dispatch_token_kernel<512, 2>, ll_dispatch_token_kernel<512, 3>};
    const int words = place == kLlPlaceInline ? 1 : place == kLlPlaceLine ? 2 : place == kLlPlaceLine128 ? 3 : 0;
    kernels[words]<<<num_sms, warps * 32, smem, (cudaStream_t)vstream>>>(p, ctx->lp, a);
  } else {
    const size_t smem = (size_t)num_tokens * p.topk * sizeof(int);  // <= 48 KB, checked in ep_ll_create
    ll_dispatch_kernel<512><<<num_sms, warps * 32, smem, (cudaStream_t)vstream>>>(p, ctx->lp, a);
  }
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

int ll_dispatch_token_smem_attr(int bytes) {
  for (auto kernel : {ll_dispatch_token_kernel<512, 0>, ll_dispatch_token_kernel<512, 1>, ll_dispatch_token_kernel<512, 2>,
                      ll_dispatch_token_kernel<512, 3>})
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return 0;
}
