"""Blocks the Qwen-VL vision towers share (qwen2_5_vl/vision.py, qwen3_vl/vision.py): the patch embedding,
the attention block and its attention within equal-length segments (windows, frames) as batched SDPA calls,
the processor's patch positions, the axial RoPE (its theta, its cos/sin tables, the exact-fp32 rotate-half),
the MLP activations by config name (SigLIP's too), and the fused-ops and flash-attention extensions for bf16
on the CPU."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.attention.flash import cu_seqlens, load_flash_attention


@dataclass(frozen=True)
class SegmentGroup:
    """`count` attention segments of `length` tokens each. `index` (the tokens, segment after
    segment) is None when they lie back to back from `start`: then they are views, not gathers."""

    length: int
    start: int
    count: int
    index: torch.Tensor | None


def group_segments(lengths: list[int]) -> tuple[SegmentGroup, ...]:
    """Segments of a packed sequence (their lengths, in order) as SDPA batches: each run of two or
    more consecutive equal-length segments is one batch of views; the segments left alone are
    gathered into one batch per length (a lone one stays a view).

    Runs, not one gather per length: a wide image's windows alternate between full tiles and the
    cut-short tile ending each tile row, and gathering the full ones (index_select of q, k and v,
    index_copy_ back) cost about as much as the per-window calls it saved (3,996 patches, bf16).
    """
    runs: list[list[int]] = []  # [length, start, count]
    offset = 0
    for length in lengths:
        if length > 0:
            if runs and runs[-1][0] == length and runs[-1][1] + runs[-1][2] * length == offset:
                runs[-1][2] += 1
            else:
                runs.append([length, offset, 1])
        offset += length
    groups = [SegmentGroup(length, start, count, None) for length, start, count in runs if count > 1]
    alone: dict[int, list[int]] = {}
    for length, start, count in runs:
        if count == 1:
            alone.setdefault(length, []).append(start)
    for length, starts in alone.items():
        index = None if len(starts) == 1 else (torch.tensor(starts)[:, None] + torch.arange(length)).flatten()
        groups.append(SegmentGroup(length, starts[0], len(starts), index))
    return tuple(groups)


def _batched(t: torch.Tensor, group: SegmentGroup, index: torch.Tensor | None) -> torch.Tensor:
    """[N, H, D] tokens -> [count, H, length, D] for SDPA (a view where the segments are contiguous)."""
    rows = t.narrow(0, group.start, group.count * group.length) if index is None else t.index_select(0, index)
    return rows.unflatten(0, (group.count, group.length)).transpose(1, 2)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: tuple[SegmentGroup, ...],
    indexes: list[torch.Tensor | None],
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention within each segment; q, k, v [N, H, D] -> [N, H * D].

    bf16 on the CPU: one call of our flash-attention kernel for all segments (a block-diagonal mask),
    reading q, k, v where they lie in the qkv output. Otherwise one SDPA call per distinct segment
    length. SDPA's CPU kernel returns [B, H, L, D] laid out as [B, L, H, D], so a single group
    covering the sequence needs no copy at all.
    """
    n, heads, dim = q.shape
    if (flash := tower_flash_attention(q)) is not None:
        bounds = segment_bounds(groups, n)
        return flash.flash_attention(q, k, v, bounds, bounds, scale).view(n, heads * dim)
    if len(groups) == 1 and indexes[0] is None and groups[0].count * groups[0].length == n:
        out = F.scaled_dot_product_attention(
            _batched(q, groups[0], None), _batched(k, groups[0], None), _batched(v, groups[0], None), scale=scale
        )
        return out.transpose(1, 2).reshape(n, heads * dim)
    out = q.new_empty(n, heads, dim)
    for group, index in zip(groups, indexes, strict=True):
        o = F.scaled_dot_product_attention(
            _batched(q, group, index), _batched(k, group, index), _batched(v, group, index), scale=scale
        ).transpose(1, 2)  # [count, length, H, D]
        if index is None:
            out.narrow(0, group.start, group.count * group.length).view_as(o).copy_(o)
        else:
            out.index_copy_(0, index, o.reshape(-1, heads, dim))
    return out.view(n, heads * dim)


def tower_flash_attention(t: torch.Tensor) -> ModuleType | None:
    """Our flash-attention extension for a tower's bf16 attention on the CPU (its fast path, as the fused
    ops: torch's bf16 SDPA ran at 50-130 GFLOP/s on the Zen 4); None for fp32, which keeps Transformers'
    SDPA bit for bit, off the CPU, and where the extension does not build."""
    if t.device.type != "cpu" or t.dtype != torch.bfloat16:
        return None
    return load_flash_attention()


def segment_bounds(groups: tuple[SegmentGroup, ...], n: int) -> torch.Tensor:
    """The int32 boundaries [0, ..., n] of the segments `group_segments` grouped (they tile [0, n) in order)."""
    spans = []
    for group in groups:
        end = group.start + group.count * group.length
        starts = range(group.start, end, group.length) if group.index is None else group.index[:: group.length].tolist()
        spans.extend((start, group.length) for start in starts)
    spans.sort()
    bounds = [0]
    for start, length in spans:
        if start != bounds[-1]:
            raise ValueError(f"attention segments leave a gap or overlap at token {start}")
        bounds.append(start + length)
    if bounds[-1] != n:
        raise ValueError(f"attention segments cover {bounds[-1]} of {n} tokens")
    return torch.tensor(bounds, dtype=torch.int32)


def merge_block_positions(grids: tuple[tuple[int, int, int], ...], merge: int) -> torch.Tensor:
    """[N, 2] (row, col) of every patch, patches in the processor's order: per frame, merge x merge
    blocks in raster order, raster order inside a block."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(h // merge, w // merge, merge, merge)
        cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, w // merge, merge, merge)
        out.append(torch.stack([rows.flatten(), cols.flatten()], dim=-1).repeat(t, 1))
    return torch.cat(out)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A vision config's `hidden_act` as Transformers' ACT2FN computes it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {name!r} (have {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def rope_theta(vision_config: Any) -> float:
    """The tower's RoPE theta: Transformers 5's `rope_parameters`, else the older `rope_theta`, else 10000."""
    rope = getattr(vision_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(vision_config, "rope_theta", 10000.0)))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] in fp32 of the axial RoPE for [N, 2] (row, col) positions: angles of the
    row axis, then the column axis, twice (the rotate-half layout). The inverse frequencies (head_dim // 4,
    shared by both axes) are Transformers' expression, computed at first use so a tower builds on meta;
    the same elementwise ops on tensors of Transformers' shapes, so even cos/sin (vectorised vs scalar
    tails) give its bits."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles = positions[..., None].float() * inv_freq  # [N, 2, head_dim // 4]
    tables = []
    for table in (angles.cos(), angles.sin()):
        axes = torch.cat([table[:, 0], table[:, 1]], dim=-1)
        tables.append(torch.cat([axes, axes], dim=-1))
    return tables[0], tables[1]


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [N, H, D] in fp32, rounded once to t's dtype (Transformers' ops, each a
    separately rounded IEEE op, so the result does not depend on layout). cos/sin: [N, D] fp32."""
    x = t.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos[:, None]) + (rotated * sin[:, None])).to(t.dtype)


def cpu_fused_ops(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The fused-ops extension for bf16 on the CPU (None elsewhere, and in fp32, which keeps
    Transformers' exact ops)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    from vlm_engine.models.fused_ops import load_fused_ops

    return load_fused_ops()


class PatchEmbed(nn.Module):
    """Patches [N, C * T * P * P] -> [N, hidden]: a Conv3d whose kernel is its stride (Qwen2.5-VL's without
    a bias, Qwen3-VL's with one)."""

    def __init__(
        self, patch_size: int, temporal_patch_size: int, in_channels: int, hidden_size: int, bias: bool
    ) -> None:
        super().__init__()
        self.patch_shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.hidden_size = hidden_size
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if weight.dtype == torch.float32:  # the conv itself: Transformers' sums, bit for bit
            return self.proj(pixels.view(-1, *self.patch_shape).to(weight.dtype)).view(-1, self.hidden_size)
        # Kernel = stride: one output per patch, i.e. a matmul with the flattened kernel. In bf16
        # oneDNN's conv took 324 ms for 3,996 patches (Qwen2.5-VL-3B's 1280 x 1176 kernel), the
        # matmul 71 ms (2-core Zen 4).
        return F.linear(pixels.reshape(-1, weight[0].numel()).to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: tuple[SegmentGroup, ...],
        indexes: list[torch.Tensor | None],
        fused: ModuleType | None,
    ) -> torch.Tensor:
        attended = rotary_segment_attention(self.qkv(x), self.num_heads, cos, sin, groups, indexes, self.scale, fused)
        return self.proj(attended)


def rotary_segment_attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    groups: tuple[SegmentGroup, ...],
    indexes: list[torch.Tensor | None],
    scale: float,
    fused: ModuleType | None,
) -> torch.Tensor:
    """A fused q/k/v projection's output [N, 3 * hidden] -> [N, hidden]: q and k rotated by the 2-D RoPE, then
    attention within each segment (`segment_attention`); the towers' attention blocks differ only in their
    projections' names (VisionAttention, PaddleOCR-VL's RotaryPackedAttention)."""
    n = qkv.shape[0]
    q, k, v = qkv.view(n, 3, num_heads, -1).unbind(1)
    if fused is not None:  # in place on the qkv output, cos/sin already in its dtype
        fused.rotary_(q, k, cos, sin)
    else:
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return segment_attention(q, k, v, groups, indexes, scale)


# The name under which `register_transformers_tower_attention` puts `transformers_tower_attention` in Transformers'
# attention (and mask) interfaces, for a tower module of theirs that a family reuses.
TRANSFORMERS_TOWER_ATTENTION = "vlm_engine_tower"  # no "flash" in it: Transformers takes such a name for a hub kernel


def transformers_tower_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-interface signature ([B, H, L, D] in, [B, L, H, D] out) over our flash kernel for a
    bidirectional tower whose images are padded at their ends (Gemma 4's: each image's patches, then padding
    the key mask hides). One kernel call for the batch: each image's queries, all L of them as SDPA computes
    them, see its unpadded keys. fp32, off the CPU, without the extension, for a causal module or with any
    other mask it is Transformers' SDPA function itself (exact numerics stay bit for bit)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bidirectional = getattr(module, "is_causal", True) is False  # as SDPA's function reads it
    flash = tower_flash_attention(query) if bidirectional and not dropout else None
    lengths = None if flash is None else _KEY_LENGTHS.of(attention_mask, key.shape[0], key.shape[2])
    if flash is None or lengths is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    batch, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)  # a view: Transformers transposed [B, L, H, D]
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], dim)
    if any(n != length for n in lengths):  # padded images: their keys gathered back to back
        kv_index = torch.cat([torch.arange(n) + b * length for b, n in enumerate(lengths)])
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    scale = scaling if scaling is not None else dim**-0.5
    out = flash.flash_attention(q, k, v, cu_seqlens([length] * batch), cu_seqlens(lengths), scale)
    return out.view(batch, length, heads, dim), None


def _unpadded_key_lengths(mask: torch.Tensor, batch: int, length: int) -> list[int] | None:
    """Per image the number of keys the mask lets every query see, where it is a prefix (padding at the end)
    and the same for every query; None for any other mask."""
    if mask.dim() != 4 or mask.shape[-1] != length:
        return None
    visible = mask if mask.dtype == torch.bool else mask == 0
    rows = visible.expand(batch, 1, visible.shape[2], length)[:, 0]
    first = rows[:, 0, :]
    counts = first.sum(dim=-1)
    prefix = torch.arange(length) < counts[:, None]
    if not bool((first == prefix).all()) or not bool((rows == first[:, None, :]).all()) or bool((counts == 0).any()):
        return None
    return [int(c) for c in counts]


class _KeyLengthsMemo:
    """`_unpadded_key_lengths` of the mask last seen: every layer of a tower forward passes the same mask tensor,
    and scanning a [B, 1, L, L] mask costs tens of milliseconds at L in the thousands, once is enough. Keyed by a
    weak reference, so a new mask at the same address is never mistaken for the old one. One tuple, read and
    replaced whole (each an atomic step), so concurrent towers at worst scan a mask twice."""

    def __init__(self) -> None:
        self._last: tuple[weakref.ref[torch.Tensor], int, int, list[int] | None] | None = None

    def of(self, mask: torch.Tensor | None, batch: int, length: int) -> list[int] | None:
        if mask is None:
            return [length] * batch
        last = self._last
        if last is not None and last[0]() is mask and last[1:3] == (batch, length):
            return last[3]
        lengths = _unpadded_key_lengths(mask, batch, length)
        self._last = (weakref.ref(mask), batch, length, lengths)
        return lengths


_KEY_LENGTHS = _KeyLengthsMemo()


def register_transformers_tower_attention() -> str:
    """`transformers_tower_attention` in Transformers' interfaces (its mask built as for SDPA); returns the name
    to set as a tower config's `_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TRANSFORMERS_TOWER_ATTENTION, transformers_tower_attention)
    AttentionMaskInterface.register(TRANSFORMERS_TOWER_ATTENTION, sdpa_mask)
    return TRANSFORMERS_TOWER_ATTENTION
