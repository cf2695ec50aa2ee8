"""PDF files as page images for the batch CLI, rendered by `preprocess.pdf` (the renderer chat `file`
parts use too, so a page reads the same whether the CLI or a client sends the PDF)."""

from __future__ import annotations

from preprocess.pdf import PDF_LONGEST_SIDE, PdfDocument, PdfOpenError, page_png

__all__ = ["PDF_LONGEST_SIDE", "pdf_page_count", "render_pdf_pages"]


def _open(path: str) -> PdfDocument:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return PdfDocument(data)
    except PdfOpenError as exc:
        # The CLI's row error says "cannot open the PDF: <reason>" itself (inputs.py).
        raise ValueError(exc.detail) from None


def pdf_page_count(path: str) -> int:
    with _open(path) as pdf:
        return pdf.pages


def render_pdf_pages(path: str, pages: list[int], longest_side: int = PDF_LONGEST_SIDE) -> list[bytes]:
    """PNG bytes of each page, scaled so its longest side is `longest_side` pixels."""
    with _open(path) as pdf:
        return [page_png(pdf.render(index, longest_side)) for index in pages]
