"""Deterministic, offline SmolVLM2 checkpoints for tests and benchmarks.

Random weights from the real Transformers config classes (`SmolVLMConfig`: a SigLIP vision config and a
Llama text config), the BPE tokenizer trained in-process by `testkit.checkpoints` with
SmolVLM's special tokens added after it (`<fake_token_around_image>`, `<image>`, `<global-img>`,
`<end_of_utterance>`, `<row_r_col_c>` for r, c in 1..6), a chat template that renders as SmolVLM2's,
and SmolVLM's own processor classes (image splitting into tiles + the global image, video frames with
their timestamp text).

    write_smolvlm(path, preset="tiny" | "tiny-idefics3" | "bench-500m", seed=0) -> Path
    cached_smolvlm(preset="tiny", seed=0) -> Path

"tiny" (parity tests): 64-px tiles of 8-px patches and scale factor 2, so a tile is 16 image tokens; an
image's longest edge is resized to 192 px, i.e. up to 3 x 3 tiles plus the global image.
"bench-500m" is SmolVLM2-500M-Video-Instruct's shape (text: 32 x 960 Llama layers, 15 heads / 5 KV
heads, MLP 2560; vision: 12 x 768 SigLIP layers, 16-px patches, 512-px tiles, scale factor 4, so 64
tokens a tile; its processor: longest edge 2048, 512-px tiles, video frames at 512 px) except the
vocabulary, which is our small tokenizer's (2,089 tokens instead of 49,280: ~91M fewer parameters in
the embedding and the untied LM head).
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

# SmolVLM's added tokens, appended after the trained tokenizer's own specials (which include
# <|endoftext|>, <|im_start|> and <|im_end|>, as SmolLM2's tokenizer does).
SMOLVLM_SPECIAL_TOKENS: tuple[str, ...] = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)

# Written here; renders as SmolVLM2-Instruct's template: "<|im_start|>" once, then per message
# "Role:" (": " unless the content opens with an image), its parts (<image> / <video> for media),
# "<end_of_utterance>\n"; "Assistant:" to generate. (With a video, SmolVLMProcessor.apply_chat_template
# swaps in its own default template, which renders the same.)
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>"
    "{%- for message in messages -%}"
    "{{- message['role'] | capitalize -}}"
    "{%- if message['content'] is string -%}"
    "{{- ': ' + message['content'] -}}"
    "{%- else -%}"
    "{{- ':' if message['content'] and message['content'][0]['type'] == 'image' else ': ' -}}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<video>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<end_of_utterance>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)

Preset = dict[str, Any]

# Parity tests: 4 Llama layers (GQA 2:1, head_dim 32), a 2-layer SigLIP tower on 64-px tiles of
# 8-px patches, pixel shuffle by 2 (16 tokens a tile). initializer_range 0.2 for distinct greedy
# tokens (see checkpoints.py).
_TINY: Preset = {
    "text": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 8192,
    },
    "vision": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": 64, "patch_size": 8,
    },
    "scale_factor": 2,
    "longest_edge": 192,  # the processor's resize before splitting
    "video_edge": 64,
    "std": 0.2,
    "dtype": "float32",
}  # fmt: skip

SMOLVLM_PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    # The same with Idefics3's classes (SmolVLM v1's architecture: Idefics3ForConditionalGeneration,
    # Idefics3Processor, images only).
    "tiny-idefics3": {**_TINY, "idefics3": True},
    # SmolVLM2-500M-Video-Instruct's config.json / processor values.
    "bench-500m": {
        "text": {
            "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
            "num_key_value_heads": 5, "max_position_embeddings": 8192,
        },
        "vision": {
            "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
            "image_size": 512, "patch_size": 16,
        },
        "scale_factor": 4,
        "longest_edge": 2048,
        "video_edge": 512,
        "std": 0.02,
        "dtype": "bfloat16",
    },
}  # fmt: skip


def _build_tokenizer(staging: Path) -> Any:
    """The trained BPE (checkpoints.py) plus SmolVLM's special tokens, saved and loaded back as a
    `PreTrainedTokenizerFast` (tokenizer.json verbatim: the same pipeline in every reader)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = _train_bpe_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SMOLVLM_SPECIAL_TOKENS])
    # "\n\n" is one token in SmolLM2's vocabulary, and llama.cpp's SmolVLM prompt (mtmd) looks it up as one
    # (before the global image); our corpus has too few blank lines for the BPE to learn it.
    tok.add_tokens([AddedToken("\n\n", special=False, normalized=False)])
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<end_of_utterance>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "extra_special_tokens": {
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    _drop_load_time_kwargs(tokenizer)
    return tokenizer


def smolvlm_config(preset: Preset, token_ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import Idefics3Config, SmolVLMConfig

    text = {
        **preset["text"],
        # as the released config.json says (llama.cpp's converter picks its text model class by it)
        "architectures": ["VLlama3ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "bos_token_id": token_ids["<|im_start|>"],
        "eos_token_id": token_ids["<end_of_utterance>"],
        "pad_token_id": token_ids["<|im_end|>"],
        "tie_word_embeddings": False,
    }
    vision = {**preset["vision"], "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "num_channels": 3}
    idefics3 = preset.get("idefics3", False)
    return (Idefics3Config if idefics3 else SmolVLMConfig)(
        text_config=text,
        vision_config=vision,
        scale_factor=preset["scale_factor"],
        image_token_id=token_ids["<image>"],
        tie_word_embeddings=False,
        architectures=["Idefics3ForConditionalGeneration" if idefics3 else "SmolVLMForConditionalGeneration"],
    )


def image_seq_len(preset: Preset) -> int:
    """Image tokens per tile: the tile's patches after the pixel shuffle."""
    side = preset["vision"]["image_size"] // preset["vision"]["patch_size"]
    return side * side // preset["scale_factor"] ** 2


def _processor(spec: Preset, tokenizer: Any) -> Any:
    """SmolVLM's processor (tiles + global image, video frames), or Idefics3's (images only)."""
    from transformers import (
        Idefics3ImageProcessor,
        Idefics3Processor,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
    )

    tile = {"longest_edge": spec["vision"]["image_size"]}
    images = {"size": {"longest_edge": spec["longest_edge"]}, "max_image_size": tile, "do_image_splitting": True}
    common = {"tokenizer": tokenizer, "image_seq_len": image_seq_len(spec), "chat_template": SMOLVLM_CHAT_TEMPLATE}
    if spec.get("idefics3", False):
        return Idefics3Processor(image_processor=Idefics3ImageProcessor(**images), **common)
    video = SmolVLMVideoProcessor(size={"longest_edge": spec["video_edge"]}, max_image_size=tile, fps=1, num_frames=64)
    return SmolVLMProcessor(image_processor=SmolVLMImageProcessor(**images), video_processor=video, **common)


def _model(config: Any, dtype: Any) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, dtype=dtype)


# Bumped when this module's output changes (the cache key holds checkpoints.BUILDER_VERSION, not this).
SMOLVLM_BUILDER_VERSION = 3

SMOLVLM = RandomCheckpoint(
    f"smolvlm2-b{SMOLVLM_BUILDER_VERSION}",
    SMOLVLM_PRESETS,
    build_tokenizer=_build_tokenizer,
    token_names=("<|endoftext|>", "<|im_start|>", "<|im_end|>", *SMOLVLM_SPECIAL_TOKENS),
    config=lambda spec, token_ids, tokenizer: smolvlm_config(spec, token_ids, len(tokenizer)),
    model=_model,
    init=lambda model, spec, seed: _init_weights_deterministically(model, spec["std"], seed),
    generation=lambda ids: {
        "bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<end_of_utterance>"], "pad_token_id": ids["<|im_end|>"],
    },
    processor=lambda spec, tokenizer: _processor(spec, tokenizer),
)  # fmt: skip


def write_smolvlm(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random-weight SmolVLM2 checkpoint (HF format) in `path`; same (preset, seed) -> same bytes."""
    return write_random_checkpoint(SMOLVLM, path, preset, seed)


def cached_smolvlm(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    return cached_random_checkpoint(SMOLVLM, preset, seed, cache_root)
