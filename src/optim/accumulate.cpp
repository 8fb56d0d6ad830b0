// Gradient accumulation (see accumulate.hpp).
#include "optim/accumulate.hpp"

#include "core/numeric.hpp"
#include "strata/device.hpp"

namespace strata {

void accumulate_on_device(Stream& stream, bool cuda, float* dst, const float* src, std::size_t n,
                          std::chrono::milliseconds timeout) {
  if (n == 0) return;
  if (cuda) {
    accumulate_cuda(dst, src, n, stream.native_handle());
    return;
  }
  stream.synchronize(timeout);
  accumulate_fp32(dst, src, n);
}

}  // namespace strata
