"""KV pages of sliding-window layers: a pool of their own, given back as the window moves on.

A layer with a window of W tokens never reads a key W or more positions behind its query (Gemma 3:
five of every six layers, W = 1024). When a model has such layers, the engine keeps their KV in a
second `PagePool` with a page table per request of its own (`Request.window_page_ids`, indexed like
`page_ids` and always as long): once every position of a page lies before the window of the
request's next query, the page goes back to the pool and its entry becomes `RELEASED`. A long
request then holds about W tokens of KV in those layers instead of all of them. Global layers keep
the ordinary pool and page table.

The prefix cache spans both pools under the same page keys: a page is published in both when it
fills (its window copy only while still held); a hit is the global pool's run of cached pages,
shortened until the window pool also holds every page the next query's window reaches back to.
"""

from __future__ import annotations

from vlm_engine.cache.page_pool import PagePool
from vlm_engine.scheduler.request import Request

RELEASED = -1  # a window page-table entry whose page went back to the pool


class WindowPages:
    def __init__(self, pool: PagePool, window: int) -> None:
        if window < 1:
            raise ValueError("a sliding window holds at least one token")
        self.pool = pool
        self.window = window
        self.page_size = pool.page_size

    def first_readable_page(self, position: int) -> int:
        """The first page a query at `position` or later can read: its window starts at position - W + 1."""
        return max(0, position - self.window + 1) // self.page_size

    def can_grow(self, num_new_pages: int, reserve: int = 0) -> bool:
        return num_new_pages <= self.pool.num_free - reserve

    def grow(self, request: Request, num_new_pages: int) -> None:
        """Extend the window page table by `num_new_pages` (the caller checked `can_grow`)."""
        pages = self.pool.allocate(num_new_pages)
        if pages is None:
            raise RuntimeError("window pool exhausted after can_grow said otherwise")
        request.window_page_ids.extend(pages)

    def release_behind(self, request: Request) -> None:
        """Give back the pages no later query of `request` can read (before its next query's window)."""
        table = request.window_page_ids
        end = min(self.first_readable_page(request.num_computed_tokens), len(table))
        behind = [page for page in table[request.num_window_released : end] if page != RELEASED]
        if behind:
            self.pool.free(behind)
        for index in range(request.num_window_released, end):
            table[index] = RELEASED
        request.num_window_released = max(request.num_window_released, end)

    def register(self, request: Request, first: int, keys: list[int]) -> None:
        """Publish the window copies of full pages `first ..` under `keys` (those still held)."""
        for index, key in enumerate(keys, start=first):
            page = request.window_page_ids[index]
            if page != RELEASED:
                self.pool.register(page, key)

    def match(self, request: Request, keys: list[int], num_hit_pages: int) -> int:
        """The longest hit of at most `num_hit_pages` pages whose window pages are all cached too;
        takes references on those and fills the request's window page table. Returns its length."""
        for hit in range(num_hit_pages, 0, -1):
            first = self.first_readable_page(hit * self.page_size)
            pages = [self.pool.cached_page(key) for key in keys[first:hit]]
            if all(page is not None for page in pages):
                held = [page for page in pages if page is not None]
                self.pool.acquire(held)
                request.window_page_ids = [RELEASED] * first + held
                request.num_window_released = first
                return hit
        return 0

    def trim(self, request: Request, keep: int) -> None:
        """Drop the window page table's entries from `keep` on (rejected draft slots)."""
        tail = [page for page in request.window_page_ids[keep:] if page != RELEASED]
        if tail:
            self.pool.free(tail)
        del request.window_page_ids[keep:]
        request.num_window_released = min(request.num_window_released, keep)

    def release_all(self, request: Request) -> None:
        self.pool.free(held_pages(request))
        request.window_page_ids = []
        request.num_window_released = 0


def held_pages(request: Request) -> list[int]:
    """The window pool pages `request` holds, in table order."""
    return [page for page in request.window_page_ids if page != RELEASED]
