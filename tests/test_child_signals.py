"""A child process told to stop (SIGTERM) during start-up leaves at once, quietly, with status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

# The child is inside a finalizer when SIGTERM arrives, as a preprocess worker was when the engine
# core refused a checkpoint while the worker still imported: an exception raised there is
# swallowed (with a printed traceback) and start-up would go on.
_CHILD = textwrap.dedent(
    """
    import time
    from vlm_engine.server.procs import init_child

    class SlowFinalizer:
        def __del__(self):
            print("in finalizer", flush=True)
            time.sleep(5)

    init_child("vlm-test", "INFO", side=False)
    finalizing = SlowFinalizer()
    del finalizing
    print("start-up went on", flush=True)
    """
)


def test_sigterm_during_start_up_exits_at_once_without_a_traceback() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "in finalizer"
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=4)  # the finalizer alone would take 5 s
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    assert "start-up went on" not in out
    assert "Traceback" not in err, err
