// Flash attention for CPU over packed variable-length sequences: block-diagonal segments (several
// images, windows or prompts in one call), causal (bottom-right aligned), sliding window, GQA;
// fp32, and bf16 with fp32 accumulation. The contract is flash_attention_reference() in
// vlm_engine/attention/flash.py:
//
//   q [Nq, Hq, D], k / v [Nk, Hkv, D] (token-major, head_dim contiguous, any other strides);
//   segment s holds queries [cu_q[s], cu_q[s+1]) and keys [cu_k[s], cu_k[s+1]). Local query i of a
//   segment with Lq queries and Lk keys sits at position p = i + Lk - Lq and sees keys
//   j < p + 1 (causal) and j > p - window (window > 0, causal only); a query that sees no key
//   gets zeros. out[i, h] = softmax_j(scale * q[i, h] . k[j, h / G]) v[j, h / G].
//
// The algorithm is in flash_core.h (shared with the paged op's long prompts).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

#include "flash_core.h"

using namespace vlm_flash;

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& cu_seqlens_k, double scale, bool causal, int64_t window,
                           std::optional<at::Tensor> out, int64_t impl) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q must be [Nq, Hq, D], k and v [Nk, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "flash_attention needs CPU tensors");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "q must be float32 or bfloat16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "q/k/v dtypes differ");
  const int64_t Nq = q.size(0), Hq = q.size(1), D = q.size(2), Nk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(2) == D, "head_dim of q and k differ");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq (", Hq, ") must be a multiple of Hkv (", Hkv, ")");
  TORCH_CHECK(D > 0 && D % 8 == 0 && D <= 512, "head_dim must be a multiple of 8 in [8, 512], got ", D);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous (stride 1)");
  TORCH_CHECK(scale > 0, "scale must be > 0");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(window == 0 || causal, "a sliding window needs causal=True");
  TORCH_CHECK(impl >= kAuto && impl <= kAvx2, "impl must be 0 (best), 1 (portable), 2 (AVX-512) or 3 (AVX2)");
  for (const at::Tensor* cu : {&cu_seqlens_q, &cu_seqlens_k}) {
    TORCH_CHECK(cu->scalar_type() == at::kInt && cu->device().is_cpu() && cu->dim() == 1 && cu->is_contiguous(),
                "cu_seqlens must be contiguous int32 CPU tensors");
  }
  TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0) && cu_seqlens_q.size(0) >= 1,
              "cu_seqlens_q and cu_seqlens_k must both have (segments + 1) entries");
  const int64_t nseg = cu_seqlens_q.size(0) - 1;
  const int32_t* cq = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* ck = cu_seqlens_k.data_ptr<int32_t>();
  TORCH_CHECK(cq[0] == 0 && ck[0] == 0 && cq[nseg] == Nq && ck[nseg] == Nk,
              "cu_seqlens must start at 0 and end at the token counts (", Nq, ", ", Nk, ")");
  std::vector<Segment> segs(nseg);
  for (int64_t s = 0; s < nseg; ++s) {
    TORCH_CHECK(cq[s + 1] >= cq[s] && ck[s + 1] >= ck[s], "cu_seqlens must be non-decreasing");
    segs[s] = Segment{cq[s], cq[s + 1] - cq[s], ck[s + 1] - ck[s], 0, ck[s]};
  }
  at::Tensor o;
  if (out.has_value() && out->defined()) {
    o = *out;
    TORCH_CHECK(o.sizes() == q.sizes() && o.scalar_type() == dt && o.device().is_cpu() && o.stride(2) == 1,
                "out must be a CPU tensor shaped and typed like q with a contiguous head_dim");
  } else {
    o = at::empty(q.sizes(), q.options());
  }
  if (Nq == 0) return o;

  Problem P{};
  P.q = static_cast<const char*>(q.data_ptr());
  P.k = static_cast<const char*>(k.data_ptr());
  P.v = static_cast<const char*>(v.data_ptr());
  P.out = static_cast<char*>(o.data_ptr());
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.k_st = k.stride(0);
  P.k_sh = k.stride(1);
  P.v_st = v.stride(0);
  P.v_sh = v.stride(1);
  P.o_st = o.stride(0);
  P.o_sh = o.stride(1);
  P.Hkv = Hkv;
  P.G = Hq / Hkv;
  P.D = D;
  P.window = window;
  P.causal = causal;
  P.c = static_cast<float>(scale) * kLog2e;
  if (dt == at::kFloat)
    run_segments<float>(P, segs, Hq, impl);
  else
    run_segments<bf16>(P, segs, Hq, impl);
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vlm_engine flash attention over packed variable-length sequences (CPU)";
  m.def("flash_attention", &flash_attention,
        "Block-diagonal / causal / sliding-window attention, GQA (see vlm_engine/attention/flash.py)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("scale"),
        py::arg("causal") = false, py::arg("window") = 0, py::arg("out") = py::none(), py::arg("impl") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("build_info", &vlm_simd::isa_info, "Compile-time ISA features of this build");
}
