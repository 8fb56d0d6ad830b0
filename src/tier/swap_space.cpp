#include "tier/swap_space.hpp"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <random>

#include "strata/error.hpp"
#include "strata/log.hpp"
#include "strata/units.hpp"
#include "tier/extent_allocator.hpp"

namespace strata {
namespace {

std::uint64_t round_up(std::uint64_t v, std::uint64_t unit) { return (v + unit - 1) / unit * unit; }

void check_swap_path(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    throw IoError("stat", path, 0, 0, errno, "tiers.nvme.paths entry is not usable");
  }
  if (S_ISLNK(st.st_mode)) {
    fail(ErrorCode::kInvalidArgument,
         strcat("tiers.nvme.paths: ", path, " is a symbolic link; swap files are never created "
                "through a symlink: configure the real directory"));
  }
  if (!S_ISDIR(st.st_mode)) {
    fail(ErrorCode::kInvalidArgument, strcat("tiers.nvme.paths: ", path, " is not a directory"));
  }
  if (access(path.c_str(), W_OK | X_OK) != 0) {
    throw IoError("access", path, 0, 0, errno, "tiers.nvme.paths entry is not writable");
  }
}

std::string run_suffix() {
  std::random_device rd;
  std::uint64_t r = (std::uint64_t(rd()) << 32) | rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(r));
  return std::string(buf, 8);
}

}  // namespace

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
  for (const auto& p : options.paths) check_swap_path(p);
  try {
    std::vector<std::shared_ptr<IoFile>> files;
    const std::string suffix = strcat("strata-swap-r", options.rank, "-", getpid(), "-", run_suffix());
    for (const auto& p : options.paths) {
      struct statvfs vfs {};
      if (statvfs(p.c_str(), &vfs) == 0) {
        const std::uint64_t free_bytes = std::uint64_t(vfs.f_bavail) * vfs.f_frsize;
        if (free_bytes < per_file) {
          throw IoError("fallocate", p, 0, per_file, ENOSPC,
                        strcat("swap space for rank ", options.rank, " needs ", per_file, " bytes (",
                               format_bytes(per_file, true), ") under ", p, " but only ",
                               free_bytes, " bytes (", format_bytes(free_bytes, true),
                               ") are free"));
        }
      }
      const std::string dir = p + "/" + suffix;
      if (mkdir(dir.c_str(), 0700) != 0) {
        throw IoError("mkdir", dir, 0, 0, errno, "creating the per-run swap directory");
      }
      dirs_.push_back(dir);
      IoFileOptions fo;
      fo.create = true;
      fo.exclusive = true;
      fo.mode = 0600;
      fo.direct_io = engine_.options().direct_io;
      const std::string path = dir + "/swap.bin";
      auto file = std::make_shared<IoFile>(IoFile::open(path, fo));
      files_.push_back(path);
      file->allocate(per_file, 0);  // ENOSPC: IoError naming size and free space
      files.push_back(std::move(file));
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
  for (const auto& f : files_) {
    if (unlink(f.c_str()) != 0 && errno != ENOENT) log_error("swap space: cannot remove ", f);
  }
  for (const auto& d : dirs_) {
    if (rmdir(d.c_str()) != 0 && errno != ENOENT) log_error("swap space: cannot remove ", d);
  }
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
  std::lock_guard lock(mutex_);
  auto e = allocator_->allocate(bytes);
  if (!e) {
    fail(ErrorCode::kBudget,
         strcat("NVMe swap space full: ", what, " needs ", round_up(bytes, alignment_),
                " bytes but ", allocator_->used(), " of ", capacity_,
                " bytes are used (largest free extent ", allocator_->largest_free(),
                " bytes); raise the NVMe capacity"));
  }
  return SwapExtent{e->offset, e->length};
}

void SwapSpace::free(const SwapExtent& extent) {
  std::lock_guard lock(mutex_);
  allocator_->free(tier::Extent{extent.offset, extent.length});
}

std::uint64_t SwapSpace::used() const {
  std::lock_guard lock(mutex_);
  return allocator_->used();
}

}  // namespace strata
