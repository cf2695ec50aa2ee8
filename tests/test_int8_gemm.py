"""The int8 / int4 GEMM for prefill-sized products (csrc/int8_gemm.cpp): equal bit for bit to fused_ops'
quant_panel_linear on the same panels, and to a float64 oracle of the quantized math within fp32
rounding, on every path this build has (`impl`), and on the AVX2 build that VLM_ENGINE_ISA=avx2 makes (which has
no bf16-compute path); its bf16-compute path for int8 weights (`wo_gemm`) against float64 on the exact weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from vlm_engine.models.quantized import GEMM_MIN_ROWS, WO_MAX_WEIGHTS, WO_MIN_ROWS, QuantizedLinear

REPO = Path(__file__).resolve().parents[1]
IMPLS = {1: "avx512-vnni", 2: "avx-vnni-256", 3: "avx2-maddubs"}
# [m, n, k]: odd row and column counts (partial tiles, a partial last panel, half-panel vectors),
# k from one group up; a thread takes x in chunks of up to 128 rows and 2.5 MiB, and the inputs in
# blocks of 16 KiB of a strip's codes (partial sums kept between them): 130 x 24576 spans two
# chunks of rows (of ~100, by bytes) and many blocks of inputs, 133 x 96 two chunks of rows (of 128).
SHAPES = [(1, 37, 64), (5, 16, 32), (17, 100, 96), (33, 130, 576), (70, 53, 160), (130, 40, 24576), (133, 24, 96)]


@pytest.fixture(scope="module")
def gemm() -> Any:
    from tests.kernel_builds import require_extension
    from vlm_engine.models.int8_gemm import load_int8_gemm

    return require_extension(load_int8_gemm, "the int8 GEMM extension")


def _case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, b, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g), torch.randn(m, k, generator=g)
    w[:, :32] = 0  # a group of zero weights (scale 0)
    x[0, -32:] = 0  # and of zero activations (their scale 0, inverse 0)
    x[-1, :32] *= 1e3  # a group far larger than the rest
    return w, b, x


def _panel_codes(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int) -> tuple[torch.Tensor, ...]:
    """Integer codes [n, k], scales d and minima m [n, k/32] (float64), read from the panel layout
    directly (fused_ops.cpp: int8 byte 4c+j of block b is column c's input 4b+j; int4 byte 4c+j holds
    input 8b+j in its low nibble and 8b+4+j in its high one; scales [P][K/32][2][16])."""
    panels, blocks, _ = codes.shape
    if bits == 8:
        q = codes.view(panels, blocks, 16, 4).permute(0, 2, 1, 3).reshape(panels * 16, blocks * 4).long()
    else:
        raw = codes.view(panels, blocks, 16, 4).long()
        q = torch.cat([raw & 15, raw >> 4], dim=-1).permute(0, 2, 1, 3).reshape(panels * 16, blocks * 8)
    half = scales.view(torch.float16).double()  # [P, G, 2, 16]
    d, mins = (half[:, :, j, :].permute(0, 2, 1).reshape(panels * 16, -1) for j in (0, 1))
    return q[:n], d[:n], mins[:n]


def _oracle(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """llama.cpp's Q8_0 / Q8_1 activations times the codes in float64: per row and group of 32,
    qx = round-half-even(x * (1 / dx)) with dx = max|x| / 127 (both fp32, as the kernels compute them);
    y = sum over groups of d dx (qx . q) + m (sum of x) + bias."""
    m, k = x.shape
    q, d, mins = _panel_codes(codes, scales, n, bits)
    groups = x.view(m, k // 32, 32)
    dx = groups.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(groups * inv[..., None]).double()  # [m, G, 32]
    sums = torch.einsum("mgi,ngi->mng", qx, q.double().view(n, k // 32, 32))  # exact integers
    y = (sums * d[None] * dx.double()[:, None, :]).sum(-1) + groups.double().sum(-1) @ mins.T
    return y + (0 if bias is None else bias.double())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", sorted(IMPLS), ids=list(IMPLS.values()))
def test_equals_the_decode_kernel_bit_for_bit(ops: Any, gemm: Any, impl: int, bits: int) -> None:
    if impl not in gemm.impls():
        pytest.skip(f"this build has no {IMPLS[impl]} path (it has {[IMPLS[i] for i in gemm.impls()]})")
    assert gemm.impl_name(impl) == IMPLS[impl]
    for m, n, k in SHAPES:
        w, b, x = _case(m, n, k, seed=m * n + bits)
        codes, scales = ops.quantize_panels(w, bits)
        for bias in (b, None):
            got = gemm.quant_gemm(x, codes, scales, n, bits, bias, impl=impl)
            assert torch.equal(got, ops.quant_panel_linear(x, codes, scales, n, bits, bias)), (m, n, k, bias is None)
            torch.testing.assert_close(got.double(), _oracle(x, codes, scales, n, bits, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", sorted(IMPLS), ids=list(IMPLS.values()))
def test_bf16_rows_equal_the_decode_kernel_on_them_widened(ops: Any, gemm: Any, impl: int, bits: int) -> None:
    """bf16 in and out (a bf16 model's quantized linears): the fp32 product of the rows widened
    (exactly), rounded to bf16 once, as QuantizedLinear does below GEMM_MIN_ROWS rows."""
    if impl not in gemm.impls():
        pytest.skip(f"this build has no {IMPLS[impl]} path (it has {[IMPLS[i] for i in gemm.impls()]})")
    for m, n, k in SHAPES:
        w, b, x = _case(m, n, k, seed=m * n + bits + 1)
        codes, scales = ops.quantize_panels(w, bits)
        x = x.bfloat16()
        got = gemm.quant_gemm(x, codes, scales, n, bits, b, impl=impl)
        assert got.dtype == torch.bfloat16
        want = ops.quant_panel_linear(x.float(), codes, scales, n, bits, b).bfloat16()
        assert torch.equal(got, want), (m, n, k)


@pytest.mark.parametrize("span", [64, 128, 256])
def test_int4_scales_per_group_of_inputs_equal_them_repeated_per_32(ops: Any, gemm: Any, span: int) -> None:
    """A checkpoint's int4 groups of `span` inputs keep one (d, m) each (scales [P][K/span][2][16]): the decode
    kernel, every GEMM path (fp32 and bf16 rows) and the dequantizer read group g's pair at g >> log2(span / 32)
    and give the numbers of that pair repeated in every block of 32, bit for bit."""
    repeat = span // 32
    for m, n, k in [*SHAPES, (9, 70, 384), (65, 33, 1152)]:
        if k % span:
            continue
        w, b, x = _case(m, n, k, seed=m + n + span)
        codes, scales = ops.quantize_panels(w, 4)
        coarse = scales[:, ::repeat].contiguous()
        repeated = coarse.repeat_interleave(repeat, dim=1)
        assert torch.equal(ops.dequantize_panels(codes, coarse, n, 4), ops.dequantize_panels(codes, repeated, n, 4))
        want = ops.quant_panel_linear(x, codes, repeated, n, 4, b)
        assert torch.equal(ops.quant_panel_linear(x, codes, coarse, n, 4, b), want), (m, n, k)
        for impl in gemm.impls():
            for rows in (x, x.bfloat16()):
                got = gemm.quant_gemm(rows, codes, coarse, n, 4, b, impl=impl)
                assert torch.equal(got, gemm.quant_gemm(rows, codes, repeated, n, 4, b, impl=impl)), (m, n, k, impl)
    w, b, x = _case(9, 70, 1152, seed=span)
    codes, scales = ops.quantize_panels(w, 4)
    three = scales[:, :3].contiguous()  # 3 groups for 36 blocks of 32: no power of two between them
    with pytest.raises(RuntimeError, match="scales do not match"):
        ops.quant_panel_linear(x, codes, three, 70, 4, b)
    with pytest.raises(RuntimeError, match="scales do not match"):
        gemm.quant_gemm(x, codes, three, 70, 4, b)


def test_rows_with_a_stride_and_the_argument_checks(ops: Any, gemm: Any) -> None:
    w, b, x = _case(9, 48, 128, seed=3)
    codes, scales = ops.quantize_panels(w, 8)
    wide = torch.cat([x, torch.ones(9, 32)], dim=1)[:, :128]  # rows 160 floats apart
    assert torch.equal(gemm.quant_gemm(wide, codes, scales, 48, 8, b), gemm.quant_gemm(x, codes, scales, 48, 8, b))
    assert gemm.quant_gemm(x[:0], codes, scales, 48, 8, b).shape == (0, 48)
    with pytest.raises(RuntimeError, match="features"):
        gemm.quant_gemm(x[:, :96].contiguous(), codes, scales, 48, 8, b)
    with pytest.raises(RuntimeError, match="n does not match"):
        gemm.quant_gemm(x, codes, scales, 64, 8, None)
    with pytest.raises(RuntimeError, match="impl"):
        gemm.quant_gemm(x, codes, scales, 48, 8, b, impl=7)


def test_threads_give_the_same_numbers(ops: Any, gemm: Any) -> None:
    """Threads take strips of columns: one thread or two, every output is the same chain of steps."""
    w, b, x = _case(40, 200, 256, seed=5)
    codes, scales = ops.quantize_panels(w, 4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = gemm.quant_gemm(x, codes, scales, 200, 4, b)
        torch.set_num_threads(max(2, before))
        assert torch.equal(gemm.quant_gemm(x, codes, scales, 200, 4, b), want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_takes_the_gemm_from_its_row_count(ops: Any, gemm: Any, bits: int) -> None:
    linear = nn.Linear(96, 70).requires_grad_(False)
    layer = QuantizedLinear(linear, bits, ops)
    rows = layer.rows_fn()
    for m in (1, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, 3 * GEMM_MIN_ROWS + 1):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        want = ops.quant_panel_linear(x, layer.codes, layer.scales, 70, bits, layer.bias)
        assert torch.equal(rows(x), want) and torch.equal(layer(x.view(1, m, 96)), want.view(1, m, 70))
        half = x.bfloat16()  # bf16 rows: the same product of the rows widened, rounded to bf16 once
        want = ops.quant_panel_linear(half.float(), layer.codes, layer.scales, 70, bits, layer.bias).bfloat16()
        assert torch.equal(rows(half), want) and torch.equal(layer(half.view(1, m, 96)), want.view(1, m, 70))


_FORCED_AVX2 = """
import torch
from vlm_engine.models.fused_ops import load_fused_ops
from vlm_engine.models.int8_gemm import load_int8_gemm
ops, gemm = load_fused_ops(), load_int8_gemm()
assert gemm.impls() == [3], gemm.impls()
assert not gemm.wo_available()  # bf16 compute needs AVX-512 BF16
g = torch.Generator().manual_seed(0)
for bits in (8, 4):
    for m, n, k in ((1, 37, 64), (19, 100, 96), (64, 130, 576)):
        w, b, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g), torch.randn(m, k, generator=g)
        codes, scales = ops.quantize_panels(w, bits)
        assert torch.equal(gemm.quant_gemm(x, codes, scales, n, bits, b), ops.quant_panel_linear(x, codes, scales, n, bits, b))
print("ok")
"""


@pytest.mark.slow
def test_the_avx2_build_equals_the_decode_kernel(gemm: Any) -> None:
    """VLM_ENGINE_ISA=avx2 builds both extensions for x86-64-v3 (what Zen 3 runs): one path, the same numbers."""
    env = {**os.environ, "VLM_ENGINE_ISA": "avx2", "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _FORCED_AVX2],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.fixture
def wo(gemm: Any) -> Any:
    if not gemm.wo_available():
        pytest.skip("this build has no AVX-512 BF16 path for int8 weights with bf16 compute")
    return gemm


def _exact_weights(codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The int8 weights d * q [n, k] in float64, read from the panels (exact)."""
    q, d, _ = _panel_codes(codes, scales, n, 8)
    return q.double() * d.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("m, n, k", [*SHAPES, (16, 3072, 576), (300, 70, 1536)])
def test_bf16_compute_against_the_exact_int8_weights(ops: Any, wo: Any, m: int, n: int, k: int) -> None:
    """wo_gemm: bf16 rows times the int8 weights, against float64 on the exact weights: within the
    weights' rounding to bf16 (2^-9 of each |w|, summed as |x| |w|) and y's to bf16 (2^-9 of |y|);
    and against the float64 product with those bf16-rounded weights, within y's rounding and fp32 sums."""
    w, b, x = _case(m, n, k, seed=m + n + k)
    codes, scales = ops.quantize_panels(w, 8)
    x = x.bfloat16()
    exact = _exact_weights(codes, scales, n)
    magnitude = x.double().abs() @ exact.abs().T
    for bias in (b, None):
        got = wo.wo_gemm(x, codes, scales, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        shift = 0 if bias is None else bias.double()
        want = x.double() @ exact.T + shift
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-9 * magnitude + 1e-6).all(), (m, n, k)
        rounded = x.double() @ exact.float().bfloat16().double().T + shift  # d * q rounded to bf16
        assert ((got.double() - rounded).abs() <= 2**-8 * rounded.abs() + 1e-5 * magnitude + 1e-6).all(), (m, n, k)


def test_bf16_compute_threads_give_the_same_numbers(ops: Any, wo: Any) -> None:
    w, b, x = _case(150, 200, 576, seed=7)
    codes, scales = ops.quantize_panels(w, 8)
    x = x.bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = wo.wo_gemm(x, codes, scales, 200, b)
        torch.set_num_threads(max(2, before))
        assert torch.equal(wo.wo_gemm(x, codes, scales, 200, b), want)
    finally:
        torch.set_num_threads(before)
    wide = torch.cat([x, x[:, :64]], dim=1)[:, :576]  # rows with a stride
    assert torch.equal(wo.wo_gemm(wide, codes, scales, 200, b), want)
    with pytest.raises(RuntimeError, match="bf16"):
        wo.wo_gemm(x.float(), codes, scales, 200, b)
    codes4, scales4 = ops.quantize_panels(w, 4)
    with pytest.raises(RuntimeError, match="features"):
        wo.wo_gemm(x, codes4, scales4, 200, b)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_computes_int8_in_bf16_from_wo_min_rows(ops: Any, wo: Any, bits: int) -> None:
    """bf16 rows of an int8 layer from WO_MIN_ROWS rows: wo_gemm; fp32 rows and int4 keep the
    integer GEMM (equal to the decode kernel bit for bit)."""
    layer = QuantizedLinear(nn.Linear(96, 70).requires_grad_(False), bits, ops)
    rows = layer.rows_fn()
    for m in (WO_MIN_ROWS - 1, WO_MIN_ROWS, 2 * WO_MIN_ROWS + 3):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
        integer = ops.quant_panel_linear(x, layer.codes, layer.scales, 70, bits, layer.bias)
        assert torch.equal(rows(x), integer)
        half = x.bfloat16()
        if bits == 8 and m >= WO_MIN_ROWS:
            want = wo.wo_gemm(half, layer.codes, layer.scales, 70, layer.bias)
        else:
            want = ops.quant_panel_linear(half.float(), layer.codes, layer.scales, 70, bits, layer.bias).bfloat16()
        assert torch.equal(rows(half), want) and torch.equal(layer(half.view(1, m, 96)), want.view(1, m, 70))


def test_quantized_linear_keeps_the_integer_gemm_above_wo_max_weights(ops: Any, wo: Any) -> None:
    """An int8 layer of more than WO_MAX_WEIGHTS weights keeps the integer GEMM for bf16 rows at every row
    count (the faster one there with both threads)."""
    inputs, out = 2048, WO_MAX_WEIGHTS // 2048 + 16
    layer = QuantizedLinear(nn.Linear(inputs, out).requires_grad_(False), 8, ops)
    x = torch.randn(WO_MIN_ROWS + 5, inputs, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = ops.quant_panel_linear(x.float(), layer.codes, layer.scales, out, 8, layer.bias).bfloat16()
    assert torch.equal(layer.rows_fn()(x), want)
    assert not torch.equal(want, wo.wo_gemm(x, layer.codes, layer.scales, out, layer.bias))
