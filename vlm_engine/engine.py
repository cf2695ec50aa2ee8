"""The in-process engine: scheduler + model runner + prompt processing, no sockets.

Tests, the batch CLI and notebooks use it directly; the server runs the same core in its own
process. `step()` is the heartbeat: plan a batch, run it, apply the results. The engine only
assembles and steps: the model and its kernels come from `models/wiring.py`, the KV pools' sizes
from `cache/kv_budget.py`, and the scheduler's update applies a step's tokens (grammars, requests
that fail alone, every finish).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlm_engine import ipc
from vlm_engine.attention.backends import create_backend
from vlm_engine.cache.kv_budget import size_kv_pools
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.cache.state_pool import plan_state_pool
from vlm_engine.config import DEFAULT_MODEL, EngineConfig
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.kernels.cpu_isa import tier_description
from vlm_engine.metrics.core_stats import StepRecorder, StepStats
from vlm_engine.models.family import VLModel, text_config_of
from vlm_engine.models.registry import prompt_processor
from vlm_engine.models.wiring import eos_token_ids, wire_model
from vlm_engine.output_processor import OutputProcessor, RequestOutput, TokenLogprob, request_output
from vlm_engine.runner.model_runner import ModelRunner, RunnerOutput, attention_windows, kv_token_bytes
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler import Request, RequestStatus, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from vlm_engine.scheduler.window import WindowPages
from vlm_engine.speculative import build_speculator
from vlm_engine.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine", "RequestOutput", "StepFailed", "TokenLogprob", "TokenStep"]

Conversation = list[dict[str, Any]]
PromptInput = str | list[int] | ProcessedPrompt


@dataclass
class TokenStep:
    """One step at the token level: the plan that ran and the tokens it appended, in chunk order
    (several per request when a draft was accepted)."""

    plan: SchedulerOutput
    tokens: list[tuple[Request, list[SampledToken]]]
    stats: StepStats
    # Requests that failed alone (logits not finite, a token the grammar rejected), with why: the
    # scheduler finished them ("abort") and freed their pages; the rest of the batch went on.
    failed: list[tuple[Request, str]] = field(default_factory=list)


class StepFailed(RuntimeError):
    """The forward pass raised; `plan` says which requests were in the batch."""

    def __init__(self, plan: SchedulerOutput) -> None:
        super().__init__(f"the forward pass failed for {len(plan.chunks)} requests")
        self.plan = plan


class Engine:
    def __init__(self, model: str | EngineConfig = DEFAULT_MODEL, **options: Any) -> None:
        """`Engine("SmolLM2-135M-Instruct", dtype="float32", kv_cache_tokens=4096)`: any option of
        `EngineConfig` by its name (`from_flat` finds its section), or a ready `EngineConfig`."""
        if isinstance(model, EngineConfig) and options:
            raise TypeError("pass a ready EngineConfig or options, not both")
        self.config = model if isinstance(model, EngineConfig) else EngineConfig.from_flat(model=model, **options)
        wired = wire_model(self.config)
        self.source, self.hf_config, self.device, self.dtype = wired.source, wired.hf_config, wired.device, wired.dtype
        self.model, self.bf16_weights = wired.model, wired.bf16_weights
        self.processor = prompt_processor(self.source, self.hf_config, self.config.media)
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = eos_token_ids(self.source, self.hf_config, self.tokenizer)
        self.scheduler = self._plan_kv(wired.draft_model)
        cache, num_pages = self.config.cache, self.pool.num_pages
        backend = create_backend(self.config.model.attention_backend, self.device)
        runner_args = (self.device, self.dtype, num_pages, cache.page_size, backend)
        self.runner = ModelRunner(
            self.model, *runner_args, cache.encoder_cache_bytes, wired.fused_ops,
            num_window_pages=self.kv_pools.num_window_pages, states=self.states,
        )  # fmt: skip
        draft_runner = None
        if wired.draft_model is not None:
            draft_runner = ModelRunner(wired.draft_model, *runner_args, 0, wired.fused_ops, merge_media=False)
        self.speculator = build_speculator(self.config.speculative, draft_runner)
        if self.speculator is not None:
            self.scheduler.lookahead = self.speculator.lookahead
        self._grammars: Any = None  # GrammarCompiler, built on the first constrained request
        self._outputs = OutputProcessor(self.tokenizer)  # in-process text: `step()` only, never the server core
        self._ids = itertools.count()
        self.last_step = StepStats()
        self._recorder = StepRecorder(num_pages)
        spec = self.config.speculative
        logger.info(
            "engine ready: %s, %s, %s numerics, weights %s, attention %s, fused CPU ops %s, CPU tier %s, "
            "%d KV pages x %d tokens (sliding-window layers: %d), max_model_len %d, speculative %s",
            self.source.name, self.dtype, self.config.model.numerics, wired.weights, backend.name,
            wired.fused_ops is not None, tier_description(), num_pages, cache.page_size,
            self.kv_pools.num_window_pages, self.max_model_len,
            f"{spec.speculative} k={spec.num_speculative_tokens}" if spec.speculative else "off",
        )  # fmt: skip

    def _plan_kv(self, draft_model: VLModel | None) -> Scheduler:
        """Size the KV pools (a draft model's layers share the full-attention pages) and build the
        scheduler over them; the context is capped so that any one request fits the pool alone."""
        cache, options = self.config.cache, self.config.scheduler
        windows = attention_windows(self.model)
        token_bytes = kv_token_bytes([self.model] if draft_model is None else [self.model, draft_model], self.dtype)
        speculative = bool(self.config.speculative.speculative)
        snapshots = cache.state_snapshots if cache.enable_prefix_cache else 0
        self.states = plan_state_pool(self.model, self.dtype, options.max_num_seqs, speculative, snapshots)
        state_bytes = 0 if self.states is None else self.states.total_bytes
        self.kv_pools = size_kv_pools(*token_bytes, max(windows), cache, options, self.device, state_bytes)
        num_pages, num_window_pages = self.kv_pools.num_pages, self.kv_pools.num_window_pages
        model_len = self.config.model.max_model_len or int(text_config_of(self.hf_config).max_position_embeddings)
        self.max_model_len = min(model_len, num_pages * cache.page_size)
        self.pool = PagePool(num_pages, cache.page_size, cache.enable_prefix_cache)
        # Sliding-window layers' KV: a pool of its own whose pages go back as the windows move on.
        self.window_pool: PagePool | None = None
        window_pages = None
        if num_window_pages:
            self.window_pool = PagePool(num_window_pages, cache.page_size, cache.enable_prefix_cache)
            window_pages = WindowPages(self.window_pool, max(windows))
        if self.states is not None:
            self.pool.on_evict = self.states.drop  # a snapshot goes with its page
        atomic_spans = bool(getattr(self.model, "bidirectional_media", False))
        config = SchedulerConfig(options, self.max_model_len, max(0, num_pages // 100), atomic_spans)
        return Scheduler(config, self.pool, window_pages, self.states)

    def kv_bytes_in_use(self) -> int:
        """KV bytes of the pages that requests hold now, in both pools, and of the state slots in use
        (live, checkpoints, snapshots) of a model with linear-attention layers."""
        window_used = 0 if self.window_pool is None else self.window_pool.num_used
        states = 0 if self.states is None else self.states.bytes_in_use
        return self.kv_pools.bytes_in_use(self.pool.num_used, window_used) + states

    @property
    def grammars(self) -> Any:
        """The grammar compiler for this tokenizer (llguidance), built when first needed."""
        if self._grammars is None:
            from vlm_engine.structured.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        return self._grammars

    # ---- request API ---------------------------------------------------------------------------

    def process_messages(
        self,
        messages: Conversation,
        tools: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        return self.processor.from_messages(messages, tools=tools, mm_processor_kwargs=mm_processor_kwargs)

    def process_prompt(self, prompt: PromptInput) -> ProcessedPrompt:
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            return self.processor.from_text(prompt)
        return self.processor.from_token_ids(list(prompt))

    def add_request(
        self, prompt: PromptInput, sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (a prompt already processed too: the server's core passes the worker's);
        raises ValueError (PromptError, RequestRejected, StructuredOutputError) for input that can
        never run, before anything is allocated."""
        processed = self.process_prompt(prompt)
        sampling = sampling or SamplingParams()
        request = Request(request_id or f"req-{next(self._ids)}", processed, sampling, self.eos_token_ids)
        spec: StructuredOutput | None = sampling.structured_output
        if spec is not None:  # StructuredOutputError for a constraint that cannot be enforced
            request.grammar = self.grammars.matcher(spec, ignore_eos=sampling.ignore_eos)
        self.scheduler.add_request(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort one request; its final output, or None when it is unknown or already finished."""
        finished = self.scheduler.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED)
        return self._on_tokens(finished[0], []) if finished else None

    def abort_requests(self, request_ids: Iterable[str], stop_string: bool = False) -> list[Request]:
        """Finish requests from outside the step loop, freeing their pages: aborted (the client
        left) or, with `stop_string`, ended by a stop string found in their text ("stop"; the
        server's detokenizer found it). Unknown and finished ids are skipped; returns the requests
        finished, in order."""
        if not stop_string:
            return self._forget_text(self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED))
        live = [r for r in map(self.scheduler.requests.get, dict.fromkeys(request_ids)) if r is not None]
        for request in live:  # not the unknown ones, nor those whose own finish came first
            self.scheduler.end_at_stop_string(request)
        return self._forget_text(live)

    def fail_batch(self, plan: SchedulerOutput) -> list[Request]:
        """The forward pass of `plan` failed (`StepFailed.plan`): abort that batch's requests,
        freeing their pages; everyone else keeps running. Returns the requests aborted."""
        ids = [chunk.request.request_id for chunk in plan.chunks]
        return self._forget_text(self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED))

    def _forget_text(self, requests: list[Request]) -> list[Request]:
        for request in requests:  # finished without a last output: no text state may outlive them
            self._outputs.drop(request.request_id)
        return requests

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- one step: schedule -> execute -> update ---------------------------------------------

    def step_tokens(self) -> TokenStep | None:
        """The one token-level step (`step()`'s and the server core's): plan, run, and apply the tokens
        (the scheduler's update: grammars, failures, every finish); None when nothing could be
        scheduled. StepFailed if the forward pass raises (the caller decides: `fail_batch`)."""
        t0 = time.perf_counter()
        if self.speculator is not None:
            self.speculator.begin_step(len(self.scheduler.running))
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        t1 = time.perf_counter()
        ran, t2, t3 = self._execute(plan)
        update = self.scheduler.update(plan, ran.sampled, ran.nonfinite)
        times = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)  # schedule, propose, forward, update
        self.last_step = StepStats.of_step(plan, ran, update.num_tokens, *times)
        return TokenStep(plan, update.tokens, self.last_step, update.failed)

    def _execute(self, plan: SchedulerOutput) -> tuple[RunnerOutput, float, float]:
        """Propose drafts and run the forward pass (StepFailed if either raises), then note what
        the drafts achieved; returns the runner's output and when proposing and the forward ended."""
        try:
            if self.speculator is not None:
                self.speculator.propose(plan)
            proposed = time.perf_counter()
            ran = self.runner.execute(plan)
        except Exception as exc:
            raise StepFailed(plan) from exc
        ended = time.perf_counter()
        if self.speculator is not None:
            self.speculator.observe_step(plan, ran.sampled)
        return ran, proposed, ended

    # ---- in-process outputs and stats ----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns an output for every request that produced tokens."""
        result = self.step_tokens()
        if result is None:
            return []
        t0 = time.perf_counter()
        outputs = [self._on_tokens(request, tokens) for request, tokens in result.tokens]
        outputs += [self._on_tokens(request, []) for request, _ in result.failed]  # finish_reason "abort"
        result.stats.update_s += time.perf_counter() - t0
        self.record_step(result)
        return outputs

    def _on_tokens(self, request: Request, tokens: list[SampledToken]) -> RequestOutput:
        """A request's new tokens through the output processor; a stop string it finds in the text
        ends the request in the scheduler (the step's later tokens never happened)."""
        text = self._outputs.process_request(request, tokens)
        if text.stop_string is not None:
            self.scheduler.end_at_stop_string(request, request.num_output_tokens - len(tokens) + len(text.token_ids))
            self._outputs.drop(request.request_id)
        return request_output(request, text)

    def record_step(self, step: TokenStep, histograms: bool = False) -> None:
        """Add a step to the cumulative stats of `make_stats()` (`step()` does; the server's core,
        which adds the time it spent on its outputs to `step.stats.update_s`, too). `histograms`:
        also the per-step histograms."""
        spec = None if self.speculator is None else self.speculator.stats.last_step_lengths
        self._recorder.record(step.stats, spec, histograms)

    def make_stats(self) -> ipc.CoreStats:
        """The engine's numbers in one record: counters over the steps recorded since the last
        `reset_counters()`, gauges as they are now. The record is live: encode or copy it before
        the next step."""
        speculation = None if self.speculator is None else self.speculator.stats
        return self._recorder.snapshot(self.scheduler, self.runner.encoder_cache, speculation)

    def reset_counters(self) -> None:
        """Start every counter from zero (the server does after its warm-up): steps, admissions and
        the prefix cache's, the vision-encoder cache's, speculation's."""
        self._recorder.reset()
        self.scheduler.reset_counters()
        self.runner.encoder_cache.reset_counters()
        if self.speculator is not None:
            self.speculator.reset_counters()

    # ---- batch conveniences -----------------------------------------------------------------

    def chat(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`tools` (OpenAI's format) go to the chat template; force a call with
        `SamplingParams(structured_output=resolve_tool_choice(...).constraint)` (vlm_engine.structured.tools).
        `mm_processor_kwargs` sets video sampling (`fps`, `max_frames`) for parts that do not."""
        prompts = [self.process_messages(list(c), tools, mm_processor_kwargs) for c in conversations]
        return self.generate(prompts, sampling)

    def generate(
        self,
        prompts: Sequence[PromptInput],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling, len(prompts))
        processed = [self.process_prompt(p) for p in prompts]  # validate everything before queueing anything
        for sp in params:
            if sp.structured_output is not None:
                self.grammars.validate(sp.structured_output)
        ids = [self.add_request(p, sp) for p, sp in zip(processed, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _per_prompt(sampling: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    params = list(sampling)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
