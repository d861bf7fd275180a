// extern "C" API of libepbench_ep.so, called from epbench/cuda_lib.py through ctypes.
// Every function returns 0 on success and -1 on failure; ep_last_error() then says why.
// Pointers are device pointers (torch tensor.data_ptr()); `stream` is a cudaStream_t.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ep_config {
  int rank;
  int world;  // ranks in this NVLink domain, <= 8
  int device;
  int hidden;
  int max_tokens;  // the largest T any rank passes to dispatch
  int topk;
  int experts_per_rank;
  int fp8;  // 1: x is fp8 e4m3 with float32 scales per 128 elements
  double timeout_s;
} ep_config;

// Buffers a Python caller may view as tensors (ep_region).
enum ep_region_id {
  EP_RECV_X = 0,
  EP_RECV_SCALES = 1,
  EP_RECV_IDX = 2,
  EP_RECV_W = 3,
  EP_COMBINE_IN = 4,
  EP_OUT = 5,
  EP_NUM_RECV = 6,
  EP_EXPERT_COUNTS = 7,
  EP_DEBUG_STAMPS = 8,  // u64 [16] %globaltimer per phase, written only while EP_OPT_DEBUG_STAMPS is on
  EP_DISPATCH_X = 9,    // [max_tokens, row_bytes]: x rows the pull dispatch lets peers read (caller fills it)
};

// ep_set_option keys.
enum ep_option {
  EP_OPT_DEBUG_STAMPS = 0,  // 1: kernels record per-phase %globaltimer stamps (debug; default 0)
  EP_OPT_NOTIFY_IMPL = 1,   // ep_notify_impl
  EP_OPT_COMBINE_IMPL = 2,  // ep_combine_impl
  EP_OPT_COMBINE_STAGES = 3,  // stages per warp of EP_COMBINE_TMA (2..4; default 2)
  EP_OPT_COMBINE_CHUNK = 4,   // bytes per holder and stage of EP_COMBINE_TMA (1024, 2048, 4096; default 2048)
  EP_OPT_EXCLUSIVE_SMS = 5,   // 1: the lean dispatch and pull combine kernels reserve over half an SM's shared
                              // memory, so no two of their blocks share an SM (default 0)
  EP_OPT_SPLIT_OWN_WARPS = 6,  // EP_DISPATCH_SPLIT: warps per block that copy the own-rank rows (1..31; default 4)
};

// Notify (layout) kernel variants.
enum ep_notify_impl {
  EP_NOTIFY_DIRECT = 0,  // v1-v3: each thread reads its 4 tokens' ids straight from global memory
  EP_NOTIFY_STAGED = 1,  // v4: coalesced id loads staged through shared memory, counts published
                         // to peers before the slot pass, vector slot stores
  EP_NOTIFY_GRID = 2,    // v12: the staged kernel on up to num_sms blocks (block counts handed over in
                         // global memory; the last block publishes)
};

// Combine kernel variants.
enum ep_combine_impl {
  EP_COMBINE_PULL = 0,  // v1: register loads from every holder, fp32 fma, bf16 store
  EP_COMBINE_TMA = 1,   // v11: bulk-copy (TMA) loads into per-warp shared-memory stages, then the same sum
};

// NOTIFY_ONLY runs the layout kernel alone (the data kernel is skipped): a measuring aid only,
// the receive buffers are left stale.
enum ep_dispatch_impl {
  EP_DISPATCH_REG = 0,
  EP_DISPATCH_TMA = 1,
  EP_DISPATCH_REG_PIPELINED = 2,
  EP_DISPATCH_LEAN = 3,  // v5: reg with every per-token load (x chunk 0, slots, ids, weights, scales) issued first
  EP_DISPATCH_DMAJ = 4,  // v7: destination-major: each warp streams its contiguous token range to one rank at a time
  EP_DISPATCH_DMAJ_NOROT = 5,  // v7: dmaj with every warp visiting the destinations in the same order
  EP_DISPATCH_SPREAD = 6,  // v9: (token, destination) pairs spread over warps, one load per remote store
  EP_DISPATCH_OWNTMA = 7,  // v10/v11: lean for remote rows; own-rank rows by one warp per block through a TMA ring
  EP_DISPATCH_SPREADTMA = 8,  // v11: spread for remote pairs; own-rank rows as in owntma
  EP_DISPATCH_NOTIFY_ONLY = 9,
  EP_DISPATCH_LEAN_DYN = 10,  // v12: lean with tokens handed to warps by a counter (balances blocks and warps)
  EP_DISPATCH_OWNBULK = 11,   // v13: lean-dyn with the own-rank rows staged in shared memory and written by bulk stores
  EP_DISPATCH_PULL = 12,      // v13: receivers pull rows from the sources' EP_DISPATCH_X by bulk copies; metadata
                              //      pushed as lean. Needs x == EP_DISPATCH_X (else lean-dyn runs)
  EP_DISPATCH_SPLIT = 13,     // v14: lean-dyn for the remote rows, own-rank rows by separate warps of each block
};

const char* ep_last_error(void);
int ep_create(const ep_config* cfg, void** ctx);
int ep_ipc_handle(void* ctx, void* handle_out /* 64 bytes */);
int ep_open_peers(void* ctx, const void* handles /* world * 64 bytes, rank order */);
int ep_region(void* ctx, int which, unsigned long long* ptr, unsigned long long* bytes);
int ep_set_option(void* ctx, int key, int value);
int ep_dispatch(void* ctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                int num_tokens, int num_sms, int impl, int warps, int stages, int epoch, void* stream);
int ep_combine(void* ctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens, int num_sms,
               int warps, int epoch, void* stream);
// Reads the host-mapped timeout record without synchronising: 1 if a kernel gave up.
int ep_poll_error(void* ctx, int* rank, int* peer, int* phase);
// Host address of the record's flag word (int), for a poll that costs no function call.
void* ep_error_flag_ptr(void* ctx);
int ep_destroy(void* ctx);
// v9: who writes the rows a rank dispatches to itself (lean and spread dispatch only).
enum ep_own_copy {
  EP_OWN_OFF = 0,      // the data kernel (default, v1-v8 behaviour)
  EP_OWN_SIDE = 1,     // a `blocks`-block kernel on a side stream, outside num_sms (the data kernel skips them)
  EP_OWN_SIDE_IN = 2,  // the same, taken from the budget: the data kernel gets num_sms - blocks
};
int ep_set_own_copy(void* ctx, int mode, int blocks);
// Measuring aid (bench.cu): every rank at once moves (world - 1) * bytes_per_peer over NVLink with
// num_blocks x warps; mode 0 store, 1 load, 2 split warps, 3 interleaved, 4-7 the same with
// local memory as source / destination, 8-11 the steps from the plain push towards the dispatch data phase,
// 12 a local reduce, 13-16 the v9 spread pattern and own-rank stores (bench.cu says which).
// Needs ep_open_peers; clobbers recv_x, recv_idx/w and combine_in.
int ep_bench_link(void* ctx, int mode, int num_blocks, int warps, long long bytes_per_peer, void* stream);

// ---- low-latency mode (ll_buffers.cu, ll_dispatch.cu, ll_combine.cu; layout in ll_common.cuh) ----
// Buffers a Python caller may view as tensors (ep_ll_region).
enum ep_ll_region_id {
  EP_LL_X = 0,           // [E, C, row_bytes] received rows, C = world * max_tokens
  EP_LL_SCALES = 1,      // [E, C, hidden / 128] f32 (fp8 only)
  EP_LL_PAIR = 2,        // [E, C] i32: t * topk + k of each received row
  EP_LL_COUNTS = 3,      // [E] i64 rows per local expert
  EP_LL_SRC_COUNTS = 4,  // [E, world] i32 rows per (local expert, source)
  EP_LL_COMBINE_IN = 5,  // [E, C, hidden] bf16, filled by the caller before ep_ll_combine
  EP_LL_OUT = 6,         // [max_tokens, hidden] bf16 combine result
  EP_LL_EPOCHS = 7,      // i32 [2] calls done (dispatch, combine), advanced on the device
};

// Creates the low-latency region (same ep_config). Export, map and poll it through the EpContext
// that ep_ll_base returns (ep_ipc_handle, ep_open_peers, ep_poll_error, ep_error_flag_ptr);
// release it with ep_ll_destroy (not ep_destroy).
int ep_ll_create(const ep_config* cfg, void** ll_ctx);
void* ep_ll_base(void* ll_ctx);
int ep_ll_region(void* ll_ctx, int which, unsigned long long* ptr, unsigned long long* bytes);
// Both calls allocate nothing, never synchronise with the host and take their epoch from device
// memory: they may be captured into a CUDA graph and replayed. num_sms <= the GPU's SM count.
// The routing weights travel with the dispatch (f32 [T, topk]): combine's expert side sums each
// token's experts on this rank with them and sends one partial row per (token, rank).
int ep_ll_dispatch(void* ll_ctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                   int num_tokens, int num_sms, int warps, void* stream);
int ep_ll_combine(void* ll_ctx, const void* topk_idx, int num_tokens, int num_sms, int warps, void* stream);
int ep_ll_destroy(void* ll_ctx);
// Measuring aids (epbench/llprobe.py, notes/LATENCY.md); they change what later launches and captures
// do, so set them before capturing. stamps: null (off, the default) or a device buffer of u64
// [num_sms, 8]: thread 0 of every block of each later ll kernel stores %globaltimer at its phase
// boundaries (LlStamp in ll_common.cuh). variant: 0 (default kernels) or LL_VARIANT_* bits
// (ll_common.cuh) that bring back pieces of the pre-issue-24 synchronisation.
int ep_ll_set_probe(void* ll_ctx, void* stamps, int variant);
// A kernel of the ll kernels' grid (num_sms blocks of warps x 32 threads) that does only one fixed
// cost, stamped like them (start, end of part A at slot 2, end): mode 0 nothing (the launch floor),
// 1 the grid-wide release / wait / finish handshake of the ll kernels (with the variant set above),
// 2 thread 0 of each block: 16 dependent global loads, 3 thread 0: 16 x (store, fence.acq_rel.sys),
// 4 thread 0 of block 0 also stores the smallest nonzero step of %globaltimer (ns) at slot 7.
int ep_ll_probe(void* ll_ctx, int mode, int num_sms, int warps, void* stream);

#ifdef __cplusplus
}
#endif
