"""The periodic one-line status log: what an operator tails to see the server breathe.

    throughput: prompt 412.3 tok/s, generation 88.1 tok/s | running 12, waiting 3, in flight 17 |
    KV 41.2% | prefix cache hit 63.0%, mm cache hit 50.0% | preemptions 0

Rates and hit rates are over the interval since the previous line; an idle server stays quiet.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm_engine import ipc


@dataclass
class _Snapshot:
    t: float
    prompt: int
    generation: int
    prefix_queries: int
    prefix_hits: int
    mm_queries: int
    mm_hits: int
    preemptions: int

    @classmethod
    def of(cls, stats: ipc.CoreStats, t: float) -> _Snapshot:
        return cls(
            t,
            stats.prompt_tokens,
            stats.generation_tokens,
            stats.prefix_cache_queries,
            stats.cached_prompt_tokens,
            stats.mm_cache_queries,
            stats.mm_cache_hits,
            stats.preemptions,
        )


def _percent(hits: int, queries: int) -> str:
    return f"{100.0 * hits / queries:.1f}%" if queries else "-"


class StatusLine:
    def __init__(self) -> None:
        self._last: _Snapshot | None = None

    def line(self, stats: ipc.CoreStats, inflight: int, now: float) -> str | None:
        """The status since the last call, or None when nothing ran and nothing is waiting."""
        snap, last = _Snapshot.of(stats, now), self._last
        self._last = snap
        if last is None:
            return None
        moved = (snap.prompt, snap.generation) != (last.prompt, last.generation)
        if not moved and not (stats.running or stats.waiting or inflight):
            return None
        dt = max(now - last.t, 1e-9)
        kv = 100.0 * stats.pages_used / stats.pages_total if stats.pages_total else 0.0
        return (
            f"throughput: prompt {(snap.prompt - last.prompt) / dt:.1f} tok/s, "
            f"generation {(snap.generation - last.generation) / dt:.1f} tok/s | "
            f"running {stats.running}, waiting {stats.waiting}, in flight {inflight} | KV {kv:.1f}% | "
            f"prefix cache hit {_percent(snap.prefix_hits - last.prefix_hits, snap.prefix_queries - last.prefix_queries)}, "
            f"mm cache hit {_percent(snap.mm_hits - last.mm_hits, snap.mm_queries - last.mm_queries)} | "
            f"preemptions {snap.preemptions - last.preemptions}"
        )
