"""The contract between decoder layers and attention backends.

A backend receives the new tokens' q/k/v for one layer, stores k/v into the paged pool and
returns attention over everything each sequence has cached. Per-step metadata is built once by
the runner and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b's queries are rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor  # [B] int32: KV length of sequence b including this step's tokens
    block_table: torch.Tensor  # [B, max_pages] int32: page ids in order
    slot_mapping: torch.Tensor  # [T] int64: pool slot (page * page_size + offset) of each new token
    query_lens_host: list[int]  # host copies, for backends that branch per sequence
    seq_lens_host: list[int]
    # Attention that is not purely causal (a family whose media tokens attend to each other both
    # ways, Gemma 3's images): the exclusive end of the KV positions each query token sees, [T]
    # int32; a token outside such a span has its own position + 1. None: causal for every token.
    kv_end: torch.Tensor | None = None
    # The sliding-window layers' own pages, when the engine keeps their KV in a pool of its own
    # (`window_pool`): block table and slot mapping as above. Entries for pages wholly before every
    # query's window may be stale (those pages went back to the pool): a backend never reads them.
    window_block_table: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: k, v of shape [num_pages, page_size, Hkv, D]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None with v: a layer that reads `kv_cache` and writes none
        v: torch.Tensor | None,  # [T, Hkv, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,  # a sliding-window layer's window: key k is visible to query q iff k > q - window
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
