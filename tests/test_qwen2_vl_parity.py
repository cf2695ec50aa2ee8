"""Greedy Qwen2-VL outputs from Engine equal Hugging Face `generate` on the same tiny weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import hf_greedy, make_image, to_hf_messages, user
from vlm_engine import Engine, SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(64, 48, 1), "What is in this picture?"),
    user("Compare these:", make_image(96, 40, 2), make_image(36, 84, 3), "Which is taller?"),
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Two more?"},
    ],
    user(make_image(120, 120, 4), "Describe it in detail."),
    user("Just text inside a parts list."),
    user(make_image(224, 56, 5), "A wide one."),
    user(make_image(50, 50, 6), "And", make_image(50, 50, 7), "two equal sizes, different content."),
]


@pytest.fixture(scope="module")
def references(hf_tiny_vlm) -> list[list[int]]:
    return [hf_greedy(hf_tiny_vlm, c, MAX_TOKENS) for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=4096, numerics="exact")


def test_prompt_equals_hf_processor(engine: Engine, hf_tiny_vlm) -> None:
    _, processor = hf_tiny_vlm
    for conv in CONVERSATIONS:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()
        assert engine.process_messages(conv).token_ids == ids


@pytest.mark.parametrize("index", [0, 1, 2], ids=["text", "one-image", "two-images"])
def test_single_request_matches_hf(engine: Engine, references, index: int) -> None:
    out = engine.chat([CONVERSATIONS[index]], GREEDY)[0]
    assert out.token_ids == references[index]
    assert out.finish_reason == ("length" if len(references[index]) == MAX_TOKENS else "stop")


def test_batch_of_eight_matches_individual_hf_runs(engine: Engine, references) -> None:
    outs = engine.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outs] == references
    assert engine.pool.num_free == engine.pool.num_pages


def test_requests_arriving_while_others_decode(engine: Engine, references) -> None:
    pending = {engine.add_request(engine.process_messages(CONVERSATIONS[i]), GREEDY): i for i in (0, 1)}
    results: dict[int, list[int]] = {}
    later = [2, 3, 4, 5, 6, 7]
    steps = 0
    while pending:
        for out in engine.step():
            if out.finished:
                results[pending.pop(out.request_id)] = out.token_ids
        steps += 1
        if later and steps % 3 == 0:  # a newcomer every few decode steps
            i = later.pop(0)
            pending[engine.add_request(engine.process_messages(CONVERSATIONS[i]), GREEDY)] = i
    assert [results[i] for i in range(8)] == references


def test_tiny_kv_pool_forces_preemption_and_chunking(tiny_vlm_dir: Path, references) -> None:
    longest_prompt = 200
    engine = Engine(
        str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=longest_prompt + MAX_TOKENS + 16,
        max_num_batched_tokens=48, page_size=8, numerics="exact",
    )
    outs = engine.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outs] == references
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


def test_prefix_cache_hit_on_repeated_image(engine: Engine, references) -> None:
    first = engine.chat([CONVERSATIONS[4]], GREEDY)[0]
    again = engine.chat([CONVERSATIONS[4]], GREEDY)[0]
    assert first.token_ids == again.token_ids == references[4]
    assert again.cached_tokens > 0 and again.cached_tokens >= again.prompt_tokens - engine.config.cache.page_size
    other_image = user(make_image(120, 120, 99), "Describe it in detail.")
    third = engine.chat([other_image], GREEDY)[0]
    # Same text and placeholder count, different pixels: only the text before the image is reusable.
    image_offset = engine.process_messages(other_image).media[0].span.offset
    assert third.cached_tokens <= image_offset
