"""Attention that is not purely causal: sliding windows (`window`) and per-token KV ends (`kv_end`,
bidirectional spans such as one image's tokens), in the fused C++ op (every impl), both torch
paths and PagedAttentionBackend, against a dense oracle that builds the mask from the contract:

    query token t of sequence b at absolute position p sees the KV positions k with lo <= k < hi,
    hi = kv_end[t] (or p + 1), lo = max(0, p - window + 1) (or 0 without a window).

Block-table entries of pages wholly below a sequence's lowest lo may be stale (NaN pages here):
nothing may read them.
"""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from tests.kernel_builds import require_extension
from vlm_engine.attention import cpu_kernel
from vlm_engine.attention.backends import create_backend
from vlm_engine.attention.base import AttentionMetadata
from vlm_engine.attention.reference import paged_attention_reference, paged_attention_torch

IMPLS = [0, 1, 2, 3]  # best, portable loops, AVX-512 without vdpbf16ps, AVX2 (missing ones fall back)
IMPL_IDS = ["best", "generic", "avx512-no-dpbf16", "avx2"]
# The op's two kernels: its decode-shaped items for every sequence (0), the flash-attention core for
# every sequence (1), and the default split by the sequence's query count (-1).
FLASH_MIN_QUERIES = [0, 1, -1]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]

# --------------------------------------------------------------------------------------------
# the oracle and the cases
# --------------------------------------------------------------------------------------------


def bounds(pos: torch.Tensor, window: int, kv_end: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    hi = pos + 1 if kv_end is None else kv_end.long()
    lo = (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)
    return lo, hi


def dense_oracle(q, k_cache, v_cache, block_table, seq_lens, qsl, scale, window=0, kv_end=None):
    """float64, one sequence at a time: the positions some query sees, looked up one by one through
    the block table, and the explicit [q_len, n] mask of the contract."""
    T, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for b in range(seq_lens.shape[0]):
        s, e, L = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        if e == s:
            continue
        pos = torch.arange(L - (e - s), L)
        lo, hi = bounds(pos, window, None if kv_end is None else kv_end[s:e])
        keys = torch.arange(int(lo.min()), L)
        pages = block_table[b, keys // page_size].long()
        K = k_cache[pages, keys % page_size].double().repeat_interleave(G, dim=1)  # [n, Hq, D]
        V = v_cache[pages, keys % page_size].double().repeat_interleave(G, dim=1)
        mask = (keys.unsqueeze(0) >= lo.unsqueeze(1)) & (keys.unsqueeze(0) < hi.unsqueeze(1))  # [q_len, n]
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), K) * scale
        probs = scores.masked_fill(~mask, -math.inf).softmax(dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, V)
    return out


def make_case(q_lens, kv_lens, Hkv, G, D, page_size, dtype, seed=0):
    """Random paged batch: shuffled page ids, garbage in the unused table tail, spare pages at the end."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B = len(q_lens)
    n_pages = [(kv + page_size - 1) // page_size for kv in kv_lens]
    num_pages = sum(n_pages) + 5
    k_cache = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, Hkv, D, generator=g).to(dtype)
    perm = list(range(num_pages))
    rng.shuffle(perm)
    block_table = torch.zeros(B, max(n_pages + [1]) + 2, dtype=torch.int32)
    i = 0
    for b, n in enumerate(n_pages):
        block_table[b, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        block_table[b, n:] = rng.randrange(num_pages)
        i += n
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(qsl[-1]), Hkv * G, D, generator=g).to(dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(kv_lens, dtype=torch.int32), qsl


def span_kv_end(q_lens, kv_lens, rng, max_span=40):
    """kv_end for bidirectional spans laid over each sequence: a query inside [s, e) sees up to e."""
    ends = []
    for ql, L in zip(q_lens, kv_lens):
        end_of = list(range(1, L + 1))  # causal by default
        p = rng.randrange(0, 4)
        while p < L:
            e = min(L, p + rng.randint(1, max_span))
            for k in range(p, e):
                end_of[k] = e
            p = e + rng.randint(0, 12)
        ends += end_of[L - ql :]
    return torch.tensor(ends, dtype=torch.int32)


def random_kv_end(q_lens, kv_lens, rng):
    """Any end the contract allows, p + 1 <= kv_end <= seq_len, not monotone within a sequence."""
    ends = []
    for ql, L in zip(q_lens, kv_lens):
        ends += [rng.randint(p + 1, L) for p in range(L - ql, L)]
    return torch.tensor(ends, dtype=torch.int32)


def scenario(name, page_size, rng):
    ps = page_size
    if name == "decode":
        kv = [1, ps, 2 * ps + 1, rng.randint(2, 90), rng.randint(90, 200), 64]
        return [1] * len(kv), kv
    if name == "prefill":  # whole prompts
        q = [rng.randint(2, 50), 2 * ps, 1, rng.randint(30, 80)]
        return q, list(q)
    if name == "chunk":  # prefill chunks behind a cached prefix
        q = [rng.randint(5, 40), 17, ps + 3]
        return q, [q[0] + rng.randint(1, 100), 17 + 3 * ps, ps + 3 + rng.randint(20, 70)]
    if name == "mixed":  # decodes beside prefill chunks
        q = [1, rng.randint(5, 40), 1, 17, 1]
        return q, [rng.randint(50, 200), q[1] + rng.randint(1, 100), 1, 17 + 3 * ps, 2 * ps]
    raise ValueError(name)


def windows_for(kv_lens):
    """Smaller than, equal to and larger than the sequences (1: a token sees only itself, or its span)."""
    return [1, 5, 16, 37, max(kv_lens), max(kv_lens) + 50]


def check(out, expect, dtype):
    assert out.dtype == dtype and out.shape == expect.shape
    assert torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=2e-5)
    else:  # an fp32 result rounded to bf16: ~1 bf16 ulp from the exact one
        torch.testing.assert_close(out.float(), expect.float(), rtol=1.6e-2, atol=1e-2)


def make_stale(args, window, seed=0):
    """The same batch with the pages wholly below each sequence's lowest window start handed back
    (their contents overwritten with NaN) and their table entries stale: page 0 or a NaN page."""
    q, k_cache, v_cache, bt, sl, qsl = (t.clone() for t in args)
    page_size = k_cache.shape[1]
    used = {int(bt[b, i]) for b in range(sl.shape[0]) for i in range(-(-int(sl[b]) // page_size))}
    poison = min(set(range(k_cache.shape[0])) - used)  # a spare page
    rng = random.Random(seed)
    n_stale = 0
    for b in range(sl.shape[0]):
        ql = int(qsl[b + 1] - qsl[b])
        if ql == 0:
            continue
        lo = max(0, int(sl[b]) - ql - window + 1)
        for i in range(lo // page_size):
            k_cache[bt[b, i].long()] = math.nan
            v_cache[bt[b, i].long()] = math.nan
            bt[b, i] = rng.choice([0, poison])
            n_stale += 1
    k_cache[poison] = math.nan
    v_cache[poison] = math.nan
    return (q, k_cache, v_cache, bt, sl, qsl), n_stale


@pytest.fixture(scope="module")
def ext():
    return require_extension(cpu_kernel.load_extension_module, "the fused CPU paged-attention extension")


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def op_runs(ext):
    """(name, op) for every kernel the fused op has: each impl, each way of sharing out the sequences."""
    return [
        (f"impl{impl}-flash{f}", partial(ext.paged_attention, impl=impl, flash_min_queries=f))
        for impl in IMPLS
        for f in FLASH_MIN_QUERIES
    ]


def torch_paths():
    return [("reference", paged_attention_reference), ("padded", paged_attention_torch)]


# --------------------------------------------------------------------------------------------
# the oracle itself
# --------------------------------------------------------------------------------------------


def test_oracle_on_hand_checked_masks():
    args = make_case([6], [10], Hkv=1, G=2, D=8, page_size=4, dtype=torch.float32, seed=1)
    _, _, v_cache, bt, _, _ = args
    # causal: the reference's own (unchanged) semantics
    torch.testing.assert_close(dense_oracle(*args, 0.3).float(), paged_attention_reference(*args, 0.3))
    # window 1: every query sees its own position only, so it returns that position's value
    own = torch.stack([v_cache[bt[0, p // 4].long(), p % 4, 0] for p in range(4, 10)]).double()
    torch.testing.assert_close(dense_oracle(*args, 0.3, window=1)[:, 0], own)
    # kv_end = seq_len for all: the last query (p = 9) is unchanged, so is a window-1 one over [p, 10)
    full = torch.full((6,), 10, dtype=torch.int32)
    causal = dense_oracle(*args, 0.3)
    bidir = dense_oracle(*args, 0.3, kv_end=full)
    torch.testing.assert_close(bidir[5], causal[5])
    assert not torch.allclose(bidir[0], causal[0])
    torch.testing.assert_close(dense_oracle(*args, 0.3, window=1, kv_end=full)[5], own[5:6].expand(2, 8))


# --------------------------------------------------------------------------------------------
# torch paths and the fused op against the oracle
# --------------------------------------------------------------------------------------------

GROUPS = [(3, 1), (2, 2), (3, 3), (1, 7)]  # (Hkv, G)
SCENARIOS = ["decode", "prefill", "chunk", "mixed"]


def _cases(scn, page_size, Hkv, G, dtype):
    rng = random.Random(hash((scn, page_size, Hkv, G)) & 0xFFFF)
    q_lens, kv_lens = scenario(scn, page_size, rng)
    args = make_case(q_lens, kv_lens, Hkv, G, 64, page_size, dtype, seed=rng.randrange(1000))
    ends = [None, span_kv_end(q_lens, kv_lens, rng)]
    return args, [(w, e) for w in [0, *windows_for(kv_lens)] for e in ends]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Hkv,G", GROUPS, ids=[f"G{g}" for _, g in GROUPS])
@pytest.mark.parametrize("page_size", [1, 16], ids=["ps1", "ps16"])
@pytest.mark.parametrize("scn", SCENARIOS)
def test_torch_paths_match_oracle(scn, page_size, Hkv, G, dtype):
    args, variants = _cases(scn, page_size, Hkv, G, dtype)
    for window, kv_end in variants:
        expect = dense_oracle(*args, 0.125, window=window, kv_end=kv_end)
        for _, fn in torch_paths():
            check(fn(*args, 0.125, window=window, kv_end=kv_end), expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("Hkv,G", GROUPS, ids=[f"G{g}" for _, g in GROUPS])
@pytest.mark.parametrize("page_size", [1, 16], ids=["ps1", "ps16"])
@pytest.mark.parametrize("scn", SCENARIOS)
def test_op_matches_oracle(ext, scn, page_size, Hkv, G, dtype):
    args, variants = _cases(scn, page_size, Hkv, G, dtype)
    for window, kv_end in variants:
        expect = dense_oracle(*args, 0.125, window=window, kv_end=kv_end)
        for _, op in op_runs(ext):
            check(op(*args, 0.125, window=window, kv_end=kv_end), expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", [32, 40, 80, 128])
def test_other_head_dims(ext, D, dtype):
    # 40: the portable loops only; 80: an odd number of 16-lane vectors; 32 / 128: other kernels.
    rng = random.Random(D)
    q_lens, kv_lens = [1, 9, 1, 30], [40, 33, 70, 30]
    args = make_case(q_lens, kv_lens, 2, 3, D, 16, dtype, seed=D)
    for window, kv_end in [
        (7, None),
        (20, span_kv_end(q_lens, kv_lens, rng)),
        (0, random_kv_end(q_lens, kv_lens, rng)),
    ]:
        expect = dense_oracle(*args, D**-0.5, window=window, kv_end=kv_end)
        for _, op in op_runs(ext):
            check(op(*args, D**-0.5, window=window, kv_end=kv_end), expect, dtype)
        for _, fn in torch_paths():
            check(fn(*args, D**-0.5, window=window, kv_end=kv_end), expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_arbitrary_kv_end(ext, dtype):
    """Ends that are not monotone within a sequence (the contract allows any p + 1 <= end <= seq_len)."""
    rng = random.Random(5)
    q_lens, kv_lens = [23, 1, 64, 9], [23, 50, 140, 80]
    args = make_case(q_lens, kv_lens, 3, 3, 64, 16, dtype, seed=5)
    for window in (0, 3, 40):
        kv_end = random_kv_end(q_lens, kv_lens, rng)
        expect = dense_oracle(*args, 0.125, window=window, kv_end=kv_end)
        for _, op in op_runs(ext):
            check(op(*args, 0.125, window=window, kv_end=kv_end), expect, dtype)
        for _, fn in torch_paths():
            check(fn(*args, 0.125, window=window, kv_end=kv_end), expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_long_sequences_and_kv_split(ext, threads, nthreads, dtype):
    """Few long sequences: multi-threaded, single-block items split over the KV axis (the window's
    range, not the whole sequence) and merged; prefill chunks whose early queries see none of a
    part; long prefills with many query blocks walking only their window's tiles."""
    threads(nthreads)
    rng = random.Random(17)
    cases = [([1], [3000], 3, 3, 1024), ([1, 1], [900, 2200], 3, 3, 512), ([1] * 3, [700, 1500, 400], 3, 3, 300)]
    cases += [([40], [2333], 1, 1, 700), ([63], [2593], 1, 2, 1000), ([7], [2401], 1, 1, 256)]
    cases += [([300, 1], [800, 1200], 2, 3, 100), ([1500], [1500], 1, 1, 512)]
    for i, (q_lens, kv_lens, Hkv, G, window) in enumerate(cases):
        args = make_case(q_lens, kv_lens, Hkv, G, 64, 16, dtype, seed=200 + i)
        for w, kv_end in [
            (window, None),
            (0, span_kv_end(q_lens, kv_lens, rng, 300)),
            (window, span_kv_end(q_lens, kv_lens, rng, 90)),
        ]:
            expect = dense_oracle(*args, 0.125, window=w, kv_end=kv_end)
            for _, op in op_runs(ext):
                check(op(*args, 0.125, window=w, kv_end=kv_end), expect, dtype)
            check(paged_attention_reference(*args, 0.125, window=w, kv_end=kv_end), expect, dtype)


# --------------------------------------------------------------------------------------------
# stale pages, defaults, validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_stale_pages_below_the_window_are_never_read(ext, threads, nthreads, dtype):
    threads(nthreads)
    rng = random.Random(3)
    cases = [([1, 1, 1], [300, 47, 1000], 3, 3, 64), ([20, 1, 33], [100, 500, 290], 2, 2, 50)]
    cases += [([1], [3000], 3, 3, 1024), ([40], [2333], 1, 1, 700), ([5, 9], [5, 200], 1, 7, 16)]
    for i, (q_lens, kv_lens, Hkv, G, window) in enumerate(cases):
        for page_size in (1, 16):
            args = make_case(q_lens, kv_lens, Hkv, G, 64, page_size, dtype, seed=300 + i)
            stale, n_stale = make_stale(args, window, seed=i)
            assert n_stale > 0
            for kv_end in (None, span_kv_end(q_lens, kv_lens, rng)):
                expect = dense_oracle(*args, 0.125, window=window, kv_end=kv_end)
                for name, fn in op_runs(ext) + torch_paths():
                    clean = fn(*args, 0.125, window=window, kv_end=kv_end)
                    dirty = fn(*stale, 0.125, window=window, kv_end=kv_end)
                    assert torch.isfinite(dirty.float()).all(), name
                    assert torch.equal(dirty, clean), name
                    check(clean, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_default_arguments_are_causal_bit_for_bit(ext, threads, dtype):
    """window=0 / kv_end=None spelled out, a window no sequence reaches past, and kv_end = p + 1:
    the causal result, bit for bit (the same tiles, the same sums)."""
    threads(2)
    q_lens, kv_lens = [1, 30, 1, 1], [700, 90, 2500, 33]
    args = make_case(q_lens, kv_lens, 3, 3, 64, 16, dtype, seed=7)
    causal_end = torch.cat([torch.arange(L - ql + 1, L + 1) for ql, L in zip(q_lens, kv_lens)]).int()
    for impl in IMPLS:
        for f in FLASH_MIN_QUERIES:
            base = ext.paged_attention(*args, 0.125, None, impl, flash_min_queries=f)
            op = partial(ext.paged_attention, impl=impl, flash_min_queries=f)
            assert torch.equal(op(*args, 0.125, window=0, kv_end=None), base)
            assert torch.equal(op(*args, 0.125, window=5000), base)
            assert torch.equal(op(*args, 0.125, kv_end=causal_end), base)
    for _, fn in torch_paths():
        base = fn(*args, 0.125)
        assert torch.equal(fn(*args, 0.125, window=5000), base)
        assert torch.equal(fn(*args, 0.125, kv_end=causal_end), base)


def test_input_validation(ext):
    q_lens, kv_lens = [1, 3], [5, 9]
    args = make_case(q_lens, kv_lens, 3, 3, 64, 16, torch.float32, seed=8)
    good = torch.tensor([5, 7, 8, 9], dtype=torch.int32)
    ext.paged_attention(*args, 0.125, kv_end=good)
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_attention(*args, 0.125, kv_end=good.long())
    with pytest.raises(RuntimeError, match="kv_end"):
        ext.paged_attention(*args, 0.125, kv_end=good[:3])
    with pytest.raises(RuntimeError, match="window"):
        ext.paged_attention(*args, 0.125, window=-1)
    for bad_end in ([4, 7, 8, 9], [5, 7, 8, 10], [5, 6, 8, 9]):  # below p + 1, past seq_len
        bad = torch.tensor(bad_end, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="kv_end"):
            ext.paged_attention(*args, 0.125, kv_end=bad)
        for _, fn in torch_paths():
            with pytest.raises(ValueError, match="kv_end"):
                fn(*args, 0.125, kv_end=bad)
    for _, fn in torch_paths():
        with pytest.raises(ValueError, match="window"):
            fn(*args, 0.125, window=-1)


# --------------------------------------------------------------------------------------------
# through the backend: the window layers' own pool and tables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
def test_backend_window_layers_use_their_own_tables(request, backend):
    if backend == "cpu_paged":
        request.getfixturevalue("ext")
    attn = create_backend(backend, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    Hkv, G, D, ps, window = 2, 3, 64, 4, 6
    q_lens, kv_lens = [1, 5, 3], [30, 5, 21]
    B, T = len(q_lens), sum(q_lens)
    rng = random.Random(0)

    def pool_and_table(num_pages, page_lists):
        kc = torch.randn(num_pages, ps, Hkv, D, generator=g)
        vc = torch.randn(num_pages, ps, Hkv, D, generator=g)
        bt = torch.zeros(B, 9, dtype=torch.int32)
        for b, pages in enumerate(page_lists):
            bt[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return (kc, vc), bt

    def slots(bt):
        return torch.tensor(
            [int(bt[b, p // ps]) * ps + p % ps for b in range(B) for p in range(kv_lens[b] - q_lens[b], kv_lens[b])]
        )

    full_pages = [list(range(8)), [8, 9], list(range(10, 16))]
    full_cache, full_bt = pool_and_table(20, full_pages)
    # The window pool: only the pages a window can still see are live; the rest of the table is stale
    # (page 0 / a NaN page) and those pages hold NaN.
    win_pages = [[0, 0, 0, 0, 0, 3, 4, 5], [6, 7], [0, 0, 8, 9, 10, 11]]
    win_cache, win_bt = pool_and_table(13, win_pages)
    win_cache[0][0], win_cache[1][0] = math.nan, math.nan
    win_cache[0][12], win_cache[1][12] = math.nan, math.nan
    win_bt[0, 1] = win_bt[2, 1] = 12
    kv_end = span_kv_end(q_lens, kv_lens, rng, 6)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=full_bt,
        slot_mapping=slots(full_bt),
        query_lens_host=q_lens,
        seq_lens_host=kv_lens,
        kv_end=kv_end,
        window_block_table=win_bt,
        window_slot_mapping=slots(win_bt),
    )
    q = torch.randn(T, Hkv * G, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)

    full_before = tuple(c.clone() for c in full_cache)
    out = attn.forward(q, k, v, win_cache, meta, 0.125, window=window)
    assert torch.isfinite(out).all()
    assert all(torch.equal(a, b) for a, b in zip(full_cache, full_before))  # the full pool untouched
    win_view = win_cache[0].view(-1, Hkv, D)
    assert torch.equal(win_view[meta.window_slot_mapping], k)  # stored through the window slots
    expect = dense_oracle(q, *win_cache, win_bt, meta.seq_lens, meta.query_start_loc, 0.125, window, kv_end)
    check(out, expect, torch.float32)

    # A full-attention layer of the same step: the main pool and table, kv_end still applies.
    out = attn.forward(q, k, v, full_cache, meta, 0.125)
    assert torch.equal(full_cache[1].view(-1, Hkv, D)[meta.slot_mapping], v)
    check(
        out, dense_oracle(q, *full_cache, full_bt, meta.seq_lens, meta.query_start_loc, 0.125, 0, kv_end), torch.float32
    )

    # Without window tables, a window layer stores and reads through the main ones.
    meta.window_block_table = meta.window_slot_mapping = None
    cache = tuple(c.clone() for c in full_before)
    out = attn.forward(q, k, v, cache, meta, 0.125, window=window)
    assert torch.equal(cache[0].view(-1, Hkv, D)[meta.slot_mapping], k)
    check(
        out, dense_oracle(q, *cache, full_bt, meta.seq_lens, meta.query_start_loc, 0.125, window, kv_end), torch.float32
    )
