// Plain SM-store ceiling: the fastest that `num_blocks` SMs move a rank's all-to-all bytes into
// its peers' buffers with ordinary 16-byte stores (no layout, no flags, no verification). Used by
// epbench/ceiling.py so every result can show its percent of what SM-driven copies reach at the
// same SM count.
//
// Grid: num_blocks blocks (one per SM) x `threads` threads, the pattern of the link
// micro-benchmark's fastest mode (csrc/bench.cu, mode 4 `push`): the work unit is a 4 KiB chunk
// (32 lanes x kUnroll 16-byte vectors, all loads in flight before the stores), and consecutive
// units go to different destinations (unit u -> destination u % ndst, chunk u / ndst), so every
// link is busy all the time and each warp's stores spread over all peers. Tail bytes past the last
// full 16-byte vector are not copied (rows are multiples of 16 bytes for bf16; fp8 rows lose
// < 16 bytes per peer).
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kMaxDst = EP_MAX_WORLD;
constexpr int kUnroll = 8;
constexpr int kChunk = 32 * kUnroll;  // vectors per unit

struct StoreCeilingArgs {
  int4* dst[kMaxDst];
  long long vecs[kMaxDst];  // 16-byte vectors to write into dst[d]
  const int4* src;
  int ndst;
};

__global__ void store_ceiling_kernel(StoreCeilingArgs a, long long max_chunks) {
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const long long units = max_chunks * a.ndst;
  for (long long u = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < units; u += warps) {
    const int d = (int)(u % a.ndst);
    const long long base = (u / a.ndst) * kChunk, n = a.vecs[d];
    if (base >= n) continue;
    int4* dst = a.dst[d];
    int4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < n) v[k] = ld_nc_v4(a.src + i);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < n) st_v4(dst + i, v[k]);
    }
  }
}

}  // namespace

extern "C" int ep_store_ceiling(const unsigned long long* dst_ptrs, const long long* bytes, int ndst,
                                const void* src, int num_blocks, int threads, void* stream) {
  if (ndst < 0 || ndst > kMaxDst || num_blocks < 1 || threads < 32 || threads > 1024 ||
      ((uintptr_t)src & 15)) {
    ep_set_error("ep_store_ceiling: bad arguments (ndst %d, blocks %d, threads %d)", ndst, num_blocks,
                 threads);
    return -1;
  }
  StoreCeilingArgs a = {};
  long long max_chunks = 0;
  a.src = static_cast<const int4*>(src);
  a.ndst = ndst;
  for (int d = 0; d < ndst; ++d) {
    if (dst_ptrs[d] & 15) {
      ep_set_error("ep_store_ceiling: destination %d is not 16-byte aligned", d);
      return -1;
    }
    a.dst[d] = reinterpret_cast<int4*>(dst_ptrs[d]);
    a.vecs[d] = bytes[d] / 16;
    max_chunks = a.vecs[d] / kChunk + 1 > max_chunks ? a.vecs[d] / kChunk + 1 : max_chunks;
  }
  if (ndst == 0) return 0;
  store_ceiling_kernel<<<num_blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(a, max_chunks);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

// Local-sum ceiling (the combine's SM side): out[t] = the fp32 sum of token t's rows, stored bf16, every row in
// this GPU's memory. What a combine that sums on `num_blocks` SMs cannot beat for these rows, whoever moved them
// across the link. `rows_in` rows for `rows_out` tokens (a rank's (token, rank) copies of its own tokens, its own
// included): token t sums rows_in / rows_out rows, one more for the first rows_in % rows_out tokens; its row j is
// row j * rows_out + t of src ([ceil(rows_in / rows_out)][rows_out][hidden] bf16). A warp per token.
namespace {

// kU vectors of each of kR rows a lane, all loaded before their adds; rows n > kR in further passes (acc kept).
template <int kR, int kU>
__device__ __forceinline__ void sum_rows(uint4* out, const int4* src, int rows_out, int t, int n, int V, int lane) {
  for (int v0 = 0; v0 < V; v0 += 32 * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
    for (int j = 0; j < n; j += kR) {
      int4 x[kR][kU];
#pragma unroll
      for (int h = 0; h < kR; ++h)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int v = v0 + u * 32 + lane;
          if (j + h < n && v < V) x[h][u] = ld_nc_v4(src + ((size_t)(j + h) * rows_out + t) * V + v);
        }
#pragma unroll
      for (int h = 0; h < kR; ++h)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (j + h < n && v0 + u * 32 + lane < V) fma_bf16x8(acc[u], x[h][u], 1.f);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v >= V) continue;
      const int4 o = pack_bf16x8(acc[u]);
      out[(size_t)t * V + v] = make_uint4(o.x, o.y, o.z, o.w);
    }
  }
}

// Tokens of at most kR rows (2: 2 ranks), one pass: kU vectors of each row a lane in flight, each vector summed and
// stored right after (no accumulators kept across rows). At 2 rows it runs well below its loads and stores timed
// apart (one H200, 4 SMs: 429 against 566 us, python -m epbench.smmem, 2026-11-27); taken for up to 4 rows it ran
// exactly as sum_rows' passes (855 / 904 us at 3 / 4 rows), so those stay with sum_rows and the bulk shape.
template <int kR, int kU>
__device__ __forceinline__ void sum_group(uint4* out, const int4* src, int rows_out, int t, int n, int V, int lane) {
  for (int v0 = 0; v0 < V; v0 += 32 * kU) {
    int4 x[kR][kU];
#pragma unroll
    for (int h = 0; h < kR; ++h)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = v0 + u * 32 + lane;
        if (h < n && v < V) x[h][u] = ld_nc_v4(src + ((size_t)h * rows_out + t) * V + v);
      }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = v0 + u * 32 + lane;
      if (v >= V) continue;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int h = 0; h < kR; ++h)
        if (h < n) fma_bf16x8(acc, x[h][u], 1.f);
      const int4 o = pack_bf16x8(acc);
      out[(size_t)t * V + v] = make_uint4(o.x, o.y, o.z, o.w);
    }
  }
}

// The register shapes of the sum (the third, sum_bulk_kernel, below), timed apart by the caller (epbench/ceiling.py
// keeps the fastest): 512 threads with
// 16 vectors a lane in flight (kRows 2: 8 of both rows; any: sum_rows' 2 rows x 4 vectors a pass), 128 KiB of
// loads a SM (64 KiB for any); 256 threads with twice the vectors a lane (any: 4 rows x 7 vectors, about what one
// block's registers hold unspilled; 4 x 8 spills). kRows: the most rows a token has (2, or 0 for more: sum_rows'
// passes). One kernel per (kRows, kDeep), as one kernel for every row count spilled at 512 threads.
template <int kRows, bool kDeep>
__global__ void __launch_bounds__(kDeep ? 256 : 512, 1) sum_ceiling_kernel(uint4* out, const int4* src,
                                                                          int rows_out, long long rows_in, int V) {
  const int lane = threadIdx.x & 31;
  const int G = gridDim.x * (blockDim.x >> 5);
  const int base = (int)(rows_in / rows_out), extra = (int)(rows_in % rows_out);
  for (int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < rows_out; t += G) {
    const int n = base + (t < extra ? 1 : 0);
    if (kRows == 2)
      sum_group<2, kDeep ? 16 : 8>(out, src, rows_out, t, n, V, lane);
    else
      sum_rows<kDeep ? 4 : 2, kDeep ? 7 : 4>(out, src, rows_out, t, n, V, lane);
  }
}

// The third shape of the local sum (threads == kBsThreads; tokens of at most kBsMaxRows rows): the same sum, the
// same bits, with the rows brought into shared memory by TMA bulk copies, in kBsPairs groups of a loading warp and
// kBsSummers summing warps a block: loader l brings units l, l + kBsPairs, ... (a unit: one kBsPiece piece of each
// of a token's n rows, lane h < n issuing row h's) into its 2 stages in turn, its summers sum them from shared
// memory (summer s: vectors lane + 32 (s + kBsSummers i) of the piece), store them and free the stage (the stage's
// empty barrier counts kBsSummers arrivals). Why so: a warp's bulk copies run one after another (~35-40 GB/s), a
// SM took in ~180 GB/s only from >= 4 warps at once, 8 warps summing one stage together waited on every stage in
// turn, and against one summer a loader, 3 summers took 654 -> 619 us at 4 rows and 4 SMs; more stages of smaller
// pieces, fewer pairs of bigger ones, TMA stores and preloaded vectors were all slower or no faster (python -m
// epbench.smmem, 2026-11-27; notes/LATENCY-NEXT.md). Block b takes tokens b, b + gridDim.x, ...
constexpr int kBsPiece = 3584;  // bytes of a row piece: a quarter of a 7168-wide bf16 row, 7 vectors a lane
constexpr int kBsMaxRows = 4;
constexpr int kBsPairs = 7;     // 7 loaders x 2 stages x 4 rows x 3.5 KiB = 196 KiB of shared memory a block
constexpr int kBsSummers = 3;   // summing warps a loader
constexpr int kBsThreads = kBsPairs * 32 * (1 + kBsSummers);
constexpr size_t kBsSmem = (size_t)kBsPairs * 2 * kBsMaxRows * kBsPiece;
// Tokens of at most 2 rows: stages of 2 pieces, 4 a pair, in the same shared memory (the combine's bulk pull at 2
// ranks, csrc/combine.cu kCbStages2, went 319 -> 236 us at 8 SMs so).
constexpr int kBsRows2 = 2;
constexpr int kBsStages2 = 4;
static_assert(kBsRows2 * kBsStages2 == kBsMaxRows * 2, "both shapes fill kBsSmem");

// One piece of a token's kN rows in shared memory (row h at x0 + h * kBsPiece / 16): summer s's share, vectors
// lane + 32 (s + kBsSummers i), summed and stored; kRead (`bulk read`): the same loads, XOR-folded into *fold instead
// (dst unused).
template <int kN, bool kRead>
__device__ __forceinline__ void sum_piece(uint4* dst, const int4* x0, int nv, int lane, int s, int* fold) {
#pragma unroll
  for (int i = 0; i < ((kBsPiece >> 4) + 32 * kBsSummers - 1) / (32 * kBsSummers); ++i) {
    const int v = lane + 32 * (s + kBsSummers * i);
    if (v >= nv) break;
    int4 x[kN];
#pragma unroll
    for (int h = 0; h < kN; ++h) x[h] = x0[h * (kBsPiece >> 4) + v];
    if (kRead) {
#pragma unroll
      for (int h = 0; h < kN; ++h) *fold ^= x[h].x ^ x[h].y ^ x[h].z ^ x[h].w;
      continue;
    }
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int h = 0; h < kN; ++h) fma_bf16x8(acc, x[h], 1.f);
    const int4 o = pack_bf16x8(acc);
    dst[v] = make_uint4(o.x, o.y, o.z, o.w);
  }
}

// kRead (python -m epbench.smmem's `bulk read`): the same loaders, stages and summers' reads of shared memory (as
// the sum issues them), but no sum and no stores: each summer lane XOR-folds every vector it reads, and each summer
// warp folds its lanes into out's word of the block (out an int array then, zeroed by the block first). What the
// pipeline costs without the summers' arithmetic and global stores: whether a SM's shared memory, written by the
// bulk copies and read by the summers, is what bounds the sum. kR pieces a stage (at least a token's rows), kS
// stages a pair.
template <bool kRead = false, int kR = kBsMaxRows, int kS = 2>
__global__ void __launch_bounds__(kBsThreads, 1) sum_bulk_kernel(uint4* out, const char* src, int rows_out,
                                                                  long long rows_in, int row_bytes) {
  extern __shared__ __align__(128) char ring[];
  __shared__ uint64_t full[kBsPairs * kS], empty[kBsPairs * kS];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int l = w % kBsPairs, sw = w < kBsPairs ? 0 : (w - kBsPairs) / kBsPairs;  // the pair; a summer's share
  const int base = (int)(rows_in / rows_out), extra = (int)(rows_in % rows_out);
  const int pieces = (row_bytes + kBsPiece - 1) / kBsPiece, V = row_bytes >> 4;
  const int ntok = blockIdx.x < rows_out ? (rows_out - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const long long units = (long long)ntok * pieces;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kBsPairs * kS; ++s) mbar_init(full + s, 1), mbar_init(empty + s, kBsSummers);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (kRead) reinterpret_cast<int*>(out)[blockIdx.x] = 0;
  }
  __syncthreads();
  const bool loader = w < kBsPairs;
  int fold = 0;    // kRead: the summer lane's XOR of every word it read
  uint32_t j = 0;  // the pair's units so far: stage j % kS, lap j / kS
  for (long long u = l; u < units; u += kBsPairs, ++j) {
    const int t = blockIdx.x + (int)(u / pieces) * gridDim.x, q = (int)(u % pieces);
    const int bytes = min(kBsPiece, row_bytes - q * kBsPiece);
    const int k = base + (t < extra ? 1 : 0);  // the token's rows
    const int st = l * kS + (int)(j % kS);
    const uint32_t lap = j / kS;
    char* stage = ring + (size_t)st * kR * kBsPiece;
    if (loader) {
      ring_stage_arm(full, empty, st, lap, lane, (uint32_t)(k * bytes));  // after the summers freed its last unit
      if (lane < k)
        bulk_load(stage + (size_t)lane * kBsPiece, src + ((size_t)lane * rows_out + t) * row_bytes + (size_t)q * kBsPiece,
                  (uint32_t)bytes, full + st);
      __syncwarp();
      continue;
    }
    mbar_wait(full + st, lap & 1u);
    const int4* x0 = reinterpret_cast<const int4*>(stage);
    uint4* dst = out + (size_t)t * V + (size_t)q * (kBsPiece >> 4);
    const int nv = bytes >> 4;
    switch (k) {  // the row count a constant in the loop (with k per token in it: 790 / 862 us at 3 / 4 rows, 4 SMs)
      case 1: sum_piece<1, kRead>(dst, x0, nv, lane, sw, &fold); break;
      case 2: sum_piece<2, kRead>(dst, x0, nv, lane, sw, &fold); break;
      case 3: sum_piece<3, kRead>(dst, x0, nv, lane, sw, &fold); break;
      default: sum_piece<4, kRead>(dst, x0, nv, lane, sw, &fold); break;
    }
    __syncwarp();  // the warp's reads of the stage are done (their values consumed) before it is freed
    if (lane == 0) mbar_arrive(empty + st);
  }
  if (kRead && !loader) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) fold ^= __shfl_xor_sync(0xffffffffu, fold, o);
    if (lane == 0) atomicXor(reinterpret_cast<int*>(out) + blockIdx.x, fold);
  }
}

// sum_bulk_kernel<kRead> on `blocks` SMs in the shape for tokens of at most `most` rows (<= kBsMaxRows): 0, or -1
// with the error set.
template <bool kRead>
int launch_sum_bulk(uint4* out, const char* src, int rows_out, long long rows_in, int row_bytes, long long most,
                     int blocks, cudaStream_t stream) {
  auto kernel = most <= kBsRows2 ? sum_bulk_kernel<kRead, kBsRows2, kBsStages2> : sum_bulk_kernel<kRead>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kBsSmem));
  kernel<<<blocks, kBsThreads, kBsSmem, stream>>>(out, src, rows_out, rows_in, row_bytes);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace

extern "C" int ep_sum_ceiling(void* out, const void* src, int rows_out, long long rows_in, int hidden, int num_blocks,
                              int threads, void* stream) {
  if (rows_out < 0 || rows_in < rows_out || hidden % 8 != 0 || num_blocks < 1 || threads < 32 ||
      (threads > 512 && threads != kBsThreads) ||
      ((uintptr_t)src & 15) || ((uintptr_t)out & 15)) {
    ep_set_error("ep_sum_ceiling: bad arguments (rows %d <- %lld, hidden %d, blocks %d, threads %d)", rows_out,
                 rows_in, hidden, num_blocks, threads);
    return -1;
  }
  if (rows_out == 0) return 0;
  const long long most = (rows_in + rows_out - 1) / rows_out;  // the most rows a token has
  if (threads == kBsThreads) {  // the bulk-copy shape
    if (most > kBsMaxRows) {
      ep_set_error("ep_sum_ceiling: the bulk-copy shape takes at most %d rows a token, got %lld", kBsMaxRows, most);
      return -1;
    }
    return launch_sum_bulk<false>(static_cast<uint4*>(out), static_cast<const char*>(src), rows_out, rows_in,
                                  hidden * 2, most, num_blocks, static_cast<cudaStream_t>(stream));
  }
  const bool deep = threads <= 256;                              // the 256-thread shape: twice the loads in flight
  auto kernel = most <= 2 ? (deep ? sum_ceiling_kernel<2, true> : sum_ceiling_kernel<2, false>)
                          : (deep ? sum_ceiling_kernel<0, true> : sum_ceiling_kernel<0, false>);
  kernel<<<num_blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint4*>(out), static_cast<const int4*>(src), rows_out, rows_in, hidden / 8);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

// What num_blocks SMs move through this GPU's own memory (no link), one block per SM, in three ways; the local-sum
// kernel's shapes above are the others (k rows in, one out). The rows are those of the sum: token t's row j is row
// j * rows_out + t of src ([k][rows_out][hidden] bf16), a warp (for bulk loads: an issuing warp) per token.
//   EP_SM_LOAD       16-byte register loads, 16 vectors a lane in flight (128 KiB a SM at 512 threads); each
//                    token's k rows folded by XOR into words[t]: the loads cannot be dropped, the result checked.
//   EP_SM_BULK_LOAD  TMA bulk copies of 7 KiB pieces into a ring of shared memory (kBulkStages x 7 KiB in flight a
//                    SM) issued by lane 0 of each of threads / 32 warps, each with its share of the ring; the first
//                    word of each piece folded into words[issuer].
//   EP_SM_STORE      16-byte register stores of one row per token into out, vector v of row t = (t, v, t ^ v, 1).
namespace {

enum SmMemMode {
  EP_SM_LOAD = 0,
  EP_SM_BULK_LOAD = 1,
  EP_SM_STORE = 2,
  EP_SM_BULK_READ = 3,  // sum_bulk_kernel<true>: threads must be kBsThreads, k <= kBsMaxRows; a word a block
};
constexpr int kLoadU = 16;
constexpr int kBulkPiece = 7168;  // bytes of one bulk copy (half a 7168-wide bf16 row)
constexpr int kBulkStages = 28;   // 196 KiB of shared memory a block

__global__ void __launch_bounds__(512, 1) sm_load_kernel(int* words, const int4* src, int rows_out, int k, int V) {
  const int lane = threadIdx.x & 31;
  const int G = gridDim.x * (blockDim.x >> 5);
  const long long n = (long long)k * V;  // the token's vectors, row after row
  for (int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < rows_out; t += G) {
    int fold = 0;
    int j = 0, c = lane;  // row and vector of the lane's next load (a step of 32 wraps into the next row at most once)
    for (long long i0 = 0; i0 < n; i0 += 32 * kLoadU) {
      int4 x[kLoadU];
      bool got[kLoadU];
#pragma unroll
      for (int u = 0; u < kLoadU; ++u) {
        got[u] = j < k;
        if (got[u]) x[u] = ld_nc_v4(src + ((size_t)j * rows_out + t) * V + c);
        c += 32;
        if (c >= V) c -= V, ++j;
      }
#pragma unroll
      for (int u = 0; u < kLoadU; ++u)
        if (got[u]) fold ^= x[u].x ^ x[u].y ^ x[u].z ^ x[u].w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) fold ^= __shfl_xor_sync(0xffffffffu, fold, o);
    if (lane == 0) words[t] = fold;
  }
}

// W = blockDim.x / 32 issuers a block (lane 0 of each warp), each with its own kBulkStages / W stages of the ring and
// its own tokens (issuer g = block * W + warp takes tokens g, g + gridDim.x * W, ...; its fold into words[g]).
__global__ void __launch_bounds__(kBulkStages * 32, 1) sm_bulk_load_kernel(int* words, const char* src, int rows_out,
                                                                          int k, int row_bytes) {
  extern __shared__ __align__(128) char ring_all[];
  __shared__ uint64_t bars_all[kBulkStages];
  const int W = blockDim.x >> 5, w = threadIdx.x >> 5, S = kBulkStages / W;
  if ((threadIdx.x & 31) != 0) return;
  char* ring = ring_all + (size_t)w * S * kBulkPiece;
  uint64_t* bars = bars_all + w * S;
  for (int s = 0; s < S; ++s) mbar_init(bars + s, 1);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int pieces = (row_bytes + kBulkPiece - 1) / kBulkPiece;
  const int g = blockIdx.x * W + w, G = gridDim.x * W;
  int fold = 0;
  int s = 0, filled = 0;  // the next piece's stage; stages holding a piece in flight (up to S)
  uint32_t phase = 0;     // parity of stage s's next completion (flips after each wrap of s)
  for (int t = g; t < rows_out; t += G)
    for (int j = 0; j < k; ++j)
      for (int q = 0; q < pieces; ++q) {
        if (filled == S) {  // the stage's previous piece: landed before its slot is reused
          mbar_wait(bars + s, phase ^ 1u);
          // Read by this thread, then written by its next bulk copy without a proxy fence between (a fence here
          // would be timed too): the copy's data comes back from global memory long after this load has
          // returned, and a fold read late would fail the host's check (python -m epbench.smmem: WRONG).
          fold ^= *reinterpret_cast<const int*>(ring + (size_t)s * kBulkPiece);
        } else {
          ++filled;
        }
        const uint32_t bytes = (uint32_t)min(kBulkPiece, row_bytes - q * kBulkPiece);
        mbar_expect_tx(bars + s, bytes);
        bulk_load(ring + (size_t)s * kBulkPiece, src + ((size_t)j * rows_out + t) * row_bytes + (size_t)q * kBulkPiece,
                  bytes, bars + s);
        if (++s == S) s = 0, phase ^= 1u;
      }
  for (int d = 0; d < filled; ++d) {  // the last `filled` pieces, oldest first
    const int st = (s - filled + d + S) % S;
    mbar_wait(bars + st, st < s ? phase : phase ^ 1u);  // issued in this lap of the ring, or the one before
    fold ^= *reinterpret_cast<const int*>(ring + (size_t)st * kBulkPiece);
  }
  words[g] = fold;
}

__global__ void __launch_bounds__(512, 1) sm_store_kernel(int4* out, int rows_out, int V) {
  const int lane = threadIdx.x & 31;
  const int G = gridDim.x * (blockDim.x >> 5);
  for (int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); t < rows_out; t += G)
    for (int v = lane; v < V; v += 32) st_v4(out + (size_t)t * V + v, make_int4(t, v, t ^ v, 1));
}

}  // namespace

extern "C" int ep_sm_mem(int mode, void* out, const void* src, int rows_out, int k, int hidden, int num_blocks,
                         int threads, void* stream) {
  const bool bulk_read = mode == EP_SM_BULK_READ;
  if (mode < EP_SM_LOAD || mode > EP_SM_BULK_READ || rows_out < 1 || k < 1 || hidden % 8 != 0 || hidden < 256 ||
      num_blocks < 1 || threads < 32 || (threads > 512 && !bulk_read) || threads % 32 != 0 ||
      (bulk_read && (threads != kBsThreads || k > kBsMaxRows)) || ((uintptr_t)src & 15) || ((uintptr_t)out & 15)) {
    ep_set_error("ep_sm_mem: bad arguments (mode %d, rows %d x %d, hidden %d, blocks %d, threads %d)", mode, rows_out,
                 k, hidden, num_blocks, threads);
    return -1;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (mode == EP_SM_LOAD) {
    sm_load_kernel<<<num_blocks, threads, 0, s>>>(static_cast<int*>(out), static_cast<const int4*>(src), rows_out, k,
                                                  hidden / 8);
  } else if (mode == EP_SM_BULK_LOAD) {
    const size_t smem = (size_t)kBulkStages * kBulkPiece;
    CUDA_CHECK(cudaFuncSetAttribute(sm_bulk_load_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (kBulkStages % (threads / 32) != 0) {
      ep_set_error("ep_sm_mem: bulk loads take 1, 2, 4, 7 or 14 issuing warps a block, got %d threads", threads);
      return -1;
    }
    sm_bulk_load_kernel<<<num_blocks, threads, smem, s>>>(static_cast<int*>(out), static_cast<const char*>(src), rows_out,
                                                     k, hidden * 2);
  } else if (bulk_read) {
    if (launch_sum_bulk<true>(static_cast<uint4*>(out), static_cast<const char*>(src), rows_out,
                              (long long)k * rows_out, hidden * 2, k, num_blocks, s) != 0)
      return -1;
  } else {
    sm_store_kernel<<<num_blocks, threads, 0, s>>>(static_cast<int4*>(out), rows_out, hidden / 8);
  }
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
