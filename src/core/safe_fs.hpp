// Safe file handling in directories that other local users may be able to reach (internal header,
// not part of the public API). Used for swap files, checkpoints and benchmark files.
//
// The threat: strata often runs as root on shared machines, with paths such as /tmp/strata-nvme.
// If another user can write a directory on the way to one of our files, they can replace a
// component with a symbolic link between our check and our use, and make us write or delete
// files of their choosing. The rules (docs/errors.md, "Files strata creates"):
//
//   - A directory is opened by walking from "/" one component at a time with
//     openat(O_DIRECTORY | O_NOFOLLOW); every later operation is relative to that fd (openat,
//     mkdirat, unlinkat, renameat), so the path is never resolved again.
//   - Every directory on the way (and the final one) must be *safe*: owned by root or by the
//     effective uid, and not writable by other users unless the sticky bit is set (/tmp). Group
//     write counts as "other users" unless the group is the caller's effective gid.
//   - A symbolic link on the way is followed (by reading it and walking its target the same way)
//     only when the directory holding it is safe and, if that directory is sticky and
//     world-writable, the link belongs to root or to us (as fs.protected_symlinks does).
//   - Files are created with O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode 0600; directories
//     with mkdirat mode 0700. A name is always one component (no '/', not "." or "..").
//   - Trailing and repeated slashes and "." components are removed before anything is checked
//     ("link/" is the same as "link").
//
// Failures: an unsafe directory throws Error(kInvalidArgument) naming the path, the component,
// and why (owner uid, mode); a syscall failure throws IoError naming the op, the path and errno
// (IoError::exit_code() is 2 for path errors such as ENOENT, EACCES, ENOTDIR, ELOOP, EEXIST).
// Thread-safety: SafeDir is an immutable fd owner; its const members may be called from any
// thread. UniqueFd is a plain owner.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

namespace strata {

// Owns a file descriptor (closed on destruction). Move-only.
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

// "a//b/./c/" -> "a/b/c"; "/x/" -> "/x"; "/" and "//" -> "/"; "" -> "". ".." is kept.
std::string normalize_path(std::string_view path);

// Why a directory with this status is not safe to create or remove private files in, or "" when
// it is safe (rules above). `st` must describe a directory.
std::string unsafe_directory_reason(const struct stat& st);

// Throws Error(kInvalidArgument) when `name` is not a single path component.
void check_component(std::string_view name);

struct SafeDirOptions {
  // Create missing directories on the way (mkdirat mode 0700, like `mkdir -p`), logging each.
  bool create = false;
  // What the path is, for messages: "tiers.nvme.paths", "--checkpoint-dir", "bench io --dir".
  std::string role;
  // Only reads will be made through the SafeDir, and what is read is only reported (`strata
  // checkpoint info` / `verify`): the directories on the way need not be safe (they may belong
  // to another user) and symbolic links are followed wherever they are, since nothing is created
  // or removed there. Not for what a load or an export reads: another user who can write a
  // directory on the way could swap in a checkpoint of their choosing. The SafeDir (and what
  // open_dir gives from it) then refuses every call that would write: create_file, make_dir,
  // remove_*, rename, open_file for writing (Error kInternal: a caller's bug), try_remove
  // (EROFS). REQUIRES: !create.
  bool read_only = false;
};

// A directory opened safely (see the rules above), and operations relative to it.
class SafeDir {
 public:
  SafeDir() = default;
  SafeDir(SafeDir&&) noexcept = default;
  SafeDir& operator=(SafeDir&&) noexcept = default;

  // Opens `path` (relative paths are taken from the current directory). Throws as described at
  // the top of this file; ENOENT without options.create is an IoError("open", path, ENOENT).
  static SafeDir open(const std::string& path, const SafeDirOptions& options = {});

  int fd() const noexcept { return fd_.get(); }
  explicit operator bool() const noexcept { return static_cast<bool>(fd_); }
  const std::string& path() const noexcept { return path_; }  // absolute, normalised
  std::string child_path(std::string_view name) const;        // path() + "/" + name

  // openat(O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | flags, mode). EEXIST is an IoError.
  UniqueFd create_file(std::string_view name, int flags, mode_t mode = 0600) const;
  // openat(O_NOFOLLOW | O_CLOEXEC | flags): a symlink at `name` fails with ELOOP.
  UniqueFd open_file(std::string_view name, int flags) const;
  // mkdirat(name, mode) (EEXIST is an IoError), then open_dir(name); the new directory must be
  // ours (checked on the opened fd).
  SafeDir make_dir(std::string_view name, mode_t mode = 0700) const;
  // openat(O_DIRECTORY | O_NOFOLLOW) and the safety check on the opened fd (none when this
  // SafeDir is read-only; the result is read-only too).
  SafeDir open_dir(std::string_view name) const;
  bool read_only() const noexcept { return read_only_; }

  void remove_file(std::string_view name) const;  // unlinkat(name, 0); IoError on failure
  void remove_dir(std::string_view name) const;   // unlinkat(name, AT_REMOVEDIR)
  // Like the two above but never throws: returns 0, or the errno (ENOENT included).
  int try_remove(std::string_view name, bool directory) const noexcept;
  // renameat(fd, from, fd, to): an atomic replace of `to` within this directory.
  void rename(std::string_view from, std::string_view to) const;
  void sync() const;  // fsync of the directory (makes creations, renames, removals durable)

  // fstatat(name, AT_SYMLINK_NOFOLLOW); false when it does not exist. Other errors throw.
  bool stat_entry(std::string_view name, struct stat* st) const;
  struct stat status() const;  // fstat of the directory itself
  // Before a file is written as a temporary and renamed onto `name`: an existing `name` is
  // refused unless `overwrite` ("exists; pass --overwrite to replace it"), and even with it
  // unless it is a regular file (a device node, FIFO, socket, directory or symbolic link is never
  // replaced). Error(kInvalidArgument) naming the entry and what it is.
  void check_replaceable(std::string_view name, bool overwrite) const;
  // Names in the directory, without "." and "..", in no particular order.
  std::vector<std::string> entries() const;

 private:
  SafeDir(UniqueFd fd, std::string path, bool read_only)
      : fd_(std::move(fd)), path_(std::move(path)), read_only_(read_only) {}
  void require_writable(const char* op, std::string_view name) const;
  UniqueFd fd_;
  std::string path_;
  bool read_only_ = false;
};

}  // namespace strata
