"""Gated DeltaNet kernels (Qwen3.5 / Qwen3-Next linear attention) over a per-sequence state pool.

Three ops, each over a packed batch: the tokens of B sequences one after another ([T, ...]),
`cu_seqlens` (int64 [B + 1], span s is tokens cu_seqlens[s]:cu_seqlens[s+1]) and `slots` (int64
[B], sequence s's row in the pools). Each op reads its sequences' state from the pool, carries it
through the span and writes it back in place, so a prompt cut into prefill chunks anywhere gives
the output and final state of one span (to fp32 rounding: chunks of 64 start at each span's start).

- `causal_conv1d(x, weight, conv_pool, slots, cu_seqlens, bias=None)`: the depthwise causal conv
  over x [T, C] with SiLU, as the model applies it to `in_proj_qkv`'s output. `weight` is
  `conv1d.weight.squeeze(1)` [C, K]; `conv_pool` [slots, K - 1, C] (x's dtype) holds each
  sequence's last K - 1 inputs. Decode is a span of one token per sequence.
- `gated_delta_prefill(q, k, v, a, b, A_log, dt_bias, state_pool, slots, cu_seqlens)`: the chunked
  gated delta rule. q, k [T, Hk, Dk] and v [T, Hv, Dv] (views of the conv output are fine: the
  token stride is free); a, b [T, Hv] are `in_proj_a` / `in_proj_b`'s outputs: inside, as
  Transformers, g = -exp(A_log) * softplus(a + dt_bias) in fp32 and beta = sigmoid(b) in the
  inputs' dtype; q and k are L2-normalised (`use_qk_l2norm_in_kernel=True`) and q scaled by
  Dk^-1/2; value head h reads key head h // (Hv // Hk). `state_pool` is fp32 [slots, Hv, Dk, Dv].
  Returns the core attention output [T, Hv, Dv] in the inputs' dtype (before the gated RMSNorm).
- `gated_delta_decode(q, k, v, a, b, A_log, dt_bias, state_pool, slots)`: the recurrent rule,
  one token per sequence (T == B).

- `gated_rms_norm(x, gate, weight, eps)`: Qwen3.5's gated RMSNorm over the rule's output, per head
  row: x, gate [T, H, D] (the z projection viewed as heads; strided views are fine), weight [D].

A slot must hold zeros when its sequence starts (the pool owner clears it at admission: `pool[slot] = 0`).
Inputs are fp32 or bf16 (one dtype for all activations); the states of the gated rule stay fp32.

The C++ ops (csrc/gated_delta.cpp, built on first use) run where they build; elsewhere, or with
VLM_ENGINE_DISABLE_CPU_KERNEL set, the torch implementations below run, with the same signatures.
"""

from __future__ import annotations

import functools
import itertools
import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

EXT_NAME = "vlm_engine_gated_delta"
_SRC = Path(__file__).resolve().parent / "csrc" / "gated_delta.cpp"
CHUNK = 64  # Transformers' chunk_size; the C++ op chunks the same way


@functools.cache
def load_gated_delta_ops() -> ModuleType | None:
    """The C++ extension, or None where it is disabled or does not build (the torch ops then run)."""
    from vlm_engine.kernels.build import build_extension, cpu_kernels_disabled

    if cpu_kernels_disabled():
        logger.info("gated delta C++ ops disabled by VLM_ENGINE_DISABLE_CPU_KERNEL")
        return None
    return build_extension(EXT_NAME, _SRC)


def _ops(x: torch.Tensor) -> ModuleType | None:
    return load_gated_delta_ops() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv1d(x)) over packed spans; each span's window in `conv_pool` is carried in and out."""
    ops = _ops(x)
    if ops is not None:
        return ops.causal_conv1d(x, weight, bias, conv_pool, slots, cu_seqlens, True)
    return torch_causal_conv1d(x, weight, conv_pool, slots, cu_seqlens, bias)


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The chunked gated delta rule over packed spans (see the module docstring); returns [T, Hv, Dv]."""
    ops = _ops(v)
    if ops is not None:
        return ops.gated_delta_prefill(q, k, v, a, b, A_log, dt_bias, state_pool, slots, cu_seqlens)
    return torch_gated_delta_prefill(q, k, v, a, b, A_log, dt_bias, state_pool, slots, cu_seqlens)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One recurrent step per sequence (token s uses slot slots[s]); returns [B, Hv, Dv]."""
    ops = _ops(v)
    if ops is not None:
        return ops.gated_delta_decode(q, k, v, a, b, A_log, dt_bias, state_pool, slots)
    return torch_gated_delta_decode(q, k, v, a, b, A_log, dt_bias, state_pool, slots)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * SiLU(gate) per head row, rounded as Transformers' Qwen3_5RMSNormGated; [T, H, D]."""
    ops = _ops(x)
    if ops is not None:
        return ops.gated_rms_norm(x, gate, weight, eps)
    return torch_gated_rms_norm(x, gate, weight, eps)


# ---------------------------------------------------------------------------------------------
# Torch implementations: the fallback, with the C++ ops' signatures and numerics.


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(itertools.pairwise(bounds))


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    window = weight.shape[1] - 1
    out = torch.empty_like(x)
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist(), strict=True):
        if start == end:  # nothing to convolve; the window stays
            continue
        # [C, window + L]: the carried window, then the span (Transformers' causal_conv1d_update).
        full = torch.cat([conv_pool[slot], x[start:end]], dim=0).t().unsqueeze(0)
        y = F.conv1d(full, weight.unsqueeze(1), bias, groups=weight.shape[0])  # fp32 or bf16 as the model's
        out[start:end] = F.silu(y)[0].t()
        conv_pool[slot] = full[0, :, full.shape[-1] - window :].t()
    return out


def _gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """g (log decay) and beta as Transformers' Qwen3_5GatedDeltaNet computes them, both returned in fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def _heads_fp32(q: torch.Tensor, k: torch.Tensor, v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k in fp32, L2-normalised (eps 1e-6), q scaled by Dk^-1/2, key heads repeated for each value head."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = v_heads // q.shape[1]
    return q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)


def _delta_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], S [H, Dk, Dv] -> (o, S')."""
    G = g.cumsum(-1)
    pair = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()  # e^(G_i - G_j) for j <= i, else 0
    w = beta.unsqueeze(-1) * (v - G.exp().unsqueeze(-1) * (k @ S))
    system = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * pair).tril(-1)
    eye = torch.eye(q.shape[1], dtype=q.dtype)
    u = torch.linalg.solve_triangular(eye + system, w, upper=False, unitriangular=True)
    o = G.exp().unsqueeze(-1) * (q @ S) + ((q @ k.transpose(-1, -2)) * pair) @ u
    tail = (G[:, -1:] - G).exp().unsqueeze(-1)
    S = S * G[:, -1].exp()[:, None, None] + (k * tail).transpose(-1, -2) @ u
    return o, S


def torch_gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    g, beta = _gating(a, b, A_log, dt_bias)
    qn, kn = _heads_fp32(q, k, v.shape[1])
    vf = v.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist(), strict=True):
        S = state_pool[slot]
        for c in range(start, end, CHUNK):
            span = slice(c, min(end, c + CHUNK))
            heads = [t[span].transpose(0, 1) for t in (qn, kn, vf, g, beta)]
            o, S = _delta_chunk(*heads, S)
            out[span] = o.transpose(0, 1)
        state_pool[slot] = S
    return out.to(v.dtype)


def torch_gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    g, beta = _gating(a, b, A_log, dt_bias)
    qn, kn = _heads_fp32(q, k, v.shape[1])
    S = state_pool[slots] * g.exp()[..., None, None]  # [B, Hv, Dk, Dv]
    delta = (v.float() - (kn.unsqueeze(-1) * S).sum(-2)) * beta.unsqueeze(-1)
    S = S + kn.unsqueeze(-1) * delta.unsqueeze(-2)
    state_pool[slots] = S
    return (qn.unsqueeze(-1) * S).sum(-2).to(v.dtype)


def torch_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * h.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)
