"""The Pixtral vision tower (Mistral 3, LightOnOCR): images at their own resolution, each a grid of
patches; a patch convolution without bias, an RMSNorm (`ln_pre`), pre-norm layers (RMSNorm, attention
without biases under a 2-D axial RoPE, a gated MLP) and no final norm.

    tower = PixtralVisionTower(vision_config)
    features = tower(images [[1, C, H, W], ...], feature_layers=(-1,))  # [sum of patches, hidden * len(layers)]

Several images go through in one pass as one packed sequence of their patches; an image's patches
attend only to each other (Transformers' block-diagonal mask), here as attention within each image's
segment (`vision_blocks.segment_attention`: per-length SDPA batches in fp32, our flash kernel in bf16).

The RoPE differs from the Qwen towers' (`vision_blocks.rope_tables`): the inverse frequencies are those
of the whole head dim, the even-indexed ones turning with the patch's row and the odd-indexed ones with
its column (Transformers' `PixtralVisionRotaryEmbedding`).

Parameter names are Transformers' (`patch_conv`, `ln_pre`, `transformer.layers.N.{attention_norm,
attention.{q,k,v,o}_proj, ffn_norm, feed_forward.{gate,up,down}_proj}`); q/k/v and gate/up are
MergedLinears the loader fills shard by shard.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.layers import MergedLinear, RMSNorm
from vlm_engine.models.vision_blocks import activation, group_segments, rope_theta, rotate, segment_attention

PIXTRAL_NORM_EPS = 1e-5  # Transformers' Pixtral hard-codes its norms' epsilon


@functools.lru_cache(maxsize=64)
def grid_positions(rows: int, cols: int) -> torch.Tensor:
    """[rows * cols, 2] (row, col) of an image's patches in raster order."""
    with torch.device("cpu"):
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        return torch.stack([r.flatten(), c.flatten()], dim=-1)


def pixtral_rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] in fp32 for [N, 2] (row, col) positions: rows turn the even-indexed inverse
    frequencies of the head dim, columns the odd-indexed ones; the two halves are repeated (rotate-half).
    The same elementwise ops as Transformers, so the same bits."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    inv_freq = torch.cat([inv_freq[0::2], inv_freq[1::2]])
    # Transformers' shapes ([N, 2, head_dim / 2]) for cos and sin: vectorised and scalar tails may differ
    angles = positions[..., None].float() * inv_freq
    quarter = head_dim // 4
    cos, sin = (torch.cat([t[:, 0, :quarter], t[:, 1, quarter:]], dim=-1) for t in (angles.cos(), angles.sin()))
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class PixtralAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        shards = {"q_proj": hidden_size, "k_proj": hidden_size, "v_proj": hidden_size}
        self.qkv_proj = MergedLinear(hidden_size, shards, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = group_segments(segments)
        return self.o_proj(segment_attention(q, k, v, groups, [g.index for g in groups], self.scale))


class PixtralMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = MergedLinear(hidden_size, shards, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PixtralLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        self.attention = PixtralAttention(config.hidden_size, config.num_attention_heads)
        self.ffn_norm = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        self.feed_forward = PixtralMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionTower(nn.Module):
    """Images, each [1, C, H, W] with H and W multiples of the patch size -> the packed patch features
    of the chosen hidden states, images one after another, patches in raster order."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.head_dim = int(config.hidden_size) // int(config.num_attention_heads)
        self.theta = rope_theta(config)
        self.patch_conv = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=self.patch_size, stride=self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(config.hidden_size, PIXTRAL_NORM_EPS)
        # Transformers' `transformer.layers.N` names, without a class of its own
        self.transformer = nn.ModuleDict(
            {"layers": nn.ModuleList(PixtralLayer(config) for _ in range(config.num_hidden_layers))}
        )

    def embed_patches(self, image: torch.Tensor) -> torch.Tensor:
        """[1, C, H, W] -> [(H / p) * (W / p), hidden]."""
        weight = self.patch_conv.weight
        image = image.to(weight.dtype)
        if weight.dtype == torch.float32:  # the conv itself: Transformers' sums
            return self.patch_conv(image).flatten(2)[0].t()
        # kernel = stride: one GEMM over the unfolded patches (oneDNN's bf16 conv is several times slower)
        p, (_, c, h, w) = self.patch_size, image.shape
        patches = image.view(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), -1)
        return F.linear(patches, weight.flatten(1))

    def forward(self, images: Sequence[torch.Tensor], feature_layers: Sequence[int] = (-1,)) -> torch.Tensor:
        """`feature_layers` index the hidden states as Transformers' `hidden_states` does: 0 is `ln_pre`'s
        output, i the output of layer i, negative from the end; several are concatenated along features."""
        count = len(self.transformer["layers"]) + 1
        chosen = [i % count for i in feature_layers]
        x = self.ln_pre(torch.cat([self.embed_patches(image) for image in images]))
        grids = [(image.shape[-2] // self.patch_size, image.shape[-1] // self.patch_size) for image in images]
        positions = torch.cat([grid_positions(r, c) for r, c in grids]).to(x.device)
        cos, sin = pixtral_rope_tables(positions, self.head_dim, self.theta)
        segments = [r * c for r, c in grids]
        states = {0: x}
        for index, layer in enumerate(self.transformer["layers"][: max(chosen)], start=1):
            x = layer(x, cos, sin, segments)
            states[index] = x
        return torch.cat([states[i] for i in chosen], dim=-1) if len(chosen) > 1 else states[chosen[0]]
