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
  if (t[i] == '-')
    fail(ErrorCode::kInvalidArgument, strcat("'", t, "': a ", what, " cannot be negative"));
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

// number × mult: exact in integers when `number` is plain digits (so sizes above 2^53 keep every
// bit), through a double otherwise ("1.5GiB", "7.5e9").
std::uint64_t scale(const std::string& number, double mult, const std::string& text,
                    const char* what, const char* unit_what) {
  const bool digits =
      !number.empty() && number.find_first_not_of("0123456789") == std::string::npos;
  const double m = std::round(mult);
  if (digits && m == mult && m < 18446744073709551616.0) {
    std::uint64_t v = 0;
    for (char c : number) {
      if (__builtin_mul_overflow(v, 10u, &v) ||
          __builtin_add_overflow(v, static_cast<unsigned>(c - '0'), &v))
        fail(ErrorCode::kInvalidArgument, strcat("'", text, "' is too large for a ", what));
    }
    std::uint64_t out = 0;
    if (__builtin_mul_overflow(v, static_cast<std::uint64_t>(m), &out))
      fail(ErrorCode::kInvalidArgument, strcat("'", text, "' is too large for a ", what));
    return out;
  }
  return to_u64(to_double(number, text, what) * mult, text, unit_what);
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

// The size units parse_bytes() accepts, with their bytes.
struct SizeUnit {
  std::string_view name;
  double bytes;
};
constexpr SizeUnit kSizeUnits[] = {{"B", 1},        {"kB", 1e3},     {"KB", 1e3},
                                   {"MB", 1e6},     {"GB", 1e9},     {"TB", 1e12},
                                   {"PB", 1e15},    {"KiB", 0x1p10}, {"MiB", 0x1p20},
                                   {"GiB", 0x1p30}, {"TiB", 0x1p40}, {"PiB", 0x1p50}};

// "1M" and friends: fio and dd read it as 2^20, other tools as 10^6, so parse_bytes asks instead
// of guessing. s.unit is one letter of kKmMgGtTpP.
[[noreturn]] void fail_ambiguous_unit(const Split& s, const std::string& text) {
  const char up = static_cast<char>(std::toupper(static_cast<unsigned char>(s.unit[0])));
  const int power = static_cast<int>(std::string_view("KMGTP").find(up)) + 1;  // of 1000 or 1024
  const std::string si = up == 'K' ? "kB" : std::string(1, up) + "B";
  fail(ErrorCode::kInvalidArgument,
       strcat("'", text, "': '", s.unit, "' is ambiguous (2^", 10 * power, " for fio, 10^",
              3 * power, " for others): did you mean ", s.number, up, "iB (or ", s.number, si,
              ")?"));
}

}  // namespace

std::uint64_t parse_bytes(std::string_view text) {
  static constexpr const char* kAccepted =
      "use a whole number of bytes with a unit: B, kB, MB, GB, TB, PB (powers of 1000) "
      "or KiB, MiB, GiB, TiB, PiB (powers of 1024), e.g. 4GiB, 512MiB, 80GB";
  Split s = split_number(text, "size");
  std::string t = trim(text);
  const std::string& u = s.unit;
  for (const SizeUnit& unit : kSizeUnits)
    if (u == unit.name) return scale(s.number, unit.bytes, t, "size", "byte");
  if (u.size() == 1 && std::string_view("kKmMgGtTpP").find(u[0]) != std::string_view::npos)
    fail_ambiguous_unit(s, t);
  if (u.empty()) {
    const double v = to_double(s.number, t, "size");
    if (v == 0) return 0;
    fail(ErrorCode::kInvalidArgument,
         strcat("'", t, "' has no unit: write ", t, "B for bytes, or e.g. ", t, "GB, ", t, "GiB; ",
                kAccepted, " (0 needs no unit)"));
  }
  fail(ErrorCode::kInvalidArgument, strcat("'", t, "': unknown size unit '", u, "'; ", kAccepted));
}

std::string format_bytes_exact(std::uint64_t bytes) {
  if (bytes == 0) return "0";
  static const char* kBin[] = {"PiB", "TiB", "GiB", "MiB", "KiB"};
  static const int kBinShift[] = {50, 40, 30, 20, 10};
  static const char* kSi[] = {"PB", "TB", "GB", "MB", "kB"};
  static const std::uint64_t kSiDiv[] = {1'000'000'000'000'000ULL, 1'000'000'000'000ULL,
                                         1'000'000'000ULL, 1'000'000ULL, 1'000ULL};
  std::string best = std::to_string(bytes) + "B";
  for (int i = 0; i < 5; ++i) {
    const std::uint64_t unit = 1ULL << kBinShift[i];
    if (bytes % unit == 0) {
      std::string c = std::to_string(bytes / unit) + kBin[i];
      if (c.size() < best.size()) best = c;
      break;
    }
  }
  for (int i = 0; i < 5; ++i) {
    if (bytes % kSiDiv[i] == 0) {
      std::string c = std::to_string(bytes / kSiDiv[i]) + kSi[i];
      if (c.size() < best.size()) best = c;
      break;
    }
  }
  return best;
}

std::uint64_t parse_count(std::string_view text) {
  Split s = split_number(text, "count");
  std::string t = trim(text);
  double mult = 0;
  const std::string& u = s.unit;
  if (u.empty())
    mult = 1;
  else if (u == "K" || u == "k")
    mult = 1e3;
  else if (u == "M")
    mult = 1e6;
  else if (u == "B" || u == "G")
    mult = 1e9;
  else if (u == "T")
    mult = 1e12;
  else
    fail(ErrorCode::kInvalidArgument,
         strcat(
             "'", t, "': unknown count suffix '", u,
             "'; use a number with an optional K, M, B (or G), T suffix, e.g. 7.5B, 350M, 7.5e9"));
  return scale(s.number, mult, t, "count", "count");
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
