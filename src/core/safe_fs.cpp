#include "core/safe_fs.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <unistd.h>

#include <cerrno>
#include <deque>

#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata {
namespace {

constexpr int kMaxSymlinks = 40;  // as the kernel's path walk (ELOOP beyond)

std::vector<std::string> split_components(std::string_view path) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < path.size()) {
    while (i < path.size() && path[i] == '/') ++i;
    std::size_t j = i;
    while (j < path.size() && path[j] != '/') ++j;
    if (j > i) {
      std::string_view c = path.substr(i, j - i);
      if (c != ".") out.emplace_back(c);
    }
    i = j;
  }
  return out;
}

std::string join(const std::string& dir, std::string_view name) {
  std::string out = dir;
  if (out.empty() || out.back() != '/') out += '/';
  out += name;
  return out;
}

std::string parent_of(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return "/";
  return path.substr(0, slash);
}

std::string user_name(uid_t uid) {
  struct passwd pw {};
  struct passwd* result = nullptr;
  char buf[1024];
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &result) == 0 && result && result->pw_name)
    return result->pw_name;
  return "";
}

std::string describe_uid(uid_t uid) {
  std::string name = user_name(uid);
  return name.empty() ? strcat("uid ", uid) : strcat("uid ", uid, " (", name, ")");
}

std::string octal_mode(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

std::string context(const std::string& role, const std::string& what) {
  return role.empty() ? what : role + ": " + what;
}

UniqueFd open_root(const std::string& role) {
  UniqueFd fd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw IoError("open", "/", 0, 0, errno, context(role, "opening the root directory"));
  return fd;
}

struct stat fstat_or_throw(int fd, const std::string& path, const std::string& role) {
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    throw IoError("fstat", path, 0, 0, errno, context(role, "checking a directory"));
  return st;
}

// Throws Error(kInvalidArgument) when the directory open at `fd` is not safe.
void require_safe(int fd, const std::string& dir, const std::string& requested,
                  const std::string& role) {
  const struct stat st = fstat_or_throw(fd, dir, role);
  if (!S_ISDIR(st.st_mode))
    throw IoError("open", dir, 0, 0, ENOTDIR, context(role, "not a directory"));
  const std::string why = unsafe_directory_reason(st);
  if (why.empty()) return;
  std::string msg = context(role, requested);
  msg += ": refusing to create or remove files there: ";
  msg += dir == normalize_path(requested) ? "it" : dir;
  msg += " " + why;
  fail(ErrorCode::kInvalidArgument, msg);
}

std::string read_link(int dirfd, const std::string& name, const std::string& path,
                      const std::string& role) {
  std::string buf(256, '\0');
  for (;;) {
    ssize_t n = ::readlinkat(dirfd, name.c_str(), buf.data(), buf.size());
    if (n < 0)
      throw IoError("readlink", path, 0, 0, errno, context(role, "following a symbolic link"));
    if (static_cast<std::size_t>(n) < buf.size()) {
      buf.resize(static_cast<std::size_t>(n));
      return buf;
    }
    if (buf.size() >= 65536)
      throw IoError("readlink", path, 0, 0, ENAMETOOLONG,
                    context(role, "following a symbolic link"));
    buf.resize(buf.size() * 2);
  }
}

}  // namespace

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string normalize_path(std::string_view path) {
  if (path.empty()) return "";
  const bool absolute = path.front() == '/';
  std::string out;
  for (const auto& c : split_components(path)) {
    if (!out.empty() || absolute) out += '/';
    out += c;
  }
  if (out.empty()) return absolute ? "/" : ".";
  return out;
}

std::string unsafe_directory_reason(const struct stat& st) {
  const uid_t me = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != me) {
    return strcat("is owned by ", describe_uid(st.st_uid), ", not by root or by you (",
                  describe_uid(me),
                  "): its owner could replace what strata creates there with "
                  "symbolic links; use a directory that you or root own");
  }
  const bool sticky = (st.st_mode & S_ISVTX) != 0;
  if (!sticky && (st.st_mode & S_IWOTH)) {
    return strcat("is writable by every user (mode ", octal_mode(st.st_mode),
                  ") and has no sticky bit: another user could replace what strata creates there "
                  "with symbolic links; run chmod o-w on it or use another directory");
  }
  if (!sticky && (st.st_mode & S_IWGRP) && st.st_gid != ::getegid()) {
    return strcat("is writable by group ", st.st_gid, " (mode ", octal_mode(st.st_mode),
                  ") and has no sticky bit: other members could replace what strata creates "
                  "there with symbolic links; run chmod g-w on it or use another directory");
  }
  return "";
}

void check_component(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos ||
      name.find('\0') != std::string_view::npos) {
    fail(ErrorCode::kInvalidArgument,
         strcat("'", name, "' is not a single file name (no '/', not '.' or '..')"));
  }
}

namespace {

// SafeDir::open's walk: one component at a time from "/", through directory fds (O_PATH,
// O_NOFOLLOW), symbolic links resolved here (ELOOP past kMaxSymlinks; one owned by another user
// in a sticky world-writable directory refused), missing directories created on request, and
// every directory on the way checked (unless read-only).
class PathWalk {
 public:
  PathWalk(const std::string& requested, const SafeDirOptions& options)
      : requested_(requested), options_(options), role_(options.role) {}

  // Walks `path` (absolute, normalized); returns the final directory's fd (its real path: at()).
  UniqueFd run(const std::string& path) {
    for (auto& c : split_components(path)) todo_.push_back(std::move(c));
    cur_ = open_root(role_);
    at_ = "/";
    check(cur_.get(), at_);
    while (!todo_.empty()) {
      const std::string name = todo_.front();
      todo_.pop_front();
      if (name == "..")
        go_up();
      else
        enter(name);
    }
    return std::move(cur_);
  }
  const std::string& at() const { return at_; }

 private:
  // A read-only open checks nothing on the way: it creates and removes nothing there.
  void check(int fd, const std::string& dir) {
    if (!options_.read_only) require_safe(fd, dir, requested_, role_);
  }

  void go_up() {
    UniqueFd up(::openat(cur_.get(), "..", O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!up) throw IoError("open", join(at_, ".."), 0, 0, errno, context(role_, requested_));
    at_ = parent_of(at_);
    check(up.get(), at_);
    cur_ = std::move(up);
  }

  void enter(const std::string& name) {
    const std::string here = join(at_, name);
    struct stat st {};
    if (::fstatat(cur_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      const int err = errno;
      if (err == ENOENT && options_.create) return create(name, here);
      throw IoError("stat", here, 0, 0, err, context(role_, requested_));
    }
    if (S_ISLNK(st.st_mode)) return follow_link(name, here, st);
    if (!S_ISDIR(st.st_mode))
      throw IoError("open", here, 0, 0, ENOTDIR,
                    context(role_, strcat(requested_, ": not a directory")));
    UniqueFd next(
        ::openat(cur_.get(), name.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next) {
      const int err = errno;
      if (err == ENOENT || err == ELOOP || err == ENOTDIR) {
        todo_.push_front(name);  // replaced between fstatat and openat: look again
        if (++links_ > kMaxSymlinks)
          throw IoError("open", here, 0, 0, err, context(role_, requested_));
        return;
      }
      throw IoError("open", here, 0, 0, err, context(role_, requested_));
    }
    at_ = here;
    check(next.get(), at_);
    cur_ = std::move(next);
  }

  void create(const std::string& name, const std::string& here) {
    if (::mkdirat(cur_.get(), name.c_str(), 0700) == 0) {
      log_info(context(role_, strcat("created directory ", here, " (mode 0700)")));
    } else if (errno != EEXIST) {
      throw IoError("mkdir", here, 0, 0, errno, context(role_, strcat("creating ", requested_)));
    }
    todo_.push_front(name);  // look again: whatever is there now must pass the checks
  }

  void follow_link(const std::string& name, const std::string& here, const struct stat& st) {
    if (++links_ > kMaxSymlinks)
      throw IoError("open", requested_, 0, 0, ELOOP, context(role_, "too many symbolic links"));
    const struct stat dir = fstat_or_throw(cur_.get(), at_, role_);
    if (!options_.read_only && (dir.st_mode & S_ISVTX) && (dir.st_mode & S_IWOTH) &&
        st.st_uid != 0 && st.st_uid != ::geteuid()) {
      fail(ErrorCode::kInvalidArgument,
           strcat(context(role_, requested_), ": refusing to follow the symbolic link ", here,
                  ": it is owned by ", describe_uid(st.st_uid),
                  " in the world-writable "
                  "directory ",
                  at_, "; use the real directory"));
    }
    const std::string target = read_link(cur_.get(), name, here, role_);
    if (target.empty())
      throw IoError("readlink", here, 0, 0, ENOENT, context(role_, "an empty symbolic link"));
    auto comps = split_components(target);
    for (auto it = comps.rbegin(); it != comps.rend(); ++it) todo_.push_front(*it);
    if (target.front() == '/') {
      cur_ = open_root(role_);
      at_ = "/";
    }
  }

  const std::string& requested_;
  const SafeDirOptions& options_;
  const std::string& role_;
  std::deque<std::string> todo_;  // the components still to walk
  UniqueFd cur_;                  // the directory reached so far
  std::string at_;                // the real path of cur_
  int links_ = 0;                 // symbolic links followed (and races retried)
};

}  // namespace

SafeDir SafeDir::open(const std::string& requested, const SafeDirOptions& options) {
  const std::string& role = options.role;
  if (options.read_only && options.create)
    fail(ErrorCode::kInternal,
         context(role, "SafeDir::open: create through a directory opened read-only"));
  if (requested.empty()) fail(ErrorCode::kInvalidArgument, context(role, "an empty path"));
  if (requested.find('\0') != std::string::npos)
    fail(ErrorCode::kInvalidArgument, context(role, "a path with a NUL byte"));
  std::string path = normalize_path(requested);
  if (path.front() != '/') {
    std::string cwd(4096, '\0');
    if (!::getcwd(cwd.data(), cwd.size()))
      throw IoError("getcwd", ".", 0, 0, errno, context(role, strcat("resolving ", requested)));
    cwd.resize(std::char_traits<char>::length(cwd.c_str()));
    path = normalize_path(cwd + "/" + path);
  }
  PathWalk walk(requested, options);
  UniqueFd cur = walk.run(path);
  UniqueFd dir(::openat(cur.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir) throw IoError("open", walk.at(), 0, 0, errno, context(role, requested));
  return SafeDir(std::move(dir), walk.at(), options.read_only);
}

void SafeDir::require_writable(const char* op, std::string_view name) const {
  if (read_only_)
    fail(ErrorCode::kInternal,
         strcat(op, " of ", child_path(name), " through a directory opened read-only"));
}

std::string SafeDir::child_path(std::string_view name) const { return join(path_, name); }

UniqueFd SafeDir::create_file(std::string_view name, int flags, mode_t mode) const {
  check_component(name);
  require_writable("create", name);
  const std::string n(name);
  int fd;
  do {
    fd = ::openat(fd_.get(), n.c_str(), flags | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw IoError("open", child_path(name), 0, 0, errno, "creating a new file (O_EXCL)");
  return UniqueFd(fd);
}

UniqueFd SafeDir::open_file(std::string_view name, int flags) const {
  check_component(name);
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_CREAT)) != 0)
    require_writable("open for writing", name);
  const std::string n(name);
  int fd;
  do {
    fd = ::openat(fd_.get(), n.c_str(), flags | O_NOFOLLOW | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw IoError("open", child_path(name), 0, 0, errno);
  return UniqueFd(fd);
}

SafeDir SafeDir::make_dir(std::string_view name, mode_t mode) const {
  check_component(name);
  require_writable("mkdir", name);
  const std::string n(name);
  if (::mkdirat(fd_.get(), n.c_str(), mode) != 0)
    throw IoError("mkdir", child_path(name), 0, 0, errno, "creating a new directory");
  SafeDir d = open_dir(name);
  if (d.status().st_uid != ::geteuid())
    fail(ErrorCode::kInvalidArgument,
         strcat(d.path(), ": the directory just created is not owned by us (uid ", ::geteuid(),
                "); refusing to use it"));
  return d;
}

SafeDir SafeDir::open_dir(std::string_view name) const {
  check_component(name);
  const std::string n(name);
  const std::string p = child_path(name);
  UniqueFd fd(::openat(fd_.get(), n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) throw IoError("open", p, 0, 0, errno);
  if (!read_only_) require_safe(fd.get(), p, p, "");
  return SafeDir(std::move(fd), p, read_only_);
}

void SafeDir::remove_file(std::string_view name) const {
  require_writable("unlink", name);
  if (int err = try_remove(name, false)) throw IoError("unlink", child_path(name), 0, 0, err);
}

void SafeDir::remove_dir(std::string_view name) const {
  require_writable("rmdir", name);
  if (int err = try_remove(name, true)) throw IoError("rmdir", child_path(name), 0, 0, err);
}

int SafeDir::try_remove(std::string_view name, bool directory) const noexcept {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos)
    return EINVAL;
  if (read_only_) return EROFS;
  try {
    const std::string n(name);
    return ::unlinkat(fd_.get(), n.c_str(), directory ? AT_REMOVEDIR : 0) == 0 ? 0 : errno;
  } catch (...) {
    return ENOMEM;
  }
}

void SafeDir::rename(std::string_view from, std::string_view to) const {
  check_component(from);
  check_component(to);
  require_writable("rename", from);
  const std::string f(from), t(to);
  if (::renameat(fd_.get(), f.c_str(), fd_.get(), t.c_str()) != 0)
    throw IoError("rename", child_path(from), 0, 0, errno, strcat("to ", child_path(to)));
}

void SafeDir::sync() const {
  if (::fsync(fd_.get()) != 0) throw IoError("fsync", path_, 0, 0, errno, "syncing the directory");
}

bool SafeDir::stat_entry(std::string_view name, struct stat* st) const {
  check_component(name);
  const std::string n(name);
  if (::fstatat(fd_.get(), n.c_str(), st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno == ENOENT) return false;
  throw IoError("stat", child_path(name), 0, 0, errno);
}

void SafeDir::check_replaceable(std::string_view name, bool overwrite) const {
  struct stat st {};
  if (!stat_entry(name, &st)) return;
  if (!overwrite)
    fail(ErrorCode::kInvalidArgument,
         strcat(child_path(name), " exists; pass --overwrite to replace it"));
  if (S_ISREG(st.st_mode)) return;
  const char* what = S_ISCHR(st.st_mode)    ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                     : S_ISLNK(st.st_mode)  ? "a symbolic link"
                                            : "not a regular file";
  fail(ErrorCode::kInvalidArgument,
       strcat(child_path(name), " is ", what, "; --overwrite replaces only a regular file"));
}

struct stat SafeDir::status() const {
  return fstat_or_throw(fd_.get(), path_, "");
}

std::vector<std::string> SafeDir::entries() const {
  int fd = ::openat(fd_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError("open", path_, 0, 0, errno, "listing the directory");
  DIR* d = ::fdopendir(fd);
  if (!d) {
    const int err = errno;
    ::close(fd);
    throw IoError("opendir", path_, 0, 0, err, "listing the directory");
  }
  std::vector<std::string> out;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n != "." && n != "..") out.emplace_back(n);
    errno = 0;
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) throw IoError("readdir", path_, 0, 0, err, "listing the directory");
  return out;
}

}  // namespace strata
