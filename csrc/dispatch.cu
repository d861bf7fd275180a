// Dispatch: after the notify kernel (layout.cu) has produced slot_map and base, num_sms blocks
// push every token row once to every rank that holds one of its experts, straight into that
// rank's recv buffers (row base[d] + slot_map[t][d]), then signal completion.
//
// Work split (both variants): warp w of block b is global warp g = b * warps + w; it handles
// tokens g, g + G, g + 2G, ... (G = all warps of the grid), so every block is an independent
// channel and blocks never wait on each other.
//
// dispatch_reg_kernel: each lane loads kU 16-byte vectors of the row (ld.global.nc, all in
//   flight at once) and stores the same registers to every destination row (st.global 16 B).
//   kPipelined: the next chunk's loads are issued before the current chunk is stored (two register
//   buffers), so a warp never waits on a load it could have started earlier.
// dispatch_tma_kernel: lane 0 of each warp runs a ring of `stages` row buffers in shared
//   memory: cp.async.bulk global -> shared (completes on the stage's mbarrier), then one
//   cp.async.bulk shared -> peer global per destination, committed as one bulk group per token;
//   a stage is refilled once its group has finished reading it (wait_group.read 1). Loads run
//   stages - 1 tokens ahead. The other lanes copy the metadata.
// Both: lanes < topk copy topk_idx / topk_weights, lanes stride over the fp8 scales.
//
// Completion (grid_release_and_wait in common.cuh): every thread fences at system scope; the
// last block to finish stores done[me] = epoch into every rank's signals with st.release.sys,
// then waits until done[s] == epoch for every source s in my signals, so the kernel ends only
// when every row addressed to this rank has landed.
#include <algorithm>

#include "common.cuh"

namespace {

struct DispatchArgs {
  const uint8_t* x;
  const float* x_scales;
  const int64_t* topk_idx;
  const float* topk_w;
  int num_tokens;
};

// Row of token t on every rank (-1 where it is not sent), the same in every lane.
__device__ __forceinline__ void dest_rows(const EpParams& p, int t, int lane, int my_base, int (&rows)[EP_MAX_WORLD]) {
  const int slot = lane < p.world ? p.slot_map[(size_t)t * p.world + lane] : -1;
  const int my_row = slot >= 0 ? my_base + slot : -1;
#pragma unroll
  for (int d = 0; d < EP_MAX_WORLD; ++d) rows[d] = __shfl_sync(0xffffffffu, my_row, d);
}

__device__ __forceinline__ void copy_metadata(const EpParams& p, const DispatchArgs& a, int t, int lane,
                                              const int (&rows)[EP_MAX_WORLD]) {
  const int topk = p.topk;
  long long idx = 0;
  float w = 0.f;
  if (lane < topk) {
    idx = a.topk_idx[(size_t)t * topk + lane];
    w = a.topk_w[(size_t)t * topk + lane];
  }
#pragma unroll
  for (int d = 0; d < EP_MAX_WORLD; ++d) {
    if (rows[d] < 0) continue;
    uint8_t* pb = p.peer_base[d];
    if (lane < topk) {
      reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)rows[d] * topk + lane] = idx;
      reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)rows[d] * topk + lane] = w;
    }
    float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)rows[d] * p.num_scales;
    for (int j = lane; j < p.num_scales; j += 32) dst_scales[j] = a.x_scales[(size_t)t * p.num_scales + j];
  }
}

// v9 own-copy hand-off: block 0's thread 0 of the data kernel, past griddepcontrol.wait (slot_map and
// base of this call are written and visible to this grid), releases the epoch into
// counters[kCounterOwnGo]; own_rows_kernel on the side stream acquires it before reading the layout.
__device__ __forceinline__ void own_go_release(const EpParams& p, int epoch) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<int*>(p.counters + kCounterOwnGo), epoch);
  }
}

// lean (v5): the same copy with every per-token load issued before the first store: chunk 0 of x,
// the slot_map row, topk ids / weights and (fp8) the first 64 scales are all in flight together,
// so a token costs one memory latency before its stores instead of three in a row.
// kSkipSelf (v9, EP_OWN_SIDE*): rows to my own rank are left to own_rows_kernel on a side stream; this
// kernel only tells it that the layout is ready (own_go_release). false: the v5 kernel unchanged.
// The lean token loop (v5), shared by dispatch_lean_kernel and dispatch_owntma_kernel: tokens first,
// first + step, ... of this warp. kSkip: 0 every destination; 1 (kSkipSelf) my own rank's rows and
// metadata are left to someone else; 2 (owntma) only my own rank's row data is (the metadata, already in
// registers, is stored here); 3 no row data at all, metadata only; 4 (pull, v13) row data only to my own
// rank (the peers pull theirs), metadata to every destination.
// kDyn (v12, lean-dyn): ignore first / step; lane 0 takes the next token from counters[kCounterDispatchWork]
// one token ahead (the atomic's latency hides behind the current token's copy), so faster warps and blocks
// take more tokens and no warp is left with one token more than the others (4096 tokens over 384 warps).
// kSkip 5 (v14, split): only my own rank's row data and metadata (the remote ones are another warp group's).
// kWork: the counter kDyn hands tokens out from (split gives each of its two warp groups its own).
// kOwnBulk (v13, ownbulk): the own-rank row data goes register -> this warp's 2 shared-memory stages
// (kU x 512 B each) -> my recv_x by one cp.async.bulk per chunk issued by lane 0, instead of 16-byte
// st.global from every lane; the pushing warps' remote stores are unchanged. `stage` = this warp's stages.
template <int kU, int kSkip, bool kDyn = false, bool kOwnBulk = false, int kWork = kCounterDispatchWork>
__device__ __forceinline__ void lean_rows(const EpParams& p, const DispatchArgs& a, int first, int step, int lane,
                                          uint8_t* stage = nullptr) {
  const int world = p.world, topk = p.topk, ns = p.num_scales;
  const int my_base = lane < world ? p.base[lane] : 0;
  const int V = p.row_bytes >> 4;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  unsigned* work = p.counters + kWork;
  int t = first;
  int nbulk = 0;  // kOwnBulk: bulk groups committed by lane 0 (the same count in every lane)
  if (kDyn) {
    unsigned g = 0;
    if (lane == 0) g = atomicAdd(work, 1u);
    t = (int)__shfl_sync(0xffffffffu, g, 0);
  }
  for (; !aborted && t < a.num_tokens;) {
    unsigned next = 0;
    if (kDyn && lane == 0) next = atomicAdd(work, 1u);
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = u * 32 + lane;
      if (kSkip != 3 && i < V) buf[u] = ld_nc_v4(src + i);  // kSkip 4 with no own row: loaded, unused
    }
    const int slot = lane < world ? p.slot_map[(size_t)t * world + lane] : -1;
    long long idx = 0;
    float w = 0.f, sc0 = 0.f, sc1 = 0.f;
    if (lane < topk) {
      idx = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const float* scales = a.x_scales + (size_t)t * ns;
    if (lane < ns) sc0 = scales[lane];
    if (lane + 32 < ns) sc1 = scales[lane + 32];
    const int my_row = slot >= 0 ? my_base + slot : -1;
    int rows[EP_MAX_WORLD];
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) rows[d] = __shfl_sync(0xffffffffu, my_row, d);
    for (int v0 = 0; v0 < (kSkip == 3 ? 0 : V); v0 += 32 * kU) {
      if (v0 > 0) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[u] = ld_nc_v4(src + i);
        }
      }
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (rows[d] < 0 || ((kSkip == 1 || kSkip == 2 || kSkip == 3) && d == p.rank) ||
            ((kSkip == 4 || kSkip == 5) && d != p.rank))
          continue;
        int4* dst = reinterpret_cast<int4*>(p.peer_base[d] + p.off_recv_x + (size_t)rows[d] * p.row_bytes);
        if (kOwnBulk && d == p.rank) {
          // stage nbulk & 1 was last read by group nbulk - 2: wait until at most one group is still reading
          if (nbulk >= 2 && lane == 0) bulk_wait_read_all_but_one();
          __syncwarp();
          int4* sb = reinterpret_cast<int4*>(stage + (size_t)(nbulk & 1) * kU * 512);
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (v0 + u * 32 + lane < V) sb[u * 32 + lane] = buf[u];
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic smem writes -> bulk copy
          __syncwarp();
          if (lane == 0) {
            bulk_store(dst + v0, sb, (uint32_t)min(32 * kU, V - v0) * 16u);
            bulk_commit();
          }
          ++nbulk;
          continue;
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) st_v4(dst + i, buf[u]);
        }
      }
    }
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) {
      if (rows[d] < 0 || (kSkip == 1 && d == p.rank) || (kSkip == 5 && d != p.rank)) continue;
      uint8_t* pb = p.peer_base[d];
      if (lane < topk) {
        reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)rows[d] * topk + lane] = idx;
        reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)rows[d] * topk + lane] = w;
      }
      float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)rows[d] * ns;
      if (lane < ns) dst_scales[lane] = sc0;
      if (lane + 32 < ns) dst_scales[lane + 32] = sc1;
      for (int j = lane + 64; j < ns; j += 32) dst_scales[j] = scales[j];
    }
    t = kDyn ? (int)__shfl_sync(0xffffffffu, next, 0) : t + step;
  }
  if (kOwnBulk) {  // every bulk write done and ordered before the caller's release (as TmaRing::drain)
    if (lane == 0 && nbulk > 0) {
      bulk_wait_all();
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
  }
}

template <int kU, int kThreads, bool kSkipSelf = false, bool kDyn = false, bool kOwnBulk = false>
__global__ void __launch_bounds__(kThreads, 1) dispatch_lean_kernel(EpParams p, DispatchArgs a, int epoch) {
  extern __shared__ __align__(128) uint8_t lean_smem[];  // kOwnBulk: 2 x kU x 512 B per warp
  griddep_wait();  // slot_map and base come from the notify kernel
  stamp_sm(p);
  if (kSkipSelf) own_go_release(p, epoch);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int total_warps = gridDim.x * nwarps;
  lean_rows<kU, kSkipSelf ? 1 : 0, kDyn, kOwnBulk>(p, a, blockIdx.x * nwarps + warp, total_warps, lane,
                                                   lean_smem + (size_t)warp * 2 * kU * 512);
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch, kDyn ? kCounterDispatchWork : -1);
}

// split (v14): the own-rank rows by their own warps. Warps [0, W - own_warps) of every block push the remote
// rows and metadata (lean-dyn, tokens from counters[kCounterDispatchWork]); warps [W - own_warps, W) copy the
// own-rank rows and metadata (tokens from counters[kCounterDispatchOwnWork]); each group walks every token,
// so x is read twice. Question (notes v14): is it the own stores inside one warp's store stream, or only
// on the same SM, that costs the 8-SM pushes their link efficiency?
template <int kU, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) dispatch_split_kernel(EpParams p, DispatchArgs a, int epoch,
                                                                     int own_warps) {
  griddep_wait();  // slot_map and base come from the notify kernel
  stamp_sm(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (warp < nwarps - own_warps)
    lean_rows<kU, 1, true>(p, a, 0, 0, lane);
  else
    lean_rows<kU, 5, true, false, kCounterDispatchOwnWork>(p, a, 0, 0, lane);
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch, kCounterDispatchWork,
                        kCounterDispatchOwnWork);
}

// pull (v13): every receiver reads its rows from the sources instead of every source writing them. An SM
// writes at most ~50 GB/s into peers and ~63 GB/s locally (linkbench store / store-local, 1-4 blocks), and
// the push kernels write every row (3 remote + 1 own per token in h200x4) from the sender's SMs: at 8 SMs
// that write port, not NVLink, sets the data phase (~407 GB/s of writes, ~51 GB/s per SM). Pulled rows
// enter through the SM's bulk-copy loads and leave it as local writes only.
// Block = `rings` ring warps + the rest metadata warps.
//   ring warp (lane 0 streams a TmaRing<S, L> of whole rows: peer dispatch_x row -> my recv_x row): units
//     q = (peer index k = q % (world - 1), token t = q / (world - 1)), source (me + 1 + k) % world; ring r of
//     the grid takes units r, r + R, ... (R = rings of the grid) in batches of 32, one per lane: each lane
//     looks up its unit's slot in the source's slot_map (a 4-byte peer load, issued one batch ahead), then
//     the selected rows go into the ring in order, to row seg[s] + slot (seg[s] = rows of sources < s).
//   copy warps: lean_rows<kSkip 4>: my own rows (register copy) and the metadata (ids, weights, fp8 scales)
//     pushed to every destination row, as lean does.
// Handshakes: block 0 releases dsp_ready[me] into every peer once past griddepcontrol.wait (my slot_map and
// my dispatch_x, filled before this call on my stream, are complete); a ring warp waits for every source's
// flag before its first lookup; each source's token count comes with its notify row. The completion barrier
// (done flags) then also means "every peer has finished reading my dispatch_x".
template <int S, int L>
__global__ void __launch_bounds__(512, 1) dispatch_pull_kernel(EpParams p, DispatchArgs a, int epoch, int rings) {
  extern __shared__ __align__(128) uint8_t pull_smem[];
  griddep_wait();  // slot_map and base come from the notify kernel
  stamp_sm(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, me = p.rank;
  if (blockIdx.x == 0 && warp == 0 && lane < world) {
    fence_acq_rel_sys();
    st_release_sys(signal_ptr(p, lane, p.sig.dsp_ready_off + me), epoch);
  }
  if (warp < rings) {
    const uint32_t rb = (uint32_t)p.row_bytes;
    TmaRing<S, L> ring;
    if (lane == 0) ring.init(pull_smem + (size_t)warp * (TmaRing<S, L>::kHeader + (size_t)S * rb), rb);
    bool ok = true;
    if (lane < world && lane != me)
      ok = wait_flag(p, signal_ptr(p, me, p.sig.dsp_ready_off + lane), epoch, lane, kPhaseDispatch);
    ok = __all_sync(0xffffffffu, ok) && ld_volatile(p.dev_error) == 0;
    __syncwarp();  // orders the peers' slot_map (acquired by lane d) before every lane's lookups
    // lane d < world: source d's token count and its first row in my recv buffers (both from the notify rows)
    const int* nrow = signal_ptr(p, me, p.sig.notify_off);
    const int stride = p.sig.notify_stride;
    const int ntok_l = lane < world ? ld_volatile(nrow + lane * stride + 1 + world + p.experts_per_rank) : 0;
    const int cnt_l = lane < world ? ld_volatile(nrow + lane * stride + 1 + me) : 0;
    int base_l = cnt_l;  // inclusive prefix over sources, then exclusive
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, base_l, off);
      if (lane >= off) base_l += v;
    }
    base_l -= cnt_l;
    int maxn = ntok_l;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) maxn = max(maxn, __shfl_xor_sync(0xffffffffu, maxn, off));
    const int np = world - 1;
    const long long Q = ok ? (long long)np * maxn : 0;
    const long long R = (long long)gridDim.x * rings, r0 = (long long)blockIdx.x * rings + warp;
    // unit qq -> source s, token t (-1: none) and the slot load (issued, consumed a batch later)
    auto issue = [&](long long qq, int& s, int& t, int& slot) {
      s = qq < Q ? (me + 1 + (int)(qq % np)) % world : 0;
      t = qq < Q ? (int)(qq / np) : -1;
      slot = -1;
      int n_s = 0;
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        const int v = __shfl_sync(0xffffffffu, ntok_l, d);
        if (d == s) n_s = v;
      }
      if (t >= 0 && t < n_s)
        slot = ld_volatile(reinterpret_cast<const int*>(p.peer_base[s] + p.off_slot_map) + (size_t)t * world + me);
      else
        t = -1;
    };
    long long q = r0 + (long long)lane * R;
    int s_cur, t_cur, slot_cur;
    issue(q, s_cur, t_cur, slot_cur);
    for (long long qb = r0; qb < Q; qb += 32 * R) {
      int s_nxt, t_nxt, slot_nxt;
      issue(q + 32 * R, s_nxt, t_nxt, slot_nxt);  // the next batch's lookups travel meanwhile
      int b_s = 0;
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        const int v = __shfl_sync(0xffffffffu, base_l, d);
        if (d == s_cur) b_s = v;
      }
      const int row = (t_cur >= 0 && slot_cur >= 0) ? b_s + slot_cur : -1;
      unsigned sel = __ballot_sync(0xffffffffu, row >= 0);
      while (sel) {
        const int l = __ffs(sel) - 1;
        sel &= sel - 1;
        const int rs = __shfl_sync(0xffffffffu, s_cur, l), rt = __shfl_sync(0xffffffffu, t_cur, l);
        const int rr = __shfl_sync(0xffffffffu, row, l);
        if (lane == 0)
          ring.push(p.peer_base[rs] + p.off_dispatch_x + (size_t)rt * rb,
                    p.peer_base[me] + p.off_recv_x + (size_t)rr * rb, rb);
      }
      q += 32 * R;
      s_cur = s_nxt;
      t_cur = t_nxt;
      slot_cur = slot_nxt;
    }
    if (lane == 0) ring.drain();
    __syncwarp();
  } else {
    const int mw = nwarps - rings;
    lean_rows<8, 4>(p, a, blockIdx.x * mw + (warp - rings), gridDim.x * mw, lane);
  }
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

// spread (v9): work unit = one (token, destination) pair; pair q -> token t = q / ndest, destination
// index k = (q % ndest + t / tpi) % ndest (tpi = tokens per grid iteration = G / ndest), destination
// (rank + 1 + k) % world, so my own rank comes last (k = world - 1) and is absent when kSkipSelf
// (ndest = world - 1). Global warp g takes pairs g, g + G, ... For a fixed token k runs over every
// destination once (a bijection per token whatever G is), so at every grid iteration the warps are
// spread evenly over the destinations (what dmaj lost), and the t / tpi term turns each warp to the next
// destination on every iteration, so every warp does its share of the (fast) own-rank rows. Each
// 16-byte load feeds exactly one store (the plain-push pattern, v7: fan-out cost +23-27 us at 8 SMs);
// a row is reloaded from HBM / L2 once per destination. Per pair the loads are issued as in lean
// (chunk 0, the slot, ids / weights, the first 64 scales together); a pair whose token does not go
// to that destination is dropped after its loads (dsv3: ~1 in 10 of the own pairs).
// spread's pair loop (v9) over the pushing warps first, first + step, ... (see dispatch_spread_kernel).
template <int kU, bool kSkipSelf>
__device__ __forceinline__ void spread_pairs(const EpParams& p, const DispatchArgs& a, int first, int G, int lane) {
  const int world = p.world, topk = p.topk, ns = p.num_scales;
  const int ndest = kSkipSelf ? world - 1 : world;
  const int tpi = max(1, G / max(ndest, 1));
  const int my_base = lane < world ? p.base[lane] : 0;
  const int V = p.row_bytes >> 4;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  const long long npairs = ndest > 0 ? (long long)a.num_tokens * ndest : 0;
  for (long long q = first; !aborted && q < npairs; q += G) {
    const int t = (int)(q / ndest);
    const int k = ((int)(q % ndest) + t / tpi) % ndest;
    const int d = (p.rank + 1 + k) % world;
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = u * 32 + lane;
      if (i < V) buf[u] = ld_nc_v4(src + i);
    }
    const int slot = p.slot_map[(size_t)t * world + d];  // same address in every lane: one transaction
    long long idx = 0;
    float w = 0.f, sc0 = 0.f, sc1 = 0.f;
    if (lane < topk) {
      idx = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const float* scales = a.x_scales + (size_t)t * ns;
    if (lane < ns) sc0 = scales[lane];
    if (lane + 32 < ns) sc1 = scales[lane + 32];
    if (slot < 0) continue;  // warp-uniform
    const int row = __shfl_sync(0xffffffffu, my_base, d) + slot;
    uint8_t* pb = p.peer_base[d];
    int4* dst = reinterpret_cast<int4*>(pb + p.off_recv_x + (size_t)row * p.row_bytes);
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      if (v0 > 0) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[u] = ld_nc_v4(src + i);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) st_v4(dst + i, buf[u]);
      }
    }
    if (lane < topk) {
      reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)row * topk + lane] = idx;
      reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)row * topk + lane] = w;
    }
    float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)row * ns;
    if (lane < ns) dst_scales[lane] = sc0;
    if (lane + 32 < ns) dst_scales[lane + 32] = sc1;
    for (int j = lane + 64; j < ns; j += 32) dst_scales[j] = scales[j];
  }
}

template <int kU, int kThreads, bool kSkipSelf>
__global__ void __launch_bounds__(kThreads, 1) dispatch_spread_kernel(EpParams p, DispatchArgs a, int epoch) {
  griddep_wait();  // slot_map and base come from the notify kernel
  if (kSkipSelf) own_go_release(p, epoch);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  spread_pairs<kU, kSkipSelf>(p, a, blockIdx.x * nwarps + warp, gridDim.x * nwarps, lane);
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

// v9 own rows (EP_OWN_SIDE*): a small grid on a side stream copies the rows this rank dispatches to
// itself (x row t -> my recv_x row base[me] + slot_map[t][me], plus ids / weights / scales), while the
// data kernel (lean or spread with kSkipSelf) pushes only the remote rows. It is launched before the
// data kernel can have started, so it first waits for the data kernel's go flag (own_go_release): no
// stream event between the notify and the data kernel, whose programmatic dependent launch stays intact.
// A copy engine cannot do this copy: the own rows are a gather (tokens routed to me are not contiguous in
// x) whose addresses exist only on the device after the notify. The wait does not report a timeout of its
// own before 2 x timeout (the notify's or the data kernel's wait names the missing peer first); it bails
// as soon as dev_error is set.
template <int kU, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) own_rows_kernel(EpParams p, DispatchArgs a, int epoch) {
  const int* go = reinterpret_cast<const int*>(p.counters + kCounterOwnGo);
  if (threadIdx.x == 0) {
    const unsigned long long start = globaltimer();
    while (ld_acquire_sys(go) - epoch < 0) {
      if (ld_volatile(p.dev_error) != 0) break;
      if (globaltimer() - start > 2 * p.timeout_ns + 1000000000ull) {
        report_timeout(p.dev_error, p.host_error, p.rank, p.rank, kPhaseDispatch);
        break;
      }
    }
  }
  __syncthreads();
  if (ld_volatile(p.dev_error) != 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int G = gridDim.x * nwarps, world = p.world, topk = p.topk, ns = p.num_scales, me = p.rank;
  const int V = p.row_bytes >> 4;
  const int base = ld_volatile(p.base + me);
  uint8_t* pb = p.peer_base[me];
  for (int t = blockIdx.x * nwarps + warp; t < a.num_tokens; t += G) {
    const int slot = ld_volatile(p.slot_map + (size_t)t * world + me);
    if (slot < 0) continue;
    const int row = base + slot;
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
    int4* dst = reinterpret_cast<int4*>(pb + p.off_recv_x + (size_t)row * p.row_bytes);
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      int4 buf[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) buf[u] = ld_nc_v4(src + i);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) st_v4(dst + i, buf[u]);
      }
    }
    if (lane < topk) {
      reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)row * topk + lane] = a.topk_idx[(size_t)t * topk + lane];
      reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)row * topk + lane] = a.topk_w[(size_t)t * topk + lane];
    }
    float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)row * ns;
    for (int j = lane; j < ns; j += 32) dst_scales[j] = a.x_scales[(size_t)t * ns + j];
  }
}

// dmaj (v7, destination-major): warp g owns the contiguous token range [g * per, (g + 1) * per)
// (per = ceil(T / G)) and copies it to one destination at a time: for each destination d (warps
// start at different d: warp g at (rank + 1 + g) % world when kRotate), it walks its tokens that go
// to d in order, so its rows land in one contiguous run of d's recv buffer (slots of consecutive
// tokens bound for d are consecutive). Every row is loaded from x once per destination (HBM reads
// are ~14x cheaper than NVLink bytes), one 16-byte load feeds one remote store, like the plain
// push of the micro-benchmark. Loads are pipelined one chunk ahead, across token boundaries, and a
// token's ids / weights / scales are loaded before its first store. Slots come 32 tokens at a time
// (one lane per token) and a ballot picks the tokens bound for d.
template <int kU, int kThreads, bool kRotate>
__global__ void __launch_bounds__(kThreads, 1) dispatch_dmaj_kernel(EpParams p, DispatchArgs a, int epoch) {
  griddep_wait();  // slot_map and base come from the notify kernel
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int G = gridDim.x * nwarps, g = blockIdx.x * nwarps + warp;
  const int world = p.world, topk = p.topk, ns = p.num_scales, T = a.num_tokens;
  const int V = p.row_bytes >> 4;
  const int per = (T + G - 1) / G;
  const int tb = min(T, g * per), te = min(T, tb + per);
  const bool aborted = ld_volatile(p.dev_error) != 0;
  for (int j = 0; !aborted && tb < te && j < world; ++j) {
    const int d = kRotate ? (p.rank + 1 + g + j) % world : (p.rank + 1 + j) % world;
    const int dbase = p.base[d];
    uint8_t* pb = p.peer_base[d];
    // cursor over my tokens bound for d: group of 32 tokens from gt0, lane l holds slot of gt0 + l
    int gt0 = tb, gslot = -1;
    unsigned todo = 0;
    {
      const int tt = gt0 + lane;
      gslot = tt < te ? p.slot_map[(size_t)tt * world + d] : -1;
      todo = __ballot_sync(0xffffffffu, gslot >= 0);
    }
    int t = -1, row = -1;
    // advance: next token of mine bound for d (warp-uniform), false when none is left
#define DMAJ_ADVANCE(T_, ROW_, OK_)                                              \
  do {                                                                           \
    OK_ = false;                                                                 \
    while (todo == 0 && gt0 + 32 < te) {                                         \
      gt0 += 32;                                                                 \
      const int tt = gt0 + lane;                                                 \
      gslot = tt < te ? p.slot_map[(size_t)tt * world + d] : -1;                 \
      todo = __ballot_sync(0xffffffffu, gslot >= 0);                             \
    }                                                                            \
    if (todo != 0) {                                                             \
      const int b = __ffs(todo) - 1;                                             \
      todo &= todo - 1;                                                          \
      T_ = gt0 + b;                                                              \
      ROW_ = dbase + __shfl_sync(0xffffffffu, gslot, b);                         \
      OK_ = true;                                                                \
    }                                                                            \
  } while (0)
    bool have;
    DMAJ_ADVANCE(t, row, have);
    int4 buf[kU];
    if (have) {
      const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = u * 32 + lane;
        if (i < V) buf[u] = ld_nc_v4(src + i);
      }
    }
    while (have) {
      long long idx = 0;
      float w = 0.f, sc0 = 0.f, sc1 = 0.f;
      if (lane < topk) {
        idx = a.topk_idx[(size_t)t * topk + lane];
        w = a.topk_w[(size_t)t * topk + lane];
      }
      const float* scales = a.x_scales + (size_t)t * ns;
      if (lane < ns) sc0 = scales[lane];
      if (lane + 32 < ns) sc1 = scales[lane + 32];
      const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
      int4* dst = reinterpret_cast<int4*>(pb + p.off_recv_x + (size_t)row * p.row_bytes);
      int tn = -1, rown = -1;
      bool have_next = false;
      for (int v0 = 0; v0 < V; v0 += 32 * kU) {
        int4 nb[kU];
        if (v0 + 32 * kU < V) {  // next chunk of this row
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int i = v0 + 32 * kU + u * 32 + lane;
            if (i < V) nb[u] = ld_nc_v4(src + i);
          }
        } else {  // chunk 0 of my next token bound for d
          DMAJ_ADVANCE(tn, rown, have_next);
          if (have_next) {
            const int4* nsrc = reinterpret_cast<const int4*>(a.x + (size_t)tn * p.row_bytes);
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int i = u * 32 + lane;
              if (i < V) nb[u] = ld_nc_v4(nsrc + i);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) st_v4(dst + i, buf[u]);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) buf[u] = nb[u];
      }
      if (lane < topk) {
        reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)row * topk + lane] = idx;
        reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)row * topk + lane] = w;
      }
      float* dst_scales = reinterpret_cast<float*>(pb + p.off_recv_scales) + (size_t)row * ns;
      if (lane < ns) dst_scales[lane] = sc0;
      if (lane + 32 < ns) dst_scales[lane + 32] = sc1;
      for (int jj = lane + 64; jj < ns; jj += 32) dst_scales[jj] = scales[jj];
      t = tn;
      row = rown;
      have = have_next;
    }
#undef DMAJ_ADVANCE
  }
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

template <int kU, int kThreads, bool kPipelined>
__global__ void __launch_bounds__(kThreads, 1) dispatch_reg_kernel(EpParams p, DispatchArgs a, int epoch) {
  griddep_wait();  // slot_map and base come from the notify kernel
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int total_warps = gridDim.x * nwarps;
  const int my_base = lane < p.world ? p.base[lane] : 0;
  const int V = p.row_bytes >> 4;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  for (int t = blockIdx.x * nwarps + warp; !aborted && t < a.num_tokens; t += total_warps) {
    int rows[EP_MAX_WORLD];
    dest_rows(p, t, lane, my_base, rows);
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * p.row_bytes);
    int4 buf[kU], next[kU];
    if (kPipelined) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = u * 32 + lane;
        if (i < V) next[u] = ld_nc_v4(src + i);
      }
    }
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      if (kPipelined) {
        // chunk v0 is already in flight in next[]: take it, then start the following chunk's loads
#pragma unroll
        for (int u = 0; u < kU; ++u) buf[u] = next[u];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + 32 * kU + u * 32 + lane;
          if (i < V) next[u] = ld_nc_v4(src + i);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[u] = ld_nc_v4(src + i);
        }
      }
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (rows[d] < 0) continue;
        int4* dst = reinterpret_cast<int4*>(p.peer_base[d] + p.off_recv_x + (size_t)rows[d] * p.row_bytes);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) st_v4(dst + i, buf[u]);
        }
      }
    }
    copy_metadata(p, a, t, lane, rows);
  }
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

constexpr int kTmaMaxThreads = 1024;

__device__ __forceinline__ size_t tma_bar_bytes(int nwarps, int stages) {
  return ((size_t)nwarps * stages * sizeof(uint64_t) + 127) / 128 * 128;
}

__global__ void __launch_bounds__(kTmaMaxThreads, 1)
    dispatch_tma_kernel(EpParams p, DispatchArgs a, int epoch, int stages) {
  extern __shared__ __align__(128) uint8_t smem[];
  griddep_wait();  // slot_map and base come from the notify kernel
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const uint32_t row_bytes = (uint32_t)p.row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * stages;
  uint8_t* ring = smem + tma_bar_bytes(nwarps, stages) + (size_t)warp * stages * row_bytes;
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(bars + s, 1);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncwarp();

  const int first = blockIdx.x * nwarps + warp, step = gridDim.x * nwarps;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int n = (!aborted && first < a.num_tokens) ? (a.num_tokens - first + step - 1) / step : 0;
  const int my_base = lane < p.world ? p.base[lane] : 0;
  if (lane == 0) {
    for (int j = 0; j < stages - 1 && j < n; ++j) {
      mbar_expect_tx(bars + j, row_bytes);
      bulk_load(ring + (size_t)j * row_bytes, a.x + (size_t)(first + j * step) * row_bytes, row_bytes, bars + j);
    }
  }
  for (int j = 0; j < n; ++j) {
    const int t = first + j * step;
    int rows[EP_MAX_WORLD];
    dest_rows(p, t, lane, my_base, rows);
    if (lane == 0) {
      const int s = j % stages;
      mbar_wait(bars + s, (uint32_t)((j / stages) & 1));
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (rows[d] < 0) continue;
        bulk_store(p.peer_base[d] + p.off_recv_x + (size_t)rows[d] * row_bytes, ring + (size_t)s * row_bytes,
                   row_bytes);
      }
      bulk_commit();
      const int jn = j + stages - 1;
      if (jn < n) {
        bulk_wait_read_all_but_one();  // the group of token j - 1, which used stage jn % stages, is read
        const int sn = jn % stages;
        mbar_expect_tx(bars + sn, row_bytes);
        bulk_load(ring + (size_t)sn * row_bytes, a.x + (size_t)(first + jn * step) * row_bytes, row_bytes,
                  bars + sn);
      }
    }
    copy_metadata(p, a, t, lane, rows);
  }
  if (lane == 0) {
    bulk_wait_all();
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncwarp();
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

// owntma (v10, ring v11) and spreadtma (v11): the rows to my own rank move through the SM's bulk-copy
// unit (TMA) instead of the pushing warps' registers. Warps 0 .. nwarps - 2 of every block push only the
// remote rows (lean or spread with kSkipSelf); the last warp copies the own rows of its block's tokens
// (blockIdx.x, + gridDim.x, ...): for 32 tokens at a time, each lane looks up its token's own slot
// (spreadtma: and stores that token's ids, weights and scales; owntma's pushing warps store them from
// the registers they already hold), then lane 0 streams the batch's rows x[t] -> my recv_x[base[me] + slot] through a TmaRing (12 row stages, 8
// loads ahead where they fit, else 6 / 4), carried across batches. v9 measured what the own stores
// cost the pushing warps at 8 SMs (ladder mode 15 vs 11: +50 us; spread with the own rows on 2 extra SMs:
// data phase 590 us vs lean 664); v10 moved 4 rows per round trip (load all, wait, store all, wait) and
// was latency-bound at ~10 GB/s per SM; the ring keeps several rows loading while earlier ones store.
constexpr int kOwnBatchBytes = 256;  // 32 token indices + 32 rows, before the ring (128-byte aligned)

// kMeta: this warp also stores the own rows' ids, weights and scales (spreadtma; owntma's pushing warps
// store them from registers). S stages, L loads ahead (TmaRing).
template <bool kMeta, int S, int L>
__device__ __forceinline__ void own_rows_tma(const EpParams& p, const DispatchArgs& a, uint8_t* smem, int lane) {
  const uint32_t rb = (uint32_t)p.row_bytes;
  const int me = p.rank, world = p.world, topk = p.topk, ns = p.num_scales;
  int* batch_tok = reinterpret_cast<int*>(smem);  // the batch's own rows, compacted (lane 0 reads them)
  int* batch_row = batch_tok + 32;
  TmaRing<S, L> ring;
  if (lane == 0) ring.init(smem + kOwnBatchBytes, rb);
  __syncwarp();
  const int T = a.num_tokens, G = gridDim.x;
  const int n = (int)blockIdx.x < T ? (T - (int)blockIdx.x + G - 1) / G : 0;  // tokens of this block
  const int base = p.base[me];
  uint8_t* recv = p.peer_base[me];
  const bool aborted = ld_volatile(p.dev_error) != 0;
  for (int j0 = 0; !aborted && j0 < n; j0 += 32) {
    const int t = (int)blockIdx.x + (j0 + lane) * G;
    const int slot = j0 + lane < n ? p.slot_map[(size_t)t * world + me] : -1;
    const int row = base + slot;
    if (kMeta && slot >= 0) {  // this lane's token: its metadata, loads of every field before the stores
      long long idx[EP_MAX_TOPK];
      float w[EP_MAX_TOPK];
#pragma unroll
      for (int k = 0; k < EP_MAX_TOPK; ++k) {
        if (k < topk) {
          idx[k] = a.topk_idx[(size_t)t * topk + k];
          w[k] = a.topk_w[(size_t)t * topk + k];
        }
      }
      long long* di = reinterpret_cast<long long*>(recv + p.off_recv_idx) + (size_t)row * topk;
      float* dw = reinterpret_cast<float*>(recv + p.off_recv_w) + (size_t)row * topk;
#pragma unroll
      for (int k = 0; k < EP_MAX_TOPK; ++k) {
        if (k < topk) {
          di[k] = idx[k];
          dw[k] = w[k];
        }
      }
      const float* src_s = a.x_scales + (size_t)t * ns;
      float* dst_s = reinterpret_cast<float*>(recv + p.off_recv_scales) + (size_t)row * ns;
#pragma unroll 8
      for (int j = 0; j < ns; ++j) dst_s[j] = src_s[j];
    }
    const unsigned have = __ballot_sync(0xffffffffu, slot >= 0);
    if (slot >= 0) {
      const int at = __popc(have & ((1u << lane) - 1));
      batch_tok[at] = t;
      batch_row[at] = row;
    }
    __syncwarp();
    if (lane == 0) {
      const int cnt = __popc(have);
      for (int i = 0; i < cnt; ++i)
        ring.push(a.x + (size_t)batch_tok[i] * rb, recv + p.off_recv_x + (size_t)batch_row[i] * rb, rb);
    }
    __syncwarp();
  }
  if (lane == 0) ring.drain();
  __syncwarp();
}

// kSpread false: owntma (lean for the remote rows); true: spreadtma (spread for the remote pairs).
template <int kU, int kThreads, bool kSpread, int S, int L>
__global__ void __launch_bounds__(kThreads, 1) dispatch_owntma_kernel(EpParams p, DispatchArgs a, int epoch) {
  extern __shared__ __align__(128) uint8_t own_smem[];
  griddep_wait();  // slot_map and base come from the notify kernel
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int first = blockIdx.x * (nwarps - 1) + warp, step = gridDim.x * (nwarps - 1);
  if (warp == nwarps - 1) {
    own_rows_tma<kSpread, S, L>(p, a, own_smem, lane);
  } else if (kSpread) {
    spread_pairs<kU, true>(p, a, first, step, lane);
  } else {
    lean_rows<kU, 2>(p, a, first, step, lane);
  }
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

}  // namespace

extern "C" int ep_dispatch(void* vctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                           int num_tokens, int num_sms, int impl, int warps, int stages, int epoch, void* vstream) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  cudaStream_t stream = (cudaStream_t)vstream;
  if (!ctx->peers_open) {
    ep_set_error("peers not opened: call ep_open_peers first");
    return -1;
  }
  if (num_tokens < 0 || num_tokens > p.max_tokens) {
    ep_set_error("num_tokens %d outside 0..max_tokens %d", num_tokens, p.max_tokens);
    return -1;
  }
  if (num_sms < 1 || warps < 1 || warps > 32) {
    ep_set_error("num_sms must be >= 1 and warps 1..32 (got %d, %d)", num_sms, warps);
    return -1;
  }
  if (p.num_scales > 0 && x_scales == nullptr && num_tokens > 0) {
    ep_set_error("fp8 dispatch needs x_scales");
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  // v9 own rows on a side stream: only for lean and spread (the other variants ignore the option).
  const bool own_side = ctx->own_copy != EP_OWN_OFF && (impl == EP_DISPATCH_LEAN || impl == EP_DISPATCH_SPREAD);
  int data_sms = num_sms;
  if (own_side) {
    if (ctx->own_copy == EP_OWN_SIDE_IN) data_sms = num_sms - ctx->own_blocks;
    if (data_sms < 1) {
      ep_set_error("own copy side-in: num_sms %d leaves no block beside %d own-row blocks", num_sms, ctx->own_blocks);
      return -1;
    }
    if (ctx->own_stream == nullptr) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->own_stream, cudaStreamNonBlocking));
      CUDA_CHECK(cudaEventCreateWithFlags(&ctx->own_ev_pre, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&ctx->own_ev_done, cudaEventDisableTiming));
    }
    // the side stream starts after everything queued before this call (buffer reuse), not after the notify
    CUDA_CHECK(cudaEventRecord(ctx->own_ev_pre, stream));
    CUDA_CHECK(cudaStreamWaitEvent(ctx->own_stream, ctx->own_ev_pre, 0));
  }
  if (impl == EP_DISPATCH_PULL &&  // checked before anything is launched (see the pull launch below)
      ((const uint8_t*)x != ctx->region + p.off_dispatch_x || p.row_bytes % 16 != 0 ||
       TmaRing<4, 2>::kHeader + 4 * (size_t)p.row_bytes > (size_t)ctx->max_smem_optin)) {
    ep_set_error("pull dispatch: x must be the EP_DISPATCH_X region and a row a multiple of 16 bytes <= %d (got %d)",
                 (ctx->max_smem_optin - TmaRing<4, 2>::kHeader) / 4, p.row_bytes);
    return -1;
  }
  if (ep_launch_notify(ctx, (const int64_t*)topk_idx, num_tokens, num_sms, epoch, stream) != 0) return -1;

  DispatchArgs a;
  a.x = (const uint8_t*)x;
  a.x_scales = (const float*)x_scales;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;

  if (impl == EP_DISPATCH_TMA) {
    const size_t bar_bytes = ((size_t)warps * 32 * sizeof(uint64_t) + 127) / 128 * 128;
    const size_t room = (size_t)ctx->max_smem_optin - bar_bytes;
    const int fit = (int)std::min<size_t>(room / ((size_t)warps * p.row_bytes), 32);
    const int use = std::min(stages, fit);
    if (use >= 2) {
      const size_t smem = ((size_t)warps * use * sizeof(uint64_t) + 127) / 128 * 128 + (size_t)warps * use * p.row_bytes;
      CUDA_CHECK(cudaFuncSetAttribute(dispatch_tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      CUDA_CHECK(launch_dependent(dispatch_tma_kernel, num_sms, warps * 32, smem, stream, p, a, epoch, use));
      return 0;
    }
    // Rows too large for two stages per warp: the register path below handles any size.
  }
  if ((impl == EP_DISPATCH_OWNTMA || impl == EP_DISPATCH_SPREADTMA) && warps >= 2 && warps <= 16 &&
      p.row_bytes % 16 == 0) {
    // the deepest ring that fits: 12 stages, 8 loads ahead (bf16 rows up to ~18 KB), else 6 / 4
    const size_t hdr = kOwnBatchBytes + TmaRing<12, 8>::kHeader;
    const bool deep = hdr + 12 * (size_t)p.row_bytes <= (size_t)ctx->max_smem_optin;
    const size_t smem = hdr + (deep ? 12 : 6) * (size_t)p.row_bytes;
    if (smem <= (size_t)ctx->max_smem_optin) {
      const bool own = impl == EP_DISPATCH_OWNTMA;
      auto kernel = deep ? (own ? dispatch_owntma_kernel<8, 512, false, 12, 8> : dispatch_owntma_kernel<8, 512, true, 12, 8>)
                         : (own ? dispatch_owntma_kernel<8, 512, false, 6, 4> : dispatch_owntma_kernel<8, 512, true, 6, 4>);
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      CUDA_CHECK(launch_dependent(kernel, num_sms, warps * 32, smem, stream, p, a, epoch));
      return 0;
    }
  }
  // owntma / spreadtma outside their limits (rows too large for the ring, fp8 rows not 16-byte
  // multiples, > 16 warps) fall through to lean / spread.
  if (impl == EP_DISPATCH_OWNTMA) impl = EP_DISPATCH_LEAN;
  if (impl == EP_DISPATCH_SPREADTMA) impl = EP_DISPATCH_SPREAD;
  if (impl == EP_DISPATCH_NOTIFY_ONLY) return 0;
  const bool pipe = impl == EP_DISPATCH_REG_PIPELINED;
  const int threads = warps * 32;
  if (impl == EP_DISPATCH_DMAJ || impl == EP_DISPATCH_DMAJ_NOROT) {
    const bool rot = impl == EP_DISPATCH_DMAJ;
    if (warps <= 16) {
      CUDA_CHECK(rot ? launch_dependent(dispatch_dmaj_kernel<8, 512, true>, num_sms, threads, 0, stream, p, a, epoch)
                     : launch_dependent(dispatch_dmaj_kernel<8, 512, false>, num_sms, threads, 0, stream, p, a, epoch));
    } else {
      CUDA_CHECK(rot ? launch_dependent(dispatch_dmaj_kernel<4, 1024, true>, num_sms, threads, 0, stream, p, a, epoch)
                     : launch_dependent(dispatch_dmaj_kernel<4, 1024, false>, num_sms, threads, 0, stream, p, a, epoch));
    }
    return 0;
  }
  if (own_side) {  // v9: lean or spread without the own rows, which a side-stream kernel copies
    if (impl == EP_DISPATCH_LEAN) {
      CUDA_CHECK(warps <= 16
                     ? launch_dependent(dispatch_lean_kernel<8, 512, true>, data_sms, threads, 0, stream, p, a, epoch)
                     : launch_dependent(dispatch_lean_kernel<4, 1024, true>, data_sms, threads, 0, stream, p, a, epoch));
    } else {
      CUDA_CHECK(warps <= 16
                     ? launch_dependent(dispatch_spread_kernel<8, 512, true>, data_sms, threads, 0, stream, p, a, epoch)
                     : launch_dependent(dispatch_spread_kernel<4, 1024, true>, data_sms, threads, 0, stream, p, a, epoch));
    }
    own_rows_kernel<8, 512><<<ctx->own_blocks, 512, 0, ctx->own_stream>>>(p, a, epoch);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(ctx->own_ev_done, ctx->own_stream));
    CUDA_CHECK(cudaStreamWaitEvent(stream, ctx->own_ev_done, 0));
    return 0;
  }
  if (impl == EP_DISPATCH_SPREAD) {
    CUDA_CHECK(warps <= 16
                   ? launch_dependent(dispatch_spread_kernel<8, 512, false>, num_sms, threads, 0, stream, p, a, epoch)
                   : launch_dependent(dispatch_spread_kernel<4, 1024, false>, num_sms, threads, 0, stream, p, a, epoch));
    return 0;
  }
  if (impl == EP_DISPATCH_PULL) {
    // rings of 4 row stages, 2 loads ahead (linkbench tma-pull-16k: 323 GB/s at 8 blocks with 3 rings), as many
    // as fit (at most 6), plus 8 copy warps. Every rank must take this path (peers wait for its flags): x must
    // be my dispatch_x region and the rows whole 16-byte units, else it is an error, not a fallback.
    const size_t per_ring = TmaRing<4, 2>::kHeader + 4 * (size_t)p.row_bytes;
    const int rings = (int)std::min<size_t>(6, (size_t)ctx->max_smem_optin / per_ring);
    const size_t smem = (size_t)rings * per_ring;
    CUDA_CHECK(cudaFuncSetAttribute(dispatch_pull_kernel<4, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
    CUDA_CHECK(launch_dependent(dispatch_pull_kernel<4, 2>, num_sms, (rings + 8) * 32, smem, stream, p, a, epoch,
                                rings));
    return 0;
  }
  if (impl == EP_DISPATCH_OWNBULK && warps <= 16) {  // 8 KiB of stages per warp: up to 128 KiB
    auto kernel = dispatch_lean_kernel<8, 512, false, true, true>;
    const size_t smem = std::max((size_t)warps * 2 * 8 * 512, exclusive_smem(ctx));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CUDA_CHECK(launch_dependent(kernel, num_sms, threads, smem, stream, p, a, epoch));
    return 0;
  }
  if (impl == EP_DISPATCH_SPLIT && warps >= 2) {
    const int own = std::min(ctx->split_own_warps, warps - 1);
    CUDA_CHECK(warps <= 16
                   ? launch_dependent(dispatch_split_kernel<8, 512>, num_sms, threads, 0, stream, p, a, epoch, own)
                   : launch_dependent(dispatch_split_kernel<4, 1024>, num_sms, threads, 0, stream, p, a, epoch, own));
    return 0;
  }
  if (impl == EP_DISPATCH_SPLIT) impl = EP_DISPATCH_LEAN_DYN;  // one warp: nothing to split
  if (impl == EP_DISPATCH_OWNBULK) impl = EP_DISPATCH_LEAN_DYN;  // > 16 warps: the stages do not fit
  if (impl == EP_DISPATCH_LEAN || impl == EP_DISPATCH_LEAN_DYN) {
    const bool dyn = impl == EP_DISPATCH_LEAN_DYN;
    auto kernel = warps <= 16 ? (dyn ? dispatch_lean_kernel<8, 512, false, true> : dispatch_lean_kernel<8, 512>)
                              : (dyn ? dispatch_lean_kernel<4, 1024, false, true> : dispatch_lean_kernel<4, 1024>);
    CUDA_CHECK(exclusive_smem_attr(ctx, kernel));
    CUDA_CHECK(launch_dependent(kernel, num_sms, threads, exclusive_smem(ctx), stream, p, a, epoch));
    return 0;
  }
  if (warps <= 16) {
    CUDA_CHECK(pipe ? launch_dependent(dispatch_reg_kernel<8, 512, true>, num_sms, threads, 0, stream, p, a, epoch)
                    : launch_dependent(dispatch_reg_kernel<8, 512, false>, num_sms, threads, 0, stream, p, a, epoch));
  } else {
    CUDA_CHECK(pipe ? launch_dependent(dispatch_reg_kernel<4, 1024, true>, num_sms, threads, 0, stream, p, a, epoch)
                    : launch_dependent(dispatch_reg_kernel<4, 1024, false>, num_sms, threads, 0, stream, p, a, epoch));
  }
  return 0;
}

extern "C" int ep_set_own_copy(void* vctx, int mode, int blocks) {
  EpContext* ctx = (EpContext*)vctx;
  if ((mode != EP_OWN_OFF && mode != EP_OWN_SIDE && mode != EP_OWN_SIDE_IN) || blocks < 1 || blocks > 64) {
    ep_set_error("ep_set_own_copy: bad mode %d or blocks %d (1..64)", mode, blocks);
    return -1;
  }
  ctx->own_copy = mode;
  ctx->own_blocks = blocks;
  return 0;
}
