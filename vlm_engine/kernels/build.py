"""Building our C++ CPU extensions (``torch.utils.cpp_extension``), shared by the attention op and the
models' fused ops and linears.

Each build is cached under ``$VLM_ENGINE_CACHE/torch_extensions`` (default
``~/.cache/vlm_engine/torch_extensions``) in a directory keyed by torch/Python version, the
host CPU's ISA flags and the compiler flags (``-march=native``, or the forced tier's -march);
torch's loader rebuilds when the source, the flags or a local header it includes (hashed into a
define) change and serialises concurrent builds with a
file lock. A build that fails with every flag set logs a warning and returns None: callers fall
back to their torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

from vlm_engine.kernels.cpu_isa import cpu_flags, march_flag

logger = logging.getLogger(__name__)


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


def extension_build_dir(name: str) -> Path:
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


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> list[Path]:
    """The headers `source` includes with `#include "..."` (found beside the including file), and theirs."""
    found: list[Path] = []
    todo = [Path(source)]
    while todo:
        current = todo.pop()
        for name in _INCLUDE.findall(current.read_text(encoding="utf-8", errors="replace")):
            header = (current.parent / name).resolve()
            if header.is_file() and header not in found:
                found.append(header)
                todo.append(header)
    return found


def _headers_flags(*sources: Path) -> list[str]:
    """A define that carries the hash of the sources' local headers. torch's loader decides whether to
    rebuild from the sources' and the flags' hash only, so without it an edited header went unseen."""
    headers = sorted({h for source in sources for h in local_headers(source)})
    if not headers:
        return []
    digest = hashlib.sha1(b"".join(h.read_bytes() for h in headers)).hexdigest()[:12]
    return [f"-DVLM_ENGINE_HEADERS_SHA={digest}"]


def build_extension(
    name: str, source: Path, build_dir: Path | None = None, extra_sources: tuple[Path, ...] = ()
) -> ModuleType | None:
    """Build/load the extension (uncached) from `source` (and `extra_sources`, compiled apart and linked
    in); returns the module, or ``None`` after logging a warning."""
    errors = []
    try:
        from torch.utils.cpp_extension import load

        _ensure_ninja_on_path()
        build_dir = Path(build_dir) if build_dir is not None else extension_build_dir(name)
        sources = [Path(source), *map(Path, extra_sources)]
        headers_flags = _headers_flags(*sources)
    except Exception as e:  # noqa: BLE001
        logger.warning("C++ extension %s unavailable (%s); using the torch reference", name, e)
        return None
    verbose = os.environ.get("VLM_ENGINE_VERBOSE_BUILD", "") not in ("", "0")
    for flags in _flag_sets():
        # Each flag set builds in a directory of its own (keyed by the flags' hash): with one
        # directory for two command lines (a fallback build, or flags read before and after a test
        # forced VLM_ENGINE_ISA) each process rebuilt what the other had built (CI logs showed ~6
        # rebuilds a suite, ~30 s each, alternating between two command hashes).
        digest = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:8]
        flags_dir = build_dir.with_name(f"{build_dir.name}-{digest}")
        try:
            flags_dir.mkdir(parents=True, exist_ok=True)
            return load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=[*flags, *headers_flags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(flags_dir),
                verbose=verbose,
            )
        except Exception as e:  # noqa: BLE001
            errors.append(f"[{' '.join(flags)}] {_error_summary(str(e)) or repr(e)}")
    logger.warning(
        "could not build the C++ extension %s; using the torch reference. Errors: %s", name, " | ".join(errors)
    )
    return None


def _error_summary(message: str, most: int = 5) -> str:
    """The compiler's `error:` lines (the first few) and the build tool's last line: the last line
    alone reads "ninja: build stopped: subcommand failed", which says nothing of the cause."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    errors = [line for line in lines if "error:" in line][:most]
    return " / ".join([*errors, lines[-1]] if lines[-1] not in errors else errors)


def cpu_kernels_disabled() -> bool:
    """VLM_ENGINE_DISABLE_CPU_KERNEL set: every C++ extension (attention, fused ops, the bf16 linear)
    stays unbuilt and the torch paths run."""
    return os.environ.get("VLM_ENGINE_DISABLE_CPU_KERNEL", "") not in ("", "0")
