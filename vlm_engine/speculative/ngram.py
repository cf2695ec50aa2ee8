"""Prompt-lookup (n-gram) speculation: no extra model.

Outputs that copy from their inputs (names, numbers, field values, code being edited) continue an
earlier stretch of the context. The proposer takes the last n tokens (longest n first, down to
`min_n`), finds their most recent earlier occurrence in the prompt plus output, and proposes the
tokens that followed it.
"""

from __future__ import annotations

import numpy as np

from vlm_engine.scheduler.batch import ScheduledChunk


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix."""
    length = len(tokens)
    # Candidates: earlier positions holding the last token (each is followed by at least one
    # token); one vector compare over the context, then the match is extended backwards over the
    # few candidates only.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        before = ends - back
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1
    return tokens[start : start + k].tolist()


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            tokens = np.asarray(chunk.request.token_ids, dtype=np.int64)
            chunk.set_draft(ngram_lookup(tokens, self.min_n, self.max_n, chunk.num_lookahead))
