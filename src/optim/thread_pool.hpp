// Internal: a persistent fork-join pool for the optimizer kernels. Threads are created once (in
// the constructor) and joined in the destructor; run() hands out task indices [0, tasks) through
// an atomic counter to the workers and the calling thread, and returns when every task is done.
//
// Thread-safety: run() calls are serialized by the caller (CpuAdam holds a mutex); the pool itself
// may be used from any one thread at a time. Tasks must not throw (the kernels do not) and must
// terminate: the wait for the workers has no timeout because every task is bounded compute.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::optim {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, std::size_t task);

  // threads: total threads that work on a run(), including the caller (>= 1).
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }

  void run(std::size_t tasks, TaskFn fn, void* ctx);

  // Convenience: fn(std::size_t task) for a callable living on the caller's stack.
  template <class Fn>
  void parallel_for(std::size_t tasks, Fn& fn) {
    run(
        tasks, [](void* c, std::size_t t) { (*static_cast<Fn*>(c))(t); }, &fn);
  }

 private:
  void worker_loop();
  void work();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::uint64_t generation_ = 0;  // guarded by mu_
  unsigned active_ = 0;           // workers still inside the current generation; guarded by mu_
  bool stop_ = false;             // guarded by mu_
  // The current job: written under mu_ before generation_ is bumped, read after seeing it.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_{0};
};

}  // namespace strata::optim
