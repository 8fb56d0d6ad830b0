// Mutex, MutexLock, UniqueLock and CondVar: std::mutex, std::lock_guard, std::unique_lock and
// std::condition_variable with clang's thread-safety annotations (core/thread_annotations.hpp),
// as leveldb's port::Mutex / MutexLock / CondVar. Members guarded by a Mutex say so with
// GUARDED_BY(mu_), functions that need it held with REQUIRES(mu_), and clang's -Wthread-safety
// checks every access. The wrappers are inline and hold exactly the std types: the same code as
// the std types under GCC.
//
// CondVar waits take the UniqueLock that holds the mutex. A wait's predicate runs with the mutex
// held, which the analysis cannot see inside a lambda: predicates that read guarded members are
// annotated REQUIRES(mu_) (the analysis then checks the caller holds it), and the waits
// themselves are NO_THREAD_SAFETY_ANALYSIS.
//
// Thread-safety: as the std types.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/thread_annotations.hpp"

namespace strata {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the mutex is held where it cannot see it (a callback run under the lock).
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  friend class UniqueLock;
  std::mutex mu_;
};

// std::lock_guard: held from construction to destruction.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() RELEASE() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// std::unique_lock: held from construction; may be released and taken again; what CondVar waits
// with.
class SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(Mutex& mu) ACQUIRE(mu) : lock_(mu.mu_) {}
  ~UniqueLock() RELEASE() = default;
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void lock() ACQUIRE() { lock_.lock(); }
  void unlock() RELEASE() { lock_.unlock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

class CondVar {
 public:
  void notify_one() noexcept { cv_.notify_one(); }
  void notify_all() noexcept { cv_.notify_all(); }

  void wait(UniqueLock& lock) NO_THREAD_SAFETY_ANALYSIS { cv_.wait(lock.lock_); }
  template <class Pred>
  void wait(UniqueLock& lock, Pred pred) NO_THREAD_SAFETY_ANALYSIS {
    cv_.wait(lock.lock_, std::move(pred));
  }
  template <class Clock, class Duration>
  std::cv_status wait_until(UniqueLock& lock, const std::chrono::time_point<Clock, Duration>& t)
      NO_THREAD_SAFETY_ANALYSIS {
    return cv_.wait_until(lock.lock_, t);
  }
  template <class Clock, class Duration, class Pred>
  bool wait_until(UniqueLock& lock, const std::chrono::time_point<Clock, Duration>& t,
                  Pred pred) NO_THREAD_SAFETY_ANALYSIS {
    return cv_.wait_until(lock.lock_, t, std::move(pred));
  }
  template <class Rep, class Period, class Pred>
  bool wait_for(UniqueLock& lock, const std::chrono::duration<Rep, Period>& d,
                Pred pred) NO_THREAD_SAFETY_ANALYSIS {
    return cv_.wait_for(lock.lock_, d, std::move(pred));
  }

 private:
  std::condition_variable cv_;
};

}  // namespace strata
