"""PDFs as chat `file` parts (preprocess/pdf.py): each page becomes one image, rendered exactly as the
batch CLI renders it, so a PDF sent as a file part and its pages sent by the CLI as PNG data URIs give
the same tokens, pixels, content hashes and greedy output. Limits (bytes, pages as images, the media
time budget) and refusals (not a PDF, corrupt, file_id) answer 400 naming the part. The API process's
fetch of a `file_url` (server/media_fetch.py) is checked against a local HTTP server."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from preprocess.errors import MediaError, PromptError
from preprocess.hashing import hash_to_int, image_content_hash
from preprocess.media import decode_image, load_image
from preprocess.pdf import NO_FILE_API, PDF_LONGEST_SIDE, PdfDocument, file_part_bytes, page_png
from preprocess.prompt import BUDGET_SPENT, PromptProcessor
from tests.conftest import make_image
from tests.server_helpers import ServerProcess
from vlm_engine.batch.inputs import WorkItem
from vlm_engine.batch.media import media_parts
from vlm_engine.batch.pdf import pdf_page_count, render_pdf_pages
from vlm_engine.config import MediaConfig, MediaPerPrompt
from vlm_engine.engine import Engine
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server.media_fetch import MediaFetcher, RemotePart, remote_parts, with_fetched

PART = "messages[0].content[1]"  # where the file part sits in `ask`'s message


def make_pdf(*pages: Image.Image) -> bytes:
    buffer = io.BytesIO()
    pages[0].save(buffer, "PDF", save_all=True, append_images=list(pages[1:]))
    return buffer.getvalue()


# Pages of different shapes and content, so order and orientation both show.
TWO_PAGES = make_pdf(make_image(300, 400, 11), make_image(400, 300, 55))
THREE_PAGES = make_pdf(make_image(200, 260, 1), make_image(260, 200, 2), make_image(240, 240, 3))
PNG = page_png(make_image(64, 48, 9))
BIG = make_pdf(*[make_image(400, 400, i) for i in range(6)])  # over `limited`'s 64 KiB file cap


def data_url(data: bytes, mime: str = "application/pdf") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def file_part(**file: Any) -> dict[str, Any]:
    return {"type": "file", "file": {"filename": "doc.pdf", **file}}


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    """One user message: a text part, then `parts` (so the first of them is `PART`), then a question."""
    content = [{"type": "text", "text": "Here is a document."}, *parts, {"type": "text", "text": "What does it say?"}]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def limited(engine: Engine) -> PromptProcessor:
    """The engine's model under a server's limits: 3 images per prompt, 64 KiB per file."""
    family = engine.processor.family
    media = MediaConfig(max_file_bytes=64 * 1024, limit_mm_per_prompt=MediaPerPrompt(image=3))
    return PromptProcessor(family, engine.processor.vocab_size, media)


@pytest.fixture(scope="module")
def pdf_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("pdf") / "doc.pdf"
    path.write_bytes(TWO_PAGES)
    return str(path)


def batch_cli_pages(path: str) -> list[dict[str, Any]]:
    """The content parts the batch CLI sends for the whole document (--pdf-pages document)."""
    return media_parts(WorkItem(source=path, kind="pdf", page=None, num_pages=pdf_page_count(path)))


def refusal(processor: PromptProcessor | Engine, messages: list[dict[str, Any]], **kwargs: Any) -> PromptError:
    convert = processor.process_messages if isinstance(processor, Engine) else processor.from_messages
    with pytest.raises(PromptError) as caught:
        convert(messages, **kwargs)
    return caught.value


def assert_same_prompt(a: ProcessedPrompt, b: ProcessedPrompt) -> None:
    assert a.token_ids == b.token_ids
    assert [m.span for m in a.media] == [m.span for m in b.media]  # offsets, lengths and content hashes
    for x, y in zip(a.media, b.media, strict=True):
        assert x.grid_thw == y.grid_thw
        assert torch.equal(x.pixel_values, y.pixel_values)
    assert np.array_equal(a.positions, b.positions)


# ---- the same pages as the batch CLI -----------------------------------------------------------------


def test_a_pdf_part_is_the_batch_cli_pages(engine: Engine, pdf_path: str) -> None:
    as_file = engine.process_messages(ask(file_part(file_data=data_url(TWO_PAGES))))
    as_images = engine.process_messages(ask(*batch_cli_pages(pdf_path)))
    assert len(as_file.media) == 2 and as_file.media[0].span.content_hash != as_file.media[1].span.content_hash
    assert_same_prompt(as_file, as_images)


def test_greedy_output_is_the_same(engine: Engine, pdf_path: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    as_file, as_images = engine.chat(
        [ask(file_part(file_data=data_url(TWO_PAGES))), ask(*batch_cli_pages(pdf_path))], greedy
    )
    assert as_file.token_ids == as_images.token_ids and len(as_file.token_ids) > 0


def test_pages_come_in_page_order(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "three.pdf"
    path.write_bytes(THREE_PAGES)
    # Each page rendered on its own by the CLI's renderer, in the order 2, 0, 1, then put back in page order.
    single = {i: render_pdf_pages(str(path), [i])[0] for i in (2, 0, 1)}
    expected = [hash_to_int(image_content_hash(decode_image(single[i]))) for i in range(3)]
    prompt = engine.process_messages(ask(file_part(file_data=data_url(THREE_PAGES))))
    assert [m.span.content_hash for m in prompt.media] == expected
    assert len(set(expected)) == 3
    assert [m.grid_thw[1] > m.grid_thw[2] for m in prompt.media] == [True, False, False]  # tall, wide, square


def test_rendered_page_is_the_decoded_png() -> None:
    """The worker keeps the rendered image; the CLI sends it as PNG: the decoded pixels are identical."""
    with PdfDocument(THREE_PAGES) as pdf:
        for index in range(pdf.pages):
            page = pdf.render(index)
            assert max(page.size) == PDF_LONGEST_SIDE and page.mode == "RGB"
            direct, via_png = load_image(page), decode_image(page_png(page))
            assert direct.size == via_png.size and direct.tobytes() == via_png.tobytes()


def test_bare_base64_and_fetched_bytes_read_as_the_data_url(engine: Engine) -> None:
    reference = engine.process_messages(ask(file_part(file_data=data_url(TWO_PAGES))))
    bare = engine.process_messages(ask(file_part(file_data=base64.b64encode(TWO_PAGES).decode())))
    fetched = engine.process_messages(ask(file_part(file_url=TWO_PAGES)))  # what the API process hands on
    octet = engine.process_messages(ask(file_part(file_url=data_url(TWO_PAGES, "application/octet-stream"))))
    for other in (bare, fetched, octet):
        assert_same_prompt(reference, other)


def test_pdf_rendering_is_timed(engine: Engine) -> None:
    engine.processor.take_media_timings()
    engine.process_messages(ask(file_part(file_data=data_url(TWO_PAGES))))
    kinds = [kind for kind, _ in engine.processor.take_media_timings()]
    assert kinds.count("pdf_render") == 1 and "image_decode" not in kinds


def test_an_absurd_page_size_is_bounded_by_the_render_scale() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (100, 3), "red").save(buffer, "PDF", resolution=0.01)  # a 720000 x 21600 pt page
    with PdfDocument(buffer.getvalue()) as pdf:
        assert pdf.render(0).size == (PDF_LONGEST_SIDE, 39)


# ---- refusals and limits -----------------------------------------------------------------------------


def test_pages_count_toward_the_image_limit_before_anything_renders(
    limited: PromptProcessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = {"type": "image_url", "image_url": {"url": data_url(PNG, "image/png")}}
    assert len(limited.from_messages(ask(file_part(file_data=data_url(TWO_PAGES)), image)).media) == 3

    def never(*args: Any) -> None:
        raise AssertionError("a page was rendered")

    monkeypatch.setattr(PdfDocument, "render", never)
    err = refusal(limited, ask(image, image, file_part(file_data=data_url(TWO_PAGES))))
    assert err.param == "messages[0].content[3]"
    assert (
        "the PDF has 2 pages" in err.message and "at most 3 images" in err.message and "2 already used" in err.message
    )
    err = refusal(limited, ask(file_part(file_data=data_url(make_pdf(*[make_image(20, 20, i) for i in range(4)])))))
    assert err.param == PART and "4 pages" in err.message


def test_images_after_the_pdf_still_count(limited: PromptProcessor) -> None:
    image = {"type": "image_url", "image_url": {"url": data_url(PNG, "image/png")}}
    err = refusal(limited, ask(file_part(file_data=data_url(TWO_PAGES)), image, image))
    assert "at most 3 images per prompt" in err.message


@pytest.mark.parametrize(
    ("file", "says"),
    [
        ({"file_data": data_url(PNG, "image/png")}, "only PDF files are supported"),
        ({"file_data": data_url(b"hello, world")}, "only PDF files are supported"),
        ({"file_data": data_url(b"%PDF-1.7\n1 0 obj garbage")}, "could not open the PDF"),
        ({"file_data": data_url(TWO_PAGES[: len(TWO_PAGES) // 3])}, "could not open the PDF"),
        ({"file_id": "file-abc123"}, NO_FILE_API),
        ({"file_id": "file-abc123", "file_data": data_url(TWO_PAGES)}, NO_FILE_API),
        ({"file_data": "data:application/pdf;base64,@@@@"}, "not valid base64"),
        ({"file_data": "data:application/pdf,%PDF-1.7"}, "base64 data URL"),
        ({"file_data": "not base64 at all!"}, "not valid base64"),
        ({"file_data": ""}, "file_data is empty"),
        ({"file_data": 12}, "file_data must be a string"),
        ({}, "needs file_data"),
        ({"file_data": data_url(TWO_PAGES), "file_url": "https://example.com/a.pdf"}, "not both"),
        ({"file_url": "/etc/passwd"}, "local file paths are not allowed"),
    ],
)
def test_bad_file_parts_are_refused_naming_the_part(engine: Engine, file: dict[str, Any], says: str) -> None:
    err = refusal(engine, ask({"type": "file", "file": file}))
    assert err.param == PART and says in err.message and err.message.startswith(PART)


def test_a_file_part_must_carry_an_object(engine: Engine) -> None:
    err = refusal(engine, ask({"type": "file", "file": data_url(TWO_PAGES)}))
    assert err.param == PART and "needs a 'file' object" in err.message


def test_the_byte_cap_holds_for_every_source(limited: PromptProcessor) -> None:
    assert len(BIG) > 64 * 1024 > len(TWO_PAGES)
    for file in ({"file_data": data_url(BIG)}, {"file_data": base64.b64encode(BIG).decode()}, {"file_url": BIG}):
        err = refusal(limited, ask(file_part(**file)))
        assert err.param == PART and f"file too large: more than {64 * 1024} bytes" in err.message


def test_the_media_time_budget_is_checked_between_pages(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    rendered: list[int] = []
    render = PdfDocument.render

    def slow(self: PdfDocument, index: int, longest_side: int = PDF_LONGEST_SIDE) -> Image.Image:
        rendered.append(index)
        time.sleep(0.3)
        return render(self, index, longest_side)

    monkeypatch.setattr(PdfDocument, "render", slow)
    err = refusal(
        engine.processor, ask(file_part(file_data=data_url(THREE_PAGES))), media_deadline=time.monotonic() + 0.2
    )
    assert err.param == PART and BUDGET_SPENT in err.message
    assert rendered == [0]


def test_models_without_images_refuse_pdfs() -> None:
    text_only = types.SimpleNamespace(tokenizer=None, accepts_images=False, accepts_videos=False, content_parts=False)
    processor = PromptProcessor(text_only, vocab_size=10)  # type: ignore[arg-type]
    err = refusal(processor, ask(file_part(file_data=data_url(TWO_PAGES))))
    assert err.param == PART and err.message == "this model does not accept images (PDF pages are sent as images)"


def test_file_part_bytes_checks_the_magic_in_the_first_kib() -> None:
    # PDF readers accept a few bytes before the header; the magic check does too, within the first KiB.
    assert file_part_bytes({"file_data": data_url(b"\xef\xbb\xbf" + TWO_PAGES)}, MediaConfig()).endswith(TWO_PAGES)
    with pytest.raises(MediaError, match="only PDF files"):
        file_part_bytes({"file_data": data_url(b" " * 1024 + TWO_PAGES)}, MediaConfig())


# ---- the batch CLI's renderer ------------------------------------------------------------------------


def test_the_batch_cli_renders_through_the_shared_renderer(pdf_path: str, tmp_path: Path) -> None:
    assert pdf_page_count(pdf_path) == 2
    pngs = render_pdf_pages(pdf_path, [1, 0], longest_side=300)
    assert [Image.open(io.BytesIO(png)).size for png in pngs] == [(300, 225), (225, 300)]
    with PdfDocument(TWO_PAGES) as pdf:
        assert pngs == [page_png(pdf.render(1, 300)), page_png(pdf.render(0, 300))]
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"not a pdf")
    with pytest.raises(ValueError, match=r"^Failed to load document"):  # the CLI's row: "cannot open the PDF: ..."
        pdf_page_count(str(broken))


# ---- file_url, fetched by the API process ------------------------------------------------------------


def test_remote_file_parts_are_found_and_replaced_by_their_bytes() -> None:
    url = "https://example.com/doc.pdf"
    messages = ask(
        file_part(file_url=url),
        {"type": "file", "file": url},  # not a file part's shape: left to the worker to refuse
        file_part(file_data=data_url(TWO_PAGES)),
        file_part(file_url="file:///srv/doc.pdf"),
    )
    assert remote_parts(messages) == [RemotePart(0, 1, "file", url)]
    replaced = with_fetched(messages, {RemotePart(0, 1, "file", url): b"%PDF-bytes"})
    assert replaced[0]["content"][1] == {"type": "file", "file": {"filename": "doc.pdf", "file_url": b"%PDF-bytes"}}
    assert messages[0]["content"][1]["file"]["file_url"] == url  # the request's own messages are untouched


@pytest.fixture(scope="module")
def pdf_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = TWO_PAGES if self.path == "/doc.pdf" else BIG
            self.send_response(200)
            self.send_header("Content-Type", "application/pdf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_a_fetched_file_url_renders_as_file_data(engine: Engine, pdf_server: str) -> None:
    fetcher = MediaFetcher(MediaConfig(allow_private_media_urls=True))
    messages = ask(file_part(file_url=f"{pdf_server}/doc.pdf"))
    fetched, _ = asyncio.run(fetcher.fetch_all(messages, time.monotonic() + 30))
    assert fetched[0]["content"][1]["file"]["file_url"] == TWO_PAGES
    assert_same_prompt(
        engine.process_messages(fetched), engine.process_messages(ask(file_part(file_data=data_url(TWO_PAGES))))
    )


def test_a_fetched_file_url_is_held_to_the_file_byte_cap(pdf_server: str) -> None:
    fetcher = MediaFetcher(MediaConfig(allow_private_media_urls=True, max_file_bytes=64 * 1024))
    with pytest.raises(MediaError) as caught:
        asyncio.run(fetcher.fetch_all(ask(file_part(file_url=f"{pdf_server}/big.pdf")), None))
    assert caught.value.param == PART and "file too large" in caught.value.message


# ---- through the real server (conftest's shared `observed_server`) -----------------------------------


def served_chat(server: ServerProcess, *parts: dict[str, Any]) -> httpx.Response:
    body = {"model": "tiny-vlm", "messages": ask(*parts), "max_tokens": 6, "temperature": 0}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


@pytest.mark.slow
def test_a_served_pdf_part_answers_as_the_batch_cli_pages(observed_server: ServerProcess, pdf_path: str) -> None:
    as_file = served_chat(observed_server, file_part(file_data=data_url(TWO_PAGES)))
    as_images = served_chat(observed_server, *batch_cli_pages(pdf_path))
    assert as_file.status_code == 200, as_file.text
    assert as_file.json()["usage"]["prompt_tokens"] == as_images.json()["usage"]["prompt_tokens"]
    assert as_file.json()["choices"][0]["message"] == as_images.json()["choices"][0]["message"]
    refused = served_chat(observed_server, file_part(file_id="file-abc123"))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == PART and NO_FILE_API in refused.json()["error"]["message"]
