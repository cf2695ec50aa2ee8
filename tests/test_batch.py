"""`vlm-engine batch` on the tiny random Qwen2-VL (its free text is noise, so only constrained
decoding makes rows valid): schemas, a mixed folder with a corrupt file, SIGKILL and resume,
an OpenAI batch file, and two real servers with one killed midway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from PIL import Image

from tests.conftest import make_image
from tests.server_helpers import REPO, ServerProcess, running
from vlm_engine.batch import BatchOptions, run_batch
from testkit.json_schemas import SCHEMAS
from testkit.videos import make_clip

pytestmark = pytest.mark.slow

ROW_SCHEMA = {
    "type": "object",
    "properties": {
        "caption": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["caption", "tags", "count"],
    "additionalProperties": False,
}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value)


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 images (some in a subfolder), 3 videos, a two-page PDF and a corrupt file."""
    root = tmp_path_factory.mktemp("batch-inputs")
    (root / "more").mkdir()
    for i in range(30):
        folder = root / "more" if i % 3 == 0 else root
        make_image(48 + 4 * (i % 7), 40 + 4 * (i % 5), seed=100 + i).save(folder / f"img{i:02d}.png")
    for i, (w, h) in enumerate([(96, 64), (64, 64), (80, 56)]):
        (root / f"clip{i}.mp4").write_bytes(
            make_clip(width=w, height=h, fps=8, seconds=2, picture=make_image(200, 140, 7 + i))
        )
    Image.new("RGB", (300, 400), "white").save(
        root / "doc.pdf", save_all=True, append_images=[make_image(400, 300, 55)]
    )
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n but then garbage")
    return root


def test_twenty_schemas_on_several_images_all_validate(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    names = list(SCHEMAS)[:20]
    manifest = tmp_path / "manifest.jsonl"
    with manifest.open("w") as f:
        for n, name in enumerate(names):
            for k in range(3):
                image = tmp_path / f"{name}-{k}.png"
                make_image(56 + 8 * k, 48, seed=n * 3 + k).save(image)
                f.write(json.dumps({"path": image.name, "schema": SCHEMAS[name], "prompt": f"Fill in {name}."}) + "\n")
    out = tmp_path / "rows.jsonl"
    summary = run_batch(
        BatchOptions(
            inputs=[str(manifest)],
            out=str(out),
            model=str(tiny_vlm_dir),
            dtype="float32",
            concurrency=32,
            max_tokens=512,
            progress=False,
        )
    )
    got = rows(out)
    assert summary.rows == len(got) == 60 and summary.errors == 0, [r["error"] for r in got if r["error"]]
    by_source = {Path(r["source"]).name: r for r in got}
    for name in names:
        for k in range(3):
            row = by_source[f"{name}-{k}.png"]
            assert row["finish_reason"] == "stop" and valid(SCHEMAS[name], row["output"]), (name, row)


def batch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlm_engine.cli", "batch", *args, "--no-progress"]


def test_a_mixed_folder_survives_sigkill_and_resumes_exactly_once(
    tiny_vlm_dir: Path, mixed_folder: Path, tmp_path: Path
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(ROW_SCHEMA))
    out = tmp_path / "rows.jsonl"
    args = batch_command(
        str(mixed_folder),
        "--prompt",
        "Describe it as a row.",
        "--schema",
        str(schema),
        "--out",
        str(out),
        "--model",
        str(tiny_vlm_dir),
        "--dtype",
        "float32",
        "--concurrency",
        "2",
        "--max-tokens",
        "256",
        "--fps",
        "2",
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 8):
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = rows(out)
    assert 8 <= len(before) < 36, len(before)
    with out.open("ab") as f:
        f.write(b'{"key": "torn-by-a-kill", "sou')  # a half-written row, as a kill mid-write leaves
    second = subprocess.run(args, check=False, cwd=REPO, env=env, capture_output=True, timeout=600)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert b"torn last line" in second.stderr
    after = rows(out)
    assert len(after) == 36  # 30 images + 3 videos + 2 PDF pages + the corrupt file, each once
    assert len({r["key"] for r in after}) == 36
    assert {json.dumps(r, sort_keys=True) for r in before} <= {json.dumps(r, sort_keys=True) for r in after}
    errors = [r for r in after if r["error"]]
    assert [Path(r["source"]).name for r in errors] == ["broken.png"], errors
    good = [r for r in after if not r["error"]]
    assert all(valid(ROW_SCHEMA, r["output"]) for r in good)
    assert sorted(r["page"] for r in good if r["kind"] == "pdf") == [0, 1]
    assert sum(r["kind"] == "video" for r in good) == 3
    pages = [r for r in good if r["kind"] == "pdf"]
    assert (
        pages[0]["content_hash"] == pages[1]["content_hash"] and pages[0]["key"] != pages[1]["key"]
    )  # one file, two rows
    third = subprocess.run(args, check=False, cwd=REPO, env=env, capture_output=True, timeout=300)
    assert b"36 of 36 inputs were already done" in third.stderr and len(rows(out)) == 36


def test_an_openai_batch_file_round_trips(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    image = make_image(64, 48, seed=3)
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    lines = [
        {
            "custom_id": "text-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            # Written for OpenAI: the in-process run uses its one model whatever the line names.
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        },
        {
            "custom_id": "image-2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": uri}},
                            {"type": "text", "text": "What is it?"},
                        ],
                    }
                ],
                "max_tokens": 8,
                "response_format": {"type": "json_object"},
            },
        },
        {
            "custom_id": "bad-3",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [], "max_tokens": 8},
        },
        {"custom_id": "embeddings-4", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    options = BatchOptions(
        inputs=[str(requests)], out=str(out), model=str(tiny_vlm_dir), dtype="float32", progress=False
    )
    run_batch(options)
    results = {r["custom_id"]: r for r in rows(out)}
    assert set(results) == {"text-1", "image-2", "bad-3", "embeddings-4"}
    for ok in ("text-1", "image-2"):
        response = results[ok]["response"]
        assert response["status_code"] == 200 and results[ok]["error"] is None
        assert (
            response["body"]["object"] == "chat.completion"
            and response["body"]["choices"][0]["message"]["role"] == "assistant"
        )
        assert results[ok]["id"].startswith("batch_req_")
    json.loads(results["image-2"]["response"]["body"]["choices"][0]["message"]["content"])  # json_object held
    assert results["bad-3"]["response"]["status_code"] == 400
    assert "messages" in results["bad-3"]["response"]["body"]["error"]["message"]
    assert results["embeddings-4"]["response"]["status_code"] == 400
    run_batch(options)  # rerun: everything is done already
    assert len(rows(out)) == 4


def test_two_servers_share_the_work_and_one_dying_loses_nothing(
    tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    logs = tmp_path_factory.mktemp("batch-servers")
    folder = tmp_path_factory.mktemp("batch-images")
    for i in range(24):
        make_image(56, 48, seed=300 + i).save(folder / f"p{i:02d}.png")
    schema_args = ("--max-model-len", "2048", "--kv-cache-tokens", "8192")
    with (
        running(ServerProcess(tiny_vlm_dir, logs / "a.log", *schema_args)) as a,
        running(ServerProcess(tiny_vlm_dir, logs / "b.log", *schema_args)) as b,
    ):
        out = logs / "rows.jsonl"
        options = BatchOptions(
            inputs=[str(folder)],
            out=str(out),
            prompt="Describe it as a row.",
            schema=ROW_SCHEMA,
            servers=[a.url, b.base_url],
            concurrency=4,
            max_tokens=128,
            retries=4,
            progress=False,
        )
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(summary=run_batch(options)))
        worker.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 6):
            time.sleep(0.1)
        b.proc.send_signal(signal.SIGKILL)  # its requests in flight fail; they must finish on a
        worker.join(timeout=300)
        assert not worker.is_alive()
        b.kill_all()
        got = rows(out)
        assert len(got) == 24 and len({r["key"] for r in got}) == 24
        assert all(r["error"] is None and valid(ROW_SCHEMA, r["output"]) for r in got), [r["error"] for r in got]
        servers = {r["server"] for r in got}
        assert servers == {a.url, b.url}, servers  # work landed on both before b died
        summary = result["summary"]
        assert summary.per_server[a.url] > 0 and summary.per_server[b.url] > 0


def test_in_process_media_urls_follow_the_private_url_flag(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """The in-process model fetches URLs under the same guard as the server: a loopback URL is
    refused by default and fetched with --allow-private-media-urls (an intranet)."""
    import http.server
    import io

    buffer = io.BytesIO()
    make_image(40, 32, seed=5).save(buffer, "PNG")
    png = buffer.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
    line = {
        "custom_id": "url-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 4,
        },
    }
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(line) + "\n")
    try:
        statuses = {}
        for allow in (False, True):
            out = tmp_path / f"results-{allow}.jsonl"
            run_batch(
                BatchOptions(
                    inputs=[str(requests)],
                    out=str(out),
                    model=str(tiny_vlm_dir),
                    dtype="float32",
                    progress=False,
                    allow_private_media_urls=allow,
                )
            )
            (row,) = rows(out)
            statuses[allow] = row["response"]["status_code"], json.dumps(row["response"]["body"])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert statuses[False][0] == 400 and "loopback" in statuses[False][1]
    assert statuses[True][0] == 200


def test_a_linear_attention_model_fills_a_folder(mixed_folder: Path, tmp_path: Path) -> None:
    """Qwen3.5 (state slots beside paged KV) through the in-process batch runner: every image,
    video and PDF page of the mixed folder becomes a valid row; only the corrupt file errs."""
    from testkit.qwen3_5_checkpoints import cached_qwen3_5

    out = tmp_path / "rows.jsonl"
    options = BatchOptions(
        inputs=[str(mixed_folder)], out=str(out), model=str(cached_qwen3_5("tiny")), dtype="float32",
        schema=ROW_SCHEMA, concurrency=8, max_tokens=256, progress=False,
    )  # fmt: skip
    summary = run_batch(options)
    got = rows(out)
    errors = [r for r in got if r["error"]]
    assert [Path(r["source"]).name for r in errors] == ["broken.png"]
    assert summary.rows == len(got) and all(valid(ROW_SCHEMA, r["output"]) for r in got if not r["error"])
