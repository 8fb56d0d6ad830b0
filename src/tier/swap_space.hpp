// SwapSpace: one rank's space on the NVMe tier. Under each configured path (tiers.nvme.paths) it
// creates a per-run directory "strata-swap-r<rank>-<pid>-<random>" (mode 0700) holding one file
// "swap.bin" created with mode 0600, O_CREAT|O_EXCL|O_NOFOLLOW; with several paths the files are
// striped by the I/O engine (block_size stripes). The full capacity is reserved with fallocate at
// construction, so a disk that is too small fails here, not mid-step. An extent allocator hands out
// aligned extents of the striped space. The files and directories are removed by the destructor
// (clean shutdown); after a crash they stay, and their directory names are in the log.
//
// Ownership: owns the files (shared with the IoEngine, registered until destruction). The engine
// must outlive the SwapSpace, and no I/O on file() may be in flight at destruction.
// Thread-safety: allocate/free/used/... are safe to call concurrently (internal mutex).
// Failure behaviour (construction): no path, a configured path that is missing, not a directory,
// a symbolic link, or not writable → Error(kInvalidArgument) or IoError naming the path; not
// enough space → IoError (ENOSPC) naming the path, the bytes needed and the bytes free; everything
// created so far is removed again. allocate() on a full space → Error(kBudget) naming the request,
// used, capacity and the largest free extent.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/io_engine.hpp"

namespace strata {

namespace tier {
class ExtentAllocator;
}

struct SwapExtent {
  std::uint64_t offset = 0;  // in the (striped) swap space
  std::uint64_t length = 0;  // a multiple of alignment()
};

struct SwapSpaceOptions {
  std::vector<std::string> paths;  // tiers.nvme.paths
  std::uint64_t capacity = 0;      // bytes to reserve for this rank, over all paths
  std::uint32_t rank = 0;
  std::uint64_t block_size = 1ULL << 20;  // stripe unit (tiers.nvme.block_size)
};

class SwapSpace {
 public:
  SwapSpace(const SwapSpaceOptions& options, IoEngine& engine);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  FileId file() const noexcept { return file_; }
  std::uint32_t alignment() const noexcept { return alignment_; }
  std::uint64_t capacity() const noexcept { return capacity_; }
  // Path of the file(s) for messages ("a|b" when striped).
  std::string describe() const;
  const std::vector<std::string>& directories() const noexcept { return dirs_; }
  const std::vector<std::string>& file_paths() const noexcept { return files_; }
  // Maps a swap-space offset to (file path, file offset), for messages and tests.
  std::pair<std::string, std::uint64_t> locate(std::uint64_t offset) const;

  // An extent of at least `bytes` (rounded up to alignment()). Throws Error(kBudget) when full.
  SwapExtent allocate(std::uint64_t bytes, const std::string& what);
  void free(const SwapExtent& extent);
  std::uint64_t used() const;

 private:
  void cleanup() noexcept;

  IoEngine& engine_;
  std::uint64_t block_size_;
  std::uint64_t capacity_ = 0;
  std::uint32_t alignment_ = 4096;
  FileId file_ = 0;
  bool registered_ = false;
  std::vector<std::string> dirs_;   // created per-run directories
  std::vector<std::string> files_;  // created files
  mutable std::mutex mutex_;
  std::unique_ptr<tier::ExtentAllocator> allocator_;  // guarded by mutex_
};

}  // namespace strata
