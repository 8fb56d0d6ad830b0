// What the plan's files share and no embedder needs.
#pragma once

#include <cstdint>

#include "strata/config.hpp"

namespace strata {

// The rank's partition, as the engine cuts it (Partition): ceil(parameters / ranks) rounded up to
// the partition alignment (64 elements). runtime.cpp.
std::uint64_t partition_elements(const Config& c);

}  // namespace strata
