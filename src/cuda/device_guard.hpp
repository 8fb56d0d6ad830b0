// RAII current-device guard (internal; CUDA builds only). strata never leaves the calling
// thread's current device changed: every entry point that needs device N makes it current for
// the call and restores the caller's device afterwards.
//
// Restoring does not create a context: when the previous device has no primary context yet (a
// thread that never used CUDA reads device 0 as current without any context existing), the guard
// leaves device N current instead of initialising GPU 0 — a context costs hundreds of MiB on a
// device this process never asked for (PyTorch's c10::cuda::MaybeExchangeDevice does the same).
#pragma once

namespace strata::cuda {

class DeviceGuard {
 public:
  // Makes `ordinal` current; throws Error(kDevice) naming the call when CUDA refuses.
  explicit DeviceGuard(int ordinal);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};

// True when device `ordinal`'s primary context exists (driver entry point
// cuDevicePrimaryCtxGetState); true also when that cannot be asked (then restoring is safe to try).
bool primary_context_active(int ordinal) noexcept;

// The device a CUDA stream belongs to (cudaStreamGetDevice); nullptr = the calling thread's
// current device (the legacy default stream). Throws Error(kDevice).
int stream_device(void* stream);

}  // namespace strata::cuda
