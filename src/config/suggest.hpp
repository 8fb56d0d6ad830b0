// "Did you mean ...?" for unknown keys and enum values (restricted Damerau-Levenshtein distance).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace strata::config_detail {

// Optimal-string-alignment distance (insert, delete, substitute, swap two neighbours).
std::size_t edit_distance(std::string_view a, std::string_view b);

// The closest candidate if it is close enough to be a plausible typo, else "".
std::string closest(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace strata::config_detail
