"""Fused CPU paged attention vs the pure-torch reference (and the reference vs naive dense attention)."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch

from tests.kernel_builds import require_extension
from vlm_engine.attention import cpu_kernel
from vlm_engine.attention.reference import paged_attention_reference, paged_attention_torch
from vlm_engine.kernels import build
from vlm_engine.kernels.cpu_isa import cpu_flags

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def make_case(q_lens, kv_lens, Hkv, G, D, page_size, dtype, seed=0, interleaved_kv=False, strided_q=False):
    """Random paged batch with scattered (shuffled) page ids and garbage in unused table slots."""
    assert all(kv >= q for q, kv in zip(q_lens, kv_lens))
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B = len(q_lens)
    n_pages = [(kv + page_size - 1) // page_size for kv in kv_lens]
    num_pages = sum(n_pages) + 5
    if interleaved_kv:  # one [num_pages, 2, page_size, Hkv, D] buffer: non-contiguous k/v views
        kv = torch.randn(num_pages, 2, page_size, Hkv, D, generator=g).to(dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(dtype)
        v_cache = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(dtype)
    perm = list(range(num_pages))
    rng.shuffle(perm)
    max_pages = max(n_pages + [1]) + 2
    block_table = torch.zeros(B, max_pages, dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_pages):
        block_table[b, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        block_table[b, n:] = rng.randrange(num_pages)  # unused tail: arbitrary
        i += n
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    if B:
        qsl[1:] = torch.tensor(q_lens).cumsum(0)
    T = int(qsl[-1])
    Hq = Hkv * G
    if strided_q:  # q as a view into a fused qkv projection output
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
        q = qkv[:, : Hq * D].view(T, Hq, D)
    else:
        q = torch.randn(T, Hq, D, generator=g).to(dtype)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_table, seq_lens, qsl


def naive_dense(q, k_cache, v_cache, block_table, seq_lens, qsl, scale):
    """Independent float64 implementation: explicit per-position page lookup, dense softmax."""
    T, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        s, e = int(qsl[b]), int(qsl[b + 1])
        L = int(seq_lens[b])
        if e == s:
            continue
        K = torch.stack([k_cache[int(block_table[b, i // page_size]), i % page_size] for i in range(L)]).double()
        V = torch.stack([v_cache[int(block_table[b, i // page_size]), i % page_size] for i in range(L)]).double()
        for j in range(e - s):
            pos = L - (e - s) + j
            for h in range(Hq):
                kh = K[: pos + 1, h // G]  # [pos+1, D]
                sc = (kh @ q[s + j, h].double()) * scale
                p = torch.softmax(sc, dim=0)
                out[s + j, h] = p @ V[: pos + 1, h // G]
    return out


def check_close(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    else:  # both round an fp32 result to bf16: at most ~1 bf16 ulp apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


@pytest.fixture(scope="module")
def ext():
    # A failed build fails under CI=true and skips elsewhere, with the compiler's errors.
    return require_extension(cpu_kernel.load_extension_module, "the fused CPU paged-attention extension")


@pytest.fixture
def threads():
    """Set torch intra-op threads for a test, restoring afterwards."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def _scenario(name, page_size, rng):
    ps = page_size
    if name == "decode":  # different lengths incl. 1 and exact page multiples
        kv = [1, ps, 2 * ps, 3 * ps + 1, rng.randint(2, 150), rng.randint(150, 300)]
        return [1] * len(kv), kv
    if name == "prefill":  # whole prompts, nothing cached
        q = [rng.randint(2, 60), 2 * ps, 1, rng.randint(30, 90)]
        return q, list(q)
    if name == "mixed":  # decode + prefill chunks with a cached prefix (prefix-cache hit / chunked prefill)
        q = [1, rng.randint(5, 40), 1, 17, ps, 1]
        kv = [rng.randint(50, 200), q[1] + rng.randint(1, 100), 1, 17 + 3 * ps, 2 * ps, ps]
        return q, kv
    raise ValueError(name)


# (page_size, G, D)
CONFIGS = [(16, 3, 64), (16, 1, 64), (7, 4, 128), (16, 4, 128), (7, 3, 64), (13, 1, 128)]


# --------------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 3])
def test_reference_matches_naive_dense(G):
    q_lens, kv_lens = [1, 4, 1, 9, 3], [5, 4, 1, 20, 16]
    args = make_case(q_lens, kv_lens, Hkv=2, G=G, D=16, page_size=4, dtype=torch.float32, seed=G)
    scale = 0.37
    expect = naive_dense(*args, scale)
    ref = paged_attention_reference(*args, scale)
    torch.testing.assert_close(ref.double(), expect, rtol=1e-5, atol=1e-6)
    fast = paged_attention_torch(*args, scale)
    torch.testing.assert_close(fast.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scenario", ["decode", "prefill", "mixed"])
def test_torch_padded_path_matches_reference(scenario):
    rng = random.Random(7)
    q_lens, kv_lens = _scenario(scenario, 16, rng)
    args = make_case(q_lens, kv_lens, Hkv=3, G=3, D=64, page_size=16, dtype=torch.float32, seed=3)
    torch.testing.assert_close(
        paged_attention_torch(*args, 0.125), paged_attention_reference(*args, 0.125), rtol=1e-5, atol=2e-5
    )


# --------------------------------------------------------------------------------------------
# fused op vs reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size,G,D", CONFIGS, ids=[f"ps{p}-G{g}-D{d}" for p, g, d in CONFIGS])
@pytest.mark.parametrize("scenario", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("flash_min", [0, 1, -1], ids=["items", "flash-core", "default"])
def test_op_matches_reference(ext, scenario, page_size, G, D, dtype, flash_min):
    """flash_min: every sequence on the decode-shaped items, every one on the flash core, or the
    default split by query count."""
    rng = random.Random(hash((scenario, page_size, G, D)) & 0xFFFF)
    q_lens, kv_lens = _scenario(scenario, page_size, rng)
    Hkv = 2 if G == 4 else 3
    args = make_case(q_lens, kv_lens, Hkv, G, D, page_size, dtype, seed=rng.randrange(1000))
    scale = 1.0 / math.sqrt(D)
    ref = paged_attention_reference(*args, scale)
    out = ext.paged_attention(*args, scale, flash_min_queries=flash_min)
    check_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", [1, 2, 3], ids=["generic", "avx512-no-dpbf16", "avx2"])
@pytest.mark.parametrize("D", [64, 128, 80])
@pytest.mark.parametrize("flash_min", [0, 1], ids=["items", "flash-core"])
def test_alternative_implementations(ext, impl, D, dtype, flash_min):
    """Every kernel this build has (an impl it lacks falls back to the next one down): on a Zen 4
    build `impl=3` forces the AVX2 kernels that a Zen 3 machine runs by default."""
    rng = random.Random(11)
    q_lens, kv_lens = _scenario("mixed", 16, rng)
    args = make_case(q_lens, kv_lens, 2, 3, D, 16, dtype, seed=5)
    scale = D**-0.5
    out = ext.paged_attention(*args, scale, impl=impl, flash_min_queries=flash_min)
    check_close(out, paged_attention_reference(*args, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [32, 40, 80, 96, 256])
def test_other_head_dims(ext, D, dtype):
    # 40: portable path; 80: odd number of 16-lane vectors (no dpbf16); 32/96/256: other kernels.
    args = make_case([1, 6, 1], [33, 20, 70], 2, 2, D, 16, dtype, seed=D)
    check_close(ext.paged_attention(*args, 0.1), paged_attention_reference(*args, 0.1), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_edge_single_token(ext, dtype):
    args = make_case([1], [1], 3, 3, 64, 16, dtype, seed=1)
    out = ext.paged_attention(*args, 0.125)
    check_close(out, paged_attention_reference(*args, 0.125), dtype)
    # softmax over a single key is exactly that key's value (per GQA group)
    _, _, v_cache, bt, _, _ = args
    v0 = v_cache[int(bt[0, 0]), 0]  # [Hkv, D]
    torch.testing.assert_close(out[0], v0.repeat_interleave(3, dim=0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flash_min", [0, -1], ids=["items", "default"])
def test_long_prefill_with_cached_prefix(ext, dtype, flash_min):
    # q_len in the thousands (many query blocks, causal tiles), plus a decode sequence alongside; by
    # default the long one runs on the flash core, the decode on the items.
    args = make_case([1500, 1], [1800, 700], 2, 3, 64, 16, dtype, seed=2)
    out = ext.paged_attention(*args, 0.125, flash_min_queries=flash_min)
    check_close(out, paged_attention_reference(*args, 0.125), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_few_sequences_split_paths(ext, threads, nthreads, dtype):
    """Few items -> KV-axis split (+ merge), and a per-KV-head split of the items too short for it,
    when running multi-threaded."""
    threads(nthreads)
    # batch-1 and batch-2 long decodes (KV split), five short decodes (head split only), one long
    # and three short ones (both at once), and single-block prefill chunks whose last KV partition
    # may be invisible to the chunk's earlier queries (empty partials in the merge).
    cases = [([1], [3000], 3, 3), ([1, 1], [900, 1200], 3, 3), ([1] * 5, [450, 470, 430, 480, 500], 3, 3)]
    cases += [([1] * 4, [700, 450, 450, 450], 3, 3)]
    cases += [([q], [kv], 1, 1) for q, kv in ((64, 2050), (40, 2333), (63, 2593), (50, 2113), (7, 2401))]
    for i, (q_lens, kv_lens, Hkv, G) in enumerate(cases):
        args = make_case(q_lens, kv_lens, Hkv, G, 64, 16, dtype, seed=100 + i)
        check_close(ext.paged_attention(*args, 0.125), paged_attention_reference(*args, 0.125), dtype)


def test_sweep_kv_lengths_multithreaded(ext, threads):
    threads(2)
    for kv in range(1700, 2700, 53):
        args = make_case([60], [kv], 1, 1, 64, 16, torch.float32, seed=kv)
        check_close(ext.paged_attention(*args, 0.125), paged_attention_reference(*args, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_inputs(ext, dtype):
    # k/v as views of one interleaved buffer, q as a view of a fused qkv projection.
    args = make_case([1, 9, 1], [40, 30, 77], 3, 3, 64, 16, dtype, seed=9, interleaved_kv=True, strided_q=True)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    check_close(ext.paged_attention(*args, 0.125), paged_attention_reference(*args, 0.125), dtype)


def test_concurrent_calls_from_python_threads(ext):
    # The op releases the GIL; concurrent callers must not share scratch state.
    import threading

    cases = [make_case([1] * 8, [50 + 37 * i for i in range(8)], 3, 3, 64, 16, torch.float32, seed=s) for s in range(4)]
    refs = [paged_attention_reference(*c, 0.125) for c in cases]
    errors = []

    def worker(i):
        for _ in range(20):
            out = ext.paged_attention(*cases[i], 0.125)
            if not torch.allclose(out, refs[i], rtol=1e-5, atol=2e-5):
                errors.append(i)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_out_argument_and_uncovered_rows(ext):
    q, k_cache, v_cache, bt, sl, qsl = make_case([2, 1, 3], [5, 9, 3], 3, 3, 64, 16, torch.float32, seed=4)
    # queries 0,1 belong to nobody (qsl[0] = 2): their out rows must stay untouched
    T = q.shape[0]
    q_big = torch.cat([torch.randn(2, *q.shape[1:]), q])
    qsl2 = qsl + 2
    out = torch.full((T + 2, *q.shape[1:]), float("nan"))
    res = ext.paged_attention(q_big, k_cache, v_cache, bt, sl, qsl2, 0.125, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isnan(out[:2]).all()
    ref_out = torch.full_like(out, float("nan"))
    paged_attention_reference(q_big, k_cache, v_cache, bt, sl, qsl2, 0.125, out=ref_out)
    assert torch.isnan(ref_out[:2]).all()
    torch.testing.assert_close(out[2:], ref_out[2:], rtol=1e-5, atol=2e-5)
    # without out=: uncovered rows are zero
    res2 = ext.paged_attention(q_big, k_cache, v_cache, bt, sl, qsl2, 0.125)
    assert (res2[:2] == 0).all()
    torch.testing.assert_close(res2[2:], ref_out[2:], rtol=1e-5, atol=2e-5)


def test_empty_sequences_and_empty_batch(ext):
    # a sequence with no scheduled queries in the middle of the batch
    args = make_case([2, 0, 1], [2, 10, 5], 3, 3, 64, 16, torch.float32, seed=6)
    torch.testing.assert_close(
        ext.paged_attention(*args, 0.125), paged_attention_reference(*args, 0.125), rtol=1e-5, atol=2e-5
    )
    q = torch.empty(0, 9, 64)
    kc = torch.randn(4, 16, 3, 64)
    out = ext.paged_attention(
        q,
        kc,
        kc,
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        0.125,
    )
    assert out.shape == (0, 9, 64)


def test_input_validation(ext):
    q, kc, vc, bt, sl, qsl = make_case([1, 2], [5, 9], 3, 3, 64, 16, torch.float32, seed=8)
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_attention(q, kc, vc, bt.long(), sl, qsl, 0.125)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ext.paged_attention(q.bfloat16(), kc, vc, bt, sl, qsl, 0.125)
    bad_sl = sl.clone()
    bad_sl[1] = 1  # fewer KV tokens than queries
    with pytest.raises(RuntimeError, match="seq_lens"):
        ext.paged_attention(q, kc, vc, bt, bad_sl, qsl, 0.125)
    bad_bt = bt.clone()
    bad_bt[0, 0] = kc.shape[0]  # page id out of range
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_attention(q, kc, vc, bad_bt, sl, qsl, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        ext.paged_attention(q[:, :8], kc, vc, bt, sl, qsl, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy_on_strided_views(ext, dtype):
    from vlm_engine.attention.base import store_kv

    g = torch.Generator().manual_seed(13)
    T, Hkv, D = 37, 3, 64
    qkv = torch.randn(T, (9 + 2 * Hkv) * D, generator=g).to(dtype)  # k/v: strided views, as in the model
    k = qkv[:, 9 * D : (9 + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (9 + Hkv) * D :].view(T, Hkv, D)
    slots = torch.randperm(20 * 16, generator=g)[:T]
    expected = (torch.zeros(20, 16, Hkv, D, dtype=dtype), torch.zeros(20, 16, Hkv, D, dtype=dtype))
    store_kv(k, v, expected, slots)
    k_cache, v_cache = torch.zeros_like(expected[0]), torch.zeros_like(expected[1])
    ext.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
    bad = slots.clone()
    bad[3] = 20 * 16
    with pytest.raises(RuntimeError, match="out of range"):
        ext.store_kv(k, v, k_cache, v_cache, bad)
    with pytest.raises(RuntimeError, match="int64"):
        ext.store_kv(k, v, k_cache, v_cache, slots.int())


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


def test_loader_returns_callable_and_wrapper(ext):
    op = cpu_kernel.load_paged_attention()
    assert op is not None and op is cpu_kernel.load_paged_attention()  # cached
    args = make_case([1, 3], [4, 3], 3, 3, 64, 16, torch.float32, seed=12)
    torch.testing.assert_close(
        cpu_kernel.paged_attention(*args, 0.125), paged_attention_reference(*args, 0.125), rtol=1e-5, atol=2e-5
    )
    info = ext.build_info()
    assert "avx512" in info and "avx2" in info
    flags = cpu_flags()
    if {"avx2", "fma"} <= flags:  # built with -march=native: the AVX2 kernels must be in
        assert "avx2=1" in info


def test_build_failure_returns_none_with_warning(tmp_path, caplog):
    bad = tmp_path / "broken.cpp"
    bad.write_text("#error intentionally broken\n")
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        mod = build.build_extension(name="vlm_engine_pa_broken_test", source=bad, build_dir=tmp_path / "b")
    assert mod is None
    assert any("could not build" in r.getMessage() for r in caplog.records)


def test_an_edited_local_header_changes_the_build_flags(tmp_path):
    """torch's loader rebuilds on a change of the sources' or the flags' hash: the local headers a
    source includes (and theirs) go into the flags, so editing any of them rebuilds."""
    src = tmp_path / "op.cpp"
    src.write_text('#include "a.h"\n#include <vector>\nint f() { return A; }\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n#define A B\n')
    (tmp_path / "b.h").write_text("#define B 1\n")
    assert build.local_headers(src) == [tmp_path / "a.h", tmp_path / "b.h"]
    before = build._headers_flags(src)
    (tmp_path / "b.h").write_text("#define B 2\n")
    assert build._headers_flags(src) != before
    assert build._headers_flags(tmp_path / "b.h") == []  # no local include: no define, flags as before
