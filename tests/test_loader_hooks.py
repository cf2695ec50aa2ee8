"""The loader's generic hooks on small modules: tied parameters the checkpoint stores apart are untied
(`loader.untie_stored`, what PaddleOCR-VL's flat released config needs)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_engine.models import loader


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
