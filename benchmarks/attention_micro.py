"""Micro-benchmark: fused CPU paged attention vs the torch paths.

SmolLM2-135M attention shapes (Hq 9, Hkv 3, D 64), decode batch 32 with KV lengths uniform in
[100, 1000], page_size 16, scattered page ids; float32 and bfloat16.  Prints µs per call (one layer).

    .venv/bin/python benchmarks/attention_micro.py [--batch 32] [--threads N] [--prefill]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from vlm_engine.attention.cpu_kernel import load_paged_attention
from vlm_engine.attention.reference import (
    paged_attention_reference,
    paged_attention_torch,
)


def make_case(batch, q_lens, kv_lens, Hq, Hkv, D, page_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_pages = [(l + page_size - 1) // page_size for l in kv_lens]
    total = sum(n_pages) + 8
    k_cache = torch.randn(total, page_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(total, page_size, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    bt = torch.zeros(batch, max(n_pages), dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = perm[i : i + n].to(torch.int32)
        i += n
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), Hq, D, generator=g).to(dtype)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, v_cache, bt, seq_lens, qsl


def bench(fn, args, min_time=0.5, max_iters=2000):
    """Returns (median, best) µs per call.  Best-of is the robust number on a loaded machine."""
    fn(*args)
    fn(*args)
    times = []
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t1)
        if time.perf_counter() - t0 > min_time or len(times) >= max_iters:
            break
    times.sort()
    return times[len(times) // 2] * 1e6, times[0] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave as is)")
    ap.add_argument("--prefill", action="store_true", help="also time one 512-token prefill chunk")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow per-sequence reference")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    Hq, Hkv, D, ps = 9, 3, 64, 16
    t0 = time.perf_counter()
    op = load_paged_attention()
    print(f"load_paged_attention: {time.perf_counter() - t0:.1f} s, op={'yes' if op else 'NO (fallback)'}")
    print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    g = torch.Generator().manual_seed(1)
    kv_lens = torch.randint(100, 1001, (a.batch,), generator=g).tolist()
    scale = D**-0.5

    cases = [("decode", [1] * a.batch, kv_lens)]
    if a.prefill:
        cases.append(("prefill512+256cached", [512], [768]))
    with torch.inference_mode():
        for name, q_lens, kvl in cases:
            for dtype in (torch.float32, torch.bfloat16):
                args = make_case(len(q_lens), q_lens, kvl, Hq, Hkv, D, ps, dtype)
                out = torch.empty_like(args[0])
                rows = []
                if op is not None:
                    rows.append(("fused op (out=)", bench(lambda *x, o=out: op(*x, out=o), (*args, scale))))
                rows.append(("torch padded", bench(paged_attention_torch, (*args, scale))))
                if not a.no_reference:
                    rows.append(("torch reference", bench(paged_attention_reference, (*args, scale), min_time=0.3)))
                print(f"{name} B={len(q_lens)} {str(dtype).replace('torch.', '')}:")
                for label, (med, best) in rows:
                    print(f"  {label:18s} {med:9.1f} us/call median (best {best:.1f})")

        if op is not None:
            # Call overhead: a tiny decode batch.
            args = make_case(1, [1], [1], Hq, Hkv, D, ps, torch.float32)
            out = torch.empty_like(args[0])
            med, best = bench(lambda *x: op(*x, out=out), (*args, scale), max_iters=20000)
            print(f"call overhead (B=1, kv=1, fp32): {med:.2f} us/call median (best {best:.2f})")


if __name__ == "__main__":
    main()
