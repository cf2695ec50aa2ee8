"""Continuous batching with chunked prefill, a prefix cache and recompute preemption.

One `schedule()` call plans one forward step under a token budget:
1. running requests first, in arrival order: a decode costs one token, an unfinished prefill
   takes what is left of the budget; when the pool cannot grow a request, the most recently
   arrived running request is preempted (pages freed, recomputed later) — never a deadlock,
   because `max_model_len` is capped so any one request fits the pool alone;
2. then waiting requests, oldest first, while budget, seats (`max_num_seqs`) and pages last,
   each starting from its longest prefix-cache hit.
`update()` then advances progress, publishes newly full pages to the prefix cache, appends
sampled tokens and retires finished requests, returning their pages at once.

A request's life ends here and nowhere else: `update()` finishes what a step decided (a stop
token, the length limit, a completed grammar, a request that failed alone: its logits were not
finite, or its grammar rejected a sampled token), `end_at_stop_string()` a request whose text
reached a stop string, and `finish_requests()` what else comes from outside a step (aborts, a
failed batch). All free through `_finish`.

Speculative decoding (vlm_engine.speculative) adds one thing: a decoding request may reserve
`lookahead` KV slots past its last token; the engine fills them with proposed tokens before the
forward pass, which verifies them all at once. `update()` then keeps the KV of the accepted
prefix only and gives back pages that hold nothing valid (the rollback).

Models with linear-attention layers (a fixed-size state per sequence, `cache/state_pool.py`) add a
state slot per running request, taken at admission and given back with its pages. Their state
cannot be rolled back to any position, so three things change:
- a prefix-cache hit ends at the deepest cached page that has a state snapshot, which the slot
  starts from; snapshots are taken at chosen page boundaries of prompts (`snapshot_bounds`), where
  prefill chunks are cut so that a step ends exactly there;
- a draft verified with a partial accept rolls back to the state before the draft (the runner's
  checkpoint) and recomputes the accepted tokens in the next step;
- a preempted request recomputes from its tokens (or a snapshot), as everyone does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from vlm_engine.cache.page_hash import page_hashes
from vlm_engine.cache.page_pool import PagePool
from vlm_engine.cache.state_pool import StatePool
from vlm_engine.inputs import context_exceeded
from vlm_engine.scheduler.batch import RequestRejected, ScheduledChunk, SchedulerConfig, SchedulerOutput, StepUpdate
from vlm_engine.scheduler.request import Request, RequestStatus, SampledToken
from vlm_engine.scheduler.window import WindowPages, held_pages

logger = logging.getLogger(__name__)

NONFINITE_LOGITS = "the model's logits for this request were not finite (NaN or inf); it was stopped"
GRAMMAR_REJECTED = "the grammar rejected a sampled token; it was stopped"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: PagePool,
        window: WindowPages | None = None,
        states: StatePool | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        # Sliding-window layers' pages, when the model has such layers (scheduler/window.py).
        self.window = window
        # Linear-attention layers' state slots, when the model has such layers (cache/state_pool.py).
        self.states = states
        self.page_size = pool.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Speculative decoding: how many draft slots a decoding request wants this step (None: off).
        self.lookahead: Callable[[Request], int] | None = None
        self.reset_counters()

    def reset_counters(self) -> None:
        self.num_preemptions = 0
        # Prefix-cache accounting, once per request at its first admission (a retry after a
        # failed admission or a preemption looks the prefix up again but is not counted again).
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests
        self.num_prefix_queries = 0  # of those, tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there
        if self.states is not None:
            self.states.snapshot_hits = 0

    # ---- admission / removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request.request_id!r}")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise RequestRejected(context_exceeded(request.num_prompt_tokens, limit))
        options = self.config.options
        if not options.enable_chunked_prefill and request.num_prompt_tokens > options.max_num_batched_tokens:
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"({options.max_num_batched_tokens}) with chunked prefill off"
            )
        request.max_model_len = min(request.max_model_len, limit)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        finished = self.finish_requests((request_id,), RequestStatus.FINISHED_ABORTED)
        return finished[0] if finished else None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside a step: aborts (the client left), a batch whose forward pass
        failed. Ids unknown or already finished are skipped; returns the requests finished, in the
        order given."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def end_at_stop_string(self, request: Request, num_output_tokens: int | None = None) -> None:
        """A stop string ended `request`'s text at output token `num_output_tokens`: the tokens
        after it never happened (a speculative step can run past it) and the request finishes with
        "stop", its pages freed; a request this step's update already finished (a stop token, the
        length limit: its pages are free) ends with "stop" too. None: the caller does not know
        where in the tokens the text stopped (the server's core; its detokenizer cut them)."""
        dropped = 0 if num_output_tokens is None else request.num_output_tokens - num_output_tokens
        if dropped > 0:
            del request.token_ids[-dropped:]
            request.stop_token_id = None
        if request.status.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self._finish(request, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request and return its pages to the pool right away."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = time.monotonic()
        self._release_pages(request)
        request.runner_state.on_finish()
        del self.requests[request.request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = SchedulerOutput()
        budget = self.config.options.max_num_batched_tokens
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk_tokens(request, budget)
            if n == 0:  # its next media span does not fit what is left of this step
                i += 1
                continue
            extra = self._lookahead(request, n, budget)
            while not self._grow(request, request.num_computed_tokens + n + extra):
                if extra:
                    extra = 0  # draft slots are the first thing to give up
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n, extra))
                scheduled.add(id(request))
                budget -= n + extra
                i += 1
                continue
            # `request` itself was preempted: the list shrank, do not advance i.

        # After a preemption the pool is tight: admitting newcomers would only thrash.
        if not out.preempted:
            budget = self._admit_waiting(out, budget)

        out.schedule_time_s = time.perf_counter() - t0
        return out

    def _chunk_tokens(self, request: Request, budget: int) -> int:
        """Tokens of `request` to run this step: what is left of its prefill within `budget`; with
        atomic media spans, cut back to the start of a span the budget ends inside, or, when the
        span began before this chunk, through its end: over the budget if nothing else runs yet in
        this step (a span longer than the budget must still run), else not this step (0)."""
        n = self._cut_at_snapshot(request, min(request.extend_len, budget))
        if not self.config.atomic_media_spans or n == request.extend_len:
            return n
        start = request.num_computed_tokens
        end = start + n
        for span in request.media_spans:
            if span.offset < end < span.end:
                if span.offset > start:
                    return span.offset - start
                return span.end - start if budget == self.config.options.max_num_batched_tokens else 0
        return n

    def _snapshots_on(self) -> bool:
        return self.states is not None and self.pool.enable_prefix_cache and self.states.slots.num_snapshots > 0

    def snapshot_bounds(self, request: Request) -> list[int]:
        """Where a request's linear-attention state is kept for the prefix cache (ascending page
        boundaries): the last boundary inside each media span (a shared system prompt and image
        followed by a different question resumes there) and the prompt's last full page (the next
        turn of the conversation resumes there)."""
        if not self._snapshots_on():
            return []
        ps = self.page_size
        last = (request.num_prompt_tokens - 1) // ps * ps
        bounds = {span.end // ps * ps for span in request.media_spans} | {last}
        return sorted(b for b in bounds if 0 < b <= last)

    def _cut_at_snapshot(self, request: Request, n: int) -> int:
        """End a prefill chunk of `n` tokens at the first snapshot boundary inside it."""
        start = request.num_computed_tokens
        if self.states is None or start >= request.num_prompt_tokens:
            return n
        for bound in self.snapshot_bounds(request):
            if start < bound < start + n:
                return bound - start
        return n

    def _lookahead(self, request: Request, n: int, budget: int) -> int:
        """Draft slots for a decoding request: what the speculation policy wants, within the step's
        budget and so that every verified token could still be emitted (max_tokens, context)."""
        if self.lookahead is None or n != 1 or request.extend_len != 1:
            return 0
        return max(0, min(self.lookahead(request), budget - 1, request.remaining_tokens - 1))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        max_num_seqs, chunked = self.config.options.max_num_seqs, self.config.options.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            if self.states is not None and request.state_slot < 0:
                slot = self.states.allocate()
                if slot is None:  # every live slot is held (a seat per slot: cannot happen while seats last)
                    break
                request.state_slot = slot
            if request.num_computed_tokens == 0 and not request.page_ids:
                self._match_prefix(request)
            n = self._chunk_tokens(request, budget)
            if n == 0 or (n < request.extend_len and not chunked):
                self._release_pages(request)
                break
            needed = self._pages_for(request.num_computed_tokens + n) - len(request.page_ids)
            short = needed > self.pool.num_free - self.config.watermark_pages
            if self.window is not None:
                short = short or not self.window.can_grow(needed, self.config.watermark_pages)
            if short and self.running:
                self._release_pages(request)  # give the prefix hit back; retry on a later step
                break
            if not self._grow(request, request.num_computed_tokens + n):
                self._release_pages(request)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                self._count_admission(request, out)
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        return budget

    def _count_admission(self, request: Request, out: SchedulerOutput) -> None:
        self.num_prompt_tokens += request.num_prompt_tokens
        if self.pool.enable_prefix_cache:
            self.num_prefix_queries += request.num_prompt_tokens
            self.num_prefix_hits += request.num_cached_tokens
        out.num_cached_tokens += request.num_cached_tokens

    def _match_prefix(self, request: Request) -> None:
        # Keep at least one token to compute: its logits give the next token.
        max_pages = (request.num_tokens - 1) // self.page_size
        if max_pages == 0 or not self.pool.enable_prefix_cache:
            return
        keys = self._page_keys(request, max_pages)
        pages = self.pool.match_prefix(keys[:max_pages])
        if self.window is not None and pages:
            hit = self.window.match(request, keys, len(pages))
            self.pool.free(pages[hit:])
            pages = pages[:hit]
        if self.states is not None and pages:
            hit = self._snapshot_hit(keys, len(pages))
            self.pool.free(pages[hit:])
            pages = pages[:hit]
            if hit:
                self.states.restore(keys[hit - 1], request.state_slot)
        request.page_ids = pages
        request.num_computed_tokens = len(pages) * self.page_size
        request.num_registered_pages = len(pages)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens

    def _snapshot_hit(self, keys: list[int], num_pages: int) -> int:
        """The longest prefix of `num_pages` cached pages whose last page has a state snapshot."""
        assert self.states is not None
        for hit in range(num_pages, 0, -1):
            if self.states.has_snapshot(keys[hit - 1]):
                return hit
        return 0

    def _page_keys(self, request: Request, num_pages: int) -> list[int]:
        """Extend the request's hash chain to at least `num_pages` full pages (cheap to call again)."""
        keys = request.page_keys
        if len(keys) < num_pages:
            parent = keys[-1] if keys else None
            limit = min(num_pages, request.num_tokens // self.page_size) * self.page_size
            keys.extend(page_hashes(request.token_ids[:limit], self.page_size, request.media_spans, len(keys), parent))
        return keys

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        needed = self._pages_for(num_tokens) - len(request.page_ids)
        if needed <= 0:
            return True
        if self.window is not None and not self.window.can_grow(needed):
            return False
        pages = self.pool.allocate(needed)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        if self.window is not None:
            self.window.grow(request, needed)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_pages(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.runner_state.on_preempt()
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release_pages(self, request: Request) -> None:
        self.pool.free(request.page_ids)
        request.page_ids = []
        if self.window is not None:
            self.window.release_all(request)
        if request.state_slot >= 0:
            assert self.states is not None
            self.states.free(request.state_slot)
            request.state_slot = -1
        request.num_computed_tokens = 0
        request.num_registered_pages = 0

    # ---- after the forward pass -------------------------------------------------------------

    def update(
        self, out: SchedulerOutput, sampled: Mapping[str, list[SampledToken]], nonfinite: Collection[str] = ()
    ) -> StepUpdate:
        """Apply one step's results and retire the requests it finished. Nothing passed in is changed.

        `sampled` maps request id -> new tokens for sampling chunks. A speculative chunk's tokens
        are its accepted draft prefix followed by one sampled token; only the accepted prefix's KV
        is kept, and pages past the last token are given back. A constrained request's grammar
        takes the tokens first: a token that completes it, or one its closer replaced, ends the
        request's tokens for this step. Requests that fail alone finish with "abort": those in
        `nonfinite` (their logits were NaN or inf, nothing was sampled) and those whose grammar
        rejects a sampled token (a bug, never silently invalid output). A stop token or the length
        limit may end a request before its last token; a constrained request whose grammar is
        complete finishes with "stop", also when that token reached its length limit.
        """
        failed = self._nonfinite(out, nonfinite) if nonfinite else []
        finished = [request for request, _ in failed]
        for request in finished:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        applied: list[tuple[Request, list[SampledToken]]] = []
        completed: list[Request] = []  # grammar complete: retired after the step's other tokens
        now = time.monotonic()
        for chunk in out.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            if not chunk.samples:
                request.num_computed_tokens = chunk.end
                self._register_full_pages(request)
                self._release_behind_window(request)
                self._snapshot_state(request)
                continue
            tokens = sampled[request.request_id]
            if len(tokens) != 1:
                _check_draft(chunk, tokens)
            if request.grammar is not None:
                taken = _accept_constrained(request, tokens)
                if taken is None:
                    logger.error("request %s: the grammar rejected a sampled token; aborting it", request.request_id)
                    failed.append((request, GRAMMAR_REJECTED))
                    self._finish(request, RequestStatus.FINISHED_ABORTED)
                    finished.append(request)
                    continue
                tokens = taken
            if request.first_token_time is None:
                request.first_token_time = now
            status = None
            for n, token in enumerate(tokens, start=1):
                status = request.append_token(token.token_id)
                if status is not None:
                    if n < len(tokens):
                        tokens = tokens[:n]  # a stop token or the length limit: later tokens are dropped
                    break
            applied.append((request, tokens))
            # Every token but the newest has its KV computed (the known ones and the accepted draft).
            request.num_computed_tokens = request.num_tokens - 1
            self._register_full_pages(request)
            self._release_behind_window(request)
            grammar_done = request.grammar is not None and request.grammar.is_stopped
            if status is not None:
                if grammar_done and status is RequestStatus.FINISHED_LENGTH:
                    status = RequestStatus.FINISHED_STOPPED  # completed on its last budgeted token
                self._finish(request, status)
                finished.append(request)
                continue
            if chunk.num_lookahead:
                self._trim_pages(request)
            if self.states is not None and len(tokens) <= len(chunk.draft):
                # A draft token was rejected: the linear layers' state went past the accepted ones.
                # Back to the checkpoint taken before the draft; the accepted tokens run again.
                self.states.restore_checkpoint(request.state_slot)
                request.num_computed_tokens = chunk.start
            if grammar_done:
                completed.append(request)
        for request in completed:  # nothing but EOS could follow: stop now, not a step later
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            finished.append(request)
        return StepUpdate(applied, failed, finished)

    def _nonfinite(self, out: SchedulerOutput, request_ids: Collection[str]) -> list[tuple[Request, str]]:
        """The step's requests whose logits came out NaN or infinite (there is nothing to sample):
        they fail alone, and the batch's other requests keep their tokens."""
        failed = []
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id in request_ids and not request.status.finished:
                rid = request.request_id
                logger.error("request %s: the model's logits were not finite (NaN or inf); aborting it", rid)
                failed.append((request, NONFINITE_LOGITS))
        return failed

    def _trim_pages(self, request: Request) -> None:
        """Give back pages that hold no token (rejected draft slots); the newest token's page stays."""
        keep = self._pages_for(request.num_tokens)
        if len(request.page_ids) > keep:
            self.pool.free(request.page_ids[keep:])
            del request.page_ids[keep:]
            if self.window is not None:
                self.window.trim(request, keep)

    def _snapshot_state(self, request: Request) -> None:
        """Keep the request's state when this step ended at one of its snapshot boundaries."""
        if self.states is None:
            return
        end = request.num_computed_tokens
        if end in self.snapshot_bounds(request):
            pages = end // self.page_size
            self.states.snapshot(self._page_keys(request, pages)[pages - 1], request.state_slot)

    def _release_behind_window(self, request: Request) -> None:
        if self.window is not None:
            self.window.release_behind(request)

    def check_invariants(self) -> None:
        """No page leaked or double-held: the pool's references are exactly the requests' pages,
        and each request holds pages for its computed tokens and at most its known ones."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_pages
        for request in self.requests.values():
            for page in request.page_ids:
                held[page] += 1
            if request.status is RequestStatus.RUNNING:
                lo, hi = self._pages_for(request.num_computed_tokens), self._pages_for(request.num_tokens)
                if not lo <= len(request.page_ids) <= hi:
                    raise AssertionError(
                        f"request {request.request_id}: {len(request.page_ids)} pages for {request.num_computed_tokens} "
                        f"computed of {request.num_tokens} tokens"
                    )
        if held != self.pool.ref_count:
            leaked = [p for p in range(self.pool.num_pages) if held[p] != self.pool.ref_count[p]]
            raise AssertionError(f"pages held by no request or miscounted: {leaked[:16]}")
        if self.window is not None:
            self._check_window_invariants()
        if self.states is not None:
            self.states.check_invariants([r.state_slot for r in self.requests.values() if r.state_slot >= 0])

    def _check_window_invariants(self) -> None:
        """The window pool's references are exactly the requests' held window pages, and each window
        page table is as long as its request's page table."""
        assert self.window is not None
        pool = self.window.pool
        pool.check_invariants()
        held = [0] * pool.num_pages
        for request in self.requests.values():
            if len(request.window_page_ids) != len(request.page_ids):
                raise AssertionError(f"request {request.request_id}: window page table out of step")
            for page in held_pages(request):
                held[page] += 1
        if held != pool.ref_count:
            leaked = [p for p in range(pool.num_pages) if held[p] != pool.ref_count[p]]
            raise AssertionError(f"window pages held by no request or miscounted: {leaked[:16]}")

    def _register_full_pages(self, request: Request) -> None:
        if not self.pool.enable_prefix_cache:
            return
        full = request.num_computed_tokens // self.page_size
        if full <= request.num_registered_pages:
            return
        keys = self._page_keys(request, full)
        first = request.num_registered_pages
        for index in range(first, full):
            self.pool.register(request.page_ids[index], keys[index])
        if self.window is not None:
            self.window.register(request, first, keys[first:full])
        request.num_registered_pages = full


def _check_draft(chunk: ScheduledChunk, tokens: Sequence[SampledToken]) -> None:
    """A sampling chunk's tokens: its accepted draft prefix, then one more."""
    n = len(tokens)
    if n == 0 or n > len(chunk.draft) + 1 or [t.token_id for t in tokens[:-1]] != chunk.draft[: n - 1]:
        ids = [t.token_id for t in tokens]
        raise ValueError(f"request {chunk.request.request_id}: tokens {ids} do not extend the draft {chunk.draft}")


def _accept_constrained(request: Request, tokens: Sequence[SampledToken]) -> list[SampledToken] | None:
    """Advance the grammar over a step's tokens; None if it rejects one. A token the closer
    swapped, or one that completes the grammar or is an EOS, ends the step's tokens for this request."""
    taken: list[SampledToken] = []
    for i, token in enumerate(tokens):
        chosen = request.grammar.accept(token.token_id, request.remaining_tokens - 1 - i)
        if chosen is None:
            return None
        if chosen != token.token_id:  # the closer finished the output instead
            taken.append(SampledToken(chosen, token.logprob, token.top_logprobs))
            break
        taken.append(token)
        if request.grammar.is_stopped or chosen in request.eos_token_ids:
            break
    return taken
