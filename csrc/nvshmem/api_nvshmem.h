// extern "C" API of libepbench_nvshmem.so (csrc/nvshmem/nvshmem_boot.cu), called from
// epbench/nvshmem_lib.py through ctypes. Groundwork for multi-node dispatch/combine:
// NVSHMEM bootstrap over a unique id, symmetric buffers, and an all-to-all put+signal ping that
// checks the transport end to end. Every int function returns 0 on success (epn_get_uniqueid:
// the id's size) and -1 on failure; epn_last_error() then says why.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

// Bytes of nvshmemx_uniqueid_t in this build (128 for NVSHMEM 3.x).
int epn_uniqueid_size(void);

// NVSHMEM versions as major * 10000 + minor * 100 + patch: *built, the headers and device library
// this library was compiled against; *loaded, the libnvshmem_host the process actually resolved
// (another copy loaded first, e.g. by torch, wins by soname). They must match.
int epn_versions(int* built, int* loaded);

// Writes a fresh nvshmemx_uniqueid_t into out (cap bytes); returns its size, -1 if cap is too
// small or NVSHMEM fails. Called on rank 0 only; every rank passes the same bytes to epn_init.
int epn_get_uniqueid(void* out, int cap);

// cudaSetDevice(device), then NVSHMEM init over the unique id (collective: every rank calls it),
// then the ping's symmetric buffers (nvshmem_malloc, collective). NVSHMEM itself exits the
// process when its own init fails (nvshmemx_init_attr does); -1 only for the checks around it.
int epn_init(const void* uid, int uid_size, int rank, int world, int device);

// This PE and the number of PEs (-1 before epn_init).
int epn_my_pe(void);
int epn_n_pes(void);

// iters rounds (collective: every PE calls it with the same iters): each PE puts a 4 KiB block
// into every other PE's symmetric buffer with put-with-signal, waits for every peer's signal,
// and checks the bytes it got. timeout_s > 0: a bounded wait that names the peer that never
// signalled; timeout_s <= 0: nvshmem_signal_wait_until (unbounded). *us_out: the median round
// time in microseconds (one kernel launch per round, device events around it).
int epn_ping(int iters, double timeout_s, double* us_out);

// Frees the symmetric buffers and finalizes NVSHMEM (collective). 0 if never initialised.
int epn_finalize(void);

// Why the last failing call failed ("" if none did).
const char* epn_last_error(void);


// ---- Hierarchical dispatch/combine (hier.cu): NVLink inside a node, NVSHMEM puts between nodes ----
// Rank r = node * gpus_per_node + local; the same semantics as the intranode kernels
// (epbench/backends/base.py). Every function returns 0 on success and -1 on failure
// (epn_last_error() says why), unless noted.
typedef struct {
  int rank, world, gpus_per_node, device;
  int hidden, max_tokens, topk, experts_per_rank;
  int fp8;           // 1: rows are fp8 e4m3 with one fp32 scale per 128 elements
  double timeout_s;  // a kernel waiting on a peer gives up after this long
  // Between nodes, to a rail peer that NVLink reaches (virtual nodes, one NVLink domain); a peer that
  // it does not reach always gets pack + put-with-signal. 0 (auto): dispatch packs and puts, combine
  // stores its partials in place then signals (measured the faster mix); 1 (put): pack + put for
  // both; 2 (direct): in-place stores + signal for both.
  int transport;
} EphConfig;

// Regions of a context that Python views as tensors.
enum {
  EPH_RECV_X = 0,
  EPH_RECV_SCALES = 1,
  EPH_RECV_IDX = 2,
  EPH_RECV_W = 3,
  EPH_COMBINE_IN = 4,
  EPH_NUM_RECV = 5,
  EPH_EXPERT_COUNTS = 6,
};

// Bytes of symmetric heap that eph_create needs for cfg (-1 for a bad config); NVSHMEM_SYMMETRIC_SIZE
// must cover it (plus NVSHMEM's own use) before epn_init.
long long eph_symmetric_bytes(const EphConfig* cfg);

// Collective (every PE, same cfg apart from rank/device): the symmetric buffers, the NVLink
// pointers to the GPUs of this PE's node, the local layout buffers. Needs epn_init first.
int eph_create(const EphConfig* cfg, void** ctx);

// Pointer and size of one region (EPH_*).
int eph_region(void* ctx, int which, void** ptr, long long* bytes);

// Enqueues layout, count exchange and dispatch on `stream` (nothing waits on the host). num_sms
// blocks, send_blocks of them put rows to other nodes (1 .. num_sms - 1 when there are several
// nodes; ignored on one node); chunk: rows per put and per signal. epoch: grows by one per call,
// the same on every PE.
int eph_dispatch(void* ctx, const void* x, const void* scales, const void* topk_idx, const void* topk_w,
                 int num_tokens, int num_sms, int send_blocks, int chunk, long long epoch, void* stream);

// Enqueues the combine of the last dispatch (same epoch, same topk_idx/topk_w/num_tokens) into
// out (bf16 [num_tokens, hidden]); send_blocks of num_sms blocks reduce and put the partials for
// other nodes' tokens.
int eph_combine(void* ctx, void* out, const void* topk_idx, const void* topk_w, int num_tokens, int num_sms,
                int send_blocks, long long epoch, void* stream);

// The host-mapped word that a kernel sets when a wait timed out (read without synchronising).
void* eph_error_flag_ptr(void* ctx);

// 1 and (rank, peer, phase) when a wait timed out, else 0.
int eph_poll_error(void* ctx, int* rank, int* peer, int* phase);

// Collective: waits for the device, a barrier, then frees everything.
int eph_destroy(void* ctx);

#ifdef __cplusplus
}
#endif
