"""Probe (H200): the TMA walk (rlk_ops/kernels/triton/walk_decode.py, one program per (sequence,
KV head) streaming the whole sequence through a ring of TMA tiles) against the routed pair
kernel and FA4 single pass, at pages a multiple of 128 (issue 8's open cell: page 128, batch 64).

Per case, in one interleaved run (canonical.Bench.graph_us_many, CUDA-graph replays):
``fa4_strict`` (the line's reference), ``op`` (canonical:C through the op: routed pairs + merge),
``pairs`` (the routed pair kernel alone), ``walk`` (the walk alone), ``op_walk`` (walk + the
merge op on its states), ``walk_fused`` (the walk merging its own states in-program, ``merge=True``), ``merge`` (the merge
alone), ``walk_hmajor`` (a sequence's KV heads bsz programs apart, probe=2, bits checked:
``walk_hmajor_equal``), ``walk_ring`` (the ring alone, no arithmetic: what the TMA ring streams
at, probe=1), ``walk_ring_rows`` (the same ring over whole cache rows: each tile BLOCK_N / Hkv
rows of every KV head, one contiguous 32 KB, probe=3; session 24 asked whether that streams
nearer a flat read than one head's 256-byte slices), ``walk_w8`` / ``op_walk_w8`` /
``walk_w8_fused`` / ``walk_w8_ring`` (the same at 8 warps per program, session 25; bits:
``walk_w8_states_equal``, ``walk_w8_fused_equal``), ``walk_ws`` / ``op_walk_ws`` (a producer warp
issuing the TMA loads, ``ws=True``, session 25; bits: ``walk_ws_states_equal``), ``walk_rows`` /
``op_walk_rows`` / ``walk_rows_fused`` (one warp per program with the queries on M, ``rows=True``,
session 26; bits: ``walk_rows_states_equal``, ``walk_rows_fused_equal``) and ``read_flat`` (every K/V byte read once:
probe_decode_roofline.read_flat). Bits first: ``walk_states_equal`` (out, lse and pair lengths of
every pair torch.equal to the routed pair kernel's) and ``op_walk_equal`` (the merged out and lse
torch.equal to the op's), ``walk_fused_equal`` (the in-program merge's out and lse torch.equal to
the op's). A case whose walk fails to build or run records the error and goes on.

``OLD=0`` leaves out the 8-warp and producer-warp walks. results/h100/session29/walk_probe.json
also timed the one-warp walk with its ring in half tiles (``walk_rows_halves``, removed after it).

Usage: [PAGES=128] [CASES=64x8192,64x32768] [CHUNK=768] [OLD=0]
       python3 benchmarks/probe_walk_decode.py OUT.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402
from probe_decode_roofline import read_flat  # noqa: E402

import rlk_ops  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

PAGES = tuple(int(p) for p in os.environ.get("PAGES", "128").split(","))
CASES = tuple(tuple(int(x) for x in c.split("x"))
              for c in os.environ.get("CASES", "64x8192,64x32768").split(","))
CHUNK = int(os.environ.get("CHUNK", "768"))
OLD = os.environ.get("OLD", "1") != "0"


def main():
    from rlk_ops.kernels.fa4 import kernels as fa4
    from rlk_ops.kernels.triton import walk_decode as wd

    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = []
    for page in PAGES:
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=2.0, reps=5)
        b = cb.Bench("cuda", sh, None, False)
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(list(CASES)):
            c = CHUNK
            n = pd.pair_count(pt.shape[1], page, c)
            routed = {"layout": "keys", **pd.step_launch(q, kc, n)}

            def merged(st):
                o, lse, plens, n = st
                return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), lse.view(n, bsz, sh.hq, 1),
                                            state_lens=plens.view(n, bsz))

            row = {"page": page, "batch": bsz, "context": ctx, "C": c, "kv_bytes": 2 * bsz * ctx * sh.hkv * sh.d * 2}
            ref = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **routed)
            fns = {"fa4_strict": lambda: fa4.paged_attention(q, kc, vc, pt, sl, b.scale),
                   "op": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}"),
                   "pairs": lambda: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **routed),
                   "merge": lambda: merged(ref),
                   "read_flat": lambda: read_flat(kc, vc)}
            try:
                got = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c)
                row["walk_states_equal"] = all(cb.beq(x, y) for x, y in zip(got[:3], ref[:3])) and got[3] == ref[3]
                mo, ml = merged(got)
                ro, rl = rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}")
                row["op_walk_equal"] = cb.beq(mo.reshape(-1), ro.reshape(-1)) and cb.beq(ml.reshape(-1), rl.reshape(-1))
                fns["walk"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c)
                fns["op_walk"] = lambda: merged(wd.walk_decode(q, kc, vc, pt, sl, b.scale, c))
                fu = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True)
                row["walk_fused_equal"] = cb.beq(fu[4].reshape(-1), ro.reshape(-1)) and cb.beq(fu[5].reshape(-1),
                                                                                              rl.reshape(-1))
                fns["walk_fused"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True)
                hm = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=2)
                row["walk_hmajor_equal"] = all(cb.beq(x, y) for x, y in zip(hm[:3], ref[:3]))
                fns["walk_hmajor"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=2)
                fns["walk_ring"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=1)
            except Exception as e:  # noqa: BLE001 - recorded: the walk did not build or run here
                row["walk"] = f"failed: {type(e).__name__}: {str(e)[:600]}"
            try:  # the walk at 8 warps per program (session 25): same bits, twice the warps per SM
                if not OLD:
                    raise RuntimeError("skipped (OLD=0)")
                w8 = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, warps=8)
                row["walk_w8_states_equal"] = all(cb.beq(x, y) for x, y in zip(w8[:3], ref[:3])) and w8[3] == ref[3]
                fns["walk_w8"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, warps=8)
                fns["op_walk_w8"] = lambda: merged(wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, warps=8))
                fu8 = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True, warps=8)
                row["walk_w8_fused_equal"] = cb.beq(fu8[4].reshape(-1), ro.reshape(-1)) and cb.beq(
                    fu8[5].reshape(-1), rl.reshape(-1))
                fns["walk_w8_fused"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True, warps=8)
                fns["walk_w8_ring"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=1, warps=8)
            except Exception as e:  # noqa: BLE001 - recorded
                row["walk_w8"] = f"failed: {type(e).__name__}: {str(e)[:600]}"
            try:  # the producer-warp walk (ws=True, session 25): a TMA warp keeps the ring full
                if not OLD:
                    raise RuntimeError("skipped (OLD=0)")
                wsr = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, ws=True)
                row["walk_ws_states_equal"] = all(cb.beq(x, y) for x, y in zip(wsr[:3], ref[:3])) and wsr[3] == ref[3]
                fns["walk_ws"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, ws=True)
                fns["op_walk_ws"] = lambda: merged(wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, ws=True))
            except Exception as e:  # noqa: BLE001 - recorded
                row["walk_ws"] = f"failed: {type(e).__name__}: {str(e)[:600]}"
            try:  # one warp per program, the queries on M (rows=True, session 26)
                wr = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, rows=True)
                row["walk_rows_states_equal"] = all(cb.beq(x, y) for x, y in zip(wr[:3], ref[:3])) and wr[3] == ref[3]
                fns["walk_rows"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, rows=True)
                fns["op_walk_rows"] = lambda: merged(wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, rows=True))
                fr = wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True, rows=True)
                row["walk_rows_fused_equal"] = cb.beq(fr[4].reshape(-1), ro.reshape(-1)) and cb.beq(
                    fr[5].reshape(-1), rl.reshape(-1))
                fns["walk_rows_fused"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, merge=True, rows=True)
            except Exception as e:  # noqa: BLE001 - recorded
                row["walk_rows"] = f"failed: {type(e).__name__}: {str(e)[:600]}"
            try:  # the whole-row ring on its own: a failure here leaves the others timed
                wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=3)
                fns["walk_ring_rows"] = lambda: wd.walk_decode(q, kc, vc, pt, sl, b.scale, c, probe=3)
            except Exception as e:  # noqa: BLE001 - recorded
                row["walk_ring_rows"] = f"failed: {type(e).__name__}: {str(e)[:600]}"
            for name, us in b.graph_us_many(fns).items():
                row[f"{name}_us"] = round(us, 2)
            for name in ("op", "pairs", "walk", "op_walk", "walk_fused", "walk_hmajor", "walk_ring", "walk_ring_rows",
                         "walk_w8", "op_walk_w8", "walk_w8_fused", "walk_w8_ring", "walk_ws", "op_walk_ws",
                         "walk_rows", "op_walk_rows", "walk_rows_fused", "read_flat"):
                if f"{name}_us" in row:
                    row[f"{name}_over_fa4_strict"] = round(row[f"{name}_us"] / row["fa4_strict_us"], 4)
            print(row, flush=True)
            res.append(row)
            write_rows(out, res)


if __name__ == "__main__":
    main()
