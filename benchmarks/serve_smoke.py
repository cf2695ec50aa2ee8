"""Streaming chat throughput against any OpenAI-compatible server, at several concurrencies.

    python benchmarks/serve_smoke.py --url http://127.0.0.1:8000 --ignore-eos
    python benchmarks/serve_smoke.py --url http://127.0.0.1:8011 --model MODEL_DIR   # transformers serve

    # the issue-3 table in one run: each server started in turn on the same weights, same client
    python benchmarks/serve_smoke.py --start transformers --start ours --model-dir smollm2 \
        --json benchmarks/results/serve_smoke.json

`--start KIND[:DTYPE]` (repeatable; KIND is ours or transformers, DTYPE defaults to auto) starts
that server on `--model-dir` (a directory, or the alias smollm2 / qwen2-vl-bench), runs every
level, stops it, and prints one table with each server's ratio to the first one started. Output
lengths are pinned the same way for both: `ignore_eos` for ours, a `generation_config` with
`min_new_tokens` for `transformers serve` (which answers 422 to `ignore_eos`).

Each level runs `--requests` greedy streaming chat requests (default 2 x concurrency, at least 8)
with `--concurrency` in flight and reports output tokens/s over the level's wall time, plus TTFT
and inter-token latency percentiles. Output tokens come from `usage` when the server sends it
(stream_options.include_usage), else from the number of content chunks. `--ignore-eos` sends the
vLLM-style `ignore_eos` extension so every request produces exactly `--max-tokens` tokens; servers
that reject unknown fields (transformers serve answers 422) must run without it.

The client is deliberately light (raw httpx, minimal SSE parsing): on a 2-core machine it shares
the CPUs with the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import roofline  # siblings in benchmarks/, importable when this file runs as a script
import servers
import workloads
from client import sse_lines

TOPICS = [
    "the sea",
    "a lighthouse",
    "mountains",
    "a robot",
    "bread",
    "winter",
    "a violin",
    "trains",
    "bees",
    "a library",
    "volcanoes",
    "a garden",
    "the moon",
    "rivers",
    "a clock",
    "owls",
]


@dataclass
class Result:
    ttft: float = 0.0
    latency: float = 0.0
    tokens: int = 0
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}."}]


async def one(client: httpx.AsyncClient, args: argparse.Namespace, i: int) -> Result:
    body = {
        "model": args.model,
        "messages": prompt(i),
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_fields)
    result = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    result.tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if result.chunks == 0:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
                        result.chunks += 1
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    result.latency = time.perf_counter() - start
    result.tokens = result.tokens or result.chunks
    return result


async def level(args: argparse.Namespace, concurrency: int) -> dict[str, float]:
    n = args.requests or max(8, 2 * concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits, headers=headers) as client:
        await one(client, args, 10_000)  # warm-up (connection, lazy init)
        queue = list(range(n))
        results: list[Result] = []

        async def worker() -> None:
            while queue:
                results.append(await one(client, args, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}")
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "output_tok_s": tokens / wall,
        "req_s": len(ok) / wall,
        "ttft_p50_s": statistics.median(r.ttft for r in ok) if ok else 0.0,
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
        "mean_tokens": tokens / max(1, len(ok)),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first id from /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=0, help="per level (default 2 x concurrency, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (our server / vLLM only)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--start", action="append", default=[], help="KIND[:DTYPE] to start (repeatable)")
    parser.add_argument("--model-dir", default="smollm2", help="checkpoint for --start (dir or alias)")
    args = parser.parse_args()
    args.extra_fields = {}
    if not args.start:
        rows = run_levels(args)
        report = {"url": args.url, "model": args.model, "max_tokens": args.max_tokens, "levels": rows}
    else:
        report = run_side_by_side(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def run_levels(args: argparse.Namespace) -> list[dict[str, float]]:
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    rows = []
    for c in args.concurrency:
        row = asyncio.run(level(args, c))
        rows.append(row)
        print(
            f"concurrency {c:3d}: {row['output_tok_s']:7.1f} output tok/s  {row['req_s']:5.2f} req/s  "
            f"TTFT p50 {row['ttft_p50_s']:6.2f} s  ITL p50 {row['itl_p50_ms']:6.1f} ms  "
            f"({row['requests']} requests, {row['mean_tokens']:.1f} tokens each, {row['wall_s']:.1f} s)",
            flush=True,
        )
    return rows


def run_side_by_side(args: argparse.Namespace) -> dict[str, object]:
    servers.install_signal_handlers()
    model_dir = roofline.resolve_model_dir(args.model_dir)
    log_dir = Path(args.json).parent / "logs" if args.json else Path(servers.BENCH) / "results" / "serve_smoke_logs"
    results: list[dict[str, object]] = []
    for entry in args.start:
        kind, _, dtype = entry.partition(":")
        spec = servers.ServerSpec(kind=kind, model_dir=model_dir, dtype=dtype or "auto", label=entry)
        flavor = spec.flavor
        args.ignore_eos = False
        args.extra_fields = workloads.length_fields(flavor, args.max_tokens)
        with servers.ManagedServer(spec, log_dir) as server:
            print(f"== {entry}: {server.base_url} (up in {server.startup_s:.0f} s)", flush=True)
            args.url, args.model = server.base_url, None
            results.append({"server": entry, "fields": sorted(args.extra_fields), "levels": run_levels(args)})
    base = results[0]
    print(f"\noutput tokens/s, {args.max_tokens} tokens per request (ratio to {base['server']}):")
    for i, c in enumerate(args.concurrency):
        cells = []
        for r in results:
            tok_s = r["levels"][i]["output_tok_s"]  # type: ignore[index]
            ratio = tok_s / max(base["levels"][i]["output_tok_s"], 1e-9)  # type: ignore[index]
            cells.append(f"{r['server']} {tok_s:7.1f} ({ratio:.2f}x)")
        print(f"  concurrency {c:3d}: " + "   ".join(cells))
    return {"model_dir": model_dir, "max_tokens": args.max_tokens, "servers": results}


if __name__ == "__main__":
    main()
