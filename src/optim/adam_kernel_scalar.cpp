// Portable Adam kernels (no SIMD intrinsics; the compiler may still auto-vectorize). Compiled with
// -ffp-contract=off like the SIMD paths, so all paths give identical results.
#include "optim/adam_kernel_body.hpp"

namespace strata::optim {
const KernelTable& kernels_scalar() {
  static const KernelTable table = make_table<ScalarV>();
  return table;
}
}  // namespace strata::optim
