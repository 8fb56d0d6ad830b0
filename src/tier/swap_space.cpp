#include "tier/swap_space.hpp"

#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "core/checked_math.hpp"
#include "core/safe_fs.hpp"
#include "strata/cleanup.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"
#include "tier/extent_allocator.hpp"

namespace strata {
namespace {

std::string run_suffix() {
  std::random_device rd;
  std::uint64_t r = (std::uint64_t(rd()) << 32) | rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(r));
  return std::string(buf, 8);
}

constexpr const char* kSwapFile = "swap.bin";

}  // namespace

// One configured path: the directory (opened safely), the per-run directory in it, and their
// registrations for removal on a signal.
struct SwapSpace::RunDir {
  SafeDir parent;
  std::string name;  // of the per-run directory in parent
  SafeDir dir;
  bool file_created = false;
  CleanupRegistration dir_reg;
  CleanupRegistration file_reg;
};

namespace {

// Removes what killed runs left under `parent` (logged; a failure to look is only a warning).
void remove_leftovers(const std::string& parent) {
  try {
    for (const auto& l : find_swap_leftovers(parent, true)) {
      if (l.status == SwapLeftover::Status::kRemoved) {
        log_info("swap space: removed ", l.path, " left by process ", l.pid,
                 " (no longer running): freed ", format_bytes(l.bytes, true));
      } else if (l.status == SwapLeftover::Status::kFailed) {
        log_warn("swap space: cannot remove ", l.path, " left by process ", l.pid, ": ", l.detail);
      }
    }
  } catch (const std::exception& e) {
    log_warn("swap space: looking for leftovers in ", parent, ": ", e.what());
  }
}

}  // namespace

// Creates the per-run directory `name` and its swap file of `per_file` bytes under one path
// (registered for removal on a signal; locked against `strata clean` in other processes).
std::shared_ptr<IoFile> SwapSpace::create_run(RunDir& run_dir, const std::string& name,
                                              std::uint64_t per_file, std::uint32_t rank) {
  RunDir* run = &run_dir;
  const std::string& p = run->parent.path();
  struct statvfs vfs {};
  if (fstatvfs(run->parent.fd(), &vfs) == 0) {
    const std::uint64_t free_bytes = std::uint64_t(vfs.f_bavail) * vfs.f_frsize;
    if (free_bytes < per_file) {
      throw IoError("fallocate", p, 0, per_file, ENOSPC,
                    strcat("swap space for rank ", rank, " needs ", per_file, " bytes (",
                           format_bytes(per_file, true), ") under ", p, " but only ", free_bytes,
                           " bytes (", format_bytes(free_bytes, true), ") are free"));
    }
  }
  run->dir = run->parent.make_dir(name, 0700);
  run->name = name;
  dirs_.push_back(run->dir.path());
  run->dir_reg = CleanupRegistration(run->parent.fd(), name, true);
  // Marks the directory as in use: find_swap_leftovers() in another process (or pid
  // namespace) sees the lock and keeps it.
  if (flock(run->dir.fd(), LOCK_EX | LOCK_NB) != 0)
    throw IoError("flock", run->dir.path(), 0, 0, errno, "locking the per-run swap directory");
  IoFileOptions fo;
  fo.create = true;
  fo.exclusive = true;
  fo.mode = 0600;
  fo.direct_io = engine_.options().direct_io;
  const std::string path = run->dir.child_path(kSwapFile);
  auto file = std::make_shared<IoFile>(IoFile::open_at(run->dir.fd(), kSwapFile, path, fo));
  run->file_created = true;
  run->file_reg = CleanupRegistration(run->dir.fd(), kSwapFile, false);
  files_.push_back(path);
  file->allocate(per_file, 0);  // ENOSPC: IoError naming size and free space
  return file;
}

SwapSpace::SwapSpace(const SwapSpaceOptions& options, IoEngine& engine)
    : engine_(engine), block_size_(options.block_size) {
  if (options.paths.empty()) {
    fail(ErrorCode::kInvalidArgument, "tiers.nvme.paths is empty: the NVMe tier needs a directory");
  }
  if (options.capacity == 0) fail(ErrorCode::kInvalidArgument, "swap space capacity is 0");
  if (block_size_ == 0 || block_size_ % 4096) {
    fail(ErrorCode::kInvalidArgument,
         strcat("swap space: block_size ", block_size_, " is not a positive multiple of 4096"));
  }
  const std::uint64_t n = options.paths.size();
  const std::uint64_t blocks = (options.capacity + block_size_ - 1) / block_size_;
  const std::uint64_t per_file = (blocks + n - 1) / n * block_size_;
  try {
    // Open (and check) every path before creating anything.
    for (const auto& p : options.paths) {
      auto run = std::make_unique<RunDir>();
      run->parent = SafeDir::open(p, {.create = options.create_paths, .role = "tiers.nvme.paths"});
      runs_.push_back(std::move(run));
    }
    if (options.clean_leftovers)
      for (const auto& run : runs_) remove_leftovers(run->parent.path());
    std::vector<std::shared_ptr<IoFile>> files;
    const std::string name =
        strcat("strata-swap-", getpid(), "-r", options.rank, "-", run_suffix());
    for (auto& run : runs_) {
      files.push_back(create_run(*run, name, per_file, options.rank));
    }
    file_ = files.size() == 1 ? engine_.register_file(files[0]) : engine_.register_striped(files);
    registered_ = true;
    alignment_ = std::max<std::uint32_t>(4096, engine_.alignment(file_));
    capacity_ = per_file * n;
    allocator_ = std::make_unique<tier::ExtentAllocator>(capacity_, alignment_);
  } catch (...) {
    cleanup();
    throw;
  }
  log_info("swap space: ", format_bytes(capacity_, true), " reserved for rank ", options.rank,
           " in ", describe());
}

SwapSpace::~SwapSpace() { cleanup(); }

void SwapSpace::cleanup() noexcept {
  if (registered_) {
    try {
      engine_.unregister_file(file_);
    } catch (const std::exception& e) {
      log_error("swap space: unregistering ", describe(), ": ", e.what());
    }
    registered_ = false;
  }
  for (auto& run : runs_) {
    if (run->file_created) {
      const int err = run->dir.try_remove(kSwapFile, false);
      if (err != 0 && err != ENOENT)
        log_error("swap space: cannot remove ", run->dir.child_path(kSwapFile), ": ",
                  std::strerror(err));
      run->file_created = false;
    }
    run->file_reg.reset();
    if (!run->name.empty()) {
      const int err = run->parent.try_remove(run->name, true);
      if (err != 0 && err != ENOENT)
        log_error("swap space: cannot remove ", run->parent.child_path(run->name), ": ",
                  std::strerror(err));
      run->name.clear();
    }
    run->dir_reg.reset();
  }
  runs_.clear();
  files_.clear();
  dirs_.clear();
}

std::string SwapSpace::describe() const {
  std::string s;
  for (const auto& f : files_) s += (s.empty() ? "" : "|") + f;
  return s;
}

std::pair<std::string, std::uint64_t> SwapSpace::locate(std::uint64_t offset) const {
  if (files_.empty()) return {"", offset};
  if (files_.size() == 1) return {files_[0], offset};
  const std::uint64_t b = offset / block_size_;
  return {files_[b % files_.size()], (b / files_.size()) * block_size_ + offset % block_size_};
}

SwapExtent SwapSpace::allocate(std::uint64_t bytes, const std::string& what) {
  MutexLock lock(mutex_);
  auto e = allocator_->allocate(bytes);
  if (!e) {
    fail(ErrorCode::kBudget,
         strcat("NVMe swap space full: ", what, " needs ",
                round_up(bytes, std::uint64_t{alignment_}), " bytes but ", allocator_->used(),
                " of ", capacity_, " bytes are used (largest free extent ",
                allocator_->largest_free(), " bytes); raise the NVMe capacity"));
  }
  return SwapExtent{e->offset, e->length};
}

void SwapSpace::free(const SwapExtent& extent) {
  MutexLock lock(mutex_);
  allocator_->free(tier::Extent{extent.offset, extent.length});
}

std::uint64_t SwapSpace::used() const {
  MutexLock lock(mutex_);
  return allocator_->used();
}

}  // namespace strata
