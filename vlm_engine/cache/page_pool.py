"""A pool of fixed-size KV pages with reference counts and a hash-addressed prefix cache.

Invariants (checked by `check_invariants`, relied on everywhere else):
- every page is either referenced (ref_count > 0) or in the free queue, never both;
- a page in the free queue may still hold a cached prefix (it has a hash); allocating it evicts that entry;
- `hash_to_page[h] == p` iff `page_hash[p] == h`.

Freed pages go to the back of the free queue and allocation takes from the front, so the least
recently released cached prefix is evicted first (LRU), while a request that frees its pages in
reverse order makes its tail pages go before the shared head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        # OrderedDict as an O(1) removable queue: page id -> None.
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.hits = 0  # pages served from the prefix cache
        # Called with a page key when its cached content goes (state snapshots go with it).
        self.on_evict: Callable[[int], None] | None = None
        self.queries = 0  # pages looked up in the prefix cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_page)

    def allocate(self, n: int) -> list[int] | None:
        """Take n pages, evicting cached prefixes as needed; None (and nothing taken) if too few."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            self._evict(page)
            self.ref_count[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages nobody holds return to the free queue."""
        for page in reversed(pages):
            count = self.ref_count[page] - 1
            if count < 0:
                raise RuntimeError(f"page {page} freed more often than allocated")
            self.ref_count[page] = count
            if count == 0:
                self._free[page] = None

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Take a reference on the longest run of cached pages matching `hashes` from the start."""
        if not self.enable_prefix_cache:
            return []
        pages = []
        for h in hashes:
            page = self.hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        self.queries += len(hashes)
        self.hits += len(pages)
        self.acquire(pages)
        return pages

    def cached_page(self, page_hash: int) -> int | None:
        """The page holding `page_hash`'s content, if cached (no reference taken)."""
        return self.hash_to_page.get(page_hash) if self.enable_prefix_cache else None

    def acquire(self, pages: list[int]) -> None:
        """Take a reference on each of `pages` (cached pages found with `cached_page`)."""
        for page in pages:
            if self.ref_count[page] == 0:
                del self._free[page]
            self.ref_count[page] += 1

    def register(self, page: int, page_hash: int) -> None:
        """Publish a full, computed page under its content hash (first writer wins)."""
        if not self.enable_prefix_cache or self.page_hash[page] is not None:
            return
        if page_hash in self.hash_to_page:
            return  # same content already cached in another page; this one stays private
        self.page_hash[page] = page_hash
        self.hash_to_page[page_hash] = page

    def reset_prefix_cache(self) -> None:
        for h, page in list(self.hash_to_page.items()):
            self.page_hash[page] = None
            if self.on_evict is not None:
                self.on_evict(h)
        self.hash_to_page.clear()

    def _evict(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None:
            del self.hash_to_page[h]
            self.page_hash[page] = None
            if self.on_evict is not None:
                self.on_evict(h)

    def check_invariants(self) -> None:
        for page in range(self.num_pages):
            in_free = page in self._free
            if in_free == (self.ref_count[page] > 0):
                raise AssertionError(f"page {page}: ref_count {self.ref_count[page]}, in free queue {in_free}")
        for h, page in self.hash_to_page.items():
            if self.page_hash[page] != h:
                raise AssertionError(f"hash map out of step at page {page}")
