"""The side-by-side runner's memory comparison (issue 49): the sides it adds, the one KV size every side gets, the
weights it reports and its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import models
import peers
import side_by_side as SBS


class _FakeLlama(peers.LlamaCpp):
    def convert(self, hf_dir: Path, outtype: str, mmproj: bool = False, extra: tuple[str, ...] = ()) -> Path:
        return Path(f"/gguf/{'mmproj-' if mmproj else ''}{outtype}.gguf")


def _checkpoint(tmp_path: Path) -> Path:
    text = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 36}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {**text, "max_position_embeddings": 128000}}))
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 24)
    return tmp_path


def test_ours_two_layouts_side_and_one_kv_size_for_every_side(tmp_path: Path) -> None:
    hf = _checkpoint(tmp_path)
    q25 = models.MODELS["qwen2.5-vl-3b"]
    two = peers.side_spec("ours two-layouts", q25, hf, slots=4, kv_tokens=16_384)
    assert two.extra_args == ("--weight-layouts", "two") and two.command(1)[-4:] == [
        "--kv-cache-tokens", "16384", "--weight-layouts", "two"]  # fmt: skip
    assert peers.side_spec("ours", q25, hf, slots=4, kv_tokens=16_384).extra_args == ()
    llama = _FakeLlama(Path("/bin/llama-server"))
    given = peers.side_spec("llama.cpp BF16 + mmproj", q25, hf, slots=4, kv_tokens=16_384, llama=llama)
    assert given.kv_tokens == 16_384  # over the model's trained context
    assert peers.side_spec("llama.cpp BF16", q25, hf, slots=4, kv_tokens=None, llama=llama).kv_tokens == 128000
    # vLLM's cache space in whole GiB: 36 layers x 2 KV heads x 128 x (K, V) x bf16 = 36,864 B a token.
    assert peers.kv_bytes_per_token(hf) == 36_864
    vllm = peers.side_spec("vllm bf16", q25, hf, slots=4, kv_tokens=65_536)
    assert peers.ADAPTERS["vllm"].env(vllm)["VLLM_CPU_KVCACHE_SPACE"] == "3"  # 2.25 GiB, rounded up
    unsized = peers.side_spec("vllm bf16", q25, hf, slots=4, kv_tokens=None)
    assert peers.ADAPTERS["vllm"].env(unsized)["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_weight_bytes_counts_the_checkpoint_or_the_gguf_and_its_projector(tmp_path: Path) -> None:
    hf = _checkpoint(tmp_path)
    assert peers.weight_bytes(peers.ServerSpec("ours", str(hf))) == 1024
    (tmp_path / "text.gguf").write_bytes(b"x" * 100)
    (tmp_path / "mmproj.gguf").write_bytes(b"x" * 10)
    spec = peers.ServerSpec(
        "llamacpp", str(tmp_path / "text.gguf"), extra_args=("--mmproj", str(tmp_path / "mmproj.gguf"))
    )
    assert peers.weight_bytes(spec) == 110


def test_memory_table_has_start_up_peak_and_steady_columns() -> None:
    info = {"server": "ours", "rep": 1, "model_dir": "/m/smolvlm", "kv": 16384, "kv_log": "16,384 tokens",
            "startup_s": 54.0} | {key: (k + 1) * 2**30 for k, key in enumerate(SBS.MEMORY_COLUMNS)}  # fmt: skip
    head, _, row = SBS.memory_table([info, {"server": "vllm bf16", "rep": 1, "error": "x"}], "avx512_bf16")
    assert "start-up peak" in head and "steady RSS" in head and "peak RSS (tree)" in head and "Σ PSS steady" in head
    assert row.split(" | ")[1:] == ["avx512_bf16", "smolvlm", "16384; log: 16,384 tokens", "54", "1.00", "2.00",
                                    "3.00", "4.00", "5.00", "6.00", "7.00", "8.00 |"]  # fmt: skip
    assert "memory" in SBS.SUITES and SBS.SUITES["memory"].kv_tokens == 16_384
    assert {p.model for p in SBS.SUITES["llamacpp-qwen2.5-vl-7b"].plans} == {"qwen2.5-vl-7b"}
