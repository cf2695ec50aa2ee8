"""testkit's shard-by-shard writer (the Qwen2.5-VL-7B-shaped `bench-7b` preset): the same tensors, under the same
names, as the whole-model writer, so a 15 GiB checkpoint can be built without holding the model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from testkit.qwen_vl_checkpoints import QWEN2_5_VL, QWEN2_5_VL_PRESETS, _write_sharded, qwen2_5_vl_config


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_sharded_writer_matches_the_whole_model_writer(tmp_path: Path) -> None:
    from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl

    whole = cached_qwen2_5_vl("tiny")
    small_shards = {**QWEN2_5_VL_PRESETS["tiny"], "shard_bytes": 300_000}
    row = replace(QWEN2_5_VL, presets={"tiny": small_shards})
    sharded = _write_sharded(row, tmp_path / "sharded", "tiny")
    assert len(list(sharded.glob("*.safetensors"))) > 3
    expected, got = _tensors(whole), _tensors(sharded)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    index = (sharded / "model.safetensors.index.json").read_text()
    assert all(f'"{name}"' in index for name in expected)
    for name in ("config.json", "generation_config.json", "processor_config.json", "tokenizer.json"):
        assert (sharded / name).read_text() == (whole / name).read_text(), name


def test_bench_7b_is_qwen2_5_vl_7b_shaped() -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    ids = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|image_pad|>": 2, "<|video_pad|>": 3}
    ids |= {"<|vision_start|>": 4, "<|vision_end|>": 5}
    config = qwen2_5_vl_config(QWEN2_5_VL_PRESETS["bench-7b"], ids)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert config.text_config.vocab_size == 152064 and not config.tie_word_embeddings
    assert 8.28e9 < params < 8.30e9  # Qwen2.5-VL-7B-Instruct: 8,292,166,656
