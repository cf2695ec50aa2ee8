"""GGUF VLMs: llama.cpp's text GGUF plus its mmproj GGUF (the vision tower and projector), served by our
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM and Gemma 3 families as if they were the Hugging Face checkpoint the
converter read.

Three things are recovered from the two files, each by undoing what llama.cpp's converter
(`convert_hf_to_gguf.py`, `conversion/qwenvl.py`, `conversion/qwen3vl.py`, `conversion/smolvlm.py` with
`conversion/llama.py` for SmolVLM's text, `conversion/gemma.py`) did:

- the config: the text file's `qwen2vl.*` / `qwen3vl.*` keys and the mmproj's `clip.vision.*` keys -> a
  Transformers `Qwen2VLConfig` / `Qwen2_5_VLConfig` / `Qwen3VLConfig` (`vlm_config`); a qwen2vl text file
  without its mmproj is served as the text model alone (`Qwen2ForCausalLM`: M-RoPE with its three axes
  equal is 1-D RoPE); SmolVLM: the `llama.*` keys and the mmproj's `idefics3` keys -> a `SmolVLMConfig`;
  Gemma 3 (`gemma3.*` keys, projector type `gemma3`): models/gguf_gemma3.py, config, tensor names and
  processor alike (`Gemma3Config`; the text file alone is `Gemma3ForCausalLM`);
- the weights: gguf-py's own HF -> GGUF name map, inverted on the names the Transformers model has, with
  the converter's own steps read backwards (`_vision_target`: Qwen2's q/k/v merged into `qkv`, the patch
  embedding's two temporal halves into one Conv3D, Qwen3-VL's renumbered DeepStack mergers, the llama
  text's q/k rows permuted for llama.cpp's RoPE, the 1 added to Gemma's norm weights), each tensor
  dequantized to fp32 on its own (`iter_weights`; in fast numerics the decoder's quantized linears come as
  their codes instead, for our int4 / int8 kernels: quant_formats/gguf_blocks.py);
- the prompt side: the tokenizer and chat template from the text file's `tokenizer.*` keys, the image
  processor from the mmproj's, written once as a Hugging Face processor directory (`processor_directory`)
  that the family's own prompt code loads.

What the files do not hold is taken as the released models and llama.cpp take it (`_NOT_STORED`,
`_PIXELS`, `_SMOLVLM_NOT_STORED`, gguf_gemma3's `_NOT_STORED`); anything else missing is an error naming the key, raised before a weight
is read.

A SmolVLM text file is a `llama` GGUF like any other: it is told apart by its vocabulary (SmolVLM's image
tokens, `_SMOLVLM_TOKENS`); served without its mmproj it is the plain llama text model (loader.py's config
and weights, the tokenizer rebuilt here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlm_engine.models import gguf_gemma3
from vlm_engine.models.gguf_keys import float32_decimal as _float  # the names this module has used
from vlm_engine.models.gguf_keys import required as _required
from vlm_engine.models.gguf_keys import siglip_vision
from vlm_engine.models.loader import gguf_field, gguf_llama_config, gguf_reader, gguf_tensor, iter_gguf
from vlm_engine.models.quant_formats.base import GroupedWeights

logger = logging.getLogger(__name__)

CLIP_ARCHITECTURE = "clip"  # general.architecture of every mmproj file
# A text GGUF's general.architecture -> the projector types (clip.projector_type) of its mmproj: llama.cpp
# writes Qwen2-VL's and Qwen2.5-VL's decoder as "qwen2vl", Qwen3-VL's as "qwen3vl".
# SmolVLM's text is SmolLM2, written as "llama" (a llama file is ours only when it is SmolVLM's: `serves`).
TEXT_ARCHITECTURES = {
    "qwen2vl": ("qwen2vl_merger", "qwen2.5vl_merger"), "qwen3vl": ("qwen3vl_merger",), "llama": ("idefics3",),
    "gemma3": ("gemma3",),
}  # fmt: skip
QWEN2_VL, QWEN2_5_VL, QWEN3_VL, SMOLVLM = (
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
)  # fmt: skip
# clip.projector_type -> the architecture whose vision tower and merger the mmproj holds. "idefics3" is
# SmolVLM v1 (Idefics3) and SmolVLM2 alike; the files do not tell them apart: served as SmolVLM2, whose
# processor and model take v1's images too.
PROJECTORS = {
    "qwen2vl_merger": QWEN2_VL, "qwen2.5vl_merger": QWEN2_5_VL, "qwen3vl_merger": QWEN3_VL, "idefics3": SMOLVLM,
    "gemma3": gguf_gemma3.GEMMA3,
}  # fmt: skip

# Values neither file stores, as the released checkpoints (and llama.cpp's clip.cpp) have them.
_NOT_STORED = {
    "temporal_patch_size": 2,  # the converter asserts it when it splits the Conv3D
    "spatial_merge_size": 2,  # clip.cpp's default where clip.vision.spatial_merge_size is absent
    "window_size": 112,  # Qwen2.5-VL's attention windows: clip.cpp's default (the converter does not write it)
    "tokens_per_second": 2,  # Qwen2.5-VL's temporal positions per second of video
}
# The released processors' pixel budget (their preprocessor_config.json `size`): (shortest, longest edge)
_PIXELS = {QWEN2_VL: (56 * 56, 28 * 28 * 16384), QWEN2_5_VL: (56 * 56, 28 * 28 * 16384), QWEN3_VL: (65536, 16777216)}
# SmolVLM's processor values neither file stores, as llama.cpp's clip.cpp and the released SmolVLM2
# processors take them: tiles of the tower's image_size (clip.cpp slices by it; max_image_size), image
# splitting on (clip.cpp always slices idefics3 images), video frames of one tile at 1 fps, at most 64
# (SmolVLM2's video_processor; llama.cpp has no video). The resize filter is Transformers' LANCZOS default.
_SMOLVLM_NOT_STORED = {"do_image_splitting": True, "video_fps": 1, "video_frames": 64}
# The vocabulary that marks a llama text GGUF as SmolVLM's, and which its processor needs.
_SMOLVLM_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")
_MEDIA_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# Our (Transformers') parameter names -> the names on disk, which the converter read and gguf-py maps.
_DISK_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "model."))
_PROCESSOR_VERSION = 4  # bump when processor_directory writes other files


def gguf_architecture(path: Path) -> str:
    """general.architecture, read from the header alone where it is the first key (the converter writes it
    first), so telling an mmproj from a text file does not parse a vocabulary."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] == b"GGUF" and len(head) >= 32:
        (key_len,) = struct.unpack_from("<Q", head, 24)
        key = head[32 : 32 + key_len]
        if key == b"general.architecture":
            at = 32 + key_len
            value_type, value_len = struct.unpack_from("<IQ", head, at)
            if value_type == 8:  # a string
                return head[at + 12 : at + 12 + value_len].decode()
    return str(gguf_field(gguf_reader(path), "general.architecture"))


def is_mmproj(path: Path) -> bool:
    return gguf_architecture(path) == CLIP_ARCHITECTURE


def serves(path: Path) -> bool:
    """Whether a text GGUF is one of this module's: a llama one only when it is SmolVLM's text (other
    llama files stay with loader.py)."""
    architecture = gguf_architecture(path)
    if architecture == "llama":
        return _is_smolvlm_text(path, path.stat().st_mtime_ns)
    return architecture in TEXT_ARCHITECTURES


@functools.lru_cache(maxsize=8)
def _is_smolvlm_text(path: Path, mtime_ns: int) -> bool:
    """The vocabulary holds SmolVLM's image tokens (cached: it is asked per property access)."""
    tokens = set(gguf_field(gguf_reader(path), "tokenizer.ggml.tokens", []))  # type: ignore[arg-type]
    return all(token in tokens for token in _SMOLVLM_TOKENS)


def find_mmproj(directory: Path) -> tuple[Path | None, list[Path]]:
    """A directory's mmproj (None without one) and its text GGUFs; several mmproj files are an error."""
    ggufs = sorted(directory.glob("*.gguf"))
    clips = [p for p in ggufs if is_mmproj(p)]
    if len(clips) > 1:
        raise ValueError(f"{directory} holds several mmproj files ({', '.join(p.name for p in clips)}): pass one")
    return (clips[0] if clips else None), [p for p in ggufs if p not in clips]


# ---- config ------------------------------------------------------------------------------------


def vlm_config(text: Path, mmproj: Path | None) -> Any:
    """The Transformers config of the model the two files hold (the text model alone without `mmproj`)."""
    reader = gguf_reader(text)
    arch = gguf_field(reader, "general.architecture")
    if arch not in TEXT_ARCHITECTURES:
        raise ValueError(
            f"{text.name}: GGUF architecture {arch!r} is not a VLM's text model ({', '.join(TEXT_ARCHITECTURES)})"
        )
    if mmproj is None and arch == "llama":  # SmolVLM's text alone: a llama model as loader.py serves it
        return gguf_llama_config(text)
    if arch == "gemma3":  # models/gguf_gemma3.py
        if mmproj is not None:
            _projector_architecture(gguf_reader(mmproj), mmproj, text, str(arch))
        return gguf_gemma3.gemma3_config(text, mmproj)
    text_config = _text_config(reader, text, str(arch))
    if mmproj is None:
        from transformers import Qwen2Config

        if arch != "qwen2vl":
            raise ValueError(f"{text.name}: a {arch} text model is served with its mmproj only (give --mmproj)")

        text_config["rope_parameters"].pop("mrope_section")  # text alone: M-RoPE's three equal axes are 1-D RoPE
        return Qwen2Config(**text_config, architectures=["Qwen2ForCausalLM"])
    clip = gguf_reader(mmproj)
    architecture = _projector_architecture(clip, mmproj, text, str(arch))
    if architecture == SMOLVLM:
        return _smolvlm_config(text_config, reader, text, clip, mmproj)
    projection = int(_required(clip, mmproj, "clip.vision.projection_dim"))
    if projection != text_config["hidden_size"]:
        raise ValueError(
            f"{mmproj.name} projects to width {projection}, {text.name} is {text_config['hidden_size']} wide: "
            "they are not one model's pair"
        )
    tokens = list(_required(reader, text, "tokenizer.ggml.tokens"))
    media_ids = {}
    for key, token in _MEDIA_TOKENS.items():
        if token not in tokens:
            raise ValueError(f"{text.name}: the vocabulary has no {token} token (tokenizer.ggml.tokens)")
        media_ids[key] = tokens.index(token)
    import transformers

    vision_config, config_class = {
        QWEN2_VL: (_qwen2_vl_vision, transformers.Qwen2VLConfig),
        QWEN2_5_VL: (_qwen2_5_vl_vision, transformers.Qwen2_5_VLConfig),
        QWEN3_VL: (_qwen3_vl_vision, transformers.Qwen3VLConfig),
    }[architecture]
    vision = vision_config(clip, mmproj)
    return config_class(
        text_config=text_config, vision_config=vision, tie_word_embeddings=text_config["tie_word_embeddings"],
        architectures=[architecture], **media_ids,
    )  # fmt: skip


def _text_config(reader: Any, path: Path, arch: str) -> dict[str, Any]:
    def key(name: str) -> Any:
        return _required(reader, path, f"{arch}.{name}")

    names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(key("attention.head_count"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(key("rope.freq_base"))}
    if arch == "llama":
        scaling = gguf_field(reader, "llama.rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(f"{path.name}: RoPE scaling {scaling!r} (llama.rope.scaling.type) is not served")
        extra: dict[str, Any] = {  # older converters write key_length only where it is not hidden / heads
            "head_dim": int(gguf_field(reader, "llama.attention.key_length", int(key("embedding_length")) // heads)),
            "attention_bias": "blk.0.attn_q.bias" in names,
        }
    else:
        rope["mrope_section"] = [int(s) for s in key("rope.dimension_sections")][:3]  # the converter pads 3 to 4
        extra = {"head_dim": int(key("attention.key_length"))} if arch == "qwen3vl" else {}  # not hidden / heads
        if arch == "qwen3vl":
            rope["mrope_interleaved"] = True  # Qwen3-VL interleaves the sections (t, h, w, t, ...)
    return {
        **extra,
        "vocab_size": int(embedding.shape[-1]),  # rows the embedding has (the vocabulary may list fewer)
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float(key("attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _projector_architecture(clip: Any, mmproj: Path, text: Path, arch: str) -> str:
    if not gguf_field(clip, "clip.has_vision_encoder", False):
        raise ValueError(f"{mmproj.name}: the mmproj has no vision encoder (clip.has_vision_encoder)")
    projector = gguf_field(clip, "clip.vision.projector_type") or gguf_field(clip, "clip.projector_type")
    if projector not in TEXT_ARCHITECTURES[arch]:
        raise ValueError(
            f"{mmproj.name}: projector type {projector!r} (clip.projector_type) is not one of {text.name}'s "
            f"family ({arch} text takes {', '.join(TEXT_ARCHITECTURES[arch])})"
        )
    return PROJECTORS[str(projector)]


def _vision_common(clip: Any, mmproj: Path) -> dict[str, Any]:
    return {
        "depth": int(_required(clip, mmproj, "clip.vision.block_count")),
        "num_heads": int(_required(clip, mmproj, "clip.vision.attention.head_count")),
        "patch_size": int(_required(clip, mmproj, "clip.vision.patch_size")),
        "spatial_merge_size": int(
            gguf_field(clip, "clip.vision.spatial_merge_size", _NOT_STORED["spatial_merge_size"])
        ),
        "temporal_patch_size": _NOT_STORED["temporal_patch_size"],
        "in_channels": 3,
    }


def _smolvlm_config(text_config: dict[str, Any], reader: Any, text: Path, clip: Any, mmproj: Path) -> Any:
    """A SmolVLMConfig: conversion/smolvlm.py writes the SigLIP tower's sizes, its LayerNorm eps and the
    connector's pixel-shuffle scale; the connector's one linear says the widths it joins."""
    from transformers import SmolVLMConfig

    tokens = list(_required(reader, text, "tokenizer.ggml.tokens"))
    missing = [t for t in _SMOLVLM_TOKENS if t not in tokens]
    if missing:
        raise ValueError(f"{text.name}: the vocabulary has no {', '.join(missing)} (tokenizer.ggml.tokens)")
    vision = siglip_vision(clip, mmproj)
    width = vision["hidden_size"]
    scale = int(_required(clip, mmproj, "clip.vision.projector.scale_factor"))
    projection = next((t for t in clip.tensors if t.name == "mm.model.fc.weight"), None)
    if projection is None:
        raise ValueError(f"{mmproj.name}: no tensor mm.model.fc.weight (the connector's projection)")
    inputs, outputs = (int(n) for n in projection.shape[:2])  # GGUF order: columns first
    if inputs != width * scale * scale:
        raise ValueError(f"{mmproj.name}: the connector takes {inputs} values, not {width} x {scale}^2")
    if outputs != text_config["hidden_size"]:
        raise ValueError(
            f"{mmproj.name} projects to width {outputs}, {text.name} is {text_config['hidden_size']} wide: "
            "they are not one model's pair"
        )
    return SmolVLMConfig(
        text_config=text_config, vision_config=vision, scale_factor=scale, image_token_id=tokens.index("<image>"),
        tie_word_embeddings=text_config["tie_word_embeddings"], architectures=[SMOLVLM],
    )  # fmt: skip


def _qwen2_vl_vision(clip: Any, mmproj: Path) -> dict[str, Any]:
    width = int(_required(clip, mmproj, "clip.vision.embedding_length"))
    # Not clip.vision.feed_forward_length: for Qwen2-VL the converter writes the config's `hidden_size`
    # there (the text width the merger projects to). The MLP's own rows say it.
    up = next((t for t in clip.tensors if t.name == "v.blk.0.ffn_up.weight"), None)
    if up is None:
        raise ValueError(f"{mmproj.name}: no tensor v.blk.0.ffn_up.weight (the vision MLP's width)")
    return {
        **_vision_common(clip, mmproj),
        "embed_dim": width,
        "hidden_size": int(_required(clip, mmproj, "clip.vision.projection_dim")),  # the merger's output
        "mlp_ratio": int(up.shape[-1]) // width,
        "hidden_act": "quick_gelu",
    }


def _qwen2_5_vl_vision(clip: Any, mmproj: Path) -> dict[str, Any]:
    common = _vision_common(clip, mmproj)
    # The converter keeps only the spacing of the full-attention blocks: n_wa_pattern = first index + 1.
    pattern = int(_required(clip, mmproj, "clip.vision.n_wa_pattern"))
    return {
        **common,
        "hidden_size": int(_required(clip, mmproj, "clip.vision.embedding_length")),
        "intermediate_size": int(_required(clip, mmproj, "clip.vision.feed_forward_length")),
        "out_hidden_size": int(_required(clip, mmproj, "clip.vision.projection_dim")),
        "fullatt_block_indexes": list(range(pattern - 1, common["depth"], pattern)),
        "window_size": int(gguf_field(clip, "clip.vision.window_size", _NOT_STORED["window_size"])),
        "tokens_per_second": _NOT_STORED["tokens_per_second"],
        "hidden_act": "silu",
    }


def _qwen3_vl_vision(clip: Any, mmproj: Path) -> dict[str, Any]:
    positions = next((t for t in clip.tensors if t.name == "v.position_embd.weight"), None)
    if positions is None:
        raise ValueError(f"{mmproj.name}: no tensor v.position_embd.weight (the learned position grid)")
    deepstack = gguf_field(clip, "clip.vision.is_deepstack_layers", [])
    return {
        **_vision_common(clip, mmproj),
        "hidden_size": int(_required(clip, mmproj, "clip.vision.embedding_length")),
        "intermediate_size": int(_required(clip, mmproj, "clip.vision.feed_forward_length")),
        "out_hidden_size": int(_required(clip, mmproj, "clip.vision.projection_dim")),
        "num_position_embeddings": int(positions.shape[-1]),
        "deepstack_visual_indexes": [i for i, flag in enumerate(deepstack) if flag],
        "hidden_act": "gelu_pytorch_tanh",
    }


# ---- weights -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """A checkpoint tensor and the GGUF tensors it is made of, in order, joined along `axis` (a stack
    when `stack`: the patch embedding's temporal halves)."""

    name: str
    parts: tuple[str, ...]
    axis: int = 0
    stack: bool = False
    rope_heads: int = 0  # llama.cpp permuted the rows for its RoPE, per head of this many: undone
    norm_shift: float = 0.0  # the converter added this (Gemma's 1 + w norms): subtracted


def checkpoint_targets(config: Any, text_arch: str) -> dict[str, _Target]:
    """GGUF tensor name -> the checkpoint tensor it belongs to, for every parameter of the Transformers
    model of `config`: gguf-py's HF -> GGUF map, applied as the converter applies it, read backwards."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if text_arch == "gemma3":  # GGUF name -> (checkpoint name, the norm shift the converter added)
        return {disk: _Target(name, (disk,), norm_shift=shift)
                for disk, (name, shift) in gguf_gemma3.checkpoint_targets(config).items()}  # fmt: skip
    vision = getattr(config, "vision_config", None)
    auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
    with torch.device("meta"):
        names = [_disk_name(n) for n, _ in auto.from_config(config).named_parameters()]
    text_config = getattr(config, "text_config", config)
    text_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[text_arch.upper()], text_config.num_hidden_layers)
    # The merger's layers are named by block index (mlp.0, mlp.2): a map for fewer than 3 blocks lacks them.
    vision_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(getattr(vision, "depth", 0), 3))
    targets: dict[str, _Target] = {}
    for name in names:
        if name.startswith("visual."):
            target = _vision_target(name, config, vision_map)
        elif name.startswith(_SMOLVLM_VISION):  # gguf-py maps Idefics3's tower and connector names as they are
            target = _Target(name, (vision_map.get_name(name, _SUFFIXES),))  # type: ignore[arg-type]
        else:
            target = _text_target(name, text_arch, text_config, text_map)
        if None in target.parts:
            raise ValueError(f"no GGUF name for checkpoint tensor {name} in gguf-py's map")
        targets.update(dict.fromkeys(target.parts, target))
    return targets


_SUFFIXES = (".weight", ".bias")
_SMOLVLM_VISION = ("model.vision_model.", "model.connector.")


def _text_target(name: str, text_arch: str, text_config: Any, text_map: Any) -> _Target:
    if text_arch != "llama":
        return _Target(name, (text_map.get_name(name, _SUFFIXES),))
    # conversion/llama.py: SmolVLM's `text_model.` dropped, q/k rows (weights and biases) permuted per head
    # (LlamaModel.permute; k by the KV heads)
    disk = name.replace("model.text_model.", "model.")
    heads = {".q_proj.": text_config.num_attention_heads, ".k_proj.": text_config.num_key_value_heads}
    rope_heads = next((n for part, n in heads.items() if part in name), 0)
    return _Target(name, (text_map.get_name(disk, _SUFFIXES),), rope_heads=rope_heads)


def _vision_target(name: str, config: Any, vision_map: Any) -> _Target:
    """What the converter made of a vision tensor: conversion/qwenvl.py (Qwen2-VL, Qwen2.5-VL) and
    conversion/qwen3vl.py (Qwen3-VL), each step read backwards."""
    import gguf

    names, kinds = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    qwen3 = config.architectures == [QWEN3_VL]
    patch = names[kinds.V_ENC_EMBD_PATCH]
    if name == "visual.patch_embed.proj.weight":  # the Conv3D's kernel split along time into two Conv2D kernels
        return _Target(name, (f"{patch}.weight", f"{patch}.weight.1"), axis=2, stack=True)
    if name == "visual.patch_embed.proj.bias":
        return _Target(name, (f"{patch}.bias",))
    if ".attn.qkv." in name and not qwen3:  # the fused projection's rows split into q, k and v
        return _Target(name, tuple(vision_map.get_name(name.replace(".qkv.", f".{p}."), _SUFFIXES) for p in "qkv"))
    parts = name.split(".")
    if qwen3 and name.startswith("visual.deepstack_merger_list."):  # renumbered by the block they follow
        index, layer, suffix = parts[2], parts[3], parts[4]
        kind = {"norm": kinds.V_DS_NORM, "linear_fc1": kinds.V_DS_FC1, "linear_fc2": kinds.V_DS_FC2}[layer]
        block = config.vision_config.deepstack_visual_indexes[int(index)]
        return _Target(name, (f"{names[kind].format(bid=block)}.{suffix}",))
    if qwen3 and name.startswith("visual.merger."):  # linear_fc1 / linear_fc2 named as Qwen2-VL's mlp.0 / mlp.2
        layer, suffix = parts[2], parts[3]
        mmproj = names[kinds.V_MMPROJ]
        base = {
            "norm": names[kinds.V_POST_NORM],
            "linear_fc1": mmproj.format(bid=0),
            "linear_fc2": mmproj.format(bid=2),
        }
        return _Target(name, (f"{base[layer]}.{suffix}",))
    return _Target(name, (vision_map.get_name(name, _SUFFIXES),))


def _disk_name(name: str) -> str:
    for ours, disk in _DISK_PREFIXES:
        if name.startswith(ours):
            return disk + name[len(ours) :]
    return name


def iter_weights(
    text: Path, mmproj: Path | None, config: Any, codes: bool = False
) -> Iterator[tuple[str, torch.Tensor | GroupedWeights]]:
    """(checkpoint name, fp32 tensor) of both files, each tensor dequantized alone; a checkpoint tensor the
    converter split is yielded once all its parts were read (they lie next to each other in the file). With
    `codes`, the text decoder's quantized linears and the LM head come as their blocks' GroupedWeights
    (loader.gguf_tensor)."""
    if mmproj is None and gguf_architecture(text) == "llama":  # SmolVLM's text alone
        yield from iter_gguf(text, config, codes)
        return
    targets = checkpoint_targets(config, gguf_architecture(text))
    pending: dict[str, dict[str, np.ndarray]] = {}
    for path in (text, mmproj) if mmproj is not None else (text,):
        for tensor in gguf_reader(path).tensors:
            target = targets.get(tensor.name)
            if target is None:
                raise ValueError(f"{path.name}: GGUF tensor {tensor.name} belongs to no parameter of the model")
            if len(target.parts) == 1:
                codes_here = codes and path == text
                yield target.name, gguf_tensor(tensor, target.name, target.rope_heads, codes_here, target.norm_shift)
                continue
            parts = pending.setdefault(target.name, {})
            part = gguf_tensor(tensor, target.name, norm_shift=target.norm_shift)
            assert isinstance(part, torch.Tensor)  # dense: no codes asked
            parts[tensor.name] = part.numpy()
            if len(parts) == len(target.parts):
                del pending[target.name]
                arrays = [parts[p] for p in target.parts]
                joined = np.stack(arrays, target.axis) if target.stack else np.concatenate(arrays, target.axis)
                yield target.name, torch.from_numpy(joined)
    if pending:
        raise ValueError(f"GGUF tensors of {sorted(pending)} are missing parts")


# ---- the prompt side ---------------------------------------------------------------------------


def processor_directory(text: Path, mmproj: Path | None, config: Any) -> Path:
    """A Hugging Face processor directory (tokenizer, chat template, image and video processors, config)
    rebuilt from the two files, made once per pair of files under the cache and reused: what the family's
    prompt code loads, as it loads a checkpoint's."""
    import transformers

    identity = [_file_identity(text), _file_identity(mmproj) if mmproj else None, transformers.__version__]
    key = hashlib.sha256(json.dumps([identity, _PROCESSOR_VERSION]).encode()).hexdigest()[:20]
    root = Path(os.environ.get("VLM_ENGINE_CACHE", Path.home() / ".cache" / "vlm_engine")) / "gguf-processors"
    final = root / f"{text.stem}-{key}"
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _write_processor(staging, text, mmproj, config)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, final)  # whole or not at all; another process may have won the race
        except OSError:
            if not final.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _file_identity(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def gguf_tokenizer(text: Path, extra_special_tokens: dict[str, str] | None = None) -> Any:
    """The text file's tokenizer (vocabulary, merges, special tokens, chat template), built by Transformers'
    GGUF tokenizer conversion (by the file's tokenizer.ggml.model; Gemma's sentencepiece vocabularies have
    their own builder). `extra_special_tokens`: named special tokens a processor reads (Gemma 3's boi_token)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(text))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    options = {k: v for k, v in {**tokenizer_config, **extra}.items() if v is not None}
    if extra_special_tokens:
        options["extra_special_tokens"] = extra_special_tokens
    if "chat_template" not in options:
        raise ValueError(f"{text.name}: no chat template (tokenizer.chat_template)")
    return PreTrainedTokenizerFast(tokenizer_object=_with_user_defined_tokens(backend, text), **options)


def _with_user_defined_tokens(backend: Any, text: Path) -> Any:
    """The vocabulary's USER_DEFINED tokens (a checkpoint's non-special added tokens, such as the double newline in our
    SmolVLM test vocabulary) as added tokens under their own ids: llama.cpp, like the checkpoint's tokenizer,
    matches them whole before BPE; Transformers' conversion leaves them to BPE (under their byte-level
    spelling, which BPE's merges never reach). The vocabulary entry takes the token's own text, so that the
    added token keeps its id."""
    from gguf import TokenType
    from tokenizers import Tokenizer

    reader = gguf_reader(text)
    tokens = list(_required(reader, text, "tokenizer.ggml.tokens"))
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", []))  # type: ignore[call-overload]
    user_defined = [(i, tokens[i]) for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED]
    if not user_defined:
        return backend
    state = json.loads(backend.to_str())
    vocabulary, present = state["model"]["vocab"], {t["content"] for t in state["added_tokens"]}
    for index, token in user_defined:
        if token in present:
            continue
        vocabulary.pop(backend.id_to_token(index), None)
        vocabulary[token] = index
        state["added_tokens"].append(
            {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False}
        )  # fmt: skip
    return Tokenizer.from_str(json.dumps(state))


def _write_processor(out: Path, text: Path, mmproj: Path | None, config: Any) -> None:
    config.save_pretrained(str(out))
    if mmproj is not None and config.architectures == [gguf_gemma3.GEMMA3]:  # its tokenizer names its image tokens
        tokenizer = gguf_tokenizer(text, extra_special_tokens=gguf_gemma3.NAMED_TOKENS)
        gguf_gemma3.gemma3_processor(tokenizer, mmproj, config).save_pretrained(str(out))
        return
    tokenizer = gguf_tokenizer(text)
    if mmproj is None:
        tokenizer.save_pretrained(str(out))
        return
    import transformers

    clip = gguf_reader(mmproj)
    vision, (architecture,) = config.vision_config, config.architectures
    if architecture == SMOLVLM:
        _smolvlm_processor(tokenizer, clip, mmproj, config).save_pretrained(str(out))
        return
    shortest, longest = _PIXELS[architecture]
    pixels = {
        "shortest_edge": int(gguf_field(clip, "clip.vision.image_min_pixels", shortest)),
        "longest_edge": int(gguf_field(clip, "clip.vision.image_max_pixels", longest)),
    }
    options = {
        "size": pixels, "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "image_mean": [_float(v) for v in _required(clip, mmproj, "clip.vision.image_mean")],
        "image_std": [_float(v) for v in _required(clip, mmproj, "clip.vision.image_std")],
    }  # fmt: skip
    processor_class, video_class = {
        QWEN2_VL: ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
        QWEN2_5_VL: ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
        QWEN3_VL: ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    }[architecture]
    processor = getattr(transformers, processor_class)(
        image_processor=transformers.Qwen2VLImageProcessor(**options),
        video_processor=getattr(transformers, video_class)(**options),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    )  # fmt: skip
    processor.save_pretrained(str(out))


def _smolvlm_processor(tokenizer: Any, clip: Any, mmproj: Path, config: Any) -> Any:
    """SmolVLMProcessor with the mmproj's resize edge (clip.vision.preproc_image_size: the released
    processor's size.longest_edge), tiles of the tower's image size, and `_SMOLVLM_NOT_STORED`."""
    import transformers

    tile = int(config.vision_config.image_size)
    common = {
        "image_mean": [_float(v) for v in _required(clip, mmproj, "clip.vision.image_mean")],
        "image_std": [_float(v) for v in _required(clip, mmproj, "clip.vision.image_std")],
        "max_image_size": {"longest_edge": tile},
    }
    image_processor = transformers.SmolVLMImageProcessor(
        size={"longest_edge": int(_required(clip, mmproj, "clip.vision.preproc_image_size"))},
        do_image_splitting=_SMOLVLM_NOT_STORED["do_image_splitting"], **common,
    )  # fmt: skip
    video_processor = transformers.SmolVLMVideoProcessor(
        size={"longest_edge": tile}, fps=_SMOLVLM_NOT_STORED["video_fps"],
        num_frames=_SMOLVLM_NOT_STORED["video_frames"], **common,
    )  # fmt: skip
    patches = tile // int(config.vision_config.patch_size)
    return transformers.SmolVLMProcessor(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer,
        image_seq_len=patches * patches // int(config.scale_factor) ** 2, chat_template=tokenizer.chat_template,
    )  # fmt: skip
