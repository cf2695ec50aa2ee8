"""`vlm-engine batch --ray ADDRESS`: the batch CLI's requests answered by engines in Ray actors,
over a Ray Dataset (Ray Data schedules, streams and backpressures; there is no scheduler here).

    items -> from_items -> build_bodies (tasks on the driver's node) -> EngineActor (N actors) -> driver

The driver keeps everything `run.py` does: expanding inputs, skipping what --out holds, retries,
schema checks and writing rows as results stream back, so killing it loses only requests in
flight and a rerun resumes. Bodies are built by the local CLI's own code (`BodyOptions.body`) on
the driver's node, where the files are (the driver already hashed them), and travel to the actors
as JSON; each actor runs the local in-process backend (`EngineBackend`) on them, so a row is the
row the local CLI writes. A retry (an answer failing --schema) goes in a later dataset, once the
current one is done: a Ray Dataset is fixed when it starts.

Ray is an optional extra (`pip install vlm-engine[ray]`): only this module imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from vlm_engine.batch.backends import BodyOptions, EngineBackend, Job, Outcome, Report, failure_reason
from vlm_engine.batch.inputs import WorkItem

# Requests per actor call (and per block): small, so answers reach the driver, and --out, soon after
# they finish; calls in flight per actor keep its engine full (`_calls_in_flight`).
ROWS_PER_CALL = 4
BODY_BUILDERS = 2  # concurrent body-building tasks (file reads and PDF renders)


# ---- on the cluster -------------------------------------------------------------------------------


def build_bodies(batch: dict[str, np.ndarray], options: BodyOptions) -> dict[str, list[Any]]:
    """Pickled (item, retry temperature) -> the JSON request body, or why it could not be built
    (an unreadable file becomes that input's error row, as in the local CLI)."""
    bodies, errors, statuses = [], [], []
    for spec in batch["spec"]:
        item, temperature = pickle.loads(spec)
        job = Job(item, lambda j: options.body(j.item), temperature=temperature)
        try:
            bodies.append(json.dumps(job.body()))
            errors.append("")
            statuses.append(0)
        except Exception as exc:  # noqa: BLE001 - every failure of one input is its row
            bodies.append("")
            errors.append(failure_reason(exc))
            statuses.append(getattr(exc, "status", 400))
    return {"job": list(batch["job"]), "body": bodies, "error": errors, "status": statuses}


# A stand-in item for jobs inside an actor: the body is built already, and rows are written by the driver.
_BUILT = WorkItem(source="", kind="built")


class EngineActor:
    """A Ray Data UDF holding one in-process engine (the local CLI's `EngineBackend`) whose step loop
    runs on a thread for the actor's life. Ray Data runs several calls at once on an actor
    (`max_concurrent_calls_per_actor`); each submits its requests and awaits their answers, so the
    calls share the engine's batches instead of draining it between calls."""

    def __init__(self, model: str, concurrency: int, dtype: str, engine_kwargs: dict[str, Any]) -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.backend = EngineBackend(model, concurrency, dtype=dtype, **engine_kwargs)
        self.backend.report = self._finished
        self._waiting: dict[int, asyncio.Future[Outcome]] = {}
        self._failure: str | None = None
        threading.Thread(target=self._step_loop, name="engine", daemon=True).start()

    def _step_loop(self) -> None:
        try:
            self.backend.run(lambda: True)
        except BaseException as exc:  # noqa: BLE001 - a broken engine fails its calls: the run stops, a rerun resumes
            self._failure = f"the engine stopped: {failure_reason(exc)}"
            for future in list(self._waiting.values()):
                self._resolve(future, None, self._failure)

    def _finished(self, outcome: Outcome) -> None:  # on the engine thread
        future = self._waiting.pop(id(outcome.job))
        self._resolve(future, outcome)

    @staticmethod
    def _resolve(future: asyncio.Future[Outcome], outcome: Outcome | None, failure: str | None = None) -> None:
        """Settles `future` on its own event loop (asyncio futures are not thread-safe)."""

        def set_result() -> None:
            if future.done():
                return
            if outcome is None:
                future.set_exception(RuntimeError(failure))
            else:
                future.set_result(outcome)

        future.get_loop().call_soon_threadsafe(set_result)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        loop = asyncio.get_running_loop()
        waits = []
        for body, error, status in zip(batch["body"], batch["error"], batch["status"], strict=True):
            if error:
                waits.append(_ready(Outcome(Job(_BUILT, _no_body), error=str(error), status=int(status))))
                continue
            job = Job(_BUILT, lambda _job, text=str(body): json.loads(text))
            future = self._waiting[id(job)] = loop.create_future()
            self.backend.submit(job)
            waits.append(future)
        if self._failure is not None:  # the engine stopped while these were submitted: fail, don't hang
            for future in waits:
                self._resolve(future, None, self._failure)
        outcomes = await asyncio.gather(*waits)
        return {
            "job": list(batch["job"]),
            "response": [json.dumps(o.response) if o.response is not None else "" for o in outcomes],
            "error": [o.error or "" for o in outcomes],
            "status": [o.status for o in outcomes],
            "actor": [self.name] * len(outcomes),
        }


def _no_body(job: Job) -> dict[str, Any]:
    raise AssertionError("a job whose body failed to build is never sent")


def _ready(outcome: Outcome) -> asyncio.Future[Outcome]:
    future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    future.set_result(outcome)
    return future


# ---- on the driver --------------------------------------------------------------------------------


class RayBackend:
    """`run.py`'s backend interface over Ray Data: jobs submitted before or during `run` go to the
    cluster as one dataset per round; each finished request is reported as it streams back."""

    report: Report

    def __init__(
        self,
        address: str,
        body_options: BodyOptions,
        actors: int = 1,
        actor_cpus: float = 1.0,
        concurrency: int = 16,
        dtype: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = body_options.model
        self.body_options = body_options
        self.actors, self.actor_cpus, self.concurrency = max(1, actors), actor_cpus, max(1, concurrency)
        self.actor_args = {
            "model": body_options.model,
            "concurrency": self.concurrency,
            "dtype": dtype,
            "engine_kwargs": engine_kwargs or {},
        }
        self.sent: Counter[str] = Counter()  # rows per actor
        self._pending: list[Job] = []
        self._lock = threading.Lock()
        self._owns_ray = connect(address)
        quiet_ray_data()

    def submit(self, job: Job, avoid: str | None = None) -> None:
        """`avoid` means nothing here: Ray Data places the work (and retries a lost actor's)."""
        with self._lock:
            self._pending.append(job)

    def run(self, more_expected: Callable[[], bool]) -> None:
        import time

        while True:
            with self._lock:
                jobs, self._pending = self._pending, []
            if jobs:
                self._round(jobs)
            elif more_expected():
                time.sleep(0.05)
            else:
                return

    def _round(self, jobs: list[Job]) -> None:
        by_id = dict(enumerate(jobs))
        for row in self.dataset(jobs).iter_rows():
            job = by_id[int(row["job"])]
            if row["actor"]:
                self.sent[str(row["actor"])] += 1
            response = json.loads(row["response"]) if row["response"] else None
            self.report(Outcome(job, response=response, error=row["error"] or None, status=int(row["status"])))

    def dataset(self, jobs: list[Job]) -> Any:
        """The round's Ray Dataset, lazily: one row per job, answered by the engine actors."""
        import ray

        specs = [{"job": n, "spec": pickle.dumps((job.item, job.temperature))} for n, job in enumerate(jobs)]
        blocks = -(-len(specs) // ROWS_PER_CALL)  # a block per call, so each call's rows return together
        # Every node has a resource named after its address: a sliver of the driver's pins tasks to it.
        here = {f"node:{ray.util.get_node_ip_address()}": 0.001}
        return (
            ray.data.from_items(specs, override_num_blocks=blocks)
            .map_batches(
                build_bodies,
                fn_kwargs={"options": self.body_options},
                compute=ray.data.TaskPoolStrategy(size=min(BODY_BUILDERS, blocks)),
                # No CPU reserved: reading files must not wait for CPUs the engines hold.
                num_cpus=0,
                resources=here,  # the files are where the driver found them
            )
            .map_batches(
                EngineActor,
                fn_constructor_kwargs=self.actor_args,
                batch_size=ROWS_PER_CALL,
                # Calls run at once on an actor, not queued behind each other: their requests share its engine.
                compute=ray.data.ActorPoolStrategy(
                    size=self.actors,
                    max_tasks_in_flight_per_actor=self._calls_in_flight(),
                    max_concurrent_calls_per_actor=self._calls_in_flight(),
                ),
                num_cpus=self.actor_cpus,
            )
        )

    def _calls_in_flight(self) -> int:
        # Enough calls queued at each actor for a full scheduler plus as many again being preprocessed
        # (the local backend keeps the same two batches' worth ahead of its step loop).
        return max(2, -(-2 * self.concurrency // ROWS_PER_CALL))

    def close(self) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()


def connect(address: str) -> bool:
    """Joins (or, for "local", starts) a Ray cluster; True when this call did, so `close` leaves a
    Ray the caller had already started alone."""
    import logging

    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        # A cluster of this machine only: nothing listens beyond loopback, no dashboard.
        # address="local": a new cluster, never one that happens to run on this machine already.
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    return True


def quiet_ray_data() -> None:
    """The batch CLI draws its own progress bar and summary; Ray Data's would interleave with them."""
    import logging

    import ray

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
