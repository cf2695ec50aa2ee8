"""Deterministic, offline Qwen2.5-VL and Qwen3-VL (dense and MoE) checkpoints for tests and benchmarks.

Random weights from the real Transformers config classes, the tokenizer trained in-process by
`testkit.checkpoints` (the Qwen2-VL special tokens and chat template: Qwen2.5-VL and
Qwen3-VL use the same ones), and each family's own HF processor classes.

    write_qwen2_5_vl(path, preset="tiny" | "bench-3b" | "bench-7b", seed=0) -> Path
    write_qwen3_vl(path, preset="tiny" | "tiny-moe", seed=0) -> Path
    cached_qwen2_5_vl(preset, seed=0) / cached_qwen3_vl(preset, seed=0) -> Path

"bench-3b" is Qwen2.5-VL-3B-Instruct's real config (36 x 2048 text layers, the 32-block window-attention
vision tower) except the vocabulary, which is our small tokenizer's (2,048 tokens instead of 151,936:
the embedding and the tied LM head are ~0.3B parameters smaller than the real model's). "bench-7b" is
Qwen2.5-VL-7B-Instruct's config, vocabulary size included (152,064 rows, of which our tokenizer names 2,048): 8.3B
parameters, 15.4 GiB in bf16, written shard by shard (`_write_sharded`) so that building it never holds the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.checkpoints import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_SPECIAL_TOKENS,
    QWEN2_VL_VOCAB_SIZE,
    RandomCheckpoint,
    _build_qwen2_vl_tokenizer,
    _init_weights_deterministically,
    _is_norm_parameter,
    cached_checkpoint,
    cached_random_checkpoint,
    checkpoint_dir,
    random_checkpoint_name,
    start_checkpoint,
    write_random_checkpoint,
)

# A preset: text / vision config values, the processor's pixel budget, init std and the save dtype.
Preset = dict[str, Any]

QWEN2_5_VL_PRESETS: dict[str, Preset] = {
    # Parity tests: 4 text layers (GQA 2:1, head_dim 32), a 4-block tower whose blocks 1 and 3 attend
    # to the whole image and 0 and 2 to 56-px windows (2x2 merged groups): images of odd sizes get
    # windows cut at their edges. initializer_range 0.2 for distinct greedy tokens (see checkpoints.py).
    "tiny": {
        "text": {
            "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "mrope_section": [4, 6, 6], "tie_word_embeddings": False,
        },
        "vision": {
            "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "window_size": 56,
            "fullatt_block_indexes": [1, 3], "tokens_per_second": 2,
        },
        "pixels": (4 * 28 * 28, 64 * 28 * 28),
        "std": 0.2,
        "dtype": "float32",
    },
    # Qwen2.5-VL-3B-Instruct's config.json values.
    "bench-3b": {
        "text": {
            "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
            "num_key_value_heads": 2, "max_position_embeddings": 128000, "mrope_section": [16, 24, 24], "tie_word_embeddings": True,
        },
        "vision": {
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        },
        "pixels": (3136, 12845056),
        "std": 0.02,
        "dtype": "bfloat16",
    },
}
# Qwen2.5-VL-7B-Instruct's config.json values: the 3B's tower (but for its output width, the text width), its own
# text model and vocabulary size.
QWEN2_5_VL_PRESETS["bench-7b"] = {
    **QWEN2_5_VL_PRESETS["bench-3b"],
    "text": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 128000, "mrope_section": [16, 24, 24],
        "tie_word_embeddings": False, "vocab_size": 152064,
    },
    "shard_bytes": 2 << 30,  # _write_sharded: at most one shard of this size in memory
}

QWEN3_VL_PRESETS: dict[str, Preset] = {
    # Parity tests: Qwen3 text layers (q/k norms, explicit head_dim 32 with hidden 128), interleaved
    # M-RoPE, a 3-block tower with 16-px patches, an 8x8 learned position grid interpolated to each
    # image, and deepstack features from blocks 0 and 1 added after decoder layers 0 and 1.
    "tiny": {
        "text": {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "mrope_section": [4, 6, 6],
            "tie_word_embeddings": False,
        },
        "vision": {
            "depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        "pixels": (4 * 32 * 32, 64 * 32 * 32),
        "std": 0.2,
        "dtype": "float32",
    },
    # The same with Qwen3-VL-MoE's text model (Qwen3-VL-30B-A3B's shape, tiny): 8 experts, top 2.
    "tiny-moe": {
        "text": {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "mrope_section": [4, 6, 6],
            "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "decoder_sparse_step": 1,
        },
        "vision": {
            "depth": 3, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        "pixels": (4 * 32 * 32, 64 * 32 * 32),
        "std": 0.2,
        "dtype": "float32",
    },
}


def _text_config(values: dict[str, Any], token_ids: dict[str, int], rope_theta: float) -> dict[str, Any]:
    values = dict(values)
    mrope_section = values.pop("mrope_section")
    vocab_size = values.pop("vocab_size", QWEN2_VL_VOCAB_SIZE)  # a real model's rows beyond our tokenizer's
    return {
        **values,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": mrope_section},
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
    }


def _media_token_ids(token_ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
    }


def qwen2_5_vl_config(preset: Preset, token_ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5_VLConfig

    text = _text_config(preset["text"], token_ids, 1000000.0)
    vision = {
        **preset["vision"],
        "hidden_act": "silu",
        "out_hidden_size": text["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=text["tie_word_embeddings"],
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        **_media_token_ids(token_ids),
    )


def qwen3_config(preset: Preset, token_ids: dict[str, int], rope_theta: float, family: str, **rope: Any) -> Any:
    """A config of the Qwen3-VL kind: `family` names its classes (`Qwen3VL` -> Qwen3VLConfig, Qwen3VLMoeConfig
    where the preset has experts, and their ...ForConditionalGeneration), the 16-px tower with 2x2 merging,
    interleaved M-RoPE as the released configs say (Transformers always interleaves), `rope` added to it."""
    import transformers

    name = family + ("Moe" if "num_experts" in preset["text"] else "")
    text = _text_config(preset["text"], token_ids, rope_theta)
    text["rope_parameters"].update(mrope_interleaved=True, **rope)
    vision = {
        **preset["vision"],
        "hidden_act": "gelu_pytorch_tanh",
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=text["tie_word_embeddings"],
        architectures=[f"{name}ForConditionalGeneration"],
        **_media_token_ids(token_ids),
    )


def qwen3_vl_config(preset: Preset, token_ids: dict[str, int]) -> Any:
    return qwen3_config(preset, token_ids, 5000000.0, "Qwen3VL")


def _size(pixels: tuple[int, int]) -> dict[str, int]:
    return {"shortest_edge": pixels[0], "longest_edge": pixels[1]}


def _generation(token_ids: dict[str, int]) -> dict[str, int]:
    return {
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
    }


def _init(model: Any, preset: Preset, seed: int) -> None:
    _init_weights_deterministically(model, preset["std"], seed)


def _qwen2_5_vl_model(config: Any, dtype: Any) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)


def _qwen2_5_vl_processor(spec: Preset, tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    patches = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=_size(spec["pixels"]), **patches),
        video_processor=Qwen2VLVideoProcessor(size=_size(spec["pixels"]), **patches),
        tokenizer=tokenizer,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _qwen3_vl_model(config: Any, dtype: Any) -> Any:
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    moe = config.architectures == ["Qwen3VLMoeForConditionalGeneration"]
    return (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)._from_config(config, dtype=dtype)


def _qwen3_vl_processor(spec: Preset, tokenizer: Any) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    patches = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    mean_std = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # Qwen3-VL's processor config
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=_size(spec["pixels"]), **patches, **mean_std),
        video_processor=Qwen3VLVideoProcessor(size=_size(spec["pixels"]), **patches, **mean_std),
        tokenizer=tokenizer,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


_SHARED = {"build_tokenizer": _build_qwen2_vl_tokenizer, "token_names": QWEN2_VL_SPECIAL_TOKENS, "init": _init,
           "generation": _generation}  # fmt: skip
QWEN2_5_VL = RandomCheckpoint(
    "qwen2.5-vl", QWEN2_5_VL_PRESETS, config=lambda spec, ids, _: qwen2_5_vl_config(spec, ids),
    model=_qwen2_5_vl_model, processor=_qwen2_5_vl_processor, **_SHARED,
)  # fmt: skip
QWEN3_VL = RandomCheckpoint(
    "qwen3-vl", QWEN3_VL_PRESETS, config=lambda spec, ids, _: qwen3_vl_config(spec, ids),
    model=_qwen3_vl_model, processor=_qwen3_vl_processor, **_SHARED,
)  # fmt: skip


def _write_sharded(row: RandomCheckpoint, path: str | Path, preset: str, seed: int = 0) -> Path:
    """`write_random_checkpoint` for a model too large to hold twice on a small machine: the model only on the meta
    device, each parameter drawn as `_init_weights_deterministically` draws it (named_parameters() order, one seeded
    generator, fp32 x std cast to the save dtype; norms 1 / 0), renamed as `save_pretrained` renames it, and written
    in safetensors shards of preset["shard_bytes"] with their index: never more than one shard in memory."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from transformers.core_model_loading import revert_weight_conversion

    spec = row.presets[preset]
    out, tokenizer, token_ids = start_checkpoint(path, row.build_tokenizer, row.token_names)
    config = row.config(spec, token_ids, tokenizer)
    config.dtype = spec["dtype"]
    dtype = getattr(torch, spec["dtype"])
    with torch.device("meta"):
        model = row.model(config, dtype)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = held = 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, param in model.named_parameters():  # tied parameters once, as save_pretrained writes them
        if _is_norm_parameter(name):
            value = torch.full(param.shape, 1.0 if name.endswith("weight") else 0.0, dtype=dtype)
        else:
            value = (torch.randn(param.shape, generator=generator, dtype=torch.float32) * spec["std"]).to(dtype)
        if shard and held + value.nbytes > spec.get("shard_bytes", 2 << 30):
            flush()
            held = 0
        shard.update(revert_weight_conversion(model, {name: value}))
        total, held = total + value.nbytes, held + value.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(str(out))
    GenerationConfig(do_sample=False, **row.generation(token_ids)).save_pretrained(str(out))
    row.processor(spec, tokenizer).save_pretrained(str(out))
    return out


def write_qwen2_5_vl(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A Qwen2.5-VL checkpoint; presets with "shard_bytes" (bench-7b) written shard by shard."""
    sharded = "shard_bytes" in QWEN2_5_VL_PRESETS.get(preset, {})
    return (_write_sharded if sharded else write_random_checkpoint)(QWEN2_5_VL, path, preset, seed)


def write_qwen3_vl(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Qwen3-VL, or with preset "tiny-moe" Qwen3-VL-MoE."""
    return write_random_checkpoint(QWEN3_VL, path, preset, seed)


def cached_qwen2_5_vl(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    name = random_checkpoint_name(QWEN2_5_VL, preset, seed)
    return cached_checkpoint(name, lambda tmp: write_qwen2_5_vl(tmp, preset, seed), cache_root)


def qwen2_5_vl_dir(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    """Where `cached_qwen2_5_vl(preset, seed)` is, built or not: the files made from a 7B's 15 GB name it alone."""
    return checkpoint_dir(random_checkpoint_name(QWEN2_5_VL, preset, seed), cache_root)


def cached_qwen3_vl(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(QWEN3_VL, preset, seed, cache_root)
