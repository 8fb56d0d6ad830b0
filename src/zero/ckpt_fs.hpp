// Directory-relative file operations for checkpoints. TEMPORARY: a minimal stand-in with the
// interface of core/safe_fs.hpp (SafeDir), replaced by it once that lands on main.
#pragma once

#include <sys/stat.h>

#include <string>
#include <string_view>
#include <vector>

namespace strata::zero::ckptfs {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

struct SafeDirOptions {
  bool create = false;
  std::string role;
};

class SafeDir {
 public:
  SafeDir() = default;
  SafeDir(SafeDir&&) noexcept = default;
  SafeDir& operator=(SafeDir&&) noexcept = default;
  static SafeDir open(const std::string& path, const SafeDirOptions& options = {});
  int fd() const noexcept { return fd_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(fd_); }
  const std::string& path() const noexcept { return path_; }
  std::string child_path(std::string_view name) const;
  UniqueFd create_file(std::string_view name, int flags, mode_t mode = 0600) const;
  UniqueFd open_file(std::string_view name, int flags) const;
  void remove_file(std::string_view name) const;
  int try_remove(std::string_view name, bool directory) const noexcept;
  void rename(std::string_view from, std::string_view to) const;
  void sync() const;
  bool stat_entry(std::string_view name, struct stat* st) const;
  std::vector<std::string> entries() const;

 private:
  SafeDir(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

}  // namespace strata::zero::ckptfs
