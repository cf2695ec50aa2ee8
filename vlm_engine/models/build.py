"""Building a served model: its modules on the meta device, storage in the served dtype, the checkpoint
streamed in, each linear quantized or packed as soon as it is filled."""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch
from torch import nn

from vlm_engine.models import loader
from vlm_engine.models.bf16_dot_gemm import load_bf16_dot_gemm
from vlm_engine.models.family import VLModel
from vlm_engine.models.layers import RotaryEmbedding
from vlm_engine.models.prepack import LoadTimePacker, prepack_linears, prepack_supported
from vlm_engine.models.quantized import QUANTIZED_DTYPES, Quantization, quantize_child, quantize_linears
from vlm_engine.models.registry import ModelSource, model_class

logger = logging.getLogger(__name__)


def build_model(
    source: ModelSource,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    prepack: bool = True,
    panel_ops: ModuleType | None = None,
    quantization: str | None = None,
    quant_ops: ModuleType | None = None,
    bf16_weights: bool = False,
    weight_layouts: str = "one",
    quantize_vision: bool = False,
) -> VLModel:
    cls = model_class(config)
    # Build on the meta device: random initialization of weights we overwrite anyway costs seconds.
    with torch.device("meta"):
        model = cls(config)
    quantizing = bool(quantization) and device.type == "cpu" and dtype in QUANTIZED_DTYPES and quant_ops is not None
    # The linears to be quantized are filled in fp32: their codes come from the checkpoint's values
    # (a Q4_1 GGUF's own), not from those rounded to a bf16 model's dtype.
    plan = Quantization.of(model, quantization, quantize_vision) if quantizing and quantization else None
    _materialize(model, dtype, plan.weights(model) if plan is not None else frozenset())
    weights = source.weights(config)
    # Each linear quantized or packed as soon as it is filled: the plain weights never all exist beside those.
    packing = prepack and prepack_supported(device, dtype)
    quantize = functools.partial(quantize_child, plan=plan, ops=quant_ops) if plan is not None else None
    dot_ops = load_bf16_dot_gemm() if packing and dtype == torch.bfloat16 else None
    encoders = tuple(getattr(model, "encoder_modules", ()))
    pack = LoadTimePacker(model, panel_ops, bf16_weights, dot_ops, weight_layouts, encoders, packing, quantize, dtype)
    loader.load_weights(model, weights, on_filled=pack if packing or quantizing else None)
    if quantization:
        if not quantizing:
            raise ValueError("weight-only quantization runs on CPU, in fp32 or bf16, with the fused-ops extension")
        # Before prepacking (what stays nn.Linear is packed) and before the cast to `dtype` (a linear
        # tied to the embedding is quantized from its fp32 values, then the embedding is cast).
        quantize_linears(model, quantization, quant_ops, quantize_vision)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    if packing:
        # A media encoder only ever multiplies prefill-sized row counts: one (oneDNN) layout for its linears.
        for name in encoders:
            prepack_linears(model.get_submodule(name))
        prepack_linears(model, panel_ops, bf16_weights, dot_ops, weight_layouts)
    logger.info("loaded %s (%s) as %s on %s", source.name, cls.__name__, dtype, device)
    return model


def _materialize(model: nn.Module, dtype: torch.dtype, fp32_params: frozenset[int] = frozenset()) -> None:
    """Give meta tensors real (uninitialized) CPU storage, floating point ones in `dtype` (the
    checkpoint is cast as it is copied in: a bf16 3B model never holds an fp32 copy), those whose
    id is in `fp32_params` in float32; tied parameters stay tied.

    Safe because `load_weights` fails on any parameter the checkpoint leaves unset, and modules
    that compute buffers at construction (e.g. a vision tower's RoPE) build them on the CPU.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in replaced:
                    like = torch.float32 if id(param) in fp32_params else dtype
                    like = like if param.is_floating_point() else param.dtype
                    replaced[id(param)] = nn.Parameter(
                        torch.empty_like(param, device="cpu", dtype=like), requires_grad=False
                    )
                setattr(module, name, replaced[id(param)])
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                raise RuntimeError(f"buffer {name} of {type(module).__name__} was built on the meta device")
