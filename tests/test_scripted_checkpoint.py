"""Tests for testkit.scripted: a hand-weighted Qwen2 that greedily emits a tool call."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from testkit import scripted
from testkit.checkpoints import COMPLETE_MARKER
from testkit.scripted import TOOL_CALL_SCRIPT, cached_scripted_qwen2, tool_call_script, write_scripted_qwen2

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A fresh cache root: exercises cached_scripted_qwen2 and always tests the current builder.
    return cached_scripted_qwen2(tmp_path_factory.mktemp("scripted_cache"))


@pytest.fixture(scope="module")
def tokenizer(scripted_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(scripted_dir))


@pytest.fixture(scope="module")
def hf_model(scripted_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(scripted_dir), dtype=torch.float32).eval()


def _hf_greedy(model: Any, tokenizer: Any, text: str, max_new_tokens: int = 40) -> list[int]:
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_default_script_is_a_hermes_tool_call() -> None:
    assert TOOL_CALL_SCRIPT == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    assert scripted.script_pieces(TOOL_CALL_SCRIPT) == [
        "<tool_call>",
        '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n',
        "</tool_call>",
    ]
    with pytest.raises(ValueError, match="repeat"):  # a bigram model cannot emit two calls
        scripted.script_pieces(TOOL_CALL_SCRIPT + "\n" + tool_call_script("get_time", {}))


def test_checkpoint_files_and_tokens(scripted_dir: Path, tokenizer: Any) -> None:
    names = {f.name for f in scripted_dir.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= names
    config = json.loads((scripted_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id

    # The script is one distinct token per piece, none of them special, so the engine's
    # skip_special_tokens=True detokenization keeps the tool-call markers in the text.
    ids = tokenizer(TOOL_CALL_SCRIPT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(set(ids)) == 3
    assert not set(tokenizer.convert_ids_to_tokens(ids)) & set(tokenizer.all_special_tokens)
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == TOOL_CALL_SCRIPT


def test_builder_is_deterministic(scripted_dir: Path, tmp_path: Path) -> None:
    def digests(path: Path) -> dict[str, str]:
        return {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.iterdir())
            if f.is_file() and f.name != COMPLETE_MARKER
        }

    assert digests(write_scripted_qwen2(tmp_path / "again")) == digests(scripted_dir)


def test_hf_generate_emits_script(hf_model: Any, tokenizer: Any) -> None:
    script_ids = tokenizer(TOOL_CALL_SCRIPT, add_special_tokens=False)["input_ids"]
    for tools in (None, [WEATHER_TOOL]):
        prompt = tokenizer.apply_chat_template(QUESTION, tools=tools, add_generation_prompt=True, tokenize=False)
        generated = _hf_greedy(hf_model, tokenizer, prompt)
        assert generated == script_ids + [tokenizer.eos_token_id]  # stops right after the script
        assert tokenizer.decode(generated, skip_special_tokens=True) == TOOL_CALL_SCRIPT


def test_hf_generate_custom_script(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = "Let me check.\n" + tool_call_script("get_time", {"timezone": "Europe/Paris"})
    path = write_scripted_qwen2(tmp_path / "custom", script)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    generated = _hf_greedy(model, tokenizer, prompt)
    assert generated[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(generated, skip_special_tokens=True) == script


def test_engine_emits_script(scripted_dir: Path, tokenizer: Any) -> None:
    from vlm_engine import Engine, SamplingParams

    engine = Engine(str(scripted_dir), dtype="float32", kv_cache_tokens=1024)
    greedy = SamplingParams(max_tokens=40, temperature=0)
    out = engine.chat([QUESTION], greedy)[0]
    assert out.text == TOOL_CALL_SCRIPT
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == tokenizer.eos_token_id

    # Engine.chat does not forward tools yet: render the tools prompt here, send it as text.
    prompt = tokenizer.apply_chat_template(QUESTION, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    out = engine.generate([prompt], greedy)[0]
    assert (out.text, out.finish_reason) == (TOOL_CALL_SCRIPT, "stop")

    # The scripted logit margin (32) is large enough that sampling follows the script too.
    sampled = engine.chat([QUESTION] * 4, SamplingParams(max_tokens=40, temperature=1.0))
    assert [(o.text, o.finish_reason) for o in sampled] == [(TOOL_CALL_SCRIPT, "stop")] * 4


def test_template_renders_tools(tokenizer: Any) -> None:
    paris = {"city": "Paris", "unit": "celsius"}
    messages = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": paris}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 19}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n" + TOOL_CALL_SCRIPT + "\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n{\"temp\": 19}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    # Without tools: plain ChatML with the default system prompt.
    plain = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The model's own tool call, put back into the history, renders as prompt + script.
    call = {"type": "function", "function": {"name": "get_weather", "arguments": paris}}
    history = QUESTION + [{"role": "assistant", "tool_calls": [call]}]
    assert tokenizer.apply_chat_template(history, tokenize=False) == plain + TOOL_CALL_SCRIPT + "<|im_end|>\n"
