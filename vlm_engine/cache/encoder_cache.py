"""Vision-encoder outputs kept by media content hash, so a repeated image is encoded once.

LRU bounded by bytes. Entries are immutable tensors; a request that is using one holds its own
reference, so eviction never pulls data out from under a running prefill.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.hits = 0
        self.misses = 0

    def get(self, content_hash: int) -> torch.Tensor | None:
        value = self._entries.get(content_hash)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.hits += 1
        return value

    def put(self, content_hash: int, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or content_hash in self._entries:
            return
        while self.used_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
        self._entries[content_hash] = value
        self.used_bytes += size

    def __len__(self) -> int:
        return len(self._entries)
