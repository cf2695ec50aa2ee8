"""Server lifecycle: queue-full 503, SIGTERM with requests in flight, and a child process dying.

Each scenario gets its own server: these tests stop or break it."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The slow image below is served from loopback, which media fetching refuses unless allowed.
SMALL_SERVER = ("--kv-cache-tokens", "8192", "--max-model-len", "4096", "--allow-private-media-urls")
LONG = 4000  # tokens: runs for several seconds, far past any grace period here


def _body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Go on and on."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class StreamReader(threading.Thread):
    """Reads one streaming request in the background; records events, the status, and errors."""

    def __init__(self, server: ServerProcess, max_tokens: int, body: dict[str, Any] | None = None) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.body = body or _body(max_tokens)
        self.first_token = threading.Event()
        self.hang_up = threading.Event()  # set it to close the connection mid-stream
        self.events: list[Any] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.server.base_url + "/chat/completions", json=self.body, timeout=60) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    if len(self.events) >= 2:
                        self.first_token.set()
                    if self.hang_up.is_set():
                        return
        except (httpx.HTTPError, ValueError) as exc:  # the connection may be cut at shutdown
            self.error = exc
        finally:
            self.first_token.set()

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c.get("finish_reason")
        ]


def _start(tiny_vlm_dir: Path, tmp_path: Path, *args: str) -> ServerProcess:
    srv = ServerProcess(tiny_vlm_dir, tmp_path / "server.log", "--served-model-name", "m", *SMALL_SERVER, *args)
    srv.wait_healthy()
    return srv


def test_queue_full_503_then_sigterm_drains_and_leaves_no_children(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    srv = _start(
        tiny_vlm_dir,
        tmp_path,
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--shutdown-timeout",
        "10",
        "--preprocess-workers",
        "2",
        "--media-fetch-timeout",
        "60",
    )
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        runners = [StreamReader(srv, LONG) for _ in range(2)]  # hold both seats
        for r in runners:
            r.start()
            assert r.first_token.wait(30) and r.status == 200
        waiting = StreamReader(srv, 5)  # queued behind them: fills the waiting queue
        waiting.start()
        _wait_inflight(srv, 3)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "server_overloaded"
        assert info.value.response.headers["retry-after"] == "1"  # backpressure says when to come back
        runners[0].hang_up.set()  # its client leaves: the queued request gets the seat and finishes
        waiting.join(30)
        assert waiting.finish_reasons == ["length"] and waiting.events[-1] == "[DONE]"
        runners[1].hang_up.set()
        runners[1].join(10)

        # SIGTERM with one request generating and one stuck in a preprocess worker (its image URL
        # answers only after the grace period): new requests get 503, the running one finishes, the
        # stuck one is failed with an error event when the grace period ends, and the process exits 0.
        with slow_image_server() as (image_url, fetching):
            short = StreamReader(srv, 100)
            short.start()
            assert short.first_token.wait(30)
            stuck = StreamReader(
                srv,
                4,
                {
                    **_body(4),
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": image_url}},
                                {"type": "text", "text": "What is it?"},
                            ],
                        }
                    ],
                },
            )
            stuck.start()
            assert fetching.wait(30)
            srv.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = httpx.post(srv.base_url + "/chat/completions", json=_body(2, stream=False), timeout=10)
            assert late.status_code == 503
            assert httpx.get(srv.url + "/health").status_code == 503
            assert srv.wait_exit(30) == 0
        short.join(10)
        stuck.join(10)
        assert short.finish_reasons == ["length"] and not short.errors and short.events[-1] == "[DONE]"
        assert stuck.status == 503 and stuck.error is None  # failed before its stream started: a JSON 503
        assert srv.leftover_children() == []
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()


@contextlib.contextmanager
def slow_image_server(delay_s: float = 60.0) -> Iterator[tuple[str, threading.Event]]:
    """An HTTP server whose one image answers only after `delay_s` (or when the block exits);
    the event is set once a request for it arrived."""
    release, fetching = threading.Event(), threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetching.set()
            release.wait(delay_s)
            try:
                self.send_response(404)
                self.end_headers()
            except OSError:
                pass

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/slow.png", fetching
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def _wait_inflight(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 10
    while srv.metrics()["vlm_engine:num_requests_inflight"] < n:
        assert time.monotonic() < deadline, "requests were not accepted"
        time.sleep(0.02)


def test_a_refused_checkpoint_stops_start_up_with_one_line_naming_why(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """An fp8 checkpoint (a format we do not serve) ends start-up with the reason, no traceback, status != 0."""
    model = tmp_path / "fp8"
    model.mkdir()
    for item in tiny_vlm_dir.iterdir():
        (model / item.name).symlink_to(item)
    config = json.loads((tiny_vlm_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    srv = ServerProcess(model, tmp_path / "server.log", *SMALL_SERVER)
    try:
        srv.proc.wait(120)
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
    log = (tmp_path / "server.log").read_text()
    assert srv.proc.returncode not in (0, None)
    assert "could not start" in log and "fp8" in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]
    assert srv.leftover_children() == []


@pytest.mark.parametrize("victim", ["engine-core", "detokenizer"])
def test_child_death_fails_inflight_and_exits_nonzero(tiny_vlm_dir: Path, tmp_path: Path, victim: str) -> None:
    srv = _start(tiny_vlm_dir, tmp_path)
    try:
        reader = StreamReader(srv, LONG)
        reader.start()
        assert reader.first_token.wait(30) and reader.status == 200
        health: list[int] = []

        def poll_health() -> None:
            while srv.proc.poll() is None:
                try:
                    health.append(httpx.get(srv.url + "/health", timeout=1).status_code)
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        os.kill(srv.child_pid(victim), signal.SIGKILL)
        reader.join(20)
        assert not reader.is_alive(), "the in-flight stream hung"
        assert reader.errors and victim.replace("-", " ").split()[0] in reader.errors[0]["message"].replace("-", " ")
        srv.proc.wait(30)
        assert srv.proc.returncode not in (0, None)
        assert 503 in health
        assert srv.leftover_children() == []
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
