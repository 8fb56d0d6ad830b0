// The fake CUDA runtime's state: devices, memory views, pinned ranges, stream workers, events,
// pending ranges and counters (see fake_internal.hpp for the model).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fakecuda/fake_internal.hpp"

namespace fakecuda {

void violation(const std::string& what) {
  std::fprintf(stderr, "\nfakecuda: VIOLATION: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

namespace {

std::uint64_t env_u64(const char* name, std::uint64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  return std::strtoull(v, nullptr, 10);
}

// $STRATA_FAKECUDA_REPORT: a line "context DEVICE pid PID" is appended when a process creates a
// device's primary context — for tests that run a whole program (the CLI, which may fork and
// _exit, so nothing is left for an exit handler).
void report_context(int dev) {
  const char* path = std::getenv("STRATA_FAKECUDA_REPORT");
  if (!path || !*path) return;
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "context %d pid %d\n", dev, static_cast<int>(::getpid()));
    std::fclose(f);
  }
}

}  // namespace

std::uint64_t checksum(const void* p, std::size_t n) {
  // FNV-1a over 8-byte words (then the tail): fast enough for test-sized copies.
  const auto* b = static_cast<const unsigned char*>(p);
  std::uint64_t h = 1469598103934665603ULL;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 1099511628211ULL;
  }
  for (; i < n; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  return h;
}

ThreadState& thread_state() {
  thread_local ThreadState t;
  return t;
}

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) thread_state().last = e;
  return e;
}

void touch_context(int dev) {
  Runtime& rt = Runtime::get();
  std::lock_guard<std::mutex> lock(rt.mu());
  if (rt.device(dev).context) return;
  rt.device(dev).context = true;
  report_context(dev);
}

// ---- streams ------------------------------------------------------------------------------------

void StreamState::push(Task t) {
  {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(t));
    ++enqueued;
    answered_not_ready = false;
  }
  cv.notify_all();
}

void StreamState::wait_for(std::uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return completed >= seq; });
}

bool StreamState::sync_to(std::uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return completed >= seq; });
  synced = std::max(synced, seq);
  return observe_locked(seq);
}

bool StreamState::observe_locked(std::uint64_t seq) {
  if (observed >= seq) return false;
  observed = seq;
  return true;
}

bool StreamState::done_up_to(std::uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu);
  return completed >= seq;
}

void StreamState::loop() {
  Runtime& rt = Runtime::get();
  for (;;) {
    Task t;
    std::uint64_t delay = 0;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;
      t = std::move(queue.front());
      queue.pop_front();
      if (rt.jitter_us()) delay = rng() % (rt.jitter_us() + 1);
    }
    if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    bool faulted = false;
    {
      std::unique_lock<std::mutex> lock(rt.mu());
      rt.pause_cv().wait(lock, [&] { return !rt.device(device).paused; });
      faulted = rt.device(device).sticky != cudaSuccess;
    }
    if (!faulted && t.run) t.run();  // after a device fault nothing runs any more
    if (t.pending_id) rt.finish_pending(t.pending_id);
    {
      std::lock_guard<std::mutex> lock(mu);
      ++completed;
    }
    cv.notify_all();
  }
}

// ---- runtime ------------------------------------------------------------------------------------

Runtime& Runtime::get() {
  static Runtime* rt = new Runtime();  // never destroyed: workers may outlive static teardown
  return *rt;
}

Runtime::Runtime() {
  const auto n = env_u64("STRATA_FAKECUDA_DEVICES", 2);
  const auto mem = env_u64("STRATA_FAKECUDA_MEMORY", 8ULL << 30);
  jitter_us_ = env_u64("STRATA_FAKECUDA_JITTER_US", 200);
  seed_ = env_u64("STRATA_FAKECUDA_SEED", 1);
  driver_lock_ = env_u64("STRATA_FAKECUDA_DRIVER_LOCK", 0) != 0;
  devices_.resize(n);
  for (auto& d : devices_) d.total = mem;
}

cudaError_t Runtime::malloc(int dev, std::size_t bytes, void** out) {
  const std::size_t size = (bytes + 4095) / 4096 * 4096;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceState& d = device(dev);
    if (d.used + size > d.total) return cudaErrorMemoryAllocation;
    d.used += size;
  }
  auto undo = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    device(dev).used -= size;
    return cudaErrorMemoryAllocation;
  };
  const int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0) return undo();
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    ::close(fd);
    return undo();
  }
  void* view = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, 0);
  void* shadow = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (view == MAP_FAILED || shadow == MAP_FAILED) {
    if (view != MAP_FAILED) munmap(view, size);
    if (shadow != MAP_FAILED) munmap(shadow, size);
    return undo();
  }
  std::memset(shadow, 0xA5, std::min<std::size_t>(size, 1 << 20));  // cudaMalloc is not zeroed
  std::lock_guard<std::mutex> lock(mu_);
  auto a = reinterpret_cast<std::uintptr_t>(view);
  allocs_[a] = Alloc{a, size, bytes, static_cast<char*>(shadow), dev};
  *out = view;
  return cudaSuccess;
}

cudaError_t Runtime::free(void* p) {
  Alloc a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == allocs_.end()) return cudaErrorInvalidValue;
    a = it->second;
  }
  // cudaFree synchronises the device; with STRATA_FAKECUDA_DRIVER_LOCK=1 every device of the
  // process (it takes the driver's locks: work in flight anywhere, NCCL kernels waiting for their
  // peers included, has to finish first — the multi-GPU-in-one-process NCCL hang).
  if (driver_lock_) {
    for (int d = 0; d < device_count(); ++d) drain_device(d);
  } else {
    drain_device(a.device);
  }
  std::lock_guard<std::mutex> lock(mu_);
  allocs_.erase(a.dev);
  device(a.device).used -= a.size;
  munmap(reinterpret_cast<void*>(a.dev), a.size);
  munmap(a.shadow, a.size);
  return cudaSuccess;
}

const Alloc* Runtime::find(const void* p, std::size_t n, bool* bad) {
  *bad = false;
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocs_.upper_bound(x);
  if (it == allocs_.begin()) return nullptr;
  --it;
  if (x >= it->first + it->second.size) return nullptr;
  // Past the requested bytes is out of bounds, as on a GPU (the page rounding is the fake's).
  if (x + n > it->first + it->second.requested) *bad = true;
  return &it->second;
}

int Runtime::device_of(const void* p) {
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocs_.upper_bound(x);
  if (it == allocs_.begin()) return -1;
  --it;
  return x < it->first + it->second.requested ? it->second.device : -1;
}

char* Runtime::shadow_of(const void* p, std::size_t n, int* dev) {
  bool bad = false;
  const Alloc* a = find(p, n, &bad);
  if (!a || bad) return nullptr;
  if (dev) *dev = a->device;
  return a->shadow + (reinterpret_cast<std::uintptr_t>(p) - a->dev);
}

cudaError_t Runtime::host_register(void* p, std::size_t n) {
  if (!p || n == 0) return cudaErrorInvalidValue;
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [lo, len] : pinned_)
    if (x < lo + len && lo < x + n) return cudaErrorHostMemoryAlreadyRegistered;
  pinned_[x] = n;
  return cudaSuccess;
}

cudaError_t Runtime::host_unregister(void* p) {
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  std::size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pinned_.find(x);
    if (it == pinned_.end()) return cudaErrorHostMemoryNotRegistered;
    n = it->second;
  }
  if (range_busy(Range{x, x + n}, -2))
    violation("cudaHostUnregister(" + std::to_string(x) + ", " + std::to_string(n) +
              " bytes) while queued copies still use that memory");
  std::lock_guard<std::mutex> lock(mu_);
  pinned_.erase(x);
  return cudaSuccess;
}

bool Runtime::is_pinned(const void* p, std::size_t n) {
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pinned_.upper_bound(x);
  if (it == pinned_.begin()) return false;
  --it;
  return x >= it->first && x + n <= it->first + it->second;
}

std::size_t Runtime::registered_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t s = 0;
  for (const auto& [lo, len] : pinned_) s += len;
  return s;
}

int Runtime::registered_ranges() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(pinned_.size());
}

std::shared_ptr<StreamState> Runtime::new_stream(int dev, bool blocking, bool legacy) {
  auto s = std::make_shared<StreamState>();
  s->device = dev;
  s->blocking = blocking;
  s->legacy = legacy;
  std::lock_guard<std::mutex> lock(mu_);
  s->rng.seed(seed_ * 0x9E3779B97F4A7C15ULL + streams_made_++);
  s->worker = std::thread([raw = s.get()] { raw->loop(); });
  streams_[s.get()] = s;
  device(dev).streams.push_back(s);
  return s;
}

std::shared_ptr<StreamState> Runtime::stream(cudaStream_t h) {
  if (h == nullptr || h == cudaStreamLegacy) {
    const int dev = thread_state().current;
    std::shared_ptr<StreamState> legacy;
    {
      std::lock_guard<std::mutex> lock(mu_);
      legacy = device(dev).legacy;
    }
    if (!legacy) {
      legacy = new_stream(dev, true, true);
      std::lock_guard<std::mutex> lock(mu_);
      if (device(dev).legacy) return device(dev).legacy;  // another thread made it first
      device(dev).legacy = legacy;
    }
    return legacy;
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(reinterpret_cast<StreamState*>(h));
  return it == streams_.end() ? nullptr : it->second;
}

cudaStream_t Runtime::handle(const std::shared_ptr<StreamState>& s) {
  return reinterpret_cast<cudaStream_t>(s.get());
}

bool Runtime::valid_stream(cudaStream_t h) {
  if (h == nullptr || h == cudaStreamLegacy) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return streams_.count(reinterpret_cast<StreamState*>(h)) != 0;
}

void Runtime::destroy_stream(cudaStream_t h) {
  std::shared_ptr<StreamState> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(reinterpret_cast<StreamState*>(h));
    if (it == streams_.end()) return;
    s = it->second;
    streams_.erase(it);
  }
  // CUDA lets queued work finish after cudaStreamDestroy returns; the fake waits for it here.
  s->wait_for(s->enqueued);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stop = true;
  }
  s->cv.notify_all();
  s->worker.join();
}

EventState* Runtime::event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = events_.find(reinterpret_cast<EventState*>(e));
  return it == events_.end() ? nullptr : it->second.get();
}

cudaEvent_t Runtime::new_event(int dev, bool timing) {
  auto e = std::make_unique<EventState>();
  e->device = dev;
  e->timing = timing;
  EventState* raw = e.get();
  std::lock_guard<std::mutex> lock(mu_);
  events_[raw] = std::move(e);
  return reinterpret_cast<cudaEvent_t>(raw);
}

void Runtime::destroy_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.erase(reinterpret_cast<EventState*>(e));
}

void Runtime::enqueue(const std::shared_ptr<StreamState>& s, Task t, Pending pending) {
  std::vector<std::pair<std::shared_ptr<StreamState>, std::uint64_t>> after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DeviceState& d = device(s->device);
    if (s->legacy) {
      for (auto& w : d.streams)
        if (auto o = w.lock(); o && o != s && o->blocking) after.emplace_back(o, 0);
    } else if (s->blocking && d.legacy) {
      after.emplace_back(d.legacy, 0);
    }
  }
  for (auto& [o, seq] : after) {
    {
      std::lock_guard<std::mutex> lock(o->mu);
      seq = o->enqueued;
    }
    if (!o->done_up_to(seq)) {
      auto other = o;
      const std::uint64_t upto = seq;
      s->push(Task{[other, upto] { other->wait_for(upto); }, "legacy-stream order", 0});
    }
  }
  if (!pending.ranges.empty() || pending.kernel_device >= 0 || pending.host_func) {
    std::lock_guard<std::mutex> lock(mu_);
    t.pending_id = next_pending_++;
    pending_[t.pending_id] = std::move(pending);
  }
  s->push(std::move(t));
}

void Runtime::drain_device(int dev) {
  std::vector<std::shared_ptr<StreamState>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : device(dev).streams)
      if (auto s = w.lock()) all.push_back(s);
  }
  for (auto& s : all) {
    std::uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      seq = s->enqueued;
    }
    s->sync_to(seq);
  }
}

bool Runtime::range_busy(const Range& r, int device_of_range) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, p] : pending_) {
    if (device_of_range < 0 && p.host_func) return true;
    if (device_of_range >= 0 && p.kernel_device == device_of_range) return true;
    for (const Range& x : p.ranges)
      if (x.overlaps(r)) return true;
  }
  return false;
}

void Runtime::finish_pending(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.erase(id);
}

void Runtime::count(const char* name, long n) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_[name] += n;
}

long Runtime::counter(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counters_.find(name);
  return it == counters_.end() ? 0 : it->second;
}

void Runtime::reset_counters() {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.clear();
}

}  // namespace fakecuda

// ---- control API (fakecuda.h) -------------------------------------------------------------------

using fakecuda::Runtime;

extern "C" {

int fakecuda_active(void) { return 1; }

int fakecuda_context_created(int dev) {
  Runtime& rt = Runtime::get();
  if (dev < 0 || dev >= rt.device_count()) return 0;
  std::lock_guard<std::mutex> lock(rt.mu());
  return rt.device(dev).context ? 1 : 0;
}

long fakecuda_counter(const char* name) { return Runtime::get().counter(name); }
void fakecuda_reset_counters(void) { Runtime::get().reset_counters(); }

void fakecuda_fail_next_kernel(int dev) {
  Runtime& rt = Runtime::get();
  std::lock_guard<std::mutex> lock(rt.mu());
  rt.device(dev).fail_next_kernel = true;
}

void fakecuda_set_paused(int dev, int paused) {
  Runtime& rt = Runtime::get();
  {
    std::lock_guard<std::mutex> lock(rt.mu());
    rt.device(dev).paused = paused != 0;
  }
  rt.pause_cv().notify_all();
}

size_t fakecuda_registered_bytes(void) { return Runtime::get().registered_bytes(); }
int fakecuda_registered_ranges(void) { return Runtime::get().registered_ranges(); }

}  // extern "C"
