"""Our SigLIP tower (vlm_engine/models/siglip.py) against Transformers' own towers on tiny random configs
built from its config classes: plain SigLIP (`SiglipVisionModel` without the pooling head, as Gemma 3
uses it) and the NaViT-style towers of SmolVLM and Idefics3 (bucketed positions, padded patches).
Transformers' state dict loads into ours by name through the loader (q/k/v into the merged projection),
nothing missing or left over; fp32 outputs are bit-identical; bf16 stays as close to the fp32
reference as Transformers' own bf16 run."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from vlm_engine.models import loader
from vlm_engine.models.siglip import SiglipVisionTower, bucketed_position_ids

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4}


def _theirs(kind: str) -> tuple[Any, nn.Module]:
    if kind == "siglip":
        from transformers import SiglipVisionConfig, SiglipVisionModel

        cfg = SiglipVisionConfig(**SMALL, image_size=70, patch_size=14, vision_use_head=False)
        model_class: Any = SiglipVisionModel
    elif kind == "smolvlm":
        from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

        cfg, model_class = SmolVLMVisionConfig(**SMALL, image_size=64, patch_size=8), SmolVLMVisionTransformer
    else:
        from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
        from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

        cfg, model_class = Idefics3VisionConfig(**SMALL, image_size=56, patch_size=14), Idefics3VisionTransformer
    cfg._attn_implementation = "sdpa"
    model = model_class._from_config(cfg).eval()
    g = torch.Generator().manual_seed(0)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.2 for k, v in model.state_dict().items()})
    return cfg, model


def _ours(cfg: Any, theirs: nn.Module, dtype: torch.dtype = torch.float32) -> SiglipVisionTower:
    with torch.device("meta"):  # as the engine builds models
        ours = SiglipVisionTower(cfg, positions="fixed" if cfg.model_type.startswith("siglip") else "bucketed")
    ours = ours.to_empty(device="cpu")
    assert loader.load_weights(ours, theirs.state_dict().items()) == []  # raises on anything missing
    return ours.to(dtype).eval()


@pytest.fixture(scope="module", params=["siglip", "smolvlm", "idefics3"])
def towers(request: pytest.FixtureRequest) -> tuple[Any, nn.Module, SiglipVisionTower]:
    cfg, theirs = _theirs(request.param)
    return cfg, theirs, _ours(cfg, theirs)


def _images(cfg: Any, batch: int, seed: int) -> torch.Tensor:
    side = cfg.image_size // cfg.patch_size * cfg.patch_size
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch", [1, 3])
def test_fp32_bit_identical(towers: tuple[Any, nn.Module, SiglipVisionTower], batch: int) -> None:
    cfg, theirs, ours = towers
    pixels = _images(cfg, batch, seed=batch)
    with torch.inference_mode():
        expected = theirs(pixels).last_hidden_state
        actual = ours(pixels)
    assert actual.shape == (batch, (cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("kind", ["smolvlm", "idefics3"])
def test_padded_patches_fp32_bit_identical(kind: str) -> None:
    """Images padded to a common size: their valid patches spread over the whole position table
    (bucketed), padded patches are masked out as keys; every row equals Transformers' (the padded
    rows too: they are computed, and the connector shuffles them in as Transformers does)."""
    cfg, theirs = _theirs(kind)
    ours = _ours(cfg, theirs)
    side = cfg.image_size // cfg.patch_size
    mask = torch.zeros(4, side, side, dtype=torch.bool)
    mask[0] = True
    mask[1, : side - 1, : side - 3] = True
    mask[2, :2, :] = True
    mask[3, :, :1] = True
    pixels = _images(cfg, 4, seed=7)
    with torch.inference_mode():
        expected = theirs(pixels, patch_attention_mask=mask).last_hidden_state
        actual = ours(pixels, mask)
    assert torch.equal(actual, expected)


def test_bucketed_ids_of_a_full_tile_cover_the_table() -> None:
    # SmolVLM2's 512-px tiles of 16-px patches: 32 x 32 patches over a 32 x 32 table
    ids = bucketed_position_ids(32, 32, 32, 32, 32)
    assert sorted(ids.tolist()) == list(range(32 * 32))


def test_fixed_positions_refuse_another_size() -> None:
    cfg, theirs = _theirs("siglip")
    ours = _ours(cfg, theirs)
    with pytest.raises(ValueError, match="positions"):
        ours(torch.randn(1, 3, 28, 28))


def test_bf16_close(towers: tuple[Any, nn.Module, SiglipVisionTower]) -> None:
    """bf16 (the CPU default; the patch embedding as a GEMM): within 1.5x Transformers' own bf16
    error against the fp32 reference, + 0.001, and under 0.02 relative."""
    cfg, theirs, _ = towers
    pixels = _images(cfg, 2, seed=11)
    with torch.inference_mode():
        reference = theirs(pixels).last_hidden_state
        ours = _ours(cfg, theirs, torch.bfloat16)(pixels).float()
        theirs_out = copy.deepcopy(theirs).to(torch.bfloat16)(pixels.bfloat16()).last_hidden_state.float()

    def rel(x: torch.Tensor) -> float:
        return ((x - reference).norm() / reference.norm()).item()

    assert rel(ours) < 0.02
    assert rel(ours) <= 1.5 * rel(theirs_out) + 0.001
