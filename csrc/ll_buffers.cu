// Low-latency buffers: one cudaMalloc region per rank laid out as in ll_common.cuh, wrapped in an
// EpContext so that the normal mode's IPC export / peer mapping / timeout record / teardown
// (buffers.cu: ep_ipc_handle, ep_open_peers, ep_poll_error, ep_error_flag_ptr, ep_destroy) serve
// it unchanged. All sizes are the worst case (every token of every rank to one expert), so
// nothing is allocated after ep_ll_create.
#include <string.h>
#include <algorithm>

#include "ll_common.cuh"

namespace {

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Carve {
  size_t next = 0;
  size_t take(size_t bytes) {
    const size_t off = align_up(next, 256);
    next = off + bytes;
    return off;
  }
};

// Largest staged topk_idx (int32, T_max x topk) the dispatch kernel keeps in shared memory.
constexpr size_t kMaxStagedIdxBytes = 48 * 1024;
// ep_ll_probe's scratch: [0, 64) the flag, counter, epoch and chase words; [64, 128) the ping flags (u64, by
// source rank); [128, 160) the ping epochs (i32, by block); from kPingRows a landing row of hidden x 2 bytes a
// source rank (the combine's bf16 row, the largest row a ping sends).
constexpr size_t kPingFlags = 64, kPingEpochs = 128, kPingRows = 256;
size_t ll_probe_bytes(int world, int hidden) { return kPingRows + (size_t)world * hidden * 2; }

}  // namespace

extern "C" int ep_ll_create(const ep_config* cfg, void** out) {
  *out = nullptr;
  if (cfg->world < 1 || cfg->world > EP_MAX_WORLD || cfg->rank < 0 || cfg->rank >= cfg->world) {
    ep_set_error("world must be 1..%d and 0 <= rank < world (got rank %d world %d)", EP_MAX_WORLD, cfg->rank,
                 cfg->world);
    return -1;
  }
  if (cfg->topk < 1 || cfg->topk > EP_MAX_TOPK || cfg->experts_per_rank < 1 || cfg->max_tokens < 1) {
    ep_set_error("topk must be 1..%d, experts_per_rank and max_tokens positive", EP_MAX_TOPK);
    return -1;
  }
  if (cfg->hidden % (cfg->fp8 ? 128 : 8) != 0) {
    ep_set_error("hidden %d must be a multiple of %d", cfg->hidden, cfg->fp8 ? 128 : 8);
    return -1;
  }
  if ((size_t)cfg->max_tokens * cfg->topk * sizeof(int) > kMaxStagedIdxBytes) {
    ep_set_error("max_tokens x topk = %d exceeds the low-latency kernels' %zu staged ids", cfg->max_tokens * cfg->topk,
                 kMaxStagedIdxBytes / sizeof(int));
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(cfg->device));
  EpContext* ep = new EpContext();
  memset(ep, 0, sizeof(*ep));
  LlContext* ctx = new LlContext();
  memset(ctx, 0, sizeof(*ctx));
  ctx->ep = ep;
  EpParams& p = ep->p;
  LlParams& lp = ctx->lp;
  ep->device = cfg->device;
  p.rank = cfg->rank;
  p.world = cfg->world;
  p.experts_per_rank = cfg->experts_per_rank;
  p.topk = cfg->topk;
  p.hidden = cfg->hidden;
  p.num_scales = cfg->fp8 ? cfg->hidden / 128 : 0;
  p.row_bytes = cfg->fp8 ? cfg->hidden : cfg->hidden * 2;
  p.max_tokens = cfg->max_tokens;
  p.capacity = cfg->world * cfg->max_tokens;
  p.timeout_ns = (unsigned long long)(cfg->timeout_s * 1e9);
  lp.t_max = cfg->max_tokens;
  lp.capacity = cfg->world * cfg->max_tokens;
  lp.experts = cfg->experts_per_rank;
  lp.num_experts = cfg->world * cfg->experts_per_rank;

  const size_t slots = (size_t)lp.experts * lp.capacity;
  Carve c;
  lp.off_x = c.take(slots * p.row_bytes);
  lp.off_scales = c.take(slots * p.num_scales * sizeof(float));
  lp.off_pair = c.take(slots * sizeof(int));
  lp.off_stage = c.take((size_t)p.world * lp.t_max * p.row_bytes);
  lp.off_sscales = c.take((size_t)p.world * lp.t_max * p.num_scales * sizeof(float));
  lp.off_cnt = c.take((size_t)p.world * lp.experts * sizeof(int));
  lp.off_dflags = c.take(EP_MAX_WORLD * sizeof(unsigned long long));
  lp.off_tmap = c.take((size_t)p.world * lp.t_max * p.topk * sizeof(unsigned long long));
  lp.off_tw = c.take((size_t)p.world * lp.t_max * p.topk * sizeof(float));
  lp.off_crows = c.take((size_t)lp.t_max * p.world * p.hidden * 2);
  lp.off_cflags = c.take(EP_MAX_WORLD * sizeof(int));
  lp.cflag_chunks = (p.hidden / 8 + 63) / 64;  // combine chunks at the smaller chunk (2 vectors per lane)
  lp.tflag_chunks = (p.row_bytes / 16 + 32 * kLlRowChunkV - 1) / (32 * kLlRowChunkV);
  const size_t tflag_bytes = (size_t)p.world * lp.t_max * lp.tflag_chunks * sizeof(unsigned long long);
  const size_t dword_bytes = (size_t)p.world * (lp.experts + 1) * sizeof(unsigned long long);
  const size_t tcflag_bytes = (size_t)lp.t_max * p.world * lp.cflag_chunks * sizeof(unsigned long long);
  lp.off_tflags = c.take(tflag_bytes);
  lp.off_dwords = c.take(dword_bytes);
  lp.off_tcflags = c.take(tcflag_bytes);
  lp.lrow_head = ll_inline_head(p.topk, p.num_scales);
  lp.line_count = ll_line_count<64>(p.row_bytes);
  lp.line128_count = ll_line_count<128>(p.row_bytes);
  lp.lline_words = std::max(lp.line_count * 8, lp.line128_count * 16);  // the larger of the two rows (a line size's rows
  // lie Lc x kWords words apart: 64- or 128-byte aligned, as their lines)
  lp.lrow_words = lp.lrow_head + 4 * (p.row_bytes / 16);
  const size_t lstage_bytes = (size_t)p.world * lp.t_max * lp.lrow_words * sizeof(unsigned long long);
  lp.off_lstage = c.take(lstage_bytes);
  const size_t lline_bytes = (size_t)p.world * lp.t_max * lp.lline_words * sizeof(unsigned long long);
  lp.off_lline = c.take(lline_bytes);
  ep->shared_bytes = c.next;
  ctx->off_y = c.take(slots * p.hidden * 2);
  ctx->off_out = c.take((size_t)lp.t_max * p.hidden * 2);
  ctx->off_counts = c.take((size_t)lp.experts * sizeof(long long));
  ctx->off_src_counts = c.take((size_t)lp.experts * p.world * sizeof(int));
  ctx->off_src_tokens = c.take(EP_MAX_WORLD * sizeof(int));
  ctx->off_epochs = c.take(2 * sizeof(int));
  ctx->off_counters = c.take(4 * sizeof(unsigned));
  ctx->off_dev_error = c.take(sizeof(int));
  ctx->off_probe = c.take(ll_probe_bytes(p.world, p.hidden));
  CUDA_CHECK(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, cfg->device));
  lp.eslot_count = ctx->sm_count;
  ctx->off_eslots = c.take(2 * (size_t)lp.eslot_count * sizeof(int));
  ctx->token_smem = ll_token_smem_bytes(lp.t_max, p.topk, lp.num_experts);
  ep->region_bytes = align_up(c.next, 1 << 21);

  cudaError_t err = cudaMalloc(&ep->region, ep->region_bytes);
  if (err != cudaSuccess) {
    ep_set_error("cudaMalloc of %zu bytes failed: %s", ep->region_bytes, cudaGetErrorString(err));
    delete ep;
    delete ctx;
    return -1;
  }
  uint8_t* r = ep->region;
  // Flags, epochs, counters and the error word start at zero; the buffers are garbage until written.
  CUDA_CHECK(cudaMemset(r + lp.off_dflags, 0, EP_MAX_WORLD * sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(r + lp.off_cflags, 0, EP_MAX_WORLD * sizeof(int)));
  CUDA_CHECK(cudaMemset(r + lp.off_tmap, 0, (size_t)p.world * lp.t_max * p.topk * sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(r + ctx->off_src_tokens, 0, EP_MAX_WORLD * sizeof(int)));
  CUDA_CHECK(cudaMemset(r + ctx->off_epochs, 0, 2 * sizeof(int)));
  CUDA_CHECK(cudaMemset(r + ctx->off_counters, 0, 4 * sizeof(unsigned)));
  CUDA_CHECK(cudaMemset(r + ctx->off_dev_error, 0, sizeof(int)));
  CUDA_CHECK(cudaMemset(r + ctx->off_probe, 0, ll_probe_bytes(p.world, p.hidden)));
  CUDA_CHECK(cudaMemset(r + lp.off_tflags, 0, tflag_bytes));
  CUDA_CHECK(cudaMemset(r + lp.off_dwords, 0, dword_bytes));
  CUDA_CHECK(cudaMemset(r + lp.off_tcflags, 0, tcflag_bytes));
  CUDA_CHECK(cudaMemset(r + lp.off_lstage, 0, lstage_bytes));
  CUDA_CHECK(cudaMemset(r + lp.off_lline, 0, lline_bytes));
  CUDA_CHECK(cudaMemset(r + ctx->off_eslots, 0, 2 * (size_t)lp.eslot_count * sizeof(int)));
  CUDA_CHECK(cudaMemset(r + ctx->off_counts, 0, (size_t)lp.experts * sizeof(long long)));
  CUDA_CHECK(cudaMemset(r + ctx->off_src_counts, 0, (size_t)lp.experts * p.world * sizeof(int)));

  void* host_err = nullptr;
  CUDA_CHECK(cudaHostAlloc(&host_err, sizeof(EpErrorInfo), cudaHostAllocMapped));
  memset(host_err, 0, sizeof(EpErrorInfo));
  ep->host_error = (EpErrorInfo*)host_err;
  void* dev_alias = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&dev_alias, host_err, 0));
  p.host_error = (EpErrorInfo*)dev_alias;

  lp.y = (uint16_t*)(r + ctx->off_y);
  lp.out = (uint16_t*)(r + ctx->off_out);
  lp.counts = (long long*)(r + ctx->off_counts);
  lp.src_counts = (int*)(r + ctx->off_src_counts);
  lp.src_tokens = (int*)(r + ctx->off_src_tokens);
  lp.epochs = (int*)(r + ctx->off_epochs);
  lp.counters = (unsigned*)(r + ctx->off_counters);
  lp.eslots = (int*)(r + ctx->off_eslots);
  p.dev_error = (int*)(r + ctx->off_dev_error);
  for (int i = 0; i < EP_MAX_WORLD; ++i) p.peer_base[i] = nullptr;
  p.peer_base[p.rank] = r;
  CUDA_CHECK(cudaDeviceSynchronize());
  *out = ctx;
  return 0;
}

extern "C" void* ep_ll_base(void* vctx) { return ((LlContext*)vctx)->ep; }

extern "C" int ep_ll_region(void* vctx, int which, unsigned long long* ptr, unsigned long long* bytes) {
  LlContext* ctx = (LlContext*)vctx;
  const EpParams& p = ctx->ep->p;
  const LlParams& lp = ctx->lp;
  const size_t slots = (size_t)lp.experts * lp.capacity;
  size_t off = 0, n = 0;
  switch (which) {
    case EP_LL_X: off = lp.off_x; n = slots * p.row_bytes; break;
    case EP_LL_SCALES: off = lp.off_scales; n = slots * p.num_scales * sizeof(float); break;
    case EP_LL_PAIR: off = lp.off_pair; n = slots * sizeof(int); break;
    case EP_LL_COUNTS: off = ctx->off_counts; n = (size_t)lp.experts * sizeof(long long); break;
    case EP_LL_SRC_COUNTS: off = ctx->off_src_counts; n = (size_t)lp.experts * p.world * sizeof(int); break;
    case EP_LL_COMBINE_IN: off = ctx->off_y; n = slots * p.hidden * 2; break;
    case EP_LL_OUT: off = ctx->off_out; n = (size_t)lp.t_max * p.hidden * 2; break;
    case EP_LL_EPOCHS: off = ctx->off_epochs; n = 2 * sizeof(int); break;
    default: ep_set_error("unknown low-latency region %d", which); return -1;
  }
  *ptr = (unsigned long long)(ctx->ep->region + off);
  *bytes = n;
  return 0;
}

// Shared by both launchers. The receive phases wait on flags that other blocks of the same grid
// release, so every block must be resident at once: at most one block per SM.
int ll_check_launch(const LlContext* ctx, int num_tokens, int num_sms, int warps) {
  const EpContext* ep = ctx->ep;
  if (!ep->peers_open) {
    ep_set_error("peers not opened: call ep_open_peers on ep_ll_base(ctx) first");
    return -1;
  }
  if (num_tokens < 0 || num_tokens > ctx->lp.t_max) {
    ep_set_error("num_tokens %d outside 0..max_tokens %d", num_tokens, ctx->lp.t_max);
    return -1;
  }
  const int sms = ctx->sm_count;
  if (num_sms < 1 || num_sms > sms || warps < 2 || warps > 16) {
    ep_set_error("num_sms must be 1..%d (all blocks resident) and warps 2..16 (got %d, %d)", sms, num_sms, warps);
    return -1;
  }
  if (ctx->lp.experts > num_sms * warps * 32) {
    ep_set_error("%d experts per rank need at least as many threads (num_sms x warps x 32)", ctx->lp.experts);
    return -1;
  }
  return 0;
}

extern "C" int ep_ll_destroy(void* vctx) {
  LlContext* ctx = (LlContext*)vctx;
  if (!ctx) return 0;
  const int rc = ep_destroy(ctx->ep);  // synchronises, unmaps peers, frees the region and the record
  delete ctx;
  return rc;
}

extern "C" int ep_ll_set_sync(void* vctx, int sync) {
  LlContext* ctx = (LlContext*)vctx;
  if (sync != kLlSyncGrid && sync != kLlSyncToken) {
    ep_set_error("low-latency sync must be 0 (grid) or 1 (token), got %d", sync);
    return -1;
  }
  if (ctx->launched && sync != ctx->sync) {
    ep_set_error("low-latency sync is fixed once a kernel ran (the two keep different flags and epochs)");
    return -1;
  }
  if (sync == kLlSyncToken) {
    // the ids and prefix counts at max_tokens, in shared memory; one 512-thread block per SM
    const size_t limit = 200 * 1024;
    if (ctx->token_smem > limit) {
      ep_set_error("ll_sync token: max_tokens x topk ids and per-32-token expert counts need %zu bytes of shared "
                   "memory, more than %zu (use ll_sync grid or fewer tokens / experts)", ctx->token_smem, limit);
      return -1;
    }
    CUDA_CHECK(cudaSetDevice(ctx->ep->device));
    if (ll_dispatch_token_smem_attr((int)ctx->token_smem) != 0) return -1;
  }
  ctx->sync = sync;
  return 0;
}

// The launch choices below are small enumerations (0..last) in fields of LlParams that later launches copy, so a
// captured graph keeps the value it was captured with; `what` names the choice and its values for the error.
static int ll_set_choice(int* field, int value, const char* what, int last = 1) {
  if (value < 0 || value > last) {
    ep_set_error("low-latency %s must be 0..%d, got %d", what, last, value);
    return -1;
  }
  *field = value;
  return 0;
}

// Both orders fill the same bytes and flags (ll_combine.cu, push_unit), so it may change between launches.
extern "C" int ep_ll_set_combine_order(void* vctx, int order) {
  static_assert(kLlOrderSource == 0 && kLlOrderRotated == 1, "LlCombineOrder is 0 / 1");
  return ll_set_choice(&((LlContext*)vctx)->lp.combine_order, order, "combine order (0 source, 1 rotated)");
}

// Row or chunk peer units for the token dispatch (LlDispatchUnits). Every rank must set the same value before
// the same call (a receiver that finds a peer's other kind stops with kPhaseLlUnitsMismatch).
extern "C" int ep_ll_set_dispatch_units(void* vctx, int units) {
  static_assert(kLlUnitsRow == 0 && kLlUnitsChunk == 1, "LlDispatchUnits is 0 / 1");
  return ll_set_choice(&((LlContext*)vctx)->lp.dispatch_units, units, "dispatch units (0 row, 1 chunk)");
}

// Stage, slot, inline, line or line128 placement of the token dispatch's peer rows (LlDispatchPlace). Every rank must
// set the same value before the same call (a receiver that finds a peer's other kind stops with kPhaseLlPlaceMismatch).
extern "C" int ep_ll_set_dispatch_place(void* vctx, int place) {
  static_assert(kLlPlaceStage == 0 && kLlPlaceSlot == 1 && kLlPlaceInline == 2 && kLlPlaceLine == 3 &&
                    kLlPlaceLine128 == 4,
                "LlDispatchPlace is 0 / 1 / 2 / 3 / 4");
  return ll_set_choice(&((LlContext*)vctx)->lp.dispatch_place, place,
                       "dispatch place (0 stage, 1 slot, 2 inline, 3 line, 4 line128)", 4);
}

// Per-unit or batched flag releases in the token combine (LlCombineRelease): the same flags and values either
// way, so ranks may differ and it may change between launches.
extern "C" int ep_ll_set_combine_release(void* vctx, int release) {
  static_assert(kLlReleaseUnit == 0 && kLlReleaseBatch == 1, "LlCombineRelease is 0 / 1");
  return ll_set_choice(&((LlContext*)vctx)->lp.combine_release, release, "combine release (0 unit, 1 batch)");
}

// ---- measuring aids (ep_ll_set_probe, ep_ll_set_probe_skip, ep_ll_probe; notes/LATENCY.md) ----
extern "C" int ep_ll_set_probe(void* vctx, void* stamps) {
  ((LlContext*)vctx)->lp.stamps = (unsigned long long*)stamps;
  return 0;
}

extern "C" int ep_ll_set_probe_skip(void* vctx, int bits) {
  if (bits < 0 || bits > kLlSkipAll) {
    ep_set_error("low-latency probe skip bits must be in 0..%d, got %d", kLlSkipAll, bits);
    return -1;
  }
  ((LlContext*)vctx)->lp.probe_skip = bits;
  return 0;
}

namespace {

// The ping (modes 5 and 6): the least that a decode call across the links does. Warp 0 of block b < world - 1
// sends one row of `bytes` (every load issued before its stores) from this rank's own landing row into its row
// on peer me + 1 + b, then, behind a system-scope fence, a flag carrying the call's epoch; then it waits for the
// flag of peer me - 1 - b (whose block b sends to me). No ids, no counts, no copy into expert slots: one row each
// way and the wait for its proof, in the kernels' grid and timed like them. Stamp 2 (sent): the flag issued.
__device__ __forceinline__ void ll_ping(const EpParams& p, const LlParams& lp, uint8_t* scratch, size_t off_probe,
                                        int bytes) {
  const int b = blockIdx.x, lane = threadIdx.x;
  if (b >= p.world - 1 || lane >= 32) {
    ll_stamp(lp, kLlSent);  // nothing to send (thread 0 of a block without a peer)
    return;
  }
  const int to = (p.rank + 1 + b) % p.world, from = (p.rank + p.world - 1 - b) % p.world;
  int* epochs = reinterpret_cast<int*>(scratch + kPingEpochs) + b;
  const int epoch = ld_volatile(epochs) + 1;
  const int4* src = reinterpret_cast<const int4*>(scratch + kPingRows + (size_t)p.rank * p.hidden * 2);
  uint8_t* peer = p.peer_base[to] + off_probe;
  int4* dst = reinterpret_cast<int4*>(peer + kPingRows + (size_t)p.rank * p.hidden * 2);
  constexpr int kV = 16;  // vectors a lane keeps in flight: a 7 KiB row in one round, a 14 KiB row in two
  const int vectors = bytes / 16;
  for (int base = 0; base < vectors; base += 32 * kV) {
    int4 v[kV];
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const int i = base + k * 32 + lane;
      if (i < vectors) v[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const int i = base + k * 32 + lane;
      if (i < vectors) dst[i] = v[k];
    }
  }
  __syncwarp();
  if (lane == 0) {
    fence_acq_rel_sys();
    st_release_sys_u64(reinterpret_cast<unsigned long long*>(peer + kPingFlags) + p.rank,
                       (unsigned long long)epoch << 32);
  }
  ll_stamp(lp, kLlSent);
  if (lane == 0) {
    ll_wait_epoch_u64(p, reinterpret_cast<const unsigned long long*>(scratch + kPingFlags) + from, epoch, from,
                      kPhaseLlDispatch);
    *epochs = epoch;  // kernel completion orders it before the next launch
  }
}

// Scratch at off_probe: [0] u64 flag, [8] u32 block counter, [12] i32 epoch, [16..] words the chase loads; the
// ping's from kPingFlags (ll_probe_bytes).
__global__ void ll_probe_kernel(EpParams p, LlParams lp, uint8_t* scratch, size_t off_probe, int mode) {
  ll_stamp(lp, kLlStart);
  if (mode == 5 || mode == 6) {
    ll_ping(p, lp, scratch, off_probe, mode == 5 ? p.row_bytes : p.hidden * 2);
    __syncthreads();
    ll_stamp(lp, kLlEnd);
    return;
  }
  auto* flag = reinterpret_cast<unsigned long long*>(scratch);
  auto* counter = reinterpret_cast<unsigned*>(scratch + 8);
  int* epochs = reinterpret_cast<int*>(scratch + 12);
  int* words = reinterpret_cast<int*>(scratch + 16);
  if (mode == 1) {
    __shared__ int s_epoch;
    if (threadIdx.x == 0) s_epoch = ld_volatile(epochs) + 1;
    __syncthreads();
    const int epoch = s_epoch;
    if (ll_last_block(lp, counter) && threadIdx.x == 0) st_release_sys_u64(flag, (unsigned long long)epoch << 32);
    if (threadIdx.x == 0) ll_wait_epoch_u64(p, flag, epoch, 0, kPhaseLlDispatch);
    __syncthreads();
    ll_finish_launch(lp, counter + 0, epochs, epoch);  // stamps part A's end (kLlReceived is not used here)
    return;
  }
  if (threadIdx.x == 0 && mode == 2) {
    int v = 0;
    for (int i = 0; i < 16; ++i) v = ld_volatile(words + (v & 1));  // each address depends on the last value
    if (v == 12345) words[2] = v;  // never true (the words are zero): keeps the chain alive
  }
  if (threadIdx.x == 0 && mode == 3) {
    for (int i = 0; i < 16; ++i) {
      asm volatile("st.volatile.global.b32 [%0], %1;" ::"l"(words + 3 + blockIdx.x % 8), "r"(i) : "memory");
      fence_acq_rel_sys();
    }
  }
  if (threadIdx.x == 0 && blockIdx.x == 0 && mode == 4 && lp.stamps != nullptr) {
    unsigned long long prev = globaltimer(), step = ~0ull;
    for (int i = 0; i < 4096; ++i) {
      const unsigned long long t = globaltimer();
      if (t != prev && t - prev < step) step = t - prev;
      prev = t;
    }
    lp.stamps[7] = step;
  }
  __syncthreads();
  ll_stamp(lp, kLlSent);
  ll_stamp(lp, kLlEnd);
}

}  // namespace

extern "C" int ep_ll_probe(void* vctx, int mode, int num_sms, int warps, void* stream) {
  LlContext* ctx = (LlContext*)vctx;
  if (mode < 0 || mode > 6) {
    ep_set_error("unknown probe mode %d", mode);
    return -1;
  }
  if ((mode == 5 || mode == 6) && num_sms < ctx->ep->p.world - 1) {
    ep_set_error("the ping needs a block for each of the %d peers, got %d SMs", ctx->ep->p.world - 1, num_sms);
    return -1;
  }
  if (ll_check_launch(ctx, 0, num_sms, warps) != 0) return -1;
  CUDA_CHECK(cudaSetDevice(ctx->ep->device));
  ll_probe_kernel<<<num_sms, warps * 32, 0, (cudaStream_t)stream>>>(ctx->ep->p, ctx->lp, ctx->ep->region + ctx->off_probe,
                                                                    ctx->off_probe, mode);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
