"""Qwen3-VL: the Qwen-VL shell (models/qwen_vl.py) with the Qwen3 decoder over paged KV (q/k RMSNorm,
explicit head_dim, interleaved M-RoPE), DeepStack (features of chosen vision blocks added to the first
decoder layers' outputs at the media tokens), and the MoE text variant's sparse MLP (Qwen3-VL-30B-A3B)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlm_engine.models.layers import GatedMLP
from vlm_engine.models.moe import SparseMoE
from vlm_engine.models.qwen3_vision import Qwen3VisionTower
from vlm_engine.models.qwen_vl import QwenVLForConditionalGeneration


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    def __init__(self, config: Any) -> None:
        text_config = config.text_config
        super().__init__(
            config,
            Qwen3VisionTower,
            default_mrope_section=(24, 20, 20),
            qkv_bias=bool(getattr(text_config, "attention_bias", False)),
            qk_norm=True,
            mrope_interleaved=True,  # Transformers' Qwen3-VL always interleaves the axes
            mlp_factory=self._mlp_factory(text_config),
        )

    def _mlp_factory(self, text_config: Any) -> Any:
        return None  # dense: GatedMLP in every layer

    def visual_features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden * (1 + deepstack layers)]: the merged features, then the DeepStack features of
        each chosen vision block (the runner hands the columns past `hidden` to the decoder as
        ForwardContext.media_features)."""
        merged, deepstack = self.visual(pixels, grid_thw)
        return torch.cat([merged, *deepstack], dim=1)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    def _mlp_factory(self, text_config: Any) -> Any:
        dense_layers = set(getattr(text_config, "mlp_only_layers", None) or [])
        step = int(getattr(text_config, "decoder_sparse_step", 1) or 1)

        def mlp(layer: int) -> nn.Module:
            if layer not in dense_layers and text_config.num_experts > 0 and (layer + 1) % step == 0:
                return SparseMoE(
                    text_config.hidden_size,
                    text_config.moe_intermediate_size,
                    text_config.num_experts,
                    text_config.num_experts_per_tok,
                )
            return GatedMLP(text_config.hidden_size, text_config.intermediate_size)

        return mlp

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The released checkpoints store the experts as [E, hidden, 2I] / [E, I, hidden]; Transformers 5
        (and we) keep [E, 2I, hidden] / [E, hidden, I]: transpose where the shape says so."""
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            module = self.get_submodule(name.rpartition(".")[0])
            expected = getattr(module, name.rpartition(".")[2]).shape
            if tensor.shape != expected and tensor.transpose(1, 2).shape == expected:
                return tensor.transpose(1, 2)
        return tensor
