"""Speculative decoding: proposers, verification, rollback, and the engine with it on vs off.

Greedy output must be token-exact with speculation on and off (SmolLM2's real weights, the tiny
Qwen2-VL with images, n-gram and draft-model proposers, mixed batches, preemption, stop strings,
structured output); sampled output must follow the target distribution (chi-square, on
hand-set bigram models whose exact distribution is known); and rejected drafts must never leak
a KV page (the scheduler's invariants are checked after every step).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from testkit.checkpoints import cached_checkpoint
from testkit.drafts import BIGRAM_TOKENS, bigram_distribution, write_bigram_qwen2, write_random_llama
from tests.conftest import make_image
from vlm_engine import Engine, SamplingParams
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.config import SchedulingConfig
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.runner.verify import verify_greedy, verify_sampled
from vlm_engine.scheduler import Request, SampledToken, Scheduler, SchedulerConfig
from vlm_engine.speculative.ngram import ngram_lookup

SMOLLM2 = "SmolLM2-135M-Instruct"
# fp32 everywhere: its linears give a row the same result whatever the batch (bf16, the 'auto'
# dtype on CPUs with bf16 dot products, does not promise that bit for bit).
NO_BATCH_LIMIT = 1000  # speculative_disable_batch_size that never turns speculation off


def run_checked(engine: Engine, prompts: list[Any], params: list[SamplingParams]) -> list[Any]:
    """Generate step by step, checking the scheduler's page invariants after every step."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final: dict[str, Any] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.pool.num_used == 0, "pages still held after every request finished"
    return [final[i] for i in ids]


# ---- n-gram lookup and verification (no model) ------------------------------------------------------


def test_ngram_lookup_prefers_the_longest_and_latest_match() -> None:
    tokens = np.array([1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 8, 5, 1, 2, 3])
    # Suffix (1, 2, 3) occurs at 0 and 8; the latest earlier one is followed by 8, 5.
    assert ngram_lookup(tokens, 1, 3, 2) == [8, 5]
    assert ngram_lookup(tokens, 1, 3, 10) == [8, 5, 1, 2, 3]
    assert ngram_lookup(np.array([5, 6, 7]), 1, 3, 4) == []  # nothing repeats
    assert ngram_lookup(np.array([4, 4]), 1, 3, 3) == [4]  # a one-token match at the very start
    assert ngram_lookup(np.array([1, 2, 9, 2]), 2, 3, 3) == []  # min_n = 2: the single 2 does not count


def test_verify_greedy_keeps_the_matching_prefix_and_adds_the_target_token() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 1, 7, 8], [5, 6, 7]) == [5, 1]
    assert verify_greedy([2, 6, 7, 8], [5, 6, 7]) == [2]
    assert verify_greedy([3], []) == [3]


BIGRAM_TARGET = [[1.0, 0.2, -0.5, 0.0], [0.0, 1.5, 0.3, -1.0], [-0.3, 0.0, 0.9, 0.6], [0.8, -0.8, 0.1, 0.4],
                 [0.0, 0.0, 0.0, 0.0]]  # fmt: skip
BIGRAM_DRAFT = [[0.2, 1.0, 0.0, -0.5], [0.5, 0.5, 0.5, 0.5], [-1.0, 0.4, 0.9, 0.0], [0.0, 0.0, 1.2, -0.6],
                [0.3, 0.0, 0.0, -0.3]]  # fmt: skip


def _chi_square_p(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float]) -> float:
    """p-value of observed outcome counts against exact probabilities (rare cells pooled)."""
    n = sum(counts.values())
    assert set(counts) <= {k for k, p in expected.items() if p > 0}, "an impossible outcome was sampled"
    keys = sorted(expected, key=lambda k: -expected[k])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        if expected[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(expected[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += expected[k] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue)


def test_rejection_sampling_follows_the_target_distribution() -> None:
    """verify_sampled on a 4-token bigram: the first three emitted tokens' joint distribution
    equals the target chain's, for point-mass drafts (n-gram) and for drafts drawn from q."""
    m = 4
    target = torch.tensor(BIGRAM_TARGET[:m])
    draft_q = torch.tensor(BIGRAM_DRAFT[:m]).softmax(-1)
    p = target.softmax(-1)
    params = SamplingParams(temperature=1.0, max_tokens=3)
    gen = torch.Generator().manual_seed(7)
    expected = {(a, b, c): float(p[0, a] * p[a, b] * p[b, c]) for a, b, c in itertools.product(range(m), repeat=3)}
    for kind in ("point", "draft"):
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        for _ in range(6000):
            # Context token 0; a draft of two tokens, then the target's logits at each position.
            if kind == "point":
                draft, q = [1, 1], None
            else:
                d1 = int(torch.multinomial(draft_q[0], 1, generator=gen))
                d2 = int(torch.multinomial(draft_q[d1], 1, generator=gen))
                draft, q = [d1, d2], torch.stack([draft_q[0], draft_q[d1]])
            logits = torch.stack([target[0], target[draft[0]], target[draft[1]]])
            out = verify_sampled(logits, draft, q, params, gen)
            accepted += len(out) - 1
            while len(out) < 3:  # continue one token at a time after a rejection
                out.append(int(torch.multinomial(p[out[-1]], 1, generator=gen)))
            key = tuple(out[:3])
            counts[key] = counts.get(key, 0) + 1
        assert 0 < accepted < 2 * 6000  # both acceptances and rejections happened
        assert _chi_square_p(counts, expected) > 1e-3, kind


def test_policy_pauses_requests_whose_drafts_fail_and_large_batches() -> None:
    from vlm_engine.scheduler.batch import ScheduledChunk
    from vlm_engine.speculative import Speculator

    class NoProposer:
        name = "none"

        def propose(self, chunks: list[ScheduledChunk]) -> None:
            pass

    spec = Speculator(NoProposer(), num_tokens=4, disable_batch_size=8)
    request = Request("r", ProcessedPrompt([1, 2, 3]), SamplingParams(max_tokens=500))

    def verify(accepted: int) -> None:
        chunk = ScheduledChunk(request, 2, 1, num_lookahead=4)
        chunk.set_draft([7, 7, 7, 7])
        spec.observe(chunk, accepted + 1)

    spec.begin_step(num_running=1)
    assert spec.lookahead(request) == 4
    pauses = []
    for _ in range(4):  # keeps failing: paused 4, 8, 16, 32 steps
        while spec.lookahead(request) == 4:
            verify(0)
        steps = 1
        while spec.lookahead(request) == 0:
            steps += 1
        pauses.append(steps)
    assert pauses == [4, 8, 16, 32]
    verify(4)  # a retry that is accepted resets the back-off
    assert request.speculation.backoff == 4 and spec.lookahead(request) == 4
    assert spec.stats.num_accepted_tokens == 4 and request.speculation.acceptance_length > 1
    spec.begin_step(num_running=8)  # compute-bound batch: nobody speculates
    assert spec.lookahead(request) == 0


# ---- scheduler: draft slots and rollback (no model) -----------------------------------------------------


class DraftingRunner:
    """Stores each slot's token; checks every step reads exactly the request's tokens; proposes
    random drafts and accepts a random prefix of each, so rollback happens all the time."""

    def __init__(self, pool: PagePool, rng: random.Random) -> None:
        self.ps, self.rng = pool.page_size, rng
        self.slots = np.full(pool.num_pages * pool.page_size, -1, dtype=np.int64)

    def slot_ids(self, request: Request, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        return np.asarray(request.page_ids)[pos // self.ps] * self.ps + pos % self.ps

    def step(self, sched: Scheduler) -> None:
        plan = sched.schedule()
        assert not plan.is_empty
        sampled = {}
        for chunk in plan.chunks:
            r = chunk.request
            if chunk.num_lookahead:
                chunk.set_draft([self.rng.randrange(50) for _ in range(self.rng.randint(0, chunk.num_lookahead))])
            assert chunk.start == r.num_computed_tokens and len(r.page_ids) * self.ps >= chunk.end
            np.testing.assert_array_equal(self.slots[self.slot_ids(r, 0, chunk.start)], r.token_ids[: chunk.start])
            self.slots[self.slot_ids(r, chunk.start, chunk.end)] = chunk.input_ids()
            if chunk.samples:
                keep = self.rng.randint(0, len(chunk.draft))
                sampled[r.request_id] = [SampledToken(t) for t in chunk.draft[:keep] + [50 + self.rng.randrange(50)]]
        sched.update(plan, sampled)
        sched.check_invariants()


def test_rollback_keeps_only_accepted_kv_and_frees_empty_pages() -> None:
    rng = random.Random(3)
    pool = PagePool(num_pages=40, page_size=4)
    options = SchedulingConfig(max_num_seqs=6, max_num_batched_tokens=48)
    sched = Scheduler(SchedulerConfig(options, max_model_len=120), pool)
    sched.lookahead = lambda request: 6
    runner = DraftingRunner(pool, rng)
    for i in range(16):
        prompt = [rng.randrange(50) for _ in range(rng.randint(3, 30))]
        sched.add_request(Request(f"r{i}", ProcessedPrompt(prompt), SamplingParams(max_tokens=rng.randint(5, 40))))
    steps = 0
    while sched.has_unfinished:
        runner.step(sched)
        steps += 1
        assert steps < 2000
    assert pool.num_used == 0 and sched.num_preemptions > 0  # the pool was tight enough to preempt


# ---- engine: greedy exactness ---------------------------------------------------------------------------------

COPY_TEXT = (
    "Order 55123: 3 x blue ceramic mugs, 1 x walnut cutting board, 2 x linen napkins (grey), "
    "ship to 14 Harbour Road, Whitby, YO21 3PU, United Kingdom."
)


def smollm2_prompts(engine: Engine) -> tuple[list[Any], list[SamplingParams]]:
    chats = [
        [{"role": "user", "content": f"Repeat this text exactly, word for word:\n{COPY_TEXT}"}],
        [{"role": "user", "content": "Write two sentences about the sea."}],
        [{"role": "user", "content": f"Copy the address from this order: {COPY_TEXT}"}],
        [{"role": "user", "content": "List the numbers from one to twelve, in words, separated by commas."}],
    ]
    prompts = [engine.process_messages(c) for c in chats]
    params = [
        SamplingParams(max_tokens=48, temperature=0),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop=["Whitby"]),
        SamplingParams(max_tokens=40, temperature=0),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[Engine, list[Any]]:
    engine = Engine(SMOLLM2, dtype="float32", kv_cache_tokens=4096)
    prompts, params = smollm2_prompts(engine)
    return engine, run_checked(engine, prompts, params)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("draft") / "smollm2-draft", vocab_size=49152, seed=1)


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_smollm2_greedy_is_token_exact_with_speculation(method: str, smollm2_reference, draft_dir: Path) -> None:
    _, reference = smollm2_reference
    spec = {"ngram": "ngram", "draft": f"draft:{draft_dir}", "self-draft": f"draft:{SMOLLM2}"}[method]
    engine = Engine(
        SMOLLM2, dtype="float32", kv_cache_tokens=4096, speculative=spec, speculative_disable_batch_size=NO_BATCH_LIMIT
    )
    prompts, params = smollm2_prompts(engine)
    outputs = run_checked(engine, prompts, params)
    for got, want in zip(outputs, reference):
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
    assert outputs[2].stop_reason == "Whitby"
    for got, want in zip(outputs[1].logprobs, reference[1].logprobs):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method != "draft":  # the copy prompts repeat; a random draft model is (almost) never right
        assert stats.num_accepted_tokens > 0
        # Speculation produced several tokens in a step: fewer steps than tokens.
        assert stats.num_accepted_tokens >= 10


def test_smollm2_structured_output_with_speculation(smollm2_reference) -> None:
    engine_off, _ = smollm2_reference
    schema = {
        "type": "object",
        "properties": {"order": {"type": "integer"}, "city": {"type": "string"}, "postcode": {"type": "string"}},
        "required": ["order", "city", "postcode"],
        "additionalProperties": False,
    }
    chat = [{"role": "user", "content": f"Extract order number, city and postcode as JSON: {COPY_TEXT}"}]
    params = [SamplingParams(max_tokens=n, temperature=0, json_schema=schema) for n in (120, 28)]
    engine = Engine(
        SMOLLM2,
        dtype="float32",
        kv_cache_tokens=4096,
        speculative="ngram",
        speculative_disable_batch_size=NO_BATCH_LIMIT,
    )
    want = engine_off.generate([engine_off.process_messages(chat)] * 2, params)
    got = run_checked(engine, [engine.process_messages(chat)] * 2, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert json.loads(g.text).keys() == {"order", "city", "postcode"}  # valid, even when cut short
    assert engine.speculator.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def vlm_conversations() -> list[list[dict[str, Any]]]:
    def user(*parts: Any) -> list[dict[str, Any]]:
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
        return [{"role": "user", "content": content}]

    return [
        user(make_image(64, 48, 1), "What is in this picture?"),
        [{"role": "user", "content": "Tell me a story about a red fox."}],
        user("Compare these:", make_image(96, 40, 2), make_image(36, 84, 3), "Which is taller?"),
        user(make_image(120, 120, 4), "Describe it in detail."),
    ]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tiny_qwen2_vl_with_images_is_token_exact(method: str, tiny_vlm_dir: Path, vlm_conversations) -> None:
    """Mixed batch (text and images), a KV pool small enough to preempt: same tokens on and off."""
    draft = cached_checkpoint("tiny-qwen2-vl-llama-draft-v1", lambda p: write_random_llama(p, 2048, seed=2))
    spec = "ngram" if method == "ngram" else f"draft:{draft}"
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 64, 32, 48)]
    outputs = {}
    for speculative in (None, spec):
        engine = Engine(
            str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=256, max_num_batched_tokens=128,
            speculative=speculative, speculative_disable_batch_size=NO_BATCH_LIMIT,
        )  # fmt: skip
        prompts = [engine.process_messages(c) for c in vlm_conversations]
        outputs[speculative] = run_checked(engine, prompts, params)
        if speculative is not None:
            assert engine.speculator.stats.num_draft_tokens > 0
            assert engine.scheduler.num_preemptions > 0
    for got, want in zip(outputs[spec], outputs[None]):
        assert got.token_ids == want.token_ids


# ---- engine: sampled outputs follow the target distribution ---------------------------------------------


@pytest.fixture(scope="module")
def bigram_models() -> tuple[Path, Path]:
    target = cached_checkpoint("bigram-qwen2-target-v2", lambda p: write_bigram_qwen2(p, BIGRAM_TARGET))
    draft = cached_checkpoint("bigram-qwen2-draft-v2", lambda p: write_bigram_qwen2(p, BIGRAM_DRAFT))
    return target, draft


def _processed(probs: list[float], temperature: float, top_p: float) -> list[float]:
    """The sampler's temperature then top-p, applied to exact probabilities."""
    p = np.asarray(probs, dtype=np.float64) ** (1.0 / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    p = np.where(keep, p, 0.0)
    return (p / p.sum()).tolist()


@pytest.mark.parametrize(("method", "temperature", "top_p"), [("ngram", 1.0, 1.0), ("draft", 0.8, 0.9)])
def test_sampled_output_follows_the_target_distribution(method: str, temperature: float, top_p: float,
                                                        bigram_models) -> None:  # fmt: skip
    target, draft = bigram_models
    exact = bigram_distribution(target)
    a, b, c, d = BIGRAM_TOKENS
    prompt = [a, b, c, d, a, b, c, d, a, b]  # n-gram lookup proposes c, d, ...
    engine = Engine(
        str(target), dtype="float32", kv_cache_tokens=8192, max_num_seqs=64, numerics="exact",
        speculative="ngram" if method == "ngram" else f"draft:{draft}",
        num_speculative_tokens=3, speculative_disable_batch_size=NO_BATCH_LIMIT,
    )  # fmt: skip
    n = 3000
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True) for i in range(n)
    ]
    outputs = engine.generate([prompt] * n, params)
    counts: dict[tuple[int, ...], int] = {}
    for out in outputs:
        key = tuple(BIGRAM_TOKENS.index(t) for t in out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    step = {t: _processed(exact[t], temperature, top_p) for t in BIGRAM_TOKENS}
    expected = {
        (i, j, k): step[b][i] * step[BIGRAM_TOKENS[i]][j] * step[BIGRAM_TOKENS[j]][k]
        for i, j, k in itertools.product(range(4), repeat=3)
    }
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # acceptances and rejections both
    assert _chi_square_p(counts, expected) > 1e-3
