// Low-latency mode (ll_buffers.cu, ll_dispatch.cu, ll_combine.cu): decode-sized batches received
// straight into per-expert padded buffers. Layout contract: epbench/backends/base.py.
//
// One cudaMalloc region per rank, exported and mapped with the normal mode's IPC code
// (ep_ipc_handle / ep_open_peers in buffers.cu, on the EpContext that ep_ll_base returns); every
// rank computes the same offsets, so a peer's buffer = peer_base[peer] + offset.
// E = experts per rank, C = world * T_max (T_max = max tokens per rank), ns = hidden / 128 (fp8).
//   shared part (peers write it over NVLink; x, scales, pair are written by the receiver itself)
//     x          [E, C, row_bytes]       row of source s for local expert e at slot s * T_max + j
//     scales     [E, C, ns] f32          fp8 only
//     pair       [E, C] i32              t * topk + k of the row's source token
//     stage      [world, T_max, row_bytes]  dispatch: source s's token t, sent once to every rank
//                                        holding one of its experts (row s * T_max + t)
//     sscales    [world, T_max, ns] f32  its fp8 scales
//     cnt        [world, E] i32          dispatch: rows source s has for each of my experts
//     dflags     [world] u64             dispatch: (epoch << 32) | T_s, stored by source s into [s]
//                                        with st.release.sys once all its stage rows, tmap / tw
//                                        entries and counts for me have landed
//     tmap       [world, T_max, topk] u64  dispatch: (epoch << 32) | slot (= le * C + s * T_max + j)
//                                        of source s's token t, k-th expert, when that expert is
//                                        mine; entries of older epochs are stale (never cleared)
//     tw         [world, T_max, topk] f32  the matching routing weight w[t, k]
//     crows      [T_max, world, hidden] bf16  combine: rank d's partial sum for my token t
//                                        (sum over t's experts on d of w * y) lands in row t * world + d
//     cflags     [world] i32             combine: epoch, stored by rank d into [d] with
//                                        st.release.sys once all of d's pushes to me landed
//   local part
//     y          [E, C, hidden] bf16     combine input, filled by the caller
//     out        [T_max, hidden] bf16    combine result
//     counts     [E] i64, src_counts [E, world] i32, src_tokens [world] i32   written by the
//                                        dispatch receive phase
//     epochs     i32 [2]                 calls done (dispatch, combine): each kernel uses epoch + 1
//                                        and its last block stores it, so a replayed CUDA graph
//                                        advances them on the device
//     counters   u32 [4]                 blocks finished: 0 dispatch end, 1 combine pushes, 2 combine
//                                        end, 3 dispatch sends
//                                        (each reset by the last block)
//     dev_error  i32                     nonzero once any wait timed out: every spin loop bails
#pragma once

#include "common.cuh"

enum LlPhase { kPhaseLlDispatch = 5, kPhaseLlCombine = 6 };  // continue EpPhase (common.cuh)

struct LlParams {
  int t_max, capacity, experts, num_experts;  // capacity = world * t_max; experts = per rank
  size_t off_x, off_scales, off_pair, off_stage, off_sscales, off_cnt, off_dflags, off_tmap, off_tw, off_crows, off_cflags;
  uint16_t* y;
  uint16_t* out;
  long long* counts;
  int* src_counts;
  int* src_tokens;  // [world] tokens of each source in the last dispatch (from its dflags)
  int* epochs;
  unsigned* counters;
};

struct LlContext {
  EpContext* ep;  // region, device, peers and the timeout record, as in normal mode
  LlParams lp;
  int sm_count;  // read once here: launches may be captured into a CUDA graph
  size_t off_y, off_out, off_counts, off_src_counts, off_src_tokens, off_epochs, off_counters, off_dev_error;
};

__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Spins until the flag's epoch (high word) reaches `epoch`; returns the flag (0 on give-up).
__device__ __forceinline__ unsigned long long wait_epoch_u64(const EpParams& p, const unsigned long long* flag,
                                                             int epoch, int peer, int phase) {
  const unsigned long long start = globaltimer();
  while (true) {
    const unsigned long long v = ld_acquire_sys_u64(flag);
    if ((int)(v >> 32) - epoch >= 0) return v;
    if (ld_volatile(p.dev_error) != 0) return 0;
    if (globaltimer() - start > p.timeout_ns) {
      report_timeout(p.dev_error, p.host_error, p.rank, peer, phase);
      return 0;
    }
  }
}

// Every thread of every block calls it once its stores to peers are issued: each thread fences at
// system scope, the block counts itself done in `counter`, and the call returns true (in every
// thread) in the last block of the grid only, after a second fence, so that its release stores
// that follow order every block's stores before them. The last block resets the counter.
__device__ __forceinline__ bool ll_last_block(unsigned* counter) {
  __shared__ int last;
  fence_acq_rel_sys();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) atomicExch(counter, 0u);
  }
  __syncthreads();
  if (last) fence_acq_rel_sys();
  return last;
}

// Every thread of every block calls it last. The last block of the grid resets the block counter
// and stores `epoch` as the number of calls done, for the next launch (stream order makes it visible).
__device__ __forceinline__ void ll_finish_launch(unsigned* counter, int* epochs_slot, int epoch) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      atomicExch(counter, 0u);
      atomicExch(epochs_slot, epoch);
    }
  }
}

int ll_check_launch(const LlContext* ctx, int num_tokens, int num_sms, int warps);
