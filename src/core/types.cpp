// The name tables (k<Enum>Names) and the element-size table of include/strata/types.hpp: the only
// copies.
#include "strata/types.hpp"

#include <iterator>

namespace strata {
namespace {

constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kFp16, "fp16"}, {DType::kBf16, "bf16"}, {DType::kFp32, "fp32"}};
constexpr EnumName<Tier> kTierNames[] = {
    {Tier::kGpu, "gpu"}, {Tier::kCpu, "cpu"}, {Tier::kNvme, "nvme"}};
constexpr EnumName<OptimizerType> kOptimizerTypeNames[] = {{OptimizerType::kAdam, "adam"},
                                                           {OptimizerType::kAdamW, "adamw"}};
constexpr EnumName<OptimizerUpdate> kOptimizerUpdateNames[] = {{OptimizerUpdate::kCpu, "cpu"},
                                                               {OptimizerUpdate::kDevice, "device"},
                                                               {OptimizerUpdate::kAuto, "auto"}};
constexpr EnumName<OptimizerOverlap> kOptimizerOverlapNames[] = {{OptimizerOverlap::kOff, "off"},
                                                                 {OptimizerOverlap::kOn, "on"},
                                                                 {OptimizerOverlap::kAuto, "auto"}};
constexpr EnumName<IoEngineKind> kIoEngineKindNames[] = {{IoEngineKind::kAuto, "auto"},
                                                         {IoEngineKind::kIoUring, "io_uring"},
                                                         {IoEngineKind::kThreads, "threads"}};
constexpr EnumName<DirectIoMode> kDirectIoModeNames[] = {{DirectIoMode::kAuto, "auto"},
                                                         {DirectIoMode::kRequired, "required"},
                                                         {DirectIoMode::kOff, "off"}};
constexpr EnumName<DeviceKind> kDeviceKindNames[] = {
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

// enum_names<E>() for each named enum: the table k<E>Names above.
#define STRATA_DEFINE_ENUM_NAMES(E)               \
  template <>                                     \
  EnumNames<E> enum_names<E>() {                  \
    return {k##E##Names, std::size(k##E##Names)}; \
  }
STRATA_NAMED_ENUMS(STRATA_DEFINE_ENUM_NAMES)
#undef STRATA_DEFINE_ENUM_NAMES

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
