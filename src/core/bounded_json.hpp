// The one JSON parse for text strata reads from files (checkpoint manifests, DeepSpeed configs,
// train.json): limits on size, nesting depth, the number of values and the numbers themselves are
// checked by one linear, non-recursive scan BEFORE the text reaches the JSON library, so that no
// input can overflow the stack (in the library's recursive dump, compare or copy), allocate
// without bound, or fail with the library's own message. The same rules as the YAML side
// (config/parse.cpp): a size cap, then a position-naming error for anything refused.
//
// Failures: ConfigError(source, line, column, key, message) (exit code 2): malformed JSON (the
// position and what was expected), more than max_bytes, nesting deeper than max_depth, more than
// max_values values, a number longer than max_number_chars or out of the range of a double (1e400),
// a duplicate key (key = the dotted path of the key). Every piece of the input quoted in a message
// passes through printable() (no control characters reach a terminal).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace strata {

struct JsonLimits {
  std::size_t max_bytes = 1 << 20;   // as a YAML config (1 MiB)
  int max_depth = 64;                // arrays and objects inside each other
  std::size_t max_values = 1 << 16;  // objects, arrays, strings (keys too), numbers, literals
  std::size_t max_number_chars = 64;
  bool reject_duplicate_keys = true;
};

// Line and column (1-based; a column counts bytes) of byte `offset` of `text`.
void json_position(std::string_view text, std::size_t offset, int* line, int* column);

// Checks `text` against `limits` (see above) without parsing it; throws ConfigError naming
// `source` and the position of the first violation.
void check_json_limits(std::string_view text, const std::string& source, const JsonLimits& limits);

// check_json_limits, then the parse. The result's nesting is at most limits.max_depth.
nlohmann::json parse_bounded_json(std::string_view text, const std::string& source,
                                  const JsonLimits& limits = {});

}  // namespace strata
