"""One owner for a request's life: every way a request ends (EOS, stop token, length, completed
grammar, stop string, abort, logits not finite, a rejected token, a failed batch) finishes it in the
scheduler, which frees its pages; the runner state's hooks run on preemption and finish; and the
one output processor gives the same text in-process and in the detokenizer process."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from vlm_engine import Engine, SamplingParams, ipc
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.config import SchedulingConfig
from vlm_engine.engine import StepFailed
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.runner.model_runner import RunnerOutput
from vlm_engine.scheduler import Request, RequestStatus, SampledToken, Scheduler, SchedulerConfig
from vlm_engine.scheduler.request import RunnerState
from vlm_engine.server.detokenizer_proc import Detokenizer, load_tokenizer

PROMPT = "Tell me a story about the sea"
FREE = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=2048, max_model_len=512)


@pytest.fixture
def finishes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, RequestStatus]]:
    """Every finish the scheduler performs, as (request id, status) — the only place pages go back."""
    seen: list[tuple[str, RequestStatus]] = []
    real = engine.scheduler._finish

    def spy(request: Request, status: RequestStatus) -> None:
        seen.append((request.request_id, status))
        real(request, status)

    monkeypatch.setattr(engine.scheduler, "_finish", spy)
    return seen


def run_to_end(engine: Engine) -> dict[str, Any]:
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            engine.scheduler.check_invariants()
            if out.finished:
                final[out.request_id] = out
    return final


def assert_whole(engine: Engine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished and not engine.scheduler.requests
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.make_stats().pages_used == 0


def free_run(engine: Engine) -> Any:
    return engine.generate([PROMPT], FREE)[0]


@pytest.mark.parametrize("kind", ["length", "stop_token", "eos", "stop_string", "grammar"])
def test_finishes_decided_by_a_step(engine: Engine, finishes: list, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    free = free_run(engine)
    finishes.clear()
    params = {
        "length": FREE,
        "stop_token": SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[free.token_ids[5]]),
        "eos": SamplingParams(max_tokens=16, temperature=0),
        "stop_string": SamplingParams(max_tokens=16, temperature=0, stop=[free.text[4:7]], ignore_eos=True),
        "grammar": SamplingParams(max_tokens=16, temperature=0, choice=["yes", "no"]),
    }[kind]
    if kind == "eos":  # this request's EOS is a token the model is about to produce
        monkeypatch.setattr(engine, "eos_token_ids", frozenset({free.token_ids[3]}))
    rid = engine.add_request(PROMPT, params)
    out = run_to_end(engine)[rid]
    want = "length" if kind == "length" else "stop"
    assert out.finish_reason == want
    assert finishes == [(rid, RequestStatus(want))]
    assert_whole(engine)
    if kind == "stop_string":  # tokens after the stop string never happened
        assert out.stop_reason == free.text[4:7] and out.text == free.text[: free.text.index(free.text[4:7])]
        assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    if kind in ("stop_token", "eos"):
        assert out.token_ids == free.token_ids[: len(out.token_ids)] and out.stop_reason == out.token_ids[-1]


def test_aborts_and_stop_strings_from_outside_the_step(engine: Engine, finishes: list) -> None:
    a = engine.add_request(PROMPT, FREE)
    b = engine.add_request("Another prompt", FREE)
    c = engine.add_request("A third one", FREE)
    waiting = engine.add_request("Never scheduled", FREE)
    for _ in range(3):
        engine.step()
    aborted = engine.abort(a)
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.finished
    assert engine.abort(a) is None  # already finished: nothing happens twice
    engine.scheduler.check_invariants()
    # The server's core: an Abort from the client, and Abort(stopped=True) from the detokenizer.
    assert [r.finish_reason for r in engine.abort_requests([b, "unknown"])] == ["abort"]
    assert [r.finish_reason for r in engine.abort_requests([c, waiting], stop_string=True)] == ["stop", "stop"]
    assert finishes == [
        (a, RequestStatus.FINISHED_ABORTED),
        (b, RequestStatus.FINISHED_ABORTED),
        (c, RequestStatus.FINISHED_STOPPED),
        (waiting, RequestStatus.FINISHED_STOPPED),
    ]
    assert_whole(engine)


def test_requests_that_fail_alone_and_failed_batches(engine: Engine, finishes: list, monkeypatch) -> None:
    poisoned = engine.add_request(PROMPT, FREE)
    rejected = engine.add_request("Answer yes or no", SamplingParams(max_tokens=8, temperature=0, choice=["yes", "no"]))
    healthy = engine.add_request("Another prompt", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runner = engine.runner
    real_execute = runner.execute

    def nan_logits(plan: Any) -> RunnerOutput:  # as if the poisoned request's logits were NaN
        ran = real_execute(plan)
        if poisoned not in ran.sampled:
            return ran
        sampled = {rid: tokens for rid, tokens in ran.sampled.items() if rid != poisoned}
        return dataclasses.replace(ran, sampled=sampled, nonfinite=[*ran.nonfinite, poisoned])

    monkeypatch.setattr(runner, "execute", nan_logits)
    monkeypatch.setattr(engine.scheduler.requests[rejected].grammar, "accept", lambda *args: None)
    step = engine.step_tokens()
    assert step is not None
    assert [(r.request_id, r.finish_reason) for r, _ in step.failed] == [(poisoned, "abort"), (rejected, "abort")]
    assert "not finite" in step.failed[0][1] and "grammar" in step.failed[1][1]
    assert [r.request_id for r, _ in step.tokens] == [healthy]
    engine.scheduler.check_invariants()

    def broken(plan: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(runner, "execute", broken)
    other = engine.add_request("Yet another", FREE)
    with pytest.raises(StepFailed) as failed:
        engine.step_tokens()
    engine.scheduler.check_invariants()  # nothing was freed by the failure itself
    assert engine.scheduler.requests.keys() == {healthy, other}
    assert [r.request_id for r in engine.fail_batch(failed.value.plan)] == [healthy, other]
    assert finishes == [
        (poisoned, RequestStatus.FINISHED_ABORTED),
        (rejected, RequestStatus.FINISHED_ABORTED),
        (healthy, RequestStatus.FINISHED_ABORTED),
        (other, RequestStatus.FINISHED_ABORTED),
    ]
    assert_whole(engine)


def test_make_stats_counts_the_steps(engine: Engine) -> None:
    engine.reset_counters()
    before = engine.make_stats()
    assert before.steps == before.generation_tokens == before.prompt_tokens == 0
    outs = engine.generate([PROMPT, "Another prompt"], FREE)
    stats = engine.make_stats()
    assert stats.generation_tokens == sum(len(o.token_ids) for o in outs)
    assert stats.prompt_tokens == sum(o.prompt_tokens for o in outs) == stats.prefill_tokens
    assert stats.steps == 16 and stats.pages_total == engine.num_pages and stats.running == stats.waiting == 0
    assert stats.step_forward_s.count == 0  # histograms only where asked (the server's core)


# ---- runner state hooks (no model) -----------------------------------------------------------------


class CountingState(RunnerState):
    def __init__(self) -> None:
        super().__init__()
        self.preempted = self.finished = 0

    def on_preempt(self) -> None:
        self.preempted += 1
        super().on_preempt()

    def on_finish(self) -> None:
        self.finished += 1
        super().on_finish()


def test_runner_state_hooks_run_on_preempt_and_finish() -> None:
    rng = random.Random(0)
    options = SchedulingConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(SchedulerConfig(options, max_model_len=40), PagePool(12, 4))
    requests = []
    for i in range(6):
        request = Request(f"r{i}", ProcessedPrompt([rng.randrange(50) for _ in range(8)]), SamplingParams(max_tokens=20))
        request.runner_state = CountingState()
        sched.add_request(request)
        requests.append(request)
    preempted = set()
    while sched.has_unfinished:
        plan = sched.schedule()
        for victim in plan.preempted:  # its KV went with its pages; the generator stays with the request
            state = victim.runner_state
            assert state.media_embeddings == {} and state.draft_computed == 0 and state.generator is not None
            preempted.add(victim.request_id)
        for chunk in plan.chunks:  # what the runner and a draft model would keep
            state = chunk.request.runner_state
            if state.generator is None:
                state.generator = torch.Generator()
            state.media_embeddings[0] = torch.zeros(2)
            state.draft_computed = chunk.end
        sampled = {c.request.request_id: [SampledToken(rng.randrange(50))] for c in plan.chunks if c.samples}
        sched.update(plan, sampled)
        sched.check_invariants()
    assert preempted, "the pool was meant to be tight enough to preempt"
    for request in requests:
        state = request.runner_state
        assert state.finished == 1 and state.preempted == request.num_preemptions
        assert state.generator is None and state.media_embeddings == {} and state.draft_computed == 0
    assert sched.pool.num_free == sched.pool.num_pages


# ---- one output processor -------------------------------------------------------------------------


def served(
    detok: Detokenizer, rid: str, stop: str, steps: list[ipc.TokenOutput]
) -> tuple[list[ipc.Delta], list[str]]:
    """The detokenizer process's logic over the core's outputs for one request."""
    deltas, stopped = [], []
    for i, out in enumerate(steps):
        added = [ipc.DetokParams(rid, (stop,), None, 7)] if i == 0 else []
        api, stop_ids = detok.process(ipc.EngineOutputs(added=added, outputs=[out]))
        deltas += api.deltas
        stopped += stop_ids
    return deltas, stopped


def test_output_processor_is_the_same_in_process_and_served(engine: Engine, tiny_vlm_dir: Path) -> None:
    free = free_run(engine)
    stop = free.text[5:8]
    detok = Detokenizer(load_tokenizer(str(tiny_vlm_dir)))

    # In-process, step by step; the core's TokenOutput for each step goes to the detokenizer logic.
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True))
    in_process, core_outputs = [], []
    while engine.has_unfinished:
        step = engine.step_tokens()
        assert step is not None
        for request, tokens in step.tokens:
            finished = request.status.finished
            core_outputs.append(
                ipc.TokenOutput(rid, [t.token_id for t in tokens], finished, request.finish_reason,
                                request.stop_token_id if finished else None)
            )  # fmt: skip
            in_process.append(engine._on_tokens(request, tokens))
    deltas, stopped = served(detok, rid, stop, core_outputs)
    assert stopped == [rid]  # the server's core still ran it: the detokenizer tells it to stop
    assert [(d.token_ids, d.text, d.finished, d.finish_reason) for d in deltas] == [
        (o.new_token_ids, o.new_text, o.finished, o.finish_reason) for o in in_process
    ]
    final = in_process[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop and final.text == free.text[: free.text.index(stop)]
    assert deltas[-1].completion_tokens == len(final.token_ids)
    assert_whole(engine)
    # The core answers Abort(stopped=True) with the request's final output: dropped, with the stream.
    out, _ = detok.process(ipc.EngineOutputs(outputs=[ipc.TokenOutput(rid, [], True, "stop")]))
    assert out.deltas == [] and detok.streams == {}

    # Several tokens an output (speculative steps): the stop string cuts the tokens after it.
    ids = free.token_ids
    sizes = [1, 3, 2, 4, 6, 16]
    chunks, at = [], 0
    for size in sizes:
        chunks.append(ids[at : at + size])
        at += size
    deltas, stopped = served(detok, "many", stop, [ipc.TokenOutput("many", c) for c in chunks if c])
    assert stopped == ["many"] and deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].completion_tokens == len(final.token_ids)
    # The core's output for it, once it has stopped, is dropped, and the stream with it.
    out, _ = detok.process(ipc.EngineOutputs(outputs=[ipc.TokenOutput("many", ids[:1], True, "stop")]))
    assert out.deltas == [] and detok.streams == {}
