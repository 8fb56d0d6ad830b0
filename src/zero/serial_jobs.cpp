#include "zero/serial_jobs.hpp"

#include <utility>

namespace strata::zero {

SerialJobs::SerialJobs() : thread_([this] { run(); }) {}

SerialJobs::~SerialJobs() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialJobs::post(std::function<void()> job) {
  {
    MutexLock lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void SerialJobs::wait() const {
  UniqueLock lock(mu_);
  done_cv_.wait(lock, [&]() REQUIRES(mu_) { return jobs_.empty() && !busy_; });
}

bool SerialJobs::idle() const {
  MutexLock lock(mu_);
  return jobs_.empty() && !busy_;
}

std::exception_ptr SerialJobs::take_error() {
  MutexLock lock(mu_);
  return std::exchange(error_, nullptr);
}

// Drains the queue before it stops: a job posted is a job run.
void SerialJobs::run() {
  UniqueLock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&]() REQUIRES(mu_) { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr err;
    try {
      job();
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    busy_ = false;
    done_cv_.notify_all();
  }
}

}  // namespace strata::zero
