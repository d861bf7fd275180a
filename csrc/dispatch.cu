// Dispatch: after the notify kernel (notify.cu) has produced slot_map and base, num_sms blocks
// push every token row once to every rank that holds one of its experts, straight into that
// rank's recv buffers (row base[d] + slot_map[t][d]), then signal completion.
//
// One kernel, dispatch_lean_kernel, in the two forms measured to win (notes/KERNELS.md):
//   lean (EP_DISPATCH_LEAN): warp w of block b is global warp g = b * warps + w and copies tokens
//     g, g + G, g + 2G, ... (G = all warps of the grid): blocks never wait on each other.
//   lean_dyn (EP_DISPATCH_LEAN_DYN, default): lane 0 of each warp takes its next token from a counter,
//     one token ahead, so blocks on faster SMs take more tokens.
// Per token every lane issues its loads first (kU 16-byte vectors of the row, the slot_map row, topk ids,
// weights, the first 64 scale words or bytes), then stores the same registers to every destination row and
// the metadata after it. 16 warps: kU = 8; 17..32 warps: kU = 4 (the same bytes in flight per SM).
// Scales (fp8: f32 per 128 elements, mxfp8: one E8M0 byte per 32) move as 32-bit words when the caller's
// scale rows allow it, else byte by byte.
//
// quantize fused (kFused, mxfp8 only): the source rows are bf16 and each lane casts its 16-byte vector
// (8 elements) in registers before the stores (mxfp8_cast): lanes 4b .. 4b + 3 of a vector group hold
// one 32-element block, the block's amax comes from two xor-shuffles; the link carries 8 e4m3 bytes per
// lane and, from lane 0, the 8 scale bytes of the warp's 8 blocks in one 8-byte store. fused_stores 16
// (quantize_fused 2): a lane holds two adjacent vectors (lanes 2b, 2b + 1 one block, one xor-shuffle) and
// stores 16 e4m3 bytes; lane 0 the 16 scale bytes of the warp's 16 blocks: half the store instructions.
// expert-major (kEm, align >= 1): the notify kernel left em_base[g] (my first slot for global expert g on its
// owner) and em_ord[t][k] (t's ordinal among my tokens routed to topk_idx[t][k]), so lane k knows the slot
// of (t, k) on the owner. A row still crosses to each destination once, into the slot of its first expert
// there; the rank-major metadata (ids, weights) goes to its rank-major row as before, with em_slot (the
// slot of each k on that rank, -1 elsewhere) beside it. After the completion wait below, every block of the
// receiver copies each received row with several of its experts from its first slot into the others
// (em_local_copies): rows land once on the link, the extra copies are local loads and stores in this kernel.
// The blocks wait for the last one (em_go) before copying, so all num_sms blocks must be resident at once.
// em_sms > 0 (ep_set_option EP_OPT_EM_SMS, kEm 4): no copy pass here; em_expand_kernel copies on em_sms blocks
// right after this kernel on the stream (its last block returned only after every source's done flag).
// em_push 1 (sender): the sending warp stores each row into every slot of it on each destination (more[d]: the
// further experts of the token there), the link carrying it once per (token, expert); no copy pass, no em_go.
// own_rows ce (p.own_ce, rank-major, quantize before): my own rows are not stored here (lane me's row is -1:
// the caller's copy engine put x, scales, ids and weights at rows [0, T) of my buffers); every row sent to a
// peer also gets its key (me << 32 | t) in the peer's recv_key, from lane 0 beside the ids and weights.
// own_rows all (p.own_ce == 2): no kernel moves a row. After the notify kernel (which proves every peer is done
// with my segment of its buffers from the previous call) ep_dispatch copies x (and x_scales) into my segment of
// every peer with the copy engine, on one stream forked from the caller's stream and joined again, the peers in
// ring order, and my own rows into my own segment on a second stream; ce_meta_kernel meanwhile stores topk_idx,
// topk_w and the keys of my whole segment on every rank (mine included); then ce_release_kernel releases done[me]
// as below. The copies and the meta kernel complete before it starts (stream order), so a peer that sees done[me]
// sees my rows. ce_share < 100 (EP_OPT_CE_SHARE): the copy engines move only x rows [0, first),
// first = T x share / 100, and ce_tail_kernel on the caller's stream stores rows [first, T) into every peer at
// the same time (scales still all by copy engine).
// Completion (grid_release_and_wait in common.cuh): every thread fences at system scope; the
// last block to finish stores done[me] = epoch into every rank's signals with st.release.sys,
// then waits until done[s] == epoch for every source s in my signals, so the kernel ends only
// when every row addressed to this rank has landed.
#include <cuda_fp8.h>

#include "common.cuh"

namespace {

struct DispatchArgs {
  const uint8_t* x;         // [T, hidden * 2] bf16 when fused, else [T, row_bytes]
  const uint8_t* x_scales;  // [T, scale_bytes] (fp8, mxfp8 before); null otherwise
  const int64_t* topk_idx;
  const float* topk_w;
  int num_tokens;
  int scale_unit;  // 4: scales move as 32-bit words; 1: as bytes (a row of scales not a whole number of words)
};

__device__ __forceinline__ uint32_t ld_scale(const uint8_t* row, int j, int unit) {
  return unit == 4 ? reinterpret_cast<const uint32_t*>(row)[j] : row[j];
}

__device__ __forceinline__ void st_scale(uint8_t* row, int j, int unit, uint32_t v) {
  if (unit == 4) {
    reinterpret_cast<uint32_t*>(row)[j] = v;
  } else {
    row[j] = (uint8_t)v;
  }
}

// 8 bf16 (one lane's 16-byte vector) -> 8 e4m3 bytes in v.x (elements 0..3), v.y (4..7); returns the E8M0
// byte of the lane's 32-element block, which lanes 4b .. 4b + 3 share. Every lane of the warp must call
// it (shuffles). The rule is epbench/mxfp8.py's, in integers, so the bytes match it exactly
// (tests/test_mxfp8_kernel_math.py replays these steps):
//   amax bits m = max of (bits & 0x7FFF) over the block (monotonic in |x|; NaN and inf sort above finite)
//   e = ((m >> 7) & 0xFF) - 135 + ((m & 0x7F) > 0x60), clamped to [-127, 127]; byte = e + 127
//   q = e4m3_rne(float(x) * 2^-e): 2^-e in [2^-126, 2^127] is a normal float built from its bits, the
//       product is exact (or far below e4m3's subnormals), cvt.rn.satfinite never saturates (|q| <= 448)
//   exponent field 0xFF (NaN or inf in the block): byte 0xFF, every element 0x7F
__device__ __forceinline__ uint32_t mx_amax_bits(const int4& v) {  // max of (bits & 0x7FFF) over 8 bf16
  const uint32_t m2 = __vmaxu2(__vmaxu2((uint32_t)v.x & 0x7FFF7FFFu, (uint32_t)v.y & 0x7FFF7FFFu),
                               __vmaxu2((uint32_t)v.z & 0x7FFF7FFFu, (uint32_t)v.w & 0x7FFF7FFFu));
  return max(m2 & 0xFFFFu, m2 >> 16);
}

__device__ __forceinline__ int mx_exponent(uint32_t m) {  // e of the block whose amax bits are m
  const int field = (int)((m >> 7) & 0xFFu);
  return min(max(field - 135 + ((m & 0x7Fu) > 0x60u ? 1 : 0), -127), 127);
}

// 8 bf16 -> 8 e4m3 bytes (elements 0..3 in .x, 4..7 in .y), each times inv = 2^-e
__device__ __forceinline__ uint2 mx_quantize(const int4& v, float inv) {
  const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
  uint32_t q[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t a = w[2 * h], b = w[2 * h + 1];
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__uint_as_float(a << 16) * inv, __uint_as_float(a & 0xFFFF0000u) * inv), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__uint_as_float(b << 16) * inv, __uint_as_float(b & 0xFFFF0000u) * inv), __NV_SATFINITE, __NV_E4M3);
    q[h] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
  return make_uint2(q[0], q[1]);
}

__device__ __forceinline__ uint32_t mxfp8_cast(int4& v) {
  uint32_t m = mx_amax_bits(v);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  const int e = mx_exponent(m);
  const float inv = __int_as_float((127 - e) << 23);  // e <= 121 for any bf16, so 127 - e >= 6
  const uint2 q = mx_quantize(v, inv);
  const bool nan = ((m >> 7) & 0xFFu) == 0xFFu;
  v.x = (int)(nan ? 0x7F7F7F7Fu : q.x);
  v.y = (int)(nan ? 0x7F7F7F7Fu : q.y);
  return nan ? 0xFFu : (uint32_t)(e + 127);
}

// fused_stores 16: the same rule for a lane holding two adjacent vectors (16 elements: half a 32-element
// block; lanes 2b, 2b + 1 share block b, so one shuffle gives its amax). a becomes the 16 e4m3 bytes (a's 8,
// then b's 8); returns the block's E8M0 byte. Every lane of the warp must call it.
__device__ __forceinline__ uint32_t mxfp8_cast_pair(int4& a, const int4& b) {
  uint32_t m = max(mx_amax_bits(a), mx_amax_bits(b));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  const int e = mx_exponent(m);
  const float inv = __int_as_float((127 - e) << 23);
  const uint2 qa = mx_quantize(a, inv), qb = mx_quantize(b, inv);
  const bool nan = ((m >> 7) & 0xFFu) == 0xFFu;
  a.x = (int)(nan ? 0x7F7F7F7Fu : qa.x);
  a.y = (int)(nan ? 0x7F7F7F7Fu : qa.y);
  a.z = (int)(nan ? 0x7F7F7F7Fu : qb.x);
  a.w = (int)(nan ? 0x7F7F7F7Fu : qb.y);
  return nan ? 0xFFu : (uint32_t)(e + 127);
}

// fused_stores 16: the scale bytes of the warp's 16 blocks (lanes 0, 2, .., 30 hold blocks 0..15) gathered
// into lane 0's v, little-endian, for one 16-byte store.
__device__ __forceinline__ void gather_scales16(int4& v, uint32_t s) {
  s |= __shfl_down_sync(0xffffffffu, s, 2) << 8;   // lanes 4k: blocks 2k, 2k + 1
  s |= __shfl_down_sync(0xffffffffu, s, 4) << 16;  // lanes 8k: blocks 4k .. 4k + 3
  v.x = (int)s;
  v.y = (int)__shfl_sync(0xffffffffu, s, 8);
  v.z = (int)__shfl_sync(0xffffffffu, s, 16);
  v.w = (int)__shfl_sync(0xffffffffu, s, 24);
}

// The scale bytes of the warp's 8 blocks (lanes 0, 4, .., 28 hold blocks 0..7) gathered into lane 0's
// v.z (blocks 0..3) and v.w (4..7), little-endian, for one 8-byte store.
__device__ __forceinline__ void gather_scales(int4& v, uint32_t s) {
  s |= __shfl_down_sync(0xffffffffu, s, 4) << 8;   // lanes 8k: blocks 2k, 2k + 1
  s |= __shfl_down_sync(0xffffffffu, s, 8) << 16;  // lanes 16k: blocks 4k .. 4k + 3
  v.z = (int)s;
  v.w = (int)__shfl_sync(0xffffffffu, s, 16);
}

// 16-byte load cached in L2 only: rows a peer wrote during this kernel (never the non-coherent path).
__device__ __forceinline__ int4 ld_cg_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Expert-major: lane k's slot for (t, k) on its owner rank (owner: -1 where topk_idx[t][k] is not a valid
// expert, or repeats an earlier k of the token). Every lane of the warp calls it.
__device__ __forceinline__ int em_slot_of(const EpParams& p, long long idx, int t, int lane, int& owner) {
  const int E = p.experts_per_rank, topk = p.topk;
  bool valid = lane < topk && idx >= 0 && idx < (long long)p.world * E;
  for (int j = 0; j < topk; ++j) {
    const long long o = __shfl_sync(0xffffffffu, idx, j);
    valid = valid && !(j < lane && o == idx);
  }
  owner = valid ? (int)(idx / E) : -1;
  return valid ? p.em_base[idx] + p.em_ord[(size_t)t * topk + lane] : -1;
}

// Expert-major, receiver side, after every row of this epoch has landed (the last block's wait, passed on
// through em_go): warp g of the grid takes received rows g, g + G, ...; a row with n > 1 of my experts is
// copied from its first slot (where the source wrote it) into the n - 1 others, scales included.
// kWide false (em_push 0): each lane loads 4 vectors (2 KiB a warp), stores them to every further slot, loads
// the next 4: a row of 7168 bytes is 4 dependent load round trips, after the round trip for its em_slot entry.
// kWide true (em_push 2, wide): the next row's em_slot entry is loaded before this row's bytes (its round trip
// hidden under the copy), and each lane loads kWideU vectors before any store (8 KiB a warp: a row of up to
// 8 KiB is one round trip). At most 16 warps (the registers: notes/KERNELS.md, "Expert-major: wide copy pass").
constexpr int kWideU = 16;

template <bool kWide>
__device__ __forceinline__ void em_copy_rows(const EpParams& p);

template <bool kWide>
__device__ void em_local_copies(const EpParams& p, bool last, int epoch) {
  __syncthreads();  // the last block: its threads' waits on every source's done flag are over
  if (last && threadIdx.x == 0) {
    fence_acq_rel_sys();
    st_release_gpu(p.em_go, epoch);
  }
  if (threadIdx.x == 0) wait_flag(p, p.em_go, epoch, p.rank, kPhaseDispatch);
  __syncthreads();
  em_copy_rows<kWide>(p);
}

// em_sms > 0 (ep_set_option EP_OPT_EM_SMS): the same copies in a kernel of their own on em_sms blocks of 16 warps,
// stream-ordered after the dispatch kernel (kEm 4), whose last block returns only once every source's rows have
// landed (its waits on their done flags)
template <bool kWide>
__global__ void __launch_bounds__(512, 1) em_expand_kernel(EpParams p) {
  em_copy_rows<kWide>(p);
}

template <bool kWide>
__device__ __forceinline__ void em_copy_rows(const EpParams& p) {
  if (ld_volatile(p.dev_error) != 0) return;
  constexpr int U = kWide ? kWideU : 4;
  const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5, topk = p.topk;
  const int V = p.row_bytes >> 4, W = p.scale_stride >> 2;
  const long long n = *reinterpret_cast<volatile long long*>(p.num_recv);
  const long long step = (long long)gridDim.x * nwarps;
  const int* em_slot = reinterpret_cast<const int*>(p.peer_base[p.rank] + p.off_em_slot);
  uint8_t* x = p.peer_base[p.rank] + p.off_recv_x;
  uint8_t* sc = p.peer_base[p.rank] + p.off_recv_scales;
  const long long first = blockIdx.x * nwarps + (threadIdx.x >> 5);
  [[maybe_unused]] int next = kWide && first < n && lane < topk ? ld_volatile(em_slot + first * topk + lane) : -1;
  for (long long r = first; r < n; r += step) {
    int slot;
    if constexpr (kWide) {  // the next row's entry now: its round trip runs under this row's copies
      slot = next;
      next = r + step < n && lane < topk ? ld_volatile(em_slot + (r + step) * topk + lane) : -1;
    } else {
      slot = lane < topk ? ld_volatile(em_slot + r * topk + lane) : -1;
    }
    unsigned rest = __ballot_sync(0xffffffffu, slot >= 0);
    if (__popc(rest) < 2) continue;  // warp-uniform
    const int src = __shfl_sync(0xffffffffu, slot, __ffs(rest) - 1);
    rest &= rest - 1;
    const int4* from = reinterpret_cast<const int4*>(x + (size_t)src * p.row_bytes);
    for (int v0 = 0; v0 < V; v0 += 32 * U) {
      int4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * 32 + lane < V) buf[u] = ld_cg_v4(from + v0 + u * 32 + lane);
      for (unsigned m = rest; m; m &= m - 1) {
        int4* to = reinterpret_cast<int4*>(x + (size_t)__shfl_sync(0xffffffffu, slot, __ffs(m) - 1) * p.row_bytes);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * 32 + lane < V) st_v4(to + v0 + u * 32 + lane, buf[u]);
      }
    }
    for (unsigned m = rest; m && W > 0; m &= m - 1) {  // warp-uniform: the shuffle has every lane
      int* to = reinterpret_cast<int*>(sc + (size_t)__shfl_sync(0xffffffffu, slot, __ffs(m) - 1) * p.scale_stride);
      for (int j = lane; j < W; j += 32) to[j] = ld_volatile(reinterpret_cast<const int*>(sc + (size_t)src * p.scale_stride) + j);
    }
  }
}

// kFused: 0 rows as given, 1 cast fused with 8-byte stores per lane and vector, 2 (fused_stores 16) two
// adjacent vectors per lane, 16-byte stores (vector v0 + 64 m + 2 lane + (u & 1) in buf[u], m = u / 2)
// kEm: 0 rank-major, 1 expert-major (em_push 0: the receiver copies), 2 expert-major with em_push 1,
// 3 expert-major with em_push 2 (the receiver's wide copy pass; lean_rows as for 1), 4 expert-major with the copies
// in em_expand_kernel (em_sms > 0; lean_rows as for 1, no copy pass in this kernel)
template <int kU, bool kDyn, int kFused, int kEm>
__device__ __forceinline__ void lean_rows(const EpParams& p, const DispatchArgs& a, int first, int step, int lane) {
  const int world = p.world, topk = p.topk;
  const int unit = a.scale_unit, ns = kFused ? 0 : p.scale_bytes / unit;  // scale units copied per row
  const int my_base = lane < world ? p.base[lane] : 0;
  // 16-byte source vectors per row; fused: hidden / 8 (a multiple of 4: whole blocks per 4 lanes)
  const int V = kFused ? p.hidden >> 3 : p.row_bytes >> 4;
  const size_t src_row = kFused ? (size_t)p.hidden * 2 : (size_t)p.row_bytes;
  const bool aborted = ld_volatile(p.dev_error) != 0;
  // own_rows ce exists for rank-major, quantize before only (ep_create refuses the rest): the fused and
  // expert-major kernels compile without it
  const bool own_ce = !kFused && !kEm && p.own_ce;
  constexpr bool kWide = kFused == 2;
  static_assert(!kWide || kU % 2 == 0, "fused_stores 16 pairs the vectors of a lane");
  // the source vector buf[u] holds in the step at v0
  auto vec = [lane](int v0, int u) { return kWide ? v0 + (u >> 1) * 64 + 2 * lane + (u & 1) : v0 + u * 32 + lane; };
  unsigned* work = p.counters + kCounterDispatchWork;
  int t = first;
  if (kDyn) {
    unsigned g = 0;
    if (lane == 0) g = atomicAdd(work, 1u);
    t = (int)__shfl_sync(0xffffffffu, g, 0);
  }
  for (; !aborted && t < a.num_tokens;) {
    unsigned next = 0;
    if (kDyn && lane == 0) next = atomicAdd(work, 1u);
    const int4* src = reinterpret_cast<const int4*>(a.x + (size_t)t * src_row);
    int4 buf[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = vec(0, u);
      if (i < V) buf[u] = kWide ? ld_nc_v4_l1(src + i) : ld_nc_v4(src + i);
    }
    const int slot = lane < world ? p.slot_map[(size_t)t * world + lane] : -1;
    long long idx = 0;
    float w = 0.f;
    uint32_t sc0 = 0, sc1 = 0;
    if (lane < topk) {
      idx = a.topk_idx[(size_t)t * topk + lane];
      w = a.topk_w[(size_t)t * topk + lane];
    }
    const uint8_t* scales = a.x_scales + (size_t)t * p.scale_bytes;
    if (lane < ns) sc0 = ld_scale(scales, lane, unit);
    if (lane + 32 < ns) sc1 = ld_scale(scales, lane + 32, unit);
    const int my_row = slot >= 0 && !(own_ce && lane == p.rank) ? my_base + slot : -1;
    int rows[EP_MAX_WORLD];
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) rows[d] = __shfl_sync(0xffffffffu, my_row, d);
    // xr[d]: where the payload goes on d (rank-major: the row; expert-major: the slot of t's first expert there);
    // more[d] (expert-major, em_push 1): the lanes k of t's further experts on d, whose slots get the payload too
    int owner = -1, em_slot = -1, xr[EP_MAX_WORLD];
    unsigned more[EP_MAX_WORLD];
    if (kEm) em_slot = em_slot_of(p, idx, t, lane, owner);
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) {
      if (kEm) {
        const unsigned m = __ballot_sync(0xffffffffu, owner == d);
        xr[d] = m ? __shfl_sync(0xffffffffu, em_slot, __ffs(m) - 1) : -1;
        more[d] = kEm == 2 ? m & (m - 1) : 0u;
      } else {
        xr[d] = rows[d];
        more[d] = 0u;
      }
    }
    // every slot of t on d: xr[d], then those of more[d] (warp-uniform: each lane runs the same shuffles)
    auto each_slot = [&](int d, auto&& put) {
      put(xr[d]);
      if (kEm == 2)
        for (unsigned m = more[d]; m; m &= m - 1) put(__shfl_sync(0xffffffffu, em_slot, __ffs(m) - 1));
    };
    for (int v0 = 0; v0 < V; v0 += 32 * kU) {
      if (v0 > 0) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = vec(v0, u);
          if (i < V) buf[u] = kWide ? ld_nc_v4_l1(src + i) : ld_nc_v4(src + i);
        }
      }
      if (kWide) {
        // whole warp (V % 4 == 0: a block's 2 lanes are both in range or both out); buf[2m] becomes the 16
        // bytes of vectors g0 + 2 lane and g0 + 2 lane + 1 (g0 = v0 + 64 m), buf[2m + 1] (lane 0) the 16
        // scale bytes of the step's 16 blocks
#pragma unroll
        for (int m = 0; m < kU / 2; ++m) gather_scales16(buf[2 * m + 1], mxfp8_cast_pair(buf[2 * m], buf[2 * m + 1]));
      } else if (kFused) {
        // whole warp (V % 4 == 0: a block's 4 lanes are all in range or all out; out-of-range lanes cast
        // garbage that is never stored)
#pragma unroll
        for (int u = 0; u < kU; ++u) gather_scales(buf[u], mxfp8_cast(buf[u]));
      }
#pragma unroll
      for (int d = 0; d < EP_MAX_WORLD; ++d) {
        if (rows[d] < 0) continue;
        each_slot(d, [&](int r) {
          uint8_t* row = p.peer_base[d] + p.off_recv_x + (size_t)r * p.row_bytes;
          if (kWide) {
            uint8_t* srow = p.peer_base[d] + p.off_recv_scales + (size_t)r * p.scale_stride;
#pragma unroll
            for (int m = 0; m < kU / 2; ++m) {
              const int g0 = v0 + m * 64, i = g0 + 2 * lane;  // 8 output bytes per source vector
              if (i < V) st_v4(reinterpret_cast<int4*>(row) + (i >> 1), buf[2 * m]);
              // blocks g0 / 4 .. + 15 (a multiple of 16; the 16-aligned stride holds any bytes past num_scales)
              if (lane == 0 && g0 < V) st_v4(reinterpret_cast<int4*>(srow + (g0 >> 2)), buf[2 * m + 1]);
            }
          } else if (kFused) {
            uint8_t* srow = p.peer_base[d] + p.off_recv_scales + (size_t)r * p.scale_stride;
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int i0 = v0 + u * 32, i = i0 + lane;
              if (i < V) st_v2(reinterpret_cast<uint2*>(row) + i, (uint32_t)buf[u].x, (uint32_t)buf[u].y);
              // blocks i0 / 4 .. + 7 (a multiple of 8; the stride holds any bytes past num_scales)
              if (lane == 0 && i0 < V) st_v2(reinterpret_cast<uint2*>(srow + (i0 >> 2)), (uint32_t)buf[u].z, (uint32_t)buf[u].w);
            }
          } else {
#pragma unroll
            for (int u = 0; u < kU; ++u) {
              const int i = v0 + u * 32 + lane;
              if (i < V) st_v4(reinterpret_cast<int4*>(row) + i, buf[u]);
            }
          }
        });
      }
    }
#pragma unroll
    for (int d = 0; d < EP_MAX_WORLD; ++d) {
      if (rows[d] < 0) continue;
      uint8_t* pb = p.peer_base[d];
      if (lane < topk) {
        reinterpret_cast<long long*>(pb + p.off_recv_idx)[(size_t)rows[d] * topk + lane] = idx;
        reinterpret_cast<float*>(pb + p.off_recv_w)[(size_t)rows[d] * topk + lane] = w;
        if (kEm) reinterpret_cast<int*>(pb + p.off_em_slot)[(size_t)rows[d] * topk + lane] = owner == d ? em_slot : -1;
      }
      if (own_ce && lane == 0) reinterpret_cast<long long*>(pb + p.off_recv_key)[rows[d]] = (long long)p.rank << 32 | t;
      if (kFused) continue;
      each_slot(d, [&](int r) {
        uint8_t* dst_scales = pb + p.off_recv_scales + (size_t)r * p.scale_stride;
        if (lane < ns) st_scale(dst_scales, lane, unit, sc0);
        if (lane + 32 < ns) st_scale(dst_scales, lane + 32, unit, sc1);
        for (int j = lane + 64; j < ns; j += 32) st_scale(dst_scales, j, unit, ld_scale(scales, j, unit));
      });
    }
    t = kDyn ? (int)__shfl_sync(0xffffffffu, next, 0) : t + step;
  }
}

template <int kU, int kThreads, bool kDyn, int kFused, int kEm>
__global__ void __launch_bounds__(kThreads, 1) dispatch_lean_kernel(EpParams p, DispatchArgs a, int epoch) {
  griddep_wait();  // slot_map and base come from the notify kernel
  stamp_sm(p);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(p, kStampDataStart);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int total_warps = gridDim.x * nwarps;
  lean_rows<kU, kDyn, kFused, kEm>(p, a, blockIdx.x * nwarps + warp, total_warps, lane);
  const bool last = grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch,
                                          kDyn ? kCounterDispatchWork : -1);
  if constexpr (kEm == 1) em_local_copies<false>(p, last, epoch);
  if constexpr (kEm == 3) em_local_copies<true>(p, last, epoch);  // em_push 2: wide
}

// own_rows all: what rides beside the copy engines' x rows, on every rank d (mine included), in my segment
// [me * max_tokens, (me + 1) * max_tokens): each row's key, me << 32 | t where token t goes to d, else -1 (t not
// routed there, or t >= num_tokens), and for t < num_tokens its ids and weights (topk_idx / topk_w rows t, whether
// routed to d or not, as a copy of the whole tensors would). Runs while the copies run; ce_release_kernel
// signals completion after both.
__global__ void __launch_bounds__(512, 1) ce_meta_kernel(EpParams p, const int64_t* idx, const float* w,
                                                         int num_tokens) {
  const int world = p.world, cap = p.max_tokens, k = p.topk;
  const long long total = (long long)world * cap, step = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (ld_volatile(p.dev_error) != 0) return;
  const size_t seg = (size_t)p.rank * cap;
  for (long long i = first; i < total; i += step) {
    const int d = (int)(i / cap), t = (int)(i - (long long)d * cap);
    const bool sent = t < num_tokens && p.slot_map[(size_t)t * world + d] >= 0;
    long long* key = reinterpret_cast<long long*>(p.peer_base[d] + p.off_recv_key);
    key[seg + t] = sent ? ((long long)p.rank << 32 | t) : -1ll;
  }
  const long long elems = (long long)num_tokens * k, all = elems * world;  // (d, t x k + j): one id and weight each
  for (long long i = first; i < all; i += step) {
    const int d = (int)(i / elems);
    const long long e = i - (long long)d * elems;
    reinterpret_cast<int64_t*>(p.peer_base[d] + p.off_recv_idx)[seg * k + e] = idx[e];
    reinterpret_cast<float*>(p.peer_base[d] + p.off_recv_w)[seg * k + e] = w[e];
  }
}

// own_rows all: completion after the copies and ce_meta_kernel (stream order): done[me] into every rank, then the
// wait for every source's (grid_release_and_wait, one block).
__global__ void __launch_bounds__(32, 1) ce_release_kernel(EpParams p, int epoch) {
  grid_release_and_wait(p, kCounterDispatch, p.sig.done_off, epoch, kPhaseDispatch);
}

// own_rows all, ce_share < 100: x rows [first, first + n) of my segment into every peer with 16-byte stores,
// while the copy engines move rows [0, first). A unit is 4 KiB (32 lanes x 8 vectors, all loaded before stored)
// of one peer's range; consecutive units go to consecutive peers (me + 1 + u % (world - 1)), so every link is
// busy from the start. Only x: the rest of a row's data is small and goes by copy engine.
__global__ void __launch_bounds__(512, 1) ce_tail_kernel(EpParams p, const int4* x, long long first, long long n) {
  constexpr int kU = 8, kUnit = 32 * kU;  // vectors a unit
  const int lane = threadIdx.x & 31, np = p.world - 1;
  const long long vpr = p.row_bytes / 16, v0 = first * vpr, vecs = n * vpr;  // vectors a row, the range's first, count
  const long long units = (vecs + kUnit - 1) / kUnit * np, warps = (long long)gridDim.x * (blockDim.x >> 5);
  const int4* src = x + v0;
  const size_t seg = p.off_recv_x + (size_t)p.rank * p.max_tokens * p.row_bytes;  // my segment in a peer's buffer
  for (long long u = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < units; u += warps) {
    const int d = (p.rank + 1 + (int)(u % np)) % p.world;
    const long long base = (u / np) * kUnit;
    int4* dst = reinterpret_cast<int4*>(p.peer_base[d] + seg) + v0;
    int4 v[kU];
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < vecs) v[k] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      const long long i = base + k * 32 + lane;
      if (i < vecs) st_v4(dst + i, v[k]);
    }
  }
}

using DispatchKernel = void (*)(EpParams, DispatchArgs, int);

// One kernel of the table below; em_push 1 and 2 and em_sms (kEm 2, 3, 4) are built for at most 16 warps only
// (null above: ep_dispatch says so)
template <int kU, int kThreads, bool kDyn, int kFused, int kEm>
constexpr DispatchKernel dispatch_kernel() {
  if constexpr (kEm >= 2 && kThreads > 512)
    return nullptr;
  else
    return dispatch_lean_kernel<kU, kThreads, kDyn, kFused, kEm>;
}

// <kEm: 0 rank-major, 1 expert-major, 2 expert-major em_push 1, 3 em_push 2, 4 em_sms>[warps > 16][lean_dyn][fused: 0 no, 1 8-byte stores,
// 2 16-byte stores]
template <int kEm>
constexpr DispatchKernel kDispatchKernels[2][2][3] = {
    {{dispatch_kernel<8, 512, false, 0, kEm>(), dispatch_kernel<8, 512, false, 1, kEm>(),
      dispatch_kernel<8, 512, false, 2, kEm>()},
     {dispatch_kernel<8, 512, true, 0, kEm>(), dispatch_kernel<8, 512, true, 1, kEm>(),
      dispatch_kernel<8, 512, true, 2, kEm>()}},
    {{dispatch_kernel<4, 1024, false, 0, kEm>(), dispatch_kernel<4, 1024, false, 1, kEm>(),
      dispatch_kernel<4, 1024, false, 2, kEm>()},
     {dispatch_kernel<4, 1024, true, 0, kEm>(), dispatch_kernel<4, 1024, true, 1, kEm>(),
      dispatch_kernel<4, 1024, true, 2, kEm>()}},
};

// own_rows all (see the header): after the notify kernel, my own x rows (and scales) into my segment by a local
// copy on copy stream 1, the peers' on copy stream 0 in ring order (ce_share < 100: x rows [first, n) by
// ce_tail_kernel on `num_sms` blocks meanwhile), ids, weights and keys by ce_meta_kernel on `num_sms` blocks, then
// ce_release_kernel once all of it has landed. The own copy comes after the notify kernel: beside it, it made the
// notify take 28-29 us instead of 13-17 (notes/LATENCY-NEXT.md, "a trace").
int dispatch_by_copies(EpContext* ctx, const DispatchArgs& a, int num_sms, int epoch, cudaStream_t stream) {
  const EpParams& p = ctx->p;
  const size_t seg = (size_t)p.rank * p.max_tokens, n = (size_t)a.num_tokens;  // my segment's first row
  const size_t first = n * ctx->ce_share / 100;  // x rows [0, first) by copy engine, the rest by SM stores
  // after a wait has timed out (the error word the host sees) the notify no longer proves that the peers are done
  // with my segment of their buffers: no copy then (the kernels bail out as in the other modes)
  const bool copies = n > 0 && !ctx->host_error->flag;
  auto rows = [&](int d, size_t x_rows, cudaStream_t s) -> int {  // x rows [0, x_rows) and every row's scales to d
    uint8_t* b = p.peer_base[d];
    if (x_rows > 0)
      CUDA_CHECK(cudaMemcpyAsync(b + p.off_recv_x + seg * p.row_bytes, a.x, x_rows * p.row_bytes, cudaMemcpyDefault,
                                 s));
    if (a.x_scales != nullptr)  // recv_scales rows may be wider than the caller's (mxfp8: 16-byte stride)
      CUDA_CHECK(cudaMemcpy2DAsync(b + p.off_recv_scales + seg * p.scale_stride, p.scale_stride, a.x_scales,
                                   p.scale_bytes, p.scale_bytes, n, cudaMemcpyDefault, s));
    return 0;
  };
  if (copies) {
    CUDA_CHECK(cudaEventRecord(ctx->ce_fork, stream));
    cudaStream_t own = ctx->ce_streams[1];
    CUDA_CHECK(cudaStreamWaitEvent(own, ctx->ce_fork, 0));
    if (rows(p.rank, n, own) != 0) return -1;
    CUDA_CHECK(cudaEventRecord(ctx->ce_done[1], own));
    if (p.world > 1) {
      // One stream, the peers in ring order (me + 1, me + 2, ...): a GPU's copy engine runs its peer copies one at
      // a time whatever the streams (measured: notes/LATENCY-NEXT.md, "a trace"), so with a stream per peer two
      // ranks often wrote into one destination at once while another waited; in ring order each receives from one
      // source at a time while the ranks keep step.
      cudaStream_t s = ctx->ce_streams[0];
      CUDA_CHECK(cudaStreamWaitEvent(s, ctx->ce_fork, 0));
      for (int i = 0; i + 1 < p.world; ++i)
        if (rows((p.rank + 1 + i) % p.world, first, s) != 0) return -1;
      CUDA_CHECK(cudaEventRecord(ctx->ce_done[0], s));
    }
  }
  ce_meta_kernel<<<num_sms, 512, 0, stream>>>(p, a.topk_idx, a.topk_w, a.num_tokens);
  CUDA_CHECK(cudaGetLastError());
  if (copies) {
    if (first < n && p.world > 1) {  // the SM part, beside the copies
      ce_tail_kernel<<<num_sms, 512, 0, stream>>>(p, reinterpret_cast<const int4*>(a.x), (long long)first,
                                                  (long long)(n - first));
      CUDA_CHECK(cudaGetLastError());
    }
    if (p.world > 1) CUDA_CHECK(cudaStreamWaitEvent(stream, ctx->ce_done[0], 0));
    CUDA_CHECK(cudaStreamWaitEvent(stream, ctx->ce_done[1], 0));
  }
  ce_release_kernel<<<1, 32, 0, stream>>>(p, epoch);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace

extern "C" int ep_dispatch(void* vctx, const void* x, const void* x_scales, const void* topk_idx, const void* topk_w,
                           int num_tokens, int num_sms, int impl, int warps, int epoch, void* vstream) {
  EpContext* ctx = (EpContext*)vctx;
  const EpParams& p = ctx->p;
  cudaStream_t stream = (cudaStream_t)vstream;
  if (ep_check_call(ctx, num_tokens, num_sms, warps, 32) != 0) return -1;
  if (impl != EP_DISPATCH_LEAN && impl != EP_DISPATCH_LEAN_DYN) {
    ep_set_error("dispatch impl %d unknown (EP_DISPATCH_LEAN %d, EP_DISPATCH_LEAN_DYN %d)", impl, EP_DISPATCH_LEAN,
                 EP_DISPATCH_LEAN_DYN);
    return -1;
  }
  const bool needs_scales = p.scale_bytes > 0 && !p.fused;
  if (needs_scales && x_scales == nullptr && num_tokens > 0) {
    ep_set_error("%s dispatch needs x_scales", p.scale_bytes == p.num_scales ? "mxfp8" : "fp8");
    return -1;
  }
  if (p.own_ce == 2 && ctx->ce_share < 100 && num_tokens > 0 && (uintptr_t)x % 16 != 0) {  // ce_tail_kernel's vectors
    ep_set_error("ce_share %d needs x 16-byte aligned", ctx->ce_share);
    return -1;
  }
  // em_push 3 (auto): the wide copy pass where it is built for the warps, else the receiver's
  const int em_push = p.em_push == 3 ? (warps > 16 ? 0 : 2) : p.em_push;
  if (p.align > 0 && em_push && warps > 16) {  // before any launch (the notify kernel meets the peers)
    ep_set_error("em_push %d (%s) runs with at most 16 dispatch warps, got %d", em_push,
                 em_push == 1 ? "sender" : "wide", warps);
    return -1;
  }
  const bool em_apart = p.align > 0 && p.em_sms > 0 && em_push != 1;  // the copies in em_expand_kernel
  if (em_apart && warps > 16) {
    ep_set_error("em_sms %d (the expansion in a kernel of its own) runs with at most 16 dispatch warps, got %d",
                 p.em_sms, warps);
    return -1;
  }
  CUDA_CHECK(cudaSetDevice(ctx->device));
  // em_sms: the ordinal pass (an expert-major pass, before the notify) on the em_sms blocks too, where more
  const int ord_blocks = em_apart && p.em_sms > num_sms ? p.em_sms : num_sms;
  if (p.align > 0 && ep_launch_em_ordinal(ctx, (const int64_t*)topk_idx, num_tokens, ord_blocks, stream) != 0) return -1;
  if (ep_launch_notify(ctx, (const int64_t*)topk_idx, num_tokens, num_sms, epoch, stream) != 0) return -1;

  DispatchArgs a;
  a.x = (const uint8_t*)x;
  a.x_scales = needs_scales ? (const uint8_t*)x_scales : nullptr;
  a.topk_idx = (const int64_t*)topk_idx;
  a.topk_w = (const float*)topk_w;
  a.num_tokens = num_tokens;
  a.scale_unit = p.scale_bytes % 4 == 0 && (uintptr_t)x_scales % 4 == 0 ? 4 : 1;
  const bool dyn = impl == EP_DISPATCH_LEAN_DYN;
  if (p.own_ce == 2) {  // own_rows all: copy engines move the rows, a small kernel keys them
    if (dispatch_by_copies(ctx, a, num_sms, epoch, stream) != 0) return -1;
  } else {
    const int w16 = warps > 16, fused = p.fused;  // 0, 1 or 2 (ep_config.quantize_fused)
    const DispatchKernel kernel =
        p.align == 0      ? kDispatchKernels<0>[w16][dyn][fused]
        : em_push == 1    ? kDispatchKernels<2>[w16][dyn][fused]
        : em_apart        ? kDispatchKernels<4>[w16][dyn][fused]
        : em_push == 2    ? kDispatchKernels<3>[w16][dyn][fused]
                          : kDispatchKernels<1>[w16][dyn][fused];
    CUDA_CHECK(launch_dependent(kernel, num_sms, warps * 32, 0, stream, p, a, epoch));
    if (em_apart) {  // the expansion on em_sms blocks of 16 warps, after every row has landed
      if (em_push == 2)
        em_expand_kernel<true><<<p.em_sms, 512, 0, stream>>>(p);
      else
        em_expand_kernel<false><<<p.em_sms, 512, 0, stream>>>(p);
      CUDA_CHECK(cudaGetLastError());
    }
  }
  ep_effective& eff = ctx->effective;
  eff.dispatch_impl = impl;
  eff.dispatch_warps = p.own_ce == 2 ? 16 : warps;  // own_rows all: the meta kernel's 512 threads ran, no row kernel
  eff.dispatch_sms = num_sms;
  eff.dispatch_scale_block = p.num_scales > 0 ? p.hidden / p.num_scales : 0;
  eff.dispatch_fused = p.fused;
  eff.dispatch_em_push = p.align > 0 ? em_push : 0;
  eff.em_sms = p.align > 0 ? p.em_sms : 0;  // sender (no copy pass): phase R only
  return 0;
}
