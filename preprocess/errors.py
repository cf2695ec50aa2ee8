"""Errors raised by the preprocessing layer.

Everything in ``preprocess`` that fails because of *client input* (a bad URL,
an undecodable image, a file outside the allowed directory, ...) raises
``MediaError``. The server can turn it into an HTTP 400 without inspecting it.
"""

from __future__ import annotations


class MediaError(ValueError):
    """Invalid or unloadable media in a request.

    The message is written for the API client: it says what was wrong with
    *their* input and never includes server-side details (resolved paths,
    configured directories, memory addresses). Subclassing ``ValueError``
    keeps callers that already treat bad input as ``ValueError`` working.

    ``param`` optionally names the offending request field (OpenAI error
    format). The media layer does not know where in a request a source came
    from, so it usually leaves it ``None`` and the server fills it in with
    ``with_param``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def with_param(self, param: str) -> MediaError:
        """Return a copy naming ``param``; keeps the original as ``__cause__``."""
        err = MediaError(self.message, param=param)
        err.__cause__ = self
        return err

    def __repr__(self) -> str:
        return f"MediaError({self.message!r}, param={self.param!r})"


class PromptError(ValueError):
    """A malformed request (messages, prompt); the message is safe to show the client."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # OpenAI's error code, when there is one (context_length_exceeded)
