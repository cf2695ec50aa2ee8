"""What every pre-quantized checkpoint format (AWQ, GPTQ, compressed-tensors, ...) hands the loader.

A format reads its own packing (bit-packed int32 words, zero points, act-order indices) and gives one
`GroupedWeights` per linear: integer codes with a scale (and zero point) per group of inputs. The loader
decides what the engine holds from it (our int4 / int8 panels, or fp32 weights in exact numerics), so
no format knows our kernels and no kernel knows a format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class UnsupportedQuantization(ValueError):
    """A checkpoint's `quantization_config` names a format or field we do not serve; raised at start-up,
    before a byte of weights is read. The message names the format and the field."""


@dataclass
class GroupedWeights:
    """One linear's weights, [out, in], as stored: w[o, i] = scales[o, g] * (codes[o, i] - zeros[o, g])
    (+ offsets[o, g]) with g = group_of_input[i] (act-order checkpoints) or i // group_size.

    codes: int32 or smaller integer tensor [out, in], unpacked (one element per weight); unsigned for asymmetric
        formats (0 .. 2**bits - 1), signed where the format stores signed codes (then zeros is None).
    scales: float32 [out, groups].
    zeros: float32 [out, groups] in code units, or None (symmetric: w = scales * codes).
    offsets: float32 [out, groups] added to the scaled codes, or None: a minimum that is no whole number of
        code units (GGUF's Q4_1 and Q4_K blocks: w = d * q + m, where a zero d leaves m alone).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int  # inputs per group; in_features for one group per output channel
    group_of_input: torch.Tensor | None = None  # int64 [in]: act-order (GPTQ desc_act) group of each input
    offsets: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def groups(self) -> torch.Tensor:
        """int64 [in]: each input's group."""
        if self.group_of_input is not None:
            return self.group_of_input.long()
        return torch.arange(self.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], exactly the format's own formula in fp32 (the reference our exact mode serves)."""
        g = self.groups()
        scales = self.scales.float()[:, g]
        codes = self.codes.float()
        weight = scales * (codes - self.zeros.float()[:, g]) if self.zeros is not None else scales * codes
        return weight if self.offsets is None else weight + self.offsets.float()[:, g]

    def rows(self, block: slice) -> GroupedWeights:
        """The weights of the output rows `block` (views, no copy)."""

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[block]

        return GroupedWeights(
            self.codes[block], self.scales[block], part(self.zeros), self.bits, self.group_size, self.group_of_input,
            part(self.offsets),
        )  # fmt: skip


@dataclass(frozen=True)
class ActivationQuantization:
    """W8A8: activations rounded to int8 at run time (compressed-tensors' dynamic per-token scheme)."""

    bits: int = 8
    symmetric: bool = True
    per: str = "token"  # one scale per row of x


class CheckpointFormat(Protocol):
    """A pre-quantized format, parsed from config.json's `quantization_config`."""

    name: str  # "awq", "gptq", "compressed-tensors", ...
    activations: ActivationQuantization | None  # None: weight-only

    def linear_of(self, name: str) -> tuple[str, str] | None:
        """A checkpoint tensor name -> (linear module path, component) for a tensor of a quantized linear
        ("model.layers.0.mlp.up_proj.qweight" -> ("model.layers.0.mlp.up_proj", "qweight")); None for a tensor
        stored as is (norms, embeddings, an unquantized vision tower, a bias)."""
        ...

    def components(self, linear: str) -> frozenset[str]:
        """Every component a quantized linear needs before `unpack` can run."""
        ...

    def unpack(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        """One linear's components (all of `components(linear)`) -> its grouped codes."""
        ...
