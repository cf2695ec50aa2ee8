"""What this CPU's instruction set allows the bf16 CPU path to use, read once from /proc/cpuinfo.

CI and developer machines are drawn from Zen 4 / Zen 5 (AVX-512 with bf16 dot products), Sapphire
Rapids (the same plus AMX tiles) and Zen 3 (AVX2 only); every fast path asks here first and falls
back to plain torch ops where it cannot run.

`VLM_ENGINE_ISA=avx2` makes a bigger CPU behave as an AVX2 + FMA one: the AVX-512 / AMX flags
are hidden from every check here and our C++ kernels are built with `-march=x86-64-v3`, so an
AVX-512 machine can test and measure the path Zen 3 runs. (Torch's own kernels dispatch on the
real CPU; `ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2`
cap those (ATen, oneDNN, MKL), set them too.)
"""

from __future__ import annotations

import functools
import os

# oneDNN's bf16 weight reorder (the prepacked linears) needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
# without them `mkldnn._reorder_linear_weight` raises at load time on Zen 3.
_ONEDNN_BF16_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})


ISA_ENV = "VLM_ENGINE_ISA"
_FORCED_MARCH = {"avx2": "x86-64-v3"}  # x86-64-v3: AVX2, FMA, F16C, BMI1/2 (Haswell, Zen 1-3)
_ABOVE_AVX2 = ("avx512", "amx", "avx_ne_convert", "avx_vnni")  # flag prefixes that a forced AVX2 hides


def forced_isa() -> str | None:
    """The tier `VLM_ENGINE_ISA` asks for, or None (the CPU's own)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in _FORCED_MARCH:
        raise ValueError(f"{ISA_ENV} must be one of {sorted(_FORCED_MARCH)}, got {value!r}")
    return value


def march_flag() -> str:
    """The -march our C++ kernels are built with: the host's, or the forced tier's."""
    forced = forced_isa()
    return f"-march={_FORCED_MARCH[forced]}" if forced else "-march=native"


@functools.cache
def cpu_flags() -> frozenset[str]:
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if forced_isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))
    return flags


def has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 dot-product instructions (not just conversion)."""
    if os.environ.get("VLM_ENGINE_CPU_BF16") in ("0", "1"):  # override for tests and odd hosts
        return os.environ["VLM_ENGINE_CPU_BF16"] == "1"
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def has_amx_bf16() -> bool:
    """AMX tiles with bf16 (Sapphire Rapids and later) that oneDNN may use: its bf16 GEMMs run on
    them, several times the vdpbf16ps rate once a product has more than a few rows. An
    `ONEDNN_MAX_CPU_ISA` below AMX (e.g. AVX512_CORE_BF16) keeps oneDNN off the tiles, and then
    the dot kernel is again the faster one up to hundreds of rows."""
    return has_native_bf16() and {"amx_bf16", "amx_tile"} <= cpu_flags() and not _onednn_capped_below_amx()


def _onednn_capped_below_amx() -> bool:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return bool(cap) and cap not in ("ALL", "DEFAULT") and "AMX" not in cap


def onednn_bf16_packing() -> tuple[bool, str]:
    """Whether oneDNN can reorder bf16 weights into its blocked layout here, and why (for logs/skips)."""
    flags = cpu_flags()
    if _ONEDNN_BF16_AVX512 <= flags:
        return True, "avx512bw/vl/dq"
    if "avx_ne_convert" in flags or "amx_bf16" in flags:
        return True, "avx_ne_convert/amx"
    return False, "oneDNN's bf16 weight reorder needs avx512bw/vl/dq or avx_ne_convert, which this CPU lacks"


def isa_tier() -> str:
    """The fast-path tier this CPU gets: 'amx_bf16', 'avx512_bf16', 'avx512', 'avx2' or 'baseline'."""
    flags = cpu_flags()
    if has_native_bf16():
        return "amx_bf16" if has_amx_bf16() else "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"


def tier_description() -> str:
    """The tier for logs, saying when VLM_ENGINE_ISA forced it."""
    return f"{isa_tier()} (forced by {ISA_ENV})" if forced_isa() else isa_tier()
