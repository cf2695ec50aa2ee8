"""Incremental detokenization with stop strings.

Decoding only a short window of recent tokens (prefix/read offsets, as in TGI and vLLM) keeps the
cost per token constant, and multi-byte characters split across tokens are held back until they
complete. Text that could still turn into a stop string is held back too, so a stream never
shows the start of a stop string it later removes.

`DecodeTokenizer` is the part of a tokenizer that text output uses, held by the `tokenizers`
library alone: the server's detokenizer process runs on it without importing torch or Transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INCOMPLETE = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # everything decoded so far (truncated at a stop string once one is hit)
    emitted: int = 0  # characters of `text` already handed out by `take_delta`
    stopped_on: str | None = None
    _prefix_offset: int = 0
    _read_offset: int = 0
    _decode_ids: Callable[..., str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._decode_ids = fast_decode(self.tokenizer)

    def add(self, new_ids: list[int]) -> bool:
        """Append tokens; returns True when a stop string has now ended the text."""
        if self.stopped_on is not None:
            return True
        start_len = len(self.text)
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(INCOMPLETE):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        return self._check_stop(start_len)

    def _check_stop(self, start_len: int) -> bool:
        if not self.stop or len(self.text) == start_len:
            return False
        longest = max(len(s) for s in self.stop)
        window_start = max(0, start_len - longest + 1)
        best = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.stopped_on = best[1]
        return True

    def take_delta(self, finished: bool) -> str:
        """New text that is safe to show now (all of it once finished)."""
        end = len(self.text)
        if not finished and self.stop and self.stopped_on is None:
            end = max(self.emitted, end - self._partial_stop_len())
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        # Longest suffix of the text that is a proper prefix of some stop string.
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)


def fast_decode(tokenizer: Any) -> Callable[..., str]:
    """The tokenizer's `decode(ids, skip_special_tokens=...)`, straight from its Rust backend where
    Transformers' wrapper would only pass the ids through (no clean-up of tokenization spaces):
    the wrapper's argument conversion cost ~2 us of each ~3 us call (SmolLM2, 4 ids), and every
    generated token is decoded twice, for each running request, every step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


@dataclass(frozen=True)
class DecodeTokenizer:
    """`decode(ids, skip_special_tokens=...)` as a Transformers fast tokenizer answers it, from its
    Rust backend alone (`tokenizers.Tokenizer`). Text output needs nothing else from a tokenizer,
    and importing Transformers and torch for it cost the server's detokenizer ~0.7 GiB of RSS.

    Built from the Transformers tokenizer itself (`decode_tokenizer`), never from the files on
    disk: loading can add tokens and mark them special, and the backend carries exactly that."""

    backend_tokenizer: Any  # tokenizers.Tokenizer
    clean_up_tokenization_spaces: bool = False  # the wrapper's clean-up, where it applies one

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def to_json(self) -> str:
        return json.dumps({"tokenizer": self.backend_tokenizer.to_str(), "clean_up": self.clean_up_tokenization_spaces})

    @classmethod
    def from_json(cls, text: str) -> DecodeTokenizer | None:
        """The tokenizer `to_json` wrote; None where the writer had none (`decode_tokenizer` refused)."""
        from tokenizers import Tokenizer

        spec = json.loads(text)
        if spec.get("tokenizer") is None:
            return None
        return cls(Tokenizer.from_str(spec["tokenizer"]), bool(spec["clean_up"]))


def clean_up_tokenization(text: str) -> str:
    """Transformers' `PreTrainedTokenizerBase.clean_up_tokenization`, replacement for replacement."""
    for old, new in _CLEAN_UPS:
        text = text.replace(old, new)
    return text


_CLEAN_UPS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip
_PROBE = "Héllo , wörld . Is it ? Yes ! It ' s , isn 't it 's I 'm we 've they 're — 😀 €5"


def decode_tokenizer(tokenizer: Any) -> DecodeTokenizer | None:
    """A Transformers fast tokenizer's decode as a `DecodeTokenizer`, or None where it cannot be one
    exactly: no Rust backend (a slow or custom tokenizer), a class with its own decode, or a probe
    (text, special tokens, ids across the vocabulary; special tokens kept and skipped) that decodes
    differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not _decodes_as_transformers_backend(tokenizer):
        return None
    from tokenizers import Tokenizer

    # Transformers' TokenizersBackend._decode: a BPE model skips the clean-up unless forced.
    skip_bpe = type(backend.model).__name__ == "BPE" and not getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    clean = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and not skip_bpe
    light = DecodeTokenizer(Tokenizer.from_str(backend.to_str()), clean)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    probe = [
        list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"]),
        list(getattr(tokenizer, "all_special_ids", []))[:8],
        list(range(0, vocab, max(1, vocab // 997))),
    ]
    for ids in probe:
        for skip in (True, False):
            if light.decode(ids, skip_special_tokens=skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                return None
    return light


def _decodes_as_transformers_backend(tokenizer: Any) -> bool:
    """The class decodes with Transformers' own TokenizersBackend code (no override anywhere)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another Transformers layout: take the full tokenizer
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    )
