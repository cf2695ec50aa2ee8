"""Gated DeltaNet kernels (vlm_engine/models/gated_delta.py) against Transformers' torch implementations.

The oracle: Qwen3.5's `torch_chunk_gated_delta_rule` (prefill), `torch_recurrent_gated_delta_rule`
(decode) and `causal_conv1d_update` (the conv window), fed g and beta as `Qwen3_5GatedDeltaNet`
computes them; for fp32 exactness also a float64 recurrence written here from the rule's definition.
Every check runs on the C++ op (`impl="cpp"`) and on the torch fallback (`impl="torch"`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from tests.kernel_builds import require_extension
from vlm_engine.kernels import cpu_isa
from vlm_engine.models import gated_delta as gd

BF16 = torch.bfloat16

# fp32 against the float64 recurrence: |ours - exact| <= FP32_TOL * (1 + |exact|) elementwise.
FP32_TOL = 2e-6  # measured: ours <= 3.3e-7, Transformers' fp32 chunked rule <= 4.3e-7
# bf16 inputs against Transformers' bf16 path (the same roundings): outputs (|o| < ~0.2 here) within
# BF16_ATOL, about one bf16 ulp of them (measured: 2.4e-4); the fp32 state within BF16_STATE_ATOL
# (measured 1.2e-6, on |S| ~1).
BF16_ATOL = 1e-3
BF16_STATE_ATOL = 1e-5


@pytest.fixture(params=["cpp", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpp":
        require_extension(gd.load_gated_delta_ops, "the gated delta C++ ops")
    else:
        monkeypatch.setattr(gd, "_ops", lambda x: None)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer_inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, seed: int, dtype=torch.float32) -> SimpleNamespace:
    """One layer's activations for `tokens` tokens: q, k, v, a, b as the projections give them."""
    gen = _gen(seed)
    qkv = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)  # strided views, as the model's split
    return SimpleNamespace(
        q=q.view(tokens, hk, dk),
        k=k.view(tokens, hk, dk),
        v=v.view(tokens, hv, dv),
        a=torch.randn(tokens, hv, generator=gen).to(dtype),
        b=(torch.randn(tokens, hv, generator=gen) * 2).to(dtype),
        A_log=torch.empty(hv).uniform_(0.01, 16, generator=gen).log(),
        dt_bias=torch.rand(hv, generator=gen).to(dtype),
    )


def hf_gating(x: SimpleNamespace) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta exactly as Qwen3_5GatedDeltaNet.forward computes them."""
    return -x.A_log.float().exp() * F.softplus(x.a.float() + x.dt_bias), x.b.sigmoid()


def piece(x: SimpleNamespace, start: int, end: int) -> SimpleNamespace:
    return SimpleNamespace(**{n: (t[start:end] if t.dim() > 1 else t) for n, t in vars(x).items()})


def hf_rule(rule: Callable[..., tuple[torch.Tensor, torch.Tensor]], x: SimpleNamespace, state: torch.Tensor):
    """One of Transformers' rules on a batch of one, from `state`: (output, final state)."""
    g, beta = hf_gating(x)
    out, final = rule(
        x.q[None],
        x.k[None],
        x.v[None],
        g=g[None],
        beta=beta[None],
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


def hf_chunk(x: SimpleNamespace, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hf_rule(hf.torch_chunk_gated_delta_rule, x, state)


def hf_recurrent(x: SimpleNamespace, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hf_rule(hf.torch_recurrent_gated_delta_rule, x, state)


def exact_recurrence(x: SimpleNamespace, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token in float64 (inputs as the fp32 kernel sees them)."""
    g, beta = (t.double() for t in hf_gating(x))
    repeat = x.v.shape[1] // x.q.shape[1]
    q, k = (t.double().repeat_interleave(repeat, dim=1) for t in (x.q, x.k))
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / q.shape[-1] ** 0.5
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    S, outs = state.double(), []
    for t in range(x.v.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = (x.v[t].double() - torch.einsum("hd,hde->he", k[t], S)) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hd,hde->he", q[t], S))
    return torch.stack(outs) if outs else x.v.double()[:0], S


def assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    err = ((got.double() - want) / (1 + want.abs())).abs().max().item() if got.numel() else 0.0
    assert err <= FP32_TOL, f"relative error {err:.2e} > {FP32_TOL}"


def random_state(hv: int, dk: int, dv: int, seed: int) -> torch.Tensor:
    return torch.randn(hv, dk, dv, generator=_gen(seed)) * 0.5


def run_prefill_pieces(x: SimpleNamespace, cuts: list[int], pool: torch.Tensor, slot: int) -> torch.Tensor:
    """The span fed as consecutive prefill calls ending at each cut, one sequence in `slot`."""
    outs, start = [], 0
    for end in [*cuts, x.v.shape[0]]:
        p = piece(x, start, end)
        cu = torch.tensor([0, end - start])
        outs.append(gd.gated_delta_prefill(p.q, p.k, p.v, p.a, p.b, p.A_log, p.dt_bias, pool, torch.tensor([slot]), cu))
        start = end
    return torch.cat(outs)


SHAPES = [  # (k heads, v heads, k dim, v dim): GQA as in Qwen3.5-9B, dims off the vector widths, Qwen3.5-2B's
    (2, 4, 24, 40),
    (1, 1, 16, 72),
]


@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), SHAPES)
def test_prefill_in_chunks_of_every_size_is_one_chunk_is_the_oracle(impl: str, hk, hv, dk, dv) -> None:
    n = 70  # crosses a 64-token chunk inside the op
    x = layer_inputs(n, hk, hv, dk, dv, seed=1)
    s0 = random_state(hv, dk, dv, seed=2)
    want_out, want_state = exact_recurrence(x, s0)
    hf_out, hf_state = hf_chunk(x, s0)
    assert_exact(hf_out, want_out)  # the oracles agree with each other at this tolerance
    pool = torch.zeros(3, hv, dk, dv)
    for size in range(1, n + 1):
        pool[1] = s0
        out = run_prefill_pieces(x, list(range(size, n, size)), pool, slot=1)
        assert_exact(out, want_out)
        assert_exact(pool[1], want_state)
        torch.testing.assert_close(out, hf_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(pool[1], hf_state, rtol=0, atol=1e-5)
    assert not pool[0].any() and not pool[2].any()  # other slots untouched


def test_prefill_cut_anywhere_with_the_qwen35_2b_head_shape(impl: str) -> None:
    hk, hv, dk, dv = 16, 16, 128, 128  # Qwen3.5-0.8B/2B's linear attention
    x = layer_inputs(150, hk, hv, dk, dv, seed=3)
    want_out, want_state = exact_recurrence(x, torch.zeros(hv, dk, dv))
    pool = torch.zeros(2, hv, dk, dv)
    for cuts in ([], [1, 2, 3, 67], [63, 64, 65, 129]):
        pool.zero_()
        out = run_prefill_pieces(x, cuts, pool, slot=1)
        assert_exact(out, want_out)
        assert_exact(pool[1], want_state)


def test_decode_steps_are_the_recurrent_oracle_in_a_batch(impl: str) -> None:
    hk, hv, dk, dv = 2, 4, 24, 40
    slots = [4, 0, 2]
    prompts = [layer_inputs(n, hk, hv, dk, dv, seed=10 + i) for i, n in enumerate([5, 1, 66])]
    steps = [layer_inputs(6, hk, hv, dk, dv, seed=20 + i) for i in range(len(slots))]
    pool = torch.zeros(5, hv, dk, dv)
    states = []
    for p, slot in zip(prompts, slots, strict=True):
        run_prefill_pieces(p, [], pool, slot)
        states.append(exact_recurrence(p, torch.zeros(hv, dk, dv))[1].float())
    hf_states = [s.clone() for s in states]
    for t in range(6):
        tok = [piece(s, t, t + 1) for s in steps]
        batch = SimpleNamespace(**{n: torch.cat([getattr(s, n) for s in tok]) for n in ("q", "k", "v", "a", "b")})
        out = gd.gated_delta_decode(
            batch.q, batch.k, batch.v, batch.a, batch.b, tok[0].A_log, tok[0].dt_bias, pool, torch.tensor(slots)
        )
        for i, (s, slot) in enumerate(zip(tok, slots, strict=True)):
            s.A_log, s.dt_bias = tok[0].A_log, tok[0].dt_bias  # one layer: shared parameters
            want_out, want_state = exact_recurrence(s, states[i].double())
            hf_out, hf_states[i] = hf_recurrent(s, hf_states[i])
            assert_exact(out[i : i + 1], want_out)
            assert_exact(pool[slot], want_state)
            torch.testing.assert_close(out[i : i + 1], hf_out, rtol=0, atol=1e-5)
            torch.testing.assert_close(pool[slot], hf_states[i], rtol=0, atol=1e-5)
            states[i] = want_state.float()
    assert not pool[1].any() and not pool[3].any()


def test_mixed_batch_of_spans_equals_each_span_alone(impl: str) -> None:
    hk, hv, dk, dv = 2, 4, 24, 40
    lengths, slots = [3, 0, 70, 1, 64], [6, 2, 0, 3, 5]
    seqs = [layer_inputs(n, hk, hv, dk, dv, seed=30 + i) for i, n in enumerate(lengths)]
    for s in seqs[1:]:
        s.A_log, s.dt_bias = seqs[0].A_log, seqs[0].dt_bias
    init = torch.randn(7, hv, dk, dv, generator=_gen(5)) * 0.3
    pool = init.clone()
    packed = {n: torch.cat([getattr(s, n) for s in seqs]) for n in ("q", "k", "v", "a", "b")}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = gd.gated_delta_prefill(
        **packed,
        A_log=seqs[0].A_log,
        dt_bias=seqs[0].dt_bias,
        state_pool=pool,
        slots=torch.tensor(slots),
        cu_seqlens=cu,
    )
    for s, slot, start, end in zip(seqs, slots, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = init.clone()
        want = run_prefill_pieces(s, [], alone, slot)
        if impl == "cpp":  # each (sequence, head) is one task: batching changes no bit
            assert torch.equal(out[start:end], want) and torch.equal(pool[slot], alone[slot])
        else:  # torch's matmuls may block differently for other sizes
            torch.testing.assert_close(out[start:end], want, rtol=0, atol=1e-6)
            torch.testing.assert_close(pool[slot], alone[slot], rtol=0, atol=1e-6)
    assert torch.equal(pool[[1, 4]], init[[1, 4]])


def conv_inputs(tokens: int, channels: int, kernel: int, seed: int, dtype=torch.float32):
    gen = _gen(seed)
    x = torch.randn(tokens, channels, generator=gen).to(dtype)
    return x, (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)


def hf_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transformers' causal_conv1d_update on [1, C, L] with the window [C, K - 1] carried in."""
    state = window.t().unsqueeze(0).clone()
    out = hf.causal_conv1d_update(x.t().unsqueeze(0), state, weight, None, activation="silu")
    return out[0].t(), state[0].t()


@pytest.mark.parametrize("channels", [40, 300])  # 300: two channel blocks in the op
def test_conv_window_carried_across_chunks_of_every_size(impl: str, channels: int) -> None:
    n, kernel = 20, 4
    x, w = conv_inputs(n, channels, kernel, seed=7)
    window0 = torch.randn(kernel - 1, channels, generator=_gen(8))
    want, want_window = hf_conv(x, w, window0)
    pool = torch.zeros(3, kernel - 1, channels)
    for size in range(1, n + 1):  # sizes 1..2 are spans shorter than the window
        pool[2] = window0
        outs = []
        for start in range(0, n, size):
            span = x[start : start + size]
            outs.append(gd.causal_conv1d(span, w, pool, torch.tensor([2]), torch.tensor([0, span.shape[0]])))
        torch.testing.assert_close(torch.cat(outs), want, rtol=1e-6, atol=1e-6)
        assert torch.equal(pool[2], want_window)  # the window is the last K - 1 inputs, bit for bit
    assert not pool[:2].any()


def test_conv_packed_batch_with_bias_and_decode(impl: str) -> None:
    channels, kernel = 48, 4
    lengths, slots = [2, 0, 9, 1], [1, 3, 0, 2]
    xs = [conv_inputs(n, channels, kernel, seed=40 + i)[0] for i, n in enumerate(lengths)]
    w = conv_inputs(1, channels, kernel, seed=50)[1]
    bias = torch.randn(channels, generator=_gen(51))
    init = torch.randn(4, kernel - 1, channels, generator=_gen(52))
    pool = init.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = gd.causal_conv1d(torch.cat(xs), w, pool, torch.tensor(slots), cu, bias=bias)
    for x, slot, start, end in zip(xs, slots, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if start == end:  # an empty span (Transformers' conv refuses one) leaves its window as it was
            assert torch.equal(pool[slot], init[slot])
            continue
        state = init[slot].t().unsqueeze(0).clone()
        want = hf.causal_conv1d_update(x.t().unsqueeze(0), state, w, bias, activation="silu")[0].t()
        torch.testing.assert_close(out[start:end], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(pool[slot], state[0].t())
    # Decode: one token per sequence, every sequence in the call.
    step = torch.randn(4, channels, generator=_gen(53))
    before = pool.clone()
    out = gd.causal_conv1d(step, w, pool, torch.tensor(slots), torch.arange(5), bias=bias)
    for i, slot in enumerate(slots):
        state = before[slot].t().unsqueeze(0).clone()
        want = hf.causal_conv1d_update(step[i : i + 1].t().unsqueeze(0), state, w, bias, activation="silu")[0].t()
        torch.testing.assert_close(out[i : i + 1], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(pool[slot], state[0].t())


def test_bf16_inputs_stay_close_to_transformers_bf16(impl: str) -> None:
    hk, hv, dk, dv, n = 2, 4, 32, 64, 80
    x = layer_inputs(n, hk, hv, dk, dv, seed=60, dtype=BF16)
    want_out, want_state = hf_chunk(x, torch.zeros(hv, dk, dv))
    pool = torch.zeros(1, hv, dk, dv)
    out = run_prefill_pieces(x, [17, 40], pool, slot=0)
    assert out.dtype == BF16 and pool.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), rtol=0, atol=BF16_ATOL)
    torch.testing.assert_close(pool[0], want_state, rtol=0, atol=BF16_STATE_ATOL)
    step = piece(layer_inputs(1, hk, hv, dk, dv, seed=61, dtype=BF16), 0, 1)
    step.A_log, step.dt_bias = x.A_log, x.dt_bias
    want_step, want_state = hf_recurrent(step, want_state)
    got = gd.gated_delta_decode(step.q, step.k, step.v, step.a, step.b, x.A_log, x.dt_bias, pool, torch.tensor([0]))
    torch.testing.assert_close(got.float(), want_step.float(), rtol=0, atol=BF16_ATOL)
    torch.testing.assert_close(pool[0], want_state, rtol=0, atol=BF16_STATE_ATOL)
    # The conv in bf16: Transformers' bf16 conv1d + SiLU, rounded the same way.
    cx, cw = conv_inputs(9, 64, 4, seed=62, dtype=BF16)
    window = torch.zeros(3, 64, dtype=BF16)
    want_conv, _ = hf_conv(cx, cw, window)
    conv_pool = torch.zeros(1, 3, 64, dtype=BF16)
    got_conv = gd.causal_conv1d(cx, cw, conv_pool, torch.tensor([0]), torch.tensor([0, 9]))
    torch.testing.assert_close(got_conv.float(), want_conv.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gated_rms_norm_is_transformers(impl: str, dtype: torch.dtype) -> None:
    t, h, d = 5, 3, 40  # d off the vector widths: the scalar tail too
    gen = _gen(90)
    core = torch.randn(t, h, d, generator=gen).to(dtype)
    z = torch.randn(t, h * d + 7, generator=gen).to(dtype)[:, 7:].view(t, h, d)  # a strided view, as the split
    norm = hf.Qwen3_5RMSNormGated(d, eps=1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    want = norm(core.reshape(-1, d), z.reshape(-1, d)).view(t, h, d)
    got = gd.gated_rms_norm(core, z, norm.weight.data, 1e-6)
    assert got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:  # a sum in another order and a 1-ulp exp
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the same bf16 roundings: at most one bf16 ulp apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    ops = require_extension(gd.load_gated_delta_ops, "the gated delta C++ ops")
    x = layer_inputs(4, 1, 2, 8, 8, seed=70)
    pool = torch.zeros(2, 2, 8, 8)
    args = (x.q, x.k, x.v, x.a, x.b, x.A_log, x.dt_bias, pool)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.gated_delta_prefill(*args, torch.tensor([2]), torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="given twice"):
        ops.gated_delta_prefill(*args, torch.tensor([1, 1]), torch.tensor([0, 2, 4]))
    with pytest.raises(RuntimeError, match="number of tokens"):
        ops.gated_delta_prefill(*args, torch.tensor([1]), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.gated_delta_decode(*args[:7], pool.double(), torch.tensor([0, 1, 0, 1]))


def isa_outputs(load: Callable[[], object]) -> dict[str, torch.Tensor]:
    """Every op on fixed inputs, fp32 and bf16 (run by the forced-AVX2 build in a subprocess too)."""
    ops = load()
    out: dict[str, torch.Tensor] = {"lanes": torch.tensor(ops.vector_lanes())}
    for dtype in (torch.float32, BF16):
        x = layer_inputs(70, 2, 4, 24, 40, seed=80, dtype=dtype)
        pool = torch.zeros(2, 4, 24, 40)
        cu = torch.tensor([0, 3, 70])
        out[f"prefill {dtype}"] = ops.gated_delta_prefill(
            x.q, x.k, x.v, x.a, x.b, x.A_log, x.dt_bias, pool, torch.tensor([1, 0]), cu
        )
        out[f"decode {dtype}"] = ops.gated_delta_decode(
            x.q[:2], x.k[:2], x.v[:2], x.a[:2], x.b[:2], x.A_log, x.dt_bias, pool, torch.tensor([0, 1])
        )
        out[f"state {dtype}"] = pool
        cx, cw = conv_inputs(11, 300, 4, seed=81, dtype=dtype)
        conv_pool = torch.zeros(2, 3, 300, dtype=dtype)
        out[f"conv {dtype}"] = ops.causal_conv1d(
            cx, cw, None, conv_pool, torch.tensor([1, 0]), torch.tensor([0, 2, 11]), True
        )
        out[f"conv state {dtype}"] = conv_pool
        out[f"norm {dtype}"] = ops.gated_rms_norm(x.v, x.v.flip(0), x.v[0, 0], 1e-6)
    return out


@pytest.mark.slow  # builds the AVX2 extension once per source version (~40 s)
@pytest.mark.skipif(
    cpu_isa.forced_isa() is not None or cpu_isa.isa_tier() not in ("avx512", "avx512_bf16", "amx_bf16"),
    reason="needs an AVX-512 CPU running its own tier (else both builds are the AVX2 one)",
)
def test_avx2_build_agrees_with_the_avx512_build(tmp_path: Path) -> None:
    """VLM_ENGINE_ISA=avx2 builds the op for x86-64-v3 (8-lane vectors, what Zen 3 runs). Both builds
    sum in the same order; only where one takes a scalar tail and the other a vector may the compiler
    fuse a multiply-add differently, so outputs agree to an fp32 ulp (the conv bit for bit)."""
    require_extension(gd.load_gated_delta_ops, "the gated delta C++ ops")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from tests.test_gated_delta import isa_outputs; "
        "from vlm_engine.models.gated_delta import load_gated_delta_ops; "
        "torch.save(isa_outputs(load_gated_delta_ops), sys.argv[2])"
    )
    saved = tmp_path / "avx2.pt"
    env = {**os.environ, cpu_isa.ISA_ENV: "avx2", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", script, str(root), str(saved)], env=env, check=True, timeout=600, cwd=root)
    avx2, native = torch.load(saved), isa_outputs(gd.load_gated_delta_ops)
    assert int(avx2.pop("lanes")) == 8 and int(native.pop("lanes")) == 16
    assert avx2.keys() == native.keys()
    for key in native:
        if key.startswith("conv"):
            assert torch.equal(native[key], avx2[key]), key
        else:
            torch.testing.assert_close(avx2[key], native[key], rtol=1e-5, atol=1e-6, msg=key)
