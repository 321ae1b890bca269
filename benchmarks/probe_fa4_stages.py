"""Probe (H200): FA4's SM90 forward with a deeper K/V pipeline (num_stages 3 instead of the
interface's hard-coded 2) for canonical:C decode pair calls. Pipeline depth changes when
loads are issued, not what is computed; this checks that (torch.equal of every pair's out
and lse) and times both (CUDA-graph replay). ``shallow``: num_stages 1 (80 KB of shared
memory instead of 144, so two CTAs fit on an SM) at the many-CTA shapes, strict single pass
included. Usage: python3 benchmarks/probe_fa4_stages.py OUT.json [deep|shallow]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.fa4 import loader  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402


def staged(mod, stages):
    """Context: every SM90 forward compiled inside builds with num_stages=stages, in a
    compile cache of its own (the interface's cache key has no num_stages)."""
    from flash_attn.cute import cache_utils

    base = mod.FlashAttentionForwardSm90

    class Staged(base):
        def __init__(self, *a, **kw):
            kw["num_stages"] = stages
            super().__init__(*a, **kw)

    class Ctx:
        def __enter__(self):
            self.cache = mod._flash_attn_fwd.compile_cache
            mod.FlashAttentionForwardSm90 = Staged
            mod._flash_attn_fwd.compile_cache = CACHES.setdefault(stages, cache_utils.JITCache())

        def __exit__(self, *exc):
            mod.FlashAttentionForwardSm90 = base
            mod._flash_attn_fwd.compile_cache = self.cache

    return Ctx()


CACHES = {}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    which = sys.argv[2] if len(sys.argv) > 2 else "deep"
    stage_set = (3,) if which == "deep" else (1,)
    res = []
    for page in (16, 128):
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=4.0)
        b = cb.Bench("cuda", sh, None, False)
        mod = loader.load().module
        cases = ((1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 8192))
        if which != "deep":
            cases = ((8, 32768), (64, 8192), (64, 32768))
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(cases):
            if which != "deep":  # strict single pass, FA4's default 2 stages vs the probed ones
                def strict(q=q, kc=kc, vc=vc, pt=pt, sl=sl):
                    return mod._flash_attn_fwd(q, kc, vc, page_table=pt, seqused_k=sl, softmax_scale=b.scale,
                                               causal=True, num_splits=1, pack_gqa=True, return_lse=True,
                                               tile_mn=(64, 128))[:2]
                srow = {"page": page, "batch": bsz, "context": ctx, "strict": True}
                so, sl2 = strict()
                srow["stages2_us"] = round(b.graph_us(strict), 2)
                for st in stage_set:
                    with staged(mod, st):
                        so1, sl1 = strict()
                        srow[f"stages{st}_equal"] = cb.beq(so1, so) and cb.beq(sl1, sl2)
                        srow[f"stages{st}_us"] = round(b.graph_us(strict), 2)
                print(srow, flush=True)
                res.append(srow)
            for c in ((512, 1024, 2048) if which == "deep" else (1024, 2048)):
                qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c)

                def pairs(overlap=None, qp=qp, ptab=ptab, klens=klens):
                    return mod._flash_attn_fwd(qp, kc, vc, page_table=ptab, seqused_k=klens,
                                               softmax_scale=b.scale, causal=True, num_splits=1,
                                               pack_gqa=True, return_lse=True, tile_mn=(64, 128),
                                               intra_wg_overlap=overlap)[:2]

                row = {"page": page, "batch": bsz, "context": ctx, "C": c, "ctas": n * bsz * sh.hkv}
                o2, l2 = pairs()
                row["stages2_us"] = round(b.graph_us(pairs), 2)
                row["stages2_no_overlap_us"] = round(b.graph_us(lambda: pairs(False)), 2)
                for st in stage_set:
                    try:
                        with staged(mod, st):
                            o3, l3 = pairs()
                            row[f"stages{st}_equal"] = cb.beq(o3, o2) and cb.beq(l3, l2)
                            row[f"stages{st}_us"] = round(b.graph_us(pairs), 2)
                            o3n, l3n = pairs(False)
                            row[f"stages{st}_no_overlap_equal"] = cb.beq(o3n, o2) and cb.beq(l3n, l2)
                            row[f"stages{st}_no_overlap_us"] = round(b.graph_us(lambda: pairs(False)), 2)
                    except Exception as e:  # noqa: BLE001 - a probe: record and go on
                        row[f"stages{st}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(row, flush=True)
                res.append(row)
    write_rows(out, res)


if __name__ == "__main__":
    main()
