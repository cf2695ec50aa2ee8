"""The API server's side of the sockets: submit requests, route results back to HTTP handlers.

Each OpenAI request gets one asyncio queue; every choice is an engine request `"{id}-{index}"`
routed to that queue. Sends use plain (non-async) ZMQ PUSH sockets with no high-water mark, so
they never block and can run inside a cancelled task's cleanup; the one receiving socket is
read by a single asyncio task.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from vlm_engine import ipc
from vlm_engine.metrics.request_tracker import RequestTracker
from vlm_engine.server.protocol import GenerateRequest

logger = logging.getLogger(__name__)


@dataclass
class RequestHandle:
    """One OpenAI request in flight: its choices' engine ids and the queue their results arrive on."""

    request_id: str
    engine_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_token_ids: dict[int, list[int]] = field(default_factory=dict)  # by choice, when asked for

    def index_of(self, engine_id: str) -> int:
        return int(engine_id.rsplit("-", 1)[1])


class EngineClient:
    def __init__(self, paths: ipc.IpcPaths, num_workers: int, tracker: RequestTracker | None = None) -> None:
        self.paths = paths
        self.num_workers = num_workers
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self.inbox = self._async_ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(paths.api)
        self.to_core = self._push(paths.core)
        self.to_workers = [self._push(paths.worker(i)) for i in range(num_workers)]
        self.outstanding = [0] * num_workers  # preprocess jobs sent but not done, per worker
        self.decoder = ipc.Decoder(ipc.ApiInbound)
        self.routes: dict[str, RequestHandle] = {}
        self.core_info: ipc.CoreReady | None = None
        self.ready_workers: set[int] = set()
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
        return self.core_info is not None and len(self.ready_workers) == self.num_workers

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
            self.tracker.start(rid)
        want_token_ids = request.return_token_ids or self.tracker.keep_token_ids
        for p, prompt in enumerate(request.prompts):
            worker = min(range(self.num_workers), key=self.outstanding.__getitem__)
            self.outstanding[worker] += 1
            msg = ipc.PreprocessRequest(
                request_id=request_id,
                first_index=p * request.n,
                n=request.n,
                sampling=request.sampling,
                messages=prompt if request.kind == "chat" else None,
                prompt=prompt if request.kind == "completion" else None,
                tools=request.tools,
                mm_processor_kwargs=request.mm_processor_kwargs,
                worker=worker,
                want_token_ids=want_token_ids,
            )
            self.to_workers[worker].send_multipart(ipc.encode(msg))
        return handle

    def abort(self, engine_ids: list[str]) -> None:
        """Forget the ids here and ask the core to drop them (non-blocking; safe during cancellation)."""
        live = [rid for rid in engine_ids if self.routes.pop(rid, None) is not None]
        for rid in engine_ids:
            self.tracker.on_abort(rid)
        if live:
            self.to_core.send_multipart(ipc.encode(ipc.Abort(live)))

    def fail_all(self, status: int, message: str, type: str = "server_error") -> None:
        """Every in-flight request gets an error (a child died, or shutdown ran out of time)."""
        ids = list(self.routes)
        for rid in ids:
            handle = self.routes.pop(rid)
            err = ipc.RequestError(rid, status, message, type)
            self.tracker.on_error(err)
            handle.queue.put_nowait(err)
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
            self.outstanding[msg.worker] = max(0, self.outstanding[msg.worker] - 1)
            self.tracker.on_preprocessed(msg)
            if msg.prompt_token_ids is not None:
                handle = self.routes.get(f"{msg.request_id}-{msg.first_index}")
                if handle is not None:
                    for i in range(msg.first_index, msg.first_index + msg.n):
                        handle.prompt_token_ids[i] = msg.prompt_token_ids
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

    def _route_error(self, err: ipc.RequestError) -> None:
        self.tracker.on_error(err)
        handle = self.routes.pop(err.request_id, None)
        if handle is not None:
            handle.queue.put_nowait(err)
