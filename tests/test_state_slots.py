"""The engine's per-sequence state slots (cache/state_pool.py) beside paged KV.

The engine tests run a toy model whose middle layer is a linear recurrence kept in a state slot
(testkit/toy_recurrent.py). Their oracle recomputes every token from scratch: one request per
generated token, the whole sequence as its prompt, in one prefill chunk from a zero state, with the
prefix cache off. Carrying state across decode steps, chunk boundaries, prefix-cache snapshots,
preemption and rejected draft tokens must give exactly those tokens in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.checkpoints import cached_checkpoint
from testkit.toy_recurrent import register, write_toy_recurrent
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.cache.state_pool import StatePool, StateSlots
from vlm_engine.engine import Engine
from vlm_engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def toy() -> Iterator[Path]:
    register()
    yield cached_checkpoint("toy-recurrent-v1", write_toy_recurrent)


def _engine(path: Path, **options: object) -> Engine:
    options.setdefault("kv_cache_tokens", 2048)
    return Engine(str(path), dtype="float32", **options)


def _prompts(count: int = 4) -> list[list[int]]:
    """Token-id prompts of different lengths (some longer than a page, not page-aligned)."""
    return [[(7 * i + 13 * j) % 900 + 20 for j in range(9 + 11 * i)] for i in range(count)]


def _recomputed(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens, each from a fresh request over the whole sequence so far (no carried state)."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        out = engine.generate([prompt + tokens], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        tokens += out[0].token_ids
    return tokens


def _check_idle(engine: Engine) -> None:
    engine.scheduler.check_invariants()
    assert engine.states is not None and engine.states.num_live_used == 0


@pytest.fixture(scope="module")
def oracle(toy: Path) -> dict[tuple[int, ...], list[int]]:
    engine = _engine(toy, enable_prefix_cache=False)
    return {tuple(p): _recomputed(engine, p, GREEDY.max_tokens) for p in _prompts()}


def test_incremental_decode_equals_recompute(toy: Path, oracle: dict) -> None:
    engine = _engine(toy)
    for prompt in _prompts():
        assert engine.generate([prompt], GREEDY)[0].token_ids == oracle[tuple(prompt)]
    _check_idle(engine)


@pytest.mark.parametrize("budget", [5, 16, 23])
def test_prefill_chunks_of_any_size(toy: Path, oracle: dict, budget: int) -> None:
    engine = _engine(toy, max_num_batched_tokens=budget, enable_prefix_cache=False)
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == [oracle[tuple(p)] for p in _prompts()]
    _check_idle(engine)


def test_batched_equals_alone(toy: Path, oracle: dict) -> None:
    engine = _engine(toy)
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == [oracle[tuple(p)] for p in _prompts()]
    _check_idle(engine)


def test_prefix_hit_resumes_from_a_snapshot(toy: Path) -> None:
    """A second turn extends the first turn's prompt: its hit ends at the first prompt's last full
    page, where a snapshot was kept, and the state resumes there."""
    engine = _engine(toy)
    first = _prompts()[3]  # 42 tokens: snapshot after page 2 (32 tokens)
    reply = engine.generate([first], GREEDY)[0].token_ids
    second = first + reply + [55, 66, 77]
    out = engine.generate([second], GREEDY)[0]
    assert out.cached_tokens == 32
    stats = engine.make_stats()  # what /metrics exports
    assert (stats.state_snapshot_hits, stats.state_slots_total) == (1, 64 + 16)
    assert 0 < stats.state_snapshots == stats.state_slots_used <= 16
    cold = _engine(toy, enable_prefix_cache=False)
    assert out.token_ids == _recomputed(cold, second, GREEDY.max_tokens)
    _check_idle(engine)


def test_no_hit_without_a_snapshot(toy: Path) -> None:
    """Cached KV pages past the last snapshot are not a hit: the state there is unknown."""
    engine = _engine(toy, state_snapshots=0)
    prompt = _prompts()[3]
    engine.generate([prompt], GREEDY)
    out = engine.generate([prompt + [5, 6]], GREEDY)[0]
    assert out.cached_tokens == 0


def test_preempted_equals_not(toy: Path, oracle: dict) -> None:
    engine = _engine(toy, kv_cache_tokens=96, max_model_len=96, page_size=16)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = engine.generate(_prompts(), params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [oracle[tuple(p)] for p in _prompts()]
    _check_idle(engine)


def test_ngram_speculation_equals_plain_with_rejected_drafts(toy: Path) -> None:
    repetitive = [[31, 32, 33, 34] * 6 + [31, 32], [40, 41, 42] * 7 + [40]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = _engine(toy).generate(repetitive, params)
    engine = _engine(toy, speculative="ngram", num_speculative_tokens=3)
    spec = engine.generate(repetitive, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # some drafts were rolled back
    _check_idle(engine)


def test_abort_frees_the_slot(toy: Path) -> None:
    engine = _engine(toy)
    request_id = engine.add_request(_prompts()[2], GREEDY)
    engine.step()
    assert engine.states is not None and engine.states.num_live_used == 1
    engine.abort(request_id)
    _check_idle(engine)
    assert engine.kv_bytes_in_use() == engine.states.num_snapshots * engine.states.slot_bytes


def test_state_pool_snapshots_are_lru_and_go_with_their_pages() -> None:
    states = StatePool(StateSlots(num_live=2, num_checkpoints=2, num_snapshots=2))
    pages = PagePool(8, 4)
    pages.on_evict = states.drop
    a, b = states.allocate(), states.allocate()
    assert (a, b) == (0, 1) and states.allocate() is None
    states.snapshot(101, a)
    states.snapshot(102, b)
    states.restore(101, b)  # 101 is now the most recent
    states.snapshot(103, a)  # evicts 102
    assert [states.has_snapshot(k) for k in (101, 102, 103)] == [True, False, True]
    assert states.take_copies() == [(0, 4), (1, 5), (4, 1), (0, 5)]
    assert states.take_copies() == []
    page = pages.allocate(1)
    assert page is not None
    pages.register(page[0], 103)
    pages.free(page)
    pages.allocate(8)  # reuses the page: its key 103 is evicted, and the snapshot with it
    assert not states.has_snapshot(103) and states.num_snapshots == 1
    states.restore_checkpoint(b)
    assert states.take_copies() == [(3, 1)]
    states.free(a)
    states.free(b)
    with pytest.raises(RuntimeError):
        states.free(a)
    states.check_invariants([])
