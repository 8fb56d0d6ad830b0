// The bounded JSON parse (see bounded_json.hpp).
#include "core/bounded_json.hpp"

#include <algorithm>
#include <charconv>
#include <set>
#include <vector>

#include "core/printable.hpp"
#include "strata/error.hpp"

namespace strata {
namespace {

using nlohmann::json;

bool number_char(char c) {
  return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
}
bool literal_char(char c) { return c >= 'a' && c <= 'z'; }

class Scanner {
 public:
  Scanner(std::string_view text, const std::string& source, const JsonLimits& limits)
      : t_(text), source_(source), l_(limits) {}

  void run() {
    if (t_.size() > l_.max_bytes)
      fail_at(
          0, strcat("the JSON text is ", t_.size(), " bytes; at most ", l_.max_bytes, " are read"));
    for (std::size_t i = 0; i < t_.size();) {
      const char c = t_[i];
      if (c == '"') {
        value(i);
        i = skip_string(i);
      } else if (c == '{' || c == '[') {
        value(i);
        if (++depth_ > l_.max_depth)
          fail_at(i, strcat("nested deeper than ", l_.max_depth, " levels (arrays and objects)"));
        ++i;
      } else if (c == '}' || c == ']') {
        if (depth_ > 0) --depth_;
        ++i;
      } else if (number_char(c)) {
        value(i);
        i = number(i);
      } else if (literal_char(c)) {
        value(i);
        while (i < t_.size() && literal_char(t_[i])) ++i;
      } else {
        ++i;
      }
    }
  }

 private:
  [[noreturn]] void fail_at(std::size_t offset, const std::string& message) const {
    int line = 0, col = 0;
    json_position(t_, offset, &line, &col);
    throw ConfigError(source_, line, col, "", "malformed JSON: " + message);
  }
  void value(std::size_t at) {
    if (++values_ > l_.max_values) fail_at(at, strcat("more than ", l_.max_values, " values"));
  }
  // Past the closing quote (or the end of an unterminated string: the parser reports it).
  std::size_t skip_string(std::size_t i) const {
    for (++i; i < t_.size(); ++i) {
      if (t_[i] == '\\')
        ++i;
      else if (t_[i] == '"')
        return i + 1;
    }
    return t_.size();
  }
  std::size_t number(std::size_t i) const {
    const std::size_t start = i;
    while (i < t_.size() && number_char(t_[i])) ++i;
    const std::string_view tok = t_.substr(start, i - start);
    if (tok.size() > l_.max_number_chars)
      fail_at(start, strcat("a number of ", tok.size(), " characters (at most ",
                            l_.max_number_chars, ")"));
    double v = 0;
    const auto r = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (r.ec == std::errc::result_out_of_range)
      fail_at(start, strcat("the number ", printable(tok),
                            " is out of the range of a double (its magnitude ",
                            "must be 0 or between 2.2e-308 and 1.8e308)"));
    return i;
  }

  std::string_view t_;
  const std::string& source_;
  const JsonLimits& l_;
  int depth_ = 0;
  std::size_t values_ = 0;
};

}  // namespace

void json_position(std::string_view text, std::size_t offset, int* line, int* column) {
  int l = 1, c = 1;
  for (std::size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n')
      ++l, c = 1;
    else
      ++c;
  }
  *line = l;
  *column = c;
}

void check_json_limits(std::string_view text, const std::string& source, const JsonLimits& limits) {
  Scanner(text, source, limits).run();
}

json parse_bounded_json(std::string_view text, const std::string& source,
                        const JsonLimits& limits) {
  check_json_limits(text, source, limits);
  // Duplicate keys: the first one found, as a dotted path (the parse runs to its end; the
  // callback keeps every value).
  std::vector<std::set<std::string>> keys;
  std::vector<std::string> names;
  std::string duplicate;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      keys.emplace_back();
      names.emplace_back();
    } else if (ev == json::parse_event_t::object_end && !keys.empty()) {
      keys.pop_back();
      names.pop_back();
    } else if (ev == json::parse_event_t::key && !keys.empty() && duplicate.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      names.back() = k;
      if (!keys.back().insert(k).second) {
        for (std::size_t i = 0; i + 1 < names.size(); ++i) duplicate += names[i] + ".";
        duplicate += k;
      }
    }
    return true;
  };
  json j;
  try {
    j = limits.reject_duplicate_keys ? json::parse(text.begin(), text.end(), cb)
                                     : json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // e.byte: the 1-based offset of the character where parsing failed (one past the end when
    // the text ended early: then the last character is named).
    const std::size_t end = std::min<std::size_t>(e.byte ? e.byte : 1, text.size());
    int line = 0, col = 0;
    json_position(text, end ? end - 1 : 0, &line, &col);
    std::string what = e.what();
    if (auto p = what.find(": ", what.find("column")); p != std::string::npos)
      what = what.substr(p + 2);
    throw ConfigError(source, line, col, "", "malformed JSON: " + printable(what, 200));
  } catch (const json::exception& e) {
    throw ConfigError(source, 0, 0, "", "malformed JSON: " + printable(e.what(), 200));
  }
  if (!duplicate.empty())
    throw ConfigError(source, 0, 0, printable(duplicate, 200), "duplicate key");
  return j;
}

}  // namespace strata
