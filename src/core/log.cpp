#include "strata/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "core/printable.hpp"

namespace strata {
namespace {

LogLevel initial_level() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (env != nullptr) {
    try {
      return parse_log_level(env);
    } catch (const Error&) {
    }
  }
  return LogLevel::kInfo;
}

std::atomic<LogLevel>& level_ref() {
  static std::atomic<LogLevel> level{initial_level()};
  return level;
}

struct SinkState {
  std::mutex mu;
  LogSink sink;  // guarded by mu; empty = default stderr sink
};
SinkState& sink_state() {
  static SinkState state;
  return state;
}

}  // namespace

void set_log_level(LogLevel level) { level_ref().store(level, std::memory_order_relaxed); }
LogLevel log_level() { return level_ref().load(std::memory_order_relaxed); }

void set_log_sink(LogSink sink) {
  auto& s = sink_state();
  std::lock_guard lock(s.mu);
  s.sink = std::move(sink);
}

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

LogLevel parse_log_level(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warn" || name == "warning") return LogLevel::kWarn;
  if (name == "error") return LogLevel::kError;
  if (name == "off") return LogLevel::kOff;
  fail(ErrorCode::kInvalidArgument,
       strcat("unknown log level '", name, "' (debug, info, warn, error, off)"));
}

void log_message(LogLevel level, std::string_view message) {
  if (level < log_level() || level == LogLevel::kOff) return;
  auto& s = sink_state();
  std::lock_guard lock(s.mu);
  if (s.sink) {
    s.sink(level, message);
    return;
  }
  // A message may quote what a file held (a tensor name, a path): nothing a terminal acts on.
  const std::string text = printable_lines(message);
  std::fprintf(stderr, "strata: %s: %.*s\n", log_level_name(level), static_cast<int>(text.size()),
               text.data());
}

}  // namespace strata
