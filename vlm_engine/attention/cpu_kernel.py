"""Lazily-built fused paged-attention op for CPU (C++ via ``torch.utils.cpp_extension``).

Usage::

    from vlm_engine.attention.cpu_kernel import load_paged_attention
    op = load_paged_attention()          # builds (first time, ~30-60 s) or loads the cached .so
    if op is None:                       # no compiler etc. -> use the torch reference
        from vlm_engine.attention.reference import paged_attention_reference as op
    out = op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None,
             window=0, kv_end=None, flash_min_queries=-1)

The returned callable is the raw pybind function (lowest call overhead, ~2-3 us); it takes the
arguments of :func:`vlm_engine.attention.reference.paged_attention_reference` (``window`` and
``kv_end`` by keyword: positionally, ``impl`` comes first) plus an optional ``impl`` (0 = best,
1 = portable C++ loops, 2 = AVX-512 without vdpbf16ps, 3 = AVX2 + FMA; for tests; an impl this build
lacks falls back to the next one down). A sequence with at least ``flash_min_queries`` queries in
the call runs on the flash-attention core (csrc/flash_core.h: K/V packed from the pages, tiled
query x key blocks), the rest on the decode-shaped items; -1 picks the default (64: see
paged_attention.cpp's kFlashMinQueries for why bf16 waits as long as fp32), 0 never, 1 always (for tests). The module's ``build_info()``
names the ISA features it was compiled with.
Metadata tensors (block_table, seq_lens, query_start_loc) must be int32 CPU tensors; q/k/v/out
float32 or bfloat16 with a contiguous head_dim.  Parallelism uses torch's intra-op thread pool
(``torch.set_num_threads``).

Built and cached by `vlm_engine.kernels.build`, like every C++ op of ours.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

logger = logging.getLogger(__name__)

__all__ = [
    "load_extension_module",
    "load_paged_attention",
    "paged_attention",
]

EXT_NAME = "vlm_engine_paged_attention"
_SRC = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
# The flash core for long prompts, compiled apart: in paged_attention.cpp's unit its code made the
# decode items ~6% slower (bf16, batch 32, one thread, Zen 5), the same source without it not.
_FLASH_SRC = _SRC.with_name("flash_paged.cpp")


@functools.cache
def load_extension_module():
    """The extension module (built once per process, cached on disk); ``None`` if unavailable."""
    if cpu_kernels_disabled():
        logger.info("fused CPU paged attention disabled by VLM_ENGINE_DISABLE_CPU_KERNEL")
        return None
    return build_extension(EXT_NAME, _SRC, extra_sources=(_FLASH_SRC,))


@functools.cache
def load_paged_attention() -> Callable | None:
    """The fused op ``(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None,
    impl=0, window=0, kv_end=None)`` or ``None`` if the extension cannot be built on this machine."""
    mod = load_extension_module()
    return None if mod is None else mod.paged_attention


@functools.cache
def load_store_kv() -> Callable | None:
    """The extension's ``store_kv(k, v, k_cache, v_cache, slot_mapping)``, or ``None``."""
    mod = load_extension_module()
    return None if mod is None else mod.store_kv


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None, *, window=0, kv_end=None
):
    """Fused op if available, else the torch reference (same contract)."""
    op = load_paged_attention()
    if op is None:
        from .reference import paged_attention_reference as op
    return op(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out, window=window, kv_end=kv_end)
