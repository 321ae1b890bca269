"""Quick check (any SM90 GPU, no FA4 needed) of the producer-warp walk (walk_decode ws=True) and the
one-warp walk with the queries on M (rows=True, session 26): their states against the 4-warp
walk's on small cases, then at 64 x ctx, page 128, C = 768 (with the one-warp walk's own merge
against the merge op: ``rows_fused_equal``), and the time of the walk, the one-warp walk alone
and merging its own states (``walk_rows_fused``), the walks + the merge op (``op_walk``, ``op_walk_rows``), the ring
alone (probe=1) and the routed pair kernel, each a CUDA graph, replayed in interleaved rounds
(_report.graph_times_us, median us). The producer-warp walk is no longer timed (session 27: it
ran no faster in session 25). For a device call too short for the FA4 install;
benchmarks/probe_walk_decode.py is the full probe (ratios over FA4). results/h100/session25/quick_ws*.json came from its first version
(commit 2016f9f), which timed with a graph helper of its own (7 rounds of 20 calls) and built
its 64 x ctx inputs itself (same shapes; canonical.Bench.decode_inputs since).
results/h100/session29/quick_halves.json came from the version of commit 45f321c, which also
timed the one-warp walk with its ring in half tiles (halves=True, removed after that run).

Usage (GPU machine): [CASES=64x8192] python3 benchmarks/quick_walk_ws.py [OUT.json]
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import canonical as cb  # noqa: E402  (benchmarks/canonical.py: the probe's decode inputs)
from _report import graph_times_us  # noqa: E402  (benchmarks/_report.py)
from test_triton_pair_decode import D, _inputs  # noqa: E402

from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402
from rlk_ops.kernels.triton.walk_decode import walk_decode  # noqa: E402

PAGE, CHUNK = 128, 768
CASES = tuple(tuple(int(x) for x in c.split("x")) for c in os.environ.get("CASES", "64x8192").split(","))


def equal_states(a, b):
    return a[3] == b[3] and all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = {"device": torch.cuda.get_device_name(), "small": {}, "cases": []}
    scale = D ** -0.5
    for label, lens, chunk in (("one block", [128], 128), ("partial block", [100], 128), ("two chunks", [256], 128),
                               ("batch 3", [300, 128, 1000], 256), ("C 768 long", [8192, 0, 7000], 768)):
        q, kc, vc, table, sl = _inputs(lens, PAGE, seed=len(label), device="cuda")
        ref = walk_decode(q, kc, vc, table, sl, scale, chunk)
        for name, opts in (("ws", {"ws": True}), ("rows", {"rows": True})):
            got = walk_decode(q, kc, vc, table, sl, scale, chunk, **opts)
            torch.cuda.synchronize()
            res["small"][f"{label} ({name})"] = equal_states(got, ref)
            print(label, name, res["small"][f"{label} ({name})"], flush=True)
    sh = cb.replace(cb.Shapes(), decode_page=PAGE)
    for bsz, ctx, q, kc, vc, pt, sl in cb.Bench("cuda", sh, None, False).decode_inputs(list(CASES)):  # the probe's
        npairs = pd.pair_count(pt.shape[1], PAGE, CHUNK)
        routed = {"layout": "keys", **pd.step_launch(q, kc, npairs)}
        ref = walk_decode(q, kc, vc, pt, sl, scale, CHUNK)
        row = {"batch": bsz, "context": ctx, "C": CHUNK, "page": PAGE,
               "ws_equal": equal_states(walk_decode(q, kc, vc, pt, sl, scale, CHUNK, ws=True), ref),
               "rows_equal": equal_states(walk_decode(q, kc, vc, pt, sl, scale, CHUNK, rows=True), ref),
               "pairs_equal": equal_states(pd.pair_decode(q, kc, vc, pt, sl, scale, CHUNK, **routed), ref)}
        def merged(st):
            o, lse, plens, n = st
            return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), lse.view(n, bsz, sh.hq, 1),
                                        state_lens=plens.view(n, bsz))

        mo, ml = merged(ref)
        fused = walk_decode(q, kc, vc, pt, sl, scale, CHUNK, rows=True, merge=True)
        row["rows_fused_equal"] = torch.equal(fused[4], mo) and torch.equal(fused[5].view(-1), ml.reshape(-1))
        row.update({f"{k}_us": round(v["us"], 2) for k, v in graph_times_us({
            "walk": lambda: walk_decode(q, kc, vc, pt, sl, scale, CHUNK),
            "walk_rows": lambda: walk_decode(q, kc, vc, pt, sl, scale, CHUNK, rows=True),
            "op_walk": lambda: merged(walk_decode(q, kc, vc, pt, sl, scale, CHUNK)),
            "op_walk_rows": lambda: merged(walk_decode(q, kc, vc, pt, sl, scale, CHUNK, rows=True)),
            "walk_rows_fused": lambda: walk_decode(q, kc, vc, pt, sl, scale, CHUNK, rows=True, merge=True),
            "ring": lambda: walk_decode(q, kc, vc, pt, sl, scale, CHUNK, probe=1),
            "pairs": lambda: pd.pair_decode(q, kc, vc, pt, sl, scale, CHUNK, **routed)}).items()})
        print(row, flush=True)
        res["cases"].append(row)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
