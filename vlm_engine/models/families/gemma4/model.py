"""Gemma 4's decoder over paged KV (Gemma4ForCausalLM, Transformers' names).

Per layer, as Transformers' Gemma4TextDecoderLayer: sandwich norms (plain RMSNorms, weight = scale,
`pow(ms + eps, -0.5)`, scaled in fp32), q/k norms and a scale-free v norm, attention scale 1, a GELU-tanh
gated MLP, then the per-layer input: gate(x) -> GELU * that layer's slice of the per-layer inputs ->
projection -> norm, added to the residual, and the whole layer output times a learned `layer_scalar`.

- Global (full-attention) layers have their own head dim (`per_layer_config`), their rotary table
  is "proportional" (only the first `partial_rotary_factor` of the frequencies turn), and with
  `attention_k_eq_v` they have no v_proj: the keys' projection is the values' too (v_norm'ed apart).
- Per-layer inputs (`hidden_size_per_layer_input`): a token's row of `embed_tokens_per_layer` (one
  slice per layer) plus a normed projection of its input embedding, times 2 ** -0.5. They need the
  token ids: `embed` keeps them for the `forward` that follows it in the same step.
- KV sharing (`num_kv_shared_layers`): the last layers have no k/v projections; each reads the paged
  KV of the last earlier layer of its type and writes none (`kv_sources`), so the runner allocates
  pages for the writing layers only (`runner.model_runner.kv_layer_shapes`).
- Logits are soft-capped (`final_logit_softcapping`): cap * tanh(logits / cap).
- 26B-A4B (`enable_moe_block`): routed experts beside each layer's dense MLP (experts.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vlm_engine.models.decoder import rope_parameters
from vlm_engine.models.families.gemma4.experts import Gemma4Router, run_experts
from vlm_engine.models.families.gemma4.norm import Gemma4RMSNorm
from vlm_engine.models.layers import ACTIVATIONS, ForwardContext, GatedMLP, MergedLinear, RotaryEmbedding, apply_rotary
from vlm_engine.models.moe import SparseExperts

SLIDING, FULL = "sliding_attention", "full_attention"


def kv_sources_of(config: Any) -> tuple[int, ...]:
    """Whose KV each layer reads: its own, or for the last `num_kv_shared_layers` layers the last
    earlier writing layer of the same type (Transformers' `kv_sharing_modes`: "store" -> "reuse")."""
    types, shared = list(config.layer_types), int(config.num_kv_shared_layers or 0)
    first_shared = len(types) - shared
    if shared and first_shared <= 0:
        raise NotImplementedError("Gemma 4 with every layer KV-shared is not supported")
    sources = []
    for i, layer_type in enumerate(types):
        if i < first_shared:
            sources.append(i)
            continue
        writers = [j for j in range(first_shared) if types[j] == layer_type]
        if not writers:
            raise ValueError(f"no layer before {first_shared} writes the {layer_type} KV that layer {i} reads")
        sources.append(writers[-1])
    return tuple(sources)


class Gemma4Attention(nn.Module):
    """q/k/v (one merged matmul; k only with k_eq_v; q alone on a KV-shared layer), q/k norms, a
    scale-free v norm, rotary on q and k, paged attention with scale 1."""

    def __init__(self, config: Any, layer_idx: int, kv_source: int) -> None:
        super().__init__()
        layer_config = config.per_layer_config[layer_idx]
        self.layer_idx = layer_idx
        self.kv_source = kv_source
        self.head_dim = int(layer_config.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(layer_config.num_key_value_heads)
        self.window = int(config.sliding_window) if config.layer_types[layer_idx] == SLIDING else 0
        self.keys_are_values = bool(config.attention_k_eq_v) and self.window == 0
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias, eps = bool(config.attention_bias), config.rms_norm_eps
        shards = {"q_proj": self.q_size}
        if self.writes_kv:
            shards |= (
                {"k_proj": self.kv_size} if self.keys_are_values else {"k_proj": self.kv_size, "v_proj": self.kv_size}
            )
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        # With bidirectional images, Transformers keeps the global layers causal: they ignore `kv_end`.
        self.causal_only = False
        if self.writes_kv:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)

    @property
    def writes_kv(self) -> bool:
        return self.kv_source == self.layer_idx

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        heads = self.qkv_proj(x).view(t, -1, self.head_dim)
        q = apply_rotary(self.q_norm(heads[:, : self.num_heads]), cos, sin)
        k = v = None
        if self.writes_kv:
            k_raw = heads[:, self.num_heads : self.num_heads + self.num_kv_heads]
            v_raw = k_raw if self.keys_are_values else heads[:, self.num_heads + self.num_kv_heads :]
            k = apply_rotary(self.k_norm(k_raw), cos, sin)
            v = self.v_norm(v_raw)
        cache = ctx.kv_caches[self.kv_source]  # a KV-shared layer reads its source's pages, writes none
        meta = ctx.attn_meta
        if self.causal_only and meta.kv_end is not None:
            meta = dataclasses.replace(meta, kv_end=None)
        out = ctx.attn_backend.forward(q, k, v, cache, meta, 1.0, window=self.window)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, kv_source: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, kv_source)
        # The double-wide MLP: twice the intermediate size on the KV-shared layers.
        wide = bool(config.use_double_wide_mlp) and not self.self_attn.writes_kv
        self.mlp = GatedMLP(hidden, config.intermediate_size * (2 if wide else 1), config.hidden_activation)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a checkpoint tensor (Transformers: a buffer)
        per_layer = int(config.hidden_size_per_layer_input or 0)
        self.per_layer_input_gate = nn.Linear(hidden, per_layer, bias=False) if per_layer else None
        self.per_layer_projection = nn.Linear(per_layer, hidden, bias=False) if per_layer else None
        self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps) if per_layer else None
        self.act = ACTIVATIONS[config.hidden_activation]
        # 26B-A4B: a mixture of experts beside the dense MLP, each output normed, their sum the MLP's output.
        self.router: Gemma4Router | None = None
        if getattr(config, "enable_moe_block", False):
            self.router = Gemma4Router(config)
            self.experts = SparseExperts(hidden, int(config.moe_intermediate_size), int(config.num_experts))
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)

    def feed_forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The dense MLP on the pre-normed residual, plus (26B-A4B) the experts, before the post-norm."""
        h = self.mlp(self.pre_feedforward_layernorm(x), ctx.fused)
        if self.router is None:
            return h
        experts = run_experts(self.experts, self.act, self.router(x), self.pre_feedforward_layernorm_2(x))
        return self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(experts)

    def forward(
        self,
        x: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        x = x + self.post_feedforward_layernorm(self.feed_forward(x, ctx))
        if per_layer_input is not None:
            assert self.per_layer_input_gate is not None and self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            h = self.per_layer_projection(self.act(self.per_layer_input_gate(x)) * per_layer_input)
            x = x + self.post_per_layer_input_norm(h)
        return x * self.layer_scalar


def rotary_for(config: Any, layer_type: str) -> RotaryEmbedding:
    """The rotary table of a layer type at that type's head dim: "default" over the whole head, or
    Transformers' "proportional" (its zero frequencies leave the last dims unturned)."""
    layer_config = config.per_layer_config[layer_type]
    dim = int(layer_config.head_dim)
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](layer_config, "cpu", layer_type=layer_type)
    return RotaryEmbedding(dim, config.max_position_embeddings, inv_freq, float(scaling))


class Gemma4TextModel(nn.Module):
    """Embeddings (scaled by sqrt(hidden) in their dtype), the per-layer input tables, the layers and
    the final norm, under Transformers' names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.layer_types = tuple(config.layer_types)
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise NotImplementedError(f"Gemma 4 layer types {sorted(unknown)} are not supported")
        sources = kv_sources_of(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, sources[i]) for i in range(layers))
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.per_layer = int(config.hidden_size_per_layer_input or 0)
        if self.per_layer:
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, layers * self.per_layer)
            self.per_layer_model_projection = nn.Linear(hidden, layers * self.per_layer, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, config.rms_norm_eps)
        self.embed_scale = float(hidden) ** 0.5
        self.per_layer_embed_scale = float(self.per_layer) ** 0.5
        self.projection_scale = float(hidden) ** -0.5
        with torch.device("cpu"):  # real tables even when the weights are built on meta
            self.rotaries = nn.ModuleDict({t: rotary_for(config, t) for t in sorted(set(self.layer_types))})

    def per_layer_inputs(self, embeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[T, layers, per-layer size]: (norm(projection(embeds) / sqrt(hidden)) + the tokens' scaled
        per-layer rows) * 2 ** -0.5, as Transformers' get_ / project_per_layer_inputs."""
        t = embeds.shape[0]
        rows = self.embed_tokens_per_layer(token_ids)
        rows = rows * torch.tensor(self.per_layer_embed_scale, dtype=rows.dtype, device=rows.device)
        projected = self.per_layer_model_projection(embeds) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(t, len(self.layers), self.per_layer))
        return (projected + rows.reshape(t, len(self.layers), self.per_layer)) * 2.0**-0.5

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, token_ids: torch.Tensor
    ) -> torch.Tensor:
        per_layer = self.per_layer_inputs(hidden, token_ids) if self.per_layer else None
        tables = {t: rotary.cos_sin(positions, hidden.dtype) for t, rotary in self.rotaries.items()}
        for i, (layer, layer_type) in enumerate(zip(self.layers, self.layer_types)):
            cos, sin = tables[layer_type]
            hidden = layer(hidden, None if per_layer is None else per_layer[:, i], cos, sin, ctx)
        return self.norm(hidden)


class Gemma4ForCausalLM(nn.Module):
    """The model side (`vlm_engine.models.family.VLModel`) of a Gemma4ForCausalLM checkpoint."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    bidirectional_media = False

    def __init__(self, config: Any, text_config: Any = None) -> None:
        super().__init__()
        text_config = config if text_config is None else text_config
        if getattr(text_config, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError("Gemma 4 with use_bidirectional_attention='all' is not supported")
        self.config, self.text_config = config, text_config
        self.model = Gemma4TextModel(text_config)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = text_config.final_logit_softcapping
        self.position_axes = 1
        self.vocab_size = int(text_config.vocab_size)
        attention = [layer.self_attn for layer in self.model.layers]
        # Read by the runner: windows, each layer's KV shape, and whose KV each layer reads.
        self.attention_windows: tuple[int, ...] = tuple(a.window for a in attention)
        self.kv_shapes: tuple[tuple[int, int], ...] = tuple((a.num_kv_heads, a.head_dim) for a in attention)
        self.kv_sources: tuple[int, ...] = tuple(a.kv_source for a in attention)
        # The widest layer's KV heads and head dim (the protocol's one layout; `kv_shapes` has each layer's).
        widest = max(self.kv_shapes, key=lambda s: s[0] * s[1])
        self.kv_layout: tuple[int, int, int] = (len(attention), *widest)
        self._step_token_ids: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden) rounded to their dtype (Transformers' scaled embedding). The
        ids are kept for this step's `forward`: the per-layer inputs look them up too."""
        self._step_token_ids = input_ids
        embeds = self.model.embed_tokens(input_ids)
        return embeds * torch.tensor(self.model.embed_scale, dtype=embeds.dtype, device=embeds.device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        token_ids, self._step_token_ids = self._step_token_ids, None
        if token_ids is None or token_ids.shape[0] != hidden.shape[0]:
            raise RuntimeError("Gemma 4's forward needs the token ids of this step's embed call")
        return self.model(hidden, positions, ctx, token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def encode_media(self, inputs: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} takes no media")
