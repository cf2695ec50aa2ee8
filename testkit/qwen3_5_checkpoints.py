"""Deterministic, offline Qwen3.5 and Qwen3.5-MoE checkpoints for tests: random weights from the real
Transformers config classes (`Qwen3_5Config`, `Qwen3_5MoeConfig`), the tokenizer and chat template of
`testkit.checkpoints` (Qwen2-VL's special tokens, as Qwen3-VL's), and Qwen3-VL's processor classes.

    write_qwen3_5(path, preset="tiny" | "tiny-moe" | "bench-2b", seed=0) -> Path
    cached_qwen3_5(preset, seed=0) -> Path
    cached_qwen3_next(preset="tiny", seed=0) -> Path   (Qwen3NextForCausalLM: text only, the tokenizer's template)

The layer mixes are their own: "tiny" alternates linear and full attention ([linear, full, linear, full]),
"tiny-moe" is Qwen3.5's 3:1 ([linear, linear, linear, full]). Rotary on a quarter of each 64-wide head
(the released `partial_rotary_factor`), interleaved M-RoPE over its 8 frequencies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.checkpoints import QWEN2_VL_VOCAB_SIZE, RandomCheckpoint, cached_random_checkpoint, write_random_checkpoint
from testkit.qwen_vl_checkpoints import _SHARED, Preset, _qwen3_vl_processor, qwen3_config

LINEAR, FULL = "linear_attention", "full_attention"
_TEXT = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096, "mrope_section": [2, 3, 3],
    "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
}  # fmt: skip
_VISION = {"depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_position_embeddings": 64}

QWEN3_5_PRESETS: dict[str, Preset] = {
    "tiny": {
        "text": {**_TEXT, "layer_types": [LINEAR, FULL, LINEAR, FULL]},
        "vision": _VISION,
        "pixels": (4 * 32 * 32, 64 * 32 * 32),
        "std": 0.2,
        "dtype": "float32",
    },
    # Qwen3.5-35B-A3B's MLP, tiny: 8 routed experts (top 2) and a gated shared expert in every layer.
    "tiny-moe": {
        "text": {
            **_TEXT, "layer_types": [LINEAR, LINEAR, LINEAR, FULL], "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64,
        },
        "vision": _VISION,
        "pixels": (4 * 32 * 32, 64 * 32 * 32),
        "std": 0.2,
        "dtype": "float32",
    },
    # Benchmarks: a Qwen3.5-shaped model of about 2B (1.7B with our 2,048-row vocabulary): Qwen3.5-2B's
    # hidden size, the released 3:1 mix over 24 layers, head_dim 256, 16 + 16 linear heads of 128; a
    # Qwen3-VL-2B-sized tower. Other values are assumed, not read from a release.
    "bench-2b": {
        "text": {
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144,
            "mrope_section": [11, 11, 10], "tie_word_embeddings": True, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 16, "layer_types": [LINEAR, LINEAR, LINEAR, FULL] * 6,
        },
        "vision": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                   "num_position_embeddings": 2304},
        "pixels": (3136, 12845056),
        "std": 0.02,
        "dtype": "bfloat16",
    },
}  # fmt: skip


def qwen3_5_config(preset: Preset, token_ids: dict[str, int]) -> Any:
    return qwen3_config(preset, token_ids, 10000000.0, "Qwen3_5", partial_rotary_factor=0.25)  # as released


def _qwen3_5_model(config: Any, dtype: Any) -> Any:
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    moe = config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    return (Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration)._from_config(
        config, dtype=dtype
    )


QWEN3_5 = RandomCheckpoint(
    "qwen3.5", QWEN3_5_PRESETS, config=lambda spec, ids, _: qwen3_5_config(spec, ids),
    model=_qwen3_5_model, processor=_qwen3_vl_processor, **_SHARED,
)  # fmt: skip


def write_qwen3_5(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Qwen3.5, or with preset "tiny-moe" Qwen3.5-MoE."""
    return write_random_checkpoint(QWEN3_5, path, preset, seed)


def cached_qwen3_5(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(QWEN3_5, preset, seed, cache_root)


QWEN3_NEXT_PRESETS: dict[str, Preset] = {
    # Qwen3-Next's MLP choice exercised: layer 1 sparse (decoder_sparse_step 2), layer 3 dense (mlp_only_layers).
    "tiny": {
        "text": {
            **{k: v for k, v in _TEXT.items() if k != "mrope_section"}, "layer_types": [LINEAR, FULL, LINEAR, FULL],
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 64, "decoder_sparse_step": 2, "mlp_only_layers": [3],
            "norm_topk_prob": True, "vocab_size": QWEN2_VL_VOCAB_SIZE,
        },
        "std": 0.2,
        "dtype": "float32",
    },
}  # fmt: skip


def qwen3_next_config(preset: Preset, token_ids: dict[str, int]) -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **preset["text"],
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        bos_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
        architectures=["Qwen3NextForCausalLM"],
    )


def _qwen3_next_model(config: Any, dtype: Any) -> Any:
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM._from_config(config, dtype=dtype)


QWEN3_NEXT = RandomCheckpoint(
    "qwen3-next", QWEN3_NEXT_PRESETS, config=lambda spec, ids, _: qwen3_next_config(spec, ids),
    model=_qwen3_next_model, processor=lambda spec, tokenizer: tokenizer, **_SHARED,
)  # fmt: skip


def cached_qwen3_next(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(QWEN3_NEXT, preset, seed, cache_root)
