"""Token-embedding tables read through a read-only mapping of the checkpoint file, not copied into memory.

An untied embedding table is only ever looked up by row: a step reads the rows of its tokens and nothing else.
Copied in, Qwen2.5-VL-7B's 152,064 x 3,584 float16 table holds 1.09 GB of the server's memory for the few
thousand rows a workload touches; mapped, only the pages of the rows looked up become resident (file pages, which
the kernel can drop and read again), as llama.cpp's mmap of its GGUF does. Lookups convert the rows to the served
dtype, the same values the copy cast as it was loaded (an exact widening to fp32; bf16 rounding as the copy's).

What is mapped (`plan_mapped_embeddings`): on a CPU model from safetensors, each nn.Embedding of at least
`MIN_MAPPED_BYTES` whose weight is tied to no other parameter (a tied LM head reads the whole table every step)
and that the family's checkpoint adapter leaves alone. Everything else loads as before. The mapping outlives the
file descriptor; a checkpoint file rewritten in place while a server runs would change what it reads (replacing
the file, as every tool that writes checkpoints does, does not).
"""

from __future__ import annotations

import math
import mmap
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vlm_engine.models.loader import StoredTensor, renamed

__all__ = ["MIN_MAPPED_BYTES", "MappedEmbedding", "MappedEmbeddings", "plan_mapped_embeddings"]

# Below this a table's copy costs little (vision towers' position tables are a few MB); above it, e.g. a 7B's
# 1.09 GB or Gemma 4's per-layer table, mapping is what keeps the server's memory near its weights.
MIN_MAPPED_BYTES = 64 << 20


class MappedEmbedding(nn.Module):
    """nn.Embedding's lookup over a table that is not a parameter (so `.to()` leaves it where it lies): a mapping of
    the checkpoint's bytes in their stored dtype, rows converted to `dtype` as they are read."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.table: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        """The table as stored (reading all of it makes all of it resident)."""
        if self.table is None:
            raise RuntimeError("the mapped embedding's table is not loaded yet")
        return self.table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(self.dtype)

    def extra_repr(self) -> str:
        stored = None if self.table is None else self.table.dtype
        return f"{self.num_embeddings}, {self.embedding_dim}, stored={stored}, dtype={self.dtype}"


class MappedEmbeddings:
    """The embeddings `plan_mapped_embeddings` replaced, by their checkpoint names (the model's, after its renames):
    `intercept` takes their tensors out of the checkpoint stream and gives them to the modules."""

    def __init__(self, modules: dict[str, MappedEmbedding], renames: tuple[tuple[str, str], ...]) -> None:
        self.modules, self.renames = modules, renames

    def intercept(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            module = self.modules.get(renamed(name, self.renames))
            if module is None:
                yield name, tensor
                continue
            shape = (module.num_embeddings, module.embedding_dim)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {shape}")
            # A tensor safetensors had to read itself (a dtype StoredTensor does not cover) is held as read.
            module.table = map_stored(tensor) if isinstance(tensor, StoredTensor) else tensor.to(module.dtype)

    def check_loaded(self) -> None:
        missing = [name for name, module in self.modules.items() if module.table is None]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def map_stored(stored: StoredTensor) -> torch.Tensor:
    """A read-only view of a stored tensor's bytes in its file, resident only where read (copy-on-write private
    mapping: torch needs a writable buffer, and nothing writes it)."""
    count = math.prod(stored.shape)
    start = stored.offset - stored.offset % mmap.ALLOCATIONGRANULARITY
    length = stored.offset - start + count * stored.dtype.itemsize
    mapping = mmap.mmap(stored.fd, length, access=mmap.ACCESS_COPY, offset=start)
    flat = torch.frombuffer(mapping, dtype=stored.dtype, count=count, offset=stored.offset - start)
    return flat.view(stored.shape)


def plan_mapped_embeddings(model: nn.Module, dtype: torch.dtype, names: Iterable[str]) -> MappedEmbeddings:
    """Replace (on the meta-device model, before its storage is made) each embedding that qualifies (module
    docstring) and that the checkpoint (`names`, before the model's renames) stores as a plain tensor by a
    MappedEmbedding of the served `dtype`."""
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    stored = {renamed(name, renames) for name in names}
    counts = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    adapt = getattr(model, "adapt_checkpoint_tensor", None)
    modules: dict[str, MappedEmbedding] = {}
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Embedding or module.padding_idx is not None or module.max_norm is not None:
            continue
        weight = module.weight
        name = f"{path}.weight"
        bytes_served = weight.numel() * dtype.itemsize
        if name not in stored or counts[id(weight)] > 1 or bytes_served < MIN_MAPPED_BYTES:
            continue
        if adapt is not None:
            probe = torch.empty(weight.shape, device="meta")
            if adapt(name, probe) is not probe:
                continue
        mapped = MappedEmbedding(module.num_embeddings, module.embedding_dim, dtype)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mapped)
        modules[name] = mapped
    return MappedEmbeddings(modules, renames)
