// Internal: the per-ISA Adam kernels and the table CpuAdam dispatches through.
//
// Each ISA's kernels live in their own translation unit compiled with that ISA's flags
// (adam_kernel_{scalar,avx2,avx512}.cpp) and include adam_kernel_body.hpp, whose code is all in an
// anonymous namespace so that no function compiled for AVX-512 can be picked by the linker for
// another TU. All paths produce bit-identical results (same operation order, explicit FMAs,
// -ffp-contract=off, the same round-to-nearest-even conversions).
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/adam.hpp"

namespace strata::optim {

// Per-call constants, rounded to float exactly as torch rounds its Python scalars.
struct AdamConsts {
  float grad_divisor;  // g / grad_divisor first (only when has_divisor: divisor != 1)
  bool has_divisor;
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float weight_decay;  // Adam: L2 coefficient (used only when has_weight_decay)
  float decay_mul;     // AdamW: float(1 - lr * weight_decay)
  float bc2_sqrt;      // float(sqrt(1 - beta2^step))
  float eps;
  float neg_step_size;  // float(-(lr / (1 - beta1^step)))
  bool adamw;
  bool has_weight_decay;
};

// Grad dtype / copy dtype codes used by the kernel table.
enum class CopyKind { kNone, kFp32, kFp16, kBf16 };

// The state arrays of one Adam call (already offset by the caller): read from p, m, v, the new
// values written to p_out, m_out, v_out, which are either the same arrays (in place) or arrays
// overlapping none of the inputs (a pending version: the committed state is left as it was).
struct AdamArrays {
  const float *p, *m, *v;
  float *p_out, *m_out, *v_out;
};

// Updates elements [0, n).
using AdamRangeFn = void (*)(const AdamConsts& c, DType grad_dtype, CopyKind copy,
                             const AdamArrays& a, const void* g, void* copy_out, std::size_t n);
// Finite check + sum of squares of (grad / divisor) * scale over [0, n) (no division when divisor
// is 1): adds to *sum_sq, sets *finite=false when a non-finite value is seen.
using GradStatsFn = void (*)(DType grad_dtype, const void* g, std::size_t n, float divisor,
                             float scale, bool* finite, double* sum_sq);
// The same-pattern stream kernel used as the bandwidth bound: reads p, m, v, g and writes p, m, v
// (their out arrays: in place where they are the same) and, when copy_bytes is 2 or 4, copy_out
// with elements of that size (Adam's updated-parameter copy: 4 — p's new value; 2 — g's bits for
// 16-bit grads, p's new value as bf16 for fp32 grads). Trivial arithmetic.
using StreamRangeFn = void (*)(DType grad_dtype, const AdamArrays& a, const void* g, void* copy_out,
                               std::size_t copy_bytes, std::size_t n);
using ConvertFn = void (*)(const void* src, void* dst, std::size_t n);

struct KernelTable {
  AdamRangeFn adam;
  GradStatsFn grad_stats;
  StreamRangeFn stream;
  ConvertFn f32_to_bf16, f32_to_fp16, bf16_to_f32, fp16_to_f32;
};

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();    // only call when adam_path_supported(kAvx2)
const KernelTable& kernels_avx512();  // only call when adam_path_supported(kAvx512)
const KernelTable& kernels_for(AdamPath resolved);

// Builds the per-call constants (validates nothing; CpuAdam/adam_step_cuda validate first).
AdamConsts make_adam_consts(const AdamParams& p, const AdamStepOptions& o);

}  // namespace strata::optim

namespace strata::optim {
// Throws Error(kInvalidArgument) naming `who` and the bad argument; used by CPU and CUDA entries.
void validate_adam_call(const AdamParams& p, const AdamTensors& t, const AdamStepOptions& o,
                        const char* who);
CopyKind copy_kind(const AdamTensors& t);
}  // namespace strata::optim
