"""Qwen3-VL's prompt side: its processor writes each video as frame groups (2 frames each), every
one behind a "<t seconds>" timestamp and its own vision start/end tokens. Each frame group is one
media item here (grid (1, h, w)), as Transformers' `get_rope_index` splits the video grid: the
tower attends within a frame group anyway, so encoding them apart gives the same features."""

from __future__ import annotations

from collections.abc import Iterator

from preprocess.errors import PromptError
from preprocess.family_prompts import placeholder_runs
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import Expansion, part_hashes
from vlm_engine.models.mrope import MRopePrompts


class Qwen3VLPrompts(MRopePrompts):
    def media_inputs(self, expansion: Expansion) -> Iterator[MediaInput]:
        yield from self.items_by_run(expansion, "image")
        videos, outputs = expansion.videos, expansion.outputs
        if not videos:
            return
        grids = [tuple(int(x) for x in g) for g in outputs["video_grid_thw"].tolist()]
        videos_pixels = outputs["pixel_values_videos"].cpu().split([t * h * w for t, h, w in grids])
        runs = list(placeholder_runs(expansion.token_ids, self.video_token_id))
        if len(runs) != sum(t for t, _, _ in grids):
            raise PromptError(f"found {len(runs)} video frame groups for {len(videos)} videos", param="messages")
        next_run = iter(runs)
        for video, (t, h, w), pixels in zip(videos, grids, videos_pixels):
            # patches are ordered frame group first
            for group, content_hash in zip(pixels.split(h * w), part_hashes(video, "frame-group")):
                offset, length = next(next_run)
                yield MediaInput("video", MediaSpan(offset, length, content_hash), group, (1, h, w))
