// Text that came from a file (a checkpoint's tensor names, a manifest's strings, a JSON key) made
// safe to print on a terminal and to put in an error message: every control character (C0, DEL,
// and the C1 controls U+0080-U+009F, which some terminals obey as escape sequences) and every
// byte that is not part of valid UTF-8 is written as \xNN, and a backslash as "\\", so the result
// names the original bytes unambiguously and contains nothing a terminal acts on. Printable ASCII
// and valid multi-byte UTF-8 are kept.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace strata {

// `max_bytes`: longer input is cut (at a character boundary) and "..." (plus the number of bytes
// left out) appended; the result then has at most about max_bytes + 40 bytes.
std::string printable(std::string_view text, std::size_t max_bytes = std::string_view::npos);

// As printable(), but '\n' and '\t' are kept and a backslash is left as it is (for whole
// messages printed as they are: only what a terminal would act on is escaped).
std::string printable_lines(std::string_view text);

}  // namespace strata
