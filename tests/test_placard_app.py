"""The placard page in a real browser: Debian's chromium driven by Playwright, against the real
`vlm-engine serve --app placard` on the default model (fp32, greedy), with Chromium's fake camera
playing a .y4m made from scikit-image's cat photo.

What is checked is what a visitor sees: a placard that streams in field by field (the title is on
screen while the answer is still streaming), its timings, one request in flight at a time, the
upload path when the camera is denied, a newer photo superseding an older one, and the banner
once the server is gone. Screenshots land in test-artifacts/ (or $VLM_TEST_ARTIFACTS)."""

from __future__ import annotations

import base64
import itertools
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.server_helpers import ARTIFACTS, BROWSER_ARGS, CHROMIUM, ServerProcess, running

pytestmark = pytest.mark.slow

PLACARD_DONE_S = 120.0  # the default model on 2 CPU cores: a placard takes ~5-10 s
COFFEE_WORDS = ("coffee", "cup", "espresso")

# Logs every change of the placard (its state and its text) with a timestamp, from the page's
# first moment: the test reads the history instead of polling and hoping to catch it mid-stream.
RECORDER = """
window.__placard = [];
document.addEventListener("DOMContentLoaded", () => {
  const placard = document.getElementById("placard");
  const field = (id) => document.getElementById(id).textContent;
  const record = () => window.__placard.push({
    t: performance.now(), state: placard.dataset.state,
    title: field("title"), description: field("description"),
  });
  new MutationObserver(record).observe(placard, {
    subtree: true, childList: true, characterData: true, attributes: true, attributeFilter: ["data-state"],
  });
});
"""


def photo(name: str) -> Image.Image:
    import skimage.data

    pixels = getattr(skimage.data, name)()
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return Image.fromarray(pixels.astype(np.uint8)).convert("RGB")


def write_y4m(path: Path, image: Image.Image, width: int = 640, height: int = 480, frames: int = 3) -> None:
    """A YUV4MPEG2 clip (4:2:0, full-range 'jpeg' chroma siting) showing `image` still."""
    y, cb, cr = ImageOps.fit(image, (width, height)).convert("YCbCr").split()
    half = (width // 2, height // 2)
    frame = (
        b"FRAME\n" + y.tobytes() + cb.resize(half, Image.BILINEAR).tobytes() + cr.resize(half, Image.BILINEAR).tobytes()
    )
    path.write_bytes(f"YUV4MPEG2 W{width} H{height} F10:1 Ip A1:1 C420jpeg\n".encode() + frame * frames)


def png_bytes(image: Image.Image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("placard-app") / "server.log"
    with running(ServerProcess("placard-default", log, "--app", "placard")) as srv:
        yield srv


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make system-packages` (run by `make test`) installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def camera_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("camera") / "chelsea.y4m"
    write_y4m(path, photo("chelsea"))
    return path


def open_page(playwright: Any, url: str, *browser_args: str, settings: dict[str, Any] | None = None) -> Any:
    """A fresh browser on `url`, recording the placard's history, page errors and the order in
    which chat requests start and end (page.chat_log, page.chat_finished)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=[*BROWSER_ARGS, *browser_args])
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.add_init_script(RECORDER)
    if settings is not None:
        page.add_init_script(f"localStorage.setItem('placard.settings', {json.dumps(json.dumps(settings))})")
    page.errors = []
    page.chat_log = []
    page.chat_finished = []  # the finished chat requests, for their browser-side timing
    page.on("pageerror", lambda err: page.errors.append(str(err)))
    for event in ("request", "requestfinished", "requestfailed"):
        page.on(event, lambda r, event=event: r.url.endswith("/v1/chat/completions") and page.chat_log.append(event))
    page.on("requestfinished", lambda r: r.url.endswith("/v1/chat/completions") and page.chat_finished.append(r))
    page.goto(url)
    return page


def upload(page: Any, name: str) -> None:
    """Chooses scikit-image's photo `name` in the page's file picker."""
    page.set_input_files(
        "#upload-input", files=[{"name": f"{name}.png", "mimeType": "image/png", "buffer": png_bytes(photo(name))}]
    )


def history(page: Any) -> list[dict[str, Any]]:
    return page.evaluate("window.__placard")


def wait_done(page: Any, after: int = 0) -> list[dict[str, Any]]:
    """Waits for the `after`+1-th finished placard; returns the history up to it."""
    page.wait_for_function(
        f"window.__placard.filter(e => e.state === 'done').length > {after}", timeout=PLACARD_DONE_S * 1000
    )
    events = history(page)
    dones = [i for i, e in enumerate(events) if e["state"] == "done"]
    return events[: dones[after] + 1]


def placard_text(page: Any) -> str:
    return " ".join(page.text_content(f"#{f}") or "" for f in ("title", "date_or_period", "medium", "description"))


def test_partial_json_and_dark_frames_in_the_browser(playwright: Any, server: ServerProcess) -> None:
    page = open_page(playwright, server.url + "/placard/")
    result = page.evaluate(
        """async () => {
          const { parsePartialJson } = await import("./partial_json.js");
          const { meanLuma, DARK_LUMA } = await import("./capture.js");
          const cases = ['', '{"ti', '{"title": "Egyp', '{"title": "a\\\\', '{"title": "a\\\\u00',
                         '{"title": "a\\\\u0041", "n": 12', '{"n": 12, "m": tr', '{"a": [1, "x',
                         '{"title": "Cat", "medium": "oil"}'];
          const parsed = cases.map((c) => parsePartialJson(c));
          const bad = ['{"a" 1}', '{"a": 1} x', 'nope'].map((c) => {
            try { parsePartialJson(c); return "parsed"; } catch (e) { return e.name; }
          });
          const canvas = (color) => {
            const c = document.createElement("canvas"); c.width = 64; c.height = 48;
            const g = c.getContext("2d"); g.fillStyle = color; g.fillRect(0, 0, 64, 48); return c;
          };
          return { parsed, bad, black: meanLuma(canvas("#050505")), grey: meanLuma(canvas("#808080")), DARK_LUMA };
        }"""
    )
    parsed = result["parsed"]
    assert parsed[0]["value"] is None and not parsed[0]["complete"]  # nothing yet: no value
    assert parsed[1]["value"] == {}  # half a key names nothing
    assert parsed[2] == {"value": {"title": "Egyp"}, "complete": False, "openPath": ["title"]}
    assert parsed[3]["value"] == {"title": "a"} and parsed[4]["value"] == {"title": "a"}  # half escapes held back
    assert parsed[5]["value"] == {"title": "aA"}  # "12" may still grow: not shown yet
    assert parsed[6]["value"] == {"n": 12}  # a half literal neither
    assert parsed[7] == {"value": {"a": [1, "x"]}, "complete": False, "openPath": ["a", 1]}
    assert parsed[8] == {"value": {"title": "Cat", "medium": "oil"}, "complete": True, "openPath": []}
    assert result["bad"] == ["SyntaxError"] * 3
    assert result["black"] < result["DARK_LUMA"] < result["grey"]
    assert page.errors == []
    page.context.browser.close()


def test_the_camera_placard_streams_in_with_its_timings(
    playwright: Any, server: ServerProcess, camera_clip: Path
) -> None:
    fake_camera = [
        "--use-fake-device-for-media-stream",
        "--use-fake-ui-for-media-stream",
        f"--use-file-for-fake-video-capture={camera_clip}",
    ]
    # A 1 s interval, shorter than a placard takes: captures must wait their turn, never pile up.
    page = open_page(playwright, server.url + "/", *fake_camera, settings={"intervalS": 1})
    assert page.url == server.url + "/placard/"  # / redirects to the app

    first = wait_done(page)
    # The title was on screen while the answer was still streaming, and the text grew in pieces.
    shown = [e for e in first if e["title"]]
    assert shown and shown[0]["state"] == "streaming", first
    assert len({(e["title"], e["description"]) for e in first if e["state"] == "streaming"}) >= 5
    assert "cat" in (first[-1]["title"] + " " + first[-1]["description"]).lower(), first[-1]
    # A second placard follows from the live camera; then automatic captures are switched off.
    wait_done(page, after=1)
    page.uncheck("#auto")
    page.wait_for_function("document.getElementById('placard').dataset.state === 'done'", timeout=PLACARD_DONE_S * 1000)
    page.wait_for_timeout(1500)
    assert page.get_attribute("#placard", "data-state") == "done"  # nothing more started

    assert re.fullmatch(r"\d+ ms", page.text_content("#ttft") or ""), page.text_content("#ttft")
    assert re.fullmatch(r"\d+\.\d", page.text_content("#tps") or ""), page.text_content("#tps")
    assert re.fullmatch(r"\d+\.\d s", page.text_content("#e2e") or ""), page.text_content("#e2e")
    assert page.get_attribute("#health", "data-state") == "ok"
    assert page.is_hidden("#banner")
    # One request in flight at a time: each chat request ended before the next one started.
    # Judged by the browser's own timing: Playwright's events for two requests that end and
    # start within a millisecond may arrive in either order.
    assert "requestfailed" not in page.chat_log and len(page.chat_finished) >= 2, page.chat_log
    spans = sorted((t["startTime"], t["startTime"] + t["responseEnd"]) for t in (r.timing for r in page.chat_finished))
    assert all(end <= next_start + 1.0 for (_, end), (next_start, _) in itertools.pairwise(spans)), spans
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "placard-camera.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nplacard screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert page.errors == []
    page.context.browser.close()


def test_upload_when_the_camera_is_denied_and_newer_photos_win(playwright: Any, server: ServerProcess) -> None:
    # A camera exists but permission is refused (Playwright grants nothing it was not told to).
    page = open_page(playwright, server.url + "/placard/", "--use-fake-device-for-media-stream")
    page.wait_for_function("document.getElementById('camera-message').dataset.reason !== undefined")
    assert page.get_attribute("#camera-message", "data-reason") == "denied"
    assert "denied" in (page.text_content("#camera-message") or "")
    assert page.is_visible("#camera-message") and page.is_disabled("#capture-button")
    assert page.input_value("#interval") == "4"  # the default capture interval

    upload(page, "coffee")
    wait_done(page)
    assert any(word in placard_text(page).lower() for word in COFFEE_WORDS), placard_text(page)

    # A dropped photo starts streaming; an upload while it streams aborts it, and only the newer
    # photo's placard is ever shown from then on.
    drop = page.evaluate_handle(
        """({ b64, name }) => {
          const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
          const data = new DataTransfer();
          data.items.add(new File([bytes], name, { type: "image/png" }));
          return data;
        }""",
        {"b64": base64.b64encode(png_bytes(photo("astronaut"))).decode(), "name": "astronaut.png"},
    )
    page.dispatch_event("#drop-zone", "drop", {"dataTransfer": drop})
    page.wait_for_function("window.__placard.at(-1).state === 'streaming'", timeout=PLACARD_DONE_S * 1000)
    upload(page, "chelsea")
    # The switch is the moment the dropped photo's request is aborted: its tokens may still render
    # between the upload and that moment (the page reads the new file first), never after it.
    deadline = time.monotonic() + 30
    while "requestfailed" not in page.chat_log and time.monotonic() < deadline:
        page.wait_for_timeout(20)  # lets Playwright deliver the request events
    assert "requestfailed" in page.chat_log  # the dropped photo's request was aborted
    before = len(history(page))
    done = wait_done(page, after=1)
    final = done[-1]
    assert "cat" in (final["title"] + final["description"]).lower(), final
    # After the switch, every title shown was a prefix of the cat's (or the dimmed old placard).
    later = [e for e in history(page)[before:] if e["state"] in ("streaming", "done")]
    assert all(final["title"].startswith(e["title"]) for e in later if e["state"] == "streaming"), later
    page.wait_for_timeout(1000)
    assert history(page)[-1]["title"] == final["title"]  # nothing stale arrives afterwards
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "placard-upload.png"), full_page=True)
    assert page.errors == []
    page.context.browser.close()


def test_no_camera_then_the_server_goes_away(playwright: Any, server: ServerProcess) -> None:
    page = open_page(playwright, server.url + "/placard/")  # no fake device: no camera at all
    page.wait_for_function("document.getElementById('camera-message').dataset.reason !== undefined")
    assert page.get_attribute("#camera-message", "data-reason") == "missing"
    page.wait_for_function("document.getElementById('health').dataset.state === 'ok'")
    assert page.is_hidden("#banner")

    server.stop()
    page.wait_for_selector("#banner", state="visible", timeout=30_000)
    assert "Cannot reach the server" in (page.text_content("#banner") or "")
    assert page.get_attribute("#health", "data-state") == "down"
    # A photo sent now fails as "unreachable" and waits to retry, visibly.
    upload(page, "coffee")
    page.wait_for_function("document.getElementById('placard').dataset.state === 'retrying'", timeout=30_000)
    assert "cannot reach the server" in (page.get_attribute("#status", "title") or "")
    assert page.is_visible("#banner")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "placard-server-down.png"), full_page=True)
    assert page.errors == []
    page.context.browser.close()
