"""PDF pages as images: the one renderer of the batch CLI and of chat `file` parts.

A page is rendered by pypdfium2 (imported on first use: only PDFs need it) so that its longest side
is `PDF_LONGEST_SIDE` pixels, then converted to RGB. The batch CLI sends each page as a PNG data URI
(`page_png`); a chat `file` part hands the same image to the image loader. PNG is lossless, so both
paths give the model the same pixels, the same content hashes and the same tokens.

A chat file part names its bytes as OpenAI's chat API does: `{"file": {"file_data": "data:application/pdf;
base64,..." | bare base64, "filename"?}}`, or `{"file": {"file_url": ...}}` (http(s) URLs are fetched by
the server's API process, which then sends the bytes in place of the URL). Only PDFs are accepted.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
from typing import Any, Self

from PIL import Image

from preprocess.errors import MediaError
from preprocess.media import load_media_bytes
from vlm_engine.config import MediaConfig

PDF_LONGEST_SIDE = 1288  # olmOCR's page size: enough for print-sized text
PDF_MAGIC = b"%PDF-"
# PDF readers (PDFium and Acrobat alike) accept the header anywhere in the first KiB: some producers
# write a few bytes (a BOM, a mail header) before it.
_MAGIC_WINDOW = 1024

# PDFium is not thread-safe and pypdfium2 does not serialize calls; in-process callers (the batch CLI
# renders on its own threads while the engine's preprocessing thread may render file parts) share
# this lock. A server worker renders one prompt at a time, so it never waits on it.
_PDFIUM = threading.Lock()

NO_FILE_API = "file_id is not supported: this server has no Files API; send file_data"


class PdfOpenError(MediaError):
    """PDFium could not open the document; `detail` is PDFium's own message."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"could not open the PDF: {detail}")
        self.detail = detail


class PdfDocument:
    """An open PDF (close it, or use it as a context manager): its page count and pages as RGB images."""

    def __init__(self, data: bytes) -> None:
        import pypdfium2

        with _PDFIUM:
            try:
                self._pdf = pypdfium2.PdfDocument(data)
            except pypdfium2.PdfiumError as exc:  # corrupt, truncated, encrypted with a password
                raise PdfOpenError(str(exc)) from None
            self.pages = len(self._pdf)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with _PDFIUM:
            self._pdf.close()

    def render(self, index: int, longest_side: int = PDF_LONGEST_SIDE) -> Image.Image:
        """Page `index` (0-based) scaled so its longest side is `longest_side` pixels, RGB. The scale
        bounds the bitmap whatever size the page claims."""
        with _PDFIUM:
            try:
                page = self._pdf[index]
                try:
                    width, height = page.get_size()  # PDF points
                    return page.render(scale=longest_side / max(width, height, 1)).to_pil().convert("RGB")
                finally:
                    page.close()
            except Exception as exc:  # noqa: BLE001 - PDFium raises its own error types (and ValueError, ...)
                raise MediaError(f"could not render page {index + 1} of the PDF: {exc}") from None


def page_png(image: Image.Image) -> bytes:
    """A rendered page as PNG bytes (the batch CLI's data URIs)."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def check_pdf(data: bytes) -> None:
    if PDF_MAGIC not in data[:_MAGIC_WINDOW]:
        raise MediaError("only PDF files are supported (the file does not start with %PDF-)")


def file_part_bytes(file: Any, limits: MediaConfig) -> bytes:
    """The bytes a chat file part's `file` object names, under `limits.max_file_bytes`; checked to be a
    PDF. Raises MediaError (the caller names the part)."""
    if not isinstance(file, dict):
        raise MediaError("a file part needs a 'file' object with file_data or file_url")
    if file.get("file_id") is not None:
        raise MediaError(NO_FILE_API)
    data, url = file.get("file_data"), file.get("file_url")
    if data is not None and url is not None:
        raise MediaError("a file part takes file_data or file_url, not both")
    if data is None and url is None:
        raise MediaError("a file part needs file_data (a base64 data URL) or file_url")
    source = data if data is not None else url
    if isinstance(source, (bytes, bytearray, memoryview)):  # fetched by the server's API process
        out = load_media_bytes(bytes(source), limits, "file")
    elif not isinstance(source, str):
        raise MediaError(f"{'file_data' if data is not None else 'file_url'} must be a string")
    elif data is not None or source[:5].lower() == "data:":
        out = _decode_file_data(source, limits)
    else:
        out = load_media_bytes(source, limits, "file")  # http(s) in process, or an allowed local path
    check_pdf(out)
    return out


def _decode_file_data(text: str, limits: MediaConfig) -> bytes:
    """A base64 data URL or, as some clients send it, bare base64: a URL or path has characters
    outside the base64 alphabet (':' at least), so the two cannot be confused."""
    payload = text
    if text[:5].lower() == "data:":
        header, comma, payload = text[5:].partition(",")
        if not comma or header.split(";")[-1].strip().lower() != "base64":
            raise MediaError("file_data must be a base64 data URL (data:application/pdf;base64,...) or base64")
    # The encoded length is checked first so an oversized payload is never decoded (4 chars carry 3 bytes).
    if len(payload) > 4 * -(-limits.max_file_bytes // 3):
        raise MediaError(f"file too large: more than {limits.max_file_bytes} bytes")
    try:
        out = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("file_data is not valid base64 (send a data URL: data:application/pdf;base64,...)") from None
    if not out:
        raise MediaError("file_data is empty")
    if len(out) > limits.max_file_bytes:
        raise MediaError(f"file too large: more than {limits.max_file_bytes} bytes")
    return out
