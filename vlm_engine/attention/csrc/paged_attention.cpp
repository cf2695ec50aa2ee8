// Fused paged attention for CPU (decode + chunked prefill, GQA; causal, sliding-window and
// per-token KV ends).
//
// out[t, h, :] = softmax(q[t, h, :] . K_b^T * scale) V_b  over the KV positions [lo(t), hi(t))
// of t's sequence b: hi = kv_end[t] or pos(t) + 1 (causal), lo = pos(t) - window + 1 or 0.
// K_b / V_b are read through the block table directly from the paged cache (no gather copy).
// See vlm_engine/attention/reference.py for the exact contract.
//
// Work decomposition: one work item = (sequence, block of query tokens, range
// of KV heads[, KV range]).  An item's KV range starts at the lowest lo of its tokens: the
// pages before a sliding window are never walked (nor read: the pool may have reused them),
// so a window layer costs its window, not its sequence; per-token bounds mask inside tiles.
// By default an item covers all KV heads, so every KV position's [Hkv, D] rows are streamed
// contiguously from memory.  Pages are scattered, so the next tile's K/V lines are
// software-prefetched into L2, spread over the current tile's rows to overlap memory with
// compute.  Within an item the G query heads sharing a KV head are processed together so each
// key/value row is loaded once (into L1) for all of them.  Items are scheduled dynamically
// (atomic counter, longest first) on the ATen intra-op thread pool.  With too few items for the
// threads, long single-block (decode) items are split over their KV range, the partial results
// (running max, running sum, unnormalised accumulator) merged afterwards; items too short for
// that are split per KV head.
//
// Long prompts: a sequence with at least flash_min_queries queries in the step (by default 64:
// kFlashMinQueries) runs on the flash-attention core instead
// (flash_core.h: K/V packed once from the pages, then query-block x key-block register panels,
// vdpbf16ps for bf16), with the same bounds (causal, window, kv_end). The items above are shaped
// for decode: a query row against a tile of keys, ~70-100 GFLOP/s on a 1-4k-token prefill (bf16,
// Zen 5, one thread) against the flash core's 200-300.
//
// Softmax: standard online softmax in the log2 domain (scores are multiplied
// by scale*log2(e) and exponentiated with exp2), float32 throughout; built
// without -ffast-math.  bf16 inputs: q.k via vdpbf16ps (exact products, fp32
// sums) when available, V converted to fp32.
//
// Only the headers we need (torch/extension.h or ATen/ATen.h double the compile time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flash_core.h"
#include "simd_common.h"

namespace {

using namespace vlm_simd;

#ifndef PA_TILE
#define PA_TILE 32
#endif
#ifndef PA_PF_LOCALITY
#define PA_PF_LOCALITY 1  // prefetcht2: into L2, not L1 (a whole tile ahead would thrash L1)
#endif
#ifndef PA_PF_STRIDE
#define PA_PF_STRIDE 64
#endif
constexpr int kTile = PA_TILE;   // KV positions per tile
static_assert(kTile % 16 == 0, "kTile must be a multiple of the 16-lane vector width");
constexpr int kRowsCap = 64;     // target (query token x group head) rows per item
constexpr int kMinSplit = 256;   // minimum KV positions per split of a KV-split item
// Queries of one sequence from which it runs on the flash core (see the top), measured on Zen 5, one
// thread, 9 x 3 heads of 64 and 12 x 2 of 128, 512 and 2,048 cached positions, flash core against
// these items: bf16 on vdpbf16ps 0.84-1.04x at 2 queries, 1.27-1.52x at 4, 1.66-1.84x at 8,
// ~2-2.3x from 16; fp32 (AVX-512 and AVX2) and bf16 on AVX2 0.82-1.56x at 8-32, 1.23-1.68x at 64.
// bf16 also waits for 64: the core rounds P to bf16 for its P.V product, and on SmolLM2's real
// weights with short chat prompts (20-50 tokens) that doubled the worst top-5 log-prob error against
// fp32 (0.125 -> 0.246 nats, plain torch ops); on ~800-token prompts it was no worse (0.12 -> 0.07).
constexpr int64_t kFlashMinQueries = 64;

enum Impl : int64_t { kAuto = 0, kGeneric = 1, kAvx512NoDpbf16 = 2, kAvx2 = 3 };

struct Params {
  const char* q;
  char* out;
  const char* k;
  const char* v;
  int64_t q_st, q_sh;  // strides (elements): token, head
  int64_t o_st, o_sh;
  int64_t k_sp, k_ss, k_sh;  // page, slot, head
  int64_t v_sp, v_ss, v_sh;
  const int32_t* bt;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* qsl;
  const int32_t* kv_end;  // [T] exclusive end of each token's visible KV, or null (causal)
  int64_t window;         // > 0: a token at p sees no position below p - window + 1
  int64_t Hkv, G, D, page_size;
  float c;      // scale * log2(e)
  float* part;  // KV-split partials: [nparts][rows_max * (D + 2)]
  int64_t rows_max;
  int64_t qb_max;  // max query tokens per item
};

// One unit of work: query tokens [q0, q1) of sequence b, KV heads [h0, h0 + nh),
// KV positions [kv0, kv1) (further limited per query token to its own [lo, hi)).
// Rows are ordered (token, head-in-range, group member): r = ti * nh * G + hk * G + g.
struct Item {
  int32_t b, h0, nh, q0, q1, kv0, kv1, part;  // part < 0: write normalised output directly
  int64_t cost;
};

struct MergeGroup {
  int32_t b, h0, nh, q0, q1, part0, nparts;
};

// Per-thread working memory.  The backing store is thread_local and only grows, so the
// steady state does no heap allocation (ATen's OpenMP workers are persistent threads).
struct Scratch {
  float* acc;    // rows_max * D
  float* m;      // rows_max
  float* l;      // rows_max
  float* alpha;  // rows_max: this tile's rescale of the row's accumulator
  float* s;      // rows_max * kTile
  float* kf;     // kTile * D (bf16 keys converted to fp32)
  float* vf;     // kTile * D (bf16 values converted to fp32)
  int32_t* lim;  // per query token: exclusive end of its visible KV range
  int32_t* lo;   // per query token: start of its visible KV range

  Scratch(int64_t rows_max, int64_t qb_max, int64_t D) {
    thread_local std::vector<float> buf;
    thread_local std::vector<int32_t> ibuf;
    const size_t n = rows_max * D + 3 * rows_max + rows_max * kTile + 2 * kTile * D + 16;
    if (buf.size() < n) buf.resize(n);
    if (ibuf.size() < static_cast<size_t>(2 * qb_max)) ibuf.resize(2 * qb_max);
    float* p = buf.data();
    p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    acc = p;
    p += rows_max * D;
    s = p;
    p += rows_max * kTile;
    kf = p;
    p += kTile * D;
    vf = p;
    p += kTile * D;
    m = p;
    p += rows_max;
    l = p;
    p += rows_max;
    alpha = p;
    lim = ibuf.data();
    lo = lim + qb_max;
  }
};

template <typename T>
inline const T* q_row(const Params& P, int64_t t, int64_t h) {
  return reinterpret_cast<const T*>(P.q) + t * P.q_st + h * P.q_sh;
}

// Absolute position of query token t of sequence b.
inline int64_t query_pos(const Params& P, int64_t b, int64_t t) {
  const int64_t qs = P.qsl[b];
  return P.seq_lens[b] - (P.qsl[b + 1] - qs) + (t - qs);
}

// The KV range [lo, hi) token t of sequence b sees (the contract in reference.py).
inline int64_t token_hi(const Params& P, int64_t b, int64_t t) {
  return P.kv_end != nullptr ? int64_t(P.kv_end[t]) : query_pos(P, b, t) + 1;
}
inline int64_t token_lo(const Params& P, int64_t b, int64_t t) {
  return P.window > 0 ? std::max<int64_t>(query_pos(P, b, t) - P.window + 1, 0) : 0;
}

// Fill per-token visibility bounds (clipped to the item's KV range) and reset the running
// state; returns the row count.
inline int64_t setup_rows(const Params& P, const Item& it, Scratch& S) {
  const int64_t rows = int64_t(it.q1 - it.q0) * it.nh * P.G;
  for (int64_t t = it.q0; t < it.q1; ++t) {
    S.lim[t - it.q0] = static_cast<int32_t>(std::min<int64_t>(token_hi(P, it.b, t), it.kv1));
    S.lo[t - it.q0] = static_cast<int32_t>(std::max<int64_t>(token_lo(P, it.b, t), it.kv0));
  }
  for (int64_t r = 0; r < rows; ++r) {
    S.m[r] = kNegInf;
    S.l[r] = 0.f;
  }
  std::memset(S.acc, 0, sizeof(float) * rows * P.D);
  return rows;
}

// out[:D] = acc[:D] * inv (vectorised where the build has vectors).
template <typename T>
inline void finish(const float* acc, float inv, T* out, int64_t D) {
#if VLM_AVX512
  finish_row<V16>(acc, inv, out, D);
#elif VLM_AVX2
  finish_row<V8>(acc, inv, out, D);
#else
  for (int64_t d = 0; d < D; ++d) store_f32(acc[d] * inv, out + d);
#endif
}

template <typename T>
inline void finish_item(const Params& P, const Item& it, Scratch& S, int64_t rows) {
  const int64_t D = P.D;
  const int64_t rpt = int64_t(it.nh) * P.G;  // rows per query token
  if (it.part < 0) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = it.q0 + r / rpt;
      const int64_t h = int64_t(it.h0) * P.G + r % rpt;
      T* o = reinterpret_cast<T*>(P.out) + t * P.o_st + h * P.o_sh;
      finish(S.acc + r * D, 1.f / S.l[r], o, D);
    }
  } else {
    float* base = P.part + int64_t(it.part) * P.rows_max * (D + 2);
    std::memcpy(base, S.acc, sizeof(float) * rows * D);
    float* pm = base + P.rows_max * D;
    float* pl = pm + P.rows_max;
    std::memcpy(pm, S.m, sizeof(float) * rows);
    std::memcpy(pl, S.l, sizeof(float) * rows);
  }
}

// Software prefetch of the next KV tile, spread over the current tile's rows so that
// memory requests overlap with compute (a burst of hundreds of prefetches would just
// stall on the miss buffers).  Walks "segments": per position, the K and the V bytes of
// the item's heads (one segment each if heads are dense, else one per head).
struct PrefetchCursor {
  const char* const* kp = nullptr;  // per-position base pointers of the next tile
  const char* const* vp = nullptr;
  int64_t k_off = 0, v_off = 0;    // byte offset of head h0
  int64_t k_hs = 0, v_hs = 0;      // byte stride between heads
  int64_t seg_bytes = 0;
  int nh_seg = 1;                  // head segments per position (1 if dense)
  int nseg = 0;                    // total segments
  int seg = 0;
  int64_t off = 0;
  int per_row = 0;                 // lines to issue per processed row

  void step(int lines) {
    while (lines > 0 && seg < nseg) {
      const int pos = seg / (2 * nh_seg);
      const int rem = seg % (2 * nh_seg);
      const bool is_v = rem >= nh_seg;
      const int h = is_v ? rem - nh_seg : rem;
      const char* p = (is_v ? vp[pos] + v_off + h * v_hs : kp[pos] + k_off + h * k_hs) + off;
      const int64_t avail = (seg_bytes - off + PA_PF_STRIDE - 1) / PA_PF_STRIDE;
      const int n = static_cast<int>(std::min<int64_t>(avail, lines));
#pragma GCC unroll 4
      for (int i = 0; i < n; ++i) __builtin_prefetch(p + i * PA_PF_STRIDE, 0, PA_PF_LOCALITY);
      lines -= n;
      off += int64_t(n) * PA_PF_STRIDE;
      if (off >= seg_bytes) {
        off = 0;
        ++seg;
      }
    }
  }
  void row_done() { step(per_row); }
  void finish() { step(1 << 30); }
};

// Pointers (KV head 0) to the n KV positions from j0 of sequence b, through its block table.
template <typename T>
inline void kv_rows(const Params& P, int32_t b, int64_t j0, int n, const T** kp, const T** vp) {
  const int32_t* bt = P.bt + int64_t(b) * P.bt_stride;
  const T* kbase = reinterpret_cast<const T*>(P.k);
  const T* vbase = reinterpret_cast<const T*>(P.v);
  int64_t pidx = j0 / P.page_size;
  int64_t slot = j0 % P.page_size;
  for (int j = 0; j < n; ++j) {
    const int64_t page = bt[pidx];
    kp[j] = kbase + page * P.k_sp + slot * P.k_ss;
    vp[j] = vbase + page * P.v_sp + slot * P.v_ss;
    if (++slot == P.page_size) {
      slot = 0;
      ++pidx;
    }
  }
}

// The KV rows of item it's first tile (for prefetching); returns how many.
template <typename T>
int first_tile(const Params& P, const Item& it, const T** kp, const T** vp) {
  const int64_t end = std::min<int64_t>(it.kv1, int64_t(it.kv0) + kTile);
  const int n = static_cast<int>(std::max<int64_t>(end - it.kv0, 0));
  kv_rows(P, it.b, it.kv0, n, kp, vp);
  return n;
}

// ---------------------------------------------------------------------------
// Per-item driver shared by all implementations.  Walks the item's KV range in
// tiles of kTile positions through the block table; Core::tile() processes one
// tile for all rows.  kp/vp hold per-position base pointers (KV head 0).
// ---------------------------------------------------------------------------
template <typename T, typename Core>
void run_item(const Params& P, const Item& it, const Item* next, Scratch& S) {
  const int64_t rows = setup_rows(P, it, S);
  const int64_t ntok = it.q1 - it.q0;
  int32_t max_lim = 0;  // with kv_end, not necessarily the last token's
  int32_t max_lo = 0;
  for (int64_t ti = 0; ti < ntok; ++ti) {
    max_lim = std::max(max_lim, S.lim[ti]);
    max_lo = std::max(max_lo, S.lo[ti]);
  }
  // Bytes to prefetch per position: the item's heads [h0, h0+nh) (one range if heads are dense).
  const int64_t row_bytes = P.D * int64_t(sizeof(T));
  const bool k_dense = P.k_sh == P.D, v_dense = P.v_sh == P.D;
  const int64_t k_off = int64_t(it.h0) * P.k_sh, v_off = int64_t(it.h0) * P.v_sh;
  // Double-buffered pointer tables: while tile i is computed, tile i+1's K/V rows are
  // software-prefetched (pages are scattered, so hardware prefetchers can't follow them).
  const T* kp[2][kTile];
  const T* vp[2][kTile];
  auto fill = [&](int buf, int32_t j0) -> int {
    const int jn = static_cast<int>(std::min<int32_t>(kTile, max_lim - j0));
    kv_rows(P, it.b, j0, jn, kp[buf], vp[buf]);
    for (int j = jn; j < kTile; ++j) {  // pad with a valid pointer (masked later)
      kp[buf][j] = kp[buf][0];
      vp[buf][j] = vp[buf][0];
    }
    return jn;
  };
  PrefetchCursor pf;
  pf.k_off = k_off * int64_t(sizeof(T));
  pf.v_off = v_off * int64_t(sizeof(T));
  pf.k_hs = P.k_sh * int64_t(sizeof(T));
  pf.v_hs = P.v_sh * int64_t(sizeof(T));
  pf.nh_seg = (k_dense && v_dense) ? 1 : it.nh;
  pf.seg_bytes = pf.nh_seg == 1 ? row_bytes * it.nh : row_bytes;
  if (it.kv0 < max_lim) {
    int cur = 0;
    int jn = fill(cur, it.kv0);
    for (int32_t j0 = it.kv0; j0 < max_lim; j0 += kTile) {
      const int32_t nj0 = j0 + kTile;
      int njn = 0;
      pf.nseg = 0;
      pf.seg = 0;
      pf.off = 0;
      int pf_n = 0;  // positions of the tile prefetched during this one
      if (nj0 < max_lim) {
        njn = fill(cur ^ 1, nj0);
        pf_n = njn;
      } else if (next != nullptr && next->h0 == it.h0 && next->nh == it.nh) {
        // The last tile: prefetch the first tile of the item this thread runs next, so that it
        // does not start on a cold page (items of one sequence are ~5 tiles at decode).
        pf_n = first_tile(P, *next, kp[cur ^ 1], vp[cur ^ 1]);
      }
#ifndef PA_NO_PREFETCH
      if (pf_n > 0) {
        pf.kp = reinterpret_cast<const char* const*>(kp[cur ^ 1]);
        pf.vp = reinterpret_cast<const char* const*>(vp[cur ^ 1]);
        pf.nseg = pf_n * 2 * pf.nh_seg;
        const int64_t lines = int64_t(pf.nseg) * ((pf.seg_bytes + PA_PF_STRIDE - 1) / PA_PF_STRIDE);
        pf.per_row = static_cast<int>((lines + rows - 1) / rows);
      }
#endif
      // Tiles that start at or after every token's lo (all of them when causal or at decode)
      // take the variant without the per-token lower bound: the causal code as it was.
      if (max_lo > j0)
        Core::template tile<true>(P, it, S, ntok, j0, jn, kp[cur], vp[cur], pf);
      else
        Core::template tile<false>(P, it, S, ntok, j0, jn, kp[cur], vp[cur], pf);
      pf.finish();
      cur ^= 1;
      jn = njn;
    }
  }
  finish_item<T>(P, it, S, rows);
}

// ---------------------------------------------------------------------------
// Portable implementation (any D, any ISA); gcc auto-vectorises the d-loops.
// ---------------------------------------------------------------------------
template <typename T>
struct GenericCore {
  template <bool kLo>
  static void tile(const Params& P, const Item& it, Scratch& S, int64_t ntok, int32_t j0, int jn,
                   const T* const* kp, const T* const* vp, PrefetchCursor& pf) {
    const int64_t D = P.D;
    const int64_t G = P.G;
    const int64_t rpt = int64_t(it.nh) * G;
    for (int64_t hk = 0; hk < it.nh; ++hk) {
      const int64_t kvh = it.h0 + hk;
      const int64_t koff = kvh * P.k_sh, voff = kvh * P.v_sh;
      for (int64_t ti = 0; ti < ntok; ++ti) {
        const int n = static_cast<int>(std::min<int64_t>(int64_t(S.lim[ti]) - j0, jn));
        const int a = kLo ? std::max(S.lo[ti] - j0, 0) : 0;  // the token sees tile positions [a, n)
        if (n <= a) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = ti * rpt + hk * G + g;
          const T* qr = q_row<T>(P, it.q0 + ti, kvh * G + g);
          float* sr = S.s + r * kTile;
          float tmax = kNegInf;
          for (int j = a; j < n; ++j) {
            const T* kr = kp[j] + koff;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += to_f32(qr[d]) * to_f32(kr[d]);
            sr[j] = dot * P.c;
            tmax = std::max(tmax, sr[j]);
          }
          const float mold = S.m[r];
          const float mnew = std::max(mold, tmax);
          const float alpha = (mold == kNegInf) ? 0.f : std::exp2(mold - mnew);
          float sum = 0.f;
          for (int j = a; j < n; ++j) {
            sr[j] = std::exp2(sr[j] - mnew);
            sum += sr[j];
          }
          S.m[r] = mnew;
          S.l[r] = S.l[r] * alpha + sum;
          pf.row_done();
          float* ar = S.acc + r * D;
          if (alpha != 1.f)
            for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          for (int j = a; j < n; ++j) {
            const T* vr = vp[j] + voff;
            const float p = sr[j];
            for (int64_t d = 0; d < D; ++d) ar[d] += p * to_f32(vr[d]);
          }
        }
      }
    }
  }
};

#if VLM_AVX512
// ---------------------------------------------------------------------------
// AVX-512 implementation, templated on NV = D / 16.
// ---------------------------------------------------------------------------

// Horizontal sums of 16 vectors: result lane i = sum of the lanes of a[i].
inline __m512 reduce16(const __m512* a) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(w[2 * i]);
    const __m512d y = _mm512_castps_pd(w[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // u[i], 128-bit lane k: partial sums (over lane k of the inputs) of a[4i .. 4i+3].
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 dot products q . k[i], i < 16 (fp32, or bf16 q converted on the fly).
template <int NV, typename QT>
inline __m512 dot16(const QT* q, const float* const* k) {
  __m512 qv[NV];
  for (int v = 0; v < NV; ++v) qv[v] = V16::load(q + 16 * v);
  __m512 a[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k[i]));
    for (int v = 1; v < NV; ++v) a[i] = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k[i] + 16 * v), a[i]);
  }
  return reduce16(a);
}

#if VLM_AVX512BF16
// 16 dot products with bf16 q/k using vdpbf16ps (exact products, fp32 accumulation).
template <int NV>
inline __m512 dot16_bf16(const bf16* q, const bf16* const* k) {
  constexpr int NW = NV / 2;  // 32 bf16 per 512-bit vector
  __m512bh qv[NW];
  for (int v = 0; v < NW; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + 32 * v));
  __m512 a[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm512_setzero_ps();
    for (int v = 0; v < NW; ++v)
      a[i] = _mm512_dpbf16_ps(a[i], qv[v],
                              (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(k[i] + 32 * v)));
  }
  return reduce16(a);
}
#endif

// Rows (query heads of one KV head) whose P.V accumulators fit the 32 zmm registers together.
template <int NV>
constexpr int kPvGroupRows = NV >= 16 ? 1 : (16 / NV > 8 ? 8 : 16 / NV);

// acc[g] = alpha[g] * acc[g] + sum_{j_begin <= j < n} s[g][j] V[j] for GR rows sharing a KV
// head: each V row is loaded (bf16: widened in registers) once for all GR rows, and the GR * NV
// accumulators are independent FMA chains (two sets over alternate positions when that is too few
// to cover the FMA latency).
template <int NV, int GR, typename VT>
inline void pv_rows(float* acc, const float* s, const float* alpha, const VT* const* vrow, int64_t voff,
                    int j_begin, int n) {
  constexpr int D = 16 * NV;
  constexpr int kSets = GR * NV < 8 ? 2 : 1;
  __m512 a[kSets][GR][NV];
  for (int g = 0; g < GR; ++g) {
    const __m512 va = _mm512_set1_ps(alpha[g]);
    for (int v = 0; v < NV; ++v) {
      a[0][g][v] = _mm512_mul_ps(_mm512_load_ps(acc + g * D + 16 * v), va);
      if constexpr (kSets == 2) a[1][g][v] = _mm512_setzero_ps();
    }
  }
  // Position j into accumulator set k.
  auto add_position = [&](int j, int k) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = V16::load(vrow[j] + voff + 16 * v);
    for (int g = 0; g < GR; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * kTile + j]);
      for (int v = 0; v < NV; ++v) a[k][g][v] = _mm512_fmadd_ps(p, vv[v], a[k][g][v]);
    }
  };
  int j = j_begin;
  for (; j + kSets <= n; j += kSets)
    for (int k = 0; k < kSets; ++k) add_position(j + k, k);
  for (; j < n; ++j) add_position(j, 0);
  for (int g = 0; g < GR; ++g)
    for (int v = 0; v < NV; ++v) {
      __m512 sum = a[0][g][v];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, a[1][g][v]);
      _mm512_store_ps(acc + g * D + 16 * v, sum);
    }
}

// pv_rows for gr <= GR rows (the last group of a head may be short), over tile positions [a, n).
template <int NV, typename VT, int GR = kPvGroupRows<NV>>
inline void pv_group(int gr, float* acc, const float* s, const float* alpha, const VT* const* vrow, int64_t voff,
                     int a, int n) {
  if constexpr (GR > 1) {
    if (gr < GR) return pv_group<NV, VT, GR - 1>(gr, acc, s, alpha, vrow, voff, a, n);
  }
  pv_rows<NV, GR>(acc, s, alpha, vrow, voff, a, n);
}

// Lanes [0, hi) of 16 (hi may exceed 16), or [lo, hi) (lo may be negative).
inline __mmask16 lanes16(int hi) { return hi >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << hi) - 1u); }
inline __mmask16 lanes16(int lo, int hi) {
  return lo <= 0 ? lanes16(hi) : static_cast<__mmask16>(lanes16(hi) & ~((1u << lo) - 1u));
}

// kDp: bf16 keys are consumed directly by vdpbf16ps (else converted to fp32 per tile).
// bf16 values: for a single query token (decode) each row group widens V in registers; with
// more tokens the head's tile is widened once into scratch and shared by all of them.
template <typename T, int NV, bool kDp>
struct Avx512Core {
  template <bool kLo>
  static void tile(const Params& P, const Item& it, Scratch& S, int64_t ntok, int32_t j0, int jn,
                   const T* const* kp, const T* const* vp, PrefetchCursor& pf) {
    constexpr int D = NV * 16;
    constexpr int kGroup = kPvGroupRows<NV>;
    const int64_t G = P.G;
    const int64_t rpt = int64_t(it.nh) * G;
    const __m512 vc = _mm512_set1_ps(P.c);
    const __m512 vneg = _mm512_set1_ps(kNegInf);
    const bool widen_v_once = std::is_same_v<T, bf16> && ntok > 1;
    const float* kpf[kTile];
    const float* vpf[kTile];
    const bf16* kpb[kTile];
    (void)kpb;
    for (int64_t hk = 0; hk < it.nh; ++hk) {
      const int64_t kvh = it.h0 + hk;
      const int64_t koff = kvh * P.k_sh, voff = kvh * P.v_sh;
      if constexpr (std::is_same_v<T, float>) {
        for (int j = 0; j < kTile; ++j) kpf[j] = kp[j] + koff;
      } else {
        if (widen_v_once) {
          for (int j = 0; j < jn; ++j) {
            float* vd = S.vf + j * D;
            for (int v = 0; v < NV; ++v) _mm512_store_ps(vd + 16 * v, V16::load(vp[j] + voff + 16 * v));
            vpf[j] = vd;
          }
          for (int j = jn; j < kTile; ++j) vpf[j] = S.vf;
        }
        if constexpr (kDp) {
          for (int j = 0; j < kTile; ++j) kpb[j] = kp[j] + koff;
        } else {
          for (int j = 0; j < jn; ++j) {
            float* kd = S.kf + j * D;
            for (int v = 0; v < NV; ++v) _mm512_store_ps(kd + 16 * v, V16::load(kp[j] + koff + 16 * v));
            kpf[j] = kd;
          }
          for (int j = jn; j < kTile; ++j) kpf[j] = S.kf;
        }
      }

      for (int64_t ti = 0; ti < ntok; ++ti) {
        const int n = static_cast<int>(std::min<int64_t>(int64_t(S.lim[ti]) - j0, jn));
        const int a = kLo ? std::max(S.lo[ti] - j0, 0) : 0;  // the token sees tile positions [a, n)
        if (n <= a) continue;
        const int g_first = a & ~15;
        const int64_t r0 = ti * rpt + hk * G;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = r0 + g;
          const T* qr = q_row<T>(P, it.q0 + ti, kvh * G + g);
          float* sr = S.s + r * kTile;
          __m512 vmax = vneg;
          for (int g0 = g_first; g0 < n; g0 += 16) {
            __m512 sc;
            if constexpr (kDp) {
#if VLM_AVX512BF16
              sc = dot16_bf16<NV>(reinterpret_cast<const bf16*>(qr), kpb + g0);
#endif
            } else {
              sc = dot16<NV>(qr, kpf + g0);
            }
            sc = _mm512_mul_ps(sc, vc);
            const __mmask16 mk = kLo ? lanes16(a - g0, n - g0) : lanes16(n - g0);
            sc = _mm512_mask_blend_ps(mk, vneg, sc);
            _mm512_store_ps(sr + g0, sc);
            vmax = _mm512_max_ps(vmax, sc);
          }
          const float mold = S.m[r];
          const float mnew = std::max(mold, V16::hmax(vmax));
          const float alpha = (mold == kNegInf) ? 0.f : std::exp2(mold - mnew);
          const __m512 vm = _mm512_set1_ps(mnew);
          __m512 vsum = _mm512_setzero_ps();
          for (int g0 = g_first; g0 < n; g0 += 16) {
            const __mmask16 mk = kLo ? lanes16(a - g0, n - g0) : lanes16(n - g0);
            __m512 p = V16::exp2(_mm512_sub_ps(_mm512_load_ps(sr + g0), vm));
            p = _mm512_maskz_mov_ps(mk, p);
            _mm512_store_ps(sr + g0, p);
            vsum = _mm512_add_ps(vsum, p);
          }
          S.m[r] = mnew;
          S.l[r] = S.l[r] * alpha + V16::hsum(vsum);
          S.alpha[r] = alpha;
          pf.row_done();
        }
        for (int64_t g = 0; g < G; g += kGroup) {
          const int gr = static_cast<int>(std::min<int64_t>(kGroup, G - g));
          float* acc = S.acc + (r0 + g) * D;
          const float* s = S.s + (r0 + g) * kTile;
          const float* alpha = S.alpha + r0 + g;
          if (!widen_v_once) {
            pv_group<NV>(gr, acc, s, alpha, vp, voff, a, n);
          } else {
            pv_group<NV>(gr, acc, s, alpha, vpf, 0, a, n);
          }
        }
      }
    }
  }
};
#endif  // VLM_AVX512

#if VLM_AVX2
// ---------------------------------------------------------------------------
// AVX2 + FMA implementation, templated on NV = D / 8. The same algorithm as the AVX-512
// core with 8-lane vectors; bf16 K/V tiles are converted to fp32 once per head (AVX2 has no
// bf16 dot product). Without it the portable loops ran ~3.6 GFLOP/s on Zen 3 (64 sequences
// x 500 positions: 10.3 ms per layer).
// ---------------------------------------------------------------------------

// Horizontal sums of 8 vectors: result lane i = sum of the lanes of a[i].
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // t0 = [a0..a3 sums of lanes 0-3 | a0..a3 sums of lanes 4-7], t1 likewise for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Lanes [0, left) set (left may exceed 8).
inline __m256 lane_mask8(int left) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), iota));
}

// Lanes [lo, hi) (lo may be negative, hi past 8).
inline __m256 lanes8(int lo, int hi) { return _mm256_andnot_ps(lane_mask8(lo), lane_mask8(hi)); }

// 8 dot products q . k[i], i < 8 (fp32 keys; fp32 or bf16 q converted on the fly).
template <int NV, typename QT>
inline __m256 dot8(const QT* q, const float* const* k) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm256_mul_ps(V8::load(q), _mm256_loadu_ps(k[i]));
    for (int v = 1; v < NV; ++v) a[i] = _mm256_fmadd_ps(V8::load(q + 8 * v), _mm256_loadu_ps(k[i] + 8 * v), a[i]);
  }
  return reduce8(a);
}

template <typename T, int NV>
struct Avx2Core {
  template <bool kLo>
  static void tile(const Params& P, const Item& it, Scratch& S, int64_t ntok, int32_t j0, int jn,
                   const T* const* kp, const T* const* vp, PrefetchCursor& pf) {
    constexpr int D = NV * 8;
    const int64_t G = P.G;
    const int64_t rpt = int64_t(it.nh) * G;
    const __m256 vc = _mm256_set1_ps(P.c);
    const __m256 vneg = _mm256_set1_ps(kNegInf);
    const float* kpf[kTile];
    const float* vpf[kTile];
    for (int64_t hk = 0; hk < it.nh; ++hk) {
      const int64_t kvh = it.h0 + hk;
      const int64_t koff = kvh * P.k_sh, voff = kvh * P.v_sh;
      if constexpr (std::is_same_v<T, float>) {
        for (int j = 0; j < kTile; ++j) {
          kpf[j] = kp[j] + koff;
          vpf[j] = vp[j] + voff;
        }
      } else {
        // Convert this head's tile once for all rows sharing it.
        for (int j = 0; j < jn; ++j) {
          float* kd = S.kf + j * D;
          float* vd = S.vf + j * D;
          for (int v = 0; v < NV; ++v) {
            _mm256_store_ps(kd + 8 * v, V8::load(kp[j] + koff + 8 * v));
            _mm256_store_ps(vd + 8 * v, V8::load(vp[j] + voff + 8 * v));
          }
          kpf[j] = kd;
          vpf[j] = vd;
        }
        for (int j = jn; j < kTile; ++j) {
          kpf[j] = S.kf;
          vpf[j] = S.vf;
        }
      }

      for (int64_t ti = 0; ti < ntok; ++ti) {
        const int n = static_cast<int>(std::min<int64_t>(int64_t(S.lim[ti]) - j0, jn));
        const int a = kLo ? std::max(S.lo[ti] - j0, 0) : 0;  // the token sees tile positions [a, n)
        if (n <= a) continue;
        const int g_first = a & ~7;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = ti * rpt + hk * G + g;
          const T* qr = q_row<T>(P, it.q0 + ti, kvh * G + g);
          float* sr = S.s + r * kTile;
          __m256 vmax = vneg;
          for (int g0 = g_first; g0 < n; g0 += 8) {
            __m256 sc = _mm256_mul_ps(dot8<NV>(qr, kpf + g0), vc);
            sc = _mm256_blendv_ps(vneg, sc, kLo ? lanes8(a - g0, n - g0) : lane_mask8(n - g0));
            _mm256_store_ps(sr + g0, sc);
            vmax = _mm256_max_ps(vmax, sc);
          }
          const float mold = S.m[r];
          const float mnew = std::max(mold, V8::hmax(vmax));
          const float alpha = (mold == kNegInf) ? 0.f : std::exp2(mold - mnew);
          const __m256 vm = _mm256_set1_ps(mnew);
          __m256 vsum = _mm256_setzero_ps();
          for (int g0 = g_first; g0 < n; g0 += 8) {
            __m256 e = V8::exp2(_mm256_sub_ps(_mm256_load_ps(sr + g0), vm));
            e = _mm256_and_ps(e, kLo ? lanes8(a - g0, n - g0) : lane_mask8(n - g0));
            _mm256_store_ps(sr + g0, e);
            vsum = _mm256_add_ps(vsum, e);
          }
          S.m[r] = mnew;
          S.l[r] = S.l[r] * alpha + V8::hsum(vsum);
          pf.row_done();

          float* ar = S.acc + r * D;
          __m256 a0[NV];
          for (int v = 0; v < NV; ++v) a0[v] = _mm256_load_ps(ar + 8 * v);
          if (alpha != 1.f) {
            const __m256 va = _mm256_set1_ps(alpha);
            for (int v = 0; v < NV; ++v) a0[v] = _mm256_mul_ps(a0[v], va);
          }
          if constexpr (NV <= 4) {
            // Two accumulator sets to hide FMA latency for small D (16 ymm registers in all).
            __m256 a1[NV];
            for (int v = 0; v < NV; ++v) a1[v] = _mm256_setzero_ps();
            int j = a;
            for (; j + 1 < n; j += 2) {
              const __m256 p0 = _mm256_set1_ps(sr[j]);
              const __m256 p1 = _mm256_set1_ps(sr[j + 1]);
              for (int v = 0; v < NV; ++v) {
                a0[v] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vpf[j] + 8 * v), a0[v]);
                a1[v] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vpf[j + 1] + 8 * v), a1[v]);
              }
            }
            if (j < n) {
              const __m256 p0 = _mm256_set1_ps(sr[j]);
              for (int v = 0; v < NV; ++v) a0[v] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vpf[j] + 8 * v), a0[v]);
            }
            for (int v = 0; v < NV; ++v) _mm256_store_ps(ar + 8 * v, _mm256_add_ps(a0[v], a1[v]));
          } else {
            for (int j = a; j < n; ++j) {
              const __m256 p0 = _mm256_set1_ps(sr[j]);
              const float* v0 = vpf[j];
              for (int v = 0; v < NV; ++v) a0[v] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * v), a0[v]);
            }
            for (int v = 0; v < NV; ++v) _mm256_store_ps(ar + 8 * v, a0[v]);
          }
        }
      }
    }
  }
};
#endif  // VLM_AVX2

using ItemFn = void (*)(const Params&, const Item&, const Item*, Scratch&);

template <typename T>
ItemFn select_kernel(int64_t D, int64_t impl) {
#if VLM_AVX512
  if (impl != kGeneric && impl != kAvx2) {
    const bool dp = VLM_AVX512BF16 && std::is_same_v<T, bf16> && impl != kAvx512NoDpbf16 && D % 32 == 0;
    (void)dp;
#define PA_CASE(NV)                                                            \
  case NV * 16:                                                                \
    if constexpr (VLM_AVX512BF16 && std::is_same_v<T, bf16> && (NV % 2 == 0)) { \
      if (dp) return &run_item<T, Avx512Core<T, NV, true>>;                    \
    }                                                                          \
    return &run_item<T, Avx512Core<T, NV, false>>;
    switch (D) {  // common head dims; anything else takes the portable path
      PA_CASE(2)
      PA_CASE(4)
      PA_CASE(5)
      PA_CASE(6)
      PA_CASE(8)
      PA_CASE(16)
      default:
        break;
    }
#undef PA_CASE
  }
#endif
#if VLM_AVX2
  if (impl != kGeneric) {
#define PA_CASE8(NV) \
  case NV * 8:       \
    return &run_item<T, Avx2Core<T, NV>>;
    switch (D) {  // common head dims; anything else takes the portable path
      PA_CASE8(4)
      PA_CASE8(8)
      PA_CASE8(10)
      PA_CASE8(12)
      PA_CASE8(16)
      PA_CASE8(32)
      default:
        break;
    }
#undef PA_CASE8
  }
#endif
  (void)D;
  (void)impl;
  return &run_item<T, GenericCore<T>>;
}

template <typename T>
void merge_group(const Params& P, const MergeGroup& mg) {
  const int64_t D = P.D;
  const int64_t rpt = int64_t(mg.nh) * P.G;
  const int64_t rows = int64_t(mg.q1 - mg.q0) * rpt;
  const int64_t stride = P.rows_max * (D + 2);
  float acc[1024];  // D <= 1024 (checked)
  for (int64_t r = 0; r < rows; ++r) {
    float M = kNegInf;
    for (int p = 0; p < mg.nparts; ++p) {
      const float* base = P.part + int64_t(mg.part0 + p) * stride;
      M = std::max(M, base[P.rows_max * D + r]);
    }
    float wl = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int p = 0; p < mg.nparts; ++p) {
      const float* base = P.part + int64_t(mg.part0 + p) * stride;
      const float mp = base[P.rows_max * D + r];
      if (mp == kNegInf) continue;  // this part saw no visible KV for the row
      const float w = std::exp2(mp - M);
      wl += w * base[P.rows_max * D + P.rows_max + r];
      const float* a = base + r * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
    }
    const int64_t t = mg.q0 + r / rpt;
    const int64_t h = int64_t(mg.h0) * P.G + r % rpt;
    T* o = reinterpret_cast<T*>(P.out) + t * P.o_st + h * P.o_sh;
    const float inv = 1.f / wl;
    for (int64_t d = 0; d < D; ++d) store_f32(acc[d] * inv, o + d);
  }
}

template <typename T>
void run_all(Params& P, int64_t B, int64_t impl, int64_t flash_min) {
  const int64_t G = P.G;
  const int32_t Hkv = static_cast<int32_t>(P.Hkv);
  // Query tokens per item: keep (tokens x all query heads) rows around kRowsCap.
  const int64_t QB = std::max<int64_t>(1, kRowsCap / (Hkv * G));
  P.qb_max = QB;
  P.rows_max = QB * Hkv * G;

  // 1) One item per (sequence, query block), covering all KV heads: each KV position's
  //    [Hkv, D] rows are then read as one contiguous stream.
  std::vector<Item> items;
  items.reserve(B + 8);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t qs = P.qsl[b], qe = P.qsl[b + 1];
    const int32_t ql = qe - qs;
    if (ql <= 0 || (flash_min > 0 && ql >= flash_min)) continue;  // none, or on the flash core
    for (int32_t q0 = qs; q0 < qe; q0 += static_cast<int32_t>(QB)) {
      const int32_t q1 = static_cast<int32_t>(std::min<int64_t>(q0 + QB, qe));
      // The block's KV range: from its first token's lo (the lowest: lo grows with the position)
      // to the furthest end any of its tokens sees (the last one's, unless kv_end says otherwise).
      const int32_t kv0 = static_cast<int32_t>(token_lo(P, b, q0));
      int64_t kv1 = token_hi(P, b, q1 - 1);
      if (P.kv_end != nullptr)
        for (int32_t t = q0; t < q1 - 1; ++t) kv1 = std::max<int64_t>(kv1, P.kv_end[t]);
      const int64_t cost = int64_t(q1 - q0) * Hkv * G * (kv1 - kv0) + 64;
      items.push_back(Item{static_cast<int32_t>(b), 0, Hkv, q0, q1, kv0, static_cast<int32_t>(kv1), -1, cost});
      total += cost;
    }
  }
  if (items.empty()) return;

  const int64_t nt = at::get_num_threads();
  // Threads from ~2k (query row x position) products: one decode of 512 / 1,024 / 1,800 positions
  // (SmolLM2 shapes, 9 x 3 heads, KV from memory, 2-core Zen 4) took 39 / 62 / 118 us on one thread
  // and 22 / 33 / 64 us split over the KV axis on two; 3 sequences of 128, 30 -> 23 us (fp32).
  // Below ~2k the fork costs what the work does.
  const bool parallel = nt > 1 && total > 2048 && !at::in_parallel_region();
  const int64_t want = 4 * nt;  // items wanted for dynamic load balance

  // 2) Too few items for the threads: long single-block items split over the KV axis (partials
  //    merged afterwards); each part still reads whole [Hkv, D] rows, contiguous in a page. Then,
  //    if there are still too few, the items left whole split by KV head: free, but each part reads
  //    1/Hkv of every row, scattered. (Head split first made the decode of 1 / 4 sequences of 1,843
  //    positions, SmolLM2 shapes, 30 layers, 2-core Zen 5, 2.2 / 8.4-9.0 ms against 1.5 / 6.1-6.6
  //    with the KV split: ~20 GB/s against ~27.)
  std::vector<MergeGroup> groups;
  at::Tensor part_buf;
  if (parallel && static_cast<int64_t>(items.size()) < want) {
    const int64_t target = std::max<int64_t>(total / want, 1);
    std::vector<Item> split;
    split.reserve(items.size() * want);
    int32_t nparts = 0;
    for (const Item& it : items) {
      const bool single_block = it.q0 == P.qsl[it.b] && it.q1 == P.qsl[it.b + 1];
      const int64_t span = it.kv1 - it.kv0;
      const int64_t ns = single_block ? std::min<int64_t>((it.cost + target - 1) / target, span / kMinSplit) : 1;
      if (ns <= 1) {
        split.push_back(it);
        continue;
      }
      const int64_t per = ((span + ns - 1) / ns + kTile - 1) / kTile * kTile;  // tile-aligned
      const int32_t part0 = nparts;
      int32_t cnt = 0;
      for (int64_t a = it.kv0; a < it.kv1; a += per) {
        Item s = it;
        s.kv0 = static_cast<int32_t>(a);
        s.kv1 = static_cast<int32_t>(std::min<int64_t>(a + per, it.kv1));
        s.part = nparts++;
        s.cost = int64_t(it.q1 - it.q0) * it.nh * G * (s.kv1 - s.kv0) + 64;
        split.push_back(s);
        ++cnt;
      }
      groups.push_back(MergeGroup{it.b, it.h0, it.nh, it.q0, it.q1, part0, cnt});
    }
    if (!groups.empty()) {
      items.swap(split);
      part_buf = at::empty({int64_t(nparts) * P.rows_max * (P.D + 2)}, at::kFloat);
      P.part = part_buf.data_ptr<float>();
    }
  }
  if (parallel && static_cast<int64_t>(items.size()) < want && Hkv > 1) {
    std::vector<Item> split;
    split.reserve(items.size() * Hkv);
    for (const Item& it : items) {
      if (it.part >= 0) {  // a KV part: its merge group covers all of its heads
        split.push_back(it);
        continue;
      }
      for (int32_t h = 0; h < Hkv; ++h) {
        Item s = it;
        s.h0 = h;
        s.nh = 1;
        s.cost = int64_t(it.q1 - it.q0) * G * (it.kv1 - it.kv0) + 64;
        split.push_back(s);
      }
    }
    items.swap(split);
  }

  // Longest first for the dynamic scheduler (stable: keeps sequence order among equals).
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const ItemFn fn = select_kernel<T>(P.D, impl);
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    Scratch S(P.rows_max, P.qb_max, P.D);
    // While more items are left than threads, a thread claims its next item before running the
    // current one, so that the current one's last tile can prefetch the next one's first (near
    // the end it does not, so that no thread holds an item another one could be running).
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < n_items) {
      int64_t ahead = n_items;
      if (next.load(std::memory_order_relaxed) + nt < n_items) ahead = next.fetch_add(1, std::memory_order_relaxed);
      fn(P, items[i], ahead < n_items ? &items[ahead] : nullptr, S);
      i = ahead < n_items ? ahead : next.fetch_add(1, std::memory_order_relaxed);
    }
  };
  if (parallel && n_items > 1) {
    at::parallel_for(0, std::min<int64_t>(nt, n_items), 1, worker);
  } else {
    worker(0, 1);
  }

  if (!groups.empty()) {
    const int64_t ng = static_cast<int64_t>(groups.size());
    auto merge = [&](int64_t a, int64_t e) {
      for (int64_t i = a; i < e; ++i) merge_group<T>(P, groups[i]);
    };
    if (ng > 1)
      at::parallel_for(0, ng, 1, merge);
    else
      merge(0, ng);
  }
}

// The sequences with at least flash_min queries (none if flash_min is 0), on the flash core: one
// segment each, keys from the pages through the block table.
template <typename T>
void run_long_prompts(const Params& P, int64_t B, int64_t impl, int64_t flash_min) {
  if (flash_min <= 0) return;
  std::vector<vlm_flash::Segment> segs;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t ql = P.qsl[b + 1] - P.qsl[b];
    if (ql > 0 && ql >= flash_min) segs.push_back(vlm_flash::Segment{P.qsl[b], ql, P.seq_lens[b], 0, b});
  }
  if (segs.empty()) return;
  vlm_flash::Problem F{};
  F.q = P.q;
  F.out = P.out;
  F.k = P.k;
  F.v = P.v;
  F.q_st = P.q_st;
  F.q_sh = P.q_sh;
  F.o_st = P.o_st;
  F.o_sh = P.o_sh;
  F.k_sp = P.k_sp;
  F.k_st = P.k_ss;  // a position's row: its slot in the page
  F.k_sh = P.k_sh;
  F.v_sp = P.v_sp;
  F.v_st = P.v_ss;
  F.v_sh = P.v_sh;
  F.bt = P.bt;
  F.bt_stride = P.bt_stride;
  F.page_size = P.page_size;
  F.kv_end = P.kv_end;
  F.window = P.window;
  F.causal = true;
  F.Hkv = P.Hkv;
  F.G = P.G;
  F.D = P.D;
  F.c = P.c;
  vlm_flash::run_paged_segments(F, segs, P.Hkv * P.G, impl, std::is_same_v<T, bf16>);
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, std::optional<at::Tensor> out,
                           int64_t impl, int64_t window, std::optional<at::Tensor> kv_end, int64_t flash_min_queries) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "k_cache/v_cache must be [num_pages, page_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention (CPU op) needs CPU tensors");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "q must be float32 or bfloat16, got ", dt);
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt, "q/k_cache/v_cache dtypes differ");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim mismatch between q and k_cache");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq (", Hq, ") must be a multiple of Hkv (", Hkv, ")");
  TORCH_CHECK(D > 0 && D <= 1024, "head_dim must be in [1, 1024]");
  TORCH_CHECK(page_size > 0, "page_size must be > 0");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be the contiguous (stride 1) dimension");

  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block_table, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_table.device().is_cpu() && seq_lens.device().is_cpu() && query_start_loc.device().is_cpu(),
              "metadata tensors must be on CPU");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1, "block_table must be [B, max_pages] with stride(1)==1");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "seq_lens must be a contiguous 1-D tensor");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous(),
              "query_start_loc must be a contiguous 1-D tensor");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1, "query_start_loc must have B+1 entries");
  TORCH_CHECK(block_table.size(0) >= B, "block_table has fewer rows than seq_lens");
  const int64_t max_pages = block_table.size(1);

  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0);
  TORCH_CHECK(qsl[0] >= 0 && qsl[B] <= T, "query_start_loc out of range [0, T]");
  TORCH_CHECK(window >= 0 && window <= std::numeric_limits<int32_t>::max(), "window must be >= 0, got ", window);
  const int32_t* ke = nullptr;
  if (kv_end.has_value() && kv_end->defined()) {
    TORCH_CHECK(kv_end->scalar_type() == at::kInt && kv_end->device().is_cpu(), "kv_end must be an int32 CPU tensor");
    TORCH_CHECK(kv_end->dim() == 1 && kv_end->size(0) == T && kv_end->is_contiguous(),
                "kv_end must be a contiguous [T] tensor");
    ke = kv_end->data_ptr<int32_t>();
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = int64_t(qsl[b + 1]) - qsl[b];
    TORCH_CHECK(ql >= 0, "query_start_loc must be non-decreasing");
    if (ql == 0) continue;
    TORCH_CHECK(sl[b] >= ql, "seq_lens[", b, "]=", sl[b], " < number of queries ", ql);
    if (ke != nullptr) {
      for (int64_t j = 0; j < ql; ++j) {
        const int64_t pos = sl[b] - ql + j, end = ke[qsl[b] + j];
        TORCH_CHECK(end > pos && end <= sl[b], "kv_end[", qsl[b] + j, "]=", end, " outside [", pos + 1, ", ", sl[b],
                    "] (its position + 1 .. seq_len)");
      }
    }
    const int64_t np = (int64_t(sl[b]) + page_size - 1) / page_size;
    TORCH_CHECK(np <= max_pages, "seq_lens[", b, "] needs ", np, " pages but block_table has ", max_pages);
    // Pages wholly before the sequence's lowest window start may be stale: neither read nor checked.
    const int64_t first = window > 0 ? std::max<int64_t>(sl[b] - ql - window + 1, 0) / page_size : 0;
    const int32_t* row = bt + b * bt_stride;
    for (int64_t i = first; i < np; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_pages, "block_table[", b, ", ", i, "]=", row[i], " out of range");
  }

  at::Tensor o;
  if (out.has_value() && out->defined()) {
    o = *out;
    TORCH_CHECK(o.sizes() == q.sizes() && o.scalar_type() == dt && o.device().is_cpu() && o.stride(2) == 1,
                "out must be a CPU tensor shaped/typed like q with stride(2)==1");
  } else if (qsl[0] == 0 && qsl[B] == T) {
    o = at::empty_like(q, at::MemoryFormat::Contiguous);
  } else {
    o = at::zeros_like(q, at::MemoryFormat::Contiguous);
  }
  if (T == 0 || B == 0) return o;

  Params P{};
  P.q = static_cast<const char*>(q.data_ptr());
  P.out = static_cast<char*>(o.data_ptr());
  P.k = static_cast<const char*>(k_cache.data_ptr());
  P.v = static_cast<const char*>(v_cache.data_ptr());
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.o_st = o.stride(0);
  P.o_sh = o.stride(1);
  P.k_sp = k_cache.stride(0);
  P.k_ss = k_cache.stride(1);
  P.k_sh = k_cache.stride(2);
  P.v_sp = v_cache.stride(0);
  P.v_ss = v_cache.stride(1);
  P.v_sh = v_cache.stride(2);
  P.bt = bt;
  P.bt_stride = bt_stride;
  P.seq_lens = sl;
  P.qsl = qsl;
  P.kv_end = ke;
  P.window = window;
  P.Hkv = Hkv;
  P.G = Hq / Hkv;
  P.D = D;
  P.page_size = page_size;
  P.c = static_cast<float>(scale) * kLog2e;
  P.part = nullptr;
  P.rows_max = 0;
  P.qb_max = 0;

  const int64_t flash_min = D % 8 == 0 && D <= 512 ? (flash_min_queries < 0 ? kFlashMinQueries : flash_min_queries) : 0;
  if (dt == at::kFloat) {
    run_long_prompts<float>(P, B, impl, flash_min);
    run_all<float>(P, B, impl, flash_min);
  } else {
    run_long_prompts<bf16>(P, B, impl, flash_min);
    run_all<bf16>(P, B, impl, flash_min);
  }
  return o;
}

// The step's new K/V rows into their cache slots: k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]
// (and the same for v), as store_kv() in base.py does with two index_copy_ calls; those took
// ~16 us per layer at decode batch 64 (SmolLM2 shapes), this ~2 us. k/v may be strided views into
// the fused qkv projection's output.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must be [T, Hkv, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k_cache/v_cache must be [P, S, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v heads or head_dim differ from the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v must have a contiguous last dim");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k/v and cache dtypes differ");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "store_kv runs on CPU tensors");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be a contiguous int64 [T] CPU tensor");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = D * static_cast<int64_t>(k.element_size());
  const int64_t slot_elems = H * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "]=", slots[t], " out of range");
  }
  const int64_t esz = k.element_size();
  const int64_t k_st = k.stride(0), k_sh = k.stride(1), v_st = v.stride(0), v_sh = v.stride(1);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t dst = slots[t] * slot_elems * esz;
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kc + dst + h * row_bytes, kp + (t * k_st + h * k_sh) * esz, row_bytes);
        std::memcpy(vc + dst + h * row_bytes, vp + (t * v_st + h * v_sh) * esz, row_bytes);
      }
    }
  });
}

std::string build_info() {
  std::string s = vlm_simd::isa_info();
#ifdef _OPENMP
  s += " openmp=1";
#else
  s += " openmp=0";
#endif
  return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine fused paged attention (CPU)";
  m.def("paged_attention", &paged_attention,
        "Paged attention: causal, sliding-window, per-token KV ends (see reference.py for the contract)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("out") = py::none(), py::arg("impl") = 0,
        py::arg("window") = 0, py::arg("kv_end") = py::none(), py::arg("flash_min_queries") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv, "Write the step's K/V rows into their cache slots", py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>());
  m.def("build_info", &build_info, "Compile-time ISA features of this build");
}
