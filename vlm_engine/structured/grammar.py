"""Constrained decoding with llguidance: grammars compiled once per spec, one matcher per request.

Why llguidance (measured in benchmarks/grammar_libraries.py, see docs/ARCHITECTURE.md): grammars
need no ahead-of-time compilation (its lexer is built lazily and shared by `deep_copy`), token
masks are computed in Rust with the GIL dropped, its JSON-Schema coverage includes everything our
schema set uses, and it has no Python dependencies.

JSON is generated with fixed separators (", " and ": ", no free whitespace): a model cannot spend
its token budget on whitespace, and the output reads like `json.dumps`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from vlm_engine.structured.closing import END, Closer
from vlm_engine.structured.spec import StructuredOutput, StructuredOutputError

logger = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled grammars kept (LRU); a data-processor run repeats a handful


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec (no tokenizer needed; validity is checked by `validate`)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.kind == "json_schema":
        return matcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        # Lark string literals take JSON escapes, so any choice text is expressed exactly.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choices))
    from llguidance.gbnf_to_lark import any_to_lark

    # GBNF / EBNF (rules with ::=, as llama.cpp and xgrammar take them) or Lark, llguidance's own.
    return matcher.grammar_from_lark(any_to_lark(spec.spec))


class GrammarCompiler:
    """Owns the llguidance view of one tokenizer; compiles and caches grammars by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] | set[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids) or [int(tokenizer.eos_token_id)]
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        self.closer = Closer.for_tokenizer(tokenizer)
        self._templates: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # workers validate from one thread; the core may compile from two

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def validate(self, spec: StructuredOutput) -> None:
        """Raise StructuredOutputError naming the problem if the spec cannot be enforced."""
        self._template(spec)

    def matcher(self, spec: StructuredOutput, ignore_eos: bool = False) -> GrammarMatcher:
        return GrammarMatcher(self._template(spec).deep_copy(), self, ignore_eos)

    def _template(self, spec: StructuredOutput) -> Any:
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
        import llguidance

        try:
            text = grammar_text(spec)
        except Exception as exc:  # noqa: BLE001 - llguidance's GBNF -> Lark converter raises plain Exceptions
            raise StructuredOutputError(f"invalid {_kind_name(spec)}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.ll_tokenizer)
        if is_error:
            raise StructuredOutputError(f"invalid {_kind_name(spec)}: {'; '.join(messages)}")
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            raise StructuredOutputError(f"invalid {_kind_name(spec)}: {template.get_error()}")
        with self._lock:
            self._templates[spec] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return template


def _kind_name(spec: StructuredOutput) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object constraint"}.get(spec.kind, spec.kind)


class GrammarMatcher:
    """One request's position in its grammar.

    Invariant: the matcher has consumed exactly the request's output tokens, minus a final EOS.
    Recompute preemption keeps output tokens, so a preempted request resumes with this state as is.
    """

    def __init__(self, matcher: Any, compiler: GrammarCompiler, ignore_eos: bool) -> None:
        self.m = matcher
        self.compiler = compiler
        self.ignore_eos = ignore_eos
        self.closing = compiler.closer.start(matcher)

    # ---- before the forward pass (the mask thread) ------------------------------------------

    def fill_mask(self, row: np.ndarray, remaining: int) -> None:
        """Write the allowed-token bits for the next token into `row` (int32 words).

        `remaining` counts the tokens this request may still generate, this one included. Near the
        end of the budget the closer takes over, so the output still completes the grammar.
        """
        forced = self.closing.forced_token(self.m, remaining)
        if forced == END and self.ignore_eos:
            forced = None  # cannot end with EOS: let the grammar's mask decide
        eos = self.compiler.eos_token_ids
        if forced is not None:
            row[:] = 0
            _set_bits(row, eos if forced == END else [forced], True)
            return
        self._grammar_mask(row)

    def _grammar_mask(self, row: np.ndarray) -> None:
        eos = self.compiler.eos_token_ids
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.ignore_eos:
            _set_bits(row, eos, False)
        if not row.any():  # nothing allowed (an error state): let it end rather than sample from -inf
            _set_bits(row, eos, True)

    # ---- speculative decoding ------------------------------------------------------------------

    def can_speculate(self, remaining: int, num_draft: int) -> bool:
        """True when a draft of `num_draft` tokens stays clear of the closer: outside its window the
        masks are the grammar's alone, so they can be computed ahead for every drafted position."""
        window = self.closing.window
        return window is not None and not self.closing.plan and remaining - num_draft - 1 > window

    def valid_draft(self, draft: list[int]) -> list[int]:
        """The longest prefix of `draft` the grammar accepts (EOS ends a draft: it ends the request)."""
        eos = self.compiler.eos_token_ids
        for i, token in enumerate(draft):
            if token in eos:
                draft = draft[:i]
                break
        if not draft:
            return []
        return draft[: self.m.validate_tokens(draft)]

    def fill_draft_masks(self, rows: np.ndarray, draft: list[int], remaining: int) -> None:
        """Masks for the next token and after each draft token (rows[i]: after draft[:i]); the
        matcher is left as it was. The draft was checked by `valid_draft` under `can_speculate`."""
        self.fill_mask(rows[0], remaining)
        consumed = 0
        for i, token in enumerate(draft):
            if not self.m.consume_token(token):  # not expected; the rows after it are never read
                rows[i + 1 :] = -1
                break
            consumed += 1
            self._grammar_mask(rows[i + 1])
        if consumed:
            self.m.rollback(consumed)

    # ---- after sampling --------------------------------------------------------------------

    def accept(self, token_id: int, remaining_after: int) -> int | None:
        """Advance by a sampled token; returns the token actually taken (the closer may swap a
        free token that would leave too little budget), or None if the grammar rejects it."""
        if token_id in self.compiler.eos_token_ids and not self.ignore_eos:
            return token_id  # ends the request; the matcher never consumes EOS
        if not self.m.consume_token(token_id):
            logger.error("grammar rejected token %d: %s", token_id, self.m.get_error())
            return None
        swap = self.closing.check_after(self.m, token_id, remaining_after)
        if swap == END:
            if not self.ignore_eos:
                self.closing.on_token(-1)
                return self.compiler.eos_token_ids[0]  # complete without the token: end here
            self.m.consume_token(token_id)  # no EOS allowed: keep the model's token
        elif swap is not None:
            if not self.m.consume_token(swap):
                return None
            token_id = swap
        self.closing.on_token(token_id)
        return token_id

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow: the request is complete."""
        return bool(self.m.is_stopped())

    @property
    def is_accepting(self) -> bool:
        return bool(self.m.is_accepting())


def _set_bits(row: np.ndarray, tokens: list[int], allowed: bool) -> None:
    """Allow or forbid tokens in one int32-word bitmask row (bit t % 32 of word t // 32)."""
    for t in tokens:
        bit = np.uint32(1 << (t & 31)).view(np.int32)
        if allowed:
            row[t >> 5] |= bit
        else:
            row[t >> 5] &= ~bit


def build_bitmask(items: list[tuple[int, GrammarMatcher, int, list[int]]], words: int) -> tuple[list[int], np.ndarray]:
    """Masks for the constrained rows of one step: items are (first row, matcher, remaining,
    draft); a request with a draft has one row per drafted position after the first. Returns the
    rows and their [len(rows), words] int32 bitmask (bit t of a row: token t is allowed)."""
    total = sum(1 + len(draft) for _, _, _, draft in items)
    bitmask = np.empty((total, words), dtype=np.int32)
    rows: list[int] = []
    k = 0
    for first, matcher, remaining, draft in items:
        n = 1 + len(draft)
        if draft:
            matcher.fill_draft_masks(bitmask[k : k + n], draft, remaining)
        else:
            matcher.fill_mask(bitmask[k], remaining)
        rows.extend(range(first, first + n))
        k += n
    return rows, bitmask
