"""The API server's side of the sockets: submit requests, route results back to HTTP handlers.

Each OpenAI request gets one asyncio queue; every choice is an engine request `"{id}-{index}"`
routed to that queue. Sends use plain (non-async) ZMQ PUSH sockets with no high-water mark, so
they never block and can run inside a cancelled task's cleanup; the one receiving socket is
read by a single asyncio task.

A prompt with http(s) media is first fetched here (`media_fetch`, one task per prompt, cancelled
when the request goes away) and reaches a worker with the bytes. The client remembers which
worker holds which prompt until its `PreprocessDone`, so when a worker dies (the launcher restarts
it) exactly the prompts it held get an error and nothing else is disturbed.

A /tokenize or /detokenize job travels the same way (fetch, least-loaded worker, the worker's
death fails it) but waits on a future in `jobs`, not in `routes`: it is no generation, so it counts
neither as in flight nor as waiting, and the request tracker never sees it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from preprocess.errors import MediaError
from vlm_engine import ipc
from vlm_engine.metrics.request_tracker import RequestTracker
from vlm_engine.server.media_fetch import MediaFetcher, remote_parts
from vlm_engine.server.protocol import GenerateRequest

logger = logging.getLogger(__name__)


@dataclass
class RequestHandle:
    """One OpenAI request in flight: its choices' engine ids and the queue their results arrive on."""

    request_id: str
    engine_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_token_ids: dict[int, list[int]] = field(default_factory=dict)  # by choice, when asked for
    fetches: list[asyncio.Task] = field(default_factory=list)  # media downloads before a worker gets a prompt

    def index_of(self, engine_id: str) -> int:
        return int(engine_id.rsplit("-", 1)[1])


class EngineClient:
    def __init__(
        self,
        paths: ipc.IpcPaths,
        num_workers: int,
        tracker: RequestTracker | None = None,
        fetcher: MediaFetcher | None = None,
        media_time_budget_s: float | None = None,
    ) -> None:
        self.paths = paths
        self.num_workers = num_workers
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self.inbox = self._async_ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(paths.api)
        self.to_core = self._push(paths.core)
        self.to_workers = [self._push(paths.worker(i)) for i in range(num_workers)]
        # Per worker: the prompts sent to it and not done yet, (request id, first index) -> engine ids.
        self.assigned: list[dict[tuple[str, int], list[str]]] = [{} for _ in range(num_workers)]
        self.fetcher = fetcher
        self.media_time_budget_s = media_time_budget_s
        self.decoder = ipc.Decoder(ipc.ApiInbound)
        self.routes: dict[str, RequestHandle] = {}
        # Tokenize / detokenize jobs by engine id ("{id}-0"): their TokenizeResult or RequestError.
        self.jobs: dict[str, asyncio.Future] = {}
        self.core_info: ipc.CoreReady | None = None
        self.ready_workers: set[int] = set()
        self.workers_started = False  # every worker reported ready once (start-up is over)
        self.stats = ipc.CoreStats()
        self.tracker = tracker or RequestTracker()
        # A /start_profile or /stop_profile call in progress: (answers so far, done, answers expected).
        self._profile_answers: tuple[list[ipc.ProfileDone], asyncio.Future, int] | None = None
        self._receiver: asyncio.Task | None = None

    def _push(self, address: str) -> zmq.Socket:
        sock = self._sync_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address)
        return sock

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self._async_ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)

    @property
    def ready(self) -> bool:
        """Serving: the core is up, start-up saw every worker, and one is up now (a restarting
        worker's share waits in its socket or goes to the others)."""
        return self.core_info is not None and self.workers_started and bool(self.ready_workers)

    @property
    def outstanding(self) -> list[int]:
        """Prompts sent to each worker and not done."""
        return [len(a) for a in self.assigned]

    @property
    def num_inflight(self) -> int:
        """Engine requests (choices) accepted and not finished."""
        return len(self.routes)

    @property
    def num_waiting(self) -> int:
        """Accepted but not yet running: in a preprocess worker, in transit, or in the core's queue."""
        return max(0, len(self.routes) - self.stats.running)

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, request_id: str, request: GenerateRequest) -> RequestHandle:
        ids = [f"{request_id}-{i}" for i in range(request.num_choices)]
        handle = RequestHandle(request_id, ids)
        for rid in ids:
            self.routes[rid] = handle
            self.tracker.start(rid, api=request.api)
        try:
            self._submit_prompts(handle, request)
        except BaseException:
            # Nothing may stay registered for a request that never left: it would count as in
            # flight forever (and hold up a drain).
            self.abort(ids)
            raise
        return handle

    def _media_deadline(self) -> float | None:
        return None if self.media_time_budget_s is None else time.monotonic() + self.media_time_budget_s

    @property
    def _max_prompt_tokens(self) -> int | None:
        return self.core_info.max_model_len if self.core_info is not None else None

    def _submit_prompts(self, handle: RequestHandle, request: GenerateRequest) -> None:
        request_id, ids = handle.request_id, handle.engine_ids
        want_token_ids = request.return_token_ids or self.tracker.keep_token_ids
        deadline = self._media_deadline()
        for p, prompt in enumerate(request.prompts):
            msg = ipc.PreprocessRequest(
                request_id=request_id,
                first_index=p * request.n,
                n=request.n,
                sampling=request.sampling,
                messages=prompt if request.kind == "chat" else None,
                prompt=prompt if request.kind == "completion" else None,
                tools=request.tools,
                mm_processor_kwargs=request.mm_processor_kwargs,
                want_token_ids=want_token_ids,
                media_deadline=deadline,
                max_prompt_tokens=self._max_prompt_tokens,
            )
            prompt_ids = ids[p * request.n : (p + 1) * request.n]
            if self.fetcher is not None and request.kind == "chat" and remote_parts(prompt):
                task = asyncio.get_running_loop().create_task(self._fetch_then_send(msg, prompt_ids))
                handle.fetches.append(task)
            else:
                self._send_to_worker(msg, prompt_ids)

    def _send_to_worker(self, msg: ipc.PreprocessRequest, engine_ids: list[str]) -> None:
        """To the live worker holding the fewest prompts (any worker while none is live: the
        message then waits in the restarting worker's socket)."""
        live = [w for w in range(self.num_workers) if w in self.ready_workers] or list(range(self.num_workers))
        worker = min(live, key=lambda w: len(self.assigned[w]))
        msg.worker = worker
        self.assigned[worker][(msg.request_id, msg.first_index)] = engine_ids
        self.to_workers[worker].send_multipart(ipc.encode(msg))

    async def _fetch_then_send(self, msg: ipc.PreprocessRequest, engine_ids: list[str]) -> None:
        assert self.fetcher is not None
        try:
            msg.messages, seconds = await self.fetcher.fetch_all(msg.messages, msg.media_deadline)
        except MediaError as exc:
            for rid in engine_ids:
                self._route_error(ipc.RequestError(rid, 400, exc.message, "invalid_request_error", exc.param))
            return
        except Exception as exc:  # a bug here must answer the request, not leave it waiting forever
            logger.exception("fetching media for %s failed", msg.request_id)
            for rid in engine_ids:
                self._route_error(ipc.RequestError(rid, 500, f"fetching media failed: {type(exc).__name__}"))
            return
        self.tracker.on_media_fetched(engine_ids, seconds)
        if any(rid in self.routes or rid in self.jobs for rid in engine_ids):  # not aborted meanwhile
            self._send_to_worker(msg, engine_ids)

    # ---- tokenize / detokenize jobs ------------------------------------------------------------

    @property
    def num_jobs(self) -> int:
        """Tokenize / detokenize jobs not answered yet."""
        return len(self.jobs)

    async def run_job(self, msg: ipc.PreprocessRequest) -> ipc.TokenizeResult | ipc.RequestError:
        """A tokenize / detokenize job (`msg.purpose`) through a worker, with the checks and the
        media time budget a chat prompt gets; a prompt that certainly cannot fit the context is
        still refused before it is tokenized (a worker held for seconds otherwise)."""
        engine_id = f"{msg.request_id}-0"
        msg.first_index, msg.n = 0, 1
        msg.media_deadline = self._media_deadline()
        msg.max_prompt_tokens = self._max_prompt_tokens
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.jobs[engine_id] = answer
        fetch: asyncio.Task | None = None
        try:
            if self.fetcher is not None and msg.messages is not None and remote_parts(msg.messages):
                fetch = asyncio.get_running_loop().create_task(self._fetch_then_send(msg, [engine_id]))
            else:
                self._send_to_worker(msg, [engine_id])
            return await answer
        finally:  # answered, failed or abandoned: a late answer finds nothing and is dropped
            self.jobs.pop(engine_id, None)
            if fetch is not None:
                fetch.cancel()

    def _answer_job(self, engine_id: str, answer: ipc.TokenizeResult | ipc.RequestError) -> None:
        future = self.jobs.get(engine_id)
        if future is not None and not future.done():
            future.set_result(answer)

    def worker_died(self, worker: int) -> int:
        """A worker process is gone (the launcher restarts it): every prompt it held gets an error,
        and its socket is replaced so nothing queued for the dead process reaches the new one.
        Returns how many engine requests were failed."""
        self.ready_workers.discard(worker)
        failed = [rid for ids in self.assigned[worker].values() for rid in ids]
        self.assigned[worker].clear()
        for rid in failed:
            self._route_error(
                ipc.RequestError(
                    rid, 500, "the preprocess worker handling this request died; please retry", "server_error"
                )
            )
        self.to_workers[worker].close(linger=0)
        self.to_workers[worker] = self._push(self.paths.worker(worker))
        return len(failed)

    def abort(self, engine_ids: list[str]) -> None:
        """Forget the ids here and ask the core to drop them (non-blocking; safe during cancellation)."""
        handles = {rid: self.routes.pop(rid, None) for rid in engine_ids}
        live = [rid for rid, handle in handles.items() if handle is not None]
        for rid in engine_ids:
            self.tracker.on_abort(rid)
        for handle in {id(h): h for h in handles.values() if h is not None}.values():
            self._cancel_fetches(handle)
        if live:
            self.to_core.send_multipart(ipc.encode(ipc.Abort(live)))

    def _cancel_fetches(self, handle: RequestHandle) -> None:
        """Downloads stop once none of the request's choices is still wanted."""
        if handle.fetches and not any(rid in self.routes for rid in handle.engine_ids):
            for task in handle.fetches:
                task.cancel()

    def fail_all(self, status: int, message: str, type: str = "server_error") -> None:
        """Every in-flight request and job gets an error (a child died, or shutdown ran out of time)."""
        for engine_id in list(self.jobs):
            self._answer_job(engine_id, ipc.RequestError(engine_id, status, message, type))
        ids = list(self.routes)
        for rid in ids:
            handle = self.routes.pop(rid)
            err = ipc.RequestError(rid, status, message, type)
            self.tracker.on_error(err)
            handle.queue.put_nowait(err)
            self._cancel_fetches(handle)
        if ids:
            try:
                self.to_core.send_multipart(ipc.encode(ipc.Abort(ids)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ---- results -------------------------------------------------------------------------------

    async def profile(self, start: bool, directory: str, timeout_s: float = 120.0) -> list[ipc.ProfileDone]:
        """Start or stop the profiler of the engine core and of every worker; waits for all answers
        (the core's first)."""
        if self._profile_answers is not None:
            raise RuntimeError("a profiler request is already pending")
        expected = 1 + self.num_workers
        self._profile_answers = ([], asyncio.get_running_loop().create_future(), expected)
        msg = ipc.encode(ipc.ProfileControl(start, directory))
        for sock in (self.to_core, *self.to_workers):
            sock.send_multipart(msg)
        try:
            answers = await asyncio.wait_for(self._profile_answers[1], timeout_s)
        finally:
            self._profile_answers = None
        return sorted(answers, key=lambda a: a.process != "engine-core")

    async def _receive_loop(self) -> None:
        while True:
            parts = await self.inbox.recv_multipart(copy=False)
            try:
                msg, _ = self.decoder.decode(parts)
                self._dispatch(msg)
            except Exception:
                logger.exception("bad message from a child process")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ipc.ApiOutputs):
            for delta in msg.deltas:
                handle = self.routes.get(delta.request_id)
                if handle is not None:
                    self.tracker.on_delta(delta)
                    handle.queue.put_nowait(delta)
                    if delta.finished:
                        del self.routes[delta.request_id]
            for err in msg.errors:
                self._route_error(err)
            if msg.stats is not None:
                self.stats = msg.stats
        elif isinstance(msg, ipc.RequestError):
            self._route_error(msg)
        elif isinstance(msg, ipc.PreprocessDone):
            if 0 <= msg.worker < self.num_workers:
                self.assigned[msg.worker].pop((msg.request_id, msg.first_index), None)
            if msg.purpose != "generate":
                return  # a tokenize job: no generation, so none of the request metrics
            self.tracker.on_preprocessed(msg)
            if msg.prompt_token_ids is not None:
                handle = self.routes.get(f"{msg.request_id}-{msg.first_index}")
                if handle is not None:
                    for i in range(msg.first_index, msg.first_index + msg.n):
                        handle.prompt_token_ids[i] = msg.prompt_token_ids
        elif isinstance(msg, ipc.TokenizeResult):
            self._answer_job(msg.request_id, msg)
        elif isinstance(msg, ipc.ProfileDone):
            if self._profile_answers is not None:
                answers, done, expected = self._profile_answers
                answers.append(msg)
                if len(answers) == expected and not done.done():
                    done.set_result(answers)
        elif isinstance(msg, ipc.CoreReady):
            self.core_info = msg
            self.stats = ipc.CoreStats(pages_total=msg.num_pages)
            logger.info("engine core ready: %s, max_model_len %d", msg.model, msg.max_model_len)
        elif isinstance(msg, ipc.WorkerReady):
            self.ready_workers.add(msg.worker)
            if len(self.ready_workers) == self.num_workers:
                self.workers_started = True

    def _route_error(self, err: ipc.RequestError) -> None:
        if err.request_id in self.jobs:
            self._answer_job(err.request_id, err)
            return
        self.tracker.on_error(err)
        handle = self.routes.pop(err.request_id, None)
        if handle is not None:
            handle.queue.put_nowait(err)
            self._cancel_fetches(handle)
