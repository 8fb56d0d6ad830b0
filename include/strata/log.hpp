// Logging: one small interface with levels. The library never writes to stdout; the default sink
// writes "strata: LEVEL: message" lines to stderr. The CLI (or an embedding program) may install
// its own sink.
//
// Thread-safety: log() may be called from any thread; set_log_sink()/set_log_level() are safe to
// call concurrently with log() (the sink is swapped under a mutex and called under it).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "strata/error.hpp"

namespace strata {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

using LogSink = std::function<void(LogLevel, std::string_view)>;

void set_log_level(LogLevel level);
LogLevel log_level();
// nullptr restores the default stderr sink.
void set_log_sink(LogSink sink);
// Parses "debug|info|warn|error|off"; throws Error(kInvalidArgument) otherwise.
LogLevel parse_log_level(std::string_view name);
const char* log_level_name(LogLevel level);

void log_message(LogLevel level, std::string_view message);

template <typename... Args>
void log_debug(const Args&... args) {
  if (log_level() <= LogLevel::kDebug) log_message(LogLevel::kDebug, strcat(args...));
}
template <typename... Args>
void log_info(const Args&... args) {
  if (log_level() <= LogLevel::kInfo) log_message(LogLevel::kInfo, strcat(args...));
}
template <typename... Args>
void log_warn(const Args&... args) {
  if (log_level() <= LogLevel::kWarn) log_message(LogLevel::kWarn, strcat(args...));
}
// ---- Warnings of several ranks ----------------------------------------------------------------
// Ranks running as threads of one process (strata train's in-process ranks) meet the same
// conditions and used to say so once each ("io: /nvme/strata-swap-42-r3-1a2b/swap.bin: tmpfs has
// no direct I/O" eight times). A RankLogGroup collects the warnings of the threads that name a
// rank of it (RankLogScope) and prints each warning once, naming the ranks:
//   strata: warning (ranks 0-7): io: /nvme/strata-swap-42-*-*/swap.bin: tmpfs has no direct I/O
// Two ranks' warnings are the same when they differ only in words that hold digits (the rank, a
// pid, a count, a random suffix); the words that differ print as '*'. A warning is printed as soon
// as every rank of the group has given it, else by flush() (the launcher calls it where every rank
// has passed the code that warns, e.g. after a step, which is collective) or at the group's
// destruction, naming the ranks that gave it. A group of one rank of a larger world (one rank per
// process, mpirun) prints at once, as "warning (rank 3): ...". A custom sink gets the message
// prefixed "(ranks 0-7) ". Other levels, and threads outside a scope, log as before.
// Thread-safety: every member may be called from any thread. The group must outlive its scopes.
class RankLogGroup {
 public:
  // `count` ranks of this process (0..count-1 of the world, or the one rank a process of a larger
  // world runs) of a world of `world` ranks.
  RankLogGroup(int count, int world);
  ~RankLogGroup();
  RankLogGroup(const RankLogGroup&) = delete;
  RankLogGroup& operator=(const RankLogGroup&) = delete;
  void flush();  // prints every warning held, with the ranks that gave it
  // What log_warn does on a thread in a RankLogScope of this group. REQUIRES: `rank` is one of
  // the group's (each distinct rank counts towards `count`).
  void warn(int rank, std::string_view message);
  struct State;  // internal (src/core/log.cpp)

 private:
  std::unique_ptr<State> state_;
};

// Names the calling thread's rank in a group for the scope's lifetime (restores the previous).
class RankLogScope {
 public:
  RankLogScope(RankLogGroup& group, int rank);
  ~RankLogScope();
  RankLogScope(const RankLogScope&) = delete;
  RankLogScope& operator=(const RankLogScope&) = delete;

 private:
  RankLogGroup* previous_group_;
  int previous_rank_;
};

// RankLogGroup::flush() of the calling thread's group (nothing outside a RankLogScope).
void flush_rank_warnings();

template <typename... Args>
void log_error(const Args&... args) {
  if (log_level() <= LogLevel::kError) log_message(LogLevel::kError, strcat(args...));
}

}  // namespace strata
