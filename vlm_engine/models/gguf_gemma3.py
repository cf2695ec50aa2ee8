"""GGUF Gemma 3: llama.cpp's `gemma3` text file and its mmproj (projector type `gemma3`), read back into the
Transformers `Gemma3ForConditionalGeneration` the converter (`conversion/gemma.py`) was given; the text file
alone is its `Gemma3ForCausalLM`. models/gguf_vlm.py dispatches here; what is common to every GGUF VLM (file
detection, the tokenizer, the processor cache, dequantization) stays there.

What the converter did, read backwards:
- every text tensor whose name ends in `norm.weight` was written as 1 + w (Gemma's RMSNorm scales by 1 + w;
  llama.cpp's by w), and of the mmproj only the projector's `mm_soft_emb_norm` (the SigLIP LayerNorms are
  plain): 1 is subtracted again in fp32, so 1 + w, what both models compute, is the checkpoint's exactly;
- the projection matrix `mm_input_projection_weight` is always written F16 (even in an F32 mmproj);
- the embedding's rows past the tokenizer's vocabulary were dropped: `vocab_size` is the rows the file has;
- nothing else: no permutation, and the sqrt(hidden) embedding scale is applied at run time on both sides.

What the files do not store is taken as llama.cpp takes it (`_NOT_STORED`), which is how the released
models have it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlm_engine.models.gguf_keys import float32_decimal, required, siglip_vision
from vlm_engine.models.loader import gguf_field, gguf_reader

GEMMA3 = "Gemma3ForConditionalGeneration"
GEMMA3_TEXT = "Gemma3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"

_NOT_STORED = {
    "sliding_window_pattern": 6,  # llama.cpp's load_swa_pattern(ml, 6): 5 sliding layers, then a global one
    "rope_theta_swa": 10000.0,  # llama_hparams.rope_freq_base_train_swa, where rope.freq_base_swa is absent
    "projector_scale_factor": 4,  # clip.cpp's n_merge for gemma3; the converter writes it only when other
    "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's Gemma 3 graph: GELU (tanh form) gated MLP
    "image_resample": 2,  # PIL bilinear: the released preprocessor_config.json's `resample`
}
# The released gemma-3-27b (62 layers) scales queries by (hidden / heads) ** -0.5, every other size by
# head_dim ** -0.5: llama.cpp decides it by the layer count (llama_model_gemma3::load_arch_hparams).
_HIDDEN_PER_HEAD_SCALE_LAYERS = 62
# The tokenizer's named special tokens that Gemma3Processor reads, and the Gemma3Config ids they give.
NAMED_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
_TOKEN_IDS = {"boi_token_index": "boi_token", "eoi_token_index": "eoi_token", "image_token_index": "image_token"}
_END_OF_TURN = "<end_of_turn>"  # llama.cpp ends generation on it as on EOS, as the released configs do


# ---- config ------------------------------------------------------------------------------------


def gemma3_config(text: Path, mmproj: Path | None) -> Any:
    """Gemma3Config of the pair, or the text file's Gemma3TextConfig alone without `mmproj`."""
    from transformers import Gemma3Config, Gemma3TextConfig

    reader = gguf_reader(text)
    tokens = list(required(reader, text, "tokenizer.ggml.tokens"))
    text_config = _text_config(reader, text, tokens)
    if mmproj is None:
        return Gemma3TextConfig(**text_config, architectures=[GEMMA3_TEXT])
    clip = gguf_reader(mmproj)
    projection = int(required(clip, mmproj, "clip.vision.projection_dim"))
    if projection != text_config["hidden_size"]:
        raise ValueError(
            f"{mmproj.name} projects to width {projection}, {text.name} is {text_config['hidden_size']} wide: "
            "they are not one model's pair"
        )
    vision = siglip_vision(clip, mmproj)
    token_ids = {}
    for key, name in _TOKEN_IDS.items():
        token = NAMED_TOKENS[name]
        if token not in tokens:
            raise ValueError(f"{text.name}: the vocabulary has no {token} token (tokenizer.ggml.tokens)")
        token_ids[key] = tokens.index(token)
    return Gemma3Config(
        text_config=text_config, vision_config={**vision, "vision_use_head": False},
        mm_tokens_per_image=_tokens_per_image(clip, mmproj, vision),
        tie_word_embeddings=text_config["tie_word_embeddings"], eos_token_id=text_config["eos_token_id"],
        architectures=[GEMMA3], **token_ids,
    )  # fmt: skip


def _text_config(reader: Any, path: Path, tokens: list[str]) -> dict[str, Any]:
    def key(name: str) -> Any:
        return required(reader, path, f"gemma3.{name}")

    names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    window = int(gguf_field(reader, "gemma3.attention.sliding_window", 0))
    scalar = hidden // heads if layers == _HIDDEN_PER_HEAD_SCALE_LAYERS else head_dim
    end_of_turn = tokens.index(_END_OF_TURN) if _END_OF_TURN in tokens else None
    eos = [i for i in (gguf_field(reader, "tokenizer.ggml.eos_token_id"), end_of_turn) if i is not None]
    return {
        "vocab_size": int(embedding.shape[-1]),  # the converter drops rows past the tokenizer's
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, "gemma3.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float32_decimal(key("attention.layer_norm_rms_epsilon")),
        "hidden_activation": _NOT_STORED["hidden_activation"],
        "sliding_window": window or None,
        "layer_types": _layer_types(reader, layers, window),
        "rope_parameters": _rope_parameters(reader, path),
        "final_logit_softcapping": gguf_field(reader, "gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": None,  # the converter asserts Gemma 3 has none
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos or None,
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _layer_types(reader: Any, layers: int, window: int) -> list[str]:
    """llama.cpp's: no window -> every layer global; a pattern array (one flag per layer, true = sliding)
    or a period n (layer i slides unless i % n == n - 1), default `_NOT_STORED`'s 6."""
    if not window:
        return [FULL] * layers
    pattern = gguf_field(reader, "gemma3.attention.sliding_window_pattern", _NOT_STORED["sliding_window_pattern"])
    if isinstance(pattern, list):
        return [SLIDING if flag else FULL for flag in pattern[:layers]]
    period = int(pattern)
    return [SLIDING if period == 0 or i % period < period - 1 else FULL for i in range(layers)]


def _rope_parameters(reader: Any, path: Path) -> dict[str, Any]:
    """A table per layer type: the global layers' base and scaling (rope.freq_base, rope.scaling.*), the
    sliding layers' own base, unscaled (llama.cpp: freq_scale_swa 1)."""
    theta = float32_decimal(required(reader, path, "gemma3.rope.freq_base"))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = gguf_field(reader, "gemma3.rope.scaling.type", "none")
    if scaling == "linear":
        full = {
            **full,
            "rope_type": "linear",
            "factor": float32_decimal(required(reader, path, "gemma3.rope.scaling.factor")),
        }
    elif scaling != "none":
        raise ValueError(f"{path.name}: RoPE scaling {scaling!r} (gemma3.rope.scaling.type) is not served")
    local = float32_decimal(gguf_field(reader, "gemma3.rope.freq_base_swa", _NOT_STORED["rope_theta_swa"]))
    return {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}}


def _tokens_per_image(clip: Any, mmproj: Path, vision: dict[str, Any]) -> int:
    """The projector average-pools the tower's patch grid by clip.vision.projector.scale_factor a side."""
    side = int(vision["image_size"]) // int(vision["patch_size"])
    scale = int(gguf_field(clip, "clip.vision.projector.scale_factor", _NOT_STORED["projector_scale_factor"]))
    if side % scale:
        raise ValueError(f"{mmproj.name}: a {side}x{side} patch grid is not pooled by {scale} a side")
    return (side // scale) ** 2


# ---- weights -----------------------------------------------------------------------------------

# Transformers 5's parameter names -> the released checkpoints' (what the converter read; our family loads both).
_RELEASED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_SUFFIXES = (".weight", ".bias")


def checkpoint_targets(config: Any) -> dict[str, tuple[str, float]]:
    """GGUF tensor name -> (the checkpoint tensor it was converted from, under the released names; the norm
    shift the converter added to it)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(config, "vision_config", None)
    auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
    with torch.device("meta"):
        names = [n for n, _ in auto.from_config(config).named_parameters()]
    text_config = getattr(config, "text_config", config)
    text_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, text_config.num_hidden_layers)
    vision_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(getattr(vision, "num_hidden_layers", 0), 3))
    targets: dict[str, tuple[str, float]] = {}
    for name in names:
        released = _released_name(name) if vision is not None else name
        if released.startswith(("vision_tower.", "multi_modal_projector.")):
            # conversion/gemma.py: `_weight` -> `.weight` (the projection is a bare parameter); only the
            # projector's RMSNorm was shifted
            disk = vision_map.get_name(released.replace("_weight", ".weight"), _SUFFIXES)
            shift = 1.0 if released.endswith("soft_emb_norm.weight") else 0.0
        else:  # the converter drops `language_model.`; every `norm.weight` was shifted
            disk = text_map.get_name(released.removeprefix("language_model."), _SUFFIXES)
            shift = 1.0 if released.endswith("norm.weight") else 0.0
        if disk is None:
            raise ValueError(f"no GGUF name for checkpoint tensor {released} in gguf-py's map")
        targets[disk] = (released, shift)
    return targets


def _released_name(name: str) -> str:
    for ours, released in _RELEASED_PREFIXES:
        if name.startswith(ours):
            return released + name[len(ours) :]
    return name


# ---- the prompt side ---------------------------------------------------------------------------


def gemma3_processor(tokenizer: Any, mmproj: Path, config: Any) -> Any:
    """Gemma3Processor: square images of the tower's size, the mmproj's mean and std, bilinear resampling and
    no pan-and-scan (llama.cpp has none), `mm_tokens_per_image` image tokens between boi and eoi. `tokenizer`:
    the text file's, with `NAMED_TOKENS` named."""
    import transformers

    clip = gguf_reader(mmproj)
    side = int(config.vision_config.image_size)
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": side, "width": side}, resample=_NOT_STORED["image_resample"], do_pan_and_scan=False,
        image_mean=[float32_decimal(v) for v in required(clip, mmproj, "clip.vision.image_mean")],
        image_std=[float32_decimal(v) for v in required(clip, mmproj, "clip.vision.image_std")],
    )  # fmt: skip
    return transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
        image_seq_length=int(config.mm_tokens_per_image),
    )  # fmt: skip
