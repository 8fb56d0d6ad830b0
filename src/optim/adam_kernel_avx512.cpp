// AVX-512 (F, BW, VL) Adam kernels. This file alone is compiled with AVX-512 flags (see
// CMakeLists.txt); CpuAdam calls into it only when CPUID and XCR0 report AVX-512 support.
//
// FP32 -> BF16 uses the round-to-nearest-even bit trick, not AVX512-BF16's VCVTNEPS2BF16: that
// instruction flushes denormal inputs to zero (measured on this machine's Zen 5), which would make
// this path differ from torch and from the other paths; the trick costs four integer operations
// per vector, free in this memory-bound kernel. FP16 uses the AVX-512F VCVTPS2PH/VCVTPH2PS.
#include <immintrin.h>

#include "optim/adam_kernel_body.hpp"

namespace {
struct Avx512V {
  using F = __m512;
  using H = __m256i;
  static constexpr std::size_t W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static H load16(const std::uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void store16(std::uint16_t* p, H x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  static void store_nt(float* p, F x) { _mm512_stream_ps(p, x); }
  static void store16_nt(std::uint16_t* p, H x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
  }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F bf16_to_f(H h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static H f_to_bf16(F f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static F fp16_to_f(H h) { return _mm512_cvtph_ps(h); }
  static H f_to_fp16(F f) {
    return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }
};
}  // namespace

namespace strata::optim {
const KernelTable& kernels_avx512() {
  static const KernelTable table = make_table<Avx512V>();
  return table;
}
}  // namespace strata::optim
