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
  int mxfp8;  // 1 (fp8 0): x is e4m3 with one E8M0 scale byte per 32 elements (epbench/mxfp8.py); normal mode only
  int quantize_fused;  // 1 (mxfp8 only): ep_dispatch takes bf16 rows and the receivers get mxfp8 rows and scales,
                       // each lane storing 8 bytes per vector; 2: the same bytes, two vectors per lane and
                       // 16-byte stores (backend option fused_stores 16)
  int align;  // 0: rank-major receive layout; >= 1: expert-major, segments padded to a multiple of align rows
              // (epbench/layout.py; normal mode only, the low-latency region ignores it)
  int own_rows;  // 0: the dispatch kernel stores a rank's own rows like a peer's (packed at base[me]); 1 (ce):
                 // rows [0, T) of the receive buffer are the rank's own tokens by index, copied there by the caller
                 // (the copy engine) before ep_dispatch's kernels run, peers' segments after them; recv_key says
                 // which row holds what. 2 (all): every source's rows by token index at rows
                 // [s * max_tokens, s * max_tokens + T_s), a peer's copied there by ep_dispatch with the copy
                 // engine after the notify kernel, my own by the caller as for 1; no kernel moves a row.
                 // Rank-major and quantize before only (normal mode; the low-latency region ignores it)
  int em_push;  // expert-major only (align >= 1): 0 (receiver): a row crosses to each destination rank once, into the
                // slot of its first expert there, and the receiver's dispatch blocks copy it into its other experts'
                // slots after every row has landed; 1 (sender): the sending warp stores the row into every slot
                // (the link carries it once per (token, expert)), no copy pass; 2 (wide): as 0, the receiver's
                // copy pass loading 8 KiB a warp before its stores, the next row's slots read ahead, and
                // the combine's reduce pass (phase R) loading 4 vectors a lane for rows of one slot; 3 (auto): 2
                // where the dispatch runs at most 16 warps (the most kEm 3 is built for), else 0; the reduce pass wide
  int combine_ce;  // own_rows 2 only: 0 (pull): the combine kernel pulls every holder's row over the link; 1 (ce): each
                   // holder's copy engine pushes its combine_in rows of source s (rows [s * max_tokens, + its own T),
                   // in chunks) into s's staging buffer, each chunk followed by a flag (stream memory operation), and
                   // s's combine kernel sums its own rows and the staged ones, all local (combine.cu). Every rank
                   // must pass the same token count (a rank that holds fewer tokens than a peer stops at once).
} ep_config;

// Buffers a Python caller may view as tensors (ep_region).
enum ep_region_id {
  EP_RECV_X = 0,
  EP_RECV_SCALES = 1,  // [capacity, scale_stride] bytes: fp8 f32 [hidden / 128]; mxfp8 u8 [hidden / 32], stride 16-aligned
  EP_RECV_IDX = 2,
  EP_RECV_W = 3,
  EP_COMBINE_IN = 4,
  EP_OUT = 5,
  EP_NUM_RECV = 6,
  EP_EXPERT_COUNTS = 7,
  EP_DEBUG_STAMPS = 8,  // u64 [25] %globaltimer per phase and the bulk kernel's counters (csrc/common.cuh EpStamp),
                        // written only while EP_OPT_DEBUG_STAMPS is on
  // expert-major layout (align >= 1): EP_RECV_X, EP_RECV_SCALES and EP_COMBINE_IN then hold slots, not rows:
  // [world * max_tokens * min(topk, E) + E * (align - 1)] (epbench/layout.py slot_capacity)
  EP_EM_OFFSETS = 9,    // i64 [E]: first slot of each local expert's segment
  EP_EM_NUM_SLOTS = 10,  // i64: slots in use, the last segment's padding included
  EP_RECV_KEY = 11,  // own_rows 1 only (else empty): i64 [capacity], row r's (source rank << 32 | source token),
                     // -1 for an own row whose token is not routed here (padding)
  EP_COMBINE_STAGE = 12,  // combine_ce only (else empty): bf16 [capacity, hidden], holder h's rows of my token t at
                          // row h * max_tokens + t, pushed by h's copy engine (combine.cu)
};

// ep_set_option keys. Every value is checked here; what actually ran is read back with ep_effective_config.
enum ep_option {
  EP_OPT_DEBUG_STAMPS = 0,  // 1: kernels record per-phase %globaltimer stamps (debug; default 0)
  EP_OPT_NOTIFY_IMPL = 1,   // ep_notify_impl (default EP_NOTIFY_GRID)
  EP_OPT_COMBINE_STAGES = 3,  // stages per warp of the combine (2..4; default 2)
  EP_OPT_COMBINE_CHUNK = 4,   // bytes per holder and stage of the combine (1024, 2048, 4096; default 2048)
  EP_OPT_CE_CHUNKS = 6,   // combine_ce only: chunks a holder pushes a source's rows in (4, 5, 6, 8, 16, 32; default 16)
  EP_OPT_CE_STREAMS = 7,  // combine_ce only: copy streams the chunks alternate over, a peer's at 2 ranks, in all at 3+
                          // (1, 2, 4; default 2 at 2 ranks, 1 at 3+)
  EP_OPT_CE_SHARE = 8,    // own_rows 2 only: percent of a source's x rows the copy engines move into each peer
                          // (25, 50, 75, 100; default 100); the rest go by SM stores at the same time (dispatch.cu)
  EP_OPT_CE_GROW = 9,     // combine_ce only: 1: chunks growing 1.5x from max_tokens / 16 rows (the first lands soon
                          // and the copies keep ahead of the sum); 0 (default): EP_OPT_CE_CHUNKS even chunks
  EP_OPT_PULL_KERNEL = 10,  // the pull's kernel (combine_ce off): 0 (default) combine_tma_kernel, each warp issuing
                            // and summing its own bulk copies; 1 loading warps with 3 summing warps each (the
                            // combine_ce bulk kernel reading the holders' combine_in over the link; rank-major,
                            // world <= 4); 2 one of the two per call, as ep_pull_auto says
  EP_OPT_CB_SKIP = 11,  // measuring aid, honoured only with EP_OPT_DEBUG_STAMPS on (the bulk kernel's counting
                        // instantiation; every other launch ignores it): 0 (default); 1 the summers read and sum
                        // their pieces but store nothing; 2 they free each stage unread (the loaders' copies alone);
                        // 4 they sum words made in registers, reading no shared memory, and store nothing
  EP_OPT_EM_SMS = 5,          // expert-major: blocks of the receiver's expansion kernel (dispatch) and of phase R
                              // (combine), each its own kernel after the transfer; 0 (default): inside the
                              // dispatch kernel / on the combine's blocks (0..1024)
};

// Notify (layout) kernel variants; measurements in notes/KERNELS.md.
enum ep_notify_impl {
  EP_NOTIFY_DIRECT = 0,  // one block, ids read straight from global memory. Not selectable: it runs
                         // only as the recorded fallback of the other two when the experts do not fit their
                         // u16 id stage or shared memory
  EP_NOTIFY_STAGED = 1,  // one block, coalesced id loads staged through shared memory (won at 24 SMs)
  EP_NOTIFY_GRID = 2,    // default: the staged kernel on up to num_sms blocks
};

// Combine: one kernel, bulk-copy (TMA) loads from every holder into per-warp shared-memory stages, fp32 sum,
// bf16 store. A register-pull combine lost or tied at every measured point, so it was deleted. combine_ce
// (ep_config.combine_ce): the peers' rows pushed by copy engines, summed from local memory in registers.
enum ep_combine_impl {
  EP_COMBINE_TMA = 1,
  EP_COMBINE_CE = 2,
  EP_COMBINE_BULK = 3,  // the pull by loading and summing warps (EP_OPT_PULL_KERNEL 1, or 2 where ep_pull_auto picks it)
};

// Dispatch: the lean copy (every per-token load issued before the first store) with tokens handed to
// warps either by a counter (lean_dyn, default: won at 16 and 24 SMs) or by a static stride (lean: won
// at 32 SMs, both shapes). Every other dispatch variant measured lost (notes/KERNELS.md "Lessons").
enum ep_dispatch_impl {
  EP_DISPATCH_LEAN = 3,
  EP_DISPATCH_LEAN_DYN = 10,
};

// What the last ep_dispatch / ep_combine launched, after every clamp and fallback (ep_effective_config).
typedef struct ep_effective {
  int dispatch_impl;   // ep_dispatch_impl
  int dispatch_warps;  // warps per dispatch block
  int dispatch_sms;    // dispatch blocks
  int notify_impl;     // ep_notify_impl that ran (EP_NOTIFY_DIRECT when the requested one could not)
  int notify_blocks;   // blocks of the notify kernel
  int combine_impl;    // ep_combine_impl
  int combine_warps;   // warps per combine block, after the clamp to the stages that fit in shared memory
  int combine_sms;     // combine blocks
  int combine_stages;  // stages per combine warp
  int combine_chunk;   // bytes per holder and stage
  int dispatch_scale_block;  // elements per scale of the dispatched rows: 0 bf16, 128 fp8, 32 mxfp8
  int dispatch_fused;        // 1 / 2: the dispatch kernel quantized bf16 rows on the way with 8 / 16-byte stores
  int dispatch_em_push;      // expert-major: ep_config.em_push as it ran (1 senders stored every slot, 2 the wide copy pass)
  int combine_em_wide;       // expert-major: 1 the combine's reduce pass ran wide (em_push 2 or 3)
  int em_sms;                // expert-major: EP_OPT_EM_SMS in force at the last dispatch (0: the passes within num_sms)
} ep_effective;

const char* ep_last_error(void);
int ep_create(const ep_config* cfg, void** ctx);
int ep_ipc_handle(void* ctx, void* handle_out /* 64 bytes */);
int ep_open_peers(void* ctx, const void* handles /* world * 64 bytes, rank order */);
int ep_region(void* ctx, int which, unsigned long long* ptr, unsigned long long* bytes);
int ep_set_option(void* ctx, int key, int value);
// combine_ce's chunk bounds for max_tokens rows (kCeChunks + 1 = 33 ints into bound): chunk c is rows [bound[c],
// bound[c + 1]); `chunks` even chunks, or growing ones (grow != 0). No CUDA call.
int ep_ce_bounds(int max_tokens, int chunks, int grow, int* bound);
// EP_OPT_PULL_KERNEL 2's choice for a call: 1 (bulk) or 0 (tma); no CUDA call.
int ep_pull_auto(int world, int num_sms, int align);
// impl: ep_dispatch_impl; warps 1..32. An impl or warp count that cannot run is an error before any launch.
// x: [T, hidden] as configured (bf16 when quantize_fused); x_scales: [T, hidden / 128] f32 (fp8) or
// [T, hidden / 32] u8 (mxfp8 not fused), contiguous; null otherwise.
// own_rows 1: the kernels never write rows [0, T) of recv_x / recv_scales / recv_idx / recv_w; the caller puts
// x, x_scales, topk_idx and topk_w there itself, stream-ordered before it reads the output (the backend copies
// them on a side stream forked before this call and joined after it). They write recv_key and everything else.
// own_rows 2: every source's rows by token index at rows [s * max_tokens, s * max_tokens + T_s) on every rank;
// ep_dispatch fills my segment everywhere, my own rank's included: x (and x_scales) by cudaMemcpyAsync after the
// notify kernel (the peers on one stream in ring order, my own rank on another, both forked from `stream` and
// joined), topk_idx, topk_w and every row's key by a small kernel meanwhile, then a one-block kernel signals
// completion. The caller copies nothing.
int ep_dispatch(void* ctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                int num_tokens, int num_sms, int impl, int warps, int epoch, void* stream);
int ep_combine(void* ctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens, int num_sms,
               int warps, int epoch, void* stream);
// Reads the host-mapped timeout record without synchronising: 1 if a kernel gave up.
int ep_poll_error(void* ctx, int* rank, int* peer, int* phase);
// Host address of the record's flag word (int), for a poll that costs no function call.
void* ep_error_flag_ptr(void* ctx);
int ep_effective_config(void* ctx, ep_effective* out);
int ep_destroy(void* ctx);

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
// chunk: 16-byte vectors per lane and work unit, 2 or 4 (1 or 2 KiB of a row; which is faster depends on
// the batch: the backend's combine_chunk auto picks, notes/LATENCY.md).
int ep_ll_combine(void* ll_ctx, const void* topk_idx, int num_tokens, int num_sms, int warps, int chunk,
                  void* stream);
int ep_ll_destroy(void* ll_ctx);
// Which synchronisation both kernels use (backend option ll_sync): 0 grid-wide handshakes (release
// through a last-block counter and a wait, finish through a counter), 1 per-token flags and per-block
// epochs (no grid-wide step; protocol at the top of ll_dispatch.cu / ll_combine.cu). Call it before the
// first ep_ll_dispatch; changing it afterwards is refused (the two keep different flags and epochs).
int ep_ll_set_sync(void* ll_ctx, int sync);
// In which order both combine kernels push their (rank, token, chunk) units (backend option combine_order):
// 0 source (destination-major, lowest rank first; the library's default), 1 rotated (destination-minor from
// rank + 1 on, as the dispatch sends; what the epbench-ll backend sets unless told otherwise). Outputs are
// bit-identical either way (ll_combine.cu, push_unit). Set it before capturing a graph: a captured launch keeps
// the order it had.
int ep_ll_set_combine_order(void* ll_ctx, int order);
// What a peer unit of the token dispatch sends (backend option dispatch_units): 0 row (a whole row, one warp,
// one flag per (token, peer); the default), 1 chunk (one warp and flag per 2 KiB chunk of the row). The same
// bytes land either way. Every rank must use the same value; a captured launch keeps the value it had.
int ep_ll_set_dispatch_units(void* ll_ctx, int units);
// Where the token dispatch's peer rows land (backend option dispatch_place): 0 stage (the receiver copies each
// into its experts' slots; the library's default), 1 the slot of the token's first expert there (the receiver
// copies it into the other slots only), 2 inline (a staging row of inline words, each 4 bytes beside the epoch: no
// fence, no flag), 3 line / 4 line128 (the row in 64- / 128-byte lines, each with the epoch in its tag; row units
// only; enum LlDispatchPlace in ll_common.cuh). Same outputs; every rank the same value (a mismatch stops every
// rank at once).
int ep_ll_set_dispatch_place(void* ll_ctx, int place);
// How the token combine releases its push units' flags (backend option combine_release): 0 unit (a release
// store after every unit; the library's default), 1 batch (up to 2 units, then one fence and relaxed flag stores;
// what the epbench-ll backend sets unless told otherwise). Same flags and outputs; a captured launch keeps the
// value it had.
int ep_ll_set_combine_release(void* ll_ctx, int release);
// Measuring aids (epbench/llprobe.py, notes/LATENCY.md). ep_ll_set_probe changes what later launches and
// captures do, so set it before capturing. stamps: null (off, the default) or a device buffer of u64
// [num_sms, 8]: thread 0 of every block of each later ll kernel stores %globaltimer at its phase
// boundaries (LlStamp in ll_common.cuh).
int ep_ll_set_probe(void* ll_ctx, void* stamps);
// bits (LlProbeSkip in ll_common.cuh, 0..15; 0 the default): parts the token dispatch leaves out, 1 the own
// rows, 2 the receive copies, 4 the scales and tmap / tw stores beside a peer row, 8 the fence before a peer
// row's flag; its outputs are then wrong.
int ep_ll_set_probe_skip(void* ll_ctx, int bits);
// A kernel of the ll kernels' grid (num_sms blocks of warps x 32 threads) that does only one fixed
// cost, stamped like them (start, end of part A at slot 2, end): mode 0 nothing (the launch floor),
// 1 the grid-wide release / wait / finish handshake of the ll kernels (ll_sync grid),
// 2 thread 0 of each block: 16 dependent global loads, 3 thread 0: 16 x (store, fence.acq_rel.sys),
// 4 thread 0 of block 0 also stores the smallest nonzero step of %globaltimer (ns) at slot 7,
// 5 the ping: warp 0 of block b < world - 1 sends one dispatch row (row_bytes) to peer rank + 1 + b with a flag
// behind a system-scope fence and waits for the flag of peer rank - 1 - b (needs num_sms >= world - 1; every
// rank must launch it the same number of times), 6 the same with a combine row (hidden x 2 bytes).
int ep_ll_probe(void* ll_ctx, int mode, int num_sms, int warps, void* stream);

#ifdef __cplusplus
}
#endif
