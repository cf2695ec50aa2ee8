"""Executes one scheduled step: builds flat inputs, runs the vision tower for media that the
step needs, the decoder over paged KV, and samples the rows that produce tokens.

Host-side input building uses plain lists and numpy and crosses into torch once per array:
per-element tensor work on the host is the classic way to starve the accelerator.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from vlm_engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from vlm_engine.cache.encoder_cache import EncoderCache
from vlm_engine.cache.state_pool import StatePool, state_layout
from vlm_engine.models.family import VLModel
from vlm_engine.models.layers import ForwardContext, StepState
from vlm_engine.runner.sampler import SampledToken, batch_argmax, sample, token_logprobs
from vlm_engine.runner.verify import verify_greedy, verify_sampled
from vlm_engine.scheduler.batch import ScheduledChunk, SchedulerOutput
from vlm_engine.scheduler.request import Request
from vlm_engine.structured.grammar import build_bitmask


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: VLModel) -> KVLayout:
        return cls(*model.kv_layout)


def attention_windows(model: VLModel) -> tuple[int, ...]:
    """Each decoder layer's sliding window (0: full attention), from the model's optional
    `attention_windows`; all 0 for a model without one."""
    num_layers = KVLayout.of(model).num_layers
    windows = tuple(getattr(model, "attention_windows", None) or (0,) * num_layers)
    if len(windows) != num_layers:
        raise ValueError(f"attention_windows names {len(windows)} layers, the KV layout {num_layers}")
    return windows


def kv_layers(model: VLModel) -> list[bool]:
    """Which decoder layers read paged KV: all but those that keep a fixed-size state instead."""
    layout = state_layout(model)
    return [True] * KVLayout.of(model).num_layers if layout is None else [entry is None for entry in layout]


def kv_sources(model: VLModel) -> tuple[int, ...]:
    """Whose paged KV each decoder layer reads: its own, or, from the model's optional `kv_sources`,
    an earlier layer's that it reads and never writes (Gemma 4's KV-shared layers)."""
    num_layers = KVLayout.of(model).num_layers
    sources = tuple(getattr(model, "kv_sources", None) or range(num_layers))
    if len(sources) != num_layers:
        raise ValueError(f"kv_sources names {len(sources)} layers, the KV layout {num_layers}")
    for layer, source in enumerate(sources):
        if source > layer or sources[source] != source:
            raise ValueError(f"layer {layer} reads layer {source}'s KV, which is not an earlier layer's own")
    return sources


def kv_layer_shapes(model: VLModel) -> list[tuple[int, int] | None]:
    """Each decoder layer's own KV pages as (KV heads, head dim), or None for a layer that keeps none
    (a fixed-size state instead, or another layer's KV that it only reads). Layers may differ
    (Gemma 4's global layers: their own head dim) when the model declares `kv_shapes`."""
    layout = KVLayout.of(model)
    shapes = getattr(model, "kv_shapes", None) or ((layout.num_kv_heads, layout.head_dim),) * layout.num_layers
    sources = kv_sources(model)
    return [
        tuple(shape) if kv and sources[i] == i else None
        for i, (shape, kv) in enumerate(zip(shapes, kv_layers(model), strict=True))
    ]


def kv_token_bytes(models: list[VLModel], dtype: torch.dtype) -> tuple[int, int]:
    """KV bytes of one token in the full-attention layers (every model's: a draft model's share
    the page tables) and in the first model's sliding-window layers, which have a pool of their own.
    Only the layers that write KV count: a layer that reads another's allocates nothing."""
    element = torch.empty((), dtype=dtype).element_size()

    def layer_bytes(model: VLModel, windowed_only: bool) -> int:
        windows = attention_windows(model)
        return sum(
            2 * shape[0] * shape[1] * element
            for shape, window in zip(kv_layer_shapes(model), windows)
            if shape is not None and (window or not windowed_only)
        )

    window = layer_bytes(models[0], windowed_only=True)
    full = sum(layer_bytes(model, windowed_only=False) for model in models)
    return full - window, window


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one `ModelRunner.execute()` produced."""

    # New tokens of each sampling chunk's request: one, or a verified draft prefix plus one.
    sampled: dict[str, list[SampledToken]]
    # Requests whose logits were not finite (NaN / inf): no token; they fail alone.
    nonfinite: list[str]
    prepare_s: float = 0.0  # host-side input building
    mask_s: float = 0.0  # host time spent building grammar masks (on their thread, during the forward)
    mask_wait_s: float = 0.0  # of that, how long the step waited for them after the forward


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    sample_rows: list[int]  # flat rows whose logits are needed: each sampling chunk's last known token and its draft
    sample_chunks: list[ScheduledChunk]
    row_offsets: list[int]  # where each sampling chunk's rows start among sample_rows
    state: StepState | None = None  # linear-attention layers' slots for the step's sequences


class ModelRunner:
    def __init__(
        self,
        model: VLModel,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        attn_backend: AttentionBackend,
        encoder_cache_bytes: int = 0,
        fused_ops: ModuleType | None = None,
        merge_media: bool = True,  # False for a text-only draft model: placeholders stay token embeddings
        num_window_pages: int = 0,  # > 0: the sliding-window layers' KV lives in a pool of this many pages
        states: StatePool | None = None,  # the linear-attention layers' slots, when the model has such layers
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.page_size = page_size
        self.attn_backend = attn_backend
        self.fused_ops = fused_ops
        self._argmax = fused_ops.argmax_rows if fused_ops is not None else None  # C++ row argmax
        self.layout = KVLayout.of(model)
        self.uses_window_pool = num_window_pages > 0
        windows = attention_windows(model) if self.uses_window_pool else (0,) * self.layout.num_layers
        # A layer that reads an earlier layer's KV holds that layer's tensors: no pages of its own.
        self.kv_caches: list[KVCache] = []
        for layer, (window, shape, source) in enumerate(zip(windows, kv_layer_shapes(model), kv_sources(model))):
            if source != layer:
                self.kv_caches.append(self.kv_caches[source])
            elif shape is None:  # a layer with a fixed-size state instead
                self.kv_caches.append(self._kv_tensors(0, (self.layout.num_kv_heads, self.layout.head_dim)))
            else:
                self.kv_caches.append(self._kv_tensors(num_window_pages if window else num_pages, shape))
        self.states = states
        self.state_pools = self._state_tensors(states)
        # Media tokens that attend to each other both ways (Gemma 3's images): per-token KV ends.
        self.bidirectional_media = bool(getattr(model, "bidirectional_media", False))
        self.position_axes = model.position_axes  # 3 for M-RoPE (t, h, w), else 1
        self.merge_media = merge_media
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.default_generator = torch.Generator(device="cpu")
        self.default_generator.seed()
        # Grammar masks are computed on this thread while the forward pass runs (llguidance drops
        # the GIL); one thread, because the forward already uses the cores.
        self._mask_thread: ThreadPoolExecutor | None = None
        self.vocab_size = model.vocab_size

    def _kv_tensors(self, num_pages: int, heads_and_dim: tuple[int, int]) -> KVCache:
        shape = (num_pages, self.page_size, *heads_and_dim)
        return (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def _state_tensors(self, states: StatePool | None) -> list[tuple[torch.Tensor, ...] | None]:
        """Each stateful layer's tensors, [slots, *shape] (zeros), and None for the KV layers."""
        layout = state_layout(self.model)
        if layout is None:
            if states is not None:
                raise ValueError("a state pool for a model that keeps no per-sequence state")
            return []
        if states is None:
            raise ValueError(f"{type(self.model).__name__} keeps per-sequence state: it needs a state pool")
        num_slots = states.slots.total
        return [
            None
            if entry is None
            else tuple(
                torch.zeros((num_slots, *shape), dtype=dtype or self.dtype, device=self.device)
                for shape, dtype in zip(entry.shapes, entry.dtypes)
            )
            for entry in layout
        ]

    def _copy_states(self, chunks: list[ScheduledChunk]) -> None:
        """The slot copies the scheduler recorded (snapshots, restores), in order, then a checkpoint
        of every request whose draft this step verifies (a partial accept goes back to it)."""
        assert self.states is not None
        copies = self.states.take_copies()
        copies += [(c.request.state_slot, self.states.checkpoint_slot(c.request.state_slot)) for c in chunks if c.draft]
        if not copies:
            return
        for src, dst in copies:
            for tensors in self.state_pools:
                for tensor in tensors or ():
                    tensor[dst].copy_(tensor[src])

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step: the new tokens of each sampling chunk's request (one, or a verified draft
        prefix plus one when the chunk carries a draft); a request whose logits were not finite
        gets none and is listed as such."""
        t0 = time.perf_counter()
        if self.states is not None:
            self._copy_states(out.chunks)
        inputs = self.prepare_inputs(out.chunks)
        prepare_s = time.perf_counter() - t0
        masks = self._start_masks(inputs)
        logits = self._logits(inputs, out.chunks)
        if logits is None:
            return RunnerOutput({}, [], prepare_s)
        mask_s = mask_wait_s = 0.0
        if masks is not None:
            mask_s, mask_wait_s = self._apply_masks(logits, masks)
        sampled, nonfinite = self._choose(logits, inputs)
        return RunnerOutput(sampled, nonfinite, prepare_s, mask_s, mask_wait_s)

    @torch.inference_mode()
    def forward_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Float32 host logits of the chunks' sample rows, in order (a draft model's proposer uses this)."""
        logits = self._logits(self.prepare_inputs(chunks), chunks)
        return None if logits is None else logits.float()

    def _logits(self, inputs: StepInputs, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        hidden = self.model.embed(inputs.input_ids)
        ctx = ForwardContext(inputs.attn_meta, self.kv_caches, self.attn_backend, self.fused_ops, state=inputs.state)
        if self.merge_media and any(c.request.prompt.media for c in chunks):
            ctx.media_rows, ctx.media_features = self._merge_media(hidden, chunks)
        hidden = self.model(hidden, inputs.positions, ctx)
        if not inputs.sample_rows:
            return None
        rows = inputs.sample_rows  # increasing row indices: all of them is every row (a decode step)
        if len(rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        logits = self.model.compute_logits(hidden).cpu()
        # bf16 stays bf16: greedy rows take the argmax of bf16 logits as they are (widening is
        # exact), and only what needs fp32 (sampling, logprobs) converts its rows; converting the
        # whole [64, 49152] block cost ~0.5 ms of a batch-64 step. Other dtypes (fp16) convert.
        return logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()

    def _choose(self, logits: torch.Tensor, inputs: StepInputs) -> tuple[dict[str, list[SampledToken]], list[str]]:
        """Each sampling chunk's tokens, and the requests whose logits were not finite."""
        chunks, offsets = inputs.sample_chunks, inputs.row_offsets
        results: dict[str, list[SampledToken]] = {}
        nonfinite: list[str] = []
        plain = [i for i, c in enumerate(chunks) if not c.draft]
        if plain:
            requests = [chunks[i].request for i in plain]
            rows = logits if len(plain) == len(logits) else logits[[offsets[i] for i in plain]]
            tokens = sample(rows, [r.sampling for r in requests], [self.generator(r) for r in requests], self._argmax)
            for request, token in zip(requests, tokens):
                if token is None:
                    nonfinite.append(request.request_id)
                else:
                    results[request.request_id] = [token]
        drafted = [i for i, c in enumerate(chunks) if c.draft]
        if drafted:
            argmax, finite = batch_argmax(logits, self._argmax)
            for i in drafted:
                chunk = chunks[i]
                if not all(finite[offsets[i] : offsets[i] + len(chunk.draft) + 1]):
                    nonfinite.append(chunk.request.request_id)
                    continue
                results[chunk.request.request_id] = self._verify(chunk, logits, argmax, offsets[i])
        return results, nonfinite

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor, argmax: list[int], row: int) -> list[SampledToken]:
        request, draft = chunk.request, chunk.draft
        rows = slice(row, row + len(draft) + 1)
        state = request.runner_state
        draft_probs, state.draft_probs = state.draft_probs, None  # this step's draft only
        params = request.sampling
        if params.greedy:
            tokens = verify_greedy(argmax[rows], draft)
        else:
            probs = None if draft_probs is None else draft_probs[: len(draft)]
            tokens = verify_sampled(logits[rows], draft, probs, params, self.generator(request))
        if params.logprobs is None:
            return [SampledToken(t) for t in tokens]
        return token_logprobs(logits[row : row + len(tokens)], tokens, params.logprobs)

    # ---- structured output -------------------------------------------------------------------

    def _start_masks(self, inputs: StepInputs) -> Future | None:
        items = [
            (offset, c.request.grammar, c.request.remaining_tokens, c.draft)
            for offset, c in zip(inputs.row_offsets, inputs.sample_chunks)
            if c.request.grammar is not None
        ]
        if not items:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        words = (self.vocab_size + 31) // 32
        return self._mask_thread.submit(_timed, build_bitmask, items, words)

    def _apply_masks(self, logits: torch.Tensor, masks: Future) -> tuple[float, float]:
        """Mask the constrained rows; returns the time building the masks took and the wait for them."""
        t0 = time.perf_counter()
        (rows, bitmask), mask_s = masks.result()
        wait_s = time.perf_counter() - t0
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))
        return mask_s, wait_s

    # ---- inputs ----------------------------------------------------------------------------

    def prepare_inputs(self, chunks: list[ScheduledChunk]) -> StepInputs:
        inputs = self._prepare_decode(chunks) or self._prepare_any(chunks)
        if self.states is not None:
            inputs.state = self._step_state(chunks)
        return inputs

    def _step_state(self, chunks: list[ScheduledChunk]) -> StepState:
        slots = [c.request.state_slot for c in chunks]
        if min(slots) < 0:
            raise RuntimeError("a request of a stateful model was scheduled without a state slot")
        initial = [c.start > 0 for c in chunks]
        dev = self.device
        return StepState(
            self.state_pools,
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(initial, dtype=torch.bool, device=dev),
            slots,
            initial,
        )

    def _prepare_decode(self, chunks: list[ScheduledChunk]) -> StepInputs | None:
        """The step's inputs when every chunk is one sampling token past its prompt (a plain decode
        step), from Python ints: the general path's per-request numpy arrays cost ~10 us a request
        (0.8 ms of a batch-64 step). None for any other step."""
        ps, axes = self.page_size, self.position_axes
        input_ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        page_lists: list[list[int]] = []
        for chunk in chunks:
            request = chunk.request
            pos = chunk.start
            if chunk.num_tokens != 1 or chunk.draft or pos + 1 != request.num_tokens or pos < request.num_prompt_tokens:
                return None
            pages = request.page_ids
            input_ids.append(request.token_ids[pos])
            slots.append(pages[pos // ps] * ps + pos % ps)
            prompt = request.prompt  # as _positions(): its delta is 0 without family positions
            positions.append(pos + prompt.position_delta if prompt.position_axes == axes else pos)
            seq_lens.append(pos + 1)
            page_lists.append(pages)
        n = len(chunks)
        dev = self.device
        pos_tensor = torch.tensor(positions, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=self._block_table(page_lists),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens_host=[1] * n,
            seq_lens_host=seq_lens,
        )
        if self.uses_window_pool:
            window_pages = [c.request.window_page_ids for c in chunks]
            meta.window_block_table = self._block_table(window_pages)
            window_slots = [pages[p // ps] * ps + p % ps for pages, p in zip(window_pages, (c.start for c in chunks))]
            meta.window_slot_mapping = torch.tensor(window_slots, dtype=torch.long, device=dev)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=pos_tensor.expand(self.position_axes, n).contiguous() if self.position_axes > 1 else pos_tensor,
            attn_meta=meta,
            sample_rows=list(range(n)),
            sample_chunks=list(chunks),
            row_offsets=list(range(n)),
        )

    def _prepare_any(self, chunks: list[ScheduledChunk]) -> StepInputs:
        ps = self.page_size
        input_ids: list[int] = []
        slots: list[np.ndarray] = []
        window_slots: list[np.ndarray] = []
        kv_ends: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        query_lens, seq_lens, sample_rows, sample_chunks, row_offsets = [], [], [], [], []
        for chunk in chunks:
            request = chunk.request
            start, end = chunk.start, chunk.end
            input_ids.extend(chunk.input_ids())
            pos = np.arange(start, end, dtype=np.int64)
            pages = np.asarray(request.page_ids, dtype=np.int64)
            slots.append(pages[pos // ps] * ps + pos % ps)
            if self.uses_window_pool:
                window_pages = np.asarray(request.window_page_ids, dtype=np.int64)
                window_slots.append(window_pages[pos // ps] * ps + pos % ps)
            if self.bidirectional_media:
                kv_ends.append(_kv_ends(chunk, pos))
            positions.append(self._positions(request, pos))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            if chunk.samples:
                row_offsets.append(len(sample_rows))
                sample_rows.extend(range(len(input_ids) - chunk.num_sample_rows, len(input_ids)))
                sample_chunks.append(chunk)
        qsl = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=self._block_table([c.request.page_ids for c in chunks]),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        if self.uses_window_pool:
            meta.window_block_table = self._block_table([c.request.window_page_ids for c in chunks])
            meta.window_slot_mapping = torch.from_numpy(np.concatenate(window_slots)).to(dev)
        if kv_ends:
            meta.kv_end = torch.from_numpy(np.concatenate(kv_ends).astype(np.int32)).to(dev)
        pos_all = np.concatenate(positions, axis=-1)
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(pos_all).to(dev),
            attn_meta=meta,
            sample_rows=sample_rows,
            sample_chunks=sample_chunks,
            row_offsets=row_offsets,
        )

    def _block_table(self, page_lists: list[list[int]]) -> torch.Tensor:
        """[B, longest] int32 page ids; released window pages (-1) and padding read as page 0,
        which no backend reads: they lie outside every query's visible range."""
        table = np.zeros((len(page_lists), max(map(len, page_lists))), dtype=np.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = pages
        np.maximum(table, 0, out=table)
        return torch.from_numpy(table).to(self.device)

    def _positions(self, request: Request, pos: np.ndarray) -> np.ndarray:
        prompt = request.prompt
        # Plain positions (on every rotary axis): no family positions, or another family's (a draft's target).
        if prompt.positions is None or prompt.position_axes != self.position_axes:
            return pos if self.position_axes == 1 else np.broadcast_to(pos, (self.position_axes, len(pos)))
        n_prompt = request.num_prompt_tokens
        if pos[-1] < n_prompt:
            return prompt.positions[:, pos[0] : pos[-1] + 1]
        # Generated tokens continue on one line, shifted by the prompt's delta.
        result = np.broadcast_to(pos + prompt.position_delta, (self.position_axes, len(pos))).copy()
        in_prompt = pos < n_prompt
        if in_prompt.any():
            result[:, in_prompt] = prompt.positions[:, pos[in_prompt]]
        return result

    def generator(self, request: Request) -> torch.Generator:
        if request.sampling.seed is None:
            return self.default_generator
        state = request.runner_state
        if state.generator is None:
            state.generator = torch.Generator(device="cpu")
            state.generator.manual_seed(request.sampling.seed)
        return state.generator

    # ---- media -----------------------------------------------------------------------------

    def _merge_media(
        self, hidden: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Overwrite placeholder rows with vision-encoder outputs, encoding only what is missing.

        An encoder output wider than the hidden size carries per-token features past its first
        `hidden` columns (DeepStack): those come back as (rows of this step, their features) for the
        decoder (`ForwardContext.media_rows` / `media_features`); else (None, None)."""
        overlaps: list[tuple[int, Request, int, int, int]] = []  # (row base, request, item, lo, hi)
        missing: list[tuple[Request, int, Any]] = []
        row_base = 0
        for chunk in chunks:
            request = chunk.request
            store = request.runner_state.media_embeddings
            for index, item in enumerate(request.prompt.media):
                lo, hi = max(chunk.start, item.span.offset), min(chunk.end, item.span.end)
                if lo >= hi:
                    continue
                overlaps.append((row_base - chunk.start, request, index, lo, hi))
                if index not in store:
                    cached = self.encoder_cache.get(item.span.content_hash)
                    if cached is not None:
                        store[index] = cached
                    elif not any(r is request and j == index for r, j, _ in missing):
                        missing.append((request, index, item))
            row_base += chunk.num_tokens
        if missing:
            outputs = self.model.encode_media(
                [m.pixel_values for _, _, m in missing], [m.grid_thw for _, _, m in missing]
            )
            for (request, index, item), emb in zip(missing, outputs):
                emb = emb.to(self.dtype)
                request.runner_state.media_embeddings[index] = emb
                self.encoder_cache.put(item.span.content_hash, emb)
        width = hidden.shape[1]
        feature_rows: list[range] = []
        features: list[torch.Tensor] = []
        for shift, request, index, lo, hi in overlaps:
            item = request.prompt.media[index]
            emb = request.runner_state.media_embeddings[index][lo - item.span.offset : hi - item.span.offset]
            hidden[shift + lo : shift + hi] = emb[:, :width]
            if emb.shape[1] > width:
                feature_rows.append(range(shift + lo, shift + hi))
                features.append(emb[:, width:])
        # Drop per-request references to media this step finished consuming.
        for chunk in chunks:
            store = chunk.request.runner_state.media_embeddings
            if store:
                for index in [j for j in store if chunk.request.prompt.media[j].span.end <= chunk.end]:
                    del store[index]
        if not features:
            return None, None
        rows = torch.tensor([r for span in feature_rows for r in span], dtype=torch.long, device=hidden.device)
        return rows, torch.cat(features)


def _kv_ends(chunk: ScheduledChunk, pos: np.ndarray) -> np.ndarray:
    """Exclusive KV end for each of the chunk's tokens at `pos`: its position + 1, or the end of the
    media span it sits in (the span's tokens see each other both ways). The scheduler never ends a
    chunk inside such a span (`SchedulerConfig.atomic_media_spans`), so every end is in this step."""
    ends = pos + 1
    for span in chunk.request.media_spans:
        lo, hi = max(span.offset, chunk.start), min(span.end, chunk.end)
        if lo >= hi:
            continue
        if span.end > chunk.end:
            raise ValueError(f"a chunk ending at {chunk.end} splits a bidirectional media span {span}")
        ends[lo - chunk.start : hi - chunk.start] = span.end
    return ends


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0
