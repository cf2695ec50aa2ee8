"""PaddleOCR-VL's vision side: a SigLIP-shaped NaViT encoder over packed images of any size, and the
projector that merges 2x2 patches into one decoder token.

The encoder is SigLIP's layers (`models/siglip.py`: q/k/v, out_proj, LayerNorms, the gelu_pytorch_tanh
MLP, under Transformers' names) run on a packed sequence: each image attends only to itself, q and k carry
2-D rotary positions (row, col) of the raster patch order, and the learned 27 x 27 position table
(`image_size / patch_size` a side) is resampled to each image's grid by bilinear interpolation with
half-pixel centres (F.interpolate's align_corners=False, border padding), as Transformers'
`PaddleOCRVisionEmbeddings` does. Patches arrive in raster order (the processor does not group them by
merge block); the projector groups them.

Float32 runs Transformers' ops on tensors of its shapes (the conv, the fp32 rotate-half, one SDPA per
image length), so the tower's outputs equal Transformers'; bf16 on the CPU takes the shared fast paths
(vision_blocks: the patch GEMM, the fused rotary, our flash attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.siglip import SiglipAttention, SiglipMLP
from vlm_engine.models.vision_blocks import (
    SegmentGroup,
    cpu_fused_ops,
    group_segments,
    merge_block_positions,
    rope_tables,
    rope_theta,
    rotary_segment_attention,
)

Grids = tuple[tuple[int, int, int], ...]
PROJECTOR_LN_EPS = 1e-5  # Transformers' PaddleOCRProjector.pre_norm, not read from the config


def half_pixel_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2 bilinear taps into a `side`-long table of target position `index` on an axis of `size`
    (half-pixel centres, taps clamped to the border) and their weights, in Transformers' float ops."""
    src = (index.float() + 0.5) * side / size - 0.5
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@dataclass(frozen=True)
class EncoderPlan:
    """What the encoder computes once per list of grids (cached): RoPE tables, resampling taps, segments."""

    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor
    pos_indices: torch.Tensor  # [N, 4] rows of the position table
    pos_weights: torch.Tensor  # [N, 4] fp32
    groups: tuple[SegmentGroup, ...]  # one attention segment per image (frame)


@functools.lru_cache(maxsize=16)
def encoder_plan(grids: Grids, head_dim: int, theta: float, side: int) -> EncoderPlan:
    positions = merge_block_positions(grids, 1)  # merge 1: (row, col) in raster order
    cos, sin = rope_tables(positions, head_dim, theta)
    counts = [t * h * w for t, h, w in grids]
    heights = torch.repeat_interleave(torch.tensor([h for _, h, _ in grids]), torch.tensor(counts))
    widths = torch.repeat_interleave(torch.tensor([w for _, _, w in grids]), torch.tensor(counts))
    h_taps, h_weights = half_pixel_taps(positions[:, 0], heights, side)
    w_taps, w_weights = half_pixel_taps(positions[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return EncoderPlan(cos, sin, indices, weights, group_segments([h * w for t, h, w in grids for _ in range(t)]))


class NaViTEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.side = int(config.image_size) // self.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=self.patch_size, stride=self.patch_size
        )
        self.position_embedding = nn.Embedding(self.side * self.side, config.hidden_size)

    def forward(self, patches: torch.Tensor, plan: EncoderPlan) -> torch.Tensor:
        """[N, C, P, P] patches -> [N, hidden], resampled positions added."""
        weight = self.patch_embedding.weight
        patches = patches.to(weight.dtype)
        if weight.dtype == torch.float32:  # the conv itself: Transformers' sums
            x = self.patch_embedding(patches).flatten(1)
        else:  # kernel = stride: a GEMM over the flattened patches (vision_blocks.PatchEmbed says why)
            x = F.linear(patches.flatten(1), weight.flatten(1), self.patch_embedding.bias)
        weights = plan.pos_weights.to(x.device)
        rows = self.position_embedding(plan.pos_indices.to(x.device)) * weights[:, :, None]
        return x + rows.sum(1).to(x.dtype)


class RotaryPackedAttention(SiglipAttention):
    """SigLIP's attention (its q/k/v shards and out_proj) over packed images, q and k rotated by 2-D RoPE."""

    def forward_packed(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: tuple[SegmentGroup, ...],
        indexes: list[torch.Tensor | None],
        fused: Any,
    ) -> torch.Tensor:
        attended = rotary_segment_attention(
            self.qkv_proj(x), self.num_heads, cos, sin, groups, indexes, self.scale, fused
        )
        return self.out_proj(attended)


class NaViTEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = RotaryPackedAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class NaViTEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NaViTEncoderLayer(config) for _ in range(config.num_hidden_layers))


class NaViTVisionModel(nn.Module):
    """Packed patches [N, C, P, P] and grid_thw [k, 3] -> [N, hidden] post-normed features, raster order."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.rope_theta = rope_theta(config)
        self.embeddings = NaViTEmbeddings(config)
        self.encoder = NaViTEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, patches: torch.Tensor, grids: Grids) -> torch.Tensor:
        plan = encoder_plan(grids, self.head_dim, self.rope_theta, self.embeddings.side)
        x = self.embeddings(patches, plan)
        device, dtype = x.device, x.dtype
        fused = cpu_fused_ops(device, dtype)
        cos, sin = plan.cos.to(device), plan.sin.to(device)
        if fused is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        indexes = [None if g.index is None else g.index.to(device) for g in plan.groups]
        for layer in self.encoder.layers:
            x = x + layer.self_attn.forward_packed(layer.layer_norm1(x), cos, sin, plan.groups, indexes, fused)
            x = x + layer.mlp(layer.layer_norm2(x))
        return self.post_layernorm(x)


class NaViTVisionTower(nn.Module):
    """Transformers' `PaddleOCRVisionModel` wrapper level: the encoder sits under `vision_model`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_model = NaViTVisionModel(config)

    def forward(self, patches: torch.Tensor, grids: Grids) -> torch.Tensor:
        out: torch.Tensor = self.vision_model(patches, grids)
        return out


class MergeProjector(nn.Module):
    """LayerNorm per patch, then each merge x merge block of an image's raster grid -> one row
    (block rows in raster order, the block's patches row by row), Linear, GELU (erf), Linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        merged = vision_hidden * merge * merge
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=PROJECTOR_LN_EPS)
        self.linear_1 = nn.Linear(merged, merged)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(merged, text_hidden)

    def forward(self, features: torch.Tensor, grids: Grids) -> torch.Tensor:
        """Image by image, as Transformers: one product over all images' rows sums in another order
        (fp32 GEMMs of other row counts differ in the last bits)."""
        m, d = self.merge, features.shape[-1]
        out = []
        for item, (t, h, w) in zip(features.split([t * h * w for t, h, w in grids]), grids):
            x = self.pre_norm(item).reshape(t, h // m, m, w // m, m, d).transpose(2, 3).reshape(-1, m * m * d)
            out.append(self.linear_2(self.act(self.linear_1(x))))
        return torch.cat(out)
