"""Triton rlk::merge_attn_states (+ backward) and the canonical:C decode pair layout.

Forward: one program per block of (row, head) pairs of the states' common layout and slice
of head_dim (``merge_config``: few rows, as in decode, get 1-row programs and head_dim in 4
slices). Two kernels with the same steps (``merge_route`` picks): ``_merge_vec`` on 1-row,
1-warp programs, over a quarter of head_dim while rows < SMs (decode up to batch 8 on the
H200; ``VEC_STATES``, ``vec_states``) and over all of it up to ``VEC_ROWS_MAX`` rows (larger
decode batches): 32 states at a time side by side, a weight per lane, every product w * out
in one tile op, only the two sums walking the states; ``_merge_fwd`` otherwise (training):
the walk unrolled, up to ``MAX_UNROLL`` states at a time, so their loads overlap.
Both go through the N states in ascending order with the formula of kernels/cpu/merge.py,
step for step:

    M = max of the non-skipped lse_n;  w = exp(lse_n - M);  L += w;  acc += w * out_n
    out = acc / L rounded once;  lse = M + log(L);  a state with lse = -inf is skipped
    (its out is never loaded), a row with no state left gives out = 0, lse = -inf.

Every step is one IEEE operation (no FMA contraction: ``_common.LAUNCH``; ``div_rn``, not
Triton's default approximate fp32 division), ``exp`` is the same Cody-Waite + degree-7
Horner polynomial as ``numerics.exp`` (fp32) and ``log`` the same float64 atanh series
as ``numerics.log``, rounded once to fp32. So both kernels give the CPU reference merge's
bits, which tests/test_canonical_cuda.py checks with torch.equal. Nothing reduces across
rows or over head_dim, so the bits of a row do not depend on the blocking, the head_dim
slicing, the unrolling or the batch.
float64 states are not supported here (FA4 has no fp64; the cpu backend merges those).

``state_lens`` (optional, int ``[N, ...]``, the lse layout without ``H, S``): a state
whose length is 0 is skipped as if its lse were -inf. canonical:C decode passes the pair
lengths, so the empty (chunk, sequence) pairs need no separate masking kernel.

Backward: per (row, state) ``p = exp(lse_n - lse)``, ``d_out_n = p * dout``,
``d_lse_n = p * (rowsum(dout * (out_n - out)) + dlse)``; the rowsum is a ``tl.sum`` over a
fixed ``[BLOCK_R, BLOCK_D]`` tile (order fixed by head_dim, never by the batch). It is not
the CPU reference's summation order, so only run-to-run and batch invariance are claimed.

Decode pairs: ``decode_pairs`` writes what ``kernels/cpu/canonical.decode_pairs`` computes
(pair table and lengths, chunk-major), the kernel lengths clamped to >= 1, and the
per-pair copy of the query, in one launch: ten small torch ops would cost more than the
attention itself at batch 1 (each launch is ~2 us even inside a CUDA graph).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rlk_ops.kernels.cpu.canonical import pair_columns, pair_count
from rlk_ops.kernels.triton import _common as C

BLOCK_R = 16     # (row, head) pairs per program at most (merge_config); any value gives the same bits
NUM_WARPS = 4    # fixed: the backward's rowsum order depends on it

# numerics.exp (fp32): clamp range, ln 2 split, 1/k! for k = 7..0 (Horner order)
_LO = tl.constexpr(-126 * math.log(2.0))
_HI = tl.constexpr(127 * math.log(2.0))
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(6.93145752e-01)
_LN2_LO = tl.constexpr(1.42860677e-06)
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + R) - R rounds half to even for |t| < 2**22
_E0 = tl.constexpr(1.0 / math.factorial(7))
_E1 = tl.constexpr(1.0 / math.factorial(6))
_E2 = tl.constexpr(1.0 / math.factorial(5))
_E3 = tl.constexpr(1.0 / math.factorial(4))
_E4 = tl.constexpr(1.0 / math.factorial(3))
_E5 = tl.constexpr(1.0 / math.factorial(2))
_E6 = tl.constexpr(1.0)
_E7 = tl.constexpr(1.0)
_NEG_INF = tl.constexpr(float("-inf"))
_INF = tl.constexpr(float("inf"))
# No NaN global: Triton (3.6) re-checks a kernel's globals on every launch with ``!=``, and
# NaN != NaN fails that check ("Global variable ... has changed"). NaN is spelled
# ``_INF - _INF`` in the kernels instead (a constexpr computed at compile time).
_N_LOG = 11  # numerics._LOG_TERMS
_LOG_TERMS = tl.constexpr(_N_LOG)


def _log_constants(device: torch.device) -> torch.Tensor:
    """float64 constants of numerics.log, loaded by the kernel: a Python float literal in a
    Triton kernel is typed fp32, which would round them."""
    key = (device.type, device.index)
    t = _LOG_CONST.get(key)
    if t is None:
        vals = [1.0 / (2 * k + 1) for k in range(_N_LOG - 1, -1, -1)]  # Horner order, 1/21 first
        vals += [math.log(2.0), math.sqrt(0.5)]
        t = _LOG_CONST[key] = torch.tensor(vals, dtype=torch.float64, device=device)
    return t


_LOG_CONST: dict = {}


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """numerics.exp for fp32, the same IEEE operations in the same order for x <= 127 * ln 2
    (the merge passes x <= 0). Above, numerics.exp (session 29) scales by 2**n in two factors
    to stay finite up to log(max); this one gives inf from 88.03."""
    xc = tl.where(x < _LO, _LO, x)  # clamp; NaN passes (comparisons are false)
    xc = tl.where(xc > _HI, _HI, xc)
    t = xc * _LOG2E
    if LIBDEVICE:
        n = libdevice.rint(t)  # round half to even, as torch.round
    else:  # TRITON_INTERPRET (no libdevice): the magic-number rounding, same result here
        n = (t + _ROUND) - _ROUND
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = _E0 * r + _E1
    p = p * r + _E2
    p = p * r + _E3
    p = p * r + _E4
    p = p * r + _E5
    p = p * r + _E6
    p = p * r + _E7
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    y = p * scale
    y = tl.where(x < _LO, 0.0, y)
    y = tl.where(x > _HI, _INF, y)
    return tl.where(x != x, x, y)


@triton.jit
def _log(x, c_ptr):
    """numerics.log: evaluated in float64 from x's exact value, rounded once to fp32."""
    xd = x.to(tl.float64)
    bits = xd.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1022                                   # frexp, positive normal x
    m = ((bits & 0xFFFFFFFFFFFFF) | (1022 << 52)).to(tl.float64, bitcast=True)  # in [0.5, 1)
    small = m < tl.load(c_ptr + _LOG_TERMS + 1)
    m = tl.where(small, m * 2.0, m)
    e = tl.where(small, e - 1, e).to(tl.float64)
    f = (m - 1.0) / (m + 1.0)                                           # fp64 division is IEEE
    f2 = f * f
    p = tl.load(c_ptr)   # a scalar: the first step below makes it f's shape (no layout needed: Gluon callers)
    for k in tl.static_range(1, _LOG_TERMS):
        p = p * f2 + tl.load(c_ptr + k)
    y = (2.0 * f) * p + e * tl.load(c_ptr + _LOG_TERMS)
    y = tl.where(xd == 0.0, _NEG_INF, y)
    y = tl.where(xd == _INF, xd, y)
    y = tl.where((xd < 0.0) | (xd != xd), _INF - _INF, y)
    return y.to(tl.float32)


@triton.jit
def _state_lse(l_ptr, lens_ptr, n, R, off, lead, n_lead, rmask, HAS_LENS: tl.constexpr, CACHE: tl.constexpr):
    """State n's lse (-inf where its length is 0). ``CACHE``: the loads' cache modifier (".cg":
    from L2, for states another CTA of the same launch wrote; see pair_decode's fused merge)."""
    lse = tl.load(l_ptr + n * R + off, mask=rmask, other=_NEG_INF, cache_modifier=CACHE)
    if HAS_LENS:
        keys = tl.load(lens_ptr + n * n_lead + lead, mask=rmask, other=0)
        lse = tl.where(keys > 0, lse, _NEG_INF)
    return lse


@triton.jit
def _max_lse(lse2, AXIS: tl.constexpr):
    """The max of a tile of lse over AXIS (exact in any order); NaN propagates, as amax."""
    m = tl.max(lse2, axis=AXIS)
    nan = tl.max(tl.where(lse2 != lse2, 1, 0), axis=AXIS) > 0
    return tl.where(nan, _INF - _INF, m)


@triton.jit
def _lse_tile(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, HAS_LENS: tl.constexpr, MAX2D: tl.constexpr):
    """Every state's lse of the rows, [BLOCK, MAX2D] in one load (-inf past N and where skipped)."""
    ns = tl.arange(0, MAX2D)
    mn = rmask[:, None] & (ns < N)[None, :]
    return _state_lse(l_ptr, lens_ptr, ns[None, :], R, off[:, None], lead[:, None], n_lead, mn, HAS_LENS, "")


@triton.jit
def _live_below_last(lse2, N, MAX2D: tl.constexpr):
    """1 + the last state below N - 1 that any row of the ``_lse_tile`` holds (0 if none): the
    states from there to N - 2 are skipped in every row, so a walk may leave them out (same
    bits). Training's plans (kernels/cpu/canonical.plan) give a row in chunk i states 0..i-1 and
    N - 1 only."""
    ns = tl.arange(0, MAX2D)[None, :]
    return tl.max(tl.max(tl.where((lse2 != _NEG_INF) & (ns < N - 1), ns + 1, 0), axis=1), axis=0)


@triton.jit
def _states_max(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, BLOCK: tl.constexpr, HAS_LENS: tl.constexpr,
                MAX2D: tl.constexpr):
    """M, the max of the rows' non-skipped lse over the N states (exact in any order; NaN
    propagates, as amax). MAX2D > 0: every state's lse in one [BLOCK, MAX2D] load and one max,
    no chain of N loads; else a loop over the states."""
    if MAX2D > 0:
        m = _max_lse(_lse_tile(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, HAS_LENS, MAX2D), 1)
    else:
        m = tl.full([BLOCK], _NEG_INF, tl.float32)
        for n in range(N):
            lse = _state_lse(l_ptr, lens_ptr, n, R, off, lead, n_lead, rmask, HAS_LENS, "")
            m = tl.where(lse > m, lse, m)
            m = tl.where(lse != lse, lse, m)
    return m


@triton.jit
def _merge_step(o_ptr, l_ptr, lens_ptr, n, R, r, off, lead, n_lead, rmask, d, m2, D: tl.constexpr, m_safe, total,
                acc, HAS_LENS: tl.constexpr, LIBDEVICE: tl.constexpr, CACHE: tl.constexpr, EAGER: tl.constexpr = 0):
    """State n's step. EAGER: its out rows are loaded whether or not it is present (a skipped
    state's values are loaded and never selected), so the load does not wait for its lse."""
    lse = _state_lse(l_ptr, lens_ptr, n, R, off, lead, n_lead, rmask, HAS_LENS, CACHE)
    present = lse != _NEG_INF
    w = _exp(lse - m_safe, LIBDEVICE)
    total = tl.where(present, total + w, total)
    omask = m2 & rmask[:, None] if EAGER else m2 & present[:, None]
    o = tl.load(o_ptr + (n * R + r)[:, None] * D + d[None, :], mask=omask, other=0.0, cache_modifier=CACHE)
    acc = tl.where(present[:, None], acc + w[:, None] * o.to(tl.float32), acc)
    return total, acc


@triton.jit
def _merge_fwd(o_ptr, l_ptr, lens_ptr, c_ptr, out_ptr, lse_ptr, N, R, S, H, n_lead,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_LENS: tl.constexpr,
               LIBDEVICE: tl.constexpr, UNROLL: tl.constexpr, MAX2D: tl.constexpr, PDL: tl.constexpr,
               EAGER: tl.constexpr = 0, SKIP: tl.constexpr = 0):
    """SKIP (MAX2D > 0, UNROLL > 0): the walk goes over the states below ``_live_below_last``'s
    bound, in groups of UNROLL, then state N - 1; the states it leaves out are skipped in every
    row of the program, so the same states are merged in the same order."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)   # (lead, s, h) row of out
    rmask = r < R
    h = r % H
    s = (r // H) % S
    lead = r // (H * S)
    off = lead * (H * S) + h * S + s                                    # its place in [..., H, S]
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)              # this program's head_dim slice
    m2 = rmask[:, None] & (d < D)[None, :]
    if PDL:  # launched before the previous kernel finished: wait for it (and its writes) here
        tl.extra.cuda.gdc_wait()
    if SKIP:  # one lse tile for the max and for the walk's bound
        lse2 = _lse_tile(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, HAS_LENS, MAX2D)
        m = _max_lse(lse2, 1)
        hi = _live_below_last(lse2, N, MAX2D)
    else:
        m = _states_max(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, BLOCK, HAS_LENS, MAX2D)
    m_safe = tl.where(m == _NEG_INF, 0.0, m)
    total = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    if SKIP:
        for g in range(0, tl.cdiv(hi, UNROLL)):
            for i in tl.static_range(UNROLL):
                n = g * UNROLL + i
                live = rmask & (r * 0 + n < hi)
                total, acc = _merge_step(o_ptr, l_ptr, lens_ptr, n, R, r, off, lead, n_lead, live, d, m2, D, m_safe,
                                         total, acc, HAS_LENS, LIBDEVICE, "", EAGER)
        total, acc = _merge_step(o_ptr, l_ptr, lens_ptr, N - 1, R, r, off, lead, n_lead, rmask, d, m2, D, m_safe,
                                 total, acc, HAS_LENS, LIBDEVICE, "", EAGER)
    elif UNROLL > 0:  # groups of UNROLL states, each unrolled so its loads are in flight together (one
        for g in range(0, tl.cdiv(N, UNROLL)):  # group when N <= MAX_UNROLL); past N: lse -inf, skipped
            for i in tl.static_range(UNROLL):
                n = g * UNROLL + i
                live = rmask & (r * 0 + n < N)
                total, acc = _merge_step(o_ptr, l_ptr, lens_ptr, n, R, r, off, lead, n_lead, live, d, m2, D, m_safe,
                                         total, acc, HAS_LENS, LIBDEVICE, "", EAGER)
    else:
        for n in range(N):
            total, acc = _merge_step(o_ptr, l_ptr, lens_ptr, n, R, r, off, lead, n_lead, rmask, d, m2, D, m_safe,
                                     total, acc, HAS_LENS, LIBDEVICE, "", EAGER)
    res = tl.math.div_rn(acc, tl.zeros_like(acc) + total[:, None])
    res = tl.where(total[:, None] == 0.0, 0.0, res)
    tl.store(out_ptr + r[:, None] * D + d[None, :], res.to(out_ptr.dtype.element_ty), mask=m2)
    first = (r * 0 + tl.program_id(1)) == 0                              # lse: the first slice writes it
    tl.store(lse_ptr + off, m + _log(total, c_ptr), mask=rmask & first)


@triton.jit
def _pick(x, k: tl.constexpr, B: tl.constexpr, BD: tl.constexpr, LOG_NP: tl.constexpr):
    """x[:, :, k] of x [B, BD, 2**LOG_NP]: reshapes and splits, no arithmetic (the state axis
    is in-thread, so this is a choice of register)."""
    y = x
    for lvl in tl.static_range(LOG_NP):
        y0, y1 = tl.split(tl.reshape(y, [B, BD, 1 << (LOG_NP - 1 - lvl), 2]))
        y = y1 if (k >> lvl) & 1 else y0
    return tl.reshape(y, [B, BD])


@triton.jit
def _vec_loads(o_ptr, l_ptr, lens_ptr, g, N, R, r, off, lead, n_lead, rmask, d, dmask, ks, D: tl.constexpr,
               NP: tl.constexpr, HAS_LENS: tl.constexpr):
    """Group g's states (NP of them from state g * NP): their lse [BLOCK, NP] and out rows
    [BLOCK, BLOCK_D, NP] (fp32); states past N: lse -inf, out 0."""
    st = g * NP + ks
    live = rmask[:, None] & (st < N)[None, :]                           # past N: lse -inf, skipped
    lse = _state_lse(l_ptr, lens_ptr, st[None, :], R, off[:, None], lead[:, None], n_lead, live, HAS_LENS, "")
    o = tl.load(o_ptr + ((st[None, None, :] * R + r[:, None, None]) * D + d[None, :, None]),
                mask=live[:, None, :] & dmask[None, :, None], other=0.0).to(tl.float32)
    return lse, o


@triton.jit
def _vec_group(lse, o, m_safe, total, acc, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, NP: tl.constexpr,
               LOG_NP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """One group's steps: the weights w = exp(lse - M) side by side, the products w * out in one
    tile op, then the two sums walking the group's states in ascending order."""
    w = _exp(lse - m_safe[:, None], LIBDEVICE)        # [BLOCK, NP], a state per lane
    present = tl.where(lse != _NEG_INF, 1, 0)
    w3 = tl.broadcast_to(w[:, None, :], [BLOCK, BLOCK_D, NP])
    p3 = tl.broadcast_to(present[:, None, :], [BLOCK, BLOCK_D, NP])
    wo = w3 * o
    for k in tl.static_range(NP):
        pk = _pick(p3, k, BLOCK, BLOCK_D, LOG_NP) != 0
        total = tl.where(pk, total + _pick(w3, k, BLOCK, BLOCK_D, LOG_NP), total)
        acc = tl.where(pk, acc + _pick(wo, k, BLOCK, BLOCK_D, LOG_NP), acc)
    return total, acc


@triton.jit
def _merge_vec(o_ptr, l_ptr, lens_ptr, c_ptr, out_ptr, lse_ptr, N, R, S, H, n_lead,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_LENS: tl.constexpr,
               LIBDEVICE: tl.constexpr, NP: tl.constexpr, LOG_NP: tl.constexpr, MAX2D: tl.constexpr,
               PDL: tl.constexpr, EAGER: tl.constexpr = 0):
    """``_merge_fwd``'s formula with the per-state scalar work side by side: NP states at a time,
    their lse loaded in one [BLOCK, NP] load, their weights w = exp(lse - M) computed as one
    [BLOCK, NP] tensor and their out rows in one [BLOCK, BLOCK_D, NP] load; the products
    w * out are formed for all NP at once (one IEEE multiply each, as in the reference) and
    only the two sums walk the states in ascending order, L + w and acc + w * out, each a
    where() on the state being present. L is carried per (row, column) (the same value in
    every column) so that no step reduces across threads. EAGER: the first group's lse and out
    rows are loaded before the max over the states (they do not depend on it), so after the
    wait for the kernel before (PDL) one round trip to memory precedes the sums instead of two
    (the lse for the max, then the group's loads); the same steps in the same order."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rmask = r < R
    h = r % H
    s = (r // H) % S
    lead = r // (H * S)
    off = lead * (H * S) + h * S + s
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    ks = tl.arange(0, NP)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EAGER:
        lse0, o0 = _vec_loads(o_ptr, l_ptr, lens_ptr, 0, N, R, r, off, lead, n_lead, rmask, d, dmask, ks, D, NP,
                              HAS_LENS)
    m = _states_max(l_ptr, lens_ptr, N, R, off, lead, n_lead, rmask, BLOCK, HAS_LENS, MAX2D)
    m_safe = tl.where(m == _NEG_INF, 0.0, m)
    total = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    first = 0
    if EAGER:
        total, acc = _vec_group(lse0, o0, m_safe, total, acc, BLOCK, BLOCK_D, NP, LOG_NP, LIBDEVICE)
        first = 1
    for g in range(first, tl.cdiv(N, NP)):
        lse, o = _vec_loads(o_ptr, l_ptr, lens_ptr, g, N, R, r, off, lead, n_lead, rmask, d, dmask, ks, D, NP,
                            HAS_LENS)
        total, acc = _vec_group(lse, o, m_safe, total, acc, BLOCK, BLOCK_D, NP, LOG_NP, LIBDEVICE)
    res = tl.math.div_rn(acc, total)
    res = tl.where(total == 0.0, 0.0, res)
    m2 = rmask[:, None] & dmask[None, :]
    tl.store(out_ptr + r[:, None] * D + d[None, :], res.to(out_ptr.dtype.element_ty), mask=m2)
    row_total = tl.max(total, axis=1)                                    # every column holds the row's L
    first_slice = (r * 0 + tl.program_id(1)) == 0
    tl.store(lse_ptr + off, m + _log(row_total, c_ptr), mask=rmask & first_slice)


@triton.jit
def _merge_bwd(do_ptr, dl_ptr, o_ptr, l_ptr, out_ptr, lse_ptr, dop_ptr, dlp_ptr, N, R, S, H,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr,
               LIBDEVICE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rmask = r < R
    h = r % H
    s = (r // H) % S
    off = (r // (H * S)) * (H * S) + h * S + s
    d = tl.arange(0, BLOCK_D)
    m2 = rmask[:, None] & (d < D)[None, :]
    dout = tl.load(do_ptr + r[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + r[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
    lse_all = tl.load(lse_ptr + off, mask=rmask, other=_NEG_INF)
    dlse = tl.zeros([BLOCK], tl.float32)
    if HAS_DLSE:
        dlse = tl.load(dl_ptr + off, mask=rmask, other=0.0)
    for n in range(N):
        base = n * R
        lse = tl.load(l_ptr + base + off, mask=rmask, other=_NEG_INF)
        present = (lse != _NEG_INF) & (lse_all != _NEG_INF)
        p = tl.where(present, _exp(tl.where(present, lse - lse_all, 0.0), LIBDEVICE), 0.0)
        o = tl.load(o_ptr + (base + r)[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(dop_ptr + (base + r)[:, None] * D + d[None, :],
                 (p[:, None] * dout).to(dop_ptr.dtype.element_ty), mask=m2)
        dot = tl.sum(dout * (o - out), axis=1) + dlse
        tl.store(dlp_ptr + base + off, tl.where(present, p * dot, 0.0), mask=rmask)


@triton.jit
def _pairs_kernel(table_ptr, lens_ptr, q_ptr, pt_ptr, plen_ptr, klen_ptr, qp_ptr, kc_ptr, vc_ptr, B, width, chunk, ps,
                  PER: tl.constexpr, BLOCK_P: tl.constexpr, QN: tl.constexpr, BLOCK_Q: tl.constexpr,
                  PDL: tl.constexpr, PAGE_ELEMS: tl.constexpr = 0, PAGE_BYTES: tl.constexpr = 0):
    i = tl.program_id(0).to(tl.int64)        # pair c * B + b (chunk-major)
    c = i // B
    b = i % B
    if PDL:
        tl.extra.cuda.gdc_wait()
    n = tl.load(lens_ptr + b).to(tl.int64)
    plen = tl.minimum(tl.maximum(n - c * chunk, 0), chunk)
    tl.store(plen_ptr + i, plen.to(tl.int32))
    tl.store(klen_ptr + i, tl.maximum(plen, 1).to(tl.int32))
    j = tl.arange(0, BLOCK_P)
    col = c * PER + j
    page = tl.load(table_ptr + b * width + col, mask=(j < PER) & (col < width) & ((j * 0 + plen) > 0), other=0)
    tl.store(pt_ptr + i * PER + j, page, mask=j < PER)
    if PAGE_BYTES > 0:  # the pair's K and V pages requested into L2 (lanes past its keys: page 0; the
        used = j * ps < plen  # table's entries there may be anything, never an address)
        at = tl.where(used, page, 0).to(tl.int64) * PAGE_ELEMS
        size = tl.full([BLOCK_P], PAGE_BYTES, tl.int32)
        for cache in tl.static_range(2):
            base = kc_ptr if cache == 0 else vc_ptr
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [base + at, size], dtype=tl.int32, is_pure=False, pack=1)
    for k0 in tl.static_range(0, QN, BLOCK_Q):
        k = k0 + tl.arange(0, BLOCK_Q)
        tl.store(qp_ptr + i * QN + k, tl.load(q_ptr + b * QN + k, mask=k < QN), mask=k < QN)


# ------------------------------------------------------------------ host side
def _rows(out_parts: torch.Tensor) -> tuple[int, int, int, int, int]:
    n, *lead, s, h, d = out_parts.shape
    return n, math.prod(lead) * s * h, s, h, d


def _check_dtype(t: torch.Tensor) -> None:
    if t.dtype == torch.float64:
        raise TypeError("the triton merge_attn_states accumulates in fp32; float64 states run on the cpu "
                        "backend (use_backend(merge_attn_states='cpu'))")


# The state walk unrolled: all N states up to MAX_UNROLL (one compile per N), beyond in groups
# of MAX_UNROLL. Measured on the H200 (results/h200/pair_decode/variants_run1.json): a walked
# merge of 64 states (batch 1 / 32k, C = 512) took ~17 us, one dependent load after another.
MAX_UNROLL = 32
# The 2D max (merge_config) reads every state's lse in one load (up to MAX_2D states; 0
# turns it off). Measured on the H200 (results/h200/canonical.json decode profile,
# merge_2d_max_us): decode merges 3.1 -> 2.4 us at batch 1 / 8k, C=1024 and 6.0 -> 3.9 us
# at 1 / 32k, bitwise equal at every profiled shape; tests/test_canonical_cuda.py checks
# its configurations against the CPU reference. Multi-row programs take it too since session
# 11: training's merges (16-row programs, B=4, S=8k, merge alone on a forward's states,
# results/h200/session11/train_merge.json, bitwise equal) 552.8 -> 478.6 us at C=640, 499.9 ->
# 423.5 at C=768, 361.0 -> 342.2 at C=1024. (With the 2-row programs batch-64 decode took
# before merge_route, it was 0.1-0.3 us slower; those merges now run on _merge_vec.)
MAX_2D = 256
# Programmatic dependent launch for the two Triton launches of canonical:C decode (pair
# layout, merge): each is launched while the kernel before it is still finishing and waits
# in-kernel (griddepcontrol.wait) before its first load, so its launch latency overlaps the
# previous kernel's tail. No bit changes (the same program runs on the same data). On the
# Triton pair route the pair kernel also lets the merge launch once all its programs have
# started (pair_decode ``pdl``, gdc_launch_dependents), so merge programs take the SM slots
# its last wave frees. Off: measured on the H200 bitwise equal but no faster beyond noise
# (decode profile, total_pdl_us; session 11 with the pair kernel's trigger,
# results/h200/session11/variants_pdl_c.json, C = 512..1024: 0.4-0.7 us faster at 1 x 8k,
# noise at batch 8 and 64 x 8k, 2-3 us slower at 64 x 32k); tests/test_canonical_cuda.py
# checks its bits under CUDA-graph capture. Since session 13 the Triton pair route launches its
# merge by PDL anyway while its pair programs are one wave (pair_decode.PDL_ONE_WAVE, the merge
# op's ``pdl``), where every measured cell was faster.
PDL = False
# Eager state loads: each state's out rows are loaded without waiting for its lse (a skipped
# state's rows are read, in bounds, and never selected: same bits). Off: measured on the H200
# (pair_decode/variants_run2.json, canonical:1024 decode merges) 8 x 32k 9.6 -> 7.2 us but
# 1 x 32k 4.4 -> 5.5, elsewhere no change (those numbers are the walk kernel's). In _merge_vec
# (session 20, not yet timed) eager means the first group's lse and out rows loaded before the
# max over the states: offline sm90 (Triton 3.6, a batch-1 decode merge, 1 row, 32 columns, 32
# states) every load of the first group then issues right after the PDL wait, where without it
# the out rows wait for the max's lse (two round trips to memory after the pair kernel, not one).
EAGER_LOADS = False
# _merge_vec's default for eager (a config without config[4]: merge_route's decode merges), kept
# apart from the walk's EAGER_LOADS (measured off above). On since session 21: measured on the
# H200 at 2ece7f0 (results/h200/session21/d_*.log, page 16, C = 768, one run per setting, op us
# routed -> eager, FlashInfer auto in the same run): 1 x 8k 13.91 -> 13.16 (1.150x -> 1.086x FI),
# 1 x 32k 30.13 -> 30.15, 8 x 8k 42.55 -> 41.81, 8 x 32k 134.42 -> 133.19, 64 x 8k 249.49 ->
# 249.6, 64 x 32k 971.8 -> 968.5; its bits equal the plain merge's (merge_vec eager CUDA tests).
VEC_EAGER = True


# States side by side in _merge_vec (a group's weights one exp per lane, its products w * out
# one tile op; only the two sums walk the states) on 1-row, 1-warp programs over a quarter of
# head_dim (merge_config gives those while rows < SMs: decode up to batch 8); other blockings
# and VEC_STATES = 0: the walk kernel _merge_fwd. 32 (a warp's lanes): offline sm90 (Triton
# 3.6) ~390 instructions per 32 states against ~2,250 for the unrolled walk (with 8 or 16 the
# compiler recomputed every weight in every lane). Measured on the H200, bitwise equal to the
# walk (results/h200/pair_decode/variants_run5_vec_slices.json, page 16, merge alone, us, walk
# -> vec): C=512 1 x 8k 5.93 -> 2.88, 1 x 32k 6.7 -> 3.58, 8 x 8k 7.0 -> 3.49, 8 x 32k 17.75 ->
# 4.42; C=1024 1 x 8k 3.89 -> 3.24, 1 x 32k 5.55 -> 3.31, 8 x 8k 3.66 -> 3.62, 8 x 32k 10.0
# -> 3.62. At batch 64 (2-row walk programs) the vec blocking was slower (C=1024 6.34 against
# 5.13), so batch 64 keeps the walk.
VEC_STATES = 32
# Past one program per SM (decode batches beyond ~8 on the H200) up to VEC_ROWS_MAX rows,
# _merge_vec on 1-row, 1-warp programs over all of head_dim (merge_route) instead of the walk's
# multi-row programs. Measured on the H200 (results/h200/session10/variants_partial.log, page
# 16, batch 64 / 8k, merge alone, walk -> vec over all of head_dim, bitwise equal): C=512
# 7.53 -> 5.09 us, C=1024 4.81 -> 4.25 (over a quarter of head_dim, as for fewer rows: 7.73
# and 6.22). Training's merges (far more rows) keep the walk.
VEC_ROWS_MAX = 4096


def _max2d(n: int) -> int:
    """The 2D max's width for n states (MAX_2D): their count rounded up to a power of two, or 0
    (the looped max) past MAX_2D or when MAX_2D is 0."""
    return C.pow2(n) if MAX_2D and n <= MAX_2D else 0


# Past VEC_ROWS_MAX rows (training's merges), the walk leaves out the states no row of a
# program holds (merge_attn_states config[5], _merge_fwd SKIP), SKIP_UNROLL states a group: a row
# of training's chunk i holds states 0..i-1 and the last, so about half of the walk was over
# states every row skips. Measured on the H200 (results/h200/session12/train_merge.json, B=4,
# S=8k, merge alone on a forward's state buffers, 16-row programs, 2D max, bitwise equal): C=640
# 479.2 -> 388.6 us, C=768 423.6 -> 348.3, C=1024 343.7 -> 301.2 (groups of 4: 429.6 / 391.9 /
# 337.1; of all N: slower than no skipping). tests/test_canonical_cuda.py checks its bits. Not
# measured: a merge that large whose rows hold every state (decode past 256 sequences at 16
# query heads), which walks SKIP_UNROLL states at a time instead of all N at once. 0 turns it off.
SKIP_UNROLL = 1   # one state at a time since session 17, with SKIP_BLOCK rows (below)
# Rows per program of that skipping walk (while the grid keeps two programs per SM), since session
# 17: measured on the H200 (results/h200/session17/train_merge.json, C = 768, the same buffers,
# CUDA-graph medians, every blocking torch.equal to the routed one) 16 rows 347.2 us (2.65 TB/s of
# the bytes it must move), 32 rows 301.6 (3.05 TB/s); 8 rows 460.2, 64 rows on 8 warps 359.4,
# 32 rows on 8 warps 339.1, groups of 4 390.7, eager loads 345.6 / 341.1 (16 / 32 rows), rows by
# position (one head's consecutive positions a program, contiguous lse; removed after this run, code
# at a14e176) 385.0 / 367.9, 16 rows on 2 warps 345.2 (318.1 with eager loads).
# A second run at 5e49797 (train_merge_more.json), 32 rows: states one at a time (SKIP_UNROLL = 1)
# 285.2 us against 300.7 in groups of 2 and 344.1 in groups of 3; 2 warps 312.3, 64 rows 319.2.
SKIP_BLOCK = 32


def merge_route(rows: int, n: int, d: int, device) -> tuple[tuple, int]:
    """(config, states side by side or 0 for the walk) of a merge with no explicit config:
    merge_config's blocking, on _merge_vec where vec_states allows (fewer rows than SMs); else,
    up to VEC_ROWS_MAX rows and head_dim 128, _merge_vec on 1-row programs over all of head_dim
    (the blocking measured); else the walk, past VEC_ROWS_MAX rows skipping the states no row of
    a program holds (SKIP_UNROLL, SKIP_BLOCK rows a program; with the 2D max).
    No choice changes a bit (see merge_config)."""
    cfg = merge_config(rows, n, d, device)
    vec = vec_states(cfg[0], C.pow2(d) // cfg[1])
    if vec:
        return cfg, vec
    if VEC_STATES and rows <= VEC_ROWS_MAX and C.pow2(d) <= 128:
        return (1, 1, 0, _max2d(n)), VEC_STATES
    if SKIP_UNROLL and rows > VEC_ROWS_MAX and cfg[3]:
        sms = C.num_sms(0 if device.index is None else device.index) if device.type == "cuda" else 4
        block = SKIP_BLOCK if triton.cdiv(rows, SKIP_BLOCK) >= 2 * sms else cfg[0]
        return (block, cfg[1], min(SKIP_UNROLL, n), cfg[3], EAGER_LOADS, 1), 0
    return cfg, 0


def _pdl(on: bool | None = None) -> dict:
    """Launch arguments for programmatic dependent launch: ``on``, or the PDL switch when None
    (never on the interpreter)."""
    return {"launch_pdl": True} if (PDL if on is None else on) and not C.INTERPRET else {}


def merge_config(rows: int, n: int, d: int, device) -> tuple[int, int, int, int]:
    """(BLOCK rows per program, head_dim slices, states per unrolled group (0: a loop), 2D max
    width or 0). None of it changes a bit: nothing reduces across rows or over head_dim, the
    states are walked in the same order either way, and a max is exact in any order. Few rows
    (decode: B*Hq of them) get 1-row programs and head_dim split in 4, so a batch-1 merge
    runs on 64 SMs instead of one; an unrolled walk lets the loads of N states (up to
    MAX_UNROLL at a time) be in flight together instead of one after another; the 2D max (up
    to MAX_2D states; off when MAX_2D is 0) reads every state's lse in one load instead of a
    chain of N."""
    sms = C.num_sms(0 if device.index is None else device.index) if device.type == "cuda" else 4
    block = BLOCK_R
    while block > 1 and triton.cdiv(rows, block) < 2 * sms:
        block //= 2
    split = 4 if triton.cdiv(rows, block) < sms and d % 4 == 0 and C.pow2(d) == d else 1
    return block, split, min(n, MAX_UNROLL), _max2d(n)


def vec_config(n: int, d: int) -> tuple[int, int, int, int]:
    """``_merge_vec``'s blocking: 1-row, 1-warp programs over a quarter of head_dim (the layout
    in which Triton 3.6 keeps the weights one state per lane: offline sm90 compiles, one exp per
    lane; with more rows or warps per program it recomputes every weight in every thread) and
    the 2D max up to MAX_2D states."""
    return 1, 4 if d % 4 == 0 and C.pow2(d) == d else 1, 0, _max2d(n)


def vec_states(block: int, block_d: int) -> int:
    """States side by side in ``_merge_vec`` (0: the walk kernel ``_merge_fwd``): VEC_STATES on
    1-row programs of one warp (see vec_config), else the walk."""
    return VEC_STATES if block == 1 and block_d <= 32 else 0


def merge_attn_states(out_parts, lse_parts, state_lens=None, config=None, vec=None, pdl=None):
    """``config``: (BLOCK, head_dim slices, unroll[, 2D max width[, eager loads[, skip[, warps]]]])
    instead of ``merge_route``'s (benchmarks, tests); skip: the walk leaves out the states no row
    of a program holds (``_merge_fwd`` SKIP; merge_route takes it past VEC_ROWS_MAX rows); warps:
    num_warps of the walk (0: the default; no reduction runs over head_dim or rows, so no bit
    depends on it). ``vec``:
    states side by side in ``_merge_vec`` (a power of two; 0: the walk, ``_merge_fwd``) instead
    of ``vec_states``'s; ``_merge_vec`` takes BLOCK, slices, the 2D max width and eager (its
    EAGER: the first group's loads before the max) from ``config`` (not unroll/skip); without
    config[4], eager is VEC_EAGER on ``_merge_vec`` and EAGER_LOADS on the walk. ``pdl``: launched by programmatic dependent launch (waiting
    in-kernel for the kernel before it) or not, instead of the PDL switch (decode_launch's choice
    on the Triton pair route; same bits either way)."""
    _check_dtype(out_parts)
    n, rows, s, h, d = _rows(out_parts)
    out = torch.empty(out_parts.shape[1:], dtype=out_parts.dtype, device=out_parts.device)
    lse = torch.empty(lse_parts.shape[1:], dtype=lse_parts.dtype, device=lse_parts.device)
    if rows == 0:
        return out, lse
    n_lead = rows // (s * h)
    assert n * rows < 2**31, "state row index n * rows must fit int32"  # element offsets are int64
    if state_lens is not None:
        state_lens = C.aligned(state_lens.reshape(n, n_lead))
    if config is None and vec is None:
        config, vec = merge_route(rows, n, d, out_parts.device)
    block, split, unroll, *rest = config or merge_config(rows, n, d, out_parts.device)
    max2d = rest[0] if rest else 0
    # an explicit config (tests, benchmarks) is checked as merge_config's are made: a 2D max narrower
    # than N read only the first states (NaN out beside a +inf lse), a split past head_dim's width
    # made an empty slice (a session 35 audit)
    if max2d and (max2d != C.pow2(max2d) or max2d < n):
        raise ValueError(f"merge_attn_states config: the 2D max width config[3] must be 0 or a power of two "
                         f">= the state count {n}, got {max2d}")
    if split < 1 or split != C.pow2(split) or C.pow2(d) % split or C.pow2(d) // split < 1:
        raise ValueError(f"merge_attn_states config: the head_dim split config[1] must be a power of two "
                         f"dividing {C.pow2(d)} (head_dim {d} rounded up), got {split}")
    skip = rest[2] if len(rest) > 2 else 0
    warps = rest[3] if len(rest) > 3 else 0
    block_d = C.pow2(d) // split
    launch = _pdl(pdl)
    vec = vec_states(block, block_d) if vec is None else vec
    eager = rest[1] if len(rest) > 1 else (VEC_EAGER if vec else EAGER_LOADS)
    if vec:
        if vec != C.pow2(vec):
            raise ValueError(f"merge_attn_states vec must be a power of two (states side by side), got {vec}")
        _merge_vec[(triton.cdiv(rows, block), split)](
            C.aligned(out_parts), C.aligned(lse_parts), state_lens if state_lens is not None else lse_parts,
            _log_constants(out_parts.device), out, lse, n, rows, s, h, n_lead,
            D=d, BLOCK_D=block_d, BLOCK=block, HAS_LENS=state_lens is not None, LIBDEVICE=not C.INTERPRET,
            NP=vec, LOG_NP=vec.bit_length() - 1, MAX2D=max2d, PDL=bool(launch), **({"EAGER": 1} if eager else {}),
            num_warps=NUM_WARPS if block * block_d >= 512 else 1, **C.LAUNCH, **launch)
        return out, lse
    if skip and not (max2d and unroll):
        raise ValueError(f"merge_attn_states config: skipping absent states needs the 2D max and an unrolled walk "
                         f"(config[3] > 0 and config[2] > 0), got {config}")
    _merge_fwd[(triton.cdiv(rows, block), split)](
        C.aligned(out_parts), C.aligned(lse_parts), state_lens if state_lens is not None else lse_parts,
        _log_constants(out_parts.device), out, lse, n, rows, s, h, n_lead,
        D=d, BLOCK_D=block_d, BLOCK=block, HAS_LENS=state_lens is not None, LIBDEVICE=not C.INTERPRET,
        UNROLL=unroll, MAX2D=max2d, PDL=bool(launch), EAGER=int(eager), **({"SKIP": 1} if skip else {}),
        num_warps=warps or (NUM_WARPS if block * block_d >= 512 else 1), **C.LAUNCH, **launch)
    return out, lse


merge_attn_states.accepts_state_lens = True
merge_attn_states.accepts_pdl = True


def merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse):
    _check_dtype(out_parts)
    n, rows, s, h, d = _rows(out_parts)
    assert n * rows < 2**31, "state row index n * rows must fit int32"
    d_out_parts = torch.empty_like(out_parts, memory_format=torch.contiguous_format)
    d_lse_parts = torch.empty_like(lse_parts, memory_format=torch.contiguous_format)
    if rows == 0:
        return d_out_parts, d_lse_parts
    _merge_bwd[(triton.cdiv(rows, BLOCK_R),)](
        C.aligned(dout), C.aligned(dlse) if dlse is not None else lse, C.aligned(out_parts), C.aligned(lse_parts),
        C.aligned(out), C.aligned(lse), d_out_parts, d_lse_parts, n, rows, s, h,
        D=d, BLOCK_D=C.pow2(d), BLOCK=BLOCK_R, HAS_DLSE=dlse is not None, LIBDEVICE=not C.INTERPRET,
        num_warps=NUM_WARPS, **C.LAUNCH)
    return d_out_parts, d_lse_parts


def prefetchable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``decode_pairs(prefetch=(k_cache, v_cache))`` applies: contiguous caches, 16-byte aligned,
    same shape, pages of a 16-byte multiple (the bulk prefetch's unit)."""
    return (k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0
            and (k_cache[0].numel() * k_cache.element_size()) % 16 == 0)


def decode_pairs(q, page_table, seq_lens, page_size: int, chunk_size: int, prefetch=None):
    """canonical:C decode layout in one launch: ``(q_pairs [N*B, 1, H, D], pair_table
    [N*B, P] int32, pair_lens [N*B] int32, kernel_lens [N*B] int32, N)`` (P from
    ``cpu.canonical.pair_columns``: C/page_size, at most the table's width).
    ``pair_table``/``pair_lens``/``N`` equal ``kernels/cpu/canonical.decode_pairs``;
    ``kernel_lens = max(pair_lens, 1)`` is what the attention kernel is given (an empty
    pair then reads one key of page 0 and the merge skips it through ``pair_lens``).
    ``prefetch=(k_cache, v_cache)``: every page of every pair is also requested into L2
    (``cp.async.bulk.prefetch.L2``, pages of 16-byte multiples), so the attention call after
    this launch reads it from L2; a hint, no value changes (not on the interpreter). Measured
    slower on the H200 (the FA4 route's op at 1 x 8k, C = 1024: 19.4 -> 39.0 us, and every
    other cell: pair_decode/variants_run2.json), so the route does not use it."""
    if chunk_size % page_size:
        raise ValueError(f"decode_pairs needs chunk_size % page_size == 0, got {chunk_size} % {page_size}")
    bsz, width = page_table.shape
    per = pair_columns(width, page_size, chunk_size)
    n = pair_count(width, page_size, chunk_size)
    dev = q.device
    q_pairs = torch.empty((n * bsz, *q.shape[1:]), dtype=q.dtype, device=dev)
    pair_table = torch.empty((n * bsz, per), dtype=torch.int32, device=dev)
    pair_lens = torch.empty(n * bsz, dtype=torch.int32, device=dev)
    kernel_lens = torch.empty(n * bsz, dtype=torch.int32, device=dev)
    if bsz:
        qn = q[0].numel()
        launch = _pdl()
        pf = {}
        kc, vc = prefetch if prefetch is not None else (q, q)
        if prefetch is not None:
            page_bytes = kc[0].numel() * kc.element_size()
            if not prefetchable(kc, vc):
                raise ValueError(f"decode_pairs prefetch needs two contiguous 16-byte aligned caches of one shape "
                                 f"with pages of a 16-byte multiple, got shapes {tuple(kc.shape)} / "
                                 f"{tuple(vc.shape)}, {page_bytes} bytes per page, strides {kc.stride()} / "
                                 f"{vc.stride()}, base offsets mod 16 {kc.data_ptr() % 16} / {vc.data_ptr() % 16}")
            if not C.INTERPRET:  # the interpreter has no inline asm
                pf = {"PAGE_ELEMS": kc[0].numel(), "PAGE_BYTES": page_bytes}
        _pairs_kernel[(n * bsz,)](
            C.aligned(page_table), C.aligned(seq_lens), C.aligned(q), pair_table, pair_lens, kernel_lens, q_pairs,
            kc, vc, bsz, width, chunk_size, page_size, PER=per, BLOCK_P=C.pow2(per), QN=qn,
            BLOCK_Q=min(C.pow2(qn), 4096), PDL=bool(launch), **pf, num_warps=NUM_WARPS, **C.LAUNCH, **launch)
    return q_pairs, pair_table, pair_lens, kernel_lens, n
