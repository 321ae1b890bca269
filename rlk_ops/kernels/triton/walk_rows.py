"""The TMA walk (walk_decode.py) with the queries on the MMA's M axis: one warp per (sequence,
KV head), no cross-warp barrier and no shared-memory round trip per key block.

Why (issue 8, page 128, batch 64, session 26): walk_decode puts the keys on M over four warps,
so each key block's softmax needs a cross-warp max and a shared-memory transpose of P to give
every thread FA4's columns for its thread sums; on the H200 its ring alone streams at
0.97-0.99x FA4 but the walk at 1.014-1.021x. Here one warp computes S = Q @ K^T as a [16, 128]
tile (mma.sync m16n8k16; the G query heads on rows 0..G-1, the other rows zero), and the
accumulator layout already gives thread t of each row quad the columns 8j + 2t + e, j = 0..15,
e = 0..1: FA4's thread-sum columns, in FA4's order, in its own registers. The row max is two
quad shuffles. O = bf16(P) @ V takes P from the accumulator registers (the A operand of mma.sync
in the same registers) and V in four 32-column slabs, so each slab's accumulator is its own
[16, 32] tile. Q and each K tile are read in head-dim steps of 16 (K^T's B operand per step),
which keeps the registers under 255 with no spill. The tensor core does 4x the work of the
keys-on-M tile (16 rows for G = 4): 256 mma.sync per block against a block's ~7,000-cycle share
of the H200's bandwidth at batch 64 (two programs per SM; 64 blocks in ~234 us at 8k).

Status: built for sm90 under Triton 3.6 and 3.9 (255 registers, no spill, 102 KB of shared
memory; benchmarks/walk_decode_sm90_offline.py --rows). Session 27, on an H100: its states and
its own merge are bitwise equal to the routed pair kernel's and the merge op's (19 CUDA tests,
the probe at 64 x 8k and 32k), and it runs at 1.040-1.050x FA4 single pass (the 4-warp walk
1.042-1.057x; results/h100/session27/). Not routed. Session 29 measured the ring as six [BN, D / 2]
half tiles, each slot refilled as soon as its half of S or O was done (``halves=True``): same
bits, slower on an H100 (1.044-1.049x FA4 against 1.023-1.026x; results/h100/session29/). It
was removed; its code is at commit 3274ca1.

Arithmetic, per key block (a chunk's blocks from its last to its first, chunks in ascending
order): the steps of walk_decode.py's docstring, the same IEEE operations in the same order. The
thread sums are walk_decode's ``_fold32`` (each column picked out, one add after another), not
gl.sum: Triton 3.9 lowers gl.sum's in-thread part as a tree, 3.6 in index order. Under 3.6 the
two give byte-identical SASS here and in every walk_decode variant (session 26, offline).
The states (out, lse, pair_lens) are pair_decode's, chunk-major (pair c * B + b).

Launched by ``walk_decode(..., rows=True)``, which checks what it needs (page_size % 128 == 0,
head_dim 128, bf16, contiguous caches, an SM90 GPU, Hq / Hkv <= 16).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from rlk_ops.kernels.triton import walk_decode as W
from rlk_ops.kernels.triton.merge import _exp as _mexp, _log as _mlog, _max_lse
from rlk_ops.kernels.triton.walk_decode import (_approx, _block, _cta_barrier, _entry, _extent, _fold32, _issue,
                                                  _quad_total, _ring_start, _tma_load, _wait)

ROWS = W.ROWS_M     # mma.sync's M: the query heads of one KV head, padded
KSTEP = 16         # head-dim columns of Q and K^T per mma.sync step
DSLAB = 32         # head-dim columns of one O accumulator slab
MERGE_STEP = 8     # merge=True: states whose out rows are loaded together (_merge_rows)
_NEG_INF = gl.constexpr(float("-inf"))
_LN2 = gl.constexpr(W._LN2.value)


@gluon.jit
def _scores(qs, tile, M: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, KS: gl.constexpr, mma: gl.constexpr):
    """S = Q @ K^T [M, BN] from Q [M, D] and a K tile [BN, D] in shared memory, K-steps of KS."""
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    s = gl.zeros([M, BN], gl.float32, mma)
    for kk in gl.static_range(D // KS):
        a = qs.slice(kk * KS, KS, dim=1).load(op_a)
        b = tile.slice(kk * KS, KS, dim=1).permute([1, 0]).load(op_b)
        s = mma_v2(a, b, s)
    return s


@gluon.jit
def _pv(p_a, tile, acc, r, dd: gl.constexpr, DS: gl.constexpr, mma: gl.constexpr):
    """One O slab: acc * r + P @ V[:, dd * DS : (dd + 1) * DS]."""
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    v = tile.slice(dd * DS, DS, dim=1).load(op_b)
    return mma_v2(p_a, v, acc * r[:, None])


@gluon.jit
def _store_slab(out, acc, inv, pair, head, rmask, dd: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr,
                DS: gl.constexpr, mma: gl.constexpr):
    dc = dd * DS + gl.arange(0, DS, layout=gl.SliceLayout(0, mma))
    gl.store(out + pair.to(gl.int64) * (HQ * D) + head[:, None] * D + dc[None, :], (acc * inv[:, None]).to(gl.bfloat16),
             mask=rmask[:, None])


@gluon.jit
def _walk_rows(q, k_desc, v_desc, table, seq_lens, out, lse, pair_lens, scale_log2, bsz, width, chunk,
               n_pairs, merged_out, merged_lse, log_c, G: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
               D: gl.constexpr, BN: gl.constexpr, M: gl.constexpr, NB: gl.constexpr, PAGE: gl.constexpr,
               NS: gl.constexpr, MERGE: gl.constexpr = 0, NP: gl.constexpr = 1, GP: gl.constexpr = 4,
               SB: gl.constexpr = 8, KS: gl.constexpr = 16, DS: gl.constexpr = 32):
    gl.static_assert(NS == 3, "the page-table look-ahead below is written for a ring of 3 tiles")
    gl.static_assert(gl.num_warps() == 1, "one warp per (sequence, KV head)")
    gl.static_assert(D == 4 * DS, "four O slabs")
    gl.static_assert(M == 16, "mma.sync's M")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)          # [M] query heads
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)          # [BN] keys / [DS] head dim
    # the thread sums: [M, t, 2j + e], each (query, t) in one thread, its 32 columns in order
    sums3: gl.constexpr = gl.BlockedLayout([1, 1, 32], [8, 4, 1], [1, 1, 1], [2, 1, 0])
    part_l: gl.constexpr = gl.SliceLayout(2, sums3)
    ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    ld_v: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], gl.bfloat16)

    pid = gl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    seq, nc, last_keys, n_steps, table_row = _extent(seq_lens, table, b, width, chunk, NB, BN)
    n_tiles = 2 * n_steps
    col = h * D

    ring = gl.allocate_shared_memory(gl.bfloat16, [NS] + k_desc.block_type.shape, k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(bars.index(s), count=1)
    e1, e2 = _ring_start(table_row, nc, last_keys, chunk, n_steps, 0, col, k_desc, v_desc, ring, bars, NB, BN,
                         PAGE, NS)

    # the pair lengths (KV head 0) and the empty pairs' states past the sequence (out 0, lse -inf)
    qr = gl.arange(0, M, layout=rows_l)
    rmask = qr < G
    head = h * G + qr
    dz = gl.arange(0, D, layout=cols_l)
    for c in range(0, n_pairs):
        pair = c * bsz + b
        if h == 0:
            gl.store(pair_lens + pair, gl.minimum(gl.maximum(seq - c * chunk, 0), chunk))
        if c >= nc:
            gl.store(out + pair.to(gl.int64) * (HQ * D) + head[:, None] * D + dz[None, :],
                     gl.zeros([M, D], gl.bfloat16, mma), mask=rmask[:, None])
            gl.store(lse + pair.to(gl.int64) * HQ + head, gl.full([M], _NEG_INF, gl.float32, rows_l), mask=rmask)

    # Q [M, D] (rows past G: 0) into shared memory once, read in K-steps
    lq_r = gl.arange(0, M, layout=gl.SliceLayout(1, ld_q))
    lq_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld_q))
    qt = gl.load(q + b.to(gl.int64) * (HQ * D) + (h * G + lq_r)[:, None] * D + lq_d[None, :],
                 mask=(lq_r < G)[:, None], other=0.0)
    qs = gl.allocate_shared_memory(gl.bfloat16, [M, D], q_sl, qt)
    _cta_barrier()

    kk = gl.arange(0, BN, layout=cols_l)
    vk = gl.arange(0, M, layout=gl.SliceLayout(1, ld_v))
    tq = gl.arange(0, 4, layout=gl.SliceLayout(0, part_l))

    m = gl.full([M], _NEG_INF, gl.float32, rows_l)
    part = gl.zeros([M, 4], gl.float32, part_l)
    acc0 = gl.zeros([M, DS], gl.float32, mma)
    acc1 = gl.zeros([M, DS], gl.float32, mma)
    acc2 = gl.zeros([M, DS], gl.float32, mma)
    acc3 = gl.zeros([M, DS], gl.float32, mma)
    for i in range(0, n_steps):
        c, j, keys = _block(i, nc, last_keys, chunk, NB, BN)
        # K of step i: S = Q @ K^T
        _wait(2 * i, bars, NS)
        st = _scores(qs, ring.index((2 * i) % NS), M, D, BN, KS, mma)
        _cta_barrier()
        fence_async_shared()
        _issue(2 * i + NS, e1, col, k_desc, v_desc, ring, bars, n_tiles, NS)  # V of step i + 1
        st = gl.where((kk < keys)[None, :], st, _NEG_INF)
        m_prev = m
        m = gl.maximum(gl.max(st, axis=1), m_prev)
        m_use = gl.where(m == _NEG_INF, 0.0, m)
        p = _approx(gl.fma(st, scale_log2, -(m_use * scale_log2)[:, None]), "ex2")
        r = _approx((m_prev - m_use) * scale_log2, "ex2")  # 0 before a chunk's first block: part and acc are 0
        # thread sums: column 8j + 2t + e of row q is p[q, 8j + 2t + e], in this thread already
        x = gl.reshape(gl.permute(gl.reshape(p, [M, 16, 4, 2]), [0, 2, 1, 3]), [M, 4, 32])
        x = gl.convert_layout(x, sums3)
        r3 = gl.convert_layout(r, gl.SliceLayout(1, part_l))
        part = _fold32(part, r3, x)
        # V of step i: O = O * r + bf16(P) @ V, four slabs of the head dim
        _wait(2 * i + 1, bars, NS)
        vtile = ring.index((2 * i + 1) % NS)
        if keys < BN:  # V rows past the chunk zeroed in place (P is 0 there, but 0 * a non-finite cache value
            for rs in gl.static_range(BN // M):            # is not); a branch: the other blocks skip it
                vsl = vtile.slice(rs * M, M, dim=0)
                vsl.store(gl.where((rs * M + vk < keys)[:, None], vsl.load(ld_v), 0.0))
            _cta_barrier()
        p_a = gl.convert_layout(p.to(gl.bfloat16), op_a)
        acc0 = _pv(p_a, vtile, acc0, r, 0, DS, mma)
        acc1 = _pv(p_a, vtile, acc1, r, 1, DS, mma)
        acc2 = _pv(p_a, vtile, acc2, r, 2, DS, mma)
        acc3 = _pv(p_a, vtile, acc3, r, 3, DS, mma)
        _cta_barrier()
        fence_async_shared()
        _issue(2 * i + 1 + NS, e2, col, k_desc, v_desc, ring, bars, n_tiles, NS)  # K of step i + 2
        e1 = e2
        e2 = _entry(table_row, i + 3, nc, last_keys, chunk, n_steps, NB, BN, PAGE)
        if j == 0:  # the chunk's first block: its state is done
            total = gl.convert_layout(_quad_total(part, tq), rows_l)
            inv = _approx(total, "rcp")
            ls = gl.fma(m, scale_log2, _approx(total, "lg2")) * _LN2
            pair = c * bsz + b
            _store_slab(out, acc0, inv, pair, head, rmask, 0, HQ, D, DS, mma)
            _store_slab(out, acc1, inv, pair, head, rmask, 1, HQ, D, DS, mma)
            _store_slab(out, acc2, inv, pair, head, rmask, 2, HQ, D, DS, mma)
            _store_slab(out, acc3, inv, pair, head, rmask, 3, HQ, D, DS, mma)
            gl.store(lse + pair.to(gl.int64) * HQ + head, ls, mask=rmask)
            m = gl.full([M], _NEG_INF, gl.float32, rows_l)
            part = gl.zeros([M, 4], gl.float32, part_l)
            acc0 = gl.zeros([M, DS], gl.float32, mma)
            acc1 = gl.zeros([M, DS], gl.float32, mma)
            acc2 = gl.zeros([M, DS], gl.float32, mma)
            acc3 = gl.zeros([M, DS], gl.float32, mma)
    for s in gl.static_range(NS):
        mbarrier.invalidate(bars.index(s))
    if MERGE:  # every state of (b, h) is stored: this CTA's own global stores, visible after a barrier
        _cta_barrier()
        _merge_rows(out, lse, merged_out, merged_lse, log_c, b, h, bsz, n_pairs, G, HQ, D, GP, NP, SB)


@gluon.jit
def _merge_rows(out, lse, merged_out, merged_lse, log_c, b, h, bsz, n_pairs, G: gl.constexpr, HQ: gl.constexpr,
                D: gl.constexpr, GP: gl.constexpr, NP: gl.constexpr, SB: gl.constexpr):
    """rlk::merge_attn_states of sequence b's chunk states for KV head h's G query heads, with
    the merge op's steps as walk_decode's ``_merge_own`` takes them (merge.py's exp, log and max,
    one IEEE op each): M = max lse; w = exp(lse - M) per state (0 where lse is -inf); L and acc =
    the sums of w and w * out over the states in ascending order, each from +0; out =
    div_rn(acc, L) (0 where L = 0); lse = M + log(L). One warp: every state's lse in one tile
    (the state axis in-thread) gives M (a max: exact in any order); then the states SB at a time,
    their lse and out rows loaded together, 16 bytes a load (``_merge_own`` reads one head-dim
    column of one row per thread), and both sums walk them one add after another (not gl.sum,
    whose order is the compiler's). A state past n_pairs loads as lse -inf and out 0 and adds +0,
    which leaves a sum that is not -0 unchanged (none is: each starts as +0 + its first term)."""
    l2d: gl.constexpr = gl.BlockedLayout([1, NP], [32, 1], [1, 1], [1, 0])   # [GP, NP]; rows replicated over lanes
    lo: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])     # [GP, D], 16 bytes a load
    rows = bsz * HQ
    g = gl.arange(0, GP, layout=gl.SliceLayout(1, l2d))
    ks = gl.arange(0, NP, layout=gl.SliceLayout(0, l2d))
    r = b.to(gl.int64) * HQ + h * G + g
    l2 = gl.load(lse + ks[None, :] * rows + r[:, None], mask=(g < G)[:, None] & (ks < n_pairs)[None, :],
                 other=_NEG_INF)
    mx = _max_lse(l2, 1)
    m_safe = gl.where(mx == _NEG_INF, 0.0, mx)
    go = gl.arange(0, GP, layout=gl.SliceLayout(1, lo))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, lo))
    ro = b.to(gl.int64) * HQ + h * G + go
    gmask = go < G
    m_o = gl.convert_layout(m_safe, gl.SliceLayout(1, lo))
    acc = gl.zeros([GP, D], gl.float32, lo)
    total = gl.zeros([GP], gl.float32, gl.SliceLayout(1, lo))
    for k0 in range(0, n_pairs, SB):
        for kk in gl.static_range(SB):
            k = k0 + kk
            live = gmask & (k < n_pairs)
            lk = gl.load(lse + k * rows + ro, mask=live, other=_NEG_INF)
            ok = gl.load(out + (k * rows + ro)[:, None] * D + do[None, :], mask=live[:, None], other=0.0)
            wk = gl.where(lk != _NEG_INF, _mexp(lk - m_o, 1), 0.0)
            total = total + wk
            acc = acc + wk[:, None] * ok.to(gl.float32)
    res = gl.div_rn(acc, total[:, None] + gl.zeros([GP, D], gl.float32, lo))
    res = gl.where(total[:, None] == 0.0, 0.0, res)
    gl.store(merged_out + ro[:, None] * D + do[None, :], res.to(gl.bfloat16), mask=gmask[:, None])
    mx_o = gl.convert_layout(mx, gl.SliceLayout(1, lo))
    gl.store(merged_lse + ro, mx_o + _mlog(total, log_c), mask=gmask)

