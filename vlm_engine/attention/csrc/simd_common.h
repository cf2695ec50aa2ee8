// SIMD pieces shared by our CPU attention kernels (paged_attention.cpp, flash_attention.cpp): the
// ISA switches, scalar bf16 helpers and the vector traits V16 (AVX-512, 16 fp32 lanes) and V8 (AVX2
// + FMA, 8 lanes) with the log2-domain exp2 and the horizontal reductions. Each kernel is its own
// extension (one translation unit), so everything here is inline. kernels/build.py hashes this
// header into the build of every source that includes it: editing it rebuilds both kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <limits>
#include <string>

// AVX-512 with the BW / VL / DQ subsets (every AVX-512 core since Skylake-SP: the kernels use 16-bit
// masked loads and permutes and 256-bit forms of the 512-bit instructions).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define VLM_AVX512 1
#else
#define VLM_AVX512 0
#endif
// AVX2 + FMA (Zen 3 and older Intel). Also built on AVX-512 machines, so that the AVX2 paths can be
// forced and tested there (impl = 3).
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLM_AVX2 1
#else
#define VLM_AVX2 0
#endif
// vdpbf16ps: bf16 pair products summed into fp32 lanes.
#if VLM_AVX512 && defined(__AVX512BF16__)
#define VLM_AVX512BF16 1
#else
#define VLM_AVX512BF16 0
#endif

namespace vlm_simd {

using bf16 = c10::BFloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return static_cast<float>(x); }
inline void store_f32(float x, float* dst) { *dst = x; }
inline void store_f32(float x, bf16* dst) { *dst = bf16(x); }

// exp2's polynomial: degree-7 Taylor of 2^f on [-0.5, 0.5], max rel. error ~1e-7. Highest first.
constexpr float kExp2Poly[8] = {1.525273380405984e-05f,  1.5403530393381606e-04f, 1.3333558146428443e-03f,
                                9.6181291076284770e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                6.9314718055994531e-01f, 1.0f};

#if VLM_AVX512
struct V16 {
  using R = __m512;
  static constexpr int W = 16;
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R load(const bf16* p) {  // 16 bf16 widened to fp32 (exact)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R zero() { return _mm512_setzero_ps(); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm512_fmsub_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static float hmax(R x) { return _mm512_reduce_max_ps(x); }
  static float hsum(R x) { return _mm512_reduce_add_ps(x); }
  static void store_out(float* dst, R x) { _mm512_storeu_ps(dst, x); }
  static void store_out(bf16* dst, R x) {  // round to nearest even, as c10 does for finite values
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
  // 2^x, exactly 0 below -126 (and for -inf).
  static R exp2(R x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    const R xc = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const R n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm512_sub_ps(xc, n);
    R p = _mm512_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
  }
};
#endif

#if VLM_AVX2
struct V8 {
  using R = __m256;
  static constexpr int W = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const bf16* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R zero() { return _mm256_setzero_ps(); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fmsub(R a, R b, R c) { return _mm256_fmsub_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static float hmax(R x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
  static float hsum(R x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
  }
  static void store_out(float* dst, R x) { _mm256_storeu_ps(dst, x); }
  static void store_out(bf16* dst, R x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 16-bit lanes 0..7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
  }
  // As V16::exp2; 2^n is built from the exponent bits (n >= -126 keeps it a normal float).
  static R exp2(R x) {
    const R live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
    const R xc = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const R n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const R f = _mm256_sub_ps(xc, n);
    R p = _mm256_set1_ps(kExp2Poly[0]);
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};
#endif

// out[:D] = acc[:D] * inv, vectorised (a per-element bf16 conversion cost as much as the attention
// of a 64-token window).
template <class V, typename T>
inline void finish_row(const float* acc, float inv, T* out, int64_t D) {
  const typename V::R vi = V::set1(inv);
  int64_t d = 0;
  for (; d + V::W <= D; d += V::W) V::store_out(out + d, V::mul(V::load(acc + d), vi));
  for (; d < D; ++d) store_f32(acc[d] * inv, out + d);
}

// The ISA features this build was compiled with (each module's build_info()).
inline std::string isa_info() {
  return std::string("avx512=") + (VLM_AVX512 ? "1" : "0") + " avx512bf16=" + (VLM_AVX512BF16 ? "1" : "0") +
         " avx2=" + (VLM_AVX2 ? "1" : "0");
}

}  // namespace vlm_simd
