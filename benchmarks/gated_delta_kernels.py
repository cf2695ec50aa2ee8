"""Speed of the Gated DeltaNet kernels (vlm_engine/models/gated_delta.py) against Transformers' torch ops.

One linear-attention layer of a Qwen3.5-0.8B/2B-shaped model (16 key and 16 value heads of 128,
conv kernel 4 over 6144 channels): prefill of a 1k-token span and decode steps at batch 1 and 16,
fp32 and bf16, on one thread. Ours: the C++ op and the torch fallback; the oracle: Qwen3.5's
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` and `causal_conv1d_fn` /
`causal_conv1d_update`, and the gated RMSNorm against its torch form. Times are CPU seconds of this process (other processes sharing the machine
do not count), the best of interleaved rounds, with glibc keeping freed memory as the engine sets it.

    .venv/bin/python benchmarks/gated_delta_kernels.py [--tokens 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from vlm_engine.host_memory import keep_freed_memory
from vlm_engine.kernels.cpu_isa import tier_description
from vlm_engine.models import gated_delta as gd

HK, HV, DK, DV, KERNEL = 16, 16, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV


def chunk_flops(tokens: int, chunk: int = gd.CHUNK) -> float:
    """Arithmetic of the chunked rule per head: three [L, Dk] x [Dk, Dv] products with the state, the
    [L, Dk] x [Dk, L] key/query products, the triangular solve and the within-chunk output."""
    total = 0.0
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        total += 3 * 2 * n * DK * DV + 2 * 2 * n * n * DK + n * n * DV + 2 * n * n * DV
    return total * HV


def best(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best CPU time of each function over `rounds` interleaved rounds."""
    times = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name] = min(times[name], time.process_time() - start)
    return times


def inputs(tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, CONV_DIM, generator=gen).to(dtype)
    return {
        "mixed": mixed,
        "weight": (torch.randn(CONV_DIM, KERNEL, generator=gen) * 0.5).to(dtype),
        "a": torch.randn(tokens, HV, generator=gen).to(dtype),
        "b": torch.randn(tokens, HV, generator=gen).to(dtype),
        "A_log": torch.empty(HV).uniform_(0.01, 16, generator=gen).log(),
        "dt_bias": torch.rand(HV, generator=gen).to(dtype),
    }


def heads(conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = conv.shape[0]
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.view(t, HK, DK), k.view(t, HK, DK), v.view(t, HV, DV)


def prefill_fns(tokens: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    x = inputs(tokens, dtype)
    slots, cu = torch.tensor([0]), torch.tensor([0, tokens])
    conv_pool = torch.zeros(1, KERNEL - 1, CONV_DIM, dtype=dtype)
    pool = torch.zeros(1, HV, DK, DV)
    conv = gd.causal_conv1d(x["mixed"], x["weight"], conv_pool, slots, cu)
    q, k, v = heads(conv)

    def ours_delta() -> object:
        return gd.gated_delta_prefill(q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], pool.zero_(), slots, cu)

    def fallback_delta() -> object:
        args = (q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], pool.zero_(), slots, cu)
        return gd.torch_gated_delta_prefill(*args)

    def hf_delta() -> object:
        g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
        return hf.torch_chunk_gated_delta_rule(
            q[None], k[None], v[None], g=g[None], beta=x["b"].sigmoid()[None], initial_state=None,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    z, norm_weight = x["mixed"][:, : HV * DV].view(tokens, HV, DV), torch.ones(DV, dtype=dtype)
    return {
        "norm ours": lambda: gd.gated_rms_norm(v, z, norm_weight, 1e-6),
        "norm torch": lambda: gd.torch_gated_rms_norm(v, z, norm_weight, 1e-6),
        "conv ours": lambda: gd.causal_conv1d(x["mixed"], x["weight"], conv_pool.zero_(), slots, cu),
        "conv hf": lambda: hf.causal_conv1d_fn(x["mixed"].t()[None], x["weight"], None, activation="silu"),
        "delta ours": ours_delta,
        "delta fallback": fallback_delta,
        "delta hf": hf_delta,
    }


def decode_fns(batch: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    x = inputs(batch, dtype, seed=1)
    slots = torch.arange(batch)
    pool = torch.randn(batch, HV, DK, DV) * 0.1
    conv_pool = torch.randn(batch, KERNEL - 1, CONV_DIM).to(dtype)
    hf_conv_state = conv_pool.transpose(1, 2).contiguous()
    q, k, v = heads(x["mixed"])

    def hf_delta() -> object:
        g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
        return hf.torch_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g=g[:, None], beta=x["b"].sigmoid()[:, None],
            initial_state=pool, output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    return {
        "conv ours": lambda: gd.causal_conv1d(x["mixed"], x["weight"], conv_pool, slots, torch.arange(batch + 1)),
        "conv hf": lambda: hf.causal_conv1d_update(
            x["mixed"][:, :, None], hf_conv_state, x["weight"], None, activation="silu"
        ),
        "delta ours": lambda: gd.gated_delta_decode(q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], pool, slots),
        "delta fallback": lambda: gd.torch_gated_delta_decode(
            q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], pool, slots
        ),
        "delta hf": hf_delta,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine runs: large outputs are not unmapped and faulted in again per call
    assert gd.load_gated_delta_ops() is not None, "the C++ op did not build"
    print(f"ISA tier {tier_description()}, 1 thread, Hk={HK} Hv={HV} Dk={DK} Dv={DV} conv {CONV_DIM}x{KERNEL}")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        t = best(prefill_fns(args.tokens, dtype), args.rounds)
        gflop = chunk_flops(args.tokens) / 1e9
        print(f"\n{name} prefill of {args.tokens} tokens (ms; tokens/s; chunked-rule GFLOP/s):")
        for key, s in t.items():
            rate = f"{gflop / s:6.1f} GFLOP/s" if key.startswith("delta") else ""
            print(f"  {key:15s} {s * 1e3:9.2f} ms {args.tokens / s:10.0f} tok/s {rate}")
        for batch in (1, 16):
            t = best(decode_fns(batch, dtype), args.rounds * 4)
            print(f"{name} decode step, batch {batch} (us per step; sequences/s):")
            for key, s in t.items():
                print(f"  {key:15s} {s * 1e6:9.1f} us {batch / s:10.0f} seq/s")


if __name__ == "__main__":
    main()
