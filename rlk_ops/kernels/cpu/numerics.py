"""Fixed-order arithmetic for the CPU reference kernels.

Every reduction and transcendental function the CPU kernels use goes through this
module, so that "a row's bits never depend on the batch" has one place to be true.

Why not plain ``torch.exp`` / ``torch.matmul``:

* BLAS (``matmul``) picks its kernel and K-blocking from the matrix shape, so row 0
  of an M=1 product can differ from row 0 of an M=4096 product.
* ATen's elementwise loops run a vectorised body and a scalar tail. For the
  transcendental functions the two use different implementations (SLEEF vs libm);
  on this project's CI CPU ``torch.exp2`` differs between them for ~6% of inputs.
  An element's path depends on where it sits in the tensor, i.e. on the batch.

What *is* position-independent: single IEEE operations (+, -, *, /, sqrt, floor,
round, min/max, bit manipulation) give the same bits on every path. So:

* ``rowsum`` reduces over the contiguous last dim with ``Tensor.sum``. ATen reduces
  each output element serially, in an order fixed by the reduction length and the
  CPU's vector width; parallelism splits across output elements, never inside one
  (except its two-pass mode for a single output of >= 32768 inputs, which
  ``rowsum`` avoids). So every dot product in the reference backend has an order
  that depends on ``D`` (or the key-block length) alone.
* ``exp``, ``log``, ``sincos`` are polynomial evaluations built from single IEEE
  operations (Cody-Waite range reduction, Horner), accurate to ~1-2 ulp (float64 ``log``: up
  to ~3 ulp near 1, 2.85 measured in a session 35 audit; fp32 results are rounded once more).
"""
from __future__ import annotations

import math

import torch

def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the reference kernels: fp64 for fp64 inputs (gradcheck), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ATen switches to a two-pass parallel reduction (which splits one output's sum
# across threads) when there is a single output and numel >= GRAIN_SIZE.
_ATEN_GRAIN_SIZE = 32768


def rowsum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed order that depends only on ``x.shape[-1]``."""
    x = x.contiguous()
    n = x.shape[-1]
    if x.numel() >= _ATEN_GRAIN_SIZE and x.numel() == n:
        # one output element: give ATen a second (zero) row so it keeps the
        # serial per-row order instead of splitting this sum across threads.
        padded = torch.stack([x.reshape(n), torch.zeros_like(x.reshape(n))])
        return padded.sum(-1)[0].reshape(x.shape[:-1])
    return x.sum(-1)


# --------------------------------------------------------------------------- exp
_LOG2E = 1.4426950408889634
# ln 2 split so that n * LN2_HI is exact for the |n| that can occur.
_LN2_HI = {torch.float32: 6.93145752e-01, torch.float64: 6.93147180369123816490e-01}
_LN2_LO = {torch.float32: 1.42860677e-06, torch.float64: 1.90821492927058770002e-10}
_EXP_DEGREE = {torch.float32: 7, torch.float64: 13}
_EXP_COEFFS = {d: [1.0 / math.factorial(k) for k in range(n, -1, -1)] for d, n in _EXP_DEGREE.items()}
# (exponent bias, mantissa bits, min normal exponent, max exponent, int dtype)
_FLOAT_LAYOUT = {
    torch.float32: (127, 23, -126, 127, torch.int32),
    torch.float64: (1023, 52, -1022, 1023, torch.int64),
}


def _check_float(x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_LAYOUT:
        raise TypeError(f"numerics: expected float32 or float64, got {x.dtype}")


def _pow2(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**n for integral-valued float n within the normal exponent range (exact)."""
    bias, mbits, _, _, itype = _FLOAT_LAYOUT[dtype]
    return ((n.to(itype) + bias) << mbits).view(dtype)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for float32/float64 with position-independent bits (~1 ulp)."""
    _check_float(x)
    dt = x.dtype
    _, _, emin, emax, _ = _FLOAT_LAYOUT[dt]
    lo = emin * math.log(2.0)  # below: flush to 0 (results under the smallest normal)
    hi = math.log(torch.finfo(dt).max)  # above: inf (emax * log(2), before, gave inf from 88.03 in fp32)
    # (in place where a temporary is done with: the same IEEE operations in the same order, so the same
    # bits, 1.5x faster than allocating each step; session 46)
    xc = x.clamp(lo, hi)
    n = torch.round(xc * _LOG2E)
    r = xc.sub_(n * _LN2_HI[dt]).sub_(n * _LN2_LO[dt])        # (xc - n * hi) - n * lo
    coeffs = _EXP_COEFFS[dt]
    p = torch.full_like(r, coeffs[0])
    for c in coeffs[1:]:
        p.mul_(r).add_(c)                                      # p * r + c
    # 2**n in two exact factors: n reaches emax + 1 just under hi, where one factor would be inf
    # (each product is exact while normal, so the bits are p * 2**n rounded once, as before)
    half = torch.floor(n * 0.5)
    y = p.mul_(_pow2(half, dt)).mul_(_pow2(n.sub_(half), dt))  # (p * 2**half) * 2**(n - half)
    y.masked_fill_(x < lo, 0.0)
    y.masked_fill_(x > hi, math.inf)
    return torch.where(torch.isnan(x), x, y)


# --------------------------------------------------------------------------- log
_LN2 = math.log(2.0)
_LOG_TERMS = 11  # atanh series up to f**21: < 1e-17 relative for |f| <= 0.1716


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive finite float32/float64 values, evaluated in float64
    and rounded once to x.dtype (position-independent bits)."""
    _check_float(x)
    xd = x.double()
    m, e = torch.frexp(xd)  # xd = m * 2**e, m in [0.5, 1)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1, e).double()
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    p = torch.full_like(f, 1.0 / (2 * _LOG_TERMS - 1))
    for k in range(_LOG_TERMS - 2, -1, -1):
        p = p * f2 + 1.0 / (2 * k + 1)
    y = (2.0 * f) * p + e * _LN2
    y = torch.where(xd == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(xd == math.inf, xd, y)
    y = torch.where((xd < 0) | torch.isnan(xd), torch.full_like(y, math.nan), y)
    return y.to(x.dtype)


# ------------------------------------------------------------------------ sincos
# pi/2 in three parts (fdlibm's pio2_1, pio2_2, pio2_2t): k * part is exact for
# |k| < 2**20, i.e. angles up to ~1.6e6 rad, far beyond RoPE's position * 1.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624879595063154e-21
_TWO_OVER_PI = 2.0 / math.pi
_SIN_COEFFS = [(-1) ** k / math.factorial(2 * k + 1) for k in range(9, -1, -1)]
_COS_COEFFS = [(-1) ** k / math.factorial(2 * k) for k in range(9, -1, -1)]
SINCOS_MAX_ABS = float(2**20) * (math.pi / 2)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin(x), cos(x)) evaluated in float64 from x's exact value, with
    position-independent bits; returned in float64 (caller rounds once)."""
    xd = x.double()
    k = torch.round(xd * _TWO_OVER_PI)
    r = ((xd - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = torch.full_like(r, _SIN_COEFFS[0])
    for c in _SIN_COEFFS[1:]:
        s = s * r2 + c
    s = s * r
    c_ = torch.full_like(r, _COS_COEFFS[0])
    for c in _COS_COEFFS[1:]:
        c_ = c_ * r2 + c
    quadrant = torch.remainder(k, 4.0)
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c_, torch.where(quadrant == 2, -s, -c_)))
    cos = torch.where(quadrant == 0, c_, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c_, s)))
    return sin, cos
