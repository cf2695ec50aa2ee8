"""Qwen3-VL's prompt side: its processor writes each video as frame groups (2 frames each), every
one behind a "<t seconds>" timestamp and its own vision start/end tokens. Each frame group is one
media item here (grid (1, h, w)), as Transformers' `get_rope_index` splits the video grid: the
tower attends within a frame group anyway, so encoding them apart gives the same features."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from preprocess.errors import PromptError
from preprocess.family_prompts import placeholder_runs
from preprocess.hashing import hash_to_int
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.mrope import MRopePrompts


class Qwen3VLPrompts(MRopePrompts):
    def _items(self, kind: str, items: list[Any], inputs: Any, token_ids: list[int]) -> Iterator[MediaInput]:
        if kind != "video" or not items:
            yield from super()._items(kind, items, inputs, token_ids)
            return
        grids = [tuple(int(x) for x in g) for g in inputs["video_grid_thw"].tolist()]
        videos_pixels = inputs["pixel_values_videos"].cpu().split([t * h * w for t, h, w in grids])
        runs = list(placeholder_runs(token_ids, self.video_token_id))
        if len(runs) != sum(t for t, _, _ in grids):
            raise PromptError(f"found {len(runs)} video frame groups for {len(items)} videos", param="messages")
        next_run = iter(runs)
        for video, (t, h, w), pixels in zip(items, grids, videos_pixels):
            for index, group in enumerate(pixels.split(h * w)):  # patches are ordered frame group first
                offset, length = next(next_run)
                digest = hashlib.sha256(f"{video.content_hash}/frame-group/{index}".encode()).hexdigest()[:32]
                yield MediaInput(kind, MediaSpan(offset, length, hash_to_int(digest)), group, (1, h, w))
