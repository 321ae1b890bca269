"""Paged KV cache manager: a page allocator with a free list, per-sequence page lists,
slot mappings, page tables.

Pages are handed out from a shuffled free list, so a sequence's pages are not
contiguous (the invariance claims cover any placement). Running out of pages raises
``CacheFullError`` before anything is allocated or written; it never overwrites.
"""
from __future__ import annotations

from collections import deque

import torch

from rlk_ops.ops._validate import FLOAT_DTYPES, positive_ints


class CacheFullError(RuntimeError):
    """Not enough free pages for a request."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype=torch.bfloat16, device="cpu", seed: int = 0):
        positive_ints("PagedKVCache", num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                      num_kv_heads=num_kv_heads, head_dim=head_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"PagedKVCache dtype must be a floating-point torch.dtype, got {dtype!r}")
        if dtype not in FLOAT_DTYPES:   # e.g. float8_e4m3fn: refused by the first append, after a forward ran
            raise ValueError(f"PagedKVCache dtype must be one the paged ops take, one of "
                             f"{', '.join(str(d) for d in FLOAT_DTYPES)}, got {dtype}")
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"PagedKVCache device must be a torch.device or its name, got {device!r}") from e
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"PagedKVCache seed must be an int in [0, 2**63) (it shuffles the free list), "
                             f"got {seed!r}")
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

    def _known(self, seq: int) -> None:
        if seq not in self._lens:
            raise KeyError(f"sequence {seq!r} is not in the cache (never added, or already released)")

    def length(self, seq: int) -> int:
        self._known(seq)
        return self._lens[seq]

    def pages(self, seq: int) -> list[int]:
        self._known(seq)
        return list(self._pages[seq])

    def __contains__(self, seq: int) -> bool:
        return seq in self._lens

    def add(self, seq: int) -> None:
        if seq in self._lens:
            raise ValueError(f"sequence {seq} is already in the cache")
        self._pages[seq] = []
        self._lens[seq] = 0

    def reserve(self, seq: int, n_new: int) -> torch.Tensor:
        """Grow ``seq`` by ``n_new`` tokens; returns their slot_mapping (int64 [n_new]). If the forward
        that was to write them fails, ``truncate(seq, old_length)`` gives the slots back."""
        self._known(seq)
        _count("n_new", n_new)
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
        _listed("reserve_batch", "requests", requests, "(seq, n_new) pairs")
        seen: set[int] = set()
        need = 0
        for item in requests:  # every check before any page is taken
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"reserve_batch: each request must be a (seq, n_new) pair, got {item!r}")
            seq, n_new = item
            self._known(seq)
            _count(f"n_new of sequence {seq!r}", n_new)
            if seq in seen:
                raise ValueError(f"reserve_batch: sequence {seq!r} appears twice; give each sequence once with "
                                 f"its total n_new")
            seen.add(seq)
            need += max(0, -(-(self._lens[seq] + n_new) // self.page_size) - len(self._pages[seq]))
        if need > len(self._free):
            raise CacheFullError(
                f"this step needs {need} more pages for {len(requests)} sequences but only {len(self._free)} of "
                f"{self.num_pages} pages are free; finish or evict a sequence first")
        if not requests:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat([self.reserve(seq, n_new) for seq, n_new in requests])

    def truncate(self, seq: int, length: int) -> None:
        """Shrink ``seq`` back to its first ``length`` tokens, e.g. to undo a ``reserve`` whose forward
        failed: the reserved slots were never written, and a second ``reserve`` on top would have the
        next forward attend to them (what the cache held there) without an error. Pages past the new
        length go back to the free list; the rows kept are untouched."""
        self._known(seq)
        _count("length", length)
        if length > self._lens[seq]:
            raise ValueError(f"PagedKVCache.truncate: length must be at most sequence {seq}'s length "
                             f"{self._lens[seq]}, got {length}")
        keep = -(-length // self.page_size)
        self._free.extend(self._pages[seq][keep:])
        del self._pages[seq][keep:]
        self._lens[seq] = length

    def release(self, seq: int) -> None:
        """Finish ``seq``: its pages go back to the free list."""
        self._known(seq)
        self._free.extend(self._pages.pop(seq))
        del self._lens[seq]

    # --------------------------------------------------------------- op inputs
    def page_table(self, seqs: list[int]) -> torch.Tensor:
        _listed("page_table", "seqs", seqs, "sequence ids")
        for s in seqs:
            self._known(s)
        width = max([1] + [len(self._pages[s]) for s in seqs])
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self._pages[s])] = torch.tensor(self._pages[s], dtype=torch.int32)
        return table.to(self.device)

    def seq_lens(self, seqs: list[int]) -> torch.Tensor:
        _listed("seq_lens", "seqs", seqs, "sequence ids")
        for s in seqs:
            self._known(s)
        return torch.tensor([self._lens[s] for s in seqs], dtype=torch.int32, device=self.device)


def _listed(where: str, name: str, value, what: str) -> None:
    """A list, tuple or range (a generator would be used up by the checks, and the call then saw nothing:
    a session 38 audit; a bare int is no list)."""
    if not isinstance(value, (list, tuple, range)):
        raise ValueError(f"PagedKVCache.{where}: {name} must be a list, tuple or range of {what}, got "
                         f"{type(value).__name__} {value!r}"[:300])


def _count(name: str, value) -> None:
    """A token count: an int >= 0 (a float or a bool is refused, not truncated)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
