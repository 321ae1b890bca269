"""Drift statistics: how far apart two computations of the same quantity are.

Bitwise equality is the claim; drift numbers say how large a mismatch is when there
is one (the negative control, CPU reference vs CUDA, non-canonical CP gradients).
"""
from __future__ import annotations

import torch


def drift_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max / mean / p95 / p99 of |a - b| (float64), plus how many elements differ at all."""
    if a.shape != b.shape:
        raise ValueError(f"drift_stats: shapes differ: {list(a.shape)} vs {list(b.shape)}")
    diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs().flatten()
    n = diff.numel()
    if n == 0:
        return {"elements": 0, "mismatched": 0, "max": 0.0, "mean": 0.0, "p95": 0.0, "p99": 0.0}
    mismatched = int((a.detach().cpu() != b.detach().cpu()).sum())
    srt = diff.sort().values

    def pct(q):
        return float(srt[min(n - 1, int(q * (n - 1) + 0.5))])

    return {"elements": n, "mismatched": mismatched, "max": float(srt[-1]), "mean": float(diff.mean()),
            "p95": pct(0.95), "p99": pct(0.99)}
