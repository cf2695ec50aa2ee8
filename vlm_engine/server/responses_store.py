"""Stored responses for `previous_response_id` and `GET/DELETE /v1/responses/{id}`: in memory, in
the API process, bounded by count, by bytes and by age (oldest out first). A server restart
forgets them, as vLLM's store does; an evicted or unknown id is a 404."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as returned
    conversation: list[dict[str, Any]]  # chat messages a follow-up continues: the input history and this output
    stored_at: float  # time.monotonic()
    size: int  # bytes, as JSON (images travel as data URIs, so this is what bounds memory)


class ResponseStore:
    def __init__(
        self, max_entries: int, max_bytes: int, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store a finished response; False when it alone is larger than the byte bound."""
        size = len(msgspec.json.encode(body)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes:
            return False
        self.delete(body["id"])
        self._entries[body["id"]] = StoredResponse(body, conversation, self.clock(), size)
        self.bytes += size
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def _evict(self) -> None:
        oldest_kept = self.clock() - self.max_age_s
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if len(self._entries) <= self.max_entries and self.bytes <= self.max_bytes and entry.stored_at >= oldest_kept:
                return
            self.delete(response_id)
