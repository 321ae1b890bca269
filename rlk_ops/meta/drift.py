"""Drift statistics: how far apart two computations of the same quantity are.

Bitwise equality is the claim; drift numbers say how large a mismatch is when there
is one (the negative control, CPU reference vs CUDA, non-canonical CP gradients).
"""
from __future__ import annotations

import torch


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise, on the CPU: True where a and b differ in their bits. -0.0 and +0.0 differ, two NaNs
    with one payload do not (``!=`` says the opposite of both; a session 34 audit). One dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"bits_differ: needs one dtype and shape, got {a.dtype} {list(a.shape)} and "
                         f"{b.dtype} {list(b.shape)}")
    as_int = _BITS[a.element_size()]
    return a.detach().cpu().contiguous().view(as_int) != b.detach().cpu().contiguous().view(as_int)


def drift_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max / mean / p95 / p99 of |a - b| (float64), plus how many elements differ in their bits
    (``mismatched``; tensors of two dtypes: how many differ in value, a NaN beside a NaN not).
    An element that does not differ counts 0 (an -inf lse beside the same -inf gave NaN drift
    before: inf - inf; a session 35 audit), and so does a NaN beside a NaN of other bits (counted
    mismatched in one dtype); a NaN beside a number, or an infinity beside another value, counts inf."""
    if a.shape != b.shape:
        raise ValueError(f"drift_stats: shapes differ: {list(a.shape)} vs {list(b.shape)}")
    x, y = a.detach().cpu(), b.detach().cpu()
    if x.numel() == 0:
        return {"elements": 0, "mismatched": 0, "max": 0.0, "mean": 0.0, "p95": 0.0, "p99": 0.0}
    both_nan = x.isnan() & y.isnan()
    differ = bits_differ(x, y) if x.dtype == y.dtype else (x != y) & ~both_nan
    diff = (x.double() - y.double()).abs()
    # NaN beside NaN (other payload or sign bits: a mismatch in one dtype) is no distance; NaN beside
    # a number, or inf beside -inf, is inf (nan_to_num alone made +inf the largest double)
    diff = torch.where(diff.isnan(), float("inf"), diff)
    diff = torch.where(differ & ~both_nan, diff, 0.0).flatten()
    n = diff.numel()
    mismatched = int(differ.sum())
    srt = diff.sort().values

    def pct(q):
        return float(srt[min(n - 1, int(q * (n - 1) + 0.5))])

    return {"elements": n, "mismatched": mismatched, "max": float(srt[-1]), "mean": float(diff.mean()),
            "p95": pct(0.95), "p99": pct(0.99)}
