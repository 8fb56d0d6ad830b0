// A program outside the strata tree, built against the installed package.
#include <cstdio>

#include "strata/build_info.hpp"
#include "strata/device_query.hpp"
#include "strata/error.hpp"
#include "strata/units.hpp"

int main() {
  if (strata::parse_bytes("4GiB") != (4ULL << 30)) return 1;
  try {
    strata::parse_bytes("4 GiBs");
    return 1;
  } catch (const strata::Error& e) {
    if (e.exit_code() != 2) return 1;
  }
  auto gpus = strata::query_cuda_devices();
  std::printf("consumer ok: strata %s, %s\n", strata::build::kVersion, gpus.status.c_str());
  return 0;
}
