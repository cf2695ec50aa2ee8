// bf16 linear on the CPU's bf16 dot-product instruction (AVX-512 BF16, vdpbf16ps), for the decode
// batches of the bf16 model: y[M, N] = x[M, K] W^T (+ bias), bf16 in and out, fp32 sums.
//
// Why not oneDNN's packed bf16 kernel, which runs the same instruction: at decode batches every
// linear's weights come from memory (SmolLM2's decoder is ~212 MB of bf16, the L3 32 MB), and
// oneDNN fetches each block of weights when it first multiplies it, so the memory stream and the
// arithmetic take turns. All SmolLM2 linears of a step at M = 64 on the 2-core Zen 5 took 21.6 ms
// with each layer's weights hot in cache and 26.6 ms with the 30 layers' weights cycling through
// memory (the ~5 ms is the 212 MB at the memory's read speed). Here each thread prefetches the
// next column group's weights while it multiplies the current one, spread over the whole group:
// the same step (with the 57 MB lm_head) took 24.1 / 10.4 / 7.7 ms at M = 64 / 16 / 1 without the
// prefetch and 20.8 / 6.9 / 5.9 with it; oneDNN's 27.6 / 12.7 / 8.9.
//
// Layout: panels of 16 output columns, [P][K/2][32]: one 64-byte row holds inputs 2i and 2i+1 of
// the panel's 16 columns, interleaved (column c's pair at elements 2c, 2c+1), which is the operand
// vdpbf16ps multiplies by a broadcast pair of x. K and N are zero-padded to even and to 16.
// A tile is MR rows x NP panels of fp32 accumulators held in registers over the whole K loop, so
// every output is one chain of dot products over k whatever the batch: rows do not depend on M.
// The sum is rounded to bf16 once, after the bias is added in fp32, as oneDNN's kernel does.
// A gate/up projection can instead be packed with 8 gate and their 8 up columns per panel
// (pack_gate_up), and dot_silu_mul writes silu(gate) * up from the registers: the MLP's [T, 2I]
// intermediate is never stored, and the separate SiLU-and-mul pass (1.2 ms of a ~42 ms SmolLM2
// decode step at batch 64 on the 2-core Zen 5) is gone.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define VLM_BF16_DOT 1
#else
#define VLM_BF16_DOT 0
#endif

// AMX tiles (Sapphire Rapids and later) in a build for such a CPU: the amx_* products below.
#if VLM_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define VLM_AMX 1
#else
#define VLM_AMX 0
#endif

namespace {

constexpr int64_t kPanel = 16;        // output columns per panel: one 16-lane fp32 vector
constexpr int64_t kPairRow = 2 * kPanel;  // bf16 elements in one panel row (16 columns x 2 inputs)
constexpr int64_t kLineBytes = 64;

void check_bf16_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-d with a contiguous last dim");
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// [N, K] bf16 -> [ceil(N/16)][ceil(K/2)][32] pair-interleaved panels.
at::Tensor pack_pairs(const at::Tensor& w) {
  check_bf16_matrix(w, "w");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
  at::Tensor out = at::zeros({panels, pairs, kPairRow}, w.options());
  const uint16_t* src = bits(w);
  uint16_t* dst = bits_mut(out);
  const int64_t ws = w.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const uint16_t* row = src + (p * kPanel + c) * ws;
        uint16_t* col = dst + p * pairs * kPairRow + 2 * c;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * kPairRow + (i % 2)] = row[i];
      }
    }
  });
  return out;
}

#if VLM_BF16_DOT

// Spreads the prefetch of `left` cache lines over `iters` loop iterations (Bresenham): a tile
// asks for its share of the next column group's weights a little at a time, so the memory stream
// runs beside the dot products instead of in bursts. Into L1 (T0) for the dot kernel, where T0
// measured a little faster than T1; into L2 (T1) for the AMX tiles, whose group of weights fills
// most of L1 itself (SmolLM2's decoder linears at M = 64 on the 2-core Sapphire Rapids, weights
// from memory: 0.52 ms a layer with T0, 0.35-0.37 with T1).
template <_mm_hint Hint>
struct PrefetchStream {
  const char* next;
  int64_t lines;  // to prefetch over the whole loop
  int64_t iters;
  int64_t left = lines;
  int64_t credit = 0;

  inline void step() {
    credit += lines;
    while (credit >= iters && left > 0) {
      _mm_prefetch(next, Hint);
      next += kLineBytes;
      credit -= iters;
      --left;
    }
  }
};

// x rounded to bf16 (nearest even) and widened back.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// silu(g) * u on the low 8 lanes of each of a and b (gate columns) and their high 8 lanes (the
// matching up columns): 16 products, a's 8 then b's. Rounded to bf16 where Transformers' bf16 MLP
// materialises a tensor (the two projections, the activation, the product), as the unfused path
// (this kernel's linear, then fused_ops' silu_and_mul) rounds them: near-tied greedy tokens of
// real models flipped with one rounding of the fp32 sums instead.
inline __m256i silu_gate_16(__m512 a, __m512 b) {
  const __m512 g = round_bf16(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
  const __m512 u = round_bf16(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  // sigmoid(g) = 1 / (1 + 2^(-g log2 e)), the power clamped so that it stays finite and normal.
  const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)),
                                               _mm512_set1_ps(-126.f)),
                                 _mm512_set1_ps(126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // 2^f on [-0.5, 0.5], degree 6 (rel. error ~2e-7)
  __m512 e = _mm512_set1_ps(1.5403530393381606e-04f);
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.3333558146428443e-03f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(9.6181291076284770e-03f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(5.5504108664821580e-02f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(2.4022650695910071e-01f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(6.9314718055994531e-01f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
  e = _mm512_scalef_ps(e, n);
  const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u));
}

// What a tile writes: the linear's outputs (plus bias), or, for a gate/up projection packed by
// pack_gate_up, silu(gate) * up: each panel holds 8 gate columns and their 8 up columns.
enum class Epilogue { kLinear, kSiluGate };

// Outputs per panel for each epilogue.
template <Epilogue E>
constexpr int64_t kPanelOut = E == Epilogue::kLinear ? kPanel : kPanel / 2;

// One row's outputs from its NP panel sums: with kLinear the bias (fp32 or null) added before the
// one rounding to bf16, with kSiluGate silu(gate) * up (ncols a multiple of 8). The dot kernel's
// tiles and the AMX tiles end here alike.
template <int NP, Epilogue E>
inline void write_row(const __m512* acc, const float* bias, uint16_t* y, int64_t ncols) {
  if constexpr (E == Epilogue::kSiluGate) {
    int j = 0;
    for (; j + 1 < NP && (j + 1) * 8 < ncols; j += 2)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * 8), silu_gate_16(acc[j], acc[j + 1]));
    if (j < NP && j * 8 < ncols)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + j * 8), _mm256_castsi256_si128(silu_gate_16(acc[j], acc[j])));
    return;
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t c0 = j * kPanel;
    if (c0 >= ncols) break;
    const __mmask16 mask = ncols - c0 >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << (ncols - c0)) - 1);
    const __m512 bj = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    _mm256_mask_storeu_epi16(y + c0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[j], bj)));
  }
}

// MR rows of x (row stride xs, in bf16 elements) times NP panels (`ps` elements apart) over all
// `pairs` input pairs; writes MR x ncols bf16 outputs (row stride ys): with kLinear the bias (fp32
// or null) added before the one rounding, with kSiluGate silu(gate) * up (ncols a multiple of 8).
template <int MR, int NP, Epilogue E>
inline void dot_tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ps, int64_t pairs, const float* bias,
                     uint16_t* y, int64_t ys, int64_t ncols, PrefetchStream<_MM_HINT_T0>& pf) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh b[NP];
    for (int j = 0; j < NP; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * ps + i * kPairRow);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * i, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
    pf.step();
  }
  for (int r = 0; r < MR; ++r) write_row<NP, E>(acc[r], bias, y + r * ys, ncols);
}

constexpr int kTileRows = 8;   // MR: 8 rows x 3 panels = 24 accumulators of the 32 vector registers
constexpr int kTilePanels = 3;

template <int NP, Epilogue E>
inline void dot_rows(const uint16_t* x, int64_t xs, int64_t m, const uint16_t* w, int64_t ps, int64_t pairs,
                     const float* bias, uint16_t* y, int64_t ys, int64_t ncols, const uint16_t* next, int64_t next_lines) {
  const int64_t blocks = (m + kTileRows - 1) / kTileRows;
  // Each row block prefetches its share of the next group, spread over its K loop.
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t r = blk * kTileRows;
    const int64_t lo = next_lines * blk / blocks, hi = next_lines * (blk + 1) / blocks;
    PrefetchStream<_MM_HINT_T0> pf{reinterpret_cast<const char*>(next) + lo * kLineBytes, next ? hi - lo : 0, pairs};
    const uint16_t* xr = x + r * xs;
    uint16_t* yr = y + r * ys;
    switch (std::min<int64_t>(kTileRows, m - r)) {
      case 8: dot_tile<8, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 7: dot_tile<7, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 6: dot_tile<6, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 5: dot_tile<5, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 4: dot_tile<4, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 3: dot_tile<3, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      case 2: dot_tile<2, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
      default: dot_tile<1, NP, E>(xr, xs, w, ps, pairs, bias, yr, ys, ncols, pf); break;
    }
  }
}

// Column groups are split into one contiguous range per thread. A thread runs its own range
// from the front, prefetching the group after the one it multiplies; when it is done it takes
// groups from the back of the range with the most left. A static split left each thread idle ~5%
// of the kernel's time at decode batch 64 (SmolLM2, 2-core Zen 5): in a VM the two cores do not
// run at the same speed from one product to the next.
class GroupRanges {
 public:
  GroupRanges(int64_t groups, int64_t parts) : slots_(parts) {
    for (int64_t t = 0; t < parts; ++t) slots_[t].range.store(pack(groups * t / parts, groups * (t + 1) / parts));
  }
  int64_t parts() const { return static_cast<int64_t>(slots_.size()); }

  // The next group of range t from its front (-1 when empty); `next` is the one after it, if any.
  int64_t take_front(int64_t t, int64_t& next) {
    auto& r = slots_[t].range;
    uint64_t v = r.load(std::memory_order_relaxed);
    while (front(v) < back(v)) {
      if (r.compare_exchange_weak(v, pack(front(v) + 1, back(v)), std::memory_order_relaxed)) {
        next = front(v) + 1 < back(v) ? front(v) + 1 : -1;
        return front(v);
      }
    }
    return -1;
  }

  // A group from the back of the range with the most left (-1 when all are empty); `next` is the
  // one before it, if any.
  int64_t steal(int64_t& next) {
    while (true) {
      int64_t victim = -1, most = 0;
      for (int64_t t = 0; t < parts(); ++t) {
        const uint64_t v = slots_[t].range.load(std::memory_order_relaxed);
        if (back(v) - front(v) > most) {
          most = back(v) - front(v);
          victim = t;
        }
      }
      if (victim < 0) return -1;
      auto& r = slots_[victim].range;
      uint64_t v = r.load(std::memory_order_relaxed);
      if (front(v) < back(v) && r.compare_exchange_weak(v, pack(front(v), back(v) - 1), std::memory_order_relaxed)) {
        next = back(v) - 2 >= front(v) ? back(v) - 2 : -1;
        return back(v) - 1;
      }
    }
  }

 private:
  struct alignas(64) Slot {  // one cache line each: the owner and a thief touch only theirs
    std::atomic<uint64_t> range{0};
  };
  static uint64_t pack(int64_t f, int64_t b) { return (uint64_t(f) << 32) | uint64_t(b); }
  static int64_t front(uint64_t v) { return int64_t(v >> 32); }
  static int64_t back(uint64_t v) { return int64_t(v & 0xFFFFFFFFu); }
  std::vector<Slot> slots_;
};

// x [m, 2*pairs] (row stride xs) times the panels into y [m, n] (n outputs: columns, or with
// kSiluGate gated products).
template <Epilogue E>
void dot_product(const uint16_t* x, int64_t xs, int64_t m, const uint16_t* wp, int64_t panels, int64_t pairs,
                 const float* bias, uint16_t* y, int64_t n) {
  constexpr int64_t kOut = kPanelOut<E>;
  const int64_t ps = pairs * kPairRow;  // elements per panel
  const int64_t groups = (panels + kTilePanels - 1) / kTilePanels;
  // Group g, prefetching group `next` (-1: none) while it multiplies.
  auto run_group = [&](int64_t g, int64_t next) {
    const int64_t p0 = g * kTilePanels, np = std::min<int64_t>(kTilePanels, panels - p0);
    const int64_t c0 = p0 * kOut, ncols = std::min<int64_t>(np * kOut, n - c0);
    const uint16_t* w = wp + p0 * ps;
    const int64_t next_np = next >= 0 ? std::min<int64_t>(kTilePanels, panels - next * kTilePanels) : 0;
    const uint16_t* nw = next_np ? wp + next * kTilePanels * ps : nullptr;
    const int64_t next_lines = next_np * ps * 2 / kLineBytes;
    const float* b = bias ? bias + c0 : nullptr;
    switch (np) {
      case 3: dot_rows<3, E>(x, xs, m, w, ps, pairs, b, y + c0, n, ncols, nw, next_lines); break;
      case 2: dot_rows<2, E>(x, xs, m, w, ps, pairs, b, y + c0, n, ncols, nw, next_lines); break;
      default: dot_rows<1, E>(x, xs, m, w, ps, pairs, b, y + c0, n, ncols, nw, next_lines); break;
    }
  };
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), groups);
  GroupRanges ranges(groups, std::max<int64_t>(threads, 1));
  auto work = [&](int64_t begin, int64_t end) {
    int64_t next = -1;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = ranges.take_front(t, next); g >= 0; g = ranges.take_front(t, next)) run_group(g, next);
    for (int64_t g = ranges.steal(next); g >= 0; g = ranges.steal(next)) run_group(g, next);
  };
  if (ranges.parts() > 1)
    at::parallel_for(0, ranges.parts(), 1, work);
  else
    work(0, 1);
}


#if VLM_AMX

// AMX: the same pairs are the B operand of TDPBF16PS as they lie. 16 pair rows of a panel (32
// inputs x its 16 columns, 1 KB, contiguous) are one tile; 16 rows x 32 inputs of x another; a
// TDPBF16PS adds their product to a 16 x 16 fp32 tile. A block is up to 2 row tiles x 2 panels:
// 4 accumulator tiles, 2 of x, 2 of weights (the 8 tile registers), held over the whole K loop,
// so every output is one chain over k whatever the batch, as in the dot kernel.
//
// Why not oneDNN's AMX GEMM, which PackedLinear runs above the dot kernel's rows: at decode
// batches (16-64 rows) its calls cost more than the weights take to stream. SmolLM2's four decoder
// linears of a layer at M = 64, weights cycling through memory, took 0.43 ms (16.7 GB/s) on the
// 2-core Sapphire Rapids; the tiles need ~0.06 ms of that arithmetic.
constexpr int64_t kTileK = 32;                   // inputs per tile: 16 pairs, one 64-byte tile row
constexpr int64_t kTileBytes = 64;               // bytes per tile row (x and weight tiles alike)
constexpr int64_t kPanelTileElems = kPanel * kPairRow;  // a 16-pair-row panel slice: one weight tile

// Tile registers (literals: GCC's tile intrinsics paste the number into the assembly): tmm0-3 the
// sums C(r, j) of row tile r times panel j at 2r + j, tmm4-5 the row tiles of x, tmm6-7 the panels.

// Linux hands out the AMX tile state only on request (once per process).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes (palette 1). Each thread loads it before its tiles and releases
// them after, so oneDNN's AMX kernels (which configure their own) and ours never share a config.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = kTileBytes;
      rows[t] = 16;
    }
  }
};

// RT (1-2) row tiles at a0 / a1 (row strides in bytes) times NP (1-2) panels (w, `ps` elements
// apart) over `ksteps` x 32 inputs, the sums stored to c: [RT * 16 rows][NP * 16] fp32.
template <int RT, int NP>
inline void amx_block(const uint16_t* a0, int64_t as0, const uint16_t* a1, int64_t as1, const uint16_t* w,
                      int64_t ps, int64_t ksteps, float* c, PrefetchStream<_MM_HINT_T1>& pf) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && NP > 1) _tile_zero(3);
  for (int64_t i = 0; i < ksteps; ++i) {
    _tile_loadd(6, w + i * kPanelTileElems, kTileBytes);
    if constexpr (NP > 1) _tile_loadd(7, w + ps + i * kPanelTileElems, kTileBytes);
    _tile_loadd(4, a0 + i * kTileK, as0);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) {
      _tile_loadd(5, a1 + i * kTileK, as1);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbf16ps(3, 5, 7);
    }
    pf.step();
  }
  constexpr int64_t cs = NP * kPanel * sizeof(float);  // c's row stride in bytes
  _tile_stored(0, c, cs);
  if constexpr (NP > 1) _tile_stored(1, c + kPanel, cs);
  if constexpr (RT > 1) _tile_stored(2, c + 16 * NP * kPanel, cs);
  if constexpr (RT > 1 && NP > 1) _tile_stored(3, c + 16 * NP * kPanel + kPanel, cs);
}

// Row tiles of x as the tiles read them: full tiles straight from x, a last partial one from a
// zero-padded copy (rows past m must not be read from x's memory).
struct RowTiles {
  const uint16_t* x;
  int64_t xs_bytes;
  const uint16_t* tail;  // 16 x K, or null when m is a multiple of 16
  int64_t tail_bytes;
  int64_t m;
  int64_t count() const { return (m + 15) / 16; }
  const uint16_t* ptr(int64_t t) const { return tail && t == count() - 1 ? tail : x + t * 16 * (xs_bytes / 2); }
  int64_t stride(int64_t t) const { return tail && t == count() - 1 ? tail_bytes : xs_bytes; }
  int64_t rows(int64_t t) const { return std::min<int64_t>(16, m - t * 16); }
};

// x's row tiles times one group of NP panels into y's columns c0..c0+ncols.
template <int NP, Epilogue E>
void amx_group(const RowTiles& rt, const uint16_t* w, int64_t ps, int64_t ksteps, const float* bias, uint16_t* y,
               int64_t ys, int64_t ncols, const uint16_t* next, int64_t next_lines) {
  alignas(64) float c[32 * NP * kPanel];
  const int64_t tiles = rt.count(), blocks = (tiles + 1) / 2;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t t0 = 2 * blk;
    const int64_t lo = next_lines * blk / blocks, hi = next_lines * (blk + 1) / blocks;
    PrefetchStream<_MM_HINT_T1> pf{reinterpret_cast<const char*>(next) + lo * kLineBytes, next ? hi - lo : 0, ksteps};
    const bool two = t0 + 1 < tiles;
    if (two)
      amx_block<2, NP>(rt.ptr(t0), rt.stride(t0), rt.ptr(t0 + 1), rt.stride(t0 + 1), w, ps, ksteps, c, pf);
    else
      amx_block<1, NP>(rt.ptr(t0), rt.stride(t0), nullptr, 0, w, ps, ksteps, c, pf);
    const int64_t rows = rt.rows(t0) + (two ? rt.rows(t0 + 1) : 0);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc[NP];
      for (int j = 0; j < NP; ++j) acc[j] = _mm512_load_ps(c + (r * NP + j) * kPanel);
      write_row<NP, E>(acc, bias, y + (t0 * 16 + r) * ys, ncols);
    }
  }
}

constexpr int64_t kAmxGroupPanels = 2;

// x [m, K] (K a multiple of 32) times the panels into y [m, n], column groups of 2 panels split
// over the threads as in dot_product, each thread prefetching the group after the one it multiplies.
template <Epilogue E>
void amx_product(const RowTiles& rt, int64_t k, const uint16_t* wp, int64_t panels, const float* bias, uint16_t* y,
                 int64_t n) {
  constexpr int64_t kOut = kPanelOut<E>;
  const int64_t pairs = k / 2, ps = pairs * kPairRow, ksteps = k / kTileK;
  const int64_t groups = (panels + kAmxGroupPanels - 1) / kAmxGroupPanels;
  auto run_group = [&](int64_t g, int64_t next) {
    const int64_t p0 = g * kAmxGroupPanels, np = std::min<int64_t>(kAmxGroupPanels, panels - p0);
    const int64_t c0 = p0 * kOut, ncols = std::min<int64_t>(np * kOut, n - c0);
    const int64_t next_np = next >= 0 ? std::min<int64_t>(kAmxGroupPanels, panels - next * kAmxGroupPanels) : 0;
    const uint16_t* nw = next_np ? wp + next * kAmxGroupPanels * ps : nullptr;
    const int64_t next_lines = next_np * ps * 2 / kLineBytes;
    const float* b = bias ? bias + c0 : nullptr;
    if (np == 2)
      amx_group<2, E>(rt, wp + p0 * ps, ps, ksteps, b, y + c0, n, ncols, nw, next_lines);
    else
      amx_group<1, E>(rt, wp + p0 * ps, ps, ksteps, b, y + c0, n, ncols, nw, next_lines);
  };
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), groups);
  GroupRanges ranges(groups, std::max<int64_t>(threads, 1));
  auto work = [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    int64_t next = -1;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = ranges.take_front(t, next); g >= 0; g = ranges.take_front(t, next)) run_group(g, next);
    for (int64_t g = ranges.steal(next); g >= 0; g = ranges.steal(next)) run_group(g, next);
    _tile_release();
  };
  if (ranges.parts() > 1)
    at::parallel_for(0, ranges.parts(), 1, work);
  else
    work(0, 1);
}

#endif  // VLM_AMX

#endif  // VLM_BF16_DOT

// x [m, K] and pairs from `packer` checked against each other, for either product.
void check_operands(const at::Tensor& x, const at::Tensor& packed, const char* packer) {
  TORCH_CHECK(VLM_BF16_DOT, "this build has no AVX-512 BF16: use another linear");
  check_bf16_matrix(x, "x");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == kPairRow &&
                  packed.is_contiguous(),
              "packed must come from ", packer);
  const int64_t k = x.size(1), pairs = packed.size(1);
  TORCH_CHECK(pairs == (k + 1) / 2, "x has ", k, " features, the weight ", 2 * pairs, " (padded to even)");
}

// x as the kernel reads it: an odd K reads one pair past the row, so x gets a zero column and that
// pair is (x, 0).
at::Tensor even_columns(const at::Tensor& x) { return x.size(1) % 2 ? at::constant_pad_nd(x, {0, 1}) : x; }

// A linear's operands checked (x against pack_pairs' panels, n against their columns); returns the
// bias as fp32, undefined without one. The bias is added in fp32: PackedLinear keeps an fp32 copy,
// so this converts nothing per call.
at::Tensor checked_linear_bias(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                               const std::optional<at::Tensor>& bias) {
  check_operands(x, packed, "pack_pairs");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the panels");
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias must have n elements");
  return bias->reshape({n}).to(at::kFloat).contiguous();
}

// A gated product's operands checked (x against pack_gate_up's panels, inter against their outputs).
void check_gated(const at::Tensor& x, const at::Tensor& packed, int64_t inter) {
  check_operands(x, packed, "pack_gate_up");
  TORCH_CHECK(inter % 8 == 0 && packed.size(0) * 8 == inter, "inter does not match the gate/up panels");
}

const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  const at::Tensor bias32 = checked_linear_bias(x, packed, n, bias);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xin = even_columns(x);
#if VLM_BF16_DOT
  dot_product<Epilogue::kLinear>(bits(xin), xin.stride(0), m, bits(packed), packed.size(0), packed.size(1),
                                 data_or_null(bias32), bits_mut(y), n);
#endif
  return y;
}

// A gate/up projection [2I, K] (gate rows, then up rows; I a multiple of 8) -> pairs whose panel p
// holds gate columns 8p..8p+7 and then the same up columns, for dot_silu_mul.
at::Tensor pack_gate_up(const at::Tensor& w) {
  check_bf16_matrix(w, "w");
  const int64_t inter = w.size(0) / 2, k = w.size(1);
  TORCH_CHECK(w.size(0) % 16 == 0, "the gate/up weight needs 2I rows with I a multiple of 8");
  return pack_pairs(w.reshape({2, inter / 8, 8, k}).permute({1, 0, 2, 3}).reshape({2 * inter, k}).contiguous());
}

// silu(x W_gate^T) * (x W_up^T) [m, I] in one pass over pack_gate_up's pairs: the MLP's
// activation is applied to the sums in registers (rounded where the unfused path rounds, see
// silu_gate_16), and only the [m, I] product is written.
at::Tensor dot_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter) {
  check_gated(x, packed, inter);
  const int64_t m = x.size(0), panels = packed.size(0);
  at::Tensor y = at::empty({m, inter}, x.options());
  if (m == 0) return y;
  const at::Tensor xin = even_columns(x);
#if VLM_BF16_DOT
  dot_product<Epilogue::kSiluGate>(bits(xin), xin.stride(0), m, bits(packed), panels, packed.size(1), nullptr,
                                   bits_mut(y), inter);
#endif
  return y;
}

bool dot_linear_available() { return VLM_BF16_DOT; }

// The AMX products exist in this build and the kernel let this process use the tiles.
bool amx_available() {
#if VLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x's checks for the AMX products (K a multiple of 32, one tile's inputs) and, where m is not a
// multiple of 16, the zero-padded copy of its last rows that the last row tile reads.
at::Tensor amx_tail(const at::Tensor& x) {
  TORCH_CHECK(amx_available(), "this build or process has no AMX tiles: use another linear");
  TORCH_CHECK(x.size(1) % 32 == 0, "the AMX linear needs K a multiple of 32, got ", x.size(1));
  const int64_t m = x.size(0), full = m / 16 * 16;
  if (m == full) return at::Tensor();
  at::Tensor tail = at::zeros({16, x.size(1)}, x.options());
  tail.narrow(0, 0, m - full).copy_(x.narrow(0, full, m - full));
  return tail;
}

#if VLM_AMX
RowTiles row_tiles(const at::Tensor& x, const at::Tensor& tail) {
  return RowTiles{bits(x), x.stride(0) * 2, tail.defined() ? bits(tail) : nullptr, x.size(1) * 2, x.size(0)};
}
#endif

// dot_linear on AMX tiles, for more rows than the dot kernel is quick at: the same pairs, the same
// one rounding after the fp32 bias.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  const at::Tensor bias32 = checked_linear_bias(x, packed, n, bias);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor tail = amx_tail(x);
#if VLM_AMX
  amx_product<Epilogue::kLinear>(row_tiles(x, tail), x.size(1), bits(packed), packed.size(0), data_or_null(bias32),
                                 bits_mut(y), n);
#endif
  return y;
}

// dot_silu_mul on AMX tiles: pack_gate_up's pairs, the same epilogue.
at::Tensor amx_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter) {
  check_gated(x, packed, inter);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, inter}, x.options());
  if (m == 0) return y;
  const at::Tensor tail = amx_tail(x);
#if VLM_AMX
  amx_product<Epilogue::kSiluGate>(row_tiles(x, tail), x.size(1), bits(packed), packed.size(0), nullptr, bits_mut(y),
                                   inter);
#endif
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine bf16 linear on vdpbf16ps (AVX-512 BF16)";
  m.def("pack_pairs", &pack_pairs, py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("dot_linear", &dot_linear, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_gate_up", &pack_gate_up, py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("dot_silu_mul", &dot_silu_mul, py::arg("x"), py::arg("packed"), py::arg("inter"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dot_linear_available", &dot_linear_available);
  m.def("amx_linear", &amx_linear, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_silu_mul", &amx_silu_mul, py::arg("x"), py::arg("packed"), py::arg("inter"),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_available", &amx_available);
}
