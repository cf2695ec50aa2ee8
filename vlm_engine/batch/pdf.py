"""PDF pages as images, rendered with pypdfium2 (imported on first use: only PDF inputs need it)."""

from __future__ import annotations

import io

PDF_LONGEST_SIDE = 1288  # olmOCR's page size: enough for print-sized text


def pdf_page_count(path: str) -> int:
    import pypdfium2

    with open(path, "rb") as f:
        pdf = pypdfium2.PdfDocument(f.read())
    try:
        return len(pdf)
    finally:
        pdf.close()


def render_pdf_pages(path: str, pages: list[int], longest_side: int = PDF_LONGEST_SIDE) -> list[bytes]:
    """PNG bytes of each page, scaled so its longest side is `longest_side` pixels."""
    import pypdfium2

    with open(path, "rb") as f:
        pdf = pypdfium2.PdfDocument(f.read())
    try:
        out = []
        for index in pages:
            page = pdf[index]
            width, height = page.get_size()  # PDF points
            image = page.render(scale=longest_side / max(width, height, 1)).to_pil().convert("RGB")
            buffer = io.BytesIO()
            image.save(buffer, "PNG")
            out.append(buffer.getvalue())
            page.close()
        return out
    finally:
        pdf.close()
