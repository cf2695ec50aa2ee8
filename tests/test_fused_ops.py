"""The CPU fast path (fast numerics): fused C++ element-wise ops and prepacked linears in bf16 and
fp32, each against the torch code it replaces, and the engine's greedy output with and without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.kernels import cpu_isa
from vlm_engine.kernels.cpu_isa import onednn_bf16_packing
from vlm_engine.models.layers import RMSNorm, apply_rotary
from vlm_engine.models.prepack import PackedLinear, prepack_linears, prepack_supported
from vlm_engine.models.registry import resolve_dtype

BF16 = torch.bfloat16


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(3).to(BF16)


def ulp_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step (reduction order / exp differ), and on >= 99% of elements exactly."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert (actual == expected).float().mean() >= 0.99


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_matches_module(ops, rows: int) -> None:
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = randn(576, seed=1) / 3
    norm = norm.to(BF16)
    x = randn(rows, 576)
    ulp_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x))


def test_add_rms_norm_updates_both_in_place(ops) -> None:
    norm = RMSNorm(96, 1e-6).to(BF16)
    norm.weight.data = randn(96, seed=2)
    x, residual = randn(5, 96, seed=3), randn(5, 96, seed=4)
    expected_sum = x + residual  # bf16 add, as the decoder's residual connection
    expected = norm(expected_sum)
    out = ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(residual, expected_sum)
    ulp_close(x, expected)


@pytest.mark.parametrize("d", [64, 80, 40])  # 80: Qwen2.5-VL's tower (halves of 40, a masked vector tail)
def test_rotary_in_place_on_strided_views(ops, d: int) -> None:
    t, hq, hk = 6, 4, 2
    qkv = randn(t, (hq + 2 * hk) * d, seed=5)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    angles = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = torch.cat((angles.cos(),) * 2, -1).to(BF16), torch.cat((angles.sin(),) * 2, -1).to(BF16)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    before_v = qkv[:, (hq + hk) * d :].clone()
    ops.rotary_(q, k, cos, sin)
    # Products of two bf16 values are exact in fp32, so every rounding step matches torch's.
    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], before_v)


def test_silu_and_mul_matches_torch(ops) -> None:
    gate_up = randn(9, 2 * 300, seed=7)
    gate, up = gate_up.split(300, dim=-1)
    ulp_close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_argmax_rows_matches_torch_argmax(ops) -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(37, 1000, generator=g)  # vocab not a multiple of the 256 block
    logits[3, [10, 700, 999]] = 50.0  # ties: the first index wins
    logits[4] = float("-inf")
    logits[5, 600] = float("nan")  # NaN counts as the maximum, as in torch
    logits[5, 900] = float("nan")
    logits[6, 999] = 9.0  # maximum in the last, partial block
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    wide = torch.randn(4, 1200, generator=g)[:, :1100]  # rows further apart than the vocab
    assert torch.equal(ops.argmax_rows(wide), wide.argmax(dim=-1))
    # bf16 logits as they come from the LM head: the argmax of their exact fp32 widening.
    half = logits.to(BF16)
    half[7, [20, 400]] = 3.0  # equal after rounding: the first wins
    assert torch.equal(ops.argmax_rows(half), half.float().argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(half), half.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(logits.half())


def test_ops_reject_other_and_mixed_dtypes(ops) -> None:
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="dtype of x"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=BF16), 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.rotary_(torch.ones(2, 1, 8), torch.ones(2, 1, 8, dtype=BF16), torch.ones(2, 8), torch.ones(2, 8))


def fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: only summation order and the exp polynomial differ from torch's ops."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp32_rms_norm_and_residual_add_match_the_modules(ops, rows: int) -> None:
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = randn(576, seed=1).float() / 3
    x, residual = randn(rows, 576, seed=3).float(), randn(rows, 576, seed=4).float()
    fp32_close(ops.rms_norm(x, norm.weight.data, norm.eps), norm(x))
    expected_sum = x + residual
    expected = norm(expected_sum)
    out = ops.add_rms_norm_(x, residual, norm.weight.data, norm.eps)
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(residual, expected_sum)
    fp32_close(x, expected)


def test_fp32_rotary_and_silu_match_torch(ops) -> None:
    t, hq, hk, d = 6, 4, 2, 64
    qkv = randn(t, (hq + 2 * hk) * d, seed=5).float()
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    angles = torch.rand(t, d // 2, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ops.rotary_(q, k, cos, sin)
    fp32_close(q, expected_q)
    fp32_close(k, expected_k)
    gate_up = randn(9, 2 * 300, seed=7).float()
    gate, up = gate_up.split(300, dim=-1)
    fp32_close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


PACKING, PACKING_REASON = onednn_bf16_packing()


@pytest.mark.skipif(not PACKING, reason=PACKING_REASON)
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_is_bit_identical(rows: int) -> None:
    linear = nn.Linear(192, 320, bias=True).to(BF16).requires_grad_(False)
    x = randn(rows, 192, seed=rows)
    packed = PackedLinear(linear)
    assert torch.equal(packed(x), linear(x))
    assert torch.equal(packed(x.view(1, rows, 192)), linear(x).view(1, rows, 320))
    assert packed.weight.dtype == BF16 and tuple(packed.weight.shape) == (320, 192)


@pytest.mark.skipif(not PACKING, reason=PACKING_REASON)
def test_prepack_replaces_bf16_linears() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.LayerNorm(4)).requires_grad_(False)
    model = model.to(BF16)
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)


def test_prepack_replaces_fp32_linears_and_leaves_fp16() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.LayerNorm(4)).requires_grad_(False)
    assert prepack_supported(torch.device("cpu"), torch.float32)
    assert prepack_linears(model.half()) == 0
    assert prepack_linears(model.float()) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    with pytest.raises(TypeError, match="float32 weights"):
        model[0](torch.ones(1, 8, dtype=BF16))


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_fp32_packed_linear_is_close_and_batch_invariant(rows: int) -> None:
    """fp32 packed rows agree with F.linear to fp32 summation noise, and a row's result does not
    depend on how many other rows share the call (the engine's outputs must not depend on the
    batch; F.linear itself gives different bits for M <= 3)."""
    linear = nn.Linear(576, 960, bias=True).requires_grad_(False)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    packed = PackedLinear(linear)
    out = packed(x)
    torch.testing.assert_close(out, linear(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(packed(x[:1]), out[:1])
    assert torch.equal(packed(x[-1:]), out[-1:])
    assert packed.weight.dtype == torch.float32 and tuple(packed.weight.shape) == (960, 576)


@pytest.mark.parametrize(
    ("flags", "packs"),
    [
        ({"avx2", "fma"}, False),  # Zen 3: the reorder raises there, so the plain bf16 linears stay
        ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, True),  # Zen 4
        ({"avx2", "avx_ne_convert"}, True),
    ],
)
def test_packing_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags: set[str], packs: bool) -> None:
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
    assert onednn_bf16_packing()[0] is packs
    if not packs:
        assert not prepack_supported(torch.device("cpu"), BF16)


def test_forcing_the_avx2_tier_hides_the_wider_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLM_ENGINE_ISA=avx2 makes an AVX-512 machine answer every check as Zen 3 does (and build our
    kernels for x86-64-v3), so the AVX2 path can be tested and measured there."""
    avx512_host = "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_bf16 amx_tile avx_vnni avx512_vnni"
    monkeypatch.setattr("builtins.open", _fake_cpuinfo(f"flags\t\t: {avx512_host}\n"), raising=True)
    cpu_isa.cpu_flags.cache_clear()
    try:
        monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
        monkeypatch.delenv("VLM_ENGINE_CPU_BF16", raising=False)  # the override would answer for the flags
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # a cap below AMX hides the tiles
        assert cpu_isa.isa_tier() == "amx_bf16" and cpu_isa.has_amx_bf16() and cpu_isa.march_flag() == "-march=native"
        cpu_isa.cpu_flags.cache_clear()
        monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
        assert cpu_isa.cpu_flags() == {"avx2", "fma", "f16c"}
        assert cpu_isa.isa_tier() == "avx2" and not cpu_isa.has_native_bf16()
        assert not onednn_bf16_packing()[0] and cpu_isa.march_flag() == "-march=x86-64-v3"
        assert cpu_isa.tier_description() == "avx2 (forced by VLM_ENGINE_ISA)"
        # The AVX2 build may if-convert FP compares (SiLU's clamp); the AVX-512 one keeps GCC's default.
        from vlm_engine.kernels.build import _flag_sets

        assert "-fno-trapping-math" in _flag_sets()[0]
        cpu_isa.cpu_flags.cache_clear()
        monkeypatch.delenv(cpu_isa.ISA_ENV)
        assert "-fno-trapping-math" not in _flag_sets()[0]
        cpu_isa.cpu_flags.cache_clear()
        monkeypatch.setenv(cpu_isa.ISA_ENV, "avx9")
        with pytest.raises(ValueError, match="VLM_ENGINE_ISA"):
            cpu_isa.forced_isa()
    finally:
        monkeypatch.undo()
        cpu_isa.cpu_flags.cache_clear()


def _fake_cpuinfo(text: str) -> Any:
    import builtins
    import io

    real_open = builtins.open

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        return io.StringIO(text) if path == "/proc/cpuinfo" else real_open(path, *args, **kwargs)

    return fake_open


@pytest.mark.skipif(PACKING, reason="this CPU packs bf16 weights; the fallback is for CPUs that cannot")
def test_bf16_model_without_packing_keeps_plain_linears(tiny_vlm_dir) -> None:
    """The fallback path on CPUs oneDNN cannot pack for: plain bf16 nn.Linear, and the engine runs."""
    from vlm_engine import Engine, SamplingParams

    engine = Engine(str(tiny_vlm_dir), dtype="bfloat16", kv_cache_tokens=512)
    assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert any(isinstance(m, nn.Linear) and m.weight.dtype == BF16 for m in engine.model.modules())
    out = engine.generate(["a short prompt"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.token_ids) == 4 or out.finish_reason == "stop"


def test_auto_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")

    class Config:
        dtype = "float32"

    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "1")
    assert resolve_dtype("auto", Config(), cpu, is_gguf=False) == BF16
    assert resolve_dtype("auto", Config(), cpu, is_gguf=True) == BF16
    assert resolve_dtype("float32", Config(), cpu, is_gguf=False) == torch.float32
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "0")
    assert resolve_dtype("auto", Config(), cpu, is_gguf=False) == torch.float32
    Config.dtype = "bfloat16"
    # A bf16 checkpoint on a CPU without bf16 arithmetic runs in fp32 (about 2x faster there)...
    assert resolve_dtype("auto", Config(), cpu, is_gguf=False) == torch.float32
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "1")
    assert resolve_dtype("auto", Config(), cpu, is_gguf=False) == BF16  # ...and stays bf16 where it has it
    assert resolve_dtype("auto", Config(), torch.device("meta"), is_gguf=False) == BF16  # other devices: as saved


def test_auto_stores_bf16_weights_only_where_it_picked_fp32_for_lack_of_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from vlm_engine.models.registry import cpu_bf16_weights

    cpu = torch.device("cpu")
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "0")
    assert cpu_bf16_weights("auto", torch.float32, cpu)
    assert not cpu_bf16_weights("float32", torch.float32, cpu)  # asked for fp32: fp32 weights
    assert not cpu_bf16_weights("auto", torch.float32, torch.device("meta"))
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "1")
    assert not cpu_bf16_weights("auto", torch.float32, cpu)  # auto picked fp32 for another reason


def test_engine_fast_path_agrees_with_plain_bf16(tiny_vlm_dir, ops) -> None:
    """Tiny random Qwen2-VL in bf16: fused ops + packed linears vs plain torch ops, same prompts.

    Random weights give flat logits, so instead of exact ids the first token's top-5 log-probs
    are compared (they must agree to bf16 noise), plus the greedy ids of a real-weights model in
    test_smollm2_parity.py.
    """
    from tests.conftest import make_image
    from vlm_engine import Engine, SamplingParams

    messages = [
        [{"role": "user", "content": "Describe a quiet harbour at dawn."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": make_image(64, 48, 1)},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    ]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    results = []
    for fast in (True, False):
        engine = Engine(
            str(tiny_vlm_dir), dtype="bfloat16", kv_cache_tokens=1024, prepack_weights=fast, fused_cpu_ops=fast
        )
        assert (engine.runner.fused_ops is not None) == fast
        results.append(engine.chat(messages, params))
    for fast_out, plain_out in zip(*results):
        fast_top = dict(fast_out.logprobs[0].top_logprobs)
        plain_top = dict(plain_out.logprobs[0].top_logprobs)
        shared = set(fast_top) & set(plain_top)
        assert len(shared) >= 4
        for token in shared:
            assert abs(fast_top[token] - plain_top[token]) < 0.05


@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 100), (5, 3)])
def test_panel_linear_matches_f_linear(ops, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = ops.pack_panels(w)
    assert tuple(panels.shape) == ((n + 15) // 16, k, 16)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g)
        tol = {"rtol": 1e-5, "atol": 1e-5 * k**0.5}  # fp32 sums of k products, another order
        torch.testing.assert_close(ops.panel_linear(x, panels, n, b), F.linear(x, w, b), **tol)
        torch.testing.assert_close(ops.panel_linear(x, panels, n), F.linear(x, w), **tol)
    with pytest.raises(RuntimeError, match="features"):
        ops.panel_linear(torch.ones(1, k + 1), panels, n)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 100), (5, 3)])
def test_bf16_panel_linear_is_the_fp32_product_rounded_once(ops, n: int, k: int) -> None:
    """bf16 panels: the exact fp32 product of the bf16 numbers (summed in another order), rounded
    to bf16 once, as oneDNN's bf16 kernels accumulate."""
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g).to(BF16), torch.randn(n, generator=g).to(BF16)
    panels = ops.pack_panels(w)
    assert panels.dtype == BF16 and tuple(panels.shape) == ((n + 15) // 16, k, 16)
    for rows in (1, 2, 4, 7):
        x = torch.randn(rows, k, generator=g).to(BF16)
        for bias in (b, None):
            got = ops.panel_linear(x, panels, n, bias)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == BF16
            # Within one bf16 rounding of the fp32 result (which itself differs only by summation order).
            torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-5 * k**0.5)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.panel_linear(torch.ones(1, k).to(BF16), ops.pack_panels(w.float()), n)  # bf16 x on fp32 panels


@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 100)])
def test_fp32_x_on_bf16_panels_is_the_fp32_product_of_the_bf16_weights(ops, n: int, k: int) -> None:
    """The bf16-weights mode: fp32 x, bf16 panels, fp32 out, nothing rounded but the weights."""
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g).to(BF16), torch.randn(n, generator=g)
    panels = ops.pack_panels(w)
    for rows in (1, 2, 3, 7):
        x = torch.randn(rows, k, generator=g)
        got = ops.panel_linear(x, panels, n, b)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_prefill_sized_panel_products_equal_one_sweep(ops) -> None:
    """From 512 rows the panel kernel sweeps the panels once per ~256 rows (x stays near the
    cores); every output must still be the sum a small call computes (same 6-row blocks)."""
    g = torch.Generator().manual_seed(5)
    n, k, rows = 40, 64, 1100  # 5 sweeps of 240 rows, the last one 140
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    for panels, xs, bias in (
        (ops.pack_panels(w), x, b),
        (ops.pack_panels(w.to(BF16)), x, None),
        (ops.pack_panels(w.to(BF16)), x.to(BF16), b.to(BF16)),
    ):
        whole = ops.panel_linear(xs, panels, n, bias)
        pieces = torch.cat([ops.panel_linear(xs[i : i + 48], panels, n, bias) for i in range(0, rows, 48)])
        assert torch.equal(whole, pieces)


def panel_outputs(ops: Any) -> dict[str, torch.Tensor]:
    """panel_linear on fixed inputs: fp32, bf16-weight and bf16 panels, row counts on both sides
    of every kernel switch (1-2 rows' partial chains, blocks of 6, an odd panel count per thread)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in (1, 2, 3, 5, 7, 13, 64):
        for n, k in ((16, 64), (20, 257), (100, 96), (600, 300)):
            w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
            out[f"fp32 {m} {n} {k}"] = ops.panel_linear(x, ops.pack_panels(w), n, b)
            out[f"bf16w {m} {n} {k}"] = ops.panel_linear(x, ops.pack_panels(w.to(BF16)), n)
            out[f"bf16 {m} {n} {k}"] = ops.panel_linear(x.to(BF16), ops.pack_panels(w.to(BF16)), n, b.to(BF16))
    return out


@pytest.mark.slow
@pytest.mark.skipif(
    cpu_isa.forced_isa() is not None or cpu_isa.isa_tier() not in ("avx512", "avx512_bf16", "amx_bf16"),
    reason="needs an AVX-512 CPU running its own tier (else both builds are the AVX2 one)",
)
def test_avx512_panel_kernel_gives_the_avx2_builds_bits(ops, tmp_path: Path) -> None:
    """The AVX-512 build takes two panels per pass in 16-lane vectors; every output is still the
    AVX2 build's FMA chain over the inputs, so the two builds agree bit for bit (and a model's
    fast-mode output does not depend on which of the two tiers the CPU has)."""
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from test_fused_ops import panel_outputs; "
        "from vlm_engine.models.fused_ops import load_fused_ops; "
        "torch.save(panel_outputs(load_fused_ops()), sys.argv[2])"
    )
    saved = tmp_path / "avx2.pt"
    env = {**os.environ, cpu_isa.ISA_ENV: "avx2"}
    command = [sys.executable, "-c", script, str(Path(__file__).parent), str(saved)]
    subprocess.run(command, env=env, check=True, timeout=600)
    avx2, native = torch.load(saved), panel_outputs(ops)
    assert avx2.keys() == native.keys()
    assert [key for key in native if not torch.equal(native[key], avx2[key])] == []


def test_fp32_packed_linear_with_bf16_weights(ops) -> None:
    linear = nn.Linear(96, 40).requires_grad_(False)
    packed = PackedLinear(linear, ops, bf16_weights=True)
    assert packed.bf16_weights and packed._panels.dtype == BF16 and "bf16 weight panels" in repr(packed)
    x = randn(9, 96, seed=6).float()
    want = F.linear(x, linear.weight.to(BF16).float(), linear.bias)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-4)
    assert not PackedLinear(linear, None, bf16_weights=True).bf16_weights  # only on the panel kernel


def test_bf16_packed_linear_takes_panels_for_few_rows_and_onednn_above(ops) -> None:
    if not prepack_supported(torch.device("cpu"), BF16):
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    from vlm_engine.models.prepack import BF16_PANEL_MAX_ROWS

    linear = nn.Linear(96, 40).requires_grad_(False).to(BF16)
    packed = PackedLinear(linear, ops, layouts="two")
    assert packed._panels is not None and "oneDNN above" in repr(packed)
    x = randn(BF16_PANEL_MAX_ROWS + 3, 96, seed=5)
    panel_rows = x[:BF16_PANEL_MAX_ROWS]
    assert torch.equal(packed(panel_rows), ops.panel_linear(panel_rows, packed._panels, 40, packed.bias))
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")
    assert torch.equal(packed(x), onednn)
    torch.testing.assert_close(packed(panel_rows).float(), linear(panel_rows).float(), rtol=2**-7, atol=1e-3)


def test_fp32_packed_linear_on_panels_is_close_and_batch_invariant(ops) -> None:
    """With the fused-ops extension fp32 linears run on panels: close to F.linear, a row's bits
    independent of the rows sharing the call, and no dense copy of the weight kept."""
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 8, bias=False)).requires_grad_(False)
    reference = [nn.Linear(64, 40), nn.Linear(40, 8, bias=False)]
    reference[0].load_state_dict(model[0].state_dict())
    reference[1].load_state_dict(model[1].state_dict())
    assert prepack_linears(model, ops) == 2
    assert model[0]._panels is not None and "panels" in repr(model[0])
    assert model[0].weight.shape == (40, 64) and model[0].weight.stride() == (0, 0)  # a stand-in, no storage
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    full = model(x)
    torch.testing.assert_close(full, reference[1](reference[0](x)), rtol=1e-4, atol=1e-5)
    for rows in (1, 5, 6, 7, 13):  # the kernel takes rows in sixes, then the remainder
        assert torch.equal(model(x[:rows]), full[:rows])
        assert torch.equal(model(x[-rows:]), full[-rows:])
