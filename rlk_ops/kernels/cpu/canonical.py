"""``canonical:C`` split-KV: the chunk plan, its executor, and the decode pair layout.

The definition (every backend computes exactly this; README "Split-KV policies"): a
query row attends to its keys in C-token chunks aligned to absolute key position 0
(chunk c holds keys ``[c*C, (c+1)*C)``). For every chunk holding a key the row can see,
it gets a partial state ``(out_c, lse_c)``: the *single-pass* attention of the row over
that chunk's keys alone (same 128-key blocks, as C % 128 == 0; fp32 online softmax;
``out_c`` rounded to the input dtype, as the kernel returns it; ``lse_c`` fp32). The
states are merged in ascending chunk order by ``rlk::merge_attn_states``
(kernels/cpu/merge.py). Nothing here depends on the device or the backend.

How the partials are computed: ``plan()`` splits each sequence into pieces, one per
(sequence, chunk, kind):

* diagonal (causal): the queries inside chunk c against chunk c's keys, up to the
  last of those queries. The piece's last query sits at its last key, so the usual
  bottom-right causal alignment is right: an ordinary causal varlen sequence.
* full (non-causal): the queries after chunk c against all C keys of chunk c.

One single-pass varlen call per kind computes every partial (``run()``); row r's
partial for chunk c lands in slot c of a ``[N, T, H, D]`` state buffer, whose unused
slots keep ``lse = -inf`` and are skipped by the merge. Non-causal attention has only
full pieces. For decode (one query per sequence), ``decode_pairs()`` lays the
(chunk, sequence) pairs out of the page table with tensor ops alone (no host sync),
so a paged single-pass kernel computes all partials in one call.

``attention_fwd`` / ``paged_attention`` below are the whole policy for any backend: it
passes its own single-pass kernels (the CPU reference passes kernels/cpu/attention.py's,
a GPU backend its FA4 ones, same signatures); the merge and the paged-KV gather come
from the one dispatch point, so training and rollout on a device share one merge.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlk_ops.kernels.dispatch import kernel_for


@dataclass(frozen=True)
class Pieces:
    """One single-pass varlen call: piece j attends the gathered query rows
    ``q_index[cu_seqlens_q[j]:cu_seqlens_q[j+1]]`` to the key rows
    ``k_index[cu_seqlens_k[j]:cu_seqlens_k[j+1]]`` (rows of the packed q / k)."""
    causal: bool
    seq: tuple[int, ...]          # per piece: its sequence
    chunk: tuple[int, ...]        # per piece: its chunk (= merge slot)
    # per piece: first key row in the packed k. A piece's keys are contiguous there, so a
    # kernel can read them in place (cu_seqlens_k = k_start, seqused_k = key counts)
    k_start: tuple[int, ...]
    q_index: torch.Tensor         # int64 [rows]
    k_index: torch.Tensor         # int64 [keys]
    slot: torch.Tensor            # int64 [rows]: the chunk of each gathered query row
    cu_seqlens_q: torch.Tensor    # int32 [pieces + 1]
    cu_seqlens_k: torch.Tensor    # int32 [pieces + 1]
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class ChunkPlan:
    chunk_size: int
    num_slots: int                # N of the state buffer: the most chunks any row has (>= 1)
    groups: tuple[Pieces, ...]    # the causal (diagonal) call, then the full one; empty ones dropped


class _Group:
    def __init__(self, causal: bool):
        self.causal = causal
        self.seq, self.chunk, self.k_start, self.q_ranges, self.k_ranges = [], [], [], [], []

    def add(self, seq: int, chunk: int, q0: int, nq: int, k0: int, nk: int) -> None:
        self.seq.append(seq)
        self.chunk.append(chunk)
        self.k_start.append(k0)
        self.q_ranges.append((q0, nq))
        self.k_ranges.append((k0, nk))

    def build(self, device) -> Pieces:
        def index(ranges):
            parts = [torch.arange(a, a + n, dtype=torch.int64) for a, n in ranges]
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

        def cu(ranges):
            return torch.tensor([0, *torch.tensor([n for _, n in ranges]).cumsum(0).tolist()], dtype=torch.int32)

        slot = torch.repeat_interleave(torch.tensor(self.chunk, dtype=torch.int64),
                                       torch.tensor([n for _, n in self.q_ranges], dtype=torch.int64))
        return Pieces(self.causal, tuple(self.seq), tuple(self.chunk), tuple(self.k_start),
                      index(self.q_ranges).to(device), index(self.k_ranges).to(device), slot.to(device),
                      cu(self.q_ranges).to(device), cu(self.k_ranges).to(device),
                      max(n for _, n in self.q_ranges), max(n for _, n in self.k_ranges))


def plan(seqs: list[tuple[int, int, int, int]], chunk_size: int, causal: bool, device=None) -> ChunkPlan:
    """The pieces for sequences given as ``(q_start, q_len, k_start, k_len)`` rows of a
    packed q / k. Causal rows are bottom-right aligned: query i of a sequence sits at
    absolute key position ``k_len - q_len + i``."""
    if chunk_size <= 0 or chunk_size % 128:
        raise ValueError(f"canonical chunk_size must be a positive multiple of 128, got {chunk_size}")
    diag, full = _Group(True), _Group(False)
    slots = 1
    for s, (q0, nq, k0, nk) in enumerate(seqs):
        if nq == 0 or nk == 0:
            continue  # no pieces: every row of s keeps lse = -inf (out 0), as single pass gives
        first = nk - nq  # absolute position of the first query (causal)
        n_chunks = math.ceil(nk / chunk_size)
        slots = max(slots, n_chunks)
        for c in range(n_chunks):
            cs, ce = c * chunk_size, min((c + 1) * chunk_size, nk)
            if not causal:
                full.add(s, c, q0, nq, k0 + cs, ce - cs)
                continue
            lo = max(cs, first)
            if lo < ce:  # queries inside the chunk; the last one is at key ce - 1
                diag.add(s, c, q0 + lo - first, ce - lo, k0 + cs, ce - cs)
            lo = max(ce, first)
            if lo < nk:  # queries after the chunk see all of it
                full.add(s, c, q0 + lo - first, nk - lo, k0 + cs, ce - cs)
    groups = tuple(g.build(device) for g in (diag, full) if g.seq)
    return ChunkPlan(chunk_size, slots, groups)


def run(chunk_plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        attend: Callable, merge: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Execute a plan on packed ``q [T, Hq, D]``, ``k``/``v [Tk, Hkv, D]``.

    ``attend(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k) -> (out, lse [Hq, rows])`` is
    a backend's single-pass varlen kernel; ``merge(out_parts, lse_parts)`` its merge kernel.
    Returns the merged ``out [T, Hq, D]`` and ``lse [Hq, T]``."""
    t, hq, d = q.shape
    n = chunk_plan.num_slots
    lse_t = torch.float64 if q.dtype == torch.float64 else torch.float32
    # empty, not zeros: a slot no piece writes keeps lse = -inf and the merge never reads its
    # out (at B=4, S=8k, C=1024 on a GPU the fill would be a 1 GiB memset per forward)
    out_parts = q.new_empty((n * t, hq, d))
    lse_rows = torch.full((n * t, hq), -math.inf, dtype=lse_t, device=q.device)
    for g in chunk_plan.groups:
        o, lse = attend(q.index_select(0, g.q_index), k.index_select(0, g.k_index), v.index_select(0, g.k_index),
                        int(g.causal), scale, g.cu_seqlens_q, g.cu_seqlens_k, g.max_seqlen_q, g.max_seqlen_k)
        dest = g.slot * t + g.q_index  # each (slot, row) is written by exactly one piece
        out_parts.index_copy_(0, dest, o)
        lse_rows.index_copy_(0, dest, lse.t().to(lse_t))
    lse_parts = lse_rows.view(n, t, hq).transpose(1, 2).contiguous()
    return merge(out_parts.view(n, t, hq, d), lse_parts)


def decode_pairs(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Decode layout: pair ``c * B + b`` (chunk-major) is sequence b's chunk c as one row
    of a single-pass paged call with one query. Returns ``(pair_table [N*B, C/page_size]
    int32, pair_lens [N*B] int32, N)`` with ``pair_lens = clamp(seq_lens[b] - c*C, 0, C)``
    and ``pair_table`` the page-table slice of the chunk (C % page_size == 0 needed). N
    comes from the table width, so nothing is read back to the host; pairs of length 0
    must come back with lse = -inf (the merge skips them) and their table rows are zeroed
    (page 0), so even a kernel that touched them would read a valid page. Chunk-major
    order makes the kernel's ``[N*B, 1, H, D]`` output a ``[N, B, 1, H, D]`` state stack
    by a view."""
    if chunk_size % page_size:
        raise ValueError(f"decode_pairs needs chunk_size % page_size == 0, got {chunk_size} % {page_size}")
    bsz, width = page_table.shape
    per = chunk_size // page_size
    n = max(1, math.ceil(width / per))
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
                  attend: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``rlk::attention_fwd`` under canonical:C, dense or varlen (the op's layouts).
    ``attend`` is the backend's single-pass ``attention_fwd`` kernel."""
    merge = kernel_for("merge_attn_states", q.device)
    if cu_seqlens_q is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        seqs = [(cq[i], cq[i + 1] - cq[i], ck[i], ck[i + 1] - ck[i]) for i in range(len(cq) - 1)]
        return run(cached_plan(tuple(seqs), chunk_size, causal, str(q.device)), q, k, v, scale, attend, merge)
    bsz, sq, hq, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    seqs = [(b * sq, sq, b * sk, sk) for b in range(bsz)]
    out, lse = run(cached_plan(tuple(seqs), chunk_size, causal, str(q.device)), q.reshape(bsz * sq, hq, d),
                   k.reshape(bsz * sk, h_kv, d), v.reshape(bsz * sk, h_kv, d), scale, attend, merge)
    return _dense(out, lse, bsz, sq)


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, scale: float, chunk_size: int,
                    attend: Callable, attend_paged: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """``rlk::paged_attention`` under canonical:C. ``attend_paged`` is the backend's
    single-pass ``paged_attention`` kernel (decode), ``attend`` its ``attention_fwd``
    (chunked prefill, over the gathered logical K/V)."""
    bsz, sq, hq, d = q.shape
    page_size = k_cache.shape[1]
    merge = kernel_for("merge_attn_states", q.device)
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
                   k.reshape(bsz * kmax, h_kv, d), v.reshape(bsz * kmax, h_kv, d), scale, attend, merge)
    return _dense(out, lse, bsz, sq)


def _dense(out, lse, bsz, sq):
    """Packed ``[B*Sq, Hq, D]`` / ``[Hq, B*Sq]`` -> dense ``[B, Sq, Hq, D]`` / ``[B, Hq, Sq]``."""
    hq = out.shape[1]
    return out.view(bsz, sq, hq, out.shape[-1]), lse.view(hq, bsz, sq).transpose(0, 1).contiguous()
