"""Tests for preprocess/: image loading from every source, validation, hashing.

Fixtures are generated with Pillow at test time; HTTP tests use a real
ThreadingHTTPServer on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from PIL import Image

from preprocess import (
    MediaError,
    decode_image,
    hash_bytes,
    hash_to_int,
    image_content_hash,
    load_image,
    load_image_async,
)
from vlm_engine.config import MediaConfig
from preprocess.media import load_media_bytes

RED = (255, 0, 0)
BLUE = (0, 0, 255)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def encode(image: Image.Image, fmt: str, **save_kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save_kwargs)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def sample_rgb(size: tuple[int, int] = (16, 12)) -> Image.Image:
    """A small image with distinct pixels so orientation/changes are visible."""
    image = Image.new("RGB", size)
    image.putdata([(x * 13 % 256, y * 29 % 256, (x + y) * 7 % 256)
                   for y in range(size[1]) for x in range(size[0])])
    return image


def png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring a huge size whose pixel data is missing.

    Cheaper than encoding a real 20000x20000 image, and proves the size check
    runs before decoding: a decode attempt would fail as "truncated" instead.
    """
    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grey
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def two_frame(fmt: str) -> bytes:
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), BLUE)]
    extra = {"lossless": True} if fmt == "WEBP" else {}
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:],
                  duration=100, loop=0, **extra)


def close_to(pixel: tuple[int, ...], expected: tuple[int, ...], tol: int = 40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, expected))


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # httpx honours proxy env vars; a CI proxy must not intercept 127.0.0.1.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------
# local HTTP server
# --------------------------------------------------------------------------

HTTP_IMAGE = sample_rgb((10, 7))
HTTP_PNG = encode(HTTP_IMAGE, "PNG")
BIG_BODY = 200_000
SMALL_CAP = MediaConfig(max_image_bytes=50_000, allow_private_media_urls=True)
# The test servers listen on loopback, which media fetching refuses unless allowed.
LOOPBACK = MediaConfig(allow_private_media_urls=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: bytes, content_type: str = "image/png",
              length: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            self._route(path)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on purpose (size cap, timeout)

    def _route(self, path: str) -> None:
        if path == "/image.png":
            self._send(200, HTTP_PNG)
        elif path.startswith("/redirect/"):
            remaining = int(path.rsplit("/", 1)[1])
            if remaining == 0:
                self._send(200, HTTP_PNG)
                return
            self.send_response(302)
            self.send_header("Location", f"/redirect/{remaining - 1}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/redirect-to-other-host":  # a public-looking hop that leads elsewhere
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.2:9/image.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/host":  # what the client said it was talking to
            self._send(200, (self.headers.get("Host") or "").encode())
        elif path == "/redirect-to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big":
            self._send(200, b"\0" * BIG_BODY)
        elif path == "/big-unsized":
            # HTTP/1.0 without Content-Length: only the streaming cap can stop it.
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(BIG_BODY // 4096 + 1):
                self.wfile.write(b"\0" * 4096)
        elif path == "/slow":
            self.server.release.wait(5)
            self._send(200, HTTP_PNG)
        elif path == "/trickle":
            # One byte every 50 ms: never trips a per-read timeout.
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for byte in HTTP_PNG[:60]:
                if self.server.release.wait(0.05):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
        elif path == "/html":
            self._send(200, b"<html>not an image</html>", "text/html")
        else:
            self._send(404, b"not found", "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    release: threading.Event


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()  # unblock /slow and /trickle handlers
        server.shutdown()
        server.server_close()
        thread.join(5)


# --------------------------------------------------------------------------
# data URIs
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "mime"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
     ("GIF", "image/gif"), ("BMP", "image/bmp"), ("TIFF", "image/tiff")],
)
def test_data_uri_formats(fmt: str, mime: str) -> None:
    source = Image.new("RGB", (20, 10), RED)
    image = load_image(data_uri(encode(source, fmt), mime))
    assert image.mode == "RGB"
    assert image.size == (20, 10)
    assert close_to(image.getpixel((5, 5)), RED)


def test_png_data_uri_is_lossless() -> None:
    source = sample_rgb()
    assert load_image(data_uri(encode(source, "PNG"))).tobytes() == source.tobytes()


@pytest.mark.parametrize(("fmt", "mime"), [("GIF", "image/gif"), ("WEBP", "image/webp")])
def test_animated_image_gives_first_frame(fmt: str, mime: str) -> None:
    data = two_frame(fmt)
    with Image.open(io.BytesIO(data)) as check:
        assert getattr(check, "n_frames", 1) == 2  # the fixture really is animated
    image = load_image(data_uri(data, mime))
    assert image.mode == "RGB"
    assert close_to(image.getpixel((4, 4)), RED, tol=5)


def test_data_uri_mime_label_need_not_match_content() -> None:
    # Clients mislabel often; the decoder sniffs the real format.
    image = load_image(data_uri(encode(Image.new("RGB", (3, 3), BLUE), "PNG"), "image/jpeg"))
    assert image.getpixel((0, 0)) == BLUE


def test_data_uri_mime_is_case_insensitive() -> None:
    png = encode(Image.new("RGB", (3, 3), BLUE), "PNG")
    uri = "data:IMAGE/PNG;BASE64," + base64.b64encode(png).decode()
    assert load_image(uri).getpixel((1, 1)) == BLUE


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("data:image/png;base64,@@@@", "invalid base64"),
        ("data:image/png;base64,aGVsbG8", "invalid base64"),  # bad padding
        ("data:image/png;base64,aGVs bG8=", "invalid base64"),  # whitespace is not base64
        ("data:image/png;base64,", "empty payload"),
        ("data:text/plain;base64,aGVsbG8=", "unsupported media type 'text/plain'"),
        ("data:application/octet-stream;base64,aGVsbG8=", "unsupported media type"),
        ("data:;base64,aGVsbG8=", "unsupported media type 'text/plain'"),
        ("data:image/svg+xml,<svg/>", "base64-encoded"),
        ("data:image/png;base64", "missing ','"),
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "could not decode image"),
    ],
)
def test_bad_data_uris(source: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_image(source)


def test_undecodable_bytes() -> None:
    with pytest.raises(MediaError, match="could not decode image: unrecognized"):
        load_image(data_uri(os.urandom(512)))
    with pytest.raises(MediaError, match="could not decode image"):
        decode_image(b"")


def test_truncated_image_is_rejected() -> None:
    png = encode(sample_rgb((64, 64)), "PNG")
    with pytest.raises(MediaError, match="could not decode image"):
        load_image(data_uri(png[: len(png) // 2]))


def test_format_outside_allowlist_is_rejected() -> None:
    ppm = encode(Image.new("RGB", (4, 4), RED), "PPM")
    with pytest.raises(MediaError, match="unsupported format"):
        load_image(data_uri(ppm, "image/x-portable-pixmap"))


def test_data_uri_over_byte_cap() -> None:
    png = encode(sample_rgb((64, 64)), "PNG")
    limits = MediaConfig(max_image_bytes=len(png) - 1)
    with pytest.raises(MediaError, match="image too large"):
        load_image(data_uri(png), limits)
    assert load_image(data_uri(png), MediaConfig(max_image_bytes=len(png))).size == (64, 64)


# --------------------------------------------------------------------------
# decompression bombs
# --------------------------------------------------------------------------


def test_bomb_rejected_by_our_pixel_limit_before_decode() -> None:
    limits = MediaConfig(max_image_pixels=1_000_000)
    with pytest.raises(MediaError, match=r"4000x4000 = 16000000 pixels exceeds the limit"):
        load_image(data_uri(png_header_only(4000, 4000)), limits)


def test_real_one_bit_bomb_rejected() -> None:
    # A genuine 1-bit image: 9 M pixels compress to a few KB.
    data = encode(Image.new("1", (3000, 3000)), "PNG")
    assert len(data) < 10_000
    with pytest.raises(MediaError, match="pixels exceeds the limit"):
        load_image(data_uri(data), MediaConfig(max_image_pixels=1_000_000))


def test_bomb_rejected_by_pillow_error() -> None:
    # 400 M pixels is over twice Pillow's MAX_IMAGE_PIXELS: Image.open raises
    # DecompressionBombError itself, which must still come out as MediaError.
    with pytest.raises(MediaError, match="image too large"):
        load_image(data_uri(png_header_only(20000, 20000)), MediaConfig(max_image_pixels=10**9))


def test_pillow_warning_threshold_is_enforced() -> None:
    assert Image.MAX_IMAGE_PIXELS is not None
    side = int(Image.MAX_IMAGE_PIXELS**0.5) + 100  # between 1x and 2x Pillow's limit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(MediaError, match="image too large"):
            load_image(data_uri(png_header_only(side, side)), MediaConfig(max_image_pixels=10**9))
    # ...and also when the warning is escalated to an exception process-wide.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(MediaError, match="image too large"):
            load_image(data_uri(png_header_only(side, side)), MediaConfig(max_image_pixels=10**9))


def test_pil_input_is_subject_to_pixel_limit() -> None:
    with pytest.raises(MediaError, match="pixels exceeds the limit"):
        load_image(Image.new("1", (2000, 2000)), MediaConfig(max_image_pixels=1_000_000))


# --------------------------------------------------------------------------
# orientation and colour modes
# --------------------------------------------------------------------------


def test_exif_rotated_jpeg_is_transposed() -> None:
    # Stored 40x20 with red left / blue right, tagged "rotate 90 CW to view".
    stored = Image.new("RGB", (40, 20), RED)
    stored.paste(BLUE, (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encode(stored, "JPEG", exif=exif.tobytes(), quality=95)
    image = load_image(data_uri(jpeg, "image/jpeg"))
    assert image.size == (20, 40)
    assert close_to(image.getpixel((10, 5)), RED)  # left edge is now on top
    assert close_to(image.getpixel((10, 35)), BLUE)


def test_rgba_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (255, 0, 0, 255))
    rgba.putpixel((2, 0), (255, 0, 0, 128))
    image = load_image(data_uri(encode(rgba, "PNG")))
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255)  # transparent black -> white
    assert image.getpixel((1, 0)) == RED
    assert close_to(image.getpixel((2, 0)), (255, 127, 127), tol=2)


def test_palette_with_transparency() -> None:
    palette_image = Image.new("P", (2, 1))
    palette_image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette_image.putpixel((1, 0), 1)
    image = load_image(data_uri(encode(palette_image, "PNG", transparency=0)))
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 0)) == RED


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    grey16 = Image.new("I;16", (3, 1))
    for x, value in enumerate((0, 32896, 65535)):
        grey16.putpixel((x, 0), value)
    image = load_image(data_uri(encode(grey16, "PNG")))
    assert [image.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "CMYK", "I", "F", "YCbCr", "RGBA", "I;16"])
def test_every_mode_becomes_rgb(mode: str) -> None:
    image = load_image(Image.new(mode, (5, 3)))
    assert image.mode == "RGB"
    assert image.size == (5, 3)


def test_cmyk_jpeg() -> None:
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # pure red in CMYK
    image = load_image(data_uri(encode(cmyk, "JPEG"), "image/jpeg"))
    assert image.mode == "RGB"
    assert close_to(image.getpixel((4, 4)), RED)


def test_pil_input_is_copied_not_aliased() -> None:
    source = sample_rgb()
    image = load_image(source)
    assert image is not source
    source.putpixel((0, 0), (1, 2, 3))
    assert image.getpixel((0, 0)) != (1, 2, 3)


# --------------------------------------------------------------------------
# local files
# --------------------------------------------------------------------------


@pytest.fixture()
def media_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    sample_rgb().save(allowed / "pic.png")
    (allowed / "sub").mkdir()
    sample_rgb().save(allowed / "sub" / "nested.png")
    sample_rgb((5, 5)).save(tmp_path / "secret.png")
    return allowed


def test_local_path_allowed(media_dir: Path) -> None:
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    expected = sample_rgb().tobytes()
    assert load_image(str(media_dir / "pic.png"), limits).tobytes() == expected
    assert load_image((media_dir / "pic.png").as_uri(), limits).tobytes() == expected
    assert load_image("sub/nested.png", limits).tobytes() == expected  # relative to the root
    assert load_image(f"file://localhost{media_dir}/pic.png", limits).tobytes() == expected


def test_file_url_percent_decoding(media_dir: Path) -> None:
    sample_rgb().save(media_dir / "with space.png")
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    assert load_image((media_dir / "with space.png").as_uri(), limits).size == (16, 12)


def test_local_paths_refused_by_default(media_dir: Path) -> None:
    for source in (str(media_dir / "pic.png"), (media_dir / "pic.png").as_uri()):
        with pytest.raises(MediaError, match="local file paths are not allowed"):
            load_image(source)


def test_local_path_escape_via_dotdot(media_dir: Path) -> None:
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    for source in (f"{media_dir}/../secret.png", "../secret.png", "sub/../../secret.png",
                   str(media_dir.parent / "secret.png"), "/etc/passwd"):
        with pytest.raises(MediaError, match="outside the allowed media directory"):
            load_image(source, limits)


def test_local_path_escape_via_symlink(media_dir: Path) -> None:
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "linkdir").symlink_to(media_dir.parent)
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    for source in (str(media_dir / "link.png"), str(media_dir / "linkdir" / "secret.png"),
                   (media_dir / "link.png").as_uri()):
        with pytest.raises(MediaError, match="outside the allowed media directory"):
            load_image(source, limits)


def test_symlink_inside_root_is_fine(media_dir: Path) -> None:
    (media_dir / "alias.png").symlink_to(media_dir / "sub" / "nested.png")
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    assert load_image(str(media_dir / "alias.png"), limits).size == (16, 12)


def test_allowed_root_itself_behind_symlink(media_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "root-link").symlink_to(media_dir)
    limits = MediaConfig(allowed_local_media_path=str(tmp_path / "root-link"))
    assert load_image(str(media_dir / "pic.png"), limits).size == (16, 12)
    assert load_image(str(tmp_path / "root-link" / "pic.png"), limits).size == (16, 12)


def test_sibling_prefix_directory_is_outside(tmp_path: Path) -> None:
    # "/x/allowed-evil" starts with "/x/allowed" but is not inside it.
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed-evil").mkdir()
    sample_rgb().save(tmp_path / "allowed-evil" / "pic.png")
    limits = MediaConfig(allowed_local_media_path=str(tmp_path / "allowed"))
    with pytest.raises(MediaError, match="outside"):
        load_image(str(tmp_path / "allowed-evil" / "pic.png"), limits)


def test_local_file_errors(media_dir: Path) -> None:
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    with pytest.raises(MediaError, match="not found"):
        load_image("missing.png", limits)
    with pytest.raises(MediaError, match="not a regular file"):
        load_image("sub", limits)
    os.mkfifo(media_dir / "fifo")
    with pytest.raises(MediaError, match="not a regular file"):
        load_image("fifo", limits)
    (media_dir / "junk.png").write_bytes(b"not an image")
    with pytest.raises(MediaError, match="could not decode image"):
        load_image("junk.png", limits)
    small = MediaConfig(allowed_local_media_path=str(media_dir), max_image_bytes=10)
    with pytest.raises(MediaError, match="image too large"):
        load_image("pic.png", small)
    with pytest.raises(MediaError, match="remote host"):
        load_image("file://example.com/pic.png", limits)
    for source in ("a\0b.png", "file:///tmp/a%00b.png"):
        with pytest.raises(MediaError, match="invalid local file path"):
            load_image(source, limits)


def test_error_messages_do_not_leak_server_paths(media_dir: Path) -> None:
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    for source in ("link.png", "missing.png", "../secret.png"):
        with pytest.raises(MediaError) as info:
            load_image(source, limits)
        assert str(media_dir) not in str(info.value)


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------


def test_http_ok(http_base: str) -> None:
    image = load_image(f"{http_base}/image.png", LOOPBACK)
    assert image.tobytes() == HTTP_IMAGE.tobytes()


def test_http_404(http_base: str) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{http_base}/nope.png", LOOPBACK)


def test_http_redirects(http_base: str) -> None:
    limits = MediaConfig(allow_private_media_urls=True, max_redirects=3)
    assert load_image(f"{http_base}/redirect/3", limits).size == HTTP_IMAGE.size
    with pytest.raises(MediaError, match="more than 3 redirects"):
        load_image(f"{http_base}/redirect/5", limits)
    with pytest.raises(MediaError, match="more than 0 redirects"):
        load_image(f"{http_base}/redirect/1", MediaConfig(allow_private_media_urls=True, max_redirects=0))


def test_http_redirect_cannot_reach_local_files(http_base: str) -> None:
    with pytest.raises(MediaError, match="fetched over http or https only"):
        load_image(f"{http_base}/redirect-to-file", LOOPBACK)


@pytest.mark.parametrize("path", ["/big", "/big-unsized"])
def test_http_body_over_cap(http_base: str, path: str) -> None:
    with pytest.raises(MediaError, match="image too large: more than 50000 bytes"):
        load_image(f"{http_base}{path}", SMALL_CAP)


def test_http_timeout(http_base: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        load_image(f"{http_base}/slow", MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=0.2))
    assert time.monotonic() - start < 2


def test_fetch_timeouts_are_per_kind(http_base: str) -> None:
    assert (MediaConfig().timeout_s("image"), MediaConfig().timeout_s("video")) == (5.0, 30.0)  # vLLM's
    limits = MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=30, video_fetch_timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"timed out fetching video \(limit 0.2s\)"):
        load_media_bytes(f"{http_base}/slow", limits, kind="video")
    assert time.monotonic() - start < 2


def test_http_trickle_hits_overall_deadline(http_base: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out"):
        load_image(f"{http_base}/trickle", MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=0.3))
    assert time.monotonic() - start < 2


def test_http_non_image_body(http_base: str) -> None:
    with pytest.raises(MediaError, match="could not decode image"):
        load_image(f"{http_base}/html", LOOPBACK)


def test_http_connection_refused() -> None:
    import socket

    with socket.socket() as sock:  # grab a free port, then close it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MediaError, match="failed to fetch image"):
        limits = MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=2)
        load_image(f"http://127.0.0.1:{port}/x.png", limits)


PRIVATE_URLS = [
    "http://localhost:9/x.png",
    "http://[::1]:9/x.png",
    "http://10.1.2.3/x.png",
    "http://192.168.0.1/x.png",
    "http://169.254.169.254/latest/meta-data",
    "http://[::ffff:127.0.0.1]/x.png",
    "http://0.0.0.0/x.png",
    "http://224.0.0.1/x.png",
]


def test_private_addresses_are_refused_by_default(http_base: str) -> None:
    for url in [f"{http_base}/image.png", *PRIVATE_URLS]:
        with pytest.raises(MediaError, match="refusing to fetch image from .*: it resolves to a"):
            load_image(url)
        with pytest.raises(MediaError, match="refusing to fetch video from"):
            load_media_bytes(url, kind="video")
    with pytest.raises(MediaError, match="it resolves to a link-local address"):
        asyncio.run(load_image_async("http://169.254.169.254/latest/meta-data"))


def test_every_redirect_hop_is_checked(http_base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from preprocess import url_guard

    real = url_guard.forbidden_reason
    # Let the test server's own address count as public: its redirect to 127.0.0.2 must still be refused.
    monkeypatch.setattr(url_guard, "forbidden_reason", lambda a: None if a == "127.0.0.1" else real(a))
    assert load_image(f"{http_base}/image.png").size == HTTP_IMAGE.size
    refused = "refusing to fetch image from 127.0.0.2: it resolves to a loopback address"
    with pytest.raises(MediaError, match=refused):
        load_image(f"{http_base}/redirect-to-other-host")
    with pytest.raises(MediaError, match=refused):
        asyncio.run(load_image_async(f"{http_base}/redirect-to-other-host"))


def test_the_connection_goes_to_the_checked_address(http_base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host is resolved once per hop, checked, and connected to by address (a second DNS
    answer cannot redirect the connection); the server still sees the name it was asked by."""
    from preprocess import media

    port = urlsplit(http_base).port
    lookups: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]  # "media.test" exists nowhere else

    monkeypatch.setattr(media, "resolve", resolve)
    body = load_media_bytes(f"http://media.test:{port}/host", LOOPBACK, kind="video")
    assert body == f"media.test:{port}".encode() and lookups == ["media.test"]


def test_allowed_media_domains(http_base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from preprocess import media

    monkeypatch.setattr(media, "resolve", lambda host, port: ["127.0.0.1"])
    limits = MediaConfig(allow_private_media_urls=True, allowed_media_domains=("Example.org.",))
    port = urlsplit(http_base).port
    assert load_image(f"http://cdn.example.org:{port}/image.png", limits).size == HTTP_IMAGE.size
    assert load_image(f"http://example.org:{port}/image.png", limits).size == HTTP_IMAGE.size
    for host in ("example.com", "badexample.org", "example.org.evil.com"):
        with pytest.raises(MediaError, match="not in the allowed media domains"):
            load_image(f"http://{host}:{port}/image.png", limits)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
        ("http:///a.png", "missing host"),
        ("http://[::1/a.png", "invalid image URL"),
        ("https://[zz]/a.png", "invalid image URL"),
        ("javascript:alert(1)", "unsupported image URL scheme 'javascript'"),
        ("", "empty image source"),
        (b"data:image/png;base64,AAAA", "could not decode image"),  # bytes are an encoded image, not a URI
        (None, "unsupported image source type NoneType"),
        (42, "unsupported image source type int"),
    ],
)
def test_bad_sources(source: object, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_image(source)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# async variant
# --------------------------------------------------------------------------


def test_async_sources(http_base: str, media_dir: Path) -> None:
    limits = MediaConfig(allow_private_media_urls=True, allowed_local_media_path=str(media_dir))
    expected_local = sample_rgb().tobytes()

    async def main() -> list[Image.Image]:
        return await asyncio.gather(
            load_image_async(f"{http_base}/image.png", limits),
            load_image_async(f"{http_base}/redirect/2", limits),
            load_image_async(data_uri(encode(sample_rgb(), "PNG")), limits),
            load_image_async(str(media_dir / "pic.png"), limits),
            load_image_async(sample_rgb(), limits),
        )

    results = asyncio.run(main())
    assert results[0].tobytes() == HTTP_IMAGE.tobytes()
    assert results[1].tobytes() == HTTP_IMAGE.tobytes()
    assert all(r.tobytes() == expected_local for r in results[2:])


@pytest.mark.parametrize(
    ("path", "limits", "message"),
    [
        ("/nope.png", LOOPBACK, "HTTP 404"),
        ("/redirect/5", MediaConfig(allow_private_media_urls=True, max_redirects=3), "more than 3 redirects"),
        ("/big-unsized", SMALL_CAP, "image too large"),
        ("/big", SMALL_CAP, "image too large"),
        ("/slow", MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=0.2), "timed out"),
        ("/trickle", MediaConfig(allow_private_media_urls=True, media_fetch_timeout_s=0.3), "timed out"),
        ("/html", LOOPBACK, "could not decode image"),
    ],
)
def test_async_http_errors(http_base: str, path: str, limits: MediaConfig, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        asyncio.run(load_image_async(f"{http_base}{path}", limits))


def test_async_offline_errors(media_dir: Path) -> None:
    with pytest.raises(MediaError, match="invalid base64"):
        asyncio.run(load_image_async("data:image/png;base64,@@@"))
    with pytest.raises(MediaError, match="local file paths are not allowed"):
        asyncio.run(load_image_async(str(media_dir / "pic.png")))
    with pytest.raises(MediaError, match="pixels exceeds the limit"):
        asyncio.run(load_image_async(data_uri(png_header_only(4000, 4000)),
                                     MediaConfig(max_image_pixels=1_000_000)))


# --------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------


def test_hash_equal_across_sources(http_base: str, media_dir: Path) -> None:
    source = sample_rgb()
    limits = MediaConfig(allowed_local_media_path=str(media_dir))
    digests = {
        image_content_hash(load_image(data_uri(encode(source, "PNG")), limits)),
        image_content_hash(load_image(data_uri(encode(source, "WEBP", lossless=True), "image/webp"))),
        image_content_hash(load_image(str(media_dir / "pic.png"), limits)),
        image_content_hash(load_image((media_dir / "pic.png").as_uri(), limits)),
        image_content_hash(load_image(source)),
        image_content_hash(source),
        image_content_hash(asyncio.run(load_image_async(str(media_dir / "pic.png"), limits))),
    }
    assert len(digests) == 1
    assert image_content_hash(load_image(f"{http_base}/image.png", LOOPBACK)) == image_content_hash(HTTP_IMAGE)


def test_hash_sensitive_to_pixels_mode_and_size() -> None:
    base = sample_rgb()
    changed = base.copy()
    r, g, b = changed.getpixel((3, 4))
    changed.putpixel((3, 4), (r, g, b ^ 1))
    assert image_content_hash(base) != image_content_hash(changed)
    # Same bytes, different geometry.
    flat = Image.frombytes("RGB", (12, 16), base.tobytes())
    assert image_content_hash(base) != image_content_hash(flat)
    # Same bytes, different mode.
    grey = Image.new("L", (4, 3), 7)
    assert image_content_hash(grey) != image_content_hash(Image.frombytes("P", (4, 3), grey.tobytes()))


def test_hash_format_and_stability() -> None:
    digest = image_content_hash(Image.new("RGB", (2, 2), RED))
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert digest == image_content_hash(Image.new("RGB", (2, 2), RED))
    assert hash_bytes(b"abc") == hash_bytes(b"abc") != hash_bytes(b"abd")
    assert len(hash_bytes(b"")) == 32
    # Image and byte hashes live in separate domains.
    image = Image.new("RGB", (1, 1), RED)
    assert image_content_hash(image) != hash_bytes(image.tobytes())


def test_hash_to_int() -> None:
    assert hash_to_int("ff" * 16) == (1 << 63) - 1
    assert hash_to_int("00" * 16) == 0
    assert hash_to_int("1") == 1
    value = hash_to_int(hash_bytes(b"x"))
    assert 0 <= value < 1 << 63
    assert value == hash_to_int(hash_bytes(b"x"))
    assert hash_to_int("ABCDEF0123456789" + "0" * 16) == hash_to_int("abcdef0123456789" + "f" * 16)
    for bad in ("", "0x12", "12 34", "1_2", "xyz"):
        with pytest.raises(ValueError):
            hash_to_int(bad)


# --------------------------------------------------------------------------
# config and error type
# --------------------------------------------------------------------------


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        MediaConfig(max_image_bytes=0)
    with pytest.raises(ValueError):
        MediaConfig(media_fetch_timeout_s=0)
    with pytest.raises(ValueError):
        MediaConfig(allowed_local_media_path="")
    with pytest.raises(Exception):
        MediaConfig().max_image_bytes = 1  # type: ignore[misc]  # frozen


def test_media_error_param() -> None:
    err = MediaError("bad image")
    assert isinstance(err, ValueError) and err.param is None and str(err) == "bad image"
    named = err.with_param("messages[0].content[1].image_url.url")
    assert named.param == "messages[0].content[1].image_url.url"
    assert named.message == "bad image" and named.__cause__ is err
