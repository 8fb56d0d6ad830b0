// Internal: the move-assignment of the owning handles (DeviceMemory, PinnedBuffer, IoBuffer,
// Scratch), written once.
#pragma once

#include <utility>

namespace strata {

// `self = std::move(other)` for a handle whose `release` gives back what it owns and whose
// `fields` are empty when value-initialized: self gives its own back, takes other's fields, and
// other is left empty (each field value-initialized). Assigning a handle to itself changes nothing.
template <typename T, typename... Fields>
T& move_assign_handle(T& self, T& other, void (T::*release)() noexcept,
                      Fields T::*... fields) noexcept {
  if (&self != &other) {
    (self.*release)();
    ((self.*fields = std::exchange(other.*fields, Fields{})), ...);
  }
  return self;
}

}  // namespace strata
