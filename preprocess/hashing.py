"""Content hashes for media.

The engine keys its prefix cache on *what the model sees*, so image hashes are
taken over decoded pixels, not over the encoded bytes: the same picture sent
as a PNG data URI, as a file or as a PIL object must share cache entries, and
two different encodings of it must not miss the cache just because the
container bytes differ.
"""

from __future__ import annotations

import hashlib
import string

from PIL import Image

DIGEST_SIZE = 16  # 128 bits: collisions are negligible for a cache key

# Distinct BLAKE2 personalisations keep the two hash domains apart: raw bytes
# that happen to equal an image's header+pixels can't collide with its hash.
_IMAGE_PERSON = b"vlm-image-v1"
_BYTES_PERSON = b"vlm-bytes-v1"

_MASK_63 = (1 << 63) - 1
_HEX_DIGITS = frozenset(string.hexdigits)


def image_content_hash(image: Image.Image) -> str:
    """Hex digest of an image's mode, size and pixels (and palette if any).

    Intended for images returned by ``load_image`` (always RGB); other modes
    are hashed by their raw bytes, so they hash consistently but differently
    from their RGB conversion.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_IMAGE_PERSON)
    # Mode and size go in first so e.g. a 2x3 and a 3x2 image with the same
    # bytes, or "L" vs "P" data, never collide.
    h.update(f"{image.mode}\0{image.width}x{image.height}\0".encode())
    if image.mode in ("P", "PA"):
        # Palette images: the same indices mean different colours under a
        # different palette.
        palette = image.getpalette(rawmode=None) or []
        h.update(bytes(palette))
    h.update(image.tobytes())
    return h.hexdigest()


def hash_bytes(data: bytes) -> str:
    """Hex digest of raw bytes (e.g. encoded media before decoding)."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, person=_BYTES_PERSON).hexdigest()


def hash_to_int(hex_digest: str) -> int:
    """Fold a hex digest into a stable non-negative 63-bit int.

    63 bits so the value fits a signed int64 (numpy/torch token-id tensors)
    without going negative. The digests are uniformly distributed, so taking
    the leading 64 bits loses nothing meaningful.
    """
    if not hex_digest or not _HEX_DIGITS.issuperset(hex_digest):
        # int(x, 16) alone would also accept "0x", "_" and whitespace.
        raise ValueError(f"not a hex digest: {hex_digest!r}")
    return int(hex_digest[:16], 16) & _MASK_63
