"""Ray Serve scale-out, for real: a local Ray head on loopback, the tiny Qwen2-VL, 2 replicas of 1
CPU, each the whole multi-process server. Streaming equals the server alone; cache-affinity
routing keeps prefix hits at a single server's level where round robin does not; a replica
SIGKILLed mid-load costs errors or retries, never a hang, and Serve restores it. Units first:
the routing key and the metrics merge, without Ray."""

from __future__ import annotations

import base64
import io
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, free_port, running
from vlm_engine.deploy.routing import RoutedRequest, key_of, media_hash, pinned_replica, routing_key
from vlm_engine.metrics.scrape import parse_metrics

MODEL = "tiny-vlm"
# A process of its own under make test: Ray's clusters, its memory monitor and its background
# threads meet a fresh interpreter, not one that earlier modules' models have grown.
pytestmark = pytest.mark.ray


def png_uri(seed: int, size: tuple[int, int] = (48, 40)) -> str:
    buffer = io.BytesIO()
    make_image(*size, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(uri: str, text: str = "Describe this picture.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


# ---- the routing key, without Ray ------------------------------------------------------------------


def test_the_key_holds_media_hashes_in_prompt_order() -> None:
    a, b = png_uri(1), png_uri(2)
    key_a = routing_key({"messages": image_message(a)})
    assert media_hash(a) in key_a and key_a.index(media_hash(a)) < key_a.index("Describe")
    # Same question, different pictures: different keys from the image on (Ray's own key, the
    # messages' text alone, would call them equal).
    key_b = routing_key({"messages": image_message(b)})
    assert key_a != key_b and key_a.split(media_hash(a))[0] == key_b.split(media_hash(b))[0]
    # A follow-up turn extends the key: its prefix is the first turn's.
    turn = image_message(a) + [{"role": "assistant", "content": "A square."}, {"role": "user", "content": "More?"}]
    assert routing_key({"messages": turn}).startswith(key_a)
    # The Responses API's items key like chat's messages; instructions lead.
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": a},
                                          {"type": "input_text", "text": "Describe this picture."}]}]  # fmt: skip
    key_r = routing_key({"input": items, "instructions": "Be brief."})
    assert key_r.startswith("system\nBe brief.\n") and media_hash(a) in key_r
    assert routing_key({"prompt": "abc"}) == "abc" and routing_key({"prompt": [1, 2]}) == "1 2"
    assert routing_key("not a dict") == "" and routing_key({"messages": "hi"}) == "user\nhi"


def test_router_reads_the_key_and_the_pin_from_the_request() -> None:
    request = RoutedRequest("POST", "/v1/chat/completions", routing_key="k", pinned_replica="r1")
    pending = type("Pending", (), {"args": [request]})()
    assert key_of(pending) == "k" and pinned_replica(pending) == "r1"
    empty = type("Pending", (), {"args": [RoutedRequest("GET", "/v1/models")]})()
    assert key_of(empty) == " " and pinned_replica(empty) is None  # never an empty key: Ray divides by its length


def test_merged_metrics_keep_every_replica() -> None:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from vlm_engine.deploy.metrics_merge import merge_expositions

    texts = []
    for replica, hits in (("a", 3), ("b", 5)):
        registry = CollectorRegistry()
        Counter("vlm_engine:hits", "doc", ["replica"], registry=registry).labels(replica).inc(hits)
        Histogram("vlm_engine:ttft", "doc", ["replica"], registry=registry, buckets=(1.0,)).labels(replica).observe(0.5)
        texts.append(generate_latest(registry).decode())
    merged = merge_expositions(texts).decode()
    assert merged.count("# TYPE vlm_engine:hits_total counter") == 1
    assert 'vlm_engine:hits_total{replica="a"} 3.0' in merged and 'vlm_engine:hits_total{replica="b"} 5.0' in merged
    assert parse_metrics(merged)["vlm_engine:hits_total"] == 8.0
    assert parse_metrics(merged)["vlm_engine:ttft_count"] == 2.0


# ---- on Ray ------------------------------------------------------------------------------------------


def test_replica_options_autoscale_on_queue_depth_and_route_by_affinity() -> None:
    from vlm_engine.deploy.ray_serve import ROUTERS, replica_options
    from vlm_engine.server.config import ServerConfig

    fixed = replica_options(ServerConfig.from_flat(ray=True, ray_replicas=3, ray_replica_gpus=1.0))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    router = fixed["request_router_config"]
    assert router.request_router_class == ROUTERS["affinity"]
    assert router.request_router_kwargs == {"imbalanced_threshold": 16.0, "do_eviction": True}
    scaled = replica_options(ServerConfig.from_flat(ray=True, ray_replicas=2, ray_max_replicas=6,
                                                    ray_target_ongoing_requests=4, ray_routing="round_robin"))  # fmt: skip
    auto = scaled["autoscaling_config"]
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (2, 6, 4)
    assert "num_replicas" not in scaled and scaled["request_router_config"].request_router_kwargs == {}


import ray  # noqa: E402  (installed by `make test`: the [ray] extra)


class Cluster:
    def __init__(self, url: str, alone: ServerProcess) -> None:
        self.url = url
        self.alone = alone

    def replicas(self) -> dict[str, dict[str, Any]]:
        """The live replicas (asking the ingress for /health first forgets those whose server is gone)."""
        from vlm_engine.deploy.ray_serve import DIRECTORY, NAMESPACE

        httpx.get(self.url + "/health", timeout=30)
        return ray.get(ray.get_actor(DIRECTORY, namespace=NAMESPACE).list.remote())

    def hits(self) -> float:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text).get(
            "vlm_engine:prefix_cache_hits_total", 0.0
        )


@pytest.fixture(scope="module")
def cluster(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from ray import serve

    from vlm_engine.deploy.ray_serve import APP_NAME, build_application
    from vlm_engine.server.config import ServerConfig

    common = {"served_model_name": MODEL, "dtype": "float32", "side_process_nice": 0}
    alone = ServerProcess(tiny_vlm_dir, tmp_path_factory.mktemp("alone") / "server.log", "--served-model-name", MODEL)
    # address="local": a cluster of its own, never one another test or process left running.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    try:
        with running(alone):
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            config = ServerConfig.from_flat(model=str(tiny_vlm_dir), ray=True, ray_replicas=2, ray_replica_cpus=1.0,
                                            **common)  # fmt: skip
            serve.run(build_application(config), name=APP_NAME, route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            _wait(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 300)
            yield Cluster(url, alone)
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"not ready after {timeout_s} s")


def stream_chat(base: str, messages: list[dict[str, Any]], max_tokens: int = 16) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(text)


def chat(base: str, messages: list[dict[str, Any]], max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_streaming_through_serve_equals_the_server_alone(cluster: Cluster) -> None:
    for messages in ([{"role": "user", "content": "Tell me a story."}], image_message(png_uri(7, (61, 33)))):
        assert stream_chat(cluster.url, messages) == stream_chat(cluster.alone.url, messages)
    models = httpx.get(cluster.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # The Responses API and its stored follow-ups go through Serve too: the follow-up is pinned to
    # the replica that stored the first response.
    first = httpx.post(cluster.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4},
                       timeout=120).json()  # fmt: skip
    for _ in range(4):
        follow = httpx.post(cluster.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "Again?", "previous_response_id": first["id"], "max_output_tokens": 2})  # fmt: skip
        assert follow.status_code == 200, follow.text
        assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert httpx.get(f"{cluster.url}/v1/responses/{first['id']}", timeout=30).json()["id"] == first["id"]
    # Every replica's metrics, each under its own `replica` label.
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    labels = {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
              if line.startswith("vlm_engine:healthy{")}  # fmt: skip
    assert len(labels) == 2, labels


def _run_workload(send: Any, seeds: list[int], copies: int, order_seed: int) -> None:
    """`copies` requests per image, in a shuffled order, one at a time."""
    uris = {seed: png_uri(seed, (224, 224)) for seed in seeds}  # 64 image tokens: the image's pages dominate
    order = [seed for seed in seeds for _ in range(copies)]
    random.Random(order_seed).shuffle(order)
    for i, seed in enumerate(order):
        send(i, image_message(uris[seed]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_affinity_keeps_prefix_hits_of_a_single_replica(cluster: Cluster) -> None:
    """8 images x 4 requests, shuffled: prefix-cache hit tokens summed over both replicas against
    the server alone (one replica) on the same workload, and against round robin over the same
    two replicas (fresh images, so no replica starts warm)."""
    single_before = cluster.alone.metrics().get("vlm_engine:prefix_cache_hits_total", 0.0)
    _run_workload(lambda i, m: chat(cluster.alone.url, m), list(range(100, 108)), 4, 1)
    single = cluster.alone.metrics()["vlm_engine:prefix_cache_hits_total"] - single_before

    before = cluster.hits()
    _run_workload(lambda i, m: chat(cluster.url, m), list(range(100, 108)), 4, 1)
    affinity = cluster.hits() - before

    urls = [entry["url"] for entry in cluster.replicas().values()]
    assert len(urls) == 2
    per_replica_before = [parse_metrics(httpx.get(u + "/metrics").text)["vlm_engine:prefix_cache_hits_total"]
                          for u in urls]  # fmt: skip
    before = cluster.hits()
    _run_workload(lambda i, m: chat(urls[i % 2], m), list(range(200, 208)), 4, 1)
    round_robin = cluster.hits() - before
    print(f"prefix-cache hit tokens: single {single:.0f}, affinity {affinity:.0f} ({affinity / single:.0%}), "
          f"round robin {round_robin:.0f} ({round_robin / single:.0%})")  # fmt: skip
    assert affinity >= 0.9 * single
    assert round_robin < affinity
    # Load still spread: each replica took part of the affinity run's new images.
    served = [parse_metrics(httpx.get(u + "/metrics").text)["vlm_engine:prefix_cache_queries_total"] for u in urls]
    assert all(s > b for s, b in zip(served, per_replica_before)), served


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_replica_costs_errors_not_hangs_and_comes_back(cluster: Cluster) -> None:
    replicas = cluster.replicas()
    assert len(replicas) == 2
    outcomes: list[str] = []

    def long_stream(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i * 7919} is where to start counting."}],
                "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    outcomes.append(f"status {response.status_code}")
                    return
                for line in response.iter_lines():
                    if '"error"' in line:
                        outcomes.append("error event")
                        return
                    if line == "data: [DONE]":
                        outcomes.append("done")
                        return
                outcomes.append("cut off")
        except httpx.HTTPError as exc:
            outcomes.append(f"transport error {type(exc).__name__}")

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    def running() -> dict[str, float]:
        return {rid: parse_metrics(httpx.get(e["url"] + "/metrics", timeout=10).text)["vlm_engine:num_requests_running"]
                for rid, e in replicas.items()}  # fmt: skip

    _wait(lambda: sum(running().values()) >= 4, 120)  # streams are generating (3,000 tokens each: seconds)
    victim_id = max(running().items(), key=lambda item: item[1])[0]  # the busier replica
    os.kill(replicas[victim_id]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    print("outcomes after the kill:", outcomes)
    assert len(outcomes) == 6 and "error event" in outcomes  # the victim's streams ended with a clear error
    assert all(o in ("done", "error event", "status 503") for o in outcomes), outcomes  # the rest finished
    # New requests succeed at once (the survivor, or a retry), and Serve brings a replica back.
    chat(cluster.url, [{"role": "user", "content": "Still there?"}])
    _wait(lambda: len(cluster.replicas()) == 2 and victim_id not in cluster.replicas(), 600)
    for i in range(4):
        chat(cluster.url, image_message(png_uri(300 + i)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_one_command_demo_serves_and_stops(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """`vlm-engine serve --ray` as a user runs it: a local cluster of its own, one replica, a chat
    answered, SIGTERM: exit 0 and nothing of it left running."""
    import subprocess
    import sys

    import psutil

    port = free_port()
    cmd = [sys.executable, "-m", "vlm_engine.cli", "serve", "--ray", "--ray-replicas", "1", "--model", str(tiny_vlm_dir),
           "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32"]  # fmt: skip
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 300)
        assert chat(url, [{"role": "user", "content": "Hello"}], max_tokens=3)["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        # Everything it started shares its session: give stragglers a moment, then none may remain.
        _wait(lambda: not [p for p in psutil.process_iter() if _session(p) == proc.pid], 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _session(process: Any) -> int | None:
    try:
        return os.getsid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None
