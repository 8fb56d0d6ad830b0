// Built without CUDA: the CUDA Adam benchmark says so.
#include "profile/adam_bench.hpp"
#include "strata/error.hpp"

namespace strata::profile {
AdamCudaBenchResult run_adam_cuda_bench(std::size_t, int) {
  fail(ErrorCode::kUnsupported,
       "bench adam --device cuda: this build of strata has no CUDA support");
}
}  // namespace strata::profile
