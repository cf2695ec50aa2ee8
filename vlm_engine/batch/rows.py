"""The output file: one JSON line per input, appended as each finishes, and what a rerun skips.

Each row is one `os.write` on an O_APPEND descriptor, so rows never interleave; a process killed
mid-write leaves at most a torn last line, which the next run cuts off (that input is then done
again). Rows carry the item's key (content hash + prompt + schema); OpenAI batch output rows carry
their `custom_id`, as OpenAI's format has it."""

from __future__ import annotations

import json
import os
from typing import Any

from vlm_engine.batch.inputs import WorkItem


class RowWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self.done_keys: set[str] = set()
        self.done_custom_ids: set[str] = set()
        self.repaired_bytes = 0
        if os.path.exists(path):
            self._load()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn last line from a killed run
            self.repaired_bytes = len(data) - end
            with open(self.path, "r+b") as f:
                f.truncate(end)
            data = data[:end]
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line damaged some other way: its input is simply done again
            if "key" in row:
                self.done_keys.add(row["key"])
            elif "custom_id" in row:
                self.done_custom_ids.add(str(row["custom_id"]))

    def is_done(self, item: WorkItem) -> bool:
        if item.kind == "openai":
            return item.custom_id in self.done_custom_ids
        return item.key in self.done_keys

    def write(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        view = memoryview(line)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        os.close(self._fd)
