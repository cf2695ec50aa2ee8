"""Deterministic, offline PaddleOCR-VL checkpoints for tests.

Random weights from the real Transformers config classes (`PaddleOCRVLConfig`: a PaddleOCR vision config
and the ERNIE-4.5 text config), the BPE tokenizer trained in-process by `testkit.checkpoints` with
PaddleOCR-VL's special tokens added after it (`<|begin_of_sentence|>`, `<|IMAGE_START|>`,
`<|IMAGE_PLACEHOLDER|>`, `<|IMAGE_END|>`, `</s>`, ...), a chat template that renders as the released one, and
Transformers' own `PaddleOCRVLProcessor` / `PaddleOCRVLImageProcessor` (smart resize to multiples of 28 px,
one placeholder per merged 2x2 patch block).

    write_paddleocr_vl(path, preset="tiny", seed=0) -> Path
    cached_paddleocr_vl(preset="tiny", seed=0) -> Path

"tiny" (parity tests): 4 text layers (GQA 2:1, head_dim 32, M-RoPE sections [4, 6, 6]), a 2-layer encoder
of width 64 (head_dim 16) whose position table is 8 x 8 (112-px image_size, 14-px patches), resampled to
every image's grid; images resized to between 4 and 64 merged tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit.checkpoints import (
    RandomCheckpoint,
    _drop_load_time_kwargs,
    _init_weights_deterministically,
    _train_bpe_tokenizer,
    cached_random_checkpoint,
    write_random_checkpoint,
)

# PaddleOCR-VL's added tokens (the released tokenizer_config.json's specials the processor and template use),
# after the trained tokenizer's own (which already hold <|video_pad|>).
PADDLEOCR_VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<s>",
    "</s>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|IMAGE_START|>",
    "<|IMAGE_END|>",
)

# Written here; renders as PaddlePaddle/PaddleOCR-VL's chat_template.jinja for list contents: the cls token
# once, "User: " + the turn's images (START, PLACEHOLDER, END each; the processor expands the placeholder)
# before its texts + "\n", "Assistant:\n" + text + "</s>", a system turn's text + "\n", "Assistant:\n" to
# generate. A string content counts as one text part.
PADDLEOCR_VL_CHAT_TEMPLATE = (
    "{%- macro parts(content, kind) -%}"
    "{%- if content is string -%}{%- if kind == 'text' -%}{{- content -}}{%- endif -%}"
    "{%- else -%}{%- for part in content if part['type'] == kind -%}"
    "{%- if kind == 'image' -%}{{- '<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- 'User: ' -}}{{- parts(message['content'], 'image') -}}{{- parts(message['content'], 'text') -}}{{- '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'Assistant:\\n' -}}{{- parts(message['content'], 'text') -}}{{- '</s>' -}}"
    "{%- elif message['role'] == 'system' -%}"
    "{{- parts(message['content'], 'text') -}}{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:\\n' -}}{%- endif -%}"
)

Preset = dict[str, Any]

PADDLEOCR_VL_PRESETS: dict[str, Preset] = {
    "tiny": {
        "text": {
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [4, 6, 6]},
        },
        "vision": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "image_size": 112,
        },
        "pixels": (4 * 28 * 28, 64 * 28 * 28),
        "std": 0.2,  # distinct greedy tokens (see checkpoints.py)
        "dtype": "float32",
    },
}  # fmt: skip


def _build_tokenizer(staging: Path) -> Any:
    """The trained BPE plus PaddleOCR-VL's special tokens, loaded back as a `PreTrainedTokenizerFast`
    whose `image_token` the processor reads."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = _train_bpe_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in PADDLEOCR_VL_SPECIAL_TOKENS])
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "unk_token": "<unk>",
        "cls_token": "<|begin_of_sentence|>",
        "sep_token": "<|end_of_sentence|>",
        "extra_special_tokens": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    tokenizer.chat_template = PADDLEOCR_VL_CHAT_TEMPLATE
    _drop_load_time_kwargs(tokenizer)
    return tokenizer


def paddleocr_vl_config(preset: Preset, token_ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import PaddleOCRVLConfig

    text = {
        **preset["text"],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "use_bias": False,
        "bos_token_id": token_ids["<s>"],
        "eos_token_id": token_ids["</s>"],
        "pad_token_id": token_ids["<unk>"],
        "tie_word_embeddings": False,
    }
    vision = {
        **preset["vision"], "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "num_channels": 3,
        "patch_size": 14, "spatial_merge_size": 2,
    }  # fmt: skip
    return PaddleOCRVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|IMAGE_PLACEHOLDER|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|IMAGE_START|>"],
        vision_end_token_id=token_ids["<|IMAGE_END|>"],
        tie_word_embeddings=False,
        architectures=["PaddleOCRVLForConditionalGeneration"],
    )


def _processor(spec: Preset, tokenizer: Any) -> Any:
    from transformers import PaddleOCRVLImageProcessor, PaddleOCRVLProcessor

    min_pixels, max_pixels = spec["pixels"]
    images = PaddleOCRVLImageProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5],  # the released preprocessor_config.json's
        image_std=[0.5, 0.5, 0.5],
    )
    return PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=PADDLEOCR_VL_CHAT_TEMPLATE)


def _model(config: Any, dtype: Any) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, dtype=dtype)


# Bumped when this module's output changes (the cache key holds checkpoints.BUILDER_VERSION, not this).
PADDLEOCR_VL_BUILDER_VERSION = 1

PADDLEOCR_VL = RandomCheckpoint(
    f"paddleocr-vl-b{PADDLEOCR_VL_BUILDER_VERSION}",
    PADDLEOCR_VL_PRESETS,
    build_tokenizer=_build_tokenizer,
    token_names=(*PADDLEOCR_VL_SPECIAL_TOKENS, "<|video_pad|>"),
    config=lambda spec, token_ids, tokenizer: paddleocr_vl_config(spec, token_ids, len(tokenizer)),
    model=_model,
    init=lambda model, spec, seed: _init_weights_deterministically(model, spec["std"], seed),
    generation=lambda ids: {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<unk>"]},
    processor=lambda spec, tokenizer: _processor(spec, tokenizer),
)  # fmt: skip


def write_paddleocr_vl(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random-weight PaddleOCR-VL checkpoint (HF format) in `path`; same (preset, seed) -> same bytes."""
    return write_random_checkpoint(PADDLEOCR_VL, path, preset, seed)


def cached_paddleocr_vl(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(PADDLEOCR_VL, preset, seed, cache_root)
