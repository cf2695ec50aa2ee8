"""The released Gemma 3 checkpoints load by name, without a download: each model is built on the meta
device from the real config.json values of gemma-3-4b-it and gemma-3-12b-it (and the text-only
gemma-3-1b-it), and every tensor name and shape the checkpoint holds must land on a parameter of that
shape, with none left over and none missing.

The checkpoint's names and shapes come from Transformers' own model built from the same config (on
meta), written the way the released files name them: `language_model.model.*`,
`vision_tower.vision_model.*` and `multi_modal_projector.*` (Transformers 5 renames them on load to
`model.language_model.*`, `model.vision_tower.*` without the `vision_model` level, and
`model.multi_modal_projector.*`); the LM head is tied, so the files hold the embedding only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vlm_engine.models import loader, registry
from vlm_engine.models.gemma3.model import Gemma3ForCausalLM

SIGLIP_SO400M = {  # every Gemma 3 VLM's tower (vision_use_head false; the rest SiglipVisionConfig's defaults)
    "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
    "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
}
MEDIA_TOKENS = {"mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144}
# The text config.json values; the rest are Gemma3TextConfig's defaults, which are the released ones
# (8 heads / 4 KV heads of 256, query_pre_attn_scalar 256, theta 1e6 and local base 1e4, a full layer
# in every 6, vocabulary 262,208), written out here where the 12B differs.
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-3-4b-it": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
    "gemma-3-12b-it": {
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
}
GEMMA_3_1B = {  # gemma-3-1b-it's config.json (Gemma3ForCausalLM, text only)
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
    "vocab_size": 262144, "max_position_embeddings": 32768,
}


def real_config(name: str) -> Any:
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=REAL_CONFIGS[name],
        vision_config=SIGLIP_SO400M,
        architectures=["Gemma3ForConditionalGeneration"],
        **MEDIA_TOKENS,
    )


def released_checkpoint(config: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor) of each tensor the released safetensors hold."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(config)
    tensors = []
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the files hold the embedding only
        name = (
            name.replace("model.language_model.", "language_model.model.", 1)
            .replace("model.vision_tower.", "vision_tower.vision_model.", 1)
            .replace("model.multi_modal_projector.", "multi_modal_projector.", 1)
        )
        tensors.append((name, torch.empty(tensor.shape, device="meta")))
    return tensors


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_every_checkpoint_tensor_loads_into_a_parameter_of_its_shape(name: str) -> None:
    config = real_config(name)
    assert config.text_config.vocab_size == 262208 and config.text_config.head_dim == 256
    with torch.device("meta"):
        model = registry.model_class(config)(config)
    checkpoint = released_checkpoint(config)
    assert all(n.startswith(("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector.")) for n, _ in checkpoint)
    assert loader.load_weights(model, checkpoint) == []  # raises on a missing tensor or a wrong shape
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = sum(p.numel() for p in model.parameters())
    assert ours == sum(t.numel() for _, t in checkpoint)  # tied: one embedding on both sides


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_the_real_layouts_windows_and_rope(name: str) -> None:
    config = real_config(name)
    with torch.device("meta"):
        model: Any = registry.model_class(config)(config)
    text = config.text_config
    layers, kv_heads, head_dim = model.kv_layout
    assert (layers, kv_heads, head_dim) == (text.num_hidden_layers, text.num_key_value_heads, 256)
    # five sliding layers of 1024 tokens, then a full one
    assert model.attention_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(layers))
    assert model.bidirectional_media
    attn = model.model.layers[0].self_attn
    assert attn.scale == 256**-0.5 and attn.window == 1024
    # the local layers rotate with base 1e4, the global ones with theta 1e6 over 8 (linear scaling)
    local, full = (model.model.rotaries[model.model.layer_rotary[i]] for i in (0, 5))
    assert torch.allclose(local.inv_freq[1], torch.tensor(10000.0 ** (-2 / 256)))
    assert torch.allclose(full.inv_freq[1], torch.tensor(1000000.0 ** (-2 / 256) / 8))


def test_the_text_only_model_loads_gemma_3_1b() -> None:
    from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA_3_1B, architectures=["Gemma3ForCausalLM"])
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
        hf = HFGemma3ForCausalLM(config)
    checkpoint = [(n, torch.empty(t.shape, device="meta")) for n, t in hf.state_dict().items() if n != "lm_head.weight"]
    assert loader.load_weights(model, checkpoint) == []
    assert model.attention_windows.count(512) == 22 and model.attention_windows.count(0) == 4
    assert not model.bidirectional_media


def test_a_leftover_tensor_is_reported() -> None:
    config = real_config("gemma-3-4b-it")
    with torch.device("meta"):
        model = registry.model_class(config)(config)
    extra = "vision_tower.vision_model.head.attention.in_proj_weight"  # the pooling head Gemma 3 does not use
    checkpoint = [*released_checkpoint(config), (extra, torch.empty(3, device="meta"))]
    assert loader.load_weights(model, checkpoint) == ["vision_tower.head.attention.in_proj_weight"]
