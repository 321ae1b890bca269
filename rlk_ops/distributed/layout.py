"""Sequence sharding over the cp mesh dim: which tokens a rank holds, and the index
tensors context-parallel attention needs. Built on the host from the *global*
``cu_seqlens`` (Python ints), once per batch, outside any compiled region: the
compiled step then sees only tensors and ints, so no value check or ``.tolist()``
lands in the graph.

Chunking. Every sequence of the packed batch is cut into ``n_chunks`` equal chunks:

* ``contiguous``: ``n_chunks = cp``; rank r holds chunk r of every sequence.
* ``zigzag`` (load-balanced): ``n_chunks = 2 * cp``; rank r holds chunks r and
  ``2*cp - 1 - r``, so every rank gets the same amount of causal work.
* canonical (``chunks=N``): the same two assignments, but over N fixed chunks
  (N a multiple of cp, or of 2*cp for zigzag); each chunk stays its own attention
  segment so its dK/dV partial can be summed in a topology-independent order.

A rank's chunks, ascending, are its *pieces*. Local token order is piece-major, then
sequence: piece p holds chunk ``chunk_ids[p]`` of sequence 0, then of sequence 1, ...
The *cp layout* of a global tensor is the concatenation of every rank's local tokens
in rank order; a DTensor with ``Shard(0)`` on cp describes a tensor in that order
(``to_cp_layout`` / ``from_cp_layout`` convert from / to natural packed order).
``rlk::all_gather`` of local tensors over cp yields exactly the cp layout.

Attention segments. Segment (p, b) = the queries of piece p in sequence b, attending
(causal, bottom-right aligned) to the key *prefix* of sequence b that ends at the
segment's last query. ``key_index`` picks those prefixes out of the all-gathered
keys; prefixes of one rank overlap (zigzag), so the same key can sit in several
segments: ``piece_index[p, t]`` is the segment-key slot of gathered key t in piece p
(or the sentinel ``len(key_index)``, a zero row), which is how the backward folds
dK/dV back onto the gathered keys in a fixed order.
"""
from __future__ import annotations

import hashlib

from dataclasses import dataclass, fields, replace

import torch

MODES = ("contiguous", "zigzag")


class LayoutError(ValueError):
    """A batch cannot be sharded as asked (raised before any communication)."""


def _fail(msg: str) -> None:
    raise LayoutError(f"rlk_ops.distributed: {msg}")


def n_chunks_for(mode: str, cp: int, chunks: int | None) -> int:
    if mode not in MODES:
        _fail(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        _fail(f"cp must be a positive int, got {cp!r}")
    unit = cp if mode == "contiguous" else 2 * cp
    if chunks is None:
        return unit
    if not isinstance(chunks, int) or isinstance(chunks, bool):  # True would pass as 1
        _fail(f"chunks (canonical token chunks per sequence) must be an int or None, got "
              f"{type(chunks).__name__} {chunks!r}")
    if chunks < 1 or chunks % unit:
        need = "cp" if mode == "contiguous" else "2 * cp"
        _fail(f"chunks (canonical token chunks per sequence) must be a positive multiple of {need} = {unit} "
              f"for {mode} sharding, got {chunks!r}")
    return chunks


def owned_chunks(mode: str, cp: int, rank: int, n_chunks: int) -> list[int]:
    """The chunk ids (ascending) that cp rank ``rank`` holds."""
    if mode == "contiguous":
        per = n_chunks // cp
        return list(range(rank * per, (rank + 1) * per))
    m = n_chunks // (2 * cp)
    return list(range(rank * m, (rank + 1) * m)) + list(range((2 * cp - 1 - rank) * m, (2 * cp - rank) * m))


def seq_lens_from_cu(cu_seqlens) -> list[int]:
    """Validated sequence lengths from a global cu_seqlens (int32 tensor or int list)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype != torch.int32:
            _fail(f"cu_seqlens must be torch.int32, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            _fail(f"cu_seqlens must be 1-D [batch + 1], got shape {list(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "meta":
            _fail("cu_seqlens must hold values (a host or device tensor, or a list of ints), got a meta tensor")
        cu = [int(v) for v in cu_seqlens.cpu().tolist()]
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in cu_seqlens):
        cu = list(cu_seqlens)
    else:
        _fail(f"cu_seqlens must be an int32 tensor or a list of ints [batch + 1], got "
              f"{type(cu_seqlens).__name__} {cu_seqlens!r}"[:300])
    if len(cu) < 2:
        _fail(f"cu_seqlens must have at least 2 entries [batch + 1], got {len(cu)}")
    if cu[0] != 0:
        _fail(f"cu_seqlens[0] must be 0, got {cu[0]}")
    if cu[-1] >= 2 ** 31:  # the attention ops take int32 cu_seqlens
        _fail(f"cu_seqlens[-1] (the packed token count) must be below 2**31, got {cu[-1]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            _fail(f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}] = {cu[i + 1]} < "
                  f"cu_seqlens[{i}] = {cu[i]}")
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


@dataclass(frozen=True, eq=False)
class CPLayout:
    """Host-built sharding of one packed batch for one cp rank (see module doc)."""

    mode: str
    cp: int
    rank: int
    n_chunks: int
    canonical: bool
    seq_lens: tuple[int, ...]
    chunk_ids: tuple[int, ...]      # global chunk id of each local piece
    piece_tokens: tuple[int, ...]   # local tokens per piece
    local_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int
    local_index: torch.Tensor       # int64 [T_l]: natural packed index of each local token
    positions: torch.Tensor         # int64 [T_l]: position within its sequence
    cu_seqlens_q: torch.Tensor      # int32 [S+1]: local query segments
    cu_seqlens_k: torch.Tensor      # int32 [S+1]: their key prefixes, packed
    key_index: torch.Tensor         # int64 [K]: gathered-key index of each segment-key slot
    piece_index: torch.Tensor       # int64 [P, cp*T_l]: slot of gathered key t in piece p (K: none)
    global_order: torch.Tensor      # int64 [T]: natural index of each cp-layout position

    def to(self, device) -> CPLayout:
        """The same layout with its index tensors on ``device`` (where the activations live)."""
        device = torch.device(device)
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name).device != device}
        return replace(self, **moved) if moved else self

    @property
    def total_tokens(self) -> int:
        return self.local_tokens * self.cp

    @property
    def pieces(self) -> int:
        return len(self.chunk_ids)

    def _tokens_dim(self, x: torch.Tensor, dim: int, what: str) -> None:
        """x's ``dim`` holds every token of the layout (a longer x was once silently cut)."""
        if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
            _fail(f"{what}: dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {list(x.shape)}, got {dim!r}")
        if x.shape[dim] != self.total_tokens:
            _fail(f"{what}: x.shape[{dim}] must be the packed token count {self.total_tokens}, got {x.shape[dim]}")

    def to_cp_layout(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Natural packed order -> cp layout (every rank's shard, in rank order)."""
        self._tokens_dim(x, dim, "to_cp_layout")
        return x.index_select(dim, self.global_order.to(x.device))

    def from_cp_layout(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self._tokens_dim(x, dim, "from_cp_layout")
        inverse = torch.empty_like(self.global_order)
        inverse[self.global_order] = torch.arange(self.global_order.numel())
        return x.index_select(dim, inverse.to(x.device))

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a global tensor in natural packed order."""
        self._tokens_dim(x, dim, "shard")
        return x.index_select(dim, self.local_index.to(x.device))

    def canonical_order(self) -> list[int]:
        """Position, in the cp-rank-major concatenation of every rank's pieces, of
        global chunk 0, 1, ..., n_chunks-1 (the order canonical sums follow)."""
        where = {}
        for r in range(self.cp):
            for p, j in enumerate(owned_chunks(self.mode, self.cp, r, self.n_chunks)):
                where[j] = r * self.pieces + p
        return [where[j] for j in range(self.n_chunks)]

    def metadata(self) -> list[int]:
        """Ints every cp rank must agree on (for the cross-rank preflight)."""
        # 63 bits of blake2b over the lengths: a polynomial hash mod 2^61 let two different batches of
        # one size and total collide (a session 31 audit built such a pair), and both ranks went on
        h = hashlib.blake2b(digest_size=8)
        h.update(b"".join(int(n).to_bytes(8, "little", signed=True) for n in self.seq_lens))
        cu_hash = int.from_bytes(h.digest(), "little") >> 1
        return [len(self.seq_lens), sum(self.seq_lens), cu_hash, MODES.index(self.mode), self.n_chunks,
                int(self.canonical)]


def build_layout(cu_seqlens, cp: int, rank: int, mode: str = "contiguous", chunks: int | None = None) -> CPLayout:
    """Shard the packed batch described by the global ``cu_seqlens`` for cp rank ``rank``.

    Raises ``LayoutError`` naming the sequence when a length is not divisible by the
    chunk count (cp, 2*cp for zigzag, or the canonical ``chunks``)."""
    n_chunks = n_chunks_for(mode, cp, chunks)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < cp:
        _fail(f"rank must be in [0, {cp - 1}], got {rank!r}")
    lens = seq_lens_from_cu(cu_seqlens)
    why = f"{mode} sharding over cp = {cp}" if chunks is None else f"{chunks} canonical chunks, {mode} over cp = {cp}"
    for b, n in enumerate(lens):
        if n % n_chunks:
            _fail(f"sequence {b} has length {n}, which is not divisible by {n_chunks} "
                  f"(chunks per sequence for {why}); pad it to a multiple of {n_chunks}")
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    total = starts[-1]

    def local(r):
        return torch.cat([torch.arange(starts[b] + j * (n // n_chunks), starts[b] + (j + 1) * (n // n_chunks))
                          for j in owned_chunks(mode, cp, r, n_chunks) for b, n in enumerate(lens)]
                         or [torch.zeros(0, dtype=torch.int64)])

    order = torch.cat([local(r) for r in range(cp)])
    gathered_of = torch.empty(total, dtype=torch.int64)
    gathered_of[order] = torch.arange(total)
    mine = owned_chunks(mode, cp, rank, n_chunks)
    local_index = local(rank)
    positions = torch.cat([torch.arange(j * (n // n_chunks), (j + 1) * (n // n_chunks))
                           for j in mine for n in lens] or [torch.zeros(0, dtype=torch.int64)])
    cu_q, cu_k, keys = [0], [0], []
    piece_slots = []
    for j in mine:
        slot_of = torch.full((total,), -1, dtype=torch.int64)
        for b, n in enumerate(lens):
            c = n // n_chunks
            prefix = gathered_of[starts[b]:starts[b] + (j + 1) * c]
            slot_of[prefix] = torch.arange(cu_k[-1], cu_k[-1] + prefix.numel())
            keys.append(prefix)
            cu_q.append(cu_q[-1] + c)
            cu_k.append(cu_k[-1] + prefix.numel())
        piece_slots.append(slot_of)
    n_keys = cu_k[-1]
    piece_index = torch.stack(piece_slots)
    piece_index[piece_index < 0] = n_keys  # sentinel: a zero row appended in the backward
    seg_q = [cu_q[i + 1] - cu_q[i] for i in range(len(cu_q) - 1)]
    seg_k = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
    return CPLayout(
        mode=mode, cp=cp, rank=rank, n_chunks=n_chunks, canonical=chunks is not None, seq_lens=tuple(lens),
        chunk_ids=tuple(mine), piece_tokens=tuple(sum(n // n_chunks for n in lens) for _ in mine),
        local_tokens=total // cp, max_seqlen_q=max(seg_q, default=0), max_seqlen_k=max(seg_k, default=0),
        local_index=local_index, positions=positions,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        key_index=torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64),
        piece_index=piece_index, global_order=order,
    )
