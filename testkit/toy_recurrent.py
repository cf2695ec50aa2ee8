"""A tiny text model with a linear-recurrence layer, for the engine's generic state-slot tests.

`ToyRecurrentForCausalLM` is Qwen2's decoder (three layers) whose middle layer mixes tokens with a
per-sequence recurrence instead of attention: s_t = decay * s_(t-1) + W_in x_t (fp32 state),
out_t = W_out tanh(s_t) + W_prev x_(t-1) (the previous token's input: a conv window of one, kept
in the model's dtype). Its output depends on every earlier token through a state the engine keeps
in a `StatePool` slot, never in KV pages, so a state that is lost, stale or advanced too far
(prefix hits, preemption, chunking, rejected draft tokens) changes the tokens.

The family is test-only: `register()` adds it to the registry for the running process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlm_engine.cache.state_pool import LayerState
from vlm_engine.models.decoder import CausalLM
from vlm_engine.models.layers import ForwardContext

ARCHITECTURE = "ToyRecurrentForCausalLM"
RECURRENT_LAYER = 1
DECAY = 0.8


class ToyRecurrence(nn.Module):
    """The token mixer of the recurrent layer (in the place of its attention)."""

    def __init__(self, layer_idx: int, hidden: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.w_in = nn.Linear(hidden, hidden, bias=False)
        self.w_prev = nn.Linear(hidden, hidden, bias=False)
        self.w_out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        state = ctx.state
        assert state is not None, "the runner hands a stateful layer its slots"
        pool = state.pools[self.layer_idx]
        assert pool is not None
        recurrent, previous = pool
        drive, carried = self.w_in(x).float(), self.w_prev(x)
        mixed = torch.empty_like(drive)
        row = 0
        for j, n in enumerate(ctx.attn_meta.query_lens_host):
            slot, warm = state.slots_host[j], state.has_initial_state_host[j]
            s = recurrent[slot].clone() if warm else torch.zeros_like(recurrent[slot])
            prev = previous[slot].clone() if warm else torch.zeros_like(previous[slot])
            for t in range(row, row + n):
                s = DECAY * s + drive[t]
                mixed[t] = torch.tanh(s) + prev.float()
                prev = carried[t]
            recurrent[slot] = s
            previous[slot] = prev
            row += n
        return self.w_out(mixed.to(x.dtype))


class ToyRecurrentForCausalLM(CausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config, config, qkv_bias=True)
        hidden = config.hidden_size
        self.model.layers[RECURRENT_LAYER].self_attn = ToyRecurrence(RECURRENT_LAYER, hidden)
        self.model._has_plans = False  # the recurrent layer has no fused plan: every layer runs as modules
        self.state_layout = tuple(
            LayerState(((hidden,), (hidden,)), (torch.float32, None)) if i == RECURRENT_LAYER else None
            for i in range(config.num_hidden_layers)
        )


def register() -> None:
    """Serve `ARCHITECTURE` from this module in this process."""
    from vlm_engine.models import registry

    registry.ARCHITECTURES[ARCHITECTURE] = "testkit.toy_recurrent"


def _family() -> Any:
    from vlm_engine.models.family import ModelFamily
    from vlm_engine.models.hf_prompts import TokenizerPrompts

    return ModelFamily(
        name="toy-recurrent",
        model_classes={ARCHITECTURE: "testkit.toy_recurrent:ToyRecurrentForCausalLM"},
        prompts=TokenizerPrompts,
    )


FAMILY = _family()


def write_toy_recurrent(path: str | Path, seed: int = 0) -> Path:
    """A random checkpoint (the tiny Qwen2-VL tokenizer's vocabulary, hidden size 64, three
    layers) in Qwen2's names, the recurrent layer's mixer as `self_attn.w_in/w_prev/w_out`."""
    import tempfile

    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from testkit.checkpoints import _build_qwen2_vl_tokenizer, _drop_load_time_kwargs

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vlm_tok_") as staging:
        tokenizer = _build_qwen2_vl_tokenizer(Path(staging))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        architectures=[ARCHITECTURE],
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ToyRecurrentForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.15 if "w_" in name else 0.08)
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    _drop_load_time_kwargs(tokenizer)
    tokenizer.save_pretrained(str(out))
    return out
