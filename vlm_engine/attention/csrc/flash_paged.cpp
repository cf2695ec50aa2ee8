// The flash-attention core for the paged op's long prompts (see paged_attention.cpp), in a unit of its
// own: linked into the paged extension, compiled apart from its decode kernels.
#include "flash_core.h"

namespace vlm_flash {

void run_paged_segments(Problem& P, std::vector<Segment>& segs, int64_t Hq, int64_t impl, bool bf16) {
  if (bf16)
    run_segments<vlm_simd::bf16>(P, segs, Hq, impl);
  else
    run_segments<float>(P, segs, Hq, impl);
}

}  // namespace vlm_flash
