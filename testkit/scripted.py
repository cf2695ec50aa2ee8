"""A tiny Qwen2 checkpoint whose greedy output is a fixed script (a Hermes-style tool call).

Random-weight checkpoints (see `checkpoints`) test numerics, but their output is noise, so
they cannot test what happens *after* generation: tool-call parsing, streaming of tool-call
deltas, finish reasons. This module writes a real `Qwen2ForCausalLM` checkpoint (safetensors,
config.json, generation_config.json, tokenizer files with a tool-aware chat template) whose
weights are set by hand so that, after any prompt, decoding emits `script` and then the EOS
token `<|im_end|>`. By default the script is a Qwen2.5 / Hermes tool call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

How the weights encode the script (a bigram model):
  * The script is cut at `<tool_call>` / `</tool_call>` into pieces; each piece is one token
    (the markers and every other piece, e.g. "\\n{...json...}\\n", are added, non-special
    tokens, so detokenizing with skip_special_tokens=True keeps them). The chain
    t_1 -> ... -> t_n -> <|im_end|> must use distinct ids, because a bigram model gives one
    token a single successor.
  * Attention and MLP weights are all zero, so each position's final hidden state is
    RMSNorm(its own embedding): the next token depends only on the current token.
  * Embeddings: t_i is the one-hot e_i (i = 1..n); every other token is e_0 ("not in the
    script"). lm_head row of t_1 is LOGIT_SCALE * e_0 and row of t_{i+1} (t_{n+1} = EOS) is
    LOGIT_SCALE * e_i; all other rows are zero. After RMSNorm (weight 1) the hidden state is
    sqrt(hidden_size) * e_i, so the successor's logit is LOGIT_SCALE * sqrt(hidden_size)
    (= 32) and every other logit is 0: greedy decoding follows the chain, and even sampling at
    temperature 1 leaves it with probability below 1e-10 per step.
  * Any prompt ending in a non-script token (e.g. the "\\n" after `<|im_start|>assistant`)
    therefore starts the script. No random numbers are drawn; the files are identical on
    every machine for a given transformers release.

Public API:
    TOOL_CALL_SCRIPT: str                       default script (without EOS)
    tool_call_script(name, arguments) -> str    the script for another call
    write_scripted_qwen2(path, script=TOOL_CALL_SCRIPT) -> Path
    cached_scripted_qwen2(cache_root=None) -> Path
    SCRIPTED_CHAT_TEMPLATE: str                 ChatML template with Qwen2.5-style tools
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

from testkit.checkpoints import _build_qwen2_vl_tokenizer, _drop_load_time_kwargs, cached_checkpoint

# Bump whenever the files written here change (checkpoints.BUILDER_VERSION covers that module).
SCRIPTED_BUILDER_VERSION = "1"

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
EOS_TOKEN = "<|im_end|>"

# Logit of the scripted successor is LOGIT_SCALE * sqrt(hidden_size); all others are 0.
LOGIT_SCALE = 4.0
MIN_HIDDEN_SIZE = 64


def tool_call_script(name: str, arguments: dict[str, Any]) -> str:
    """Text of one Hermes/Qwen2.5 tool call, exactly as the chat template renders one."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"


TOOL_CALL_SCRIPT: str = tool_call_script("get_weather", {"city": "Paris", "unit": "celsius"})

# Written from scratch; renders like Qwen2.5-Instruct's template: ChatML framing, the tool
# signatures as JSON lines inside <tools></tools> in the system turn, assistant tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, and consecutive `tool` messages as
# <tool_response> blocks inside one user turn. `arguments` may be a dict or a JSON string.
SCRIPTED_CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}{%- if 'text' in part -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- render_content(messages[0]['content']) -}}"
    "{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " ~ 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '"
    " ~ 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " ~ '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' ~ render_content(messages[0]['content']) ~ '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if loop.first and role == 'system' -%}"
    "{#- rendered above -#}"
    "{%- elif role == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ render_content(message['content']) ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif role == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- set text = render_content(message.get('content')) -%}"
    "{%- if text -%}{{- '\\n' ~ text -}}{%- endif -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set call = tool_call['function'] if 'function' in tool_call else tool_call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' ~ call['name'] ~ '\", \"arguments\": ' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}"
    "{%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ role ~ '\\n' ~ render_content(message.get('content')) ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def script_pieces(script: str) -> list[str]:
    """Split `script` into the token strings it is emitted as (tool-call markers kept apart)."""
    if not script:
        raise ValueError("the script must not be empty")
    markers = f"({re.escape(TOOL_CALL_START)}|{re.escape(TOOL_CALL_END)})"
    pieces = [p for p in re.split(markers, script) if p]
    repeated = sorted({p for p in pieces if pieces.count(p) > 1})
    if repeated:
        raise ValueError(f"a bigram script cannot repeat a piece; repeated: {repeated}")
    if EOS_TOKEN in script:
        raise ValueError(f"the script must not contain {EOS_TOKEN!r}; it is appended automatically")
    return pieces


def _scripted_weights(
    vocab_size: int, hidden_size: int, chain: list[int], eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: F821
    """Embedding and lm_head matrices that make token chain[i] predict chain[i+1] (last -> EOS)."""
    import torch

    embed = torch.zeros(vocab_size, hidden_size)
    embed[:, 0] = 1.0  # every token outside the script: "start the script"
    lm_head = torch.zeros(vocab_size, hidden_size)
    for dim, token_id in enumerate(chain, start=1):
        embed[token_id] = 0.0
        embed[token_id, dim] = 1.0
    successors = chain + [eos_id]
    for dim, token_id in enumerate(successors):  # dim 0 (outside) -> chain[0], dim i -> successor of chain[i-1]
        lm_head[token_id, dim] = LOGIT_SCALE
    return embed, lm_head


def write_scripted_qwen2(path: str | Path, script: str = TOOL_CALL_SCRIPT) -> Path:
    """Write a Qwen2ForCausalLM checkpoint into `path` whose greedy output is `script` + EOS."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    pieces = script_pieces(script)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="vlm_tok_") as staging:
        tokenizer = _build_qwen2_vl_tokenizer(Path(staging))
    vocab = tokenizer.get_vocab()
    new_tokens = list(dict.fromkeys(t for t in (TOOL_CALL_START, TOOL_CALL_END, *pieces) if t not in vocab))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in new_tokens])
    tokenizer.chat_template = SCRIPTED_CHAT_TEMPLATE
    chain = [tokenizer.convert_tokens_to_ids(p) for p in pieces]
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    vocab_size = len(tokenizer)
    # One-hot dims: 0 for "outside the script" plus one per piece; whole heads of 32.
    hidden_size = max(MIN_HIDDEN_SIZE, 32 * math.ceil((len(chain) + 1) / 32))
    embed, lm_head = _scripted_weights(vocab_size, hidden_size, chain, eos_id)
    save_embedding_only_qwen2(out, tokenizer, embed, lm_head, eos_id, pad_id)

    # The saved tokenizer must reproduce the chain exactly (added tokens survived the round trip).
    reloaded = AutoTokenizer.from_pretrained(str(out))
    ids = reloaded(script, add_special_tokens=False)["input_ids"]
    if ids != chain or reloaded.decode(chain + [eos_id], skip_special_tokens=True) != script:
        raise RuntimeError(f"scripted tokenizer does not round-trip the script: {ids} != {chain}")
    return out


def save_embedding_only_qwen2(
    out: Path, tokenizer: Any, embed: torch.Tensor, lm_head: torch.Tensor, eos_id: int, pad_id: int  # noqa: F821
) -> None:
    """Save a one-layer Qwen2ForCausalLM whose attention and MLP are zero and norms one, so each
    position's output is `lm_head @ RMSNorm(embed[token])`: the next token depends on the current
    one only. No random numbers reach the files."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab_size, hidden_size = embed.shape
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        architectures=["Qwen2ForCausalLM"],
    )
    with torch.random.fork_rng(devices=[]):  # construction draws (then discarded) random init
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm scales 1; attention, MLP (and biases) 0, so the residual stream is the embedding.
            param.fill_(1.0 if "norm" in name else 0.0)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
    model.config.dtype = "float32"
    model.generation_config = GenerationConfig(
        do_sample=False, bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    _drop_load_time_kwargs(tokenizer)
    tokenizer.save_pretrained(str(out))


def cached_scripted_qwen2(cache_root: Path | None = None) -> Path:
    """Cached `write_scripted_qwen2` checkpoint with the default `TOOL_CALL_SCRIPT`."""
    return cached_checkpoint(
        f"scripted-qwen2-tool-call-s{SCRIPTED_BUILDER_VERSION}", write_scripted_qwen2, cache_root
    )
