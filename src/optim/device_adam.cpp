// DeviceAdam (include/strata/adam.hpp): Adam on a Device for host-resident arrays — copy in, update
// on the device's stream, copy out.
#include <algorithm>

#include "strata/adam.hpp"
#include "strata/device.hpp"
#include "strata/error.hpp"

namespace strata {

struct DeviceAdam::Impl {
  Device& device;
  std::chrono::milliseconds timeout;
  std::unique_ptr<CpuAdam> cpu;  // the host-emulated device's kernel
  DeviceMemory mem;              // master | m | v | grad | param copy, each 256-byte aligned
  std::size_t capacity = 0;      // elements the layout was made for
  std::size_t grad_size = 0, copy_size = 0;
  std::unique_ptr<Stream> stream;  // last: destroyed (drained) before the memory and the kernel

  Impl(Device& d, unsigned threads, std::chrono::milliseconds t) : device(d), timeout(t) {
    stream = device.create_stream();
    if (device.kind() == DeviceKind::kHost) cpu = std::make_unique<CpuAdam>(threads);
  }

  static std::size_t pad(std::size_t b) { return (b + 255) / 256 * 256; }
  std::size_t layout(std::size_t n, std::size_t gs, std::size_t cs) const {
    return 3 * pad(n * sizeof(float)) + pad(n * gs) + pad(n * std::max<std::size_t>(cs, 1));
  }
  void reserve(std::size_t n, std::size_t gs, std::size_t cs) {
    if (n <= capacity && gs <= grad_size && cs <= copy_size) return;
    const std::size_t want = std::max(n, capacity);
    const std::size_t g = std::max(gs, grad_size), c = std::max(cs, copy_size);
    mem.reset();
    capacity = 0;
    mem = device.allocate(layout(want, g, c));
    capacity = want;
    grad_size = g;
    copy_size = c;
  }
};

DeviceAdam::DeviceAdam(Device& device, unsigned cpu_threads, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(device, cpu_threads, timeout)) {
  if (device.kind() == DeviceKind::kCuda && !adam_cuda_available())
    fail(ErrorCode::kUnsupported, "DeviceAdam: this build has no CUDA Adam kernel");
}

DeviceAdam::~DeviceAdam() {
  try {
    impl_->stream->synchronize(impl_->timeout);
  } catch (const std::exception&) {
    // already reported by the step that failed
  }
}

std::uint64_t DeviceAdam::device_bytes() const { return impl_->mem.size(); }
const Device& DeviceAdam::device() const { return impl_->device; }

void DeviceAdam::step(const AdamParams& params, const AdamTensors& host, const AdamStepOptions& o) {
  if (o.check_finite)
    fail(ErrorCode::kInvalidArgument,
         "DeviceAdam: check_finite is not supported; check the gradients before the step");
  if (!host.param || !host.exp_avg || !host.exp_avg_sq || !host.grad)
    fail(ErrorCode::kInvalidArgument, "DeviceAdam: null array");
  const std::size_t n = host.n;
  if (n == 0) return;
  Impl& m = *impl_;
  const std::size_t gs = dtype_size(host.grad_dtype);
  const std::size_t cs = host.param_copy ? dtype_size(host.param_copy_dtype) : 0;
  m.reserve(n, gs, cs);
  auto* base = static_cast<unsigned char*>(m.mem.get());
  const std::size_t fb = Impl::pad(m.capacity * sizeof(float));
  AdamTensors d = host;
  d.param = reinterpret_cast<float*>(base);
  d.exp_avg = reinterpret_cast<float*>(base + fb);
  d.exp_avg_sq = reinterpret_cast<float*>(base + 2 * fb);
  d.grad = base + 3 * fb;
  d.param_copy = host.param_copy ? base + 3 * fb + Impl::pad(m.capacity * m.grad_size) : nullptr;

  Stream& s = *m.stream;
  s.memcpy_async(d.param, host.param, n * sizeof(float));
  s.memcpy_async(d.exp_avg, host.exp_avg, n * sizeof(float));
  s.memcpy_async(d.exp_avg_sq, host.exp_avg_sq, n * sizeof(float));
  s.memcpy_async(const_cast<void*>(d.grad), host.grad, n * gs);
  if (m.cpu) {
    CpuAdam* cpu = m.cpu.get();
    s.launch_host_func([cpu, params, d, o] { cpu->step(params, d, o); });
  } else {
    adam_step_cuda(params, d, o, s.native_handle(), nullptr);
  }
  s.memcpy_async(host.param, d.param, n * sizeof(float));
  s.memcpy_async(host.exp_avg, d.exp_avg, n * sizeof(float));
  s.memcpy_async(host.exp_avg_sq, d.exp_avg_sq, n * sizeof(float));
  if (host.param_copy) s.memcpy_async(host.param_copy, d.param_copy, n * cs);
  s.synchronize(m.timeout);
}

void DeviceAdam::step_resident(const AdamParams& params, const AdamTensors& d,
                               const AdamStepOptions& o) {
  if (o.check_finite)
    fail(ErrorCode::kInvalidArgument,
         "DeviceAdam: check_finite is not supported; check the gradients before the step");
  if (!d.param || !d.exp_avg || !d.exp_avg_sq || !d.grad)
    fail(ErrorCode::kInvalidArgument, "DeviceAdam: null array");
  if (d.n == 0) return;
  Impl& m = *impl_;
  Stream& s = *m.stream;
  if (m.cpu) {
    CpuAdam* cpu = m.cpu.get();
    s.launch_host_func([cpu, params, d, o] { cpu->step(params, d, o); });
  } else {
    adam_step_cuda(params, d, o, s.native_handle(), nullptr);
  }
  s.synchronize(m.timeout);
}

}  // namespace strata
