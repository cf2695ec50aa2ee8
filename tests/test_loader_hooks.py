"""The loader's generic hooks on small modules: tied parameters the checkpoint stores apart are untied
(`loader.untie_stored`, what PaddleOCR-VL's flat released config needs); a pre-quantized checkpoint's tensors
under a family's `checkpoint_skipped` prefixes (Gemma 4's audio tower) pass `grouped_weights` unread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from vlm_engine.models import loader
from vlm_engine.models.quant_formats import GroupedWeights, checkpoint_format


class TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight, as our decoders tie them; the checkpoint names its
    embedding `language_model.embed.weight` (renamed to ours)."""

    checkpoint_renames = (("language_model.", ""),)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.embed.weight


def test_a_head_stored_beside_its_embedding_is_untied_and_loads_its_own_values() -> None:
    model = TiedLM()
    assert loader.untie_stored(model, ["language_model.embed.weight", "lm_head.weight"]) == ["lm_head.weight"]
    assert model.lm_head.weight is not model.embed.weight
    embed, head = torch.randn(5, 3), torch.randn(5, 3)
    assert loader.load_weights(model, [("language_model.embed.weight", embed), ("lm_head.weight", head)]) == []
    assert torch.equal(model.embed.weight, embed) and torch.equal(model.lm_head.weight, head)


def test_one_stored_copy_stays_tied() -> None:
    for names in (["language_model.embed.weight"], ["lm_head.weight"]):
        model = TiedLM()
        assert loader.untie_stored(model, names) == []
        assert model.lm_head.weight is model.embed.weight


class TextWithoutAudio(nn.Module):
    """A text linear; the checkpoint's `model.audio_tower.*` (renamed `audio.*`) is not built."""

    checkpoint_renames = (("model.audio_tower.", "audio."),)
    checkpoint_skipped = ("audio.",)

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(64, 16, bias=False)


W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
    }}},
}  # fmt: skip


def test_a_skipped_prefix_of_a_prequantized_checkpoint_passes_unread_and_is_not_left_over(tmp_path: Path) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (16, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(16, 2, generator=g) * 0.05 + 0.01
    components = {
        "weight_packed": pack_to_int32(codes, 4),
        "weight_scale": scale,
        "weight_shape": torch.tensor([16, 64]),
    }
    tensors = {
        f"{linear}.{c}": t.clone() for linear in ("text", "model.audio_tower.proj") for c, t in components.items()
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    fmt = checkpoint_format({"quantization_config": W4A16})
    assert fmt is not None

    def stream(model: nn.Module) -> Iterator[tuple[str, torch.Tensor | loader.StoredTensor | GroupedWeights]]:
        names = loader.safetensors_names(tmp_path)
        return loader.grouped_weights(loader.iter_safetensors(tmp_path), fmt, names, loader.skips(model))

    passed = {name: type(tensor) for name, tensor in stream(TextWithoutAudio())}
    audio = {n for n in tensors if n.startswith("model.audio_tower.")}
    assert passed == {"text.weight": GroupedWeights, **dict.fromkeys(audio, loader.StoredTensor)}
    model = TextWithoutAudio()
    assert loader.load_weights(model, stream(model)) == []
    want = scale.repeat_interleave(32, dim=1) * codes.float()
    assert torch.equal(model.text.weight, want)
