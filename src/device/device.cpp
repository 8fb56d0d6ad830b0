#include "strata/device.hpp"

#include <algorithm>
#include <cstdlib>

#include "core/move_handle.hpp"
#include "device/host_device.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"
#ifdef STRATA_HAVE_CUDA
#include "device/cuda_device.hpp"
#endif

namespace strata {

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  return move_assign_handle(*this, other, &DeviceMemory::reset, &DeviceMemory::device_,
                            &DeviceMemory::ptr_, &DeviceMemory::bytes_);
}

void DeviceMemory::reset() noexcept {
  if (ptr_ && device_) device_->free(ptr_);
  device_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

void Stream::wait_external(void* producer) {
  if (producer)
    fail(ErrorCode::kInvalidArgument,
         "stream hand-off: a native producer stream was given to a device without native streams "
         "(the host-emulated device orders host producers by the call itself: pass nullptr)");
}

void Stream::copy(void* dst, const void* src, std::size_t bytes,
                  std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  memcpy_async(dst, src, bytes);
  synchronize(timeout);
}

void Stream::fill(void* dst, int value, std::size_t bytes, std::chrono::milliseconds timeout) {
  if (bytes == 0) return;
  memset_async(dst, value, bytes);
  synchronize(timeout);
}

int local_device_ordinal(int rank, int ranks_per_node, int device_count) {
  const int n = std::max(1, device_count);
  for (const char* v :
       {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (const char* s = std::getenv(v)) {
      char* end = nullptr;
      const long x = std::strtol(s, &end, 10);
      if (end != s && x >= 0) return static_cast<int>(x % n);
    }
  }
  return std::max(0, rank) % std::max(1, ranks_per_node) % n;
}

std::unique_ptr<Device> make_host_device(std::uint64_t total_memory) {
  return std::make_unique<device::HostDevice>(total_memory);
}

std::unique_ptr<Device> make_device(DeviceKind kind, int ordinal, std::uint64_t host_memory) {
  if (kind == DeviceKind::kHost) {
    log_info("device: host-emulated (forced by runtime.device: host)");
    return make_host_device(host_memory);
  }
#ifdef STRATA_HAVE_CUDA
  if (kind == DeviceKind::kCuda) {
    auto dev = device::make_cuda_device(ordinal);
    log_info("device: ", dev->name(), " (forced by runtime.device: cuda)");
    return dev;
  }
  if (cuda_available()) {
    try {
      auto dev = device::make_cuda_device(ordinal);
      log_info("device: ", dev->name(), " (auto: a GPU answered)");
      return dev;
    } catch (const Error& e) {
      log_warn("device: CUDA device ", ordinal, " unusable (", e.what(),
               "); using the host-emulated device");
    }
  } else {
    log_info("device: host-emulated (auto: ", query_cuda_devices().status, ")");
  }
  return make_host_device(host_memory);
#else
  (void)ordinal;
  if (kind == DeviceKind::kCuda) {
    fail(ErrorCode::kUnsupported, "runtime.device: cuda, but this build of strata has no CUDA");
  }
  log_info("device: host-emulated (auto: built without CUDA)");
  return make_host_device(host_memory);
#endif
}

}  // namespace strata
