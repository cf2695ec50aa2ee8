"""Every model family, one matrix (rows: tests/family_table.py): on each tiny random checkpoint, built from
the real Transformers config and processor classes, our prompt ids and greedy tokens in exact fp32 equal
Transformers' (alone; batched; prefix cache on = off; preempted and chunked through the media = not),
structured output holds, fast numerics agree with exact; the built model and prompt side implement the
protocol and their hooks agree with each other; and every tensor of the released checkpoints loads by name
into a parameter of its shape (on the meta device, no download), none left over and none missing."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import torch

from preprocess.family_prompts import FamilyPrompts
from tests.conftest import to_hf_messages
from tests.family_table import (
    FAMILIES,
    STRUCTURED_SCHEMA,
    TEXT_ARCHITECTURES,
    Family,
    exact_engine,
    fast_engine,
    hf_model,
    meta_model,
    references,
    uncached_engine,
)
from tests.released_configs import released_checkpoint
from tests.test_fast_numerics import compare_greedy_logprobs
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader, registry
from vlm_engine.models.family import ModelFamily, VLModel, text_config_of


def rows(*, extra_engines: bool = False) -> list[Any]:
    return [pytest.param(f, id=f.name) for f in FAMILIES if f.extra_engines or not extra_engines]


def conversations() -> list[Any]:
    return [
        pytest.param(f, i, id=f"{f.name}-{f.names[i]}")
        for f in FAMILIES
        for i in (range(len(f.conversations)) if f.alone is None else f.alone)
    ]


def releases(attribute: str = "") -> list[Any]:
    if attribute:
        return [pytest.param(f, id=f.name) for f in FAMILIES if getattr(f, attribute)]
    return [pytest.param(f, name, id=name) for f in FAMILIES for name in sorted(f.releases)]


# ---- the table covers the registry ---------------------------------------------------------------------


def test_every_architecture_has_a_row() -> None:
    """A new family cannot be registered without joining the matrix (or saying where its text model is checked)."""
    covered = [a for f in FAMILIES for a in f.architectures] + list(TEXT_ARCHITECTURES)
    assert sorted(covered) == sorted(registry.ARCHITECTURES)


@pytest.mark.parametrize("row", rows())
def test_the_checkpoint_is_of_its_rows_architecture(row: Family) -> None:
    config = registry.load_config(registry.resolve_model(str(row.path)))
    assert config.architectures[0] in row.architectures


# ---- exactness ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", rows())
def test_prompt_equals_hf_processor(row: Family) -> None:
    engine, (_, processor) = exact_engine(row), hf_model(row)
    for conv in row.conversations:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()
        assert engine.process_messages(conv).token_ids == ids


@pytest.mark.parametrize(("row", "index"), conversations())
def test_alone_matches_hf(row: Family, index: int) -> None:
    out = exact_engine(row).chat([row.conversations[index]], row.greedy)[0]
    want = references(row)[index]
    assert out.token_ids == want
    assert out.finish_reason == ("length" if len(want) == row.max_tokens else "stop")


@pytest.mark.parametrize("row", rows())
def test_batched_equals_alone(row: Family) -> None:
    engine = exact_engine(row)
    assert [o.token_ids for o in engine.chat(row.conversations, row.greedy)] == list(references(row))
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("row", rows(extra_engines=True))
def test_prefix_cache_on_equals_off(row: Family) -> None:
    engine, conv = exact_engine(row), row.conversations[row.prefix_conversation]
    first = engine.chat([conv], row.greedy)[0]
    again = engine.chat([conv], row.greedy)[0]
    assert again.cached_tokens > 0
    if row.full_prefix_reuse:  # the media's KV reused
        assert again.cached_tokens >= again.prompt_tokens - engine.config.cache.page_size
    off = uncached_engine(row).chat([conv], row.greedy)[0]
    assert off.cached_tokens == 0
    assert first.token_ids == again.token_ids == off.token_ids == references(row)[row.prefix_conversation]


@pytest.mark.parametrize("row", rows(extra_engines=True))
def test_preempted_and_chunked_through_media_equals_not(row: Family) -> None:
    engine = Engine(str(row.path), dtype="float32", numerics="exact", **row.preempted)
    assert [o.token_ids for o in engine.chat(row.conversations, row.greedy)] == list(references(row))
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("row", rows())
def test_structured_output_with_an_image(row: Family) -> None:
    params = SamplingParams(max_tokens=80, temperature=0.0, json_schema=STRUCTURED_SCHEMA)
    out = exact_engine(row).chat([row.conversations[1]], params)[0]
    assert out.finish_reason == "stop"
    assert set(json.loads(out.text)) == {"title", "year"}


@pytest.mark.parametrize("row", rows(extra_engines=True))
def test_fast_numerics_agree_with_exact(row: Family) -> None:
    """Per conversation, greedy tokens of fast fp32 numerics agree with exact for at least half the run,
    with every top-5 log-prob within tolerance up to the first divergence."""
    params = SamplingParams(max_tokens=row.max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    fast, exact = fast_engine(row).chat(row.fast, params), exact_engine(row).chat(row.fast, params)
    agreed = [compare_greedy_logprobs(f, e) for f, e in zip(fast, exact)]
    assert min(agreed) >= row.max_tokens // 2, agreed


# ---- the protocol -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", sorted(registry.ARCHITECTURES))
def test_each_architecture_has_one_family(architecture: str) -> None:
    """The family module's FAMILY serves the architecture with a class of its own module tree, and the
    family names exactly the architectures the registry sends it."""
    family = registry.family_of_architecture(architecture)
    assert isinstance(family, ModelFamily)
    module = registry.ARCHITECTURES[architecture]
    assert importlib.import_module(module).FAMILY is family
    assert sorted(family.model_classes) == sorted(a for a, m in registry.ARCHITECTURES.items() if m == module)
    module_name, _, class_name = family.model_classes[architecture].partition(":")
    assert module_name == module or module_name.startswith(module + ".")
    assert isinstance(getattr(importlib.import_module(module_name), class_name), type)


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'NopeForCausalLM'"):
        registry.family_of_architecture("NopeForCausalLM")


PROTOCOL = [*rows(), pytest.param(registry.SMOLLM2_MODEL, id="smollm2"), pytest.param(registry.PLACARD_MODEL, id="placard")]


@pytest.mark.parametrize("row", PROTOCOL)
def test_built_models_and_prompts_implement_the_protocol(row: Family | str) -> None:
    source = registry.resolve_model(str(row.path) if isinstance(row, Family) else row)
    config = registry.load_config(source)
    model = meta_model(config)
    assert isinstance(model, VLModel)
    layers, kv_heads, head_dim = model.kv_layout
    assert layers == len(model.model.layers) and kv_heads >= 1 and head_dim >= 1
    assert model.position_axes == (row.position_axes if isinstance(row, Family) else 1)
    processor = registry.prompt_processor(source, config)
    assert isinstance(processor.family, FamilyPrompts)
    assert processor.vocab_size == model.vocab_size
    if isinstance(row, Family):
        assert processor.accepts_images and processor.accepts_videos == row.videos


@pytest.mark.parametrize("row", rows())
def test_the_hooks_agree_on_a_prompt(row: Family) -> None:
    """The prompt side and the model side of one family agree: each media span covers exactly the
    placeholder tokens, the tower gives one row per span token, hashes tell different pictures apart,
    and positions have the model's axes."""
    engine = exact_engine(row)
    prompt = engine.process_messages(row.conversations[2])  # two images
    placeholders = engine.processor.family.placeholder_ids
    spans = [i for m in prompt.media for i in range(m.span.offset, m.span.end)]
    assert prompt.media and len(set(spans)) == len(spans)
    assert spans == [i for i, t in enumerate(prompt.token_ids) if t in placeholders]
    assert len({m.span.content_hash for m in prompt.media}) == len(prompt.media)
    with torch.inference_mode():
        features = engine.model.encode_media([m.pixel_values for m in prompt.media], [m.grid_thw for m in prompt.media])
    hidden = int(text_config_of(engine.hf_config).hidden_size)
    assert [tuple(f.shape[:1]) for f in features] == [(m.span.length,) for m in prompt.media]
    assert all(f.shape[1] >= hidden and torch.isfinite(f).all() for f in features)
    if engine.model.position_axes == 1:
        assert prompt.positions is None
    else:
        assert prompt.positions.shape == (engine.model.position_axes, len(prompt.token_ids))


# ---- the released checkpoints' names, on the meta device ---------------------------------------------


@pytest.mark.parametrize(("row", "name"), releases())
def test_every_checkpoint_tensor_loads_into_a_parameter_of_its_shape(row: Family, name: str) -> None:
    release = row.releases[name]
    config = release.config()
    model = meta_model(config)
    checkpoint = released_checkpoint(release, config)
    if row.release_prefixes:
        used = {p for n, _ in checkpoint for p in row.release_prefixes if n.startswith(p)}
        assert all(n.startswith(row.release_prefixes) for n, _ in checkpoint)
        assert used >= set(row.release_prefixes) - {"lm_head."}
    assert loader.load_weights(model, checkpoint) == []  # raises on a missing tensor or a wrong shape
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ours = sum(p.numel() for p in model.parameters())
    assert ours == sum(t.numel() for _, t in checkpoint)  # tied: one embedding on both sides


@pytest.mark.parametrize("row", releases("leftover"))
def test_a_leftover_tensor_is_reported(row: Family) -> None:
    name, extra, shape, reported = row.leftover
    release = row.releases[name]
    config = release.config()
    checkpoint = [*released_checkpoint(release, config), (extra, torch.empty(shape, device="meta"))]
    assert loader.load_weights(meta_model(config), checkpoint) == [reported]


@pytest.mark.parametrize("row", releases("wrong_shape"))
def test_a_wrong_shape_is_refused(row: Family) -> None:
    name, suffix = row.wrong_shape
    release = row.releases[name]
    config = release.config()
    checkpoint = released_checkpoint(release, config)
    index = max(i for i, (n, _) in enumerate(checkpoint) if n.endswith(suffix))
    tensor_name, tensor = checkpoint[index]
    checkpoint[index] = (tensor_name, torch.empty(tensor.shape[0] + 1, *tensor.shape[1:], device="meta"))
    with pytest.raises(ValueError, match="shape"):
        loader.load_weights(meta_model(config), checkpoint)
