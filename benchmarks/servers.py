"""Start and stop the servers under test as subprocesses: ours (`vlm-engine serve`), the CPU peers
(llama.cpp's `llama-server`, `transformers serve --continuous-batching`) and, on CUDA machines,
vLLM and SGLang.

Each server runs in its own session (process group) with its log in a file; stopping it signals
the whole group (SIGTERM, then SIGKILL after a grace period), so no worker outlives a run, even
when the benchmark fails or is interrupted.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
PEER_VENV = BENCH / ".peer-venv"
KINDS = ("ours", "llamacpp", "transformers", "vllm", "sglang")
TRANSFORMERS_PAGE_TOKENS = 256  # ContinuousBatchingConfig.page_size default (transformers 5.24)

_live: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_tool(name: str, venv: Path) -> str | None:
    """`name` from the given venv, else from this interpreter's venv, else from PATH."""
    for candidate in (venv / "bin" / name, Path(sys.executable).parent / name):
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)


@dataclass(frozen=True)
class ServerSpec:
    kind: str  # one of KINDS
    model_dir: str
    dtype: str = "auto"
    extra_args: tuple[str, ...] = ()
    label: str = ""
    # KV capacity in tokens, the same for every server in a comparison. `transformers serve` sizes
    # its paged cache from free memory and was OOM-killed on a 24 GiB machine shared with other
    # work, so it always gets an explicit size.
    kv_tokens: int | None = 65_536
    executable: str | None = None  # llamacpp: the llama-server binary (model_dir is then a .gguf file)
    slots: int = 64  # llamacpp: parallel sequences (-np); its -c context is split between them
    threads: int | None = None  # llamacpp: -t (default: this machine's cores)

    @property
    def name(self) -> str:
        return self.label or self.kind

    @property
    def flavor(self) -> str:
        """workloads.FLAVORS entry: which length-pinning fields the server accepts."""
        return {"ours": "vlm-engine", "transformers": "transformers"}.get(self.kind, self.kind)

    def command(self, port: int) -> list[str]:
        """Launcher and model first, then the flags every server shares, then its own."""
        d = self.model_dir
        if self.kind == "ours":
            launcher = [sys.executable, "-m", "vlm_engine.cli", "serve", "--model", d]
            own = ["--kv-cache-tokens", str(self.kv_tokens)] if self.kv_tokens else []
        elif self.kind == "transformers":
            tool = _venv_tool("transformers", PEER_VENV)
            if tool is None:
                raise FileNotFoundError('`transformers` CLI not found: pip install "transformers[serving]"')
            launcher = [tool, "serve", d, "--continuous-batching", "--device", "cpu"]
            blocks = -(-(self.kv_tokens or 65_536) // TRANSFORMERS_PAGE_TOKENS)
            own = ["--cb-num-blocks", str(blocks)]
        elif self.kind == "llamacpp":
            if not self.executable:
                raise FileNotFoundError("llama-server not given (benchmarks/vs_llamacpp.py finds or builds it)")
            threads = self.threads or os.cpu_count() or 1
            ctx = ["-np", str(self.slots), "-c", str(self.kv_tokens or 65_536), "-t", str(threads), "--cont-batching"]
            # llama-server has no --dtype: the GGUF file's tensor types are the dtype.
            return [self.executable, "-m", d, "--host", "127.0.0.1", "--port", str(port), *ctx, *self.extra_args]
        elif self.kind == "vllm":
            launcher = [_venv_tool("vllm", PEER_VENV) or "vllm", "serve", d]
            own = ["--served-model-name", d]
        elif self.kind == "sglang":
            launcher = [sys.executable, "-m", "sglang.launch_server", "--model-path", d]
            own = ["--served-model-name", d]
        else:
            raise ValueError(f"unknown server kind {self.kind!r}; choose from {', '.join(KINDS)}")
        shared = ["--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype]
        return [*launcher, *shared, *own, *self.extra_args]


@dataclass(eq=False)  # identity semantics: instances live in a WeakSet
class ManagedServer:
    """`with ManagedServer(spec, log_dir) as server:` -> a healthy server at `server.base_url`."""

    spec: ServerSpec
    log_dir: Path
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 20.0
    poll_s: float = 0.25  # /health poll interval while starting
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.spec.name}-{self.port}.log"

    def start(self) -> Self:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.spec.command(self.port),
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:  # from here on, any failure (even registering) must not leave the group running
            _live.add(self)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise TimeoutError(f"{self.spec.name} not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # The leader is gone; make sure nothing it started lingers in its group.
        _signal_group(proc.pid, signal.SIGKILL)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all() -> None:
    for server in list(_live):
        server.stop()


atexit.register(stop_all)


def install_signal_handlers() -> None:
    """SIGTERM/SIGINT/SIGHUP stop every managed server before the benchmark exits."""

    def handler(signum: int, frame: object) -> None:
        stop_all()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)
