// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) on the CPU: the short causal depthwise
// convolution with its per-sequence window, and the gated delta rule, chunked for prefill and
// recurrent for decode. Every op takes a packed batch of token spans (cu_seqlens, one span per
// sequence) and each sequence's slot index into a state pool, which it reads and updates in place.
//
// Numerics follow Transformers' torch implementations (the oracle in tests/test_gated_delta.py):
// everything is computed in fp32 and the recurrent state stays fp32. In bf16, the values that
// Transformers materialises as bf16 tensors are rounded to bf16 here too (the conv output before
// and after SiLU, beta = sigmoid(b), the attention output); only summation order and the exp
// polynomial differ (a few fp32 ulps).
//
// The chunked rule is the UT-transform form Transformers uses (chunks of 64 tokens from the span's
// start), rearranged to solve one triangular system per chunk instead of two: with S the state at
// the chunk's start, G_i the within-chunk cumulative log decay and A_ij = beta_i (k_i.k_j) e^(G_i-G_j)
// for j < i,
//   u_i = beta_i (v_i - e^(G_i) k_i S) - sum_{j<i} A_ij u_j                       (forward substitution)
//   o_i = e^(G_i) q_i S + sum_{j<=i} (q_i.k_j) e^(G_i-G_j) u_j
//   S'  = e^(G_last) S + sum_j e^(G_last-G_j) k_j^T u_j
// which is Transformers' `v_new = solve(v_beta) - solve(k_beta e^G) S` with the subtraction moved
// before the (linear) solve. The state is read three times per chunk as small matrix products
// instead of twice per token, which is what makes a long prefill fast.
//
// Vectors: GCC vector extensions of the build's width (16 fp32 lanes with AVX-512, 8 with AVX2,
// 4 otherwise); the build picks the -march (kernels/cpu_isa.py: the host's, or x86-64-v3 when
// VLM_ENGINE_ISA=avx2), so each CPU runs the widest path it has.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec vload_f(const float* p);
inline void vstore_f(float* p, vec v);
inline vec vload(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec vload_f(const float* p) { return vload(p); }
inline void vstore_f(float* p, vec v) { vstore(p, v); }
inline vec vset(float x) { return vec{} + x; }
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vbits __attribute__((vector_size(kLanes * sizeof(uint16_t))));

constexpr int kChunk = 64;  // Transformers' chunk_size

// bf16 <-> fp32 on raw bits (round-to-nearest-even as c10::BFloat16, NaN kept) without its NaN branch.
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

// Element access: fp32 rounds nothing; bf16 rounds what Transformers keeps as a bf16 tensor.
struct F32 {
  using raw_t = float;
  static inline float load(raw_t v) { return v; }
  static inline raw_t store(float v) { return v; }
  static inline float round(float v) { return v; }
  static inline vec vload(const raw_t* p) { return ::vload_f(p); }
  static inline void vstore(raw_t* p, vec v) { ::vstore_f(p, v); }
  static inline vec vround(vec v) { return v; }
  static raw_t* data(const at::Tensor& t) { return t.data_ptr<float>(); }
};
struct BF16 {
  using raw_t = uint16_t;
  static inline float load(raw_t v) { return bits_to_float(v); }
  static inline raw_t store(float v) { return float_to_bits(v); }
  static inline float round(float v) { return bits_to_float(float_to_bits(v)); }
  static inline vec vload(const raw_t* p) {
    vbits b;
    std::memcpy(&b, p, sizeof b);
    const vuint u = __builtin_convertvector(b, vuint) << 16;
    vec f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline vbits to_bits(vec f) {
    vuint u;
    std::memcpy(&u, &f, sizeof u);
    const vuint rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const vint nan = f != f;
    return __builtin_convertvector(nan ? vuint{} + 0x7FC0u : rounded, vbits);
  }
  static inline void vstore(raw_t* p, vec v) {
    const vbits b = to_bits(v);
    std::memcpy(p, &b, sizeof b);
  }
  static inline vec vround(vec v) {
    const vuint u = __builtin_convertvector(to_bits(v), vuint) << 16;
    vec f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static raw_t* data(const at::Tensor& t) { return reinterpret_cast<raw_t*>(t.data_ptr<c10::BFloat16>()); }
};

// exp(x) to ~1 fp32 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
// exponent bits), written so that the SiLU loop vectorises; inputs are clamped to [-88, 88].
inline float exp_poly(float x) {
  const float xc = x < -88.0f ? -88.0f : (x > 88.0f ? 88.0f : x);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
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

// exp_poly on a vector, step for step.
inline vec vexp(vec x) {
  vec xc = x < vset(-88.0f) ? vset(-88.0f) : x;
  xc = xc > vset(88.0f) ? vset(88.0f) : xc;
  const vec n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vec r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  vec p = vset(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec y = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Spans from cu_seqlens (int64 [B + 1]) and the slots (int64 [B]) they use, checked against the pool.
struct Spans {
  const int64_t* cu;
  const int64_t* slots;
  int64_t count;
};

Spans check_spans(const at::Tensor& cu_seqlens, const at::Tensor& slots, int64_t tokens, int64_t pool_slots) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "cu_seqlens and slots must be int64");
  TORCH_CHECK(cu_seqlens.dim() == 1 && slots.dim() == 1 && cu_seqlens.is_contiguous() && slots.is_contiguous(),
              "cu_seqlens and slots must be contiguous 1-D tensors");
  const int64_t count = slots.size(0);
  TORCH_CHECK(cu_seqlens.size(0) == count + 1, "cu_seqlens must have one entry more than slots");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[count] == tokens, "cu_seqlens must run from 0 to the number of tokens (", tokens, ")");
  for (int64_t s = 0; s < count; ++s) {
    TORCH_CHECK(cu[s + 1] >= cu[s], "cu_seqlens must not decrease");
    TORCH_CHECK(sl[s] >= 0 && sl[s] < pool_slots, "slot ", sl[s], " is outside the pool (", pool_slots, " slots)");
    for (int64_t r = 0; r < s; ++r) TORCH_CHECK(sl[r] != sl[s], "slot ", sl[s], " is given twice");
  }
  return {cu, sl, count};
}

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv1d with a carried window.
//
// Row-major: each task takes a run of a span's tokens and, for each, every channel with the taps
// transposed once per call to [kernel][channels] (the channel loop then reads only contiguous rows).
// Looping channel blocks outside and tokens inside (rows 24 KB apart at Qwen3.5's 6144 channels)
// ran a 1k-token prefill at ~8 GB/s; rows in order stream.

constexpr int64_t kConvTokens = 64;  // tokens per task

template <typename E>
void conv_rows(const typename E::raw_t* x, int64_t x_stride, const float* taps, const float* bias,
               const typename E::raw_t* window_rows, typename E::raw_t* out, int64_t t0, int64_t t1, int64_t kernel,
               int64_t channels, bool apply_silu) {
  using raw_t = typename E::raw_t;
  const int64_t window = kernel - 1;
  const raw_t* rows[8];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < kernel; ++j) {
      const int64_t src = t - window + j;  // < 0: from the window carried in
      rows[j] = src < 0 ? window_rows + (window + src) * channels : x + src * x_stride;
    }
    raw_t* dst = out + t * channels;
    int64_t c = 0;
    for (; c + kLanes <= channels; c += kLanes) {
      vec acc = bias ? vload(bias + c) : vset(0.0f);
      for (int64_t j = 0; j < kernel; ++j) acc += vload(taps + j * channels + c) * E::vload(rows[j] + c);
      if (apply_silu) {
        acc = E::vround(acc);  // Transformers' conv output is a tensor of the model's dtype
        acc = acc / (vset(1.0f) + vexp(-acc));
      }
      E::vstore(dst + c, acc);
    }
    for (; c < channels; ++c) {
      float acc = bias ? bias[c] : 0.0f;
      for (int64_t j = 0; j < kernel; ++j) acc += taps[j * channels + c] * E::load(rows[j][c]);
      if (apply_silu) {
        acc = E::round(acc);
        acc = acc / (1.0f + exp_poly(-acc));
      }
      dst[c] = E::store(acc);
    }
  }
}

// The new window: the last `window` inputs of (old window, span). Ascending rows read only rows
// at or after themselves, so shifting a short span's window in place is safe.
template <typename E>
void shift_window(const typename E::raw_t* x, int64_t x_stride, typename E::raw_t* window_rows, int64_t length,
                  int64_t window, int64_t channels) {
  using raw_t = typename E::raw_t;
  for (int64_t r = 0; r < window; ++r) {
    const int64_t src = length - window + r;
    const raw_t* row = src < 0 ? window_rows + (window + src) * channels : x + src * x_stride;
    raw_t* dst = window_rows + r * channels;
    if (row != dst) std::memmove(dst, row, channels * sizeof(raw_t));
  }
}

template <typename E>
at::Tensor conv_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     at::Tensor& pool, const Spans& spans, bool apply_silu) {
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = weight.size(1);
  at::Tensor out = at::empty({tokens, channels}, x.options());
  at::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  std::vector<float> taps(kernel * channels);
  const auto* wp = E::data(weight);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < kernel; ++j) taps[j * channels + c] = E::load(wp[c * kernel + j]);
  const auto* xp = E::data(x);
  auto* pp = E::data(pool);
  auto* op = E::data(out);
  const int64_t x_stride = x.stride(0), slot_stride = pool.stride(0);
  // Tasks: (span, run of kConvTokens tokens), listed by their first token.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t s = 0; s < spans.count; ++s)
    for (int64_t t = spans.cu[s]; t < spans.cu[s + 1]; t += kConvTokens) tasks.emplace_back(s, t);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [s, t0] = tasks[i];
      const int64_t start = spans.cu[s], t1 = std::min(spans.cu[s + 1], t0 + kConvTokens);
      conv_rows<E>(xp + start * x_stride, x_stride, taps.data(), b, pp + spans.slots[s] * slot_stride,
                   op + start * channels, t0 - start, t1 - start, kernel, channels, apply_silu);
    }
  });
  // Only once every output has read the old windows.
  at::parallel_for(0, spans.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      shift_window<E>(xp + spans.cu[s] * x_stride, x_stride, pp + spans.slots[s] * slot_stride,
                      spans.cu[s + 1] - spans.cu[s], kernel - 1, channels);
  });
  return out;
}

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::Tensor conv_pool, const at::Tensor& slots, const at::Tensor& cu_seqlens,
                         bool apply_silu) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [tokens, channels] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t channels = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [channels, kernel] tensor of x's dtype");
  const int64_t kernel = weight.size(1);
  TORCH_CHECK(kernel >= 1 && kernel <= 8, "kernel sizes 1..8 are supported, got ", kernel);
  TORCH_CHECK(conv_pool.dim() == 3 && conv_pool.size(1) == kernel - 1 && conv_pool.size(2) == channels &&
                  conv_pool.stride(2) == 1 && conv_pool.stride(1) == channels &&
                  conv_pool.scalar_type() == x.scalar_type(),
              "conv_pool must be [slots, kernel - 1, channels] with rows contiguous, in x's dtype");
  if (bias.has_value()) TORCH_CHECK(bias->numel() == channels, "bias must have one value per channel");
  const Spans spans = check_spans(cu_seqlens, slots, x.size(0), conv_pool.size(0));
  return x.scalar_type() == at::kBFloat16 ? conv_impl<BF16>(x, weight, bias, conv_pool, spans, apply_silu)
                                          : conv_impl<F32>(x, weight, bias, conv_pool, spans, apply_silu);
}

// ---------------------------------------------------------------------------------------------
// Small dense products on row-major fp32 blocks: C[m][n] (+)= sum_k A[m][k] B[k][n]. kRows rows of A
// at a time against a strip of 4 vectors of B: 4 kRows accumulators and the strip in registers
// (AVX-512 has 32 vector registers: 6 rows, 28 of them; AVX2 16: 3 rows, 16).
constexpr int kRows = kLanes >= 16 ? 6 : 3;

void matmul_rows(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
                 int64_t K, int64_t N, bool accumulate) {
  constexpr int64_t kStrip = 4 * kLanes;
  int64_t n = 0;
  for (; n + kStrip <= N; n += kStrip) {
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) {
      vec acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < 4; ++v) acc[r][v] = accumulate ? vload(C + (m + r) * ldc + n + v * kLanes) : vset(0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const float* b = B + k * ldb + n;
        const vec b0 = vload(b), b1 = vload(b + kLanes), b2 = vload(b + 2 * kLanes), b3 = vload(b + 3 * kLanes);
        for (int r = 0; r < kRows; ++r) {
          const vec a = vset(A[(m + r) * lda + k]);
          acc[r][0] += a * b0;
          acc[r][1] += a * b1;
          acc[r][2] += a * b2;
          acc[r][3] += a * b3;
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < 4; ++v) vstore(C + (m + r) * ldc + n + v * kLanes, acc[r][v]);
    }
    for (; m < M; ++m) {
      vec acc[4];
      for (int v = 0; v < 4; ++v) acc[v] = accumulate ? vload(C + m * ldc + n + v * kLanes) : vset(0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const vec a = vset(A[m * lda + k]);
        const float* b = B + k * ldb + n;
        for (int v = 0; v < 4; ++v) acc[v] += a * vload(b + v * kLanes);
      }
      for (int v = 0; v < 4; ++v) vstore(C + m * ldc + n + v * kLanes, acc[v]);
    }
  }
  for (; n + kLanes <= N; n += kLanes) {
    for (int64_t m = 0; m < M; ++m) {
      vec acc = accumulate ? vload(C + m * ldc + n) : vset(0.0f);
      for (int64_t k = 0; k < K; ++k) acc += vset(A[m * lda + k]) * vload(B + k * ldb + n);
      vstore(C + m * ldc + n, acc);
    }
  }
  for (; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = accumulate ? C[m * ldc + n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[m * lda + k] * B[k * ldb + n];
      C[m * ldc + n] = acc;
    }
  }
}

// y[n] += a * x[n]
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const vec av = vset(a);
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vload(y + i) + av * vload(x + i));
  for (; i < n; ++i) y[i] += a * x[i];
}

// ---------------------------------------------------------------------------------------------
// The gated delta rule.

struct DeltaShape {
  int64_t k_heads, v_heads, k_dim, v_dim;
  float scale;  // k_dim^-1/2, applied to the normalised queries
};

// Per-token inputs of one (sequence, value head): strided views into the caller's q/k/v/a/b.
template <typename E>
struct HeadInputs {
  const typename E::raw_t *q, *k, *v, *a, *b;
  int64_t q_stride, k_stride, v_stride, a_stride, b_stride;
  float A, dt_bias;  // exp(A_log) and dt_bias of this head

  // q and k of token t, L2-normalised (eps 1e-6 as Transformers' l2norm) and q scaled.
  void load_qk(int64_t t, const DeltaShape& sh, float* qd, float* kd) const {
    float qq = 0.0f, kk = 0.0f;
    for (int64_t d = 0; d < sh.k_dim; ++d) {
      qd[d] = E::load(q[t * q_stride + d]);
      kd[d] = E::load(k[t * k_stride + d]);
      qq += qd[d] * qd[d];
      kk += kd[d] * kd[d];
    }
    const float qs = sh.scale / std::sqrt(qq + 1e-6f), ks = 1.0f / std::sqrt(kk + 1e-6f);
    for (int64_t d = 0; d < sh.k_dim; ++d) {
      qd[d] *= qs;
      kd[d] *= ks;
    }
  }
  // g = -exp(A_log) softplus(a + dt_bias) in fp32; beta = sigmoid(b) rounded to the input dtype.
  float log_decay(int64_t t) const { return -A * softplus(E::load(a[t * a_stride]) + dt_bias); }
  float beta(int64_t t) const { return E::round(1.0f / (1.0f + std::exp(-E::load(b[t * b_stride])))); }
};

// Scratch of one prefill task (one sequence, one value head); sized for a 64-token chunk.
struct ChunkScratch {
  std::vector<float> q, k, kT, v, w, o, kk, qk, pair, g, eg, beta;
  ChunkScratch(const DeltaShape& sh)
      : q(kChunk * sh.k_dim), k(kChunk * sh.k_dim), kT(sh.k_dim * kChunk), v(kChunk * sh.v_dim),
        w(kChunk * sh.v_dim), o(kChunk * sh.v_dim), kk(kChunk * kChunk), qk(kChunk * kChunk),
        pair(kChunk * kChunk), g(kChunk), eg(kChunk), beta(kChunk) {}
};

// One chunk of `len` tokens starting at token t0 of the head's span; S [k_dim][v_dim] is updated.
template <typename E>
void delta_chunk(const HeadInputs<E>& in, const DeltaShape& sh, int64_t t0, int64_t len, float* S,
                 typename E::raw_t* out, int64_t out_stride, ChunkScratch& sc) {
  const int64_t Dk = sh.k_dim, Dv = sh.v_dim;
  float G = 0.0f;  // cumulative log decay within the chunk (a running fp32 sum, as torch's cumsum)
  for (int64_t i = 0; i < len; ++i) {
    in.load_qk(t0 + i, sh, &sc.q[i * Dk], &sc.k[i * Dk]);
    for (int64_t d = 0; d < Dk; ++d) sc.kT[d * kChunk + i] = sc.k[i * Dk + d];
    for (int64_t e = 0; e < Dv; ++e) sc.v[i * Dv + e] = E::load(in.v[(t0 + i) * in.v_stride + e]);
    G += in.log_decay(t0 + i);
    sc.g[i] = G;
    sc.beta[i] = in.beta(t0 + i);
  }
  // e^(G_i - G_j) for j <= i (0 above the diagonal: only the causal pairs count), one exp per pair.
  for (int64_t j = len; j < kChunk; ++j) sc.g[j] = G;  // finite filler for whole-vector rows
  for (int64_t i = 0; i < len; ++i) {
    float* row = &sc.pair[i * kChunk];
    const vec gi = vset(sc.g[i]);
    for (int64_t j = 0; j < kChunk; j += kLanes) vstore(row + j, vexp(gi - vload(&sc.g[j])));
    std::fill(row + i + 1, row + kChunk, 0.0f);
    sc.eg[i] = std::exp(sc.g[i]);
  }
  // k_i.k_j and q_i.k_j for every pair (the lower triangles are used).
  matmul_rows(sc.k.data(), Dk, sc.kT.data(), kChunk, sc.kk.data(), kChunk, len, Dk, len, false);
  matmul_rows(sc.q.data(), Dk, sc.kT.data(), kChunk, sc.qk.data(), kChunk, len, Dk, len, false);
  // w_i = beta_i (v_i - e^(G_i) k_i S)
  matmul_rows(sc.k.data(), Dk, S, Dv, sc.w.data(), Dv, len, Dk, Dv, false);
  for (int64_t i = 0; i < len; ++i) {
    const float eg = sc.eg[i], bi = sc.beta[i];
    float* w = &sc.w[i * Dv];
    const float* v = &sc.v[i * Dv];
    for (int64_t e = 0; e < Dv; ++e) w[e] = bi * (v[e] - eg * w[e]);
  }
  // Forward substitution: u_i = w_i - sum_{j<i} beta_i (k_i.k_j) e^(G_i-G_j) u_j (u overwrites w);
  // the coefficients, negated, overwrite k_i.k_j.
  for (int64_t i = 1; i < len; ++i) {
    float* a = &sc.kk[i * kChunk];
    const float* pair = &sc.pair[i * kChunk];
    for (int64_t j = 0; j < i; ++j) a[j] = -sc.beta[i] * a[j] * pair[j];
    matmul_rows(a, kChunk, sc.w.data(), Dv, &sc.w[i * Dv], Dv, 1, i, Dv, true);
  }
  // o_i = e^(G_i) q_i S + sum_{j<=i} (q_i.k_j) e^(G_i-G_j) u_j
  matmul_rows(sc.q.data(), Dk, S, Dv, sc.o.data(), Dv, len, Dk, Dv, false);
  for (int64_t i = 0; i < len; ++i) {
    const float eg = sc.eg[i];
    for (int64_t e = 0; e < Dv; ++e) sc.o[i * Dv + e] *= eg;
    for (int64_t j = 0; j < len; ++j) sc.qk[i * kChunk + j] *= sc.pair[i * kChunk + j];
  }
  matmul_rows(sc.qk.data(), kChunk, sc.w.data(), Dv, sc.o.data(), Dv, len, len, Dv, true);
  for (int64_t i = 0; i < len; ++i) {
    typename E::raw_t* dst = out + (t0 + i) * out_stride;
    for (int64_t e = 0; e < Dv; ++e) dst[e] = E::store(sc.o[i * Dv + e]);
  }
  // S' = e^(G_last) S + sum_j e^(G_last-G_j) k_j^T u_j (row len-1 of the pairs holds e^(G_last-G_j)).
  const float* tail = &sc.pair[(len - 1) * kChunk];
  const float chunk_decay = sc.eg[len - 1];
  for (int64_t d = 0; d < Dk; ++d)
    for (int64_t j = 0; j < len; ++j) sc.kT[d * kChunk + j] *= tail[j];
  for (int64_t x = 0; x < Dk * Dv; ++x) S[x] *= chunk_decay;
  matmul_rows(sc.kT.data(), kChunk, sc.w.data(), Dv, S, Dv, Dk, len, Dv, true);
}

// One token of the recurrent rule on S [k_dim][v_dim]: decay, read, delta write, output.
template <typename E>
void delta_step(const HeadInputs<E>& in, const DeltaShape& sh, int64_t t, float* S, typename E::raw_t* out,
                float* q, float* k, float* acc, float* o) {
  const int64_t Dk = sh.k_dim, Dv = sh.v_dim;
  in.load_qk(t, sh, q, k);
  const float decay = std::exp(in.log_decay(t)), beta = in.beta(t);
  // Pass 1: S *= decay; acc = k S (the decayed state's prediction of v).
  std::fill(acc, acc + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d) {
    float* row = S + d * Dv;
    int64_t e = 0;
    const vec dv = vset(decay), kv = vset(k[d]);
    for (; e + kLanes <= Dv; e += kLanes) {
      const vec s = vload(row + e) * dv;
      vstore(row + e, s);
      vstore(acc + e, vload(acc + e) + kv * s);
    }
    for (; e < Dv; ++e) {
      row[e] *= decay;
      acc[e] += k[d] * row[e];
    }
  }
  // delta = beta (v - k S), kept in acc.
  for (int64_t e = 0; e < Dv; ++e) acc[e] = (E::load(in.v[t * in.v_stride + e]) - acc[e]) * beta;
  // Pass 2: S += k^T delta; o = q S.
  std::fill(o, o + Dv, 0.0f);
  for (int64_t d = 0; d < Dk; ++d) {
    float* row = S + d * Dv;
    int64_t e = 0;
    const vec kd = vset(k[d]), qd = vset(q[d]);
    for (; e + kLanes <= Dv; e += kLanes) {
      const vec s = vload(row + e) + kd * vload(acc + e);
      vstore(row + e, s);
      vstore(o + e, vload(o + e) + qd * s);
    }
    for (; e < Dv; ++e) {
      row[e] += k[d] * acc[e];
      o[e] += q[d] * row[e];
    }
  }
  for (int64_t e = 0; e < Dv; ++e) out[e] = E::store(o[e]);
}

struct DeltaArgs {
  const at::Tensor &q, &k, &v, &a, &b;
  at::Tensor A, dt_bias;  // fp32, contiguous
  at::Tensor& pool;
  DeltaShape shape;
};

template <typename E>
HeadInputs<E> head_inputs(const DeltaArgs& args, int64_t h) {
  const int64_t hk = h / (args.shape.v_heads / args.shape.k_heads);  // repeat_interleave of the k heads
  HeadInputs<E> in;
  in.q = E::data(args.q) + hk * args.q.stride(1);
  in.k = E::data(args.k) + hk * args.k.stride(1);
  in.v = E::data(args.v) + h * args.v.stride(1);
  in.a = E::data(args.a) + h * args.a.stride(1);
  in.b = E::data(args.b) + h * args.b.stride(1);
  in.q_stride = args.q.stride(0);
  in.k_stride = args.k.stride(0);
  in.v_stride = args.v.stride(0);
  in.a_stride = args.a.stride(0);
  in.b_stride = args.b.stride(0);
  in.A = args.A.data_ptr<float>()[h];
  in.dt_bias = args.dt_bias.data_ptr<float>()[h];
  return in;
}

// Every (sequence, value head) is one task, so batching changes no result. kChunked: the span runs
// in 64-token chunks (prefill); else token by token on the recurrent rule (decode).
template <typename E, bool kChunked>
at::Tensor delta_impl(const DeltaArgs& args, const Spans& spans) {
  const DeltaShape& sh = args.shape;
  at::Tensor out = at::empty({args.v.size(0), sh.v_heads, sh.v_dim}, args.v.options());
  auto* op = E::data(out);
  float* pool = args.pool.data_ptr<float>();
  const int64_t slot_stride = args.pool.stride(0), head_stride = sh.k_dim * sh.v_dim;
  const int64_t out_stride = sh.v_heads * sh.v_dim;
  at::parallel_for(0, spans.count * sh.v_heads, 1, [&](int64_t begin, int64_t end) {
    // Scratch: a chunk's matrices, or a token's q, k, delta and output.
    std::optional<ChunkScratch> sc;
    std::vector<float> step;
    if constexpr (kChunked) {
      sc.emplace(sh);
    } else {
      step.resize(2 * (sh.k_dim + sh.v_dim));
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / sh.v_heads, h = task % sh.v_heads;
      const int64_t start = spans.cu[s], length = spans.cu[s + 1] - start;
      const HeadInputs<E> in = head_inputs<E>(args, h);
      float* S = pool + spans.slots[s] * slot_stride + h * head_stride;
      auto* head_out = op + h * sh.v_dim;
      if constexpr (kChunked) {
        for (int64_t c = 0; c < length; c += kChunk)
          delta_chunk<E>(in, sh, start + c, std::min<int64_t>(kChunk, length - c), S, head_out, out_stride, *sc);
      } else {
        for (int64_t t = start; t < start + length; ++t)
          delta_step<E>(in, sh, t, S, head_out + t * out_stride, step.data(), step.data() + sh.k_dim,
                        step.data() + 2 * sh.k_dim, step.data() + 2 * sh.k_dim + sh.v_dim);
      }
    }
  });
  return out;
}

DeltaArgs check_delta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                      const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias, at::Tensor& pool) {
  const auto dtype = v.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "q, k, v must be float32 or bfloat16");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->scalar_type() == dtype && t->stride(2) == 1,
                "q, k, v must be CPU [tokens, heads, dim] tensors of one dtype with a contiguous last dim");
  }
  for (const at::Tensor* t : {&a, &b})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == dtype && t->stride(1) == 1,
                "a and b must be CPU [tokens, v_heads] tensors of q's dtype");
  const int64_t tokens = v.size(0), k_heads = q.size(1), k_dim = q.size(2), v_heads = v.size(1), v_dim = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && q.size(0) == tokens && a.size(0) == tokens && b.size(0) == tokens &&
                  a.size(1) == v_heads && b.size(1) == v_heads,
              "q/k [tokens, k_heads, k_dim], v [tokens, v_heads, v_dim], a/b [tokens, v_heads] disagree");
  TORCH_CHECK(v_heads % k_heads == 0, "v_heads must be a multiple of k_heads");
  TORCH_CHECK(A_log.numel() == v_heads && dt_bias.numel() == v_heads, "A_log and dt_bias need one value per v head");
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.dim() == 4 && pool.size(1) == v_heads &&
                  pool.size(2) == k_dim && pool.size(3) == v_dim && pool.stride(3) == 1 &&
                  pool.stride(2) == v_dim && pool.stride(1) == k_dim * v_dim,
              "state_pool must be float32 [slots, v_heads, k_dim, v_dim], each slot contiguous");
  at::Tensor A = A_log.to(at::kFloat).exp().contiguous();  // as Transformers: A_log.float().exp()
  at::Tensor dt = dt_bias.to(at::kFloat).contiguous();
  return {q, k, v, a, b, A, dt, pool,
          {k_heads, v_heads, k_dim, v_dim, static_cast<float>(1.0 / std::sqrt(static_cast<double>(k_dim)))}};
}

at::Tensor gated_delta_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                               const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                               at::Tensor state_pool, const at::Tensor& slots, const at::Tensor& cu_seqlens) {
  const DeltaArgs args = check_delta(q, k, v, a, b, A_log, dt_bias, state_pool);
  const Spans spans = check_spans(cu_seqlens, slots, v.size(0), state_pool.size(0));
  return v.scalar_type() == at::kBFloat16 ? delta_impl<BF16, true>(args, spans) : delta_impl<F32, true>(args, spans);
}

at::Tensor gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                              const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias,
                              at::Tensor state_pool, const at::Tensor& slots) {
  const DeltaArgs args = check_delta(q, k, v, a, b, A_log, dt_bias, state_pool);
  const int64_t count = slots.size(0);
  TORCH_CHECK(v.size(0) == count, "decode takes one token per slot");
  at::Tensor cu = at::arange(count + 1, slots.options());
  const Spans spans = check_spans(cu, slots, count, state_pool.size(0));
  return v.scalar_type() == at::kBFloat16 ? delta_impl<BF16, false>(args, spans)
                                          : delta_impl<F32, false>(args, spans);
}

// ---------------------------------------------------------------------------------------------
// The gated RMSNorm after the rule (Transformers' Qwen3_5RMSNormGated): per head row,
// y = round(w * round(x * rsqrt(mean(x^2) + eps))) * silu(gate) in fp32, then rounded. One pass per
// row instead of ~9 aten ops over the whole [T, H, D] block.

template <typename E>
void gated_norm_row(const typename E::raw_t* x, const typename E::raw_t* gate, const typename E::raw_t* weight,
                    typename E::raw_t* out, int64_t D, float eps) {
  vec ss_v = vset(0.0f);
  int64_t e = 0;
  for (; e + kLanes <= D; e += kLanes) {
    const vec xv = E::vload(x + e);
    ss_v += xv * xv;
  }
  float ss = 0.0f;
  for (int l = 0; l < kLanes; ++l) ss += ss_v[l];
  for (; e < D; ++e) ss += E::load(x[e]) * E::load(x[e]);
  const float scale = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  e = 0;
  for (; e + kLanes <= D; e += kLanes) {
    const vec h = E::vround(E::vload(weight + e) * E::vround(E::vload(x + e) * scale));
    const vec g = E::vload(gate + e);
    E::vstore(out + e, h * (g / (vset(1.0f) + vexp(-g))));
  }
  for (; e < D; ++e) {
    const float h = E::round(E::load(weight[e]) * E::round(E::load(x[e]) * scale));
    const float g = E::load(gate[e]);
    out[e] = E::store(h * (g / (1.0f + exp_poly(-g))));
  }
}

template <typename E>
at::Tensor gated_norm_impl(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, float eps) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({T, H, D}, x.options());
  const auto *xp = E::data(x), *gp = E::data(gate), *wp = E::data(weight);
  auto* op = E::data(out);
  at::parallel_for(0, T * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / H, h = r % H;
      gated_norm_row<E>(xp + t * x.stride(0) + h * x.stride(1), gp + t * gate.stride(0) + h * gate.stride(1), wp,
                        op + r * D, D, eps);
    }
  });
  return out;
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "x must be a CPU [tokens, heads, dim] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(gate.sizes() == x.sizes() && gate.stride(2) == 1 && gate.scalar_type() == x.scalar_type(),
              "gate must match x (shape, dtype, a contiguous last dim)");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(2) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [dim] tensor of x's dtype");
  const float e = static_cast<float>(eps);
  return x.scalar_type() == at::kBFloat16 ? gated_norm_impl<BF16>(x, gate, weight, e)
                                          : gated_norm_impl<F32>(x, gate, weight, e);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_conv1d", &causal_conv1d,
        "Causal depthwise conv1d over packed spans with each sequence's window in conv_pool (updated in place)");
  m.def("gated_delta_prefill", &gated_delta_prefill,
        "Chunked gated delta rule over packed spans; state_pool slots read and updated in place");
  m.def("gated_delta_decode", &gated_delta_decode,
        "Recurrent gated delta rule, one token per slot; state_pool slots read and updated in place");
  m.def("gated_rms_norm", &gated_rms_norm, "RMSNorm of each [.., dim] head row times SiLU(gate) (Qwen3.5's norm)");
  m.def("vector_lanes", []() { return kLanes; }, "fp32 lanes of this build's vectors (16 AVX-512, 8 AVX2)");
}
