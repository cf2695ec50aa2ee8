"""Pure-torch paged attention: the reference (and fallback) for the fused CPU op.

Contract (shared with ``cpu_kernel.load_paged_attention()``)::

    paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None)

    q:               [T, Hq, D]  queries of all scheduled tokens, sequences concatenated
    k_cache/v_cache: [num_pages, page_size, Hkv, D]  (one layer), already holding this step's keys/values
    block_table:     [B, max_pages_per_seq] int32  page ids of sequence b in order
    seq_lens:        [B] int32  KV length of sequence b INCLUDING this step's tokens
    query_start_loc: [B+1] int32  sequence b's queries are q[qsl[b]:qsl[b+1]]
    scale:           softmax scale
    out:             optional [T, Hq, D] written in place

KV position i of sequence b lives at ``k_cache[block_table[b, i // page_size], i % page_size]``.
Sequence b has ``q_len = qsl[b+1] - qsl[b]`` queries; its query j sits at absolute position
``seq_lens[b] - q_len + j`` and attends to KV positions ``0 ..= that position`` (causal with the
cached prefix in front).  GQA: query head h uses KV head ``h // (Hq // Hkv)``.  float32 or bfloat16
inputs; computation in float32, result in the input dtype.  Rows of ``q`` not covered by any
sequence are left untouched in ``out`` (zero if ``out`` is not given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gather_kv", "paged_attention_reference", "paged_attention_torch"]


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """KV rows ``0..seq_len-1`` of one sequence: ``[seq_len, Hkv, D]``."""
    page_size = cache.shape[1]
    n_pages = (seq_len + page_size - 1) // page_size
    pages = block_table_row[:n_pages].long()
    return cache[pages].reshape(n_pages * page_size, *cache.shape[2:])[:seq_len]


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
) -> torch.Tensor:
    """Clearly-correct reference: per sequence, gather its KV, SDPA with an explicit causal mask."""
    T, Hq, _ = q.shape
    Hkv = k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
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
        k = gather_kv(k_cache, block_table[b], kv_len).float()  # [L, Hkv, D]
        v = gather_kv(v_cache, block_table[b], kv_len).float()
        k = k.repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(G, dim=1).transpose(0, 1)
        qb = q[s:e].float().transpose(0, 1)  # [Hq, q_len, D]
        q_pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)  # absolute query positions
        kv_pos = torch.arange(kv_len).unsqueeze(0)
        mask = kv_pos <= q_pos  # [q_len, L], True = attend
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
) -> torch.Tensor:
    """Vectorised torch path: pad every sequence to the longest, one gather, one batched SDPA.

    GQA is folded into query rows (``[B, Hkv, q_len*G, D]``) so KV is never repeated.  Good for
    decode batches (no per-sequence Python loop); memory is O(B * max_q * G * max_kv) for the mask,
    so long prefills should use :func:`paged_attention_reference` (or SDPA per sequence) instead.
    """
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    B = seq_lens.shape[0]
    if B == 0:
        return _prepare_out(q, out, True)
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    kv_lens = seq_lens.long()
    max_q = int(q_lens.max())
    max_kv = int(kv_lens.max())
    covered = int(qsl[0]) == 0 and int(qsl[-1]) == T
    out = _prepare_out(q, out, covered)
    if max_q == 0:
        return out
    dev = q.device
    compute_dtype = torch.float32

    # KV gather: [B, max_kv] flat slot ids -> [B, max_kv, Hkv, D]
    kv_pos = torch.arange(max_kv, device=dev)
    n_pages_needed = (max_kv + page_size - 1) // page_size
    bt = block_table[:, :n_pages_needed].long()
    page_idx = (kv_pos // page_size).clamp(max=bt.shape[1] - 1)
    slots = bt[:, page_idx] * page_size + (kv_pos % page_size)  # [B, max_kv]
    kv_valid = kv_pos.unsqueeze(0) < kv_lens.unsqueeze(1)
    slots = torch.where(kv_valid, slots, torch.zeros_like(slots))
    k_flat = k_cache.reshape(num_pages * page_size, Hkv, D)
    v_flat = v_cache.reshape(num_pages * page_size, Hkv, D)
    flat_idx = slots.reshape(-1)
    k = k_flat.index_select(0, flat_idx).view(B, max_kv, Hkv, D).to(compute_dtype).permute(0, 2, 1, 3)
    v = v_flat.index_select(0, flat_idx).view(B, max_kv, Hkv, D).to(compute_dtype).permute(0, 2, 1, 3)

    # Query gather: [B, max_q] token ids (padded rows point at token 0 and are discarded).
    qi = torch.arange(max_q, device=dev)
    q_valid = qi.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
    tok = torch.where(q_valid, qsl[:-1].unsqueeze(1) + qi.unsqueeze(0), torch.zeros_like(q_valid, dtype=torch.long))
    qb = q.index_select(0, tok.reshape(-1)).view(B, max_q, Hq, D).to(compute_dtype)
    qb = qb.view(B, max_q, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, max_q * G, D)

    # Mask [B, 1, max_q*G, max_kv]: query j of seq b sits at kv_len - q_len + j.
    q_pos = (kv_lens - q_lens).unsqueeze(1) + qi.unsqueeze(0)  # [B, max_q]
    mask = kv_pos.view(1, 1, max_kv) <= q_pos.unsqueeze(2)  # [B, max_q, max_kv]
    mask = mask & kv_valid.unsqueeze(1)
    mask[:, :, 0] |= ~q_valid  # padded query rows: attend to something (avoid NaN); discarded
    mask = mask.unsqueeze(2).expand(B, max_q, G, max_kv).reshape(B, 1, max_q * G, max_kv)

    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, max_q*G, D]
    o = o.view(B, Hkv, max_q, G, D).permute(0, 2, 1, 3, 4).reshape(B, max_q, Hq, D)
    if bool(q_valid.all()):
        out[tok.view(-1)] = o.reshape(B * max_q, Hq, D).to(out.dtype)
    else:
        out[tok[q_valid]] = o[q_valid].to(out.dtype)
    return out
