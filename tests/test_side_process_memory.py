"""The server's detokenizer runs on the `tokenizers` library alone (no torch, no Transformers), and
decodes exactly as the Transformers tokenizer the engine and the preprocess workers load."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vlm_engine.detokenizer import DecodeTokenizer, IncrementalDetokenizer, decode_tokenizer
from vlm_engine.ipc import IpcPaths
from vlm_engine.server.detokenizer_proc import await_decode_tokenizer, publish_decode_tokenizer

TEXT = "Héllo wörld — naïve café 😀 costs €5. Isn't it ? Stop here: END and more text after it."


def _family_dirs() -> list[tuple[str, Callable[[], Path]]]:
    from testkit.checkpoints import cached_qwen2_vl, cached_smollm2
    from testkit.gemma3_checkpoints import cached_gemma3
    from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl
    from testkit.smolvlm_checkpoints import cached_smolvlm

    return [
        ("qwen2-vl", lambda: cached_qwen2_vl("tiny")),
        ("smollm2", cached_smollm2),
        ("smolvlm", lambda: cached_smolvlm("tiny")),
        ("qwen2.5-vl", lambda: cached_qwen2_5_vl("tiny")),
        ("qwen3-vl", lambda: cached_qwen3_vl("tiny")),
        ("gemma3", lambda: cached_gemma3("tiny")),
    ]


def _random_ids(tok: Any, rng: random.Random) -> list[list[int]]:
    vocab = len(tok)
    text_ids = list(tok(TEXT, add_special_tokens=False)["input_ids"])
    special = list(tok.all_special_ids)
    mixed = text_ids[:5] + special[:3] + text_ids[5:] + special[-2:]
    return [text_ids, mixed, *([rng.randrange(vocab) for _ in range(40)] for _ in range(20))]


def _streamed(tok: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(tok, stop=stop)
    out = ""
    for token in ids:
        hit = detok.add([token])
        out += detok.take_delta(finished=hit)
        if hit:
            break
    return out + detok.take_delta(finished=True), detok.stopped_on


@pytest.mark.parametrize("family", [name for name, _ in _family_dirs()])
def test_decode_tokenizer_decodes_as_transformers(family: str) -> None:
    model_dir = dict(_family_dirs())[family]()
    full = AutoTokenizer.from_pretrained(str(model_dir))
    published = decode_tokenizer(full)
    assert published is not None, f"{family}: {type(full).__name__} should be held without Transformers"
    light = DecodeTokenizer.from_json(published.to_json())  # as the detokenizer process receives it
    assert light is not None
    rng = random.Random(0)
    for ids in _random_ids(full, rng):
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    text_ids = list(full(TEXT, add_special_tokens=False)["input_ids"])
    for stop in ((), ("END",), ("é c", "€")):
        assert _streamed(light, text_ids, stop) == _streamed(full, text_ids, stop)


def _wordpiece(clean_up: bool) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer (not BPE), where Transformers' clean-up of tokenization spaces applies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "[SEP]", "hello", "world", ".", "?", "!", ",", "'", "s", "n", "t", "m", "isn", "it", "##s"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=clean_up
    )


@pytest.mark.parametrize("clean_up", [True, False])
def test_decode_tokenizer_keeps_the_wrappers_space_clean_up(clean_up: bool) -> None:
    full = _wordpiece(clean_up)
    light = decode_tokenizer(full)
    assert light is not None and light.clean_up_tokenization_spaces is clean_up
    ids = full("hello , world . isn ' t it ? it ' s [SEP] hello !", add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert light.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    assert (light.decode(ids) != light.backend_tokenizer.decode(ids, skip_special_tokens=False)) is clean_up


def test_a_tokenizer_with_its_own_decode_is_not_replaced(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """A class that decodes its own way: nothing light is published, and the detokenizer loads the
    full tokenizer (what it did for every model before)."""
    full = AutoTokenizer.from_pretrained(str(tiny_vlm_dir))

    class OwnDecode(type(full)):  # type: ignore[misc]
        def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    full.__class__ = OwnDecode
    assert decode_tokenizer(full) is None
    paths = IpcPaths(tmp_path)
    publish_decode_tokenizer(full, paths)
    loaded = await_decode_tokenizer(paths, str(tiny_vlm_dir), lambda: True)
    assert not isinstance(loaded, DecodeTokenizer) and hasattr(loaded, "backend_tokenizer")


def test_published_tokenizer_reaches_the_detokenizer(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    full = AutoTokenizer.from_pretrained(str(tiny_vlm_dir))
    paths = IpcPaths(tmp_path)
    assert await_decode_tokenizer(paths, str(tiny_vlm_dir), lambda: False) is None  # nothing yet, parent gone
    publish_decode_tokenizer(full, paths)
    loaded = await_decode_tokenizer(paths, str(tiny_vlm_dir), lambda: True)
    assert isinstance(loaded, DecodeTokenizer)
    ids = list(full(TEXT)["input_ids"])
    assert loaded.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_detokenizer_and_api_processes_never_load_torch(observed_server: Any) -> None:
    """The real server, after it answered: its detokenizer (and the API process) map no libtorch,
    while the detokenizer does map the `tokenizers` library it decodes with."""
    client = observed_server.openai_client()
    reply = client.chat.completions.create(
        model="tiny-vlm", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content is not None
    detok = observed_server.child_pid("detokenizer")
    maps = _mapped_libraries(detok)
    assert "tokenizers" in maps
    assert "libtorch" not in maps, "the detokenizer loaded torch"
    assert "libtorch" not in _mapped_libraries(observed_server.proc.pid), "the API process loaded torch"
    assert "libtorch" in _mapped_libraries(observed_server.child_pid("preprocess-0"))  # the check can see torch
