"""What Gemma 3's sliding-window layers save in the engine, on a Gemma-3-4B-shaped random checkpoint
(`testkit.gemma3_checkpoints`, preset "bench-4b": 34 layers, 29 of them with a 1,024-token
window, 5 global; 8 query / 4 KV heads of 256).

    .venv/bin/python benchmarks/gemma3_sliding_window.py                 # both parts, window on and off
    .venv/bin/python benchmarks/gemma3_sliding_window.py --long 4096 --batch-context 1024   # lighter
    .venv/bin/python benchmarks/gemma3_sliding_window.py --parts decode     # part 2 only

1. KV bytes held by one request at `--long` (8,192) tokens of context, right after its prefill: the
   engine as it runs Gemma 3 (the window layers' KV in their own pool, pages behind the window given
   back) against the same model with every layer attending fully (`disable_sliding_window`, what an
   engine without sliding-window support holds).
2. Decode tokens/s at batch `--batch` (4), each request with `--batch-context` (2,048) distinct
   prompt tokens, window on and off: the time of the steps after every prefill is done.

Heavy on 2 cores (a 4B model prefills ~16k tokens per mode): measured once, the CPU tier in the output.
Memory: the process peaked at ~21 GiB on the 24 GiB machine (8.6 GB of bf16 weights, their packed copies, the
KV pool); run it alone.
Prompts are random token ids (no special tokens); outputs ignore EOS.
"""

from __future__ import annotations

import sys

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any


sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # the repository root: testkit

from vlm_engine import Engine, SamplingParams
from vlm_engine.kernels.cpu_isa import tier_description


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # Ordinary ids only: the tiny tokenizer's specials sit below 512 and the image token at the top.
    return [rng.randrange(512, vocab - 512) for _ in range(length)]


def held_kv_after_prefill(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    """Prefill one request (chunked), then read the KV bytes it holds before it decodes on."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    request = engine.scheduler.requests[rid]
    while request.num_output_tokens == 0:
        engine.step_tokens()
    prefill_s = time.perf_counter() - t0
    held = engine.kv_bytes_in_use()
    global_pages = engine.pool.num_used
    window_pages = 0 if engine.window_pool is None else engine.window_pool.num_used
    while engine.has_unfinished:
        engine.step_tokens()
    return {
        "context_tokens": len(prompt),
        "kv_bytes_held": held,
        "global_pages_held": global_pages,
        "window_pages_held": window_pages,
        "prefill_s": round(prefill_s, 1),
    }


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Decode tokens/s of the batch once every prompt is prefilled."""
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True))
        for p in prompts
    ]
    requests = [engine.scheduler.requests[i] for i in ids]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step_tokens()
    produced = sum(r.num_output_tokens for r in requests)
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished:
        engine.step_tokens()
        steps += 1
    elapsed = time.perf_counter() - t0
    generated = len(prompts) * (new_tokens + 1) - produced
    return {"batch": len(prompts), "steps": steps, "tokens": generated, "tok_s": round(generated / elapsed, 2),
            "ms_per_step": round(1000 * elapsed / max(steps, 1), 1)}  # fmt: skip


def run_mode(path: Path, window: bool, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    kv_tokens = max(args.long, args.batch * args.batch_context) + 256
    engine = Engine(str(path), kv_cache_tokens=kv_tokens, disable_sliding_window=not window, max_num_seqs=8)
    vocab = engine.runner.vocab_size
    result: dict[str, Any] = {"window": window, "dtype": str(engine.dtype).replace("torch.", "")}
    long_prompt = random_prompt(rng, args.long, vocab)  # drawn either way: part 2's prompts stay the same
    if "kv" in args.parts:
        result["long"] = held_kv_after_prefill(engine, long_prompt)
    prompts = [random_prompt(rng, args.batch_context, vocab) for _ in range(args.batch)]
    if "decode" in args.parts:
        result["decode"] = decode_rate(engine, prompts, args.new_tokens)
    del engine
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a bench-4b checkpoint (default: build and cache one)")
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--batch-context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--parts", nargs="+", choices=("kv", "decode"), default=["kv", "decode"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gemma3_sliding_window.json"))
    args = parser.parse_args()
    if args.checkpoint is None:
        from testkit.gemma3_checkpoints import cached_gemma3

        args.checkpoint = cached_gemma3("bench-4b")
    rows = [run_mode(args.checkpoint, window, args) for window in (True, False)]
    report = {"cpu_tier": tier_description(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    on, off = rows
    print(f"CPU tier: {report['cpu_tier']}")
    print("| | window on (own pool) | window off (all layers full) | on / off |")
    print("|---|---:|---:|---:|")
    if "kv" in args.parts:
        held_on, held_off = on["long"]["kv_bytes_held"], off["long"]["kv_bytes_held"]
        print(f"| KV held at {args.long} tokens | {held_on / 2**20:.0f} MiB | {held_off / 2**20:.0f} MiB | "
              f"{held_on / held_off:.2f}x |")  # fmt: skip
    if "decode" in args.parts:
        rate_on, rate_off = on["decode"]["tok_s"], off["decode"]["tok_s"]
        print(f"| decode tok/s, batch {args.batch} x {args.batch_context} | {rate_on} | {rate_off} | "
              f"{rate_on / rate_off:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
