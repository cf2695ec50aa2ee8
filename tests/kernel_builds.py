"""Our C++ extensions in tests. An extension that does not build is our breakage, not the machine's:
under CI (`CI=true`, which the CI sets) the test fails with the compiler's errors, so a broken build
cannot pass green; on a developer machine it skips with those errors as the reason, and the rest of
the suite still runs. Only VLM_ENGINE_DISABLE_CPU_KERNEL (a deliberate choice) skips everywhere."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import NoReturn

import pytest

from vlm_engine.kernels import build

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def build_warnings() -> Iterator[list[str]]:
    """The warnings `vlm_engine.kernels.build` logs meanwhile: a failed build's compiler errors."""
    handler = _Collect()
    build.logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        build.logger.removeHandler(handler)


def require_extension(load: Callable[[], ModuleType | None], what: str) -> ModuleType:
    """`load()`'s module. Its None fails the test under CI and skips it elsewhere, with the build errors."""
    if build.cpu_kernels_disabled():
        pytest.skip(f"{what}: VLM_ENGINE_DISABLE_CPU_KERNEL is set")
    module = load()
    if module is None:
        build_failed(load, what)
    return module


def build_failed(load: Callable[[], ModuleType | None], what: str) -> NoReturn:
    # The loaders cache their result (and the first try's warning may have gone to an earlier
    # test's log): build once more, uncached, to put the errors into this report.
    with build_warnings() as errors:
        getattr(load, "__wrapped__", load)()
    reason = f"{what} did not build: {' | '.join(errors) or 'no build error was logged (see the warning log)'}"
    if IN_CI:
        pytest.fail(f"{reason}\n(CI=true: a C++ extension that does not build fails the suite)", pytrace=False)
    pytest.skip(reason)


def setup_missing(reason: str) -> NoReturn:
    """Something `make test` installs is absent (a Debian package, a weight package, the fuzz corpus):
    under CI that is a broken set-up and fails; elsewhere the test skips with how to get it."""
    if IN_CI:
        pytest.fail(f"{reason}\n(CI=true: `make test` installs this, so its absence is a failure)", pytrace=False)
    pytest.skip(reason)
