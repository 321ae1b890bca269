"""Probe (H200): the training merge's blockings on a real forward's state buffers. canonical:C
training at B=4, S=8192 (Qwen3-8B TP=2 shard) writes N = ceil(S / C) state slots of [T, Hq, D]
bf16 (a row in chunk i holds states 0..i-1 and the diagonal one in the last slot, the others
lse = -inf), then merges them; benchmarks/canonical.py's ``merge alone`` column times that
merge on the route's blocking (the walk skipping the states no row of a program holds, 2D max;
32 rows per program one state at a time since session 17). Here: ``blockings``' sweep;
every result torch.equal to the routed merge's (no blocking changes a bit:
kernels/triton/merge.py), CUDA-graph median us, and the bytes the merge must move (the present
states' out rows and the merged out) over that time.
Usage: [CHUNKS=640,768] python3 benchmarks/probe_train_merge.py OUT.json
ONLY=name,..: those blockings only. (DEVICE=cpu TRITON_INTERPRET=1 CHUNKS=128
ONLY=skip_b16_u2_w4,skip_b32_u1_w4_e1: a smoke run of the plumbing, not a measurement.)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import add_row, write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.triton import _common as C  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402

CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "640,768").split(","))
DEVICE = os.environ.get("DEVICE", "cuda")
ONLY = [x for x in os.environ.get("ONLY", "").split(",") if x]   # some blockings only (default: all)


def blockings(n: int) -> dict:
    """name -> (config, vec) for merge_attn_states: the skipping walk with eager state loads or not,
    on other rows per program, groups and warps. (Sessions 11-12 measured the walk without
    skipping on 8/16/32 rows, looped and 2D max, eager and not, and _merge_vec on 1-4 rows:
    results/h200/session11/train_merge.json, session12/train_merge.json; session 17 also rows by
    position, one head's consecutive positions a program, code at a14e176: slower.)"""
    np2 = C.pow2(n)
    out = {}
    for block, unroll, warps in ((16, 2, 0), (16, 4, 0), (32, 2, 0), (32, 2, 8), (16, 2, 2), (16, 2, 8),
                                 (8, 2, 0), (64, 2, 8), (32, 1, 0), (32, 3, 0), (32, 2, 2), (64, 2, 4)):
        for eager in (0, 1):
            name = f"skip_b{block}_u{unroll}_w{warps or 4}{'_e1' if eager else ''}"
            out[name] = ((block, 1, min(unroll, n), np2, eager, 1, warps), 0)
    return {k: x for k, x in out.items() if not ONLY or k in ONLY}


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    if DEVICE == "cpu":
        cb.install_dry_run()  # the stand-in FA4 and the Triton interpreter (plumbing only)
    sh = cb.replace(cb.Shapes(), target_ms=4.0, reps=3) if DEVICE == "cuda" else cb.replace(cb.DRY, train=(1, 200))
    b = cb.Bench(DEVICE, sh, None, False)
    bsz, s = sh.train
    q, k, v = b.rand(bsz, s, sh.hq, sh.d), b.rand(bsz, s, sh.hkv, sh.d), b.rand(bsz, s, sh.hkv, sh.d)
    rows = []
    for c in CHUNKS:
        o, l = b.forward_states(q, k, v, c)
        n, t, hq, d = o.shape
        present = int((l != float("-inf")).sum())
        moved = present * d * o.element_size() + t * hq * d * o.element_size()
        routed_cfg, routed_vec = tm.merge_route(t * hq, n, d, o.device)
        ref = tm.merge_attn_states(o, l)
        row = {"C": c, "slots": n, "rows": t * hq, "present_states": present, "bytes_moved": moved,
               "routed": [list(routed_cfg), routed_vec],
               "routed_us": round(b.graph_us(lambda: tm.merge_attn_states(o, l)), 1)}
        row["routed_TBps"] = round(moved / row["routed_us"] / 1e6, 2)
        for name, (cfg, vec) in blockings(n).items():
            try:
                got = tm.merge_attn_states(o, l, config=cfg, vec=vec)
            except Exception as e:  # noqa: BLE001 - a blocking the compiler refuses
                row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                continue
            row[name + "_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
            row[name + "_us"] = round(b.graph_us(lambda cfg=cfg, vec=vec: tm.merge_attn_states(o, l, config=cfg,
                                                                                            vec=vec)), 1)
        add_row(out_path, rows, row)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main()
