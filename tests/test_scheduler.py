"""Scheduler + page pool + prefix cache with no model: a fake runner keeps a 'KV pool' of token
contents and checks every step reads exactly the tokens (and media) each request owns."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.config import SchedulingConfig
from vlm_engine.inputs import MediaInput, ProcessedPrompt
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler import Request, RequestRejected, RequestStatus, SampledToken, Scheduler, SchedulerConfig

VOCAB = 1000
PLACEHOLDER = 999


class FakeRunner:
    """Stores (token, media hash) per KV slot and derives the next token from what it reads."""

    def __init__(self, pool: PagePool) -> None:
        self.ps = pool.page_size
        self.slots = np.full((pool.num_pages * self.ps, 2), -1, dtype=np.int64)

    def content(self, request: Request, lo: int, hi: int) -> np.ndarray:
        out = np.zeros((hi - lo, 2), dtype=np.int64)
        out[:, 0] = request.token_ids[lo:hi]
        for span in request.media_spans:
            a, b = max(lo, span.offset), min(hi, span.end)
            if a < b:
                out[a - lo : b - lo, 1] = span.content_hash % 1_000_003
        return out

    def slot_ids(self, request: Request, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        pages = np.asarray(request.page_ids)[pos // self.ps]
        return pages * self.ps + pos % self.ps

    def execute(self, plan) -> dict[str, list[SampledToken]]:
        sampled = {}
        for chunk in plan.chunks:
            r = chunk.request
            assert chunk.start == r.num_computed_tokens
            assert len(r.page_ids) * self.ps >= chunk.end
            # Everything before the chunk must already be in the pool, exactly.
            if chunk.start:
                seen = self.slots[self.slot_ids(r, 0, chunk.start)]
                np.testing.assert_array_equal(seen, self.content(r, 0, chunk.start))
            self.slots[self.slot_ids(r, chunk.start, chunk.end)] = self.content(r, chunk.start, chunk.end)
            if chunk.samples:
                history = self.slots[self.slot_ids(r, 0, chunk.end)]
                sampled[r.request_id] = [SampledToken(int(hash(history.tobytes()) % (VOCAB - 2)))]
        return sampled


def make_request(rid: str, rng: random.Random, max_tokens: int, prompt_len: int, with_media: bool = False,
                 shared_prefix: list[int] | None = None) -> Request:
    tokens = list(shared_prefix or []) + [rng.randrange(VOCAB - 2) for _ in range(prompt_len)]
    media = []
    if with_media and len(tokens) > 12:
        offset, length = rng.randrange(0, len(tokens) - 10), 8
        tokens[offset : offset + length] = [PLACEHOLDER] * length
        media.append(MediaInput("image", MediaSpan(offset, length, rng.choice([11, 22, 33])), None, (1, 4, 8)))
    return Request(rid, ProcessedPrompt(tokens, media), SamplingParams(max_tokens=max_tokens, temperature=0),
                   eos_token_ids=frozenset({VOCAB - 1}))


def run_to_completion(sched: Scheduler, runner: FakeRunner, budget: int | None = None, on_step=None) -> int:
    steps = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        if budget is not None:
            assert plan.num_tokens <= budget
        assert not plan.is_empty, "scheduler stalled with work left"
        sched.update(plan, runner.execute(plan))
        sched.pool.check_invariants()
        steps += 1
        if on_step:
            on_step(steps)
        assert steps < 100_000
    return steps


def new_scheduler(num_pages: int, page_size: int = 4, budget: int = 64, seqs: int = 16,
                  max_len: int | None = None, prefix: bool = True) -> tuple[Scheduler, FakeRunner]:
    pool = PagePool(num_pages, page_size, enable_prefix_cache=prefix)
    options = SchedulingConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)
    config = SchedulerConfig(options, max_len or num_pages * page_size)
    return Scheduler(config, pool), FakeRunner(pool)


def test_no_page_leak_after_1000_random_requests_with_aborts() -> None:
    rng = random.Random(0)
    sched, runner = new_scheduler(num_pages=96, page_size=4, budget=48, seqs=12)
    shared = [rng.randrange(VOCAB - 2) for _ in range(20)]
    submitted = 0
    aborted = 0

    def churn(step: int) -> None:
        nonlocal submitted, aborted
        for _ in range(rng.randrange(0, 3)):
            if submitted < 1000:
                prefix = shared if rng.random() < 0.4 else None
                sched.add_request(make_request(f"r{submitted}", rng, rng.randrange(1, 12), rng.randrange(1, 40),
                                               with_media=rng.random() < 0.3, shared_prefix=prefix))
                submitted += 1
        if sched.requests and rng.random() < 0.15:
            victim = rng.choice(list(sched.requests))
            assert sched.abort(victim) is not None
            aborted += 1

    sched.add_request(make_request("first", rng, 4, 10))
    while submitted < 1000 or sched.has_unfinished:
        if not sched.has_unfinished:
            churn(0)
            continue
        run_to_completion(sched, runner, budget=48, on_step=churn)
    assert aborted > 50 and sched.num_preemptions > 0
    assert sched.pool.num_free == sched.pool.num_pages
    assert all(c == 0 for c in sched.pool.ref_count)
    assert sched.pool.hits > 0  # the shared prefix was served from the cache


def test_chunked_prefill_respects_budget_and_splits_long_prompts() -> None:
    rng = random.Random(1)
    sched, runner = new_scheduler(num_pages=200, page_size=8, budget=32, seqs=8)
    long = make_request("long", rng, 3, 150)
    sched.add_request(long)
    for i in range(5):
        sched.add_request(make_request(f"s{i}", rng, 5, rng.randrange(3, 20)))
    plan = sched.schedule()
    assert plan.num_tokens == 32 and plan.chunks[0].request is long and not plan.chunks[0].samples
    sched.update(plan, runner.execute(plan))
    chunk_sizes = [32]
    while long.status is RequestStatus.RUNNING:
        plan = sched.schedule()
        assert plan.num_tokens <= 32
        chunk_sizes += [c.num_tokens for c in plan.chunks if c.request is long]
        sched.update(plan, runner.execute(plan))
    run_to_completion(sched, runner, budget=32)
    assert sum(chunk_sizes[:5]) == 150  # the 150-token prompt went through in budget-sized pieces
    assert long.num_output_tokens == 3


def test_without_chunked_prefill_long_prompt_is_rejected() -> None:
    pool = PagePool(100, 4)
    options = SchedulingConfig(max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched = Scheduler(SchedulerConfig(options, max_model_len=400), pool)
    with pytest.raises(RequestRejected):
        sched.add_request(make_request("x", random.Random(0), 2, 40))
    assert pool.num_free == 100


def outputs_of(sched_factory, requests_factory) -> dict[str, list[int]]:
    sched, runner = sched_factory()
    requests = requests_factory()
    for r in requests:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert sched.pool.num_free == sched.pool.num_pages
    return {r.request_id: r.output_token_ids for r in requests}, sched


@pytest.mark.parametrize("prefix", [True, False])
def test_preempted_requests_resume_with_identical_tokens(prefix: bool) -> None:
    def requests():
        rng = random.Random(7)
        return [make_request(f"r{i}", rng, 20, rng.randrange(5, 30), with_media=i % 3 == 0) for i in range(10)]

    roomy, roomy_sched = outputs_of(lambda: new_scheduler(num_pages=400, prefix=prefix), requests)
    tight, tight_sched = outputs_of(lambda: new_scheduler(num_pages=14, page_size=4, max_len=56, prefix=prefix), requests)
    assert roomy_sched.num_preemptions == 0
    assert tight_sched.num_preemptions > 0
    assert tight == roomy


def test_prefix_cache_reuses_pages_only_for_same_media() -> None:
    sched, runner = new_scheduler(num_pages=64, page_size=4)
    base = list(range(1, 9)) + [PLACEHOLDER] * 8 + list(range(20, 30))

    def req(rid: str, image_hash: int) -> Request:
        media = [MediaInput("image", MediaSpan(8, 8, image_hash), None, (1, 4, 8))]
        return Request(rid, ProcessedPrompt(list(base), media), SamplingParams(max_tokens=2, temperature=0))

    first = req("a", 5)
    sched.add_request(first)
    run_to_completion(sched, runner)
    same = req("b", 5)
    other = req("c", 6)
    sched.add_request(same)
    sched.add_request(other)
    run_to_completion(sched, runner)
    assert same.num_cached_tokens == 24  # 26 tokens: six full pages, all but the last token's page
    assert other.num_cached_tokens == 8  # text before the image only
    assert same.output_token_ids == first.output_token_ids


def test_rejects_prompt_longer_than_context_without_allocating() -> None:
    sched, _ = new_scheduler(num_pages=10, page_size=4)
    with pytest.raises(RequestRejected):
        sched.add_request(make_request("big", random.Random(0), 1, 40))
    assert sched.pool.num_free == 10 and not sched.has_unfinished


def test_generation_is_capped_at_max_model_len() -> None:
    sched, runner = new_scheduler(num_pages=10, page_size=4)
    r = make_request("r", random.Random(0), 100, 30)
    sched.add_request(r)
    run_to_completion(sched, runner)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 40
