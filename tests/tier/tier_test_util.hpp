// Helpers for the tier tests: a tmpfs of a given size mounted for the test's lifetime (root only).
#pragma once

#include <sys/mount.h>

#include <filesystem>
#include <string>

namespace strata::testing {

class TmpfsMount {
 public:
  TmpfsMount(const std::string& dir, const std::string& size) : dir_(dir) {
    std::filesystem::create_directories(dir_);
    const std::string opts = "size=" + size + ",mode=0755";
    ok_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, opts.c_str()) == 0;
  }
  ~TmpfsMount() {
    if (ok_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  bool ok() const { return ok_; }

 private:
  std::string dir_;
  bool ok_ = false;
};

}  // namespace strata::testing

#include <cstring>
#include <memory>
#include <vector>

#include "device/pinned_pool.hpp"
#include "strata/device.hpp"
#include "strata/device_fault.hpp"
#include "strata/io_engine.hpp"
#include "strata/io_fault.hpp"
#include "test_util.hpp"
#include "tier/tier_store.hpp"

namespace strata::testing {

// Every tier, fastest first.
constexpr Tier kAllTiers[3] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};

struct RigOptions {
  std::uint32_t pool_buffers = 4;
  std::uint64_t pool_buffer_size = 64 << 10;
  std::uint64_t gpu_budget = 64 << 20;
  std::uint64_t host_budget = 64 << 20;
  std::uint64_t nvme_capacity = 16 << 20;
  std::uint64_t pinned_budget = ~0ULL;  // tiers.host.pinned_budget (the pool counts in it)
  bool checksum = true;
  DirectIoMode direct_io = DirectIoMode::kAuto;
  std::uint32_t movers = 2;
  std::chrono::milliseconds timeout{20000};
  bool fault_device = false;  // the device goes through a FaultInjectingDevice (StoreRig::fdev)
  // Wraps the device last (over the fault-injecting one), e.g. to watch registrations.
  std::function<std::unique_ptr<Device>(std::unique_ptr<Device>)> wrap_device;
  // The device (default: the host-emulated one), e.g. a CUDA device under the fake runtime.
  std::function<std::unique_ptr<Device>()> make_device;
};

// Caller memory for the streaming calls: host (4096-aligned) or device memory, with helpers to
// fill it and read it back.
class CallerMemory {
 public:
  CallerMemory(Device& device, Tier where, std::uint64_t bytes) : device_(device), where_(where) {
    const std::uint64_t n = (bytes + 4095) / 4096 * 4096;
    if (where == Tier::kGpu) {
      dev_ = device.allocate(n);
    } else {
      host_ = IoBuffer::allocate(n, HugePageMode::kNone);
    }
  }
  void* data() { return where_ == Tier::kGpu ? dev_.get() : host_.data(); }
  void put(const std::vector<std::uint8_t>& v) { copy(data(), v.data(), v.size()); }
  std::vector<std::uint8_t> get(std::uint64_t n) {
    std::vector<std::uint8_t> out(n);
    copy(out.data(), data(), n);
    return out;
  }

 private:
  void copy(void* dst, const void* src, std::size_t n) {
    if (where_ == Tier::kCpu) {
      std::memcpy(dst, src, n);
      return;
    }
    auto s = device_.create_stream();
    s->memcpy_async(dst, src, n);
    s->synchronize(std::chrono::seconds(10));
  }
  Device& device_;
  Tier where_;
  DeviceMemory dev_;
  IoBuffer host_;
};

// A host-emulated device, a fault-injecting I/O engine, a small pinned pool and a store with its
// swap space in a fresh temporary directory. Members are destroyed in reverse order.
struct StoreRig {
  explicit StoreRig(const RigOptions& o = {}) : dir("strata-tier") {
    device = o.make_device ? o.make_device() : make_host_device();
    if (o.fault_device) {
      auto f = std::make_unique<FaultInjectingDevice>(std::move(device));
      fdev = f.get();
      device = std::move(f);
    }
    if (o.wrap_device) device = o.wrap_device(std::move(device));
    IoEngineOptions io;
    io.block_size = 64 << 10;
    io.direct_io = o.direct_io;
    auto inner = make_io_engine(io, dir.str());
    auto f = std::make_unique<FaultInjectingIoEngine>(std::move(inner));
    fault = f.get();
    engine = std::move(f);
    PinnedPoolOptions po;
    po.buffer_count = o.pool_buffers;
    po.buffer_size = o.pool_buffer_size;
    po.pinned_budget = 64 << 20;
    pool = std::make_unique<PinnedPool>(po, device.get(), engine.get());
    TierStoreOptions so;
    so.gpu_budget = o.gpu_budget;
    so.host_budget = o.host_budget;
    so.nvme_capacity = o.nvme_capacity;
    so.pinned_budget = o.pinned_budget;
    so.nvme_paths = {dir.str()};
    so.block_size = 64 << 10;
    so.checksum = o.checksum;
    so.movers = o.movers;
    so.timeout = o.timeout;
    store = std::make_unique<TierStore>(so, *device, *engine, *pool);
  }

  std::vector<std::uint8_t> read(BufferId id, Tier t, std::uint64_t bytes) {
    auto* p = static_cast<std::uint8_t*>(store->acquire(id, t, Access::kRead));
    std::vector<std::uint8_t> out(bytes);
    if (t == Tier::kGpu) {
      auto s = device->create_stream();
      s->memcpy_async(out.data(), p, bytes);
      s->synchronize(std::chrono::seconds(10));
    } else {
      std::memcpy(out.data(), p, bytes);
    }
    store->release(id, t);
    return out;
  }
  // Registers FP32 buffer `name` of data.size() bytes at `home` and writes `data` there.
  BufferId add(const std::string& name, Tier home, const std::vector<std::uint8_t>& data) {
    const BufferId id = store->register_buffer({name, data.size(), DType::kFp32, home, {}});
    write(id, home, data);
    return id;
  }
  // Writes data[at, at+n) at the same offset. With `discard` (only for the whole buffer) the old
  // contents are not loaded (Access::kDiscard).
  void write(BufferId id, Tier t, const std::vector<std::uint8_t>& data, std::uint64_t at = 0,
             std::uint64_t n = ~0ULL, bool discard = false) {
    if (n == ~0ULL) n = data.size() - at;
    auto* p = static_cast<std::uint8_t*>(
        store->acquire(id, t, discard ? Access::kDiscard : Access::kWrite));
    if (t == Tier::kGpu) {
      auto s = device->create_stream();
      s->memcpy_async(p + at, data.data() + at, n);
      s->synchronize(std::chrono::seconds(10));
    } else {
      std::memcpy(p + at, data.data() + at, n);
    }
    store->release(id, t);
  }

  TempDir dir;
  std::unique_ptr<Device> device;
  FaultInjectingDevice* fdev = nullptr;  // with RigOptions::fault_device
  FaultInjectingIoEngine* fault = nullptr;
  std::unique_ptr<IoEngine> engine;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<TierStore> store;
};

}  // namespace strata::testing
