// Buffers and CUDA IPC: one cudaMalloc region per rank (layout in common.cuh), exported with a
// single IPC handle and mapped on every peer with cudaIpcOpenMemHandle. All sizes are the worst
// case (every token of every rank routed to one rank), so nothing is allocated after ep_create.
#include <stdarg.h>

#include <algorithm>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

static thread_local char g_error[512];

void ep_set_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, ap);
  va_end(ap);
}

extern "C" const char* ep_last_error(void) { return g_error; }

static size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Hands out 256-byte aligned offsets in order.
struct Carver {
  size_t next = 0;
  size_t take(size_t bytes) {
    size_t off = align_up(next, 256);
    next = off + bytes;
    return off;
  }
};

// combine_ce's chunk bounds (EpParams::ce_bound: kCeChunks + 1 ints) for max_tokens T: `chunks` even chunks, or
// growing ones (grow): the first T / 16 rows, each next 1.5x the one before (the sum of 4 SMs takes ~1.5x the copy
// engines' time for the same rows at 4 ranks), at most kCeChunks, the last one taking the rest; every bound after
// the last chunk's is T. No CUDA call: tests/test_ce_bounds.py calls it on any host where the library is built.
// EP_OPT_PULL_KERNEL 2 (auto): 1 where the loading / summing warps' pull ran faster than the tma kernel's on
// 2 and 4 x H200 (notes/LATENCY-NEXT.md "pull_kernel bulk, measured"), else 0. Rank-major rows at 2-4 ranks only
// (kCbHolders). 2 ranks: bulk at every SM count since its stages hold 2 pieces, 4 a pair (dsv3x2 8 / 16 SMs 236 /
// 195 us against tma's 322 / 266, qwen3 shape 170 against 192 at 8 SMs; 4 x H200, 2026-11-27). 3-4 ranks: bulk below
// 8 SMs (dsv3x4 4 SMs 738 against 876); from 8 SMs both are at the link and tma is level or up to 4 % faster (qwen3x4
// 8 SMs 306 against 320). No CUDA call: tests/test_ce_bounds.py checks it wherever the library is built.
extern "C" int ep_pull_auto(int world, int num_sms, int align) {
  if (align > 0 || world < 2 || world > 4) return 0;
  return (world == 2 || num_sms < 8) ? 1 : 0;
}

extern "C" int ep_ce_bounds(int T, int chunks, int grow, int* bound) {
  if (T < 0 || (!grow && chunks < 1) || bound == nullptr) {
    ep_set_error("ep_ce_bounds: bad arguments (max_tokens %d, chunks %d)", T, chunks);
    return -1;
  }
  int c = 0;
  bound[0] = 0;
  if (grow) {
    int size = std::max(1, (T + 15) / 16);
    while (bound[c] < T && c < kCeChunks) {
      bound[c + 1] = std::min(T, bound[c] + size);
      size = size + (size + 1) / 2;
      ++c;
    }
  } else {
    const int rows = std::max(1, (T + chunks - 1) / chunks);
    while (bound[c] < T && c < kCeChunks) bound[c + 1] = std::min(T, bound[c] + rows), ++c;
  }
  bound[c] = T;  // the last chunk takes the rest
  for (int d = c + 1; d <= kCeChunks; ++d) bound[d] = T;
  return 0;
}

static void ce_set_bounds(EpContext* ctx) {
  ep_ce_bounds(ctx->p.max_tokens, ctx->ce_chunks, ctx->ce_grow, ctx->p.ce_bound);
}

extern "C" int ep_create(const ep_config* cfg, void** out) {
  *out = nullptr;
  if (cfg->world < 1 || cfg->world > EP_MAX_WORLD || cfg->rank < 0 || cfg->rank >= cfg->world) {
    ep_set_error("world must be 1..%d and 0 <= rank < world (got rank %d world %d)", EP_MAX_WORLD, cfg->rank,
                 cfg->world);
    return -1;
  }
  if (cfg->topk < 1 || cfg->topk > EP_MAX_TOPK) {
    ep_set_error("topk must be 1..%d (got %d)", EP_MAX_TOPK, cfg->topk);
    return -1;
  }
  if (cfg->fp8 && cfg->mxfp8) {
    ep_set_error("fp8 and mxfp8 exclude each other");
    return -1;
  }
  if (cfg->quantize_fused < 0 || cfg->quantize_fused > 2) {
    ep_set_error("quantize_fused must be 0, 1 (8-byte stores) or 2 (16-byte stores), got %d", cfg->quantize_fused);
    return -1;
  }
  if (cfg->quantize_fused && !cfg->mxfp8) {
    ep_set_error("quantize_fused is implemented for mxfp8 only");
    return -1;
  }
  // fp8: whole scale blocks; mxfp8: whole 32-element blocks (4 lanes x 8 bf16 in the fused cast); bf16: 16-byte rows
  const int multiple = cfg->fp8 ? 128 : cfg->mxfp8 ? 32 : 8;
  if (cfg->hidden % multiple != 0) {
    ep_set_error("hidden %d must be a multiple of %d", cfg->hidden, multiple);
    return -1;
  }
  if (cfg->align < 0) {
    ep_set_error("align must be 0 (rank-major) or >= 1 (expert-major), got %d", cfg->align);
    return -1;
  }
  if (cfg->own_rows < 0 || cfg->own_rows > 2) {
    ep_set_error("own_rows must be 0 (sm), 1 (ce) or 2 (all), got %d", cfg->own_rows);
    return -1;
  }
  if (cfg->own_rows && (cfg->align > 0 || cfg->quantize_fused)) {  // a copy can neither spread rows nor quantize
    ep_set_error("own_rows %s needs the rank-major layout and quantize before (align %d, quantize_fused %d)",
                 cfg->own_rows == 2 ? "all" : "ce", cfg->align, cfg->quantize_fused);
    return -1;
  }
  if (cfg->combine_ce < 0 || cfg->combine_ce > 1 || (cfg->combine_ce && cfg->own_rows != 2)) {
    ep_set_error("combine_ce must be 0 (pull) or 1 (copy-engine pushes; needs own_rows 2, all), got %d with own_rows %d",
                 cfg->combine_ce, cfg->own_rows);
    return -1;
  }
  if (cfg->em_push < 0 || cfg->em_push > 3 || (cfg->em_push && cfg->align == 0)) {
    ep_set_error("em_push must be 0 (receiver), 1 (sender), 2 (receiver, wide passes) or 3 (auto: 2 up to 16 dispatch "
                 "warps, else 0; expert-major only), got %d "
                 "with align %d", cfg->em_push, cfg->align);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(cfg->device));
  EpContext* ctx = new EpContext();
  memset(ctx, 0, sizeof(*ctx));
  EpParams& p = ctx->p;
  ctx->device = cfg->device;
  // the measured defaults (notes/KERNELS.md); the Python backend sets every option explicitly anyway
  ctx->combine_stages = 2;
  ctx->ce_streams_used = cfg->world > 2 ? 1 : 2;  // a peer's at 2 ranks, in all at 3+ (combine.cu ce_push_streams)
  ctx->ce_share = 100;
  ctx->combine_chunk = 2048;
  p.notify_impl = EP_NOTIFY_GRID;
  p.rank = cfg->rank;
  p.world = cfg->world;
  p.experts_per_rank = cfg->experts_per_rank;
  p.topk = cfg->topk;
  p.hidden = cfg->hidden;
  p.num_scales = cfg->fp8 ? cfg->hidden / 128 : cfg->mxfp8 ? cfg->hidden / 32 : 0;
  p.row_bytes = cfg->fp8 || cfg->mxfp8 ? cfg->hidden : cfg->hidden * 2;
  p.scale_bytes = cfg->fp8 ? p.num_scales * (int)sizeof(float) : p.num_scales;
  // the fused cast stores 8 (16) scale bytes at a time at multiples of 8 (16) within the row (dispatch.cu)
  p.scale_stride = cfg->mxfp8 ? (int)align_up((size_t)p.num_scales, 16) : p.scale_bytes;
  p.fused = cfg->quantize_fused;
  p.max_tokens = cfg->max_tokens;
  p.capacity = cfg->world * cfg->max_tokens;
  p.align = cfg->align;
  p.own_ce = cfg->own_rows;
  p.em_push = cfg->em_push;
  p.combine_ce = cfg->combine_ce;
  ctx->ce_chunks = 16;  // until EP_OPT_CE_CHUNKS / EP_OPT_CE_GROW say otherwise
  ce_set_bounds(ctx);
  // expert-major: every source's tokens once per local expert they can pick, plus the largest padding
  // (epbench/layout.py slot_capacity)
  const int em = cfg->align > 0, E = cfg->experts_per_rank;
  p.slots = em ? p.capacity * std::min(cfg->topk, E) + E * (cfg->align - 1) : p.capacity;
  p.timeout_ns = (unsigned long long)(cfg->timeout_s * 1e9);

  EpSignals& s = p.sig;
  // + num_tokens; expert-major: + the counts for every global expert
  s.notify_stride = (int)align_up(2 + cfg->world + E + (em ? cfg->world * E : 0), 32);
  s.notify_off = 0;
  s.done_off = s.notify_off + s.notify_stride * cfg->world;
  s.ready_off = s.done_off + 32;
  s.pulled_off = s.ready_off + 32;
  s.dsp_ready_off = s.pulled_off + 32;
  s.cstage_off = s.dsp_ready_off + 32;
  s.total_ints = s.cstage_off + EP_MAX_WORLD * kCeChunks;

  const size_t cap = (size_t)p.capacity, slots = (size_t)p.slots;
  Carver c;
  p.off_recv_x = c.take(slots * p.row_bytes);
  p.off_recv_scales = c.take(slots * p.scale_stride);
  p.off_recv_idx = c.take(cap * p.topk * sizeof(long long));
  p.off_recv_w = c.take(cap * p.topk * sizeof(float));
  p.off_combine_in = c.take(slots * p.hidden * 2);
  p.off_em_slot = c.take(em ? cap * p.topk * sizeof(int) : 0);
  p.off_combine_red = c.take(em ? cap * p.hidden * 2 : 0);
  p.off_recv_key = c.take(p.own_ce ? cap * sizeof(long long) : 0);  // 0 bytes: every later offset as before
  // combine_ce: holder h's rows of my tokens at rows [h * max_tokens, + T) (0 bytes otherwise)
  p.off_combine_stage = c.take(p.combine_ce ? cap * p.hidden * 2 : 0);
  p.off_signals = c.take((size_t)s.total_ints * sizeof(int));
  ctx->shared_bytes = c.next;
  ctx->off_out = c.take((size_t)p.max_tokens * p.hidden * 2);
  ctx->off_slot_map = c.take((size_t)p.max_tokens * p.world * sizeof(int));
  ctx->off_base = c.take(EP_MAX_WORLD * sizeof(int));
  ctx->off_num_recv = c.take(sizeof(long long));
  ctx->off_expert_counts = c.take((size_t)p.experts_per_rank * sizeof(long long));
  ctx->off_counters = c.take(kNumCounters * sizeof(unsigned));
  ctx->notify_scratch_bytes = ((size_t)kMaxNotifyBlocks * (1 + EP_MAX_WORLD) + (size_t)cfg->world * cfg->experts_per_rank) * sizeof(int);
  ctx->off_notify_scratch = c.take(ctx->notify_scratch_bytes);
  ctx->off_dev_error = c.take(sizeof(int));
  ctx->off_stamps = c.take(kNumStamps * sizeof(unsigned long long));
  ctx->off_em_ord = c.take(em ? (size_t)p.max_tokens * p.topk * sizeof(int) : 0);
  ctx->off_em_base = c.take(em ? (size_t)cfg->world * E * sizeof(int) : 0);
  ctx->off_em_offsets = c.take((size_t)E * sizeof(long long));
  ctx->off_em_num_slots = c.take(sizeof(long long));
  ctx->off_em_go = c.take(sizeof(int));
  ctx->region_bytes = align_up(c.next, 1 << 21);

  cudaError_t err = cudaMalloc(&ctx->region, ctx->region_bytes);
  if (err != cudaSuccess) {
    ep_set_error("cudaMalloc of %zu bytes failed: %s", ctx->region_bytes, cudaGetErrorString(err));
    delete ctx;
    return -1;
  }
  // Signals, counters and the error word must start at zero; the rest is garbage until written.
  CUDA_CHECK(cudaMemset(ctx->region + p.off_signals, 0, (size_t)s.total_ints * sizeof(int)));
  CUDA_CHECK(cudaMemset(ctx->region + ctx->off_counters, 0, kNumCounters * sizeof(unsigned)));
  CUDA_CHECK(cudaMemset(ctx->region + ctx->off_notify_scratch, 0, ctx->notify_scratch_bytes));
  CUDA_CHECK(cudaMemset(ctx->region + ctx->off_dev_error, 0, sizeof(int)));
  CUDA_CHECK(cudaMemset(ctx->region + ctx->off_em_go, 0, sizeof(int)));

  void* host_err = nullptr;
  CUDA_CHECK(cudaHostAlloc(&host_err, sizeof(EpErrorInfo), cudaHostAllocMapped));
  memset(host_err, 0, sizeof(EpErrorInfo));
  ctx->host_error = (EpErrorInfo*)host_err;
  void* dev_alias = nullptr;
  CUDA_CHECK(cudaHostGetDevicePointer(&dev_alias, host_err, 0));
  p.host_error = (EpErrorInfo*)dev_alias;

  p.slot_map = (int*)(ctx->region + ctx->off_slot_map);
  p.base = (int*)(ctx->region + ctx->off_base);
  p.num_recv = (long long*)(ctx->region + ctx->off_num_recv);
  p.expert_counts = (long long*)(ctx->region + ctx->off_expert_counts);
  p.counters = (unsigned*)(ctx->region + ctx->off_counters);
  p.notify_scratch = (int*)(ctx->region + ctx->off_notify_scratch);
  p.dev_error = (int*)(ctx->region + ctx->off_dev_error);
  p.em_ord = em ? (int*)(ctx->region + ctx->off_em_ord) : nullptr;
  p.em_base = em ? (int*)(ctx->region + ctx->off_em_base) : nullptr;
  p.em_offsets = (long long*)(ctx->region + ctx->off_em_offsets);
  p.em_num_slots = (long long*)(ctx->region + ctx->off_em_num_slots);
  p.em_go = (int*)(ctx->region + ctx->off_em_go);
  for (int r = 0; r < EP_MAX_WORLD; ++r) p.peer_base[r] = nullptr;
  p.peer_base[p.rank] = ctx->region;

  CUDA_CHECK(cudaDeviceGetAttribute(&ctx->max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cfg->device));
  if (p.own_ce == 2) {  // own_rows all: copy streams forked and joined by events (dispatch.cu: 2; combine.cu: more)
    CUDA_CHECK(cudaEventCreateWithFlags(&ctx->ce_fork, cudaEventDisableTiming));
    for (int i = 0; i < std::max(2, (cfg->combine_ce ? kCeStreams : 1) * (cfg->world - 1)); ++i) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->ce_streams[i], cudaStreamNonBlocking));
      CUDA_CHECK(cudaEventCreateWithFlags(&ctx->ce_done[i], cudaEventDisableTiming));
    }
  }
  if (p.combine_ce) {  // the chunk flags after each pushed chunk (combine.cu)
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      ep_set_error("combine_ce: the driver has no cuStreamWriteValue32 (%s)", cudaGetErrorString(err));
      ep_destroy(ctx);
      return -1;
    }
    ctx->write_value32 = reinterpret_cast<int (*)(void*, unsigned long long, unsigned, unsigned)>(fn);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  *out = ctx;
  return 0;
}

extern "C" int ep_ipc_handle(void* vctx, void* handle_out) {
  EpContext* ctx = (EpContext*)vctx;
  CUDA_CHECK(cudaSetDevice(ctx->device));
  cudaIpcMemHandle_t h;
  CUDA_CHECK(cudaIpcGetMemHandle(&h, ctx->region));
  static_assert(sizeof(h) == 64, "cudaIpcMemHandle_t is 64 bytes");
  memcpy(handle_out, &h, sizeof(h));
  return 0;
}

extern "C" int ep_open_peers(void* vctx, const void* handles) {
  EpContext* ctx = (EpContext*)vctx;
  CUDA_CHECK(cudaSetDevice(ctx->device));
  for (int r = 0; r < ctx->p.world; ++r) {
    if (r == ctx->p.rank) continue;
    cudaIpcMemHandle_t h;
    memcpy(&h, (const char*)handles + 64 * r, sizeof(h));
    void* ptr = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      ep_set_error("rank %d: cudaIpcOpenMemHandle for peer %d failed: %s", ctx->p.rank, r, cudaGetErrorString(err));
      return -1;
    }
    ctx->p.peer_base[r] = (uint8_t*)ptr;
  }
  ctx->peers_open = true;
  return 0;
}

extern "C" int ep_region(void* vctx, int which, unsigned long long* ptr, unsigned long long* bytes) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  const size_t cap = (size_t)p.capacity, slots = (size_t)p.slots;
  size_t off = 0, n = 0;
  switch (which) {
    case EP_RECV_X: off = p.off_recv_x; n = slots * p.row_bytes; break;
    case EP_RECV_SCALES: off = p.off_recv_scales; n = slots * p.scale_stride; break;
    case EP_RECV_IDX: off = p.off_recv_idx; n = cap * p.topk * sizeof(long long); break;
    case EP_RECV_W: off = p.off_recv_w; n = cap * p.topk * sizeof(float); break;
    case EP_COMBINE_IN: off = p.off_combine_in; n = slots * p.hidden * 2; break;
    case EP_OUT: off = ctx->off_out; n = (size_t)p.max_tokens * p.hidden * 2; break;
    case EP_NUM_RECV: off = ctx->off_num_recv; n = sizeof(long long); break;
    case EP_EXPERT_COUNTS: off = ctx->off_expert_counts; n = (size_t)p.experts_per_rank * sizeof(long long); break;
    case EP_DEBUG_STAMPS: off = ctx->off_stamps; n = kNumStamps * sizeof(unsigned long long); break;
    case EP_EM_OFFSETS: off = ctx->off_em_offsets; n = (size_t)p.experts_per_rank * sizeof(long long); break;
    case EP_EM_NUM_SLOTS: off = ctx->off_em_num_slots; n = sizeof(long long); break;
    case EP_RECV_KEY: off = p.off_recv_key; n = p.own_ce ? cap * sizeof(long long) : 0; break;
    case EP_COMBINE_STAGE: off = p.off_combine_stage; n = p.combine_ce ? cap * p.hidden * 2 : 0; break;
    default: ep_set_error("unknown region %d", which); return -1;
  }
  *ptr = (unsigned long long)(ctx->region + off);
  *bytes = n;
  return 0;
}

extern "C" int ep_set_option(void* vctx, int key, int value) {
  EpContext* ctx = (EpContext*)vctx;
  switch (key) {
    case EP_OPT_DEBUG_STAMPS:
      ctx->p.stamps = value ? (unsigned long long*)(ctx->region + ctx->off_stamps) : nullptr;
      return 0;
    case EP_OPT_NOTIFY_IMPL:
      if (value != EP_NOTIFY_STAGED && value != EP_NOTIFY_GRID) break;  // direct: a fallback only
      ctx->p.notify_impl = value;
      return 0;
    case EP_OPT_COMBINE_STAGES:
      if (value < 2 || value > 4) break;
      ctx->combine_stages = value;
      return 0;
    case EP_OPT_COMBINE_CHUNK:
      if (value != 1024 && value != 2048 && value != 4096) break;
      ctx->combine_chunk = value;
      return 0;
    case EP_OPT_CE_CHUNKS:  // combine_ce only; every rank must set the same (a chunk's flag names its rows)
      if (!ctx->p.combine_ce || (value != 4 && value != 5 && value != 6 && value != 8 && value != 16 && value != 32)) break;
      ctx->ce_chunks = value;
      ce_set_bounds(ctx);
      return 0;
    case EP_OPT_PULL_KERNEL:  // the pull only (combine_ce off); bulk: rank-major at <= 4 ranks (combine.cu kCbHolders);
                              // auto: ep_pull_auto per call
      if (ctx->p.combine_ce || value < 0 || value > 2 || (value == 1 && (ctx->p.world > 4 || ctx->p.align > 0)))
        break;
      ctx->pull_bulk = value;
      return 0;
    case EP_OPT_CB_SKIP:  // measuring aid: outputs are not written while it is on (never in a verified call)
      if (value != 0 && value != kCbSkipStores && value != kCbSkipReads && value != kCbSkipSmem) break;
      ctx->p.cb_skip = value;
      return 0;
    case EP_OPT_CE_GROW:  // combine_ce only; the same on every rank
      if (!ctx->p.combine_ce || (value != 0 && value != 1)) break;
      ctx->ce_grow = value;
      ce_set_bounds(ctx);
      return 0;
    case EP_OPT_CE_STREAMS:
      if (!ctx->p.combine_ce || (value != 1 && value != 2 && value != 4)) break;
      ctx->ce_streams_used = value;
      return 0;
    case EP_OPT_CE_SHARE:  // own_rows all only; the SM part stores 16-byte vectors of whole rows
      if (ctx->p.own_ce != 2 || (value != 25 && value != 50 && value != 75 && value != 100)) break;
      if (value < 100 && ctx->p.row_bytes % 16 != 0) {
        ep_set_error("ce_share %d needs rows of a multiple of 16 bytes (row %d bytes)", value, ctx->p.row_bytes);
        return -1;
      }
      ctx->ce_share = value;
      return 0;
    case EP_OPT_EM_SMS:
      if (value < 0 || value > 1024 || (value > 0 && ctx->p.align == 0)) break;  // expert-major only
      ctx->p.em_sms = value;
      return 0;
    default: break;
  }
  ep_set_error("ep_set_option: bad key %d or value %d", key, value);
  return -1;
}

extern "C" int ep_poll_error(void* vctx, int* rank, int* peer, int* phase) {
  EpContext* ctx = (EpContext*)vctx;
  if (!ctx->host_error->flag) return 0;
  *rank = ctx->host_error->rank;
  *peer = ctx->host_error->peer;
  *phase = ctx->host_error->phase;
  return 1;
}

extern "C" void* ep_error_flag_ptr(void* vctx) {
  EpContext* ctx = (EpContext*)vctx;
  return (void*)&ctx->host_error->flag;
}

extern "C" int ep_destroy(void* vctx) {
  EpContext* ctx = (EpContext*)vctx;
  if (!ctx) return 0;
  CUDA_CHECK(cudaSetDevice(ctx->device));
  CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < ctx->p.world; ++r) {
    if (r != ctx->p.rank && ctx->p.peer_base[r]) CUDA_CHECK(cudaIpcCloseMemHandle(ctx->p.peer_base[r]));
  }
  CUDA_CHECK(cudaFree(ctx->region));
  CUDA_CHECK(cudaFreeHost((void*)ctx->host_error));
  if (ctx->ce_fork) CUDA_CHECK(cudaEventDestroy(ctx->ce_fork));
  for (int i = 0; i < kCeStreams * (EP_MAX_WORLD - 1); ++i) {
    if (ctx->ce_streams[i]) CUDA_CHECK(cudaStreamDestroy(ctx->ce_streams[i]));
    if (ctx->ce_done[i]) CUDA_CHECK(cudaEventDestroy(ctx->ce_done[i]));
  }
  delete ctx;
  return 0;
}

extern "C" int ep_effective_config(void* vctx, ep_effective* out) {
  if (vctx == nullptr || out == nullptr) {
    ep_set_error("ep_effective_config: null context or output");
    return -1;
  }
  *out = ((EpContext*)vctx)->effective;
  return 0;
}
