"""Weight loading: Hugging Face safetensors directories and GGUF files into our modules."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlm_engine.models.layers import MergedLinear

logger = logging.getLogger(__name__)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy checkpoint tensors into `model`, filling fused projections shard by shard; returns the
    checkpoint names that went nowhere (logged: the weight-name tests require none).

    Raises if any parameter is left unset, so a naming mismatch can never run on random weights.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_targets = _shard_targets(model)
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    # A family whose checkpoints store a tensor in another layout than its module converts it here.
    adapt = getattr(model, "adapt_checkpoint_tensor", None)
    tied = {name for name, p in params.items() if any(p is q and name != n for n, q in params.items())}
    loaded: set[str] = set()
    unused: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            if adapt is not None:
                tensor = adapt(name, tensor)
            if name in params:
                _copy(params[name], tensor, name)
                loaded.add(name)
                continue
            module_path, _, param_name = name.rpartition(".")
            target = shard_targets.get(module_path)
            if target is None:
                unused.append(name)
                continue
            fused_name, module, shard = target
            start, size = module.shards[shard]
            _copy(getattr(module, param_name).narrow(0, start, size), tensor, name)
            loaded.add(f"{fused_name}.{param_name}:{shard}")
    missing = []
    for name, param in params.items():
        if name in loaded:
            continue
        module_path, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_path)
        if isinstance(module, MergedLinear):
            missing += [f"{name}:{s}" for s in module.shards if f"{name}:{s}" not in loaded]
        elif name in tied and any(other in loaded for other in tied if params[other] is param):
            continue
        else:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    if unused:
        logger.warning("%d checkpoint tensors match no parameter, e.g. %s", len(unused), unused[:5])
    return unused


def _shard_targets(model: nn.Module) -> dict[str, tuple[str, MergedLinear, str]]:
    """Checkpoint module path (e.g. '...self_attn.q_proj') -> (fused module path, module, shard)."""
    targets = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shards:
                targets[f"{parent}.{shard}"] = (path, module, shard)
    return targets


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src)


# ---- GGUF --------------------------------------------------------------------------------------

_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


@functools.lru_cache(maxsize=2)
def gguf_reader(path: Path) -> Any:
    """Parsing a GGUF header takes seconds (every vocabulary string); config and weights share one."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def gguf_field(reader: object, key: str, default: object = None) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return default if field is None else field.contents()


def gguf_llama_config(path: Path) -> object:
    """A Transformers LlamaConfig built from a GGUF file's metadata."""
    from transformers import LlamaConfig

    reader = gguf_reader(path)
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (only llama)")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(gguf_field(reader, "llama.attention.head_count"))
    config = LlamaConfig(
        vocab_size=int(gguf_field(reader, "llama.vocab_size", embd.shape[-1])),
        hidden_size=int(gguf_field(reader, "llama.embedding_length")),
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(gguf_field(reader, "llama.attention.head_count_kv", heads)),
        max_position_embeddings=int(gguf_field(reader, "llama.context_length", 4096)),
        rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": float(gguf_field(reader, "llama.rope.freq_base", 1e4))},
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        architectures=["LlamaForCausalLM"],
    )
    return config


def iter_gguf(path: Path, config: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized tensors under Transformers' names, with llama.cpp's q/k row order undone."""
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    kv_heads = config.num_key_value_heads  # type: ignore[attr-defined]
    for tensor in reader.tensors:
        name = _gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("ignoring GGUF tensor %s", tensor.name)
            continue
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if ".q_proj." in name:
            array = _unpermute_rope_rows(array, heads)
        elif ".k_proj." in name:
            array = _unpermute_rope_rows(array, kv_heads)
        yield name, torch.from_numpy(np.array(array, copy=True))


def _gguf_to_hf_name(name: str) -> str | None:
    for pattern, replacement in _GGUF_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary pairs; Transformers' rotate-half wants them split.
    dim = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
