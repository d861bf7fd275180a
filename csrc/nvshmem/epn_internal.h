// Shared by the files of libepbench_nvshmem.so (not part of the ctypes API).
#pragma once

// Records the message that epn_last_error() returns and returns -1.
int epn_fail(const char* fmt, ...);
