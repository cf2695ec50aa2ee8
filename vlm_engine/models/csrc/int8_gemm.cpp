// Prefill-sized products of the weight-only int8 / int4 panels (fused_ops.cpp's quantize_panels:
// Q8_0 / Q4_1 codes in groups of 32 inputs, fp16 scales, panels of 16 output columns) on the CPU's
// int8 dot products: y[M, N] = x[M, K] W^T (+ bias), fp32 or bf16 in and out (fp32 sums).
//
// Why a second kernel: fused_ops' quant_panel_linear is built for decode (1-2 rows a tile, 8
// columns a 256-bit vector): at M in the hundreds every weight vector it loads feeds 2 rows, and
// each int8 dot product costs a sign fix-up of x, so prefill ran below the bf16 linears and the int8
// model lost to the bf16 one at batch 8 (2.10 vs 3.17 requests/s, the bench Qwen2-VL). Here a tile
// is MR rows x NV vectors of columns with the group's integer sums in registers; a weight vector
// loaded once feeds MR rows, and a row's 4 inputs (one broadcast) feed NV vectors.
//
// The numbers are those of quant_panel_linear, bit for bit: x is quantized per row and group of 32
// exactly as there (qx = round-half-even(x / dx), dx = max|x| / 127, the fp32 sum of x in the same
// order), every group's integer sum is exact, and the fp32 steps per output are the same ones in the
// same order (acc = fma(d * dx, float(sum), acc); int4: acc = fma(m, sum x, acc); y = acc + bias).
//
// The integer sums: vpdpbusd multiplies u8 by s8. int4 codes are 0..15 (u8) and meet qx (s8)
// directly. int8 codes are signed: the VNNI paths feed them as u8 = q + 128 (one xor per weight
// vector, shared by MR rows) and start each group's sum at -128 * sum(qx) (computed once per row and
// group), where fused_ops moves q's sign onto x for every row. AVX2 without VNNI (vpmaddubsw, whose
// int16 pair sums saturate: 2 * 255 * 127 does not fit) keeps that sign fix-up, |q| <= 128.
//
// Paths (`impl`): 1 AVX-512 VNNI (16 columns a vector, a panel's 64-byte block is one vector),
// 2 256-bit VNNI (AVX-VNNI or AVX-512 VL), 3 AVX2 vpmaddubsw (Zen 3, or VLM_ENGINE_ISA=avx2);
// 0 picks the first this build has. A path the build lacks falls back to the next one down.

#include <torch/extension.h>

#include "panel_scales.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VLM_INT8_AVX2 1
#else
#define VLM_INT8_AVX2 0
#endif
#if VLM_INT8_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VLM_INT8_ZMM 1
#else
#define VLM_INT8_ZMM 0
#endif
#if VLM_INT8_ZMM && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define VLM_INT8_BF16 1
#else
#define VLM_INT8_BF16 0
#endif
#if VLM_INT8_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define VLM_INT8_YMM_VNNI 1
#else
#define VLM_INT8_YMM_VNNI 0
#endif

namespace {

constexpr int64_t kPanel = 16;       // output columns per panel
constexpr int64_t kGroup = 32;       // inputs per group of x's scales; weights: 32 << Problem::scale_shift
constexpr int64_t kBlockBytes = 64;  // one panel block: 16 columns x 4 int8 inputs, or x 8 int4 inputs
// Cache blocking (see run): chunks of at most kRowChunk rows and kRowChunkBytes of codes of x (L2,
// spilling to L3 at wide inputs), blocks of kWeightBlockBytes of one strip's codes (L1; without them
// each row tile fetched its weights from L2). Every chunk streams all the weights from memory once:
// with 384 KiB of x a chunk, Qwen2.5-VL-7B's 18944-input down projection took 20-row chunks, 22
// passes over its 68 MB at 430 rows, 75-84 ms int8 (2 threads, 2-core Zen 5); with 2.5 MiB, 128-row
// chunks and x read from L3, 53-55 ms, the other layers unchanged within the noise.
constexpr int64_t kRowChunk = 128, kRowChunkBytes = 2560 << 10, kWeightBlockBytes = 16 << 10;

#if VLM_INT8_AVX2

// x per row and group of 32, as fused_ops' quantize_rows: codes [m][k]; scale, exact sum of x and
// -128 * sum of the codes [m][k/32].
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> offset;
};

float lanes_max(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The order of fused_ops' sum: lanes j and j+4, then those pairs' j and j+2, then the last two.
float lanes_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// 8 inputs as fp32: fp32 as they are, bf16 widened (exactly).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <class T>
void quantize_group(const T* x, int8_t* q, float* d, float* sum, int32_t* offset) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 part = _mm256_setzero_ps(), amax = _mm256_setzero_ps();
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    part = _mm256_add_ps(part, v[i]);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  const float scale = lanes_max(amax) / 127.f, inverse = scale ? 1.f / scale : 0.f;
  int32_t codes_sum = 0;
  for (int i = 0; i < 4; ++i) {
    // cvtps rounds half to even (the default rounding mode); |x / scale| <= 127 needs no clamp.
    alignas(32) int32_t r[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(r),
                       _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse))));
    for (int j = 0; j < 8; ++j) {
      q[8 * i + j] = static_cast<int8_t>(std::clamp(r[j], -128, 127));
      codes_sum += q[8 * i + j];
    }
  }
  *d = scale;
  *sum = lanes_sum(part);
  *offset = -128 * codes_sum;
}

template <class T>
Rows quantize_rows(const T* x, int64_t xs, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  const auto cells = static_cast<size_t>(m * groups);
  Rows out{std::vector<int8_t>(static_cast<size_t>(m * k)), std::vector<float>(cells), std::vector<float>(cells),
           std::vector<int32_t>(cells)};
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = r * groups + g;
        quantize_group(x + r * xs + g * kGroup, out.q.data() + r * k + g * kGroup, &out.d[at], &out.sum[at],
                       &out.offset[at]);
      }
  });
  return out;
}

inline int32_t load4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

#if VLM_INT8_ZMM
struct Zmm {
  using I = __m512i;
  using F = __m512;
  // int8: 6 rows, 12 integer sums + 12 fp32 sums + 2 weight vectors + x in 32 zmm. 4 rows (8 chains)
  // left vpdpbusd waiting on its latency: 1 thread, Zen 5, warm, GFLOP/s at 16 / 256 rows (ranges over
  // 4 runs), 3072x576 485 -> 502-522 / 331 -> 339-392, 576x1536 394 -> 404-414 / 395 -> 410-465. int4
  // (two nibble vectors per weight vector) keeps 4: at 6, 3072x576 at 256 rows measured 548 -> 479.
  static constexpr int kCols = 16, kMR8 = 6, kMR4 = 4, kNV = 2;
  static constexpr bool kBiased = true;  // int8 codes enter the dot product as q + 128
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I low4(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static I high4(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
  static I unsigned8(I w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static I dot8(I acc, I u, I, I x) { return dot(acc, u, x); }
  // acc + u times the 4 s8 codes at x4 broadcast to every lane.
  // (vpdpbusd's own {1to16} memory broadcast, forced by inline asm, measured no faster.)
  static I dot_at(I acc, I u, const int8_t* x4) { return dot(acc, u, set1(load4(x4))); }
  static F cvt(I s) { return _mm512_cvtepi32_ps(s); }
  static F halves(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// 256-bit vectors, 8 columns (half a panel); Vnni: vpdpbusd, else vpmaddubsw + vpmaddwd.
template <bool Vnni>
struct Ymm {
  using I = __m256i;
  using F = __m256;
  static constexpr int kCols = 8, kMR8 = 4, kMR4 = 4, kNV = 2;
  static constexpr bool kBiased = Vnni;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I dot(I acc, I u, I s) {
    if constexpr (Vnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
      return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
    }
    // The int16 pair sums stay below 32767 with u <= 128 and |s| <= 127.
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I low4(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static I high4(I w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
  static I unsigned8(I w) {
    return Vnni ? _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))) : _mm256_abs_epi8(w);
  }
  static I dot8(I acc, I u, I w, I x) { return Vnni ? dot(acc, u, x) : dot(acc, u, _mm256_sign_epi8(x, w)); }
  static I dot_at(I acc, I u, const int8_t* x4) { return dot(acc, u, set1(load4(x4))); }
  static F cvt(I s) { return _mm256_cvtepi32_ps(s); }
  static F halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// The next strip's codes and scales, prefetched a few lines a group over the whole of the current
// strip's work (every row tile of the chunk; Bresenham, as bf16_dot_gemm's PrefetchStream), so that
// the memory stream runs beside the dot products: at decode batches every linear's codes come from
// memory, and without it the tiles waited for them. 1 thread on the 2-core Zen 5, weights cycling
// through memory, 16 rows, us, before / after / the bf16 dot kernel: 3072x576 210 / 125-165 / 155-170,
// the 49,152x576 LM head 3,000-3,600 / 2,100-2,800 / 2,300-2,600; 4 rows 100-120 / 60-90 / 105-130
// (a shared machine: ranges over runs). Into L1 (T0): into L2 (T1) measured slower at K = 576, 1,536
// and 8,960 alike, though a strip of 8,960 inputs (280 KiB) outgrows L1.
struct NextStrip {
  const char* codes = nullptr;
  int64_t code_lines = 0;
  const char* scales = nullptr;
  int64_t scale_lines = 0;
  int64_t lines = 0;  // code_lines + scale_lines at the start
  int64_t iters = 1;  // group steps of the current strip's work
  int64_t credit = 0;

  inline void step() {
    credit += lines;
    while (credit >= iters && (code_lines > 0 || scale_lines > 0)) {
      const char*& at = code_lines > 0 ? codes : scales;
      _mm_prefetch(at, _MM_HINT_T0);
      at += 64;
      --(code_lines > 0 ? code_lines : scale_lines);
      credit -= iters;
    }
  }
};

// One product's operands: x's rows, the weights, where the output goes.
struct Problem {
  const Rows* x;
  int64_t k, n, groups, panel_bytes, panel_scales;
  int64_t scale_shift;  // groups of 32 inputs that share one weight (d, m): 1 << scale_shift (fused_ops' layout)
  const uint8_t* codes;
  const uint16_t* scales;
  const float* bias;
  float* y;              // fp32 rows: the sums (the partial ones between blocks of inputs); null for bf16 rows
  at::BFloat16* y16;     // bf16 rows: the last block writes its sums here, rounded (partial ones: `Sums`)
};

// Where a tile keeps its partial sums between blocks of inputs: y itself for fp32 rows; for bf16 rows a
// thread's scratch of one chunk x strip (rows x strip columns), so that no fp32 [M, N] is ever allocated
// (at a 2048-token prefill, Qwen2.5-VL-7B's gate/up projection's would be 310 MB on top of its 155 MB output).
struct Sums {
  float* at;       // row `row0`, column `col0` of the tile asking
  int64_t stride;  // floats from one row to the next
};

// MR rows from row0 x NV vectors from column col0 (a vector never crosses a panel), groups g0..g1-1.
// The first block of groups starts from 0, the others from the sums y holds; the last adds the bias.
// `ahead`: the bytes from this block's codes to those the next block reads, which the tile prefetches
// (the first row tile of a block does, spread over its groups, so that they come in while it computes).
template <class V, int Bits, int MR, int NV>
void tile(const Problem& p, int64_t row0, int64_t col0, int64_t g0, int64_t g1, int64_t ahead, NextStrip& next,
          Sums sums) {
  using I = typename V::I;
  using F = typename V::F;
  const int64_t k = p.k, groups = p.groups;
  const uint8_t* cp[NV];
  const uint16_t* sp[NV];
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col0 + v * V::kCols;
    cp[v] = p.codes + (c / kPanel) * p.panel_bytes + (c % kPanel) * 4;
    sp[v] = p.scales + (c / kPanel) * p.panel_scales + c % kPanel;
  }
  const int8_t* xq = p.x->q.data() + row0 * k;
  const float* dx = p.x->d.data() + row0 * groups;
  const float* xsum = p.x->sum.data() + row0 * groups;
  const int32_t* offset = p.x->offset.data() + row0 * groups;
  const bool first = g0 == 0, last = g1 == groups;
  int64_t cols[NV];
  F acc[MR][NV];
  for (int v = 0; v < NV; ++v) {
    cols[v] = std::clamp<int64_t>(p.n - col0 - v * V::kCols, 0, V::kCols);
    for (int r = 0; r < MR; ++r) {
      const float* at = sums.at + r * sums.stride + v * V::kCols;
      if (first || cols[v] == 0) {
        acc[r][v] = V::zerof();
      } else if (cols[v] == V::kCols) {
        acc[r][v] = V::loadf(at);
      } else {
        alignas(64) float t[16] = {};
        std::copy(at, at + cols[v], t);
        acc[r][v] = V::loadf(t);
      }
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    I s[MR][NV];
    for (int r = 0; r < MR; ++r) {
      const I start = (Bits == 8 && V::kBiased) ? V::set1(offset[r * groups + g]) : V::zero();
      for (int v = 0; v < NV; ++v) s[r][v] = start;
    }
    const int8_t* xg = xq + g * kGroup;
    if (ahead) {
      constexpr int64_t group_bytes = kGroup * Bits / 8 * kPanel;  // one group of one panel's codes
      for (int v = 0; v < NV; ++v)
        if ((v * V::kCols) % kPanel == 0)
          for (int64_t line = 0; line < group_bytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(cp[v] + ahead + g * group_bytes + line), _MM_HINT_T0);
    }
    if constexpr (Bits == 8) {
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const int64_t at = (g * 8 + b) * kBlockBytes;
        I w[NV], u[NV];
        for (int v = 0; v < NV; ++v) {
          w[v] = V::load(cp[v] + at);
          u[v] = V::unsigned8(w[v]);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = xg + r * k + 4 * b;
          if constexpr (V::kBiased) {
            for (int v = 0; v < NV; ++v) s[r][v] = V::dot_at(s[r][v], u[v], xr);
          } else {
            const I x4 = V::set1(load4(xr));
            for (int v = 0; v < NV; ++v) s[r][v] = V::dot8(s[r][v], u[v], w[v], x4);
          }
        }
      }
    } else {
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const int64_t at = (g * 4 + b) * kBlockBytes;
        I lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          const I w = V::load(cp[v] + at);
          lo[v] = V::low4(w);
          hi[v] = V::high4(w);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = xg + r * k + 8 * b;
          for (int v = 0; v < NV; ++v) s[r][v] = V::dot_at(V::dot_at(s[r][v], lo[v], xr), hi[v], xr + 4);
        }
      }
    }
    next.step();
    F d[NV];
    const int64_t sg = (g >> p.scale_shift) * 2 * kPanel;
    for (int v = 0; v < NV; ++v) d[v] = V::halves(sp[v] + sg);
    for (int r = 0; r < MR; ++r) {
      const F dxr = V::set1f(dx[r * groups + g]);
      for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(V::mul(d[v], dxr), V::cvt(s[r][v]), acc[r][v]);
    }
    if constexpr (Bits == 4) {
      for (int v = 0; v < NV; ++v) d[v] = V::halves(sp[v] + sg + kPanel);  // the minima
      for (int r = 0; r < MR; ++r) {
        const F sr = V::set1f(xsum[r * groups + g]);
        for (int v = 0; v < NV; ++v) acc[r][v] = V::fma(d[v], sr, acc[r][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c = col0 + v * V::kCols;
    const float* bias = last && p.bias ? p.bias + c : nullptr;
    for (int r = 0; r < MR; ++r) {
      if (last && p.y16) {  // nearest even, as torch's .to(bfloat16): no pass over an fp32 y afterwards
        alignas(64) float t[16];
        V::storef(t, V::add(acc[r][v], cols[v] == V::kCols && bias ? V::loadf(bias) : V::zerof()));
        at::BFloat16* out = p.y16 + (row0 + r) * p.n + c;
        for (int64_t j = 0; j < cols[v]; ++j) out[j] = at::BFloat16(cols[v] == V::kCols || !bias ? t[j] : t[j] + bias[j]);
        continue;
      }
      float* out = sums.at + r * sums.stride + v * V::kCols;
      if (cols[v] == V::kCols) {
        V::storef(out, last ? V::add(acc[r][v], bias ? V::loadf(bias) : V::zerof()) : acc[r][v]);
      } else {
        alignas(64) float t[16];
        V::storef(t, acc[r][v]);
        for (int64_t j = 0; j < cols[v]; ++j) out[j] = last ? t[j] + (bias ? bias[j] : 0.f) : t[j];
      }
    }
  }
}

// tile<V, Bits, mr, nv> for 1 <= mr <= MR, 1 <= nv <= NV.
template <class V, int Bits, int MR, int NV>
void tile_of(int mr, int nv, const Problem& p, int64_t row0, int64_t col0, int64_t g0, int64_t g1, int64_t ahead,
             NextStrip& next, Sums sums) {
  if constexpr (MR > 1) {
    if (mr < MR) return tile_of<V, Bits, MR - 1, NV>(mr, nv, p, row0, col0, g0, g1, ahead, next, sums);
  }
  if constexpr (NV > 1) {
    if (nv < NV) return tile_of<V, Bits, MR, NV - 1>(mr, nv, p, row0, col0, g0, g1, ahead, next, sums);
  }
  tile<V, Bits, MR, NV>(p, row0, col0, g0, g1, ahead, next, sums);
}

// Threads take strips of NV vectors of columns from a shared counter, for each chunk of x's rows
// whose codes stay in L2, and walk each strip's inputs in blocks (kWeightBlockBytes of codes) that
// stay in L1 while every row tile of the chunk passes them; the chunk x strip sums between blocks
// stay in L1 as well (walking all strips per block instead sent them through L3 once y outgrew L2:
// -20% at 1024 rows). The counter, not a static split: in a VM the two cores do not run at the same
// speed from one product to the next, and the bf16 dot kernel, which lets the faster one take the
// other's share, lost less to it in the server. Every output is still one thread's same chain.
template <class V, int Bits>
void run(const Problem& p, int64_t m) {
  constexpr int MR = Bits == 8 ? V::kMR8 : V::kMR4;  // rows a tile
  constexpr int64_t strip_cols = V::kNV * V::kCols;
  constexpr int64_t group_bytes = kGroup * Bits / 8 * kPanel;  // one group of one panel's codes
  const int64_t strips = (p.n + strip_cols - 1) / strip_cols, strip_bytes = strip_cols / kPanel * p.panel_bytes;
  const int64_t rows = std::clamp<int64_t>(kRowChunkBytes / p.k / MR * MR, MR, kRowChunk);
  const int64_t block_groups = std::max<int64_t>(1, kWeightBlockBytes / (strip_cols / kPanel * group_bytes));
  const int64_t panels = (p.n + kPanel - 1) / kPanel, strip_panels = std::max<int64_t>(1, strip_cols / kPanel);
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), strips);
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    std::atomic<int64_t> counter{0};
    auto work = [&](int64_t, int64_t) {
      std::vector<float> scratch(p.y ? 0 : (r1 - r0) * strip_cols);
      int64_t s = counter.fetch_add(1);
      while (s < strips) {
        const int64_t after = counter.fetch_add(1);  // taken now, so that its codes can come in meanwhile
        const int64_t col0 = s * strip_cols;
        const int nv = static_cast<int>(std::min<int64_t>(V::kNV, (p.n - col0 + V::kCols - 1) / V::kCols));
        NextStrip next;
        if (after < strips) {
          const int64_t p0 = after * strip_cols / kPanel, np = std::min(strip_panels, panels - p0);
          next.codes = reinterpret_cast<const char*>(p.codes + p0 * p.panel_bytes);
          next.code_lines = np * p.panel_bytes / 64;
          next.scales = reinterpret_cast<const char*>(p.scales + p0 * p.panel_scales);
          next.scale_lines = np * p.panel_scales * 2 / 64;
          next.lines = next.code_lines + next.scale_lines;
          next.iters = (r1 - r0 + MR - 1) / MR * p.groups;
        }
        for (int64_t g0 = 0; g0 < p.groups; g0 += block_groups) {
          const int64_t g1 = std::min(p.groups, g0 + block_groups);
          // What the next block reads: this strip's next inputs, or the next strip's first ones.
          const int64_t ahead =
              g1 < p.groups ? (g1 - g0) * group_bytes : (after < strips ? (after - s) * strip_bytes - g0 * group_bytes : 0);
          for (int64_t r = r0; r < r1; r += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, r1 - r));
            const Sums sums = p.y ? Sums{p.y + r * p.n + col0, p.n} : Sums{scratch.data() + (r - r0) * strip_cols, strip_cols};
            tile_of<V, Bits, MR, V::kNV>(mr, nv, p, r, col0, g0, g1, r == r0 ? ahead : 0, next, sums);
          }
        }
        s = after;
      }
    };
    if (threads > 1)
      at::parallel_for(0, threads, 1, work);
    else
      work(0, 1);
  }
}

template <class V>
void run_bits(const Problem& p, int64_t m, int64_t bits) {
  if (bits == 8) {
    run<V, 8>(p, m);
  } else {
    run<V, 4>(p, m);
  }
}
#endif  // VLM_INT8_AVX2

#if VLM_INT8_BF16
// Weight-only int8 with bf16 compute (`wo_gemm`): bf16 rows times the dequantized weights d * q
// rounded to bf16 (nearest even), on vdpbf16ps, fp32 sums, y rounded to bf16 once. x is not rounded
// to int8: against the exact int8 weights the error is the weights' bf16 rounding (<= 2^-9 of each
// |w|, as in a bf16 model of the same weights) where the VNNI path rounds each x to int8 (<= 1/254
// of its group's max |x|).
//
// Why: on the 2-core Zen 5 vpdpbusd issues at well under half vdpbf16ps's rate, so the VNNI GEMM
// above ran decoder products of 16-256 rows at ~0.75-0.9x the bf16 dot kernel (SmolLM2's linears,
// 1 thread); int8's only advantage there is half the weight bytes. A thread dequantizes one strip
// of columns (kWoNV panels, all of K) into a bf16 buffer of vdpbf16ps pairs (L1/L2: 96 bytes per
// input) once per chunk of rows, and every row tile of the chunk reads it from there, so the
// conversion (~20 instructions per 64 codes) is shared by all the rows; the next strip's codes and
// scales are prefetched over the current strip's tiles, and threads take strips from a shared
// counter (a VM's two cores do not run at the same speed). Keeping q exact and scaling each group's
// fp32 sum by d instead cost ~17% at 256 rows (3072x576, 1 thread: 373 vs 451 GFLOP/s): the
// per-group sums drain the 24 vdpbf16ps chains every 16 pairs.
constexpr int kWoMR = 8, kWoNV = 3;  // 24 sums + 3 weight vectors + x in 32 zmm, as the bf16 dot kernel
constexpr int64_t kWoRowChunk = 128;

// 64 codes (16 columns x 4 inputs, one panel block) times their columns' scales d as two vectors of
// bf16 pairs: inputs 0-1 and 2-3 of each column.
inline void dequantize_block(const uint8_t* codes, __m512 d, uint16_t* pair01, uint16_t* pair23) {
  const __m512i v = _mm512_loadu_si512(codes);
  const __m512 f0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)));
  const __m512 f1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)));
  const __m512 f2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)));
  const __m512 f3 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)));
  // vcvtne2ps2bf16 puts its second operand's 16 values in the low half: interleave them per column.
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(pair01, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
  _mm512_storeu_si512(pair23, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(f3, f2)));
}

// One strip's operands: the bf16 pairs [nv][k/2][16], x, y.
struct WoStrip {
  const uint16_t* pairs;
  const at::BFloat16* x;
  int64_t xs, k, n, col0;
  const float* bias;
  at::BFloat16* y;
};

// MR rows x NV panels over all of K, the sums in registers.
template <int MR, int NV>
void wo_tile(const WoStrip& s, int64_t row0, NextStrip& next) {
  const int64_t half_k = s.k / 2;
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const uint16_t*>(s.x + (row0 + r) * s.xs);
  for (int64_t g = 0; g < s.k / kGroup; ++g) {
#pragma GCC unroll 16
    for (int p = 0; p < kGroup / 2; ++p) {
      const int64_t pair = g * (kGroup / 2) + p;
      __m512bh w[NV];
      for (int v = 0; v < NV; ++v) {
        __m512i wv = _mm512_loadu_si512(s.pairs + (v * half_k + pair) * kPanel * 2);
        asm("" : "+v"(wv));  // held in a register for the MR rows: GCC otherwise reloads it for every row
        w[v] = (__m512bh)wv;
      }
      for (int r = 0; r < MR; ++r) {
        int32_t x2;
        std::memcpy(&x2, xr[r] + 2 * pair, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(x2);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
      }
    }
    next.step();
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c = s.col0 + v * kPanel, cols = std::min<int64_t>(kPanel, s.n - c);
    const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 b = s.bias ? _mm512_maskz_loadu_ps(keep, s.bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)  // vcvtneps2bf16: nearest even, as torch's .to(bfloat16)
      _mm256_mask_storeu_epi16(s.y + (row0 + r) * s.n + c, keep,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], b)));
  }
}

template <int MR, int NV>
void wo_tile_of(int mr, int nv, const WoStrip& s, int64_t row0, NextStrip& next) {
  if constexpr (MR > 1) {
    if (mr < MR) return wo_tile_of<MR - 1, NV>(mr, nv, s, row0, next);
  }
  if constexpr (NV > 1) {
    if (nv < NV) return wo_tile_of<MR, NV - 1>(mr, nv, s, row0, next);
  }
  wo_tile<MR, NV>(s, row0, next);
}

void wo_run(const at::BFloat16* x, int64_t xs, int64_t m, int64_t k, const uint8_t* codes, const uint16_t* scales,
            int64_t n, const float* bias, at::BFloat16* y) {
  const int64_t groups = k / kGroup, panel_bytes = k * kPanel, panel_scales = groups * 2 * kPanel;
  const int64_t panels = (n + kPanel - 1) / kPanel, strips = (panels + kWoNV - 1) / kWoNV;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), strips);
  for (int64_t r0 = 0; r0 < m; r0 += kWoRowChunk) {
    const int64_t r1 = std::min(m, r0 + kWoRowChunk), tiles = (r1 - r0 + kWoMR - 1) / kWoMR;
    std::atomic<int64_t> counter{0};
    auto work = [&](int64_t, int64_t) {
      // One buffer per thread for the life of the process (a fresh one per call cost its zeroing).
      static thread_local std::vector<uint16_t> buffer;
      buffer.resize(std::max(buffer.size(), static_cast<size_t>(kWoNV * k * kPanel) + 32));
      uint16_t* pairs = buffer.data() + (32 - reinterpret_cast<uintptr_t>(buffer.data()) / 2 % 32) % 32;  // 64-byte aligned
      int64_t s = counter.fetch_add(1);
      while (s < strips) {
        const int64_t after = counter.fetch_add(1);  // taken now, so that its codes can come in meanwhile
        const int64_t p0 = s * kWoNV, np = std::min<int64_t>(kWoNV, panels - p0);
        for (int64_t v = 0; v < np; ++v) {
          const uint8_t* c = codes + (p0 + v) * panel_bytes;
          const uint16_t* d = scales + (p0 + v) * panel_scales;
          uint16_t* out = pairs + v * k * kPanel;
          for (int64_t b = 0; b < k / 4; ++b) {
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b / 8 * 2 * kPanel)));
            dequantize_block(c + b * kBlockBytes, dv, out + 2 * b * 32, out + (2 * b + 1) * 32);
          }
        }
        NextStrip next;
        if (after < strips) {
          const int64_t q0 = after * kWoNV, nq = std::min<int64_t>(kWoNV, panels - q0);
          next.codes = reinterpret_cast<const char*>(codes + q0 * panel_bytes);
          next.code_lines = nq * panel_bytes / 64;
          next.scales = reinterpret_cast<const char*>(scales + q0 * panel_scales);
          next.scale_lines = nq * panel_scales * 2 / 64;
          next.lines = next.code_lines + next.scale_lines;
          next.iters = tiles * groups;
        }
        const WoStrip strip{pairs, x, xs, k, n, p0 * kPanel, bias, y};
        for (int64_t r = r0; r < r1; r += kWoMR)
          wo_tile_of<kWoMR, kWoNV>(static_cast<int>(std::min<int64_t>(kWoMR, r1 - r)), static_cast<int>(np), strip, r, next);
        s = after;
      }
    };
    if (threads > 1)
      at::parallel_for(0, threads, 1, work);
    else
      work(0, 1);
  }
}
#endif  // VLM_INT8_BF16

enum Impl : int64_t { kAuto = 0, kZmmVnni = 1, kYmmVnni = 2, kYmmAvx2 = 3 };

std::vector<int64_t> impls() {
  std::vector<int64_t> out;
  if (VLM_INT8_ZMM) out.push_back(kZmmVnni);
  if (VLM_INT8_YMM_VNNI) out.push_back(kYmmVnni);
  if (VLM_INT8_AVX2) out.push_back(kYmmAvx2);
  return out;
}

// The path `impl` asks for, or the next one down that this build has.
int64_t resolve(int64_t impl) {
  TORCH_CHECK(impl >= kAuto && impl <= kYmmAvx2, "impl must be 0..3, got ", impl);
  for (int64_t have : impls())
    if (have >= impl) return have;
  return -1;
}

// log2 of the groups of 32 inputs that share one (d, m) in `scales` (panel_scales.h).
inline int64_t scale_shift(const at::Tensor& scales, int64_t panels, int64_t k) {
  return vlm_panels::scale_shift(scales, panels, k, kGroup, kPanel);
}

// The panels' checks for x with k features and n outputs (both products); the bias's data, or nullptr, and
// the scales' shift (scale_shift) in `shift`.
const float* checked_bias(const at::Tensor& codes, const at::Tensor& scales, int64_t k, int64_t n, int64_t bits,
                          const std::optional<at::Tensor>& bias, int64_t& shift) {
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == kBlockBytes, "codes must come from quantize_panels");
  const int64_t panels = codes.size(0);
  TORCH_CHECK(codes.size(1) * (bits == 8 ? 4 : 8) == k, "x has ", k, " features, the weight ", codes.size(1) * (bits == 8 ? 4 : 8));
  shift = scale_shift(scales, panels, k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n, "bias must be fp32 [n]");
    bp = bias->data_ptr<float>();
  }
  return bp;
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t bits,
                      const std::optional<at::Tensor>& bias, int64_t impl) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || bf16) && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU fp32 or bf16 [M, K] tensor with a contiguous last dim");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  int64_t shift = 0;
  const float* bp = checked_bias(codes, scales, k, n, bits, bias, shift);
  const int64_t path = resolve(impl);
  TORCH_CHECK(path > 0, "this build of the int8 GEMM has no AVX2 + FMA + F16C path");
  // The sums in fp32; bf16 rows get them rounded to bf16 once at the end (nearest even, as torch's
  // .to(bfloat16) of the decode kernel's fp32 output: the two stay equal bit for bit).
  at::Tensor y = bf16 ? at::Tensor() : at::empty({m, n}, x.options().dtype(at::kFloat));
  at::Tensor y16 = bf16 ? at::empty({m, n}, x.options()) : at::Tensor();
  if (m == 0) return bf16 ? y16 : y;
#if VLM_INT8_AVX2
  const Rows rows = bf16 ? quantize_rows(x.data_ptr<at::BFloat16>(), x.stride(0), m, k)
                         : quantize_rows(x.data_ptr<float>(), x.stride(0), m, k);
  const Problem p{&rows, k, n, groups, codes.size(1) * kBlockBytes, (groups >> shift) * 2 * kPanel, shift,
                  static_cast<const uint8_t*>(codes.data_ptr()), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                  bp, bf16 ? nullptr : y.data_ptr<float>(), bf16 ? y16.data_ptr<at::BFloat16>() : nullptr};
  switch (path) {
#if VLM_INT8_ZMM
    case kZmmVnni:
      run_bits<Zmm>(p, m, bits);
      break;
#endif
#if VLM_INT8_YMM_VNNI
    case kYmmVnni:
      run_bits<Ymm<true>>(p, m, bits);
      break;
#endif
    default:
      run_bits<Ymm<false>>(p, m, bits);
  }
#endif
  return bf16 ? y16 : y;
}

bool wo_available() { return VLM_INT8_BF16; }

// bf16 [M, K] rows times int8 panels on vdpbf16ps (see wo_run): bf16 [M, N].
at::Tensor wo_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU bf16 [M, K] tensor with a contiguous last dim");
  const int64_t m = x.size(0), k = x.size(1);
  int64_t shift = 0;
  const float* bp = checked_bias(codes, scales, k, n, 8, bias, shift);
  TORCH_CHECK(shift == 0, "wo_gemm takes one scale per 32 inputs");
  TORCH_CHECK(wo_available(), "this build of the int8 GEMM has no AVX-512 BF16 path");
  at::Tensor y = at::empty({m, n}, x.options());
#if VLM_INT8_BF16
  if (m > 0)
    wo_run(x.data_ptr<at::BFloat16>(), x.stride(0), m, k, static_cast<const uint8_t*>(codes.data_ptr()),
           reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), n, bp, y.data_ptr<at::BFloat16>());
#endif
  return y;
}

const char* impl_name(int64_t impl) {
  switch (impl) {
    case kZmmVnni:
      return "avx512-vnni";
    case kYmmVnni:
      return "avx-vnni-256";
    case kYmmAvx2:
      return "avx2-maddubs";
    default:
      return "none";
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine int8 / int4 GEMM on the int8 dot products (AVX-512 VNNI, AVX-VNNI, AVX2)";
  m.def("quant_gemm", &quant_gemm, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bits"),
        py::arg("bias") = py::none(), py::arg("impl") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("wo_gemm", &wo_gemm, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("wo_available", &wo_available, "whether this build has the weight-only bf16-compute path (AVX-512 BF16)");
  m.def("impls", &impls, "the paths this build has (1 AVX-512 VNNI, 2 256-bit VNNI, 3 AVX2)");
  m.def("impl_name", [](int64_t impl) { return std::string(impl_name(resolve(impl))); }, py::arg("impl") = 0,
        "the path `impl` runs in this build");
}
