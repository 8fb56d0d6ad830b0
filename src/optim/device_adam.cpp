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
  bool pending = false;                           // work queued since the last wait
  std::chrono::steady_clock::time_point done_at;  // when the last queued host-array update ended
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
    wait();  // queued updates still use the buffers
    const std::size_t want = std::max(n, capacity);
    const std::size_t g = std::max(gs, grad_size), c = std::max(cs, copy_size);
    mem.reset();
    capacity = 0;
    mem = device.allocate(layout(want, g, c));
    capacity = want;
    grad_size = g;
    copy_size = c;
  }
  void wait() {
    if (!pending) return;
    pending = false;
    stream->synchronize(timeout);
  }
  // Runs `queue_work` (stream operations); on failure waits for what the stream already holds
  // before rethrowing, or throws the wait's timeout (the arrays may still be in use).
  template <typename F>
  void queue(F&& queue_work) {
    try {
      queue_work();
      pending = true;
    } catch (...) {
      pending = false;
      try {
        stream->synchronize(timeout);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kTimeout) throw;
      }
      throw;
    }
  }
  void launch(const AdamParams& params, const AdamTensors& d, const AdamStepOptions& o) {
    if (cpu) {
      CpuAdam* k = cpu.get();
      stream->launch_host_func([k, params, d, o] { k->step(params, d, o); });
    } else {
      adam_step_cuda(params, d, o, stream->native_handle(), nullptr);
    }
  }
};

namespace {
void check_step_args(const AdamTensors& t, const AdamStepOptions& o) {
  if (o.check_finite)
    fail(ErrorCode::kInvalidArgument,
         "DeviceAdam: check_finite is not supported; check the gradients before the step");
  if (!t.param || !t.exp_avg || !t.exp_avg_sq || !t.grad)
    fail(ErrorCode::kInvalidArgument, "DeviceAdam: null array");
}
}  // namespace

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
  enqueue(params, host, o);
  wait();
}

void DeviceAdam::step_resident(const AdamParams& params, const AdamTensors& d,
                               const AdamStepOptions& o) {
  enqueue_resident(params, d, o);
  wait();
}

void DeviceAdam::wait() { impl_->wait(); }
std::chrono::steady_clock::time_point DeviceAdam::completed_at() const { return impl_->done_at; }

void DeviceAdam::enqueue(const AdamParams& params, const AdamTensors& host,
                         const AdamStepOptions& o) {
  check_step_args(host, o);
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
  d.param_out = d.exp_avg_out = d.exp_avg_sq_out = nullptr;  // in place in the device's copy

  Stream& s = *m.stream;
  m.queue([&] {
    s.memcpy_async(d.param, host.param, n * sizeof(float));
    s.memcpy_async(d.exp_avg, host.exp_avg, n * sizeof(float));
    s.memcpy_async(d.exp_avg_sq, host.exp_avg_sq, n * sizeof(float));
    s.memcpy_async(const_cast<void*>(d.grad), host.grad, n * gs);
    m.launch(params, d, o);  // in place in the device's copy; back to the out arrays if given
    const bool out = host.param_out != nullptr;
    s.memcpy_async(out ? host.param_out : host.param, d.param, n * sizeof(float));
    s.memcpy_async(out ? host.exp_avg_out : host.exp_avg, d.exp_avg, n * sizeof(float));
    s.memcpy_async(out ? host.exp_avg_sq_out : host.exp_avg_sq, d.exp_avg_sq, n * sizeof(float));
    if (host.param_copy) s.memcpy_async(host.param_copy, d.param_copy, n * cs);
    s.launch_host_func([&m] { m.done_at = std::chrono::steady_clock::now(); });
  });
}

void DeviceAdam::enqueue_resident(const AdamParams& params, const AdamTensors& d,
                                  const AdamStepOptions& o) {
  check_step_args(d, o);
  if (d.param_out)
    fail(ErrorCode::kUnsupported, "DeviceAdam: an update of resident arrays out of place");
  if (d.n == 0) return;
  impl_->queue([&] { impl_->launch(params, d, o); });
}

}  // namespace strata
