// Hierarchical kernels' buffers: the symmetric (NVSHMEM) and local allocations, eph_create / eph_region /
// eph_poll_error / eph_destroy; hier_common.cuh has the design and the buffer table.
#include "hier_common.cuh"

namespace {

// ---- host side ----
size_t align16(size_t n) { return (n + 15) & ~static_cast<size_t>(15); }

// The symmetric allocations, in order (the same on every PE): sizes from the config alone.
struct SymSizes {
  size_t recv_x, recv_scales, recv_idx, recv_w, combine_in, msg, part, my_row, cnt_mat, cnt_sig, chunk_sig, flags;
  size_t total() const {
    return recv_x + recv_scales + recv_idx + recv_w + combine_in + 2 * msg + 2 * part + my_row + cnt_mat + cnt_sig +
           2 * chunk_sig + flags;
  }
};

int message_layout(const EphConfig& c, HierParams& p) {
  const int N = c.world / c.gpus_per_node;
  p.row_bytes = c.fp8 ? c.hidden : 2 * c.hidden;
  p.num_scales = c.fp8 ? c.hidden / 128 : 0;
  p.msg_off_scales = static_cast<int>(align16(p.row_bytes));
  p.msg_off_idx = p.msg_off_scales + static_cast<int>(align16(4 * p.num_scales));
  p.msg_off_w = p.msg_off_idx + static_cast<int>(align16(8 * c.topk));
  p.msg_off_pos = p.msg_off_w + static_cast<int>(align16(4 * c.topk));
  p.msg_bytes = p.msg_off_pos + static_cast<int>(align16(4 * c.gpus_per_node));
  p.row_ints = c.world + N + c.world * c.experts_per_rank;
  return N;
}

SymSizes sym_sizes(const EphConfig& c) {
  HierParams p{};
  const int N = message_layout(c, p);
  const size_t T = c.max_tokens, cap = static_cast<size_t>(c.world) * T;
  SymSizes s{};
  // never 0 bytes (max_tokens 0): nvshmem_malloc(0) returns null, which would read as a full heap
  auto some = [](size_t n) { return align16(n > 16 ? n : 16); };
  s.recv_x = some(cap * p.row_bytes);
  s.recv_scales = some(cap * 4 * (p.num_scales ? p.num_scales : 1));
  s.recv_idx = some(cap * 8 * c.topk);
  s.recv_w = some(cap * 4 * c.topk);
  s.combine_in = some(cap * 2 * c.hidden);
  s.msg = N > 1 ? some(static_cast<size_t>(N) * T * p.msg_bytes) : 16;
  s.part = N > 1 ? some(static_cast<size_t>(N) * T * 2 * c.hidden) : 16;
  s.my_row = align16(4 * static_cast<size_t>(p.row_ints));
  s.cnt_mat = align16(2 * static_cast<size_t>(c.world) * p.row_ints * 4);
  s.cnt_sig = 2 * static_cast<size_t>(c.world) * 8;
  s.chunk_sig = static_cast<size_t>(N) * (T > 0 ? T : 1) * 8;  // room for chunk = 1
  s.flags = align16(2 * static_cast<size_t>(c.gpus_per_node) * 4);
  return s;
}

int check_config(const EphConfig* c) {
  if (c == nullptr) return epn_fail("eph: null config");
  if (c->gpus_per_node < 1 || c->gpus_per_node > kMaxG) return epn_fail("eph: %d GPUs per node (1..%d)", c->gpus_per_node, kMaxG);
  if (c->world < 1 || c->world % c->gpus_per_node) return epn_fail("eph: world %d is not nodes x %d", c->world, c->gpus_per_node);
  if (c->world / c->gpus_per_node > kMaxNodes) return epn_fail("eph: %d nodes (at most %d)", c->world / c->gpus_per_node, kMaxNodes);
  if (c->topk < 1 || c->topk > kMaxTopk) return epn_fail("eph: topk %d (1..%d)", c->topk, kMaxTopk);
  if (c->hidden < 8 || c->hidden % (c->fp8 ? 128 : 8)) return epn_fail("eph: hidden %d must be a multiple of %d", c->hidden, c->fp8 ? 128 : 8);
  if (c->max_tokens < 0 || c->experts_per_rank < 1) return epn_fail("eph: max_tokens %d, experts_per_rank %d", c->max_tokens, c->experts_per_rank);
  return 0;
}

void release(HierContext* ctx) {
  for (int i = ctx->n_sym - 1; i >= 0; --i) nvshmem_free(ctx->sym[i]);
  for (int i = 0; i < ctx->n_loc; ++i) cudaFree(ctx->loc[i]);
  if (ctx->host_error) cudaFreeHost(ctx->host_error);
  delete ctx;
}

}  // namespace

extern "C" long long eph_symmetric_bytes(const EphConfig* cfg) {
  if (check_config(cfg)) return -1;
  return static_cast<long long>(sym_sizes(*cfg).total());
}

extern "C" int eph_create(const EphConfig* cfg, void** out) {
  if (out == nullptr) return epn_fail("eph_create: null output");
  *out = nullptr;
  if (check_config(cfg)) return -1;
  if (cfg->transport < 0 || cfg->transport > 2) return epn_fail("eph_create: transport %d (0 auto, 1 put, 2 direct)", cfg->transport);
  if (epn_my_pe() != cfg->rank || epn_n_pes() != cfg->world)
    return epn_fail("eph_create: NVSHMEM is PE %d of %d, the config says rank %d of %d (call epn_init first)",
                    epn_my_pe(), epn_n_pes(), cfg->rank, cfg->world);
  const EphConfig& c = *cfg;
  auto* ctx = new HierContext{};
  HierParams& p = ctx->p;
  p.rank = c.rank;
  p.world = c.world;
  p.G = c.gpus_per_node;
  p.N = message_layout(c, p);
  p.node = c.rank / p.G;
  p.local = c.rank % p.G;
  p.hidden = c.hidden;
  p.topk = c.topk;
  p.E = c.experts_per_rank;
  p.max_tokens = c.max_tokens;
  p.chunk = 8;
  p.timeout_ns = static_cast<unsigned long long>((c.timeout_s > 0 ? c.timeout_s : 10.0) * 1e9);
  ctx->device = c.device;
  int rc = 0;
  auto fail_free = [&](int r) {
    release(ctx);
    return r;
  };
  if (cudaSetDevice(c.device) != cudaSuccess) return fail_free(epn_fail("eph_create: cudaSetDevice(%d) failed", c.device));

  const SymSizes s = sym_sizes(c);
  // nvshmem_malloc is collective: every PE makes the same calls in the same order.
  auto sym = [&](size_t bytes) -> void* {
    void* ptr = nvshmem_malloc(bytes);
    if (ptr != nullptr) {
      ctx->sym[ctx->n_sym++] = ptr;
      if (cudaMemset(ptr, 0, bytes) != cudaSuccess) rc = -1;
    } else {
      rc = -1;
    }
    return ptr;
  };
  p.recv_x = static_cast<uint8_t*>(sym(s.recv_x));
  p.recv_scales = static_cast<float*>(sym(s.recv_scales));
  p.recv_idx = static_cast<int64_t*>(sym(s.recv_idx));
  p.recv_w = static_cast<float*>(sym(s.recv_w));
  p.combine_in = static_cast<__nv_bfloat16*>(sym(s.combine_in));
  p.msg_send = static_cast<uint8_t*>(sym(s.msg));
  p.msg_recv = static_cast<uint8_t*>(sym(s.msg));
  p.part_send = static_cast<__nv_bfloat16*>(sym(s.part));
  p.part_recv = static_cast<__nv_bfloat16*>(sym(s.part));
  p.my_row = static_cast<int*>(sym(s.my_row));
  p.cnt_mat = static_cast<int*>(sym(s.cnt_mat));
  p.cnt_sig = static_cast<uint64_t*>(sym(s.cnt_sig));
  p.msg_sig = static_cast<uint64_t*>(sym(s.chunk_sig));
  p.part_sig = static_cast<uint64_t*>(sym(s.chunk_sig));
  p.flags = static_cast<int*>(sym(s.flags));
  if (rc)
    return fail_free(epn_fail("eph_create: nvshmem_malloc of %.2f GiB failed: raise NVSHMEM_SYMMETRIC_SIZE "
                              "(it must be set before NVSHMEM starts)", s.total() / 1073741824.0));
  for (int g = 0; g < p.G; ++g) {
    const int pe = p.node * p.G + g;
    p.peer_recv_x[g] = static_cast<uint8_t*>(nvshmem_ptr(p.recv_x, pe));
    p.peer_recv_scales[g] = static_cast<float*>(nvshmem_ptr(p.recv_scales, pe));
    p.peer_recv_idx[g] = static_cast<int64_t*>(nvshmem_ptr(p.recv_idx, pe));
    p.peer_recv_w[g] = static_cast<float*>(nvshmem_ptr(p.recv_w, pe));
    p.peer_combine_in[g] = static_cast<const __nv_bfloat16*>(nvshmem_ptr(p.combine_in, pe));
    p.peer_flags[g] = static_cast<int*>(nvshmem_ptr(p.flags, pe));
    if (!p.peer_recv_x[g] || !p.peer_recv_scales[g] || !p.peer_recv_idx[g] || !p.peer_recv_w[g] ||
        !p.peer_combine_in[g] || !p.peer_flags[g])
      return fail_free(epn_fail("eph_create: PE %d (node %d) cannot reach PE %d of its own node by NVLink "
                                "load/store (nvshmem_ptr is null)", p.rank, p.node, pe));
  }

  for (int m = 0; m < p.N; ++m) {  // rail peers on every node (my own never used)
    const int pe = m * p.G + p.local;
    const bool rows_direct = c.transport == 2 && m != p.node, partials_direct = c.transport != 1 && m != p.node;
    p.direct_msg_recv[m] = rows_direct ? static_cast<uint8_t*>(nvshmem_ptr(p.msg_recv, pe)) : nullptr;
    p.direct_part_recv[m] = partials_direct ? static_cast<__nv_bfloat16*>(nvshmem_ptr(p.part_recv, pe)) : nullptr;
  }

  const size_t T = c.max_tokens > 0 ? c.max_tokens : 1;
  auto loc = [&](size_t bytes) -> void* {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, bytes ? bytes : 16) != cudaSuccess) {
      rc = -1;
      return nullptr;
    }
    ctx->loc[ctx->n_loc++] = ptr;
    if (cudaMemset(ptr, 0, bytes ? bytes : 16) != cudaSuccess) rc = -1;
    return ptr;
  };
  p.pos = static_cast<int*>(loc(T * c.world * 4));
  p.jn = static_cast<int*>(loc(T * p.N * 4));
  p.tok_of = static_cast<int*>(loc(T * p.N * 4));
  p.off = static_cast<int*>(loc(static_cast<size_t>(c.world) * p.G * 4));
  p.to_node = static_cast<int*>(loc(p.N * 4));
  p.from_node = static_cast<int*>(loc(p.N * 4));
  p.num_recv = static_cast<long long*>(loc(8));
  p.expert_counts = static_cast<long long*>(loc(8 * static_cast<size_t>(p.E)));
  p.counters = static_cast<unsigned*>(loc(16));
  p.dev_error = static_cast<int*>(loc(16));
  if (rc) return fail_free(epn_fail("eph_create: cudaMalloc failed"));
  void* host = nullptr;
  if (cudaHostAlloc(&host, sizeof(EpErrorInfo), cudaHostAllocMapped) != cudaSuccess)
    return fail_free(epn_fail("eph_create: cudaHostAlloc failed"));
  memset(host, 0, sizeof(EpErrorInfo));
  ctx->host_error = static_cast<EpErrorInfo*>(host);
  void* alias = nullptr;
  if (cudaHostGetDevicePointer(&alias, host, 0) != cudaSuccess)
    return fail_free(epn_fail("eph_create: cudaHostGetDevicePointer failed"));
  p.host_error = static_cast<EpErrorInfo*>(alias);
  if (eph::allow_layout_smem(4 * p.E) != cudaSuccess &&
      4 * p.E > 48 * 1024)
    return fail_free(epn_fail("eph_create: %d experts per rank need too much shared memory", p.E));
  if (cudaDeviceSynchronize() != cudaSuccess) return fail_free(epn_fail("eph_create: set-up failed"));
  nvshmem_barrier_all();  // nobody signals before every PE zeroed its signals
  ctx->cap_rows = static_cast<size_t>(c.world) * c.max_tokens;
  *out = ctx;
  return 0;
}

extern "C" int eph_region(void* vctx, int which, void** ptr, long long* bytes) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr || ptr == nullptr || bytes == nullptr) return epn_fail("eph_region: null argument");
  const HierParams& p = ctx->p;
  const size_t cap = ctx->cap_rows;
  switch (which) {
    case EPH_RECV_X: *ptr = p.recv_x; *bytes = cap * p.row_bytes; break;
    case EPH_RECV_SCALES: *ptr = p.recv_scales; *bytes = cap * 4 * p.num_scales; break;
    case EPH_RECV_IDX: *ptr = p.recv_idx; *bytes = cap * 8 * p.topk; break;
    case EPH_RECV_W: *ptr = p.recv_w; *bytes = cap * 4 * p.topk; break;
    case EPH_COMBINE_IN: *ptr = p.combine_in; *bytes = cap * 2 * p.hidden; break;
    case EPH_NUM_RECV: *ptr = p.num_recv; *bytes = 8; break;
    case EPH_EXPERT_COUNTS: *ptr = p.expert_counts; *bytes = 8 * static_cast<long long>(p.E); break;
    default: return epn_fail("eph_region: unknown region %d", which);
  }
  return 0;
}

extern "C" void* eph_error_flag_ptr(void* vctx) {
  auto* ctx = static_cast<HierContext*>(vctx);
  return ctx ? (void*)&ctx->host_error->flag : nullptr;
}

extern "C" int eph_poll_error(void* vctx, int* rank, int* peer, int* phase) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr || !ctx->host_error->flag) return 0;
  *rank = ctx->host_error->rank;
  *peer = ctx->host_error->peer;
  *phase = ctx->host_error->phase;
  return 1;
}

extern "C" int eph_destroy(void* vctx) {
  auto* ctx = static_cast<HierContext*>(vctx);
  if (ctx == nullptr) return 0;
  cudaError_t err = cudaDeviceSynchronize();
  nvshmem_barrier_all();  // nobody frees while a peer may still put into it
  release(ctx);
  if (err != cudaSuccess) return epn_fail("eph_destroy: %s", cudaGetErrorString(err));
  return 0;
}
