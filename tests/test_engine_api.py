"""The Python API around the core: prompts as text / ids, per-request params, sampling controls,
stop conditions, aborts and bad input — on the tiny Qwen2-VL checkpoint."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch

from preprocess.prompt import PromptError
from tests.conftest import make_image
from vlm_engine import Engine, SamplingParams
from vlm_engine.scheduler import RequestRejected


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=2048, max_model_len=512)


def assert_no_pages_held(engine: Engine) -> None:
    assert not engine.has_unfinished
    assert engine.pool.num_free == engine.pool.num_pages
    engine.pool.check_invariants()


def test_generate_accepts_text_and_token_ids(engine: Engine) -> None:
    text_prompt = "The quick brown fox"
    ids = engine.tokenizer(text_prompt)["input_ids"]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    by_text, by_ids = engine.generate([text_prompt, ids], greedy)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.prompt_tokens == len(ids)
    assert by_text.text == engine.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert_no_pages_held(engine)


def test_one_sampling_params_per_prompt(engine: Engine) -> None:
    outs = engine.generate(
        ["a b c", "d e f"],
        [
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        ],
    )
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert all(o.finish_reason == "length" for o in outs)
    with pytest.raises(ValueError):
        engine.generate(["x"], [SamplingParams(), SamplingParams()])


def test_seed_makes_sampling_reproducible(engine: Engine) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return engine.generate(["Once upon a time"], params)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    # A seeded request's tokens do not depend on what else is in the batch.
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1, top_p=0.95, top_k=50, ignore_eos=True)
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = engine.generate(["Once upon a time", "Other text", "More"], [params, noise, noise])[0].token_ids
    assert batched == run(1)


def test_top_k_one_is_greedy(engine: Engine) -> None:
    greedy = engine.generate(["Hello there"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    top1 = engine.generate(["Hello there"], SamplingParams(max_tokens=10, temperature=5.0, top_k=1, ignore_eos=True))[0]
    assert greedy.token_ids == top1.token_ids


def test_stop_token_ids_and_eos(engine: Engine) -> None:
    free = engine.generate(["Count with me"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = engine.generate(["Count with me"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_strings_truncate_text(engine: Engine) -> None:
    free = engine.generate(["Tell me"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = engine.generate(["Tell me"], SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)
    assert_no_pages_held(engine)


def test_logprobs_are_returned(engine: Engine) -> None:
    out = engine.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for lp, token in zip(out.logprobs, out.token_ids):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == token  # greedy picks the top one


def test_abort_mid_decode_frees_pages(engine: Engine) -> None:
    rid = engine.add_request("A long story", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    other = engine.add_request("Another", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    aborted = engine.abort(rid)
    assert aborted is not None and aborted.finish_reason == "abort"
    while engine.has_unfinished:
        engine.step()
    assert_no_pages_held(engine)
    assert engine.abort(other) is None  # already finished


def test_bad_input_is_rejected_without_side_effects(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(RequestRejected):
        engine.generate([list(range(3, 600))], SamplingParams(max_tokens=4))
    with pytest.raises(PromptError):
        engine.chat(
            [
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
                        ],
                    }
                ]
            ]
        )
    with pytest.raises(PromptError):
        engine.chat([[{"role": "wizard", "content": "hi"}]])
    with pytest.raises(PromptError):
        engine.generate([[10**9]])
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert_no_pages_held(engine)


def test_image_as_data_uri_equals_pil_image(engine: Engine) -> None:
    image = make_image(80, 60, 11)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    as_uri = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What?"}],
        }
    ]
    as_pil = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    a, b = engine.chat([as_uri, as_pil], greedy)
    assert a.token_ids == b.token_ids


def test_decode_inputs_equal_the_general_path(engine: Engine) -> None:
    """The runner's decode-only input builder gives exactly the general builder's tensors, step for
    step, for text and image prompts (Qwen2-VL's 3-axis positions after the prompt) in one batch."""
    import torch

    runner = engine.runner
    general = runner._prepare_any
    decode_steps = 0

    def checked(chunks):
        nonlocal decode_steps
        fast, want = runner._prepare_decode(chunks), general(chunks)
        if fast is not None:
            decode_steps += 1
            for name in ("input_ids", "positions"):
                assert torch.equal(getattr(fast, name), getattr(want, name)), name
            for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
                assert torch.equal(getattr(fast.attn_meta, name), getattr(want.attn_meta, name)), name
            assert fast.attn_meta.query_lens_host == want.attn_meta.query_lens_host
            assert fast.attn_meta.seq_lens_host == want.attn_meta.seq_lens_host
            assert (fast.sample_rows, fast.row_offsets) == (want.sample_rows, want.row_offsets)
            assert fast.sample_chunks == want.sample_chunks
        return want

    runner.prepare_inputs = checked
    try:
        image = [
            {
                "role": "user",
                "content": [{"type": "image", "image": make_image(64, 48, 3)}, {"type": "text", "text": "What?"}],
            }
        ]
        text = [{"role": "user", "content": "Count to twenty, slowly."}]
        engine.chat([image, text, image], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    finally:
        del runner.prepare_inputs
    assert decode_steps >= 30
    assert_no_pages_held(engine)


def test_bf16_logits_greedy_sampling_and_logprobs(tiny_vlm_dir: Path) -> None:
    # bf16 logits reach the sampler as they are: greedy takes the argmax of their exact fp32
    # widening, sampling and logprobs convert their rows.
    half = Engine(str(tiny_vlm_dir), dtype="bfloat16", kv_cache_tokens=1024, max_model_len=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    out = half.generate(["a small red square"], params)[0]
    assert len(out.token_ids) == 6 and len(out.logprobs) == 6
    for entry in out.logprobs:
        assert entry.top_logprobs[0][0] == entry.token_id  # greedy: the most likely token
        assert entry.logprob <= 0.0
    sampled = half.generate(["a small red square"], SamplingParams(max_tokens=4, temperature=0.8, seed=3))[0]
    assert 1 <= len(sampled.token_ids) <= 4
    assert_no_pages_held(half)


def test_float16_on_the_cpu_runs_in_bf16(tiny_vlm_dir: Path) -> None:
    # The CPU kernels take fp32 or bf16: before, every fp16 step failed in the attention.
    engine = Engine(str(tiny_vlm_dir), dtype="float16", kv_cache_tokens=1024, max_model_len=256)
    assert engine.dtype == torch.bfloat16
    out = engine.generate(["a small red square"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
