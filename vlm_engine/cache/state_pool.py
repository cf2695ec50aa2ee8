"""Slots of fixed-size per-sequence state beside the paged KV: linear-attention layers (Gated
DeltaNet) keep a short conv window and a recurrent matrix per sequence instead of KV pages.

A model declares what each decoder layer keeps (`state_layout`: a `LayerState`, or None for a
layer with paged KV). The runner holds one tensor per declared shape, [num_slots, *shape]; this
pool hands out slot numbers and never touches a tensor. Its slots are, in order:

- **live** slots, one per seat (`max_num_seqs`): a request holds one from admission until it
  finishes, is aborted or is preempted (then it recomputes from its tokens);
- **checkpoint** slots, one per live slot (speculative decoding only): the runner copies a
  request's state there before a step verifies a draft, and a partial accept restores it;
- **snapshot** slots, keyed by a prefix-cache page key: the state after that page, so that a
  prefix-cache hit can resume the linear layers where the cached pages end. The least recently
  used snapshot goes first when they run out, and a snapshot goes with its page when the page
  pool evicts that page's key.

Copies between slots are recorded here in order (`take_copies`) and done by the runner before the
next forward pass; nothing else writes a slot in between, so a copy recorded after a step sees
exactly the state that step left.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerState:
    """What one layer keeps per sequence: tensors of these shapes, each in its dtype (None: the
    model's dtype)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype | None, ...]

    def bytes(self, model_dtype: torch.dtype) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            total += math.prod(shape) * torch.empty((), dtype=dtype or model_dtype).element_size()
        return total


StateLayout = tuple[LayerState | None, ...]


def state_layout(model: object) -> StateLayout | None:
    """The model's optional `state_layout` when any layer keeps state, else None."""
    layout = getattr(model, "state_layout", None)
    if layout is None or all(entry is None for entry in layout):
        return None
    return tuple(layout)


def slot_bytes(layout: StateLayout, model_dtype: torch.dtype) -> int:
    """Bytes of one slot: every stateful layer's tensors."""
    return sum(entry.bytes(model_dtype) for entry in layout if entry is not None)


@dataclass(frozen=True)
class StateSlots:
    """How many slots of each kind the engine keeps."""

    num_live: int
    num_checkpoints: int  # 0, or num_live with speculative decoding
    num_snapshots: int

    @property
    def total(self) -> int:
        return self.num_live + self.num_checkpoints + self.num_snapshots


def plan_state_pool(
    model: object, dtype: torch.dtype, max_num_seqs: int, speculative: bool, snapshots: int
) -> StatePool | None:
    """The pool for the model's stateful layers (None without any): a live slot per seat, a
    checkpoint per live slot with speculative decoding, `snapshots` prefix-cache snapshots."""
    layout = state_layout(model)
    if layout is None:
        return None
    slots = StateSlots(max_num_seqs, max_num_seqs if speculative else 0, snapshots)
    return StatePool(slots, slot_bytes(layout, dtype))


class StatePool:
    def __init__(self, slots: StateSlots, slot_bytes: int = 0) -> None:
        if slots.num_live < 1:
            raise ValueError("the state pool needs a live slot per seat")
        if slots.num_checkpoints not in (0, slots.num_live):
            raise ValueError("checkpoint slots come one per live slot")
        self.slots = slots
        self.slot_bytes = slot_bytes  # of one slot, every stateful layer's tensors
        self._free_live = list(range(slots.num_live - 1, -1, -1))  # a stack: slot 0 first
        first_snapshot = slots.num_live + slots.num_checkpoints
        self._free_snapshots = list(range(slots.total - 1, first_snapshot - 1, -1))
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # page key -> slot, least recent first
        self._copies: list[tuple[int, int]] = []
        self.snapshot_hits = 0  # prefix-cache hits resumed from a snapshot

    @property
    def num_live_used(self) -> int:
        return self.slots.num_live - len(self._free_live)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_used(self) -> int:
        """Slots holding something: live slots of requests (and their checkpoints) and snapshots."""
        live = self.num_live_used
        return live + (live if self.slots.num_checkpoints else 0) + len(self._snapshots)

    @property
    def bytes_in_use(self) -> int:
        return self.num_used * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.slots.total * self.slot_bytes

    def allocate(self) -> int | None:
        return self._free_live.pop() if self._free_live else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.slots.num_live or slot in self._free_live:
            raise RuntimeError(f"state slot {slot} freed but not held")
        self._free_live.append(slot)

    def checkpoint_slot(self, live: int) -> int:
        if not self.slots.num_checkpoints:
            raise RuntimeError("no checkpoint slots: speculative decoding is off")
        return self.slots.num_live + live

    def snapshot(self, key: int, live: int) -> None:
        """Keep `live`'s state (as the last step left it) as the state after the page `key`."""
        if not self.slots.num_snapshots or key in self._snapshots:
            return
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        else:
            _, slot = self._snapshots.popitem(last=False)
        self._snapshots[key] = slot
        self._copies.append((live, slot))

    def has_snapshot(self, key: int) -> bool:
        return key in self._snapshots

    def restore(self, key: int, live: int) -> None:
        """Start `live` from the snapshot after page `key` (which `has_snapshot`)."""
        slot = self._snapshots[key]
        self._snapshots.move_to_end(key)
        self._copies.append((slot, live))
        self.snapshot_hits += 1

    def restore_checkpoint(self, live: int) -> None:
        """Put back the state `live` had before its last verified draft."""
        self._copies.append((self.checkpoint_slot(live), live))

    def drop(self, key: int) -> None:
        """The page pool evicted page `key`: its snapshot can never be hit again."""
        slot = self._snapshots.pop(key, None)
        if slot is not None:
            self._free_snapshots.append(slot)

    def drop_all(self) -> None:
        for key in list(self._snapshots):
            self.drop(key)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) slot copies recorded since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies

    def check_invariants(self, held: list[int]) -> None:
        """`held`: the live slots requests hold; each held once, and held or free, never both."""
        if len(set(held)) != len(held):
            raise AssertionError(f"a live state slot is held twice: {sorted(held)}")
        if set(held) & set(self._free_live) or len(held) + len(self._free_live) != self.slots.num_live:
            raise AssertionError("live state slots leaked or double-freed")
        if len(self._snapshots) + len(self._free_snapshots) != self.slots.num_snapshots:
            raise AssertionError("snapshot slots leaked")
