"""KV page pool with a content-aware prefix cache, and the vision-encoder output cache."""

from vlm_engine.cache.page_hash import MediaSpan, page_hashes
from vlm_engine.cache.page_pool import PagePool

__all__ = ["MediaSpan", "PagePool", "page_hashes"]
