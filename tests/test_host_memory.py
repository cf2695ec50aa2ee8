"""Freed host memory stays in the process: a step's large activations are not page-faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vlm_engine import host_memory

# Allocate and free a 64 MiB tensor ten times; print whether the settings took and the fewest page
# faults one allocation cost (the first few may still fault while the heap settles).
SCRIPT = """
import resource, torch
from vlm_engine.host_memory import keep_freed_memory
applied = keep_freed_memory()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, min(faults))
"""


def _fewest_faults(keep: str) -> tuple[bool, int]:
    env = {**os.environ, host_memory.ENV: keep}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, check=True, capture_output=True, text=True, timeout=120
    )
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_memory_is_reused_without_page_faults() -> None:
    applied, faults = _fewest_faults("1")
    default_applied, default_faults = _fewest_faults("0")
    assert applied and not default_applied
    pages = 64 * 2**20 // 4096
    assert default_faults > pages // 2  # glibc's default: every allocation mapped and faulted in anew
    assert faults < pages // 20  # kept: the freed chunk is reused


def test_the_engine_applies_it_on_cpu(tiny_vlm_dir) -> None:
    from vlm_engine import Engine

    Engine(str(tiny_vlm_dir), kv_cache_tokens=256)
    assert host_memory._applied is (os.environ.get(host_memory.ENV, "1") != "0" and sys.platform.startswith("linux"))
