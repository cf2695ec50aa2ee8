"""Deterministic, offline Gemma 3 checkpoints for tests and benchmarks.

Random weights from the real Transformers config classes (`Gemma3Config` over `Gemma3TextConfig` and
`SiglipVisionConfig`), the byte-level BPE trained in-process by `testkit.checkpoints` with
Gemma's special tokens added (the processor reads its begin/end-of-image and image tokens from the
tokenizer), a chat template that renders as Gemma 3's does, and the real `Gemma3ImageProcessor` /
`Gemma3Processor` at the preset's image size.

    write_gemma3(path, preset="tiny" | "bench-4b", seed=0) -> Path
    cached_gemma3(preset="tiny", seed=0) -> Path

"tiny" (parity tests, seconds): 5 text layers (sliding, sliding, full, sliding, full) with a 32-token
window, linear-scaled RoPE on the full layers and the local base frequency on the sliding ones, q/k
norms, a query scale that is not the head dim's, a 2-layer SigLIP tower on 64-px images (8-px patches)
pooled to 16 tokens an image.

"bench-4b" is gemma-3-4b-it's released config.json (text 2560 x 34 layers, 8 heads / 4 KV heads of 256,
window 1024 on 5 layers of 6; SigLIP-so400m at 896 px, 27 layers; 256 tokens an image; vocabulary
262,208 rows, of which our tokenizer uses the first 2,056), saved in bfloat16: ~4.3B parameters, 8.6 GB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit.checkpoints import (
    RandomCheckpoint,
    _drop_load_time_kwargs,
    _train_bpe_tokenizer,
    cached_random_checkpoint,
    write_random_checkpoint,
)

# Gemma's own special tokens, added after the trained BPE vocabulary (and its Qwen-style specials,
# which stay unused here). The real tokenizer has them at other ids; nothing reads those ids.
GEMMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)

# Written from scratch; renders as gemma-3-*-it's template does: <bos>, a system message folded into
# the first user turn, "model" for the assistant, one <start_of_image> per image part (the processor
# expands it), text parts trimmed, <end_of_turn> after each turn.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set prefix = namespace(text='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- if system is string -%}{%- set prefix.text = system ~ '\\n\\n' -%}"
    "{%- else -%}{%- for part in system if part['type'] == 'text' -%}"
    "{%- set prefix.text = prefix.text ~ part['text'] -%}{%- endfor -%}"
    "{%- set prefix.text = prefix.text ~ '\\n\\n' -%}{%- endif -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n' -}}"
    "{%- if loop.first -%}{{- prefix.text -}}{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] | trim -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# A preset: text / vision config values, tokens per image, init std and the save dtype.
Preset = dict[str, Any]
SLIDING, FULL = "sliding_attention", "full_attention"

GEMMA3_PRESETS: dict[str, Preset] = {
    "tiny": {
        "text": {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 24, "max_position_embeddings": 4096,
            "sliding_window": 32, "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL],
            "rope_parameters": {
                FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        "vision": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "image_size": 64, "patch_size": 8,
        },
        "mm_tokens_per_image": 16,
        "vocab_size": None,  # the tokenizer's
        # Untied: with the embedding as LM head the tiny model's greedy tokens repeat the prompt's last
        # token (its scaled embedding dominates the residual stream); the released configs tie (bench-4b,
        # tests/test_gemma3_checkpoint_names.py).
        "tie_word_embeddings": False,
        "std": 0.2,
        "norm_std": 0.1,
        "dtype": "float32",
    },
    # gemma-3-4b-it's config.json; the text config's other values are Gemma3TextConfig's defaults, which
    # are the released ones (head_dim 256, query_pre_attn_scalar 256, rope theta 1e6 / local 1e4).
    "bench-4b": {
        "text": {
            "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
            "sliding_window": 1024, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        "vision": {
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
            "image_size": 896, "patch_size": 14,
        },
        "mm_tokens_per_image": 256,
        "vocab_size": 262208,
        "std": 0.02,
        "norm_std": 0.02,
        "dtype": "bfloat16",
    },
}


def _build_tokenizer(staging: Path) -> Any:
    """The trained byte-level BPE plus Gemma's specials, loaded back as a transformers tokenizer whose
    boi/eoi/image tokens are named attributes (Gemma3Processor reads them)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = _train_bpe_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA3_SPECIAL_TOKENS])
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": None,
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "padding_side": "left",
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    _drop_load_time_kwargs(tokenizer)
    return tokenizer


def gemma3_config(preset: Preset, token_ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import Gemma3Config

    tied = preset.get("tie_word_embeddings", True)
    text = {
        "tie_word_embeddings": tied,
        **preset["text"],
        "vocab_size": vocab_size,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "bos_token_id": token_ids["<bos>"],
        "eos_token_id": token_ids["<eos>"],
        "pad_token_id": token_ids["<pad>"],
    }
    vision = {**preset["vision"], "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False}
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=preset["mm_tokens_per_image"],
        boi_token_index=token_ids["<start_of_image>"],
        eoi_token_index=token_ids["<end_of_image>"],
        image_token_index=token_ids["<image_soft_token>"],
        tie_word_embeddings=tied,
        architectures=["Gemma3ForConditionalGeneration"],
        # gemma-3-*-it: generation ends at <eos> or <end_of_turn>
        eos_token_id=[token_ids["<eos>"], token_ids["<end_of_turn>"]],
    )


# Values drawn per block of this many (a multiple of 16, the CPU normal sampler's group): a bf16 4B model
# is filled without an fp32 copy of its 671M-row embedding beside it.
_INIT_BLOCK = 1 << 24


def _init_deterministically(model: Any, std: float, norm_std: float, seed: int) -> None:
    """Every parameter from one seeded generator, in named_parameters() order: matrices, embeddings and
    biases N(0, std); Gemma's RMSNorm weights (stored as scale - 1) N(0, norm_std), so that 1 + w is
    exercised; SigLIP's LayerNorms 1 + N(0, norm_std) and biases N(0, norm_std)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.rsplit(".", 2)[-2]
            base, scale = 0.0, std
            if "norm" in module:
                layer_norm = "vision_tower" in name  # the tower's are LayerNorms; the rest Gemma's RMSNorms
                base, scale = (1.0 if layer_norm and name.endswith("weight") else 0.0), norm_std
            flat = param.view(-1)
            for start in range(0, flat.numel(), _INIT_BLOCK):
                count = min(_INIT_BLOCK, flat.numel() - start)
                block = torch.randn(count, generator=generator, dtype=torch.float32).mul_(scale).add_(base)
                flat[start : start + count].copy_(block)


def _model(config: Any, dtype: Any) -> Any:
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration._from_config(config, dtype=dtype)


def _processor(spec: Preset, tokenizer: Any) -> Any:
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    side = spec["vision"]["image_size"]
    image_processor = Gemma3ImageProcessor(
        size={"height": side, "width": side}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=spec["mm_tokens_per_image"],
    )


# Bumped when this module's output changes (the cache key holds checkpoints.BUILDER_VERSION, not this).
GEMMA3_BUILDER_VERSION = 2

GEMMA3 = RandomCheckpoint(
    f"gemma3-b{GEMMA3_BUILDER_VERSION}",
    GEMMA3_PRESETS,
    build_tokenizer=_build_tokenizer,
    token_names=GEMMA3_SPECIAL_TOKENS,
    config=lambda spec, token_ids, tokenizer: gemma3_config(spec, token_ids, spec["vocab_size"] or len(tokenizer)),
    model=_model,
    init=lambda model, spec, seed: _init_deterministically(model, spec["std"], spec["norm_std"], seed),
    generation=lambda ids: {
        "bos_token_id": ids["<bos>"], "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]], "pad_token_id": ids["<pad>"],
    },
    processor=_processor,
)  # fmt: skip


def write_gemma3(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random-weight Gemma 3 checkpoint (HF format) in `path`; same (preset, seed) -> same bytes."""
    return write_random_checkpoint(GEMMA3, path, preset, seed)


def cached_gemma3(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(GEMMA3, preset, seed, cache_root)
