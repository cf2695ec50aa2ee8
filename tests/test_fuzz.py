"""Hostile input through the real `vlm-engine serve` (tiny Qwen2-VL): every file of Pillow's own
test-image corpus (broken, truncated, bomb and odd files), a set of damaged videos, and malformed
or out-of-range values in every request field. Each request must answer 200 with a valid body (or
a 200 SSE stream ending in [DONE]) or a 4xx in the OpenAI error shape: never a 5xx, never a request
that does not answer, and afterwards the server is healthy, its preprocess worker is the same
process and no KV page is left in use.

The Pillow corpus is `Tests/images` of the installed Pillow's sdist, which `make fuzz-corpus` (a
prerequisite of `make test`) downloads once into .cache/fuzz/. Every outcome is counted: the
summary goes to test-artifacts/fuzz-summary.json (and to stdout under `pytest -s`), each request's
answer to test-artifacts/fuzz-outcomes/<group>.jsonl."""

from __future__ import annotations

import base64
import copy
import dataclasses
import io
import json
import mimetypes
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL
import psutil
import pytest

from tests.conftest import make_image
from tests.kernel_builds import setup_missing
from tests.server_helpers import ARTIFACTS, REPO, ServerProcess, running, sse_events
from testkit.videos import audio_only_clip, make_clip, zero_frame_clip

pytestmark = pytest.mark.slow

CORPUS = REPO / ".cache" / "fuzz" / f"pillow-{PIL.__version__}" / "Tests" / "images"
SUMMARY_PATH = ARTIFACTS / "fuzz-summary.json"
OUTCOMES_PATH = ARTIFACTS / "fuzz-outcomes"  # one JSON-lines file per group: every request's answer
CLIENT_TIMEOUT_S = 60.0  # one request that has not answered by then counts as stuck
CONCURRENCY = 4
SEED = 16  # the number; every generated input below derives from it


# ---- the server and how one request is judged --------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-fuzz") / "server.log"
    # A short context keeps the fuzz cases that do generate (e.g. a huge max_tokens) cheap; the
    # images (<= 64 tokens) and the short clips below fit in it easily.
    srv = ServerProcess(
        tiny_vlm_dir,
        log,
        "--served-model-name", "tiny-vlm",
        "--max-model-len", "512",
        "--kv-cache-tokens", "4096",
        "--max-num-seqs", "8",
        "--log-stats-interval", "0",
    )  # fmt: skip
    with running(srv):
        yield srv


@pytest.fixture(scope="module", autouse=True)
def fresh_artifacts() -> None:
    """The summary and outcome files describe this run only."""
    SUMMARY_PATH.unlink(missing_ok=True)
    shutil.rmtree(OUTCOMES_PATH, ignore_errors=True)


@dataclass(frozen=True)
class Case:
    """One HTTP request: a raw body, so malformed JSON can be sent as it is."""

    name: str
    path: str  # under /v1
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class Outcome:
    case: str
    status: int | None  # None: no HTTP answer at all
    reason: str  # "ok", "stream", or the 4xx error message
    problem: str | None  # None: an acceptable answer
    param: str | None = None  # the 4xx error's param


def as_json(body: Any) -> bytes:
    # ensure_ascii: lone surrogates go out as \ud800 escapes, which is what a hostile client sends.
    return json.dumps(body, allow_nan=False).encode()


def chat_case(name: str, body: Any) -> Case:
    return Case(name, "/chat/completions", body if isinstance(body, bytes) else as_json(body))


def completion_case(name: str, body: Any) -> Case:
    return Case(name, "/completions", body if isinstance(body, bytes) else as_json(body))


def send(client: httpx.Client, server: ServerProcess, case: Case) -> Outcome:
    try:
        response = client.post(
            server.base_url + case.path, content=case.body, headers={"content-type": case.content_type}
        )
    except httpx.TimeoutException:
        return Outcome(case.name, None, "timeout", f"no answer within {CLIENT_TIMEOUT_S:g} s")
    except httpx.HTTPError as exc:
        return Outcome(case.name, None, "transport", f"{type(exc).__name__}: {exc}")
    status = response.status_code
    if status == 200:
        return Outcome(case.name, status, *judge_200(case, response))
    if 400 <= status < 500:
        return Outcome(case.name, status, *judge_4xx(response))
    return Outcome(case.name, status, f"HTTP {status}", f"HTTP {status}: {response.text[:300]}")


def judge_200(case: Case, response: httpx.Response) -> tuple[str, str | None]:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(response.text.splitlines())
        if not events or events[-1] != "[DONE]":
            return "stream", f"the stream did not end with [DONE]: {response.text[-300:]!r}"
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:  # an error after the 200 went out: it must be the client's fault too
                problem = error_shape_problem(chunk)
                if problem is None and chunk["error"]["type"] == "server_error":
                    problem = f"server error inside the stream: {chunk['error']['message']}"
                return f"stream error: {chunk['error'].get('message')}", problem
        return "stream", None
    try:
        body = response.json()
    except ValueError:
        return "ok", f"a 200 whose body is not JSON: {response.text[:300]!r}"
    expected = "chat.completion" if case.path == "/chat/completions" else "text_completion"
    if not isinstance(body, dict) or body.get("object") != expected:
        return "ok", f"a 200 that is not a {expected}: {response.text[:300]!r}"
    if not isinstance(body.get("choices"), list) or not body["choices"] or not isinstance(body.get("usage"), dict):
        return "ok", f"a 200 without choices or usage: {response.text[:300]!r}"
    return "ok", None


def judge_4xx(response: httpx.Response) -> tuple[str, str | None, str | None]:
    try:
        body = response.json()
    except ValueError:
        return "not JSON", f"HTTP {response.status_code} whose body is not JSON: {response.text[:300]!r}", None
    problem = error_shape_problem(body)
    if problem is not None:
        return str(body)[:200], problem, None
    return body["error"]["message"], None, body["error"]["param"]


def error_shape_problem(body: Any) -> str | None:
    """None when `body` is {"error": {"message", "type", "param", "code"}} as OpenAI sends it."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not the OpenAI error shape: {str(body)[:300]}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"an error without a message or type: {error}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"an error whose param is not a string: {error}"
    return None


def send_all(server: ServerProcess, cases: list[Case]) -> list[Outcome]:
    """Every case, CONCURRENCY at a time, each on its own connection: a connection the server
    drops then shows up on the request that caused it, not on the next one sent over it."""
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    with httpx.Client(timeout=CLIENT_TIMEOUT_S, limits=limits) as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(lambda case: send(client, server, case), cases))


def problems_of(outcomes: list[Outcome]) -> list[str]:
    return [f"{o.case}: {o.problem}" for o in outcomes if o.problem is not None]


def unexpected(outcomes: list[Outcome], expected: dict[str, tuple[int, str | None]]) -> list[str]:
    """Cases whose answer is pinned (status, and param for a 4xx): inputs that once broke the server."""
    by_case = {o.case: o for o in outcomes}
    found = []
    for case, (status, param) in expected.items():
        o = by_case[case]
        if o.status != status or (status != 200 and o.param != param):
            found.append(f"{case}: expected {status} (param {param}), got {o.status} (param {o.param}): {o.reason}")
    return found


# ---- what must hold after each group ------------------------------------------------------------


def image_uri(width: int = 56, height: int = 56, seed: int = 0) -> str:
    buf = io.BytesIO()
    make_image(width, height, seed=seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What is this?") -> list[dict[str, Any]]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def idle_metrics(server: ServerProcess, inflight: float = 0, timeout_s: float = 15.0) -> dict[str, float]:
    """/metrics once no more than `inflight` requests are in flight and no KV page is held (the
    core reports the pages it freed with its next step, so this polls briefly, not once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = server.metrics()
        if values["vlm_engine:num_requests_inflight"] <= inflight and values["vlm_engine:kv_pages_used"] == 0:
            return values
        if time.monotonic() > deadline:
            return values
        time.sleep(0.1)


@dataclass(frozen=True)
class Before:
    """The server before a test's requests: what must still hold after them (so that a test does
    not blame itself for what an earlier one left behind)."""

    worker_pid: int
    worker_restarts: int
    inflight: float


def before(server: ServerProcess) -> Before:
    log = server.log()
    # The launcher's line for a worker it had to restart (launcher._restart_workers).
    restarts = re.findall(r"the preprocess-0 process \(pid \d+\) exited .*restarted as pid (\d+)", log)
    worker_pid = int(restarts[-1]) if restarts else server.child_pid("preprocess-0")
    inflight = server.metrics()["vlm_engine:num_requests_inflight"]
    return Before(worker_pid, log.count("restarted as pid"), inflight)


def process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def serving_problems(server: ServerProcess, start: Before) -> list[str]:
    """What is wrong with the server after a test (empty: healthy, idle, no KV page or request left
    behind, the same worker, and a normal image request answers). Returned, not asserted, so that
    a failing test reports these next to the bad answers that caused them."""
    if server.proc.poll() is not None:
        return [f"the server exited with {server.proc.returncode}"]
    found = []
    health = httpx.get(server.url + "/health", timeout=10)
    if health.status_code != 200:
        found.append(f"/health answers {health.status_code}: {health.text}")
    metrics = idle_metrics(server, start.inflight)
    if metrics["vlm_engine:kv_pages_used"] != 0:
        found.append(f"leaked KV pages: vlm_engine:kv_pages_used stays at {metrics['vlm_engine:kv_pages_used']:g}")
    if metrics["vlm_engine:num_requests_inflight"] > start.inflight:
        leaked = metrics["vlm_engine:num_requests_inflight"] - start.inflight
        found.append(f"leaked requests: vlm_engine:num_requests_inflight stays {leaked:g} above where it was")
    # The same worker process, alive: a crash would have been restarted under a new pid.
    if not process_alive(start.worker_pid) or server.log().count("restarted as pid") != start.worker_restarts:
        found.append(f"the preprocess worker (pid {start.worker_pid}) died")
    body = {"model": "tiny-vlm", "messages": image_message(image_uri(seed=1)), "max_tokens": 2, "temperature": 0}
    normal = httpx.post(server.base_url + "/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    if normal.status_code != 200:
        found.append(f"a normal image request answers {normal.status_code}: {normal.text[:300]}")
    return found


# ---- the summary ------------------------------------------------------------------------------


def reason_key(reason: str) -> str:
    """Errors grouped by what they say (the part they name and the numbers in them left out)."""
    reason = re.sub(r"^messages\[\d+\]\.content\[\d+\]: ", "", reason)
    return re.sub(r"\d+", "N", ": ".join(reason.split(": ")[:2]))[:90]


def summarize(group: str, outcomes: list[Outcome], **extra: Any) -> dict[str, Any]:
    statuses = Counter(str(o.status) for o in outcomes)
    errors = Counter(reason_key(o.reason) for o in outcomes if o.status is not None and 400 <= o.status < 500)
    section = {
        "requests": len(outcomes),
        "by_status": dict(sorted(statuses.items())),
        "top_4xx_reasons": dict(errors.most_common(12)),
        "problems": problems_of(outcomes),
        **extra,
    }
    OUTCOMES_PATH.mkdir(parents=True, exist_ok=True)
    with open(OUTCOMES_PATH / f"{group}.jsonl", "w") as f:
        f.writelines(json.dumps(dataclasses.asdict(o)) + "\n" for o in outcomes)
    summary = json.loads(SUMMARY_PATH.read_text()) if SUMMARY_PATH.exists() else {}
    summary[group] = section
    SUMMARY_PATH.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(f"\n[fuzz] {group}: {json.dumps(section, indent=2, ensure_ascii=False)}")
    return section


# ---- 1. Pillow's test-image corpus -------------------------------------------------------------


def corpus_files() -> list[Path]:
    if not CORPUS.is_dir():
        setup_missing(f"{CORPUS.relative_to(REPO)} is missing: `make fuzz-corpus` downloads Pillow's test images")
    return sorted(p for p in CORPUS.rglob("*") if p.is_file())


def image_mime(path: Path) -> str:
    # The server refuses non-image data URIs before decoding; every file must reach the decoder.
    guessed = mimetypes.guess_type(path.name)[0]
    return guessed if guessed and guessed.startswith("image/") else "image/png"


def corpus_case(path: Path) -> Case:
    uri = f"data:{image_mime(path)};base64,{base64.b64encode(path.read_bytes()).decode()}"
    body = {"model": "tiny-vlm", "messages": image_message(uri), "max_tokens": 1, "temperature": 0}
    return chat_case(str(path.relative_to(CORPUS)), body)


def test_every_file_of_pillows_test_images(server: ServerProcess) -> None:
    files = corpus_files()
    start = before(server)
    outcomes = send_all(server, [corpus_case(p) for p in files])
    section = summarize("pillow_corpus", outcomes, pillow=PIL.__version__, files=len(files))
    assert len(outcomes) == len(files)
    problems = section["problems"] + serving_problems(server, start)
    assert not problems, "\n".join(problems)


# ---- 2. damaged videos ----------------------------------------------------------------------


VIDEO_MIME = {"mp4": "video/mp4", "webm": "video/webm", "avi": "video/x-msvideo", "mov": "video/quicktime"}


def source_clips() -> dict[str, tuple[bytes, str]]:
    """Short, small clips in the four container families the server accepts."""
    return {
        "h264-mp4": (make_clip(width=96, height=64, fps=10, seconds=2), "mp4"),
        "vp9-webm": (make_clip(width=64, height=48, fps=8, seconds=1, codec="libvpx-vp9", container="webm"), "webm"),
        "mpeg4-avi": (make_clip(width=80, height=64, fps=8, seconds=1, codec="mpeg4", container="avi"), "avi"),
        "h264-mov": (make_clip(width=96, height=64, fps=10, seconds=1, container="mov"), "mov"),
    }


def truncated(fraction: float) -> Callable[[bytes, np.random.Generator], bytes]:
    return lambda data, _: data[: int(len(data) * fraction)]


def zeroed_ranges(data: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    for start in rng.integers(0, len(data) - 64, size=3):
        out[start : start + 64] = bytes(64)
    return bytes(out)


def flipped_bits(data: bytes, rng: np.random.Generator) -> bytes:
    out = np.frombuffer(data, dtype=np.uint8).copy()
    where = rng.integers(0, len(out), size=max(1, len(out) // 200))
    out[where] ^= rng.integers(1, 256, size=len(where), dtype=np.uint8)
    return out.tobytes()


def duplicated_chunk(data: bytes, _: np.random.Generator) -> bytes:
    a, b = len(data) * 2 // 5, len(data) * 3 // 5
    return data[:b] + data[a:b] + data[b:]


def swapped_halves(data: bytes, _: np.random.Generator) -> bytes:
    return data[len(data) // 2 :] + data[: len(data) // 2]


def random_block_shuffle(data: bytes, rng: np.random.Generator) -> bytes:
    blocks = [data[i : i + 512] for i in range(0, len(data), 512)]
    order = rng.permutation(len(blocks))
    return b"".join(blocks[i] for i in order)


DAMAGES: dict[str, Callable[[bytes, np.random.Generator], bytes]] = {
    "truncated-2%": truncated(0.02),
    "truncated-30%": truncated(0.3),
    "truncated-70%": truncated(0.7),
    "truncated-last-byte": lambda data, _: data[:-1],
    "header-cut": lambda data, _: data[32:],
    "zeroed-ranges": zeroed_ranges,
    "flipped-bits": flipped_bits,
    "duplicated-chunk": duplicated_chunk,
    "swapped-halves": swapped_halves,
    "shuffled-blocks": random_block_shuffle,
}


def patched(data: bytes, tag: bytes, offset: int, value: bytes, occurrence: int = 0) -> bytes:
    """`value` written `offset` bytes after the end of the `occurrence`-th `tag` (negative: before it)."""
    at = -1
    for _ in range(occurrence + 1):
        at = data.index(tag, at + 1)
    start = at + len(tag) + offset
    return data[:start] + value + data[start + len(value) :]


def claimed_size_damages(mp4: bytes, webm: bytes, avi: bytes) -> dict[str, bytes]:
    """Headers that claim absurd sizes, counts and durations (the payload stays as it was)."""
    huge32 = b"\xff\xff\xff\xff"
    return {
        "mp4-moov-size-huge": patched(mp4, b"moov", -8, huge32),
        "mp4-mdat-size-huge": patched(mp4, b"mdat", -8, huge32),
        "mp4-trak-size-huge": patched(mp4, b"trak", -8, huge32),
        "mp4-moov-size-zero": patched(mp4, b"moov", -8, bytes(4)),
        "mp4-sample-entry-65535x65535": patched(mp4, b"avc1", 24, b"\xff\xff\xff\xff", occurrence=1),
        "mp4-mdhd-timescale-zero": patched(mp4, b"mdhd", 12, bytes(4)),
        "mp4-mdhd-duration-huge": patched(mp4, b"mdhd", 16, huge32),
        "mp4-mvhd-timescale-zero": patched(mp4, b"mvhd", 12, bytes(4)),
        "mp4-stsz-count-huge": patched(mp4, b"stsz", 8, b"\x7f\xff\xff\xff"),
        "mp4-stts-entries-huge": patched(mp4, b"stts", 4, huge32),
        "mp4-stts-delta-zero": patched(mp4, b"stts", 12, bytes(4)),
        "mp4-no-moov": mp4.replace(b"moov", b"free", 1),
        "mp4-no-mdat": mp4.replace(b"mdat", b"free", 1),
        "webm-segment-size-huge": patched(webm, b"\x18\x53\x80\x67", 0, b"\x01\x7f\xff\xff\xff\xff\xff\xff"),
        "webm-unknown-doctype": webm.replace(b"webm", b"xxxx", 1),
        "avi-riff-size-huge": patched(avi, b"RIFF", 0, huge32),
        "avi-total-frames-huge": patched(avi, b"avih", 20, huge32),
        "avi-stream-length-huge": patched(avi, b"strh", 36, huge32),
        "avi-frame-size-huge": patched(avi, b"avih", 36, b"\xff\xff\x00\x00\xff\xff\x00\x00"),
    }


def not_videos(mp4: bytes, webm: bytes) -> dict[str, tuple[bytes, str]]:
    png = io.BytesIO()
    make_image(64, 48, seed=2).save(png, format="PNG")
    gif = io.BytesIO()
    frames = [make_image(32, 32, seed=s) for s in range(3)]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    rng = np.random.default_rng(SEED)
    interleaved = b"".join(mp4[i : i + 512] + webm[i : i + 512] for i in range(0, max(len(mp4), len(webm)), 512))
    return {
        "empty": (b"", "mp4"),
        "one-byte": (b"\x00", "mp4"),
        "text": (b"hello, this is not a video\n" * 40, "mp4"),
        "png-as-video": (png.getvalue(), "mp4"),
        "gif-animation-as-video": (gif.getvalue(), "mp4"),
        "random-bytes": (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "mp4"),
        "ftyp-box-only": (mp4[:32], "mp4"),
        "two-clips-concatenated": (mp4 + mp4, "mp4"),
        "clip-then-1MB-of-zeros": (mp4 + bytes(1 << 20), "mp4"),
        "mp4-and-webm-interleaved": (interleaved, "mp4"),
        "webm-sent-as-mp4": (webm, "mp4"),
        "audio-only": (audio_only_clip(), "mp4"),
        "one-frame": (make_clip(width=64, height=48, fps=1, seconds=1), "mp4"),
        "zero-frames": (zero_frame_clip(), "avi"),
    }


def damaged_videos() -> dict[str, tuple[bytes, str]]:
    clips = source_clips()
    rng = np.random.default_rng(SEED)
    videos: dict[str, tuple[bytes, str]] = {}
    for clip_name, (data, container) in clips.items():
        for damage_name, damage in DAMAGES.items():
            videos[f"{clip_name}/{damage_name}"] = (damage(data, rng), container)
    sizes = claimed_size_damages(clips["h264-mp4"][0], clips["vp9-webm"][0], clips["mpeg4-avi"][0])
    videos.update({name: (data, name.split("-", 1)[0]) for name, data in sizes.items()})
    videos.update(not_videos(clips["h264-mp4"][0], clips["vp9-webm"][0]))
    return videos


def video_case(name: str, data: bytes, container: str) -> Case:
    uri = f"data:{VIDEO_MIME[container]};base64,{base64.b64encode(data).decode()}"
    content = [{"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": "What happens?"}]
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return chat_case(name, body)


def video_sampling_cases(clip: bytes) -> list[Case]:
    """The frame sampling (fps, max_frames) of an intact clip, set to every bad value in each place a
    request can set it: mm_processor_kwargs and the video part."""
    uri = f"data:video/mp4;base64,{base64.b64encode(clip).decode()}"
    values = {**BAD_VALUES, "one": 1, "sixty": 60, "1e-9": 1e-9}
    cases = []
    for key in ("fps", "max_frames"):
        for value_name, value in values.items():
            for where in ("mm_processor_kwargs", "video_url"):
                video_url = {"url": uri, key: value} if where == "video_url" else {"url": uri}
                content = [{"type": "video_url", "video_url": video_url}, {"type": "text", "text": "What happens?"}]
                body: dict[str, Any] = {**CHAT_BODY, "messages": [{"role": "user", "content": content}]}
                if where == "mm_processor_kwargs":
                    body["mm_processor_kwargs"] = {key: value}
                cases.append(chat_case(f"{where}.{key}={value_name}", encode(body)))
    return cases


# Inputs that once gave a 500: Qwen2-VL's frame sampler divided by zero (fewer frames than one
# temporal patch), and integers the IPC cannot carry.
VIDEO_EXPECTED: dict[str, tuple[int, str | None]] = {
    "one-frame": (400, "messages[0].content[0]"),
    "mm_processor_kwargs.max_frames=one": (400, "messages[0].content[0]"),
    "video_url.max_frames=one": (400, "messages[0].content[0]"),
    "mm_processor_kwargs.fps=2^64": (400, "mm_processor_kwargs"),
    "video_url.max_frames=10^400": (400, "messages"),
}


def test_damaged_videos(server: ServerProcess) -> None:
    start = before(server)
    clips = source_clips()
    videos = damaged_videos()
    intact = [video_case(f"{name}/intact", data, c) for name, (data, c) in clips.items()]
    outcomes = send_all(server, intact + [video_case(name, data, c) for name, (data, c) in videos.items()])
    section = summarize("damaged_videos", outcomes, videos=len(videos))
    sampling_outcomes = send_all(server, video_sampling_cases(clips["h264-mp4"][0]))
    sampling = summarize("video_sampling_fields", sampling_outcomes)
    assert [o.status for o in outcomes[: len(intact)]] == [200] * len(intact), outcomes[: len(intact)]
    problems = section["problems"] + sampling["problems"] + unexpected(outcomes + sampling_outcomes, VIDEO_EXPECTED)
    problems += serving_problems(server, start)
    assert not problems, "\n".join(problems)


# ---- 3. request fields ------------------------------------------------------------------------

CHAT_BODY: dict[str, Any] = {
    "model": "tiny-vlm",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 2,
    "temperature": 0,
}
COMPLETION_BODY: dict[str, Any] = {"model": "tiny-vlm", "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}

# What protocol.py reads (and, last, fields it ignores: they must stay ignored, whatever they hold).
COMMON_FIELDS = (
    "model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "response_format", "structured_outputs", "return_token_ids",
    "presence_penalty", "frequency_penalty", "logit_bias", "user",
)  # fmt: skip
CHAT_FIELDS = (
    *COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "mm_processor_kwargs",
)  # fmt: skip
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "suffix", "best_of")

# Values json.dumps cannot write (it recurses on deep nesting): a placeholder string in the body,
# replaced in the encoded JSON by `encode`.
_RAW_JSON: dict[str, str] = {}


def raw_json(text: str) -> str:
    mark = f"__raw_json_{hash_of(text)}__"
    _RAW_JSON[mark] = text
    return mark


def hash_of(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def nested(depth: int) -> str:
    """`depth` nested arrays around a 1."""
    return raw_json("[" * depth + "1" + "]" * depth)


def deep_schema(depth: int) -> str:
    """A JSON schema of `depth` nested arrays of integers."""
    return raw_json('{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth)


BAD_VALUES: dict[str, Any] = {
    "null": None,
    "true": True,
    "zero": 0,
    "minus-one": -1,
    "2^31": 2**31,
    "2^63": 2**63,
    "-2^63-1": -(2**63) - 1,
    "2^64": 2**64,
    "10^400": 10**400,  # a JSON integer with 401 digits
    "1e308": 1e308,
    "-1e308": -1e308,
    "5e-324": 5e-324,
    "half": 0.5,
    "empty-string": "",
    "lone-surrogate": "\ud800",
    "nul-rtl-emoji-combining": "\x00\u202e\U0001f600e\u0301\U00020000",
    "empty-array": [],
    "array-of-null": [None],
    "empty-object": {},
    "object": {"type": {"a": [1]}},
    "nested-500": nested(500),
}


def encode(body: Any) -> bytes:
    """JSON, with every `raw_json` placeholder replaced by its text."""
    text = json.dumps(body, allow_nan=False)
    return re.sub(r'"(__raw_json_[0-9a-f]+__)"', lambda m: _RAW_JSON[m.group(1)], text).encode()


def field_cases(kind: str) -> list[Case]:
    """Every known field of the endpoint set to every bad value, on an otherwise valid body."""
    base, fields, path = (
        (CHAT_BODY, CHAT_FIELDS, "/chat/completions")
        if kind == "chat"
        else (COMPLETION_BODY, COMPLETION_FIELDS, "/completions")
    )
    cases = []
    for field_name in fields:
        for value_name, value in BAD_VALUES.items():
            body = {**base, field_name: value}
            if field_name == "stream_options":  # read only when streaming
                body["stream"] = True
            cases.append(Case(f"{kind}.{field_name}={value_name}", path, encode(body)))
    return cases


def malformed_bodies() -> dict[str, bytes]:
    valid = as_json(CHAT_BODY)
    return {
        "empty": b"",
        "whitespace": b" \n\t ",
        "truncated-1": valid[:1],
        "truncated-half": valid[: len(valid) // 2],
        "truncated-last-byte": valid[:-1],
        "trailing-garbage": valid + b"garbage",
        "two-objects": valid + valid,
        "nan": valid[:-1] + b', "temperature": NaN}',
        "infinity": valid[:-1] + b', "top_p": Infinity}',
        "minus-infinity": valid[:-1] + b', "seed": -Infinity}',
        "single-quotes": b"{'model': 'tiny-vlm'}",
        "comment": b'{"model": "tiny-vlm" /* hi */}',
        "trailing-comma": valid[:-1] + b",}",
        "invalid-utf8": valid.replace(b"Say hi.", b"Say \xff\xfe hi."),
        "overlong-utf8": valid.replace(b"Say hi.", b"Say \xc0\xaf hi."),
        "utf8-bom": b"\xef\xbb\xbf" + valid,
        "utf16": json.dumps(CHAT_BODY).encode("utf-16"),
        "lone-surrogate-escape": valid.replace(b"Say hi.", rb"\ud800"),
        "reversed-surrogates": valid.replace(b"Say hi.", rb"\udc00\ud800"),
        "bad-escape": valid.replace(b"Say hi.", rb"\x41"),
        "raw-control-char": valid.replace(b"Say hi.", b"a\x01b"),
        "string-body": b'"hello"',
        "array-body": b"[1, 2, 3]",
        "number-body": b"42",
        "huge-number-body": b"1" + b"0" * 400,
        "float-overflow-body": b"1e400",
        "null-body": b"null",
        "true-body": b"true",
        "duplicate-keys": valid[:-1] + b', "max_tokens": "two"}',
        "deep-array-body": b"[" * 100_000 + b"]" * 100_000,
        "deep-object-body": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "10MB-whitespace": b" " * (10 << 20) + valid,
    }


def special_cases() -> list[Case]:
    """Deep nesting, unicode edge cases and oversize values where they hurt most."""
    hostile_text = "\x00\u202e\u200f\ufeff\U0001f600\U0001f468\u200d\U0001f469e\u0301\u0301\u0301\U00020000\uffff"
    user = {"role": "user"}
    chat: dict[str, Any] = {
        "deep-content-100k": {**user, "content": nested(100_000)},
        "deep-content-120": {**user, "content": [{"type": "text", "text": nested(120)}]},
        "deep-part-100k": {**user, "content": [{"type": "text", "text": nested(100_000)}]},
        "deep-image-url-100k": {**user, "content": [{"type": "image_url", "image_url": nested(100_000)}]},
        "unicode-text": {**user, "content": hostile_text},
        "unicode-parts": {**user, "content": [{"type": "text", "text": hostile_text}] * 3},
        "lone-surrogate-text": {**user, "content": "a\ud800b\udfff"},
        "lone-surrogate-role": {"role": "\ud800", "content": "hi"},
        "text-5MB": {**user, "content": "hello " * ((5 << 20) // 6)},
        "text-parts-10k": {**user, "content": [{"type": "text", "text": "a"}] * 10_000},
        "unknown-part-type": {**user, "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]},
        "image-url-not-string": {**user, "content": [{"type": "image_url", "image_url": {"url": 10**400}}]},
        "image-url-5MB": {**user, "content": [{"type": "image_url", "image_url": {"url": "x" * (5 << 20)}}]},
        "image-bad-base64": {**user, "content": [{"type": "image_url", "image_url": {"url": "data:image/png,!"}}]},
        "nine-images": {**user, "content": [{"type": "image_url", "image_url": {"url": image_uri()}}] * 9},
    }
    cases = [chat_case(f"chat.messages.{name}", encode({**CHAT_BODY, "messages": [m]})) for name, m in chat.items()]
    many_messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(10_001)]
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(2_000)}}
    for name, extra in {
        "messages-10k": {"messages": many_messages},
        "stop-10k": {"stop": [f"s{i}" for i in range(10_000)]},
        "stop-unicode": {"stop": ["\x00", "\u202e", "\U0001f600", "e\u0301", "\ud800"]},
        "stop-1MB": {"stop": "x" * (1 << 20)},
        "logit-bias-100k": {"logit_bias": {str(i): 100 for i in range(100_000)}},
        "stop-token-ids-100k": {"stop_token_ids": list(range(100_000))},
        "stop-token-ids-huge": {"stop_token_ids": [2**63, -1]},
        "stream-n-16": {"stream": True, "n": 16, "stream_options": {"include_usage": True}},
        "seed-max-n-2": {"seed": 2**63 - 1, "n": 2, "temperature": 1},  # choice 1 gets seed + 1
        "temperature-denormal-long": {"temperature": 5e-324, "max_tokens": 64, "ignore_eos": True},
        "response-format-deep-schema": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(2_000)}}
        },
        "response-format-deep-nesting": {"response_format": {"type": "json_schema", "json_schema": nested(100_000)}},
        # Just under the server's nesting cap (128): must reach the grammar compiler and come back.
        "response-format-schema-120": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(120)}}
        },
        "structured-outputs-schema-120": {"structured_outputs": {"json": deep_schema(120)}},
        "tools-schema-120": {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": deep_schema(120)}}]
        },
        "tools-deep-schema": {"tools": [tool]},
        "tools-10k": {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]},
        "mm-kwargs-deep": {"mm_processor_kwargs": {"fps": nested(100_000)}},
        "mm-kwargs-huge": {"mm_processor_kwargs": {"fps": 1e308, "max_frames": 10**400}},
        "unknown-field-deep": {"x_unknown": nested(100_000)},
        "unknown-field-5MB": {"x_unknown": "x" * (5 << 20)},
    }.items():
        cases.append(chat_case(f"chat.{name}", encode({**CHAT_BODY, **extra})))
    for name, prompt in {
        "prompt-deep": nested(100_000),
        "prompt-unicode": hostile_text,
        "prompt-lone-surrogate": "a\ud800",
        "prompt-5MB": "hello " * ((5 << 20) // 6),
        "prompt-token-ids-huge": [2**63, 10**400],
        "prompt-token-ids-out-of-vocab": [10**9, -1],
        "prompt-batch-10k": ["a"] * 10_000,
        "prompt-token-ids-100k": [1] * 100_000,
    }.items():
        cases.append(completion_case(f"completion.{name}", encode({**COMPLETION_BODY, "prompt": prompt})))
    return cases


def random_value(rng: random.Random) -> Any:
    pool = [
        *BAD_VALUES.values(),
        rng.randint(-(2**70), 2**70),
        rng.uniform(-1e6, 1e6),
        rng.choice(["stop", "user", "tiny-vlm", "json_object", "auto", "none", "\U0001f600" * rng.randint(1, 50)]),
        [rng.randint(0, 3000) for _ in range(rng.randint(0, 20))],
        {"type": rng.choice(["text", "image_url", "json_schema", "function"])},
    ]
    return rng.choice(pool)


def paths_in(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key/index path inside a JSON value (the root excluded)."""
    found: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        found.append((*prefix, key))
        found.extend(paths_in(child, (*prefix, key)))
    return found


def mutate(body: dict[str, Any], fields: tuple[str, ...], rng: random.Random) -> dict[str, Any]:
    """One to three random edits: a known field set to a random value, any node replaced, removed
    or wrapped, or an unknown field added."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        action = rng.choice(["set-field", "replace", "delete", "wrap", "add-unknown"])
        if action == "set-field":
            body[rng.choice(fields)] = random_value(rng)
            continue
        if action == "add-unknown":
            body[f"x_{rng.randint(0, 99)}"] = random_value(rng)
            continue
        paths = paths_in(body)
        if not paths:
            continue
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if action == "replace":
            parent[path[-1]] = random_value(rng)
        elif action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = rng.choice([[parent[path[-1]]], {"value": parent[path[-1]]}])
    return body


def mutated_cases(count: int) -> list[Case]:
    rng = random.Random(SEED)
    rich_chat = {
        **CHAT_BODY,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": image_uri()}},
                ],
            },
        ],
        "stop": ["\n"],
        "seed": 3,
    }
    streaming_chat = {**rich_chat, "stream": True, "stream_options": {"include_usage": True}}
    cases = []
    for i in range(count):
        if i % 3 == 2:
            cases.append(completion_case(f"mutated-{i}", encode(mutate(COMPLETION_BODY, COMPLETION_FIELDS, rng))))
        else:
            base = streaming_chat if i % 3 == 1 else rich_chat
            cases.append(chat_case(f"mutated-{i}", encode(mutate(base, CHAT_FIELDS, rng))))
    return cases


def check_request_group(server: ServerProcess, group: str, cases: list[Case], expected: dict[str, Any]) -> None:
    start = before(server)
    outcomes = send_all(server, cases)
    problems = summarize(f"request_fields.{group}", outcomes)["problems"]
    problems += unexpected(outcomes, expected) + serving_problems(server, start)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_malformed_json_bodies(server: ServerProcess) -> None:
    cases = [
        Case(f"{path}:{name}", path, body)
        for name, body in malformed_bodies().items()
        for path in ("/chat/completions", "/completions")
    ]
    cases.append(Case("chat:text/plain", "/chat/completions", as_json(CHAT_BODY), "text/plain"))
    check_request_group(server, "malformed_json", cases, {})


def test_every_field_set_to_every_bad_value(server: ServerProcess) -> None:
    # Inputs that once gave a 500 (the tiny temperature failed every request batched with it).
    expected = {
        "chat.seed=2^64": (400, "seed"),
        "chat.seed=-2^63-1": (400, "seed"),
        "chat.max_tokens=10^400": (400, "max_tokens"),
        "chat.top_k=2^64": (400, "top_k"),
        "completion.temperature=10^400": (400, "temperature"),
        "chat.temperature=5e-324": (200, None),
    }
    check_request_group(server, "field_table", field_cases("chat") + field_cases("completion"), expected)


def test_oversize_values_deep_nesting_and_unicode(server: ServerProcess) -> None:
    expected = {
        "chat.temperature-denormal-long": (200, None),
        "chat.seed-max-n-2": (200, None),
        "chat.messages.image-url-not-string": (400, "messages"),
        "chat.mm-kwargs-huge": (400, "mm_processor_kwargs"),
        "completion.prompt-token-ids-huge": (400, "prompt"),
        "chat.tools-schema-120": (200, None),
        "chat.response-format-schema-120": (200, None),
    }
    check_request_group(server, "oversize_nesting_unicode", special_cases(), expected)


def test_random_mutations_of_valid_bodies(server: ServerProcess) -> None:
    check_request_group(server, "random_mutations", mutated_cases(240), {})
