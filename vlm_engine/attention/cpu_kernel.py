"""Lazily-built fused paged-attention op for CPU (C++ via ``torch.utils.cpp_extension``).

Usage::

    from vlm_engine.attention.cpu_kernel import load_paged_attention
    op = load_paged_attention()          # builds (first time, ~30-60 s) or loads the cached .so
    if op is None:                       # no compiler etc. -> use the torch reference
        from vlm_engine.attention.reference import paged_attention_reference as op
    out = op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None)

The returned callable is the raw pybind function (lowest call overhead, ~2-3 us); it takes the
arguments of :func:`vlm_engine.attention.reference.paged_attention_reference` plus an
optional ``impl`` (0 = best, 1 = portable C++ loops, 2 = AVX-512 without vdpbf16ps, 3 = AVX2 + FMA;
for tests; an impl this build lacks falls back to the next one down). The module's ``build_info()``
names the ISA features it was compiled with.
Metadata tensors (block_table, seq_lens, query_start_loc) must be int32 CPU tensors; q/k/v/out
float32 or bfloat16 with a contiguous head_dim.  Parallelism uses torch's intra-op thread pool
(``torch.set_num_threads``).

The build is cached under ``$VLM_ENGINE_CACHE/torch_extensions`` (default
``~/.cache/vlm_engine/torch_extensions``) in a directory keyed by torch/Python version and the
host CPU's ISA flags (the code is compiled with ``-march=native``); torch's loader rebuilds when
the source or flags change and serialises concurrent builds with a file lock.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from vlm_engine.models.cpu_isa import cpu_flags, march_flag

logger = logging.getLogger(__name__)

__all__ = [
    "build_extension",
    "cpu_kernels_disabled",
    "extension_build_dir",
    "load_extension_module",
    "load_paged_attention",
    "paged_attention",
]

EXT_NAME = "vlm_engine_paged_attention"
_SRC = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"


def _flag_sets() -> list[list[str]]:
    return [
        ["-O3", march_flag(), "-fopenmp", "-fno-math-errno", *_vectorizing_flags()],
        ["-O3", "-fopenmp"],  # e.g. a compiler that does not know -march=native
    ]


def _vectorizing_flags() -> list[str]:
    """-fno-trapping-math for builds without AVX-512. We never read FP exception flags; without
    it GCC cannot turn a clamp such as exp's `x < -88 ? -88 : (x > 88 ? 88 : x)` into blends
    (AVX2 has no masked compares), which left fused_ops' SiLU-and-mul scalar: on the Zen 5 forced
    to AVX2, a [64, 3072] fp32 row block 211 -> 97 us (~3 ms of a batch-64 SmolLM2 step), bf16 500
    -> 153 us. The AVX-512 build vectorises that loop either way and ran it 2x slower with the
    flag (21 vs 48 us), so it keeps GCC's default. The flag changes no value (no reassociation)."""
    return [] if "avx512f" in cpu_flags() else ["-fno-trapping-math"]


def _cache_root() -> Path:
    root = os.environ.get("VLM_ENGINE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "vlm_engine"
    return base / "torch_extensions"


def _cpu_tag() -> str:
    """Short hash of the host ISA and the -march (the .so is built for one, so don't share across CPUs)."""
    parts = [platform.machine(), march_flag()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features", "model name"):
                    parts.append(line.strip())
                    if key in ("flags", "Features"):
                        break
    except OSError:
        parts.append(platform.processor())
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:10]


def extension_build_dir(name: str = EXT_NAME) -> Path:
    import torch

    tv = torch.__version__.split("+")[0]
    tag = f"{name}-torch{tv}-py{sys.version_info.major}{sys.version_info.minor}-{_cpu_tag()}"
    return _cache_root() / tag


def _ensure_ninja_on_path() -> None:
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, ninja.BIN_DIR)
    except Exception as e:  # noqa: BLE001
        logger.debug("python ninja package not importable: %s", e)
    for c in candidates:
        if os.path.exists(os.path.join(c, "ninja")):
            os.environ["PATH"] = c + os.pathsep + os.environ.get("PATH", "")
            return


def build_extension(name: str = EXT_NAME, source: Path = _SRC, build_dir: Path | None = None):
    """Build/load the extension (uncached); returns the module, or ``None`` after logging a warning."""
    errors = []
    try:
        from torch.utils.cpp_extension import load

        _ensure_ninja_on_path()
        build_dir = Path(build_dir) if build_dir is not None else extension_build_dir(name)
        build_dir.mkdir(parents=True, exist_ok=True)
    except Exception as e:  # noqa: BLE001
        logger.warning("C++ extension %s unavailable (%s); using the torch reference", name, e)
        return None
    verbose = os.environ.get("VLM_ENGINE_VERBOSE_BUILD", "") not in ("", "0")
    for flags in _flag_sets():
        try:
            return load(
                name=name,
                sources=[str(source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=verbose,
            )
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip()
            errors.append(f"[{' '.join(flags)}] {msg.splitlines()[-1] if msg else repr(e)}")
    logger.warning(
        "could not build the C++ extension %s; using the torch reference. Errors: %s", name, " | ".join(errors)
    )
    return None


def cpu_kernels_disabled() -> bool:
    """VLM_ENGINE_DISABLE_CPU_KERNEL set: every C++ extension (attention, fused ops, the bf16 linear)
    stays unbuilt and the torch paths run."""
    return os.environ.get("VLM_ENGINE_DISABLE_CPU_KERNEL", "") not in ("", "0")


@functools.cache
def load_extension_module():
    """The extension module (built once per process, cached on disk); ``None`` if unavailable."""
    if cpu_kernels_disabled():
        logger.info("fused CPU paged attention disabled by VLM_ENGINE_DISABLE_CPU_KERNEL")
        return None
    return build_extension()


@functools.cache
def load_paged_attention() -> Callable | None:
    """The fused op ``(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None)``
    or ``None`` if the extension cannot be built on this machine."""
    mod = load_extension_module()
    return None if mod is None else mod.paged_attention


@functools.cache
def load_store_kv() -> Callable | None:
    """The extension's ``store_kv(k, v, k_cache, v_cache, slot_mapping)``, or ``None``."""
    mod = load_extension_module()
    return None if mod is None else mod.store_kv


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None):
    """Fused op if available, else the torch reference (same contract)."""
    op = load_paged_attention()
    if op is None:
        from .reference import paged_attention_reference as op
    return op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out)
