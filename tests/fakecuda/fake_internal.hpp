// Internal state of the fake CUDA runtime (tests only; see fakecuda.h).
//
// Model:
// - Devices 0..N-1, each with a primary context (created by the first context-creating call with
//   the device current), a legacy default stream, a memory budget and a sticky error.
// - Device memory: each cudaMalloc is a memfd mapped twice: a PROT_NONE view (the pointer the
//   program gets: host code touching it dies with SIGSEGV) and a read-write shadow that only
//   stream workers use.
// - Streams: one worker thread each, running tasks in order after a seeded random delay. Events
//   capture (stream, position). A query answers NotReady at least once after new work.
// - Copies: destinations are poisoned (0xFF: NaN in fp32/bf16/fp16) at enqueue, host sources are
//   checksummed at enqueue and re-checked when the copy runs ("modified before the copy ran" is a
//   violation: the process aborts naming both). Pageable device-to-host copies are synchronous,
//   pageable host-to-device copies are staged at enqueue, as the real runtime's are.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace fakecuda {

[[noreturn]] void violation(const std::string& what);

struct StreamState;

struct Task {
  std::function<void()> run;
  std::string what;
  std::uint64_t pending_id = 0;  // registered in Runtime::pending_ (0: none)
};

struct StreamState {
  int device = 0;
  bool blocking = true;  // synchronises with the legacy default stream
  bool legacy = false;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> queue;
  std::uint64_t enqueued = 0;       // tasks ever queued
  std::uint64_t completed = 0;      // tasks ever finished
  bool answered_not_ready = false;  // since the last enqueue
  std::uint64_t synced = 0;  // a host sync has observed completion up to here: no forced NotReady
  // The host has learned that work up to here completed (a sync, or a query answering success):
  // each advance is one "host_sync" (fakecuda.h).
  std::uint64_t observed = 0;
  bool stop = false;
  std::mt19937_64 rng;
  std::thread worker;

  void push(Task t);
  void wait_for(std::uint64_t seq);  // until completed >= seq
  // wait_for, as a host synchronisation (sets `synced`); true when it is the first host
  // observation of work up to seq (advances `observed`).
  bool sync_to(std::uint64_t seq);
  bool observe_locked(std::uint64_t seq);  // mu held: advances `observed`, true when it moved
  bool done_up_to(std::uint64_t seq);
  void loop();
};

struct EventState {
  int device = 0;
  bool timing = true;  // not cudaEventDisableTiming
  // When the stream reached the last record (ns, steady clock; 0: not yet).
  std::shared_ptr<std::atomic<std::int64_t>> stamp;
  std::shared_ptr<StreamState> stream;  // last record (null: never recorded = complete)
  std::uint64_t seq = 0;
  bool answered_not_ready = false;
};

struct Alloc {
  std::uintptr_t dev = 0;     // the PROT_NONE view
  std::size_t size = 0;       // mapped: the request rounded up to 4 KiB
  std::size_t requested = 0;  // what cudaMalloc was asked for
  char* shadow = nullptr;
  int device = 0;
};

struct Range {
  std::uintptr_t lo = 0, hi = 0;
  bool overlaps(const Range& o) const { return lo < o.hi && o.lo < hi; }
};

struct Pending {
  std::vector<Range> ranges;  // shadow / host addresses it reads or writes
  int kernel_device = -1;     // a kernel touches its device's memory anywhere
  bool host_func = false;     // a host function may touch any host memory
};

struct DeviceState {
  std::size_t total = 0, used = 0;
  bool context = false;
  cudaError_t sticky = cudaSuccess;
  bool fail_next_kernel = false;
  bool paused = false;
  std::shared_ptr<StreamState> legacy;
  std::vector<std::weak_ptr<StreamState>> streams;  // every stream of this device, legacy too
};

class Runtime {
 public:
  static Runtime& get();

  int device_count() const { return static_cast<int>(devices_.size()); }
  DeviceState& device(int d) { return devices_[static_cast<std::size_t>(d)]; }
  std::mutex& mu() { return mu_; }
  std::condition_variable& pause_cv() { return pause_cv_; }

  // Memory.
  cudaError_t malloc(int dev, std::size_t bytes, void** out);
  cudaError_t free(void* p);
  // The allocation holding [p, p+n) (null when p is not device memory); *bad when the range
  // starts in an allocation but runs past its end.
  const Alloc* find(const void* p, std::size_t n, bool* bad);
  char* shadow_of(const void* p, std::size_t n, int* dev);  // null: not (all) device memory
  // cudaPointerGetAttributes: the device of a live allocation's requested bytes holding p (-1:
  // none); else whether p lies in a registered host range.
  int device_of(const void* p);

  // Pinned host ranges.
  cudaError_t host_register(void* p, std::size_t n);
  cudaError_t host_unregister(void* p);
  bool is_pinned(const void* p, std::size_t n);
  std::size_t registered_bytes();
  int registered_ranges();

  // Streams and events.
  std::shared_ptr<StreamState> new_stream(int dev, bool blocking, bool legacy);
  std::shared_ptr<StreamState> stream(cudaStream_t s);  // null handle = current legacy
  cudaStream_t handle(const std::shared_ptr<StreamState>& s);
  void destroy_stream(cudaStream_t s);
  bool valid_stream(cudaStream_t s);
  EventState* event(cudaEvent_t e);
  cudaEvent_t new_event(int dev, bool timing);
  void destroy_event(cudaEvent_t e);
  // Queues `t` on `s`, ordered after the legacy stream / blocking streams as CUDA does.
  void enqueue(const std::shared_ptr<StreamState>& s, Task t, Pending pending);
  void drain_device(int dev);  // waits until every stream of `dev` is idle

  // Pending ranges (poisoning and source checks are skipped where tasks still touch a range).
  bool range_busy(const Range& r, int device_of_range);
  void finish_pending(std::uint64_t id);

  // Counters.
  void count(const char* name, long n = 1);
  long counter(const std::string& name);
  void reset_counters();

  std::uint64_t jitter_us() const { return jitter_us_; }
  std::uint64_t seed() const { return seed_; }

 private:
  Runtime();
  std::mutex mu_;
  std::condition_variable pause_cv_;
  std::vector<DeviceState> devices_;
  std::map<std::uintptr_t, Alloc> allocs_;        // by device address
  std::map<std::uintptr_t, std::size_t> pinned_;  // host ranges registered
  std::map<StreamState*, std::shared_ptr<StreamState>> streams_;
  std::map<EventState*, std::unique_ptr<EventState>> events_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t next_pending_ = 1;
  std::map<std::string, long> counters_;
  std::uint64_t jitter_us_ = 200;
  std::uint64_t seed_ = 1;
  std::uint64_t streams_made_ = 0;
  bool driver_lock_ = false;
};

// Per-thread API state.
struct ThreadState {
  int current = 0;
  cudaError_t last = cudaSuccess;
  bool in_host_func = false;
};
ThreadState& thread_state();

// Records `e` as the thread's last error (when not success) and returns it.
cudaError_t ret(cudaError_t e);
// Marks the current device's primary context as created.
void touch_context(int dev);

std::uint64_t checksum(const void* p, std::size_t n);

// Kernels (fake_kernels.cpp): registered host stub -> name; runs a launch on the CPU.
void register_kernel(const void* host_fun, const char* device_name);
// Returns an error for an unknown kernel or bad arguments; queues the CPU reference otherwise.
cudaError_t launch_kernel(const void* host_fun, dim3 grid, dim3 block, void** args,
                          std::size_t shmem, cudaStream_t stream);

}  // namespace fakecuda
