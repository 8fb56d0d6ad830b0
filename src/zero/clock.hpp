// The engine's one clock for its phase timings (EngineStats).
#pragma once

#include <chrono>

namespace strata::zero {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace strata::zero
