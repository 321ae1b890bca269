"""Probe: canonical:C decode as FA4's own SM90 kernel walking the chunks (rlk_ops/kernels/fa4/walk.py)
against FA4 single pass (issue 8's line at page 128, batch 64) and the routed op (Triton pairs + merge).

Per case, in one interleaved run (canonical.Bench.graph_us_many, CUDA-graph replays): ``fa4_strict``
(FA4 single pass, the line's reference), ``op`` (canonical:C through rlk::paged_attention as routed:
fa4 canonical.DECODE_WALK decides), ``op_pairs`` (the op with DECODE_WALK None: pair kernel + merge
op), ``walk`` (the walk, merging in the program), ``walk_states`` (the walk writing its partials only,
``merge=False``), ``walk_states_merge`` (those + the merge op), ``single_walk`` (one chunk holding
the whole sequence, no merge: the walk's structure without its chunk boundaries; session 31 also
timed three variants, since removed: results/h100/session31/)
and ``read_flat`` (every K/V byte read once). Bits first: ``walk_equal`` (out and lse torch.equal to
the op's pair route, DECODE_WALK None), ``walk_pairs_equal`` (every non-empty partial torch.equal to the routed pair kernel's).

Usage: [CASES=64x8192,64x32768] [CHUNK=768] python3 benchmarks/probe_fa4_walk.py OUT.json
"""
from __future__ import annotations

import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402
from probe_decode_roofline import read_flat  # noqa: E402

import rlk_ops  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

CASES = tuple(tuple(int(x) for x in c.split("x"))
              for c in os.environ.get("CASES", "64x8192,64x32768").split(","))
CHUNK = int(os.environ.get("CHUNK", "768"))


def variant_fn(module, settings, fn):
    """fn run with ``module``'s settings patched (its kernel compiled before the timing's graph capture)."""
    def run():
        with mock.patch.multiple(module, **settings):
            return fn()
    return run


def main():
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import kernels as fa4
    from rlk_ops.kernels.fa4 import walk

    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = []
    sh = cb.replace(cb.Shapes(), decode_page=128, target_ms=2.0, reps=5)
    b = cb.Bench("cuda", sh, None, False)
    for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(list(CASES)):
        c = CHUNK
        n = pd.pair_count(pt.shape[1], 128, c)
        routed = {"layout": "keys", **pd.step_launch(q, kc, n)}
        row = {"page": 128, "batch": bsz, "context": ctx, "C": c, "hq": sh.hq, "hkv": sh.hkv,
               "kv_bytes": 2 * bsz * ctx * sh.hkv * sh.d * 2}
        fns = {"fa4_strict": lambda: fa4.paged_attention(q, kc, vc, pt, sl, b.scale),
               "op": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}"),
               "op_pairs": variant_fn(fa4_canonical, {"DECODE_WALK": None}, lambda: rlk_ops.paged_attention(
                   q, kc, vc, pt, sl, split_kv=f"canonical:{c}")),
               "read_flat": lambda: read_flat(kc, vc)}
        try:
            with mock.patch.multiple(fa4_canonical, DECODE_WALK=None):   # the reference: pairs + merge op
                ro, rl = rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}")
            wo, wl, po, pl = walk.decode(q, kc, vc, pt, sl, b.scale, c)
            row["walk_equal"] = cb.beq(wo.reshape(-1), ro.reshape(-1)) and cb.beq(wl.reshape(-1), rl.reshape(-1))
            ref = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **routed)
            full = (ref[2] > 0).view(n, bsz)
            row["walk_pairs_equal"] = (cb.beq(po[full].reshape(-1), ref[0].view(n, bsz, 1, sh.hq, sh.d)[full].reshape(-1))
                                       and cb.beq(pl[full].reshape(-1), ref[1].view(n, bsz, sh.hq, 1)[full].reshape(-1)))
            fns["walk"] = lambda: walk.decode(q, kc, vc, pt, sl, b.scale, c)
            fns["walk_states"] = lambda: walk.decode(q, kc, vc, pt, sl, b.scale, c, merge=False)

            def states_merge():  # as the "states" route runs it: the lengths computed every step
                _, _, po2, pl2 = walk.decode(q, kc, vc, pt, sl, b.scale, c, merge=False)
                return tm.merge_attn_states(po2, pl2, state_lens=walk.pair_lengths(sl, n, c))
            fns["walk_states_merge"] = states_merge
            # the walk over one chunk holding the whole sequence, without its merge: FA4's single pass plus
            # one partial's store (what the walk's own structure costs, apart from its chunk boundaries)
            whole = pt.shape[1] * 128
            fns["single_walk"] = lambda: walk.decode(q, kc, vc, pt, sl, b.scale, whole, merge=False)
        except Exception as e:  # noqa: BLE001 - recorded: the walk did not build or run here
            row["walk"] = f"failed: {type(e).__name__}: {str(e)[:800]}"
        print(b.timed_row(row, fns), flush=True)
        res.append(row)
        write_rows(out, res)


if __name__ == "__main__":
    main()
