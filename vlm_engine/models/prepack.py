"""Prepacked linear layers on CPU (bf16 and fp32), used in "fast" numerics.

oneDNN reorders a plain [out, in] weight into its blocked layout on every call; doing it once at
load time made bf16 linears 1.15-2x faster at decode batch sizes on the 2-core Zen 4 EPYC
(576->49,152 at M=16: 6.0 ms -> 3.0 ms; 1,536->8,960 at M=64: 4.9 ms -> 4.3 ms) with
bit-identical outputs. In fp32 oneDNN's packed kernels beat MKL's `F.linear` by more at decode
sizes (on Zen 3, all SmolLM2 linears of a step at M=16: 133 ms -> 61 ms), but they accumulate in
a different order, so fp32 is packed only in fast numerics; "exact" keeps Transformers' ops.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from vlm_engine.models.cpu_isa import onednn_bf16_packing

logger = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this many rows; decode batches are the case that matters.
# fp32 on Zen 3, all SmolLM2 linears of a step: hint 16 was as fast as 64 at M=64 and 5-15% faster
# at M=1-16. Either hint gives rows that do not depend on the batch (F.linear's do, for M <= 3).
PACK_BATCH_HINT = {torch.bfloat16: 64, torch.float32: 16}
# fp32 steps with at most this many rows take the fused ops' panel kernel, a weight-streaming
# GEMV (25 GB/s on Zen 3 where oneDNN reached 17). SmolLM2 decode forward on Zen 3, same process:
# 27.5 vs 36.8 ms at batch 1, 35.0 vs 43.8 ms at batch 4; from batch 8 oneDNN is as fast or faster.
SMALL_M_ROWS = 4


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if dtype == torch.bfloat16 and not onednn_bf16_packing()[0]:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A frozen nn.Linear whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, small_m_ops: ModuleType | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        # An opaque oneDNN tensor (it still reports dtype, device and the logical [out, in] shape,
        # which code such as Transformers' vision tower reads); kept out of parameters().
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT[self.dtype])
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # fp32 only: a second copy of the weight in the panel layout of `small_m_ops.panel_linear`.
        self._small_m_ops = small_m_ops if self.dtype == torch.float32 else None
        self._panels = None if self._small_m_ops is None else self._small_m_ops.pack_panels(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # e.g. a vision block run in fp32 by its own code
            raise TypeError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        if self._panels is not None and flat.shape[0] <= SMALL_M_ROWS:
            assert self._small_m_ops is not None
            out = self._small_m_ops.panel_linear(flat, self._panels, self.out_features, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        panels = ", small-M panels" if self._panels is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed{panels}"


def prepack_linears(model: nn.Module, small_m_ops: ModuleType | None = None, small_m_budget: int = 0) -> int:
    """Replace every bf16/fp32 nn.Linear in `model` by a PackedLinear; returns how many were replaced.

    Subclasses of nn.Linear (MergedLinear keeps its shard map for the loader) are packed too:
    weights are loaded before this runs, so only the matmul is needed afterwards. With
    `small_m_ops` (the fused-ops extension, vectorised build), fp32 linears also keep a panel copy
    for steps of <= SMALL_M_ROWS rows, if all of those copies fit in `small_m_budget` bytes.
    """
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear) and child.weight.dtype in (torch.bfloat16, torch.float32)
    ]
    fp32_bytes = sum(c.weight.numel() * 4 for _, _, c in linears if c.weight.dtype == torch.float32)
    use_panels = small_m_ops is not None and 0 < fp32_bytes <= small_m_budget
    if small_m_ops is not None and fp32_bytes and not use_panels:
        logger.info(
            "small-M fp32 kernel off: its weight copy (%.0f MiB) exceeds the budget (%.0f MiB)",
            fp32_bytes / 2**20, small_m_budget / 2**20,
        )
    dtypes: set[torch.dtype] = set()
    for parent, name, child in linears:
        dtypes.add(child.weight.dtype)
        setattr(parent, name, PackedLinear(child, small_m_ops if use_panels else None))
    for dtype in dtypes:
        _check_close_to_plain_linear(dtype)
    logger.info(
        "prepacked %d linear layers (oneDNN, %s)%s", len(linears), ", ".join(sorted(map(str, dtypes))) or "none",
        f"; fp32 steps of <= {SMALL_M_ROWS} rows use the panel kernel (+{fp32_bytes / 2**20:.0f} MiB)" if use_panels else "",
    )
    return len(linears)


def _check_close_to_plain_linear(dtype: torch.dtype) -> None:
    """Fail loudly at start-up if this build's packed op disagrees with F.linear."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 48, bias=True).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    linear = linear.to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for rows in (1, 5, 70):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got, want = PackedLinear(linear)(x).float(), linear(x).float()
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            raise RuntimeError(f"oneDNN packed {dtype} linear disagrees with F.linear on this machine")
