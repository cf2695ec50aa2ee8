"""Flash attention over packed variable-length sequences on the CPU (our C++ op, `csrc/flash_attention.cpp`;
its core, `csrc/flash_core.h`, also runs the paged op's long prompts with K/V read from the pages).

    from vlm_engine.attention.flash import cu_seqlens, load_flash_attention
    op = load_flash_attention()  # the extension module, or None where it does not build
    out = op.flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal=False, window=0)

q [Nq, Hq, D], k / v [Nk, Hkv, D], token-major as the towers hold them (any token / head strides, the
head dim contiguous: the q, k, v views of a fused qkv projection go in without a copy); Hq a multiple
of Hkv (GQA); D a multiple of 8; float32 or bfloat16 (fp32 accumulation, bf16 out). `cu_seqlens_q` /
`cu_seqlens_k` (int32, segments + 1 entries) split the tokens into segments that attend only within
themselves: a block-diagonal mask, so several images, windows or frames run in one call.
`causal` aligns a segment's queries with the end of its keys (query i of Lq sees keys j <= i + Lk - Lq,
as in prefill after a cached prefix); `window` > 0 (causal only) also hides keys j <= i + Lk - Lq - window.
A query that sees no key gets zeros. `flash_attention_reference` states the same contract in torch.

`load_flash_attention()` builds (first use, ~1 min) or loads the extension through
`vlm_engine.kernels.build` (callers fall back to their SDPA code without it); the op also takes an
optional `out` and an `impl` for tests (0 best, 1 portable loops, 2 AVX-512 fp32 FMA
without vdpbf16ps, 3 AVX2 + FMA; one this build lacks falls back to the next one down); the module's
`build_info()` names the ISA it was compiled for.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

logger = logging.getLogger(__name__)

__all__ = ["cu_seqlens", "flash_attention_reference", "load_flash_attention"]

EXT_NAME = "vlm_engine_flash_attention"
_SRC = Path(__file__).resolve().parent / "csrc" / "flash_attention.cpp"


@functools.cache
def load_flash_attention() -> ModuleType | None:
    """The extension module (built once per process, cached on disk); None if unavailable or disabled."""
    if cpu_kernels_disabled():
        logger.info("CPU flash attention disabled by VLM_ENGINE_DISABLE_CPU_KERNEL")
        return None
    return build_extension(EXT_NAME, _SRC)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """Segment lengths -> the int32 [0, l0, l0 + l1, ...] boundaries the op takes."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def flash_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int = 0,
) -> torch.Tensor:
    """The contract in torch: one SDPA call per segment with an explicit boolean mask (rows that see
    no key are zero)."""
    if window and not causal:
        raise ValueError("a sliding window needs causal=True")
    out = q.new_zeros(q.shape)
    groups = q.shape[1] // k.shape[1]
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])
    for q0, q1, k0, k1 in bounds:
        if q1 == q0 or k1 == k0:
            continue
        pos = torch.arange(q1 - q0, device=q.device)[:, None] + (k1 - k0) - (q1 - q0)
        key = torch.arange(k1 - k0, device=q.device)[None, :]
        visible = (key <= pos) if causal else torch.ones_like(key <= pos)
        if window:
            visible &= key > pos - window
        seg_k = k[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        seg_v = v[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), seg_k, seg_v, attn_mask=visible, scale=scale)
        out[q0:q1] = torch.where(visible.any(-1)[:, None, None], o.transpose(0, 1), 0)
    return out
