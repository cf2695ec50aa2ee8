"""vision_blocks.transformers_tower_attention: Transformers' attention interface over our flash kernel for a tower
whose images are padded at their ends (Gemma 4's). bf16 on the CPU it runs the kernel and agrees with SDPA on
every query row; fp32, or a mask that is not per-image key padding, is SDPA's own result bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlm_engine.models.vision_blocks import tower_flash_attention, transformers_tower_attention

BATCH, HEADS, LENGTH, DIM = 2, 3, 40, 16
VALID = (40, 27)  # the second image padded from its 27th patch on


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    # As Transformers hands them over: [B, L, H, D] projections transposed to [B, H, L, D].
    q, k, v = (torch.randn(BATCH, LENGTH, HEADS, DIM, generator=generator).to(dtype).transpose(1, 2) for _ in range(3))
    return q, k, v


def _key_padding_mask(valid: tuple[int, ...]) -> torch.Tensor:
    keys = torch.arange(LENGTH)[None, :] < torch.tensor(valid)[:, None]  # [B, L]
    return keys[:, None, None, :].expand(BATCH, 1, LENGTH, LENGTH)


class TowerAttention(torch.nn.Module):
    is_causal = False  # as a tower's attention module says (SDPA's function reads it when no mask is given)


def _both(
    dtype: torch.dtype, mask: torch.Tensor | None, module: torch.nn.Module | None = None
) -> tuple[torch.Tensor, ...]:
    q, k, v = _inputs(dtype)
    module = module or TowerAttention()
    ours, _ = transformers_tower_attention(module, q, k, v, mask, scaling=DIM**-0.5)
    sdpa, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=DIM**-0.5)
    return ours, sdpa


@pytest.mark.skipif(tower_flash_attention(torch.zeros(1, dtype=torch.bfloat16)) is None, reason="no flash extension")
@pytest.mark.parametrize("mask", [None, _key_padding_mask(VALID)], ids=["unpadded", "padded"])
def test_bf16_runs_the_kernel_and_agrees_with_sdpa_on_every_row(mask: torch.Tensor | None) -> None:
    ours, sdpa = _both(torch.bfloat16, mask)
    assert ours.shape == sdpa.shape == (BATCH, LENGTH, HEADS, DIM)
    assert not torch.equal(ours, sdpa)  # the kernel ran: SDPA's bf16 rounding differs from ours
    error = (ours.float() - sdpa.float()).norm() / sdpa.float().norm()
    assert error < 2e-2, error


@pytest.mark.parametrize(
    ("dtype", "mask"),
    [
        (torch.float32, _key_padding_mask(VALID)),
        (torch.bfloat16, _key_padding_mask(VALID).transpose(-1, -2).contiguous()),  # queries masked, not keys
    ],
    ids=["fp32", "not-key-padding"],
)
def test_anything_else_is_sdpa_bit_for_bit(dtype: torch.dtype, mask: torch.Tensor) -> None:
    ours, sdpa = _both(dtype, mask)
    assert torch.equal(ours, sdpa)


def test_a_causal_module_without_a_mask_is_sdpa_bit_for_bit() -> None:
    ours, sdpa = _both(torch.bfloat16, None, torch.nn.Module())  # no is_causal attribute: SDPA's default, causal
    assert torch.equal(ours, sdpa)


@pytest.mark.skipif(tower_flash_attention(torch.zeros(1, dtype=torch.bfloat16)) is None, reason="no flash extension")
def test_the_mask_scan_is_remembered_for_that_mask_only() -> None:
    """A tower forward passes one mask to every layer, scanned once; another mask, even one of the same shape
    right after, is scanned for itself (here it is no key padding, so SDPA's result bit for bit)."""
    padded = _key_padding_mask(VALID)
    first, _ = _both(torch.bfloat16, padded)
    again, _ = _both(torch.bfloat16, padded)
    assert torch.equal(first, again)
    other = padded.transpose(-1, -2).contiguous()
    ours, sdpa = _both(torch.bfloat16, other)
    assert torch.equal(ours, sdpa)
