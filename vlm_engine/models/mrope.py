"""M-RoPE prompt positions, shared by the Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Text advances the three axes (t, h, w) together; a media item lays its merged patch grid out from
the current position, and the text after it resumes at current + max(h, w) / merge, as
Transformers' `get_rope_index`. Qwen2.5-VL spaces a video's temporal positions by absolute time
(`tokens_per_second` x the seconds each temporal grid step covers); Qwen3-VL's videos arrive as one
item per frame group (t = 1), separated by timestamp text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import ProcessorPrompts


class MRopePrompts(ProcessorPrompts):
    """A Qwen-VL processor's prompts with their M-RoPE positions."""

    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)
        # Qwen2.5-VL: temporal positions per second of video; None: one position per temporal grid step
        self.tokens_per_second: float | None = getattr(config.vision_config, "tokens_per_second", None)

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        items = [(m.span.offset, m.span.length, m.grid_thw, self._time_interval(m)) for m in media]
        return mrope_positions(len(token_ids), items, self.spatial_merge_size)

    def _time_interval(self, item: MediaInput) -> float:
        if item.kind != "video" or self.tokens_per_second is None:
            return 1.0
        return self.tokens_per_second * (item.grid_seconds if item.grid_seconds is not None else 1.0)


def mrope_positions(
    num_tokens: int,
    media: list[tuple[int, int, tuple[int, int, int], float]],
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """3-D positions [3, num_tokens] for a prompt, and the delta that continues them in decode.

    `media` holds (offset, length, grid_thw, time_interval) per image/video in prompt order; a
    video's temporal index i sits at current + int(i * time_interval) (float arithmetic truncated, as
    Transformers' `.long()` of the float product).
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = 0
    cursor = 0
    for offset, length, (t, h, w), time_interval in sorted(media, key=lambda m: m[0]):
        text_len = offset - cursor
        positions[:, cursor:offset] = np.arange(current, current + text_len)
        current += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != length:
            raise ValueError(f"media grid {t}x{gh}x{gw} does not match its {length} placeholder tokens")
        times = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, offset : offset + length] = tt.reshape(-1) + current
        positions[1, offset : offset + length] = hh.reshape(-1) + current
        positions[2, offset : offset + length] = ww.reshape(-1) + current
        current += max(h, w) // spatial_merge_size
        cursor = offset + length
    positions[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
