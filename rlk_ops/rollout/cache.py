"""Paged KV cache manager: a page allocator with a free list, per-sequence page lists,
slot mappings, page tables.

Pages are handed out from a shuffled free list, so a sequence's pages are not
contiguous (the invariance claims cover any placement). Running out of pages raises
``CacheFullError`` before anything is allocated or written; it never overwrites.
"""
from __future__ import annotations

from collections import deque

import torch


class CacheFullError(RuntimeError):
    """Not enough free pages for a request."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.bfloat16, device="cpu", seed: int = 0):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be > 0, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._free: deque[int] = deque(order)
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self.device = torch.device(device)

    # ------------------------------------------------------------- bookkeeping
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def length(self, seq: int) -> int:
        return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        return list(self._pages[seq])

    def __contains__(self, seq: int) -> bool:
        return seq in self._lens

    def add(self, seq: int) -> None:
        if seq in self._lens:
            raise ValueError(f"sequence {seq} is already in the cache")
        self._pages[seq] = []
        self._lens[seq] = 0

    def reserve(self, seq: int, n_new: int) -> torch.Tensor:
        """Grow ``seq`` by ``n_new`` tokens; returns their slot_mapping (int64 [n_new])."""
        if seq not in self._lens:
            raise KeyError(f"sequence {seq} is not in the cache (add it first)")
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        start = self._lens[seq]
        ps = self.page_size
        need = -(-(start + n_new) // ps) - len(self._pages[seq])
        if need > len(self._free):
            raise CacheFullError(
                f"sequence {seq} needs {need} more pages for {n_new} tokens but only {len(self._free)} of "
                f"{self.num_pages} pages are free; finish or evict a sequence first")
        for _ in range(need):
            self._pages[seq].append(self._free.popleft())
        self._lens[seq] = start + n_new
        pos = torch.arange(start, start + n_new)
        pages = torch.tensor(self._pages[seq], dtype=torch.int64)
        return (pages[pos // ps] * ps + pos % ps).to(self.device)

    def reserve_batch(self, requests: list[tuple[int, int]]) -> torch.Tensor:
        """Reserve ``(seq, n_new)`` for several sequences at once, all or nothing:
        the pages for every request are counted before any is taken. Returns the
        concatenated slot_mapping."""
        need = 0
        for seq, n_new in requests:
            if seq not in self._lens:
                raise KeyError(f"sequence {seq} is not in the cache (add it first)")
            need += max(0, -(-(self._lens[seq] + n_new) // self.page_size) - len(self._pages[seq]))
        if need > len(self._free):
            raise CacheFullError(
                f"this step needs {need} more pages for {len(requests)} sequences but only {len(self._free)} of "
                f"{self.num_pages} pages are free; finish or evict a sequence first")
        return torch.cat([self.reserve(seq, n_new) for seq, n_new in requests])

    def release(self, seq: int) -> None:
        """Finish ``seq``: its pages go back to the free list."""
        self._free.extend(self._pages.pop(seq))
        del self._lens[seq]

    # --------------------------------------------------------------- op inputs
    def page_table(self, seqs: list[int]) -> torch.Tensor:
        width = max(1, max(len(self._pages[s]) for s in seqs))
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self, seqs: list[int]) -> torch.Tensor:
        return torch.tensor([self._lens[s] for s in seqs], dtype=torch.int32, device=self.device)
