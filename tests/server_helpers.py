"""Run the real `vlm-engine serve` as a subprocess on a free port, and check what it returns."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from pydantic import BaseModel

from vlm_engine.metrics.scrape import parse_metrics

REPO = Path(__file__).resolve().parents[1]

# The browser tests (placard page, dashboard) drive Debian's chromium through Playwright and save
# screenshots here. From shared/PEERS.md: a quiet headless chromium that reaches for nothing on the network.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("VLM_TEST_ARTIFACTS", REPO / "test-artifacts"))
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m vlm_engine.cli serve ...`; the log goes to a file (a full pipe would block it)."""

    def __init__(
        self, model: str | Path, log_path: Path, *args: str, api_key: str | None = None, side_nice: int = 0
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_path
        cmd = [sys.executable, "-m", "vlm_engine.cli", "serve", "--model", str(model), "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        # Side processes at normal priority: on a shared, busy test machine nice-19 helpers are
        # starved by unrelated load and latencies balloon; priority is a speed knob, not behaviour.
        cmd += ["--side-process-nice", str(side_nice)]
        # fp32: the tests compare outputs across batch compositions, which bf16 (the CPU 'auto'
        # dtype where the CPU has bf16 dot products) does not promise bit for bit. Later args win.
        cmd += ["--dtype", "float32", *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the server's whole life, closed in wait_exit
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.health_codes: list[int] = []  # every /health status seen while waiting
        self.child_pids: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def openai_client(self, timeout: float = 120.0) -> Any:
        """The official SDK pointed at this server, without retries (a test sees every failure)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 360.0) -> None:
        # A server's core may (re)build its C++ extensions before it is ready (~30 s each on 2 cores;
        # three on a fresh machine): 180 s was once not enough for placard-default's first start.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                code = httpx.get(self.url + "/health", timeout=2.0).status_code
                self.health_codes.append(code)
                if code == 200:
                    self.child_pids = {p.pid for p in self.children()}
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()[-4000:]}")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def child_pid(self, name: str) -> int:
        """The pid of a child by its launcher name ("engine-core", "detokenizer", "preprocess-0")."""
        match = re.search(rf"started {re.escape(name)} \(pid (\d+)\)", self.log())
        assert match, f"no pid for {name} in the log"
        return int(match.group(1))

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5.0).text)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.child_pids |= {p.pid for p in self.children()}
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise
        self._log.close()
        return self.proc.returncode

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait for it; returns its exit status."""
        if self.proc.poll() is None:
            self.send_signal(sig)
        return self.wait_exit(timeout_s)

    def leftover_children(self, wait_s: float = 5.0) -> list[int]:
        """Children seen while running that still exist (zombies count as gone)."""
        deadline = time.monotonic() + wait_s
        while True:
            alive = [pid for pid in self.child_pids if _alive(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill_all(self) -> None:
        for pid in [*self.child_pids, self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@contextlib.contextmanager
def running(srv: ServerProcess) -> Iterator[ServerProcess]:
    """A started server, healthy inside the block and stopped after it (module fixtures)."""
    try:
        srv.wait_healthy()
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_exact_schema(model_cls: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """Parse with the SDK's own model, strictly, and fail on any field the SDK does not define."""
    obj = model_cls.model_validate(data, strict=True)
    _no_extra(obj, model_cls.__name__)
    return obj


def _no_extra(value: Any, where: str) -> None:
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: fields unknown to the SDK: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            _no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_extra(item, f"{where}[{i}]")


def sse_events(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]
