#include "strata/io_file.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"

namespace strata {

namespace {

bool fd_on_tmpfs(int fd) {
  struct statfs st {};
  if (fstatfs(fd, &st) != 0) return false;
  return static_cast<unsigned long>(st.f_type) == TMPFS_MAGIC;
}

int open_raw(int dirfd, const std::string& name, int flags, unsigned mode) {
  int fd;
  do {
    fd = ::openat(dirfd, name.c_str(), flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

std::uint32_t dio_alignment(int fd) {
#ifdef STATX_DIOALIGN
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_mem_align > 0 && stx.stx_dio_offset_align > 0) {
    return std::max(stx.stx_dio_mem_align, stx.stx_dio_offset_align);
  }
#endif
  (void)fd;
  return 4096;
}

}  // namespace

bool is_tmpfs(const std::string& dir) {
  struct statfs st {};
  if (statfs(dir.c_str(), &st) != 0) return false;
  return static_cast<unsigned long>(st.f_type) == TMPFS_MAGIC;
}

IoFile IoFile::open(const std::string& path, const IoFileOptions& options) {
  return open_at(AT_FDCWD, path, path, options);
}

IoFile IoFile::open_at(int dirfd, const std::string& name, const std::string& path,
                       const IoFileOptions& options) {
  if (dirfd != AT_FDCWD && (name.empty() || name.find('/') != std::string::npos))
    fail(ErrorCode::kInvalidArgument, strcat("io: '", name, "' is not a single file name"));
  int flags = O_CLOEXEC | O_NOFOLLOW | (options.read_only ? O_RDONLY : O_RDWR);
  if (options.create) flags |= O_CREAT;
  if (options.create && options.exclusive) flags |= O_EXCL;
  const std::string op = "open";
  IoFile f;
  f.path_ = path;
  f.read_only_ = options.read_only;

  if (options.direct_io != DirectIoMode::kOff) {
    int fd = open_raw(dirfd, name, flags | O_DIRECT, options.mode);
    int err = errno;
    bool refused = false;
    if (fd >= 0 && fd_on_tmpfs(fd)) {
      // tmpfs "O_DIRECT" is a page-cache copy, not direct I/O: treat it as refused and clear the
      // flag on this fd (no reopen, so O_EXCL keeps its meaning).
      refused = true;
      int fl = fcntl(fd, F_GETFL);
      if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0) {
        err = errno;
        ::close(fd);
        throw IoError(op, path, 0, 0, err, "clearing O_DIRECT");
      }
      if (options.direct_io == DirectIoMode::kRequired) {
        ::close(fd);
        throw IoError(op, path, 0, 0, EINVAL,
                      "O_DIRECT refused: tmpfs has no direct I/O (direct_io: required)");
      }
      log_warn("io: ", path, ": tmpfs has no direct I/O; using buffered I/O");
      f.fd_ = fd;
      return f;
    } else if (fd < 0 && err == EINVAL) {
      refused = true;
    }
    if (fd >= 0) {
      f.fd_ = fd;
      f.direct_ = true;
      f.alignment_ = dio_alignment(fd);
      return f;
    }
    if (!refused) throw IoError(op, path, 0, 0, err);
    if (options.direct_io == DirectIoMode::kRequired)
      throw IoError(op, path, 0, 0, EINVAL,
                    "O_DIRECT refused by the file system (direct_io: required)");
    log_warn("io: ", path, ": the file system refuses O_DIRECT; using buffered I/O");
  }
  int fd = open_raw(dirfd, name, flags, options.mode);
  if (fd < 0 && errno == EEXIST && options.direct_io != DirectIoMode::kOff && (flags & O_EXCL)) {
    // Some file systems create the file before refusing O_DIRECT with EINVAL; open that one.
    fd = open_raw(dirfd, name, flags & ~(O_CREAT | O_EXCL), options.mode);
  }
  if (fd < 0) throw IoError(op, path, 0, 0, errno);
  f.fd_ = fd;
  f.direct_ = false;
  f.alignment_ = 1;
  return f;
}

IoFile::IoFile(IoFile&& other) noexcept { *this = std::move(other); }

IoFile& IoFile::operator=(IoFile&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    direct_ = other.direct_;
    read_only_ = other.read_only_;
    alignment_ = other.alignment_;
    other.fd_ = -1;
  }
  return *this;
}

IoFile::~IoFile() { close(); }

void IoFile::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::uint64_t IoFile::size() const {
  struct stat st {};
  if (fstat(fd_, &st) != 0) throw IoError("fstat", path_, 0, 0, errno);
  return static_cast<std::uint64_t>(st.st_size);
}

void IoFile::allocate(std::uint64_t length, std::uint64_t offset) {
  if (length == 0) return;
  int r;
  do {
    r = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (r != 0 && errno == EINTR);
  if (r == 0) return;
  int err = errno;
  if (err == EOPNOTSUPP) {
    if (offset + length > size()) truncate(offset + length);
    return;
  }
  if (err == ENOSPC) {
    std::string free_text = "unknown";
    struct statvfs vs {};
    if (fstatvfs(fd_, &vs) == 0)
      free_text = format_bytes(static_cast<std::uint64_t>(vs.f_bavail) * vs.f_frsize, true);
    throw IoError("fallocate", path_, offset, length, err,
                  strcat("no space to reserve ", format_bytes(length, true), " (", length,
                         " bytes); free on the file system: ", free_text));
  }
  throw IoError("fallocate", path_, offset, length, err);
}

void IoFile::truncate(std::uint64_t size) {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
    throw IoError("ftruncate", path_, size, 0, errno);
}

void IoFile::sync() {
  if (::fdatasync(fd_) != 0) throw IoError("fdatasync", path_, 0, 0, errno);
}

}  // namespace strata
