"""The server's process plumbing without processes: message round trips and detokenizer logic."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from tests.conftest import make_image
from vlm_engine import ipc
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server.detokenizer_proc import Detokenizer, load_tokenizer
from vlm_engine.server.engine_core import build_prompt
from vlm_engine.server.preprocess_worker import choice_sampling, encode_engine_request


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir: Path):
    from vlm_engine.models.registry import load_config, prompt_processor, resolve_model

    source = resolve_model(str(tiny_vlm_dir))
    return prompt_processor(source, load_config(source))


def test_engine_request_round_trip_over_zmq_without_pickling(processor, tmp_path: Path) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": make_image(56, 42, seed=1)},
                {"type": "image", "image": make_image(28, 28, seed=2)},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    prompt = processor.from_messages(messages)
    sampling = SamplingParams(max_tokens=5, stop=("x",), seed=3)
    parts = encode_engine_request("r-0", sampling, prompt)
    assert len(parts) == 1 + 1 + 2 + 1  # header, token ids, two pixel tensors, M-RoPE positions

    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        address = f"ipc://{tmp_path / 'test.sock'}"
        pull.bind(address)
        push.connect(address)
        push.send_multipart(parts, copy=False)
        msg, frames = ipc.Decoder(ipc.CoreInbound).decode(pull.recv_multipart(copy=False))
    finally:
        ctx.destroy(linger=0)
    assert isinstance(msg, ipc.EngineRequest) and msg.sampling == sampling
    rebuilt = build_prompt(msg, frames)
    assert rebuilt.token_ids == prompt.token_ids
    assert rebuilt.position_delta == prompt.position_delta
    np.testing.assert_array_equal(rebuilt.positions, prompt.positions)
    for got, want in zip(rebuilt.media, prompt.media, strict=True):
        assert got.span == want.span and got.grid_thw == want.grid_thw and got.kind == want.kind
        assert torch.equal(got.pixel_values, want.pixel_values)


CONTEXT = 512


# Each refuses a prompt that cannot fit the context: (processor, a body-sized text) -> the call.
TOO_LONG = [
    pytest.param(
        lambda proc, huge: proc.from_messages([{"role": "user", "content": huge}], max_prompt_tokens=CONTEXT),
        "messages",
        id="messages",
    ),
    pytest.param(lambda proc, huge: proc.from_text(huge, max_prompt_tokens=CONTEXT), "prompt", id="text"),
    pytest.param(
        lambda proc, huge: proc.from_token_ids([1] * CONTEXT, max_prompt_tokens=CONTEXT), "prompt", id="token-ids"
    ),
]


@pytest.mark.parametrize(("call", "param"), TOO_LONG)
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(
    processor, monkeypatch: pytest.MonkeyPatch, call: Callable[[Any, str], Any], param: str
) -> None:
    """A body-sized prompt would hold the worker while it tokenizes; the length bound refuses it
    first (and a prompt that may fit is tokenized as before)."""
    from preprocess.prompt import PromptError

    longest = max(len(t) for t in processor.tokenizer.get_vocab())
    huge = "word " * (CONTEXT * longest)
    tokenized: list[int] = []
    tokenizer_call = type(processor.tokenizer).__call__
    monkeypatch.setattr(
        type(processor.tokenizer), "__call__", lambda self, *a, **k: tokenized.append(1) or tokenizer_call(self, *a, **k)
    )
    with pytest.raises(PromptError, match=f"context is {CONTEXT} tokens") as info:
        call(processor, huge)
    assert info.value.param == param and info.value.code == "context_length_exceeded"
    assert not tokenized, "the refused prompt was tokenized"
    fits = processor.from_text("word " * 50, max_prompt_tokens=CONTEXT)
    assert 0 < len(fits.token_ids) < CONTEXT and tokenized


def test_choice_seeds_differ_per_choice() -> None:
    sampling = SamplingParams(seed=10)
    assert [choice_sampling(sampling, i).seed for i in range(3)] == [10, 11, 12]
    assert choice_sampling(SamplingParams(), 2).seed is None


def test_detokenizer_stop_string_finishes_early_and_holds_back(tiny_vlm_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_vlm_dir))
    ids = tokenizer("hello world, this is a test of stopping", add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids)
    stop = "is a"
    detok = Detokenizer(tokenizer)
    params = ipc.DetokParams("r-0", (stop,), None, 7)
    shown, stopped_at = "", None
    for i, token in enumerate(ids):
        out, stopped = detok.process(
            ipc.EngineOutputs(added=[params] if i == 0 else [], outputs=[ipc.TokenOutput("r-0", [token])])
        )
        assert not out.errors
        if out.deltas:
            shown += out.deltas[0].text
            assert stop not in shown
            if out.deltas[0].finished:
                assert out.deltas[0].finish_reason == "stop" and stopped == ["r-0"]
                stopped_at = i
                break
    assert stopped_at is not None and shown == text[: text.index(stop)]
    # Tokens the core made before it saw the stop are dropped; its final output frees the state.
    out, _ = detok.process(ipc.EngineOutputs(outputs=[ipc.TokenOutput("r-0", [ids[0]], True, "stop")]))
    assert out.deltas == [] and detok.streams == {}


def test_detokenizer_eos_is_not_text_and_counts_as_a_token(tiny_vlm_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_vlm_dir))
    eos = tokenizer.eos_token_id
    detok = Detokenizer(tokenizer)
    ids = tokenizer("ok", add_special_tokens=False)["input_ids"]
    out, _ = detok.process(
        ipc.EngineOutputs(
            added=[ipc.DetokParams("r-1", (), 0, 3)],
            outputs=[
                ipc.TokenOutput(
                    "r-1",
                    ids + [eos],
                    True,
                    "stop",
                    stop_token_id=eos,
                    cached_tokens=0,
                    logprobs=[ipc.SampledLogprob(t, -0.5, []) for t in ids + [eos]],
                )
            ],
        )
    )
    delta = out.deltas[0]
    assert delta.text == "ok" and delta.finished and delta.finish_reason == "stop"
    assert delta.completion_tokens == len(ids) + 1 and delta.prompt_tokens == 3
    assert [e.token for e in delta.logprobs][:-1] == [tokenizer.decode([t]) for t in ids]
