"""Deterministic, offline Mistral 3 and LightOnOCR checkpoints for tests.

Random weights from the real Transformers config classes (`Mistral3Config` over `PixtralVisionConfig` and
`MistralConfig`; `LightOnOcrConfig` over Pixtral and `Qwen3Config`), the byte-level BPE trained in-process
by `testkit.checkpoints` with Mistral's special tokens added ([INST], [IMG], [IMG_BREAK], [IMG_END], ...;
[IMG_END] right after [IMG_BREAK], as in Mistral's tokenizers), chat templates written from scratch that
render as Mistral-Small-3.1's (`[SYSTEM_PROMPT]`, `[INST]`) and as LightOnOCR's (Qwen's `<|im_start|>`)
do, one [IMG] per image part, and the real `PixtralImageProcessor` with `PixtralProcessor` /
`LightOnOcrProcessor`.

    cached_mistral3(preset="tiny" | "tiny-lightonocr" | "bench-1b", seed=0) -> Path

"tiny": a 3-layer Mistral decoder (128 wide, 4 heads / 2 KV heads of 32) under a 2-layer Pixtral tower
(64 wide, 8-px patches, images up to 96 px on their longest edge) and the 2 x 2 patch merger;
"tiny-lightonocr": the same tower and projector before a 3-layer Qwen3 decoder (q/k norms), tied.
"bench-1b": LightOnOCR-1B-1025's layer shapes (Pixtral tower 1024 x 24 layers, 14-px patches, images up to
1540 px; Qwen3-0.6B-sized decoder, 28 layers of 1024, tied), bf16, its image processor (CLIP mean / std), and
its config.json's form (`released_config`): Mistral3's model type under the release's architecture name, which
vLLM and llama.cpp's converter key on. The vocabulary is the testkit's small trained one, not the release's
151,936 rows, so the embedding is 4 MB instead of 311 MB and the token ids are ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit.checkpoints import (
    RandomCheckpoint,
    _drop_load_time_kwargs,
    _train_bpe_tokenizer,
    cached_checkpoint,
    random_checkpoint_name,
    write_random_checkpoint,
)

# Added after the trained BPE vocabulary (and its Qwen-style specials, which LightOnOCR's template uses).
MISTRAL3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[IMG]", "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip
TOKEN_NAMES = (*MISTRAL3_SPECIAL_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>")

# A message's content, string or parts: one [IMG] per image part (the processor expands it), text as is.
_CONTENT = (
    "{%- macro content(message) -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '[IMG]' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
# Mistral-Small-3.1's shape: <s>, a system prompt in its own tags, user turns in [INST] ... [/INST], an
# assistant turn followed by </s>; the generation prompt is empty (the model answers after [/INST]).
MISTRAL3_CHAT_TEMPLATE = (
    _CONTENT + "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' ~ content(message) ~ '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' ~ content(message) ~ '[/INST]' -}}"
    "{%- else -%}{{- content(message) ~ eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
# LightOnOCR's (Qwen3's) shape: <|im_start|>role\n ... <|im_end|>\n, then <|im_start|>assistant\n.
LIGHTONOCR_CHAT_TEMPLATE = (
    _CONTENT + "{%- for message in messages -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ content(message) ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

Preset = dict[str, Any]
_TEXT = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "sliding_window": None,
}  # fmt: skip
_VISION = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "patch_size": 8, "image_size": 96, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}  # fmt: skip
MISTRAL3_PRESETS: dict[str, Preset] = {
    "tiny": {
        "architecture": "Mistral3ForConditionalGeneration",
        "text": {**_TEXT, "model_type": "mistral", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "vision": _VISION, "longest_edge": 96, "tie_word_embeddings": False, "std": 0.2, "norm_std": 0.1,
        "dtype": "float32",
    },
    "tiny-lightonocr": {
        "architecture": "LightOnOcrForConditionalGeneration",
        "text": {**_TEXT, "model_type": "qwen3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "vision": _VISION, "longest_edge": 96, "tie_word_embeddings": True, "std": 0.2, "norm_std": 0.1,
        "dtype": "float32",
    },
    # LightOnOCR-1B-1025's config.json (tests/released_configs.py LIGHTONOCR_1B; restated: testkit does not import
    # tests): its layer shapes and its 8,192 positions; our vocabulary.
    "bench-1b": {
        "architecture": "LightOnOcrForConditionalGeneration",
        "text": {
            "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        "vision": {
            "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
            "head_dim": 64, "patch_size": 14, "image_size": 1540, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
        "longest_edge": 1540, "tie_word_embeddings": True, "std": 0.02, "norm_std": 0.02, "dtype": "bfloat16",
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "released_config": "LightOnOCRForConditionalGeneration",
    },
}  # fmt: skip


def _build_tokenizer(staging: Path) -> Any:
    """The trained byte-level BPE plus Mistral's specials, whose image tokens are named attributes
    (LightOnOcrProcessor reads them from the tokenizer)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = _train_bpe_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL3_SPECIAL_TOKENS])
    staging.mkdir(parents=True, exist_ok=True)
    tok.save(str(staging / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "extra_special_tokens": {
            "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }  # fmt: skip
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    _drop_load_time_kwargs(tokenizer)
    return tokenizer


def _lightonocr(spec: Preset) -> bool:
    return spec["architecture"] == "LightOnOcrForConditionalGeneration"


def _eos(spec: Preset, ids: dict[str, int]) -> int:
    return ids["<|im_end|>"] if _lightonocr(spec) else ids["</s>"]


def mistral3_config(spec: Preset, ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import LightOnOcrConfig, Mistral3Config

    tied = spec["tie_word_embeddings"]
    text = {**spec["text"], "vocab_size": vocab_size, "tie_word_embeddings": tied, "bos_token_id": ids["<s>"],
            "eos_token_id": _eos(spec, ids), "pad_token_id": ids["<pad>"]}  # fmt: skip
    vision = {**spec["vision"], "model_type": "pixtral"}
    common = {"text_config": text, "vision_config": vision, "tie_word_embeddings": tied,
              "architectures": [spec["architecture"]], "spatial_merge_size": 2}  # fmt: skip
    if _lightonocr(spec):
        return LightOnOcrConfig(**common, image_token_id=ids["[IMG]"], eos_token_id=_eos(spec, ids))
    return Mistral3Config(**common, image_token_index=ids["[IMG]"], vision_feature_layer=-1, eos_token_id=ids["</s>"])


def _init_deterministically(model: Any, std: float, norm_std: float, seed: int) -> None:
    """Every parameter from one seeded generator, in named_parameters() order: RMSNorm weights
    1 + N(0, norm_std), everything else N(0, std)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            module = name.rsplit(".", 2)[-2]
            norm = "norm" in module or module == "ln_pre"
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(values * norm_std + 1.0 if norm else values * std)


def _model(config: Any, dtype: Any) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def _processor(spec: Preset, tokenizer: Any) -> Any:
    from transformers import LightOnOcrProcessor, PixtralImageProcessor, PixtralProcessor

    patch = spec["vision"]["patch_size"]
    image_processor = PixtralImageProcessor(
        size={"longest_edge": spec["longest_edge"]}, patch_size={"height": patch, "width": patch},
        image_mean=spec.get("image_mean", [0.5, 0.5, 0.5]), image_std=spec.get("image_std", [0.5, 0.5, 0.5]),
    )  # fmt: skip
    if _lightonocr(spec):
        tokenizer.chat_template = LIGHTONOCR_CHAT_TEMPLATE
        return LightOnOcrProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=patch, spatial_merge_size=2,
            chat_template=LIGHTONOCR_CHAT_TEMPLATE,
        )  # fmt: skip
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    return PixtralProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch, spatial_merge_size=2,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    )  # fmt: skip


# Bumped when this module's output changes (the cache key holds checkpoints.BUILDER_VERSION, not this).
MISTRAL3_BUILDER_VERSION = 1

MISTRAL3 = RandomCheckpoint(
    f"mistral3-b{MISTRAL3_BUILDER_VERSION}",
    MISTRAL3_PRESETS,
    build_tokenizer=_build_tokenizer,
    token_names=TOKEN_NAMES,
    config=lambda spec, ids, tokenizer: mistral3_config(spec, ids, len(tokenizer)),
    model=_model,
    init=lambda model, spec, seed: _init_deterministically(model, spec["std"], spec["norm_std"], seed),
    # The generation config cannot see the preset: both presets stop at either end-of-turn token.
    generation=lambda ids: {"bos_token_id": ids["<s>"], "eos_token_id": [ids["</s>"], ids["<|im_end|>"]],
                            "pad_token_id": ids["<pad>"]},
    processor=_processor,
)  # fmt: skip


def released_lightonocr_config(saved: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Transformers' LightOnOcrConfig as saved -> the form of LightOnOCR-1B-1025's config.json: model type
    `mistral3` (vLLM's LightOnOCR model asks for a Mistral3Config: `image_token_index`, the projector's
    activation and bias, the feature layer) under the release's architecture name, and the text model's own
    architecture, from which llama.cpp's converter picks its text side."""
    return {
        **saved, "architectures": [architecture], "model_type": "mistral3", "projector_hidden_act": "gelu",
        "multimodal_projector_bias": False, "vision_feature_layer": -1,
        "text_config": {**saved["text_config"], "architectures": ["Qwen3ForCausalLM"]},
    }  # fmt: skip


def write_mistral3(path: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """A random-weight Mistral 3 / LightOnOCR checkpoint (HF format) in `path`; same (preset, seed) -> same bytes."""
    out = write_random_checkpoint(MISTRAL3, path, preset, seed)
    released = MISTRAL3_PRESETS[preset].get("released_config")
    if released:
        config_file = out / "config.json"
        config = released_lightonocr_config(json.loads(config_file.read_text()), released)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def cached_mistral3(preset: str = "tiny", seed: int = 0, cache_root: Path | None = None) -> Path:
    name = random_checkpoint_name(MISTRAL3, preset, seed)
    return cached_checkpoint(name, lambda tmp: write_mistral3(tmp, preset, seed), cache_root)
