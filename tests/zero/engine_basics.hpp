// What the engine tests share beneath their own helpers: a small FP32 engine on the host device,
// the optimizer their references repeat, the swap tier (a small pinned pool and NVMe files in a
// test directory), and reading the parameters back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/config.hpp"
#include "strata/engine.hpp"

namespace strata::testing {

// Stage `stage`, gradient buckets of `bucket` and optimizer sub-groups of `sub_group` elements,
// FP32 parameters and gradients, lr 1e-2, one optimizer thread; the device the config's default.
inline Config base_engine_config(int stage, std::uint64_t bucket, std::uint64_t sub_group,
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
  return cfg;
}

// base_engine_config on the host-emulated device.
inline Config small_engine_config(int stage, std::uint64_t bucket, std::uint64_t sub_group,
                                  double collective_timeout_s) {
  Config cfg = base_engine_config(stage, bucket, sub_group, collective_timeout_s);
  cfg.runtime.device = DeviceKind::kHost;
  return cfg;
}

// AdamW with lr 1e-2 and weight decay 0.01, losses scaled by 1024 to begin with: what the
// bitwise references (CpuAdam on the unsharded sums) read back from the config.
inline void use_reference_adamw(Config& cfg) {
  cfg.precision.loss_scale.initial = 1024;
  cfg.optimizer.type = OptimizerType::kAdamW;
  cfg.optimizer.lr = 1e-2;
  cfg.optimizer.weight_decay = 0.01;
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

// The FP32 values of the parameters 0, 1, ... (of `sizes` elements), each gathered and released.
inline std::vector<std::vector<float>> read_params(Engine& e,
                                                   const std::vector<std::size_t>& sizes) {
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    TensorId id = t;
    e.gather({&id, 1});
    std::vector<float> p(sizes[t]);
    e.read_param(id, p);
    out.push_back(std::move(p));
    e.release({&id, 1});
  }
  return out;
}

}  // namespace strata::testing
