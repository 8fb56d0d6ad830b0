#include "device/host_device.hpp"

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/rethrow.hpp"
#include "strata/error.hpp"
#include "strata/log.hpp"

namespace strata::device {
namespace {

constexpr std::size_t kAlign = 4096;
// How long a stream's worker waits on another stream's event before declaring the stream failed.
constexpr auto kCrossStreamWait = std::chrono::minutes(10);

// Zero-filled memory (alloc_zeroed()). From this size on, anonymous pages of their own (what glibc
// gives such sizes anyway, its mmap threshold being 32 MiB at most): zero, and resident only once
// written, so that state the run has not touched yet costs no memory (as torch's lazy state).
// Smaller: the heap, cleared here.
constexpr std::size_t kOwnPages = std::size_t{32} << 20;

void* zeroed_pages(std::size_t bytes) {
  if (bytes < kOwnPages) {
    void* p = std::aligned_alloc(kAlign, bytes);
    if (!p) fail(ErrorCode::kOutOfMemory, strcat("host device: aligned_alloc(", bytes, ") failed"));
    return std::memset(p, 0, bytes);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    fail(ErrorCode::kOutOfMemory,
         strcat("host device: mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
  return p;
}

void release_pages(void* p, std::size_t bytes) {
  if (bytes < kOwnPages) {
    std::free(p);
  } else {
    munmap(p, bytes);
  }
}

// memcpy/memset with an empty range: the pointers of an empty span may be null, which the C
// library may not be handed (UBSan: "null pointer passed as argument").
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
}
void fill_bytes(void* dst, int value, std::size_t bytes) {
  if (bytes != 0) std::memset(dst, value, bytes);
}

struct EventState {
  std::mutex mutex;
  std::condition_variable cv;
  std::uint64_t recorded = 0;   // guarded by mutex: tickets handed out by record()
  std::uint64_t completed = 0;  // guarded by mutex: highest ticket the stream reached
  std::exception_ptr error;     // guarded by mutex: error of the work before the last ticket
};

class HostEvent final : public Event {
 public:
  HostEvent() : state_(std::make_shared<EventState>()) {}
  bool query() override {
    std::lock_guard lock(state_->mutex);
    if (state_->error) rethrow_detached(state_->error);
    return state_->completed >= state_->recorded;
  }
  void synchronize(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(state_->mutex);
    const std::uint64_t target = state_->recorded;
    if (!state_->cv.wait_for(lock, timeout, [&] { return state_->completed >= target; })) {
      fail(ErrorCode::kTimeout,
           strcat("host device: event not complete after ", timeout.count(), " ms"));
    }
    if (state_->error) rethrow_detached(state_->error);
  }
  std::shared_ptr<EventState> state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

class HostStream final : public HostStreamBase {
 public:
  explicit HostStream(std::shared_ptr<HostDevice::StreamSet> set)
      : set_(std::move(set)), worker_([this] { run(); }) {
    std::lock_guard lock(set_->mutex);
    set_->streams.insert(this);
  }
  ~HostStream() override {
    {
      std::lock_guard lock(set_->mutex);
      set_->streams.erase(this);
    }
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  void memcpy_async(void* dst, const void* src, std::size_t bytes) override {
    enqueue([=] { copy_bytes(dst, src, bytes); });
  }
  void memset_async(void* dst, int value, std::size_t bytes) override {
    enqueue([=] { fill_bytes(dst, value, bytes); });
  }
  void copy(void* dst, const void* src, std::size_t bytes,
            std::chrono::milliseconds timeout) override {
    run_here([=] { copy_bytes(dst, src, bytes); }, timeout);
  }
  void fill(void* dst, int value, std::size_t bytes, std::chrono::milliseconds timeout) override {
    run_here([=] { fill_bytes(dst, value, bytes); }, timeout);
  }
  void record(Event& event) override {
    auto state = host_event(event).state();
    std::uint64_t ticket;
    {
      std::lock_guard lock(state->mutex);
      ticket = ++state->recorded;
      state->error = nullptr;
    }
    // Runs even after an earlier task failed, so that waiters on the event learn of the failure.
    enqueue_always([this, state, ticket] {
      std::exception_ptr err;
      {
        std::lock_guard lock(mutex_);
        err = error_;
      }
      {
        std::lock_guard lock(state->mutex);
        if (ticket > state->completed) state->completed = ticket;
        if (err) state->error = err;
      }
      state->cv.notify_all();
    });
  }
  void wait_event(Event& event) override {
    auto state = host_event(event).state();
    std::uint64_t target;
    {
      std::lock_guard lock(state->mutex);
      target = state->recorded;
    }
    enqueue([state, target] {
      std::unique_lock lock(state->mutex);
      if (!state->cv.wait_for(lock, kCrossStreamWait, [&] { return state->completed >= target; })) {
        fail(ErrorCode::kTimeout, "host device: stream waited too long for another stream's event");
      }
      if (state->error) rethrow_detached(state->error);
    });
  }
  void launch_host_func(std::function<void()> fn) override { enqueue(std::move(fn)); }
  // An idle stream (nothing queued, nothing running inline) has no work left that could use what
  // `fn` releases: it runs here, without a round trip through the worker.
  // (Work queued after the check cannot use it: it was released before.)
  void defer(std::function<void()> fn) override {
    bool idle;
    {
      std::lock_guard lock(mutex_);
      idle = done_ == queued_ && inline_ == 0;
    }
    if (idle) {
      fn();
    } else {
      enqueue_always(std::move(fn));
    }
  }
  void* native_handle() const noexcept override { return nullptr; }
  void synchronize(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = queued_;
    if (!done_cv_.wait_for(lock, timeout, [&] { return done_ >= target; })) {
      fail(ErrorCode::kTimeout, strcat("host device: stream not idle after ", timeout.count(),
                                       " ms (", target - done_, " task(s) pending)"));
    }
    if (error_) rethrow_detached(error_);
  }

 private:
  struct Task {
    std::function<void()> fn;
    bool always;  // run even when the stream has failed
  };
  static HostEvent& host_event(Event& event) {
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (!e) fail(ErrorCode::kInvalidArgument, "host device: event from another device");
    return *e;
  }
  // A synchronous operation in the caller's thread, in the stream's order: once everything queued
  // before it is done (synchronize: its errors and timeout), with the worker held off until it
  // returns (work queued meanwhile by another thread runs after it). Its failure fails the stream,
  // as the worker's would.
  template <typename Fn>
  void run_here(Fn fn, std::chrono::milliseconds timeout) {
    for (bool claimed = false; !claimed;) {  // idle under the lock: nothing queued meanwhile runs
      synchronize(timeout);
      std::lock_guard lock(mutex_);
      claimed = done_ == queued_;
      if (claimed) {
        ++queued_;
        ++inline_;
      }
    }
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      if (err && !error_) error_ = err;
      ++done_;
      --inline_;
    }
    done_cv_.notify_all();
    cv_.notify_one();
    if (err) rethrow_detached(err);
  }
  void enqueue(std::function<void()> fn) { push(Task{std::move(fn), false}); }
  void enqueue_always(std::function<void()> fn) { push(Task{std::move(fn), true}); }
  void push(Task task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
      ++queued_;
    }
    cv_.notify_one();
  }
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return (stop_ || !tasks_.empty()) && inline_ == 0; });
      if (tasks_.empty()) return;  // stop_ and drained
      Task task = std::move(tasks_.front());
      tasks_.pop_front();
      const bool skip = error_ && !task.always;
      lock.unlock();
      std::exception_ptr err;
      if (!skip) {
        try {
          task.fn();
        } catch (const Error&) {
          err = std::current_exception();
        } catch (const std::exception& e) {
          err =
              std::make_exception_ptr(Error(ErrorCode::kDevice, strcat("host device: ", e.what())));
        }
      }
      lock.lock();
      if (err && !error_) error_ = err;
      ++done_;
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;       // work arrived or stop
  std::condition_variable done_cv_;  // a task finished
  std::deque<Task> tasks_;           // guarded by mutex_
  std::uint64_t queued_ = 0;         // guarded by mutex_
  std::uint64_t done_ = 0;           // guarded by mutex_
  std::exception_ptr error_;         // guarded by mutex_: first failure, sticky
  bool stop_ = false;                // guarded by mutex_
  int inline_ = 0;                   // guarded by mutex_: run_here operations in progress
  std::shared_ptr<HostDevice::StreamSet> set_;
  std::thread worker_;  // last: started after every member above exists
};

}  // namespace

HostDevice::HostDevice(std::uint64_t total_memory) : total_(total_memory) {}

HostDevice::~HostDevice() {
  std::lock_guard lock(mutex_);
  if (!allocations_.empty()) {
    log_warn("host device: ", allocations_.size(), " allocation(s) still live at destruction");
    for (auto& [p, n] : allocations_) release_pages(p, n);
  }
}

void* HostDevice::alloc(std::size_t bytes) {
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  std::lock_guard lock(mutex_);
  if (allocated_ + rounded > total_) {
    fail(ErrorCode::kOutOfMemory, strcat("host device: cannot allocate ", bytes,
                                         " bytes: ", allocated_, " of ", total_, " bytes in use"));
  }
  void* p = zeroed_pages(rounded);
  allocations_.emplace(p, rounded);
  allocated_ += rounded;
  return p;
}

void HostDevice::free(void* ptr) noexcept {
  if (!ptr) return;
  std::lock_guard lock(mutex_);
  auto it = allocations_.find(ptr);
  if (it == allocations_.end()) {
    log_error("host device: free of unknown pointer ", ptr);
    return;
  }
  const std::size_t bytes = it->second;
  allocated_ -= bytes;
  allocations_.erase(it);
  // Like cudaFree, which waits for the device: work already queued that uses this memory still
  // finds it. The release is queued behind every live stream's work (no wait here: a stream
  // blocked on a host function delays the release, not the caller).
  std::lock_guard slock(streams_->mutex);
  auto pending = std::make_shared<std::atomic<std::size_t>>(streams_->streams.size() + 1);
  for (HostStreamBase* s : streams_->streams)
    s->defer([pending, ptr, bytes] {
      if (--*pending == 0) release_pages(ptr, bytes);
    });
  if (--*pending == 0) release_pages(ptr, bytes);
}

std::uint64_t HostDevice::allocated() const {
  std::lock_guard lock(mutex_);
  return allocated_;
}

std::unique_ptr<Stream> HostDevice::create_stream() {
  return std::make_unique<HostStream>(streams_);
}
std::unique_ptr<Event> HostDevice::create_event() { return std::make_unique<HostEvent>(); }

}  // namespace strata::device
