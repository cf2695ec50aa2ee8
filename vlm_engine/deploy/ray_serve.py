"""`vlm-engine serve --ray`: N replicas of one model behind Ray Serve's HTTP proxy.

The boundary: **each Serve replica runs the whole multi-process server** (`vlm-engine serve`: API,
preprocess workers, engine core, detokenizer) as a child process on a port of its node's address,
and forwards requests to it. Everything a single server does (streaming, the Responses store, metrics, media
fetching, draining, worker restarts) works unchanged in a replica, and a replica fails as one
server fails. The alternative, the engine core behind a Serve deployment, would move tokenization
and media decoding into Serve's request path and re-implement our process split on Ray's; the
server's process split already keeps the core's step loop free of that work.

    client ⇄ Serve HTTP proxy ⇄ Ingress (FastAPI: the OpenAI routes, pins, /metrics of all replicas)
                                   │ DeploymentHandle, request router = MediaPrefixAffinityRouter
                                   ▼
                       ServerReplica × N ── http://NODE_IP:PORT ──> vlm-engine serve (child)

Routing (`routing.py`, `ray_router.py`): Ray's prefix-affinity router with our key (text and
media content hashes in prompt order); a Responses follow-up (`previous_response_id`, and GET /
DELETE of a stored response) is pinned to the replica that stored it. Autoscaling is Serve's, on
ongoing requests per replica (the queue depth), when `--ray-max-replicas` exceeds
`--ray-replicas`. A replica whose server died fails Serve's health check and is replaced; a
request whose replica died before answering is retried once elsewhere, one that had started
streaming ends with an error event.
"""

# No `from __future__ import annotations`: FastAPI must see the routes' real annotation objects
# through Serve's class-based ingress (string annotations reach it unresolved).

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from vlm_engine.deploy.metrics_merge import merge_expositions
from vlm_engine.deploy.routing import RoutedRequest, routing_key
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.errors import error_body

logger = logging.getLogger(__name__)

APP_NAME = "vlm-engine"
DIRECTORY = "vlm_engine_replicas"  # the named actor replicas register their server URLs with
NAMESPACE = "vlm_engine"  # where it lives (Serve's actors and a driver run in different namespaces)
ROUTERS = {
    "affinity": "vlm_engine.deploy.ray_router.MediaPrefixAffinityRouter",
    "round_robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
}
_FORWARDED_HEADERS = ("authorization", "content-type", "accept")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]+)"')
_PINS_KEPT = 100_000  # response id -> replica, for follow-ups (oldest forgotten first)



def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """Which replica serves at which URL: read by the ingress for /metrics, /health and for
    finding a stored response it has no pin for."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}

    def register(self, replica_id: str, url: str, pid: int) -> None:
        self.replicas[replica_id] = {"url": url, "pid": pid}

    def unregister(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def list(self) -> dict[str, dict[str, Any]]:
        return dict(self.replicas)


def directory() -> Any:
    return ReplicaDirectory.options(
        name=DIRECTORY, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class ServerReplica:
    """One replica: starts `vlm-engine serve` as a child and forwards requests to it."""

    def __init__(self, config: ServerConfig, startup_timeout_s: float = 900.0) -> None:
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()
        # The node's address, not loopback: the ingress (possibly on another node) reads the
        # server's /metrics and /health, and asks it for stored responses, directly.
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        config = _with(config, api={"host": host, "port": port},
                       observability={"replica_id": context.replica_id.unique_id})  # fmt: skip
        self.url = f"http://{host}:{port}"
        fd, path = tempfile.mkstemp(prefix="vlm-replica-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f)
        self.proc = subprocess.Popen([sys.executable, "-m", "vlm_engine.deploy.replica_process", path])
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0))
        _wait_healthy(self.url, self.proc, startup_timeout_s)
        self.directory = directory()
        ray.get(self.directory.register.remote(self.replica_id, self.url, os.getpid()))

    async def forward(self, request: RoutedRequest) -> AsyncIterator[Any]:
        """The server's answer: first {"status", "content_type", "replica"}, then its body's bytes."""
        async with self.client.stream(
            request.method, request.path, content=request.body, headers=request.headers
        ) as response:
            yield {
                "status": response.status_code,
                "content_type": response.headers.get("content-type", "application/json"),
                "replica": self.replica_id,
            }
            async for chunk in response.aiter_raw():
                yield chunk

    async def check_health(self) -> None:
        """Serve's periodic probe: a replica whose server exited or stopped serving is replaced."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the replica's server exited with status {self.proc.returncode}")
        response = await self.client.get("/health", timeout=10.0)
        if response.status_code != 200:
            raise RuntimeError(f"the replica's server answers /health with {response.status_code}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # shutting down: the directory may be gone already
            ray.get(self.directory.unregister.remote(self.replica_id), timeout=5)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then stops its children
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _with(config: ServerConfig, **sections: dict[str, Any]) -> ServerConfig:
    changes = {name: dataclasses.replace(getattr(config, name), **values) for name, values in sections.items()}
    return dataclasses.replace(config, **changes)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the replica's server exited with status {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"the replica's server was not healthy after {timeout_s:.0f} s")


def _json_or_none(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None  # the replica's server answers it with its own 400


class ReplicaGone(Exception):
    """The replica died before it answered: the request may go to another one."""


# Everything the ingress's methods use is defined above it: Serve pickles the class by value when it
# is built, and names defined later in this module are not in what it captured.
ingress_app = FastAPI(title="vlm-engine on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """The HTTP routes: every OpenAI route of the server, forwarded to a replica."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas
        self.directory = directory()
        self.pins: OrderedDict[str, str] = OrderedDict()  # response id -> replica id
        self.http = httpx.AsyncClient(timeout=10.0)

    @ingress_app.get("/health")
    async def health(self) -> Response:
        for url in await self._urls():
            try:
                if (await self.http.get(url + "/health")).status_code == 200:
                    return JSONResponse({"status": "ok"})
            except httpx.HTTPError:
                continue
        return JSONResponse({"status": "no replica is serving"}, status_code=503)

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every live replica's /metrics in one exposition (their samples carry `replica`)."""
        texts = await asyncio.gather(*(self._get_text(url + "/metrics") for url in await self._urls()))
        return Response(merge_expositions([t for t in texts if t]), media_type="text/plain; version=0.0.4")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        parsed = _json_or_none(body) if request.method == "POST" else None
        query = f"?{request.url.query}" if request.url.query else ""
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        routed = RoutedRequest(
            method=request.method,
            path="/" + path + query,
            body=body,
            headers=headers,
            routing_key=routing_key(parsed),
            pinned_replica=await self._pin_for(path, parsed, headers),
        )
        for attempt in (0, 1):
            try:
                return await self._answer(routed)
            except ReplicaGone as exc:
                if attempt == 1 or routed.pinned_replica is not None:
                    return JSONResponse(
                        error_body(f"the replica serving this request died ({exc}); please retry", "server_error"),
                        status_code=503,
                        headers={"Retry-After": "1"},
                    )
                logger.warning("replica died before answering; retrying once elsewhere: %s", exc)
        raise AssertionError("unreachable")

    async def _answer(self, routed: RoutedRequest) -> Response:
        stream = self.replicas.options(stream=True).forward.remote(routed)
        try:
            head = await stream.__anext__()
        except ray.exceptions.RayError as exc:  # the actor died, or its server refused the connection
            raise ReplicaGone(type(exc).__name__) from None
        status, media_type, replica = head["status"], head["content_type"], head["replica"]
        if media_type.startswith("text/event-stream"):
            return StreamingResponse(
                self._relay(stream, replica, routed), status_code=status, media_type=media_type,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        content = b"".join(chunks)
        self._remember(routed, content, replica, status)
        return Response(content, status_code=status, media_type=media_type)

    async def _relay(self, stream: Any, replica: str, routed: RoutedRequest) -> AsyncIterator[bytes]:
        """A stream's bytes; a replica that dies mid-stream ends it with an error event."""
        first = True
        try:
            async for chunk in stream:
                if first:
                    self._remember(routed, chunk, replica, 200)
                    first = False
                yield chunk
        except ray.exceptions.RayError as exc:
            body = error_body(f"the replica serving this stream died ({type(exc).__name__})", "server_error")
            yield b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _remember(self, routed: RoutedRequest, content: bytes, replica: str, status: int) -> None:
        """Pin a stored response to its replica, for follow-ups."""
        if status != 200 or routed.method != "POST" or not routed.path.startswith("/v1/responses"):
            return
        match = _RESPONSE_ID.search(content[:4096])
        if match is not None:
            self.pins[match.group(1).decode()] = replica
            while len(self.pins) > _PINS_KEPT:
                self.pins.popitem(last=False)

    async def _pin_for(self, path: str, body: Any, headers: dict[str, str]) -> str | None:
        response_id = None
        if path.startswith("v1/responses/"):
            response_id = path.removeprefix("v1/responses/").split("/", 1)[0]
        elif isinstance(body, dict) and isinstance(body.get("previous_response_id"), str):
            response_id = body["previous_response_id"]
        if response_id is None:
            return None
        if response_id not in self.pins:
            await self._find(response_id, headers)
        return self.pins.get(response_id)

    async def _find(self, response_id: str, headers: dict[str, str]) -> None:
        """No pin (this ingress restarted, or the id is unknown): ask every replica, as the client."""
        auth = {k: v for k, v in headers.items() if k == "authorization"}
        replicas = await self.directory.list.remote()
        for replica_id, entry in replicas.items():
            try:
                if (await self.http.get(f"{entry['url']}/v1/responses/{response_id}", headers=auth)).status_code == 200:
                    self.pins[response_id] = replica_id
                    return
            except httpx.HTTPError:
                continue

    async def _urls(self) -> list[str]:
        """Live replicas' server URLs. A replica killed outright never unregistered: its URL refuses
        connections, and is forgotten here."""
        urls = []
        for replica_id, entry in (await self.directory.list.remote()).items():
            try:
                await self.http.get(entry["url"] + "/health", timeout=2.0)
                urls.append(entry["url"])
            except httpx.ConnectError:
                await self.directory.unregister.remote(replica_id)
            except httpx.HTTPError:
                urls.append(entry["url"])  # slow, not gone
        return urls

    async def _get_text(self, url: str) -> str | None:
        try:
            response = await self.http.get(url)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None


def replica_options(config: ServerConfig) -> dict[str, Any]:
    """The ServerReplica deployment's Serve options for `config`'s `ray` section."""
    r = config.ray
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": r.ray_replica_cpus, "num_gpus": r.ray_replica_gpus},
        "max_ongoing_requests": r.ray_max_ongoing_requests,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": config.process.shutdown_timeout_s + 5.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTERS[r.ray_routing],
            request_router_kwargs=_affinity_options(r) if r.ray_routing == "affinity" else {},
        ),
    }
    if r.ray_max_replicas is not None and r.ray_max_replicas > r.ray_replicas:
        # Serve's autoscaling on the queue depth: ongoing requests per replica.
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=r.ray_replicas,
            max_replicas=r.ray_max_replicas,
            target_ongoing_requests=r.ray_target_ongoing_requests,
        )
    else:
        options["num_replicas"] = r.ray_replicas
    return options


def build_application(config: ServerConfig) -> Any:
    """The Serve application for `config` (its `ray` section: replicas, autoscaling, routing)."""
    replicas = serve.deployment(ServerReplica, name="ServerReplica", **replica_options(config)).bind(config)
    return serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(replicas)


def _affinity_options(r: Any) -> dict[str, Any]:
    """Ray's defaults never let load outweigh affinity (a popular prefix would pile up on one
    replica) and never trim the prefix tree (it would grow for the service's life): here load wins
    once replicas' queues differ by the autoscaling target, and the tree is kept near 400k chars."""
    return {"imbalanced_threshold": r.ray_target_ongoing_requests, "do_eviction": True}


def app_builder(args: dict[str, Any]) -> Any:
    """The application for `serve run` and KubeRay's RayService (`import_path:
    vlm_engine.deploy.ray_serve:app_builder`): `args` are `vlm-engine serve` options by their
    field names (`model`, `ray_replicas`, `ray_max_replicas`, `max_num_seqs`, ...)."""
    values = {k.replace("-", "_"): v for k, v in args.items()}
    return build_application(ServerConfig.from_flat(**{**values, "ray": True}))


def serve_on_ray(config: ServerConfig) -> int:
    """Run the application until SIGINT / SIGTERM (`vlm-engine serve --ray`), then stop it: the
    replicas drain (their servers get SIGTERM), and a cluster this process started goes with it."""
    # No address: a new local cluster ("local"), never one that happens to run here (that is "auto").
    ray.init(address=config.ray.ray_address or "local", include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": config.api.host, "port": config.api.port})
    serve.run(build_application(config), name=APP_NAME, route_prefix="/")
    logger.info("serving on Ray at http://%s:%d", config.api.host, config.api.port)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    logger.info("stopping the Serve application")
    # Bounded: a cluster that lost its raylet (a signal to the whole process group) would hang it.
    stopper = threading.Thread(target=serve.shutdown, daemon=True)
    stopper.start()
    stopper.join(config.process.shutdown_timeout_s + 60.0)
    ray.shutdown()
    return 0
