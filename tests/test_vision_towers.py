"""Our Qwen2.5-VL and Qwen3-VL vision towers against Transformers' own, on tiny random configs built
from Transformers' config classes: the same state dict loads into both by name (strict), fp32
outputs are bit-identical on odd grids, several images in one call and a video, and bf16 (the CPU
default, fused ops included) stays as close to the fp32 reference as Transformers' own bf16 run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vlm_engine.models.families.qwen2_5_vl import vision as qwen25_vision
from vlm_engine.models.families.qwen2_5_vl.vision import Qwen25VisionTower
from vlm_engine.models import qwen3_vision
from vlm_engine.models.qwen3_vision import Qwen3VisionTower

# Odd sizes: windows cut short at the right and bottom edges (Qwen2.5: 2x2-group windows of 16
# patches here), several images of different lengths in one call, a video of 3 frames.
GRIDS = [
    [[1, 10, 14]],
    [[1, 6, 22]],
    [[1, 10, 14], [1, 6, 22]],
    [[3, 8, 12]],
    [[1, 8, 8], [2, 4, 4], [1, 8, 8]],  # equal-length segments not back to back: gathered, not views
]

# bf16 (weights and activations) against the fp32 reference, relative Frobenius error of the
# output: bf16 keeps 8 significand bits (relative rounding 2**-9 ~ 0.002) and the error of a few
# blocks of rounded matmuls, norms and softmax lands at ~0.007 for Transformers and us alike (the
# fused RoPE/RMSNorm round products to bf16 where Transformers rounds once from fp32). We must
# stay under 0.02, and within 1.5x Transformers' own bf16 error (+ 0.001 of slack).
BF16_MAX_REL_ERROR = 0.02


def _random_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=g) * 0.2 for name, t in model.state_dict().items()}


def _ours(cls: type[nn.Module], cfg: Any, state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):  # as the engine builds models: nothing may depend on data at init
        model = cls(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def _pixels(grid: torch.Tensor, patch: int, seed: int) -> torch.Tensor:
    patches = int(grid.prod(-1).sum())
    return torch.randn(patches, 3 * 2 * patch * patch, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------- Qwen2.5-VL


@pytest.fixture(scope="module")
def qwen25() -> tuple[Any, nn.Module, dict[str, torch.Tensor]]:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        out_hidden_size=48,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1, 3],
        hidden_act="silu",
        tokens_per_second=2,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cpu"):
        theirs = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    state = _random_state(theirs, seed=0)
    theirs.load_state_dict(state, strict=True)
    return cfg, theirs, state


def test_qwen25_names_match_transformers(qwen25: tuple[Any, nn.Module, dict[str, torch.Tensor]]) -> None:
    cfg, theirs, _ = qwen25
    with torch.device("meta"):
        ours = Qwen25VisionTower(cfg)
    assert list(ours.state_dict()) == list(theirs.state_dict())


@pytest.mark.parametrize("grids", GRIDS, ids=str)
def test_qwen25_fp32_bit_identical(qwen25: tuple[Any, nn.Module, dict[str, torch.Tensor]], grids: list) -> None:
    cfg, theirs, state = qwen25
    ours = _ours(Qwen25VisionTower, cfg, state, torch.float32)
    grid = torch.tensor(grids)
    pixels = _pixels(grid, cfg.patch_size, seed=1)
    with torch.inference_mode():
        expected = theirs(pixels, grid).pooler_output
        actual = ours(pixels, grid)
    assert actual.shape == (grid.prod(-1).sum() // 4, cfg.out_hidden_size)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_qwen25_bf16_close(
    qwen25: tuple[Any, nn.Module, dict[str, torch.Tensor]], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, theirs, state = qwen25
    if not fused:
        monkeypatch.setattr(qwen25_vision, "cpu_fused_ops", lambda device, dtype: None)
    ours = _ours(Qwen25VisionTower, cfg, state, torch.bfloat16)
    theirs_bf16 = _theirs_in(theirs, torch.bfloat16)
    grid = torch.tensor([[1, 10, 14], [3, 8, 12]])
    pixels = _pixels(grid, cfg.patch_size, seed=2)
    with torch.inference_mode():
        expected = theirs(pixels, grid).pooler_output
        theirs_error = _rel_error(theirs_bf16(pixels.bfloat16(), grid).pooler_output, expected)
        ours_error = _rel_error(ours(pixels.bfloat16(), grid), expected)
    assert ours_error < BF16_MAX_REL_ERROR
    assert ours_error <= 1.5 * theirs_error + 1e-3, (ours_error, theirs_error)


def test_qwen25_prepacked_bf16(qwen25: tuple[Any, nn.Module, dict[str, torch.Tensor]]) -> None:
    """As the engine runs it: every nn.Linear replaced by a PackedLinear (bf16, oneDNN / dot kernel)."""
    from vlm_engine.models.prepack import prepack_linears, prepack_supported

    if not prepack_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bf16 weight packing on this CPU")
    cfg, _, state = qwen25
    plain = _ours(Qwen25VisionTower, cfg, state, torch.bfloat16)
    packed = _ours(Qwen25VisionTower, cfg, state, torch.bfloat16)
    assert prepack_linears(packed) == 4 * 5 + 2
    grid = torch.tensor([[1, 10, 14]])
    pixels = _pixels(grid, cfg.patch_size, seed=3).bfloat16()
    with torch.inference_mode():
        assert _rel_error(packed(pixels, grid), plain(pixels, grid).float()) < 0.01


# --------------------------------------------------------------------------------------- Qwen3-VL


@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, nn.Module, dict[str, torch.Tensor]]:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(
        depth=3,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        out_hidden_size=48,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,  # an 8 x 8 table, resampled to every grid
        deepstack_visual_indexes=[0, 1],
    )
    cfg._attn_implementation = "sdpa"
    with torch.device("cpu"):
        theirs = Qwen3VLVisionModel._from_config(cfg).eval()
    state = _random_state(theirs, seed=10)
    theirs.load_state_dict(state, strict=True)
    return cfg, theirs, state


def test_qwen3_names_match_transformers(qwen3: tuple[Any, nn.Module, dict[str, torch.Tensor]]) -> None:
    cfg, theirs, _ = qwen3
    with torch.device("meta"):
        ours = Qwen3VisionTower(cfg)
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_qwen3_moe_config_builds() -> None:
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig

    cfg = Qwen3VLMoeVisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=16)
    with torch.device("meta"):
        assert len(Qwen3VisionTower(cfg).deepstack_merger_list) == len(cfg.deepstack_visual_indexes)


@pytest.mark.parametrize("grids", [*GRIDS, [[1, 2, 2]]], ids=str)
def test_qwen3_fp32_bit_identical(qwen3: tuple[Any, nn.Module, dict[str, torch.Tensor]], grids: list) -> None:
    cfg, theirs, state = qwen3
    ours = _ours(Qwen3VisionTower, cfg, state, torch.float32)
    grid = torch.tensor(grids)
    pixels = _pixels(grid, cfg.patch_size, seed=11)
    with torch.inference_mode():
        expected = theirs(pixels, grid)
        merged, deepstack = ours(pixels, grid)
    assert merged.shape == (grid.prod(-1).sum() // 4, cfg.out_hidden_size)
    assert torch.equal(merged, expected.pooler_output)
    assert len(deepstack) == len(expected.deepstack_features) == 2
    for actual, feature in zip(deepstack, expected.deepstack_features, strict=True):
        assert actual.shape == merged.shape
        assert torch.equal(actual, feature)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_qwen3_bf16_close(
    qwen3: tuple[Any, nn.Module, dict[str, torch.Tensor]], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, theirs, state = qwen3
    if not fused:
        monkeypatch.setattr(qwen3_vision, "cpu_fused_ops", lambda device, dtype: None)
    ours = _ours(Qwen3VisionTower, cfg, state, torch.bfloat16)
    theirs_bf16 = _theirs_in(theirs, torch.bfloat16)
    grid = torch.tensor([[1, 10, 14], [3, 8, 12]])
    pixels = _pixels(grid, cfg.patch_size, seed=12)
    with torch.inference_mode():
        expected = theirs(pixels, grid)
        theirs_out = theirs_bf16(pixels.bfloat16(), grid)
        merged, deepstack = ours(pixels.bfloat16(), grid)
    pairs = [
        (merged, theirs_out.pooler_output, expected.pooler_output),
        *zip(deepstack, theirs_out.deepstack_features, expected.deepstack_features, strict=True),
    ]
    for actual, theirs_actual, reference in pairs:
        ours_error, theirs_error = _rel_error(actual, reference), _rel_error(theirs_actual, reference)
        assert ours_error < BF16_MAX_REL_ERROR
        assert ours_error <= 1.5 * theirs_error + 1e-3, (ours_error, theirs_error)


def _theirs_in(theirs: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of Transformers' tower in `dtype` (the fp32 one stays the reference)."""
    with torch.device("cpu"):
        copy = type(theirs)._from_config(theirs.config).eval()
    copy.load_state_dict(theirs.state_dict())
    return copy.to(dtype)
