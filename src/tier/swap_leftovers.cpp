// find_swap_leftovers(): what killed strata processes left under a swap path (see
// src/tier/swap_space.hpp for the contract).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>

#include "core/safe_fs.hpp"
#include "strata/error.hpp"
#include "tier/swap_space.hpp"

namespace strata {
namespace {

struct Parsed {
  long pid = 0;
  bool directory = true;  // a per-run swap directory, else a bench io file
};

bool all_digits(std::string_view s) {
  if (s.empty() || s.size() > 10) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

bool all_hex(std::string_view s) {
  if (s.empty() || s.size() > 32) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

long to_pid(std::string_view s) {
  long v = 0;
  for (char c : s) v = v * 10 + (c - '0');
  return v;
}

// Splits "a-b-c" on '-'.
std::vector<std::string_view> split_dash(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t b = 0;
  for (std::size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '-') {
      out.push_back(s.substr(b, i - b));
      b = i + 1;
    }
  }
  return out;
}

// "strata-swap-<pid>-r<rank>-<hex>", "strata-swap-r<rank>-<pid>-<hex>" (before 0.2),
// ".strata-bench-io-<pid>-<hex>".
std::optional<Parsed> parse_name(std::string_view name) {
  constexpr std::string_view kSwap = "strata-swap-";
  constexpr std::string_view kBench = ".strata-bench-io-";
  if (name.substr(0, kSwap.size()) == kSwap) {
    auto p = split_dash(name.substr(kSwap.size()));
    if (p.size() != 3 || !all_hex(p[2])) return std::nullopt;
    auto is_rank = [](std::string_view r) {
      return r.size() > 1 && r[0] == 'r' && all_digits(r.substr(1));
    };
    if (all_digits(p[0]) && is_rank(p[1])) return Parsed{to_pid(p[0]), true};
    if (is_rank(p[0]) && all_digits(p[1])) return Parsed{to_pid(p[1]), true};
    return std::nullopt;
  }
  if (name.substr(0, kBench.size()) == kBench) {
    auto p = split_dash(name.substr(kBench.size()));
    if (p.size() != 2 || !all_digits(p[0]) || !all_hex(p[1])) return std::nullopt;
    return Parsed{to_pid(p[0]), false};
  }
  return std::nullopt;
}

// True when a process with this pid exists (as far as this pid namespace can tell).
bool process_alive(long pid) {
  if (pid <= 0) return true;  // never treat a nonsense pid as dead
  if (::kill(static_cast<pid_t>(pid), 0) == 0) return true;
  return errno != ESRCH;  // EPERM: it exists, owned by someone else
}

std::uint64_t allocated(const struct stat& st) {
  return static_cast<std::uint64_t>(st.st_blocks) * 512;
}

// Lists a per-run directory (open as `fd`): its regular files into `files`, their allocated
// bytes into l.bytes. False (l marked failed) when it holds a directory.
bool list_run_dir(int fd, SwapLeftover& l, std::vector<std::string>& files) {
  const int dfd = ::openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw IoError("open", l.path, 0, 0, errno);
  UniqueFd list_fd(dfd);
  // Listed by hand: SafeDir would refuse another user's directory, which root may clean.
  DIR* d = ::fdopendir(list_fd.release());
  if (!d) throw IoError("opendir", l.path, 0, 0, errno);
  while (const dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n == "." || n == "..") continue;
    struct stat fst {};
    if (::fstatat(fd, e->d_name, &fst, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(fst.st_mode)) {
      ::closedir(d);
      l.status = SwapLeftover::Status::kFailed;
      l.detail = strcat("it holds a directory (", n, "); not removing it");
      return false;
    }
    l.bytes += allocated(fst);
    files.emplace_back(n);
  }
  ::closedir(d);
  return true;
}

// Examines (and with `remove`, removes) one entry `name` of `dir`.
SwapLeftover examine(const SafeDir& dir, const std::string& name, const Parsed& parsed,
                     const struct stat& st, bool remove) {
  SwapLeftover l;
  l.path = dir.child_path(name);
  l.pid = parsed.pid;
  l.uid = st.st_uid;
  const uid_t me = ::geteuid();
  if (st.st_uid != me && me != 0) {
    l.status = SwapLeftover::Status::kOtherUser;
    l.detail = strcat("owned by uid ", st.st_uid, "; only its owner or root can remove it");
    return l;
  }
  if (process_alive(parsed.pid)) {
    l.status = SwapLeftover::Status::kRunning;
    l.detail = strcat("process ", parsed.pid, " is running");
    return l;
  }
  try {
    // The entry's own lock: a live owner in another pid namespace still holds it.
    UniqueFd fd;
    if (parsed.directory) {
      // Not SafeDir::open_dir: root may clean another user's directory, which open_dir refuses.
      fd = dir.open_file(name, O_RDONLY | O_DIRECTORY);
    } else {
      fd = dir.open_file(name, O_RDONLY | O_NONBLOCK);
    }
    struct stat now {};
    if (::fstat(fd.get(), &now) != 0) throw IoError("fstat", l.path, 0, 0, errno);
    if (now.st_dev != st.st_dev || now.st_ino != st.st_ino) {
      l.status = SwapLeftover::Status::kFailed;
      l.detail = "it changed while being examined";
      return l;
    }
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) {
        l.status = SwapLeftover::Status::kRunning;
        l.detail = "in use (locked by a running process)";
        return l;
      }
      throw IoError("flock", l.path, 0, 0, errno);
    }
    // Inside a per-run directory: only regular files (swap.bin), removed by name through the
    // directory's fd; anything else is left for a person to look at.
    std::vector<std::string> files;
    if (parsed.directory) {
      if (!list_run_dir(fd.get(), l, files)) return l;
    } else {
      l.bytes = allocated(now);
    }
    if (!remove) {
      l.status = SwapLeftover::Status::kWouldRemove;
      return l;
    }
    for (const auto& f : files) {
      if (::unlinkat(fd.get(), f.c_str(), 0) != 0 && errno != ENOENT)
        throw IoError("unlink", l.path + "/" + f, 0, 0, errno);
    }
    const int err = dir.try_remove(name, parsed.directory);
    if (err != 0 && err != ENOENT)
      throw IoError(parsed.directory ? "rmdir" : "unlink", l.path, 0, 0, err);
    l.status = SwapLeftover::Status::kRemoved;
  } catch (const std::exception& e) {
    l.status = SwapLeftover::Status::kFailed;
    l.detail = e.what();
  }
  return l;
}

}  // namespace

const char* swap_leftover_status_name(SwapLeftover::Status s) {
  switch (s) {
    case SwapLeftover::Status::kRemoved: return "removed";
    case SwapLeftover::Status::kWouldRemove: return "would remove";
    case SwapLeftover::Status::kRunning: return "kept: running";
    case SwapLeftover::Status::kOtherUser: return "kept: another user's";
    case SwapLeftover::Status::kFailed: return "failed";
  }
  return "?";
}

std::vector<SwapLeftover> find_swap_leftovers(const std::string& path, bool remove) {
  std::vector<SwapLeftover> out;
  const std::string norm = normalize_path(path);
  // `path` may name one per-run directory itself: examine it from its parent.
  const auto slash = norm.rfind('/');
  const std::string base = slash == std::string::npos ? norm : norm.substr(slash + 1);
  if (auto parsed = parse_name(base)) {
    const std::string parent = slash == std::string::npos ? "."
                               : slash == 0               ? "/"
                                                          : norm.substr(0, slash);
    SafeDir dir = SafeDir::open(parent, {.role = "swap path"});
    struct stat st {};
    if (!dir.stat_entry(base, &st)) throw IoError("stat", norm, 0, 0, ENOENT);
    if (parsed->directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))
      fail(ErrorCode::kInvalidArgument, strcat(norm, " is not a strata swap directory or file"));
    out.push_back(examine(dir, base, *parsed, st, remove));
    return out;
  }
  SafeDir dir = SafeDir::open(path, {.role = "swap path"});
  const long self = static_cast<long>(::getpid());
  for (const auto& name : dir.entries()) {
    auto parsed = parse_name(name);
    if (!parsed || parsed->pid == self) continue;  // not ours, or this process's own
    struct stat st {};
    try {
      if (!dir.stat_entry(name, &st)) continue;  // gone meanwhile
    } catch (const std::exception&) {
      continue;
    }
    if (parsed->directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) continue;
    out.push_back(examine(dir, name, *parsed, st, remove));
  }
  return out;
}

}  // namespace strata
