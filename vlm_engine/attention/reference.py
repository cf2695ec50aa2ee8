"""Pure-torch paged attention: the reference (and fallback) for the fused CPU op.

Contract (shared with ``cpu_kernel.load_paged_attention()``)::

    paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None,
                    *, window=0, kv_end=None)

    q:               [T, Hq, D]  queries of all scheduled tokens, sequences concatenated
    k_cache/v_cache: [num_pages, page_size, Hkv, D]  (one layer), already holding this step's keys/values
    block_table:     [B, max_pages_per_seq] int32  page ids of sequence b in order
    seq_lens:        [B] int32  KV length of sequence b INCLUDING this step's tokens
    query_start_loc: [B+1] int32  sequence b's queries are q[qsl[b]:qsl[b+1]]
    scale:           softmax scale
    out:             optional [T, Hq, D] written in place
    window:          0, or a sliding-window layer's window (see below)
    kv_end:          None, or [T] int32: the exclusive end of each query token's visible KV range

KV position i of sequence b lives at ``k_cache[block_table[b, i // page_size], i % page_size]``.
Sequence b has ``q_len = qsl[b+1] - qsl[b]`` queries; its query j (token t = qsl[b] + j) sits at
absolute position ``p = seq_lens[b] - q_len + j`` and attends to the KV positions k with
``lo <= k < hi``:

    hi = kv_end[t] if kv_end is given (p + 1 <= kv_end[t] <= seq_lens[b]) else p + 1
    lo = max(0, p - window + 1) if window > 0 else 0

Defaults give causal attention with the cached prefix in front.  ``kv_end`` lets a token see past
its own position (the tokens of one image attend to each other both ways); ``window`` limits how
far back it sees.  A token always sees its own position, so no row is empty.  Block-table entries
of pages that lie wholly below the lowest ``lo`` of a sequence's queries may be stale (the pool
took those pages back; they may hold anything, NaN included): implementations never read them.
GQA: query head h uses KV head ``h // (Hq // Hkv)``.  float32 or bfloat16 inputs; computation in
float32, result in the input dtype.  Rows of ``q`` not covered by any sequence are left untouched
in ``out`` (zero if ``out`` is not given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gather_kv", "paged_attention_reference", "paged_attention_torch", "query_bounds"]


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, first_page: int = 0) -> torch.Tensor:
    """KV rows ``first_page * page_size .. seq_len-1`` of one sequence: ``[seq_len - first_page * page_size, Hkv, D]``."""
    page_size = cache.shape[1]
    n_pages = (seq_len + page_size - 1) // page_size
    pages = block_table_row[first_page:n_pages].long()
    rows = cache[pages].reshape((n_pages - first_page) * page_size, *cache.shape[2:])
    return rows[: seq_len - first_page * page_size]


def query_bounds(q_pos: torch.Tensor, window: int, kv_end: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of the visible KV range ``[lo, hi)`` of queries at absolute positions ``q_pos`` (int64)."""
    hi = q_pos + 1 if kv_end is None else kv_end.long()
    lo = (q_pos - (window - 1)).clamp(min=0) if window > 0 else torch.zeros_like(q_pos)
    return lo, hi


def _check_mask_args(window: int, kv_end: torch.Tensor | None, T: int) -> None:
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if kv_end is not None and (kv_end.dim() != 1 or kv_end.shape[0] != T):
        raise ValueError(f"kv_end must be a [T={T}] tensor, got shape {tuple(kv_end.shape)}")


def _prepare_out(q: torch.Tensor, out: torch.Tensor | None, covered_all: bool) -> torch.Tensor:
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape/dtype, got {tuple(out.shape)} {out.dtype}")
        return out
    return torch.empty_like(q) if covered_all else torch.zeros_like(q)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int = 0,
    kv_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clearly-correct reference: per sequence, gather its KV (from the first page any of its
    queries sees), SDPA with an explicit mask."""
    T, Hq, _ = q.shape
    Hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    _check_mask_args(window, kv_end, T)
    G = Hq // Hkv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    B = len(lens)
    out = _prepare_out(q, out, B == 0 or (qsl[0] == 0 and qsl[B] == T))
    for b in range(B):
        s, e = qsl[b], qsl[b + 1]
        q_len = e - s
        if q_len <= 0:
            continue
        kv_len = lens[b]
        if kv_len < q_len:
            raise ValueError(f"seq_lens[{b}]={kv_len} < q_len={q_len}")
        q_pos = torch.arange(kv_len - q_len, kv_len)  # absolute query positions
        lo, hi = query_bounds(q_pos, window, None if kv_end is None else kv_end[s:e])
        if kv_end is not None and bool(((hi <= q_pos) | (hi > kv_len)).any()):
            raise ValueError(f"kv_end of sequence {b} outside [position + 1, seq_len={kv_len}]")
        # Pages wholly below every query's window may be stale: not gathered (NaN * 0 is NaN).
        first_page = int(lo.min()) // page_size
        k = gather_kv(k_cache, block_table[b], kv_len, first_page).float()  # [L, Hkv, D]
        v = gather_kv(v_cache, block_table[b], kv_len, first_page).float()
        k = k.repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(G, dim=1).transpose(0, 1)
        qb = q[s:e].float().transpose(0, 1)  # [Hq, q_len, D]
        kv_pos = torch.arange(first_page * page_size, kv_len).unsqueeze(0)
        mask = (kv_pos < hi.unsqueeze(1)) & (kv_pos >= lo.unsqueeze(1))  # [q_len, L], True = attend
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int = 0,
    kv_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Vectorised torch path: pad every sequence to the longest, one gather, one batched SDPA.

    GQA is folded into query rows (``[B, Hkv, q_len*G, D]``) so KV is never repeated.  Good for
    decode batches (no per-sequence Python loop); memory is O(B * max_q * G * max_kv) for the mask,
    so long prefills should use :func:`paged_attention_reference` (or SDPA per sequence) instead.
    With a window, each sequence's KV is gathered from the first page its queries see (``max_kv``
    is then the longest such span, not the longest sequence).
    """
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    B = seq_lens.shape[0]
    _check_mask_args(window, kv_end, T)
    if B == 0:
        return _prepare_out(q, out, True)
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    kv_lens = seq_lens.long()
    max_q = int(q_lens.max())
    covered = int(qsl[0]) == 0 and int(qsl[-1]) == T
    out = _prepare_out(q, out, covered)
    if max_q == 0:
        return out
    dev = q.device
    compute_dtype = torch.float32

    # Query gather: [B, max_q] token ids (padded rows point at token 0 and are discarded).
    qi = torch.arange(max_q, device=dev)
    q_valid = qi.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
    tok = torch.where(q_valid, qsl[:-1].unsqueeze(1) + qi.unsqueeze(0), torch.zeros_like(q_valid, dtype=torch.long))
    qb = q.index_select(0, tok.reshape(-1)).view(B, max_q, Hq, D).to(compute_dtype)
    qb = qb.view(B, max_q, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, max_q * G, D)
    q_pos = (kv_lens - q_lens).unsqueeze(1) + qi.unsqueeze(0)  # [B, max_q]: query j of seq b sits at kv_len - q_len + j
    ends = None if kv_end is None else kv_end.index_select(0, tok.reshape(-1)).view(B, max_q)
    lo, hi = query_bounds(q_pos, window, ends)
    if ends is not None and bool((q_valid & ((hi <= q_pos) | (hi > kv_lens.unsqueeze(1)))).any()):
        raise ValueError("kv_end outside [position + 1, seq_len] for some query")

    # KV gather: [B, max_kv] flat slot ids -> [B, max_kv, Hkv, D], sequence b's row i holding its
    # absolute position base[b] + i (base: the first position of the first page its queries see).
    if window > 0:
        base = lo[:, 0].clamp(max=(kv_lens - 1).clamp(min=0)) // page_size * page_size  # query 0 has the lowest lo
    else:
        base = torch.zeros_like(kv_lens)
    max_kv = int((kv_lens - base).max())
    rel = torch.arange(max_kv, device=dev)
    kv_pos = base.unsqueeze(1) + rel.unsqueeze(0)  # [B, max_kv] absolute positions
    kv_valid = kv_pos < kv_lens.unsqueeze(1)
    page_idx = (kv_pos // page_size).clamp(max=block_table.shape[1] - 1)
    slots = block_table.long().gather(1, page_idx) * page_size + (kv_pos % page_size)  # [B, max_kv]
    slots = torch.where(kv_valid, slots, torch.zeros_like(slots))
    k_flat = k_cache.reshape(num_pages * page_size, Hkv, D)
    v_flat = v_cache.reshape(num_pages * page_size, Hkv, D)
    flat_idx = slots.reshape(-1)
    k = k_flat.index_select(0, flat_idx).view(B, max_kv, Hkv, D).to(compute_dtype)
    v = v_flat.index_select(0, flat_idx).view(B, max_kv, Hkv, D).to(compute_dtype)
    if window > 0:
        # The padding rows read slot 0, which a window pool may have handed back to anyone (NaN
        # included): a masked NaN still poisons SDPA (NaN * 0), so they are zeroed.
        keep = kv_valid.view(B, max_kv, 1, 1)
        k = torch.where(keep, k, 0.0)
        v = torch.where(keep, v, 0.0)
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)

    # Mask [B, 1, max_q*G, max_kv].
    mask = (kv_pos.unsqueeze(1) < hi.unsqueeze(2)) & kv_valid.unsqueeze(1)  # [B, max_q, max_kv]
    if window > 0:
        mask &= kv_pos.unsqueeze(1) >= lo.unsqueeze(2)
    mask[:, :, 0] |= ~q_valid  # padded query rows: attend to something (avoid NaN); discarded
    mask = mask.unsqueeze(2).expand(B, max_q, G, max_kv).reshape(B, 1, max_q * G, max_kv)

    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, max_q*G, D]
    o = o.view(B, Hkv, max_q, G, D).permute(0, 2, 1, 3, 4).reshape(B, max_q, Hq, D)
    if bool(q_valid.all()):
        out[tok.view(-1)] = o.reshape(B * max_q, Hq, D).to(out.dtype)
    else:
        out[tok[q_valid]] = o[q_valid].to(out.dtype)
    return out
