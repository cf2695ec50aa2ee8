"""`vlm-engine batch --ray`: the batch CLI over a Ray Dataset with engine actors, on the tiny random
Qwen2-VL. Over 40 images, 2 videos, a two-page PDF and a corrupt file: the rows equal the local
CLI's (timings aside), schema-valid; a schema failure is retried in a later round; a SIGKILLed
driver resumes. Each Ray cluster here is this machine's (2 CPUs, loopback) and is gone afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest
from PIL import Image

from tests.conftest import make_image
from tests.server_helpers import REPO
from vlm_engine.batch import BatchOptions, run_batch
from testkit.videos import make_clip

pytestmark = [pytest.mark.slow, pytest.mark.ray]

# Enums and a boolean: under constrained decoding the random model finishes a row in a few tokens.
ROW_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["photo", "drawing", "text"]}, "outdoor": {"type": "boolean"}},
    "required": ["kind", "outdoor"],
    "additionalProperties": False,
}
PROMPT = "Classify it."
NUM_ROWS = 45  # 40 images + 2 videos + 2 PDF pages + the corrupt file
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
LINGERING_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def comparable(found: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by key, less the one field that differs between runs of the same model (the latency)."""
    return {r["key"]: {k: v for k, v in r.items() if k != "latency_s"} for r in found}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray-batch-inputs")
    for i in range(40):
        make_image(40 + 4 * (i % 5), 36 + 4 * (i % 3), seed=500 + i).save(root / f"img{i:02d}.png")
    for i, (w, h) in enumerate([(64, 48), (56, 56)]):
        clip = make_clip(width=w, height=h, fps=4, seconds=1, picture=make_image(160, 120, 9 + i))
        (root / f"clip{i}.mp4").write_bytes(clip)
    Image.new("RGB", (200, 260), "white").save(
        root / "doc.pdf", save_all=True, append_images=[make_image(260, 200, 77)]
    )
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but then garbage")
    (root.parent / "schema.json").write_text(json.dumps(ROW_SCHEMA))
    return root


def cli_args(inputs: Path, out: Path, model: Path, *extra: str) -> list[str]:
    schema = inputs.parent / "schema.json"
    return ["batch", str(inputs), "--prompt", PROMPT, "--schema", str(schema), "--out", str(out), "--model", str(model),
            "--dtype", "float32", "--max-tokens", "64", "--no-progress", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def local_rows(inputs: Path, tiny_vlm_dir: Path) -> list[dict[str, Any]]:
    """The local CLI's rows (in-process engine), from a fresh interpreter that must not import Ray."""
    out = inputs.parent / "local.jsonl"
    script = (
        "import sys, time\nfrom vlm_engine.cli import main\nstart = time.monotonic()\n"
        f"code = main({cli_args(inputs, out, tiny_vlm_dir)!r})\n"
        "print(f'local wall {time.monotonic() - start:.1f} s', file=sys.stderr)\n"
        "assert 'ray' not in sys.modules, 'the batch CLI without --ray imported ray'\nsys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=REPO,
        env={**os.environ, **ENV},
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    print(done.stderr.decode().strip().splitlines()[-1])
    found = rows(out)
    assert len(found) == NUM_ROWS
    return found


@pytest.fixture
def ray_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Ray temp dir of the test's own (short: Ray's socket paths must fit 107 bytes). Every Ray
    process started under it carries RAY_TMPDIR in its environment, which is how the test finds
    its own leftovers, and only those, among other sessions' clusters."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", path)
    yield path
    # Ray's workers exit shortly after `ray.shutdown()` returns, or after their raylet dies.
    deadline = time.monotonic() + 30
    while (left := ray_processes(path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = [p.info["name"] for p in left]
    for process in left:
        process.kill()
    # Once (on a machine loaded 6x over) Ray's two per-node agents outlived a SIGKILLed driver's
    # raylet by minutes: Ray's behaviour, not ours; they are ended above and named here.
    if left:
        print(f"ended Ray processes left after the test: {names}")
    shutil.rmtree(path, ignore_errors=True)
    assert not [n for n in names if n not in LINGERING_AGENTS], names


def ray_processes(ray_tmpdir: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["name", "pid"]):
        try:
            mine = process.pid != os.getpid() and process.environ().get("RAY_TMPDIR") == ray_tmpdir
            if mine and process.status() != psutil.STATUS_ZOMBIE:  # a zombie has exited already
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def check_rows(found: list[dict[str, Any]], local: list[dict[str, Any]]) -> None:
    assert len(found) == NUM_ROWS and len({r["key"] for r in found}) == NUM_ROWS
    assert comparable(found) == comparable(local)
    errors = [Path(r["source"]).name for r in found if r["error"]]
    assert errors == ["broken.png"]
    validator = jsonschema.Draft202012Validator(ROW_SCHEMA)
    assert all(validator.is_valid(r["output"]) for r in found if not r["error"])
    assert [r["kind"] for r in found if not r["error"]].count("video") == 2
    assert sorted(r["page"] for r in found if r["kind"] == "pdf") == [0, 1]


@pytest.mark.timeout(600)
def test_ray_rows_equal_the_local_cli_rows(
    inputs: Path,
    tiny_vlm_dir: Path,
    local_rows: list[dict[str, Any]],
    ray_tmpdir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--ray local` (a cluster started and stopped by the run) with two engine actors."""
    import ray

    out = tmp_path / "ray.jsonl"
    options = BatchOptions(
        inputs=[str(inputs)],
        out=str(out),
        prompt=PROMPT,
        schema=ROW_SCHEMA,
        model=str(tiny_vlm_dir),
        dtype="float32",
        max_tokens=64,
        progress=False,
        ray="local",
        ray_actors=2,
    )
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)  # the actors inherit the driver's environment
    start = time.monotonic()
    summary = run_batch(options)
    print(f"ray (2 actors) wall {time.monotonic() - start:.1f} s: {summary.line()}")
    assert not ray.is_initialized()  # the run started Ray, so it shut it down
    check_rows(rows(out), local_rows)
    assert summary.rows == NUM_ROWS and summary.retries == 0 and summary.errors == 1
    # Every row is an actor's answer, the corrupt file's too (the engine rejects its pixels). Ray Data
    # starts work on the first actor up, which may finish this little before the second loads.
    assert 1 <= len(summary.per_server) <= 2 and sum(summary.per_server.values()) == NUM_ROWS, summary.per_server


@pytest.mark.timeout(300)
def test_a_schema_failure_is_retried_hotter_in_a_later_round(
    tiny_vlm_dir: Path, ray_tmpdir: str, tmp_path: Path
) -> None:
    """Answers cut by max_tokens fail the schema and go again at a higher temperature, in a second
    dataset; on a Ray the caller started (the Python API), which the run leaves running."""
    import ray

    for i in range(3):
        make_image(48, 40, seed=900 + i).save(tmp_path / f"p{i}.png")
    out = tmp_path / "rows.jsonl"
    options = BatchOptions(
        inputs=[str(tmp_path)],
        out=str(out),
        prompt=PROMPT,
        schema={
            "type": "object",
            "properties": {"caption": {"type": "string", "minLength": 30}},
            "required": ["caption"],
        },
        model=str(tiny_vlm_dir),
        dtype="float32",
        max_tokens=6,
        retries=1,
        progress=False,
        ray="auto",
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        summary = run_batch(options)
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    found = rows(out)
    assert summary.retries == 3 and summary.errors == 3 and len(found) == 3
    for row in found:
        assert row["attempts"] == 2 and row["finish_reason"] == "length", row
        assert row["error"].startswith("the answer is not JSON"), row


def test_the_ray_options_reach_batch_options() -> None:
    from vlm_engine import cli

    args = cli.build_parser().parse_args(
        ["batch", "x", "--out", "o.jsonl", "--ray", "auto", "--ray-actors", "3", "--ray-actor-cpus", "2.5"]
    )
    assert (args.ray, args.ray_actors, args.ray_actor_cpus) == ("auto", 3, 2.5)
    assert cli.main(["batch", "x", "--out", "o.jsonl", "--ray", "auto", "--server", "http://h"]) == 2


@pytest.mark.timeout(600)
def test_a_killed_ray_driver_resumes_exactly_once(
    inputs: Path, tiny_vlm_dir: Path, local_rows: list[dict[str, Any]], ray_tmpdir: str, tmp_path: Path
) -> None:
    """SIGKILL of `vlm-engine batch --ray local` mid-run keeps the rows written; the rerun does only
    the rest; the cluster the driver started (`--ray local`) dies with it. A smaller --concurrency
    than the local run's spreads the rows out in time, so the kill lands midway; the rows are the same."""
    out = tmp_path / "rows.jsonl"
    extra = ("--ray", "local", "--concurrency", "4")
    command = [sys.executable, "-m", "vlm_engine.cli", *cli_args(inputs, out, tiny_vlm_dir, *extra)]
    env = {**os.environ, **ENV}
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 4):
        assert first.poll() is None, first.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = rows(out)
    assert 4 <= len(before) < NUM_ROWS, len(before)
    print(f"killed the driver with {len(before)} of {NUM_ROWS} rows written")
    # The cluster's raylet and GCS die with the driver that started them (its workers soon after).
    time.sleep(1.0)
    assert not [p for p in ray_processes(ray_tmpdir) if p.info["name"] in ("raylet", "gcs_server")]
    second = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, timeout=400)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert f"{len(before)} of {NUM_ROWS} inputs were already done".encode() in second.stderr
    after = rows(out)
    assert after[: len(before)] == before  # appended to, never rewritten
    check_rows(after, local_rows)
