"""Starting, watching and stopping the server's child processes.

Every child is started with the `spawn` method (no forked torch / zmq state), names itself (so
`top` and `ps -o comm` show what it is), asks the kernel to kill it when the API process dies (no
orphans even after a SIGKILL of the parent), ignores SIGINT (a Ctrl-C reaches the whole process
group; the parent decides the shutdown order) and exits cleanly on SIGTERM.

Side processes (API, preprocess, detokenizer) run at a lower priority (nice 10 by default, see
`ServerConfig.process.side_process_nice`) with one torch thread: on a small CPU box a side process
competing at full priority made a 2-thread engine step up to 3.8x slower (shared/CPU-PERF.md);
the engine core keeps normal priority and all of torch's threads. A side process that needs no
torch (the detokenizer) never imports it: torch alone is ~0.5 GiB of RSS in each process.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s[%(process)d] %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def _prctl(option: int, value: Any) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no-op
        pass


def set_process_name(name: str) -> None:
    _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def lower_priority(nice: int) -> None:
    if nice <= 0:
        return
    try:
        os.nice(nice - os.nice(0))
    except OSError:
        pass


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Get `sig` when the parent process dies (Linux), and exit now if it already has."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent or parent == 1:  # the parent died before the prctl took effect
        os._exit(1)


def init_child(name: str, log_level: str, side: bool, nice: int = 10, uses_torch: bool = True) -> None:
    """First thing a child does: name, lifetime tied to the parent, signals, priority, threads
    (`uses_torch`: a side child gets one torch thread; without it torch stays unimported)."""
    die_with_parent(signal.SIGKILL)
    set_process_name(name)
    multiprocessing.current_process().name = name
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup_logging(log_level)
    if side:
        lower_priority(nice)
    if side and uses_torch:
        import torch

        torch.set_num_threads(1)


_serving = False  # set once serve_forever's loop runs: from then on SIGTERM unwinds through close()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # Before the main loop a child holds nothing to close, and a SystemExit raised there can land
    # in a finalizer (a regex object's __del__ during an import), which swallows it with a printed
    # traceback and lets start-up go on: leave at once instead.
    if not _serving:
        exit_child(0)
    raise SystemExit(0)


def exit_child(code: int = 0) -> None:
    """Leave without the interpreter's teardown: with torch and transformers loaded it takes
    seconds, and a child has nothing left to flush but its logs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve_forever(name: str, loop: Callable[[Callable[[], bool]], None], close: Callable[[], None]) -> None:
    """Run a child's main loop until SIGTERM (exit 0), a dead parent (0) or a crash (1, logged)."""
    global _serving
    parent = os.getppid()
    code = 0
    _serving = True
    try:
        loop(lambda: os.getppid() == parent)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        logging.getLogger(name).exception("%s crashed", name)
        code = 1
    finally:
        try:
            close()
        finally:
            exit_child(code)


def run_entry_point(entry_point: str, *args: Any) -> None:
    """Child-side trampoline: import "module:function" and run it. The parent names children's
    code by string so it never imports torch and the engine itself (the API process stays light)."""
    import importlib

    module, _, function = entry_point.partition(":")
    getattr(importlib.import_module(module), function)(*args)


@dataclass
class Child:
    name: str
    entry_point: str  # "package.module:function", imported in the child only
    args: tuple[Any, ...]
    process: Any = None
    worker_index: int | None = None  # preprocess workers: restartable (see launcher._restart_workers)
    restart_times: list[float] = field(default_factory=list)  # time.monotonic() of recent restarts

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if self.process is not None else None


@dataclass
class ChildGroup:
    """The children of one server run, started together and stopped together."""

    children: list[Child] = field(default_factory=list)

    def add(self, name: str, entry_point: str, *args: Any, worker_index: int | None = None) -> None:
        self.children.append(Child(name, entry_point, args, worker_index=worker_index))

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def restart(self, child: Child) -> None:
        """Reap a dead child and start it again with the same arguments."""
        if child.process is not None:
            child.process.join(1.0)
        self._spawn(child)

    @staticmethod
    def _spawn(child: Child) -> None:
        ctx = multiprocessing.get_context("spawn")
        child.process = ctx.Process(
            target=run_entry_point, args=(child.entry_point, *child.args), name=child.name, daemon=False
        )
        child.process.start()
        logger.info("started %s (pid %d)", child.name, child.pid)

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.process is not None and not c.process.is_alive()]

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM everyone, wait, then SIGKILL whoever is left; always reaps every child."""
        for child in self.children:
            if child.alive:
                child.process.terminate()
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.process is None:
                continue
            child.process.join(max(0.0, deadline - time.monotonic()))
            logger.debug("%s exited with %s", child.name, child.process.exitcode)
            if child.process.is_alive():
                logger.warning("%s (pid %d) did not exit after SIGTERM; killing it", child.name, child.pid)
                child.process.kill()
                child.process.join(5.0)
