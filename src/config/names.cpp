// The derived Config values (the enums' names: core, include/strata/types.hpp).
#include <algorithm>

#include "strata/config.hpp"

namespace strata {

std::uint32_t Config::ranks_per_node() const {
  if (world.ranks_per_node != 0) return world.ranks_per_node;
  return std::min<std::uint32_t>(std::max<std::uint32_t>(world.ranks, 1), 8);
}

std::uint32_t Config::nodes() const {
  std::uint32_t rpn = ranks_per_node();
  if (rpn == 0) return 1;
  return (world.ranks + rpn - 1) / rpn;
}

}  // namespace strata
