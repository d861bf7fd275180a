// NVSHMEM groundwork for multi-node dispatch/combine: bootstrap over a unique id
// that torch.distributed carries from rank 0 to every rank, the symmetric buffers, and a ping
// in which every PE puts a 4 KiB block into every other PE with put-with-signal, waits for
// every peer's signal and checks the bytes. API: api_nvshmem.h. Build: ../Makefile (relocatable
// device code, device-linked against libnvshmem_device.a, host-linked against libnvshmem_host).
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "api_nvshmem.h"
#include "epn_internal.h"

namespace {

constexpr int kBlockBytes = 4096;  // what each PE puts into each peer per round
constexpr int kBlockWords = kBlockBytes / 4;
constexpr int kMaxWarps = 16;  // warps of the ping block; each handles peers warp, warp + 16, ...

// Outcome of one ping round, written by the kernel (first failure wins).
enum PingStatus { kPingOk = 0, kPingTimeout = 1, kPingWrongBytes = 2 };
struct PingReport {
  int status;
  int peer;        // the PE that never signalled, or whose block was wrong
  int bad_words;   // 4-byte words of that block that were wrong
  int first_bad;   // index of the first wrong word
  unsigned got;    // its value
  unsigned want;   // and what it should have been
};


struct State {
  bool ready = false;
  int me = -1;
  int npes = -1;
  uint8_t* send = nullptr;   // symmetric [npes][4 KiB]: this PE's block for each peer
  uint8_t* recv = nullptr;   // symmetric [2][npes][4 KiB]: by round parity, then by sender
  uint64_t* sig = nullptr;   // symmetric [2][npes]: by round parity, then by sender
  PingReport* report = nullptr;  // device
  cudaStream_t stream = nullptr;
  uint64_t round = 0;  // last round sent; signals carry it, so they never need resetting
};
State g;


#define EPN_CUDA(call)                                                                   \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) return epn_fail("%s: %s", #call, cudaGetErrorString(err_));     \
  } while (0)

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The word `word` of the block PE src sends PE dst in round `round`: differs per round, pair and
// position, so a stale, misplaced or partly written block cannot pass the check.
__device__ __forceinline__ uint32_t expected_word(uint64_t round, int src, int dst, int word) {
  uint32_t x = static_cast<uint32_t>(round) * 0x9E3779B1u;
  x ^= static_cast<uint32_t>(src + 1) * 0x85EBCA77u;
  x ^= static_cast<uint32_t>(dst + 1) * 0xC2B2AE3Du;
  x ^= static_cast<uint32_t>(word) * 0x27D4EB2Fu + static_cast<uint32_t>(round >> 32);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 13;
  return x;
}

// One block. Phase 1: each warp writes its peers' blocks into `send` and puts them with
// put-with-signal (signal := round) into recv[parity][me] / sig[parity][me] of the peer.
// Phase 2: each warp waits for its peers' signals and checks recv[parity][peer].
// Parity double-buffering: a peer can start round r+1 as soon as it has every signal of round r,
// while this PE may still be checking round r's data; round r+1 lands in the other half, and
// round r+2 cannot start anywhere before this PE's round r+1 put, i.e. after this kernel.
__global__ void ping_kernel(uint8_t* send, uint8_t* recv, uint64_t* sig, uint64_t round,
                            long long timeout_ns, PingReport* report) {
  const int me = nvshmem_my_pe();
  const int npes = nvshmem_n_pes();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const int parity = static_cast<int>(round & 1);
  uint8_t* recv_half = recv + static_cast<size_t>(parity) * npes * kBlockBytes;
  uint64_t* sig_half = sig + static_cast<size_t>(parity) * npes;

  for (int k = 1 + warp; k < npes; k += nwarps) {
    const int peer = (me + k) % npes;  // staggered: PEs do not all hit PE 0 first
    uint32_t* block = reinterpret_cast<uint32_t*>(send + static_cast<size_t>(peer) * kBlockBytes);
    for (int w = lane; w < kBlockWords; w += 32) block[w] = expected_word(round, me, peer, w);
    __syncwarp();
    nvshmemx_putmem_signal_nbi_warp(recv_half + static_cast<size_t>(me) * kBlockBytes, block,
                                    kBlockBytes, sig_half + me, round, NVSHMEM_SIGNAL_SET, peer);
  }
  // Completes this warp's puts before the kernel ends, so the next round may rewrite `send`. Once
  // per warp (lane 0), not once per block: nvshmem_quiet is a thread-level call, and a network
  // transport may queue a warp's puts apart from other warps' (IBGDA: per-warp queues, unverified).
  __syncwarp();
  if (lane == 0) nvshmem_quiet();

  for (int k = 1 + warp; k < npes; k += nwarps) {
    const int peer = (me - k + npes) % npes;  // the PE whose block for us was sent k-th
    int timed_out = 0;
    if (lane == 0) {
      if (timeout_ns <= 0) {
        nvshmem_signal_wait_until(sig_half + peer, NVSHMEM_CMP_GE, round);
      } else {
        // Bounded: nvshmem_uint64_test, unlike a bare read of the signal word, also runs NVSHMEM's
        // consistency step for proxy (network) transports once the condition holds.
        const uint64_t t0 = globaltimer_ns();
        while (!nvshmem_uint64_test(sig_half + peer, NVSHMEM_CMP_GE, round)) {
          if (static_cast<long long>(globaltimer_ns() - t0) > timeout_ns) {
            timed_out = 1;
            break;
          }
        }
      }
      __threadfence();  // the signal was observed: order the data reads after it
    }
    timed_out = __shfl_sync(0xffffffffu, timed_out, 0);
    __syncwarp();
    if (timed_out) {
      if (lane == 0 && atomicCAS(&report->status, kPingOk, kPingTimeout) == kPingOk) report->peer = peer;
      continue;
    }
    const volatile uint32_t* got =
        reinterpret_cast<const volatile uint32_t*>(recv_half + static_cast<size_t>(peer) * kBlockBytes);
    int bad = 0, first = kBlockWords;
    for (int w = lane; w < kBlockWords; w += 32) {
      if (got[w] != expected_word(round, peer, me, w)) {
        ++bad;
        first = min(first, w);
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      bad += __shfl_down_sync(0xffffffffu, bad, off);
      first = min(first, __shfl_down_sync(0xffffffffu, first, off));
    }
    if (lane == 0 && bad > 0 && atomicCAS(&report->status, kPingOk, kPingWrongBytes) == kPingOk) {
      report->peer = peer;
      report->bad_words = bad;
      report->first_bad = first;
      report->got = got[first];
      report->want = expected_word(round, peer, me, first);
    }
  }
}

void release_buffers() {
  if (g.send) nvshmem_free(g.send);
  if (g.recv) nvshmem_free(g.recv);
  if (g.sig) nvshmem_free(g.sig);
  if (g.report) cudaFree(g.report);
  if (g.stream) cudaStreamDestroy(g.stream);
  g.send = g.recv = nullptr;
  g.sig = nullptr;
  g.report = nullptr;
  g.stream = nullptr;
}

}  // namespace

thread_local char g_error[512];

int epn_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, ap);
  va_end(ap);
  return -1;
}

extern "C" int epn_uniqueid_size(void) { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }

extern "C" int epn_versions(int* built, int* loaded) {
  if (built == nullptr || loaded == nullptr) return epn_fail("epn_versions: null pointer");
  *built = NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 + NVSHMEM_VENDOR_PATCH_VERSION;
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);  // answered by libnvshmem_host
  *loaded = major * 10000 + minor * 100 + patch;
  return 0;
}

extern "C" int epn_get_uniqueid(void* out, int cap) {
  if (out == nullptr || cap < static_cast<int>(sizeof(nvshmemx_uniqueid_t)))
    return epn_fail("epn_get_uniqueid: need %zu bytes, got %d", sizeof(nvshmemx_uniqueid_t), cap);
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int rc = nvshmemx_get_uniqueid(&id);
  if (rc != 0) return epn_fail("nvshmemx_get_uniqueid returned %d", rc);
  memcpy(out, &id, sizeof(id));
  return static_cast<int>(sizeof(id));
}

namespace {
volatile int g_in_init = 0;  // inside nvshmemx_init_attr
int g_init_rank = -1;

void say_init_failed() {
  if (!g_in_init) return;
  fprintf(stderr,
          "epbench: NVSHMEM initialisation failed on rank %d and NVSHMEM ended the process (its own "
          "message is above; NVSHMEM_DEBUG=INFO says more; check NVSHMEM_SYMMETRIC_SIZE and, on one host, "
          "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo)\n",
          g_init_rank);
  fflush(stderr);
}
}  // namespace

extern "C" int epn_init(const void* uid, int uid_size, int rank, int world, int device) {
  if (g.ready) return epn_fail("epn_init: NVSHMEM is already initialised (call epn_finalize first)");
  if (uid == nullptr || uid_size != static_cast<int>(sizeof(nvshmemx_uniqueid_t)))
    return epn_fail("epn_init: the unique id must be %zu bytes, got %d", sizeof(nvshmemx_uniqueid_t), uid_size);
  if (world < 1 || rank < 0 || rank >= world) return epn_fail("epn_init: rank %d of world %d", rank, world);
  EPN_CUDA(cudaSetDevice(device));

  nvshmemx_uniqueid_t id;  // must outlive nvshmemx_init_attr: the attributes point at it
  memcpy(&id, uid, sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr);
  if (rc != 0) return epn_fail("nvshmemx_set_attr_uniqueid_args returned %d", rc);
  // A failed NVSHMEM init exits the process from inside nvshmemx_init_attr (it never returns an
  // error): a handler registered with atexit says in one line which rank it was and what to try.
  static bool handler_set = false;
  if (!handler_set) handler_set = atexit(say_init_failed) == 0;
  g_init_rank = rank;
  g_in_init = 1;
  rc = nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  g_in_init = 0;
  if (rc != 0) return epn_fail("nvshmemx_init_attr returned %d", rc);
  g.me = nvshmem_my_pe();
  g.npes = nvshmem_n_pes();
  g.ready = true;  // from here on epn_finalize must run, even if the rest fails
  if (g.me != rank || g.npes != world)
    return epn_fail("NVSHMEM says PE %d of %d, expected rank %d of %d", g.me, g.npes, rank, world);

  const size_t npes = static_cast<size_t>(g.npes);
  // nvshmem_malloc is collective; every PE asks for the same sizes in the same order.
  g.send = static_cast<uint8_t*>(nvshmem_malloc(npes * kBlockBytes));
  g.recv = static_cast<uint8_t*>(nvshmem_malloc(2 * npes * kBlockBytes));
  g.sig = static_cast<uint64_t*>(nvshmem_malloc(2 * npes * sizeof(uint64_t)));
  if (!g.send || !g.recv || !g.sig) return epn_fail("nvshmem_malloc failed (symmetric heap too small?)");
  EPN_CUDA(cudaMalloc(&g.report, sizeof(PingReport)));
  EPN_CUDA(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
  EPN_CUDA(cudaMemset(g.recv, 0, 2 * npes * kBlockBytes));
  EPN_CUDA(cudaMemset(g.sig, 0, 2 * npes * sizeof(uint64_t)));
  EPN_CUDA(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // no PE puts before every PE has zeroed its signals
  g.round = 0;
  g_error[0] = '\0';
  return 0;
}

extern "C" int epn_my_pe(void) { return g.ready ? g.me : -1; }
extern "C" int epn_n_pes(void) { return g.ready ? g.npes : -1; }

extern "C" int epn_ping(int iters, double timeout_s, double* us_out) {
  if (!g.ready || g.sig == nullptr) return epn_fail("epn_ping: call epn_init first");
  if (iters < 1 || us_out == nullptr) return epn_fail("epn_ping: iters must be >= 1 and us_out set");
  const int peers = std::max(g.npes - 1, 1);
  const dim3 grid(1), block(32 * std::min(peers, kMaxWarps));
  const long long timeout_ns = timeout_s > 0 ? static_cast<long long>(timeout_s * 1e9) : 0;

  cudaEvent_t start, stop;
  EPN_CUDA(cudaEventCreate(&start));
  EPN_CUDA(cudaEventCreate(&stop));
  std::vector<double> us;
  us.reserve(iters);
  int rc = 0;
  nvshmemx_barrier_all_on_stream(g.stream);  // start the rounds together
  for (int i = 0; i < iters && rc == 0; ++i) {
    uint64_t round = ++g.round;
    void* args[] = {&g.send, &g.recv, &g.sig, &round, const_cast<long long*>(&timeout_ns), &g.report};
    PingReport rep{};
    cudaError_t err = cudaMemsetAsync(g.report, 0, sizeof(PingReport), g.stream);
    if (err == cudaSuccess) err = cudaEventRecord(start, g.stream);
    if (err != cudaSuccess) {
      rc = epn_fail("round %llu: %s", static_cast<unsigned long long>(round), cudaGetErrorString(err));
      break;
    }
    // Collective launch: the kernel waits on other PEs (NVSHMEM's rule for such kernels).
    const int lrc = nvshmemx_collective_launch(reinterpret_cast<const void*>(ping_kernel), grid, block,
                                               args, 0, g.stream);
    if (lrc != 0) {
      rc = epn_fail("round %llu: nvshmemx_collective_launch returned %d", static_cast<unsigned long long>(round), lrc);
      break;
    }
    err = cudaEventRecord(stop, g.stream);
    if (err == cudaSuccess) err = cudaMemcpyAsync(&rep, g.report, sizeof(rep), cudaMemcpyDeviceToHost, g.stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(g.stream);
    float ms = 0.f;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start, stop);
    if (err != cudaSuccess) {
      rc = epn_fail("round %llu: %s", static_cast<unsigned long long>(round), cudaGetErrorString(err));
      break;
    }
    if (rep.status == kPingTimeout) {
      rc = epn_fail("PE %d, round %llu: no signal from PE %d after %g s", g.me,
                static_cast<unsigned long long>(round), rep.peer, timeout_s);
    } else if (rep.status == kPingWrongBytes) {
      rc = epn_fail("PE %d, round %llu: %d of %d words from PE %d wrong (first: word %d = 0x%08x, want 0x%08x)",
                g.me, static_cast<unsigned long long>(round), rep.bad_words, kBlockWords, rep.peer,
                rep.first_bad, rep.got, rep.want);
    }
    us.push_back(1000.0 * ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (rc != 0) return rc;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  *us_out = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  return 0;
}

extern "C" int epn_finalize(void) {
  if (!g.ready) return 0;
  cudaError_t err = g.stream ? cudaStreamSynchronize(g.stream) : cudaSuccess;
  nvshmem_barrier_all();  // no PE frees while a peer may still put into it
  release_buffers();
  nvshmem_finalize();
  g = State{};
  if (err != cudaSuccess) return epn_fail("epn_finalize: %s", cudaGetErrorString(err));
  return 0;
}

extern "C" const char* epn_last_error(void) { return g_error; }
