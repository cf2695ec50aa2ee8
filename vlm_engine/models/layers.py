"""Decoder building blocks shared by the model families: norms, rotary embeddings, fused linears.

Numerics follow Hugging Face Transformers operation for operation (fp32 norm statistics, the
same rotate-half RoPE) because greedy outputs must match it token for token.

On the decode path submodules are called through `.forward`: the engine registers no hooks, and
nn.Module.__call__'s hook dispatch costs ~1 us a call, ~180 calls a SmolLM2 step. The fused path
goes further: each layer runs as one closure over its kernels and weights (`DecoderLayer.decode_plan`),
built on first use and rebuilt whenever a decoder module has been given a new submodule or tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.attention.base import AttentionBackend, AttentionMetadata, KVCache


@dataclass
class StepState:
    """The fixed-size per-sequence state of a step's sequences (linear-attention layers: a conv
    window and a recurrent matrix), kept in slots of a pool beside the paged KV
    (`vlm_engine.cache.state_pool`).

    `pools[i]` holds layer i's state tensors, each [num_slots, *shape] as the model's
    `state_layout[i]` declares them (None for a layer that keeps paged KV). Sequence j of the step
    (the order of `AttentionMetadata.query_start_loc`) reads and writes slot `slots[j]`; where
    `has_initial_state[j]` is False it starts from zeros (its chunk begins at token 0) and the slot's
    old contents are ignored."""

    pools: list[tuple[torch.Tensor, ...] | None]
    slots: torch.Tensor  # [num_seqs] int64
    has_initial_state: torch.Tensor  # [num_seqs] bool
    slots_host: list[int]
    has_initial_state_host: list[bool]


@dataclass
class ForwardContext:
    """Everything a decoder needs for one step besides the hidden states."""

    attn_meta: AttentionMetadata
    kv_caches: list[KVCache]
    attn_backend: AttentionBackend
    # vlm_engine.models.fused_ops extension (bf16 on CPU); None: plain torch ops
    fused: ModuleType | None = None
    # Per-token media features beyond the input embedding (DeepStack: one hidden-sized block per early
    # decoder layer, added to that layer's output): the step's rows that carry them and their values.
    media_rows: torch.Tensor | None = None
    media_features: torch.Tensor | None = None
    # Linear-attention layers' per-sequence state (None: the model keeps only paged KV).
    state: StepState | None = None


RowsFn = Callable[[torch.Tensor], torch.Tensor]
# A fused decoder layer: (normed input, residual updated in place, cos, sin, ctx) -> MLP output.
LayerPlan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]

# Bumped whenever a decoder module is given a submodule or a tensor (prepacking and quantization
# replace linears after the model is built): layer plans bound to the old ones are then rebuilt.
_structure_generation = 0


class _DecoderModule(nn.Module):
    """A decoder building block whose attribute assignments invalidate the layer plans."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, (nn.Module, torch.Tensor)):
            global _structure_generation
            _structure_generation += 1
        super().__setattr__(name, value)


def rows_fn(linear: nn.Module) -> RowsFn:
    """`linear` as a function of contiguous [T >= 1, in] rows in its dtype: the packed and quantized
    linears' `rows_fn` binds their kernel and weights (forward's checks and reshapes cost ~1.5 us a
    call, 121 linears a SmolLM2 step); anything else is its forward."""
    bind = getattr(linear, "rows_fn", None)
    return bind() if bind is not None else linear.forward


class RMSNorm(_DecoderModule):
    """RMSNorm with fp32 statistics. Llama's rounds the normalized rows to the model's dtype and then
    multiplies by the weight; with `unit_offset` (Gemma) the weight is stored as scale - 1 and the
    fp32 rows are multiplied by 1 + weight in fp32 before the one rounding."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


class MergedLinear(nn.Linear):
    """One matmul for several projections that read the same input (q/k/v, gate/up).

    `shards` maps a checkpoint projection name to its row range so the loader can copy each
    checkpoint tensor into its slice.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shards[name] = (start, size)
            start += size


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position.

    With `mrope_section` set (Qwen2-VL), positions are [3, T] (temporal, height, width) and the
    frequency bands are split between the three axes: in contiguous sections, or with
    `mrope_interleaved` (Qwen3-VL) frequency j from axis 1 (h) when j % 3 == 1 and j < 3 * section[1],
    from axis 2 (w) when j % 3 == 2 and j < 3 * section[2], else from axis 0 (t).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        mrope_section: list[int] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.mrope_section = mrope_section
        self.axis_of_frequency: torch.Tensor | None = None
        if mrope_section is not None and mrope_interleaved:
            axis = torch.zeros(head_dim // 2, dtype=torch.long, device="cpu")
            axis[1 : 3 * mrope_section[1] : 3] = 1
            axis[2 : 3 * mrope_section[2] : 3] = 2
            self.axis_of_frequency = axis
        self.max_positions = max_positions
        self.inv_freq = inv_freq.float()
        self.attention_scaling = attention_scaling
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        # Plain attributes, not buffers: model.to(bfloat16) must not round the angles.
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]  # [P, D/2]
        self.cos_half = freqs.cos() * self.attention_scaling
        self.sin_half = freqs.sin() * self.attention_scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D] for positions [T] or [3, T]."""
        if positions.dim() == 1:
            cos, sin = self.cos_half[positions], self.sin_half[positions]
        else:
            cos = self._merge_axes(self.cos_half[positions])
            sin = self._merge_axes(self.sin_half[positions])
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)

    def _merge_axes(self, per_axis: torch.Tensor) -> torch.Tensor:
        # per_axis: [3, T, D/2]; band i takes its frequencies from axis i % 3.
        assert self.mrope_section is not None
        if self.axis_of_frequency is not None:
            axis = self.axis_of_frequency.to(per_axis.device)
            return per_axis.gather(0, axis.expand(1, per_axis.shape[1], -1)).squeeze(0)
        bands = per_axis.split(self.mrope_section, dim=-1)
        return torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class Attention(_DecoderModule):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        qk_norm_eps: float | None = None,
        *,
        scale: float | None = None,
        window: int = 0,
        norm_unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Gemma scales by query_pre_attn_scalar ** -0.5, which need not be the head dim's
        self.scale = head_dim**-0.5 if scale is None else scale
        # A sliding-window layer (Gemma 3's local layers): a query at position p sees keys k > p - window;
        # 0 is full attention. The backend applies it (and reads no KV before the window).
        self.window = window
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(
            hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias=qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        # Qwen3, Gemma 3: an RMSNorm over each query and key head before RoPE
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset) if qk_norm_eps is not None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        # One view as [T, heads, D] and one native split: q, k, v come out as strided views of the
        # projection's output (Tensor.split's Python wrapper and three views cost ~6 us a layer).
        heads = self.qkv_proj.forward(x).view(t, -1, self.head_dim)
        q, k, v = heads.split_with_sizes([self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = _head_norm(self.q_norm, q, ctx.fused), _head_norm(self.k_norm, k, ctx.fused)
        if ctx.fused is not None:
            ctx.fused.rotary_(q, k, cos, sin)  # in place, on the views into the qkv output
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attn_backend.forward(
            q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_meta, self.scale, window=self.window
        )
        return self.o_proj.forward(out.reshape(t, self.q_size))


def _head_norm(norm: RMSNorm, heads: torch.Tensor, fused: ModuleType | None) -> torch.Tensor:
    """`norm` over each head of [T, H, D] (a strided view into the qkv output): a new tensor. The
    fused kernel is Llama's norm; a unit-offset (Gemma) norm runs as its module."""
    if fused is None or norm.unit_offset:
        return norm(heads)
    t, h, d = heads.shape
    return fused.rms_norm(heads.reshape(t * h, d), norm.weight, norm.eps).view(t, h, d)


# Gated MLP activations by their Transformers names (`hidden_act` / `hidden_activation`)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),  # Gemma
}


class GatedMLP(_DecoderModule):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}; known: {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        if fused is not None:  # x: [T, hidden] rows; the fused decoder runs this in its layer plans
            return self.down_proj.forward(self.gated_rows_fn(fused)(x))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def gated_rows_fn(self, fused: ModuleType) -> RowsFn:
        """act(gate) * up of the gate/up projection, as a function of rows (see `forward`): SiLU in
        the fused kernels; another activation as torch ops on the bound projection's output."""
        if self.activation != "silu":
            gate_up, act, n = rows_fn(self.gate_up_proj), self.act, self.intermediate_size

            def gated(x: torch.Tensor) -> torch.Tensor:
                gate, up = gate_up(x).split(n, dim=-1)
                return act(gate) * up

            return gated
        bind = getattr(self.gate_up_proj, "silu_and_mul_rows_fn", None)
        if bind is not None:
            return bind(fused)
        gate_up, silu_and_mul = rows_fn(self.gate_up_proj), fused.silu_and_mul
        return lambda x: silu_and_mul(gate_up(x))


class DecoderLayer(_DecoderModule):
    """A pre-norm decoder layer. With `sandwich_norms` (Gemma 2/3) the attention and MLP outputs are
    normed too before they join the residual (`post_attention_layernorm`, `post_feedforward_layernorm`)
    and the MLP reads `pre_feedforward_layernorm` of it; such a layer has no fused plan (the plans'
    residual-stream form folds each add into Llama's norm) and runs as its modules, the fused ops
    that are exact for it (rotary, the bound linears) included."""

    def __init__(
        self,
        attention: Attention,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        *,
        sandwich_norms: bool = False,
        norm_unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, norm_unit_offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, norm_unit_offset) if sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, norm_unit_offset) if sandwich_norms else None
        self._plan: LayerPlan | None = None
        self._plan_key: tuple[int, ModuleType] | None = None

    @property
    def has_plan(self) -> bool:
        """Whether `decode_plan` applies (Llama's norms, pre-norm only)."""
        return self.pre_feedforward_layernorm is None and not self.input_layernorm.unit_offset

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, ctx)
            x = x + self.post_attention_layernorm.forward(h)
            h = self.pre_feedforward_layernorm.forward(x)
            h = self.mlp.forward(h, ctx.fused) if isinstance(self.mlp, GatedMLP) else self.mlp(h)
            return x + self.post_feedforward_layernorm.forward(h)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_plan(self, fused: ModuleType) -> LayerPlan:
        """The fused forward (residual-stream form) of this layer as one closure: `normed` is
        input_layernorm(residual); `residual` is updated in place; it returns the MLP output, which
        the caller adds into `residual` with the next norm. Arithmetic as the modules' own forwards;
        the bound kernels and weights skip ~12 module calls and attribute lookups a layer (~0.4 ms
        of a batch-1 SmolLM2 step on the 2-core Zen 4)."""
        key = (_structure_generation, fused)
        if self._plan is None or self._plan_key != key:
            self._plan, self._plan_key = self._build_plan(fused), key
        return self._plan

    def _build_plan(self, fused: ModuleType) -> LayerPlan:
        if not self.has_plan:
            raise ValueError("a layer with sandwich or unit-offset norms runs as its modules: it has no fused plan")
        attn, post_norm = self.self_attn, self.post_attention_layernorm
        qkv, o_proj = rows_fn(attn.qkv_proj), rows_fn(attn.o_proj)
        mlp = self.mlp
        if isinstance(mlp, GatedMLP):
            gated, down = mlp.gated_rows_fn(fused), rows_fn(mlp.down_proj)
            mlp_rows: RowsFn = lambda x: down(gated(x))
        else:  # another MLP (a sparse mixture of experts) runs as its own forward
            mlp_rows = mlp.forward
        rotary, add_rms_norm = fused.rotary_, fused.add_rms_norm_
        heads = [attn.num_heads, attn.num_kv_heads, attn.num_kv_heads]
        head_dim, q_size, scale, layer_idx, window = attn.head_dim, attn.q_size, attn.scale, attn.layer_idx, attn.window
        norm_weight, eps = post_norm.weight, post_norm.eps
        q_norm, k_norm = attn.q_norm, attn.k_norm

        def run(
            normed: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
        ) -> torch.Tensor:
            t = normed.shape[0]
            q, k, v = qkv(normed).view(t, -1, head_dim).split_with_sizes(heads, 1)
            if q_norm is not None and k_norm is not None:
                q, k = _head_norm(q_norm, q, fused), _head_norm(k_norm, k, fused)
            rotary(q, k, cos, sin)  # in place, on the views into the qkv output
            out = ctx.attn_backend.forward(q, k, v, ctx.kv_caches[layer_idx], ctx.attn_meta, scale, window=window)
            x = o_proj(out.reshape(t, q_size))
            add_rms_norm(x, residual, norm_weight, eps)
            return mlp_rows(x)

        return run
