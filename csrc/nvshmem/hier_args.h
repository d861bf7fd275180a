// Host-side checks of the arguments of eph_dispatch and eph_combine (hier_dispatch.cu, hier_combine.cu).
// Plain C++ with no CUDA and no NVSHMEM, so that tests/test_hier_args.py can compile it with the host
// compiler on a machine without either.
//
// A rank whose call is refused here launches nothing, so every other rank waits for it in the count
// exchange until its timeout and then names it (phase 11): a check here must never refuse a call that
// is valid on one rank alone. Example (2026-11-26, 4 x H200): an fp8 dispatch of 0 tokens has empty x
// and scale tensors, whose data_ptr() is 0; the scales check refused it, and every other rank reported
// "gave up after 10 s waiting for rank 1 in hierarchical count exchange".
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdio>

namespace eph {

struct CallArgs {
  const char* who;    // "eph_dispatch" or "eph_combine", the first word of a message
  int num_tokens;     // this rank's tokens (0 is valid: its pointers may then be null)
  int max_tokens;     // the context's
  int nodes;          // N
  int num_sms;        // blocks
  int send_blocks;    // blocks that feed other nodes (ignored on one node)
  int chunk;          // rows per put and per signal (dispatch only; pass 1 for combine)
  bool needs_scales;  // fp8 rows (dispatch only)
  bool has_scales;    // the scales pointer is not null
};

inline int args_fail(char* msg, size_t cap, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, cap, fmt, ap);
  va_end(ap);
  return -1;
}

// 0 with *blocks = the sending blocks to launch (0 on one node), or -1 with the reason in msg.
inline int check_call(const CallArgs& a, int* blocks, char* msg, size_t cap) {
  if (a.num_tokens < 0 || a.num_tokens > a.max_tokens)
    return args_fail(msg, cap, "%s: %d tokens (0..%d)", a.who, a.num_tokens, a.max_tokens);
  if (a.chunk < 1 || a.chunk > 1024) return args_fail(msg, cap, "%s: chunk %d (1..1024)", a.who, a.chunk);
  if (a.nodes > 1 && (a.send_blocks < 1 || a.send_blocks >= a.num_sms))
    return args_fail(msg, cap, "%s: %d sending blocks of %d: need 1 .. num_sms - 1", a.who, a.send_blocks,
                     a.num_sms);
  const int send = a.nodes > 1 ? a.send_blocks : 0;
  if (a.num_sms < 1 + send) return args_fail(msg, cap, "%s: num_sms %d", a.who, a.num_sms);
  // No token, no scale row to read: an empty scale tensor's pointer is null (as in dispatch.cu).
  if (a.needs_scales && !a.has_scales && a.num_tokens > 0)
    return args_fail(msg, cap, "%s: fp8 needs scales (%d tokens)", a.who, a.num_tokens);
  *blocks = send;
  return 0;
}

}  // namespace eph
