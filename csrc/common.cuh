// Shared by every kernel file: the context that one rank keeps, the parameter block every kernel
// receives by value, PTX helpers for system-scope release/acquire, and the bounded spin-wait.
//
// Memory region (one cudaMalloc per rank, exported once with cudaIpcGetMemHandle; every rank
// computes the same offsets, so a peer's buffer = peer_base[peer] + offset):
//   shared part (peers write or read it over NVLink)
//     recv_x        [capacity, row_bytes]        dispatch destination, rows (source, token) order
//     recv_scales   [capacity, scale_stride] B   fp8: num_scales f32; mxfp8: num_scales E8M0 bytes, the
//                                                  stride rounded up to 16 (padding never read)
//     recv_idx      [capacity, topk] i64
//     recv_w        [capacity, topk] f32
//     combine_in    [capacity, hidden] bf16      filled by the caller, pulled by sources in combine
//     em_slot       [capacity, topk] i32         expert-major only: slot of (received row, k) on this rank, -1
//                                                  where expert k is not mine (written by the source)
//     combine_red   [capacity, hidden] bf16      expert-major only: each received row's experts summed with
//                                                  their weights (combine phase R), pulled by the sources
//     recv_key      [capacity] i64               own_rows ce only: row r's source rank << 32 | source token, -1
//                                                  where an own row's token is not routed to me (padding)
//     signals       int32 flags, see Signals below
//   own_rows ce: recv_x, recv_scales, recv_idx and recv_w rows [0, T_me) are my own tokens by index (the
//   caller's copy engine writes them, no kernel does), then each peer's packed rows in rank order; with
//   own_rows sm (default) every source's rows are packed in rank order, mine included; own_rows all: source
//   s's token t at row s * max_tokens + t for every s (copy engines move every row; recv_key marks the rows
//   whose token is not routed here, and rows past T_s, -1)
//   expert-major (align >= 1): recv_x, recv_scales and combine_in hold `slots` rows (per local expert
//   segments, epbench/layout.py), not `capacity`
//   local part (only this rank touches it)
//     out           [max_tokens, hidden] bf16    combine result
//     slot_map      [max_tokens, world] i32      token t's row on rank d relative to my base there, -1: not sent
//     base          [world] i32                  first row of my tokens in rank d's recv buffer (own_rows ce:
//                                                  base[me] = 0 and slot_map[t][me] = t, so row t is token t)
//     num_recv      i64, expert_counts [experts_per_rank] i64
//     counters      u32 [8]                      blocks finished per launch (reset by the last block)
//                                                  [2]: unused (no kernel reads or writes it)
//                                                  [3], [4]: grid notify range index / tickets;
//                                                  [5]: lean_dyn token counter (dispatch.cu)
//     notify_scratch i32 [kMaxNotifyBlocks x (1 + EP_MAX_WORLD) + world * E]: grid notify's
//                                                  per-block flags and counts, expert count accumulator
//     dev_error     i32                          nonzero once any wait timed out: every spin loop bails
//     expert-major only: em_ord [max_tokens, topk] i32 (ordinal of token t among my tokens routed to expert
//     topk_idx[t][k]), em_base [world * E] i32 (my first slot for global expert g on its owner), em_offsets [E]
//     i64, em_num_slots i64 (my segment table), em_go i32 (dispatch: every row of this epoch has landed)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "api.h"

#define EP_MAX_WORLD 8
#define EP_MAX_TOPK 32

// Records the message for ep_last_error() and returns -1 from the calling API function.
#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    cudaError_t err_ = (expr);                                                            \
    if (err_ != cudaSuccess) {                                                            \
      ep_set_error("%s:%d: %s: %s", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      return -1;                                                                          \
    }                                                                                     \
  } while (0)

void ep_set_error(const char* fmt, ...);

enum EpPhase { kPhaseNotify = 1, kPhaseDispatch = 2, kPhaseCombineReady = 3, kPhaseCombineDone = 4 };
// combine_ce (phases 9, 10; 5-8 are the low-latency kernels'): waiting for a chunk a peer's copy engine pushed, and a
// peer that pushed fewer rows than this rank's tokens (reported at once)
enum { kPhaseCombineStaged = 9, kPhaseCombineTokens = 10 };
// combine_ce: a holder pushes source s's rows in at most this many chunks, each with a flag (EP_OPT_CE_CHUNKS even
// chunks: 4, 5, 6, 8, 16 or 32, default 16; EP_OPT_CE_GROW: growing ones), on up to kCeStreams copy streams a peer
// (EP_OPT_CE_STREAMS)
constexpr int kCeChunks = 32;
constexpr int kCeStreams = 4;

// Host-mapped pinned memory: a kernel that gives up writes here, Python reads it without a sync.
struct EpErrorInfo {
  volatile int flag;
  volatile int rank;
  volatile int peer;
  volatile int phase;
};

// Offsets (in int32 units) of the flags inside the signals area. Each flag is written by exactly
// one source rank with st.release.sys and holds the epoch of the last call that wrote it; epochs
// only grow, so nothing is ever reset.
//   notify row s : [flag, counts to each dest (world), counts per local expert of mine (E)]
//                  written by source s in its notify kernel
//   done[s]      : source s finished writing its dispatch rows into my buffers
//   ready[s]     : rank s entered combine, so its combine_in is filled and may be pulled
//   pulled[s]    : rank s finished pulling from my combine_in (my buffer may be reused)
//   dsp_ready[s] : unused (allocated; no kernel reads or writes it)
//   cstage[h][c] : combine_ce: holder h's copy engine finished pushing chunk c of my rows into my staging buffer
//                  (written by a stream memory operation of h's copy stream, kCeChunks per holder)
// The notify row also carries the source's num_tokens at [1 + world + E] and, in the expert-major layout,
// the source's counts for every global expert at [2 + world + E + g] (each rank then knows every segment).
struct EpSignals {
  int notify_stride;
  int notify_off;
  int done_off;
  int ready_off;
  int pulled_off;
  int dsp_ready_off;
  int cstage_off;
  int total_ints;
};

struct EpParams {
  int rank, world, experts_per_rank, topk, hidden, num_scales;
  int row_bytes;  // bytes of one x row as received (hidden * 2 for bf16, hidden for fp8 and mxfp8)
  int scale_bytes;   // scale bytes of one row as the caller hands them (fp8: 4 * num_scales, mxfp8: num_scales)
  int scale_stride;  // bytes per row of recv_scales (>= scale_bytes; mxfp8: a multiple of 16)
  int fused;         // 1 / 2: ep_dispatch gets bf16 rows and quantizes them to mxfp8 on the way, storing 8 / 16
                     // bytes per lane and step (fused_stores; dispatch.cu)
  int max_tokens, capacity;
  int align;  // 0: rank-major; >= 1: expert-major receive layout, segments padded to align rows
  int slots;  // rows of recv_x / recv_scales / combine_in (capacity when rank-major)
  int own_ce;  // ep_config.own_rows: 1 (ce) = my own rows at their token index, stored by the caller (see above);
               // 2 (all) = every source s's rows at s * max_tokens + token, a peer's copied by ep_dispatch
  int combine_ce;     // ep_config.combine_ce: 1 = peers' rows pushed into my staging buffer by their copy engines
  // combine_ce: chunk c holds rows [ce_bound[c], ce_bound[c + 1]); every bound after the last chunk's is max_tokens
  int ce_bound[kCeChunks + 1];
  int em_push;  // ep_config.em_push: 1 = expert-major senders store a row into every slot of it, 3 = auto (2 up to 16
                // dispatch warps, else 0; ep_dispatch resolves it), 2 = the receiver's
                // wide copy pass (dispatch.cu)
  unsigned long long timeout_ns;
  uint8_t* peer_base[EP_MAX_WORLD];  // region base of each rank, mine included (local pointer)
  size_t off_recv_x, off_recv_scales, off_recv_idx, off_recv_w, off_combine_in, off_em_slot, off_combine_red,
      off_recv_key, off_combine_stage, off_signals;
  EpSignals sig;
  int* slot_map;
  int* base;
  long long* num_recv;
  long long* expert_counts;
  unsigned* counters;
  int* notify_scratch;  // grid notify (notify.cu); the accumulator part is zero between calls
  int* dev_error;
  int* em_ord;              // expert-major only (null otherwise), see the region comment above
  int* em_base;
  long long* em_offsets;
  long long* em_num_slots;
  int* em_go;
  EpErrorInfo* host_error;  // device alias of the host-mapped struct
  // Debug only (ep_set_option EP_OPT_DEBUG_STAMPS): when non-null, kernels store %globaltimer per
  // phase at the kStamp* indices. Null by default: the stores are skipped.
  unsigned long long* stamps;
  int notify_impl;  // EP_NOTIFY_* (api.h)
  int em_sms;  // ep_set_option EP_OPT_EM_SMS (expert-major): 0 = the dispatch kernel's blocks expand the rows after their
               // grid-wide wait and phase R runs on the combine's blocks; n > 0 = both in kernels of their own on n
               // blocks (dispatch.cu em_expand_kernel, combine.cu em_reduce_kernel)
  int cb_skip;  // measuring aid (EP_OPT_CB_SKIP; kCbSkip* bits): read only while stamps is non-null
};

// Indices into EpParams::stamps (one launch's worth; each call overwrites them).
enum EpStamp {
  kStampNotifyStart = 0,
  kStampCounted = 1,    // masks and counts of every token done
  kStampPublished = 2,  // my count row stored into every peer (thread 0's warp)
  kStampSlots = 3,      // slot_map written (staged notify: after publishing)
  kStampPeersSeen = 4,  // every peer's row for this epoch seen
  kStampNotifyEnd = 5,
  kStampDataStart = 6,  // data kernel block 0 past griddepcontrol.wait
  kStampDataLast = 7,   // last data block done with its rows (before the completion flags)
  kStampDataEnd = 8,    // last block saw every peer's completion flag
  kStampBlockCounted = 9,  // notify: a block finished A (grid: the last block to get there)
  kStampDataFirst = 10,    // first data block done with its rows
  kStampSmMask = 11,       // [11..13]: bit s set when a data block ran on SM s (lean / lean-dyn; debug)
  // [14..18] combine_ce_bulk_kernel (the bulk pull and the ce combine at 3-4 ranks), debug stamps on: sums over
  // its warps of clock64 cycles (zeroed before the launch): the loaders' waits for a free stage (and, ce, for a
  // chunk flag), the summers' waits for a full stage, each kind's cycles from its start to its end, the units
  kStampCbLoaderWait = 14,
  kStampCbSummerWait = 15,
  kStampCbLoaderBusy = 16,
  kStampCbSummerBusy = 17,
  kStampCbUnits = 18,
  // [19..23] the same kernel's cycles by kind, summed over its warps: the loaders' and the summers' preparation
  // (the batch's holder lookups, each token's holders), the loaders' issue of a unit's copies, the summers' sum,
  // stores and release of a stage, and every warp's start (the bulk pull's ready handshake or the ce path's token
  // check, then the block barrier)
  kStampCbLoaderPrep = 19,
  kStampCbSummerPrep = 20,
  kStampCbLoaderIssue = 21,
  kStampCbSummerSum = 22,
  kStampCbReady = 23,
  // [24] the same, with EP_OPT_CB_SKIP's kCbSkipStores or kCbSkipSmem: the XOR of every summed word a summer did
  // not store (so the sums are computed, not dropped by the compiler)
  kStampCbFold = 24,
  kNumStamps = 25,
};


// EP_OPT_CB_SKIP's bits (measuring aid, debug stamps on): what the bulk kernel's summers leave out
enum { kCbSkipStores = 1, kCbSkipReads = 2, kCbSkipSmem = 4 };

enum EpCounter { kCounterDispatch = 0, kCounterCombine = 1 };
// grid notify (notify.cu): [3] hands out block ranges in arrival order, [4] counts finished blocks;
// the last block resets both.
enum { kCounterNotifyTile = 3, kCounterNotifyDone = 4, kNumCounters = 8 };
// lean_dyn dispatch (dispatch.cu): [5] hands out tokens to warps; the last block of the grid resets it.
enum { kCounterDispatchWork = 5 };
constexpr int kMaxNotifyBlocks = 128;

struct EpContext {
  EpParams p;
  int device;
  uint8_t* region;
  size_t region_bytes, shared_bytes;
  size_t off_out, off_slot_map, off_base, off_num_recv, off_expert_counts, off_counters, off_notify_scratch,
      off_dev_error, off_stamps, off_em_ord, off_em_base, off_em_offsets, off_em_num_slots, off_em_go;
  size_t notify_scratch_bytes;
  EpErrorInfo* host_error;  // host view
  bool peers_open;
  int max_smem_optin;
  int combine_stages;  // stages per combine warp (EP_OPT_COMBINE_STAGES)
  int combine_chunk;   // combine bytes per holder and stage (EP_OPT_COMBINE_CHUNK: 1024, 2048, 4096)
  ep_effective effective;  // what the last launches ran, filled by the launchers (ep_effective_config)
  // own_rows all (p.own_ce == 2): the peers' copies on stream 0, in ring order (peer me + 1 + i i-th), my own on 1; combine_ce
  // at 2 ranks pushes a peer's chunk c on stream i + (c % ce_streams) * (world - 1) (several copy queues, so one chunk's
  // flag write and the next copy's start overlap another stream's copy), at 3+ chunk c on stream c % ce_streams in ring order
  cudaEvent_t ce_fork;
  cudaStream_t ce_streams[kCeStreams * (EP_MAX_WORLD - 1)];
  cudaEvent_t ce_done[kCeStreams * (EP_MAX_WORLD - 1)];
  int ce_streams_used;  // combine_ce: copy streams a peer at 2 ranks, in all at 3+ (EP_OPT_CE_STREAMS: 1, 2, 4; 2 / 1)
  int ce_chunks;        // combine_ce: even chunks (EP_OPT_CE_CHUNKS), unless ce_grow
  int ce_grow;          // combine_ce: growing chunks (EP_OPT_CE_GROW)
  int pull_bulk;        // EP_OPT_PULL_KERNEL: 1 the pull by combine_ce_bulk_kernel<true>, 2 per call by ep_pull_auto
  int ce_share;         // own_rows all: percent of my x rows the copy engines move (EP_OPT_CE_SHARE, default 100)
  // combine_ce: the driver's cuStreamWriteValue32 (resolved at ep_create through the runtime, so the library does
  // not link libcuda): int (CUstream, CUdeviceptr, uint32 value, unsigned flags)
  int (*write_value32)(void*, unsigned long long, unsigned, unsigned);
};

// The checks ep_dispatch and ep_combine both make before launching: peers open, the token count
// within the buffers, an SM count and 1..max_warps warps. 0, or -1 with the error set.
inline int ep_check_call(const EpContext* ctx, int num_tokens, int num_sms, int warps, int max_warps) {
  if (!ctx->peers_open) {
    ep_set_error("peers not opened: call ep_open_peers first");
    return -1;
  }
  if (num_tokens < 0 || num_tokens > ctx->p.max_tokens) {
    ep_set_error("num_tokens %d outside 0..max_tokens %d", num_tokens, ctx->p.max_tokens);
    return -1;
  }
  if (num_sms < 1 || warps < 1 || warps > max_warps) {
    ep_set_error("num_sms must be >= 1 and warps 1..%d (got %d, %d)", max_warps, num_sms, warps);
    return -1;
  }
  return 0;
}

// ---- launchers (each next to its kernel) ----
// num_sms: the data kernel's blocks; the grid notify uses up to that many.
int ep_launch_notify(EpContext* ctx, const int64_t* topk_idx, int num_tokens, int num_sms, int epoch,
                     cudaStream_t stream);
// Expert-major only: em_ord of this call's tokens (notify.cu), launched before the notify kernel.
int ep_launch_em_ordinal(EpContext* ctx, const int64_t* topk_idx, int num_tokens, int num_sms, cudaStream_t stream);

// Launches a kernel that may start while the previous kernel on the stream (the notify kernel)
// is still running: programmatic dependent launch. The kernel must execute
// griddep_wait() before touching anything the previous kernel writes.
template <typename... KArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KArgs...), int grid, int block, size_t smem, cudaStream_t stream,
                             Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// ---- device helpers ----
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Inclusive prefix sum of v over the warp's lanes (lane l gets v of lanes 0..l); every lane must call it.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) >= off) v += x;
  }
  return v;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void stamp(const EpParams& p, int which) {
  if (p.stamps != nullptr) p.stamps[which] = globaltimer();
}

// Debug stamps on: record this block's SM in the kStampSmMask bits (zeroed by the notify kernel).
__device__ __forceinline__ void stamp_sm(const EpParams& p) {
  if (p.stamps == nullptr || threadIdx.x != 0) return;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (smid < 192) atomicOr(p.stamps + kStampSmMask + smid / 64, 1ull << (smid % 64));
}

// 16-byte read of data nobody writes during the kernel, kept in L1: for loads whose neighbouring 16 bytes
// the next instruction reads (fused_stores 16: lane l reads vectors 2l and 2l + 1 in two loads, each using
// half of the sectors it touches; without L1 the second would fetch the same sectors from L2 again).
__device__ __forceinline__ int4 ld_nc_v4_l1(const int4* p) {
  int4 v;
  asm("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16-byte read of data nobody writes during the kernel; no L1 allocation (streamed once).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void st_v4(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_v2(uint2* p, uint32_t x, uint32_t y) {
  asm volatile("st.global.L1::no_allocate.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(x), "r"(y) : "memory");
}

__device__ __forceinline__ int* signal_ptr(const EpParams& p, int rank, int index) {
  return reinterpret_cast<int*>(p.peer_base[rank] + p.off_signals) + index;
}

// Out of line and without the EpParams reference, so the parameter block stays in param space.
static __device__ __noinline__ void report_timeout(int* dev_error, EpErrorInfo* host_error, int rank, int peer, int phase) {
  if (atomicCAS(dev_error, 0, phase) == 0) {
    host_error->rank = rank;
    host_error->peer = peer;
    host_error->phase = phase;
    __threadfence_system();
    host_error->flag = 1;
    __threadfence_system();
  }
}

// Spins until *flag >= expected. Gives up (returns false) when another wait already failed or
// after p.timeout_ns, recording (rank, peer, phase) for the host.
__device__ __forceinline__ bool wait_flag(const EpParams& p, const int* flag, int expected, int peer, int phase) {
  unsigned long long start = globaltimer();
  while (true) {
    if (ld_acquire_sys(flag) - expected >= 0) return true;
    if (ld_volatile(p.dev_error) != 0) return false;
    if (globaltimer() - start > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return false;
    }
  }
}

// combine_ce: the chunk holding row t, from chunk c on (a warp's rows only grow).
__device__ __forceinline__ int ce_chunk_from(const EpParams& p, int t, int c) {
  while (t >= p.ce_bound[c + 1]) ++c;
  return c;
}

// Called by every thread at the end of a kernel whose blocks wrote into peer memory. All
// threads fence, then one thread per block counts the block done; the last block of the grid
// releases `epoch` into flag `my_flag_index` of every peer and waits until every peer has
// released its own flag to me (flag_base + peer). Returns after the wait (or a timeout).
// reset_counter / reset_counter2 >= 0: work counters of the kernel, zeroed by the last block (every block is
// past its last use).
// Returns true in the last block (block-uniform).
__device__ __forceinline__ bool grid_release_and_wait(const EpParams& p, int counter, int flag_base, int epoch,
                                                      int phase, int reset_counter = -1, int reset_counter2 = -1) {
  __shared__ int is_last;
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned prev = atomicAdd(p.counters + counter, 1u);
    is_last = (prev == gridDim.x - 1);
    if (is_last) atomicExch(p.counters + counter, 0u);
    if (is_last && reset_counter >= 0) atomicExch(p.counters + reset_counter, 0u);
    if (is_last && reset_counter2 >= 0) atomicExch(p.counters + reset_counter2, 0u);
    if (prev == 0 && counter == kCounterDispatch) stamp(p, kStampDataFirst);
  }
  __syncthreads();
  if (!is_last) return false;
  if (threadIdx.x == 0 && counter == kCounterDispatch) stamp(p, kStampDataLast);
  fence_acq_rel_sys();
  const int peer = threadIdx.x;
  if (peer < p.world) {
    st_release_sys(signal_ptr(p, peer, flag_base + p.rank), epoch);
    wait_flag(p, signal_ptr(p, p.rank, flag_base + peer), epoch, peer, phase);
  }
  if (p.stamps != nullptr && counter == kCounterDispatch) {
    __syncthreads();  // block-uniform: every thread of the last block is here
    if (threadIdx.x == 0) stamp(p, kStampDataEnd);
  }
  return true;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// acc[i] += w * bf16 element i of the 16-byte vector v (8 bf16), in fp32.
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], const int4& v, float w) {
  const uint32_t words[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = fmaf(w, __uint_as_float(words[i] << 16), acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, __uint_as_float(words[i] & 0xffff0000u), acc[2 * i + 1]);
  }
}

// Eight fp32 values rounded to bf16 (nearest even) in one 16-byte vector.
__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    words[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_int4((int)words[0], (int)words[1], (int)words[2], (int)words[3]);
}

// ---- TMA (bulk copy) helpers ----
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) { return (uint32_t)__cvta_generic_to_shared(ptr); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "EP_MBAR_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra EP_MBAR_WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// A loading warp's next use (lap) of stage st of a TMA ring whose consumers free it through `empty`: wait until they
// freed its last use, then lane 0 arms `full` with the bytes the lanes' bulk copies will bring.
__device__ __forceinline__ void ring_stage_arm(uint64_t* full, uint64_t* empty, int st, uint32_t lap, int lane,
                                               uint32_t bytes) {
  if (lap > 0) mbar_wait(empty + st, (lap - 1) & 1u);
  if (lane == 0) mbar_expect_tx(full + st, bytes);
}

// 16-byte read of data written during the kernel by another agent (a copy engine) after a flag was acquired: weak,
// no L1 allocation, so no line fetched before the flag can be returned.
__device__ __forceinline__ int4 ld_v4_na(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void bulk_load(void* smem_dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem_dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}


