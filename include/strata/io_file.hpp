// IoFile: one open file for the I/O engines (include/strata/io_engine.hpp), plus the aligned
// buffer allocation helper that engines and the pinned pool share.
//
// Opening: O_CLOEXEC | O_NOFOLLOW always (a symlink at the path is refused with ELOOP), O_CREAT
// (mode 0600 by default) when `create`, O_EXCL when `exclusive`. O_DIRECT follows DirectIoMode:
//   kOff       buffered I/O.
//   kAuto      O_DIRECT; a file system that refuses it (open fails with EINVAL, or tmpfs, whose
//              "O_DIRECT" is a page-cache copy) gets buffered I/O and one log_warn line.
//   kRequired  O_DIRECT or IoError("open", path, 0, 0, EINVAL, "O_DIRECT refused ...").
// Alignment under O_DIRECT: max(stx_dio_mem_align, stx_dio_offset_align) from statx(STATX_DIOALIGN)
// when the kernel reports it, else 4096. Buffered files have alignment 1. The engines reject a
// request whose buffer address, offset or length is not a multiple of alignment() before
// submitting anything (Error kInvalidArgument).
//
// Ownership: IoFile owns its fd (closed in the destructor); move-only. Engines hold files through
// std::shared_ptr<IoFile> from register_file() until unregister_file().
// Thread-safety: const members may be called from any thread; allocate()/truncate()/sync() may be
// called concurrently with I/O on other ranges (they are plain syscalls on the fd).
// Failures: every syscall failure throws IoError naming path, offset, length and errno.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/config.hpp"

namespace strata {

struct IoFileOptions {
  bool create = false;     // O_CREAT
  bool exclusive = false;  // O_EXCL (with create): fail with EEXIST if the path exists
  bool read_only = false;  // O_RDONLY instead of O_RDWR
  unsigned mode = 0600;    // permission bits for a created file
  DirectIoMode direct_io = DirectIoMode::kAuto;
};

class IoFile {
 public:
  // Opens `path` as described above. Throws IoError (open failures, O_DIRECT refused with
  // kRequired) naming the path and errno.
  static IoFile open(const std::string& path, const IoFileOptions& options = {});
  // The same, relative to an open directory: openat(dirfd, name, ...), so that the directory's
  // path is not resolved again (safe files, docs/errors.md). `display_path` is the path used in
  // messages and returned by path(). `name` must be a single component when dirfd is not
  // AT_FDCWD. The fd is not kept: the caller keeps the directory open as long as it needs it.
  static IoFile open_at(int dirfd, const std::string& name, const std::string& display_path,
                        const IoFileOptions& options = {});

  IoFile(IoFile&& other) noexcept;
  IoFile& operator=(IoFile&& other) noexcept;
  IoFile(const IoFile&) = delete;
  IoFile& operator=(const IoFile&) = delete;
  ~IoFile();

  int fd() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  bool direct() const noexcept { return direct_; }  // opened with O_DIRECT
  bool read_only() const noexcept { return read_only_; }
  // Required alignment of buffer address, offset and length (1 for buffered files).
  std::uint32_t alignment() const noexcept { return alignment_; }

  std::uint64_t size() const;  // current file size (fstat)
  // Reserves [offset, offset+length) with fallocate(mode 0). ENOSPC throws IoError whose message
  // names the requested size and the free space of the file system (statvfs). A file system
  // without fallocate (EOPNOTSUPP) falls back to ftruncate to extend the size.
  void allocate(std::uint64_t length, std::uint64_t offset = 0);
  void truncate(std::uint64_t size);  // ftruncate
  void sync();                        // fdatasync
  void close();                       // closes now (idempotent); the destructor does it otherwise

 private:
  IoFile() = default;
  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
  bool read_only_ = false;
  std::uint32_t alignment_ = 1;
};

// True if `dir` is on tmpfs (statfs magic). Used to decide that O_DIRECT is not real there.
bool is_tmpfs(const std::string& dir);

// ---- I/O buffers
// ---------------------------------------------------------------------------------

enum class HugePageMode {
  kAuto,  // MAP_HUGETLB when huge pages are reserved (vm.nr_hugepages, enough free) and the size
          // is a multiple of 2 MiB, else anonymous memory with MADV_HUGEPAGE (transparent huge
          // pages); falls back silently.
  kTransparent,  // anonymous memory + MADV_HUGEPAGE only
  kNone,         // plain anonymous memory (still 2 MiB-aligned)
};

// A 2 MiB-aligned anonymous mapping (RAII, move-only). Physically contiguous huge pages let the
// block layer merge requests up to the device's max_sectors_kb, which is worth 1.4-1.8x on
// virtual disks. The memory is zero-filled and readable/writable; it is not page-locked (the
// pinned pool or io_uring buffer registration pins it).
// Thread-safety: a plain owner; the bytes may be used from any thread.
// Failure: Error(kOutOfMemory) naming the size when mmap fails.
class IoBuffer {
 public:
  IoBuffer() = default;
  static IoBuffer allocate(std::size_t bytes, HugePageMode mode = HugePageMode::kAuto);
  IoBuffer(IoBuffer&& other) noexcept;
  IoBuffer& operator=(IoBuffer&& other) noexcept;
  IoBuffer(const IoBuffer&) = delete;
  IoBuffer& operator=(const IoBuffer&) = delete;
  ~IoBuffer();

  void* data() const noexcept { return data_; }
  std::uint8_t* bytes() const noexcept { return static_cast<std::uint8_t*>(data_); }
  std::size_t size() const noexcept { return size_; }  // as requested
  bool hugetlb() const noexcept { return hugetlb_; }   // backed by MAP_HUGETLB pages
  explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  void reset() noexcept;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t mapped_ = 0;  // bytes mapped (rounded up), for munmap
  bool hugetlb_ = false;
};

}  // namespace strata
