"""The one statistics module: a load point's summary (latency percentiles, throughput, cache share,
errors), medians over repetitions, paired A/B ratios, in-process interleaved timing, markdown tables."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from client import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Dist:
    """A latency distribution in seconds (NaN when there were no samples)."""

    n: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
        if v.size == 0:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan, nan, nan)
        p = np.percentile(v, PERCENTILES)  # linear interpolation, as numpy/guidellm/vLLM's bench do
        return cls(int(v.size), float(v.mean()), *(float(x) for x in p), float(v.min()), float(v.max()))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    mean_prompt_tokens: float
    mean_output_tokens: float
    cached_token_share: float  # cached prompt tokens / prompt tokens (NaN if the server never said)
    ttft: Dist
    itl: Dist
    tpot: Dist
    e2e: Dist
    first_chunk: Dist
    # Decode tokens/s: at most one request in flight, the mean over requests of 1 / TPOT; otherwise all
    # tokens after the first over the union of the requests' decode intervals (wall time some request decoded).
    decode_tok_s: float
    tokens_per_chunk: float
    errors: list[str]  # up to 5 distinct messages
    output_len_exact: bool  # every ok request produced exactly the requested tokens

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    share = sum(cached) / sum(prompt) if cached and sum(prompt) else float("nan")
    dur = duration_s if duration_s > 0 else float("nan")
    itls = [x for r in ok for x in r.itls]
    errors = list(dict.fromkeys(r.error for r in records if r.error))[:5]
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / dur,
        output_throughput=out_tokens / dur,
        mean_prompt_tokens=float(np.mean(prompt)) if prompt else float("nan"),
        mean_output_tokens=out_tokens / len(ok) if ok else float("nan"),
        cached_token_share=share,
        ttft=Dist.of([r.ttft for r in ok]),
        itl=Dist.of(itls),
        tpot=Dist.of([r.tpot for r in ok]),
        e2e=Dist.of([r.e2e for r in ok]),
        first_chunk=Dist.of([r.first_chunk for r in ok]),
        decode_tok_s=decode_rate(ok),
        tokens_per_chunk=out_tokens / max(1, sum(len(r.chunk_times) for r in ok)),
        errors=[e for e in errors if e],
        output_len_exact=bool(ok) and all(r.output_tokens == r.requested_output_tokens for r in ok),
    )


def fmt_ms(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{1000 * x:,.0f}" if x >= 0.1 else f"{1000 * x:,.1f}"


def one_line(label: str, s: Summary) -> str:
    """A compact console line for one load point."""
    share = "—" if not math.isfinite(s.cached_token_share) else f"{100 * s.cached_token_share:.0f}%"
    return (
        f"{label:>12}  ok {s.num_ok}/{s.num_requests}  {s.request_throughput:6.2f} req/s  "
        f"{s.output_throughput:7.1f} tok/s  TTFT p50/p95 {fmt_ms(s.ttft.p50)}/{fmt_ms(s.ttft.p95)} ms  "
        f"ITL p50/p95 {fmt_ms(s.itl.p50)}/{fmt_ms(s.itl.p95)} ms  TPOT p50 {fmt_ms(s.tpot.p50)} ms  "
        f"e2e p50 {fmt_ms(s.e2e.p50)} ms  cached {share}"
    )


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def decode_rate(ok: Sequence[RequestRecord]) -> float:
    dec = [r for r in ok if r.tpot and r.first_token_s is not None]
    if not dec:
        return float("nan")
    spans = [(r.first_token_s or 0.0, r.end_s) for r in dec]
    if all(b <= c for (_, b), (c, _) in zip(sorted(spans), sorted(spans)[1:])):  # one at a time
        return statistics.fmean(1.0 / (r.tpot or math.inf) for r in dec)
    return sum(r.output_tokens - 1 for r in dec) / union_length(spans)


# ---- over repetitions and variants ----------------------------------------------------------------------


def median(values: Sequence[float | None]) -> float:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return statistics.median(v) if v else float("nan")


def median_tree(items: Sequence[Any]) -> Any:
    """Element-wise median of equally shaped JSON trees (numbers; lists and strings from the first)."""
    first = items[0]
    if isinstance(first, dict):
        return {k: median_tree([it[k] for it in items if isinstance(it, dict) and k in it]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median([x for x in items if isinstance(x, (int, float))])
    return first


def ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else float("nan")


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the round-by-round ratios a[i] / b[i]: adjacent runs share the machine's drift."""
    return median([ratio(x, y) for x, y in zip(a, b)])


def lower_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The first value (sorted) whose cumulative weight reaches q of the total: guidellm's medians."""
    pairs = sorted(zip(values, weights))
    total = sum(w for _, w in pairs)
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return float("nan")


def timed(
    fn: Callable[[], Any], repeats: int = 1_000_000, min_s: float = math.inf, warmup: int = 1
) -> tuple[list[float], Any]:
    """Seconds of each call of `fn` after `warmup` untimed ones, until `repeats` calls or `min_s` seconds, and the
    last call's result. Its minimum is the run least disturbed by other load, its median the typical one."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    result, end = None, time.perf_counter() + min_s
    while len(times) < repeats and (not times or time.perf_counter() < end):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def interleaved(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """In-process A/B: each variant once per round, taking turns (order reversed every other round), so
    the machine's drift hits all alike. Returns each variant's seconds per round (warm-ups not kept) by
    `clock` (wall time; e.g. time.thread_time for one thread's CPU time on a shared machine)."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = clock()
            variants[name]()
            times[name].append(clock() - t0)
    return times


# ---- formatting ----------------------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x * scale:,.{digits}f}"


def fmt_ratio(x: float) -> str:
    return "—" if not math.isfinite(x) else f"**{x:.2f}x**"


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
