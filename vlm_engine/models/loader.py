"""Weight loading: Hugging Face safetensors directories and GGUF files into our modules."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlm_engine.models.layers import MergedLinear
from vlm_engine.models.quant_formats import gguf_blocks
from vlm_engine.models.quant_formats.base import CheckpointFormat, GroupedWeights

logger = logging.getLogger(__name__)


# safetensors' dtype names -> torch's (the header's "dtype").
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor not read yet: where its bytes lie in an open file. `read_into` reads them
    straight into the parameter that takes them (no mmap of the file, whose pages would count in the
    process's resident memory, and no second copy of the tensor); `read` gives a tensor of its own."""

    fd: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def read_into(self, dst: torch.Tensor) -> None:
        """dst: contiguous, of this dtype and shape (a row range of a fused weight is)."""
        buffer = memoryview(dst.detach().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(buffer):  # one read returns at most ~2 GiB
            got = os.preadv(self.fd, [buffer[done:]], self.offset + done)
            if got <= 0:
                raise OSError(f"checkpoint file ended {len(buffer) - done} bytes early")
            done += got


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor | StoredTensor]]:
    """(name, tensor) of every *.safetensors file in `model_dir`, one file open at a time: a
    StoredTensor where the dtype is one of `_SAFETENSORS_DTYPES`, else the tensor safetensors reads."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for name in files:
        path = model_dir / name
        with open(path, "rb", buffering=0) as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_size))
            header.pop("__metadata__", None)
            data_start = 8 + header_size
            for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                offset, shape = data_start + entry["data_offsets"][0], tuple(entry["shape"])
                stored = None if dtype is None else StoredTensor(f.fileno(), offset, dtype, shape)
                yield key, _read_with_safetensors(path, key) if stored is None else stored


def _read_with_safetensors(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def safetensors_names(model_dir: Path) -> frozenset[str]:
    """Every tensor name of a safetensors directory, from the index or the files' headers (no data read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return frozenset(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(header_size)) if k != "__metadata__")
    return frozenset(names)


def untie_stored(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Give each tied parameter that the checkpoint (`names`, before the model's renames) stores beside a partner
    a parameter of its own (same shape, dtype and device, unset); returns their names. Transformers 5's loader does
    the same when both copies are present (it re-ties them where their values are equal; we keep them apart, which
    costs the memory of one copy and changes no result): e.g. PaddleOCR-VL's released flat config, which
    Transformers reads as tied, beside a file that stores its own `lm_head.weight`. Call it before the model's
    storage is made and before anything plans by which parameters are tied."""
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    stored = {renamed(name, renames) for name in names}
    kept: dict[int, str] = {}  # id of a tied parameter -> the first stored name that keeps it
    untied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in stored:
            continue
        if id(param) not in kept:
            kept[id(param)] = name
            continue
        module_path, _, param_name = name.rpartition(".")
        own = nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad)
        setattr(model.get_submodule(module_path), param_name, own)
        untied.append(name)
    if untied:
        logger.info("the checkpoint stores tied parameters apart, loaded untied: %s", untied)
    return untied


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name in our modules' names: the first of `renames` (prefix, ours) it starts with applied."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def skips(model: nn.Module) -> Callable[[str], bool]:
    """Whether a checkpoint name (as stored, before the model's renames) lies under one of the model's
    `checkpoint_skipped` prefixes: a part the family does not build, passed over unread."""
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    skipped: tuple[str, ...] = tuple(getattr(model, "checkpoint_skipped", ()))
    return lambda name: bool(skipped) and renamed(name, renames).startswith(skipped)


def grouped_weights(
    weights: Iterable[tuple[str, torch.Tensor | StoredTensor]],
    fmt: CheckpointFormat,
    names: Iterable[str],
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | StoredTensor | GroupedWeights]]:
    """A pre-quantized checkpoint's stream with each quantized linear's components (`fmt.components`) gathered
    into one `(linear + ".weight", GroupedWeights)` as soon as the last of them is read: one linear's codes in
    memory at a time. A linear is quantized where the checkpoint (`names`) holds all its components; every
    other tensor passes as stored, and so does every one that `skip` names (`skips(model)`: load_weights passes
    over it unread and does not count it unused)."""
    stored = frozenset(names)
    quantized: dict[str, bool] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        owner = None if skip is not None and skip(name) else fmt.linear_of(name)
        if owner is None:
            yield name, tensor
            continue
        linear, component = owner
        needed = fmt.components(linear)
        if linear not in quantized:
            quantized[linear] = all(f"{linear}.{c}" in stored for c in needed)
        if not quantized[linear] or component not in needed:
            yield name, tensor
            continue
        parts = pending.setdefault(linear, {})
        parts[component] = tensor.read() if isinstance(tensor, StoredTensor) else tensor
        del tensor
        if len(parts) == len(needed):
            del pending[linear]
            yield f"{linear}.weight", fmt.unpack(linear, parts)
            del parts
    for linear, parts in pending.items():  # a component listed but never streamed: reported as unused
        yield from ((f"{linear}.{component}", tensor) for component, tensor in parts.items())


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | StoredTensor | GroupedWeights]],
    on_filled: Callable[[str], None] | None = None,
    on_grouped: Callable[[str, str | None, GroupedWeights], bool] | None = None,
) -> list[str]:
    """Copy checkpoint tensors into `model`, filling fused projections shard by shard; returns the
    checkpoint names that went nowhere (logged: the weight-name tests require none).

    `on_filled(module_path)` is called for each nn.Linear as soon as all its parameters (every shard
    of a fused one) are filled, unless one of them is tied to another parameter; it may replace the
    module (prepack.LoadTimePacker packs it), and this function then holds no reference to the old one.

    A pre-quantized linear's weight arrives as `GroupedWeights` (`grouped_weights`): `on_grouped(module_path,
    shard, grouped)` may take it (shard: the checkpoint projection of a fused module, else None) and return True;
    otherwise it is dequantized into the parameter (fp32 values, then the parameter's dtype). Either way it
    counts as filled.

    Tensors under the model's `checkpoint_skipped` prefixes (after the renames: parts a family deliberately does not
    build, e.g. Gemma 4's audio tower) are passed over unread and not reported as unused; logged once at INFO.

    Raises if any parameter is left unset, so a naming mismatch can never run on random weights.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_targets = _shard_targets(model)
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    skipped: tuple[str, ...] = tuple(getattr(model, "checkpoint_skipped", ()))
    not_served: dict[str, int] = {}
    # A family whose checkpoints store a tensor in another layout than its module converts it here.
    adapt = getattr(model, "adapt_checkpoint_tensor", None)
    tied = {name for name, p in params.items() if any(p is q and name != n for n, q in params.items())}
    pending = _linear_entries(model, tied) if on_filled is not None else {}
    loaded: set[str] = set()
    unused: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            name = renamed(name, renames)
            if skipped and name.startswith(skipped):  # before `adapt`, which would read it
                prefix = next(p for p in skipped if name.startswith(p))
                not_served[prefix] = not_served.get(prefix, 0) + 1
                continue
            if adapt is not None and isinstance(tensor, GroupedWeights):
                # A layout change works on plain weights: a quantized linear the family changes (probed on a meta
                # tensor: adapters hand back what they leave alone) is dequantized first.
                probe = torch.empty(tensor.shape, device="meta")
                if adapt(name, probe) is not probe:
                    tensor = adapt(name, tensor.dequantize())
            elif adapt is not None:
                tensor = adapt(name, tensor.read() if isinstance(tensor, StoredTensor) else tensor)
            if name in params:
                entry, module_path = name, name.rpartition(".")[0]
                take = None if on_grouped is None else functools.partial(on_grouped, module_path, None)
                _fill(params[name], tensor, name, take)
            else:
                module_path, _, param_name = name.rpartition(".")
                target = shard_targets.get(module_path)
                if target is None:
                    unused.append(name)
                    continue
                fused_name, module, shard = target
                start, size = module.shards[shard]
                take = None if on_grouped is None else functools.partial(on_grouped, fused_name, shard)
                _fill(getattr(module, param_name).narrow(0, start, size), tensor, name, take)
                entry, module_path = f"{fused_name}.{param_name}:{shard}", fused_name
            loaded.add(entry)
            del tensor
            left = pending.get(module_path)
            if left is not None:
                left.discard(entry)
                if not left:
                    del pending[module_path]
                    _forget_module(module_path, params, shard_targets)
                    on_filled(module_path)  # type: ignore[misc]
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
    if not_served:
        _log_not_served(not_served, getattr(model, "checkpoint_skipped_reason", ""))
    if unused:
        logger.warning("%d checkpoint tensors match no parameter, e.g. %s", len(unused), unused[:5])
    return unused


def _log_not_served(counts: dict[str, int], reason: str) -> None:
    by_prefix = ", ".join(f"{n} under {prefix!r}" for prefix, n in counts.items())
    why = f": {reason}" if reason else ""
    logger.info("%d checkpoint tensors not served (%s)%s", sum(counts.values()), by_prefix, why)


def _linear_entries(model: nn.Module, tied: set[str]) -> dict[str, set[str]]:
    """Module path -> the entries `load_weights` marks loaded for it (a parameter's name, or
    name:shard of a fused one), for every nn.Linear none of whose parameters is tied."""
    entries = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        names = [f"{path}.{p}" if path else p for p, _ in module.named_parameters(recurse=False)]
        if any(name in tied for name in names):
            continue
        shards = module.shards if isinstance(module, MergedLinear) else None
        entries[path] = {f"{n}:{s}" for n in names for s in shards} if shards else set(names)
    return entries


def _forget_module(path: str, params: dict[str, nn.Parameter], shard_targets: dict[str, Any]) -> None:
    """Drop load_weights' references to the filled module at `path` (its parameters, its shard
    targets), so that replacing it frees its weights."""
    prefix = f"{path}."
    for name in [n for n in params if n.startswith(prefix) and "." not in n[len(prefix) :]]:
        del params[name]
    for key in [k for k, target in shard_targets.items() if target[0] == path]:
        del shard_targets[key]


def _shard_targets(model: nn.Module) -> dict[str, tuple[str, MergedLinear, str]]:
    """Checkpoint module path (e.g. '...self_attn.q_proj') -> (fused module path, module, shard)."""
    targets = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = path.rpartition(".")[0]
            for shard in module.shards:
                targets[f"{parent}.{shard}"] = (path, module, shard)
    return targets


def _fill(
    dst: torch.Tensor,
    src: torch.Tensor | StoredTensor | GroupedWeights,
    name: str,
    take: Callable[[GroupedWeights], bool] | None,
) -> None:
    """Copy `src` into `dst`; a GroupedWeights one goes to `take` first, and is dequantized into dst if not taken."""
    if not isinstance(src, GroupedWeights):
        _copy(dst, src, name)
        return
    if tuple(dst.shape) != src.shape:
        raise ValueError(f"{name}: checkpoint shape {src.shape} != model shape {tuple(dst.shape)}")
    if take is None or not take(src):
        dequantize_into(dst, src)


def dequantize_into(dst: torch.Tensor, grouped: GroupedWeights, rows: int = 1024) -> None:
    """`grouped.dequantize()` copied into dst a block of output rows at a time: the same values (each is its own
    product), without the whole linear's fp32 codes and expanded scales at once (~3x its fp32 weights)."""
    for start in range(0, grouped.shape[0], rows):
        block = slice(start, start + rows)
        dst[block].copy_(grouped.rows(block).dequantize())


def _copy(dst: torch.Tensor, src: torch.Tensor | StoredTensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    if isinstance(src, StoredTensor):
        if dst.dtype == src.dtype and dst.is_contiguous() and dst.device.type == "cpu":
            src.read_into(dst)
            return
        src = src.read()  # another dtype (cast as it is copied in) or layout: one tensor at a time
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


def iter_gguf(path: Path, config: object, codes: bool = False) -> Iterator[tuple[str, torch.Tensor | GroupedWeights]]:
    """Dequantized tensors under Transformers' names, with llama.cpp's q/k row order undone; with `codes`, the
    decoder's quantized linears and the LM head as their blocks' GroupedWeights instead (`gguf_tensor`)."""
    reader = gguf_reader(path)
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    kv_heads = config.num_key_value_heads  # type: ignore[attr-defined]
    for tensor in reader.tensors:
        name = _gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("ignoring GGUF tensor %s", tensor.name)
            continue
        rope_heads = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
        yield name, gguf_tensor(tensor, name, rope_heads, codes)


def gguf_tensor(
    tensor: Any, name: str, rope_heads: int = 0, codes: bool = False, norm_shift: float = 0.0
) -> torch.Tensor | GroupedWeights:
    """One GGUF tensor (gguf-py's ReaderTensor) as the checkpoint tensor `name`: gguf-py's fp32 values, or with
    `codes` for a quantized linear of the decoder or the LM head its GroupedWeights (quant_formats/gguf_blocks.py:
    our int4 / int8 blocks, read from the file's). `rope_heads`: llama.cpp permuted the rows per head of this
    many for its RoPE: undone (on the values, or on the codes' rows). `norm_shift`: the converter added this to
    the values (Gemma's RMSNorm scales by 1 + w, llama.cpp's by w): subtracted in fp32, as it was added; such a
    tensor (a norm) is always read dense. Every dense read of a GGUF tensor goes through here."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the inputs (ne0) first
    if codes and not norm_shift and gguf_blocks.serves_from_codes(name, len(shape)):
        lm_head = name == "lm_head.weight"
        grouped = gguf_blocks.grouped_of(tensor.tensor_type.name, tensor.data, shape, lm_head)  # type: ignore[arg-type]
        if grouped is not None:
            if not rope_heads:
                return grouped
            order = unpermute_rope_rows(np.arange(shape[0]), rope_heads)
            return gguf_blocks.permute_rows(grouped, torch.from_numpy(np.ascontiguousarray(order)))
    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if rope_heads:
        array = unpermute_rope_rows(array, rope_heads)
    values = torch.from_numpy(np.array(array, copy=True))
    return values - norm_shift if norm_shift else values


def _gguf_to_hf_name(name: str) -> str | None:
    for pattern, replacement in _GGUF_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary pairs; Transformers' rotate-half wants them split.
    dim = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
