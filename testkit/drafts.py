"""Checkpoints for speculative-decoding tests: random draft models and bigram models whose
next-token distribution is set by hand.

- `write_random_llama(path, vocab_size, seed)`: a tiny random `LlamaForCausalLM` (config and
  safetensors only: a draft model needs no tokenizer) with a target's vocabulary.
- `write_bigram_qwen2(path, logits)`: a `Qwen2ForCausalLM` with the tiny Qwen2-VL tokenizer
  whose next token depends only on the current one. Attention and MLP weights are zero, so each
  position's final hidden state is RMSNorm(its embedding). Token `BIGRAM_TOKENS[i]` embeds as the
  one-hot e_(i+1) and every other token as e_0; the LM head then gives, after token i, logit
  `logits[i][j] + BIGRAM_OFFSET` to token j (row `logits[m]` is used after any other token) and
  0 to every token outside the set, whose probability is then below 1e-9 in all. The exact
  distributions come from Transformers' forward on the same files (`bigram_distribution`).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

# Token ids that take part (ordinary BPE tokens of the tiny Qwen2-VL vocabulary).
BIGRAM_TOKENS: tuple[int, ...] = (300, 301, 302, 303)
BIGRAM_OFFSET = 30.0
_HIDDEN = 64


def write_random_llama(path: str | Path, vocab_size: int, seed: int = 0, hidden_size: int = 64) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype=torch.float32)
    model.config.dtype = "float32"
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def write_bigram_qwen2(path: str | Path, logits: list[list[float]]) -> Path:
    """`logits` has len(BIGRAM_TOKENS) + 1 rows (after each set token, then after any other) of
    len(BIGRAM_TOKENS) values."""
    import torch

    from testkit.checkpoints import _build_qwen2_vl_tokenizer
    from testkit.scripted import save_embedding_only_qwen2

    m = len(BIGRAM_TOKENS)
    if len(logits) != m + 1 or any(len(row) != m for row in logits):
        raise ValueError(f"need {m + 1} rows of {m} logits")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vlm_tok_") as staging:
        tokenizer = _build_qwen2_vl_tokenizer(Path(staging))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = len(tokenizer)
    embed = torch.zeros(vocab_size, _HIDDEN)
    embed[:, 0] = 1.0
    lm_head = torch.zeros(vocab_size, _HIDDEN)
    scale = 1.0 / math.sqrt(_HIDDEN)  # RMSNorm makes a one-hot embedding sqrt(hidden) long
    for i, token in enumerate(BIGRAM_TOKENS):
        embed[token] = 0.0
        embed[token, i + 1] = 1.0
    for j, token in enumerate(BIGRAM_TOKENS):
        for i in range(m):
            lm_head[token, i + 1] = (logits[i][j] + BIGRAM_OFFSET) * scale
        lm_head[token, 0] = (logits[m][j] + BIGRAM_OFFSET) * scale
    save_embedding_only_qwen2(out, tokenizer, embed, lm_head, eos_id, pad_id)
    return out


def bigram_distribution(path: str | Path) -> dict[int, list[float]]:
    """Next-token probabilities over BIGRAM_TOKENS after each of them, from Transformers' forward."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([[t] for t in BIGRAM_TOKENS])
    with torch.no_grad():
        probs = model(input_ids=ids).logits[:, -1].float().softmax(-1)
    return {t: probs[i, list(BIGRAM_TOKENS)].tolist() for i, t in enumerate(BIGRAM_TOKENS)}
