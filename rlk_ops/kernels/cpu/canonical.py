"""``canonical:C`` split-KV: the chunk plan, its executor, and the decode pair layout.

The definition (every backend computes exactly this; README "Split-KV policies"): a
query row attends to its keys in C-token chunks aligned to absolute key position 0
(chunk c holds keys ``[c*C, (c+1)*C)``). For every chunk holding a key the row can see,
it gets a partial state ``(out_c, lse_c)``: the *single-pass* attention of the row over
that chunk's keys alone (the backend's own key blocks: 128 keys on the CPU, where C % 128 == 0
keeps the chunk aligned to them; FA4's SM90 tile is 128 keys up to head_dim 128; fp32 online softmax;
``out_c`` rounded to the input dtype, as the kernel returns it; ``lse_c`` fp32). The
states are merged in ascending chunk order by ``rlk::merge_attn_states``
(kernels/cpu/merge.py). Nothing here depends on the device or the backend.

How the partials are computed: ``plan()`` splits each sequence into pieces, one per
(sequence, chunk, kind):

* diagonal (causal): the queries inside chunk c against chunk c's keys, up to the
  last of those queries. The piece's last query sits at its last key, so the usual
  bottom-right causal alignment is right: an ordinary causal varlen sequence.
* full (non-causal): the queries after chunk c against all C keys of chunk c.

Each state slot is written by one single-pass varlen call, in place (``run()``): slot
c (c < N - 1) holds every full piece of chunk c, slot N - 1 every diagonal piece (N =
the most chunks any sequence has); a row's unused slots keep ``lse = -inf`` and the
merge skips them, so it merges the row's chunks in ascending order. Non-causal
attention has only full pieces, slot c = chunk c. A call's pieces are disjoint, ordered
row ranges of the packed q (and key ranges of the packed k), so a kernel with FA4's
varlen convention (``cu_seqlens_*`` = piece starts, ``seqused_*`` = piece lengths,
``out=``/``lse=`` buffers) reads and writes everything in place: no query copies, no
scatter of the partials; ``gathered()`` gives the same rows by copying, for kernels
without that convention. For decode (one query per sequence), ``decode_pairs()`` lays the
(chunk, sequence) pairs out of the page table with tensor ops alone (no host sync),
so a paged single-pass kernel computes all partials in one call.

``attention_fwd`` / ``paged_attention`` below are the whole policy for any backend: it
passes its own single-pass kernels (the CPU reference ``gathered()`` around
kernels/cpu/attention.py's, the fa4 backend FA4's in-place call); the merge and the paged-KV gather come
from the one dispatch point, so training and rollout on a device share one merge.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlk_ops.kernels.dispatch import kernel_for


@dataclass(frozen=True)
class Call:
    """One single-pass varlen call that writes state slot ``slot`` in place.

    Piece j attends query rows ``[q_start[j], q_start[j] + q_len[j])`` of the packed q to
    key rows ``[k_start[j], k_start[j] + k_len[j])`` of the packed k; its (out, lse) land
    in the same query rows of the slot. A call's pieces never share a query row and are
    in ascending row order, so a kernel that takes ``cu_seqlens_*`` as piece starts and
    ``seqused_*`` as piece lengths reads q/k/v and writes out/lse in place (FA4's varlen
    convention). Rows no piece covers are not written."""
    causal: bool
    slot: int
    seq: tuple[int, ...]          # per piece: its sequence
    chunk: tuple[int, ...]        # per piece: its chunk
    q_start: tuple[int, ...]
    q_len: tuple[int, ...]
    k_start: tuple[int, ...]
    k_len: tuple[int, ...]
    cu_seqlens_q: torch.Tensor    # int32 [pieces + 1]: q_start, then the end of the last piece
    cu_seqlens_k: torch.Tensor    # int32 [pieces + 1]: k_start, then the end of the last piece
    seqused_q: torch.Tensor       # int32 [pieces]: q_len
    seqused_k: torch.Tensor       # int32 [pieces]: k_len
    max_seqlen_q: int
    max_seqlen_k: int

    @functools.cached_property
    def q_index(self) -> torch.Tensor:
        """int64 [rows]: the query rows of every piece, piece by piece."""
        return _ranges(self.q_start, self.q_len, self.cu_seqlens_q.device)

    @functools.cached_property
    def k_index(self) -> torch.Tensor:
        return _ranges(self.k_start, self.k_len, self.cu_seqlens_k.device)

    @functools.cached_property
    def strided_batch(self) -> tuple[int, int] | None:
        """``(q_stride, k_stride)`` when the pieces form one strided batch: every piece the same
        q and k length and the starts evenly spaced (the full pieces of a dense ``[B, S]`` batch
        of equal lengths), so piece b is rows ``q_start[0] + b * q_stride + [0, q_len)``; None
        otherwise. (One piece: its own lengths as strides.)"""
        if len(set(self.q_len)) != 1 or len(set(self.k_len)) != 1:
            return None
        qs = {b - a for a, b in zip(self.q_start, self.q_start[1:])} or {self.q_len[0]}
        ks = {b - a for a, b in zip(self.k_start, self.k_start[1:])} or {self.k_len[0]}
        if len(qs) != 1 or len(ks) != 1 or min(*qs, *ks) <= 0:
            return None
        return qs.pop(), ks.pop()

    @functools.cached_property
    def strided_runs(self) -> tuple["Call", ...]:
        """The call cut into sub-calls (same kind and slot) that each form one strided batch:
        the pieces grouped by (q_len, k_len), each group in row order cut where the spacing
        changes. A dense ``[B, S]`` batch's diagonal call at S % C != 0 gives one run per
        sequence (its full-length diagonal pieces, C apart) and one of the short last pieces (S
        apart); at S % C == 0 one run. ``(self,)`` when the call is one strided batch."""
        if self.strided_batch is not None:
            return (self,)
        groups: dict = {}
        for j in range(len(self.q_start)):
            groups.setdefault((self.q_len[j], self.k_len[j]), []).append(j)
        def gap(i, j):
            return self.q_start[j] - self.q_start[i], self.k_start[j] - self.k_start[i]

        runs = []
        for idx in groups.values():
            run = [idx[0]]
            for j in idx[1:]:
                if len(run) > 1 and gap(run[-1], j) != gap(run[0], run[1]):   # the spacing changes: cut
                    runs.append(run)
                    run = []
                run.append(j)
            runs.append(run)
        dev = self.cu_seqlens_q.device
        out = []
        for run in sorted(runs):
            sub = _Call(self.causal, self.slot)
            for j in run:
                sub.add(self.seq[j], self.chunk[j], self.q_start[j], self.q_len[j], self.k_start[j], self.k_len[j])
            out.append(sub.build(dev))
        return tuple(out)

    @functools.cached_property
    def tight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cu_seqlens_q, cu_seqlens_k) of the pieces packed back to back (for ``gathered``)."""
        dev = self.cu_seqlens_q.device
        return (torch.tensor([0, *itertools.accumulate(self.q_len)], dtype=torch.int32, device=dev),
                torch.tensor([0, *itertools.accumulate(self.k_len)], dtype=torch.int32, device=dev))


def _ranges(starts, lens, device) -> torch.Tensor:
    parts = [torch.arange(a, a + n, dtype=torch.int64) for a, n in zip(starts, lens)]
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)).to(device)


@dataclass(frozen=True)
class ChunkPlan:
    chunk_size: int
    num_slots: int                # N of the state buffer (>= 1)
    calls: tuple[Call, ...]       # the diagonal call first, then one full call per chunk; empty ones dropped


class _Call:
    def __init__(self, causal: bool, slot: int):
        self.causal, self.slot, self.pieces = causal, slot, []

    def add(self, seq: int, chunk: int, q0: int, nq: int, k0: int, nk: int) -> None:
        self.pieces.append((seq, chunk, q0, nq, k0, nk))

    def build(self, device) -> Call:
        seq, chunk, q0, nq, k0, nk = (tuple(col) for col in zip(*self.pieces))

        def i32(vals):
            return torch.tensor(vals, dtype=torch.int32).to(device)

        return Call(self.causal, self.slot, seq, chunk, q0, nq, k0, nk,
                    i32([*q0, q0[-1] + nq[-1]]), i32([*k0, k0[-1] + nk[-1]]), i32(nq), i32(nk), max(nq), max(nk))


def plan(seqs: list[tuple[int, int, int, int]], chunk_size: int, causal: bool, device=None) -> ChunkPlan:
    """The calls for sequences given as ``(q_start, q_len, k_start, k_len)`` rows of a
    packed q / k. Causal rows are bottom-right aligned: query i of a sequence sits at
    absolute key position ``k_len - q_len + i``.

    Slots: with N the most chunks any sequence has, a causal plan writes the full state
    of chunk c to slot c (c < N - 1) and every diagonal state to slot N - 1; a row in
    chunk i therefore has its states in slots 0..i-1 and N-1, slots i..N-2 empty, which
    the merge skips: it merges the row's chunks in ascending order. A non-causal plan
    writes chunk c to slot c."""
    if chunk_size <= 0 or chunk_size % 128:
        raise ValueError(f"canonical chunk_size must be a positive multiple of 128, got {chunk_size}")
    n_slots = max([1] + [math.ceil(nk / chunk_size) for _, nq, _, nk in seqs if nq and nk])
    diag = _Call(True, n_slots - 1)
    full = [_Call(False, c) for c in range(n_slots)]
    for s, (q0, nq, k0, nk) in enumerate(seqs):
        if nq == 0 or nk == 0:
            continue  # no pieces: every row of s keeps lse = -inf (out 0), as single pass gives
        first = nk - nq  # absolute position of the first query (causal)
        for c in range(math.ceil(nk / chunk_size)):
            cs, ce = c * chunk_size, min((c + 1) * chunk_size, nk)
            if not causal:
                full[c].add(s, c, q0, nq, k0 + cs, ce - cs)
                continue
            lo = max(cs, first)
            if lo < ce:  # queries inside the chunk; the last one is at key ce - 1
                diag.add(s, c, q0 + lo - first, ce - lo, k0 + cs, ce - cs)
            lo = max(ce, first)
            if lo < nk:  # queries after the chunk see all of it
                full[c].add(s, c, q0 + lo - first, nk - lo, k0 + cs, ce - cs)
    calls = tuple(g.build(device) for g in ([diag] if causal else []) + full if g.pieces)
    return ChunkPlan(chunk_size, n_slots, calls)


def run(chunk_plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        attend_into: Callable, merge: Callable, streams: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute a plan on packed ``q [T, Hq, D]``, ``k``/``v [Tk, Hkv, D]``.

    ``attend_into(q, k, v, call, scale, out, lse)`` is a backend's single-pass kernel
    writing the call's pieces into ``out [T, Hq, D]`` / ``lse [Hq, T]`` (one slot of the
    state buffer) in place; ``gathered`` makes one from any tight varlen kernel.
    ``merge(out_parts, lse_parts)`` is the backend's merge. Returns the merged
    ``out [T, Hq, D]`` and ``lse [Hq, T]``.

    ``streams > 1`` (CUDA): the calls are issued round-robin on that many side streams,
    forked from and joined back into the current stream before the merge, so one call's
    tail overlaps the next call's work. No bit changes: every call writes its own slot
    and a kernel's arithmetic does not depend on what runs beside it."""
    t, hq, d = q.shape
    lse_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    # empty, not zeros: a row a call does not cover keeps lse = -inf and the merge never
    # reads its out (a zero fill would be a 1 GiB memset per forward at B=4, S=8k, C=1024)
    out_parts = q.new_empty((chunk_plan.num_slots, t, hq, d))
    lse_parts = torch.full((chunk_plan.num_slots, hq, t), -math.inf, dtype=lse_t, device=q.device)
    calls = chunk_plan.calls
    side = _side_streams(q.device, min(streams, len(calls))) if q.is_cuda and streams > 1 else ()
    if len(side) > 1:
        main = torch.cuda.current_stream(q.device)
        for s in side:
            s.wait_stream(main)  # the buffers above (and q/k/v) are ready before any call
        for i, call in enumerate(calls):
            with torch.cuda.stream(side[i % len(side)]):
                attend_into(q, k, v, call, scale, out_parts[call.slot], lse_parts[call.slot])
        for s in side:
            main.wait_stream(s)  # every slot written before the merge (and before the buffers' reuse)
    else:
        for call in calls:
            attend_into(q, k, v, call, scale, out_parts[call.slot], lse_parts[call.slot])
    return merge(out_parts, lse_parts)


_SIDE: dict = {}


def _side_streams(device: torch.device, n: int) -> tuple:
    """``n`` side streams of ``device``, created once and reused."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    have = _SIDE.setdefault(index, [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device=index))
    return tuple(have[:n])


def gathered(attend: Callable) -> Callable:
    """``attend_into`` from a backend's tight single-pass varlen kernel
    ``attend(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k) -> (out, lse [Hq, rows])``:
    copy the call's pieces out back to back, attend, copy the rows into the slot. This is
    what an in-place kernel must write, row for row (a row's partial depends on its
    piece alone); the cpu backend runs it, and the GPU checks FA4's in-place call against it."""
    def attend_into(q, k, v, call: Call, scale, out, lse):
        cu_q, cu_k = call.tight
        qi, ki = call.q_index, call.k_index
        o, l = attend(q.index_select(0, qi), k.index_select(0, ki), v.index_select(0, ki), int(call.causal),
                      scale, cu_q, cu_k, call.max_seqlen_q, call.max_seqlen_k)
        out.index_copy_(0, qi, o)
        lse.index_copy_(1, qi, l.to(lse.dtype))

    return attend_into


def pair_count(width: int, page_size: int, chunk_size: int) -> int:
    """N, the chunks of a decode step's (chunk, sequence) pairs: from the page table's width
    (``width`` pages of ``page_size``), so nothing is read back from the device; at least 1."""
    return max(1, math.ceil(width / (chunk_size // page_size)))


def pair_columns(width: int, page_size: int, chunk_size: int) -> int:
    """Page-table columns of a decode pair: the chunk's C / page_size pages, but no more than
    the table's ``width`` (a chunk wider than the table holds the whole table: padding it
    to C / page_size would allocate columns no sequence can use)."""
    return min(chunk_size // page_size, width)


def decode_pairs(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode layout: pair ``c * B + b`` (chunk-major) is sequence b's chunk c as one row
    of a single-pass paged call with one query. Returns ``(pair_table [N*B, P] int32,
    pair_lens [N*B] int32, N)`` with ``pair_lens = clamp(seq_lens[b] - c*C, 0, C)`` and
    ``pair_table`` the page-table slice of the chunk (C % page_size == 0 needed), P =
    ``pair_columns()``: C/page_size, or the table's width where one chunk covers it. N
    comes from the table width, so nothing is read back to the host; pairs of length 0
    must come back with lse = -inf (the merge skips them) and their table rows are zeroed
    (page 0), so even a kernel that touched them would read a valid page. Chunk-major
    order makes the kernel's ``[N*B, 1, H, D]`` output a ``[N, B, 1, H, D]`` state stack
    by a view."""
    if chunk_size % page_size:
        raise ValueError(f"decode_pairs needs chunk_size % page_size == 0, got {chunk_size} % {page_size}")
    bsz, width = page_table.shape
    per = pair_columns(width, page_size, chunk_size)
    n = pair_count(width, page_size, chunk_size)
    padded = torch.nn.functional.pad(page_table, (0, n * per - width))  # page 0: a valid id, never read
    pair_table = padded.view(bsz, n, per).transpose(0, 1).reshape(n * bsz, per)
    starts = torch.arange(n, device=seq_lens.device, dtype=torch.int64)[:, None] * chunk_size
    pair_lens = (seq_lens.to(torch.int64)[None, :] - starts).clamp(0, chunk_size).reshape(n * bsz)
    pair_table = torch.where(pair_lens[:, None] > 0, pair_table, 0)
    return pair_table.to(torch.int32), pair_lens.to(torch.int32), n


@functools.lru_cache(maxsize=16)
def cached_plan(seqs: tuple, chunk_size: int, causal: bool, device: str) -> ChunkPlan:
    """``plan()`` for a shape seen before: the plan is a pure function of its arguments and
    is never modified, so reusing it changes no bits. Building it costs host time that a
    GPU forward does not hide (index tensors from Python lists, then host-to-device
    copies); a varlen batch of new lengths still pays it."""
    return plan(list(seqs), chunk_size, causal, device)


# ----------------------------------------------------------------- the policy, per op
def attention_fwd(q, k, v, causal: bool, scale: float, cu_seqlens_q, cu_seqlens_k, chunk_size: int,
                  attend_into: Callable, streams: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``rlk::attention_fwd`` under canonical:C, dense or varlen (the op's layouts).
    ``attend_into`` is the backend's in-place single-pass kernel (``run``)."""
    merge = kernel_for("merge_attn_states", q.device)
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        seqs = [(cq[i], cq[i + 1] - cq[i], ck[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
        return run(cached_plan(tuple(seqs), chunk_size, causal, str(q.device)), q, k, v, scale, attend_into, merge,
                   streams)
    bsz, sq, hq, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    seqs = [(b * sq, sq, b * sk, sk) for b in range(bsz)]
    out, lse = run(cached_plan(tuple(seqs), chunk_size, causal, str(q.device)), q.reshape(bsz * sq, hq, d),
                   k.reshape(bsz * sk, h_kv, d), v.reshape(bsz * sk, h_kv, d), scale, attend_into, merge, streams)
    return _dense(out, lse, bsz, sq)


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, scale: float, chunk_size: int,
                    attend_into: Callable, attend_paged: Callable,
                    merge: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rlk::paged_attention`` under canonical:C. ``attend_paged`` is the backend's
    single-pass ``paged_attention`` kernel (decode), ``attend_into`` its in-place varlen one
    (chunked prefill, over the gathered logical K/V). ``merge``: the merge kernel a caller has
    already looked up (a second lookup recorded a second merge call in provenance)."""
    bsz, sq, hq, d = q.shape
    page_size = k_cache.shape[1]
    merge = merge or kernel_for("merge_attn_states", q.device)
    if q.device.type == "cpu" and bsz:
        # the work is sized from the table's width (on a GPU, no host read of seq_lens); on the CPU
        # seq_lens is at hand, and the columns past the longest sequence are never read: a table
        # padded to a fixed width (e.g. 8192 pages for 200 tokens) ran every empty pair, 100-170x
        # disabled's time (a session 34 audit). Dropping pairs that are all empty changes no bits:
        # the merge skips empty states.
        used = max(1, -(-int(seq_lens.max()) // page_size))
        page_table = page_table[:, :used]
    if sq == 1 and chunk_size % page_size == 0:
        pair_table, pair_lens, n = decode_pairs(page_table, seq_lens, page_size, chunk_size)
        q_pairs = q[None].expand(n, bsz, 1, hq, d).reshape(n * bsz, 1, hq, d)
        out, lse = attend_paged(q_pairs, k_cache, v_cache, pair_table, pair_lens, scale)
        # a pair without keys is an empty state whatever the kernel wrote for it
        lse = torch.where(pair_lens.view(-1, 1, 1) > 0, lse, -math.inf)
        return merge(out.view(n, bsz, 1, hq, d), lse.view(n, bsz, hq, 1))
    # chunked prefill: the general plan over each sequence's gathered K/V (exact copies)
    k, v = kernel_for("paged_kv_gather", q.device)(k_cache, v_cache, page_table, seq_lens)
    kmax, h_kv = k.shape[1], k.shape[2]
    seqs = [(b * sq, sq, b * kmax, n) for b, n in enumerate(seq_lens.tolist())]
    out, lse = run(plan(seqs, chunk_size, True, q.device), q.reshape(bsz * sq, hq, d),
                   k.reshape(bsz * kmax, h_kv, d), v.reshape(bsz * kmax, h_kv, d), scale, attend_into, merge)
    return _dense(out, lse, bsz, sq)


def _dense(out, lse, bsz, sq):
    """Packed ``[B*Sq, Hq, D]`` / ``[Hq, B*Sq]`` -> dense ``[B, Sq, Hq, D]`` / ``[B, Hq, Sq]``."""
    hq = out.shape[1]
    return out.view(bsz, sq, hq, out.shape[-1]), lse.view(hq, bsz, sq).transpose(0, 1).contiguous()
