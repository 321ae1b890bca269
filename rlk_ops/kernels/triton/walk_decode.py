"""canonical:C decode states by one program per (sequence, KV head) that streams the whole
sequence through a TMA ring (Gluon, SM90): the pair kernel's arithmetic (pair_decode.py,
"keys" layout, FA4's steps) on every chunk, without one program per chunk.

Why (issue 8, page 128, batch 64): there FA4's single pass streams the cache within ~3% of a
flat read (its TMA path), while the pair kernel (cp.async, 5,632 programs of 6 blocks at 64 x
8k, C = 768) streams ~1.5% slower than FA4 and the merge adds ~2%. The Triton whole-sequence walk
(sessions 14-16, cp.async, removed) was slower still: each chunk's loop drained its pipeline.
Here one ring of NS tiles (K and V of each key block, [BLOCK_N, D] each, 32 KB) runs across
chunk boundaries: the next tiles are in flight while a chunk's state is finished.

Per key block (blocks of a chunk from its last to its first, chunks in ascending order), the
same operations as ``_keys_pair`` in the same order, with the same bits: on an H100 (session 24,
results/h100/session24) every state equals the pair kernel's and FA4's pair call
(tests/test_walk_decode.py, 15/15; benchmarks/diag_walk_decode.py). NOT ROUTED: at page 128,
64 x 8k / 32k, C = 768 it took 1.018-1.039x FA4 single pass against the routed pairs'
1.008-1.013x, and its ring alone (``probe=1``, no arithmetic) 0.992-0.998x, so even without the
merge it does not reach FA4 there (benchmarks/probe_walk_decode.py, three runs; README).
Session 25: on the H200 (results/h200/session25) the ring alone streams at 0.969-0.986x FA4 and
over whole cache rows (``probe=3``) at a flat read's rate, so there the stream has room and the
walk's arithmetic (3-5% over its ring) is what it loses; on an H100 the ring is no faster than
FA4. ``warps=8`` (two warpgroups over the keys and head dim) gives the same bits and is slower.
    S^T = K @ Q^T (mma.sync m16n8k16, keys on M, the G query heads padded to 8 on N)
    keys past the chunk -inf;  m = max(m_prev, max S);  m' = 0 if m = -inf else m
    P = ex2(fma(S, scale_log2, -(m' * scale_log2)));  r = ex2((m_prev - m') * scale_log2)
    thread sums: fma(sum_t, r, P[first column]) then 31 adds in FA4's column order
    O^T = O^T * r + V^T @ bf16(P)^T (mma.sync; operand roles swapped as for S: the same element
      in either role, measured on the H200 for S and by the walk's tests for O)
    chunk end: L = (s0 + s1) + (s2 + s3);  out = bf16(O * rcp(L));  lse = fma(m, scale_log2, lg2(L)) * ln 2
The states (out, lse, pair_lens) are pair_decode's, chunk-major (pair c * B + b); the merge op
merges them as it merges the pair kernel's.

Needs page_size % BLOCK_N == 0 (a block never leaves its page: one TMA box per tile), a
contiguous cache, Triton with Gluon (3.5+) and an SM90 GPU.
"""
from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rlk_ops.kernels.cpu.canonical import pair_count
from rlk_ops.kernels.triton import _common as C
from rlk_ops.kernels.triton import merge as merge_mod
from rlk_ops.kernels.triton.merge import _exp as _mexp, _log as _mlog, _max_lse

BLOCK_N = 128      # FA4's key block on SM90 for head_dim 128
COLS = 8           # the query heads of one KV head, padded: mma.sync's N
ROWS_M = 16        # rows=True (walk_rows.py): the query heads on mma.sync's M, padded to 16
NUM_WARPS = 4
STAGES = 3         # tiles in the ring (32 KB each): two programs per SM
WS_MAXNREG = 128   # ws=True: (4 + 4) warps x 128 registers = 32K a program, so two programs per SM
MERGE_MAX = 64     # chunks per sequence the in-program merge takes (the state axis is in-thread)
MERGE_DSL = 8      # head-dim columns per step of that merge (16 spilled 8 bytes offline)
# Triton 3.6 (the H200's) names the TMA load async_copy_global_to_shared and the CTA barrier
# thread_barrier; 3.9 renamed them async_load and barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_LN2 = gl.constexpr(math.log(2.0))
_NEG_INF = gl.constexpr(float("-inf"))


@gluon.jit
def _approx(x, OP: gl.constexpr):
    """FA4's PTX approximations: ex2 / lg2 / rcp ``.approx.ftz.f32``."""
    return gl.inline_asm_elementwise(OP + ".approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _fold32(part, r3, x):
    """FA4's thread sums: fma(part, r, x[..., 0]) + x[..., 1] + ... + x[..., 31], one fp32 add
    after another in index order, for x [M, 4, 32] with the last axis in-thread. Each column is
    picked out with reshapes and splits (no arithmetic), as pair_decode's ``_thread_sums`` does:
    gl.sum's order is the compiler's (Triton 3.6 folds in index order, 3.9 in a tree)."""
    M: gl.constexpr = x.shape[0]
    for k in gl.static_range(32):
        y = x
        for bit in gl.static_range(5):
            y0, y1 = gl.split(gl.reshape(y, [M, 4, 32 >> (bit + 1), 2]))
            y = y1 if (k >> bit) % 2 == 1 else y0
        y = gl.convert_layout(gl.reshape(y, [M, 4]), part.type.layout)  # the same registers: no data movement
        if k == 0:
            acc = gl.fma(part, r3[:, None], y)
        else:
            acc = acc + y
    return acc


@gluon.jit
def _quad_total(part, tq):
    """A chunk's L = (s0 + s1) + (s2 + s3) from the thread sums part [M, 4] (tq: the column index);
    each s_t is one thread sum plus three +0, exact in any order."""
    s0 = gl.sum(gl.where(tq[None, :] == 0, part, 0.0), axis=1)
    s1 = gl.sum(gl.where(tq[None, :] == 1, part, 0.0), axis=1)
    s2 = gl.sum(gl.where(tq[None, :] == 2, part, 0.0), axis=1)
    s3 = gl.sum(gl.where(tq[None, :] == 3, part, 0.0), axis=1)
    return (s0 + s1) + (s2 + s3)


@gluon.jit
def _block(i, nc, last_keys, chunk, NB: gl.constexpr, BN: gl.constexpr):
    """Walk step i's chunk c, block j (from the chunk's last to its first) and the keys of
    block j inside the chunk (more than BN: all valid)."""
    full = (nc - 1) * NB                       # blocks of the chunks before the last
    nb_last = gl.cdiv(last_keys, BN)
    in_full = i < full
    c = gl.where(in_full, i // NB, nc - 1)
    j = gl.where(in_full, NB - 1 - i % NB, nb_last - 1 - (i - full))
    keys = gl.where(in_full, chunk, last_keys) - j * BN
    return c, j, keys


@gluon.jit
def _entry(table_row, i, nc, last_keys, chunk, n_steps, NB: gl.constexpr, BN: gl.constexpr, PAGE: gl.constexpr):
    """The cache row of walk step i's first key (page-table entry * PAGE + offset); 0 past the walk."""
    c, j, _ = _block(i, nc, last_keys, chunk, NB, BN)
    pos = c * chunk + j * BN
    live = i < n_steps
    ent = gl.load(table_row + gl.where(live, pos // PAGE, 0), mask=live, other=0)
    return ent * PAGE + pos % PAGE


@gluon.jit
def _extent(seq_lens, table, b, width, chunk, NB: gl.constexpr, BN: gl.constexpr):
    """Sequence b's length, chunks holding keys, keys of its last chunk, walk steps (key blocks)
    and page-table row."""
    seq = gl.load(seq_lens + b)
    nc = gl.cdiv(seq, chunk)
    last_keys = seq - (nc - 1) * chunk
    n_steps = gl.where(nc > 0, (nc - 1) * NB + gl.cdiv(last_keys, BN), 0)
    return seq, nc, last_keys, n_steps, table + b.to(gl.int64) * width


@gluon.jit
def _ring_start(table_row, nc, last_keys, chunk, n_steps, roff, col, k_desc, v_desc, ring, bars,
                NB: gl.constexpr, BN: gl.constexpr, PAGE: gl.constexpr, NS: gl.constexpr):
    """The ring's first three tiles (K and V of step 0, K of step 1) issued; returns the cache
    rows of steps 1 and 2 (the loop issues V of step i + 1 and K of step i + 2 from them)."""
    n_tiles = 2 * n_steps
    e0 = _entry(table_row, 0, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
    e1 = _entry(table_row, 1, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
    _issue(0, e0 + roff, col, k_desc, v_desc, ring, bars, n_tiles, NS)
    _issue(1, e0 + roff, col, k_desc, v_desc, ring, bars, n_tiles, NS)
    _issue(2, e1 + roff, col, k_desc, v_desc, ring, bars, n_tiles, NS)
    e2 = _entry(table_row, 2, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
    return e1, e2


@gluon.jit
def _issue(t, row, col, k_desc, v_desc, ring, bars, n_tiles, NS: gl.constexpr):
    """Tile t of the walk (K of step t // 2 when t is even, else its V) into ring slot t % NS."""
    if t < n_tiles:
        slot = t % NS
        bar = bars.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes)
        if t % 2 == 0:
            _tma_load(k_desc, [row, col], bar, ring.index(slot))
        else:
            _tma_load(v_desc, [row, col], bar, ring.index(slot))


@gluon.jit
def _wait(t, bars, NS: gl.constexpr):
    mbarrier.wait(bars.index(t % NS), (t // NS) & 1)


@gluon.jit
def _walk_decode(q, k_desc, v_desc, table, seq_lens, out, lse, pair_lens, scale_log2, bsz, width, chunk,
                 n_pairs, merged_out, merged_lse, log_c, G: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                 D: gl.constexpr, BN: gl.constexpr, M: gl.constexpr, NB: gl.constexpr, PAGE: gl.constexpr,
                 NS: gl.constexpr, MERGE: gl.constexpr = 0, NP: gl.constexpr = 1, DSL: gl.constexpr = 16,
                 PROBE: gl.constexpr = 0, NW: gl.constexpr = 4, WS: gl.constexpr = 0):
    gl.static_assert(NS == 3, "the page-table look-ahead below is written for a ring of 3 tiles")
    gl.static_assert(gl.num_warps() == NW, "NW is the launch's num_warps")
    gl.static_assert(NW == 4 or NW == 8, "4 warps (one warpgroup) or 8 (two): the layouts below split the keys and "
                                         "the head dim over them")
    gl.static_assert(WS == 0 or PROBE == 0, "the probes run without the producer partition")
    pid = gl.program_id(0)
    if PROBE == 2:  # probe: a sequence's KV heads bsz programs apart
        b = pid % bsz
        h = pid // bsz
    else:
        b = pid // HKV
        h = pid % HKV
    seq, nc, last_keys, n_steps, table_row = _extent(seq_lens, table, b, width, chunk, NB, BN)
    n_tiles = 2 * n_steps
    if PROBE == 3:  # probe: the ring over whole cache rows (all KV heads), a quarter-block per program
        roff = h * (BN // HKV)
        col = 0
    else:
        roff = 0
        col = h * D

    ring = gl.allocate_shared_memory(gl.bfloat16, [NS] + k_desc.block_type.shape, k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(bars.index(s), count=1)
    if WS:  # a producer warp issues the TMA loads (bars: tile landed; empty: slot consumed)
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NS):
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize([
            (_walk_body, (q, k_desc, v_desc, ring, bars, empty, out, lse, pair_lens, scale_log2, bsz, chunk, n_pairs,
                          table_row, b, h, seq, nc, last_keys, n_steps, n_tiles, roff, col, G, HQ, D, BN, M, NB,
                          PAGE, NS, PROBE, NW, WS)),
            (_walk_produce, (k_desc, v_desc, ring, bars, empty, table_row, nc, last_keys, chunk, n_steps, roff, col,
                             NB, BN, PAGE, NS)),
        ], [1], [24])
        for s in gl.static_range(NS):
            mbarrier.invalidate(empty.index(s))
    else:
        _walk_body(q, k_desc, v_desc, ring, bars, bars, out, lse, pair_lens, scale_log2, bsz, chunk, n_pairs,
                   table_row, b, h, seq, nc, last_keys, n_steps, n_tiles, roff, col, G, HQ, D, BN, M, NB, PAGE, NS,
                   PROBE, NW, WS)
    for s in gl.static_range(NS):
        mbarrier.invalidate(bars.index(s))
    if MERGE:  # every state of (b, h) is stored: this CTA's own global stores, visible after a barrier
        _cta_barrier()
        _merge_own(out, lse, merged_out, merged_lse, log_c, b, h, bsz, n_pairs, G, HQ, D, M, NP, DSL, NW)


@gluon.jit
def _walk_produce(k_desc, v_desc, ring, bars, empty, table_row, nc, last_keys, chunk, n_steps, roff, col,
                  NB: gl.constexpr, BN: gl.constexpr, PAGE: gl.constexpr, NS: gl.constexpr):
    """The producer partition (``ws=True``, one warp): tile t (K of step t // 2 when t is even,
    else its V) into slot t % NS once the consumer has released the slot's previous tile (the
    slot's u-th use waits for phase u - 1 of ``empty``; a fresh barrier passes parity 1)."""
    e = _entry(table_row, 0, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
    for i in range(0, n_steps):
        e_next = _entry(table_row, i + 1, nc, last_keys, chunk, n_steps, NB, BN, PAGE)  # its load in flight early
        for kv in gl.static_range(2):
            t = 2 * i + kv
            slot = t % NS
            mbarrier.wait(empty.index(slot), ((t // NS) & 1) ^ 1)
            mbarrier.expect(bars.index(slot), k_desc.block_type.nbytes)
            if kv == 0:
                _tma_load(k_desc, [e + roff, col], bars.index(slot), ring.index(slot))
            else:
                _tma_load(v_desc, [e + roff, col], bars.index(slot), ring.index(slot))
        e = e_next


@gluon.jit
def _walk_body(q, k_desc, v_desc, ring, bars, empty, out, lse, pair_lens, scale_log2, bsz, chunk, n_pairs, table_row,
               b, h, seq, nc, last_keys, n_steps, n_tiles, roff, col, G: gl.constexpr, HQ: gl.constexpr,
               D: gl.constexpr, BN: gl.constexpr, M: gl.constexpr, NB: gl.constexpr, PAGE: gl.constexpr,
               NS: gl.constexpr, PROBE: gl.constexpr, NW: gl.constexpr, WS: gl.constexpr):
    """Every block of the sequence's chunks (the walk; with ``WS`` the consumer partition, which
    releases each slot to the producer instead of refilling it), the states stored."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)          # [BN] keys / [D] head dim of a [*, M] tile
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)          # [M] query heads
    # the thread sums: [M, t, 2j + e] with each (query, t) in one thread, its 32 columns in order
    sums3: gl.constexpr = gl.BlockedLayout([1, 1, 32], [8, 4, 1], [NW, 1, 1], [2, 1, 0])
    sums4: gl.constexpr = gl.BlockedLayout([1, 1, 16, 2], [8, 4, 1, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    part_l: gl.constexpr = gl.SliceLayout(2, sums3)
    ld_q: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, NW], [0, 1])
    ld_v: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # a [BN, D] tile, 16 bytes a thread
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    if WS:  # the producer partition (_walk_produce) fills the ring
        e1 = 0
        e2 = 0
    else:
        e1, e2 = _ring_start(table_row, nc, last_keys, chunk, n_steps, roff, col, k_desc, v_desc, ring, bars, NB, BN,
                             PAGE, NS)

    # the pair lengths (KV head 0) and the empty pairs' states past the sequence (out 0, lse -inf)
    qc = gl.arange(0, M, layout=cols_l)
    dr = gl.arange(0, D, layout=rows_l)
    cmask = qc < G
    head = h * G + qc
    for c in range(0, n_pairs):
        pair = c * bsz + b
        if h == 0:
            gl.store(pair_lens + pair, gl.minimum(gl.maximum(seq - c * chunk, 0), chunk))
        if c >= nc:
            gl.store(out + pair.to(gl.int64) * (HQ * D) + head[None, :] * D + dr[:, None],
                     gl.zeros([D, M], gl.bfloat16, mma), mask=cmask[None, :])
            gl.store(lse + pair.to(gl.int64) * HQ + head, gl.full([M], _NEG_INF, gl.float32, cols_l), mask=cmask)

    # Q^T [D, M] (query heads past G: 0), once
    qd = gl.arange(0, D, layout=gl.SliceLayout(1, ld_q))
    qq = gl.arange(0, M, layout=gl.SliceLayout(0, ld_q))
    qt = gl.load(q + b.to(gl.int64) * (HQ * D) + (h * G + qq)[None, :] * D + qd[:, None], mask=(qq < G)[None, :],
                 other=0.0)
    qt = gl.convert_layout(qt, op_b)

    psm = gl.allocate_shared_memory(gl.float32, [BN, M], flat)
    kk = gl.arange(0, BN, layout=rows_l)
    vk = gl.arange(0, BN, layout=gl.SliceLayout(1, ld_v))
    tq = gl.arange(0, 4, layout=gl.SliceLayout(0, part_l))

    m = gl.full([M], _NEG_INF, gl.float32, cols_l)
    part = gl.zeros([M, 4], gl.float32, part_l)
    acc = gl.zeros([D, M], gl.float32, mma)
    for i in range(0, n_steps):
        c, j, keys = _block(i, nc, last_keys, chunk, NB, BN)
        # K of step i: S^T = K @ Q^T
        _wait(2 * i, bars, NS)
        if PROBE == 1 or PROBE == 3:  # probe: the ring alone (every tile waited for and refilled, no arithmetic)
            _cta_barrier()
            fence_async_shared()
            _issue(2 * i + NS, e1 + roff, col, k_desc, v_desc, ring, bars, n_tiles, NS)
            _wait(2 * i + 1, bars, NS)
            _cta_barrier()
            fence_async_shared()
            _issue(2 * i + 1 + NS, e2 + roff, col, k_desc, v_desc, ring, bars, n_tiles, NS)
            e1 = e2
            e2 = _entry(table_row, i + 3, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
        else:
            k = ring.index((2 * i) % NS).load(op_a)
            _cta_barrier()
            fence_async_shared()
            if WS:  # the slot is free for the producer
                mbarrier.arrive(empty.index((2 * i) % NS), count=1)
            else:
                _issue(2 * i + NS, e1, col, k_desc, v_desc, ring, bars, n_tiles, NS)  # V of step i + 1
            st = mma_v2(k, qt, gl.zeros([BN, M], gl.float32, mma))
            st = gl.where((kk < keys)[:, None], st, _NEG_INF)
            m_prev = m
            m = gl.maximum(gl.max(st, axis=0), m_prev)
            m_use = gl.where(m == _NEG_INF, 0.0, m)
            p = _approx(gl.fma(st, scale_log2, -(m_use * scale_log2)[None, :]), "ex2")
            r = _approx((m_prev - m_use) * scale_log2, "ex2")  # 0 before a chunk's first block: part and acc are 0
            # thread sums: column 8j + 2t + e of query q is P^T[8j + 2t + e, q]
            psm.store(p)
            _cta_barrier()
            x = psm.reshape([16, 4, 2, M]).permute([3, 1, 0, 2]).load(sums4)
            _cta_barrier()
            x = gl.convert_layout(gl.reshape(x, [M, 4, 32]), sums3)
            r3 = gl.convert_layout(r, gl.SliceLayout(1, part_l))
            part = _fold32(part, r3, x)
            # V of step i: O^T = O^T * r + V^T @ P^T
            _wait(2 * i + 1, bars, NS)
            if keys < BN:  # V rows past the chunk zeroed in place (P is 0 there, but 0 * a non-finite cache value
                vt = ring.index((2 * i + 1) % NS).load(ld_v)        # is not); a branch: the other blocks skip it
                ring.index((2 * i + 1) % NS).store(gl.where((vk < keys)[:, None], vt, 0.0))
                _cta_barrier()
            v = ring.index((2 * i + 1) % NS).permute([1, 0]).load(op_a)
            _cta_barrier()
            fence_async_shared()
            if WS:
                mbarrier.arrive(empty.index((2 * i + 1) % NS), count=1)
            else:
                _issue(2 * i + 1 + NS, e2, col, k_desc, v_desc, ring, bars, n_tiles, NS)  # K of step i + 2
                e1 = e2
                e2 = _entry(table_row, i + 3, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
            acc = acc * r[None, :]
            acc = mma_v2(v, gl.convert_layout(p.to(gl.bfloat16), op_b), acc)
            if j == 0:  # the chunk's first block: its state is done
                total = gl.convert_layout(_quad_total(part, tq), cols_l)
                o = acc * _approx(total, "rcp")[None, :]
                ls = gl.fma(m, scale_log2, _approx(total, "lg2")) * _LN2
                pair = c * bsz + b
                gl.store(out + pair.to(gl.int64) * (HQ * D) + head[None, :] * D + dr[:, None], o.to(gl.bfloat16),
                         mask=cmask[None, :])
                gl.store(lse + pair.to(gl.int64) * HQ + head, ls, mask=cmask)
                m = gl.full([M], _NEG_INF, gl.float32, cols_l)
                part = gl.zeros([M, 4], gl.float32, part_l)
                acc = gl.zeros([D, M], gl.float32, mma)


@gluon.jit
def _merge_own(out, lse, merged_out, merged_lse, log_c, b, h, bsz, n_pairs, G: gl.constexpr, HQ: gl.constexpr,
               D: gl.constexpr, M: gl.constexpr, NP: gl.constexpr, DSL: gl.constexpr, NW: gl.constexpr):
    """rlk::merge_attn_states of sequence b's chunk states for KV head h's G query heads, with
    the merge op's steps (merge.py ``_merge_vec``: its exp, log and max, one IEEE op each):
    M = max lse, w = exp(lse - M) per state, L and acc = sum of w and w * out over the present
    states in ascending order, out = div_rn(acc, L) (0 where L = 0), lse = M + log(L). The
    state axis is in-thread, so each sum is one thread's sequential reduction; a state that is
    not present (lse -inf) adds +0 (its w is 0, its out loaded as 0), which leaves a sum other
    than -0 unchanged, and the first term is added to +0 first, as the op's walk does, so no sum
    is -0 where the op's is not. Its sums are gl.sum over the in-thread state axis: Triton 3.6
    folds them in index order (the GPU runs where these bits were checked), 3.9 in a tree, so
    under 3.9 they are not the op's (walk_rows.py's ``_merge_rows`` walks the states by hand)."""
    m3: gl.constexpr = gl.BlockedLayout([1, 1, NP], [8, 4, 1], [1, NW, 1], [2, 1, 0])
    l2d: gl.constexpr = gl.SliceLayout(1, m3)                # [M, NP]
    rows = bsz * HQ
    g = gl.arange(0, M, layout=gl.SliceLayout(1, l2d))
    ks = gl.arange(0, NP, layout=gl.SliceLayout(0, l2d))
    r = b.to(gl.int64) * HQ + h * G + g
    live = (g < G)[:, None] & (ks < n_pairs)[None, :]
    l2 = gl.load(lse + ks[None, :] * rows + r[:, None], mask=live, other=_NEG_INF)
    mx = _max_lse(l2, 1)
    m_safe = gl.where(mx == _NEG_INF, 0.0, mx)
    w = _mexp(l2 - m_safe[:, None], 1)
    w = gl.where(l2 != _NEG_INF, w, 0.0)
    first = (ks == 0)[None, :]
    total = gl.sum(gl.where(first, 0.0 + w, w), axis=1)     # [M]
    g3 = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, m3)))
    d3 = gl.arange(0, DSL, layout=gl.SliceLayout(0, gl.SliceLayout(2, m3)))
    k3 = gl.arange(0, NP, layout=gl.SliceLayout(0, gl.SliceLayout(1, m3)))
    r3 = b.to(gl.int64) * HQ + h * G + g3
    live3 = (g3 < G)[:, None, None] & (k3 < n_pairs)[None, None, :]
    w3 = gl.expand_dims(w, 1)
    first3 = (k3 == 0)[None, None, :]
    tot2 = gl.convert_layout(total, gl.SliceLayout(1, gl.SliceLayout(2, m3)))
    for sl in gl.static_range(D // DSL):
        d = sl * DSL + d3
        o = gl.load(out + ((k3[None, None, :] * rows + r3[:, None, None]) * D + d[None, :, None]), mask=live3,
                    other=0.0).to(gl.float32)
        wo = w3 * o
        acc = gl.sum(gl.where(first3, 0.0 + wo, wo), axis=2)  # [M, DSL]
        res = gl.div_rn(acc, tot2[:, None] + gl.zeros([M, DSL], gl.float32, gl.SliceLayout(2, m3)))
        res = gl.where(tot2[:, None] == 0.0, 0.0, res)
        gl.store(merged_out + r3[:, None] * D + d[None, :], res.to(gl.bfloat16), mask=(g3 < G)[:, None])
    gl.store(merged_lse + r, mx + _mlog(total, log_c), mask=g < G)


def supported(k_cache: torch.Tensor, v_cache: torch.Tensor, chunk_size: int) -> str | None:
    """None where walk_decode can run these caches and chunk size, else why not (the caller
    raises or routes)."""
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        return (f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from k_cache {tuple(k_cache.shape)} "
                f"{k_cache.dtype}")
    pages, page, hkv, d = k_cache.shape
    if page % BLOCK_N:
        return f"page_size {page} is not a multiple of {BLOCK_N}"
    if chunk_size % BLOCK_N:
        return f"chunk_size {chunk_size} is not a multiple of {BLOCK_N}"
    if d != 128:
        return f"head_dim {d} is not 128"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the cache is not contiguous"
    if k_cache.dtype != torch.bfloat16:
        return f"the cache dtype {k_cache.dtype} is not bfloat16"
    return None


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, whole_rows: bool = False) -> tuple:
    """TMA descriptors of the caches as [rows, HKV * D]: a tile is BLOCK_N rows of one KV head's
    D columns (column h * D); ``whole_rows`` (probe 3): BLOCK_N / HKV rows of every KV head, the
    same bytes."""
    pages, page, hkv, d = k_cache.shape
    shape, strides = [pages * page, hkv * d], [hkv * d, 1]
    block = [BLOCK_N // hkv, hkv * d] if whole_rows else [BLOCK_N, d]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return tuple(TensorDescriptor(c.view(shape), shape, strides, block, layout) for c in (k_cache, v_cache))


def walk_decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale: float, chunk_size: int,
                merge: bool = False, probe: int = 0, warps: int = NUM_WARPS, ws: bool = False, rows: bool = False):
    """pair_decode's ``(out [N*B, 1, Hq, D], lse [N*B, Hq, 1], pair_lens [N*B], N)`` of a decode
    step, by one program per (sequence, KV head) walking every chunk of the sequence. ``merge``:
    each program then merges its own states with the merge op's steps (``_merge_own``; up to
    MERGE_MAX chunks per sequence) and the merged ``(out [B, 1, Hq, D], lse [B, Hq, 1])`` follow.
    ``probe`` is for benchmarks/probe_walk_decode.py only: 1 runs the ring alone (no arithmetic,
    the states are garbage), 2 places a sequence's KV heads bsz programs apart (same bits), 3 runs
    the ring alone over whole cache rows: program (b, h) reads rows h * BLOCK_N / Hkv onward of
    each block, every KV head's columns, the same bytes per tile as 1 (garbage states).
    ``warps``: 4 (one warpgroup) or 8 (two, same bits; slower on the H200, session 25). ``ws``: a
    producer warp of its own issues the TMA loads into the ring (``_walk_produce``) while the
    program's warps only compute (``_walk_body`` as the default partition of gl.warp_specialize,
    releasing each slot through an ``empty`` barrier), registers capped at WS_MAXNREG so two
    programs still fit an SM. Built for sm90 under Triton 3.6 and 3.9 (session 25; the non-ws
    variants' SASS byte-identical to before the split into ``_walk_body``); on an H100 its states
    equal the 4-warp walk's and it is no faster (benchmarks/quick_walk_ws.py; README). ``rows``: one
    warp per (sequence, KV head) with the queries on the MMA's M axis (walk_rows.py, session 26;
    Hq / Hkv up to 16; no probes, ``warps`` and ``ws`` do not apply)."""
    from rlk_ops.kernels.triton.pair_decode import scale_log2

    why = supported(k_cache, v_cache, chunk_size)
    if why is not None:
        raise ValueError(f"walk_decode: {why}")
    if warps not in (4, 8):
        raise ValueError(f"walk_decode warps must be 4 or 8, got {warps!r}")
    if ws and probe:
        raise ValueError(f"walk_decode ws=True runs without probes, got probe={probe!r}")
    if rows and (probe or ws or warps != NUM_WARPS):
        raise ValueError(f"walk_decode rows=True is one warp per program without probes or a producer warp, got "
                         f"probe={probe!r}, ws={ws!r}, warps={warps!r}")
    if probe not in (0, 1, 2, 3):
        raise ValueError(f"walk_decode probe must be 0, 1 (the ring alone), 2 (KV heads apart) or 3 (the ring over "
                         f"whole rows), got {probe!r}")
    bsz, _, hq, d = q.shape
    pages, page, hkv, _ = k_cache.shape
    cols = ROWS_M if rows else COLS
    if hq % hkv or hq // hkv > cols:
        raise ValueError(f"walk_decode{' rows=True' if rows else ''} needs Hq / Hkv <= {cols} query heads per KV "
                         f"head, got Hq {hq}, Hkv {hkv}")
    width = page_table.shape[1]
    n = pair_count(width, page, chunk_size)
    if merge and n > MERGE_MAX:
        raise ValueError(f"walk_decode merge=True takes up to {MERGE_MAX} chunks per sequence, got {n} "
                         f"(page_table width {width} x page {page} / chunk_size {chunk_size})")
    if q.device.type != "cuda":
        raise ValueError(f"walk_decode needs a CUDA device (SM90: TMA), got q on {q.device}")
    cap = torch.cuda.get_device_capability(q.device)
    if cap[0] != 9:
        raise ValueError(f"walk_decode needs an SM90 GPU (Hopper: TMA with mma.sync), got compute capability "
                         f"{cap[0]}.{cap[1]} for q on {q.device}")
    dev = q.device
    out = torch.empty((n * bsz, 1, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty((n * bsz, hq, 1), dtype=torch.float32, device=dev)
    pair_lens = torch.empty(n * bsz, dtype=torch.int32, device=dev)
    merged = (torch.empty((bsz, 1, hq, d), dtype=q.dtype, device=dev),
              torch.empty((bsz, hq, 1), dtype=torch.float32, device=dev)) if merge else (out, lse)
    extra = {"MERGE": 1, "NP": C.pow2(n), "DSL": MERGE_DSL} if merge else {}
    if probe:
        extra["PROBE"] = probe
    if ws:  # a producer warp (its own warpgroup): registers capped so two programs still fit an SM
        extra.update(WS=1, maxnreg=WS_MAXNREG)
    if bsz and rows:
        from rlk_ops.kernels.triton.walk_rows import DSLAB, KSTEP, MERGE_STEP, _walk_rows

        # 16 query heads: 4 states a step (8 spilled offline, Triton 3.6 and 3.9)
        step = MERGE_STEP if hq // hkv <= 8 else MERGE_STEP // 2
        extra = {"MERGE": 1, "NP": C.pow2(n), "GP": C.pow2(hq // hkv), "SB": step} if merge else {}
        k_desc, v_desc = descriptors(k_cache, v_cache)
        _walk_rows[(bsz * hkv,)](C.aligned(q), k_desc, v_desc, C.aligned(page_table), C.aligned(seq_lens), out, lse,
                                 pair_lens, scale_log2(softmax_scale), bsz, width, chunk_size, n, *merged,
                                 merge_mod._log_constants(dev) if merge else lse,
                                 G=hq // hkv, HQ=hq, HKV=hkv, D=d, BN=BLOCK_N, M=ROWS_M, NB=chunk_size // BLOCK_N,
                                 PAGE=page, NS=STAGES, **extra, KS=KSTEP, DS=DSLAB,
                                 num_warps=1, **C.LAUNCH)
    elif bsz:
        k_desc, v_desc = descriptors(k_cache, v_cache, whole_rows=probe == 3)
        _walk_decode[(bsz * hkv,)](C.aligned(q), k_desc, v_desc, C.aligned(page_table), C.aligned(seq_lens), out,
                                   lse, pair_lens, scale_log2(softmax_scale), bsz, width, chunk_size, n, *merged,
                                   merge_mod._log_constants(dev) if merge else lse,
                                   G=hq // hkv, HQ=hq, HKV=hkv, D=d, BN=BLOCK_N, M=COLS, NB=chunk_size // BLOCK_N,
                                   PAGE=page, NS=STAGES, **extra, NW=warps, num_warps=warps, **C.LAUNCH)
    res = (out, lse, pair_lens, n)
    return res + merged if merge else res
