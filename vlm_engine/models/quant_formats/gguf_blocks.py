"""A GGUF file's quantized linears as `GroupedWeights` our int4 / int8 panels take (fast numerics): llama.cpp's
blocks read from their bytes (ggml-quants.c's `block_q4_0` ... `block_q6_K`, as gguf-py's quants.py unpacks them).

Our panels are llama.cpp's own Q4_1 and Q8_0 blocks (32 inputs, fp16 d and for int4 an fp16 minimum m: w = d * q
+ m), so each GGML type maps onto them as follows:

- Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m): int4, exactly.
- Q4_K: 8 sub-blocks of 32 per super-block of 256, w = (d * sc) * q - dmin * mn with 6-bit sc and mn: int4 with the
  block's d' = d * sc and m' = -dmin * mn rounded to fp16 (their products are exact in fp32; fp16 keeps 11
  significant bits, so a weight moves by at most 2^-11 * (15 |d'| + |m'|): fast numerics' tolerance).
- Q8_0 (w = d * q): int8, exactly; Q5_0 (w = d * (q - 16)): int8 with signed codes q - 16, exactly.
- Everything else (Q5_1, Q5_K and Q6_K, whose minimum or 16-input scales our int8 blocks do not hold: the int8
  kernels apply no minimum; Q2_K, Q3_K, IQ*, ...): the tensor's values, dequantized by gguf-py (1024 rows' fp32
  at a time), re-rounded per block of 32 to Q8_0 (`round_to_q8_0`), logged once per type.

The LM head is int8 whatever its type (our rule, as llama.cpp's Q4 files keep the output projection in Q6_K /
Q8_0); embedding tables, norms and F32 / F16 / BF16 tensors stay dense as gguf-py dequantizes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlm_engine.models.quant_formats.base import ActivationQuantization, GroupedWeights

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per block of our panels (and of every GGML type's smallest scale group but Q6_K's)
SUPER_BLOCK = 256  # the K-quants' super-block
DENSE_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
EXACT_INT4 = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # Q4_K: exact codes, its scales rounded to fp16
EXACT_INT8 = frozenset({"Q8_0", "Q5_0"})
_REROUNDED: set[str] = set()  # the types a re-rounding was logged for


@dataclass(frozen=True)
class GGUFCodes:
    """A quantized GGUF served from its codes: the `CheckpointFormat` the loader's pre-quantized path takes
    (the GGUF iterators hand it `GroupedWeights` themselves, so no checkpoint tensor is a component)."""

    name: str  # "GGUF Q4_K_M": the file's type, for the log
    activations: ActivationQuantization | None = None

    def linear_of(self, name: str) -> tuple[str, str] | None:
        return None

    def components(self, linear: str) -> frozenset[str]:
        return frozenset()

    def unpack(self, linear: str, tensors: dict[str, torch.Tensor]) -> GroupedWeights:
        raise NotImplementedError("GGUF linears arrive as GroupedWeights (gguf_blocks.grouped_of)")


def quantized_format(reader: Any) -> GGUFCodes | None:
    """A GGUF file's (gguf-py's reader) format where any of its 2-D tensors is quantized (not F32 / F16 / BF16), else None."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    if types <= DENSE_TYPES:
        return None
    file_type = reader.fields.get("general.file_type")
    if file_type is not None:
        from gguf import LlamaFileType

        try:
            return GGUFCodes(f"GGUF {LlamaFileType(int(file_type.contents())).name.removeprefix('MOSTLY_')}")
        except ValueError:
            pass
    return GGUFCodes(f"GGUF {'/'.join(sorted(types - DENSE_TYPES))}")


def serves_from_codes(name: str, dims: int) -> bool:
    """Whether a checkpoint tensor (Transformers' name) is a linear of the text decoder or the LM head: what our
    panels hold (vision towers, embeddings and norms stay dense, as `quantized.Quantization` leaves them)."""
    if dims != 2 or not name.endswith(".weight"):
        return False
    return name == "lm_head.weight" or (".layers." in name and not name.startswith(("visual.", "model.vision")))


def grouped_of(
    type_name: str, data: np.ndarray, shape: tuple[int, int], lm_head: bool = False
) -> GroupedWeights | None:
    """One GGUF tensor's bytes ([rows, bytes per row] as gguf-py's reader gives them) of [out, in] = `shape`
    weights as our panels' GroupedWeights; None for a dense type (F32 / F16 / BF16: the caller dequantizes).
    `lm_head`: 8 bits whatever the type."""
    if type_name in DENSE_TYPES:
        return None
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    out, inputs = shape
    if inputs % BLOCK:
        raise ValueError(f"a {type_name} tensor of {inputs} inputs: not a multiple of {BLOCK}")
    if type_name in EXACT_INT8 or (type_name in EXACT_INT4 and not lm_head):
        return _UNPACK[type_name](blocks, out, inputs)
    level = logging.DEBUG if type_name in _REROUNDED else logging.INFO  # once per type at INFO, not per tensor
    _REROUNDED.add(type_name)
    why = "the LM head is int8" if lm_head else "our panels do not hold its blocks"
    logger.log(level, "%s [%d x %d]: %s: re-rounded to int8 (Q8_0, blocks of 32) from its fp32 values",
               type_name, out, inputs, why)  # fmt: skip
    return _rerounded(type_name, data, shape)


def _rerounded(type_name: str, data: np.ndarray, shape: tuple[int, int], rows: int = 1024) -> GroupedWeights:
    """`round_to_q8_0` of gguf-py's values, `rows` output rows at a time: a 7B's Q6_K LM head (545M weights) never
    has its 2.2 GB of fp32 values, let alone the rounding's temporaries, in memory at once."""
    out, inputs = shape
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(out, -1)
    codes = torch.empty(out, inputs, dtype=torch.int8)
    scales = torch.empty(out, inputs // BLOCK)
    for start in range(0, out, rows):
        end = min(out, start + rows)
        part = round_to_q8_0(dequantized(type_name, blocks[start:end], (end - start, inputs)))
        codes[start:end], scales[start:end] = part.codes, part.scales
    return GroupedWeights(codes, scales, None, 8, BLOCK)


def dequantized(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """gguf-py's fp32 values of one tensor, [out, in]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def round_to_q8_0(weight: torch.Tensor) -> GroupedWeights:
    """llama.cpp's quantize_row_q8_0_ref on fp32 [out, in]: per block of 32, d = amax / 127 (kept as fp16, as
    the block stores it), q = round(w / d) half away from zero."""
    out, inputs = weight.shape
    blocks = weight.float().reshape(out, inputs // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse[..., None]
    codes = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return GroupedWeights(codes.reshape(out, inputs), d.half().float(), None, 8, BLOCK)


def permute_rows(grouped: GroupedWeights, order: torch.Tensor) -> GroupedWeights:
    """The same weights with output row i taken from row order[i] (llama.cpp's RoPE row order undone)."""

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, order)

    return GroupedWeights(
        grouped.codes.index_select(0, order), grouped.scales.index_select(0, order), rows(grouped.zeros),
        grouped.bits, grouped.group_size, grouped.group_of_input, rows(grouped.offsets),
    )  # fmt: skip


# ---- the block layouts (ggml-common.h; gguf-py quants.py unpacks them the same way) -------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks] fp32 of the stored fp16."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of 32 4-bit codes (element j in the low nibble of byte j, 16 + j in the high one) -> [n, 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian uint32 whose bit j is element j's fifth bit -> [n, 32] of 0 / 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _grouped(
    codes: np.ndarray, scales: np.ndarray, out: int, inputs: int, bits: int, zero: float | None, offsets: Any = None
) -> GroupedWeights:
    groups = inputs // BLOCK
    scale = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)).reshape(out, groups)
    zeros = None if zero is None else torch.full_like(scale, zero)
    extra = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32))
    return GroupedWeights(
        torch.from_numpy(np.ascontiguousarray(codes)).reshape(out, inputs), scale, zeros, bits, BLOCK, None,
        None if extra is None else extra.reshape(out, groups),
    )  # fmt: skip


def _q4_0(raw: np.ndarray, out: int, inputs: int) -> GroupedWeights:
    blocks = raw.reshape(-1, 18)  # d, 16 bytes of codes
    return _grouped(_nibbles(blocks[:, 2:]), _f16(blocks[:, :2]), out, inputs, 4, 8.0)


def _q4_1(raw: np.ndarray, out: int, inputs: int) -> GroupedWeights:
    blocks = raw.reshape(-1, 20)  # d, m, 16 bytes of codes
    return _grouped(_nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), out, inputs, 4, 0.0, _f16(blocks[:, 2:4]))


def _q5_0(raw: np.ndarray, out: int, inputs: int) -> GroupedWeights:
    blocks = raw.reshape(-1, 22)  # d, qh (fifth bits), 16 bytes of low nibbles
    codes = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return _grouped(codes, _f16(blocks[:, :2]), out, inputs, 8, None)


def _q8_0(raw: np.ndarray, out: int, inputs: int) -> GroupedWeights:
    blocks = raw.reshape(-1, 34)  # d, 32 int8 codes
    return _grouped(blocks[:, 2:].view(np.int8), _f16(blocks[:, :2]), out, inputs, 8, None)


def _q4_k(raw: np.ndarray, out: int, inputs: int) -> GroupedWeights:
    """block_q4_K: d, dmin, 12 bytes of 6-bit (sc, mn) pairs, 128 bytes: sub-blocks 2c and 2c + 1 in the low and
    high nibbles of bytes 32c .. 32c + 31."""
    blocks = raw.reshape(-1, 144)
    d, dmin = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(-1, 8 * 32)
    # The products as gguf-py forms them (fp32): exactly its values in GroupedWeights.dequantize.
    return _grouped(codes, d * sc.astype(np.float32), out, inputs, 4, 0.0, -(dmin * mn.astype(np.float32)))


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4: 8 6-bit scales and mins per super-block from 12 bytes."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k}
