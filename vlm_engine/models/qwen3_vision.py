"""Qwen3-VL's vision tower (also Qwen3-VL-MoE's, and Qwen3.5's, which has no DeepStack): a learned
position table resampled to each grid, full attention per image / video frame, LayerNorm + GELU MLP
blocks, 2-D rotary positions, the 2x2 patch merger, and DeepStack mergers on the outputs of chosen
blocks (none where the config names none).

Parameter names are those of Transformers' `Qwen3VLVisionModel`, so a checkpoint's `visual.*`
tensors load by name. In float32 every op runs as Transformers runs it, on tensors of the same
shapes, so the outputs are bit-identical (tests/test_vision_towers.py). Faster without changing a
sum: frames / images of equal length attend in ONE batched SDPA call (Transformers loops over
them); positions, RoPE tables and the resampling taps are built once per grid list (cached); the
residual adds run in place. In bfloat16 on the CPU, RoPE runs in place on the qkv output through
the fused-ops extension (products rounded to bf16 where Transformers rounds once from fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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

LN_EPS = 1e-6  # Transformers' vision LayerNorms (blocks and mergers), not read from the config

def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (2 per position) into a `side`-long table and their weights, align_corners=True:
    position i of `size` maps to i * (side - 1) / (size - 1). Each float op is Transformers' (a
    tensor divisor, as there: CPU division by a scalar may take a reciprocal)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def interpolation_taps(
    grids: tuple[tuple[int, int, int], ...], positions: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 4] rows of the side x side position table and their bilinear weights for every patch."""
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])
    h_taps, h_weights = _axis_taps(positions[:, 0], heights, side)
    w_taps, w_weights = _axis_taps(positions[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


@dataclass(frozen=True)
class _Plan:
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor
    pos_indices: torch.Tensor  # [N, 4]
    pos_weights: torch.Tensor  # [N, 4] fp32
    groups: tuple[SegmentGroup, ...]  # one segment per image / video frame


@functools.lru_cache(maxsize=16)
def _plan(grids: tuple[tuple[int, int, int], ...], merge: int, head_dim: int, theta: float, side: int) -> _Plan:
    positions = merge_block_positions(grids, merge)
    cos, sin = rope_tables(positions, head_dim, theta)
    indices, weights = interpolation_taps(grids, positions, side)
    return _Plan(cos, sin, indices, weights, group_segments([h * w for t, h, w in grids for _ in range(t)]))


class VisionMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LN_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LN_EPS)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class PatchMerger(nn.Module):
    """merge x merge patches -> one token: LayerNorm per patch (or, `postshuffle`, over the merged
    row, as the DeepStack mergers), then Linear, GELU (erf), Linear."""

    def __init__(self, hidden_size: int, out_hidden_size: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.merged_size = hidden_size * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_size if postshuffle else hidden_size, eps=LN_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_size) if self.postshuffle else x).view(-1, self.merged_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's vision encoder: pixel patches [N, C * T * P * P] and grid_thw [k, 3] ->
    (merged [N / merge**2, out_hidden_size], one [N / merge**2, out_hidden_size] DeepStack feature per
    `deepstack_visual_indexes` entry), rows in the processor's patch order."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        self.spatial_merge_size = cfg.spatial_merge_size
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.out_hidden_size = cfg.out_hidden_size
        self.rope_theta = rope_theta(cfg)
        self.num_grid_per_side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        merge = cfg.spatial_merge_size
        self.merger = PatchMerger(cfg.hidden_size, cfg.out_hidden_size, merge, postshuffle=False)
        # Qwen3.5's vision config has no such field: no DeepStack features
        self.deepstack_visual_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(
            [
                PatchMerger(cfg.hidden_size, cfg.out_hidden_size, merge, postshuffle=True)
                for _ in self.deepstack_visual_indexes
            ]
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
        plan = _plan(grids, self.spatial_merge_size, self.head_dim, self.rope_theta, self.num_grid_per_side)
        x = self.patch_embed(pixel_values)
        device, dtype = x.device, x.dtype
        weights = plan.pos_weights.to(device)
        # Transformers' resampling: the 4 taps' rows times their weights (fp32 weights promote a
        # bf16 table), summed, rounded to x's dtype, added.
        x = x + (self.pos_embed(plan.pos_indices.to(device)) * weights[:, :, None]).sum(1).to(dtype)
        fused = cpu_fused_ops(device, dtype)
        cos, sin = plan.cos.to(device), plan.sin.to(device)
        if fused is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        indexes = [None if g.index is None else g.index.to(device) for g in plan.groups]
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x.add_(block.attn(block.norm1(x), cos, sin, plan.groups, indexes, fused))  # x + ...: same bits
            x.add_(block.mlp(block.norm2(x)))
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


