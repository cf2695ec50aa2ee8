"""The CPU flash-attention op (vlm_engine/attention/csrc/flash_attention.cpp) against a float64 oracle: every
mask kind (block-diagonal segments of odd lengths, causal bottom-right aligned, causal + sliding window), GQA
groups 1/2/4, head dims 64/72/80/128, fp32 and bf16, every implementation this build has; and the towers'
attention with the op against their SDPA path.

Tolerances (absolute, on outputs that are convex combinations of N(0, 1) values, so |out| < ~3):
- fp32: every path multiplies and accumulates in fp32 (D-term dot products, exp2 by a polynomial with
  relative error ~1e-7, sums of up to a few hundred terms): errors are a few 1e-6; 1e-4 leaves room for
  the longest sums, while a key leaking through a mask, or a missed rescale, moves outputs by >= 1e-2.
- bf16: inputs are bf16 in both (the oracle computes on the same rounded values); the output is rounded
  to bf16 (half an ulp: 2^-8 relative, <= 0.008 at |out| < 2), and on the vdpbf16ps path each
  probability is rounded to bf16 before P.V (relative 2^-9 each, independent, so their effect on an
  average is far below that). Max 2e-2, and a mean of 2e-3 so that a systematic error cannot hide under
  the maximum; a mask error on these short segments moves outputs by ~0.1 or more.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_builds import require_extension
from vlm_engine.attention.flash import cu_seqlens, flash_attention_reference, load_flash_attention
from vlm_engine.models import siglip
from vlm_engine.models.siglip import SiglipAttention
from vlm_engine.models.vision_blocks import group_segments, segment_attention

IMPLS = {"best": 0, "portable": 1, "avx512-fma": 2, "avx2-fma": 3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def ext():
    return require_extension(load_flash_attention, "flash attention")


def oracle(q, k, v, cu_q, cu_k, scale, causal=False, window=0) -> torch.Tensor:
    """Dense float64 attention per segment with an explicit mask; rows that see no key are zero."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        pos = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        key = torch.arange(k1 - k0)[None, :]
        visible = (key <= pos if causal else key >= 0) & (key > pos - window if window else key >= 0)
        kk, vv = k[k0:k1].repeat_interleave(groups, 1), v[k0:k1].repeat_interleave(groups, 1)
        scores = torch.einsum("ihd,jhd->hij", q[q0:q1], kk) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)  # no key: zeros
        out[q0:q1] = torch.einsum("hij,jhd->ihd", probs, vv)
    return out


def make(lq: list[int], lk: list[int], hkv: int, groups: int, dim: int, dtype, seed: int = 0, spread: float = 1.0):
    """q, k, v as views of one fused [N, (Hq + 2 Hkv) * D] projection output (strided, as in the towers)."""
    g = torch.Generator().manual_seed(seed)
    hq = hkv * groups
    nq, nk = sum(lq), sum(lk)
    qbuf = (spread * torch.randn(nq, hq + 2 * hkv, dim, generator=g)).to(dtype)
    kvbuf = torch.randn(nk, 2 * hkv, dim, generator=g).to(dtype)
    return qbuf[:, :hq], kvbuf[:, :hkv], kvbuf[:, hkv:], cu_seqlens(lq), cu_seqlens(lk)


def check(out: torch.Tensor, expected: torch.Tensor, dtype, what: str = "") -> None:
    assert out.dtype == dtype and out.shape == expected.shape
    err = (out.double() - expected).abs()
    if dtype == torch.float32:
        assert err.max().item() < 1e-4, (what, err.max().item())
    else:
        assert err.max().item() < 2e-2 and err.mean().item() < 2e-3, (what, err.max().item(), err.mean().item())


# Segment lengths: 1, odd ones, exactly one key block (64), past one query block (96) and several key blocks.
BLOCK_DIAGONAL = [1, 17, 5, 64, 3, 100, 130]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dim", [64, 72, 80, 128])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_block_diagonal(ext, dtype, dim: int, groups: int) -> None:
    """Every implementation (IMPLS) against one oracle run."""
    q, k, v, cu_q, cu_k = make(BLOCK_DIAGONAL, BLOCK_DIAGONAL, 2, groups, dim, dtype, seed=dim + groups)
    scale = dim**-0.5
    expected = oracle(q, k, v, cu_q, cu_k, scale)
    for name, impl in IMPLS.items():
        check(ext.flash_attention(q, k, v, cu_q, cu_k, scale, impl=impl), expected, dtype, name)


# Queries no more than keys (prefill after a cached prefix), equal, and more queries than keys (the first
# rows see nothing: zeros); an empty segment on either side.
CAUSAL_Q = [5, 1, 70, 130, 7, 0, 4]
CAUSAL_K = [5, 40, 200, 130, 3, 6, 0]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("window", [0, 1, 16, 50], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("dim,groups", [(64, 1), (72, 2), (80, 4), (128, 2)])
def test_causal_and_window(ext, dtype, window: int, dim: int, groups: int) -> None:
    q, k, v, cu_q, cu_k = make(CAUSAL_Q, CAUSAL_K, 2, groups, dim, dtype, seed=window + dim)
    scale = dim**-0.5
    expected = oracle(q, k, v, cu_q, cu_k, scale, causal=True, window=window)
    for name, impl in IMPLS.items():
        out = ext.flash_attention(q, k, v, cu_q, cu_k, scale, causal=True, window=window, impl=impl)
        check(out, expected, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("dim", [8, 96, 256])
def test_other_head_dims_peaked_scores_and_threads(ext, dtype, dim: int) -> None:
    """Head dims beyond the towers'; scores spread wide (the running max changes often and most
    probabilities underflow); one thread and two."""
    q, k, v, cu_q, cu_k = make([150, 33], [150, 33], 1, 2, dim, dtype, seed=dim, spread=6.0)
    scale = dim**-0.5
    expected = oracle(q, k, v, cu_q, cu_k, scale)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            check(ext.flash_attention(q, k, v, cu_q, cu_k, scale), expected, dtype)
    finally:
        torch.set_num_threads(threads)


def test_out_argument_and_validation(ext) -> None:
    q, k, v, cu_q, cu_k = make([9, 4], [9, 4], 2, 2, 64, torch.float32)
    out = torch.full((13, 4, 64), float("nan"))
    assert ext.flash_attention(q, k, v, cu_q, cu_k, 0.125, out=out) is out
    check(out, oracle(q, k, v, cu_q, cu_k, 0.125), torch.float32)
    with pytest.raises(RuntimeError, match="needs causal"):
        ext.flash_attention(q, k, v, cu_q, cu_k, 0.125, window=4)
    with pytest.raises(RuntimeError, match="end at the token counts"):
        ext.flash_attention(q, k, v, cu_seqlens([9, 3]), cu_k, 0.125)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        ext.flash_attention(q[:, :3], k, v, cu_q, cu_k, 0.125)
    with pytest.raises(RuntimeError, match="impl must be"):
        ext.flash_attention(q, k, v, cu_q, cu_k, 0.125, impl=4)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.flash_attention(q[..., :60], k[..., :60], v[..., :60], cu_q, cu_k, 0.125)
    assert "avx" in ext.build_info()


@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 3)])
def test_torch_reference_matches_oracle(causal: bool, window: int) -> None:
    """The fallback used where the extension does not build states the same contract."""
    q, k, v, cu_q, cu_k = make(CAUSAL_Q, CAUSAL_K, 2, 2, 16, torch.float32, seed=3)
    out = flash_attention_reference(q, k, v, cu_q, cu_k, scale=0.25, causal=causal, window=window)
    check(out, oracle(q, k, v, cu_q, cu_k, 0.25, causal=causal, window=window), torch.float32)


def test_segment_attention_runs_the_kernel_in_bf16(ext) -> None:
    """The Qwen towers' window / frame attention: in bf16 one kernel call over all segments (equal-length
    runs and lone segments alike), close to fp32 SDPA on the same inputs; fp32 keeps SDPA (exact)."""
    lengths = [64, 64, 32, 64, 16, 48, 64]
    groups = group_segments(lengths)
    indexes = [group.index for group in groups]
    n, heads, dim = sum(lengths), 4, 80
    qkv = torch.randn(n, 3, heads, dim, generator=torch.Generator().manual_seed(7)).bfloat16()
    q, k, v = qkv.unbind(1)
    out = segment_attention(q, k, v, groups, indexes, dim**-0.5)
    bounds = cu_seqlens(lengths)
    assert torch.equal(out, ext.flash_attention(q, k, v, bounds, bounds, dim**-0.5).view(n, heads * dim))
    exact = segment_attention(q.float(), k.float(), v.float(), groups, indexes, dim**-0.5)
    check(out.view(n, heads, dim), exact.double().view(n, heads, dim), torch.bfloat16)


def test_siglip_attention_leaves_padded_keys_out(ext, monkeypatch: pytest.MonkeyPatch) -> None:
    """SigLIP (head dim 72) over two images, the second with padded patches (not a prefix in raster
    order): the kernel's bf16 output against the SDPA path with the boolean key mask."""
    torch.manual_seed(0)
    attention = SiglipAttention(144, 2).bfloat16()
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 36, 144).bfloat16()
    mask = torch.ones(2, 6, 6, dtype=torch.bool)
    mask[1, 4:, :] = False
    mask[1, :, 5:] = False
    key_mask = mask.reshape(2, 1, 1, 36)
    ours = attention(x, key_mask)
    monkeypatch.setattr(siglip, "tower_flash_attention", lambda t: None)
    sdpa = attention(x, key_mask)
    error = (ours.float() - sdpa.float()).norm() / sdpa.float().norm()
    assert error < 1e-2, error.item()
    monkeypatch.setattr(siglip, "tower_flash_attention", lambda t: ext)
    assert torch.equal(attention(x, None), attention(x, torch.ones(2, 1, 1, 36, dtype=torch.bool)))
