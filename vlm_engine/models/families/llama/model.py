"""Llama-architecture text models (Llama, SmolLM2, Mistral, Qwen2): the shared decoder as it is."""

from __future__ import annotations

from typing import Any

from vlm_engine.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: Any, qkv_bias: bool | None = None) -> None:
        if qkv_bias is None:
            qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, config, qkv_bias)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config, qkv_bias=True)
