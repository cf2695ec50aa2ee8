"""Speculative decoding on vs off: our server with `--speculative ngram` (prompt lookup) against the
same server without it, same model, same client, same requests, in one run.

    .venv/bin/python benchmarks/speculative.py              # SmolLM2, c=1 and 16, 3 rounds (~14 min)
    .venv/bin/python benchmarks/speculative.py --quick      # smoke: 1 round, 2 requests, 16 tokens, c=1,2
    .venv/bin/python benchmarks/speculative.py --model qwen2-vl-tiny --quick --out /tmp/spec

Servers, each started once and kept up for the whole run (an idle server blocks on its sockets and
costs the others nothing): 'off' (no --speculative), 'ngram' (--speculative ngram, defaults k=4,
n <= 4, no drafts in steps that start with >= 8 running requests) and, at concurrencies >= 8 only,
'ngram-forced' (the same with --speculative-disable-batch-size 64: it drafts at every batch size,
which shows what the threshold protects against).

Workloads, streaming chat, greedy, `stream_options.include_usage`:
- extraction: a deterministic synthetic document (invoice, customer record, shipping notice: names,
  numbers, addresses, emails, codes) with an instruction whose answer copies spans of it ("Copy the
  following text exactly", "Copy the lines ... that mention X, exactly as written", "Rewrite each
  field as `key: value` lines"). May stop at EOS before --max-tokens; the actual completion tokens
  are counted, and the share of each answer copied verbatim from its document is reported.
- chat: open-ended prompts (stories, explanations, advice) whose answer does not repeat the prompt.

Only one server is under load at a time. Each round runs every (workload, concurrency) point on each
server back to back, the servers' order reversed every other round (off, on | on, off | ...), so the
VM's drift hits all alike; every round sends fresh requests, the same ones to each server. Per
request: TTFT (send -> first content chunk), decode time = e2e - TTFT, ITL = decode time /
(completion tokens - 1) (per token: one chunk can carry several accepted tokens), decode tok/s =
(completion tokens - 1) / decode time. Per point and round: decode tok/s (c=1: the mean over
requests; c>1: the sum of (tokens - 1) over the union of the requests' decode intervals), ITL
mean/p50/p99 over requests, TTFT p50, and from /metrics (counters diffed around the point) the
acceptance length 1 + accepted / drafts. Reported: medians over rounds, and on/off ratios taken
round by round (paired), median over rounds.
Writes --out (default benchmarks/results/speculative/): results.json, table.md, logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client as C
import roofline as R
import servers

from vlm_engine.kernels.cpu_isa import isa_tier

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the server's embedded SmolLM2 (`vlm-engine serve --model ...`)
DISABLE_BATCH_DEFAULT = 8  # the server's --speculative-disable-batch-size default
WARMUP_INDEX = 900_000
SPEC_COUNTERS = {
    "drafts": "vlm_engine:spec_decode_num_drafts_total",
    "draft_tokens": "vlm_engine:spec_decode_num_draft_tokens_total",
    "accepted": "vlm_engine:spec_decode_num_accepted_tokens_total",
    "steps": "vlm_engine:engine_steps_total",
    "generation_tokens": "vlm_engine:generation_tokens_total",
}


@dataclass(frozen=True)
class Config:
    name: str
    extra_args: tuple[str, ...]
    min_concurrency: int = 1  # run only at concurrencies >= this


OFF = Config("off", ())
NGRAM = Config("ngram", ("--speculative", "ngram"))
FORCED = Config(
    "ngram-forced", ("--speculative", "ngram", "--speculative-disable-batch-size", "64"), DISABLE_BATCH_DEFAULT
)


# ---- workloads -------------------------------------------------------------------------------------------

FIRST = ["Maria", "James", "Aiko", "Olusegun", "Priya", "Lars", "Sofia", "Mateo", "Hannah", "Wei", "Fatima", "Noah",
         "Ingrid", "Rafael", "Chloe", "Dmitri", "Amara", "Kenji", "Elena", "Tomasz"]  # fmt: skip
LAST = ["Kowalski", "Okafor", "Tanaka", "Lindqvist", "Moreau", "Haddad", "Fernandez", "Novak", "Schmidt", "Chen",
        "Patel", "Brennan", "Castillo", "Yamamoto", "Ivanova", "Mensah", "Larsen", "Duarte"]  # fmt: skip
STREETS = ["Birchwood Lane", "Harbor Street", "Maple Avenue", "Old Mill Road", "Quarry Drive", "Sunset Boulevard",
           "Elm Court", "Riverside Way", "Juniper Place", "Kings Road"]  # fmt: skip
CITIES = [("Springfield", "IL", "62704"), ("Portland", "OR", "97205"), ("Austin", "TX", "78701"),
          ("Madison", "WI", "53703"), ("Savannah", "GA", "31401"), ("Boulder", "CO", "80302"),
          ("Burlington", "VT", "05401"), ("Tucson", "AZ", "85701")]  # fmt: skip
ITEMS = [("Wireless keyboard", 49.99), ("USB-C hub", 34.50), ("27-inch monitor", 229.00), ("Desk lamp", 18.75),
         ("Ergonomic chair", 310.00), ("Laptop stand", 42.10), ("Noise-cancelling headset", 129.95),
         ("Webcam 1080p", 59.00), ("Cable organizer", 9.99), ("External SSD 1TB", 89.49)]  # fmt: skip
CARRIERS = ["FedEx", "UPS", "DHL Express", "USPS Priority", "Canada Post"]
DOMAINS = ["example.com", "mail.example.org", "corp.example.net"]
STATUSES = ["In transit", "Out for delivery", "Held at depot", "Delivered"]
PLANS = ["Basic", "Plus", "Business", "Enterprise"]


def _code(rng: random.Random, letters: int, digits: int) -> str:
    return (
        "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ", k=letters)) + "-" + "".join(rng.choices("0123456789", k=digits))
    )


def _person(rng: random.Random) -> dict[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    city, state, zip_code = rng.choice(CITIES)
    return {
        "name": f"{first} {last}",
        "address": f"{rng.randint(10, 9999)} {rng.choice(STREETS)}, {city}, {state} {zip_code}",
        "email": f"{first.lower()}.{last.lower()}@{rng.choice(DOMAINS)}",
        "phone": f"+1-{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}",
    }


def _date(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def document(index: int, seed: int = 0) -> tuple[str, list[tuple[str, str]], str]:
    """(kind, fields in order, a word that a few lines mention) of a deterministic synthetic document."""
    rng = random.Random(f"doc-{seed}-{index}")
    kind = rng.choice(("invoice", "customer record", "shipping notice"))
    p = _person(rng)
    if kind == "invoice":
        fields = [("Invoice", _code(rng, 3, 5)), ("Date", _date(rng)), ("Bill to", p["name"]),
                  ("Address", p["address"]), ("Email", p["email"])]  # fmt: skip
        total = 0.0
        for name, price in rng.sample(ITEMS, rng.randint(2, 3)):
            qty = rng.randint(1, 4)
            total += qty * price
            fields.append(("Item", f"{name} x{qty} @ {price:.2f}"))
        fields += [("Total", f"{total:.2f} USD"), ("Payment code", _code(rng, 2, 4))]
        return kind, fields, "Item"
    if kind == "customer record":
        fields = [("Customer ID", _code(rng, 2, 6)), ("Name", p["name"]), ("Email", p["email"]),
                  ("Phone", p["phone"]), ("Address", p["address"]), ("Plan", rng.choice(PLANS)),
                  ("Since", _date(rng)), ("Account manager", _person(rng)["name"]),
                  ("Balance", f"{rng.randint(0, 4000)}.{rng.randint(0, 99):02d} USD")]  # fmt: skip
        return kind, fields, "Name"
    sender = _person(rng)
    fields = [("Tracking", _code(rng, 4, 8)), ("Carrier", rng.choice(CARRIERS)), ("Shipped", _date(rng)),
              ("From", sender["name"]), ("From address", sender["address"]), ("To", p["name"]),
              ("To address", p["address"]), ("Weight", f"{rng.randint(1, 40)}.{rng.randint(0, 9)} kg"),
              ("Status", rng.choice(STATUSES))]  # fmt: skip
    return kind, fields, "address"


def extraction_prompt(index: int, seed: int = 0) -> tuple[str, str]:
    """(prompt, the document's text): three instructions whose answers copy spans of the document."""
    kind, fields, mention = document(index, seed)
    lines = "\n".join(f"{k}: {v}" for k, v in fields)
    task = index % 3
    # SmolLM2-135M refuses ~half of "Copy the following customer record/invoice exactly" (it answers
    # as a customer-service assistant) but copies when the document is called "text".
    if task == 0:
        return f"Copy the following text exactly:\n\n{lines}", lines
    if task == 1:
        return f"Copy the lines of the following text that mention {mention}, exactly as written:\n\n{lines}", lines
    # The fields arrive as one semicolon-separated line: the answer copies the values, not the layout.
    flat = "; ".join(f"{k} = {v}" for k, v in fields)
    return f"Rewrite each field of the following {kind} as `key: value` lines:\n\n{flat}", flat


SUBJECTS = ["a lighthouse keeper", "a retired astronaut", "a young baker", "a lost robot", "a village doctor",
            "a street musician", "an old cartographer", "a night-shift nurse"]  # fmt: skip
EVENTS = ["finds a message in a bottle", "misses the last train home", "inherits a strange key",
          "hears a song nobody else can hear", "meets a talking fox", "wakes up a hundred years later"]  # fmt: skip
THINGS = ["a refrigerator", "the immune system", "a suspension bridge", "photosynthesis", "a jet engine",
          "compound interest", "the water cycle", "a vaccine", "an electric guitar", "tides"]  # fmt: skip
AUDIENCES = ["a ten-year-old", "a curious adult", "a history student", "someone who has never seen one"]
ADVICE = ["starting to run in the mornings", "keeping houseplants alive", "preparing for a job interview",
          "learning a second language", "sleeping better", "planning a first vegetable garden",
          "saving money on groceries", "writing a wedding toast"]  # fmt: skip


def chat_prompt(index: int, seed: int = 0) -> str:
    rng = random.Random(f"chat-{seed}-{index}")
    kind = index % 3
    if kind == 0:
        return f"Write a short story about {rng.choice(SUBJECTS)} who {rng.choice(EVENTS)}."
    if kind == 1:
        return f"Explain how {rng.choice(THINGS)} works to {rng.choice(AUDIENCES)}."
    return f"Give me some practical advice on {rng.choice(ADVICE)}."


WORKLOADS = ("extraction", "chat")


@dataclass(frozen=True)
class Request:
    workload: str
    index: int
    payload: dict[str, Any]
    source: str = ""  # extraction: the document text the answer should copy from


def build_request(workload: str, index: int, model: str | None, max_tokens: int, seed: int = 0) -> Request:
    if workload == "extraction":
        prompt, source = extraction_prompt(index, seed)
    elif workload == "chat":
        prompt, source = chat_prompt(index, seed), ""
    else:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    return Request(workload, index, payload, source)


# ---- client ---------------------------------------------------------------------------------------------


@dataclass
class Record:
    index: int
    start_s: float = 0.0
    first_token_s: float | None = None
    end_s: float = 0.0
    chunks: int = 0  # content chunks (one can carry several tokens)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    copied_share: float | None = None  # extraction: share of the answer copied verbatim from the document
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def decode_s(self) -> float | None:
        return None if self.first_token_s is None else self.end_s - self.first_token_s

    @property
    def itl(self) -> float | None:
        d = self.decode_s
        return d / (self.completion_tokens - 1) if d is not None and d > 0 and self.completion_tokens > 1 else None

    @property
    def decode_tok_s(self) -> float | None:
        itl = self.itl
        return 1.0 / itl if itl else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"ttft": self.ttft, "decode_s": self.decode_s, "itl": self.itl}


COPY_WINDOW = 12  # characters


def copied_share(text: str, source: str, window: int = COPY_WINDOW) -> float | None:
    """Share of the answer's characters inside some `window`-character span that occurs verbatim in
    the document (as the prompt gave it): ~1 for a copy, ~0 for a refusal or free text."""
    if len(text) < window:
        return None
    covered = np.zeros(len(text), dtype=bool)
    for i in range(len(text) - window + 1):
        if text[i : i + window] in source:
            covered[i : i + window] = True
    return float(covered.mean())


async def stream_one(client: httpx.AsyncClient, url: str, req: Request, t0: float, timeout_s: float) -> Record:
    record = Record(req.index, start_s=time.perf_counter() - t0)
    parts: list[str] = []

    async def run() -> None:
        async with client.stream("POST", url, json=req.payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            parser = C.SSEParser()
            async for line in C.sse_lines(response):
                event = parser.feed_line(line)
                if event is None:
                    continue
                if event.done:
                    break
                chunk = event.data or {}
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"[:300]
                    return
                text = C.chunk_content(chunk)
                if text:
                    if record.first_token_s is None:
                        record.first_token_s = time.perf_counter() - t0
                    record.chunks += 1
                    parts.append(text)
                for choice in chunk.get("choices") or []:
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                usage = chunk.get("usage")
                if usage:
                    record.completion_tokens = int(usage.get("completion_tokens") or 0)
                    record.prompt_tokens = usage.get("prompt_tokens")

    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        record.error = f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end_s = time.perf_counter() - t0
    record.text = "".join(parts)
    if record.ok and not record.completion_tokens:
        record.error = "no usage chunk (completion_tokens unknown)"
    if req.source:
        record.copied_share = copied_share(record.text, req.source)
    return record


async def closed_loop(url: str, requests: list[Request], concurrency: int, timeout_s: float) -> list[Record]:
    """`concurrency` requests in flight until `requests` run out (each taken by one worker)."""
    pending = iter(requests)
    records: list[Record] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:

        async def worker() -> None:
            for req in pending:
                records.append(await stream_one(client, url, req, t0, timeout_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


# ---- statistics -------------------------------------------------------------------------------------------


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], concurrency: int, spec: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    dec = [r for r in ok if r.itl is not None]
    itls = [r.itl for r in dec if r.itl is not None]
    tokens = sum(r.completion_tokens - 1 for r in dec)
    decode_union = union_length([(r.first_token_s or 0.0, r.end_s) for r in dec])
    per_request = statistics.fmean(r.decode_tok_s or 0.0 for r in dec) if dec else None
    aggregate = tokens / decode_union if decode_union > 0 else None
    drafts = spec.get("drafts", 0.0)
    copied = [r.copied_share for r in ok if r.copied_share is not None]
    wall = max(r.end_s for r in records) - min(r.start_s for r in records) if records else 0.0
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors": list(dict.fromkeys(r.error for r in records if r.error))[:5],
        # c=1: mean over requests of (tokens - 1) / decode time; c>1: all decode tokens over the
        # union of the decode intervals (the wall time in which some request was decoding).
        "decode_tok_s": per_request if concurrency == 1 else aggregate,
        "decode_tok_s_per_request_mean": per_request,
        "decode_tok_s_aggregate": aggregate,
        "output_tok_s": sum(r.completion_tokens for r in ok) / wall if wall > 0 else None,
        "itl_mean_s": statistics.fmean(itls) if itls else None,
        "itl_p50_s": _pct(itls, 50),
        "itl_p99_s": _pct(itls, 99),
        "ttft_p50_s": _pct([r.ttft for r in ok if r.ttft is not None], 50),
        "completion_tokens_mean": statistics.fmean(r.completion_tokens for r in ok) if ok else None,
        "tokens_per_chunk": sum(r.completion_tokens for r in ok) / max(1, sum(r.chunks for r in ok)),
        "copied_share": statistics.fmean(copied) if copied else None,
        "spec": spec,
        "acceptance_length": 1 + spec["accepted"] / drafts if drafts else None,
        "wall_s": wall,
    }


def counters(base_url: str) -> dict[str, float]:
    m = C.scrape_metrics(base_url) or {}
    return {k: m.get(name, 0.0) for k, name in SPEC_COUNTERS.items()}


def median(values: list[Any]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


# ---- running ------------------------------------------------------------------------------------------------


def run_point(server: servers.ManagedServer, requests: list[Request], concurrency: int, timeout_s: float) -> tuple[dict[str, Any], list[Record]]:  # fmt: skip
    before = counters(server.base_url)
    records = asyncio.run(closed_loop(server.base_url + "/v1/chat/completions", requests, concurrency, timeout_s))
    after = counters(server.base_url)
    return summarize(records, concurrency, {k: after[k] - before[k] for k in after}), records


def requests_per_point(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests if concurrency == 1 else args.waves * concurrency


def configs_at(concurrency: int, configs: list[Config]) -> list[Config]:
    return [c for c in configs if concurrency >= c.min_concurrency]


def point_key(workload: str, concurrency: int, config: str) -> str:
    return f"{workload}/c={concurrency}/{config}"


def run_all(args: argparse.Namespace, model_dir: str, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    configs = [OFF, NGRAM] + ([] if args.quick else [FORCED])
    configs = [c for c in configs if any(conc >= c.min_concurrency for conc in args.concurrency)]
    rounds: dict[str, list[dict[str, Any]]] = {}
    startup: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        up: dict[str, servers.ManagedServer] = {}
        for cfg in configs:
            spec = servers.ServerSpec("ours", model_dir, extra_args=cfg.extra_args, label=cfg.name,
                                      kv_tokens=args.kv_cache_tokens)  # fmt: skip
            up[cfg.name] = stack.enter_context(servers.ManagedServer(spec, out / "logs"))
            startup[cfg.name] = up[cfg.name].startup_s
            log(f"{cfg.name}: up at {up[cfg.name].base_url} in {startup[cfg.name]:.1f} s")
        model = C.served_model_id(up[OFF.name].base_url)
        for cfg in configs:  # warm-up, not measured: one request per workload
            for k, workload in enumerate(WORKLOADS):
                req = build_request(workload, WARMUP_INDEX + k, model, args.max_tokens, args.seed)
                (rec,) = asyncio.run(
                    closed_loop(up[cfg.name].base_url + "/v1/chat/completions", [req], 1, args.request_timeout)
                )
                if not rec.ok:
                    raise RuntimeError(f"{cfg.name}: warm-up request failed: {rec.error}")
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                here = configs_at(concurrency, configs)
                order = here if r % 2 == 0 else here[::-1]  # off, on | on, off | ...
                n = requests_per_point(args, concurrency)
                # Fresh requests every round and concurrency; with n a multiple of 3 each round
                # has the same mix of instructions (index % 3).
                first_index = 100_000 * concurrency + r * n
                for workload in WORKLOADS:
                    reqs = [
                        build_request(workload, first_index + i, model, args.max_tokens, args.seed) for i in range(n)
                    ]
                    for cfg in order:
                        summary, records = run_point(up[cfg.name], reqs, concurrency, args.request_timeout)
                        if summary["num_ok"] < len(reqs):
                            raise RuntimeError(f"{cfg.name} {workload} c={concurrency}: {summary['errors']}")
                        key = point_key(workload, concurrency, cfg.name)
                        rounds.setdefault(key, []).append(
                            {
                                "round": r,
                                "first_index": first_index,
                                **summary,
                                "records": [x.to_json() for x in records],
                            }
                        )
                        log(f"round {r + 1}/{args.rounds} {key:>28}: {one_line(summary)}")
    return {"rounds": rounds, "startup_s": startup, "model_id": model, "configs": [asdict(c) for c in configs]}


def one_line(s: dict[str, Any]) -> str:
    acc = s["acceptance_length"]
    return (
        f"ok {s['num_ok']}/{s['num_requests']}  decode {_f(s['decode_tok_s'], 1)} tok/s  "
        f"ITL mean/p50/p99 {_ms(s['itl_mean_s'])}/{_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])} ms  "
        f"TTFT p50 {_ms(s['ttft_p50_s'])} ms  tokens {_f(s['completion_tokens_mean'], 1)}  "
        f"accept {'—' if acc is None else f'{acc:.2f}'}  {s['wall_s']:.1f} s"
    )


def _f(x: float | None, digits: int) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1000 * x:,.1f}"


def aggregate(rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per point: medians over rounds, acceptance over all rounds, on/off ratios paired by round."""
    points = []
    for key, runs in rounds.items():
        workload, conc, config = key.split("/")
        concurrency = int(conc.removeprefix("c="))
        spec = {k: sum(r["spec"][k] for r in runs) for k in SPEC_COUNTERS}
        med = {
            k: median([r[k] for r in runs])
            for k in ("decode_tok_s", "decode_tok_s_per_request_mean", "decode_tok_s_aggregate", "output_tok_s",
                      "itl_mean_s", "itl_p50_s", "itl_p99_s", "ttft_p50_s", "completion_tokens_mean",
                      "tokens_per_chunk", "copied_share")
        }  # fmt: skip
        point: dict[str, Any] = {
            "key": key,
            "workload": workload,
            "concurrency": concurrency,
            "config": config,
            "rounds": len(runs),
            "num_requests": sum(r["num_requests"] for r in runs),
            "num_ok": sum(r["num_ok"] for r in runs),
            "median": med,
            "spec": spec,
            "acceptance_length": 1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else None,
            "drafts_per_request": spec["drafts"] / max(1, sum(r["num_ok"] for r in runs)),
        }
        off = rounds.get(point_key(workload, concurrency, OFF.name))
        if config != OFF.name and off:
            pairs = list(zip(runs, off, strict=True))
            point["ratio_vs_off"] = {
                "decode_tok_s": median([a["decode_tok_s"] / b["decode_tok_s"] for a, b in pairs]),
                "itl_mean": median([a["itl_mean_s"] / b["itl_mean_s"] for a, b in pairs]),
                "itl_p50": median([a["itl_p50_s"] / b["itl_p50_s"] for a, b in pairs]),
                "ttft_p50": median([a["ttft_p50_s"] / b["ttft_p50_s"] for a, b in pairs]),
            }
            same = total = 0
            for a, b in pairs:
                for ra, rb in zip(a["records"], b["records"], strict=True):
                    total += 1
                    same += ra["text"] == rb["text"]
            point["same_output_as_off"] = [same, total]
        points.append(point)
    return points


def table(points: list[dict[str, Any]]) -> list[str]:
    lines = [
        (
            "| workload | c | config | decode tok/s | on/off | ITL mean ms | p50 | p99 | ITL mean on/off | TTFT p50 ms "
            "| acceptance length | drafts / req | tokens / req | tokens / chunk | same output as off |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {w: i for i, w in enumerate(WORKLOADS)}
    for p in sorted(points, key=lambda p: (order[p["workload"]], p["concurrency"])):
        m, ratio = p["median"], p.get("ratio_vs_off")
        acc = p["acceptance_length"]
        same = p.get("same_output_as_off")
        tok_ratio = "—" if not ratio else f"**{ratio['decode_tok_s']:.2f}x**"
        itl_ratio = "—" if not ratio else f"{ratio['itl_mean']:.2f}x"
        lines.append(
            f"| {p['workload']} | {p['concurrency']} | {p['config']} | {_f(m['decode_tok_s'], 1)} | "
            f"{tok_ratio} | {_ms(m['itl_mean_s'])} | "
            f"{_ms(m['itl_p50_s'])} | {_ms(m['itl_p99_s'])} | {itl_ratio} | "
            f"{_ms(m['ttft_p50_s'])} | {'—' if acc is None else f'{acc:.2f}'} | {p['drafts_per_request']:.1f} | "
            f"{_f(m['completion_tokens_mean'], 1)} | {m['tokens_per_chunk']:.2f} | "
            f"{'—' if not same else f'{same[0]}/{same[1]}'} |"
        )
    return lines


INSTRUCTIONS = ("copy exactly", "copy the lines that mention X", "rewrite as key: value lines")


def copy_lines(rounds: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How much the off server's extraction answers copy from their documents, per instruction."""
    shares: dict[int, list[float]] = {}
    for key, runs in rounds.items():
        if key.startswith("extraction/") and key.endswith(f"/{OFF.name}"):
            for run in runs:
                for rec in run["records"]:
                    if rec["copied_share"] is not None:
                        shares.setdefault(rec["index"] % 3, []).append(rec["copied_share"])
    if not shares:
        return []
    parts = [f"{INSTRUCTIONS[t]} {100 * statistics.fmean(v):.0f}% (n={len(v)})" for t, v in sorted(shares.items())]
    line = (
        f"Extraction answers copied from the document (share of their characters in {COPY_WINDOW}-character spans "
        f"found verbatim in it, off server): {'; '.join(parts)}."
    )
    return [line, ""]


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=servers.REPO
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], check=False, capture_output=True, text=True, cwd=servers.REPO
        )
        return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke: 1 round, 2 requests per point, 16 tokens, c=1,2")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="--model for the server (smollm2 / qwen2-vl-tiny: cached checkpoints)"
    )
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None, help="default 1,16")
    p.add_argument("--rounds", type=int, default=None, help="default 3")
    p.add_argument("--requests", type=int, default=None, help="requests per point at c=1 (default 6)")
    p.add_argument("--waves", type=int, default=None, help="requests per point at c>1 = waves x c (default 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128")
    p.add_argument("--kv-cache-tokens", type=int, default=16_384)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "speculative")
    args = p.parse_args(argv)
    quick = {"concurrency": [1, 2], "rounds": 1, "requests": 2, "waves": 1, "max_tokens": 16}
    full = {"concurrency": [1, 16], "rounds": 3, "requests": 6, "waves": 2, "max_tokens": 128}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    servers.install_signal_handlers()
    model_dir = (
        R.resolve_model_dir(args.model) if args.model in ("smollm2", "qwen2-vl-tiny", "qwen2-vl-bench") else args.model
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M"), time.monotonic()
    machine = {"cpu": R.cpu_name(), "isa_tier": isa_tier(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    result = run_all(args, model_dir, out)
    machine["loadavg_end"] = os.getloadavg()
    points = aggregate(result["rounds"])
    wall = time.monotonic() - t0
    lines = [
        f"# Speculative decoding on vs off — {started}",
        "",
        f"Command: `.venv/bin/python benchmarks/speculative.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        (
            f"CPU: {machine['cpu']}, {machine['cores']} cores, CPU tier **{machine['isa_tier']}** (1-min load "
            f"average {machine['loadavg_start'][0]:.1f} at start, {machine['loadavg_end'][0]:.1f} at end); commit "
            f"{git_commit()}; model `{args.model}`; streaming chat, greedy, max_tokens {args.max_tokens}; "
            f"{args.rounds} rounds, {args.requests} requests per point at c=1 and {args.waves} x c above; "
            f"wall time {wall / 60:.1f} min (server start-ups "
            f"{', '.join(f'{k} {v:.0f} s' for k, v in result['startup_s'].items())})."
        ),
        "",
        *table(points),
        "",
        (
            "decode tok/s: c=1 the mean over requests of (tokens - 1) / (e2e - TTFT); c>1 all (tokens - 1) over the "
            "union of the requests' decode intervals. ITL per request = (e2e - TTFT) / (tokens - 1); mean/p50/p99 "
            "over a round's requests. Every number is the median over rounds; on/off ratios are taken round by round "
            "(adjacent runs) and their median shown. acceptance length = 1 + accepted / drafts over all rounds "
            "(/metrics counters); drafts / req = sequences verified with a draft, per request. 'same output': "
            "requests whose text equals the off server's."
        ),
        "",
    ]
    lines += copy_lines(result["rounds"])
    (out / "table.md").write_text("\n".join(lines))
    doc = {
        "started": started, "wall_s": wall, "machine": machine, "commit": git_commit(), "args": vars(args) | {"out": str(out)},
        "model_dir": model_dir, **{k: v for k, v in result.items() if k != "rounds"}, "points": points,
        "rounds": result["rounds"],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
