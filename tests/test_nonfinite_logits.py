"""Logits that come out NaN or infinite fail their own request only: the batch goes on.

The model under test is the tiny Qwen2-VL with one token's embedding row set to NaN (a real
checkpoint on disk, written here): a prompt holding that token has NaN hidden states, so its
logits are NaN, while every other sequence in the same batch computes as usual. Before, a sampled
row's `torch.multinomial` raised and the whole step failed (every request in the batch a 500).
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.server_helpers import ServerProcess, running
from vlm_engine import Engine, SamplingParams
from vlm_engine.runner.sampler import sample

POISON_TEXT = "quokka pineapple"
NORMAL = [{"role": "user", "content": "Describe a small red square."}]
POISONED = [{"role": "user", "content": f"Describe a {POISON_TEXT}."}]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)


def test_sample_returns_none_for_rows_without_a_distribution() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, logprobs=2)
    out = sample(logits, [greedy, sampled, greedy, sampled, sampled], [None] * 5)
    assert [t is None for t in out] == [False, True, True, True, False]
    assert out[0].token_id == int(logits[0].argmax())
    assert out[4].logprob is not None and math.isfinite(out[4].logprob)
    half = sample(logits.to(torch.bfloat16), [greedy] * 5, [None] * 5)  # the model's bf16 logits
    assert [t is None for t in half] == [False, True, True, True, False]


@pytest.fixture(scope="module")
def poisoned_vlm_dir(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """The tiny checkpoint with a NaN embedding for a token only POISONED's prompt holds (not the
    chat template, not NORMAL's prompt, not NORMAL's greedy output); also NORMAL's greedy tokens."""
    clean = Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=1024, max_model_len=512)
    normal_ids = clean.process_messages(NORMAL).token_ids
    normal_out = clean.chat([NORMAL], GREEDY)[0].token_ids
    candidates = set(clean.process_messages(POISONED).token_ids) - set(normal_ids) - set(normal_out)
    assert candidates, "the poison text shares every token with the normal request"
    out = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(tiny_vlm_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"][min(candidates)] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out, normal_out


def test_engine_aborts_only_the_request_whose_logits_are_nan(poisoned_vlm_dir: tuple[Path, list[int]]) -> None:
    model_dir, normal_out = poisoned_vlm_dir
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024, max_model_len=512)
    for params in (SAMPLED, GREEDY):  # sampling used to raise in multinomial; greedy to emit junk
        poisoned, normal = engine.chat([POISONED, NORMAL], [params, GREEDY])
        assert poisoned.finished and poisoned.finish_reason == "abort" and poisoned.token_ids == []
        assert normal.finish_reason == "length" and normal.token_ids == normal_out  # same batch, unharmed
        assert not engine.has_unfinished  # the aborted request's pages are free again
        assert engine.pool.num_free == engine.pool.num_pages
        engine.pool.check_invariants()


@pytest.mark.slow
def test_server_fails_the_nan_request_with_a_500_and_serves_the_rest(
    poisoned_vlm_dir: tuple[Path, list[int]], tmp_path: Path
) -> None:
    model_dir, _ = poisoned_vlm_dir
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--served-model-name", "m", "--kv-cache-tokens", "4096")
    with running(srv):
        results: dict[str, httpx.Response] = {}

        def post(name: str, messages: list[dict[str, Any]], temperature: float, max_tokens: int) -> None:
            body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": 1}
            results[name] = httpx.post(
                srv.base_url + "/chat/completions", json={**body, "ignore_eos": True}, timeout=120
            )

        # The normal request is still decoding (~1 s of tiny-model steps) when the poisoned one is
        # prefilled: they share steps.
        normal = threading.Thread(target=post, args=("normal", NORMAL, 0.0, 1500))
        normal.start()
        time.sleep(0.3)
        post("poisoned", POISONED, 0.8, 16)
        normal.join()
        assert results["normal"].status_code == 200, results["normal"].text  # in the failed batch, before
        assert results["normal"].json()["usage"]["completion_tokens"] == 1500
        assert results["poisoned"].status_code == 500
        assert "not finite" in results["poisoned"].json()["error"]["message"]
        after = httpx.post(
            srv.base_url + "/chat/completions",
            json={"model": "m", "messages": NORMAL, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True},
            timeout=60,
        )
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 12
        assert "not finite" in srv.log()  # the engine core logged which request it stopped
