"""The sliding-window layers' own KV pool (scheduler/window.py) and atomic media spans, with no model:
a fake runner writes each token's content into both pools and checks that every chunk can read exactly
what its window needs, while requests give back the pages behind their windows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.test_scheduler import FakeRunner, make_request
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.config import SchedulingConfig
from vlm_engine.inputs import MediaInput, ProcessedPrompt
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler import Request, SampledToken, Scheduler, SchedulerConfig
from vlm_engine.scheduler.window import RELEASED, WindowPages, held_pages

PS = 4


class FakeWindowRunner(FakeRunner):
    """FakeRunner's full-pool checks, plus the window pool: before each chunk, the `window - 1`
    positions its first query reaches back to hold exactly the request's content there."""

    def __init__(self, pool: PagePool, window: WindowPages) -> None:
        super().__init__(pool)
        self.window = window
        self.window_slots = np.full((window.pool.num_pages * self.ps, 2), -1, dtype=np.int64)

    def window_slot_ids(self, request: Request, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        pages = np.asarray(request.window_page_ids)[pos // self.ps]
        assert (pages != RELEASED).all(), f"{request.request_id} reads released window pages in [{lo}, {hi})"
        return pages * self.ps + pos % self.ps

    def execute(self, plan) -> dict[str, list[SampledToken]]:
        for chunk in plan.chunks:
            r = chunk.request
            assert len(r.window_page_ids) == len(r.page_ids)
            lo = max(0, chunk.start - self.window.window + 1)
            if lo < chunk.start:
                seen = self.window_slots[self.window_slot_ids(r, lo, chunk.start)]
                np.testing.assert_array_equal(seen, self.content(r, lo, chunk.start))
            self.window_slots[self.window_slot_ids(r, chunk.start, chunk.end)] = self.content(r, chunk.start, chunk.end)
        return super().execute(plan)


def make_scheduler(num_pages: int, window: int, window_pages: int, budget: int = 32, seqs: int = 8,
                   prefix_cache: bool = True) -> tuple[Scheduler, FakeWindowRunner]:
    pool = PagePool(num_pages, PS, prefix_cache)
    pages = WindowPages(PagePool(window_pages, PS, prefix_cache), window)
    options = SchedulingConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)
    config = SchedulerConfig(options, max_model_len=num_pages * PS)
    return Scheduler(config, pool, pages), FakeWindowRunner(pool, pages)


def run(sched: Scheduler, runner: FakeWindowRunner, window: int) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished:
        plan = sched.schedule()
        assert not plan.is_empty, "scheduler stalled with work left"
        for request in sched.update(plan, runner.execute(plan)).finished:
            outputs[request.request_id] = request.output_token_ids
        sched.check_invariants()
        for request in sched.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:  # decoding: about one window held
                assert len(held_pages(request)) <= -(-window // PS) + 2
    return outputs


@pytest.mark.parametrize("seed", range(4))
def test_window_pool_serves_every_window_and_gives_back_the_rest(seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([5, 8, 13])
    shared = [rng.randrange(900) for _ in range(24)]
    requests = [
        make_request(f"r{i}", rng, rng.randint(4, 30), rng.randint(2, 50), with_media=rng.random() < 0.5,
                     shared_prefix=shared if rng.random() < 0.5 else None)
        for i in range(12)
    ]  # fmt: skip
    # A tight global pool preempts; a window pool of a few windows makes the window side bind too.
    sched, runner = make_scheduler(num_pages=40, window=window, window_pages=24, budget=rng.choice([7, 16, 32]))
    for r in requests:
        sched.add_request(r)
    outputs = run(sched, runner, window)
    assert len(outputs) == len(requests)
    assert sched.window is not None and sched.window.pool.num_used == 0 and sched.pool.num_used == 0


def test_long_request_holds_one_window_of_window_pages() -> None:
    rng = random.Random(7)
    sched, runner = make_scheduler(num_pages=64, window=8, window_pages=16, budget=12)
    request = make_request("long", rng, max_tokens=120, prompt_len=90)
    sched.add_request(request)
    peak = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        sched.check_invariants()
        if sched.running:
            peak = max(peak, len(held_pages(request)))
            assert request.num_window_released == sched.window.first_readable_page(request.num_computed_tokens)
    # 210 tokens in the global pool (53 pages); the window side never more than a step's chunk + window.
    assert peak <= -(-(12 + 8) // PS) + 1


def test_prefix_hit_needs_the_window_pages_of_its_last_window() -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(900) for _ in range(61)]

    def fresh(rid: str) -> Request:
        return Request(rid, ProcessedPrompt(list(prompt), []), SamplingParams(max_tokens=3, temperature=0))

    sched, runner = make_scheduler(num_pages=64, window=9, window_pages=32)
    sched.add_request(fresh("a"))
    run(sched, runner, 9)
    # The same prompt again: every full page but the last token's is a hit, window pages included,
    # although the first request gave its early window pages back long before it finished.
    second = fresh("b")
    sched.add_request(second)
    plan = sched.schedule()
    assert second.num_cached_tokens == 60
    assert second.window_page_ids[: second.num_window_released] == [RELEASED] * second.num_window_released
    assert sched.window.first_readable_page(60) == second.num_window_released
    sched.update(plan, runner.execute(plan))
    run(sched, runner, 9)
    # Without the window pool's copies the global pages alone are no hit: the window must be recomputed.
    sched.window.pool.reset_prefix_cache()
    third = fresh("c")
    sched.add_request(third)
    sched.schedule()
    assert third.num_computed_tokens == 0 and sched.pool.num_used == len(third.page_ids)
    sched.check_invariants()


def _media_request(rid: str, spans: list[tuple[int, int]], prompt_len: int) -> Request:
    tokens = list(range(prompt_len))
    media = [MediaInput("image", MediaSpan(o, n, 100 + o), None, (1, 1, n)) for o, n in spans]
    return Request(rid, ProcessedPrompt(tokens, media), SamplingParams(max_tokens=2, temperature=0))


def test_atomic_media_spans_never_end_a_chunk_inside_a_span() -> None:
    pool = PagePool(128, PS)
    options = SchedulingConfig(max_num_seqs=4, max_num_batched_tokens=10)
    config = SchedulerConfig(options, max_model_len=512, atomic_media_spans=True)
    sched = Scheduler(config, pool)
    # Spans: one cut back to its start; one longer than the step budget (runs whole, over budget, alone).
    a = _media_request("a", [(6, 5), (14, 23)], 45)
    b = _media_request("b", [(3, 4)], 20)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(pool)
    chunks: list[tuple[str, int, int]] = []
    while sched.has_unfinished:
        plan = sched.schedule()
        chunks += [(c.request.request_id, c.start, c.end) for c in plan.chunks]
        for c in plan.chunks:
            for span in c.request.media_spans:
                assert not span.offset < c.end < span.end, f"chunk {c.start}-{c.end} splits {span}"
        if plan.num_tokens > options.max_num_batched_tokens:
            assert len(plan.chunks) == 1  # over the budget only alone
        sched.update(plan, runner.execute(plan))
        sched.check_invariants()
    assert ("a", 0, 6) in chunks and ("a", 14, 37) in chunks


def _held_after_prefill(engine, prompt: list[int]) -> tuple[int, int]:
    """(KV bytes held, window pages held) right after the prompt's prefill, before it decodes on."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while request.num_output_tokens == 0:
        engine.step_tokens()
    held = engine.kv_bytes_in_use(), len(held_pages(request))
    while engine.has_unfinished:
        engine.step_tokens()
    return held


def test_gemma3_engine_gives_back_the_window_layers_pages() -> None:
    """Tiny Gemma 3 (3 of 5 layers with a 32-token window): after a 300-token prefill in 64-token
    chunks the window layers hold about one window of pages; with every layer attending fully, all."""
    from vlm_engine import Engine
    from testkit.gemma3_checkpoints import GEMMA3_PRESETS, cached_gemma3

    window = GEMMA3_PRESETS["tiny"]["text"]["sliding_window"]
    prompt = [random.Random(5).randrange(300, 900) for _ in range(300)]
    options = {"dtype": "float32", "kv_cache_tokens": 1024, "max_num_batched_tokens": 64, "page_size": 16}
    windowed = Engine(str(cached_gemma3("tiny")), **options)
    full = Engine(str(cached_gemma3("tiny")), disable_sliding_window=True, **options)
    assert full.window_pool is None and windowed.window_pool is not None
    held_windowed, window_pages = _held_after_prefill(windowed, prompt)
    held_full, _ = _held_after_prefill(full, prompt)
    assert window_pages <= -(-window // 16) + 2
    pages = -(-301 // 16)  # the prompt and its first token
    page_bytes = held_full // pages // 5  # one layer's page
    assert held_full == 5 * pages * page_bytes
    assert held_windowed == 2 * pages * page_bytes + 3 * window_pages * page_bytes
    windowed.pool.check_invariants()
    assert windowed.window_pool.num_used == 0 and windowed.pool.num_used == 0
