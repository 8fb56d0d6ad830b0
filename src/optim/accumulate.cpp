// Gradient accumulation (see accumulate.hpp).
#include "optim/accumulate.hpp"

#include "core/numeric.hpp"
#include "strata/device.hpp"

namespace strata {

void accumulate_on_device(Stream& stream, bool cuda, void* dst, DType dd, const void* src, DType sd,
                          std::size_t n, bool add, std::chrono::milliseconds timeout) {
  if (n == 0) return;
  if (cuda) {
    accumulate_cuda(dst, dd, src, sd, n, add, stream.native_handle());
    return;
  }
  stream.synchronize(timeout);
  accumulate_elems(dst, dd, src, sd, n, add);
}

}  // namespace strata
