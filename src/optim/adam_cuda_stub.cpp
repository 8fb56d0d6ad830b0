// Built without CUDA: the CUDA entry points exist and say so.
#include "optim/accumulate.hpp"
#include "strata/adam.hpp"
#include "strata/error.hpp"

namespace strata {

bool adam_cuda_available() { return false; }

void adam_step_cuda(const AdamParams&, const AdamTensors&, const AdamStepOptions&, void*, int*) {
  fail(ErrorCode::kUnsupported, "adam_step_cuda: this build of strata has no CUDA support");
}

void adam_check_finite_cuda(const void*, DType, std::size_t, float, int*, void*, float) {
  fail(ErrorCode::kUnsupported, "adam_check_finite_cuda: this build of strata has no CUDA support");
}

void accumulate_cuda(void*, DType, const void*, DType, std::size_t, bool, void*) {
  fail(ErrorCode::kUnsupported, "accumulate_cuda: this build of strata has no CUDA support");
}

}  // namespace strata
