"""Qwen2.5-VL's vision tower: window attention over 2x2-merged patch groups, full attention in a few
blocks, RMSNorm + gated MLP, 2-D rotary positions; the merger's output in the original patch order.

Parameter names are those of Transformers' `Qwen2_5_VisionTransformerPretrainedModel`, so a
checkpoint's `visual.*` tensors load by name. In float32 every op runs as Transformers runs it, in
the same order and on tensors of the same shapes, so the output is bit-identical
(tests/test_vision_towers.py); the speed comes from what does not change a single sum:

- Attention segments of equal length (the windows, or the images / frames of a full-attention
  block) run as batched SDPA calls (`group_segments`) instead of Transformers' Python loop of one
  call per window. Each (segment, head) is computed by the same CPU flash-attention kernel either
  way, so the results are the same bits. Padding unequal windows to one length with a mask would
  change the kernel's softmax sums (vectorised tails), so windows are batched by length instead.
  One windowed block's attention on a 1024x768 image (3,996 patches, 70 windows), 2-core Zen 4,
  min of 15: bf16 53 -> 35 ms, fp32 66 -> 44 ms.
- Window order, its inverse, positions and RoPE tables are built once per grid list (cached).

In bfloat16 on the CPU (the engine's default there) attention, windows and full blocks alike, is one
call of our flash-attention kernel over all segments (`vlm_engine.attention.flash`, a block-diagonal
mask; vision_blocks.segment_attention), and the element-wise work goes through the fused ops extension (`vlm_engine.models.fused_ops`): RMSNorm fused with the residual add, RoPE in place
on the qkv output, in-place SiLU-and-mul, and the patch embedding is a matmul rather than a conv.
Transformers rounds the same way except that its RoPE and norms round once from fp32 where these
round products to bf16 first: both stay within bf16's own error of the fp32 model (the test's bound).

What remains is the linears, at the bf16 matmul ceiling (prepacked by the engine, `models/prepack.py`).
Where the time goes (`benchmarks/inproc.py vision --threads 1 --cpu-time --split`, 448x448 = 1,024 patches,
one thread's CPU time, Zen 5 avx512_bf16, issue 49): 3,202 ms = linears 2,801 (88%: qkv 691, proj 240,
gate / up / down 622 / 625 / 622; 1.29 TFLOP at ~460 GFLOP/s, what oneDNN does on these shapes alone) + RoPE and flash
attention 259 (28 window blocks, 4 full) + SiLU-and-up 62 + merger 42 + norms and window reorder 31 +
patch embedding 7. Transformers' bf16 tower runs the same linears on the same oneDNN kernels (aten::addmm),
so the linears alone are ~0.7x of its time at 448x448, whatever the rest costs. Full attention at 3,996
patches was the other big part: torch SDPA's bf16 kernel ran at ~50 GFLOP/s on this CPU, 1.4 s per full
block; our kernel, 1 thread: 2.2 -> 0.67 s at 3,888 patches (issue 49). Before that kernel,
benchmarks/inproc.py vision, Qwen2.5-VL-3B's tower cut to 8 blocks, bf16, 2-core Zen 4
shared with other jobs, min of 5 runs, ms (Transformers / ours / ours with prepacked linears):
448x448 6116 / 2776 / 2364, 1024x768 10352 / 9386 / 8808.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.layers import RMSNorm
from vlm_engine.models.vision_blocks import (
    PatchEmbed,
    SegmentGroup,
    VisionAttention,
    activation,
    cpu_fused_ops,
    group_segments,
    merge_block_positions,
    rope_tables,
    rope_theta,
)

RMS_EPS = 1e-6  # Transformers' Qwen2_5_VLRMSNorm in the vision tower (not read from the config)

# --------------------------------------------------------------------------------------------
# Window order and the plan, per grid list


def window_order(grids: tuple[tuple[int, int, int], ...], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The order in which merged patch groups enter the blocks, and the window lengths in patches.

    Per image and frame, the merged grid is cut into `window` x `window` tiles (the last row and
    column of tiles cut short); tiles run in raster order, groups in raster order inside a tile.
    A stable sort by tile number of the raster-ordered groups gives exactly that order.
    """
    order, lengths, offset = [], [], 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        tiles_h, tiles_w = -(-gh // window), -(-gw // window)
        tile_row = (torch.arange(gh) // window)[:, None]
        tile_col = (torch.arange(gw) // window)[None, :]
        tile = (tile_row * tiles_w + tile_col).flatten()  # [gh * gw]
        frame_tiles = torch.arange(t)[:, None] * (tiles_h * tiles_w) + tile  # [t, gh * gw]
        order.append(torch.sort(frame_tiles.flatten(), stable=True).indices + offset)
        counts = torch.bincount(frame_tiles.flatten(), minlength=t * tiles_h * tiles_w)
        lengths.extend((counts * unit).tolist())
        offset += t * gh * gw
    return torch.cat(order), lengths


@dataclass(frozen=True)
class _Plan:
    """Everything a forward needs that depends on the grids only (CPU tensors)."""

    token_order: torch.Tensor  # [N]: window order of the patches
    merged_inverse: torch.Tensor  # [N / unit]: merged rows back to the original order
    cos: torch.Tensor  # [N, head_dim] fp32, in window order
    sin: torch.Tensor
    window_groups: tuple[SegmentGroup, ...]
    full_groups: tuple[SegmentGroup, ...]


@functools.lru_cache(maxsize=16)
def _plan(grids: tuple[tuple[int, int, int], ...], merge: int, window: int, head_dim: int, theta: float) -> _Plan:
    unit = merge * merge
    group_order, window_lengths = window_order(grids, merge, window)
    token_order = (group_order[:, None] * unit + torch.arange(unit)).flatten()
    merged_inverse = torch.empty_like(group_order)
    merged_inverse[group_order] = torch.arange(group_order.numel())
    cos, sin = rope_tables(merge_block_positions(grids, merge), head_dim, theta)
    # Frames stay contiguous in window order, so full attention is per frame in either order.
    frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
    return _Plan(
        token_order=token_order,
        merged_inverse=merged_inverse,
        cos=cos[token_order],
        sin=sin[token_order],
        window_groups=group_segments(window_lengths),
        full_groups=group_segments(frame_lengths),
    )


# --------------------------------------------------------------------------------------------
# Modules (names as Transformers')


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.hidden_act = hidden_act
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        # In place (no [N, I] temporaries); the same element-wise ops as act(gate) * up.
        gate = F.silu(gate, inplace=True) if self.hidden_act in ("silu", "swish") else self.act(gate)
        return self.down_proj(gate.mul_(self.up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, RMS_EPS)
        self.norm2 = RMSNorm(config.hidden_size, RMS_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class PatchMerger(nn.Module):
    def __init__(self, hidden_size: int, out_hidden_size: int, merge: int) -> None:
        super().__init__()
        self.merged_size = hidden_size * merge * merge
        self.ln_q = RMSNorm(hidden_size, RMS_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size), nn.GELU(), nn.Linear(self.merged_size, out_hidden_size)
        )

    def project(self, normed: torch.Tensor) -> torch.Tensor:
        """The MLP on ln_q's output ([N, hidden] -> [N / merge**2, out])."""
        return self.mlp(normed.reshape(-1, self.merged_size))


class Qwen25VisionTower(nn.Module):
    """Qwen2.5-VL's vision encoder: pixel patches [N, C * T * P * P] and grid_thw [k, 3] -> merged
    features [N / merge**2, out_hidden_size], in the processor's patch order."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.spatial_merge_size = cfg.spatial_merge_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.out_hidden_size = cfg.out_hidden_size
        # Window side in merged groups: 112 px / 14 px per patch / 2 patches per group = 4.
        self.window_groups = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.fullatt_block_indexes = frozenset(cfg.fullatt_block_indexes)
        self.rope_theta = rope_theta(cfg)
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
        plan = _plan(grids, self.spatial_merge_size, self.window_groups, self.head_dim, self.rope_theta)
        x = self.patch_embed(pixel_values)
        device, dtype = x.device, x.dtype
        fused = cpu_fused_ops(device, dtype)
        x = x.index_select(0, plan.token_order.to(device))
        cos, sin = plan.cos.to(device), plan.sin.to(device)
        if fused is not None:  # the fused RoPE takes tables in the activations' dtype
            cos, sin = cos.to(dtype), sin.to(dtype)
        window = (plan.window_groups, [_on(g.index, device) for g in plan.window_groups])
        full = (plan.full_groups, [_on(g.index, device) for g in plan.full_groups])
        if fused is None:
            for i, block in enumerate(self.blocks):
                groups, indexes = full if i in self.fullatt_block_indexes else window
                x = x + block.attn(block.norm1(x), cos, sin, groups, indexes, None)
                x = x + block.mlp(block.norm2(x))
            merged = self.merger.project(self.merger.ln_q(x))
        else:
            merged = self._forward_fused(x, cos, sin, window, full, fused)
        return merged.index_select(0, plan.merged_inverse.to(device))

    def _forward_fused(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        window: tuple[tuple[SegmentGroup, ...], list[torch.Tensor | None]],
        full: tuple[tuple[SegmentGroup, ...], list[torch.Tensor | None]],
        fused: ModuleType,
    ) -> torch.Tensor:
        """bf16 on the CPU: each residual add fused with the RMSNorm after it (the next block's
        norm1, or the merger's ln_q after the last block), all in place on x and the residual."""
        residual = x
        normed = fused.rms_norm(residual, self.blocks[0].norm1.weight, RMS_EPS)
        for i, block in enumerate(self.blocks):
            groups, indexes = full if i in self.fullatt_block_indexes else window
            out = block.attn(normed, cos, sin, groups, indexes, fused)
            normed = fused.add_rms_norm_(out, residual, block.norm2.weight, RMS_EPS)
            out = block.mlp(normed)
            nxt = self.blocks[i + 1].norm1 if i + 1 < len(self.blocks) else self.merger.ln_q
            normed = fused.add_rms_norm_(out, residual, nxt.weight, RMS_EPS)
        return self.merger.project(normed)


def _on(index: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if index is None else index.to(device)


