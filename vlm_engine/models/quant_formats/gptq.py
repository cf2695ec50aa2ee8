"""GPTQ checkpoints (AutoGPTQ, GPTQModel, Transformers/optimum), read as those tools write them.

Per quantized linear [out, in] with `bits` in 4 or 8 (`per_word` = 32 // bits codes to an int32 word):
- `qweight` int32 [in / per_word, out]: packed along the inputs, input r * per_word + i in bits
  [i * bits, (i + 1) * bits) of row r;
- `qzeros` int32 [groups, out / per_word]: packed along the outputs the same way;
- `scales` fp16 [groups, out]; `g_idx` int32 [in]: each input's group (a permutation of groups with
  `desc_act`, i // group_size without); w[o, i] = scales[g, o] * (q[o, i] - z[g, o]), g = g_idx[i].

`checkpoint_format` "gptq" (v1, what every tool exports) stores each zero minus one: GPTQModel exports by
subtracting 0x11111111 (4-bit; 0x01010101 8-bit) from each whole qzeros word, borrows included, and adds the
same constant back on load (gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module /
convert_gptq_v1_to_v2_format_module); "gptq_v2" stores the zeros as they are. AutoGPTQ's reader adds one to each
field instead, which agrees wherever no stored zero is 0 (always so for `sym`); an asymmetric v1 checkpoint
is read only from GPTQModel >= 0.9.0 (`meta.quantizer`), the rule GPTQModel's own loader applies, since AutoGPTQ's
asymmetric export corrupts the words holding a zero of 0.

The word unpacking, the naming of packed linears and the symmetric-codes rule are packing.py's (awq.py's too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vlm_engine.models.quant_formats.base import ActivationQuantization, GroupedWeights, UnsupportedQuantization
from vlm_engine.models.quant_formats.packing import PackedLinears, ceil_div, check_shapes, grouped_weights, unpack_words

SUPPORTED_BITS = (4, 8)
COMPONENTS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
V1, V2 = "gptq", "gptq_v2"
# GPTQModel's MIN_VERSION_WITH_V2: from it on, asymmetric v1 exports are written with whole-word borrows.
ASYMMETRIC_V1_SINCE = (0, 9, 0)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _quantizers(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """`meta.quantizer`: "tool:version" strings (a list, or one string), as GPTQModel reads them."""
    found = (config.get("meta") or {}).get("quantizer") or []
    found = [found] if isinstance(found, str) else found
    return [(tool.lower(), _version(version)) for tool, _, version in (str(q).partition(":") for q in found)]


def _checked(field: str, value: Any, allowed: tuple[Any, ...], why: str = "") -> Any:
    if value not in allowed:
        raise UnsupportedQuantization(
            f"GPTQ quantization_config.{field} = {value!r} is not supported (served: {', '.join(map(repr, allowed))})"
            + (f": {why}" if why else "")
        )
    return value


def parse(config: dict[str, Any]) -> GPTQFormat:
    """config.json's `quantization_config` with quant_method "gptq" -> its reader; raises
    UnsupportedQuantization naming the field for a packing we do not read."""
    bits = _checked("bits", config.get("bits", 4), SUPPORTED_BITS)
    # GPTQModel writes `format` and `checkpoint_format` (its deprecated alias, the one Transformers reads).
    fields = [f for f in ("checkpoint_format", "format") if config.get(f)]
    for field in fields:
        why = "marlin, bitblas and gptq_p packings are kernel layouts we do not read"
        _checked(field, str(config[field]).lower(), (V1, V2), why)
    layouts = {str(config[f]).lower() for f in fields} or {V1}
    if len(layouts) > 1:
        raise UnsupportedQuantization(f"GPTQ quantization_config.checkpoint_format and .format disagree: {layouts}")
    (layout,) = layouts
    if config.get("is_marlin_format"):
        raise UnsupportedQuantization("GPTQ quantization_config.is_marlin_format = true: a Marlin packing, not read")
    _checked("pack_dtype", str(config.get("pack_dtype") or "int32"), ("int32",))
    if config.get("dynamic"):
        raise UnsupportedQuantization("GPTQ quantization_config.dynamic (per-module overrides) is not supported")
    if config.get("rotation"):
        raise UnsupportedQuantization(f"GPTQ quantization_config.rotation = {config['rotation']!r} is not supported")
    sym = bool(config.get("sym", True))
    if layout == V1 and not sym:
        made_by = dict(_quantizers(config))
        if made_by.get("gptqmodel", ()) < ASYMMETRIC_V1_SINCE:
            raise UnsupportedQuantization(
                "GPTQ quantization_config.sym = false with checkpoint_format 'gptq' (v1) is read only from "
                "GPTQModel >= 0.9.0 (meta.quantizer): older exporters corrupt the packed zero points"
            )
    group_size = int(config.get("group_size", 128))
    if group_size != -1 and group_size <= 0:
        raise UnsupportedQuantization(f"GPTQ quantization_config.group_size = {group_size} is not supported")
    return GPTQFormat(
        bits=bits, group_size=group_size, desc_act=bool(config.get("desc_act", False)), zeros_offset=layout == V1,
        not_converted=tuple(config.get("modules_to_not_convert") or ()),
    )  # fmt: skip


@dataclass(frozen=True)
class GPTQFormat(PackedLinears):
    """A parsed GPTQ `quantization_config` (the `CheckpointFormat` protocol)."""

    # Every writer stores g_idx, act-order or not (AutoGPTQ's and GPTQModel's QuantLinear buffers).
    component_names: ClassVar[frozenset[str]] = COMPONENTS
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool  # informative: `g_idx` is read in every case
    zeros_offset: bool  # v1: each stored zero is the zero minus one
    not_converted: tuple[str, ...] = ()
    name: str = "gptq"
    activations: ActivationQuantization | None = None

    def unpack(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        qweight, qzeros, scales, g_idx = (tensors[c] for c in ("qweight", "qzeros", "scales", "g_idx"))
        per_word = 32 // self.bits
        out_features, in_features = qweight.shape[1], qweight.shape[0] * per_word
        group_size = in_features if self.group_size == -1 else self.group_size
        groups = ceil_div(in_features, group_size)
        expected = {"qzeros": (groups, ceil_div(out_features, per_word)), "scales": (groups, out_features),
                    "g_idx": (in_features,)}  # fmt: skip
        check_shapes(linear, tensors, expected)
        # Transposing the packed words (0.5 byte a weight at 4 bits) makes the codes come out [out, in].
        codes = unpack_words(qweight.t().contiguous(), self.bits).reshape(out_features, in_features)
        words = qzeros
        if self.zeros_offset:  # the exporter's whole-word subtraction undone, as int32 arithmetic wraps
            words = qzeros + sum(1 << (self.bits * i) for i in range(per_word))  # 0x11111111: fits an int32
        zeros = unpack_words(words, self.bits).reshape(groups, -1)[:, :out_features].t()
        group_of_input = g_idx.long()
        if bool(((group_of_input < 0) | (group_of_input >= groups)).any()):
            raise ValueError(f"{linear}.g_idx: a group outside 0 .. {groups - 1}")
        if torch.equal(group_of_input, torch.arange(in_features, device=g_idx.device) // group_size):
            group_of_input = None  # contiguous groups: the loader needs no per-input table
        return grouped_weights(codes, zeros, scales.t(), self.bits, group_size, group_of_input)
