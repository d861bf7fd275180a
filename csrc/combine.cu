// Combine (pull): every rank reads its own tokens' rows back from the combine_in buffers of the
// ranks that received them, and reduces them in fp32 registers as they arrive; no staging
// buffer, no second pass, no weights on the wire (the source keeps its topk_weights).
//
// 1. Block 0, threads d < world: store ready[me] = epoch into rank d's signals
//    (st.release.sys): my caller has filled my combine_in, peers may pull from it.
// 2. Every block, threads s < world: wait until ready[s] == epoch in my signals.
// 3. Warp g of the grid takes tokens g, g + G, ... (G = all warps). For token t it reads the
//    rows of t on every rank (base[d] + slot_map[t][d], kept from the matching dispatch),
//    computes w(t, d) = sum of t's topk weights whose experts live on d (a warp reduction), then
//    streams the row in chunks of 32 * kU vectors: kMaxWorld * kU 16-byte loads in flight per
//    lane, fp32 fma, one bf16 16-byte store per vector into out[t].
// 4. grid_release_and_wait on pulled[]: the last block stores pulled[me] = epoch into every
//    rank and waits for every rank's pulled[] flag, so the call ends only when no peer still
//    reads my combine_in (the caller may overwrite it right after).
//
// combine_tma_kernel (v11, EP_COMBINE_TMA): the same contract and steps 1, 2 and 4; step 3 pulls with
// the SM's bulk-copy unit instead of register loads (linkbench v11: at 8 blocks bulk pulls from peers
// reach ~323 GB/s of egress, register pulls ~276). Work unit = (token, 4 KiB chunk of its row), the
// block's tokens blockIdx.x, + gridDim.x, ... A producer warp loads each unit's chunk from every holder's
// combine_in into one of S shared-memory stages (cp.async.bulk onto the stage's full mbarrier), up to S
// units ahead; two groups of four consumer warps take alternate units, sum the holders' chunks in fp32
// with w(t, d), store bf16 into out[t] and release the stage (empty mbarrier). Details at the kernel.
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

// Steps 1 and 2: tell every peer my combine_in is filled, wait until every peer's is.
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

template <int kMaxWorld, int kU>
__global__ void __launch_bounds__(512, 1) combine_pull_kernel(EpParams p, CombineArgs a, int epoch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int world = p.world, topk = p.topk, E = p.experts_per_rank;
  combine_ready(p, epoch);

  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int my_base = lane < world ? p.base[lane] : 0;
  const int V = p.hidden >> 3;  // 16-byte vectors per bf16 row
  const size_t row_bytes = (size_t)p.hidden * 2;
  const int total_warps = gridDim.x * nwarps;
  for (int t = blockIdx.x * nwarps + warp; !aborted && t < a.num_tokens; t += total_warps) {
    const int slot = lane < world ? p.slot_map[(size_t)t * world + lane] : -1;
    const int my_row = slot >= 0 ? my_base + slot : -1;
    long long e = -1;
    float w = 0.f;
    if (lane < topk) {
      e = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const int owner = (e >= 0 && e < (long long)world * E) ? (int)(e / E) : -1;
    int rows[kMaxWorld];
    float wd[kMaxWorld];
    const int4* src[kMaxWorld];
#pragma unroll
    for (int d = 0; d < kMaxWorld; ++d) {
      rows[d] = __shfl_sync(0xffffffffu, my_row, d);
      wd[d] = warp_sum(owner == d ? w : 0.f);
      src[d] = reinterpret_cast<const int4*>(p.peer_base[d < world ? d : 0] + p.off_combine_in +
                                             (size_t)(rows[d] >= 0 ? rows[d] : 0) * row_bytes);
    }
    uint4* dst = a.out + (size_t)t * V;
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      int4 buf[kMaxWorld][kU];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        if (rows[d] < 0) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = v0 + u * 32 + lane;
          if (i < V) buf[d][u] = ld_nc_v4(src[d] + i);
        }
      }
      float acc[kU][8];
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.f;
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        if (rows[d] < 0) continue;
#pragma unroll
        for (int u = 0; u < kU; ++u) fma_bf16x8(acc[u], buf[d][u], wd[d]);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = v0 + u * 32 + lane;
        if (i < V) {
          const int4 v = pack_bf16x8(acc[u]);
          dst[i] = make_uint4(v.x, v.y, v.z, v.w);
        }
      }
    }
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

constexpr int kCtChunk = 4096;                           // bytes of a row per work unit
constexpr int kCtGroups = 2, kCtGroupWarps = 4;          // consumer warps: groups take alternate units
constexpr int kCtGroupThreads = kCtGroupWarps * 32;      // threads of a group: kCtChunk / 16 / 128 vectors each
constexpr int kCtThreads = kCtGroups * kCtGroupThreads + 32;  // + one producer warp
constexpr int kCtMaxStages = 32;
constexpr int kCtTable = 4 * 32;  // token table: 4 batches of 32 tokens, refilled one batch ahead

// Shared memory of combine_tma_kernel: full / empty mbarriers (kCtMaxStages each), the token table (rows, then
// weights: kCtTable x world each), then the stages (world x kCtChunk each).
__host__ __device__ __forceinline__ size_t ct_header_bytes(int world) {
  return 2 * kCtMaxStages * 8 + ((size_t)kCtTable * world * 8 + 127) / 128 * 128;
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Producer (last warp): lane 0 streams unit j = (token k, chunk c) of this block's tokens (blockIdx.x +
// k * gridDim.x) into stage j % S: waits until the consumers have released the stage (empty[s]), then
// one bulk load per holder of the token onto full[s]. The whole warp refills the token table (rows on
// every rank, w(t, d); one lane per token) one batch of 32 tokens ahead.
// Consumers (kCtGroups groups of kCtGroupWarps warps): group g takes units g, g + kCtGroups, ...; each
// thread sums its kCtChunk / 16 / kCtGroupThreads vectors over the holders in fp32 and stores bf16 into
// out[t]; lane 0 of each warp then arrives on empty[s].
template <int kMaxWorld>
__global__ void __launch_bounds__(kCtThreads, 1) combine_tma_kernel(EpParams p, CombineArgs a, int epoch, int S) {
  extern __shared__ __align__(128) uint8_t ct_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int world = p.world, topk = p.topk, E = p.experts_per_rank;
  uint64_t* full = reinterpret_cast<uint64_t*>(ct_smem);
  uint64_t* empty = full + kCtMaxStages;
  int* trow = reinterpret_cast<int*>(ct_smem + 2 * kCtMaxStages * 8);  // [kCtTable][world]
  float* tw = reinterpret_cast<float*>(trow + kCtTable * world);        // [kCtTable][world]
  uint8_t* stages = ct_smem + ct_header_bytes(world);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, kCtGroupWarps);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  combine_ready(p, epoch);  // ends with __syncthreads: the barriers are initialised for everyone

  const int row_bytes = p.hidden * 2;
  const int nch = (row_bytes + kCtChunk - 1) / kCtChunk;
  const int T = a.num_tokens, B = gridDim.x, b0 = blockIdx.x;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  const int ntok = (!aborted && b0 < T) ? (T - b0 + B - 1) / B : 0;  // tokens b0 + k * B, k < ntok
  const long long nunits = (long long)ntok * nch;

  if (warp == kCtGroups * kCtGroupWarps) {  // producer
    auto fill = [&](int b) {  // batch b: tokens 32b .. 32b + 31, one per lane
      const int k = 32 * b + lane;
      if (k >= ntok) return;
      const int t = b0 + k * B;
      int* rr = trow + ((b & 3) * 32 + lane) * world;
      float* ww = tw + ((b & 3) * 32 + lane) * world;
      float wd[EP_MAX_WORLD];
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) wd[d] = 0.f;
      for (int kk = 0; kk < topk; ++kk) {
        const long long e = a.topk_idx[(size_t)t * topk + kk];
        const float w = a.topk_w[(size_t)t * topk + kk];
        const int owner = (e >= 0 && e < (long long)world * E) ? (int)(e / E) : -1;
#pragma unroll
        for (int d = 0; d < EP_MAX_WORLD; ++d) wd[d] += owner == d ? w : 0.f;
      }
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (d >= world) break;
        const int slot = p.slot_map[(size_t)t * world + d];
        rr[d] = slot >= 0 ? p.base[d] + slot : -1;
        ww[d] = wd[d];
      }
    };
    if (ntok > 0) fill(0);
    __syncwarp();
    for (long long j = 0; j < nunits; ++j) {
      const int k = (int)(j / nch), c = (int)(j % nch), s = (int)(j % S);
      if (c == 0 && (k & 31) == 0) {
        // batch k / 32 + 1 goes where batch k / 32 - 3 was: the consumers are at most S <= 32 units behind
        if (k + 32 < ntok) fill(k / 32 + 1);
        __syncwarp();
      }
      if (lane == 0) {
        if (j >= S) mbar_wait(empty + s, (uint32_t)((j / S - 1) & 1));
        const int* rr = trow + (((k >> 5) & 3) * 32 + (k & 31)) * world;
        const uint32_t bytes = (uint32_t)min(kCtChunk, row_bytes - c * kCtChunk);
        uint32_t total = 0;
        for (int d = 0; d < world; ++d) total += rr[d] >= 0 ? bytes : 0u;
        mbar_expect_tx(full + s, total);  // release: the table entries written above come with it
        for (int d = 0; d < world; ++d) {
          if (rr[d] < 0) continue;
          bulk_load(stages + ((size_t)s * world + d) * kCtChunk,
                    p.peer_base[d] + p.off_combine_in + (size_t)rr[d] * row_bytes + (size_t)c * kCtChunk, bytes,
                    full + s);
        }
      }
      __syncwarp();
    }
  } else {  // consumers
    const int grp = warp / kCtGroupWarps, gt = threadIdx.x - grp * kCtGroupThreads;
    constexpr int kVec = kCtChunk / 16 / kCtGroupThreads;  // vectors per thread and unit
    for (long long j = grp; j < nunits; j += kCtGroups) {
      const int k = (int)(j / nch), c = (int)(j % nch), s = (int)(j % S);
      mbar_wait(full + s, (uint32_t)((j / S) & 1));
      const int* rr = trow + (((k >> 5) & 3) * 32 + (k & 31)) * world;
      const float* ww = tw + (((k >> 5) & 3) * 32 + (k & 31)) * world;
      const int nv = min(kCtChunk, row_bytes - c * kCtChunk) >> 4;
      bool have[kMaxWorld];
      float wd[kMaxWorld];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d) {
        have[d] = d < world && rr[d] >= 0;
        wd[d] = d < world ? ww[d] : 0.f;
      }
      int4 x[kMaxWorld][kVec];
#pragma unroll
      for (int d = 0; d < kMaxWorld; ++d)
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          const int v = gt + kCtGroupThreads * u;
          if (have[d] && v < nv) x[d][u] = reinterpret_cast<const int4*>(stages + ((size_t)s * world + d) * kCtChunk)[v];
        }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);  // the stage is read (the values are in registers)
      const int t = b0 + k * B;
      uint4* dst = a.out + (size_t)t * (row_bytes >> 4) + (size_t)c * (kCtChunk >> 4);
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const int v = gt + kCtGroupThreads * u;
        if (v >= nv) continue;
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = 0.f;
#pragma unroll
        for (int d = 0; d < kMaxWorld; ++d)
          if (have[d]) fma_bf16x8(acc, x[d][u], wd[d]);
        const int4 o = pack_bf16x8(acc);
        dst[v] = make_uint4(o.x, o.y, o.z, o.w);
      }
    }
  }
  grid_release_and_wait(p, kCounterCombine, p.sig.pulled_off, epoch, kPhaseCombineDone);
}

template <int kMaxWorld, int kU>
int launch_combine(const EpParams& p, const CombineArgs& a, int num_sms, int warps, int epoch, cudaStream_t stream) {
  combine_pull_kernel<kMaxWorld, kU><<<num_sms, warps * 32, 0, stream>>>(p, a, epoch);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace

extern "C" int ep_combine(void* vctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens,
                          int num_sms, int warps, int epoch, void* vstream) {
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
  if (num_sms < 1 || warps < 1 || warps > 16) {
    ep_set_error("num_sms must be >= 1 and warps 1..16 (got %d, %d)", num_sms, warps);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  CombineArgs a;
  a.out = (uint4*)out;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  if (ctx->combine_impl == EP_COMBINE_TMA) {
    // stages: as many as fit (at most kCtMaxStages), or ctx->combine_stages when set and smaller
    const size_t hdr = ct_header_bytes(p.world), stage = (size_t)p.world * kCtChunk;
    int S = (int)std::min<size_t>(kCtMaxStages, ((size_t)ctx->max_smem_optin - hdr) / stage);
    if (ctx->combine_stages > 0) S = std::min(S, ctx->combine_stages);
    if (S >= 2) {
      const size_t smem = hdr + (size_t)S * stage;
      auto kernel = p.world <= 4 ? combine_tma_kernel<4> : combine_tma_kernel<8>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      kernel<<<num_sms, kCtThreads, smem, stream>>>(p, a, epoch, S);
      CUDA_CHECK(cudaGetLastError());
      return 0;
    }
    // fewer than two stages fit: the register pull below
  }
  if (p.world <= 2) return launch_combine<2, 4>(p, a, num_sms, warps, epoch, stream);
  if (p.world <= 4) return launch_combine<4, 4>(p, a, num_sms, warps, epoch, stream);
  return launch_combine<8, 2>(p, a, num_sms, warps, epoch, stream);
}
