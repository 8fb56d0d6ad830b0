// FaultInjectingDevice (include/strata/device_fault.hpp).
#include <thread>

#include "strata/device_fault.hpp"
#include "strata/error.hpp"

namespace strata {
namespace {

class FaultStream final : public StreamWrapper {
 public:
  FaultStream(FaultInjectingDevice& dev, std::unique_ptr<Stream> inner)
      : StreamWrapper(std::move(inner)), dev_(dev) {}
  void memcpy_async(void* dst, const void* src, std::size_t bytes) override {
    std::chrono::milliseconds delay{0};
    if (dev_.hit(DeviceFaultKind::kDelay, &delay))
      inner().launch_host_func([delay] { std::this_thread::sleep_for(delay); });
    if (dev_.hit(DeviceFaultKind::kCopyFail)) {
      inner().launch_host_func([bytes] {
        fail(ErrorCode::kDevice, strcat("device: copy of ", bytes,
                                        " bytes failed (injected by the fault-injecting device)"));
      });
      return;
    }
    inner().memcpy_async(dst, src, bytes);
  }
  void launch_host_func(std::function<void()> fn) override {
    if (dev_.hit(DeviceFaultKind::kHostFuncFail)) {
      inner().launch_host_func([] {
        fail(ErrorCode::kDevice,
             "device: kernel / host function failed (injected by the fault-injecting device)");
      });
      return;
    }
    inner().launch_host_func(std::move(fn));
  }

 private:
  FaultInjectingDevice& dev_;
};

std::unique_ptr<Device> non_null(std::unique_ptr<Device> inner) {
  if (!inner) fail(ErrorCode::kInvalidArgument, "FaultInjectingDevice: no inner device");
  return inner;
}

}  // namespace

FaultInjectingDevice::FaultInjectingDevice(std::unique_ptr<Device> inner)
    : DeviceWrapper(non_null(std::move(inner))) {}
FaultInjectingDevice::~FaultInjectingDevice() = default;

std::string FaultInjectingDevice::name() const {
  return DeviceWrapper::name() + " (fault-injecting)";
}

std::size_t FaultInjectingDevice::add_fault(const DeviceFault& fault) {
  if (fault.nth == 0) fail(ErrorCode::kInvalidArgument, "DeviceFault: nth is 1-based");
  std::lock_guard<std::mutex> lock(mu_);
  faults_.push_back({fault, 0, 0});
  return faults_.size() - 1;
}

void FaultInjectingDevice::clear_faults() {
  std::lock_guard<std::mutex> lock(mu_);
  for (State& s : faults_) s.fault.count = s.fault.nth = ~0ULL;  // keep ids valid, never match
}

std::uint64_t FaultInjectingDevice::fired(std::size_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (id >= faults_.size()) fail(ErrorCode::kInvalidArgument, strcat("DeviceFault: no fault ", id));
  return faults_[id].fired;
}

bool FaultInjectingDevice::hit(DeviceFaultKind kind, std::chrono::milliseconds* delay) {
  std::lock_guard<std::mutex> lock(mu_);
  bool any = false;
  for (State& s : faults_) {
    if (s.fault.kind != kind) continue;
    const std::uint64_t k = ++s.matched;
    if (k < s.fault.nth) continue;
    if (s.fault.count != 0 && k - s.fault.nth >= s.fault.count) continue;
    ++s.fired;
    any = true;
    if (delay) *delay = s.fault.delay;
  }
  return any;
}

void* FaultInjectingDevice::alloc(std::size_t bytes) {
  if (hit(DeviceFaultKind::kAllocFail))
    fail(ErrorCode::kOutOfMemory, strcat("device: allocation of ", bytes,
                                         " bytes failed (injected by the fault-injecting device)"));
  return DeviceWrapper::alloc(bytes);
}

std::unique_ptr<Stream> FaultInjectingDevice::create_stream() {
  return std::make_unique<FaultStream>(*this, DeviceWrapper::create_stream());
}

}  // namespace strata
