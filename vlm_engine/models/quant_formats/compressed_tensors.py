"""compressed-tensors checkpoints (llm-compressor's output; what vLLM serves), read as the library defines them.

Two formats:
- `pack-quantized` (W4A16, and W8A16): `weight_packed` int32 [out, ceil(in * bits / 32)], the codes stored
  offset by 2**(bits-1) and packed densely from the low bits up (element i at bit i * bits); `weight_scale`
  [out, groups] (group strategy) or [out, 1] (channel); `weight_shape` [2]; asymmetric: `weight_zero_point`
  packed the same way along the output dimension ([ceil(out * bits / 32), groups]); act-order "group":
  `weight_g_idx` [in]. w = scale * (q - zero_point), q and zero_point signed.
- `int-quantized` (W8A8): int8 `weight` [out, in] and `weight_scale` [out, 1] (or [out, groups], or one per
  tensor); the activations are rounded to int8 at run time, per token, symmetric and dynamic.

(compressed_tensors/compressors/pack_quantized, naive_quantized and quantization/lifecycle/forward.py.) Which
linears are quantized: those the checkpoint stores these components for (`targets` and `ignore` decided that
when it was written); the scheme of a linear is that of the config group whose `targets` name it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from vlm_engine.models.quant_formats.base import ActivationQuantization, GroupedWeights, UnsupportedQuantization
from vlm_engine.models.quant_formats.packing import unpack_words

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
SUPPORTED = "int 4-bit pack-quantized (W4A16) and int 8-bit int-quantized (W8A8; W8A16 packed or not)"
# Weight component suffixes of a quantized linear, by format.
_PACKED = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_DENSE = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True)
class Scheme:
    """One config group's weight scheme (and W8A8's activations), checked against what we serve."""

    group: str
    format: str
    targets: tuple[str, ...]
    bits: int
    symmetric: bool
    strategy: str  # "group" | "channel" | "tensor"
    group_size: int | None
    actorder_group: bool  # a `weight_g_idx` is stored
    activations: ActivationQuantization | None

    def components(self) -> frozenset[str]:
        if self.format == "pack-quantized":
            names = {"weight_packed", "weight_scale", "weight_shape"}
            names |= set() if self.symmetric else {"weight_zero_point"}
        else:
            names = {"weight", "weight_scale"} | (set() if self.symmetric else {"weight_zero_point"})
        names |= {"weight_g_idx"} if self.actorder_group else set()
        return frozenset(names)

    def targets_name(self, module: str) -> bool:
        """compressed-tensors' matching: "re:<pattern>" (re.match), a module path, or a class name (which
        names-only matching cannot check: "Linear" and the like match any module)."""
        for target in self.targets:
            if target.startswith("re:"):
                if re.match(target[3:], module):
                    return True
            elif target == module or not ("." in target or target[:1].islower()):
                return True
        return False


class CompressedTensorsFormat:
    """A parsed `quantization_config` with quant_method "compressed-tensors" (the `CheckpointFormat` protocol)."""

    name = "compressed-tensors"

    def __init__(self, schemes: tuple[Scheme, ...]) -> None:
        self.schemes = schemes
        activations = {s.activations for s in schemes}
        # One activation scheme for the model: the loader applies it to every quantized linear.
        if len(activations) > 1:
            raise UnsupportedQuantization(
                "compressed-tensors config_groups mix weight-only and quantized-activation schemes: not supported"
            )
        self.activations = activations.pop() if activations else None

    def scheme_of(self, linear: str) -> Scheme:
        """A name or regex target wins over a class-name one (compressed-tensors' precedence)."""
        if len(self.schemes) == 1:
            return self.schemes[0]
        named = [s for s in self.schemes if any(t.startswith("re:") or t == linear for t in s.targets)]
        for scheme in [*named, *self.schemes]:
            if scheme.targets_name(linear):
                return scheme
        return self.schemes[0]

    def linear_of(self, name: str) -> tuple[str, str] | None:
        linear, _, component = name.rpartition(".")
        if not linear:
            return None
        formats = {s.format for s in self.schemes}
        if component in _PACKED and "pack-quantized" in formats and component != "weight":
            return linear, component
        if component in _DENSE and formats & {"int-quantized", "naive-quantized"}:
            # A plain `weight` is a quantized linear's only where its `weight_scale` is stored too: the loader
            # checks that (`components`) against the checkpoint's names.
            return linear, component
        return None

    def components(self, linear: str) -> frozenset[str]:
        return self.scheme_of(linear).components()

    def unpack(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        scheme = self.scheme_of(linear)
        scales = tensors["weight_scale"].float()
        if scheme.format == "pack-quantized":
            packed, stored_shape = tensors["weight_packed"], tensors["weight_shape"]
            if stored_shape.is_meta:  # names-only loading: the packed words' capacity
                shape = (int(packed.shape[0]), int(packed.shape[1]) * 32 // scheme.bits)
            else:
                shape = tuple(int(v) for v in stored_shape.reshape(-1).tolist())
            codes = unpack_int32(packed, scheme.bits, shape[1])
        else:
            codes = tensors["weight"]
            if codes.dtype != torch.int8:
                raise UnsupportedQuantization(
                    f"{linear}.weight: int-quantized weights stored as {codes.dtype}, not int8"
                )
            shape = tuple(codes.shape)
        out, inputs = shape
        scales = _per_output(scales, out, f"{linear}.weight_scale")
        groups = scales.shape[1]
        if inputs % groups:
            raise ValueError(f"{linear}: {inputs} inputs do not split into {groups} groups")
        zeros = None
        if not scheme.symmetric:
            zero_point = tensors["weight_zero_point"]
            if scheme.format == "pack-quantized":
                # Packed along the outputs: unpack the transpose.
                zero_point = unpack_int32(zero_point.t().contiguous(), scheme.bits, out).t()
            zero_point = _per_output(zero_point.float(), out, f"{linear}.weight_zero_point")
            # The contract's asymmetric codes are unsigned: q + 2**(bits-1), zero point likewise (same differences).
            offset = 1 << (scheme.bits - 1)
            codes, zeros = codes.to(torch.int16) + offset, zero_point + offset
        g_idx = tensors.get("weight_g_idx")
        group_of_input = None
        # -1: never set (column order); a meta one (names-only loading) is taken as set.
        if g_idx is not None and (g_idx.is_meta or not bool((g_idx < 0).any())):
            group_of_input = g_idx.long()
        return GroupedWeights(codes, scales, zeros, scheme.bits, inputs // groups, group_of_input)


def unpack_int32(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' `unpack_from_int32` for 4 and 8 bits: int8 codes [rows, columns], signed (element i of
    a word in bits [i * bits, (i + 1) * bits), as `packing.unpack_words` reads them)."""
    unsigned = unpack_words(packed, bits).reshape(packed.shape[0], -1)
    # The stored codes are offset by 2**(bits-1): subtracting it in uint8 arithmetic wraps onto the signed bytes.
    return (unsigned[:, :columns] - (1 << (bits - 1))).view(torch.int8)


def _per_output(values: torch.Tensor, out: int, name: str) -> torch.Tensor:
    """[out, groups]: a per-tensor value ([] or [1]) repeated for every output."""
    if values.dim() <= 1 and values.numel() == 1:
        return values.reshape(1, 1).expand(out, 1).contiguous()
    if values.dim() != 2 or values.shape[0] != out:
        raise ValueError(f"{name}: shape {tuple(values.shape)} is not [{out}, groups]")
    return values


def parse(config: dict[str, Any]) -> CompressedTensorsFormat:
    """Check a compressed-tensors `quantization_config` against what we serve; every refusal names the field."""
    for field in ("kv_cache_scheme", "transform_config"):
        if config.get(field):
            raise UnsupportedQuantization(f"compressed-tensors {field} is set: not supported ({SUPPORTED} are)")
    sparsity = config.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise UnsupportedQuantization(
            f"compressed-tensors sparsity_config.format {sparsity.get('format')!r} is not supported ({SUPPORTED} are)"
        )
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedQuantization(
            f"compressed-tensors quantization_status {status!r}: only compressed checkpoints are read"
        )
    groups = config.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization("compressed-tensors config_groups is empty: nothing says how weights are stored")
    schemes = tuple(_scheme(name, group, config.get("format")) for name, group in groups.items())
    return CompressedTensorsFormat(schemes)


def _scheme(name: str, group: dict[str, Any], top_format: str | None) -> Scheme:
    where = f"compressed-tensors scheme {name!r}"
    # The weights' type before the format: it names what the user has (fp8, fp4) better than the format it implies.
    weights = group.get("weights")
    if not weights:
        raise UnsupportedQuantization(f"{where}: no weights scheme (activation-only quantization) is not supported")
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    if kind != "int" or bits not in (4, 8):
        label = " (fp8)" if kind == "float" and bits == 8 else " (fp4)" if kind == "float" and bits == 4 else ""
        raise UnsupportedQuantization(
            f"{where}: weights.type {kind!r}, num_bits {bits}{label} is not supported: {SUPPORTED} are"
        )
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise UnsupportedQuantization(f"{where}: format {fmt!r} is not supported: {SUPPORTED} are")
    if fmt == "pack-quantized" and group.get("input_activations"):
        raise UnsupportedQuantization(
            f"{where}: pack-quantized with input_activations is not supported: {SUPPORTED} are"
        )
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("group", "channel", "tensor") or (fmt == "pack-quantized" and strategy == "tensor"):
        raise UnsupportedQuantization(f"{where}: weights.strategy {strategy!r} is not supported: {SUPPORTED} are")
    if weights.get("dynamic"):
        raise UnsupportedQuantization(f"{where}: weights.dynamic {weights['dynamic']!r} is not supported")
    if group.get("output_activations"):
        raise UnsupportedQuantization(f"{where}: output_activations are not supported")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "group", "weight", "static"):
        raise UnsupportedQuantization(f"{where}: weights.actorder {actorder!r} is not supported")
    return Scheme(
        group=name, format=fmt, targets=tuple(group.get("targets") or ("Linear",)), bits=bits,
        symmetric=bool(weights.get("symmetric", True)), strategy=strategy,
        group_size=weights.get("group_size"), actorder_group=actorder == "group",
        activations=_activations(where, group.get("input_activations")),
    )  # fmt: skip


def _activations(where: str, args: dict[str, Any] | None) -> ActivationQuantization | None:
    if not args:
        return None  # weight-only (W4A16, W8A16)
    got = (
        args.get("type", "int"),
        int(args.get("num_bits", 8)),
        args.get("strategy"),
        args.get("dynamic"),
        args.get("symmetric", True),
    )
    if got != ("int", 8, "token", True, True):
        raise UnsupportedQuantization(
            f"{where}: input_activations type {got[0]!r}, num_bits {got[1]}, strategy {got[2]!r}, dynamic {got[3]!r}, "
            f"symmetric {got[4]!r} is not supported: int 8-bit dynamic per-token symmetric (W8A8) is"
        )
    return ActivationQuantization(bits=8, symmetric=True, per="token")
