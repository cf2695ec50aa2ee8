"""Reading a GGUF's metadata into a Transformers config's values, shared by models/gguf_vlm.py and the
family modules beside it (models/gguf_gemma3.py): a key that must be there, a float32 as its decimal,
the SigLIP tower an mmproj describes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vlm_engine.models.loader import gguf_field


def required(reader: Any, path: Path, key: str) -> Any:
    value = gguf_field(reader, key)
    if value is None:
        raise ValueError(f"{path.name}: GGUF key {key!r} is missing (it is needed to build the model)")
    return value


def float32_decimal(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07): the shortest
    text that reads back as the same float32."""
    return float(str(np.float32(value)))


def siglip_vision(clip: Any, mmproj: Path) -> dict[str, Any]:
    """A SiglipVisionConfig's values (SmolVLM's and Gemma 3's towers): sizes, LayerNorm eps, tanh GELU."""
    if not gguf_field(clip, "clip.use_gelu", False):  # clip.cpp's other choice, quick GELU, is not SigLIP's
        raise ValueError(f"{mmproj.name}: clip.use_gelu is not set: not SigLIP's tanh GELU")
    return {
        "hidden_size": int(required(clip, mmproj, "clip.vision.embedding_length")),
        "intermediate_size": int(required(clip, mmproj, "clip.vision.feed_forward_length")),
        "num_hidden_layers": int(required(clip, mmproj, "clip.vision.block_count")),
        "num_attention_heads": int(required(clip, mmproj, "clip.vision.attention.head_count")),
        "image_size": int(required(clip, mmproj, "clip.vision.image_size")),
        "patch_size": int(required(clip, mmproj, "clip.vision.patch_size")),
        "layer_norm_eps": float32_decimal(required(clip, mmproj, "clip.vision.attention.layer_norm_epsilon")),
        "hidden_act": "gelu_pytorch_tanh",  # clip.use_gelu: ggml's GELU is the tanh form
        "num_channels": 3,
    }
