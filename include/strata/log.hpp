// Logging: one small interface with levels. The library never writes to stdout; the default sink
// writes "strata: LEVEL: message" lines to stderr. The CLI (or an embedding program) may install
// its own sink.
//
// Thread-safety: log() may be called from any thread; set_log_sink()/set_log_level() are safe to
// call concurrently with log() (the sink is swapped under a mutex and called under it).
#pragma once

#include <functional>
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
template <typename... Args>
void log_error(const Args&... args) {
  if (log_level() <= LogLevel::kError) log_message(LogLevel::kError, strcat(args...));
}

}  // namespace strata
