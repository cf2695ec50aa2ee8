"""Building a served model: its modules on the meta device, storage in the served dtype, the checkpoint
streamed in, each linear quantized or packed as soon as it is filled."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch import nn

from vlm_engine.models import gguf_vlm, loader
from vlm_engine.models.bf16_dot_gemm import load_bf16_dot_gemm
from vlm_engine.models.family import VLModel
from vlm_engine.models.layers import MergedLinear, RotaryEmbedding
from vlm_engine.models.mapped_embedding import plan_mapped_embeddings
from vlm_engine.models.prepack import LoadTimePacker, prepack_linears, prepack_supported, release_freed_memory
from vlm_engine.models.quant_formats.base import CheckpointFormat, GroupedWeights
from vlm_engine.models.quant_formats.gguf_blocks import round_to_q8_0
from vlm_engine.models.quantized import (
    QUANTIZED_DTYPES,
    InputQuantizedLinear,
    Quantization,
    QuantizedLinear,
    quantize_child,
    quantize_linears,
)
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
    prequantized: CheckpointFormat | None = None,
) -> VLModel:
    """`prequantized`: the checkpoint's own quantization (`quant_formats.checkpoint_format`, or a quantized GGUF's
    `gguf_blocks.GGUFCodes`); its linears become our int4 / int8 QuantizedLinears straight from their codes where
    `quant_ops` is given (fast numerics, on a CPU, fp32 or bf16), else they are dequantized into fp32 values (exact
    numerics: Transformers on the dequantized weights; a GGUF's as gguf-py dequantizes them), with W8A8's
    activations rounded per token as the format does."""
    cls = model_class(config)
    # Build on the meta device: random initialization of weights we overwrite anyway costs seconds.
    with torch.device("meta"):
        model = cls(config)
    names = loader.safetensors_names(source.directory) if source.gguf_path is None else None
    if names is not None:  # a GGUF's config is tied exactly where the file stores no head of its own
        loader.untie_stored(model, names)
    # Large untied embedding tables are looked up through a mapping of the file, not copied in (mapped_embedding).
    mapped = plan_mapped_embeddings(model, dtype, names) if names is not None and device.type == "cpu" else None
    quantizing = bool(quantization) and device.type == "cpu" and dtype in QUANTIZED_DTYPES and quant_ops is not None
    # The linears to be quantized are filled in fp32: their codes come from the checkpoint's values
    # (a Q4_1 GGUF's own), not from those rounded to a bf16 model's dtype.
    plan = Quantization.of(model, quantization, quantize_vision) if quantizing and quantization else None
    _materialize(model, dtype, plan.weights(model) if plan is not None else frozenset())
    weights: Any = source.weights(config)
    if mapped is not None:
        weights = mapped.intercept(weights)
    placer = None
    if prequantized is not None:
        kernels = quant_ops if device.type == "cpu" and dtype in QUANTIZED_DTYPES else None
        placer = PreQuantizedLinears(model, prequantized, kernels)
        if source.gguf_path is not None:  # exact numerics: gguf-py's fp32 values, as source.weights gives them
            weights = gguf_codes(source, config) if kernels is not None else weights
        else:
            weights = loader.grouped_weights(weights, prequantized, names or (), loader.skips(model))
    # Each linear quantized or packed as soon as it is filled: the plain weights never all exist beside those.
    packing = prepack and prepack_supported(device, dtype)
    quantize = functools.partial(quantize_child, plan=plan, ops=quant_ops) if plan is not None else None
    dot_ops = load_bf16_dot_gemm() if packing and dtype == torch.bfloat16 else None
    encoders = tuple(getattr(model, "encoder_modules", ()))
    pack = LoadTimePacker(model, panel_ops, bf16_weights, dot_ops, weight_layouts, encoders, packing, quantize, dtype)
    on_filled = pack if packing or quantizing else None
    if placer is not None:
        placer.then = on_filled
        on_filled = placer.filled if placer.kernels is not None else on_filled
    loader.load_weights(model, weights, on_filled, placer.take if placer is not None else None)
    if mapped is not None:
        mapped.check_loaded()
    if placer is not None:
        placer.finish()
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


def gguf_codes(source: ModelSource, config: Any) -> Iterator[tuple[str, torch.Tensor | GroupedWeights]]:
    """A quantized GGUF's weights with its decoder linears and LM head as GroupedWeights (quant_formats/gguf_blocks.py),
    read by the reader `source.weights` picks."""
    path = source.gguf_path
    assert path is not None
    if source.is_gguf_vlm:
        return gguf_vlm.iter_weights(path, source.mmproj, config, codes=True)
    return loader.iter_gguf(path, config, codes=True)


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


class PreQuantizedLinears:
    """Where a pre-quantized checkpoint's linears go as the loader fills them (`loader.load_weights`' on_grouped
    and on_filled). With `kernels` (the fused-ops extension) each linear's GroupedWeights, every shard of a fused
    one, is kept until the linear is filled (its bias too), then becomes one QuantizedLinear from the codes
    (shards concatenated along the outputs); a linear the panels cannot hold (a group boundary inside a block of
    32, an int8 zero point) is dequantized into its weight and handed on (`then`: packing) with a warning.
    Without kernels the loader dequantizes every linear into its parameter; W8A8 linears then round their
    inputs per token (`finish`)."""

    def __init__(self, model: nn.Module, fmt: CheckpointFormat, kernels: ModuleType | None) -> None:
        self.model, self.format, self.kernels = model, fmt, kernels
        self.then: Callable[[str], None] | None = None
        self._shards: dict[str, dict[str | None, GroupedWeights]] = {}
        self._dequantized: dict[str, None] = {}  # module paths, in order
        self.from_codes = 0

    def take(self, module_path: str, shard: str | None, grouped: GroupedWeights) -> bool:
        if self.kernels is None:
            self._dequantized[module_path] = None
            return False
        self._shards.setdefault(module_path, {})[shard] = grouped
        return True

    def filled(self, path: str) -> None:
        shards = self._shards.pop(path, None)
        if shards is not None and self._place(path, shards):
            release_freed_memory()
            return
        if self.then is not None:
            self.then(path)

    def _place(self, path: str, shards: dict[str | None, GroupedWeights]) -> bool:
        parent_path, _, name = path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        module = getattr(parent, name)
        order = list(module.shards) if isinstance(module, MergedLinear) else [None]
        grouped = concat_outputs([shards[s] for s in order])
        layer = None if grouped is None else QuantizedLinear.from_grouped(grouped, self.kernels, module.bias)
        if layer is not None:
            setattr(parent, name, layer)
            self.from_codes += 1
            return True
        logger.warning("%s: its %s codes do not fit our int4 / int8 panels: dequantized", path, self.format.name)
        with torch.no_grad():
            for shard, part in shards.items():
                start, size = module.shards[shard] if shard is not None else (0, module.out_features)
                loader.dequantize_into(module.weight.narrow(0, start, size), part)
        self._dequantized[path] = None
        return False

    def finish(self) -> None:
        """After loading: the dequantized linears of a W8A8 checkpoint round their inputs as the format does."""
        if self.format.activations is not None:
            for path in self._dequantized:
                parent_path, _, name = path.rpartition(".")
                parent = self.model.get_submodule(parent_path)
                linear = getattr(parent, name)
                if isinstance(linear, nn.Linear):  # not packed (fast numerics' fallback packs it: x not rounded)
                    setattr(parent, name, InputQuantizedLinear(linear))
        logger.info(
            "%s checkpoint: %d linears on our int4 / int8 kernels from their codes, %d dequantized%s",
            self.format.name, self.from_codes, len(self._dequantized),
            " (W8A8: inputs rounded to int8 per token)" if self.format.activations is not None and self._dequantized else "",
        )  # fmt: skip


def concat_outputs(parts: list[GroupedWeights]) -> GroupedWeights | None:
    """Shards of one fused linear (q/k/v, gate/up) as one GroupedWeights, stacked along the outputs (groups run
    along the inputs); None where they do not share groups and input order. Shards of 4 and of 8 bits (a GGUF
    Q4_K_M's Q4_K q and k beside its Q6_K v) are all made int8, the 4-bit ones re-rounded to Q8_0 from their values:
    the fused module is one kernel call, and int8 loses less of the 4-bit shards than int4 would of the others."""
    if len(parts) == 1:
        return parts[0]
    if {p.bits for p in parts} == {4, 8} and all(p.group_of_input is None for p in parts):
        logger.info("a fused linear of int4 and int8 shards: its int4 shards re-rounded to int8 (Q8_0)")
        parts = [p if p.bits == 8 else round_to_q8_0(p.dequantize()) for p in parts]
    first = parts[0]
    same_order = all(
        (p.group_of_input is None) == (first.group_of_input is None)
        and (p.group_of_input is None or torch.equal(p.group_of_input, first.group_of_input))
        for p in parts
    )
    if not same_order or any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
        return None
    if all(p.zeros is None for p in parts):
        codes, zeros = [p.codes for p in parts], None
    else:  # signed shards beside unsigned ones: shift them to the unsigned codes of the contract
        offset = 1 << (first.bits - 1)
        codes = [p.codes.to(torch.int16) + (offset if p.zeros is None else 0) for p in parts]
        zeros = torch.cat([torch.full_like(p.scales, offset) if p.zeros is None else p.zeros.float() for p in parts])
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat([torch.zeros(p.scales.shape) if p.offsets is None else p.offsets.float() for p in parts])
    dtype = torch.int16 if len({c.dtype for c in codes}) > 1 else codes[0].dtype
    return GroupedWeights(
        torch.cat([c.to(dtype) for c in codes]), torch.cat([p.scales.float() for p in parts]), zeros,
        first.bits, first.group_size, first.group_of_input, offsets,
    )  # fmt: skip
