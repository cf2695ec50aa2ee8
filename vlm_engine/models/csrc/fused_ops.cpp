// Fused element-wise ops for the bf16 CPU decoder: RMSNorm (+ residual add), rotary embedding
// (in place on q and k) and SiLU-and-multiply.
//
// Why: at decode batch sizes each of these is a handful of tiny aten ops per layer (RMSNorm alone
// is ~9: upcast, pow, mean, add, rsqrt, mul, downcast, mul), and on 2 CPU cores the per-op
// dispatch cost was ~15-20% of a SmolLM2 batch-64 step. One call each removes that.
//
// Numerics follow Transformers' bf16 modules step by step: statistics in fp32, and every
// intermediate that Transformers materialises as a bf16 tensor is rounded to bf16 here too
// (round-to-nearest-even, c10::BFloat16). Only reduction order and exp/rsqrt implementations
// differ, so results match the torch reference to within one bf16 ulp on rare elements.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float f(bf16 v) { return static_cast<float>(v); }
inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with a contiguous last dim");
}

// y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), as LlamaRMSNorm / Qwen2RMSNorm in bf16.
inline void rms_norm_row(const bf16* x, const bf16* w, bf16* y, int64_t hidden, float eps) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = f(x[i]);
    sum_sq += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    y[i] = bf16(f(w[i]) * round_bf16(f(x[i]) * inv));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_bf16_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kBFloat16, "weight must be contiguous bf16");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.numel() == hidden, "weight size != hidden size");
  at::Tensor out = at::empty({rows, hidden}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * xs, wp, op + r * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

// residual = bf16(residual + x); x = rms_norm(residual). Both updated in place; returns x.
at::Tensor add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_bf16_rows(x, "x");
  check_bf16_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden, "weight must be contiguous [hidden]");
  bf16* xp = x.data_ptr<bf16>();
  bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* xr = xp + r * xs;
      bf16* rr = rp + r * rs;
      for (int64_t i = 0; i < hidden; ++i) rr[i] = bf16(f(rr[i]) + f(xr[i]));
      rms_norm_row(rr, wp, xr, hidden, static_cast<float>(eps));
    }
  });
  return x;
}

// In place: t = bf16(bf16(t * cos) + bf16(rotate_half(t) * sin)) for t in (q, k), each [T, H, D]
// with a contiguous last dim (they may be strided views into the fused qkv output).
void rotate_heads(at::Tensor& t, const bf16* cos, const bf16* sin, int64_t cs_stride) {
  const int64_t tokens = t.size(0), heads = t.size(1), dim = t.size(2), half = dim / 2;
  bf16* base = t.data_ptr<bf16>();
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t tok = begin; tok < end; ++tok) {
      const bf16* c = cos + tok * cs_stride;
      const bf16* s = sin + tok * cs_stride;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = base + tok * s0 + h * s1;
        for (int64_t i = 0; i < dim; ++i) row[i] = f(v[i]);
        for (int64_t i = 0; i < dim; ++i) {
          const float rotated = i < half ? -row[i + half] : row[i - half];
          v[i] = bf16(round_bf16(row[i] * f(c[i])) + round_bf16(rotated * f(s[i])));
        }
      }
    }
  });
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "q/k must be CPU bf16");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "q/k must be [T, H, D] with a contiguous last dim");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos/sin must be [T, D]");
  TORCH_CHECK(q.size(2) % 2 == 0 && q.size(2) == k.size(2), "head_dim must be even and equal for q and k");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kBFloat16 && s.scalar_type() == at::kBFloat16, "cos/sin must be bf16");
  rotate_heads(q, c.data_ptr<bf16>(), s.data_ptr<bf16>(), c.size(1));
  rotate_heads(k, c.data_ptr<bf16>(), s.data_ptr<bf16>(), c.size(1));
}

// [T, 2I] (gate | up) -> [T, I]: bf16(bf16(silu(gate)) * up), as act_fn(gate_proj(x)) * up_proj(x).
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_bf16_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up width must be even");
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  const bf16* in = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t is = gate_up.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = in + r * is;
      const bf16* u = g + inter;
      bf16* o = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = f(g[i]);
        o[i] = bf16(round_bf16(x / (1.0f + std::exp(-x))) * f(u[i]));
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine fused bf16 element-wise ops (CPU)";
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
}
