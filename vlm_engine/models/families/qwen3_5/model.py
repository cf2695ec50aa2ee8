"""Qwen3.5 (dense, and the MoE text variant): the Qwen-VL shell (models/qwen_vl.py) with Qwen3-VL's vision
tower without DeepStack (models/qwen3_vision.py) and a hybrid decoder: most layers are Gated DeltaNet
linear attention (`linear_attn`: a causal conv window and a recurrent matrix per sequence, kept in state
slots beside the paged KV, run by models/gated_delta.py), the others gated full attention over paged KV
(`self_attn`: a sigmoid output gate read from the query projection, q/k norms, interleaved M-RoPE on the
first `partial_rotary_factor` of each head). Every RMSNorm but the linear layers' gated one stores its
scale as weight - 1 (applied in fp32, as `layers.RMSNorm(unit_offset=True)`).

Parameter names are Transformers' (`model.language_model.layers.N.linear_attn.in_proj_qkv`, ...), so a
checkpoint loads by name; the four input projections of a linear layer and q/k/v of an attention layer
are each one merged linear, filled shard by shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.cache.state_pool import LayerState
from vlm_engine.models import gated_delta
from vlm_engine.models.decoder import CausalLM, head_dim_of, rope_parameters
from vlm_engine.models.layers import ForwardContext, GatedMLP, MergedLinear, RMSNorm, RotaryEmbedding, apply_rotary
from vlm_engine.models.moe import SparseMoE
from vlm_engine.models.qwen3_vision import Qwen3VisionTower
from vlm_engine.models.qwen_vl import QwenVLForConditionalGeneration

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Spans:
    """Sequences of a step that one op runs: `cu_seqlens` over their rows, their state `slots`, and the
    step's `rows` they hold (None: every row of the step, in order)."""

    cu_seqlens: torch.Tensor  # [n + 1] int64
    slots: torch.Tensor  # [n] int64
    rows: torch.Tensor | None

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rows is None else x[self.rows]


@dataclass(frozen=True)
class LinearStep:
    """How a step's sequences run through the linear layers, worked out once a step: the decode tokens
    (one token of a sequence that has a state) take the recurrent rule, as Transformers' cached decode
    does; every other span (a prompt, a prefill chunk, a draft to verify) the chunked rule."""

    decode: Spans | None
    prefill: Spans | None


def linear_step(ctx: ForwardContext) -> LinearStep:
    state, meta = ctx.state, ctx.attn_meta
    if state is None:
        raise RuntimeError("Qwen3.5's linear-attention layers need the step's state slots (ForwardContext.state)")
    lengths = meta.query_lens_host
    decode = [n == 1 and initial for n, initial in zip(lengths, state.has_initial_state_host)]
    slots, device = state.slots.to(torch.long), state.slots.device
    if all(decode):
        return LinearStep(Spans(torch.arange(len(lengths) + 1, device=device), slots, None), None)
    if not any(decode):
        return LinearStep(None, Spans(meta.query_start_loc.to(torch.long), slots, None))
    starts = meta.query_start_loc.tolist()
    prefill = [i for i, d in enumerate(decode) if not d]
    decoding = [i for i, d in enumerate(decode) if d]
    prefill_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in prefill])
    bounds = torch.tensor([0, *[lengths[i] for i in prefill]]).cumsum(0)
    return LinearStep(
        Spans(
            torch.arange(len(decoding) + 1, device=device),
            slots[torch.tensor(decoding, device=device)],
            torch.tensor([starts[i] for i in decoding], device=device),
        ),
        Spans(bounds.to(device), slots[torch.tensor(prefill, device=device)], prefill_rows.to(device)),
    )


def clear_new_slots(ctx: ForwardContext) -> None:
    """Zero the slots of sequences that start from token 0 (their old contents belong to no one)."""
    state = ctx.state
    if state is None or all(state.has_initial_state_host):
        return
    fresh = state.slots[~state.has_initial_state]
    for pools in state.pools:
        for pool in pools or ():
            pool.index_fill_(0, fresh, 0)


class GatedRMSNorm(nn.Module):
    """Transformers' Qwen3_5RMSNormGated: RMSNorm (a plain scale) times SiLU(gate), the gate in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * h.to(dtype)) * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer: x -> (q, k, v | z | b | a) in one product; SiLU(causal conv) over q, k, v
    carrying each sequence's conv window; the gated delta rule over the sequence's recurrent state
    (chunked over prefill spans, recurrent for decode tokens); the gated RMSNorm with z; out_proj.
    `grouped`: the checkpoint stores the projections as Qwen3-Next does, `in_proj_qkvz` and `in_proj_ba`
    with rows grouped by key head (`regroup` puts them in this layer's order as they load)."""

    def __init__(self, layer_idx: int, config: Any, grouped: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        if grouped:
            shards = {"in_proj_qkvz": self.conv_dim + self.value_dim, "in_proj_ba": 2 * self.num_v_heads}
        else:
            shards = {
                "in_proj_qkv": self.conv_dim,
                "in_proj_z": self.value_dim,
                "in_proj_b": self.num_v_heads,
                "in_proj_a": self.num_v_heads,
            }
        self.in_proj = MergedLinear(config.hidden_size, shards, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.kernel_size,
            groups=self.conv_dim,
            padding=self.kernel_size - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    @property
    def state(self) -> LayerState:
        """Per sequence: the last kernel_size - 1 conv inputs (the model's dtype) and the fp32 state."""
        return LayerState(
            shapes=((self.kernel_size - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
            dtypes=(None, torch.float32),
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext, step: LinearStep) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self.in_proj.forward(x).split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        assert ctx.state is not None
        conv_pool, state_pool = ctx.state.pools[self.layer_idx]  # type: ignore[misc]
        weight = self.conv1d.weight.squeeze(1)
        parts = []
        for spans, decoding in ((step.decode, True), (step.prefill, False)):
            if spans is None:
                continue
            conv = gated_delta.causal_conv1d(spans.pick(mixed), weight, conv_pool, spans.slots, spans.cu_seqlens)
            q, k, v = self._heads(conv)
            args = (q, k, v, spans.pick(a), spans.pick(b), self.A_log, self.dt_bias, state_pool, spans.slots)
            if decoding:
                core = gated_delta.gated_delta_decode(*args)
            else:
                core = gated_delta.gated_delta_prefill(*args, spans.cu_seqlens)
            parts.append((spans.rows, core))
        if len(parts) == 1:
            out = parts[0][1]
        else:  # decode tokens beside prefill spans: each op's rows back in the step's order
            out = torch.empty(t, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
            for rows, core in parts:
                out[rows] = core
        normed = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj.forward(normed.view(t, self.value_dim))

    def regroup(self, shard: str, weight: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's `in_proj_qkvz` rows [per key head: q, k, its value heads' v, z] -> [q | k | v | z], and
        `in_proj_ba` rows [per key head: its value heads' b, a] -> [b | a] (Transformers'
        `fix_query_key_value_ordering`)."""
        ratio = self.num_v_heads // self.num_k_heads
        if shard == "in_proj_qkvz":
            sizes = [self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim, ratio * self.head_v_dim]
        else:
            sizes = [ratio, ratio]
        groups = weight.reshape(self.num_k_heads, sum(sizes), -1).split(sizes, dim=1)
        return torch.cat([part.reshape(-1, weight.shape[-1]) for part in groups])

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = conv.shape[0]
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.view(t, self.num_k_heads, self.head_k_dim),
            k.view(t, self.num_k_heads, self.head_k_dim),
            v.view(t, self.num_v_heads, self.head_v_dim),
        )


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] channels of each head; the rest pass."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


class GatedAttention(nn.Module):
    """Full attention over paged KV whose query projection also gives a per-channel output gate:
    q_proj's output is, per head, the query then the gate; the attention output is multiplied by
    sigmoid(gate) before o_proj. q/k unit-offset RMSNorms per head, partial M-RoPE."""

    def __init__(self, layer_idx: int, config: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q_proj": 2 * self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias=bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        query_gate, k, v = self.qkv_proj.forward(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = query_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rotary(self.q_norm.forward(q), cos, sin)
        k = partial_rotary(self.k_norm.forward(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = ctx.attn_backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_meta, self.scale)
        return self.o_proj.forward(out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size)))


class HybridLayer(nn.Module):
    """A pre-norm layer whose token mixer is `linear_attn` (Gated DeltaNet) or `self_attn` (gated attention)."""

    def __init__(self, layer_idx: int, config: Any, mlp: nn.Module, grouped: bool = False) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(layer_idx, config, grouped)
        elif self.layer_type == FULL:
            self.self_attn = GatedAttention(layer_idx, config)
        else:
            raise ValueError(f"unsupported Qwen3.5 layer type {self.layer_type!r}")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext, step: LinearStep | None
    ) -> torch.Tensor:
        h = self.input_layernorm.forward(x)
        if step is not None and self.layer_type == LINEAR:
            h = self.linear_attn.forward(h, ctx, step)
        else:
            h = self.self_attn.forward(h, cos, sin, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm.forward(x))


class HybridDecoder(nn.Module):
    """Token embeddings, the hybrid layers (`config.layer_types`) and the final norm; one rotary table
    over the rotary part of the head for the attention layers (M-RoPE, interleaved, with `mrope_section`;
    1-D without: Qwen3-Next). `grouped`: Qwen3-Next's projections (see `GatedDeltaNet`)."""

    def __init__(self, config: Any, mlp_factory: Any, mrope_section: list[int] | None, grouped: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridLayer(i, config, mlp_factory(i), grouped) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        params = rope_parameters(config)
        rotary_dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
        with torch.device("cpu"):  # real tables even when the weights are built on meta
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponent)
            self.rotary = RotaryEmbedding(
                rotary_dim, config.max_position_embeddings, inv_freq, 1.0, mrope_section, mrope_interleaved=True
            )
        self.has_linear = any(layer.layer_type == LINEAR for layer in self.layers)

    @property
    def state_layout(self) -> tuple[LayerState | None, ...]:
        """Per layer: what it keeps per sequence in the state pool (None: paged KV)."""
        return tuple(layer.linear_attn.state if layer.layer_type == LINEAR else None for layer in self.layers)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.media_features is not None:
            raise NotImplementedError("Qwen3.5 has no per-layer media features")
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        step = None
        if self.has_linear:
            clear_new_slots(ctx)
            step = linear_step(ctx)
        for layer in self.layers:
            hidden = layer.forward(hidden, cos, sin, ctx, step)
        return self.norm.forward(hidden)


class Qwen3_5ForConditionalGeneration(QwenVLForConditionalGeneration):
    def __init__(self, config: Any) -> None:
        text_config = config.text_config
        super().__init__(
            config,
            Qwen3VisionTower,
            default_mrope_section=(11, 11, 10),
            qkv_bias=bool(getattr(text_config, "attention_bias", False)),
            mlp_factory=self._mlp_factory(text_config),
        )

    def build_decoder(
        self, text_config: Any, qkv_bias: bool, mrope_section: list[int] | None, **decoder_options: Any
    ) -> nn.Module:
        assert mrope_section is not None
        return HybridDecoder(text_config, decoder_options["mlp_factory"], mrope_section)

    def _mlp_factory(self, text_config: Any) -> Any:
        return lambda layer: GatedMLP(text_config.hidden_size, text_config.intermediate_size)

    @property
    def state_layout(self) -> tuple[LayerState | None, ...]:
        return self.model.state_layout  # type: ignore[no-any-return]

    def visual_features(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        merged, _ = self.visual(pixels, grid_thw)  # no DeepStack features
        return merged


class SharedExpertMoE(SparseMoE):
    """Qwen3.5-MoE's MLP: the routed experts, each a `GatedMLP` (the releases and Transformers' save store
    them one by one: `mlp.experts.N.gate_proj`, ...), plus a shared expert scaled by
    sigmoid(shared_expert_gate(x)), added in Transformers' order (routed + gated shared)."""

    def __init__(self, config: Any) -> None:
        hidden, size = config.hidden_size, config.moe_intermediate_size
        experts = nn.ModuleList(GatedMLP(hidden, size) for _ in range(config.num_experts))
        normalize = bool(getattr(config, "norm_topk_prob", True))  # Qwen3-Next's option; Qwen3.5 always does
        super().__init__(hidden, size, config.num_experts, config.num_experts_per_tok, experts, normalize)
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        routed = super().forward(x)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    def _mlp_factory(self, text_config: Any) -> Any:
        return lambda layer: SharedExpertMoE(text_config)


def _qwen3_next_mlp(config: Any) -> Any:
    """Qwen3-Next: layer i sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step`."""
    dense = set(config.mlp_only_layers or [])

    def mlp(layer: int) -> nn.Module:
        if layer not in dense and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0:
            return SharedExpertMoE(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    return mlp


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next (text only): the same hybrid stack with 1-D partial RoPE, Qwen3.5-MoE's MLP (sparse
    layers chosen by `decoder_sparse_step` / `mlp_only_layers`, `norm_topk_prob`), and the linear layers'
    projections stored grouped by key head (`GatedDeltaNet.regroup`)."""

    def __init__(self, config: Any) -> None:
        super().__init__(
            config, config, bool(getattr(config, "attention_bias", False)), mlp_factory=_qwen3_next_mlp(config)
        )

    def build_decoder(
        self, text_config: Any, qkv_bias: bool, mrope_section: list[int] | None, **decoder_options: Any
    ) -> nn.Module:
        return HybridDecoder(text_config, decoder_options["mlp_factory"], None, grouped=True)

    @property
    def state_layout(self) -> tuple[LayerState | None, ...]:
        return self.model.state_layout  # type: ignore[no-any-return]

    def adapt_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        path, _, _ = name.rpartition(".")
        owner, _, shard = path.rpartition(".")
        if shard in ("in_proj_qkvz", "in_proj_ba") and owner.endswith(".linear_attn"):
            layer = self.get_submodule(owner)
            assert isinstance(layer, GatedDeltaNet)
            return layer.regroup(shard, tensor)
        return tensor
