"""Diagnosis (H200) for the TMA walk (rlk_ops/kernels/triton/walk_decode.py) when its tests fail:
small cases from one key block upward, each compared with the routed pair kernel ("keys"
layout), printing where the states differ, so one device call tells which step is off.

Per case: pair lengths equal; for out and lse, the count of differing elements, the largest
absolute difference, NaN counts, and the first differing (pair, query head, dim). A lse that
matches with an out that does not points at O (V^T @ P^T, the swapped operand roles, the V
masking); a lse off by a few ulp points at the thread sums; both far off at the tiles (ring,
page table, layouts).

Usage (GPU machine): [VARIANTS=4,8,ws,rows] python3 benchmarks/diag_walk_decode.py
"""
from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_triton_pair_decode import D, _inputs  # noqa: E402

from rlk_ops.kernels.triton.pair_decode import pair_decode  # noqa: E402
from rlk_ops.kernels.triton.walk_decode import walk_decode  # noqa: E402

# (label, lens, page, chunk, hq): one block, a partial block, two blocks of one chunk, two chunks,
# several sequences and KV heads, then the tests' shapes
CASES = [("one block", [128], 128, 128, 16), ("partial block", [100], 128, 128, 16),
         ("two blocks one chunk", [256], 128, 256, 16), ("partial second block", [200], 128, 256, 16),
         ("two chunks", [256], 128, 128, 16), ("G 2", [256], 128, 256, 8), ("G 8", [256], 128, 256, 32),
         ("batch 3", [300, 128, 1000], 128, 256, 16), ("page 256", [700], 256, 256, 16),
         ("C 768 long", [8192], 128, 768, 16)]
# walk_decode's launch variants, by name (VARIANTS=4,8,ws,rows): 4 or 8 warps per program, the
# producer warp (ws=True), or one warp with the queries on M (rows=True); run one variant over every
# case before the next, so a variant that hangs (the call's time limit stops it) has left the
# others' lines printed
_VARIANT_OPTS = {"4": {}, "8": {"warps": 8}, "ws": {"ws": True}, "rows": {"rows": True}}
VARIANTS = tuple(os.environ.get("VARIANTS", "4,8,ws,rows").split(","))


def _where(a, b):
    a, b = a.float(), b.float()
    bad = ~((a == b) | (a.isnan() & b.isnan()))
    if not bool(bad.any()):
        return "equal"
    idx = bad.nonzero()[0].tolist()
    diff = (a - b).abs()[bad & ~a.isnan() & ~b.isnan()]
    return (f"{int(bad.sum())}/{bad.numel()} differ, max |diff| {float(diff.max()) if diff.numel() else 'nan'}, "
            f"nan walk {int(a.isnan().sum())} ref {int(b.isnan().sum())}, first at {idx}: "
            f"walk {float(a[tuple(idx)])} ref {float(b[tuple(idx)])}")


def main():
    for variant in VARIANTS:
        for label, lens, ps, chunk, hq in CASES:
            _case(label if variant == "4" else f"{label} ({variant})", len(label), lens, ps, chunk, hq,
                  _VARIANT_OPTS[variant])


def _case(label, seed, lens, ps, chunk, hq, opts):
    try:
        q, kc, vc, table, sl = _inputs(lens, ps, seed=seed, device="cuda", hq=hq)
        got = walk_decode(q, kc, vc, table, sl, D ** -0.5, chunk, **opts)
        torch.cuda.synchronize()
        ref = pair_decode(q, kc, vc, table, sl, D ** -0.5, chunk, layout="keys")
        lens_ok = got[3] == ref[3] and torch.equal(got[2], ref[2])
        print(f"{label}: lens {'equal' if lens_ok else (got[2].tolist(), ref[2].tolist())}; "
              f"lse {_where(got[1], ref[1])}; out {_where(got[0], ref[0])}", flush=True)
    except Exception:  # noqa: BLE001 - printed: the diagnosis goes on to the next case
        print(f"{label}: raised\n{traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
