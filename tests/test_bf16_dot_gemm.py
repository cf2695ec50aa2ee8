"""The bf16 linear on vdpbf16ps (AVX-512 BF16): the fp32 product of the bf16 numbers rounded once,
rows independent of the batch, and PackedLinear's choice between it and oneDNN by row count.
Skipped where the CPU (or VLM_ENGINE_ISA) has no bf16 dot products: the kernel cannot run there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.bf16_dot_gemm import load_bf16_dot_gemm
from vlm_engine.kernels import cpu_isa
from vlm_engine.kernels.build import cpu_kernels_disabled
from vlm_engine.models.prepack import (
    BF16_DOT_MAX_ROWS,
    BF16_DOT_MAX_ROWS_AMX,
    PackedLinear,
    bf16_dot_max_rows,
    prepack_linears,
)

from tests.kernel_builds import require_extension

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    not cpu_isa.has_native_bf16() or cpu_kernels_disabled(),
    reason="no AVX-512 BF16 on this CPU (or VLM_ENGINE_ISA / _CPU_BF16 hide it, or _DISABLE_CPU_KERNEL is set)",
)
dot = load_bf16_dot_gemm()


@pytest.fixture(autouse=True, scope="module")
def _dot_built() -> None:
    """On a CPU with bf16 dot products, no module is our build's failure: fails under CI=true."""
    require_extension(load_bf16_dot_gemm, "the bf16 dot-product extension")


def bf16_randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(BF16)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (49, 100), (5, 3), (40, 1537)])
def test_dot_linear_is_the_fp32_product_rounded_once(n: int, k: int) -> None:
    """Odd K (a zero-padded last pair), N off the 16-column panels and the 3-panel tiles, every
    row-tile remainder: within one bf16 rounding of the fp32 product of the bf16 numbers."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w, b = bf16_randn(n, k, gen=gen), bf16_randn(n, gen=gen)
    pairs = dot.pack_pairs(w)
    assert pairs.dtype == BF16 and tuple(pairs.shape) == ((n + 15) // 16, (k + 1) // 2, 32)
    for rows in (1, 3, 8, 13, 70):
        x = bf16_randn(rows, k, gen=gen)
        for bias in (b, None):
            got = dot.dot_linear(x, pairs, n, bias)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == BF16 and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-5 * k**0.5)


def test_dot_linear_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    w = bf16_randn(200, 96, gen=gen)
    pairs = dot.pack_pairs(w)
    x = bf16_randn(67, 96, gen=gen)
    full = dot.dot_linear(x, pairs, 200)
    for lo, hi in ((0, 1), (5, 6), (3, 12), (60, 67), (1, 66)):
        assert torch.equal(dot.dot_linear(x[lo:hi], pairs, 200), full[lo:hi])
    strided = torch.cat([x, x], dim=1)[:, :96]  # a row stride other than K
    assert torch.equal(dot.dot_linear(strided, pairs, 200), full)


def test_dot_linear_rejects_mismatched_inputs() -> None:
    gen = torch.Generator().manual_seed(4)
    pairs = dot.pack_pairs(bf16_randn(32, 64, gen=gen))
    with pytest.raises(RuntimeError, match="features"):
        dot.dot_linear(bf16_randn(2, 66, gen=gen), pairs, 32)
    with pytest.raises(RuntimeError, match="n does not match"):
        dot.dot_linear(bf16_randn(2, 64, gen=gen), pairs, 48)
    with pytest.raises(RuntimeError, match="bfloat16"):
        dot.dot_linear(torch.ones(2, 64), pairs, 32)
    assert dot.dot_linear(bf16_randn(0, 64, gen=gen), pairs, 32).shape == (0, 32)


AVX512_BF16 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}  # Zen 4 / Zen 5
SAPPHIRE_RAPIDS = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("cap", "amx"), [("", True), ("ALL", True), ("AVX512_CORE_AMX", True), ("AVX512_CORE_BF16", False), ("avx2", False)]
)
def test_amx_counts_only_where_onednn_may_use_it(monkeypatch: pytest.MonkeyPatch, cap: str, amx: bool) -> None:
    """ONEDNN_MAX_CPU_ISA below AMX keeps oneDNN's bf16 GEMM off the tiles: the dot kernel then
    keeps its Zen 4 row limit instead of handing 7+ rows to a oneDNN without AMX."""
    monkeypatch.delenv("VLM_ENGINE_CPU_BF16", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    assert cpu_isa.has_amx_bf16() is amx
    assert bf16_dot_max_rows() == (BF16_DOT_MAX_ROWS_AMX if amx else BF16_DOT_MAX_ROWS)


@pytest.mark.parametrize(
    ("flags", "rows"), [(AVX512_BF16, BF16_DOT_MAX_ROWS), (SAPPHIRE_RAPIDS, BF16_DOT_MAX_ROWS_AMX)]
)
def test_packed_linear_takes_the_dot_kernel_up_to_its_rows_and_onednn_above(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], rows: int
) -> None:
    """Two layouts: the dot kernel's last row count follows the CPU: with AMX tiles oneDNN's bf16 GEMM
    is the faster one from a few rows on (4x at 64 rows on a Sapphire Rapids), without them from 257."""
    monkeypatch.delenv("VLM_ENGINE_CPU_BF16", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
    assert bf16_dot_max_rows() == rows
    gen = torch.Generator().manual_seed(5)
    linear = nn.Linear(96, 40).requires_grad_(False).to(BF16)
    packed = PackedLinear(linear, None, False, dot, layouts="two")
    assert packed.dot_max_rows == rows and f"up to {rows} rows" in repr(packed)
    assert packed._pairs is not None and packed._panels is None and "dot pairs" in repr(packed)
    small, large = bf16_randn(rows, 96, gen=gen), bf16_randn(rows + 1, 96, gen=gen)
    assert torch.equal(packed(small), dot.dot_linear(small, packed._pairs, 40, packed.bias))
    onednn = torch.ops.mkldnn._linear_pointwise(large, packed.weight, packed.bias, "none", [], "")
    assert torch.equal(packed(large), onednn)
    for x in (small, large):
        torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=2**-7, atol=1e-2)


def test_prepack_hands_bf16_linears_to_the_dot_kernel_and_leaves_fp32_alone() -> None:
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8)).requires_grad_(False)
    assert prepack_linears(model.to(BF16), None, False, dot) == 2
    assert all(m._pairs is not None for m in model)
    fp32 = nn.Sequential(nn.Linear(16, 24)).requires_grad_(False)
    assert prepack_linears(fp32, None, False, dot) == 1
    assert fp32[0]._pairs is None


@pytest.mark.parametrize(("inter", "k"), [(1536, 576), (40, 96), (8, 7)])
def test_dot_silu_mul_equals_the_linear_then_the_fused_op(inter: int, k: int) -> None:
    """The gate/up kernel rounds where the unfused path does (the projection, the activation, the
    product): bit-identical to dot_linear followed by fused_ops' silu_and_mul, at every row-tile
    remainder, odd K, and an odd count of 8-column panels (inter 40: 5 panels, a 2-panel tile)."""
    from vlm_engine.models.fused_ops import load_fused_ops

    fused = load_fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=gen) / k**0.5).to(BF16)
    gated, plain = dot.pack_gate_up(w), dot.pack_pairs(w)
    for rows in (1, 3, 8, 13, 70):
        x = bf16_randn(rows, k, gen=gen)
        got = dot.dot_silu_mul(x, gated, inter)
        assert got.dtype == BF16 and got.shape == (rows, inter)
        assert torch.equal(got, fused.silu_and_mul(dot.dot_linear(x, plain, 2 * inter)))
    with pytest.raises(RuntimeError, match="inter does not match"):
        dot.dot_silu_mul(x, gated, inter + 8)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        dot.pack_gate_up(w[:-8])


def test_gated_mlp_takes_the_gate_up_kernel_and_stays_the_mlp() -> None:
    """prepack_linears packs GatedMLP's gate/up projection for dot_silu_mul: the MLP's output
    equals the unfused bf16 MLP's; above the kernel's rows (oneDNN), and for a plain call of the
    projection, the product and the fused op still give the same numbers."""
    from vlm_engine.models.fused_ops import load_fused_ops
    from vlm_engine.models.layers import GatedMLP

    fused = load_fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(6)
    mlp = GatedMLP(96, 48).requires_grad_(False).to(BF16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 96**0.5)
    reference = GatedMLP(96, 48).to(BF16)
    reference.load_state_dict(mlp.state_dict())
    prepack_linears(mlp, None, False, dot, layouts="two")
    gate_up = mlp.gate_up_proj
    assert gate_up._gate_up_pairs is not None and gate_up._pairs is None and "silu(gate) * up" in repr(gate_up)
    for rows in (1, 9, gate_up.dot_max_rows + 1):
        x = bf16_randn(rows, 96, gen=gen)
        unfused = fused.silu_and_mul(F.linear(x, reference.gate_up_proj.weight))
        assert torch.equal(gate_up.silu_and_mul(x, fused), unfused) or rows > gate_up.dot_max_rows
        torch.testing.assert_close(gate_up.silu_and_mul(x, fused).float(), unfused.float(), rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(
            gate_up(x).float(), F.linear(x, reference.gate_up_proj.weight).float(), rtol=2**-7, atol=1e-2
        )
        torch.testing.assert_close(mlp(x, fused).float(), reference(x, fused).float(), rtol=2**-7, atol=2e-2)
    # Not a gate/up pair: keeps its ordinary pairs.
    assert mlp.down_proj._pairs is not None and mlp.down_proj._gate_up_pairs is None


# ---- AMX tiles (the same pairs, for the rows between the dot kernel's and oneDNN's) ----------------

# A failed build (dot None) is not "no AMX": those tests run, and the module's require_extension fixture
# fails them under CI.
amx = pytest.mark.skipif(dot is not None and not dot.amx_available(), reason="no AMX tiles on this CPU")


@amx
@pytest.mark.parametrize(("n", "k"), [(960, 576), (49, 96), (40, 1536)])
def test_amx_linear_is_the_fp32_product_rounded_once(n: int, k: int) -> None:
    """N off the 32-column groups, every row-tile remainder (a zero-padded last tile) and the bias:
    within one bf16 rounding of the fp32 product of the bf16 numbers."""
    gen = torch.Generator().manual_seed(n + k)
    w, b = bf16_randn(n, k, gen=gen), bf16_randn(n, gen=gen)
    pairs = dot.pack_pairs(w)
    for rows in (1, 7, 16, 17, 33, 64, 70, 128):
        x = bf16_randn(rows, k, gen=gen)
        for bias in (b, None):
            got = dot.amx_linear(x, pairs, n, bias)
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert got.dtype == BF16 and got.shape == (rows, n)
            torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-5 * k**0.5)


@amx
def test_amx_rows_do_not_depend_on_the_batch_and_match_onednn_at_decode_sizes() -> None:
    """Every output is one chain over k whatever the batch; up to ~16 rows those are the bits of
    oneDNN's own AMX GEMM (measured: its blocking changes from 64 rows), so taking our tiles instead
    of oneDNN changes no numbers there."""
    gen = torch.Generator().manual_seed(8)
    w, b = bf16_randn(200, 576, gen=gen), bf16_randn(200, gen=gen)
    pairs = dot.pack_pairs(w)
    x = bf16_randn(100, 576, gen=gen)
    full = dot.amx_linear(x, pairs, 200, b)
    for lo, hi in ((0, 7), (5, 21), (3, 35), (60, 100), (1, 99)):
        assert torch.equal(dot.amx_linear(x[lo:hi], pairs, 200, b), full[lo:hi])
    strided = torch.cat([x, x], dim=1)[:, :576]  # a row stride other than K
    assert torch.equal(dot.amx_linear(strided, pairs, 200, b), full)
    onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    for rows in (7, 16, 17):
        for bias in (None, b):
            onednn = torch.ops.mkldnn._linear_pointwise(x[:rows], onednn_weight, bias, "none", [], "")
            assert torch.equal(dot.amx_linear(x[:rows], pairs, 200, bias), onednn)


@amx
def test_amx_silu_mul_equals_the_linear_then_the_fused_op() -> None:
    from vlm_engine.models.fused_ops import load_fused_ops

    fused = load_fused_ops()
    assert fused is not None
    gen = torch.Generator().manual_seed(9)
    for inter, k in ((1536, 576), (40, 96)):  # inter 40: 5 panels, a last group of one panel
        w = (torch.randn(2 * inter, k, generator=gen) / k**0.5).to(BF16)
        gated, plain = dot.pack_gate_up(w), dot.pack_pairs(w)
        for rows in (7, 16, 30, 64, 70):
            x = bf16_randn(rows, k, gen=gen)
            assert torch.equal(dot.amx_silu_mul(x, gated, inter), fused.silu_and_mul(dot.amx_linear(x, plain, 2 * inter)))


@amx
def test_amx_tiles_leave_onednn_its_own() -> None:
    """Our threads load their tile config and release the tiles; oneDNN's AMX GEMM (prefill sizes)
    configures its own: interleaved, each still gives its own numbers."""
    gen = torch.Generator().manual_seed(10)
    w = bf16_randn(256, 576, gen=gen)
    pairs, onednn_weight = dot.pack_pairs(w), torch.ops.mkldnn._reorder_linear_weight(w, 64)
    small, large = bf16_randn(20, 576, gen=gen), bf16_randn(300, 576, gen=gen)
    want_small = dot.amx_linear(small, pairs, 256)
    want_large = torch.ops.mkldnn._linear_pointwise(large, onednn_weight, None, "none", [], "")
    for _ in range(3):
        assert torch.equal(torch.ops.mkldnn._linear_pointwise(large, onednn_weight, None, "none", [], ""), want_large)
        assert torch.equal(dot.amx_linear(small, pairs, 256), want_small)


@amx
def test_amx_linear_rejects_what_its_tiles_cannot_read() -> None:
    gen = torch.Generator().manual_seed(11)
    pairs = dot.pack_pairs(bf16_randn(32, 80, gen=gen))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        dot.amx_linear(bf16_randn(8, 80, gen=gen), pairs, 32)
    assert dot.amx_linear(bf16_randn(0, 80, gen=gen), pairs, 32).shape == (0, 32)


@amx
def test_packed_linear_takes_amx_tiles_between_the_dot_kernel_and_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this AMX CPU: the dot kernel up to its rows, our tiles to BF16_AMX_MAX_ROWS, oneDNN above;
    a layer whose inputs a tile's 32 do not divide skips the tiles. The gate/up projection follows."""
    from vlm_engine.models.fused_ops import load_fused_ops
    from vlm_engine.models.prepack import BF16_AMX_MAX_ROWS

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    fused = load_fused_ops()
    gen = torch.Generator().manual_seed(12)
    linear = nn.Linear(96, 40).requires_grad_(False).to(BF16)
    packed = PackedLinear(linear, None, False, dot, layouts="two")
    assert packed.amx_max_rows == BF16_AMX_MAX_ROWS and f"AMX tiles up to {BF16_AMX_MAX_ROWS}" in repr(packed)
    for rows in (packed.dot_max_rows + 1, 50, BF16_AMX_MAX_ROWS):
        x = bf16_randn(rows, 96, gen=gen)
        assert torch.equal(packed(x), dot.amx_linear(x, packed._pairs, 40, packed.bias))
    x = bf16_randn(BF16_AMX_MAX_ROWS + 1, 96, gen=gen)
    assert torch.equal(packed(x), torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], ""))
    assert PackedLinear(nn.Linear(80, 40).to(BF16), None, False, dot).amx_max_rows == 0
    gate_up = PackedLinear(
        nn.Linear(96, 48, bias=False).requires_grad_(False).to(BF16), None, False, dot, gate_up=True, layouts="two"
    )
    x = bf16_randn(30, 96, gen=gen)
    assert torch.equal(gate_up.silu_and_mul(x, fused), dot.amx_silu_mul(x, gate_up._gate_up_pairs, 24))
