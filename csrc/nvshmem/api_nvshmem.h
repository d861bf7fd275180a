// extern "C" API of libepbench_nvshmem.so (csrc/nvshmem/nvshmem_boot.cu), called from
// epbench/nvshmem_lib.py through ctypes. Groundwork for multi-node dispatch/combine (issue #5):
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

#ifdef __cplusplus
}
#endif
