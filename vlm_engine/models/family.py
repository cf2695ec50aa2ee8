"""The one protocol between generic code and a model family.

A family is a folder under `vlm_engine/models/` (`llama/`, `qwen2_vl/`, `placard/`) whose
`__init__.py` defines `FAMILY`, a `ModelFamily`; `registry.ARCHITECTURES` is the one place that
maps Hugging Face architecture names to those modules. Generic code (preprocess/, the scheduler,
the runner, the server, the engine) reaches a family only through:

- `ModelFamily`: how to build the nn.Module for a config (`model_class`), how to adapt a config
  that does not name the family itself (`adapt_config`, e.g. a GGUF read as Llama), and how to
  build its prompt side (`prompts`, a `preprocess.family_prompts.FamilyPrompts`: tokenizer, media
  placeholders and positions);
- `VLModel`: what the runner calls on the built model.

See "Adding a model family" in docs/ARCHITECTURE.md for the files and the tests a family must have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from preprocess.family_prompts import FamilyPrompts
from vlm_engine.models.layers import ForwardContext


@runtime_checkable
class VLModel(Protocol):
    """The model side: what the runner and the loader need of a family's nn.Module."""

    kv_layout: tuple[int, int, int]  # (layers, KV heads, head dim) of the paged KV it reads
    position_axes: int  # rotary position axes: 1, or 3 for M-RoPE (t, h, w)
    vocab_size: int
    # checkpoint name prefixes -> the module's own (the loader renames with them)
    checkpoint_renames: tuple[tuple[str, str], ...]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def encode_media(self, inputs: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        """One [span length, hidden] embedding per media item (`MediaInput.pixel_values` / `grid_thw`),
        in one batched pass. Rows may be wider than `hidden`: the first `hidden` columns replace the
        placeholder embeddings, the rest reach `forward` as `ForwardContext.media_features` at
        `media_rows` (Qwen3-VL's DeepStack features for its first decoder layers)."""
        ...


# Optional on a VLModel: `encoder_modules`, names of submodules (a vision tower) that only multiply
# prefill-sized row counts, whose linears keep one (oneDNN) layout when prepacked instead of two;
# `adapt_checkpoint_tensor(name, tensor) -> tensor`, called by the loader on each
# checkpoint tensor (after `checkpoint_renames`) whose stored layout differs from the module's (the
# Qwen3-VL-MoE release stores its experts transposed); `kv_shapes`, one (KV heads, head dim) per layer
# where layers differ (Gemma 4's global layers; `kv_layout` then names the widest), and `kv_sources`,
# whose paged KV each layer reads (its own, or an earlier layer's that it reads and never writes: Gemma
# 4's KV-shared layers, which the runner gives no pages of their own); `checkpoint_skipped`, checkpoint
# name prefixes (after `checkpoint_renames`) of parts the family deliberately does not build, whose tensors
# the loader passes over unread and does not report as unused (Gemma 4's audio tower), with
# `checkpoint_skipped_reason`, the why the loader logs beside their count.


# (model directory, config, GGUF file name or None, video device) -> the family's prompt side
PromptsFactory = Callable[[Path, Any, "str | None", str], FamilyPrompts]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    # Hugging Face architecture name -> "module:Class" of the nn.Module that serves it
    model_classes: dict[str, str]
    prompts: PromptsFactory
    # A config read from a file that does not name this family (a GGUF read as Llama) -> its own.
    adapt_config: Callable[[Any], Any] | None = None


def text_config_of(config: Any) -> Any:
    """The decoder's config: a VLM's `text_config`, or a text model's own config."""
    return getattr(config, "text_config", None) or config
