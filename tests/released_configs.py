"""The real config.json values of released checkpoints, for the names check of the family matrix
(tests/test_family_matrix.py): each model is built on the meta device from them, and the tensor names and
shapes the released safetensors hold come from Transformers' own model built from the same config (on meta),
written the way the released files name them (`Release.renames`, `Release.transposed`).

Qwen2.5-VL-3B/7B-Instruct (named `model.*` / `visual.*`, its original release), Qwen3-VL-2B/4B/8B-Instruct and
Qwen3-VL-30B-A3B-Instruct (the MoE: experts stored [E, hidden, 2I] / [E, I, hidden], which Transformers
transposes on load), SmolVLM2-256M/500M-Video-Instruct, SmolVLM2-2.2B-Instruct and SmolVLM-256M-Instruct
(Idefics3; named as Transformers names them), gemma-3-4b-it and gemma-3-12b-it (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`, which Transformers 5 renames on load; tied),
Qwen3.5-0.8B and Qwen3.5-35B-A3B (hybrid linear / full attention; the MoE's experts stored one by one, as
Transformers 5 saves them)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Release:
    config: Callable[[], Any]
    renames: tuple[tuple[str, str], ...] = ()  # Transformers' name prefix -> the released file's
    transposed: tuple[str, ...] = ()  # name suffixes stored with their last two dims swapped
    # Named as Transformers' save_pretrained writes them (its load-time conversions reverted): Qwen3.5-MoE's
    # experts one tensor per expert and projection.
    saved: bool = False


def released_checkpoint(release: Release, config: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor) of each tensor the released safetensors hold; a tied LM head is not stored."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(config)
    state = hf.state_dict()
    if release.saved:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(hf, state)
    tensors = []
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for old, new in release.renames:
            name = name.replace(old, new, 1)
        if name.endswith(release.transposed):
            tensor = tensor.transpose(1, 2)
        tensors.append((name, torch.empty(tensor.shape, device="meta")))
    return tensors


# ---- Qwen2.5-VL, Qwen3-VL ---------------------------------------------------------------------------

QWEN2_5_VL_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
    "hidden_act": "silu", "in_channels": 3,
}  # fmt: skip
QWEN3_VL_VISION_SMALL = {  # Qwen3-VL-2B / 4B
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17],
    "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
}  # fmt: skip
QWEN3_VL_VISION_LARGE = dict(  # Qwen3-VL-8B / 30B-A3B
    QWEN3_VL_VISION_SMALL, depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24]
)
QWEN2_5_VL_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def _qwen3_text(**values: Any) -> dict[str, Any]:
    return dict(
        vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=128, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True},
        **values,
    )  # fmt: skip


def _qwen(class_name: str, text: dict[str, Any], vision: dict[str, Any], tied: bool) -> Callable[[], Any]:
    def config() -> Any:
        import transformers

        architecture = class_name.removesuffix("Config") + "ForConditionalGeneration"
        config_class = getattr(transformers, class_name)
        return config_class(text_config=text, vision_config=vision, tie_word_embeddings=tied, architectures=[architecture])

    return config


QWEN2_5_VL_LEGACY = (("model.language_model.", "model."), ("model.visual.", "visual."))
QWEN3_VL_MOE_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

QWEN2_5_VL_RELEASES = {
    "Qwen2.5-VL-3B-Instruct": Release(_qwen(
        "Qwen2_5_VLConfig",
        {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
         "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
         "rope_parameters": QWEN2_5_VL_ROPE},
        dict(QWEN2_5_VL_VISION, out_hidden_size=2048),
        True,
    ), QWEN2_5_VL_LEGACY),
    "Qwen2.5-VL-7B-Instruct": Release(_qwen(
        "Qwen2_5_VLConfig",
        {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
         "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
         "rope_parameters": QWEN2_5_VL_ROPE},
        dict(QWEN2_5_VL_VISION, out_hidden_size=3584),
        False,
    ), QWEN2_5_VL_LEGACY),
}  # fmt: skip
QWEN3_VL_RELEASES = {
    "Qwen3-VL-2B-Instruct": Release(_qwen(
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_SMALL, out_hidden_size=2048),
        True,
    )),
    "Qwen3-VL-4B-Instruct": Release(_qwen(
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_SMALL, out_hidden_size=2560),
        True,
    )),
    "Qwen3-VL-8B-Instruct": Release(_qwen(
        "Qwen3VLConfig",
        _qwen3_text(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8),
        dict(QWEN3_VL_VISION_LARGE, out_hidden_size=4096),
        False,
    )),
}  # fmt: skip
QWEN3_VL_MOE_RELEASES = {
    "Qwen3-VL-30B-A3B-Instruct": Release(_qwen(
        "Qwen3VLMoeConfig",
        _qwen3_text(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                    decoder_sparse_step=1, mlp_only_layers=[]),
        dict(QWEN3_VL_VISION_LARGE, out_hidden_size=2048),
        False,
    ), transposed=QWEN3_VL_MOE_EXPERTS),
}  # fmt: skip



# ---- Qwen3.5 -------------------------------------------------------------------------------------------
# The smallest dense VL release (0.8B) and the first MoE one (35B-A3B): hybrid text stacks (every 4th layer
# full attention), head_dim 256 with a quarter rotary, 248,320-row vocabulary, Qwen3-VL-shaped towers
# without DeepStack; named as Transformers 5 names them (model.language_model.*, model.visual.*). Qwen3.6-35B-A3B
# has 35B-A3B's architecture and shape (its model card: 40 layers of 2048, 16 QK / 32 V linear heads of 128,
# 16 / 2 attention heads of 256 with 64 rotary dims, 256 experts of 512, 8 routed + 1 shared).


def _qwen3_5_text(**values: Any) -> dict[str, Any]:
    return dict(
        vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=256, hidden_act="silu",
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
        **values,
    )  # fmt: skip


QWEN3_5_VISION = {
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
}  # fmt: skip
QWEN3_5_RELEASES = {
    "Qwen3.5-0.8B": Release(_qwen(
        "Qwen3_5Config",
        _qwen3_5_text(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                      num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
        dict(QWEN3_5_VISION, depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024),
        True,
    )),
}  # fmt: skip
QWEN3_5_MOE_RELEASES = {
    "Qwen3.5-35B-A3B": Release(_qwen(
        "Qwen3_5MoeConfig",
        _qwen3_5_text(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                      linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512),
        dict(QWEN3_5_VISION, depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048),
        False,
    ), saved=True),
}  # fmt: skip

# ---- SmolVLM2, SmolVLM (Idefics3) --------------------------------------------------------------------

# SigLIP-B/16 at 512 px (the 256M / 500M towers) and SigLIP so400m/14 at 384 px (the 2.2B's)
VISION_BASE_512 = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "patch_size": 16, "image_size": 512,
}  # fmt: skip
VISION_SO400M_384 = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "patch_size": 14, "image_size": 384,
}  # fmt: skip


def _smol_text(**values: Any) -> dict[str, Any]:
    return dict(
        model_type="llama", vocab_size=49280, head_dim=64, rms_norm_eps=1e-5, hidden_act="silu",
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=False, **values,
    )  # fmt: skip


def _smol(class_name: str, text: dict[str, Any], vision: dict[str, Any], scale_factor: int) -> Release:
    def config() -> Any:
        import transformers

        architecture = class_name.removesuffix("Config") + "ForConditionalGeneration"
        return getattr(transformers, class_name)(
            text_config=text, vision_config=vision, scale_factor=scale_factor, image_token_id=49190,
            tie_word_embeddings=False, architectures=[architecture],
        )  # fmt: skip

    return Release(config)


SMOL_256M = _smol_text(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3)  # fmt: skip
SMOLVLM_RELEASES = {
    "SmolVLM2-256M-Video-Instruct": _smol("SmolVLMConfig", SMOL_256M, VISION_BASE_512, 4),
    "SmolVLM2-500M-Video-Instruct": _smol(
        "SmolVLMConfig",
        _smol_text(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                   num_key_value_heads=5),
        VISION_BASE_512,
        4,
    ),
    "SmolVLM2-2.2B-Instruct": _smol(
        "SmolVLMConfig",
        dict(
            _smol_text(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32),
            max_position_embeddings=16384, rope_parameters={"rope_type": "default", "rope_theta": 273768.0},
        ),
        VISION_SO400M_384,
        3,
    ),
}  # fmt: skip
IDEFICS3_RELEASES = {"SmolVLM-256M-Instruct": _smol("Idefics3Config", SMOL_256M, VISION_BASE_512, 4)}


# ---- Gemma 3 -----------------------------------------------------------------------------------------

SIGLIP_SO400M = {  # every Gemma 3 VLM's tower (vision_use_head false; the rest SiglipVisionConfig's defaults)
    "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
    "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
}  # fmt: skip
GEMMA3_MEDIA_TOKENS = {
    "mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
}  # fmt: skip
# The text config.json values; the rest are Gemma3TextConfig's defaults, which are the released ones
# (8 heads / 4 KV heads of 256, query_pre_attn_scalar 256, theta 1e6 and local base 1e4, a full layer
# in every 6, vocabulary 262,208), written out here where the 12B differs.
GEMMA3_TEXT = {
    "gemma-3-4b-it": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
    "gemma-3-12b-it": {
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
}  # fmt: skip
GEMMA_3_1B = {  # gemma-3-1b-it's config.json (Gemma3ForCausalLM, text only)
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
    "vocab_size": 262144, "max_position_embeddings": 32768,
}  # fmt: skip
GEMMA3_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def gemma3_config(name: str) -> Any:
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=GEMMA3_TEXT[name], vision_config=SIGLIP_SO400M,
        architectures=["Gemma3ForConditionalGeneration"], **GEMMA3_MEDIA_TOKENS,
    )  # fmt: skip


GEMMA3_RELEASES = {name: Release(lambda name=name: gemma3_config(name), GEMMA3_RENAMES) for name in GEMMA3_TEXT}


# ---- PaddleOCR-VL --------------------------------------------------------------------------------------
# PaddlePaddle/PaddleOCR-VL (0.9B)'s config.json values. The values are Transformers 5.25's PaddleOCRTextConfig /
# PaddleOCRVisionConfig defaults, which its docstrings give as PaddlePaddle/PaddleOCR-VL's, cross-checked against
# the candle and mlx-vlm ports' defaults and a public test fixture that mirrors the released file's keys
# (rope_scaling with mrope_section [16, 24, 24], rope_theta 500000, use_bias false, tie_word_embeddings false);
# not checked against the hub file itself. The file is flat (text values at the top level), which Transformers
# 5.25 reads as tied; but the released safetensors store their own `lm_head.weight` (a public PaddleOCR-VL loader
# builds an untied head and requires every key), so Transformers' loader unties it again: the release is served
# untied, as this nested config says (tests/test_paddleocr_vl_family.py serves the flat form).
# Names: the released files name the projector `mlp_AR.*`, the encoder `visual.vision_model.*`, the decoder
# `model.*` (Transformers' conversion_mapping "paddleocr_vl" renames them on load, and back on save); they also
# hold the encoder's unused `packing_position_embedding` (32768 x 1152) and pooling `head`, which Transformers skips.
PADDLEOCR_VL_TEXT = {
    "vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "use_bias": False, "tie_word_embeddings": False,
    "rope_theta": 500000, "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
}  # fmt: skip
PADDLEOCR_VL_VISION = {
    "model_type": "paddleocr_vl", "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 384, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6, "spatial_merge_size": 2,
}  # fmt: skip
PADDLEOCR_VL_RENAMES = (
    ("model.projector.", "mlp_AR."), ("model.visual.", "visual."), ("model.language_model.", "model."),
)  # fmt: skip


def paddleocr_vl_config() -> Any:
    from transformers import PaddleOCRVLConfig

    return PaddleOCRVLConfig(
        text_config=dict(PADDLEOCR_VL_TEXT), vision_config=dict(PADDLEOCR_VL_VISION), tie_word_embeddings=False,
        image_token_id=100295, vision_start_token_id=101305, vision_end_token_id=101306,
        architectures=["PaddleOCRVLForConditionalGeneration"],
    )  # fmt: skip


PADDLEOCR_VL_RELEASES = {"PaddleOCR-VL": Release(paddleocr_vl_config, PADDLEOCR_VL_RENAMES)}
# ---- Mistral 3, LightOnOCR -------------------------------------------------------------------------------

# Mistral-Small-3.1-24B-Instruct-2503's config.json (as quoted verbatim in a public config-parser test,
# brolm's mistral3_config test; the same values are Transformers' Mistral3Config defaults). It names no
# top-level tie_word_embeddings: Transformers 5 then ties (Mistral3Config's default) although the text config
# is untied and the file stores `language_model.lm_head.weight`; the release here says untied, as the file is.
MISTRAL_SMALL_3_1 = {
    "text_config": {
        "model_type": "mistral", "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
        "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072,
    },
    "vision_config": {
        "model_type": "pixtral", "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
        "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "image_token_index": 10, "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "vision_feature_layer": -1,
}  # fmt: skip
# The file's names are Llava's (Transformers' conversion mapping "llava", which Mistral3 uses).
MISTRAL3_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# LightOnOCR-1B-1025: its config.json's values (a copy of the release's files in a public repository: Pixtral as in
# Mistral Small 3.1; a Qwen3-0.6B-sized text model, tied, 8,192 positions; image token 151655), in Transformers 5's
# LightOnOcr form: the file itself says mistral3 / "LightOnOCRForConditionalGeneration" (testkit's bench-1b writes
# that form); the tensor names are Transformers 5's (no conversion mapping for lighton_ocr).
LIGHTONOCR_1B = {
    "vision_config": {
        "model_type": "pixtral", "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "image_size": 1540,
        "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    },
    "text_config": {
        "model_type": "qwen3", "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
        "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "sliding_window": None, "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "spatial_merge_size": 2, "image_token_id": 151655, "tie_word_embeddings": True,
}  # fmt: skip


def mistral3_release_config() -> Any:
    from transformers import Mistral3Config

    return Mistral3Config(
        **MISTRAL_SMALL_3_1, tie_word_embeddings=False, architectures=["Mistral3ForConditionalGeneration"]
    )


def lightonocr_release_config() -> Any:
    from transformers import LightOnOcrConfig

    return LightOnOcrConfig(**LIGHTONOCR_1B, architectures=["LightOnOcrForConditionalGeneration"])


MISTRAL3_RELEASES = {"Mistral-Small-3.1-24B-Instruct-2503": Release(mistral3_release_config, MISTRAL3_RENAMES)}
LIGHTONOCR_RELEASES = {"LightOnOCR-1B-1025": Release(lightonocr_release_config)}
# ---- Gemma 4 (text models) -------------------------------------------------------------------------------

# The text_config values of gemma-4-E2B-it / gemma-4-E4B-it's config.json, as public ports' test fixtures
# reproduce them (not read from the Hugging Face files themselves, which this workplace cannot reach): E2B
# in a Rust and a Swift test of Gemma4ForConditionalGeneration configs, E4B in a Go (MLX) test and a
# from-scratch notebook. The rest are Gemma4TextConfig's defaults, which those fixtures agree with:
# rope theta 1e4 (sliding) / 1e6 proportional over a quarter of the 512 dims (global), vocabulary 262,144,
# per-layer inputs of 256, final logits soft-capped at 30, 131,072 positions, tied embeddings.
GEMMA4_TEXT = {
    "gemma-4-E2B": {
        "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
        "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 256,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "final_logit_softcapping": 30.0,
    },
    "gemma-4-E4B": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
        "num_kv_shared_layers": 18, "use_double_wide_mlp": False, "hidden_size_per_layer_input": 256,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7, "final_logit_softcapping": 30.0,
    },
}  # fmt: skip


def gemma4_text_config(name: str, **overrides: Any) -> Any:
    """A released Gemma 4 text config (Gemma4ForCausalLM), with `overrides` on top."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**GEMMA4_TEXT[name], **overrides}, architectures=["Gemma4ForCausalLM"])


# gemma-4-31B-it (dense, images only: no audio tower): its text_config as a Go (MLX) test and a Rust test of
# Gemma4ForConditionalGeneration configs write it (no per-layer inputs, keys as values on the global
# layers with 4 global KV heads, a full layer in every 6, window 1024); its vision_config as five public
# fixtures agree on it (the larger models' tower: 27 layers of 1152, 16 heads of 72, standardized outputs).
# max_position_embeddings: 262,144 in one fixture, 131,072 in another (unconfirmed; names do not depend on it).
GEMMA4_31B_TEXT = {
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32,
    "num_key_value_heads": 16, "num_global_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
    "attention_k_eq_v": True, "sliding_window": 1024, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision", "max_position_embeddings": 262144,
}  # fmt: skip
GEMMA4_VISION_LARGE = {
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "head_dim": 72, "patch_size": 16, "pooling_kernel_size": 3,
    "position_embedding_size": 10240, "standardize": True, "use_clipped_linears": False,
}  # fmt: skip


# gemma-4-26B-A4B-it (MoE, images only): its text_config as a Go (MLX) test, a Rust and a Swift test write it
# (30 layers of 2816, 128 experts of 704 beside a dense MLP of 2112, top 8; 2 global KV heads as values); the
# larger models' tower.
GEMMA4_26B_A4B_TEXT = {
    "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
    "attention_k_eq_v": True, "sliding_window": 1024, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5, "final_logit_softcapping": 30.0,
    "use_bidirectional_attention": "vision", "max_position_embeddings": 262144,
}  # fmt: skip


def gemma4_config(text: dict[str, Any], vision: dict[str, Any] = GEMMA4_VISION_LARGE, audio: bool = False) -> Any:
    from transformers import Gemma4AudioConfig, Gemma4Config

    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=Gemma4AudioConfig() if audio else None,
        architectures=["Gemma4ForConditionalGeneration"],
    )  # fmt: skip


# Transformers 5 wrote these releases: the files hold its own names.
GEMMA4_RELEASES = {
    "gemma-4-31B-it": Release(lambda: gemma4_config(GEMMA4_31B_TEXT)),
    "gemma-4-26B-A4B-it": Release(lambda: gemma4_config(GEMMA4_26B_A4B_TEXT)),
}

# gemma-4-E2B-it / gemma-4-E4B-it (images and audio): the text configs above; the small models' tower as the
# config.json of a gemma-4-E4B-it fine-tune (written by Transformers 5.7.0, quoted in a public agent log) and a
# Rust test's E2B vision_config (text hidden 1536) write it: Gemma4VisionConfig's defaults (16 layers of 768,
# 12 heads of 64) with clipped linears and no standardization. The audio tower: Gemma4AudioConfig's defaults
# (12 Conformer layers of 1024, output 1536), which that config.json and a Go (Ollama) test of the released
# audio_config agree with. Not in the family matrix (GEMMA4_RELEASES): its names check wants every checkpoint
# tensor in a parameter, and our model deliberately leaves the audio tower out (tests/test_gemma4_family.py).
GEMMA4_VISION_SMALL = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
    "num_key_value_heads": 12, "head_dim": 64, "patch_size": 16, "pooling_kernel_size": 3,
    "position_embedding_size": 10240, "standardize": False, "use_clipped_linears": True,
}  # fmt: skip
GEMMA4_AUDIO_RELEASES = {
    f"{name}-it": Release(functools.partial(gemma4_config, GEMMA4_TEXT[name], GEMMA4_VISION_SMALL, audio=True))
    for name in ("gemma-4-E2B", "gemma-4-E4B")
}
