"""The in-process engine: scheduler + model runner + prompt processing, no sockets.

Tests, the batch CLI and notebooks use it directly; the server runs the same core in its own
process. `step()` is the heartbeat: plan a batch, run it, apply the results.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_engine import ipc
from vlm_engine.attention.backends import create_backend
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.config import DEFAULT_MODEL, EngineConfig
from vlm_engine.host_memory import keep_freed_memory
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.kernels.cpu_isa import tier_description
from vlm_engine.metrics.core_stats import StepRecorder, StepStats
from vlm_engine.models.family import text_config_of
from vlm_engine.models.fused_ops import fused_ops_apply, load_fused_ops
from vlm_engine.models.registry import (
    build_model,
    cpu_bf16_weights,
    default_device,
    load_config,
    prompt_processor,
    resolve_dtype,
    resolve_model,
)
from vlm_engine.output_processor import OutputProcessor
from vlm_engine.runner.model_runner import KVLayout, ModelRunner, attention_windows
from vlm_engine.runner.sampler import SampledToken
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from vlm_engine.scheduler.window import WindowPages
from vlm_engine.speculative import Speculator
from vlm_engine.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]
PromptInput = str | list[int] | ProcessedPrompt

NONFINITE_LOGITS = "the model's logits for this request were not finite (NaN or inf); it was stopped"
GRAMMAR_REJECTED = "the grammar rejected a sampled token; it was stopped"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    cached_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step
    new_text: str = ""  # text made safe to show by the last step (stop strings held back)
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it


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
        # `cfg` is the model section: most of the set-up reads it.
        cfg, cache, sched, spec = self.config.model, self.config.cache, self.config.scheduler, self.config.speculative
        self.source = resolve_model(cfg.model)
        self.hf_config = load_config(self.source)
        if cache.disable_sliding_window:
            _attend_fully(self.hf_config)
        self.device = default_device(cfg.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # steps reuse their large activations instead of page-faulting them in
        # Quantized linears keep fp32 activations: "auto" then means float32.
        dtype_choice = "float32" if cfg.quantization else cfg.dtype
        self.dtype = resolve_dtype(dtype_choice, self.hf_config, self.device, self.source.gguf_file is not None)
        fast = cfg.numerics == "fast"
        use_fused = fast and cfg.fused_cpu_ops and fused_ops_apply(self.device, self.dtype)
        fused = load_fused_ops() if use_fused else None
        panel_ops = fused if fused is not None and fused.panel_linear_vectorized() else None
        quant_ops = (fused or load_fused_ops()) if cfg.quantization else None
        self.bf16_weights = panel_ops is not None and cpu_bf16_weights(dtype_choice, self.dtype, self.device)
        self.model = build_model(
            self.source, self.hf_config, self.dtype, self.device, fast and cfg.prepack_weights, panel_ops,
            cfg.quantization, quant_ops, self.bf16_weights,
        )
        self.processor = prompt_processor(self.source, self.hf_config, limits=self.config.media.fetch_limits())
        self.tokenizer = self.processor.tokenizer
        draft_model = None
        if spec.draft_path is not None:
            draft_model = self._build_draft_model(spec.draft_path, fast, panel_ops)

        layout = KVLayout.of(self.model)
        layouts = [layout] if draft_model is None else [layout, KVLayout.of(draft_model)]
        windows = attention_windows(self.model)
        self.kv_page_bytes = self._kv_page_bytes(layouts, windows)
        num_pages, num_window_pages = self._num_pages(windows)
        model_len = cfg.max_model_len or int(text_config_of(self.hf_config).max_position_embeddings)
        self.max_model_len = min(model_len, num_pages * cache.page_size)
        self.pool = PagePool(num_pages, cache.page_size, cache.enable_prefix_cache)
        # Sliding-window layers' KV: a pool of its own whose pages go back as the windows move on.
        self.window_pool: PagePool | None = None
        window_pages = None
        if num_window_pages:
            self.window_pool = PagePool(num_window_pages, cache.page_size, cache.enable_prefix_cache)
            window_pages = WindowPages(self.window_pool, max(windows))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=sched.enable_chunked_prefill,
                watermark_pages=max(0, num_pages // 100),
                atomic_media_spans=bool(getattr(self.model, "bidirectional_media", False)),
            ),
            self.pool,
            window_pages,
        )
        backend = create_backend(cfg.attention_backend, self.device)
        self.runner = ModelRunner(
            self.model, self.device, self.dtype, num_pages, cache.page_size, backend, cache.encoder_cache_bytes, fused,
            num_window_pages=num_window_pages,
        )  # fmt: skip
        self.speculator = self._build_speculator(draft_model, num_pages, backend, fused)
        self.eos_token_ids = self._eos_token_ids()
        self._grammars: Any = None  # GrammarCompiler, built on the first constrained request
        self._outputs = OutputProcessor(self.tokenizer)  # in-process text: `step()` only, never the server core
        self._ids = itertools.count()
        self.last_step = StepStats()
        self._recorder = StepRecorder(num_pages)
        logger.info(
            "engine ready: %s, %s, %s numerics, weights %s, attention %s, fused CPU ops %s, CPU tier %s, "
            "%d KV pages x %d tokens (sliding-window layers: %d), max_model_len %d, speculative %s",
            self.source.name, self.dtype, cfg.numerics,
            cfg.quantization or ("bf16 (fp32 activations)" if self.bf16_weights else "unquantized"), backend.name,
            fused is not None, tier_description(), num_pages, cache.page_size, num_window_pages, self.max_model_len,
            f"{spec.speculative} k={spec.num_speculative_tokens}" if spec.speculative else "off",
        )

    # ---- set-up helpers ----------------------------------------------------------------------

    def _build_draft_model(self, path: str, fast: bool, panel_ops: Any) -> torch.nn.Module:
        source = resolve_model(path)
        config = load_config(source)
        draft_vocab = int(text_config_of(config).vocab_size)
        target_vocab = int(text_config_of(self.hf_config).vocab_size)
        if draft_vocab != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({target_vocab})")
        # Same dtype and kernels as the target; optionally weight-only quantized, which makes the
        # target's own weights a draft (int4 of a Q4_1 GGUF keeps its codes: it agrees nearly always).
        quantization = self.config.speculative.speculative_draft_quantization
        return build_model(
            source, config, self.dtype, self.device, fast and self.config.model.prepack_weights, panel_ops,
            quantization, load_fused_ops() if quantization else None, self.bf16_weights,
        )  # fmt: skip

    def _build_speculator(self, draft_model: Any, num_pages: int, backend: Any, fused: Any) -> Speculator | None:
        cfg = self.config.speculative
        if not cfg.speculative:
            return None
        proposer: Any
        if draft_model is not None:
            from vlm_engine.speculative.draft_model import DraftModelProposer

            page_size = self.config.cache.page_size
            draft_runner = ModelRunner(
                draft_model, self.device, self.dtype, num_pages, page_size, backend, 0, fused, merge_media=False
            )
            proposer = DraftModelProposer(draft_runner)
        else:
            from vlm_engine.speculative.ngram import NgramProposer

            proposer = NgramProposer(cfg.speculative_ngram_min, cfg.speculative_ngram_max)
        speculator = Speculator(proposer, cfg.num_speculative_tokens, cfg.speculative_disable_batch_size)
        self.scheduler.lookahead = speculator.lookahead
        return speculator

    def _kv_page_bytes(self, layouts: list[KVLayout], windows: tuple[int, ...]) -> tuple[int, int]:
        """Bytes of one KV page in the full-attention pool (the draft model's layers included) and in
        the sliding-window layers' pool."""
        ps = self.config.cache.page_size
        window_layers = sum(1 for w in windows if w)
        window_bytes = layouts[0].bytes_per_token(self.dtype, window_layers) * ps
        return sum(layout.bytes_per_token(self.dtype) for layout in layouts) * ps - window_bytes, window_bytes

    def _window_pool_pages(self, windows: tuple[int, ...]) -> int:
        """Enough window pages for every seat to hold its window plus one step's prefill."""
        ps, sched = self.config.cache.page_size, self.config.scheduler
        window_pages = -(-max(windows) // ps) + 1
        return sched.max_num_seqs * window_pages + -(-sched.max_num_batched_tokens // ps) + 1

    def _num_pages(self, windows: tuple[int, ...]) -> tuple[int, int]:
        """Pages of the full-attention pool and of the sliding-window layers' (0: no such layers)."""
        cfg = self.config.cache
        full_bytes, window_bytes = self.kv_page_bytes
        window_cap = self._window_pool_pages(windows) if window_bytes else 0
        if cfg.kv_cache_tokens is not None:
            num_pages = -(-cfg.kv_cache_tokens // cfg.page_size)
            return num_pages, min(num_pages, window_cap)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        else:
            budget = min(int(_mem_available() * cfg.cpu_kv_cache_fraction), cfg.cpu_kv_cache_max_bytes)
        if budget < full_bytes + window_bytes:
            raise RuntimeError("not enough free memory for even one KV page")
        if window_bytes and full_bytes and budget >= window_cap * (full_bytes + window_bytes):
            return (budget - window_cap * window_bytes) // full_bytes, window_cap
        num_pages = budget // (full_bytes + window_bytes)  # both pools alike when memory is that tight
        return num_pages, num_pages if window_bytes else 0

    def kv_bytes_in_use(self) -> int:
        """KV bytes of the pages that requests hold now, in both pools."""
        full_bytes, window_bytes = self.kv_page_bytes
        used = self.pool.num_used * full_bytes
        return used if self.window_pool is None else used + self.window_pool.num_used * window_bytes

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.hf_config, text_config_of(self.hf_config), _generation_config(self.source)):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

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
        self,
        prompt: PromptInput,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (a prompt already processed too: the server's core passes the worker's);
        raises ValueError (PromptError, RequestRejected, StructuredOutputError) for input that can
        never run, before anything is allocated."""
        processed = self.process_prompt(prompt)
        request_id = request_id or f"req-{next(self._ids)}"
        self.scheduler.add_request(self._make_request(request_id, processed, sampling or SamplingParams()))
        return request_id

    def _make_request(self, request_id: str, prompt: ProcessedPrompt, sampling: SamplingParams) -> Request:
        """A scheduler request with its per-request state (grammar matcher); raises
        StructuredOutputError for a constraint that cannot be enforced."""
        request = Request(request_id=request_id, prompt=prompt, sampling=sampling, eos_token_ids=self.eos_token_ids)
        spec: StructuredOutput | None = sampling.structured_output
        if spec is not None:
            request.grammar = self.grammars.matcher(spec, ignore_eos=sampling.ignore_eos)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort one request; its final output, or None when it is unknown or already finished."""
        finished = self.scheduler.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED)
        return self._on_tokens(finished[0], []) if finished else None

    def abort_requests(self, request_ids: Iterable[str], stop_string: bool = False) -> list[Request]:
        """Finish requests from outside the step loop, freeing their pages: aborted (the client
        left) or, with `stop_string`, ended by a stop string found in their text ("stop"). Unknown
        and finished ids are skipped; returns the requests finished, in order."""
        status = RequestStatus.FINISHED_STOPPED if stop_string else RequestStatus.FINISHED_ABORTED
        return self._forget_text(self.scheduler.finish_requests(request_ids, status))

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
        """Plan a batch, run it, apply its sampled tokens; None when nothing could be scheduled.

        The one token-level step, shared by `step()` and the server's engine core: grammar
        matchers advance here and every finish a step decides happens in the scheduler's update.
        Raises StepFailed if the forward pass fails (the caller decides: `fail_batch`).
        """
        t0 = time.perf_counter()
        speculator = self.speculator
        if speculator is not None:
            speculator.begin_step(len(self.scheduler.running))
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        t1 = time.perf_counter()
        try:
            if speculator is not None:
                speculator.stats.last_step_lengths.clear()
                speculator.propose(plan)
            t2 = time.perf_counter()
            sampled = self.runner.execute(plan)
        except Exception as exc:
            raise StepFailed(plan) from exc
        t3 = time.perf_counter()
        tokens, failed = self._update(plan, sampled)
        t4 = time.perf_counter()
        runner = self.runner
        stats = StepStats(
            num_tokens=plan.num_tokens,
            num_seqs=len(plan.chunks),
            schedule_s=t1 - t0,
            propose_s=t2 - t1,
            forward_s=t3 - t2,
            update_s=t4 - t3,
            mask_s=runner.last_mask_s,
            mask_wait_s=runner.last_mask_wait_s,
            num_decode_tokens=sum(  # drafts included
                c.num_tokens for c in plan.chunks if c.num_tokens - len(c.draft) == 1 and c.start >= c.request.num_prompt_tokens
            ),
            num_cached_tokens=plan.num_cached_tokens,
            num_generated_tokens=sum(len(t) for _, t in tokens),
            num_preemptions=len(plan.preempted),
        )  # fmt: skip
        self.last_step = stats
        return TokenStep(plan, tokens, stats, failed)

    def _update(
        self, plan: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> tuple[list[tuple[Request, list[SampledToken]]], list[tuple[Request, str]]]:
        """Hand the step's results to the scheduler's update: the tokens each request takes (its
        grammar's verdict included) and the requests that failed alone. Returns the tokens actually
        appended, in chunk order, and the failed requests with the reason."""
        if self.speculator is not None:
            for chunk in plan.chunks:
                if chunk.draft and chunk.request.request_id in sampled:
                    self.speculator.observe(chunk, len(sampled[chunk.request.request_id]))
        failed = self._nonfinite(plan, self.runner.last_nonfinite)
        applied: list[tuple[Request, list[SampledToken]]] = []
        token_ids: dict[str, list[int]] = {}
        for chunk in plan.chunks:
            request = chunk.request
            tokens = sampled.get(request.request_id)
            if not tokens or request.status is not RequestStatus.RUNNING:
                continue
            if request.grammar is not None:
                tokens = self._accept_constrained(request, tokens)
                if tokens is None:  # a token outside the mask: a bug, never silently invalid output
                    logger.error("request %s: the grammar rejected a sampled token; aborting it", request.request_id)
                    failed.append((request, GRAMMAR_REJECTED))
                    continue
            applied.append((request, tokens))
            token_ids[request.request_id] = [t.token_id for t in tokens]
        finished = self.scheduler.update(plan, token_ids, [request.request_id for request, _ in failed])
        if finished:  # a stop token or the length limit may have come before a step's last token
            for index, (request, tokens) in enumerate(applied):
                taken = len(token_ids[request.request_id])
                if taken < len(tokens):
                    applied[index] = (request, tokens[:taken])
        return applied, failed

    def _nonfinite(self, plan: SchedulerOutput, request_ids: list[str]) -> list[tuple[Request, str]]:
        """Requests whose logits came out NaN or infinite (there is nothing to sample): they fail
        alone, and the batch's other requests keep their tokens."""
        if not request_ids:
            return []
        ids = set(request_ids)
        failed = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.request_id in ids and not request.status.finished:
                logger.error(
                    "request %s: the model's logits were not finite (NaN or inf); aborting it", request.request_id
                )
                failed.append((request, NONFINITE_LOGITS))
        return failed

    def _accept_constrained(self, request: Request, tokens: list[SampledToken]) -> list[SampledToken] | None:
        """Advance the grammar over a step's tokens; None if it rejects one. A token the closer
        swapped, or one that completes the grammar, ends the step's tokens for this request."""
        taken: list[SampledToken] = []
        for i, token in enumerate(tokens):
            chosen = request.grammar.accept(token.token_id, request.remaining_tokens - 1 - i)
            if chosen is None:
                return None
            if chosen != token.token_id:  # the closer finished the output instead
                taken.append(SampledToken(chosen, token.logprob, token.top_logprobs))
                break
            taken.append(token)
            if request.grammar.is_stopped or chosen in self.eos_token_ids:
                break
        return taken

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
        rid = request.request_id
        sampling = request.sampling
        outputs = self._outputs
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = [TokenLogprob(t.token_id, t.logprob or 0.0, t.top_logprobs or []) for t in tokens]
        ids = [t.token_id for t in tokens]
        finished = request.status.finished
        reason, stop_token = (request.finish_reason, request.stop_token_id) if finished else (None, None)
        if rid not in outputs:  # its first output: the stream starts here (the server's core never makes one)
            outputs.add_request(rid, sampling.stop, request.num_prompt_tokens, sampling.logprobs is not None)
        text = outputs.process(rid, ids, logprobs, finished, reason, stop_token)
        assert text is not None  # a stop string drops the stream as it finishes the request
        if text.stop_string is not None:
            self.scheduler.end_at_stop_string(request, request.num_output_tokens - len(tokens) + len(text.token_ids))
            outputs.drop(rid)
        return RequestOutput(
            request_id=rid,
            token_ids=request.output_token_ids,
            text=text.text,
            finished=request.status.finished,
            finish_reason=request.finish_reason,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            new_token_ids=text.token_ids,
            new_text=text.delta,
            logprobs=text.history,
            stop_reason=text.stop_string if text.stop_string is not None else request.stop_token_id,
        )

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
        s = self._recorder.stats
        pool, sched, media = self.pool, self.scheduler, self.runner.encoder_cache
        s.pages_used, s.pages_cached = pool.num_used, pool.num_cached
        s.running, s.waiting = len(sched.running), len(sched.waiting)
        s.prompt_tokens = sched.num_prompt_tokens
        s.prefix_cache_queries, s.cached_prompt_tokens = sched.num_prefix_queries, sched.num_prefix_hits
        s.mm_cache_hits, s.mm_cache_queries = media.hits, media.hits + media.misses
        if self.speculator is not None:
            spec = self.speculator.stats
            s.spec_drafts, s.spec_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            s.spec_accepted_tokens = spec.num_accepted_tokens
        return s

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


def _attend_fully(hf_config: Any) -> None:
    """`disable_sliding_window`: every layer of the config's `layer_types` attends to the whole context."""
    text = text_config_of(hf_config)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        text.layer_types = ["full_attention"] * len(layer_types)
    if getattr(text, "sliding_window", None) is not None:
        text.sliding_window = None


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3


def _generation_config(source: Any) -> Any:
    path = source.directory / "generation_config.json"
    if source.gguf_file or not path.exists():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(source.directory))
