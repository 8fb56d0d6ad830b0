#include "strata/units.hpp"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "strata/error.hpp"

namespace strata {
namespace {

struct Split {
  std::string number;
  std::string unit;
};

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// Splits "1.5 GiB" into "1.5" and "GiB". The number part is digits, '.', and an exponent.
Split split_number(std::string_view text, const char* what) {
  std::string t = trim(text);
  if (t.empty()) fail(ErrorCode::kInvalidArgument, strcat("empty ", what));
  size_t i = 0;
  if (t[i] == '-' ) fail(ErrorCode::kInvalidArgument, strcat("'", t, "': a ", what, " cannot be negative"));
  if (t[i] == '+') ++i;
  size_t digits = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) {
    if (std::isdigit(static_cast<unsigned char>(t[i]))) ++digits;
    ++i;
  }
  if (digits == 0) fail(ErrorCode::kInvalidArgument, strcat("'", t, "' is not a ", what));
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    size_t j = i + 1;
    if (j < t.size() && (t[j] == '+' || t[j] == '-')) ++j;
    size_t exp_digits = 0;
    while (j < t.size() && std::isdigit(static_cast<unsigned char>(t[j]))) {
      ++j;
      ++exp_digits;
    }
    if (exp_digits > 0) i = j;
  }
  Split s;
  s.number = t.substr(0, i);
  size_t u = i;
  while (u < t.size() && t[u] == ' ') ++u;
  s.unit = t.substr(u);
  return s;
}

double to_double(const std::string& number, const std::string& text, const char* what) {
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size())
    fail(ErrorCode::kInvalidArgument, strcat("'", text, "' is not a ", what));
  if (errno == ERANGE || !std::isfinite(v))
    fail(ErrorCode::kInvalidArgument, strcat("'", text, "' is out of range for a ", what));
  return v;
}

std::uint64_t to_u64(double v, const std::string& text, const char* what) {
  // 2^64 as a double; anything >= it overflows.
  if (v >= 18446744073709551616.0)
    fail(ErrorCode::kInvalidArgument, strcat("'", text, "' is too large for a ", what));
  double r = std::round(v);
  if (std::fabs(r - v) > 1e-6 * std::max(1.0, std::fabs(v)))
    fail(ErrorCode::kInvalidArgument,
         strcat("'", text, "' is not a whole number of ", what, " units"));
  return static_cast<std::uint64_t>(r);
}

std::string trim_zeros(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  std::string s = buf;
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  return s;
}

}  // namespace

std::uint64_t parse_bytes(std::string_view text) {
  static constexpr const char* kAccepted =
      "use a whole number of bytes with an optional unit: B, kB, MB, GB, TB, PB (powers of 1000) "
      "or KiB, MiB, GiB, TiB, PiB (powers of 1024), e.g. 4GiB, 512MiB, 80GB";
  Split s = split_number(text, "size");
  std::string t = trim(text);
  double mult = 0;
  const std::string& u = s.unit;
  if (u.empty() || u == "B") mult = 1;
  else if (u == "kB" || u == "KB" || u == "k" || u == "K") mult = 1e3;
  else if (u == "MB" || u == "M") mult = 1e6;
  else if (u == "GB" || u == "G") mult = 1e9;
  else if (u == "TB" || u == "T") mult = 1e12;
  else if (u == "PB" || u == "P") mult = 1e15;
  else if (u == "KiB") mult = 1024.0;
  else if (u == "MiB") mult = 1024.0 * 1024;
  else if (u == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (u == "TiB") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (u == "PiB") mult = 1024.0 * 1024 * 1024 * 1024 * 1024;
  else fail(ErrorCode::kInvalidArgument, strcat("'", t, "': unknown size unit '", u, "'; ", kAccepted));
  double v = to_double(s.number, t, "size");
  return to_u64(v * mult, t, "byte");
}

std::uint64_t parse_count(std::string_view text) {
  Split s = split_number(text, "count");
  std::string t = trim(text);
  double mult = 0;
  const std::string& u = s.unit;
  if (u.empty()) mult = 1;
  else if (u == "K" || u == "k") mult = 1e3;
  else if (u == "M") mult = 1e6;
  else if (u == "B" || u == "G") mult = 1e9;
  else if (u == "T") mult = 1e12;
  else
    fail(ErrorCode::kInvalidArgument,
         strcat("'", t, "': unknown count suffix '", u,
                "'; use a number with an optional K, M, B (or G), T suffix, e.g. 7.5B, 350M, 7.5e9"));
  double v = to_double(s.number, t, "count");
  return to_u64(v * mult, t, "count");
}

std::string format_bytes(std::uint64_t bytes, bool binary) {
  static const char* kSi[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB"};
  static const char* kBin[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  const double base = binary ? 1024.0 : 1000.0;
  double v = static_cast<double>(bytes);
  int i = 0;
  while (v >= base && i < 6) {
    v /= base;
    ++i;
  }
  if (i == 0) return std::to_string(bytes) + " B";
  return trim_zeros(v, 2) + " " + (binary ? kBin[i] : kSi[i]);
}

std::string format_count(std::uint64_t count) {
  static const char* kSuffix[] = {"", "K", "M", "B", "T"};
  double v = static_cast<double>(count);
  int i = 0;
  while (v >= 1000.0 && i < 4) {
    v /= 1000.0;
    ++i;
  }
  return trim_zeros(v, 3) + kSuffix[i];
}

std::string format_rate(double bytes_per_second) {
  if (!(bytes_per_second >= 0)) return "n/a";
  static const char* kSi[] = {"B/s", "kB/s", "MB/s", "GB/s", "TB/s"};
  double v = bytes_per_second;
  int i = 0;
  while (v >= 1000.0 && i < 4) {
    v /= 1000.0;
    ++i;
  }
  return trim_zeros(v, 2) + " " + kSi[i];
}

}  // namespace strata
