"""Untied token-embedding tables looked up through a mapping of the checkpoint file (models/mapped_embedding.py):
the same tokens as a model that copies them in, only the rows looked up resident, and tied or small tables
copied in as before."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader, mapped_embedding
from vlm_engine.models.mapped_embedding import MappedEmbedding, map_stored

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[dict]]:
    rng = np.random.default_rng(5)
    image = Image.fromarray((rng.random((61, 83, 3)) * 255).astype(np.uint8))
    return [
        [{"role": "user", "content": "Describe a lighthouse at dusk."}],
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}],
    ]


def _mapped(engine: Engine) -> list[MappedEmbedding]:
    return [m for m in engine.model.modules() if isinstance(m, MappedEmbedding)]


@pytest.mark.parametrize(
    ("name", "dtype", "numerics"),
    [("qwen2-vl", "float32", "exact"), ("qwen2-vl", "bfloat16", "fast"), ("gemma4", "float32", "exact"),
     ("qwen3.5", "float32", "exact")],
)  # fmt: skip
def test_mapped_embeddings_give_the_tokens_of_copied_ones(
    name: str, dtype: str, numerics: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny checkpoints' untied tables (Gemma 4's per-layer table too) mapped (the size floor lowered to 0)
    against copied in (the default floor): the same greedy tokens on text and an image."""
    from tests.family_table import family

    path = family(name).path
    tokens = {}
    for floor in (1 << 40, 0):
        monkeypatch.setattr(mapped_embedding, "MIN_MAPPED_BYTES", floor)
        engine = Engine(str(path), dtype=dtype, numerics=numerics, kv_cache_tokens=2048)
        mapped = _mapped(engine)
        assert bool(mapped) == (floor == 0)
        assert all(m.dtype == getattr(torch, dtype) for m in mapped)
        tokens[floor] = [out.token_ids for out in engine.chat(_prompts(), GREEDY)]
        del engine
    assert tokens[0] == tokens[1 << 40]


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file by hand (the format's header, then the bytes), so that this test reads what it wrote."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        dtype = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+)", status)
    assert found
    return int(found[1]) * 1024


def test_only_the_rows_looked_up_become_resident(tmp_path: Path) -> None:
    """A 96 MiB float16 table behind a small tensor: mapping it costs no memory until rows are read, reading 16
    rows gives the stored values, widened, and costs about their pages, not the table."""
    rows, width = 49_152, 1_024
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(rows, width, generator=gen) * 0.02).half()
    _write_safetensors(tmp_path / "model.safetensors", {"a.bias": torch.ones(3), "embed.weight": table})
    ids = torch.tensor([0, 7, 49_151, 1_000, 20_000, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    want = table[ids].float()  # table stays alive: no freed memory that a copy could reuse unseen
    mapped = None
    for name, stored in loader.iter_safetensors(tmp_path):  # mapped while the loader has the file open, as in a load
        if name == "embed.weight":
            before = _rss_bytes()
            mapped = map_stored(stored)
    assert mapped is not None  # the file is closed now: the mapping outlives it
    got = torch.nn.functional.embedding(ids, mapped).float()
    grown = _rss_bytes() - before
    assert torch.equal(got, want)
    assert grown < 8 << 20, f"{grown / 2**20:.1f} MiB resident after 16 rows of a 96 MiB table"


def test_tied_tables_are_copied_in(tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table the LM head shares is read whole every step: never mapped, whatever its size."""
    from vlm_engine.models.mapped_embedding import plan_mapped_embeddings
    from vlm_engine.models.registry import load_config, model_class, resolve_model

    monkeypatch.setattr(mapped_embedding, "MIN_MAPPED_BYTES", 0)
    config = load_config(resolve_model(str(tiny_vlm_dir)))
    with torch.device("meta"):
        model = model_class(config)(config)
    names = loader.safetensors_names(tiny_vlm_dir)
    assert plan_mapped_embeddings(model, torch.float32, names).modules  # untied: mapped
    with torch.device("meta"):
        tied = model_class(config)(config)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert not plan_mapped_embeddings(tied, torch.float32, names).modules
    assert type(tied.model.embed_tokens) is torch.nn.Embedding
