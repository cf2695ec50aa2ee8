"""Attention backends behind one interface, chosen by name from a registry of lazy factories.

A factory imports what its backend needs only when that backend is selected, so a machine
without a given library fails only if asked for that backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from vlm_engine.attention.base import AttentionBackend, AttentionMetadata, KVCache, store_kv

logger = logging.getLogger(__name__)

PagedAttentionFn = Callable[..., torch.Tensor]
StoreKVFn = Callable[[torch.Tensor, torch.Tensor, KVCache, torch.Tensor], None]


class PagedAttentionBackend:
    """Stores the step's k/v into the pool, then runs one paged-attention op for the whole batch.

    A sliding-window layer (``window > 0``) whose KV lives in a pool of its own stores and reads it
    through ``meta.window_slot_mapping`` / ``meta.window_block_table``; the op is told the window,
    so it never reads the pages before it (the pool may have handed them to someone else).
    Without k / v (Gemma 4's KV-shared layers) it stores nothing: the layer that owns the pool
    stored this step's KV earlier in the same forward pass.
    """

    def __init__(self, name: str, op: PagedAttentionFn, store: StoreKVFn = store_kv) -> None:
        self.name = name
        self._op = op
        self._store = store

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        own_pages = window > 0 and meta.window_block_table is not None
        if own_pages and meta.window_slot_mapping is None:
            raise ValueError("AttentionMetadata has a window_block_table but no window_slot_mapping")
        block_table = meta.window_block_table if own_pages else meta.block_table
        if k is not None and v is not None:
            self._store(k, v, kv_cache, meta.window_slot_mapping if own_pages else meta.slot_mapping)
        k_cache, v_cache = kv_cache
        # q may be a strided view into the fused qkv output: both ops read it through its strides
        # (a copy per layer cost ~1.5 ms of a batch-64 SmolLM2 step).
        if window == 0 and meta.kv_end is None:  # causal: the plain call, the cheapest to dispatch
            return self._op(q, k_cache, v_cache, block_table, meta.seq_lens, meta.query_start_loc, scale)
        return self._op(
            q,
            k_cache,
            v_cache,
            block_table,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            window=window,
            kv_end=meta.kv_end,
        )


def _torch_sdpa(device: torch.device) -> AttentionBackend:
    from vlm_engine.attention.reference import paged_attention_reference

    return PagedAttentionBackend("torch_sdpa", paged_attention_reference)


def _cpu_paged(device: torch.device) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError("the cpu_paged attention backend runs on CPU only")
    from vlm_engine.attention.cpu_kernel import load_paged_attention, load_store_kv

    op, store = load_paged_attention(), load_store_kv()
    if op is None or store is None:
        raise RuntimeError("the C++ paged-attention op could not be built (see the log)")

    def store_rows(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        store(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    return PagedAttentionBackend("cpu_paged", op, store_rows)


BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch_sdpa": _torch_sdpa,
    "cpu_paged": _cpu_paged,
}


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        if device.type == "cpu":
            try:
                return _cpu_paged(device)
            except (RuntimeError, ImportError) as exc:
                logger.warning("falling back to torch_sdpa attention: %s", exc)
        return _torch_sdpa(device)
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)} or 'auto'")
    return factory(device)
