"""benchmarks/_report.fits: the per-implementation line time = fixed + rate * K/V bytes that the
batch-64 roofline probe (benchmarks/probe_decode_roofline.py) reports over its contexts."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _report import fits  # noqa: E402


def _row(page, ctx, **us):
    return {"page": page, "batch": 64, "context": ctx, "kv_bytes": ctx * 131072,
            **{f"{k}_us": v for k, v in us.items()}}


def test_two_contexts_give_the_line_through_them():
    rows = [_row(16, 8192, op=10.0 + 2.0 * 1.073741824, pairs=5.0 + 1.073741824),
            _row(16, 32768, op=10.0 + 2.0 * 4.294967296, pairs=5.0 + 4.294967296)]
    (fit,) = fits(rows)
    assert (fit["page"], fit["batch"], fit["contexts"]) == (16, 64, [8192, 32768])
    assert fit["op"] == {"us_per_GB": 2.0, "fixed_us": 10.0, "points": 2}
    assert fit["pairs"] == {"us_per_GB": 1.0, "fixed_us": 5.0, "points": 2}


def test_least_squares_over_three_contexts_and_groups_kept_apart():
    # y = 3 + 1 * x with residuals +0.5, -1, +0.5 at x = 1, 2, 3 GB (mean 0, uncorrelated with x)
    rows = [_row(128, int(g * 1e9 / 131072), op=3.0 + g + e) for g, e in ((1, 0.5), (2, -1.0), (3, 0.5))]
    rows.append(_row(16, 8192, op=7.0))   # one context only at page 16: no line
    rows[0]["only_here_us"] = 1.0         # timed at one context: not fitted
    (fit,) = fits(rows)
    assert fit["page"] == 128 and "only_here" not in fit
    assert fit["op"]["points"] == 3
    assert fit["op"]["us_per_GB"] == pytest.approx(1.0, abs=1e-3)
    assert fit["op"]["fixed_us"] == pytest.approx(3.0, abs=1e-2)
