"""The Llama-style decoder that families compose: token embeddings, pre-norm layers over paged KV
(merged QKV and gate/up linears, RMSNorm, rotate-half RoPE or M-RoPE), the final norm and the LM
head. Llama, Mistral and Qwen2 are it as it is; Qwen2-VL and placard-default put media in front;
Qwen3 adds q/k norms (`qk_norm`), Qwen3-VL interleaved M-RoPE and DeepStack media features, its MoE
variant a sparse MLP (`mlp_factory`); Gemma 3 unit-offset and sandwich norms, a GELU MLP, its own
attention scale, sliding-window layers and a rotary table per layer type (`DecoderOptions`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlm_engine.models.layers import Attention, DecoderLayer, ForwardContext, GatedMLP, RMSNorm, RotaryEmbedding


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE parameters; with `layer_type`, that layer type's own (Gemma 3 keeps one set
    per layer type: its local layers' base frequency, its global layers' theta and scaling)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params if layer_type is None else params[layer_type])
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config: Any, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and output scaling, delegating scaled variants to Transformers' formulas."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    dim = head_dim_of(config)
    if rope_type in ("default", "mrope", "axial"):
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        return 1.0 / (params["rope_theta"] ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if layer_type is None:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    return inv_freq, float(scaling)


@dataclass(frozen=True)
class DecoderOptions:
    """Gemma-style variations of the decoder layers (the defaults are Llama's).

    - `norm_unit_offset`: RMSNorm weights stored as scale - 1, applied in fp32 (`layers.RMSNorm`);
    - `sandwich_norms`: attention and MLP outputs normed before the residual add, a pre-MLP norm;
    - `mlp_activation`: the gated MLP's activation (`layers.ACTIVATIONS`);
    - `attention_scale`: the score scale when it is not head_dim ** -0.5;
    - `attention_windows`: each layer's sliding window, 0 = full attention (None: all full);
    - `layer_types`: each layer's type when the rotary table is chosen per type (the config's
      `rope_parameters[type]`), None: one table from the config's own parameters.
    """

    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    attention_scale: float | None = None
    attention_windows: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None


# (layer index) -> the layer's MLP; default: the dense GatedMLP of the config's intermediate_size
MLPFactory = Callable[[int], nn.Module]


class DecoderModel(nn.Module):
    """Token embeddings, the decoder stack and the final norm.

    DeepStack (Qwen3-VL): when the step carries media features (`ForwardContext.media_rows` /
    `media_features`, k hidden-sized blocks a row), block i is added to the output of layer i at
    those rows, for i < k, as Transformers' `_deepstack_process` does.

    With `options.layer_types` each layer reads the rotary table of its type (computed once a step
    per type), and layers without a fused plan (`DecoderLayer.has_plan`) run as their modules in
    both numerics."""

    def __init__(
        self,
        config: Any,
        qkv_bias: bool,
        mrope_section: list[int] | None = None,
        *,
        qk_norm: bool = False,
        mrope_interleaved: bool = False,
        mlp_factory: MLPFactory | None = None,
        options: DecoderOptions = DecoderOptions(),
    ) -> None:
        super().__init__()
        dim = head_dim_of(config)
        windows = options.attention_windows or (0,) * config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                Attention(
                    i,
                    config.hidden_size,
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    dim,
                    qkv_bias,
                    config.rms_norm_eps if qk_norm else None,
                    scale=options.attention_scale,
                    window=windows[i],
                    norm_unit_offset=options.norm_unit_offset,
                ),
                mlp_factory(i)
                if mlp_factory is not None
                else GatedMLP(config.hidden_size, config.intermediate_size, options.mlp_activation),
                config.hidden_size,
                config.rms_norm_eps,
                sandwich_norms=options.sandwich_norms,
                norm_unit_offset=options.norm_unit_offset,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_unit_offset)
        # The norm that follows each layer's output (the next layer's input norm, then the final
        # one): the fused forward's residual add goes into it. A tuple, so not registered twice.
        self._norms_after = tuple(layer.input_layernorm for layer in self.layers[1:]) + (self.norm,)
        self._has_plans = all(layer.has_plan for layer in self.layers)
        with torch.device("cpu"):  # real tables even when the weights are built on meta
            if options.layer_types is None:
                inv_freq, scaling = rope_inv_freq(config)
                self.rotary = RotaryEmbedding(
                    dim, config.max_position_embeddings, inv_freq, scaling, mrope_section, mrope_interleaved
                )
                self.layer_rotary: tuple[int, ...] | None = None
            else:  # one table per layer type; layer i reads rotaries[layer_rotary[i]]
                types = sorted(set(options.layer_types))
                self.rotaries = nn.ModuleList(
                    RotaryEmbedding(dim, config.max_position_embeddings, *rope_inv_freq(config, t)) for t in types
                )
                self.layer_rotary = tuple(types.index(t) for t in options.layer_types)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.layer_rotary is not None or not self._has_plans:
            return self._forward_modules(hidden, positions, ctx)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        if ctx.media_features is not None:
            return self._forward_deepstack(hidden, cos, sin, ctx)
        if ctx.fused is not None:
            return self._forward_fused(hidden, cos, sin, ctx)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, ctx)
        return self.norm(hidden)

    def _forward_modules(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Each layer as its modules, with its type's rotary table (the fused ops it can use are
        chosen inside: rotary in place, bound linears)."""
        if ctx.media_features is not None:
            raise NotImplementedError("per-layer media features need the plain rotary and fused plans")
        if self.layer_rotary is None:
            tables = [self.rotary.cos_sin(positions, hidden.dtype)]
            which: tuple[int, ...] = (0,) * len(self.layers)
        else:
            tables = [rotary.cos_sin(positions, hidden.dtype) for rotary in self.rotaries]
            which = self.layer_rotary
        for layer, index in zip(self.layers, which):
            cos, sin = tables[index]
            hidden = layer.forward(hidden, cos, sin, ctx)
        return self.norm.forward(hidden)

    def _forward_deepstack(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The forward of a step whose media rows carry per-layer features (prefill chunks only)."""
        rows, features = ctx.media_rows, ctx.media_features
        assert rows is not None and features is not None
        blocks = features.to(hidden.dtype).split(hidden.shape[1], dim=1)
        if ctx.fused is None:
            for i, layer in enumerate(self.layers):
                hidden = layer(hidden, cos, sin, ctx)
                if i < len(blocks):
                    hidden[rows] += blocks[i]
            return self.norm(hidden)
        fused = ctx.fused
        residual = hidden
        first_norm = self.layers[0].input_layernorm
        x = fused.rms_norm(residual, first_norm.weight, first_norm.eps)
        for i, (layer, next_norm) in enumerate(zip(self.layers, self._norms_after)):
            x = layer.decode_plan(fused)(x, residual, cos, sin, ctx)
            if i < len(blocks):
                residual.add_(x)
                residual[rows] += blocks[i]
                x = fused.rms_norm(residual, next_norm.weight, next_norm.eps)
            else:
                fused.add_rms_norm_(x, residual, next_norm.weight, next_norm.eps)
        return x

    def _forward_fused(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Same arithmetic with each residual add fused into the norm that follows it."""
        fused = ctx.fused
        assert fused is not None
        residual = hidden  # the step's own embedding output: safe to update in place
        first_norm = self.layers[0].input_layernorm
        x = fused.rms_norm(residual, first_norm.weight, first_norm.eps)
        for layer, next_norm in zip(self.layers, self._norms_after):
            x = layer.decode_plan(fused)(x, residual, cos, sin, ctx)
            fused.add_rms_norm_(x, residual, next_norm.weight, next_norm.eps)
        return x


class CausalLM(nn.Module):
    """A decoder with its LM head: the model side of a family (`vlm_engine.models.family.VLModel`).

    `text_config` is the decoder's config (a VLM's `text_config`, a text model's own config); the
    runner reads the KV layout, the vocabulary and the rotary axes from here, never from HF config.
    """

    # checkpoint name prefixes -> ours (Transformers' own names for the text stack)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        config: Any,
        text_config: Any,
        qkv_bias: bool,
        mrope_section: list[int] | None = None,
        **decoder_options: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.text_config = text_config
        self.model = self.build_decoder(text_config, qkv_bias, mrope_section, **decoder_options)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        # A VLM's own flag decides, as in Transformers (Qwen3-VL-MoE's text config defaults to tied while the
        # model is not); a text model's config is its text config.
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.position_axes = 3 if mrope_section else 1  # M-RoPE: (t, h, w) positions per token
        self.vocab_size = int(text_config.vocab_size)

    def build_decoder(
        self, text_config: Any, qkv_bias: bool, mrope_section: list[int] | None, **decoder_options: Any
    ) -> nn.Module:
        """The decoder stack under `model`; a family whose layers are not `DecoderLayer`s (Qwen3.5's
        linear-attention layers) returns its own, with the same `embed_tokens` / `layers` / `norm` names."""
        return DecoderModel(text_config, qkv_bias, mrope_section, **decoder_options)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of the paged KV cache this decoder reads."""
        config = self.text_config
        return config.num_hidden_layers, config.num_key_value_heads, head_dim_of(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(hidden, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def encode_media(self, inputs: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} takes no media")
