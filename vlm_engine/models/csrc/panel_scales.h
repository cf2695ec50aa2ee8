// The weight scales of quantized panels, shared by fused_ops.cpp (the decode kernel, the dequantizer)
// and int8_gemm.cpp (the GEMM): scales [P][K/32 >> shift][2][kPanel] (d, then m), one (d, m) per
// 32 << shift inputs. Each kernel is its own extension (one translation unit), so everything here is
// inline; kernels/build.py hashes this header into the build of every source that includes it.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace vlm_panels {

// log2 of the groups of `group` inputs that share one (d, m) in `scales` for `panels` panels of
// `panel` columns and k inputs.
inline int64_t scale_shift(const at::Tensor& scales, int64_t panels, int64_t k, int64_t group, int64_t panel) {
  const int64_t groups = k / group, per_group = panels * 2 * panel;
  TORCH_CHECK(scales.is_contiguous() && scales.numel() > 0 && scales.numel() % per_group == 0, "scales do not match the codes");
  const int64_t scale_groups = scales.numel() / per_group;
  int64_t shift = 0;
  while ((scale_groups << shift) < groups) ++shift;
  TORCH_CHECK((scale_groups << shift) == groups, "scales do not match the codes: ", scale_groups, " groups for ", groups,
              " groups of ", group, " inputs");
  return shift;
}

}  // namespace vlm_panels
