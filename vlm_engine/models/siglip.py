"""The SigLIP vision tower that several families put in front of their decoder (Gemma 3's, SmolVLM's and
Idefics3's): a patch embedding (a Conv2d whose kernel is its stride), a learned position table, pre-norm
encoder layers (LayerNorm, attention with biases, a gelu_pytorch_tanh MLP) and a post-LayerNorm.

    tower = SiglipVisionTower(vision_config, positions="fixed" | "bucketed")
    features = tower(pixel_values [B, C, H, W], patch_mask [B, H / p, W / p] bool | None)  # [B, N, hidden]

The variants are configuration:
- "fixed" (plain SigLIP, `SiglipVisionConfig`; Gemma 3 with `vision_use_head=False`, 896 px, patch 14):
  every image is `image_size` square and patch i takes position row i of the table.
- "bucketed" (Idefics3 / SmolVLM, NaViT-style): an image of r x c valid patches (the rest padding, per
  `patch_mask`) spreads its patches over the side x side table by bucketing their fractional
  coordinates; padded patches take position 0 and are masked out as keys. A full tile's ids come from
  the same float arithmetic as Transformers' (not assumed to be 0..N-1: the buckets are float
  boundaries), cached per (rows, cols, grid).

Parameter names are Transformers' (`embeddings.patch_embedding`, `embeddings.position_embedding`,
`encoder.layers.N.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`,
`post_layernorm`): a family names the tower `vision_model` (or whatever its checkpoints prefix it
with) and the checkpoint loads by name; q/k/v are one MergedLinear filled shard by shard by the loader.
The attention-pooling head (`vision_use_head`) is not built: no family here reads it.

Float32 runs Transformers' ops on tensors of its shapes (the conv itself, one SDPA call over the
batch), so the outputs equal Transformers' towers bit for bit (tests/test_siglip_tower.py). In bf16
the patch embedding is a matmul over unfolded patches (oneDNN's bf16 conv is several times slower
than the same product as a GEMM; see vision_blocks.PatchEmbed).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.attention.flash import cu_seqlens
from vlm_engine.models.layers import MergedLinear
from vlm_engine.models.vision_blocks import activation, tower_flash_attention

PositionScheme = Literal["fixed", "bucketed"]


@functools.lru_cache(maxsize=64)
def bucketed_position_ids(rows: int, cols: int, grid_rows: int, grid_cols: int, side: int) -> torch.Tensor:
    """[grid_rows * grid_cols] position ids of an image whose top-left rows x cols patches are valid,
    in a grid_rows x grid_cols patch grid, over a side x side table (Idefics3's NaViT bucketing):
    each valid patch's fractional coordinate i / rows is bucketed by the boundaries 1/side, 2/side, ...
    Same float ops as Transformers (int count -> float32 step, clamp below 1, bucketize right)."""
    with torch.device("cpu"):
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        step_h = 1.0 / torch.tensor([rows])
        step_w = 1.0 / torch.tensor([cols])
        frac_h = torch.clamp(torch.arange(grid_rows, dtype=torch.float32)[None, :] * step_h[:, None], max=1.0 - 1e-6)
        frac_w = torch.clamp(torch.arange(grid_cols, dtype=torch.float32)[None, :] * step_w[:, None], max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)[0]
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)[0]
        ids = (bucket_h[:, None] * side + bucket_w[None, :]).reshape(-1)
        valid = torch.zeros(grid_rows, grid_cols, dtype=torch.bool)
        valid[:rows, :cols] = True
        return torch.where(valid.reshape(-1), ids, torch.zeros_like(ids))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: Any, positions: PositionScheme) -> None:
        super().__init__()
        self.patch_size = int(config.patch_size)
        self.side = int(config.image_size) // self.patch_size  # the position table is side x side
        self.positions = positions
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=self.patch_size, stride=self.patch_size
        )
        self.position_embedding = nn.Embedding(self.side * self.side, config.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H / p) * (W / p), hidden], positions added."""
        weight = self.patch_embedding.weight
        b, _, height, width = pixels.shape
        rows, cols = height // self.patch_size, width // self.patch_size
        pixels = pixels.to(weight.dtype)
        if weight.dtype == torch.float32:  # the conv itself: Transformers' sums, bit for bit
            x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        else:  # kernel = stride: one output per patch, a GEMM over the unfolded patches
            p = self.patch_size
            patches = pixels.view(b, -1, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(b * rows * cols, -1)
            x = F.linear(patches, weight.flatten(1), self.patch_embedding.bias).view(b, rows * cols, -1)
        return x + self.position_embedding(self.position_ids(b, rows, cols, patch_mask, x.device))

    def position_ids(
        self, batch: int, rows: int, cols: int, patch_mask: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """[1 or B, rows * cols] rows of the position table for each patch."""
        if self.positions == "fixed":
            if rows * cols != self.side * self.side:
                raise ValueError(f"a {rows}x{cols}-patch image in a SigLIP tower of {self.side}x{self.side} positions")
            return torch.arange(rows * cols, device=device)[None]
        if patch_mask is None:
            return bucketed_position_ids(rows, cols, rows, cols, self.side).to(device)[None]
        # Transformers counts an image's valid rows down its first column and its valid columns along its first row.
        heights = patch_mask[:, :, 0].sum(dim=1).tolist()
        widths = patch_mask[:, 0, :].sum(dim=1).tolist()
        ids = [bucketed_position_ids(h, w, rows, cols, self.side) for h, w in zip(heights, widths)]
        return torch.stack(ids).to(device)


class SiglipAttention(nn.Module):
    """Bidirectional multi-head attention with biases: one SDPA call over the batch, or in bf16 on the
    CPU one call of our flash-attention kernel (vision_blocks.tower_flash_attention)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5
        shards = {"q_proj": hidden_size, "k_proj": hidden_size, "v_proj": hidden_size}
        self.qkv_proj = MergedLinear(hidden_size, shards, bias=True)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape
        if (flash := tower_flash_attention(x)) is not None:
            # bf16 on the CPU: our flash kernel, each image a segment, its padded patches left out as keys
            q, k, v = self.qkv_proj(x).view(b * n, 3, self.num_heads, self.head_dim).unbind(1)
            bounds = keys = cu_seqlens([n] * b)
            if key_mask is not None:
                valid = key_mask.reshape(b, n)
                kept = valid.reshape(-1).nonzero().squeeze(1)
                k, v, keys = k.index_select(0, kept), v.index_select(0, kept), cu_seqlens(valid.sum(1).tolist())
            out = flash.flash_attention(q, k, v, bounds, keys, self.scale)
            return self.out_proj(out.view(b, n, d))
        q, k, v = self.qkv_proj(x).view(b, n, 3, self.num_heads, self.head_dim).transpose(1, 3).unbind(2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.scale)  # [B, H, N, hd]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act = activation(hidden_act)  # gelu_pytorch_tanh in every released SigLIP tower

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionTower(nn.Module):
    """Images [B, C, H, W] (and, "bucketed", which patches are real) -> [B, N, hidden] post-normed
    patch features, patches in raster order."""

    def __init__(self, config: Any, positions: PositionScheme = "fixed") -> None:
        super().__init__()
        self.config = config
        self.patch_size = int(config.patch_size)
        self.embeddings = SiglipEmbeddings(config, positions)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(pixel_values, patch_mask)
        key_mask = None
        if patch_mask is not None and not bool(patch_mask.all()):
            # padded patches are never attended to (as keys); their own rows are computed and ignored
            key_mask = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1).to(x.device)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)
