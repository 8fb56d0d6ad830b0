// Config pieces the engine tests share: a small FP32 engine on the host device, and the swap tier
// (a small pinned pool and NVMe files in a test directory).
#pragma once

#include <cstdint>
#include <string>

#include "strata/config.hpp"

namespace strata::testing {

// Stage `stage`, gradient buckets of `bucket` and optimizer sub-groups of `sub_group` elements,
// FP32 parameters and gradients, lr 1e-2, one optimizer thread, the host-emulated device.
inline Config small_engine_config(int stage, std::uint64_t bucket, std::uint64_t sub_group,
                                  double collective_timeout_s) {
  Config cfg;
  cfg.zero.stage = stage;
  cfg.zero.reduce_bucket_size = bucket;
  cfg.zero.sub_group_size = sub_group;
  cfg.precision.params = DType::kFp32;
  cfg.precision.grads = DType::kFp32;
  cfg.optimizer.lr = 1e-2;
  cfg.runtime.cpu_threads = 1;
  cfg.runtime.collective_timeout_s = collective_timeout_s;
  cfg.runtime.device = DeviceKind::kHost;
  return cfg;
}

// The NVMe tier in `dir` through the thread engine on the page cache (CI's disk is not what is
// tested), staged through `buffers` pinned buffers of `buffer_size` bytes.
inline void use_test_swap(Config& cfg, const std::string& dir, std::uint32_t buffers,
                          std::uint64_t buffer_size) {
  cfg.tiers.host.buffer_count = buffers;
  cfg.tiers.host.buffer_size = buffer_size;
  cfg.tiers.nvme.paths = {dir};
  cfg.tiers.nvme.engine = IoEngineKind::kThreads;
  cfg.tiers.nvme.direct_io = DirectIoMode::kOff;
}

}  // namespace strata::testing
