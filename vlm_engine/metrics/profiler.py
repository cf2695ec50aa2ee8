"""On-demand torch profiler traces of a server process (`POST /start_profile`, `/stop_profile`).

A trace is Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.
While no trace runs, `range()` is a no-op context, so the step loop pays nothing for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from vlm_engine import ipc


class TorchProfiler:
    def __init__(self, process_name: str) -> None:
        self.process_name = process_name
        self._profile: Any = None
        self._directory: Path | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> None:
        if self._profile is not None:
            raise RuntimeError("a profile is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()

    def stop(self) -> str:
        """Stops the trace and writes it; returns the file's path."""
        if self._profile is None or self._directory is None:
            raise RuntimeError("no profile is running")
        profile, self._profile = self._profile, None
        profile.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self._directory / f"{self.process_name}-{os.getpid()}-{stamp}.trace.json"
        profile.export_chrome_trace(str(path))
        return str(path)

    def control(self, msg: ipc.ProfileControl) -> ipc.ProfileDone:
        """Carry out a start or stop request; the answer for the API (an error when it cannot)."""
        try:
            if msg.start:
                self.start(msg.directory)
                return ipc.ProfileDone(started=True, process=self.process_name)
            return ipc.ProfileDone(started=False, path=self.stop(), process=self.process_name)
        except (RuntimeError, OSError) as exc:  # start while running, stop while stopped, an unwritable dir
            return ipc.ProfileDone(started=msg.start, error=str(exc), process=self.process_name)

    def range(self, name: str) -> Any:
        """A named span in the trace (the engine step, say), only while a trace runs."""
        if self._profile is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(name)
