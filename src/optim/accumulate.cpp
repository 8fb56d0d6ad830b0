// Gradient accumulation (see accumulate.hpp).
#include "optim/accumulate.hpp"

#include "strata/device.hpp"

namespace strata {

void accumulate_host(float* dst, const float* src, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

void accumulate_on_device(Stream& stream, bool cuda, float* dst, const float* src, std::size_t n,
                          std::chrono::milliseconds timeout) {
  if (n == 0) return;
  if (cuda) {
    accumulate_cuda(dst, src, n, stream.native_handle());
    return;
  }
  stream.synchronize(timeout);
  accumulate_host(dst, src, n);
}

}  // namespace strata
