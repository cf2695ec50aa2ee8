"""Qwen2-VL's prompt side: its HF processor expands media; M-RoPE positions as Transformers' `get_rope_index`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vlm_engine.inputs import MediaInput
from vlm_engine.models.hf_prompts import ProcessorPrompts


class Qwen2VLPrompts(ProcessorPrompts):
    def __init__(self, model_dir: Path, config: Any, gguf_file: str | None, video_device: str = "cpu") -> None:
        super().__init__(model_dir, config, gguf_file, video_device)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)

    def positions(self, token_ids: list[int], media: list[MediaInput]) -> tuple[np.ndarray | None, int]:
        spans = [(m.span.offset, m.span.length, m.grid_thw) for m in media]
        return mrope_positions(len(token_ids), spans, self.spatial_merge_size)


def mrope_positions(
    num_tokens: int,
    media: list[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """3-D positions [3, num_tokens] for a prompt, and the delta that continues them in decode.

    `media` holds (offset, length, grid_thw) per image/video in prompt order. Text advances all
    three axes together; a media item lays its (t, h, w) grid out from the current position, and
    the text after it resumes at current + max(h, w) / merge — as Transformers' `get_rope_index`.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    current = 0
    cursor = 0
    for offset, length, (t, h, w) in sorted(media):
        text_len = offset - cursor
        positions[:, cursor:offset] = np.arange(current, current + text_len)
        current += text_len
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != length:
            raise ValueError(f"media grid {t}x{gh}x{gw} does not match its {length} placeholder tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[0, offset : offset + length] = tt.reshape(-1) + current
        positions[1, offset : offset + length] = hh.reshape(-1) + current
        positions[2, offset : offset + length] = ww.reshape(-1) + current
        current += max(h, w) // spatial_merge_size
        cursor = offset + length
    positions[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
