// Names of the config enums and the derived Config values.
#include <algorithm>

#include "strata/config.hpp"

namespace strata {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFp16: return 2;
    case DType::kBf16: return 2;
    case DType::kFp32: return 4;
  }
  return 4;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFp16: return "fp16";
    case DType::kBf16: return "bf16";
    case DType::kFp32: return "fp32";
  }
  return "?";
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kGpu: return "gpu";
    case Tier::kCpu: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

const char* optimizer_update_name(OptimizerUpdate u) {
  return u == OptimizerUpdate::kDevice ? "device" : "cpu";
}

const char* optimizer_name(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam: return "adam";
    case OptimizerType::kAdamW: return "adamw";
  }
  return "?";
}

const char* io_engine_name(IoEngineKind k) {
  switch (k) {
    case IoEngineKind::kAuto: return "auto";
    case IoEngineKind::kIoUring: return "io_uring";
    case IoEngineKind::kThreads: return "threads";
  }
  return "?";
}

const char* direct_io_name(DirectIoMode m) {
  switch (m) {
    case DirectIoMode::kAuto: return "auto";
    case DirectIoMode::kRequired: return "required";
    case DirectIoMode::kOff: return "off";
  }
  return "?";
}

const char* device_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::kAuto: return "auto";
    case DeviceKind::kCuda: return "cuda";
    case DeviceKind::kHost: return "host";
  }
  return "?";
}

const char* comm_backend_name(CommBackend b) {
  switch (b) {
    case CommBackend::kAuto: return "auto";
    case CommBackend::kInProcess: return "inprocess";
    case CommBackend::kMpi: return "mpi";
    case CommBackend::kNccl: return "nccl";
  }
  return "?";
}

std::uint32_t Config::ranks_per_node() const {
  if (world.ranks_per_node != 0) return world.ranks_per_node;
  return std::min<std::uint32_t>(std::max<std::uint32_t>(world.ranks, 1), 8);
}

std::uint32_t Config::nodes() const {
  std::uint32_t rpn = ranks_per_node();
  if (rpn == 0) return 1;
  return (world.ranks + rpn - 1) / rpn;
}

}  // namespace strata
