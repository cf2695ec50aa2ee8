"""AWQ checkpoints (AutoAWQ, GPTQModel's AWQ, the Qwen*-AWQ releases), read as those tools write them.

4-bit codes, eight to an int32 word, w[o, i] = scales[g, o] * (q[o, i] - z[g, o]) with g = i // group_size.
- version "gemm" (AutoAWQ's WQLinear_GEMM, what the releases use): `qweight` int32 [in, out / 8] packed along
  the outputs in AWQ's interleaved order: the field in bits [4k, 4k + 4) of word j holds output 8j + ORDER[k],
  ORDER = (0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [groups, out / 8] the same; `scales` fp16 [groups, out].
  (AutoAWQ awq/modules/linear/gemm.py `from_linear`; vLLM's awq_triton.py unpacks with shifts
  4 * (0, 4, 1, 5, 2, 6, 3, 7)[column % 8], the same order.)
- version "gemv" (WQLinear_GEMV): `qweight` int32 [out, in / 8] packed along the inputs in plain order;
  `qzeros` int32 [out, width] packed along the groups, `scales` fp16 [out, width * 8], where width pads the
  group count (`calculate_zeros_width`) and only the first `groups` columns count.
`zero_point: false` (GPTQModel's AWQ with sym) stores qzeros all 8 and the same formula holds; AutoAWQ cannot
export it at all. Other versions (exllama, marlin, gemv_fast, llm-awq's packing) are other layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vlm_engine.models.quant_formats.base import ActivationQuantization, GroupedWeights, UnsupportedQuantization
from vlm_engine.models.quant_formats.packing import PackedLinears, ceil_div, check_shapes, grouped_weights, unpack_words

BITS = 4
PER_WORD = 32 // BITS
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field k of a GEMM word holds output column 8j + ORDER[k]
FIELD_OF_COLUMN = tuple(ORDER.index(c) for c in range(PER_WORD))  # (0, 4, 1, 5, 2, 6, 3, 7): vLLM's reverse order
VERSIONS = ("gemm", "gemv")
COMPONENTS = frozenset({"qweight", "qzeros", "scales"})


def parse(config: dict[str, Any]) -> AWQFormat:
    """config.json's `quantization_config` with quant_method "awq" -> its reader; raises
    UnsupportedQuantization naming the field for a packing we do not read."""
    bits = config.get("bits", config.get("w_bit", BITS))
    if bits != BITS:
        raise UnsupportedQuantization(f"AWQ quantization_config.bits = {bits!r} is not supported (served: 4)")
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version not in VERSIONS:
        raise UnsupportedQuantization(
            f"AWQ quantization_config.version = {version!r} is not supported (served: {', '.join(VERSIONS)}): "
            "exllama, marlin, gemv_fast and ipex are other packings"
        )
    backend = str(config.get("backend") or "autoawq").lower()
    if backend != "autoawq":
        raise UnsupportedQuantization(
            f"AWQ quantization_config.backend = {backend!r} is not supported: llm-awq packs as gemv_fast"
        )
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    if group_size != -1 and group_size <= 0:
        raise UnsupportedQuantization(f"AWQ quantization_config.group_size = {group_size} is not supported")
    return AWQFormat(group_size, version, tuple(config.get("modules_to_not_convert") or ()))


def gemv_zeros_width(in_features: int, group_size: int) -> int:
    """AutoAWQ's calculate_zeros_width: qzeros words per output row of a GEMV checkpoint."""
    multiplier = {64: 2, 32: 4}.get(group_size, 1)
    return ceil_div(ceil_div(in_features // group_size, PER_WORD), multiplier) * multiplier


@dataclass(frozen=True)
class AWQFormat(PackedLinears):
    """A parsed AWQ `quantization_config` (the `CheckpointFormat` protocol)."""

    component_names: ClassVar[frozenset[str]] = COMPONENTS
    group_size: int  # -1: one group per output channel
    version: str
    not_converted: tuple[str, ...] = ()  # `modules_to_not_convert`: stored as plain tensors
    name: str = "awq"
    activations: ActivationQuantization | None = None

    def unpack(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        if self.version == "gemm":
            return self._unpack_gemm(linear, tensors)
        return self._unpack_gemv(linear, tensors)

    def _group_size(self, in_features: int) -> int:
        group_size = in_features if self.group_size == -1 else self.group_size
        if in_features % group_size:
            raise ValueError(f"AWQ: {in_features} inputs are not a whole number of groups of {group_size}")
        return group_size

    def _unpack_gemm(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        in_features, out_features = qweight.shape[0], qweight.shape[1] * PER_WORD
        group_size = self._group_size(in_features)
        groups = in_features // group_size
        check_shapes(linear, tensors, {"qzeros": (groups, out_features // PER_WORD), "scales": (groups, out_features)})
        field_of_column = torch.tensor(FIELD_OF_COLUMN, device=qweight.device)
        # [in, word, field] -> [word, column in word, in]: the reorder and the transpose in one copy.
        fields = unpack_words(qweight, BITS).permute(1, 2, 0)
        codes = fields.index_select(1, field_of_column).reshape(out_features, in_features)
        zeros = unpack_words(qzeros, BITS).index_select(2, field_of_column).reshape(groups, out_features).t()
        return grouped_weights(codes, zeros, scales.t(), BITS, group_size)

    def _unpack_gemv(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        out_features, in_features = qweight.shape[0], qweight.shape[1] * PER_WORD
        group_size = self._group_size(in_features)
        groups, width = in_features // group_size, gemv_zeros_width(in_features, group_size)
        check_shapes(linear, tensors, {"qzeros": (out_features, width), "scales": (out_features, width * PER_WORD)})
        codes = unpack_words(qweight, BITS).reshape(out_features, in_features)
        zeros = unpack_words(qzeros, BITS).reshape(out_features, -1)[:, :groups]
        return grouped_weights(codes, zeros, scales[:, :groups], BITS, group_size)
