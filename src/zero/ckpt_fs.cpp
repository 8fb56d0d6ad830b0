// TEMPORARY stand-in for core/safe_fs (see ckpt_fs.hpp).
#include "zero/ckpt_fs.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "strata/error.hpp"

namespace strata::zero::ckptfs {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

SafeDir SafeDir::open(const std::string& path, const SafeDirOptions& options) {
  if (options.create) {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) throw IoError("mkdir", path, 0, 0, ec.value(), options.role);
  }
  int fd = ::open(path.c_str(), O_DIRECTORY | O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("open", path, 0, 0, errno, options.role);
  return SafeDir(UniqueFd(fd), path);
}

std::string SafeDir::child_path(std::string_view name) const { return path_ + "/" + std::string(name); }

UniqueFd SafeDir::create_file(std::string_view name, int flags, mode_t mode) const {
  const std::string n(name);
  int fd = ::openat(fd_.get(), n.c_str(), O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | flags, mode);
  if (fd < 0) throw IoError("open", child_path(name), 0, 0, errno, "create");
  return UniqueFd(fd);
}

UniqueFd SafeDir::open_file(std::string_view name, int flags) const {
  const std::string n(name);
  int fd = ::openat(fd_.get(), n.c_str(), O_NOFOLLOW | O_CLOEXEC | flags);
  if (fd < 0) throw IoError("open", child_path(name), 0, 0, errno);
  return UniqueFd(fd);
}

void SafeDir::remove_file(std::string_view name) const {
  if (int e = try_remove(name, false)) throw IoError("unlink", child_path(name), 0, 0, e);
}

int SafeDir::try_remove(std::string_view name, bool directory) const noexcept {
  const std::string n(name);
  return ::unlinkat(fd_.get(), n.c_str(), directory ? AT_REMOVEDIR : 0) == 0 ? 0 : errno;
}

void SafeDir::rename(std::string_view from, std::string_view to) const {
  const std::string f(from), t(to);
  if (::renameat(fd_.get(), f.c_str(), fd_.get(), t.c_str()) != 0)
    throw IoError("rename", child_path(from), 0, 0, errno, "to " + child_path(to));
}

void SafeDir::sync() const {
  if (::fsync(fd_.get()) != 0) throw IoError("fsync", path_, 0, 0, errno);
}

bool SafeDir::stat_entry(std::string_view name, struct stat* st) const {
  const std::string n(name);
  if (::fstatat(fd_.get(), n.c_str(), st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno == ENOENT) return false;
  throw IoError("stat", child_path(name), 0, 0, errno);
}

std::vector<std::string> SafeDir::entries() const {
  std::vector<std::string> out;
  int fd = ::openat(fd_.get(), ".", O_DIRECTORY | O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError("opendir", path_, 0, 0, errno);
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    throw IoError("opendir", path_, 0, 0, errno);
  }
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

}  // namespace strata::zero::ckptfs
