// Flash attention for CPU over packed variable-length segments, the core shared by the flash op
// (flash_attention.cpp: keys in token rows, block-diagonal segments) and the paged op
// (paged_attention.cpp: a long prompt's queries, keys read from the paged cache through the block
// table, per-token key ends for bidirectional image spans). Causal is bottom-right aligned (query i
// of a segment with Lq queries and Lk keys sits at position i + Lk - Lq), window > 0 hides keys at or
// below position - window, kv_end (per query row) replaces the causal end; a query that sees no key
// gets zeros.
//
// Algorithm: K and V are first packed once per call (O(N D), parallel) into the layouts the
// micro-kernels read as GEMM operands: keys in groups of 16, K transposed ([D/2][16] pairs of bf16
// for vdpbf16ps, or [D][16] fp32), V as [key pairs][D] pairs (bf16) or [keys][D] (fp32), head_dim
// padded to a multiple of 16 with zeros, each segment's keys padded to a multiple of 16 with zeros.
// A work item is (segment, query head, block of up to kBQ queries). It walks its visible keys in
// blocks of kBK: S = Q K^T in panels of kMR query rows x up to 64 keys held in registers; an online
// softmax per row in the log2 domain (scores scaled by scale * log2(e), exp2 by a polynomial; the
// accumulator is rescaled lazily when the PV kernel loads it); O += P V in panels of kMR rows x up
// to 4 vectors of head_dim. bf16 on avx512_bf16: Q K^T and P V both on vdpbf16ps (P rounded to
// bf16 as flash-attention implementations do, row sums in fp32), the accumulators fp32. Elsewhere
// bf16 is widened to fp32 when packed and runs the fp32 FMA kernels (AVX-512 or AVX2). Items are
// scheduled longest first from an atomic counter on the ATen intra-op thread pool.
//
// Impl (for tests): 0 = best, 1 = portable C++ loops, 2 = AVX-512 FMA without vdpbf16ps, 3 = AVX2
// + FMA; an impl this build lacks falls back to the next one down. No AMX tile path: the machines
// this was written on have none.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd_common.h"

namespace vlm_flash {

using namespace vlm_simd;

constexpr int kGroup = 16;  // keys per packed group
constexpr int kBK = 64;     // keys per block (up to 4 groups)
constexpr int kBQ = 96;     // query rows per work item
constexpr int kMR = 6;      // query rows per register panel
constexpr int kLanes = 16;  // floats per row of running sums (the widest vector)

enum Impl : int64_t { kAuto = 0, kGeneric = 1, kAvx512 = 2, kAvx2 = 3 };

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Queries [q0, q0 + lq) of q / out; keys at positions [0, lk), query i at position i + lk - lq. Keys
// below k0 are never read (a window's pages that the pool may have reused): packing starts at k0.
// kbase: the token row of position 0 (contiguous keys) or the block-table row (paged keys).
struct Segment {
  int32_t q0, lq, lk, k0;
  int64_t kbase;
};

struct Problem {
  const char* q;
  const char* k;
  const char* v;
  char* out;
  int64_t q_st, q_sh, k_st, k_sh, v_st, v_sh, o_st, o_sh;  // strides in elements: token, head
  const Segment* seg;
  const int32_t* gstart;  // [nseg + 1] first packed key group of each segment
  const int32_t* kv_end;  // null, or per query row: the exclusive end of its keys (overrides causal)
  // Keys from a paged cache: position j of segment s in page bt[seg[s].kbase * bt_stride + j /
  // page_size], slot j % page_size (k_st / v_st are then the slot strides); null: token rows.
  const int32_t* bt;
  int64_t bt_stride, page_size, k_sp, v_sp;
  int64_t Hkv, G, D, Dp;  // Dp: head_dim padded to 16
  int64_t window;
  bool causal;
  float c;  // scale * log2(e)
  const void* kp;  // packed K: per KV head kp_head elements, per group kp_group
  const void* vp;
  int64_t kp_head, kp_group, vp_head, vp_group;
};

// Query rows [i0, i1) of segment s, query head h.
struct Item {
  int32_t s, h, i0, i1;
  int64_t cost;
};

// The packed keys [lo, hi) (positions minus k0) its segment's local query i sees.
inline void row_bounds(const Problem& P, int64_t s, int64_t i, int32_t* lo, int32_t* hi) {
  const Segment& sg = P.seg[s];
  const int64_t pos = i + sg.lk - sg.lq;
  int64_t h = P.kv_end != nullptr ? P.kv_end[sg.q0 + i] : P.causal ? std::min<int64_t>(pos + 1, sg.lk) : sg.lk;
  int64_t l = P.window > 0 ? std::max<int64_t>(pos - P.window + 1, 0) : 0;
  h = std::max<int64_t>(h - sg.k0, 0);
  l = std::max<int64_t>(l - sg.k0, 0);
  *lo = static_cast<int32_t>(std::min(l, h));
  *hi = static_cast<int32_t>(h);
}

// Per-thread working memory: thread_local and only growing (ATen's workers are persistent).
struct Scratch {
  float* q;  // kBQ * D: the item's queries (fp32, or bf16 pairs for vdpbf16ps)
  float* s;  // kBQ * kBK: raw scores of one key block
  float* p;  // kBQ * kBK: probabilities (fp32, or bf16 in the first half of each row)
  float* o;  // kBQ * Dp: unnormalised output
  float* m;  // kBQ: running max (scaled, log2 domain)
  float* l;  // kBQ * kLanes: running sum, per lane of the vector kernels (summed at the end)
  float* alpha;  // kBQ: this block's rescale of the row's accumulator
  int32_t* lo;
  int32_t* hi;

  Scratch(int64_t D, int64_t Dp) {
    thread_local std::vector<float> buf;
    thread_local std::vector<int32_t> ibuf;
    const size_t n = kBQ * D + 2 * kBQ * kBK + kBQ * Dp + (2 + kLanes) * kBQ + 64;
    if (buf.size() < n) buf.resize(n);
    if (ibuf.size() < 2 * kBQ) ibuf.resize(2 * kBQ);
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
    s = base;  // 64-byte aligned blocks first
    p = s + kBQ * kBK;
    o = p + kBQ * kBK;
    q = o + kBQ * Dp;
    m = q + kBQ * D;
    l = m + kBQ;
    alpha = l + kBQ * kLanes;
    lo = ibuf.data();
    hi = lo + kBQ;
  }
};

// Calls f(std::integral_constant<int, n>) for a runtime 1 <= n <= N (instantiates all of them).
template <int N, class F>
inline void with_n(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_n<N - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, N>{});
}

// The next of the near-equal chunks (at most most) that n vectors split into: 5 as 3 + 2, not
// 4 + 1, whose one-vector panel is bound by its broadcasts (head_dim 80 and 72).
inline int chunk(int n, int most) {
  const int parts = (n + most - 1) / most;
  return (n + parts - 1) / parts;
}

template <typename T>
inline const T* at_row(const char* base, int64_t st, int64_t sh, int64_t t, int64_t h) {
  return reinterpret_cast<const T*>(base) + t * st + h * sh;
}

// KV head kh's K (or V) row of packed key j of segment s.
template <typename T, bool kV>
inline const T* kv_row(const Problem& P, int64_t s, int64_t j, int64_t kh) {
  const Segment& sg = P.seg[s];
  const int64_t pos = sg.k0 + j;
  const char* base = kV ? P.v : P.k;
  const int64_t st = kV ? P.v_st : P.k_st, sh = kV ? P.v_sh : P.k_sh;
  if (P.bt == nullptr) return at_row<T>(base, st, sh, sg.kbase + pos, kh);
  const int64_t page = P.bt[sg.kbase * P.bt_stride + pos / P.page_size];
  return reinterpret_cast<const T*>(base) + page * (kV ? P.v_sp : P.k_sp) + (pos % P.page_size) * st + kh * sh;
}

// ---------------------------------------------------------------------------------------------
// Packing (once per call). Group g of KV head kh covers keys 16 * (g - gstart[s]) + [0, 16) of
// segment s; keys past the segment and dims past D are zeros (their probabilities are zero, and
// zero times a zero pad is never NaN).

#if VLM_AVX512
// r[i] <- column i of the 16 x 16 matrix of 32-bit words whose row j is r[j].
inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Now r[4i + c] holds, in 128-bit lane L, the words (row 4i..4i+3, column 4L + c).
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// vdpbf16ps operands: K as [D/2][16] 32-bit (d, d+1) pairs, V as [8 key pairs][Dp] 32-bit pairs.
inline void pack_group_pairs(const Problem& P, int64_t kh, int64_t s, int64_t g, uint32_t* kp, uint32_t* vp) {
  const int64_t lk = P.seg[s].lk - P.seg[s].k0;  // packed keys
  const int64_t j0 = (g - P.gstart[s]) * kGroup;
  const int64_t D = P.D, Dp = P.Dp, np = D / 2;
  const uint32_t* krow[kGroup];
  const uint16_t* vrow[kGroup];
  for (int jj = 0; jj < kGroup; ++jj) {
    const bool live = j0 + jj < lk;
    krow[jj] = live ? reinterpret_cast<const uint32_t*>(kv_row<bf16, false>(P, s, j0 + jj, kh)) : nullptr;
    vrow[jj] = live ? reinterpret_cast<const uint16_t*>(kv_row<bf16, true>(P, s, j0 + jj, kh)) : nullptr;
  }
#if VLM_AVX512
  // K: 16 x 16 transposes of 32-bit pairs; V: two rows' bf16 interleaved by vpermt2w. Scalar loops
  // here cost about as much as the attention itself on 64-token windows.
  for (int64_t p0 = 0; p0 < np; p0 += 16) {
    const __mmask16 mk = np - p0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (np - p0)) - 1u);
    __m512i r[16];
    for (int jj = 0; jj < kGroup; ++jj)
      r[jj] = krow[jj] ? _mm512_maskz_loadu_epi32(mk, krow[jj] + p0) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int64_t i = 0; i < std::min<int64_t>(16, np - p0); ++i)
      _mm512_storeu_si512(kp + (p0 + i) * kGroup, r[i]);
  }
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int pr = 0; pr < kGroup / 2; ++pr) {
    const uint16_t* a = vrow[2 * pr];
    const uint16_t* b = vrow[2 * pr + 1];
    uint32_t* dst = vp + pr * Dp;
    for (int64_t d0 = 0; d0 < Dp; d0 += 32) {
      const int64_t left = D - d0;
      const __mmask32 mv = left >= 32 ? __mmask32(0xFFFFFFFFu) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1u);
      const __m512i va = a ? _mm512_maskz_loadu_epi16(mv, a + d0) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(mv, b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(va, lo_idx, vb));
      if (d0 + 16 < Dp) _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
#else
  for (int64_t p = 0; p < np; ++p)
    for (int jj = 0; jj < kGroup; ++jj) kp[p * kGroup + jj] = krow[jj] ? krow[jj][p] : 0u;
  for (int pr = 0; pr < kGroup / 2; ++pr) {
    const uint16_t* a = vrow[2 * pr];
    const uint16_t* b = vrow[2 * pr + 1];
    uint32_t* dst = vp + pr * Dp;
    for (int64_t d = 0; d < D; ++d)
      dst[d] = (a ? uint32_t(a[d]) : 0u) | ((b ? uint32_t(b[d]) : 0u) << 16);
    for (int64_t d = D; d < Dp; ++d) dst[d] = 0u;
  }
#endif
}

// fp32 FMA operands: K as [D][16], V as [16][Dp] (bf16 widened here).
template <typename T>
inline void pack_group_f32(const Problem& P, int64_t kh, int64_t s, int64_t g, float* kp, float* vp) {
  const int64_t lk = P.seg[s].lk - P.seg[s].k0;  // packed keys
  const int64_t j0 = (g - P.gstart[s]) * kGroup;
  const int64_t D = P.D, Dp = P.Dp;
  for (int jj = 0; jj < kGroup; ++jj) {
    float* vd = vp + jj * Dp;
    if (j0 + jj < lk) {
      const T* kr = kv_row<T, false>(P, s, j0 + jj, kh);
      const T* vr = kv_row<T, true>(P, s, j0 + jj, kh);
      for (int64_t d = 0; d < D; ++d) kp[d * kGroup + jj] = to_f32(kr[d]);
      for (int64_t d = 0; d < D; ++d) vd[d] = to_f32(vr[d]);
      for (int64_t d = D; d < Dp; ++d) vd[d] = 0.f;
    } else {
      for (int64_t d = 0; d < D; ++d) kp[d * kGroup + jj] = 0.f;
      for (int64_t d = 0; d < Dp; ++d) vd[d] = 0.f;
    }
  }
}

// One row's online-softmax step over a key block of n (a multiple of 16) raw scores, the positions
// the row does not see already -inf. Writes the block's probabilities through Out::store (fp32 or
// bf16), the accumulator's rescale alpha, and updates the running max m and sum l.
template <class V, class Out>
inline void softmax_row(const float* s, int n, float c, float* m, float* l, float* alpha, float* prow) {
  using R = typename V::R;
  R vmax = V::set1(kNegInf);
  for (int j = 0; j < n; j += V::W) vmax = V::max(vmax, V::load(s + j));
  const float tmax = V::hmax(vmax);
  if (tmax == kNegInf) {  // nothing visible in this block
    *alpha = 1.f;
    for (int j = 0; j < n; j += V::W) Out::store(prow, j, V::zero());
    return;
  }
  const float mold = *m;
  const float mnew = std::max(mold, tmax * c);
  const float a = mold == kNegInf ? 0.f : std::exp2(mold - mnew);
  const R vc = V::set1(c), vm = V::set1(mnew);
  R vsum = V::zero();
  for (int j = 0; j < n; j += V::W) {
    const R p = V::exp2(V::fmsub(V::load(s + j), vc, vm));
    vsum = V::add(vsum, p);
    Out::store(prow, j, p);
  }
  *alpha = a;
  *m = mnew;
  // Lane-wise: a horizontal sum per row and block was a latency chain that showed in profiles.
  V::store(l, V::fmadd(V::load(l), V::set1(a), vsum));
}

template <class V>
struct OutF32 {
  static void store(float* row, int j, typename V::R p) { V::store(row + j, p); }
};

// ---------------------------------------------------------------------------------------------
// Per-item driver shared by all implementations. Arch provides the layout (kPairs), the query
// load, the score and P.V panels and the softmax of one row.

template <class Arch, typename T>
void run_item(const Problem& P, const Item& it, Scratch& S) {
  const int64_t s = it.s, h = it.h, kh = h / P.G;
  const int rows = it.i1 - it.i0;
  const int64_t D = P.D, Dp = P.Dp;
  const int64_t q0 = P.seg[s].q0 + it.i0;
  for (int r = 0; r < rows; ++r) row_bounds(P, s, it.i0 + r, S.lo + r, S.hi + r);
  Arch::load_q(P, q0, h, rows, S.q);
  for (int r = 0; r < rows; ++r) S.m[r] = kNegInf;
  std::memset(S.l, 0, sizeof(float) * rows * kLanes);
  std::memset(S.o, 0, sizeof(float) * rows * Dp);
  // The item's keys: [lowest lo, highest hi) (without kv_end, lo[0] and hi[rows - 1]).
  int32_t jlo = S.lo[0], jhi = S.hi[rows - 1];
  for (int r = 0; r < rows; ++r) {
    jlo = std::min(jlo, S.lo[r]);
    jhi = std::max(jhi, S.hi[r]);
  }
  jlo &= ~(kGroup - 1);
  const int64_t g_seg = P.gstart[s];
  for (int32_t j0 = jlo; j0 < jhi; j0 += kBK) {
    const int n = static_cast<int>(round_up(std::min<int32_t>(kBK, jhi - j0), kGroup));
    const int64_t g = g_seg + j0 / kGroup;
    Arch::scores(P, kh, g, n / kGroup, rows, S);
    for (int r = 0; r < rows; ++r) {
      float* sr = S.s + r * kBK;
      const int a = std::max(S.lo[r] - j0, 0), b = std::min(S.hi[r] - j0, n);
      if (a > 0 || b < n) {  // a boundary block for this row: hide what it does not see
        for (int j = 0; j < std::min(a, n); ++j) sr[j] = kNegInf;
        for (int j = std::max(b, 0); j < n; ++j) sr[j] = kNegInf;
      }
      Arch::softmax(sr, n, P.c, S.m + r, S.l + r * kLanes, S.alpha + r, S.p + r * kBK);
    }
    Arch::pv(P, kh, g, n / kGroup, rows, S);
  }
  for (int r = 0; r < rows; ++r) {
    T* o = reinterpret_cast<T*>(P.out) + (q0 + r) * P.o_st + h * P.o_sh;
    const float l = Arch::row_sum(S.l + r * kLanes);
    Arch::finish(S.o + r * Dp, l > 0.f ? 1.f / l : 0.f, o, D);
  }
}

// Query rows as fp32 [rows][D].
template <typename T>
inline void load_q_f32(const Problem& P, int64_t q0, int64_t h, int rows, float* dst) {
  for (int r = 0; r < rows; ++r) {
    const T* src = at_row<T>(P.q, P.q_st, P.q_sh, q0 + r, h);
    for (int64_t d = 0; d < P.D; ++d) dst[r * P.D + d] = to_f32(src[d]);
  }
}

// ---------------------------------------------------------------------------------------------
// Portable implementation: the same blocking in plain loops (gcc vectorises the inner ones).
template <typename T>
struct GenericArch {
  static constexpr bool kPairs = false;
  static void finish(const float* acc, float inv, T* out, int64_t D) {
    for (int64_t d = 0; d < D; ++d) store_f32(acc[d] * inv, out + d);
  }
  static float row_sum(const float* l) { return l[0]; }
  static void load_q(const Problem& P, int64_t q0, int64_t h, int rows, float* dst) {
    load_q_f32<T>(P, q0, h, rows, dst);
  }
  static void scores(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const float* kp = static_cast<const float*>(P.kp) + kh * P.kp_head + g * P.kp_group;
    for (int r = 0; r < rows; ++r) {
      const float* q = S.q + r * P.D;
      for (int gi = 0; gi < ng; ++gi) {
        float acc[kGroup] = {};
        const float* kg = kp + gi * P.kp_group;
        for (int64_t d = 0; d < P.D; ++d)
          for (int jj = 0; jj < kGroup; ++jj) acc[jj] += q[d] * kg[d * kGroup + jj];
        std::memcpy(S.s + r * kBK + gi * kGroup, acc, sizeof(acc));
      }
    }
  }
  static void softmax(const float* s, int n, float c, float* m, float* l, float* alpha, float* prow) {
    float tmax = kNegInf;
    for (int j = 0; j < n; ++j) tmax = std::max(tmax, s[j]);
    if (tmax == kNegInf) {
      *alpha = 1.f;
      std::fill(prow, prow + n, 0.f);
      return;
    }
    const float mnew = std::max(*m, tmax * c);
    const float a = *m == kNegInf ? 0.f : std::exp2(*m - mnew);
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      prow[j] = s[j] == kNegInf ? 0.f : std::exp2(s[j] * c - mnew);
      sum += prow[j];
    }
    *alpha = a;
    *m = mnew;
    *l = *l * a + sum;
  }
  static void pv(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const float* vp = static_cast<const float*>(P.vp) + kh * P.vp_head + g * P.vp_group;
    const int64_t Dp = P.Dp;
    for (int r = 0; r < rows; ++r) {
      float* o = S.o + r * Dp;
      const float a = S.alpha[r];
      for (int64_t d = 0; d < Dp; ++d) o[d] *= a;
      const float* pr = S.p + r * kBK;
      for (int j = 0; j < ng * kGroup; ++j) {
        const float p = pr[j];
        if (p == 0.f) continue;
        const float* vr = vp + j * Dp;
        for (int64_t d = 0; d < Dp; ++d) o[d] += p * vr[d];
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// fp32 FMA implementation over a vector type (AVX-512: 16 lanes, AVX2: 8 lanes).
//   scores: kMR rows x NV vectors of keys (AVX-512: up to 4 = a 64-key block; AVX2: 2 = one group).
//   pv:     kMR rows x DV vectors of head_dim (AVX-512: up to 4, AVX2: up to 2).

template <class V, int MR, int NV>
inline void s_panel_f32(const float* q, int64_t D, const float* kp, int64_t gstride, float* s) {
  using R = typename V::R;
  R acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = V::zero();
  const float* kv[NV];
  for (int v = 0; v < NV; ++v) kv[v] = kp + (v * V::W / kGroup) * gstride + (v * V::W) % kGroup;
  for (int64_t d = 0; d < D; ++d) {
    R b[NV];
    for (int v = 0; v < NV; ++v) b[v] = V::load(kv[v] + d * kGroup);
    for (int m = 0; m < MR; ++m) {
      const R a = V::set1(q[m * D + d]);
      for (int v = 0; v < NV; ++v) acc[m][v] = V::fmadd(a, b[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) V::store(s + m * kBK + v * V::W, acc[m][v]);
}

template <class V, int MR, int DV>
inline void pv_panel_f32(float* o, int64_t Dp, const float* alpha, const float* p, const float* vp, int nkeys) {
  using R = typename V::R;
  R acc[MR][DV];
  for (int m = 0; m < MR; ++m) {
    const R a = V::set1(alpha[m]);
    for (int v = 0; v < DV; ++v) acc[m][v] = V::mul(V::load(o + m * Dp + v * V::W), a);
  }
  for (int j = 0; j < nkeys; ++j) {
    R b[DV];
    for (int v = 0; v < DV; ++v) b[v] = V::load(vp + j * Dp + v * V::W);
    for (int m = 0; m < MR; ++m) {
      const R a = V::set1(p[m * kBK + j]);
      for (int v = 0; v < DV; ++v) acc[m][v] = V::fmadd(a, b[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < DV; ++v) V::store(o + m * Dp + v * V::W, acc[m][v]);
}

template <class V, typename T>
struct F32Arch {
  static constexpr bool kPairs = false;
  static void finish(const float* acc, float inv, T* out, int64_t D) { finish_row<V>(acc, inv, out, D); }
  static float row_sum(const float* l) { return V::hsum(V::load(l)); }
  static constexpr int kKeyVecs = V::W == 16 ? 4 : 2;  // key vectors per score panel
  static constexpr int kDimVecs = V::W == 16 ? 4 : 2;  // head_dim vectors per P.V panel
  static void load_q(const Problem& P, int64_t q0, int64_t h, int rows, float* dst) {
    load_q_f32<T>(P, q0, h, rows, dst);
  }
  static void scores(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const float* kp = static_cast<const float*>(P.kp) + kh * P.kp_head + g * P.kp_group;
    const int nvec = ng * kGroup / V::W;
    for (int r0 = 0; r0 < rows; r0 += kMR) {
      const int mr = std::min(kMR, rows - r0);
      for (int v0 = 0; v0 < nvec; v0 += kKeyVecs) {
        const int nv = std::min(kKeyVecs, nvec - v0);
        const float* kb = kp + (v0 * V::W / kGroup) * P.kp_group;
        float* sb = S.s + r0 * kBK + v0 * V::W;
        with_n<kMR>(mr, [&](auto MR) {
          with_n<kKeyVecs>(nv, [&](auto NV) {
            s_panel_f32<V, decltype(MR)::value, decltype(NV)::value>(S.q + r0 * P.D, P.D, kb, P.kp_group, sb);
          });
        });
      }
    }
  }
  static void softmax(const float* s, int n, float c, float* m, float* l, float* alpha, float* prow) {
    softmax_row<V, OutF32<V>>(s, n, c, m, l, alpha, prow);
  }
  static void pv(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const float* vp = static_cast<const float*>(P.vp) + kh * P.vp_head + g * P.vp_group;
    const int ndv = static_cast<int>(P.Dp / V::W);
    for (int r0 = 0; r0 < rows; r0 += kMR) {
      const int mr = std::min(kMR, rows - r0);
      for (int v0 = 0, dv; v0 < ndv; v0 += dv) {
        dv = chunk(ndv - v0, kDimVecs);
        with_n<kMR>(mr, [&](auto MR) {
          with_n<kDimVecs>(dv, [&](auto DV) {
            pv_panel_f32<V, decltype(MR)::value, decltype(DV)::value>(S.o + r0 * P.Dp + v0 * V::W, P.Dp,
                                                                      S.alpha + r0, S.p + r0 * kBK,
                                                                      vp + v0 * V::W, ng * kGroup);
          });
        });
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// bf16 on avx512_bf16: vdpbf16ps multiplies 32 bf16 pairs and adds the pair sums to 16 fp32 lanes.
// Q K^T: lanes = 16 keys, pair = 2 dims (K packed [D/2][16] pairs; Q's pair broadcast).
// P V: lanes = 16 dims, pair = 2 keys (V packed [key pairs][Dp]; P's row-major pair broadcast).
#if VLM_AVX512BF16
template <int MR, int NG>
inline void s_panel_dp(const uint32_t* q, int64_t np, const uint32_t* kp, int64_t gstride, float* s) {
  __m512 acc[MR][NG];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh b[NG];
    for (int g = 0; g < NG; ++g) b[g] = (__m512bh)_mm512_loadu_si512(kp + g * gstride + p * kGroup);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[m * np + p]));
      for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_dpbf16_ps(acc[m][g], a, b[g]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s + m * kBK + g * kGroup, acc[m][g]);
}

template <int MR, int DV>
inline void pv_panel_dp(float* o, int64_t Dp, const float* alpha, const uint32_t* p, const uint32_t* vp, int npairs) {
  __m512 acc[MR][DV];
  for (int m = 0; m < MR; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int v = 0; v < DV; ++v) acc[m][v] = _mm512_mul_ps(_mm512_loadu_ps(o + m * Dp + v * 16), a);
  }
  constexpr int kRowPairs = kBK / 2;  // 32-bit words per P row (its bf16 half)
  for (int j = 0; j < npairs; ++j) {
    __m512bh b[DV];
    for (int v = 0; v < DV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(vp + j * Dp + v * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[m * 2 * kRowPairs + j]));
      for (int v = 0; v < DV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(o + m * Dp + v * 16, acc[m][v]);
}

// Probabilities rounded to bf16 into the first half of the row (16 at a time).
struct OutBf16 {
  static void store(float* row, int j, __m512 p) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(row) + j),
                        (__m256i)_mm512_cvtneps_pbh(p));
  }
};

struct DpArch {
  static constexpr bool kPairs = true;
  static void finish(const float* acc, float inv, bf16* out, int64_t D) { finish_row<V16>(acc, inv, out, D); }
  static float row_sum(const float* l) { return V16::hsum(V16::load(l)); }
  static void load_q(const Problem& P, int64_t q0, int64_t h, int rows, float* dst) {
    bf16* d = reinterpret_cast<bf16*>(dst);
    for (int r = 0; r < rows; ++r)
      std::memcpy(d + r * P.D, at_row<bf16>(P.q, P.q_st, P.q_sh, q0 + r, h), sizeof(bf16) * P.D);
  }
  static void scores(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const uint32_t* kp = static_cast<const uint32_t*>(P.kp) + kh * P.kp_head + g * P.kp_group;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(S.q);
    const int64_t np = P.D / 2;
    for (int r0 = 0; r0 < rows; r0 += kMR) {
      const int mr = std::min(kMR, rows - r0);
      with_n<kMR>(mr, [&](auto MR) {
        with_n<kBK / kGroup>(ng, [&](auto NG) {
          s_panel_dp<decltype(MR)::value, decltype(NG)::value>(q + r0 * np, np, kp, P.kp_group, S.s + r0 * kBK);
        });
      });
    }
  }
  static void softmax(const float* s, int n, float c, float* m, float* l, float* alpha, float* prow) {
    softmax_row<V16, OutBf16>(s, n, c, m, l, alpha, prow);
  }
  static void pv(const Problem& P, int64_t kh, int64_t g, int ng, int rows, Scratch& S) {
    const uint32_t* vp = static_cast<const uint32_t*>(P.vp) + kh * P.vp_head + g * P.vp_group;
    const uint32_t* p = reinterpret_cast<const uint32_t*>(S.p);
    const int ndv = static_cast<int>(P.Dp / 16);
    for (int r0 = 0; r0 < rows; r0 += kMR) {
      const int mr = std::min(kMR, rows - r0);
      for (int v0 = 0, dv; v0 < ndv; v0 += dv) {
        dv = chunk(ndv - v0, 4);
        with_n<kMR>(mr, [&](auto MR) {
          with_n<4>(dv, [&](auto DV) {
            pv_panel_dp<decltype(MR)::value, decltype(DV)::value>(S.o + r0 * P.Dp + v0 * 16, P.Dp, S.alpha + r0,
                                                                  p + r0 * kBK, vp + v0 * 16, ng * kGroup / 2);
          });
        });
      }
    }
  }
};
#endif  // VLM_AVX512BF16

// ---------------------------------------------------------------------------------------------

template <class Arch, typename T>
void run_arch(Problem& P, int64_t nseg, int64_t Hq) {
  const int64_t ngroups = P.gstart[nseg];
  const int64_t D = P.D, Dp = P.Dp;
  // Pack K and V.
  at::Tensor kbuf, vbuf;
  if constexpr (Arch::kPairs) {
    P.kp_group = D / 2 * kGroup;
    P.vp_group = kGroup / 2 * Dp;
    kbuf = at::empty({std::max<int64_t>(P.Hkv * ngroups * P.kp_group, 1)}, at::kInt);
    vbuf = at::empty({std::max<int64_t>(P.Hkv * ngroups * P.vp_group, 1)}, at::kInt);
  } else {
    P.kp_group = D * kGroup;
    P.vp_group = kGroup * Dp;
    kbuf = at::empty({std::max<int64_t>(P.Hkv * ngroups * P.kp_group, 1)}, at::kFloat);
    vbuf = at::empty({std::max<int64_t>(P.Hkv * ngroups * P.vp_group, 1)}, at::kFloat);
  }
  P.kp_head = ngroups * P.kp_group;
  P.vp_head = ngroups * P.vp_group;
  P.kp = kbuf.data_ptr();
  P.vp = vbuf.data_ptr();
  std::vector<int32_t> group_seg(ngroups);
  for (int64_t s = 0; s < nseg; ++s)
    for (int64_t g = P.gstart[s]; g < P.gstart[s + 1]; ++g) group_seg[g] = static_cast<int32_t>(s);
  // Group-major: a token's KV heads are neighbours in memory (one [Hkv, D] row per token, or all of
  // q/k/v in a fused projection's output), so each token's lines are read once for all heads.
  at::parallel_for(0, P.Hkv * ngroups, 8, [&](int64_t a, int64_t e) {
    for (int64_t i = a; i < e; ++i) {
      const int64_t g = i / P.Hkv, kh = i % P.Hkv;
      if constexpr (Arch::kPairs) {
        pack_group_pairs(P, kh, group_seg[g], g, static_cast<uint32_t*>(kbuf.data_ptr()) + kh * P.kp_head + g * P.kp_group,
                         static_cast<uint32_t*>(vbuf.data_ptr()) + kh * P.vp_head + g * P.vp_group);
      } else {
        pack_group_f32<T>(P, kh, group_seg[g], g, kbuf.data_ptr<float>() + kh * P.kp_head + g * P.kp_group,
                          vbuf.data_ptr<float>() + kh * P.vp_head + g * P.vp_group);
      }
    }
  });

  // Work items, longest first.
  std::vector<Item> items;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t lq = P.seg[s].lq;
    for (int64_t i0 = 0; i0 < lq; i0 += kBQ) {
      const int64_t i1 = std::min<int64_t>(i0 + kBQ, lq);
      int32_t lo0, hi0, lo1, hi1;
      row_bounds(P, s, i0, &lo0, &hi0);
      row_bounds(P, s, i1 - 1, &lo1, &hi1);
      const int64_t cost = (i1 - i0) * (std::max(hi0 - lo0, 0) + std::max(hi1 - lo1, 0)) / 2 + 64;
      for (int64_t h = 0; h < Hq; ++h)
        items.push_back(Item{int32_t(s), int32_t(h), int32_t(i0), int32_t(i1), cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    Scratch S(D, Dp);
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) run_item<Arch, T>(P, items[i], S);
  };
  const int64_t nt = at::get_num_threads();
  if (nt > 1 && n_items > 1)
    at::parallel_for(0, std::min<int64_t>(nt, n_items), 1, worker);
  else
    worker(0, 1);
}

template <typename T>
void dispatch(Problem& P, int64_t nseg, int64_t Hq, int64_t impl) {
  P.Dp = round_up(P.D, 16);
#if VLM_AVX512BF16
  if constexpr (std::is_same_v<T, bf16>) {
    if (impl == kAuto) return run_arch<DpArch, T>(P, nseg, Hq);
  }
#endif
#if VLM_AVX512
  if (impl == kAuto || impl == kAvx512) return run_arch<F32Arch<V16, T>, T>(P, nseg, Hq);
#endif
#if VLM_AVX2
  if (impl != kGeneric) return run_arch<F32Arch<V8, T>, T>(P, nseg, Hq);
#endif
  run_arch<GenericArch<T>, T>(P, nseg, Hq);
}

// Attention over the segments (P filled but for seg, gstart and the packed operands): each one's
// lowest visible key becomes its k0 (a window's keys below it are never read), then the kernel
// this build and impl pick runs.
template <typename T>
void run_segments(Problem& P, std::vector<Segment>& segs, int64_t Hq, int64_t impl) {
  const int64_t nseg = static_cast<int64_t>(segs.size());
  std::vector<int32_t> gstart(nseg + 1, 0);
  for (int64_t s = 0; s < nseg; ++s) {
    Segment& sg = segs[s];
    sg.k0 = P.window > 0 ? static_cast<int32_t>(std::max<int64_t>(int64_t(sg.lk) - sg.lq - P.window + 1, 0)) : 0;
    sg.k0 = std::min(sg.k0, sg.lk);
    gstart[s + 1] = static_cast<int32_t>(gstart[s] + (int64_t(sg.lk - sg.k0) + kGroup - 1) / kGroup);
  }
  P.seg = segs.data();
  P.gstart = gstart.data();
  dispatch<T>(P, nseg, Hq, impl);
}

// run_segments for a paged caller, defined in flash_paged.cpp: compiled apart from paged_attention.cpp,
// whose decode kernels this code slowed when it shared their unit.
void run_paged_segments(Problem& P, std::vector<Segment>& segs, int64_t Hq, int64_t impl, bool bf16);

}  // namespace vlm_flash
