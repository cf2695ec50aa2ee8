"""Incremental detokenization equals a full decode; stop strings truncate and are never streamed."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from vlm_engine.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld — naïve café 😀 costs €5. Stop here: END and more text after it."


def tokenizer(tiny_vlm_dir: Path):
    return AutoTokenizer.from_pretrained(str(tiny_vlm_dir))


def test_incremental_text_equals_full_decode(tiny_vlm_dir: Path) -> None:
    tok = tokenizer(tiny_vlm_dir)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    streamed = ""
    for token in ids:
        detok.add([token])
        streamed += detok.take_delta(finished=False)
    streamed += detok.take_delta(finished=True)
    assert streamed == detok.text == tok.decode(ids) == TEXT


def test_stop_string_truncates_and_partial_stop_is_held_back(tiny_vlm_dir: Path) -> None:
    tok = tokenizer(tiny_vlm_dir)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, stop=("END",))
    streamed = ""
    for token in ids:
        hit = detok.add([token])
        streamed += detok.take_delta(finished=hit)
        assert "E" not in streamed[streamed.find("here:") :] or hit  # no prefix of the stop leaks early
        if hit:
            break
    assert hit and detok.stopped_on == "END"
    assert streamed == detok.text == TEXT[: TEXT.index("END")]


def test_fast_decode_is_the_tokenizers_decode(tiny_vlm_dir: Path) -> None:
    """The Rust backend's decode, taken where Transformers' wrapper adds nothing, gives the same text
    (special tokens kept or skipped); a tokenizer that cleans up spaces keeps its own decode."""
    from vlm_engine.detokenizer import fast_decode
    from testkit.checkpoints import cached_smollm2

    for tok in (tokenizer(tiny_vlm_dir), AutoTokenizer.from_pretrained(str(cached_smollm2()))):
        decode = fast_decode(tok)
        assert decode == tok.backend_tokenizer.decode
        ids = tok(TEXT, add_special_tokens=False)["input_ids"] + tok.all_special_ids[:2]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
        tok.clean_up_tokenization_spaces = True
        assert fast_decode(tok) == tok.decode
