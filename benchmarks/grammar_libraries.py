"""llguidance against xgrammar on CPU (`inproc.py grammar`): tokenizer-info build, compile time and coverage per
schema of testkit.json_schemas, mask fill per token and batched, on three vocabularies (load_vocab). The table and
what it means: benchmarks/README.md, "Structured output (issue 9)"."""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import stats as S
import torch

from testkit.json_schemas import EXAMPLES, REGEXES, SCHEMAS

MASK_SCHEMAS = ["nested_invoice", "image_description", "tool_call", "recursive_tree"]
BATCH_SIZES = (32, 64)
BATCH_STEPS = 40
# (schema, invalid instance): an enforcing library rejects a token or refuses EOS at the end.
PROBES: list[tuple[str, Any]] = [
    ("number_ranges", {"temperature": 61, "count": 7, "ratio": 0.25}),
    ("number_ranges", {"temperature": 20, "count": 0, "ratio": 0.25}),
    ("number_ranges", {"temperature": 20, "count": 7, "ratio": 1}),
    ("string_lengths", {"username": "ab", "bio": "", "code": "X9Z2"}),
    ("string_lengths", {"username": "abc", "bio": "", "code": "X9Z2A"}),
    ("string_pattern", {"sku": "abc-1234", "color": "#1a2b3c"}),
    ("bounded_array", {"tags": ["a", "b", "c", "d", "e", "f"]}),
    ("array_of_objects", [{"id": 1, "label": "x"}]),
    ("closed_object", {"key": "k", "value": 1, "extra": 2}),
    ("enum_string", {"status": "unknown"}),
    ("const_fields", {"version": "2.0", "kind": "event", "payload": "x"}),
    ("nullable_fields", {"first_name": None, "middle_name": None, "age": None}),
    ("string_formats", dict(EXAMPLES["string_formats"], id="not-a-uuid")),
    ("tuple_prefix_items", ["w", 640, True, 1]),
    ("nested_invoice", dict(EXAMPLES["nested_invoice"], invoice_id="INV-42")),
]


def pct(xs: list[float], q: float) -> float:
    """The nearest-rank quantile (the sample at rank round(q * (n - 1)))."""
    return sorted(xs)[round(q * (len(xs) - 1))]


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------ vocabularies


def synthetic_151k(base: Any, target: int = 151_646, seed: int = 0) -> Any:
    """SmolLM2's BPE plus lowest-priority merges of pairs of its own tokens, up to `target`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges: list = spec["model"]["merges"]
    as_pairs = not merges or isinstance(merges[0], list)
    n_total = base.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    special = {a["content"] for a in spec["added_tokens"]}
    pieces = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special][:24_000]
    words = [t for t in pieces if t.startswith("Ġ") and t[1:].isalpha()]
    tails = [t for t in pieces if t.isalpha()]
    rng = random.Random(seed)
    next_id = max(max(vocab.values()), n_total - 1) + 1
    while next_id < target:
        r = rng.random()
        if r < 0.55:
            a, b = rng.choice(words), rng.choice(tails)  # word + suffix, like most real merges
        elif r < 0.7:
            a, b = rng.choice(tails), rng.choice(tails)
        else:
            a, b = rng.choice(pieces), rng.choice(pieces)  # punctuation, digits, partial UTF-8
        merged = a + b
        if merged in vocab or len(merged) > 24:
            continue
        vocab[merged] = next_id
        merges.append([a, b] if as_pairs else f"{a} {b}")
        next_id += 1
    tk = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=base.eos_token, bos_token=base.bos_token)


def load_vocab(name: str, cache: dict[str, Any]) -> tuple[Any, int, int]:
    """-> (HF tokenizer, mask width = model vocab size, EOS id)."""
    from transformers import AutoTokenizer

    if name in ("smollm2", "synthetic-151k") and "smollm2" not in cache:
        from testkit.checkpoints import smollm2_gguf_path

        p = smollm2_gguf_path()
        cache["smollm2"] = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    if name == "smollm2":
        tok = cache["smollm2"]
        return tok, len(tok), tok.eos_token_id
    if name == "qwen2-tiny":
        from testkit.checkpoints import cached_qwen2_vl

        tok = AutoTokenizer.from_pretrained(str(cached_qwen2_vl("tiny")))
        return tok, len(tok), tok.eos_token_id
    if name == "synthetic-151k":
        t0 = time.perf_counter()
        tok = synthetic_151k(cache["smollm2"])
        print(f"  (built synthetic tokenizer: {len(tok)} tokens in {time.perf_counter() - t0:.1f} s)")
        return tok, 151_936, tok.eos_token_id
    raise ValueError(name)


# ------------------------------------------------------------------ library adapters


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab_size: int, eos: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size, eos_token=eos)
        self.info_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.version = llguidance.__version__
        self.has_cache = False

    def compile(self, kind: str, spec: Any, cached: bool = False) -> Any:
        M = self.llg.LLMatcher
        grammar = M.grammar_from_json_schema(spec) if kind == "json" else M.grammar_from_regex(spec)
        m = M(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m  # no compile cache: a "compiled grammar" is a fresh matcher (clone with deep_copy)

    def matcher(self, compiled: Any) -> Any:  # a fresh matcher per request, cloned
        return compiled.deep_copy()

    def fill(self, m: Any, mask: torch.Tensor, i: int = 0) -> None:
        self.llt.fill_next_token_bitmask(m, mask, i)

    def batch_fill(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m: Any, t: int) -> bool:
        return m.consume_token(t) and not m.is_error()

    def finished(self, m: Any) -> bool:
        return m.is_stopped()

    def reset(self, m: Any) -> None:
        m.reset()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab_size: int, eos: int, threads: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[eos])
        self.info_s = time.perf_counter() - t0
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.version = importlib.metadata.version("xgrammar")
        self.has_cache = True

    def compile(self, kind: str, spec: Any, cached: bool = False) -> Any:
        if not cached:
            self.compiler.clear_cache()
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec))
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: torch.Tensor, i: int = 0) -> None:
        m.fill_next_token_bitmask(mask, i)

    def batch_fill(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m: Any, t: int) -> bool:
        return m.accept_token(t)

    def finished(self, m: Any) -> bool:
        return m.is_terminated()

    def reset(self, m: Any) -> None:
        m.reset()


def allowed(mask: torch.Tensor, i: int, t: int) -> bool:
    return bool((int(mask[i, t >> 5]) >> (t & 31)) & 1)


def drive(lib: Any, compiled: Any, tokens: list[int], eos: int, mask: torch.Tensor,
          times: list[float] | None = None) -> str:
    """Feed `tokens` then EOS, filling the mask before each; '' if all fine, else what failed."""
    m = lib.matcher(compiled)
    for k, t in enumerate(tokens + [eos]):
        t0 = time.perf_counter()
        lib.fill(m, mask)
        dt = time.perf_counter() - t0
        if times is not None:
            times.append(dt)
        if not allowed(mask, 0, t):
            return f"token {k} ({t}) masked out" if t != eos else "EOS masked out at end"
        if not lib.accept(m, t):
            return f"token {k} ({t}) rejected" if t != eos else "EOS rejected at end"
    return "" if lib.finished(m) else "not finished after EOS"


# ------------------------------------------------------------------ measurements


def bench_library(lib_cls: type, tok: Any, vocab_size: int, eos: int, repeats: int, threads: int) -> dict:
    lib = lib_cls(tok, vocab_size, eos, threads)
    r: dict[str, Any] = {"library": lib.name, "version": lib.version, "info_ms": lib.info_s * 1e3,
                         "schemas": {}, "failures": {}, "not_accepted": {}, "regex_fail": {}}
    mask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    compiled: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        cold, warm, ttfm = [], [], []
        try:
            for _ in range(repeats):
                gc.collect()
                t0 = time.perf_counter()
                c = lib.compile("json", schema)
                t1 = time.perf_counter()
                lib.fill(lib.matcher(c), mask)  # time to first mask = compile + matcher + 1st fill
                ttfm.append(time.perf_counter() - t0)
                cold.append(t1 - t0)
                t0 = time.perf_counter()
                lib.compile("json", schema, cached=True) if lib.has_cache else lib.matcher(c)
                warm.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - report any compile failure
            r["failures"][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        compiled[name] = c
        err = drive(lib, c, encode(compact(EXAMPLES[name])), eos, mask)
        if err:
            r["not_accepted"][name] = err
        r["schemas"][name] = {"cold_ms": statistics.median(cold) * 1e3, "warm_ms": statistics.median(warm) * 1e3,
                              "ttfm_ms": statistics.median(ttfm) * 1e3}
    r["probes_rejected"] = sum(
        1 for name, bad in PROBES if name in compiled and drive(lib, compiled[name], encode(compact(bad)), eos, mask))
    r["probes_run"] = sum(1 for name, _ in PROBES if name in compiled)
    regex_ms = []
    for name, rx in REGEXES.items():
        try:
            t0 = time.perf_counter()
            lib.compile("regex", rx)
            regex_ms.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001
            r["regex_fail"][name] = str(exc).splitlines()[0][:160]
    r["regex_ms"] = statistics.median(regex_ms) * 1e3 if regex_ms else float("nan")

    # Mask fill per token along valid instances.
    streams = {n: encode(compact(EXAMPLES[n])) for n in MASK_SCHEMAS if n in compiled}
    per_tok: list[float] = []
    for _ in range(repeats):
        for n, toks in streams.items():
            drive(lib, compiled[n], toks, eos, mask, per_tok)
    r["mask_tokens"] = len(per_tok)
    r["mask_med_us"] = statistics.median(per_tok) * 1e6 if per_tok else float("nan")
    r["mask_p95_us"] = pct(per_tok, 0.95) * 1e6 if per_tok else float("nan")

    # Batched fill: B matchers at staggered positions, advanced one token per step (not timed).
    names = list(streams)
    for bs in BATCH_SIZES:
        if not names:
            break
        bmask = torch.full((bs, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        rows = []
        for i in range(bs):
            n = names[i % len(names)]
            m, toks = lib.matcher(compiled[n]), streams[n]
            pos = (i * 7) % len(toks)
            for t in toks[:pos]:
                lib.accept(m, t)
            rows.append([m, toks, pos])
        step_s = []
        for _ in range(BATCH_STEPS * max(1, repeats // 2)):
            ms = [row[0] for row in rows]
            t0 = time.perf_counter()
            lib.batch_fill(ms, bmask)
            step_s.append(time.perf_counter() - t0)
            for i, row in enumerate(rows):
                m, toks, pos = row
                assert allowed(bmask, i, toks[pos]), f"batch row {i}: next token masked out"
                lib.accept(m, toks[pos])
                row[2] = pos + 1
                if row[2] == len(toks):
                    lib.reset(m)
                    row[2] = 0
        r[f"b{bs}_med_ms"] = statistics.median(step_s) * 1e3
        r[f"b{bs}_p95_ms"] = pct(step_s, 0.95) * 1e3
    return r


# ------------------------------------------------------------------ report


def report(results: dict[str, list[dict]]) -> list[str]:
    nan = float("nan")
    head = ["vocab", "library", "tok-info ms", "compiled", "example ok", "invalid rejected", "regex ok",
            "cold compile med / max ms", "cached ms", "time-to-1st-mask med ms", "mask/token med / p95 µs",
            "batch32 med / p95 ms", "batch64 med / p95 ms"]  # fmt: skip
    rows = []
    for vocab, rs in results.items():
        for r in rs:
            s = r["schemas"]
            cold, warm, ttfm = ([v[k] for v in s.values()] or [nan] for k in ("cold_ms", "warm_ms", "ttfm_ms"))
            rows.append([vocab, f"{r['library']} {r['version']}", S.fmt(r["info_ms"], 0), f"{len(s)}/{len(SCHEMAS)}",
                         f"{len(s) - len(r['not_accepted'])}/{len(s)}", f"{r['probes_rejected']}/{r['probes_run']}",
                         f"{len(REGEXES) - len(r['regex_fail'])}/{len(REGEXES)}",
                         f"{S.fmt(statistics.median(cold))} / {S.fmt(max(cold))}", S.fmt(statistics.median(warm), 3),
                         S.fmt(statistics.median(ttfm)), f"{S.fmt(r['mask_med_us'], 1)} / {S.fmt(r['mask_p95_us'], 1)}",
                         *(f"{S.fmt(r.get(f'b{b}_med_ms', nan))} / {S.fmt(r.get(f'b{b}_p95_ms', nan))}" for b in BATCH_SIZES)])  # fmt: skip
    lines = ["## Summary (CPU; times are medians unless p95)", "", *S.md_table(head, rows)]
    for vocab, rs in results.items():
        lines += ["", f"### Cold compile ms per schema, {vocab} (time-to-first-mask in parentheses)", ""]
        cells = lambda v: f"{S.fmt(v['cold_ms'])} ({S.fmt(v['ttfm_ms'])})" if v else "FAILED"  # noqa: E731
        lines += S.md_table(["schema", *(r["library"] for r in rs)], [[n, *(cells(r["schemas"].get(n)) for r in rs)] for n in SCHEMAS])
        for r in rs:
            for what, d in (("compile failure", r["failures"]), ("example not accepted", r["not_accepted"]),
                            ("regex failure", r["regex_fail"])):  # fmt: skip
                lines += [f"- {r['library']} {what}: `{name}`: {err}" for name, err in d.items()]
    return lines


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """llguidance against xgrammar: compile times, coverage, mask fill per token and batched (inproc.py grammar)."""
    from jsonschema import Draft202012Validator, FormatChecker

    for name, schema in SCHEMAS.items():
        Draft202012Validator.check_schema(schema)
        Draft202012Validator(schema, format_checker=FormatChecker()).validate(EXAMPLES[name])
    for name, bad in PROBES:
        assert not Draft202012Validator(SCHEMAS[name], format_checker=FormatChecker()).is_valid(bad), name
    vocabs = ["qwen2-tiny", "smollm2", "synthetic-151k"] if args.vocab == "all" else [args.vocab]
    cache: dict[str, Any] = {}
    results: dict[str, list[dict]] = {}
    threads = os.cpu_count() or 1
    for v in vocabs:
        tok, vocab_size, eos = load_vocab(v, cache)
        label = f"{v} ({vocab_size:,})"
        print(f"# {label}: tokenizer {type(tok).__name__} len {len(tok)}, eos {eos}", flush=True)
        results[label] = []
        for lib in (LLGuidance, XGrammar):
            t0 = time.perf_counter()
            results[label].append(bench_library(lib, tok, vocab_size, eos, args.repeats, threads))
            print(f"  {lib.name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"torch {torch.__version__}, threads={threads}, repeats={args.repeats}, schemas={len(SCHEMAS)}")
    print("\n".join(report(results)))
    return {"results": results}
