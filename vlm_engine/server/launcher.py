"""`vlm-engine serve`: start the child processes, serve HTTP, watch the children, shut down cleanly.

Process layout (all children use the `spawn` start method):
    api server (this process: uvicorn + FastAPI, nice 10; never imports torch)
    ├── vlm-core    engine core: scheduler + model runner (normal priority, all torch threads)
    ├── vlm-detok   detokenizer (nice 10; the tokenizers library alone, no torch)
    └── vlm-prep-i  preprocess workers (nice 10, 1 torch thread each)

Lifecycle:
- /health is 503 until the core (after warm-up) and every worker have reported ready.
- SIGINT/SIGTERM: /health and new requests answer 503, in-flight requests get
  `shutdown_timeout_s` to finish and are then failed and aborted; uvicorn stops, children get
  SIGTERM (then SIGKILL), are joined, and the process exits 0. A second signal stops at once.
- A preprocess worker that dies after start-up is restarted at once; only the prompts it held get
  an error (500) and the other workers keep serving (/health stays 200 while one worker is up).
  One that dies during start-up, or 5 times within a minute, stops the server like any child.
- The engine core or the detokenizer dying: every in-flight request gets an error, /health turns
  503, and the server exits with status 1 (a supervisor restarts the whole group; a partial restart
  would have to rebuild the state the dead child held: the KV cache, the detokenizer streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from vlm_engine import ipc
from vlm_engine.metrics.status_log import StatusLine
from vlm_engine.server.api import build_app
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.engine_client import EngineClient
from vlm_engine.server.http_common import ServerState
from vlm_engine.server.media_fetch import MediaFetcher
from vlm_engine.server.metrics import observe_requests
from vlm_engine.server.procs import Child, ChildGroup, lower_priority, set_process_name, setup_logging

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 0.2
_FAIL_LINGER_S = 1.0  # after a child died: time for error events to reach clients, /health shows 503
# A preprocess worker is restarted unless it died this many times within the window (then the
# server stops as for any other child: something is wrong beyond one bad input).
_MAX_RESTARTS_PER_WINDOW = 5
_RESTART_WINDOW_S = 60.0


def serve(config: ServerConfig) -> int:
    """Run the server until a signal or a child failure; returns the process exit status."""
    setup_logging(config.process.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_dir = Path(tempfile.mkdtemp(prefix="vlm-engine-"))
    paths = ipc.IpcPaths(run_dir)
    children = ChildGroup()
    children.add("engine-core", "vlm_engine.server.engine_core:run_engine_core", config, paths)
    children.add("detokenizer", "vlm_engine.server.detokenizer_proc:run_detokenizer", config, paths)
    for i in range(config.process.preprocess_workers):
        children.add(
            f"preprocess-{i}", "vlm_engine.server.preprocess_worker:run_preprocess_worker", config, paths, i,
            worker_index=i,
        )  # fmt: skip
    try:
        children.start()
        # Only after the spawns: children inherit the niceness, and the core must keep priority 0.
        lower_priority(config.process.side_process_nice)
        set_process_name("vlm-api")
        return asyncio.run(_serve_http(config, paths, children))
    finally:
        children.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
        logger.info("all child processes stopped")


class _Server(uvicorn.Server):
    """uvicorn with our shutdown: drain first, and never re-raise the signal (exit status 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.timeout_s = timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self.should_exit:
            logger.warning("second signal: stopping now")
            self.should_exit = True
            self.force_exit = True
            return
        logger.info("received %s: draining in-flight requests", signal.Signals(sig).name)
        self.state.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        client = self.state.client
        deadline = time.monotonic() + self.timeout_s
        while client.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.num_inflight:
            logger.warning("aborting %d unfinished requests", client.num_inflight)
            client.fail_all(503, "the server is shutting down")
            await asyncio.sleep(0.1)  # let the handlers write their error responses
        self.should_exit = True

    def fail(self, message: str, exit_code: int) -> None:
        """A child died: fail everything in flight, then stop."""
        if self.state.failure is None and not self.state.draining:
            self.state.failure = message
            self.exit_code = exit_code
        self.state.client.fail_all(500, message)
        self._loop.call_later(_FAIL_LINGER_S, setattr, self, "should_exit", True)  # type: ignore[union-attr]


async def _watch(children: ChildGroup, server: _Server) -> None:
    while True:
        await asyncio.sleep(_WATCH_INTERVAL_S)
        dead = children.dead()
        if dead and server.state.client.workers_started and not server.state.draining:
            dead = _restart_workers(dead, children, server.state)
        if dead:
            child = dead[0]
            message = f"the {child.name} process (pid {child.pid}) exited with status {child.exitcode}"
            if server.state.draining:
                logger.warning("%s during shutdown", message)
                server.fail(message, 0)
            else:
                logger.error("%s; shutting down", message)
                server.fail(message, 1)
            return


def _restart_workers(dead: list[Child], children: ChildGroup, state: ServerState) -> list[Child]:
    """A preprocess worker holds nothing but the prompts it was working on: those get an error and
    a new worker takes its place (the others keep serving meanwhile). Returns the dead children
    that cannot be restarted (the engine core holds the KV cache, the detokenizer the streams)."""
    others = []
    now = time.monotonic()
    for child in dead:
        recent = [t for t in child.restart_times if now - t < _RESTART_WINDOW_S]
        if child.worker_index is None or len(recent) >= _MAX_RESTARTS_PER_WINDOW:
            others.append(child)  # a worker that keeps dying is a broken deployment: stop, loudly
            continue
        pid, status = child.pid, child.exitcode
        failed = state.client.worker_died(child.worker_index)
        children.restart(child)
        child.restart_times = [*recent, now]
        if state.metrics is not None:
            state.metrics.worker_restarts.inc()
        logger.error(
            "the %s process (pid %s) exited with status %s; %d requests it held got an error; restarted as pid %s",
            child.name, pid, status, failed, child.pid,
        )  # fmt: skip
    return others


async def _status_log(client: EngineClient, interval_s: float) -> None:
    status = StatusLine()
    while True:
        line = status.line(client.stats, client.num_inflight, time.monotonic())
        if line is not None:
            logger.info(line)
        await asyncio.sleep(interval_s)


async def _serve_http(config: ServerConfig, paths: ipc.IpcPaths, children: ChildGroup) -> int:
    media, process = config.engine.media, config.process
    client = EngineClient(
        paths,
        config.process.preprocess_workers,
        fetcher=MediaFetcher(media),
        media_time_budget_s=media.media_time_budget_s or None,
    )
    client.start()
    state = ServerState(config, client)
    observe_requests(state)
    uv_config = uvicorn.Config(
        build_app(state),
        host=config.api.host,
        port=config.api.port,
        log_level=process.log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=int(process.shutdown_timeout_s) + 2,
    )
    server = _Server(uv_config, state, process.shutdown_timeout_s)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_watch(children, server))]
    stats = config.observability
    if stats.log_stats and stats.log_stats_interval_s > 0:
        tasks.append(loop.create_task(_status_log(client, stats.log_stats_interval_s)))
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        client.close()
    return server.exit_code
