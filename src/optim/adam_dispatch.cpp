// Path selection (CPUID + $STRATA_ADAM_PATH), per-call constants, argument validation and the
// public conversion functions.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "core/numeric.hpp"
#include "optim/adam_kernels.hpp"
#include "strata/error.hpp"

namespace strata {

const char* adam_path_name(AdamPath p) {
  switch (p) {
    case AdamPath::kAuto: return "auto";
    case AdamPath::kAvx512: return "avx512";
    case AdamPath::kAvx2: return "avx2";
    case AdamPath::kScalar: return "scalar";
  }
  return "?";
}

#if defined(__x86_64__) || defined(__i386__)
// F16C (CPUID leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". The OS's
// saving of the YMM state it needs is checked by __builtin_cpu_supports("avx2").
static bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

bool adam_path_supported(AdamPath p) {
  switch (p) {
    case AdamPath::kAuto:
    case AdamPath::kScalar: return true;
#if defined(__x86_64__) || defined(__i386__)
    // __builtin_cpu_supports checks CPUID and that the OS saves the register state (XCR0).
    case AdamPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case AdamPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && adam_path_supported(AdamPath::kAvx2);
#else
    default: return false;
#endif
  }
  return false;
}

AdamPath adam_default_path() {
  if (const char* env = std::getenv("STRATA_ADAM_PATH"); env && *env) {
    const std::string s = env;
    AdamPath p;
    if (s == "avx512")
      p = AdamPath::kAvx512;
    else if (s == "avx2")
      p = AdamPath::kAvx2;
    else if (s == "scalar")
      p = AdamPath::kScalar;
    else if (s == "auto")
      p = AdamPath::kAuto;
    else
      fail(ErrorCode::kInvalidArgument,
           strcat("STRATA_ADAM_PATH=", s, ": expected avx512, avx2, scalar or auto"));
    if (p != AdamPath::kAuto) {
      if (!adam_path_supported(p))
        fail(ErrorCode::kUnsupported,
             strcat("STRATA_ADAM_PATH=", s, ": this CPU does not support that path"));
      return p;
    }
  }
  if (adam_path_supported(AdamPath::kAvx512)) return AdamPath::kAvx512;
  if (adam_path_supported(AdamPath::kAvx2)) return AdamPath::kAvx2;
  return AdamPath::kScalar;
}

namespace optim {

#if !defined(__x86_64__) && !defined(__i386__)
const KernelTable& kernels_avx2() { fail(ErrorCode::kUnsupported, "AVX2 Adam path: not x86"); }
const KernelTable& kernels_avx512() { fail(ErrorCode::kUnsupported, "AVX-512 Adam path: not x86"); }
#endif

const KernelTable& kernels_for(AdamPath p) {
  if (p == AdamPath::kAuto) p = adam_default_path();
  if (!adam_path_supported(p))
    fail(ErrorCode::kUnsupported,
         strcat("Adam path ", adam_path_name(p), " is not supported by this CPU"));
  switch (p) {
    case AdamPath::kAvx512: return kernels_avx512();
    case AdamPath::kAvx2: return kernels_avx2();
    default: return kernels_scalar();
  }
}

AdamConsts make_adam_consts(const AdamParams& p, const AdamStepOptions& o) {
  // Python floats (double) rounded to float where torch hands them to its FP32 kernels.
  const double step = static_cast<double>(o.step);
  const double bc1 = 1.0 - std::pow(p.beta1, step);
  const double bc2 = 1.0 - std::pow(p.beta2, step);
  AdamConsts c{};
  c.grad_divisor = o.grad_divisor;
  c.has_divisor = o.grad_divisor != 1.0f;
  c.grad_scale = o.grad_scale;
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.decay_mul = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(p.eps);
  c.neg_step_size = static_cast<float>((p.lr / bc1) * -1.0);
  c.adamw = p.type == OptimizerType::kAdamW;
  c.has_weight_decay = p.weight_decay != 0.0;
  return c;
}

CopyKind copy_kind(const AdamTensors& t) {
  if (!t.param_copy) return CopyKind::kNone;
  switch (t.param_copy_dtype) {
    case DType::kFp32: return CopyKind::kFp32;
    case DType::kFp16: return CopyKind::kFp16;
    default: return CopyKind::kBf16;
  }
}

namespace {
bool valid_dtype(DType d) { return d == DType::kFp32 || d == DType::kFp16 || d == DType::kBf16; }
}  // namespace

void validate_adam_call(const AdamParams& p, const AdamTensors& t, const AdamStepOptions& o,
                        const char* who) {
  auto bad = [&](const std::string& what) {
    fail(ErrorCode::kInvalidArgument, strcat(who, ": ", what));
  };
  if (p.type != OptimizerType::kAdam && p.type != OptimizerType::kAdamW)
    bad("unknown optimizer type");
  if (!(p.lr >= 0.0)) bad(strcat("lr=", p.lr, " must be >= 0"));
  if (!(p.beta1 >= 0.0 && p.beta1 < 1.0)) bad(strcat("beta1=", p.beta1, " must be in [0, 1)"));
  if (!(p.beta2 >= 0.0 && p.beta2 < 1.0)) bad(strcat("beta2=", p.beta2, " must be in [0, 1)"));
  if (!(p.eps >= 0.0)) bad(strcat("eps=", p.eps, " must be >= 0"));
  if (!(p.weight_decay >= 0.0)) bad(strcat("weight_decay=", p.weight_decay, " must be >= 0"));
  if (o.step < 1) bad(strcat("step=", o.step, " must be >= 1"));
  if (!(o.grad_divisor > 0.0f) || !std::isfinite(o.grad_divisor))
    bad(strcat("grad_divisor=", o.grad_divisor, " must be finite and > 0"));
  if (!valid_dtype(t.grad_dtype)) bad("unknown grad dtype");
  if (t.param_copy && !valid_dtype(t.param_copy_dtype)) bad("unknown param_copy dtype");
  if (t.n == 0) return;
  if (!t.param || !t.exp_avg || !t.exp_avg_sq || !t.grad)
    bad(strcat("null param/exp_avg/exp_avg_sq/grad pointer with n=", t.n));
  const int outs =
      (t.param_out != nullptr) + (t.exp_avg_out != nullptr) + (t.exp_avg_sq_out != nullptr);
  if (outs != 0 && outs != 3) bad("param_out, exp_avg_out, exp_avg_sq_out: all three or none");
  struct Arr {
    const char* name;
    std::uintptr_t begin;
    std::size_t elem;
  };
  const auto at = [](const void* q) { return reinterpret_cast<std::uintptr_t>(q); };
  const Arr arrs[8] = {
      {"param", at(t.param), 4},
      {"exp_avg", at(t.exp_avg), 4},
      {"exp_avg_sq", at(t.exp_avg_sq), 4},
      {"grad", at(t.grad), dtype_size(t.grad_dtype)},
      {"param_copy", at(t.param_copy), t.param_copy ? dtype_size(t.param_copy_dtype) : 0},
      {"param_out", at(t.param_out), 4},
      {"exp_avg_out", at(t.exp_avg_out), 4},
      {"exp_avg_sq_out", at(t.exp_avg_sq_out), 4},
  };
  for (const Arr& a : arrs) {
    if (a.begin && a.begin % a.elem != 0)
      bad(strcat(a.name, " pointer ", reinterpret_cast<const void*>(a.begin),
                 " is not aligned to its element size ", a.elem));
  }
  for (int i = 0; i < 8; ++i) {
    for (int j = i + 1; j < 8; ++j) {
      const Arr& a = arrs[i];
      const Arr& b = arrs[j];
      if (!a.begin || !b.begin) continue;
      const std::uintptr_t a_end = a.begin + a.elem * t.n, b_end = b.begin + b.elem * t.n;
      if (a.begin >= b_end || b.begin >= a_end) continue;
      const bool allowed = i == 3 && j == 4 && a.begin == b.begin && a.elem == b.elem;
      if (!allowed) bad(strcat(a.name, " and ", b.name, " overlap (n=", t.n, ")"));
    }
  }
}

}  // namespace optim

// The public conversions run on the best path of this machine (single-threaded).
namespace {
const optim::KernelTable& best() {
  static const optim::KernelTable& table = optim::kernels_for(adam_default_path());
  return table;
}
}  // namespace

void convert_fp32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
  best().f32_to_bf16(src, dst, n);
}
void convert_fp32_to_fp16(const float* src, std::uint16_t* dst, std::size_t n) {
  best().f32_to_fp16(src, dst, n);
}
void convert_bf16_to_fp32(const std::uint16_t* src, float* dst, std::size_t n) {
  best().bf16_to_f32(src, dst, n);
}
void convert_fp16_to_fp32(const std::uint16_t* src, float* dst, std::size_t n) {
  best().fp16_to_f32(src, dst, n);
}

}  // namespace strata
