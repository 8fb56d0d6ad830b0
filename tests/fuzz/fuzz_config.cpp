// libFuzzer target for the config loader: any bytes given to parse_config() (as a file's text and
// as a --set value) either load or throw ConfigError, within the fuzzer's time and memory
// limits; a config that loads renders with to_yaml() to text that loads back to the same config.
// Built with clang (tests/fuzz/CMakeLists.txt) and run under CTest (label "fuzz").
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "strata/config.hpp"
#include "strata/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const strata::Config c = strata::parse_config(text, "fuzz.yaml");
    const std::string y = strata::to_yaml(c);
    const strata::Config d = strata::parse_config(y, "to_yaml");
    if (strata::to_yaml(d) != y) __builtin_trap();  // to_yaml is not a fixed point
  } catch (const strata::ConfigError&) {
  }
  // The same bytes as a --set value (parsed as YAML on its own).
  try {
    strata::parse_config("world: {ranks: 2}\n", "fuzz.yaml",
                         {"tiers.nvme.paths=" + std::string(text)});
  } catch (const strata::ConfigError&) {
  }
  return 0;
}
