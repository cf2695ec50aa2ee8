"""Load images from the sources an OpenAI-style request can name.

A source is a PIL image, a ``data:image/...;base64,`` URI, an ``http(s)://``
URL, or a ``file://`` URL / plain path (only under an allowed directory).
Whatever the source, the result is a fully decoded RGB ``PIL.Image.Image``
and every failure is a ``MediaError`` whose message can go back to the client.

Layout: ``_parse_source`` classifies the source without doing I/O, one
function per source obtains the encoded bytes (sync and async HTTP share
their checks), and ``decode_image`` / ``_normalize`` do all validation of the
pixels, so the sync and async entry points differ only in how they fetch.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import os
import socket
import ssl
import stat
import time
from dataclasses import dataclass
from typing import Union
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import httpx
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from preprocess.errors import MediaError
from preprocess.url_guard import PinnedUrl, check_domain, pin_url, resolve, split_target
from vlm_engine.config import MediaConfig

__all__ = [
    "DEFAULT_MEDIA",
    "decode_image",
    "fetch_http_async",
    "is_http_url",
    "load_image",
    "load_image_async",
    "load_media_bytes",
]


# The limits a caller that gives none gets: the engine's defaults (vlm_engine.config.MediaConfig).
DEFAULT_MEDIA = MediaConfig()

# Formats a VLM client plausibly sends. Pillow can open many more, but some
# plugins are rarely exercised (more parser bugs) and EPS would shell out to
# Ghostscript, so untrusted bytes only reach this allowlist. MPO (multi-picture
# JPEG from phone cameras) is opened by the JPEG plugin.
_PREFERRED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
_allowed_formats: tuple[str, ...] | None = None

_USER_AGENT = "vlm-engine-media/0.1"
_HTTP_HEADERS = {
    "User-Agent": _USER_AGENT,
    "Accept": "image/*,*/*;q=0.8",
    # Images are already compressed; asking for identity avoids a gzip layer
    # whose decompressed size we would only see after inflating it.
    "Accept-Encoding": "identity",
}

_WHITE_RGBA = (255, 255, 255, 255)
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_HIGH_BIT_DEPTH_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})
_MAX_DETAIL_CHARS = 200


# --------------------------------------------------------------------------
# Source classification (no I/O)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _DataUri:
    mime: str
    payload: str


@dataclass(frozen=True)
class _HttpUrl:
    url: str


@dataclass(frozen=True)
class _LocalPath:
    path: str


_Source = Union[Image.Image, _DataUri, _HttpUrl, _LocalPath]


def _parse_source(source: object, kind: str = "image") -> _Source:
    if isinstance(source, Image.Image):
        return source
    if not isinstance(source, str):
        raise MediaError(
            f"unsupported {kind} source type {type(source).__name__}; expected a URL, data URI, file path or PIL image"
        )
    if not source:
        raise MediaError(f"empty {kind} source")
    scheme = _scheme_of(source)
    if scheme == "data":
        return _parse_data_uri(source, kind)
    if scheme in ("http", "https"):
        if not _split_url(source).hostname:
            raise MediaError("invalid image URL: missing host")
        return _HttpUrl(source)
    if scheme == "file":
        return _LocalPath(_path_from_file_url(source))
    if scheme:
        raise MediaError(f"unsupported image URL scheme {scheme[:20]!r}; expected http, https, data or file")
    return _LocalPath(source)


def _split_url(url: str) -> SplitResult:
    try:
        # Rejects malformed bracketed hosts such as "http://[::1/".
        return urlsplit(url)
    except ValueError:
        raise MediaError("invalid image URL") from None


def is_http_url(source: str) -> bool:
    return _scheme_of(source) in ("http", "https")


def _scheme_of(source: str) -> str:
    """Lower-cased URL scheme, or "" when ``source`` looks like a plain path."""
    head, sep, _ = source[:64].partition(":")
    # RFC 3986 scheme: ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ). Anything
    # else before the first ":" (e.g. "/a:b.png") is a path.
    if sep and head[:1].isalpha() and all(c.isalnum() or c in "+-." for c in head):
        return head.lower()
    return ""


def _parse_data_uri(uri: str, kind: str = "image") -> _DataUri:
    header, comma, payload = uri[len("data:") :].partition(",")
    if not comma:
        raise MediaError("malformed data URI: missing ','")
    parts = [p.strip().lower() for p in header.split(";")]
    mime, params = parts[0], parts[1:]
    # Containers are often sent as application/octet-stream (or e.g. application/mp4).
    accepted = ("video/", "application/") if kind == "video" else ("image/",)
    if not mime.startswith(accepted):
        shown = mime[:64] or "text/plain"  # RFC 2397 default media type
        raise MediaError(f"unsupported media type {shown!r} in data URI; expected {kind}/*")
    if not params or params[-1] != "base64":
        raise MediaError("data URI must be base64-encoded (';base64,')")
    if not payload:
        raise MediaError("data URI has an empty payload")
    return _DataUri(mime=mime, payload=payload)


def _path_from_file_url(url: str) -> str:
    parts = _split_url(url)
    # Only this machine: "file://otherhost/x" would be a UNC path elsewhere.
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file URLs must not name a remote host")
    path = unquote(parts.path)
    if not path:
        raise MediaError("file URL has an empty path")
    return path


# --------------------------------------------------------------------------
# Obtaining the encoded bytes
# --------------------------------------------------------------------------


def _too_large(limits: MediaConfig, kind: str = "image") -> MediaError:
    return MediaError(f"{kind} too large: more than {limits.max_bytes(kind)} bytes")


def _decode_data_uri(uri: _DataUri, limits: MediaConfig, kind: str = "image") -> bytes:
    # Reject on the encoded length first so an oversized payload is never
    # decoded into memory. 4 base64 chars carry 3 bytes.
    if len(uri.payload) > 4 * -(-limits.max_bytes(kind) // 3):
        raise _too_large(limits, kind)
    try:
        # validate=True: characters outside the alphabet are an error instead
        # of being silently skipped, so garbage can't decode to "something".
        data = base64.b64decode(uri.payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 payload in data URI") from None
    if not data:
        raise MediaError("data URI has an empty payload")
    if len(data) > limits.max_bytes(kind):
        raise _too_large(limits, kind)
    return data


def _read_local_file(local: _LocalPath, limits: MediaConfig, kind: str = "image") -> bytes:
    if limits.allowed_local_media_path is None:
        raise MediaError("local file paths are not allowed on this server")
    if "\0" in local.path:
        # os functions raise ValueError on NUL; answer like any bad path.
        raise MediaError("invalid local file path")
    root = os.path.realpath(limits.allowed_local_media_path)
    # Relative paths are relative to the allowed directory: the client cannot
    # know the server's working directory. An absolute path replaces root.
    real = os.path.realpath(os.path.join(root, local.path))
    # Containment is checked on the fully resolved path (symlinks and ".."
    # gone) *before* touching the file, so refusals don't reveal whether a
    # path outside the directory exists.
    if os.path.commonpath([root, real]) != root:
        raise MediaError("local file path is outside the allowed media directory")
    try:
        # O_NONBLOCK: opening a FIFO must not hang the worker.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise MediaError(f"local {kind} file not found") from None
    except OSError:
        raise MediaError(f"local {kind} file cannot be read") from None
    try:
        # fstat on the open descriptor: checks the object we will read, not
        # whatever the path points to by now.
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"local {kind} path is not a regular file")
        if st.st_size > limits.max_bytes(kind):
            raise _too_large(limits, kind)
        # +1 so a file that grew after fstat is still caught.
        data = _read_up_to(fd, limits.max_bytes(kind) + 1)
    except OSError:
        raise MediaError(f"local {kind} file cannot be read") from None
    finally:
        os.close(fd)
    if len(data) > limits.max_bytes(kind):
        raise _too_large(limits, kind)
    return data


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    # Building a context loads the CA bundle (~35 ms); a fresh client per
    # image would pay that every time. SSLContext is safe to share.
    return httpx.create_ssl_context()


def _http_client_kwargs(limits: MediaConfig, kind: str) -> dict:
    return {
        "verify": _ssl_context(),
        "follow_redirects": False,  # followed hop by hop, each hop checked and pinned (url_guard)
        # httpx timeouts apply per connect/read/write/pool operation; the
        # overall deadline is enforced separately while streaming.
        "timeout": httpx.Timeout(limits.timeout_s(kind)),
        "headers": _HTTP_HEADERS,
    }


def _check_http_response(response: httpx.Response, limits: MediaConfig, kind: str = "image") -> None:
    if not response.is_success:
        raise MediaError(f"failed to fetch {kind}: HTTP {response.status_code}")
    declared = response.headers.get("content-length", "")
    # Fail before downloading anything when the server announces the size;
    # the streaming check below still guards lying or absent headers.
    if declared.isdigit() and int(declared) > limits.max_bytes(kind):
        raise _too_large(limits, kind)


def _append_chunk(body: bytearray, chunk: bytes, limits: MediaConfig, deadline: float, kind: str = "image") -> None:
    body += chunk
    if len(body) > limits.max_bytes(kind):
        raise _too_large(limits, kind)
    # A server trickling bytes never trips the per-read timeout; this bounds
    # the whole download.
    if time.monotonic() > deadline:
        raise _fetch_timeout(limits, kind)


def _fetch_timeout(limits: MediaConfig, kind: str = "image") -> MediaError:
    return MediaError(f"timed out fetching {kind} (limit {limits.timeout_s(kind):g}s)")


def _http_error(exc: BaseException, limits: MediaConfig, kind: str = "image") -> MediaError:
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return _fetch_timeout(limits, kind)
    if isinstance(exc, httpx.TooManyRedirects):
        return MediaError(f"failed to fetch {kind}: more than {limits.max_redirects} redirects")
    detail = str(exc)[:_MAX_DETAIL_CHARS] or type(exc).__name__
    return MediaError(f"failed to fetch {kind}: {detail}")


def _request_args(pinned: PinnedUrl) -> dict:
    return {"headers": {"Host": pinned.host_header}, "extensions": {"sni_hostname": pinned.server_name}}


def _next_hop(url: str, response: httpx.Response, hops: int, limits: MediaConfig, kind: str) -> str | None:
    """The redirect target, or None when the response is the answer."""
    location = response.headers.get("location")
    if not response.is_redirect or location is None:
        return None
    if hops >= limits.max_redirects:
        raise MediaError(f"failed to fetch {kind}: more than {limits.max_redirects} redirects")
    return urljoin(url, location)


def _fetch_http(url: str, limits: MediaConfig, kind: str = "image") -> bytes:
    deadline = time.monotonic() + limits.timeout_s(kind)
    body = bytearray()
    try:
        with httpx.Client(**_http_client_kwargs(limits, kind)) as client:
            for hops in range(limits.max_redirects + 1):
                _, host, port = split_target(url, kind)
                check_domain(host, limits.allowed_media_domains, kind)
                pinned = pin_url(url, resolve(host, port), limits.allow_private_media_urls, kind)
                with client.stream("GET", pinned.connect_url, **_request_args(pinned)) as response:
                    target = _next_hop(url, response, hops, limits, kind)
                    if target is not None:
                        url = target
                        continue
                    _check_http_response(response, limits, kind)
                    for chunk in response.iter_bytes():
                        _append_chunk(body, chunk, limits, deadline, kind)
                    return bytes(body)
    except MediaError:
        raise
    except Exception as exc:  # httpx, ssl, DNS, invalid URLs...: all client-facing
        raise _http_error(exc, limits, kind) from exc
    raise MediaError(f"failed to fetch {kind}: more than {limits.max_redirects} redirects")


async def fetch_http_async(url: str, limits: MediaConfig, kind: str = "image") -> bytes:
    """The body an http(s) URL answers with, under every check `load_image` applies to URLs
    (the server's API process fetches with it: vlm_engine.server.media_fetch)."""
    deadline = time.monotonic() + limits.timeout_s(kind)
    body = bytearray()
    loop = asyncio.get_running_loop()
    try:
        # asyncio.timeout also cancels a stalled await, which the per-chunk
        # deadline check alone cannot do.
        async with asyncio.timeout(limits.timeout_s(kind)):
            async with httpx.AsyncClient(**_http_client_kwargs(limits, kind)) as client:
                for hops in range(limits.max_redirects + 1):
                    _, host, port = split_target(url, kind)
                    check_domain(host, limits.allowed_media_domains, kind)
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
                    pinned = pin_url(url, addresses, limits.allow_private_media_urls, kind)
                    async with client.stream("GET", pinned.connect_url, **_request_args(pinned)) as response:
                        target = _next_hop(url, response, hops, limits, kind)
                        if target is not None:
                            url = target
                            continue
                        _check_http_response(response, limits, kind)
                        async for chunk in response.aiter_bytes():
                            _append_chunk(body, chunk, limits, deadline, kind)
                        return bytes(body)
    except MediaError:
        raise
    except Exception as exc:
        raise _http_error(exc, limits, kind) from exc
    raise MediaError(f"failed to fetch {kind}: more than {limits.max_redirects} redirects")


# --------------------------------------------------------------------------
# Decoding and normalisation
# --------------------------------------------------------------------------


def _image_formats() -> tuple[str, ...]:
    global _allowed_formats
    if _allowed_formats is None:
        Image.init()
        # Image.open raises KeyError for names it has no plugin for (AVIF
        # depends on how Pillow was built), so keep only registered ones.
        _allowed_formats = tuple(f for f in _PREFERRED_FORMATS if f in Image.OPEN)
    return _allowed_formats


def _check_pixels(size: tuple[int, int], limits: MediaConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError(f"invalid image size {width}x{height}")
    # Pillow's own guard is process-global: it *warns* above MAX_IMAGE_PIXELS
    # and raises only above twice that. Taking the minimum makes every image
    # Pillow would warn about a MediaError too, without touching the global
    # warnings filters (warnings.catch_warnings is not thread-safe, and
    # decoding runs in worker threads).
    limit = limits.max_image_pixels
    if Image.MAX_IMAGE_PIXELS is not None:
        limit = min(limit, int(Image.MAX_IMAGE_PIXELS))
    pixels = width * height
    if pixels > limit:
        raise MediaError(f"image too large: {width}x{height} = {pixels} pixels exceeds the limit of {limit}")


def decode_image(data: bytes, limits: MediaConfig = DEFAULT_MEDIA) -> Image.Image:
    """Decode encoded image bytes into a validated RGB image (first frame)."""
    if not data:
        raise MediaError("could not decode image: no data")
    if len(data) > limits.max_image_bytes:
        raise _too_large(limits)
    try:
        # Image.open only parses the header, so the pixel cap is enforced
        # before any pixel data is decompressed. It opens at frame 0, which is
        # the frame we keep for animated GIF/WebP.
        with Image.open(io.BytesIO(data), formats=_image_formats()) as image:
            return _normalize(image, limits)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(
            f"could not decode image: unrecognized or unsupported format (supported: {', '.join(_image_formats())})"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Raised by Image.open before our own check can run (the warning only
        # when the process runs with warnings as errors).
        raise MediaError(f"image too large: {exc}") from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, struct.error, ...
        raise MediaError(f"could not decode image: {_describe(exc)}") from None


def _describe(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:_MAX_DETAIL_CHARS]


def _normalize(image: Image.Image, limits: MediaConfig) -> Image.Image:
    """Validate and convert to the engine's canonical form; returns a new image.

    PIL images passed by the caller go through here too, so every source gets
    the same pixel cap, EXIF orientation and RGB conversion (and hashes the
    same). The result is always a new image, so a caller mutating its own
    object later cannot change pixels that were already hashed.
    """
    _check_pixels(image.size, limits)
    image.load()  # full decode; truncated/corrupt data fails here
    if _exif_orientation(image) not in (None, 1):
        # Phones store pixels sensor-side up and record the rotation in EXIF;
        # the model must see the picture the way the user does.
        image = ImageOps.exif_transpose(image)
    return _to_rgb(image)


def _exif_orientation(image: Image.Image) -> int | None:
    try:
        return image.getexif().get(0x0112)  # Orientation tag
    except Exception:
        # Broken EXIF is common in the wild and must not reject an otherwise
        # fine image; we just can't rotate it.
        return None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB; always returns a new image."""
    if image.mode in _HIGH_BIT_DEPTH_MODES:
        return _high_bit_depth_to_l(image).convert("RGB")
    if image.mode == "F":
        return image.convert("L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        return _composite_on_white(image)
    # convert() handles 1, L, P, CMYK, YCbCr, ... and copies when already RGB.
    return image.convert("RGB")


def _composite_on_white(image: Image.Image) -> Image.Image:
    # Alpha is composited on white rather than dropped: plain convert("RGB")
    # exposes whatever colour the fully transparent pixels happen to hold
    # (often black), so a black logo on a transparent background would turn
    # into black-on-black. White matches how viewers and browsers usually
    # show such images, which is what the user saw when sending it.
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, _WHITE_RGBA)
    background.alpha_composite(rgba)
    return background.convert("RGB")


def _high_bit_depth_to_l(image: Image.Image) -> Image.Image:
    # Pillow's convert() clips 16-bit values to 255 (most of the picture
    # turns white); scale the 0..65535 range down instead. Mode "I" is what
    # 16-bit PNG/TIFF data usually ends up as, so it gets the same range.
    values = np.asarray(image).astype(np.int64)
    values = np.clip(values, 0, 65535)
    scaled = ((values + 128) // 257).astype(np.uint8)
    return Image.fromarray(scaled, mode="L")


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def _load_offline(source: _Source, limits: MediaConfig) -> Image.Image:
    """Everything that needs no network: blocking file I/O and CPU work."""
    if isinstance(source, Image.Image):
        try:
            return _normalize(source, limits)
        except MediaError:
            raise
        except Exception as exc:  # e.g. a lazily opened image that is corrupt
            raise MediaError(f"could not decode image: {_describe(exc)}") from None
    if isinstance(source, _DataUri):
        data = _decode_data_uri(source, limits)
    elif isinstance(source, _LocalPath):
        data = _read_local_file(source, limits)
    else:  # pragma: no cover - _HttpUrl is handled by the callers
        raise TypeError(f"unexpected source {source!r}")
    return decode_image(data, limits)


def load_image(source: str | bytes | Image.Image, limits: MediaConfig = DEFAULT_MEDIA) -> Image.Image:
    """Load, validate and decode an image into a new RGB ``PIL.Image``. ``bytes`` are an encoded
    image (e.g. what the server's API process already fetched from a URL).

    Raises ``MediaError`` (and nothing else) for any problem with the source.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits)
    parsed = _parse_source(source)
    if isinstance(parsed, _HttpUrl):
        return decode_image(_fetch_http(parsed.url, limits), limits)
    return _load_offline(parsed, limits)


async def load_image_async(source: str | Image.Image, limits: MediaConfig = DEFAULT_MEDIA) -> Image.Image:
    """Async ``load_image``: network I/O on the event loop, decoding in a thread."""
    parsed = _parse_source(source)
    if isinstance(parsed, _HttpUrl):
        data = await fetch_http_async(parsed.url, limits)
        return await asyncio.to_thread(decode_image, data, limits)
    return await asyncio.to_thread(_load_offline, parsed, limits)


def load_media_bytes(source: str | bytes, limits: MediaConfig = DEFAULT_MEDIA, kind: str = "video") -> bytes:
    """The encoded bytes a source names (data URI, http(s) URL, allowed local path), under the
    same checks as images and `limits.max_bytes(kind)`. Videos are decoded elsewhere
    (`preprocess.video`): a container needs seeking, not one decode call."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise MediaError(f"empty {kind}")
        if len(data) > limits.max_bytes(kind):
            raise _too_large(limits, kind)
        return data
    parsed = _parse_source(source, kind)
    if isinstance(parsed, Image.Image):
        raise MediaError(f"a {kind} source must be a URL, data URI, path or bytes")
    if isinstance(parsed, _HttpUrl):
        return _fetch_http(parsed.url, limits, kind)
    if isinstance(parsed, _DataUri):
        return _decode_data_uri(parsed, limits, kind)
    return _read_local_file(parsed, limits, kind)
