// The name tables and the element-size table of include/strata/types.hpp: the only copies.
#include "strata/types.hpp"

#include <iterator>

namespace strata {
namespace {

constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kFp16, "fp16"}, {DType::kBf16, "bf16"}, {DType::kFp32, "fp32"}};
constexpr EnumName<Tier> kTierNames[] = {
    {Tier::kGpu, "gpu"}, {Tier::kCpu, "cpu"}, {Tier::kNvme, "nvme"}};
constexpr EnumName<OptimizerType> kOptimizerNames[] = {{OptimizerType::kAdam, "adam"},
                                                       {OptimizerType::kAdamW, "adamw"}};
constexpr EnumName<OptimizerUpdate> kUpdateNames[] = {{OptimizerUpdate::kCpu, "cpu"},
                                                      {OptimizerUpdate::kDevice, "device"}};
constexpr EnumName<OptimizerOverlap> kOverlapNames[] = {{OptimizerOverlap::kOff, "off"},
                                                        {OptimizerOverlap::kOn, "on"},
                                                        {OptimizerOverlap::kAuto, "auto"}};
constexpr EnumName<IoEngineKind> kIoEngineNames[] = {{IoEngineKind::kAuto, "auto"},
                                                     {IoEngineKind::kIoUring, "io_uring"},
                                                     {IoEngineKind::kThreads, "threads"}};
constexpr EnumName<DirectIoMode> kDirectIoNames[] = {{DirectIoMode::kAuto, "auto"},
                                                     {DirectIoMode::kRequired, "required"},
                                                     {DirectIoMode::kOff, "off"}};
constexpr EnumName<DeviceKind> kDeviceNames[] = {
    {DeviceKind::kAuto, "auto"}, {DeviceKind::kCuda, "cuda"}, {DeviceKind::kHost, "host"}};
constexpr EnumName<CommBackend> kCommBackendNames[] = {{CommBackend::kAuto, "auto"},
                                                       {CommBackend::kInProcess, "inprocess"},
                                                       {CommBackend::kMpi, "mpi"},
                                                       {CommBackend::kNccl, "nccl"}};

// Bytes per element, indexed by DType.
constexpr std::size_t kDTypeSizes[] = {2, 2, 4};
static_assert(static_cast<int>(DType::kFp16) == 0 && static_cast<int>(DType::kBf16) == 1 &&
              static_cast<int>(DType::kFp32) == 2);

}  // namespace

template <>
EnumNames<DType> enum_names<DType>() {
  return {kDTypeNames, std::size(kDTypeNames)};
}
template <>
EnumNames<Tier> enum_names<Tier>() {
  return {kTierNames, std::size(kTierNames)};
}
template <>
EnumNames<OptimizerType> enum_names<OptimizerType>() {
  return {kOptimizerNames, std::size(kOptimizerNames)};
}
template <>
EnumNames<OptimizerUpdate> enum_names<OptimizerUpdate>() {
  return {kUpdateNames, std::size(kUpdateNames)};
}
template <>
EnumNames<OptimizerOverlap> enum_names<OptimizerOverlap>() {
  return {kOverlapNames, std::size(kOverlapNames)};
}
template <>
EnumNames<IoEngineKind> enum_names<IoEngineKind>() {
  return {kIoEngineNames, std::size(kIoEngineNames)};
}
template <>
EnumNames<DirectIoMode> enum_names<DirectIoMode>() {
  return {kDirectIoNames, std::size(kDirectIoNames)};
}
template <>
EnumNames<DeviceKind> enum_names<DeviceKind>() {
  return {kDeviceNames, std::size(kDeviceNames)};
}
template <>
EnumNames<CommBackend> enum_names<CommBackend>() {
  return {kCommBackendNames, std::size(kCommBackendNames)};
}

std::size_t dtype_size(DType t) {
  const auto i = static_cast<std::size_t>(t);
  return i < std::size(kDTypeSizes) ? kDTypeSizes[i] : 4;
}

const char* dtype_name(DType t) { return enum_name(t); }
const char* tier_name(Tier t) { return enum_name(t); }
const char* optimizer_name(OptimizerType t) { return enum_name(t); }
const char* optimizer_update_name(OptimizerUpdate u) { return enum_name(u); }
const char* optimizer_overlap_name(OptimizerOverlap o) { return enum_name(o); }
const char* io_engine_name(IoEngineKind k) { return enum_name(k); }
const char* direct_io_name(DirectIoMode m) { return enum_name(m); }
const char* device_name(DeviceKind k) { return enum_name(k); }
const char* comm_backend_name(CommBackend b) { return enum_name(b); }

}  // namespace strata
