// Fused element-wise ops for the CPU decoder (bf16, and fp32 in "fast" numerics): RMSNorm (+ residual add), rotary embedding
// (in place on q and k), SiLU-and-multiply, and the greedy sampler's row argmax.
//
// Why: at decode batch sizes each of these is a handful of tiny aten ops per layer (RMSNorm alone
// is ~9: upcast, pow, mean, add, rsqrt, mul, downcast, mul), and on 2 CPU cores the per-op
// dispatch cost was ~15-20% of a SmolLM2 batch-64 step. One call each removes that.
//
// Numerics follow Transformers' bf16 modules step by step: statistics in fp32, and every
// intermediate that Transformers materialises as a bf16 tensor is rounded to bf16 here too
// (round-to-nearest-even, as c10::BFloat16). Only reduction order and the exp implementation
// differ, so results match the torch reference to within one bf16 ulp on rare elements.
// In fp32 nothing is rounded in between, so results differ from torch's ops only by reduction order
// and the exp polynomial (a few fp32 ulps): fp32 uses these only in "fast" numerics, never in the
// "exact" mode that the Transformers parity tests run.
//
// Speed: the inner loops are written so that the compiler vectorises them (`omp simd`,
// -march=native): bf16 <-> fp32 conversions are branch-free bit operations and exp is a
// polynomial. With c10::BFloat16 (a NaN branch per conversion) and std::exp they stayed scalar,
// and SiLU-and-multiply was 5x slower than torch's two vectorised ops (221 vs 45 us at 64 x 3072).

#include <torch/extension.h>

#include "panel_scales.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

// bf16 <-> fp32 on raw bits, as c10::BFloat16 converts (round-to-nearest-even, NaN kept), but
// without its NaN branch.
inline float bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

inline uint16_t float_to_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return x != x ? static_cast<uint16_t>(0x7FC0) : rounded;
}

inline float round_bits(float x) { return bits_to_float(float_to_bits(x)); }

// exp(x) to ~1 fp32 ulp (Cephes' expf: x = n ln2 + r, degree-6 polynomial for e^r, 2^n from the
// exponent bits). The input is clamped to [-88, 88], where 2^n stays a normal float; beyond it
// the true exp differs from the clamped one, which changes SiLU only for |x| > 88 (e.g. ~-5e-37
// instead of -0 at x = -100).
inline float exp_approx(float x) {
  const float xc = x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x);
  // Round to nearest by adding and subtracting 1.5 * 2^23 (std::floor and std::fmin/fmax kept
  // the loop scalar; this needs no -ffast-math, which would fold the two adds away).
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Element access for the two dtypes the CPU decoder runs in. bf16 rounds every intermediate that
// Transformers materialises as a bf16 tensor; fp32 ("fast" numerics) has nothing to round.
struct Bf16Elem {
  using raw_t = uint16_t;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static inline float load(raw_t v) { return bits_to_float(v); }
  static inline raw_t store(float v) { return float_to_bits(v); }
  static inline float round(float v) { return round_bits(v); }
  static raw_t* data(const at::Tensor& t) { return reinterpret_cast<raw_t*>(t.data_ptr<bf16>()); }
};

struct F32Elem {
  using raw_t = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static inline float load(raw_t v) { return v; }
  static inline raw_t store(float v) { return v; }
  static inline float round(float v) { return v; }
  static raw_t* data(const at::Tensor& t) { return t.data_ptr<float>(); }
};

// Whether t is bf16 (else fp32; anything else is refused).
bool is_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  if (t.scalar_type() == at::kBFloat16) return true;
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be bfloat16 or float32");
  return false;
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with a contiguous last dim");
}

// y = w * round(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm / Qwen2RMSNorm (statistics in fp32).
template <typename E>
inline void rms_norm_row(const typename E::raw_t* x, const typename E::raw_t* w, typename E::raw_t* y,
                         int64_t hidden, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = E::load(x[i]);
    sum_sq += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) {
    y[i] = E::store(E::load(w[i]) * E::round(E::load(x[i]) * inv));
  }
}

template <typename E>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x", E::kType);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == E::kType, "weight must be contiguous, dtype of x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.numel() == hidden, "weight size != hidden size");
  at::Tensor out = at::empty({rows, hidden}, x.options());
  const auto* xp = E::data(x);
  const auto* wp = E::data(weight);
  auto* op = E::data(out);
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row<E>(xp + r * xs, wp, op + r * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (is_bf16(x, "x")) {
    return rms_norm_impl<Bf16Elem>(x, weight, eps);
  }
  return rms_norm_impl<F32Elem>(x, weight, eps);
}

// residual = round(residual + x); x = rms_norm(residual). Both updated in place; returns x.
template <typename E>
at::Tensor add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x", E::kType);
  check_rows(residual, "residual", E::kType);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden && weight.scalar_type() == E::kType,
              "weight must be contiguous [hidden], dtype of x");
  auto* xp = E::data(x);
  auto* rp = E::data(residual);
  const auto* wp = E::data(weight);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      auto* xr = xp + r * xs;
      auto* rr = rp + r * rs;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) rr[i] = E::store(E::load(rr[i]) + E::load(xr[i]));
      rms_norm_row<E>(rr, wp, xr, hidden, static_cast<float>(eps));
    }
  });
  return x;
}

at::Tensor add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  if (is_bf16(x, "x")) {
    return add_rms_norm_impl<Bf16Elem>(x, residual, weight, eps);
  }
  return add_rms_norm_impl<F32Elem>(x, residual, weight, eps);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 bf16 <-> fp32 lanes as bits_to_float / float_to_bits (round-to-nearest-even, NaN -> 0x7FC0), masked.
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m512i bf16_bits16(__m512 x) {  // the rounded bf16 in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline __m512 round_bf16x16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16)); }

inline void store_bf16x16(uint16_t* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(x)));
}

// One bf16 head of rotate_heads in 16-lane vectors, the tail masked: the same roundings, so the
// same bits. The compiler's own vectorisation left a head dim of 80 (Qwen2.5-VL's tower: halves of
// 40) mostly scalar, 3x the time of 64 or 128 (1,024 tokens x 16 heads, Zen 5).
inline void rotate_head_bf16(uint16_t* v, const uint16_t* c, const uint16_t* s, int64_t half) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (half - i)) - 1u);
    const __m512 x1 = load_bf16x16(v + i, m), x2 = load_bf16x16(v + half + i, m);
    const __m512 lo = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(c + i, m))),
                                    round_bf16x16(_mm512_mul_ps(_mm512_xor_ps(x2, sign), load_bf16x16(s + i, m))));
    const __m512 hi = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, load_bf16x16(c + half + i, m))),
                                    round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(s + half + i, m))));
    store_bf16x16(v + i, lo, m);
    store_bf16x16(v + half + i, hi, m);
  }
}
#endif

// In place: t = round(round(t * cos) + round(rotate_half(t) * sin)) for t in (q, k), each [T, H, D]
// with a contiguous last dim (they may be strided views into the fused qkv output).
template <typename E>
void rotate_heads(at::Tensor& t, const typename E::raw_t* cos, const typename E::raw_t* sin, int64_t cs_stride) {
  const int64_t tokens = t.size(0), heads = t.size(1), dim = t.size(2), half = dim / 2;
  auto* base = E::data(t);
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<E, Bf16Elem>) {
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t tok = begin; tok < end; ++tok)
        for (int64_t h = 0; h < heads; ++h)
          rotate_head_bf16(base + tok * s0 + h * s1, cos + tok * cs_stride, sin + tok * cs_stride, half);
    });
    return;
  }
#endif
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t tok = begin; tok < end; ++tok) {
      const auto* c = cos + tok * cs_stride;
      const auto* s = sin + tok * cs_stride;
      for (int64_t h = 0; h < heads; ++h) {
        auto* v = base + tok * s0 + h * s1;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) row[i] = E::load(v[i]);
        // rotate_half(t) = (-t2, t1): the two halves as separate loops, so both vectorise.
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          v[i] = E::store(E::round(row[i] * E::load(c[i])) + E::round(-row[i + half] * E::load(s[i])));
        }
#pragma omp simd
        for (int64_t i = half; i < dim; ++i) {
          v[i] = E::store(E::round(row[i] * E::load(c[i])) + E::round(row[i - half] * E::load(s[i])));
        }
      }
    }
  });
}

template <typename E>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == E::kType, "q and k must be CPU tensors of one dtype");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "q/k must be [T, H, D] with a contiguous last dim");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos/sin must be [T, D]");
  TORCH_CHECK(q.size(2) % 2 == 0 && q.size(2) == k.size(2), "head_dim must be even and equal for q and k");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == E::kType && s.scalar_type() == E::kType, "cos/sin must have the dtype of q");
  rotate_heads<E>(q, E::data(c), E::data(s), c.size(1));
  rotate_heads<E>(k, E::data(c), E::data(s), c.size(1));
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  if (is_bf16(q, "q")) {
    rotary_impl<Bf16Elem>(q, k, cos, sin);
  } else {
    rotary_impl<F32Elem>(q, k, cos, sin);
  }
}

// [T, 2I] (gate | up) -> [T, I]: round(round(silu(gate)) * up), as act_fn(gate_proj(x)) * up_proj(x).
template <typename E>
at::Tensor silu_and_mul_impl(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up", E::kType);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up width must be even");
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const auto* in = E::data(gate_up);
  auto* op = E::data(out);
  const int64_t is = gate_up.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* g = in + r * is;
      const auto* u = g + inter;
      auto* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float x = E::load(g[i]);
        o[i] = E::store(E::round(x / (1.0f + exp_approx(-x))) * E::load(u[i]));
      }
    }
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  if (is_bf16(gate_up, "gate_up")) {
    return silu_and_mul_impl<Bf16Elem>(gate_up);
  }
  return silu_and_mul_impl<F32Elem>(gate_up);
}

// ---- fp32 linear over weight panels ----------------------------------------------------------------
//
// y[M, N] = x[M, K] W^T (+ bias) with W re-laid out once as panels of 16 output rows,
// [ceil(N/16)][K][16]. Each thread takes whole panels; for every 6 rows of x it streams the panel
// (in chunks of 256 inputs that stay in L1), loads each 16-wide weight row once and broadcasts x
// into 12 accumulators. Every output is one FMA chain over k = 0..K-1, whatever the number of
// rows, so results do not depend on the batch. On Zen 3 (AVX2), all SmolLM2 linears of a step,
// weights cycling through memory, against oneDNN's packed fp32 kernel: M=1 21 vs 31 ms (25 GB/s of
// the machine's 27), M=8 23 vs 32 ms, M=16 36 vs 47 ms, M=64 103 vs 127 ms (166 GFLOP/s).
// The AVX-512 build (below) runs the same chains two panels at a time in 16-lane vectors: on the
// 2-core Zen 5, fp32 panels at M=16 33 -> 20 ms, M=64 93 -> 49 ms; at 229-432 rows (a Qwen2-VL
// prefill) ~225 -> ~440 GFLOP/s, level with oneDNN's AVX-512 kernel.
//
// bf16 weights (pack_panels keeps the weight's dtype) use the same panels, each 16-wide row stored
// with its middle two quarters swapped so that two unpacks widen it to fp32 in registers (exact);
// the FMAs run in fp32 on x widened to fp32, and the result is rounded to bf16 once: the fp32
// product of the bf16 numbers, as oneDNN's bf16 kernels accumulate. This is for the few-row
// decode, which only streams weights: half the bytes of fp32, no bf16 dot-product instructions.
// With one or two rows an FMA chain per 8 outputs would wait on its own latency between inputs,
// so bf16 sums interleaved inputs in 4 (1 row) or 2 (2 rows) partial chains, added at the end:
// another summation order than the fp32 panels, whose one-chain order keeps rows batch-invariant.
constexpr int64_t kPanel = 16;

// Slot of column c in a stored bf16 panel row (quarters 1 and 2 swapped; see load_panel_row).
constexpr int64_t bf16_slot(int64_t c) { return c < 4 || c >= 12 ? c : (c < 8 ? c + 4 : c - 4); }

template <typename T>
void pack_rows(const T* sp, T* dp, int64_t n, int64_t k, int64_t panels) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const T* row = sp + (p * kPanel + c) * k;
        T* col = dp + p * k * kPanel + (kBf16 ? bf16_slot(c) : c);
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
    }
  });
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2, "w must be a CPU [N, K] tensor");
  const bool bf = is_bf16(w, "w");
  const at::Tensor src = w.contiguous();
  const int64_t n = src.size(0), k = src.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, k, kPanel}, src.options());
  if (bf) {
    pack_rows(Bf16Elem::data(src), Bf16Elem::data(out), n, k, panels);
  } else {
    pack_rows(src.data_ptr<float>(), out.data_ptr<float>(), n, k, panels);
  }
  return out;
}

constexpr int64_t kRowBlock = 6;       // rows per pass
constexpr int64_t kGroupBlocks = 8;    // passes that share one chunk of panel while it is in L1

// Output rows: fp32, or bf16 rounded once from the fp32 sum.
inline void store_out(float* y, float v) { *y = v; }
inline void store_out(uint16_t* y, float v) { *y = float_to_bits(v); }

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kPanelVectorized = true;

// One 16-wide weight row as two fp32 vectors. Aligned loads: panels come from at::zeros (64-byte
// aligned) in whole rows of 64 (fp32) or 32 (bf16) bytes.
inline void load_panel_row(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_load_ps(w);
  w1 = _mm256_load_ps(w + 8);
}

// bf16 -> fp32 is the 16 bits moved to the top of a 32-bit lane: unpacking with zeros does that
// per 128-bit lane, giving slots 0-3, 8-11 and 4-7, 12-15, i.e. columns 0-7 and 8-15 (bf16_slot).
inline void load_panel_row(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// Software prefetch of the weights 8 KB ahead of the row being multiplied (panels are contiguous, so
// past a panel's end it is the next panel's start; a prefetch never faults). The hardware
// prefetchers alone let the weight stream fall to ~16 GB/s once FMAs sit between the loads: on the
// 2-core Zen 5 built for AVX2, all SmolLM2 linears of a step at M = 1 / 6 / 16 / 64 took 13.0 / 18.5
// / 35.1 / 88.4 ms in fp32 without it and 8.7 / 9.2 / 20.6 / 73.6 with it (bf16 weights 5.4 / 13.0
// / 31.0 / 88.1 -> 5.1 / 8.5 / 21.1 / 76.9).
constexpr int64_t kPrefetchBytes = 8192;

template <typename W>
inline void prefetch_panel_row(const W* w) {
  _mm_prefetch(reinterpret_cast<const char*>(w), _MM_HINT_T0);
}

template <typename W>
constexpr int64_t kPrefetchRows = kPrefetchBytes / (16 * sizeof(W));

// Partial FMA chains per accumulator for MR rows of bf16 panels: with 4 / 2 the 8 FMA chains of
// 1 / 2 rows hide the FMA latency; 3+ rows have enough chains. The fp32 panels keep one chain:
// their summation order keeps rows batch-invariant.
template <int MR, typename W>
constexpr int kChains = std::is_same_v<W, float> ? 1 : (MR == 1 ? 4 : (MR == 2 ? 2 : 1));

// The FMA loop over inputs [k0, k1), accumulating into an aligned [MR][16] block (zeroed first
// when `first`). This shape is measured, not derived: one function doing the loop, bias and
// partial-panel copy together compiled (gcc) to a loop 2-3x slower at MR = 6.
template <int MR, typename W>
inline void panel_block(const float* x, int64_t xs, const W* w, int64_t k0, int64_t k1, float* acc, bool first) {
  constexpr int S = kChains<MR, W>;
  __m256 lo[S][MR], hi[S][MR];
  for (int r = 0; r < MR; ++r) {
    lo[0][r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel);
    hi[0][r] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * kPanel + 8);
    for (int c = 1; c < S; ++c) lo[c][r] = hi[c][r] = _mm256_setzero_ps();
  }
  int64_t i = k0;
  for (; i + S <= k1; i += S) {
#pragma GCC unroll 4
    for (int c = 0; c < S; ++c) {
      __m256 w0, w1;
      prefetch_panel_row(w + (i + c + kPrefetchRows<W>) * kPanel);
      load_panel_row(w + (i + c) * kPanel, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * xs + i + c);
        lo[c][r] = _mm256_fmadd_ps(xb, w0, lo[c][r]);
        hi[c][r] = _mm256_fmadd_ps(xb, w1, hi[c][r]);
      }
    }
  }
  for (; i < k1; ++i) {
    __m256 w0, w1;
    load_panel_row(w + i * kPanel, w0, w1);
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + i);
      lo[0][r] = _mm256_fmadd_ps(xb, w0, lo[0][r]);
      hi[0][r] = _mm256_fmadd_ps(xb, w1, hi[0][r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 1; c < S; ++c) {
      lo[0][r] = _mm256_add_ps(lo[0][r], lo[c][r]);
      hi[0][r] = _mm256_add_ps(hi[0][r], hi[c][r]);
    }
    _mm256_store_ps(acc + r * kPanel, lo[0][r]);
    _mm256_store_ps(acc + r * kPanel + 8, hi[0][r]);
  }
}

constexpr int64_t kPanelChunk = 256;  // inputs per pass: 16 KB of panel stays in L1 for all rows

#if defined(__AVX512F__)
// AVX-512: a 16-wide weight row is one vector, and a pass covers NP = 2 panels (32 columns) so that
// 6 rows keep 12 independent FMA chains in flight. Every output is the same chain (or the same
// kChains partial chains, added in the same order) over k as in the AVX2 build, so the two builds
// give bit-identical results (tests/test_fused_ops.py compares them); on a CPU with full-width
// 512-bit FMA units (Zen 5, Xeon) the FMA rate doubles at prefill sizes.
constexpr int kPanelsPerPass = 2;

inline __m512 load_panel_row16(const float* w) { return _mm512_load_ps(w); }

// bf16: widened in stored slot order (quarters 1 and 2 swapped), so the sums land in slot order
// too; acc_column maps them back when the outputs are written.
inline __m512 load_panel_row16(const uint16_t* w) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// The loop over inputs [k0, k1) for MR rows of NP panels (`wstride` elements apart), accumulating
// into an aligned [MR][NP][16] block, as panel_block above.
template <int MR, int NP, typename W>
inline void panel_block(const float* x, int64_t xs, const W* w, int64_t wstride, int64_t k0, int64_t k1, float* acc,
                        bool first) {
  constexpr int S = kChains<MR, W>;
  __m512 a[S][MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) {
      a[0][r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r * NP + j) * kPanel);
      for (int c = 1; c < S; ++c) a[c][r][j] = _mm512_setzero_ps();
    }
  int64_t i = k0;
  for (; i + S <= k1; i += S) {
#pragma GCC unroll 4
    for (int c = 0; c < S; ++c) {
      __m512 wv[NP];
      for (int j = 0; j < NP; ++j) {
        prefetch_panel_row(w + j * wstride + (i + c + kPrefetchRows<W>) * kPanel);
        wv[j] = load_panel_row16(w + j * wstride + (i + c) * kPanel);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * xs + i + c]);
        for (int j = 0; j < NP; ++j) a[c][r][j] = _mm512_fmadd_ps(xb, wv[j], a[c][r][j]);
      }
    }
  }
  for (; i < k1; ++i) {
    __m512 wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = load_panel_row16(w + j * wstride + i * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * xs + i]);
      for (int j = 0; j < NP; ++j) a[0][r][j] = _mm512_fmadd_ps(xb, wv[j], a[0][r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) {
      for (int c = 1; c < S; ++c) a[0][r][j] = _mm512_add_ps(a[0][r][j], a[c][r][j]);
      _mm512_store_ps(acc + (r * NP + j) * kPanel, a[0][r][j]);
    }
}
#else
constexpr int kPanelsPerPass = 1;
#endif

// One pass of MR rows over inputs [k0, k1) of NP panels: 8-lane vectors for one panel (the AVX2
// build's kernel, and the AVX-512 build's for few rows), 16-lane ones for two.
template <int MR, int NP, typename W>
inline void panel_pass(const float* x, int64_t xs, const W* w, int64_t wstride, int64_t k0, int64_t k1, float* acc,
                       bool first) {
  if constexpr (NP == 1) {
    panel_block<MR>(x, xs, w, k0, k1, acc, first);
  } else {
#if defined(__AVX512F__)
    panel_block<MR, NP>(x, xs, w, wstride, k0, k1, acc, first);
#endif
  }
}

// Where output column c's sum sits in a pass's 16 accumulators: the 16-lane bf16 widening keeps
// the stored slot order.
template <int NP, typename W>
constexpr int64_t acc_column(int64_t c) { return NP > 1 && !std::is_same_v<W, float> ? bf16_slot(c) : c; }

// fp32 (one chain per output) may end a pass anywhere: NP panels take the L1 bytes of one. bf16
// weights add their partial chains at the end of each pass, so their passes stay the AVX2
// build's (a pair of bf16 panels takes the L1 bytes of one fp32 panel).
template <int NP, typename W>
constexpr int64_t kPassInputs = std::is_same_v<W, float> ? kPanelChunk / NP : kPanelChunk;

// All m rows of x against NP panels. Per group of up to 48 rows, chunk by chunk of inputs, every
// 6-row block of the group: a chunk comes from memory once and serves the whole group from L1.
// (Block by block over all chunks read the panel once per block, and only the first block's pass
// overlapped the memory stream: at 16 rows the FMA units idled while a 6-row pass streamed.)
// The block partition (6s, then the rest) and every accumulator's sequence of passes are the
// same either way, so the sums are too.
template <int NP, typename W, typename O>
inline void panel_all_rows(const float* xp, int64_t xs, int64_t m, const W* w, int64_t k, const float* b, O* y,
                           int64_t n, int64_t ncols) {
  alignas(64) float acc[kGroupBlocks * kRowBlock * NP * kPanel];
  const int64_t wstride = k * kPanel;
  for (int64_t g0 = 0; g0 < m; g0 += kGroupBlocks * kRowBlock) {
    const int64_t g1 = std::min(m, g0 + kGroupBlocks * kRowBlock);
    for (int64_t k0 = 0; k0 < k; k0 += kPassInputs<NP, W>) {
      const int64_t k1 = std::min(k, k0 + kPassInputs<NP, W>);
      for (int64_t r = g0; r < g1; r += kRowBlock) {
        const float* x = xp + r * xs;
        float* a = acc + (r - g0) * NP * kPanel;
        switch (std::min(kRowBlock, g1 - r)) {
          case 6: panel_pass<6, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
          case 5: panel_pass<5, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
          case 4: panel_pass<4, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
          case 3: panel_pass<3, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
          case 2: panel_pass<2, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
          default: panel_pass<1, NP>(x, xs, w, wstride, k0, k1, a, k0 == 0); break;
        }
      }
    }
    for (int64_t r = g0; r < g1; ++r) {
      const float* a = acc + (r - g0) * NP * kPanel;
      for (int64_t c = 0; c < ncols; ++c)
        store_out(y + r * n + c, a[(c / kPanel) * kPanel + acc_column<NP, W>(c % kPanel)] + (b ? b[c] : 0.f));
    }
  }
}
#else
constexpr bool kPanelVectorized = false;
constexpr int kPanelsPerPass = 1;

inline float panel_weight(const float* row, int64_t c) { return row[c]; }
inline float panel_weight(const uint16_t* row, int64_t c) { return bits_to_float(row[bf16_slot(c)]); }

template <int NP, typename W, typename O>
inline void panel_all_rows(const float* xp, int64_t xs, int64_t m, const W* w, int64_t k, const float* b, O* y,
                           int64_t n, int64_t ncols) {
  static_assert(NP == 1, "the portable build takes one panel per pass");
  for (int64_t r = 0; r < m; ++r) {
    float acc[kPanel] = {};
    for (int64_t i = 0; i < k; ++i)
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += xp[r * xs + i] * panel_weight(w + i * kPanel, c);
    for (int64_t c = 0; c < ncols; ++c) store_out(y + r * n + c, acc[c] + (b ? b[c] : 0.f));
  }
}
#endif

// Rows from which the AVX-512 build takes two panels per pass in 16-lane vectors. bf16 panels at
// one or two rows (a pure weight stream, in partial chains) keep the 8-lane kernel, whose in-lane
// widening measured ~15% faster there on the Zen 5; fp32 panels gain from one row on.
template <typename W>
constexpr int64_t kWideMinRows = std::is_same_v<W, float> ? 1 : 3;

// Rows of x per sweep over the panels, for prefill-sized products. Every panel reads all the rows
// of its sweep, so with a 2,048-row prefill in one sweep x (12-73 MB) came from L3 or memory once
// per panel; sweeps of ~256 rows (~1.5 MB at 1,536 inputs) stay near the cores, and the weights are
// re-read once per sweep instead. Zen 3 (AVX2), 2 threads, interleaved medians, GFLOP/s one sweep
// -> sweeps, fp32 / bf16 panels: 2,048 x 8,960 -> 1,536 99 -> 128 / 110 -> 137; 3,960 x 1,280 ->
// 3,840 (a vision tower's) 105 -> 126 / 105 -> 131; 1,536 -> 2,048 level. Products of fewer than
// 2 x kSweepRows rows keep one sweep: a short last sweep re-reads all the weights for a few rows
// (229 rows as 192 + 37 measured ~0.85x).
// Sweeps are multiples of kRowBlock * kGroupBlocks rows, so the rows fall into the same 6-row blocks
// as in one sweep and every output is the same sum (bf16 panels chain by block size).
constexpr int64_t kSweepRows = 256;

int64_t sweep_rows(int64_t m) {
  if (m < 2 * kSweepRows) return std::max<int64_t>(m, 1);
  constexpr int64_t unit = kRowBlock * kGroupBlocks;
  const int64_t sweeps = (m + kSweepRows - 1) / kSweepRows, rows = (m + sweeps - 1) / sweeps;
  return (rows + unit - 1) / unit * unit;
}

// y [m, n] (fp32 or bf16) = x [m, k] fp32 (row stride xs) times the panels, plus bias (fp32 or null).
template <typename W, typename O>
void panel_product(const float* xp, int64_t xs, int64_t m, const W* wp, int64_t panels, int64_t k, int64_t n,
                   const float* bp, O* yp) {
  const int64_t per_pass = m >= kWideMinRows<W> ? kPanelsPerPass : 1;
  const int64_t sweep = sweep_rows(m);
  for (int64_t r0 = 0; r0 < m; r0 += sweep) {
    const int64_t rows = std::min(sweep, m - r0);
    const float* x = xp + r0 * xs;
    O* y = yp + r0 * n;
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; p += per_pass) {
        const W* w = wp + p * k * kPanel;
        const int64_t c0 = p * kPanel, ncols = std::min<int64_t>(per_pass * kPanel, n - c0);
        const float* b = bp ? bp + c0 : nullptr;
        if (per_pass > 1 && p + per_pass <= end) {
          panel_all_rows<kPanelsPerPass>(x, xs, rows, w, k, b, y + c0, n, ncols);
        } else {  // few rows, or the thread's last panel when it has an odd count
          panel_all_rows<1>(x, xs, rows, w, k, b, y + c0, n, std::min<int64_t>(kPanel, ncols));
        }
      }
    });
  }
}

// x and y in x's dtype; panels in x's dtype, or bf16 under fp32 x ("bf16 weights": the fp32 model
// of a CPU without bf16 dot products streams half the bytes, with fp32 activations and sums).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
  const bool bf = is_bf16(x, "x");
  check_rows(x, "x", bf ? at::kBFloat16 : at::kFloat);
  const bool bf_panels = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (panels.scalar_type() == x.scalar_type() || bf_panels),
              "panels must come from pack_panels, in x's dtype or (under fp32 x) bf16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(panels.size(1) == k, "x has ", k, " features, the weight ", panels.size(1));
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel, "n does not match the panels");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be [n] in x's dtype");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  if (!bf) {
    if (bf_panels) {
      panel_product(x.data_ptr<float>(), x.stride(0), m, Bf16Elem::data(panels), panels.size(0), k, n, bp, y.data_ptr<float>());
    } else {
      panel_product(x.data_ptr<float>(), x.stride(0), m, panels.data_ptr<float>(), panels.size(0), k, n, bp, y.data_ptr<float>());
    }
    return y;
  }
  // bf16: x widened to fp32 once (exact; a few rows: a plain buffer, not a tensor, whose dispatch
  // cost more than the loop), each output rounded to bf16 once.
  std::vector<float> x32(static_cast<size_t>(m * k));
  const uint16_t* xb = Bf16Elem::data(x);
  for (int64_t r = 0; r < m; ++r) {
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) x32[r * k + i] = bits_to_float(xb[r * x.stride(0) + i]);
  }
  panel_product(x32.data(), k, m, Bf16Elem::data(panels), panels.size(0), k, n, bp, Bf16Elem::data(y));
  return y;
}

bool panel_linear_vectorized() { return kPanelVectorized; }

// ---- Weight-only quantized panels: int8 (Q8_0) and int4 (Q4_1), groups of 32 along K -------------
//
// The schemes of llama.cpp's Q8_0 and Q4_1 blocks, so that a GGUF file re-quantized here keeps its
// codes: per (output row, group of 32 inputs) a scale d and, for int4, a minimum m (fp16, as in
// GGUF); int8: w = d * q, q in [-127, 127]; int4: w = d * q + m, q in [0, 15].
//
// The product quantizes x as well, as llama.cpp does (its Q8_0 / Q8_1 activations): per row and
// group qx = round(x / dx), dx = max|x| / 127, and per output sum_k w x = d dx sum_k q qx, plus
// m sum_k x for int4 (the exact fp32 sum of x). The integer sums run on dot products of four
// u8 x s8 pairs per 32-bit lane (vpdpbusd with AVX-512 VNNI or AVX-VNNI; vpmaddubsw + vpmaddwd on
// AVX2): about 3 instructions per 32 weights and row where widening the codes to fp32 for FMAs took
// ~10 per 16, and that decoding, not memory, had bound the batch-1 int4 step (~10 GB/s of codes on
// the 2-core Zen 4). int8 codes are signed: the dot takes |q| and moves q's sign onto qx.
//
// Layout, so that one 32-bit lane holds one output column's codes for 4 consecutive inputs: panels
// of 16 output rows, codes [P][K/4][64] (int8: bytes 4c..4c+3 of a block are column c's inputs
// 4b..4b+3) or [P][K/8][64] (int4: byte 4c+j holds column c's input 8b+j in its low nibble and
// input 8b+4+j in its high one), scales [P][K/32 >> shift][2][16] (d, then m): a checkpoint's group of
// 32 << shift inputs (AWQ's and GPTQ's 128: shift 2) keeps one (d, m) per group, not one per 32 inputs
// (at 4 bits a repeated pair costs a bit per weight: 0.6 GB of a 7B's 4.1), and the kernels read group
// g's pair at g >> shift; our own panels and GGUF's blocks have shift 0.
constexpr int64_t kGroup = 32;
constexpr int64_t kBlockBytes = 4 * kPanel;  // one 4-input (int8) or 8-input (int4) block of a panel

constexpr int64_t inputs_per_block(int64_t bits) { return bits == 8 ? 4 : 8; }

inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }

// Byte offset of input kk of column c within a panel's codes (int4: inputs 8b+4..8b+7 are the high
// nibbles of the bytes of 8b..8b+3).
inline int64_t code_offset(int64_t bits, int64_t c, int64_t kk) {
  const int64_t per_block = inputs_per_block(bits), j = kk % per_block;
  return (kk / per_block) * kBlockBytes + 4 * c + (bits == 8 ? j : j % 4);
}

std::vector<at::Tensor> quantize_panels(const at::Tensor& w, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2, "w must be a CPU fp32 [N, K] tensor");
  const at::Tensor src = w.contiguous();
  const int64_t n = src.size(0), k = src.size(1), panels = (n + kPanel - 1) / kPanel, groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "in_features (", k, ") must be a multiple of ", kGroup);
  const int64_t blocks = k / inputs_per_block(bits);
  at::Tensor codes = at::zeros({panels, blocks, kBlockBytes}, src.options().dtype(bits == 8 ? at::kChar : at::kByte));
  at::Tensor scales = at::zeros({panels, groups, 2, kPanel}, src.options().dtype(at::kShort));
  const float* sp = src.data_ptr<float>();
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  uint16_t* qp = reinterpret_cast<uint16_t*>(scales.data_ptr<int16_t>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin * kPanel; row < std::min(n, end * kPanel); ++row) {
      const int64_t p = row / kPanel, c = row % kPanel;
      uint8_t* panel = cp + p * blocks * kBlockBytes;
      for (int64_t g = 0; g < groups; ++g) {
        const float* x = sp + row * k + g * kGroup;
        uint16_t* sc = qp + ((p * groups + g) * 2) * kPanel;
        if (bits == 8) {  // llama.cpp quantize_row_q8_0_ref
          float amax = 0.f;
          for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
          const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
          sc[c] = half_bits(d);
          sc[kPanel + c] = half_bits(0.f);
          for (int64_t i = 0; i < kGroup; ++i)
            panel[code_offset(8, c, g * kGroup + i)] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(x[i] * id)));
        } else {  // llama.cpp quantize_row_q4_1_ref
          float mn = x[0], mx = x[0];
          for (int64_t i = 1; i < kGroup; ++i) {
            mn = std::min(mn, x[i]);
            mx = std::max(mx, x[i]);
          }
          const float d = (mx - mn) / 15.f, id = d ? 1.f / d : 0.f;
          sc[c] = half_bits(d);
          sc[kPanel + c] = half_bits(mn);
          for (int64_t i = 0; i < kGroup; ++i) {
            const int64_t kk = g * kGroup + i;
            const uint8_t q = static_cast<uint8_t>(std::min(15, static_cast<int>((x[i] - mn) * id + 0.5f)));
            uint8_t& byte = panel[code_offset(4, c, kk)];
            byte = static_cast<uint8_t>(kk % 8 < 4 ? (byte & 0xF0) | q : (byte & 0x0F) | (q << 4));
          }
        }
      }
    }
  });
  return {codes, scales};
}

// The code of input kk of column c (int8 signed, int4 0..15).
inline int code_at(const uint8_t* panel, int64_t bits, int64_t c, int64_t kk) {
  const uint8_t byte = panel[code_offset(bits, c, kk)];
  if (bits == 8) return static_cast<int8_t>(byte);
  return kk % 8 < 4 ? (byte & 0x0F) : (byte >> 4);
}

// log2 of the groups of 32 inputs that share one (d, m) in `scales` (panel_scales.h).
inline int64_t scale_shift(const at::Tensor& scales, int64_t panels, int64_t k) {
  return vlm_panels::scale_shift(scales, panels, k, kGroup, kPanel);
}

int64_t codes_inputs(const at::Tensor& codes, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == kBlockBytes, "codes must come from quantize_panels");
  return codes.size(1) * inputs_per_block(bits);
}

// The weights the codes stand for, [N, K] fp32 (tests, and the reference the kernel must equal).
at::Tensor dequantize_panels(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t bits) {
  const int64_t panels = codes.size(0), k = codes_inputs(codes, bits);
  const int64_t shift = scale_shift(scales, panels, k), scale_groups = (k / kGroup) >> shift;
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the panels");
  at::Tensor out = at::empty({n, k}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  float* op = out.data_ptr<float>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t p = row / kPanel, c = row % kPanel;
    const uint8_t* panel = cp + p * codes.size(1) * kBlockBytes;
    for (int64_t kk = 0; kk < k; ++kk) {
      const uint16_t* sc = qp + ((p * scale_groups + ((kk / kGroup) >> shift)) * 2) * kPanel;
      op[row * k + kk] = half_value(sc[c]) * code_at(panel, bits, c, kk) + half_value(sc[kPanel + c]);
    }
  }
  return out;
}

// x quantized per row and group of 32 (see above): codes qx [m][k], scale dx and exact sum of x [m][k/32].
struct QuantizedRows {
  std::vector<int8_t> qx;
  std::vector<float> dx, sum;
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kQuantVectorized = true;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// One group of 32 inputs: q = round-to-nearest-even(x / d) (cvtps under the default rounding mode).
inline void quantize_group(const float* x, int8_t* q, float* d_out, float* sum_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    sum = _mm256_add_ps(sum, v[i]);
  }
  const float d = hmax(amax) / 127.f, id = d ? 1.f / d : 0.f;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
  // The packs work per 128-bit lane: the dwords come out in the order 0 4 1 5 2 6 3 7.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d_out = d;
  *sum_out = hsum(sum);
}

// acc + per 32-bit lane the sum of its four u8 (u) x s8 (s) products.
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // vpmaddubsw's int16 pair sums saturate past 32767; |u| <= 127 here (|int8 code|, or int4), so they cannot.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}

// MR rows of x against one panel. The integer sums of a group run in C chains per half-panel
// (one row has two, low / high nibble or even / odd block, so that the dot products' latency
// overlaps), scaled into fp32 accumulators once per group.
template <int Bits, int MR>
inline void quant_panel_rows(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* codes,
                             const uint16_t* scales, int64_t shift, const float* bias, float* y, int64_t ys,
                             int64_t ncols) {
  constexpr int C = MR == 1 ? 2 : 1;
  const int64_t groups = k / kGroup;
  const int8_t* qx = xq.qx.data() + row0 * k;
  const float* dx = xq.dx.data() + row0 * groups;
  const float* xsum = xq.sum.data() + row0 * groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc_lo[MR], acc_hi[MR];
  for (int r = 0; r < MR; ++r) acc_lo[r] = acc_hi[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t g0 = g * kGroup;
    __m256i s_lo[C][MR], s_hi[C][MR];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < MR; ++r) s_lo[c][r] = s_hi[c][r] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const uint8_t* cb = codes + (g0 / 8 + b) * kBlockBytes;
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb + 32));
        const __m256i a0 = _mm256_and_si256(v0, nibble), b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        const __m256i a1 = _mm256_and_si256(v1, nibble), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i xa = broadcast4(qx + r * k + g0 + 8 * b), xb = broadcast4(qx + r * k + g0 + 8 * b + 4);
          s_lo[0][r] = dot4(s_lo[0][r], a0, xa);
          s_lo[C - 1][r] = dot4(s_lo[C - 1][r], b0, xb);
          s_hi[0][r] = dot4(s_hi[0][r], a1, xa);
          s_hi[C - 1][r] = dot4(s_hi[C - 1][r], b1, xb);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const uint8_t* cb = codes + (g0 / 4 + b) * kBlockBytes;
        const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb));
        const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb + 32));
        const __m256i u0 = _mm256_abs_epi8(v0), u1 = _mm256_abs_epi8(v1);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m256i xr = broadcast4(qx + r * k + g0 + 4 * b);
          s_lo[b % C][r] = dot4(s_lo[b % C][r], u0, _mm256_sign_epi8(xr, v0));
          s_hi[b % C][r] = dot4(s_hi[b % C][r], u1, _mm256_sign_epi8(xr, v1));
        }
      }
    }
    if constexpr (C == 2) {
      for (int r = 0; r < MR; ++r) {
        s_lo[0][r] = _mm256_add_epi32(s_lo[0][r], s_lo[1][r]);
        s_hi[0][r] = _mm256_add_epi32(s_hi[0][r], s_hi[1][r]);
      }
    }
    const uint16_t* sc = scales + (g >> shift) * 2 * kPanel;
    const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8)));
    for (int r = 0; r < MR; ++r) {
      const __m256 dxr = _mm256_set1_ps(dx[r * groups + g]);
      acc_lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_lo, dxr), _mm256_cvtepi32_ps(s_lo[0][r]), acc_lo[r]);
      acc_hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_hi, dxr), _mm256_cvtepi32_ps(s_hi[0][r]), acc_hi[r]);
    }
    if constexpr (Bits == 4) {
      const __m256 m_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kPanel)));
      const __m256 m_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kPanel + 8)));
      for (int r = 0; r < MR; ++r) {
        const __m256 sr = _mm256_set1_ps(xsum[r * groups + g]);
        acc_lo[r] = _mm256_fmadd_ps(m_lo, sr, acc_lo[r]);
        acc_hi[r] = _mm256_fmadd_ps(m_hi, sr, acc_hi[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float t[kPanel];
    _mm256_store_ps(t, acc_lo[r]);
    _mm256_store_ps(t + 8, acc_hi[r]);
    for (int64_t c = 0; c < ncols; ++c) y[r * ys + c] = t[c] + (bias ? bias[c] : 0.f);
  }
}
#else
constexpr bool kQuantVectorized = false;

inline void quantize_group(const float* x, int8_t* q, float* d_out, float* sum_out) {
  float amax = 0.f, sum = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    sum += x[i];
  }
  const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
  for (int64_t i = 0; i < kGroup; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
  *d_out = d;
  *sum_out = sum;
}

template <int Bits, int MR>
inline void quant_panel_rows(const QuantizedRows& xq, int64_t row0, int64_t k, const uint8_t* codes,
                             const uint16_t* scales, int64_t shift, const float* bias, float* y, int64_t ys,
                             int64_t ncols) {
  const int64_t groups = k / kGroup;
  for (int r = 0; r < MR; ++r) {
    const int8_t* qx = xq.qx.data() + (row0 + r) * k;
    for (int64_t c = 0; c < ncols; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) dot += code_at(codes, Bits, c, i) * qx[i];
        const uint16_t* sc = scales + (g >> shift) * 2 * kPanel;
        const int64_t at = (row0 + r) * groups + g;
        acc += half_value(sc[c]) * xq.dx[at] * static_cast<float>(dot) + half_value(sc[kPanel + c]) * xq.sum[at];
      }
      y[r * ys + c] = acc + (bias ? bias[c] : 0.f);
    }
  }
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t xs, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedRows out{std::vector<int8_t>(static_cast<size_t>(m * k)), std::vector<float>(static_cast<size_t>(m * groups)),
                    std::vector<float>(static_cast<size_t>(m * groups))};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g)
        quantize_group(x + r * xs + g * kGroup, out.qx.data() + r * k + g * kGroup, &out.dx[r * groups + g],
                       &out.sum[r * groups + g]);
  });
  return out;
}

at::Tensor quant_panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                              int64_t bits, const std::optional<at::Tensor>& bias) {
  check_rows(x, "x", at::kFloat);
  const int64_t m = x.size(0), k = x.size(1), panels = codes.size(0), blocks = codes.size(1);
  const int64_t weight_inputs = codes_inputs(codes, bits);
  TORCH_CHECK(weight_inputs == k, "x has ", k, " features, the weight ", weight_inputs);
  const int64_t shift = scale_shift(scales, panels, k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n, "bias must be fp32 [n]");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), x.stride(0), m, k);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const int64_t scale_count = ((k / kGroup) >> shift) * 2 * kPanel;
  auto run = [&](auto bits_tag) {
    constexpr int B = decltype(bits_tag)::value;
    at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* c = cp + p * blocks * kBlockBytes;
        const uint16_t* sc = qp + p * scale_count;
        const int64_t c0 = p * kPanel, ncols = std::min<int64_t>(kPanel, n - c0);
        const float* b = bp ? bp + c0 : nullptr;
        int64_t r = 0;
        for (; r + 2 <= m; r += 2) quant_panel_rows<B, 2>(xq, r, k, c, sc, shift, b, yp + r * n + c0, n, ncols);
        if (r < m) quant_panel_rows<B, 1>(xq, r, k, c, sc, shift, b, yp + r * n + c0, n, ncols);
      }
    });
  };
  if (bits == 8) {
    run(std::integral_constant<int, 8>{});
  } else {
    run(std::integral_constant<int, 4>{});
  }
  return y;
}

bool quant_linear_vectorized() { return kQuantVectorized; }

// Logit i of a row as fp32 (bf16 widens exactly: its bits are the top half of the fp32's).
inline float logit_at(const float* x, int64_t i) { return x[i]; }
inline float logit_at(const uint16_t* x, int64_t i) {
  const uint32_t bits = uint32_t(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// [B, V] fp32 or bf16 -> [B] int64: the index of each row's first maximum, as torch.argmax (a NaN
// counts as the maximum). torch's CPU argmax tracks an index per element and ran at ~0.75 ns per
// logit (2 ms per step for 64 x 49,152); here a vectorised max over blocks, then a scan of the first
// block that holds it. bf16 rows are read as they are: widening to fp32 is exact, so the argmax is
// the fp32 one, without the [B, V] fp32 copy (~0.5 ms at 64 x 49,152).
template <typename T>
void argmax_rows_impl(const T* base, int64_t rows, int64_t vocab, int64_t stride, int64_t* idx) {
  constexpr int64_t kBlock = 256;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      const T* x = base + r * stride;
      int nan = 0;
      for (int64_t b = 0; b * kBlock < vocab; ++b) {
        const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = lo; i < hi; ++i) {
          const float v = logit_at(x, i);
          m = v > m ? v : m;
          nan |= v != v;
        }
        block_max[b] = m;
      }
      int64_t found = 0;
      if (nan) {
        while (logit_at(x, found) == logit_at(x, found)) ++found;
      } else {
        const float m = *std::max_element(block_max.begin(), block_max.end());
        int64_t b = 0;
        while (block_max[b] != m) ++b;
        found = b * kBlock;
        while (logit_at(x, found) != m) ++found;
      }
      idx[r] = found;
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "logits must be CPU float32 or bfloat16");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [rows, vocab] with a contiguous last dim");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(vocab > 0, "empty vocabulary");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat) {
    argmax_rows_impl(logits.data_ptr<float>(), rows, vocab, stride, out.data_ptr<int64_t>());
  } else {
    argmax_rows_impl(reinterpret_cast<const uint16_t*>(logits.data_ptr<bf16>()), rows, vocab, stride,
                     out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine fused bf16/fp32 element-wise ops (CPU)";
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("pack_panels", &pack_panels, py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear", &panel_linear, py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear_vectorized", &panel_linear_vectorized);
  m.def("quantize_panels", &quantize_panels, py::arg("w"), py::arg("bits"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_panels", &dequantize_panels, py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bits"));
  m.def("quant_panel_linear", &quant_panel_linear, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"),
        py::arg("bits"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_vectorized", &quant_linear_vectorized);
}
