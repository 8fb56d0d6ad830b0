// AVX2 + FMA + F16C Adam kernels. This file alone is compiled with -mavx2 -mfma -mf16c (see
// CMakeLists.txt); CpuAdam calls into it only when CPUID reports those features.
#include <immintrin.h>

#include "optim/adam_kernel_body.hpp"

namespace {
struct Avx2V {
  using F = __m256;
  using H = __m128i;
  static constexpr std::size_t W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static H load16(const std::uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  static void store16(std::uint16_t* p, H x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x); }
  static void store_nt(float* p, F x) { _mm256_stream_ps(p, x); }
  static void store16_nt(std::uint16_t* p, H x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
  }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F bf16_to_f(H h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static H f_to_bf16(F f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
  }
  static F fp16_to_f(H h) { return _mm256_cvtph_ps(h); }
  static H f_to_fp16(F f) {
    return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};
}  // namespace

namespace strata::optim {
const KernelTable& kernels_avx2() {
  static const KernelTable table = make_table<Avx2V>();
  return table;
}
}  // namespace strata::optim
