"""Triton qk_rmsnorm, rope and the fused qk_norm_rope (forward), plus the norm backward.

One kernel body serves all three forward ops: ``_heads`` normalizes and/or rotates
every head of a block of TOK tokens, one head at a time. What makes the fused op
bitwise equal to ``qk_rmsnorm`` then ``rope``:

* the norm of a row is ``w * (x32 * rstd).to(dtype)`` rounded to dtype: elementwise
  given the row's ``rstd``. Rope needs each element's rotate-half partner; the fused
  kernel loads the partner's x and recomputes its normalized value with the same
  ``rstd`` and the same operations, so it gets the bits the norm kernel stored;
* the row reduction (sum of squares) is a ``tl.sum`` over a ``[TOK, BLOCK_D]`` tile in
  every kernel; its order depends on BLOCK_D, the vector width and num_warps, all
  fixed per (head_dim, dtype), never on the number of tokens (batch invariance);
* no FMA contraction (``_common.LAUNCH``), so each step is one IEEE operation.

RoPE angles follow the CPU reference: ``fp32(position) * inv_freq`` in fp32 (fp64 for
fp64), then sin/cos evaluated in fp64 (libdevice) and rounded once, so cos/sin agree with
the reference's fp64 polynomial except in rounding ties (none seen on 8M values, H200). For fp64
inputs nothing rounds them further, so where the reference's polynomial is not correctly rounded
(27 of 128 angles in a session 35 check) fp64 rope differs from the CPU by an ulp.
Evaluated per token inside the kernel this held rope to 1.4 TB/s, so positions below
TABLE_LEN read cos/sin from a table built once by the same code (same bits).

Backward of the norm: ``dx`` per row; ``dweight`` sums over every (token, head) row in a
fixed order without atomics: each program sums its TOK_BWD tokens (heads ascending),
then ``reduce.sum_partials`` adds the per-program partials in ascending order.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from rlk_ops.kernels.cpu.rope import inv_freq as cpu_inv_freq
from rlk_ops.kernels.triton import _common as C
from rlk_ops.kernels.triton.reduce import sum_partials

TOK = 16        # tokens per program (forward)
TOK_BWD = 32    # tokens per program (norm backward); one dweight partial per program
NUM_WARPS = 4   # fixed: the row reduction's order depends on it
# RoPE cos/sin for positions below TABLE_LEN come from a cached table (fp32: 32 MiB per
# (theta, rotary_dim) at rotary_dim 128); Qwen3's native context (40960) fits. A program
# with any position at or beyond it computes cos/sin itself, with the same code and bits.
TABLE_LEN = 65536


@triton.jit
def _rstd(xa, eps, D: tl.constexpr, ACC: tl.constexpr):
    ssq = tl.sum(xa * xa, axis=1)
    if ACC == tl.float64:
        return 1.0 / tl.sqrt(ssq / D + eps)  # fp64 division and sqrt are IEEE
    else:
        var = tl.math.div_rn(ssq, tl.full(ssq.shape, D, tl.float32))
        return tl.math.div_rn(tl.full(ssq.shape, 1.0, tl.float32), tl.math.sqrt_rn(var + eps))


@triton.jit
def _normalized(xa, rstd, w, OUT: tl.constexpr, ACC: tl.constexpr):
    """Qwen3 order: (x32 * rstd) rounded to dtype, times weight, rounded to dtype."""
    xhat = (xa * rstd[:, None]).to(OUT)
    return (w.to(ACC)[None, :] * xhat.to(ACC)).to(OUT)


@triton.jit
def _compute_cos_sin(pos, inv_ptr, cols, R: tl.constexpr, HALF: tl.constexpr, ACC: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    """cos, sin [TOK, BLOCK_D] for column j (frequency j mod HALF), in ACC."""
    freq = tl.where(cols < HALF, cols, cols - HALF)
    inv = tl.load(inv_ptr + freq, mask=cols < R, other=0.0)
    angle = pos.to(ACC)[:, None] * inv.to(ACC)[None, :]
    a64 = angle.to(tl.float64)
    if LIBDEVICE:
        c = libdevice.cos(a64)
        s = libdevice.sin(a64)
    else:  # TRITON_INTERPRET: numpy's float64 sin/cos
        c = tl.cos(a64)
        s = tl.sin(a64)
    return c.to(ACC), s.to(ACC)


@triton.jit
def _cos_sin(pos_ptr, tab_ptr, inv_ptr, tok, tmask, cols, TABLE: tl.constexpr, R: tl.constexpr,
             HALF: tl.constexpr, ACC: tl.constexpr, LIBDEVICE: tl.constexpr):
    """cos, sin of the program's tokens: read from the table when every position is in it,
    else computed (the table holds exactly what ``_compute_cos_sin`` gives)."""
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0)
    if tl.max(pos, axis=0) < TABLE:
        freq = tl.where(cols < HALF, cols, cols - HALF)
        m = tmask[:, None] & (cols < R)[None, :]
        row = pos[:, None] * R + freq[None, :]
        c = tl.load(tab_ptr + row, mask=m, other=0.0)
        s = tl.load(tab_ptr + row + HALF, mask=m, other=0.0)
    else:
        c, s = _compute_cos_sin(pos, inv_ptr, cols, R, HALF, ACC, LIBDEVICE)
    return c, s


@triton.jit
def _table_kernel(tab_ptr, inv_ptr, n_pos, R: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                  TOK_: tl.constexpr, ACC: tl.constexpr, LIBDEVICE: tl.constexpr):
    """table[p, j] = cos(p * inv_freq[j]) for j < HALF, sin(p * inv_freq[j - HALF]) for HALF <= j < R."""
    pos = tl.program_id(0).to(tl.int64) * TOK_ + tl.arange(0, TOK_)
    cols = tl.arange(0, BLOCK_D)
    c, s = _compute_cos_sin(pos, inv_ptr, cols, R, HALF, ACC, LIBDEVICE)
    tl.store(tab_ptr + pos[:, None] * R + cols[None, :], tl.where((cols < HALF)[None, :], c, s),
             mask=(pos < n_pos)[:, None] & (cols < R)[None, :])


@triton.jit
def _heads(x_ptr, y_ptr, w_ptr, eps_ptr, tok, tmask, cols, c, s,
           H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
           NORM: tl.constexpr, ROPE: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr):
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    cmask = cols < D
    mask = tmask[:, None] & cmask[None, :]
    pcols = tl.where(cols < HALF, cols + HALF, tl.where(cols < R, cols - HALF, cols))
    first = (cols < HALF)[None, :]
    if NORM:
        eps = tl.load(eps_ptr)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
        wp = tl.load(w_ptr + pcols, mask=cmask, other=0.0)
    for h in range(H):  # a loop, not tl.static_range: unrolled, the kernels took 10-40x longer to compile
        row = (tok * H + h) * D
        ptrs = row[:, None] + cols[None, :]
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0)
        if NORM:
            xa = x.to(ACC)
            rstd = _rstd(xa, eps, D, ACC)
            y = _normalized(xa, rstd, w, OUT, ACC)
        else:
            y = x
        if ROPE:
            xp = tl.load(x_ptr + row[:, None] + pcols[None, :], mask=mask, other=0.0)
            if NORM:
                yp = _normalized(xp.to(ACC), rstd, wp, OUT, ACC)
            else:
                yp = xp
            ypa = yp.to(ACC)
            if SIGN > 0:   # forward: [x1*cos - x2*sin, x2*cos + x1*sin]
                ypa = tl.where(first, -ypa, ypa)
            else:          # backward (inverse rotation): [x1*cos + x2*sin, x2*cos - x1*sin]
                ypa = tl.where(first, ypa, -ypa)
            rot = (y.to(ACC) * c + ypa * s).to(OUT)
            y = tl.where((cols < R)[None, :], rot, y)
        tl.store(y_ptr + ptrs, y, mask=mask)


@triton.jit(do_not_specialize=["n_tok"])
def _one_kernel(x_ptr, y_ptr, w_ptr, eps_ptr, pos_ptr, tab_ptr, inv_ptr, n_tok,
                H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, TABLE: tl.constexpr,
                BLOCK_D: tl.constexpr, TOK_: tl.constexpr,
                NORM: tl.constexpr, ROPE: tl.constexpr, SIGN: tl.constexpr,
                ACC: tl.constexpr, LIBDEVICE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * TOK_ + tl.arange(0, TOK_)
    tmask = tok < n_tok
    cols = tl.arange(0, BLOCK_D)
    if ROPE:
        c, s = _cos_sin(pos_ptr, tab_ptr, inv_ptr, tok, tmask, cols, TABLE, R, HALF, ACC, LIBDEVICE)
    else:
        c = 0.0
        s = 0.0
    _heads(x_ptr, y_ptr, w_ptr, eps_ptr, tok, tmask, cols, c, s, H, D, R, HALF, NORM, ROPE, SIGN, ACC)


@triton.jit(do_not_specialize=["n_tok"])
def _pair_kernel(q_ptr, qo_ptr, qw_ptr, k_ptr, ko_ptr, kw_ptr, eps_ptr, pos_ptr, tab_ptr, inv_ptr, n_tok,
                 HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
                 TABLE: tl.constexpr,
                 BLOCK_D: tl.constexpr, TOK_: tl.constexpr, ACC: tl.constexpr, LIBDEVICE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * TOK_ + tl.arange(0, TOK_)
    tmask = tok < n_tok
    cols = tl.arange(0, BLOCK_D)
    c, s = _cos_sin(pos_ptr, tab_ptr, inv_ptr, tok, tmask, cols, TABLE, R, HALF, ACC, LIBDEVICE)
    _heads(q_ptr, qo_ptr, qw_ptr, eps_ptr, tok, tmask, cols, c, s, HQ, D, R, HALF, True, True, 1, ACC)
    _heads(k_ptr, ko_ptr, kw_ptr, eps_ptr, tok, tmask, cols, c, s, HK, D, R, HALF, True, True, 1, ACC)


@triton.jit(do_not_specialize=["n_tok"])
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, eps_ptr, dx_ptr, part_ptr, n_tok,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, TOK_: tl.constexpr,
                     ACC: tl.constexpr):
    pid = tl.program_id(0)
    tok = pid.to(tl.int64) * TOK_ + tl.arange(0, TOK_)
    tmask = tok < n_tok
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = tmask[:, None] & cmask[None, :]
    OUT: tl.constexpr = dx_ptr.dtype.element_ty
    eps = tl.load(eps_ptr)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK_D], ACC)
    for h in range(H):
        ptrs = ((tok * H + h) * D)[:, None] + cols[None, :]
        xa = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + ptrs, mask=mask, other=0.0).to(ACC)
        rstd = _rstd(xa, eps, D, ACC)
        xhat = xa * rstd[:, None]
        # rows past the last token add nothing: with eps 0 (refused by the ops, not here) their
        # xhat is 0 * inf = NaN, and 0 * NaN would reach dweight
        dw += tl.sum(tl.where(mask, dy * xhat.to(OUT).to(ACC), 0.0), axis=0)
        g = dy * w[None, :]
        if ACC == tl.float64:
            proj = tl.sum(g * xhat, axis=1) / D
        else:
            proj = tl.math.div_rn(tl.sum(g * xhat, axis=1), tl.full([TOK_], D, tl.float32))
        dx = rstd[:, None] * (g - xhat * proj[:, None])
        tl.store(dx_ptr + ptrs, dx.to(OUT), mask=mask)
    tl.store(part_ptr + pid.to(tl.int64) * D + cols, dw, mask=cmask)


# ---------------------------------------------------------------------- launchers
def _layout(x: torch.Tensor, rope: bool) -> tuple[int, int, int]:
    """(tokens, heads, head_dim) of x viewed as [T, H, D]. H is a compile-time constant:
    rope needs the token of each row (H = x.shape[-2]); the norm alone uses the same
    split for [..., H, D] inputs (so it runs the fused kernel's code) and treats a 1-D or
    2-D input as rows (H = 1), so a batch dimension never becomes a constant."""
    d = x.shape[-1]
    h = x.shape[-2] if (x.dim() >= 3 or (rope and x.dim() >= 2)) else 1
    t = x.numel() // max(1, h * d)
    return t, h, d


def _consts(x, eps, positions, theta, rotary_dim, norm, rope):
    acc = C.acc_dtype(x.dtype)
    dev = x.device
    eps_t = C.scalar(float(eps), acc, dev) if norm else x  # dummy pointer when unused
    if rope:
        pos = C.aligned(positions.reshape(-1))
        inv = _inv_freq(float(theta), int(rotary_dim), dev)
        tab = _table(float(theta), int(rotary_dim), acc, dev)
    else:
        pos, inv, tab = x, x, x
    return eps_t, pos, tab, inv


_INV_CACHE: dict = {}
_TABLES: dict = {}


def _table(theta: float, rotary_dim: int, acc: torch.dtype, device: torch.device) -> torch.Tensor:
    """cos/sin of positions [0, TABLE_LEN) for (theta, rotary_dim), built once per device by
    ``_table_kernel`` with the kernels' own code (so a table hit and an in-kernel computation
    give the same bits). Measured: computing fp64 sin/cos in the rope kernel itself held it to
    ~1.4 TB/s (190 us for 32k tokens x 16 heads); the table costs 2*HALF*4 bytes per token."""
    key = (theta, rotary_dim, acc, str(device))
    tab = _TABLES.get(key)
    if tab is None:
        tab = torch.empty((TABLE_LEN, rotary_dim), dtype=acc, device=device)
        _table_kernel[(triton.cdiv(TABLE_LEN, TOK),)](
            tab, _inv_freq(theta, rotary_dim, device), TABLE_LEN, R=rotary_dim, HALF=rotary_dim // 2,
            BLOCK_D=C.pow2(rotary_dim), TOK_=TOK, ACC=C.tl_acc(acc), LIBDEVICE=not C.INTERPRET,
            num_warps=NUM_WARPS, **C.LAUNCH)
        _TABLES[key] = tab
    return tab


def _inv_freq(theta: float, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """The CPU reference's fp32 inv_freq, copied to the device once per (theta, dim)."""
    key = (theta, rotary_dim, str(device))
    t = _INV_CACHE.get(key)
    if t is None:
        t = cpu_inv_freq(theta, rotary_dim).to(device)
        _INV_CACHE[key] = t
    return t


def _run_one(x, w, eps, positions, theta, rotary_dim, norm, rope, sign):
    x = C.aligned(x)
    y = torch.empty_like(x)
    t, h, d = _layout(x, rope)
    if x.numel() == 0:
        return y
    rd = int(rotary_dim) if rope else d
    eps_t, pos, tab, inv = _consts(x, eps, positions, theta, rd, norm, rope)
    wt = C.aligned(w) if norm else x
    _one_kernel[(triton.cdiv(t, TOK),)](
        x, y, wt, eps_t, pos, tab, inv, t, H=h, D=d, R=rd, HALF=rd // 2, TABLE=TABLE_LEN,
        BLOCK_D=C.pow2(d), TOK_=TOK,
        NORM=norm, ROPE=rope, SIGN=sign, ACC=C.tl_acc(x.dtype), LIBDEVICE=not C.INTERPRET,
        num_warps=NUM_WARPS, **C.LAUNCH)
    return y


def qk_rmsnorm(x, weight, eps):
    return _run_one(x, weight, eps, None, None, None, norm=True, rope=False, sign=1)


def rope(x, positions, theta, rotary_dim):
    return _run_one(x, None, None, positions, theta, rotary_dim, norm=False, rope=True, sign=1)


def rope_bwd(dy, positions, theta, rotary_dim):
    return _run_one(dy, None, None, positions, theta, rotary_dim, norm=False, rope=True, sign=-1)


def qk_norm_rope(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    """Both heads of one token in one program: cos/sin computed once for q and k."""
    q, k = C.aligned(q), C.aligned(k)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    _, hq, d = _layout(q, rope=True)
    _, hk, _ = _layout(k, rope=True)
    # tokens from the leading shape (q and k share it): from q's numel, q with 0 heads gave 0 tokens, no
    # launch, and k's output uninitialised (session 32 audit)
    t = math.prod(q.shape[:-2])
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    eps_t, pos, tab, inv = _consts(q, eps, positions, theta, rotary_dim, True, True)
    _pair_kernel[(triton.cdiv(t, TOK),)](
        q, qo, C.aligned(q_weight), k, ko, C.aligned(k_weight), eps_t, pos, tab, inv, t,
        HQ=hq, HK=hk, D=d, R=int(rotary_dim), HALF=int(rotary_dim) // 2, TABLE=TABLE_LEN,
        BLOCK_D=C.pow2(d), TOK_=TOK,
        ACC=C.tl_acc(q.dtype), LIBDEVICE=not C.INTERPRET, num_warps=NUM_WARPS, **C.LAUNCH)
    return qo, ko


def qk_rmsnorm_bwd(dy, x, weight, eps):
    x, dy = C.aligned(x), C.aligned(dy)
    dx = torch.empty_like(x)
    t, h, d = _layout(x, rope=False)
    acc = C.acc_dtype(x.dtype)
    n_prog = math.ceil(t / TOK_BWD)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    partials = torch.empty((n_prog, d), dtype=acc, device=x.device)
    _norm_bwd_kernel[(n_prog,)](
        dy, x, C.aligned(weight), C.scalar(float(eps), acc, x.device), dx, partials, t,
        H=h, D=d, BLOCK_D=C.pow2(d), TOK_=TOK_BWD, ACC=C.tl_acc(x.dtype), num_warps=NUM_WARPS, **C.LAUNCH)
    return dx, sum_partials(partials, weight.dtype)
