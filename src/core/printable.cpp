// Terminal-safe text (see printable.hpp).
#include "core/printable.hpp"

#include <cstdint>
#include <cstdio>

namespace strata {
namespace {

// Length of the valid UTF-8 sequence at s[i] (2-4), or 0 (overlong forms, surrogates and code
// points above U+10FFFF are invalid).
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  std::size_t n = 0;
  std::uint32_t cp = 0;
  if (c >= 0xc2 && c <= 0xdf)
    n = 2, cp = c & 0x1fu;
  else if (c >= 0xe0 && c <= 0xef)
    n = 3, cp = c & 0x0fu;
  else if (c >= 0xf0 && c <= 0xf4)
    n = 4, cp = c & 0x07u;
  else
    return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3fu);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff))) return 0;
  if (cp >= 0xd800 && cp <= 0xdfff) return 0;
  if (cp >= 0x80 && cp <= 0x9f) return 0;  // C1 controls: escaped byte by byte
  return n;
}

std::string escape(std::string_view text, std::size_t max_bytes, bool keep_lines) {
  std::string out;
  std::size_t i = 0;
  const auto hex = [&](unsigned char c) {
    char buf[5];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  };
  while (i < text.size()) {
    if (out.size() >= max_bytes) break;
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\\' && !keep_lines) {
      out += "\\\\";
      ++i;
    } else if (keep_lines && (c == '\n' || c == '\t')) {
      out += static_cast<char>(c);
      ++i;
    } else if (c < 0x20 || c == 0x7f) {
      hex(c);
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else if (const std::size_t n = utf8_length(text, i)) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      hex(c);
      ++i;
    }
  }
  if (i < text.size()) out += "... (" + std::to_string(text.size() - i) + " more bytes)";
  return out;
}

}  // namespace

std::string printable(std::string_view text, std::size_t max_bytes) {
  return escape(text, max_bytes, false);
}

std::string printable_lines(std::string_view text) {
  return escape(text, std::string_view::npos, true);
}

}  // namespace strata
