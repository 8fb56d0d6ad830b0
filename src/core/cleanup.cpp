#include "strata/cleanup.hpp"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "strata/error.hpp"

namespace strata {
namespace {

// Slot states. A slot moves kFree -> kBusy (claimed by a registering thread) -> kReady, and back
// kReady -> kBusy -> kFree when unregistered. run_signal_cleanup() claims kReady slots (-> kBusy)
// and leaves them claimed, so an owner that unregisters concurrently never closes a descriptor
// the handler is using.
enum : int { kFree = 0, kBusy = 1, kReady = 2 };

struct Slot {
  std::atomic<int> state{kFree};
  int dirfd = -1;
  bool directory = false;
  char name[256] = {};
};

static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");

Slot g_slots[kMaxCleanupEntries];
std::atomic<std::size_t> g_count{0};
std::atomic<bool> g_ending{false};  // run_signal_cleanup(true) began
std::atomic<int> g_creating{0};     // CleanupCreation objects alive

int remove_pass(bool directories) noexcept {
  int removed = 0;
  for (std::size_t i = kMaxCleanupEntries; i-- > 0;) {
    Slot& s = g_slots[i];
    int expected = kReady;
    if (!s.state.compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) continue;
    if (s.directory != directories) {  // the other pass's
      s.state.store(kReady, std::memory_order_release);
      continue;
    }
    if (::unlinkat(s.dirfd, s.name, directories ? AT_REMOVEDIR : 0) == 0) ++removed;
  }
  return removed;
}

}  // namespace

CleanupRegistration::CleanupRegistration(int dirfd, const std::string& name, bool directory) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos || name.size() >= sizeof(Slot::name))
    fail(ErrorCode::kInvalidArgument, strcat("cleanup: '", name, "' is not a single file name"));
  const int fd = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw IoError("dup", name, 0, 0, errno, "registering a file for removal on a signal");
  for (std::size_t i = 0; i < kMaxCleanupEntries; ++i) {
    Slot& s = g_slots[i];
    int expected = kFree;
    if (!s.state.compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) continue;
    s.dirfd = fd;
    s.directory = directory;
    std::memcpy(s.name, name.c_str(), name.size() + 1);
    s.state.store(kReady, std::memory_order_release);
    g_count.fetch_add(1, std::memory_order_relaxed);
    slot_ = static_cast<int>(i);
    return;
  }
  ::close(fd);
  fail(ErrorCode::kOutOfMemory, strcat("cleanup: more than ", kMaxCleanupEntries,
                                       " files registered for removal on a signal"));
}

CleanupRegistration::CleanupRegistration(CleanupRegistration&& other) noexcept
    : slot_(other.slot_) {
  other.slot_ = -1;
}

CleanupRegistration& CleanupRegistration::operator=(CleanupRegistration&& other) noexcept {
  if (this != &other) {
    reset();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

CleanupRegistration::~CleanupRegistration() { reset(); }

void CleanupRegistration::reset() noexcept {
  if (slot_ < 0) return;
  Slot& s = g_slots[slot_];
  slot_ = -1;
  int expected = kReady;
  // When the signal handler has claimed the slot, leave it (and its fd) alone.
  if (!s.state.compare_exchange_strong(expected, kBusy, std::memory_order_acq_rel)) return;
  ::close(s.dirfd);
  s.dirfd = -1;
  g_count.fetch_sub(1, std::memory_order_relaxed);
  s.state.store(kFree, std::memory_order_release);
}

int run_signal_cleanup(bool process_ending) noexcept {
  if (process_ending) g_ending.store(true);  // (seq_cst: before the passes below)
  const int saved = errno;
  int removed = remove_pass(false);
  removed += remove_pass(true);
  // Creations in progress on other threads: each finds g_ending set once its file exists and
  // removes the file itself. Bounded: the handler may run on such a thread.
  const timespec tick{0, 1000000};  // 1 ms; nanosleep is async-signal-safe
  for (int i = 0; process_ending && i < 2000 && g_creating.load() > 0; ++i)
    ::nanosleep(&tick, nullptr);
  errno = saved;
  return removed;
}

CleanupCreation::CleanupCreation() noexcept { g_creating.fetch_add(1); }
CleanupCreation::~CleanupCreation() { g_creating.fetch_sub(1); }

bool signal_cleanup_ending() noexcept { return g_ending.load(); }

std::size_t registered_cleanup_entries() noexcept {
  return g_count.load(std::memory_order_relaxed);
}

}  // namespace strata
