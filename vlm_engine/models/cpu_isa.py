"""What this CPU's instruction set allows the bf16 CPU path to use, read once from /proc/cpuinfo.

CI and developer machines are drawn from Zen 4 (AVX-512 with bf16 dot products) and Zen 3 (AVX2
only); every fast path asks here first and falls back to plain torch ops where it cannot run.
"""

from __future__ import annotations

import functools
import os

# oneDNN's bf16 weight reorder (the prepacked linears) needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
# without them `mkldnn._reorder_linear_weight` raises at load time on Zen 3.
_ONEDNN_BF16_AVX512 = frozenset({"avx512bw", "avx512vl", "avx512dq"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 dot-product instructions (not just conversion)."""
    if os.environ.get("VLM_ENGINE_CPU_BF16") in ("0", "1"):  # override for tests and odd hosts
        return os.environ["VLM_ENGINE_CPU_BF16"] == "1"
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def onednn_bf16_packing() -> tuple[bool, str]:
    """Whether oneDNN can reorder bf16 weights into its blocked layout here, and why (for logs/skips)."""
    flags = cpu_flags()
    if _ONEDNN_BF16_AVX512 <= flags:
        return True, "avx512bw/vl/dq"
    if "avx_ne_convert" in flags or "amx_bf16" in flags:
        return True, "avx_ne_convert/amx"
    return False, "oneDNN's bf16 weight reorder needs avx512bw/vl/dq or avx_ne_convert, which this CPU lacks"


def isa_tier() -> str:
    """The fast-path tier this CPU gets: 'avx512_bf16', 'avx512', 'avx2' or 'baseline'."""
    flags = cpu_flags()
    if has_native_bf16():
        return "avx512_bf16"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "baseline"
