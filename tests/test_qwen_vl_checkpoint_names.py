"""The released Qwen2.5-VL and Qwen3-VL checkpoints load by name, without a download: each model is
built on the meta device from the real config.json values of Qwen2.5-VL-3B/7B-Instruct and
Qwen3-VL-2B/4B/8B-Instruct (and Qwen3-VL-30B-A3B-Instruct, the MoE), and every tensor name and shape
the checkpoint holds must land on a parameter of that shape, with none left over and none missing.

The checkpoint's names and shapes come from Transformers' own model built from the same config (on
meta), written the way the released files name them: Qwen2.5-VL's as `model.*` / `visual.*` (its
original release), Qwen3-VL's as Transformers names them, the MoE experts as [E, hidden, 2I] / [E, I,
hidden] (the released layout, which Transformers transposes on load)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.family_matrix import meta_model
from vlm_engine.models import loader

QWEN2_5_VL_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    "hidden_act": "silu", "in_channels": 3,
}
QWEN3_VL_VISION_SMALL = {  # Qwen3-VL-2B / 4B
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17],
    "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
}
QWEN3_VL_VISION_LARGE = dict(  # Qwen3-VL-8B / 30B-A3B
    QWEN3_VL_VISION_SMALL, depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24]
)


def _qwen3_text(**values: Any) -> dict[str, Any]:
    return dict(
        vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=128, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True},
        **values,
    )


REAL_CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any], bool]] = {
    # name: (config class, text config, vision config, tie_word_embeddings)
    "Qwen2.5-VL-3B-Instruct": (
        "Qwen2_5_VLConfig",
        {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        dict(QWEN2_5_VL_VISION, out_hidden_size=2048),
        True,
    ),
    "Qwen2.5-VL-7B-Instruct": (
        "Qwen2_5_VLConfig",
        {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        dict(QWEN2_5_VL_VISION, out_hidden_size=3584),
        False,
    ),
    "Qwen3-VL-2B-Instruct": (
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_SMALL, out_hidden_size=2048),
        True,
    ),
    "Qwen3-VL-4B-Instruct": (
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_SMALL, out_hidden_size=2560),
        True,
    ),
    "Qwen3-VL-8B-Instruct": (
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_LARGE, out_hidden_size=4096),
        False,
    ),
    "Qwen3-VL-30B-A3B-Instruct": (
        "Qwen3VLMoeConfig",
        _qwen3_text(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                    decoder_sparse_step=1, mlp_only_layers=[]),
        dict(QWEN3_VL_VISION_LARGE, out_hidden_size=2048),
        False,
    ),
}


def real_config(name: str) -> Any:
    import transformers

    class_name, text, vision, tied = REAL_CONFIGS[name]
    config_class = getattr(transformers, class_name)
    architecture = class_name.removesuffix("Config") + "ForConditionalGeneration"
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=tied, architectures=[architecture])


def released_checkpoint(config: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor) of each tensor the released safetensors hold."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(config)
    legacy = config.model_type == "qwen2_5_vl"
    tensors = []
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the files hold the embedding only
        if legacy:
            name = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        tensors.append((name, torch.empty(tensor.shape, device="meta")))
    return tensors


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_every_checkpoint_tensor_loads_into_a_parameter_of_its_shape(name: str) -> None:
    config = real_config(name)
    model = meta_model(config)
    checkpoint = released_checkpoint(config)
    assert loader.load_weights(model, checkpoint) == []  # raises on a missing tensor or a wrong shape
    ours = sum(p.numel() for p in model.parameters())
    assert ours == sum(t.numel() for _, t in checkpoint)  # tied: one embedding on both sides


def test_a_wrong_shape_is_refused() -> None:
    config = real_config("Qwen3-VL-2B-Instruct")
    model = meta_model(config)
    checkpoint = released_checkpoint(config)
    name, tensor = checkpoint[-1]
    checkpoint[-1] = (name, torch.empty(tensor.shape[0] + 1, *tensor.shape[1:], device="meta"))
    with pytest.raises(ValueError, match="shape"):
        loader.load_weights(model, checkpoint)


def test_a_leftover_tensor_is_reported() -> None:
    config = real_config("Qwen2.5-VL-3B-Instruct")
    model = meta_model(config)
    checkpoint = [*released_checkpoint(config), ("visual.blocks.99.attn.qkv.weight", torch.empty(3, device="meta"))]
    assert loader.load_weights(model, checkpoint) == ["visual.blocks.99.attn.qkv.weight"]
