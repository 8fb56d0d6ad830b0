#include "core/page_lock.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string>

namespace strata {

bool cap_ipc_lock_in(std::string_view status_text) {
  constexpr std::string_view kKey = "CapEff:";
  std::size_t at = 0;
  while (at < status_text.size()) {
    const std::size_t end = std::min(status_text.find('\n', at), status_text.size());
    std::string_view line = status_text.substr(at, end - at);
    at = end + 1;
    if (line.substr(0, kKey.size()) != kKey) continue;
    line.remove_prefix(kKey.size());
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
    std::uint64_t caps = 0;
    const auto [p, ec] = std::from_chars(line.data(), line.data() + line.size(), caps, 16);
    if (ec != std::errc() || p == line.data()) return false;
    return (caps >> 14) & 1;  // CAP_IPC_LOCK
  }
  return false;
}

PageLockLimit page_lock_limit() {
  PageLockLimit l;
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    l.rlimit = static_cast<std::uint64_t>(rl.rlim_cur);
  std::ifstream status("/proc/self/status");
  std::stringstream text;
  text << status.rdbuf();
  l.cap_ipc_lock = cap_ipc_lock_in(text.str());
  l.applies = l.rlimit != ~0ULL && !l.cap_ipc_lock;
  if (l.applies) l.bytes = l.rlimit;
  return l;
}

}  // namespace strata
