// The CUDA runtime entry points strata and its tests call, on the fake runtime's model
// (fake_internal.hpp). Semantics follow the CUDA Runtime API documentation: per-thread last error
// (every failing call records it, cudaErrorNotReady from a query included), sticky device errors,
// a per-thread current device (cudaSetDevice creates the primary context, as CUDA >= 12 does),
// kernel launches only into streams of the current device, copies into any stream, legacy
// default stream synchronisation, synchronous pageable device-to-host copies, cudaFree
// synchronising, and no runtime call from inside a host function.
#include <cuda.h>

#include <chrono>
#include <cstring>

#include "fakecuda/fake_internal.hpp"

using namespace fakecuda;

namespace {

// Common prologue: no CUDA call from a host function; a sticky error of `dev` answers first.
cudaError_t enter(int dev = -1) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (dev < 0) dev = thread_state().current;
  if (dev >= rt.device_count()) return cudaSuccess;
  std::lock_guard<std::mutex> lock(rt.mu());
  if (rt.device(dev).sticky != cudaSuccess) return ret(rt.device(dev).sticky);
  return cudaSuccess;
}

#define FAKE_ENTER(dev)               \
  do {                                \
    cudaError_t e_ = enter(dev);      \
    if (e_ != cudaSuccess) return e_; \
  } while (0)

int current() { return thread_state().current; }

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

struct CopyPlan {
  char* dst = nullptr;
  const char* src = nullptr;
  int dst_dev = -1, src_dev = -1;  // -1: host
  bool dst_pageable = false, src_pageable = false;
};

cudaError_t plan_copy(void* dst, const void* src, std::size_t n, CopyPlan* p) {
  Runtime& rt = Runtime::get();
  bool bad_d = false, bad_s = false;
  const Alloc* ad = rt.find(dst, n, &bad_d);
  const Alloc* as = rt.find(src, n, &bad_s);
  if (bad_d || bad_s) return cudaErrorInvalidValue;  // a range running past its allocation
  p->dst = ad ? ad->shadow + (static_cast<char*>(dst) - reinterpret_cast<char*>(ad->dev))
              : static_cast<char*>(dst);
  p->src = as ? as->shadow + (static_cast<const char*>(src) - reinterpret_cast<char*>(as->dev))
              : static_cast<const char*>(src);
  p->dst_dev = ad ? ad->device : -1;
  p->src_dev = as ? as->device : -1;
  p->dst_pageable = !ad && !rt.is_pinned(dst, n);
  p->src_pageable = !as && !rt.is_pinned(src, n);
  return cudaSuccess;
}

Range range_of(const void* p, std::size_t n) {
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  return Range{x, x + n};
}

// Queues the copy; returns the stream position to wait for when the call must be synchronous.
cudaError_t queue_copy(const CopyPlan& c, std::size_t n, const std::shared_ptr<StreamState>& s,
                       bool sync) {
  Runtime& rt = Runtime::get();
  const bool host_to_host = c.dst_dev < 0 && c.src_dev < 0;
  if (host_to_host || (c.dst_dev < 0 && c.dst_pageable) || c.src_pageable)
    rt.count("pageable_copy");
  sync = sync || host_to_host || (c.dst_dev < 0 && c.dst_pageable);
  const char* src = c.src;
  std::shared_ptr<std::vector<char>> staged;
  if (c.src_dev < 0 && c.src_pageable && !sync) {  // staged at the call, like the real runtime
    staged = std::make_shared<std::vector<char>>(c.src, c.src + n);
    src = staged->data();
  }
  const Range dr = range_of(c.dst, n), sr = range_of(c.src, n);
  if (!sync && !rt.range_busy(dr, c.dst_dev)) std::memset(c.dst, 0xFF, n);  // poison
  const bool check = c.src_dev < 0 && !staged && !sync && !rt.range_busy(sr, -1);
  const std::uint64_t sum = check ? checksum(src, n) : 0;
  char* dst = c.dst;
  Task t;
  t.what = "memcpy";
  t.run = [dst, src, n, check, sum, staged] {
    if (check && checksum(src, n) != sum)
      violation("host memory " + hex(src) + " (" + std::to_string(n) +
                " bytes) was modified after cudaMemcpyAsync queued a copy from it and before "
                "the copy ran");
    std::memmove(dst, src, n);
  };
  Pending pend;
  pend.ranges.push_back(dr);
  if (!staged) pend.ranges.push_back(sr);
  rt.enqueue(s, std::move(t), std::move(pend));
  if (sync) {
    std::uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      seq = s->enqueued;
    }
    s->sync_to(seq);
    std::lock_guard<std::mutex> lock(rt.mu());
    if (rt.device(s->device).sticky != cudaSuccess) return ret(rt.device(s->device).sticky);
  }
  return cudaSuccess;
}

cudaError_t memcpy_impl(void* dst, const void* src, std::size_t n, cudaStream_t stream, bool sync) {
  FAKE_ENTER(-1);
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return ret(cudaErrorInvalidValue);
  CopyPlan plan;
  if (cudaError_t e = plan_copy(dst, src, n, &plan); e != cudaSuccess) return ret(e);
  touch_context(current());
  auto s = rt.stream(stream);
  return queue_copy(plan, n, s, sync);
}

cudaError_t memset_impl(void* dst, int value, std::size_t n, cudaStream_t stream, bool sync) {
  FAKE_ENTER(-1);
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(stream)) return ret(cudaErrorInvalidResourceHandle);
  if (n == 0) return cudaSuccess;
  int dev = -1;
  char* d = rt.shadow_of(dst, n, &dev);
  if (!d) return ret(cudaErrorInvalidValue);  // not (entirely) device memory
  touch_context(current());
  auto s = rt.stream(stream);
  Pending pend;
  pend.ranges.push_back(range_of(d, n));
  rt.enqueue(s, Task{[d, value, n] { std::memset(d, value, n); }, "memset", 0}, std::move(pend));
  if (sync) s->sync_to(s->enqueued);
  return cudaSuccess;
}

cudaError_t sticky_of(int dev) {
  Runtime& rt = Runtime::get();
  std::lock_guard<std::mutex> lock(rt.mu());
  return rt.device(dev).sticky;
}

// The stream a stream call names, or null with *err what the call returns: cudaErrorNotPermitted
// from inside a host function (as CUDA), cudaErrorInvalidResourceHandle for a destroyed or unknown
// handle.
std::shared_ptr<StreamState> called_stream(cudaStream_t h, cudaError_t* err) {
  if (thread_state().in_host_func) {
    *err = cudaErrorNotPermitted;
    return nullptr;
  }
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(h)) {
    *err = cudaErrorInvalidResourceHandle;
    return nullptr;
  }
  return rt.stream(h);
}

// The event an event call names, or null with *err what the call returns (as called_stream).
EventState* called_event(cudaEvent_t ev, cudaError_t* err) {
  if (thread_state().in_host_func) {
    *err = cudaErrorNotPermitted;
    return nullptr;
  }
  EventState* e = Runtime::get().event(ev);
  if (!e) *err = cudaErrorInvalidResourceHandle;
  return e;
}

}  // namespace

extern "C" {

// ---- errors
// --------------------------------------------------------------------------------------

cudaError_t cudaGetLastError(void) {
  ThreadState& t = thread_state();
  const cudaError_t sticky =
      Runtime::get().device_count() > t.current ? sticky_of(t.current) : cudaSuccess;
  if (sticky != cudaSuccess) return sticky;
  const cudaError_t e = t.last;
  t.last = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  ThreadState& t = thread_state();
  const cudaError_t sticky =
      Runtime::get().device_count() > t.current ? sticky_of(t.current) : cudaSuccess;
  return sticky != cudaSuccess ? sticky : t.last;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
    case cudaErrorHostMemoryNotRegistered: return "cudaErrorHostMemoryNotRegistered";
    case cudaErrorNotPermitted: return "cudaErrorNotPermitted";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cudaErrorNotPermitted: return "operation not permitted";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    default: return cudaGetErrorName(e);
  }
}

// ---- devices
// -------------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  if (!count) return ret(cudaErrorInvalidValue);
  *count = Runtime::get().device_count();
  return *count ? cudaSuccess : ret(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* dev) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  if (!dev) return ret(cudaErrorInvalidValue);
  *dev = current();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  if (dev < 0 || dev >= Runtime::get().device_count()) return ret(cudaErrorInvalidDevice);
  thread_state().current = dev;
  touch_context(dev);  // CUDA >= 12: cudaSetDevice initialises the device's primary context
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int dev) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (!prop) return ret(cudaErrorInvalidValue);
  if (dev < 0 || dev >= rt.device_count()) return ret(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "fake GPU %d (strata fakecuda)", dev);
  prop->totalGlobalMem = rt.device(dev).total;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 4 + dev;  // differs per device: a grid sized on the wrong one shows
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int dev) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (!value) return ret(cudaErrorInvalidValue);
  if (dev < 0 || dev >= rt.device_count()) return ret(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = 4 + dev; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = 32; return cudaSuccess;
    default: return ret(cudaErrorInvalidValue);
  }
}

cudaError_t cudaDeviceSynchronize(void) {
  FAKE_ENTER(-1);
  touch_context(current());
  Runtime::get().count("device_sync");
  Runtime::get().count("host_sync");
  Runtime::get().drain_device(current());
  const cudaError_t s = sticky_of(current());
  return s != cudaSuccess ? ret(s) : cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

// ---- memory
// --------------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** p, size_t bytes) {
  FAKE_ENTER(-1);
  if (!p) return ret(cudaErrorInvalidValue);
  touch_context(current());
  Runtime::get().count("malloc");
  Runtime::get().count("device_sync");
  if (bytes == 0) {
    *p = nullptr;
    return cudaSuccess;
  }
  return ret(Runtime::get().malloc(current(), bytes, p));
}

cudaError_t cudaFree(void* p) {
  FAKE_ENTER(-1);
  touch_context(current());  // the first call of a thread binds its current device's context
  if (!p) return cudaSuccess;
  Runtime::get().count("free");
  Runtime::get().count("device_sync");
  return ret(Runtime::get().free(p));
}

cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned int) {
  FAKE_ENTER(-1);
  touch_context(current());
  Runtime::get().count("host_register");
  return ret(Runtime::get().host_register(p, bytes));
}

cudaError_t cudaHostUnregister(void* p) {
  FAKE_ENTER(-1);
  touch_context(current());
  Runtime::get().count("host_unregister");
  return ret(Runtime::get().host_unregister(p));
}

// As CUDA >= 11: device memory (within a live allocation's requested bytes) of its device, a
// registered host range as host memory (UVA: both pointers the address), anything else
// (pageable, freed, null) unregistered, with cudaSuccess and no last error.
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  FAKE_ENTER(-1);
  if (!a) return ret(cudaErrorInvalidValue);
  Runtime& rt = Runtime::get();
  rt.count("pointer_attributes");
  *a = cudaPointerAttributes{};
  a->type = cudaMemoryTypeUnregistered;
  a->device = current();
  if (!p) return cudaSuccess;
  const int dev = rt.device_of(p);
  if (dev >= 0) {
    a->type = cudaMemoryTypeDevice;
    a->device = dev;
    a->devicePointer = const_cast<void*>(p);
  } else if (rt.is_pinned(p, 1)) {
    a->type = cudaMemoryTypeHost;
    a->devicePointer = a->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  return memcpy_impl(dst, src, n, nullptr, true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  return memcpy_impl(dst, src, n, s, false);
}

cudaError_t cudaMemset(void* dst, int value, size_t n) {
  return memset_impl(dst, value, n, nullptr, true);
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t n, cudaStream_t s) {
  return memset_impl(dst, value, n, s, false);
}

// ---- streams
// -------------------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  FAKE_ENTER(-1);
  if (!s) return ret(cudaErrorInvalidValue);
  touch_context(current());
  Runtime& rt = Runtime::get();
  *s = rt.handle(rt.new_stream(current(), (flags & cudaStreamNonBlocking) == 0, false));
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (!s || !rt.valid_stream(s)) return ret(cudaErrorInvalidResourceHandle);
  rt.destroy_stream(s);
  return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t h, int* dev) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  if (!dev) return ret(cudaErrorInvalidValue);
  if (!rt.valid_stream(h)) return ret(cudaErrorInvalidResourceHandle);
  *dev = rt.stream(h)->device;
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t h) {
  cudaError_t err = cudaSuccess;
  auto s = called_stream(h, &err);
  if (!s) return ret(err);
  Runtime& rt = Runtime::get();
  if (cudaError_t e = sticky_of(s->device); e != cudaSuccess) return ret(e);
  std::lock_guard<std::mutex> lock(s->mu);
  // New work answers NotReady at least once, however fast it ran.
  if (s->completed < s->enqueued || (s->enqueued > s->synced && !s->answered_not_ready)) {
    s->answered_not_ready = true;
    rt.count("not_ready");
    return ret(cudaErrorNotReady);
  }
  if (s->observe_locked(s->enqueued)) rt.count("host_sync");
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h) {
  cudaError_t err = cudaSuccess;
  auto s = called_stream(h, &err);
  if (!s) return ret(err);
  if (s->sync_to(s->enqueued)) Runtime::get().count("host_sync");
  if (cudaError_t e = sticky_of(s->device); e != cudaSuccess) return ret(e);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t ev, unsigned int) {
  cudaError_t err = cudaSuccess;
  auto s = called_stream(h, &err);
  if (!s) return ret(err);
  Runtime& rt = Runtime::get();
  EventState* e = rt.event(ev);
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (!e->stream) return cudaSuccess;  // never recorded: nothing to wait for
  auto producer = e->stream;
  const std::uint64_t seq = e->seq;
  rt.enqueue(s, Task{[producer, seq] { producer->wait_for(seq); }, "wait event", 0}, Pending{});
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t h, cudaHostFn_t fn, void* data) {
  FAKE_ENTER(-1);
  Runtime& rt = Runtime::get();
  if (!rt.valid_stream(h) || !fn) return ret(cudaErrorInvalidValue);
  auto s = rt.stream(h);
  Pending pend;
  pend.host_func = true;
  rt.enqueue(s,
             Task{[fn, data] {
                    thread_state().in_host_func = true;
                    fn(data);
                    thread_state().in_host_func = false;
                  },
                  "host function", 0},
             std::move(pend));
  return cudaSuccess;
}

// ---- events
// --------------------------------------------------------------------------------------

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  FAKE_ENTER(-1);
  if (!e) return ret(cudaErrorInvalidValue);
  touch_context(current());
  *e = Runtime::get().new_event(current(), (flags & cudaEventDisableTiming) == 0);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  if (!Runtime::get().event(e)) return ret(cudaErrorInvalidResourceHandle);
  Runtime::get().destroy_event(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t h) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  EventState* e = rt.event(ev);
  if (!e || !rt.valid_stream(h)) return ret(cudaErrorInvalidResourceHandle);
  auto s = rt.stream(h);
  if (s->device != e->device) return ret(cudaErrorInvalidResourceHandle);  // as CUDA
  if (e->timing) {  // a marker that stamps the time the stream reaches this point
    auto stamp = std::make_shared<std::atomic<std::int64_t>>(0);
    e->stamp = stamp;
    s->push(Task{[stamp] {
                   *stamp = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now().time_since_epoch())
                                .count();
                 },
                 "event timestamp", 0});
  }
  std::lock_guard<std::mutex> lock(s->mu);
  e->stream = s;
  e->seq = s->enqueued;
  e->answered_not_ready = false;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
  cudaError_t err = cudaSuccess;
  EventState* e = called_event(ev, &err);
  if (!e) return ret(err);
  Runtime& rt = Runtime::get();
  if (cudaError_t st = sticky_of(e->device); st != cudaSuccess) return ret(st);
  if (!e->stream) return cudaSuccess;
  bool synced = false;
  {
    std::lock_guard<std::mutex> lock(e->stream->mu);
    synced = e->stream->synced >= e->seq;
  }
  if (!e->stream->done_up_to(e->seq) || (e->seq && !synced && !e->answered_not_ready)) {
    e->answered_not_ready = true;
    rt.count("not_ready");
    return ret(cudaErrorNotReady);
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(e->stream->mu);
    first = e->stream->observe_locked(e->seq);
  }
  if (first) rt.count("host_sync");
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (thread_state().in_host_func) return ret(cudaErrorNotPermitted);
  Runtime& rt = Runtime::get();
  EventState* a = rt.event(start);
  EventState* b = rt.event(end);
  if (!ms || !a || !b) return ret(cudaErrorInvalidResourceHandle);
  if (!a->timing || !b->timing || !a->stamp || !b->stamp)
    return ret(cudaErrorInvalidResourceHandle);
  const std::int64_t t0 = *a->stamp, t1 = *b->stamp;
  if (t0 == 0 || t1 == 0) return ret(cudaErrorNotReady);
  *ms = static_cast<float>(static_cast<double>(t1 - t0) / 1e6);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  cudaError_t err = cudaSuccess;
  EventState* e = called_event(ev, &err);
  if (!e) return ret(err);
  if (e->stream && e->stream->sync_to(e->seq)) Runtime::get().count("host_sync");
  if (cudaError_t st = sticky_of(e->device); st != cudaSuccess) return ret(st);
  return cudaSuccess;
}

// ---- driver entry points (the device guard asks whether a primary context exists) ---------------

static CUresult fake_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  Runtime& rt = Runtime::get();
  if (dev < 0 || dev >= rt.device_count()) return CUDA_ERROR_INVALID_DEVICE;
  if (flags) *flags = 0;
  std::lock_guard<std::mutex> lock(rt.mu());
  if (active) *active = rt.device(dev).context ? 1 : 0;
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (!symbol || !fn) return ret(cudaErrorInvalidValue);
  if (std::strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0) {
    *fn = reinterpret_cast<void*>(&fake_cuDevicePrimaryCtxGetState);
    if (status) *status = cudaDriverEntryPointSuccess;
    return cudaSuccess;
  }
  *fn = nullptr;
  if (status) *status = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

}  // extern "C"
