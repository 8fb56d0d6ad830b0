#include "strata/log.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <vector>

#include "core/mutex.hpp"
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

namespace {

// One line to the sink; `ranks` ("ranks 0-7", or empty) says whose it is.
void emit(LogLevel level, std::string_view ranks, std::string_view message) {
  auto& s = sink_state();
  std::lock_guard lock(s.mu);
  if (s.sink) {
    s.sink(level, ranks.empty() ? std::string(message) : strcat("(", ranks, ") ", message));
    return;
  }
  // A message may quote what a file held (a tensor name, a path): nothing a terminal acts on.
  const std::string text = printable_lines(message);
  const std::string who = ranks.empty() ? std::string() : strcat(" (", ranks, ")");
  std::fprintf(stderr, "strata: %s%s: %.*s\n", log_level_name(level), who.c_str(),
               static_cast<int>(text.size()), text.data());
}

// The calling thread's rank (RankLogScope).
struct ThreadRank {
  RankLogGroup* group = nullptr;
  int rank = -1;
};
thread_local ThreadRank t_rank;

// "rank 3", "ranks 0-7", "ranks 0-2, 5" (`ranks` sorted, distinct).
std::string rank_label(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += strcat(i ? ", " : "", ranks[i]);
    if (j > i) out += strcat("-", ranks[j]);
    i = j + 1;
  }
  return out;
}

// Words (runs of letters and digits) and single other characters.
std::vector<std::string> tokenize(std::string_view m) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < m.size();) {
    std::size_t j = i;
    while (j < m.size() && std::isalnum(static_cast<unsigned char>(m[j]))) ++j;
    if (j == i) ++j;
    out.emplace_back(m.substr(i, j - i));
    i = j;
  }
  return out;
}

// What two ranks' versions of one warning share: the words with digits are wildcards, and so are
// hexadecimal words of 6 or more letters (a swap directory's random suffix: "cfbcaadb" has no
// digit by chance, about once in 2600 names, and its rank's warning stood apart).
std::string shape_of(const std::vector<std::string>& tokens) {
  std::string key;
  for (const std::string& t : tokens) {
    const bool digits = std::any_of(t.begin(), t.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c)) != 0;
    });
    const bool hex = t.size() >= 6 && std::all_of(t.begin(), t.end(), [](char c) {
                       return std::isxdigit(static_cast<unsigned char>(c)) != 0;
                     });
    key += digits || hex ? std::string("\x01") : t;
    key += '\0';
  }
  return key;
}

}  // namespace

// One warning as given by some of the group's ranks.
struct HeldWarning {
  std::string shape;
  std::vector<int> ranks;                        // who gave it, in order
  std::vector<std::vector<std::string>> tokens;  // each one's words
  // The message: the words all ranks agree on, '*' where they differ.
  std::string text() const {
    std::string out;
    for (std::size_t i = 0; i < tokens[0].size(); ++i) {
      const bool same = std::all_of(tokens.begin(), tokens.end(),
                                    [&](const auto& t) { return t[i] == tokens[0][i]; });
      out += same ? tokens[0][i] : "*";
    }
    return out;
  }
  std::string label() const {
    std::vector<int> r = ranks;
    std::sort(r.begin(), r.end());
    return rank_label(r);
  }
};

struct RankLogGroup::State {
  State(int c, int w) : count(c), world(w) {}
  const int count, world;
  Mutex mu;
  std::vector<HeldWarning> held GUARDED_BY(mu);  // in the order first given
};

RankLogGroup::RankLogGroup(int count, int world)
    : state_(std::make_unique<State>(std::max(count, 1), std::max(world, 1))) {}

RankLogGroup::~RankLogGroup() { flush(); }

void RankLogGroup::flush() {
  std::vector<HeldWarning> out;
  {
    MutexLock lock(state_->mu);
    out.swap(state_->held);
  }
  for (const HeldWarning& w : out) emit(LogLevel::kWarn, w.label(), w.text());
}

// Held until every rank has given it, then printed once.
void RankLogGroup::warn(int rank, std::string_view message) {
  State& g = *state_;
  if (g.count == 1) {
    emit(LogLevel::kWarn, g.world > 1 ? rank_label({rank}) : std::string(), message);
    return;
  }
  std::vector<std::string> tokens = tokenize(message);
  std::string shape = shape_of(tokens);
  std::optional<HeldWarning> done;
  {
    MutexLock lock(g.mu);
    auto it = std::find_if(g.held.begin(), g.held.end(), [&](const HeldWarning& w) {
      return w.shape == shape && std::find(w.ranks.begin(), w.ranks.end(), rank) == w.ranks.end();
    });
    if (it == g.held.end()) it = g.held.insert(g.held.end(), HeldWarning{std::move(shape), {}, {}});
    it->ranks.push_back(rank);
    it->tokens.push_back(std::move(tokens));
    if (static_cast<int>(it->ranks.size()) == g.count) {
      done = std::move(*it);
      g.held.erase(it);
    }
  }
  if (done) emit(LogLevel::kWarn, done->label(), done->text());
}

RankLogScope::RankLogScope(RankLogGroup& group, int rank)
    : previous_group_(t_rank.group), previous_rank_(t_rank.rank) {
  t_rank = {&group, rank};
}

RankLogScope::~RankLogScope() { t_rank = {previous_group_, previous_rank_}; }

void flush_rank_warnings() {
  if (t_rank.group != nullptr) t_rank.group->flush();
}

void log_message(LogLevel level, std::string_view message) {
  if (level < log_level() || level == LogLevel::kOff) return;
  if (level == LogLevel::kWarn && t_rank.group != nullptr) {
    t_rank.group->warn(t_rank.rank, message);
    return;
  }
  emit(level, {}, message);
}

}  // namespace strata
