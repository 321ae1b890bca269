"""Probe (H200): the canonical:C decode pairs from rlk_ops/kernels/triton/pair_decode.py (one
Triton launch, 16-row tile) against the route it would replace (Triton pair layout + FA4's
paged call over the pairs): bits of every pair (torch.equal) and CUDA-graph time, and the
merged op with each. ``configs``: the kernel's launch configurations at batch 1 and 8 instead.
Usage: [PAGES=16,128] python3 benchmarks/probe_pair_decode.py OUT.json [configs]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.fa4.kernels import pair_attention  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402


PAGES = tuple(int(p) for p in os.environ.get("PAGES", "16,128").split(","))  # page sizes of the configs run
# layout -> ((num_warps, num_stages, prefetch), ...); prefetch: see pair_decode's PF
CONFIGS = {"rows": ((4, 2, None),), "keys": ((4, 2, 3), (4, 3, 3), (8, 2, 3), (8, 3, 3))}


def configs(out):
    """Launch configurations (num_warps, num_stages) of both tile layouts ("rows": queries on the
    MMA's M axis; "keys": keys there) against FA4's pair call (layout + call): bits of every
    pair and time, then the merged op with each kernel's fastest configuration."""
    res = []
    cases = ((1, 8192, (512, 1024, 2048)), (1, 32768, (1024,)), (8, 8192, (1024,)), (8, 32768, (1024,)),
             (64, 8192, (1024,)))
    for page in PAGES:
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=2.0, reps=3)
        b = cb.Bench("cuda", sh, None, False)
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs([(bb, cc) for bb, cc, _ in cases]):
            for c in next(cs for bb, cc, cs in cases if (bb, cc) == (bsz, ctx)):
                qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c)
                ref = pair_attention(qp, kc, vc, ptab, klens, b.scale)

                def fa4_route(q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c):
                    qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c)
                    o, l = pair_attention(qp, kc, vc, ptab, klens, b.scale)
                    return o, l, plens, n

                def merged(route, bsz=bsz):
                    o, l, pl, n = route()
                    return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                                state_lens=pl.view(n, bsz))

                row = {"page": page, "batch": bsz, "context": ctx, "C": c,
                       "fa4_layout_and_call_us": round(b.graph_us(fa4_route), 2),
                       "op_fa4_us": round(b.graph_us(lambda: merged(fa4_route)), 2)}
                full = plens > 0
                for layout, cfgs in CONFIGS.items():
                    best = None
                    for cfg in cfgs:
                        key = f"{layout}_w{cfg[0]}s{cfg[1]}" + ("" if cfg[2] is None else f"pf{cfg[2]}")

                        def run(cfg=cfg, layout=layout, q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c):
                            return pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, config=cfg[:2], layout=layout,
                                                  prefetch=cfg[2])

                        try:
                            got = run()
                        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                            row[key] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                            continue
                        row[key + "_equal"] = (cb.beq(got[0][full], ref[0][full]) and cb.beq(got[1][full], ref[1][full])
                                               and cb.beq(got[2], plens))
                        row[key + "_us"] = t = round(b.graph_us(run), 2)
                        if best is None or t < best[0]:
                            best = (t, run, key, cfg)
                    if best:
                        row[f"op_{layout}_us"] = round(b.graph_us(lambda: merged(best[1])), 2)
                        row[f"op_{layout}_config"] = best[2]
                    if best and layout == "keys":  # the merge folded into the same launch
                        cfg = best[3]

                        def fused(cfg=cfg, q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c):
                            return pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, config=cfg[:2], layout="keys",
                                                  prefetch=cfg[2], merge=True)[4:]

                        ref_op = merged(fa4_route)
                        got = fused()
                        row["op_keys_fused_equal"] = cb.beq(got[0], ref_op[0]) and cb.beq(got[1], ref_op[1])
                        row["op_keys_fused_us"] = round(b.graph_us(fused), 2)
                print(row, flush=True)
                res.append(row)
    write_rows(out, res)


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
    write_rows(out, res)


if __name__ == "__main__":
    main()
