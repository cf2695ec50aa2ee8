"""The released SmolVLM2 checkpoints (and SmolVLM v1, an Idefics3ForConditionalGeneration) load by name,
without a download: each model is built on the meta device from the real config.json values of
SmolVLM2-256M-Video-Instruct, SmolVLM2-500M-Video-Instruct, SmolVLM2-2.2B-Instruct and SmolVLM-256M-Instruct,
and every tensor name and shape the checkpoint holds must land on a parameter of that shape, with none
left over and none missing (q/k/v of the decoder and of the SigLIP tower fill merged projections).

The checkpoint's names and shapes come from Transformers' own model built from the same config (on meta):
the released files name them as Transformers does (`model.text_model.*`, `model.vision_model.*`,
`model.connector.modality_projection.proj.weight`, `lm_head.weight`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.family_matrix import meta_model
from vlm_engine.models import loader

# SigLIP-B/16 at 512 px (the 256M / 500M towers) and SigLIP so400m/14 at 384 px (the 2.2B's)
VISION_BASE_512 = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "patch_size": 16, "image_size": 512,
}  # fmt: skip
VISION_SO400M_384 = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 384,
}  # fmt: skip


def _text(**values: Any) -> dict[str, Any]:
    return dict(
        model_type="llama", vocab_size=49280, head_dim=64, rms_norm_eps=1e-5, hidden_act="silu",
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=False, **values,
    )  # fmt: skip


REAL_CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any], int]] = {
    # name: (config class, text config, vision config, scale_factor)
    "SmolVLM2-256M-Video-Instruct": (
        "SmolVLMConfig",
        _text(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
        VISION_BASE_512,
        4,
    ),
    "SmolVLM2-500M-Video-Instruct": (
        "SmolVLMConfig",
        _text(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5),
        VISION_BASE_512,
        4,
    ),
    "SmolVLM2-2.2B-Instruct": (
        "SmolVLMConfig",
        dict(
            _text(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                  num_key_value_heads=32),
            max_position_embeddings=16384, rope_parameters={"rope_type": "default", "rope_theta": 273768.0},
        ),
        VISION_SO400M_384,
        3,
    ),
    "SmolVLM-256M-Instruct": (  # SmolVLM v1: the Idefics3 architecture
        "Idefics3Config",
        _text(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
        VISION_BASE_512,
        4,
    ),
}  # fmt: skip


def real_config(name: str) -> Any:
    import transformers

    class_name, text, vision, scale_factor = REAL_CONFIGS[name]
    architecture = class_name.removesuffix("Config") + "ForConditionalGeneration"
    return getattr(transformers, class_name)(
        text_config=text,
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=49190,
        tie_word_embeddings=False,
        architectures=[architecture],
    )


def released_checkpoint(config: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor) of each tensor the released safetensors hold."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(config)
    return [(name, torch.empty(t.shape, device="meta")) for name, t in hf.state_dict().items()]


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_every_checkpoint_tensor_loads_into_a_parameter_of_its_shape(name: str) -> None:
    config = real_config(name)
    model = meta_model(config)
    checkpoint = released_checkpoint(config)
    parts = {n.split(".")[1] for n, _ in checkpoint if n.startswith("model.")}
    assert parts == {"text_model", "vision_model", "connector"}
    assert loader.load_weights(model, checkpoint) == []  # raises on a missing tensor or a wrong shape
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for _, t in checkpoint)


def test_a_leftover_tensor_is_reported() -> None:
    config = real_config("SmolVLM2-256M-Video-Instruct")
    model = meta_model(config)
    extra = ("model.vision_model.head.probe", torch.empty(1, 1, 768, device="meta"))
    assert loader.load_weights(model, [*released_checkpoint(config), extra]) == ["vision_model.head.probe"]


def test_a_wrong_shape_is_refused() -> None:
    config = real_config("SmolVLM2-500M-Video-Instruct")
    model = meta_model(config)
    checkpoint = released_checkpoint(config)
    index = next(i for i, (n, _) in enumerate(checkpoint) if n.endswith("modality_projection.proj.weight"))
    name, tensor = checkpoint[index]
    checkpoint[index] = (name, torch.empty(tensor.shape[0], tensor.shape[1] // 4, device="meta"))
    with pytest.raises(ValueError, match="shape"):
        loader.load_weights(model, checkpoint)
