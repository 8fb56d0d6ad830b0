// libFuzzer target for the DeepSpeed config importer: any bytes given to import_deepspeed()
// either convert to a YAML that parse_config() loads, or throw ConfigError / Error
// (kInvalidArgument) — bad input, exit code 2 — within the fuzzer's time and memory limits, with
// a bounded message free of control characters other than '\n'.
// Built with clang (tests/fuzz/CMakeLists.txt) and run under CTest (label "fuzz").
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cli/import_deepspeed.hpp"
#include "strata/config.hpp"
#include "strata/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  strata::cli::DsImportOptions o;
  o.source = "fuzz.json";
  o.parameters = 1000000;
  try {
    const strata::cli::DsImportResult r = strata::cli::import_deepspeed(text, o);
    (void)strata::parse_config(r.yaml, "imported.yaml");  // what it returns loads
  } catch (const strata::Error& e) {
    if (e.exit_code() != 2) __builtin_trap();  // bad input, never "anything else"
    const std::string_view w = e.what();
    if (w.size() > 8192) __builtin_trap();
    for (char ch : w)
      if (ch != '\n' && static_cast<unsigned char>(ch) < 0x20) __builtin_trap();
  }
  return 0;
}
