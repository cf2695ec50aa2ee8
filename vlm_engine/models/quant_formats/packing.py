"""What the packed formats share: int32 words unpacked into their bit fields (AWQ, GPTQ, compressed-tensors),
and the naming and zero-point handling AWQ and GPTQ have in common."""

from __future__ import annotations

import sys
from typing import ClassVar

import torch

from vlm_engine.models.quant_formats.base import GroupedWeights


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., n] -> uint8 [..., n, 32 // bits]: index i holds the field in bits [i * bits, (i + 1) *
    bits) of each word (4 or 8 bits). Read through the words' bytes (little-endian: byte k holds bits 8k .. 8k +
    7): a 4-bit field is a nibble, an 8-bit one a byte, so nothing wider than a byte is shifted or copied."""
    if sys.byteorder != "little" or words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32 on a little-endian machine, got {words.dtype}")
    as_bytes = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
    if bits == 8:
        return as_bytes.clone()  # not a view of the checkpoint's words
    if bits == 4:
        return torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).reshape(*words.shape, 8)
    raise ValueError(f"{bits}-bit fields are not unpacked here")


def grouped_weights(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    group_of_input: torch.Tensor | None = None,
) -> GroupedWeights:
    """Unsigned codes [out, in], zeros [out, groups] (uint8, code units), scales [out, groups]. Where every
    zero is the midpoint 2**(bits-1) (symmetric checkpoints) the codes are returned signed (q - midpoint,
    int8) without zeros, so the loader can use its symmetric kernels: in fp32 scales * (q - z) is the same
    number either way, since both q - z and its float are exact."""
    midpoint = 1 << (bits - 1)
    scales = scales.float().contiguous()
    if bool((zeros == midpoint).all()):
        signed = (codes.to(torch.int16) - midpoint).to(torch.int8)
        return GroupedWeights(signed, scales, None, bits, group_size, group_of_input)
    return GroupedWeights(codes, scales, zeros.float().contiguous(), bits, group_size, group_of_input)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_shapes(linear: str, tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    for component, shape in expected.items():
        if tuple(tensors[component].shape) != shape:
            raise ValueError(f"{linear}.{component}: shape {tuple(tensors[component].shape)}, expected {shape}")


class PackedLinears:
    """The naming AWQ and GPTQ share: a quantized linear is stored as its packed components (`<linear>.qweight`
    ...), its bias stays a plain tensor, and a module path holding any of `modules_to_not_convert` (vision
    tower, lm_head) is stored as is: Transformers' and vLLM's substring rule."""

    component_names: ClassVar[frozenset[str]]
    not_converted: tuple[str, ...]

    def linear_of(self, name: str) -> tuple[str, str] | None:
        linear, _, component = name.rpartition(".")
        if not linear or component not in self.component_names:
            return None
        return None if any(key in linear for key in self.not_converted) else (linear, component)

    def components(self, linear: str) -> frozenset[str]:
        return self.component_names
