"""Shared fixtures: locally built checkpoints, Hugging Face references, generated images."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    from testkit.checkpoints import cached_qwen2_vl

    return cached_qwen2_vl("tiny")


@pytest.fixture(scope="session")
def hf_tiny_vlm() -> tuple[Any, Any]:
    """Transformers' model and processor of the tiny Qwen2-VL, shared with the family matrix."""
    from tests.family_table import family, hf_model

    return hf_model(family("qwen2-vl"))


@pytest.fixture(scope="session")
def ops() -> Any:
    """The fused-ops C++ extension (vlm_engine.models.fused_ops), built on first use. A failed build
    fails its tests under CI=true and skips them elsewhere (tests/kernel_builds.py)."""
    from tests.kernel_builds import require_extension
    from vlm_engine.models.fused_ops import load_fused_ops

    return require_extension(load_fused_ops, "the fused-ops extension")


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic picture with structure (gradients + blocks), not flat noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    blocks = rng.integers(0, 255, size=(height // 8 + 1, width // 8 + 1, 3))
    pixels = (base + blocks[y // 8, x // 8]) // 2
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def user(*parts: Any) -> list[dict[str, Any]]:
    """One user message of text (str) and image (PIL) parts, in order."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return [{"role": "user", "content": content}]


def to_hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """OpenAI-style messages with PIL image parts -> Transformers chat format and the image list."""
    out, images = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        parts = []
        for p in content:
            if p["type"] == "text":
                parts.append({"type": "text", "text": p["text"]})
            else:
                images.append(p["image"])
                parts.append({"type": "image"})
        out.append({"role": m["role"], "content": parts})
    return out, images


def hf_greedy(hf: tuple[Any, Any], messages: list[dict[str, Any]], max_new_tokens: int) -> list[int]:
    import torch

    model, processor = hf
    hf_messages, images = to_hf_messages(messages)
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="session")
def observed_server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One `vlm-engine serve` (tiny Qwen2-VL) with every observability option on, shared by
    test_observability, test_dashboard and test_deploy: a server start costs 20-40 s on 2 cores.
    Its tests compare /metrics before and after their own requests, never absolute totals. The KV
    pool is small (512 tokens) so that a burst of long requests must preempt; the request log and
    profiles go next to the server log."""
    from tests.server_helpers import ServerProcess, running

    run_dir = tmp_path_factory.mktemp("observed-server")
    srv = ServerProcess(
        tiny_vlm_dir,
        run_dir / "server.log",
        "--served-model-name", "tiny-vlm",
        "--max-model-len", "512",
        "--kv-cache-tokens", "512",
        "--max-num-seqs", "8",
        "--replica-id", OBSERVED_REPLICA,
        "--request-log", str(run_dir / "requests.jsonl"),
        "--profile-dir", str(run_dir / "profiles"),
        "--log-stats-interval", "0.5",
    )  # fmt: skip
    with running(srv):
        yield srv


OBSERVED_REPLICA = "replica-a"  # observed_server's --replica-id
