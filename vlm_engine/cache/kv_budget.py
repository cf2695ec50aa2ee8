"""How many KV pages the engine allocates, and what one weighs.

The budget is `kv_cache_tokens` when given, else a share of free memory (CUDA: what is free less
the part of the device's memory the engine must leave; CPU: a fraction of MemAvailable, capped).
Sliding-window layers keep their KV in a pool of their own (scheduler/window.py): it gets enough
pages for every seat to hold its window plus one step's prefill, and the full-attention pool the
rest of the budget; when memory is tighter than that, both pools get the same number of pages.
Linear-attention layers' state slots (cache/state_pool.py) come out of the same budget first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_engine.config import CacheConfig, SchedulingConfig

_MEMINFO_FALLBACK = 4 * 1024**3  # no /proc/meminfo: assume 4 GiB available


@dataclass(frozen=True)
class KVPools:
    """The KV pools' sizes in pages, and one page's bytes in each: the full-attention pool (a draft
    model's layers included) and the sliding-window layers' pool (0 pages: no such layers)."""

    num_pages: int
    num_window_pages: int
    page_bytes: int
    window_page_bytes: int

    def bytes_in_use(self, pages_used: int, window_pages_used: int = 0) -> int:
        """KV bytes of the pages that requests hold, in both pools."""
        return pages_used * self.page_bytes + window_pages_used * self.window_page_bytes


def size_kv_pools(
    token_bytes: int,
    window_token_bytes: int,
    max_window: int,
    cache: CacheConfig,
    scheduling: SchedulingConfig,
    device: torch.device,
    state_bytes: int = 0,
) -> KVPools:
    """The pools for KV of `token_bytes` per token in the full-attention layers and
    `window_token_bytes` in the sliding-window layers (0: none), whose longest window is `max_window`;
    `state_bytes` of state slots are taken from the budget first."""
    ps = cache.page_size
    full_bytes, window_bytes = token_bytes * ps, window_token_bytes * ps
    window_cap = window_pool_pages(max_window, ps, scheduling) if window_bytes else 0
    if cache.kv_cache_tokens is not None:
        num_pages = -(-cache.kv_cache_tokens // ps)
        return KVPools(num_pages, min(num_pages, window_cap), full_bytes, window_bytes)
    budget = _memory_budget(cache, device) - state_bytes
    if budget < full_bytes + window_bytes:
        if state_bytes:
            raise RuntimeError(
                f"the linear-attention state slots take {state_bytes / 2**20:.0f} MiB, leaving no room for a KV "
                "page: lower --max-num-seqs or --state-snapshots, or give the KV cache more memory"
            )
        raise RuntimeError("not enough free memory for even one KV page")
    if window_bytes and full_bytes and budget >= window_cap * (full_bytes + window_bytes):
        return KVPools((budget - window_cap * window_bytes) // full_bytes, window_cap, full_bytes, window_bytes)
    num_pages = budget // (full_bytes + window_bytes)  # both pools alike when memory is that tight
    return KVPools(num_pages, num_pages if window_bytes else 0, full_bytes, window_bytes)


def window_pool_pages(max_window: int, page_size: int, scheduling: SchedulingConfig) -> int:
    """Enough window pages for every seat to hold its window plus one step's prefill."""
    per_seat = -(-max_window // page_size) + 1
    return scheduling.max_num_seqs * per_seat + -(-scheduling.max_num_batched_tokens // page_size) + 1


def _memory_budget(cache: CacheConfig, device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1 - cache.gpu_memory_utilization))
    return min(int(mem_available() * cache.cpu_kv_cache_fraction), cache.cpu_kv_cache_max_bytes)


def mem_available() -> int:
    """The kernel's MemAvailable in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _MEMINFO_FALLBACK
