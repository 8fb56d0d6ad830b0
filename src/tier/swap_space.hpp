// SwapSpace: one rank's space on the NVMe tier. Under each configured path (tiers.nvme.paths) it
// creates a per-run directory "strata-swap-<pid>-r<rank>-<random>" (mode 0700, flock'ed while the
// run lives) holding one file "swap.bin" (mode 0600, O_CREAT|O_EXCL|O_NOFOLLOW); with several
// paths the files are striped by the I/O engine (block_size stripes). Everything is created and
// removed through directory file descriptors (openat/mkdirat/unlinkat, src/core/safe_fs.hpp): a
// configured path is walked from "/" component by component, and a path (or a directory on the
// way) that another user owns, or can write without the sticky bit, is refused with a message
// saying why (docs/errors.md, "Files strata creates"). A missing configured path is created
// (mode 0700, like mkdir -p) when options.create_paths.
//
// The full capacity is reserved with fallocate at construction, so a disk that is too small
// fails here, not mid-step. An extent allocator hands out aligned extents of the striped space.
// The files and directories are removed by the destructor (clean shutdown) and, while they
// exist, are registered for removal on SIGTERM/SIGINT/SIGHUP (strata/cleanup.hpp). What a killed
// run left is removed by the next SwapSpace under the same path (options.clean_leftovers: per-run
// directories whose process is gone, see find_swap_leftovers()), with one log line each.
//
// Ownership: owns the files (shared with the IoEngine, registered until destruction). The engine
// must outlive the SwapSpace, and no I/O on file() may be in flight at destruction.
// Thread-safety: allocate/free/used/... are safe to call concurrently (internal mutex).
// Failure behaviour (construction): no path → Error(kInvalidArgument); a configured path that is
// missing (without create_paths), not a directory or not writable → IoError naming the path
// (exit code 2); unsafe (see above) → Error(kInvalidArgument) naming the path and the reason; not
// enough space → IoError (ENOSPC) naming the path, the bytes needed and the bytes free; everything
// created so far is removed again. allocate() on a full space → Error(kBudget) naming the
// request, used, capacity and the largest free extent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/mutex.hpp"
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
  bool create_paths = true;     // create a missing configured path (mode 0700, like mkdir -p)
  bool clean_leftovers = true;  // remove per-run directories of dead processes under the paths
};

// A per-run directory (or benchmark file) that a strata process left under a swap path.
struct SwapLeftover {
  enum class Status {
    kRemoved,      // it was removed
    kWouldRemove,  // dry run: it would be removed
    kRunning,      // kept: its process is alive (or holds its lock from another pid namespace)
    kOtherUser,    // kept: owned by another user (only its owner or root may remove it)
    kFailed,       // removing it failed (detail says why)
  };
  std::string path;
  long pid = 0;             // the owner process, from the name
  unsigned uid = 0;         // owner of the directory or file
  std::uint64_t bytes = 0;  // space its files hold (allocated blocks)
  Status status = Status::kRemoved;
  std::string detail;  // why it was kept, or what failed
};
const char* swap_leftover_status_name(SwapLeftover::Status s);  // "removed", "would remove", ...

// Looks in `path` (a swap path, opened safely as SwapSpace does) for per-run swap directories
// ("strata-swap-<pid>-r<rank>-<hex>", and the older "strata-swap-r<rank>-<pid>-<hex>") and
// `strata bench io` files (".strata-bench-io-<pid>-<hex>") whose process is gone: no process has
// that pid (kill(pid, 0) fails with ESRCH) and nobody holds the entry's flock. `path` may also
// name one such directory itself. With `remove`, removes them (the regular files directly inside,
// then the directory; never following a symlink, never descending further). Entries of this
// process, of live processes and of other users (unless we are root) are kept and reported.
// Throws like SafeDir::open for `path` itself; problems with single entries are reported in the
// result (kFailed), not thrown.
std::vector<SwapLeftover> find_swap_leftovers(const std::string& path, bool remove);

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
  struct RunDir;  // one configured path: its directory fd, the run directory, registrations
  void cleanup() noexcept;
  std::shared_ptr<IoFile> create_run(RunDir& run, const std::string& name, std::uint64_t per_file,
                                     std::uint32_t rank);

  IoEngine& engine_;
  std::uint64_t block_size_;
  std::uint64_t capacity_ = 0;
  std::uint32_t alignment_ = 4096;
  FileId file_ = 0;
  bool registered_ = false;
  std::vector<std::string> dirs_;   // created per-run directories
  std::vector<std::string> files_;  // created files
  std::vector<std::unique_ptr<RunDir>> runs_;
  mutable Mutex mutex_;
  std::unique_ptr<tier::ExtentAllocator> allocator_ GUARDED_BY(mutex_);
};

}  // namespace strata
