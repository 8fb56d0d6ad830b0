// SerialJobs: one background thread that runs posted jobs in the order they were posted. The
// speculative update posts each batch of chunks whose gradients are final, so that their Adam runs
// while the loop's backward goes on (speculator.hpp).
//
// Ownership: owns its thread; a job borrows what it captures (its poster keeps that alive until
// wait() returned). Thread-safety: post / wait / take_error are called from one thread (the
// engine's); jobs run on the worker, one at a time. Failure: a job's exception is kept (the first
// since the last take_error) and the jobs posted after it still run; nothing is thrown by wait().
// Every wait is bounded by the jobs' own bounded operations.
#pragma once

#include <deque>
#include <exception>
#include <functional>
#include <thread>

#include "core/mutex.hpp"

namespace strata::zero {

class SerialJobs {
 public:
  SerialJobs();
  ~SerialJobs();  // the posted jobs finish first
  SerialJobs(const SerialJobs&) = delete;
  SerialJobs& operator=(const SerialJobs&) = delete;

  void post(std::function<void()> job);
  void wait() const;                // every posted job finished
  bool idle() const;                // no job queued or running
  std::exception_ptr take_error();  // the first failure since the last take (call after wait)

 private:
  void run();

  mutable Mutex mu_;
  mutable CondVar cv_;       // work posted, or stop
  mutable CondVar done_cv_;  // a job finished
  std::deque<std::function<void()>> jobs_ GUARDED_BY(mu_);
  bool busy_ GUARDED_BY(mu_) = false;  // a job is running
  bool stop_ GUARDED_BY(mu_) = false;
  std::exception_ptr error_ GUARDED_BY(mu_);
  std::thread thread_;  // last: started once every member above exists
};

}  // namespace strata::zero
