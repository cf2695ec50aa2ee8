"""Finishing a constrained output inside its token budget.

A model whose free text is noise can wander inside a JSON string or a digit run until
`max_tokens`, leaving output that does not parse. The closer keeps one invariant for every
constrained request: the tokens left always suffice to reach an accepting state. It measures a
short completion from the current state greedily (forced stretches in the grammar's own tokens,
otherwise one printable character at a time: close strings and containers first, then the
shortest values; two preference orders, the shorter result wins; repeated characters are
skipped so a run cannot loop), and only near the end of the budget: there it forces that
completion, and it swaps a sampled token that would break the invariant for the completion's
first one (or ends the output, if it was complete without that token).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

# Closers first, then the comma (it ends a number, and is only allowed in a container when the
# closer is not: a required key or minItems), then "@" (an email format ends only after one),
# then the shortest values, then the rest of ASCII. Digits before the comma would grow a number
# forever; "." before "-" grows a date-time's fraction instead of reaching its time zone.
PREFERENCE = (
    '"}]),@0123456789ntf[{-.:' + "abcdefghijklmopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" + " !#$%&'*+/;<=>?@\\^_`|~("
)
# A second order tried too (the shorter completion wins): sentence-like terminators right after
# the closers, for regexes such as "[a-z]+(, [a-z]+)*\." that the first order lengthens.
TERMINATORS_FIRST = '"}])' + ".!?;" + PREFERENCE
SLACK = 4  # start forcing a little early: a free token can lengthen the completion
# Loop breaking: a character used MAX_REPEATS times among the last RECENT steps is skipped (a
# digit run, "nnnt" in a word), except closers, which may repeat MAX_CLOSER_RUN times in a row
# (deep nesting) before they too are skipped (a "}" run inside an email's local part).
RECENT, MAX_REPEATS, MAX_CLOSER_RUN = 32, 3, 16
CLOSERS = frozenset('"}])')
END = -1  # check_after's answer "end the output here": it was complete before the last token
MAX_COMPLETION = 512  # longer completions are not searched for (the closer then stays off)


@dataclass
class Closer:
    """The per-tokenizer part: the token id of each character, in each preference order."""

    orders: list[list[int]]
    closer_ids: frozenset[int] = frozenset()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Closer:
        singles = printable_single_char_tokens(tokenizer)
        orders = [
            [singles[c] for c in dict.fromkeys(order) if c in singles] for order in (PREFERENCE, TERMINATORS_FIRST)
        ]
        return cls(orders, frozenset(singles[c] for c in CLOSERS if c in singles))

    def start(self, matcher: Any) -> ClosingState:
        return ClosingState(self)

    def completion(self, matcher: Any, limit: int) -> list[int] | None:
        """Token ids of a short completion to an accepting state, or None past `limit` tokens:
        the shorter of the greedy completions in each preference order."""
        best: list[int] | None = None
        for order in self.orders:
            path = self._greedy(matcher, order, limit if best is None else len(best) - 1)
            if path is not None:
                best = path
                if not best:
                    break
        return best

    def _greedy(self, matcher: Any, order: list[int], limit: int) -> list[int] | None:
        """Forced stretches (e.g. a required key) in the grammar's own multi-character tokens, the
        rest one preferred character at a time. The matcher is left exactly as it was."""
        path: list[int] = []
        try:
            while not matcher.is_accepting():
                if len(path) >= limit:
                    return None
                forced = matcher.compute_ff_tokens()
                if forced:
                    if not matcher.consume_tokens(forced):
                        return None
                    path.extend(forced)
                    continue
                token = self._next_char(matcher, order, path)
                if token is None or not matcher.consume_token(token):
                    return None  # no single-character step: leave the closer off
                path.append(token)
            return path if len(path) <= limit else None
        finally:
            if path:
                matcher.rollback(len(path))

    def _next_char(self, matcher: Any, order: list[int], path: list[int]) -> int | None:
        recent = path[-RECENT:]
        run = path[-MAX_CLOSER_RUN:]
        fallback = None
        for token in order:
            if matcher.validate_tokens([token]) != 1:
                continue
            if token in self.closer_ids:
                looping = len(run) == MAX_CLOSER_RUN and all(t == token for t in run)
            else:
                looping = recent.count(token) >= MAX_REPEATS
            if not looping:
                return token
            fallback = fallback if fallback is not None else token
        return fallback


class ClosingState:
    """One request's closer: measures its first completion once, then watches the last stretch."""

    def __init__(self, closer: Closer) -> None:
        self.closer = closer
        self.window: int | None = None  # budget below which completions are measured every step
        self.plan: list[int] = []  # the completion being forced, followed to its end once begun

    def _in_window(self, matcher: Any, remaining: int) -> bool:
        if self.window is None:
            first = self.closer.completion(matcher, MAX_COMPLETION)
            # Twice the first completion plus a margin: deeper nesting later is usually a few levels.
            self.window = 0 if first is None else 2 * len(first) + 16
        return remaining <= self.window

    def forced_token(self, matcher: Any, remaining: int) -> int | None:
        if self.plan:
            return self.plan[0]
        if not self._in_window(matcher, remaining):
            return None
        path = self.closer.completion(matcher, remaining + SLACK)
        if path is None or len(path) + SLACK < remaining:
            return None
        if not path:  # complete already: end it on the last token rather than risk breaking it
            return END if remaining <= 1 else None
        self.plan = path
        return path[0]

    def on_token(self, token: int) -> None:
        """The token the matcher just took: the plan advances, or is dropped if it was not its step."""
        if self.plan and self.plan[0] == token:
            self.plan.pop(0)
        else:
            self.plan = []

    def check_after(self, matcher: Any, token: int, remaining_after: int) -> int | None:
        """Called with a free `token` just consumed. If the tokens left no longer suffice, rolls it
        back and returns the completion's first token to take instead (the caller consumes it), or
        END when the output was complete without it."""
        if self.window is None or remaining_after > self.window or matcher.is_accepting():
            return None
        if self.closer.completion(matcher, remaining_after) is not None:
            return None
        matcher.rollback(1)
        before = self.closer.completion(matcher, remaining_after + 1)
        if before is not None:
            return before[0] if before else END
        matcher.consume_token(token)  # no completion either way: keep the model's token
        return None


def printable_single_char_tokens(tokenizer: Any) -> dict[str, int]:
    """Printable ASCII characters that are a token of their own, with their ids."""
    found: dict[str, int] = {}
    for ch in string.printable:
        if ch in "\t\n\r\x0b\x0c":
            continue
        ids = tokenizer.encode(ch, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == ch:
            found[ch] = ids[0]
    return found
