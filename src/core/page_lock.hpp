// How much memory this process may page-lock (mlock): RLIMIT_MEMLOCK's soft limit applies unless
// the process holds CAP_IPC_LOCK in its effective capability set (root usually does; a container's
// root does not by default) or the limit is unlimited. One answer for the pinned pool, the
// profile's pool sizing and `strata info`.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata {

struct PageLockLimit {
  bool applies = false;          // false: unlimited, or CAP_IPC_LOCK lifts it
  std::uint64_t bytes = ~0ULL;   // the soft limit when it applies, else ~0
  std::uint64_t rlimit = ~0ULL;  // RLIMIT_MEMLOCK's soft limit (~0 = unlimited or unknown)
  bool cap_ipc_lock = false;     // the process holds CAP_IPC_LOCK
};

// This process's limit, from getrlimit and /proc/self/status.
PageLockLimit page_lock_limit();

// Whether a /proc/<pid>/status text grants CAP_IPC_LOCK (bit 14 of its CapEff line); false for a
// missing or unreadable line.
bool cap_ipc_lock_in(std::string_view status_text);

}  // namespace strata
