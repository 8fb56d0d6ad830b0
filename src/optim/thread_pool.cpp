#include "optim/thread_pool.hpp"

#include "strata/error.hpp"

namespace strata::optim {

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) fail(ErrorCode::kInvalidArgument, "optimizer thread pool: 0 threads");
  workers_.reserve(threads - 1);
  try {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    fail(ErrorCode::kInternal, strcat("optimizer thread pool: cannot start thread ",
                                      workers_.size() + 1, " of ", threads, ": ", e.what()));
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::work() {
  for (;;) {
    const std::size_t t = next_.fetch_add(1, std::memory_order_relaxed);
    if (t >= tasks_) return;
    fn_(ctx_, t);
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    work();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::run(std::size_t tasks, TaskFn fn, void* ctx) {
  if (tasks == 0) return;
  if (workers_.empty() || tasks == 1) {
    for (std::size_t t = 0; t < tasks; ++t) fn(ctx, t);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = fn;
    ctx_ = ctx;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    active_ = static_cast<unsigned>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  work();
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return active_ == 0; });
}

}  // namespace strata::optim
