"""One step's numbers, and the cumulative record behind `Engine.make_stats()`.

`StepStats` says what a step did and where its time went (host overhead is a first-class
number). `StepRecorder` adds steps to an `ipc.CoreStats`: cumulative counters always, per-step
histograms when asked (the server's `--disable-log-stats` turns them off). The engine fills in the
gauges (pages, queues, caches) when a snapshot is taken; the server exports it as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlm_engine import ipc

if TYPE_CHECKING:
    from vlm_engine.cache.encoder_cache import EncoderCache
    from vlm_engine.runner.model_runner import RunnerOutput
    from vlm_engine.scheduler.batch import SchedulerOutput
    from vlm_engine.scheduler.scheduler import Scheduler
    from vlm_engine.speculative.speculator import SpeculationStats


@dataclass
class StepStats:
    """What one step did and where its time went."""

    num_tokens: int = 0
    num_seqs: int = 0
    schedule_s: float = 0.0
    propose_s: float = 0.0  # speculative decoding: proposing drafts (a draft model's forwards)
    forward_s: float = 0.0
    update_s: float = 0.0  # applying the tokens; the caller adds the time it spends on its outputs
    mask_s: float = 0.0  # grammar masks, built on a host thread during the forward (not added to it)
    mask_wait_s: float = 0.0  # of forward_s, the wait for masks after the forward finished
    prepare_s: float = 0.0  # of forward_s, building the step's inputs on the host
    num_decode_tokens: int = 0  # tokens of decoding chunks, drafts included; the rest is prefill
    num_cached_tokens: int = 0  # prefix-cache hits of the requests admitted for the first time
    num_generated_tokens: int = 0  # tokens appended to requests
    num_preemptions: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @classmethod
    def of_step(
        cls,
        plan: SchedulerOutput,
        ran: RunnerOutput,
        num_generated_tokens: int,
        schedule_s: float,
        propose_s: float,
        forward_s: float,
        update_s: float,
    ) -> StepStats:
        """The numbers of a step that ran `plan`, whose forward pass gave `ran`."""
        return cls(
            num_tokens=plan.num_tokens,
            num_seqs=len(plan.chunks),
            schedule_s=schedule_s,
            propose_s=propose_s,
            forward_s=forward_s,
            update_s=update_s,
            mask_s=ran.mask_s,
            mask_wait_s=ran.mask_wait_s,
            prepare_s=ran.prepare_s,
            num_decode_tokens=plan.num_decode_tokens,
            num_cached_tokens=plan.num_cached_tokens,
            num_generated_tokens=num_generated_tokens,
            num_preemptions=len(plan.preempted),
        )


class StepRecorder:
    """Cumulative counters and per-step histograms over the steps recorded since the last reset."""

    def __init__(self, pages_total: int) -> None:
        self.stats = ipc.CoreStats(pages_total=pages_total)

    def reset(self) -> None:
        self.stats = ipc.CoreStats(pages_total=self.stats.pages_total)

    def record(self, step: StepStats, spec_lengths: Sequence[int] | None = None, histograms: bool = False) -> None:
        """Add one step. `spec_lengths`: with speculative decoding on, the tokens each verified draft
        emitted this step (None: off)."""
        s = self.stats
        s.steps += 1
        s.generation_tokens += step.num_generated_tokens
        s.prefill_tokens += step.num_prefill_tokens
        s.preemptions += step.num_preemptions
        s.grammar_mask_s += step.mask_s
        if not histograms:
            return
        s.step_schedule_s.observe(step.schedule_s)
        s.step_forward_s.observe(step.forward_s)
        s.step_update_s.observe(step.update_s)
        s.step_batch_size.observe(step.num_seqs)
        s.step_prefill_tokens.observe(step.num_prefill_tokens)
        s.step_cached_tokens.observe(step.num_cached_tokens)
        s.step_decode_tokens.observe(step.num_decode_tokens)
        if spec_lengths is not None:
            s.step_spec_propose_s.observe(step.propose_s)
            for length in spec_lengths:
                s.spec_acceptance_length.observe(length)

    def snapshot(
        self, scheduler: Scheduler, encoder_cache: EncoderCache, speculation: SpeculationStats | None
    ) -> ipc.CoreStats:
        """The counters with the gauges filled in as they are now (pages, queues, caches). The
        record is live: encode or copy it before the next step."""
        s = self.stats
        pool = scheduler.pool
        s.pages_used, s.pages_cached = pool.num_used, pool.num_cached
        s.running, s.waiting = len(scheduler.running), len(scheduler.waiting)
        s.prompt_tokens = scheduler.num_prompt_tokens
        s.prefix_cache_queries, s.cached_prompt_tokens = scheduler.num_prefix_queries, scheduler.num_prefix_hits
        s.mm_cache_hits, s.mm_cache_queries = encoder_cache.hits, encoder_cache.hits + encoder_cache.misses
        states = scheduler.states
        if states is not None:
            s.state_slots_used, s.state_slots_total = states.num_used, states.slots.total
            s.state_snapshots, s.state_snapshot_hits = states.num_snapshots, states.snapshot_hits
        if speculation is not None:
            s.spec_drafts, s.spec_draft_tokens = speculation.num_drafts, speculation.num_draft_tokens
            s.spec_accepted_tokens = speculation.num_accepted_tokens
        return s
