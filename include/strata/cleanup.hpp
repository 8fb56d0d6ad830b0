// Files to remove if the process is ended by a signal (SIGTERM, SIGINT, SIGHUP).
//
// strata's swap files are gigabytes each; a run that is interrupted must not leave them behind.
// Every part of strata that creates such a file registers it here (a directory fd and a name, so
// removal does not resolve the path again) while the file exists. The library installs no signal
// handler and never ends the process: the `strata` command line installs handlers for SIGTERM,
// SIGINT and SIGHUP that call run_signal_cleanup() and then re-raise the signal with its default
// action (exit status 128 + signal number). An embedding program may do the same from its own
// handler. What a killed run (SIGKILL, power loss) leaves is found by the next run, or by
// `strata clean` (docs/errors.md, "Shutdown and leftovers"; find_swap_leftovers() in
// src/tier/swap_space.hpp).
//
// Thread-safety: registration and unregistration are lock-free and may run on any thread;
// run_signal_cleanup() is async-signal-safe (only unlinkat on descriptors the registry owns).
#pragma once

#include <cstddef>
#include <string>

namespace strata {

// Most entries registered at once (each swap space holds two per path).
constexpr std::size_t kMaxCleanupEntries = 512;

// One registered entry, removed by run_signal_cleanup() until this object is destroyed (or
// reset). Destroying it does NOT remove the file: the owner removes it on its normal path.
// Move-only.
class CleanupRegistration {
 public:
  CleanupRegistration() = default;
  // Registers `name` (one path component) in the directory open at `dirfd` (the fd is
  // duplicated; the caller keeps its own). `directory`: removed with AT_REMOVEDIR, after every
  // file. Throws Error(kInvalidArgument) for a bad name, Error(kOutOfMemory) when
  // kMaxCleanupEntries are registered, IoError when the fd cannot be duplicated.
  CleanupRegistration(int dirfd, const std::string& name, bool directory);
  CleanupRegistration(CleanupRegistration&& other) noexcept;
  CleanupRegistration& operator=(CleanupRegistration&& other) noexcept;
  CleanupRegistration(const CleanupRegistration&) = delete;
  CleanupRegistration& operator=(const CleanupRegistration&) = delete;
  ~CleanupRegistration();

  void reset() noexcept;  // unregisters now
  bool active() const noexcept { return slot_ >= 0; }

 private:
  int slot_ = -1;
};

// Removes every registered entry: files first, then directories. Async-signal-safe; meant for a
// signal handler that then ends the process (entries it removed stay claimed). Returns how many
// entries were removed. `process_ending` (the `strata` command's handler, which re-raises the
// signal next): other threads keep running until the process is gone, and one may create a file
// right after this pass; an owner that registers its file before creating it and then finds
// signal_cleanup_ending() true removes it itself (checkpoint shards do).
// With `process_ending`, it then waits (at most 2 s) for every CleanupCreation in progress: a
// file created on another thread just after the pass is removed by its owner before the handler
// returns and the process ends.
int run_signal_cleanup(bool process_ending = false) noexcept;
bool signal_cleanup_ending() noexcept;

// Held by an owner from before it creates a registered file until it has checked
// signal_cleanup_ending() (and, if set, removed the file): run_signal_cleanup(true) waits for it.
// Hold it only for that (a create and a check), never while the file is written.
class CleanupCreation {
 public:
  CleanupCreation() noexcept;
  ~CleanupCreation();
  CleanupCreation(const CleanupCreation&) = delete;
  CleanupCreation& operator=(const CleanupCreation&) = delete;
};

// Entries registered now (for tests and diagnostics).
std::size_t registered_cleanup_entries() noexcept;

}  // namespace strata
