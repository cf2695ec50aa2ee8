"""From an `EngineConfig` to loaded models: the checkpoint, the device and dtype, the kernels (fused
CPU ops, weight panels, weight-only quantization, bf16 weights) and the optional draft model.

The engine gets one `WiredModel` and builds its runner and pools around it; nothing here knows
about pages or requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vlm_engine.config import EngineConfig
from vlm_engine.host_memory import keep_freed_memory
from vlm_engine.models import loader
from vlm_engine.models.build import build_model
from vlm_engine.models.family import VLModel, text_config_of
from vlm_engine.models.fused_ops import fused_ops_apply, load_fused_ops
from vlm_engine.models.quant_formats import CheckpointFormat, checkpoint_format, gguf_blocks
from vlm_engine.models.registry import (
    ModelSource,
    cpu_bf16_weights,
    default_device,
    load_config,
    resolve_dtype,
    resolve_model,
)


@dataclass(frozen=True)
class WiredModel:
    """The loaded models and the choices made on the way, which the runner and the log need."""

    source: ModelSource
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    model: VLModel
    fused_ops: ModuleType | None  # the fused CPU ops the runners call (None: not loaded)
    quantization: str | None  # the target's weight-only quantization
    bf16_weights: bool  # fp32 activations over bf16 weight panels (see registry.cpu_bf16_weights)
    draft_model: VLModel | None = None  # speculative decoding's draft model, when one is configured
    prequantized: str | None = None  # the checkpoint's own quantization format (compressed-tensors, AWQ, ...)

    @property
    def weights(self) -> str:
        """What the linears' weights are, for the log."""
        if self.prequantized:
            return f"{self.prequantized} (the checkpoint's own codes)"
        return self.quantization or ("bf16 (fp32 activations)" if self.bf16_weights else "unquantized")


def wire_model(config: EngineConfig) -> WiredModel:
    """Load the target model (and the draft model, if any) as `config` asks."""
    cfg, spec = config.model, config.speculative
    source = resolve_model(cfg.model, cfg.mmproj)
    hf_config = load_config(source)
    # Before a byte of weights: a format we do not serve, or quantizing a quantized checkpoint again, fails here.
    prequantized = _prequantized(source, hf_config, cfg.quantization)
    if config.cache.disable_sliding_window:
        attend_fully(hf_config)
    device = default_device(cfg.device)
    if device.type == "cpu":
        keep_freed_memory()  # steps reuse their large activations instead of page-faulting them in
    # Quantized linears take the model's activations (bf16 where the CPU has bf16 dot products, as
    # the unquantized model, else fp32); a quantized model keeps its other linears in fp32 on a CPU
    # without them (no bf16 weight panels: the decoder's bytes are already the codes').
    dtype = resolve_dtype(cfg.dtype, hf_config, device, source.gguf_file is not None)
    fast = cfg.numerics == "fast"
    fused = load_fused_ops() if fast and cfg.fused_cpu_ops and fused_ops_apply(device, dtype) else None
    panel_ops = fused if fused is not None and fused.panel_linear_vectorized() else None
    bf16_weights = panel_ops is not None and not cfg.quantization and cpu_bf16_weights(cfg.dtype, dtype, device)
    prepack = fast and cfg.prepack_weights

    def build(
        checkpoint: ModelSource, checkpoint_config: Any, quantization: str | None, own: CheckpointFormat | None
    ) -> VLModel:
        # Fast numerics serve a pre-quantized checkpoint's codes on our int4 / int8 kernels; exact dequantizes them.
        kernels = bool(quantization) or (own is not None and fast)
        quant_ops = (fused or load_fused_ops()) if kernels else None
        return build_model(
            checkpoint, checkpoint_config, dtype, device, prepack, panel_ops, quantization, quant_ops, bf16_weights,
            cfg.weight_layouts, cfg.quantize_vision, own,
        )  # fmt: skip

    model = build(source, hf_config, cfg.quantization, prequantized)
    draft = None
    if spec.draft_path is not None:
        # Same dtype and kernels as the target; optionally weight-only quantized, which makes the
        # target's own weights a draft (int4 of a Q4_1 GGUF keeps its codes: it agrees nearly always).
        draft_source = resolve_model(spec.draft_path)
        draft_config = load_config(draft_source)
        _check_vocab(draft_config, hf_config)
        draft_quantization = spec.speculative_draft_quantization
        draft_format = _prequantized(draft_source, draft_config, draft_quantization)
        draft = build(draft_source, draft_config, draft_quantization, draft_format)
    own = prequantized.name if prequantized is not None else None
    return WiredModel(source, hf_config, device, dtype, model, fused, cfg.quantization, bf16_weights, draft, own)


def _prequantized(source: ModelSource, hf_config: Any, quantization: str | None) -> CheckpointFormat | None:
    """The checkpoint's own quantization format (raises UnsupportedQuantization for one we do not serve), and a
    clear error where weight-only quantization is asked of an already quantized checkpoint."""
    own = _gguf_codes(source) if source.gguf_path is not None else checkpoint_format(hf_config)
    if own is not None and quantization:
        raise ValueError(
            f"{source.name} is already quantized ({own.name}): quantization {quantization!r} would quantize it "
            "again; leave it out to serve the checkpoint's own codes"
        )
    return own


def _gguf_codes(source: ModelSource) -> CheckpointFormat | None:
    """A quantized GGUF VLM (or SmolVLM text) file is served from its codes as a pre-quantized checkpoint is. A llama
    text GGUF (the default SmolLM2 Q4_1) is not: its bf16 / fp32 and `--quantization int4` serving are what the
    benchmarks' rows and the SmolLM2 numerics and perplexity tests measure (int4 of a Q4_1 file gives back its codes)."""
    if not source.is_gguf_vlm:
        return None
    assert source.gguf_path is not None
    return gguf_blocks.quantized_format(loader.gguf_reader(source.gguf_path))


def _check_vocab(draft_config: Any, target_config: Any) -> None:
    draft_vocab = int(text_config_of(draft_config).vocab_size)
    target_vocab = int(text_config_of(target_config).vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")


def attend_fully(hf_config: Any) -> None:
    """`disable_sliding_window`: every layer of the config's `layer_types` attends to the whole context."""
    text = text_config_of(hf_config)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        text.layer_types = ["full_attention"] * len(layer_types)
    if getattr(text, "sliding_window", None) is not None:
        text.sliding_window = None


def eos_token_ids(source: ModelSource, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """Every token that ends a generation: the config's, the text config's, generation_config.json's
    and the tokenizer's EOS."""
    ids: set[int] = set()
    for holder in (hf_config, text_config_of(hf_config), _generation_config(source)):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _generation_config(source: ModelSource) -> Any:
    path = source.directory / "generation_config.json"
    if source.gguf_file or not path.exists():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(source.directory))
