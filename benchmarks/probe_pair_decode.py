"""Probe (H200): the canonical:C decode pairs from rlk_ops/kernels/triton/pair_decode.py (one
Triton launch, 16-row tile) against the route it would replace (Triton pair layout + FA4's
paged call over the pairs): bits of every pair (torch.equal) and CUDA-graph time, and the
merged op with each. ``configs``: the kernel's launch configurations at batch 1 and 8 instead.
Usage: python3 benchmarks/probe_pair_decode.py OUT.json [configs]
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)

from rlk_ops.kernels.fa4.kernels import pair_attention  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402


def configs(out):
    """Launch configurations of the Triton kernel (num_warps, num_stages) at the batch-1/8 shapes:
    bits against FA4's pair call and time."""
    res = []
    for page in (16, 128):
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=2.0, reps=3)
        b = cb.Bench("cuda", sh, None, False)
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(((1, 8192), (1, 32768), (8, 8192))):
            c = 1024
            qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c)
            ref = pair_attention(qp, kc, vc, ptab, klens, b.scale)

            def fa4_route(q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c):
                qp, ptab, _, klens, _ = tm.decode_pairs(q, pt, sl, page, c)
                return pair_attention(qp, kc, vc, ptab, klens, b.scale)

            row = {"page": page, "batch": bsz, "context": ctx, "C": c,
                   "fa4_layout_and_call_us": round(b.graph_us(fa4_route), 2)}
            for cfg in ((4, 2), (4, 3), (8, 2), (8, 3)):
                got = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, config=cfg)
                row[f"w{cfg[0]}s{cfg[1]}_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
                row[f"w{cfg[0]}s{cfg[1]}_us"] = round(b.graph_us(
                    lambda cfg=cfg: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, config=cfg)), 2)
            print(row, flush=True)
            res.append(row)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    if "configs" in sys.argv[2:]:
        return configs(out)
    res = []
    for page in (16, 128):
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=4.0)
        b = cb.Bench("cuda", sh, None, False)
        cases = ((1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 8192))
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(cases):
            for c in (512, 1024, 2048):
                def fa4_route(c=c, q=q, kc=kc, vc=vc, pt=pt, sl=sl):
                    qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c)
                    o, l = pair_attention(qp, kc, vc, ptab, klens, b.scale)
                    return o, l, plens, n

                def triton_route(c=c, q=q, kc=kc, vc=vc, pt=pt, sl=sl):
                    return pd.pair_decode(q, kc, vc, pt, sl, b.scale, c)

                def merged(route, bsz=bsz):
                    o, l, plens, n = route()
                    return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                                state_lens=plens.view(n, bsz))

                ra, rb = fa4_route(), triton_route()
                row = {"page": page, "batch": bsz, "context": ctx, "C": c,
                       "pairs_equal": cb.beq(ra[0], rb[0]) and cb.beq(ra[1], rb[1]) and cb.beq(ra[2], rb[2]),
                       "fa4_layout_and_call_us": round(b.graph_us(fa4_route), 2),
                       "triton_pair_decode_us": round(b.graph_us(triton_route), 2),
                       "op_fa4_us": round(b.graph_us(lambda: merged(fa4_route)), 2),
                       "op_triton_us": round(b.graph_us(lambda: merged(triton_route)), 2)}
                print(row, flush=True)
                res.append(row)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
