"""Media preprocessing: loading, validating and hashing request media.

Knows nothing about KV caches, batching or HTTP serving; the engine and the
server call into it.
"""

from preprocess.errors import MediaError
from preprocess.hashing import hash_bytes, hash_to_int, image_content_hash
from preprocess.media import (
    DEFAULT_MEDIA,
    decode_image,
    load_image,
    load_image_async,
)

__all__ = [
    "DEFAULT_MEDIA",
    "MediaError",
    "decode_image",
    "hash_bytes",
    "hash_to_int",
    "image_content_hash",
    "load_image",
    "load_image_async",
]
