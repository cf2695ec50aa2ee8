"""Content keys for KV pages, so the prefix cache knows which image it saw.

Every image expands to the same run of placeholder tokens, so token ids alone would let two
different pictures share KV. Each page's key therefore folds in the content hash of every media
item whose placeholder span overlaps the page, chained to the previous page's key: equal keys
mean equal tokens, equal media and an equal prefix before them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaSpan:
    offset: int  # first placeholder token in the prompt
    length: int  # number of placeholder tokens
    content_hash: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def page_hashes(
    token_ids: list[int],
    page_size: int,
    media: list[MediaSpan],
    start_page: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Keys of the full pages of `token_ids` from `start_page` on; `parent` is the key before it."""
    keys = []
    num_full = len(token_ids) // page_size
    for page in range(start_page, num_full):
        lo, hi = page * page_size, (page + 1) * page_size
        extra = tuple(m.content_hash for m in media if m.offset < hi and m.end > lo)
        parent = hash((parent, tuple(token_ids[lo:hi]), extra))
        keys.append(parent)
    return keys
