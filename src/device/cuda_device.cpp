#include "device/cuda_device.hpp"

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "core/poll_backoff.hpp"
#include "core/rethrow.hpp"
#include "cuda/device_guard.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::device {
namespace {

using cuda::DeviceGuard;

// Every failure clears the thread's last-error slot before throwing: a non-sticky error left
// there would otherwise be reported by the next unrelated launch check (adam_step_cuda's).
[[noreturn]] void cuda_fail(cudaError_t rc, const char* call, ErrorCode code = ErrorCode::kDevice) {
  (void)cudaGetLastError();
  fail(code,
       strcat("CUDA ", call, " failed: ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc)));
}

#define STRATA_CUDA_CHECK(call)                    \
  do {                                             \
    cudaError_t rc_ = (call);                      \
    if (rc_ != cudaSuccess) cuda_fail(rc_, #call); \
  } while (0)

void log_if_error(cudaError_t rc, const char* call) noexcept {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  log_error("CUDA ", call, " failed: ", cudaGetErrorString(rc));
}

// A stream/event query: true when complete, false for cudaErrorNotReady — which the runtime also
// records in the calling thread's last-error slot; it is cleared here, or the next
// `kernel<<<>>>; cudaGetLastError()` of this thread would report it (PyTorch's CUDAEvent::query
// clears it for the same reason). Throws for any other error.
bool query_done(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return true;
  if (rc == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  cuda_fail(rc, what);
}

// Polls `query` until complete or the deadline passes (a bounded wait: cudaStreamSynchronize has
// no deadline). Between polls a PollBackoff: a 10 us spin, then sleeps of 1 -> 64 us.
template <typename Query>
void poll_until(Query query, std::chrono::milliseconds timeout, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  PollBackoff backoff;
  for (;;) {
    if (query_done(query(), what)) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      fail(ErrorCode::kTimeout,
           strcat("CUDA ", what, ": not complete after ", timeout.count(), " ms"));
    }
    backoff.pause();
  }
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) : ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { log_if_error(cudaEventDestroy(event_), "cudaEventDestroy"); }
  bool query() override { return query_done(cudaEventQuery(event_), "cudaEventQuery"); }
  void synchronize(std::chrono::milliseconds timeout) override {
    poll_until([&] { return cudaEventQuery(event_); }, timeout, "cudaEventQuery");
  }
  cudaEvent_t get() const { return event_; }

 private:
  int ordinal_;
  cudaEvent_t event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int ordinal) : ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    log_if_error(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    if (handoff_) log_if_error(cudaEventDestroy(handoff_), "cudaEventDestroy");
    log_if_error(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
  void memcpy_async(void* dst, const void* src, std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void memset_async(void* dst, int value, std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    STRATA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  void record(Event& event) override {
    STRATA_CUDA_CHECK(cudaEventRecord(cuda_event(event).get(), stream_));
  }
  void wait_event(Event& event) override {
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event(event).get(), 0));
  }
  void wait_external(void* producer) override {
    if (producer == stream_) return;
    DeviceGuard guard(ordinal_);
    if (!handoff_) STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming));
    // The event must belong to the producer's device: a producer on another GPU gets its own.
    const int dev = cuda::stream_device(producer);
    if (dev != ordinal_)
      fail(ErrorCode::kInvalidArgument,
           strcat("CUDA stream hand-off: the producer stream is on device ", dev,
                  ", this stream on device ", ordinal_));
    STRATA_CUDA_CHECK(cudaEventRecord(handoff_, static_cast<cudaStream_t>(producer)));
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, handoff_, 0));
  }
  void launch_host_func(std::function<void()> fn) override {
    auto* job = new HostJob{std::move(fn), this};
    cudaError_t rc = cudaLaunchHostFunc(stream_, &CudaStream::run_host_job, job);
    if (rc != cudaSuccess) {
      delete job;
      cuda_fail(rc, "cudaLaunchHostFunc");
    }
  }
  void* native_handle() const noexcept override { return stream_; }
  void synchronize(std::chrono::milliseconds timeout) override {
    poll_until([&] { return cudaStreamQuery(stream_); }, timeout, "cudaStreamQuery");
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(host_error_mu_);
      e = host_error_;
    }
    if (e) rethrow_detached(e);
  }

 private:
  struct HostJob {
    std::function<void()> fn;
    CudaStream* stream;
  };
  // Runs on a CUDA runtime thread: no CUDA calls, no exceptions out.
  static void CUDART_CB run_host_job(void* p) {
    std::unique_ptr<HostJob> job(static_cast<HostJob*>(p));
    try {
      job->fn();
    } catch (...) {
      std::lock_guard<std::mutex> lock(job->stream->host_error_mu_);
      if (!job->stream->host_error_) job->stream->host_error_ = std::current_exception();
    }
  }
  std::mutex host_error_mu_;
  std::exception_ptr host_error_;  // first failure of a host function (sticky, like CUDA's)

  static CudaEvent& cuda_event(Event& event) {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (!e) fail(ErrorCode::kInvalidArgument, "CUDA device: event from another device");
    return *e;
  }
  int ordinal_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t handoff_ = nullptr;  // wait_external's event (recorded on the producer)
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {
    int count = 0;
    cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) cuda_fail(rc, "cudaGetDeviceCount", ErrorCode::kUnsupported);
    if (ordinal < 0 || ordinal >= count) {
      fail(ErrorCode::kUnsupported,
           strcat("CUDA device ", ordinal, " does not exist (", count, " device(s))"));
    }
    try {  // the device's context, now (a GPU that cannot be used fails here, not later)
      DeviceGuard guard(ordinal_);
      STRATA_CUDA_CHECK(cudaFree(nullptr));
    } catch (const Error& e) {
      fail(ErrorCode::kUnsupported, strcat("CUDA device ", ordinal, " cannot be used: ", e.what()));
    }
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
    name_ = strcat("cuda:", ordinal_, " ", prop.name);
    total_ = prop.totalGlobalMem;
  }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int ordinal() const override { return ordinal_; }
  std::string name() const override { return name_; }
  std::uint64_t total_memory() const override { return total_; }
  void* alloc(std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    void* p = nullptr;
    cudaError_t rc = cudaMalloc(&p, bytes ? bytes : 1);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the (non-sticky) allocation error
      fail(ErrorCode::kOutOfMemory,
           strcat("CUDA cudaMalloc(", bytes, ") on ", name_, " failed: out of device memory"));
    }
    if (rc != cudaSuccess) cuda_fail(rc, "cudaMalloc");
    return p;
  }
  void free(void* ptr) noexcept override {
    if (!ptr) return;
    try {
      DeviceGuard guard(ordinal_);  // else a thread's first call binds a context on GPU 0
      log_if_error(cudaFree(ptr), "cudaFree");
    } catch (const std::exception& e) {
      log_error("CUDA cudaFree on ", name_, ": ", e.what());
    }
  }
  std::unique_ptr<Stream> create_stream() override {
    return std::make_unique<CudaStream>(ordinal_);
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(ordinal_); }
  bool register_host(void* ptr, std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    const cudaError_t rc = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (rc == cudaSuccess) return true;
    (void)cudaGetLastError();
    const std::string what =
        strcat("CUDA cudaHostRegister(", ptr, ", ", bytes, " bytes) on ", name_,
               " failed: ", cudaGetErrorName(rc), ": ", cudaGetErrorString(rc));
    if (rc == cudaErrorMemoryAllocation)
      fail(ErrorCode::kOutOfMemory,
           strcat(what,
                  " (page-locked memory is limited by RLIMIT_MEMLOCK: raise it with "
                  "`ulimit -l` or memlock in /etc/security/limits.conf)"));
    if (rc == cudaErrorHostMemoryAlreadyRegistered || rc == cudaErrorInvalidValue)
      fail(ErrorCode::kInvalidArgument, what);
    fail(ErrorCode::kDevice, what);
  }
  void unregister_host(void* ptr) noexcept override {
    try {
      DeviceGuard guard(ordinal_);
      log_if_error(cudaHostUnregister(ptr), "cudaHostUnregister");
    } catch (const std::exception& e) {
      log_error("CUDA cudaHostUnregister on ", name_, ": ", e.what());
    }
  }

 private:
  int ordinal_;
  std::string name_;
  std::uint64_t total_ = 0;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int ordinal) {
  return std::make_unique<CudaDevice>(ordinal);
}

}  // namespace strata::device
