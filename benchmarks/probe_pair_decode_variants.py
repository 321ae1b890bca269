"""Probe (H200): the decode-pair kernel's variants against the routed one ("keys", the
launch config the op picks), each in one run: bits of every pair (torch.equal against the
routed kernel, itself checked equal to FA4's pair call by tests/test_triton_pair_decode.py),
CUDA-graph time of the pairs and of the op (pairs + the merge op; also with the merge's
_merge_vec kernel, routed_op_vec_*, and with programmatic dependent launch from the pair kernel
to the merge, pdl=True, routed_op_pdl_*; decode_launch routes it up to one wave), and the fused
merge.
Variants: "keys" with one pair's KV heads on adjacent programs (heads_first) and without;
"tile", FA4's 64-row wgmma tile (4 warps, thread sums in registers, the masked block peeled),
with and without heads_first, at 2 stages; "keys" with every K/V line of the pair prefetched
into L2 up front (keys_l2), with the next block's scores issued before this block's softmax
(keys_ahead), and both; "keys" under a register cap, so that four programs fit an SM
(keys_{warps}x{stages}_r{maxnreg}) and other (warps, stages) uncapped (keys_{warps}x{stages});
"keys" with the page-table loads issued without waiting for the sequence length (keys_early); (sessions 14-16: each program walking 2, 4 or all chunks of
a sequence, keys_walk*, and keys_walk_fused*, which merged in the same program; slower, removed
after session 16, code at commit 6b83051);
"keys" with the head dim of V and O split over 2, 4 or 8 programs per (pair, KV head), each
scoring the block itself (keys_ds{slices}; keys_ds1: none where the launch splits it) (VARIANT_PDL=1 also times every variant's op with
the merge launched by PDL, *_op_pdl_*); the merge alone
with and without eager state loads (merge.EAGER_LOADS) and on _merge_vec (merge_vec*; merge_vec_eager and
routed_op_vec_eager: its first group loaded before the max, session 20).
variants_run3_split.json and variants_run4_phased.json timed two layouts since removed,
"split" and "phased", session12/variants_persist.json persistent programs (keys_persist*) and
session 13 the early merge (EARLY=1), both removed after (pair_decode's docstring).
VARIANTS=a,b picks some (none: only the routed kernel and the merges); keys_seq: the routed
kernel with sequence-major programs. FUSED=0 skips the fused merge (keys_fused_vec*: chunk- and
sequence-major programs). FA4_ROUTE=1 adds the op on the FA4 route (pair
layout, FA4's pair call, merge) with and without the layout launch prefetching every pair's
pages into L2 (merge.decode_pairs prefetch=).
(results/h200/pair_decode/variants_run1.json is from commit 3338e45, when the routed kernel
never took heads_first: its "routed" is today's keys_pairs_first.)
Usage: [PAGES=16] [CASES=1x8192,...] [CHUNKS=1024] [VARIANTS=...] [FUSED=0] [FA4_ROUTE=1] [VEC_WIDTH=32]
       [VARIANT_PDL=1]
       python3 benchmarks/probe_pair_decode_variants.py OUT.json
(DEVICE=cpu with TRITON_INTERPRET=1 and small CASES: a smoke run of the plumbing, not a measurement.)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

PAGES = tuple(int(p) for p in os.environ.get("PAGES", "16").split(","))
CASES = tuple(tuple(int(x) for x in c.split("x")) for c in
              os.environ.get("CASES", "1x8192,1x32768,8x8192,8x32768,64x8192").split(","))
DEVICE = os.environ.get("DEVICE", "cuda")
CHUNKS = {1: (512, 1024, 2048)}   # batch -> the C values timed (default: 1024); CHUNKS=c,.. for every batch
if os.environ.get("CHUNKS"):
    CHUNKS = {b: tuple(int(c) for c in os.environ["CHUNKS"].split(",")) for b in (1, 8, 64)}
ALL_VARIANTS = {"keys_heads_first": {"layout": "keys", "heads_first": True},
                "keys_pairs_first": {"layout": "keys", "heads_first": False},
                "tile": {"layout": "tile", "config": (4, 2)},
                "tile_heads_first": {"layout": "tile", "config": (4, 2), "heads_first": True},
                "keys_l2": {"layout": "keys", "l2_prefetch": True},
                "keys_ahead": {"layout": "keys", "ahead": True},
                "keys_ahead_l2": {"layout": "keys", "ahead": True, "l2_prefetch": True}}
for _ds in (2, 4, 8):
    ALL_VARIANTS[f"keys_ds{_ds}"] = {"layout": "keys", "slices": _ds}
for _w, _st, _r in ((4, 1, 128), (8, 1, 64)):
    ALL_VARIANTS[f"keys_{_w}x{_st}_r{_r}"] = {"layout": "keys", "config": (_w, _st, _r)}
ALL_VARIANTS["keys_seq"] = {"layout": "keys", "seq_major": True}
ALL_VARIANTS["keys_ds1"] = {"layout": "keys", "slices": 1}
# the page-table loads not waiting for seq_lens (pair_decode early_table; session 20, not yet timed)
ALL_VARIANTS["keys_early"] = {"layout": "keys", "early_table": True}
# other (warps, stages) on the routed launch otherwise (session 20: in one wave only (8, 3) had been
# timed with 2 head-dim slices)
for _w, _st in ((8, 2), (8, 4), (4, 2), (4, 3)):
    ALL_VARIANTS[f"keys_{_w}x{_st}"] = {"layout": "keys", "config": (_w, _st)}
# K/V tiles by TMA (prefetch 4; pages a multiple of 128 only: elsewhere the row records the refusal);
# uncapped it takes 188 registers at 4 warps (two programs per SM), capped at the routed 168 it spills
ALL_VARIANTS["keys_tma"] = {"layout": "keys", "prefetch": 4}
ALL_VARIANTS["keys_tma_r168"] = {"layout": "keys", "prefetch": 4, "config": (4, 2, 168)}
VARIANTS = {k: ALL_VARIANTS[k] for k in os.environ.get("VARIANTS", ",".join(ALL_VARIANTS)).split(",") if k != "none"}
FUSED = os.environ.get("FUSED", "1") == "1"
VARIANT_PDL = os.environ.get("VARIANT_PDL", "0") == "1"   # also each variant's op with the merge by PDL
# the fused merge (pair_decode merge=True) on the routed launch, chunk- and sequence-major
# programs (keys_fused in earlier runs was the walk's steps, removed in session 10)
FUSED_VARIANTS = {"keys_fused_vec": {}, "keys_fused_vec_seq": {"seq_major": True}}
FA4_ROUTE = os.environ.get("FA4_ROUTE", "0") == "1"
VEC_WIDTH = int(os.environ.get("VEC_WIDTH", "32"))   # merge_row: states per group of _merge_vec


def merge_row(tm, states, lens, cfg, b):
    """The merge op alone on these states: the walk kernel with its config and with eager state
    loads, and the states-side-by-side kernel (_merge_vec, VEC_WIDTH states a group) on 1-row,
    1-warp programs (merge_vec_config; and over all or half of head_dim, merge_vec_s1/s2)."""
    eager_cfg = (*cfg, True)   # merge_config's 4 entries, then eager loads
    ref = tm.merge_attn_states(*states, state_lens=lens, config=cfg, vec=0)
    got = tm.merge_attn_states(*states, state_lens=lens, config=eager_cfg, vec=0)
    n, d = states[0].shape[0], states[0].shape[-1]
    vcfg = tm.vec_config(n, d)
    vec = tm.merge_attn_states(*states, state_lens=lens, config=vcfg, vec=VEC_WIDTH)
    return {"merge_config": list(cfg), "merge_us": round(b.graph_us(
                lambda: tm.merge_attn_states(*states, state_lens=lens, config=cfg, vec=0)), 2),
            "merge_eager_equal": cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1]),
            "merge_eager_us": round(b.graph_us(lambda: tm.merge_attn_states(*states, state_lens=lens,
                                                                            config=eager_cfg, vec=0)), 2),
            "merge_vec_config": list(vcfg),
            "merge_vec_equal": cb.beq(vec[0], ref[0]) and cb.beq(vec[1], ref[1]),
            "merge_vec_us": round(b.graph_us(lambda: tm.merge_attn_states(*states, state_lens=lens, config=vcfg,
                                                                          vec=VEC_WIDTH)), 2),
            **{k: v for split in (1, 2) for k, v in vec_blocking(tm, states, lens, ref, (1, split, *vcfg[2:]), b).items()},
            **vec_eager(tm, states, lens, ref, vcfg, b)}


def vec_eager(tm, states, lens, ref, vcfg, b):
    """_merge_vec with its first group's loads before the max (config eager; session 20, not
    yet timed): one round trip after the wait instead of two."""
    cfg = (*vcfg, True)
    got = tm.merge_attn_states(*states, state_lens=lens, config=cfg, vec=VEC_WIDTH)
    return {"merge_vec_eager_equal": cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1]),
            "merge_vec_eager_us": round(b.graph_us(lambda: tm.merge_attn_states(*states, state_lens=lens, config=cfg,
                                                                                vec=VEC_WIDTH)), 2)}


def vec_blocking(tm, states, lens, ref, cfg, b):
    """_merge_vec on 1-row, 1-warp programs over head_dim / split columns (offline sm90: the
    weights stay one per lane; fewer, longer programs than merge_vec_config's split of 4)."""
    got = tm.merge_attn_states(*states, state_lens=lens, config=cfg, vec=VEC_WIDTH)
    name = f"merge_vec_s{cfg[1]}"
    return {name + "_equal": cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1]),
            name + "_us": round(b.graph_us(lambda: tm.merge_attn_states(*states, state_lens=lens, config=cfg,
                                                                        vec=VEC_WIDTH)), 2)}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = []
    if FA4_ROUTE:
        if DEVICE == "cpu":
            cb.install_dry_run()  # the stand-in FA4 (plumbing only)
        from rlk_ops.kernels.fa4 import kernels as fa4_kernels
    for page in PAGES:
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=2.0, reps=3)
        b = cb.Bench(DEVICE, sh, None, False)
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(list(CASES)):
            for c in CHUNKS.get(bsz, (1024,)):
                n = pd.pair_count(pt.shape[1], page, c)
                launch = pd.step_launch(q, kc, n)
                cfg = launch["config"]

                def pairs(kw, q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c):
                    return pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **kw)

                def merged(kw, bsz=bsz, vec=None, eager=False):
                    o, l, pl, n = pairs(kw)
                    vkw = {} if vec is None else {"vec": vec, "config": (*tm.vec_config(n, sh.d), eager)}
                    return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                                state_lens=pl.view(n, bsz), pdl=kw.get("pdl"), **vkw)

                routed = {"layout": "keys", **launch}
                ref = pairs(routed)
                ref_op = merged(routed)
                full = ref[2] > 0
                states = (ref[0].view(ref[3], bsz, 1, sh.hq, sh.d), ref[1].view(ref[3], bsz, sh.hq, 1))
                mcfg = tm.merge_config(bsz * sh.hq, ref[3], sh.d, q.device)
                eager = merge_row(tm, states, ref[2].view(ref[3], bsz), mcfg, b)
                row = {"page": page, "batch": bsz, "context": ctx, "C": c, "routed_config": list(cfg),
                       "routed_heads_first": launch["heads_first"],
                       "routed_pairs_us": round(b.graph_us(lambda: pairs(routed)), 2),
                       "routed_op_us": round(b.graph_us(lambda: merged(routed)), 2), **eager}
                op_vec = merged(routed, vec=VEC_WIDTH)
                row["routed_op_vec_equal"] = cb.beq(op_vec[0], ref_op[0]) and cb.beq(op_vec[1], ref_op[1])
                row["routed_op_vec_us"] = round(b.graph_us(lambda: merged(routed, vec=VEC_WIDTH)), 2)
                # the routed op with the merge's first group loaded before its max (merge_vec EAGER)
                op_eager = merged(routed, vec=VEC_WIDTH, eager=True)
                row["routed_op_vec_eager_equal"] = cb.beq(op_eager[0], ref_op[0]) and cb.beq(op_eager[1], ref_op[1])
                row["routed_op_vec_eager_us"] = round(b.graph_us(lambda: merged(routed, vec=VEC_WIDTH, eager=True)), 2)
                on = {**routed, "pdl": True}   # the merge by PDL, the pair kernel letting it start early
                try:
                    got = merged(on)
                    row["routed_op_pdl_equal"] = cb.beq(got[0], ref_op[0]) and cb.beq(got[1], ref_op[1])
                    row["routed_op_pdl_us"] = round(b.graph_us(lambda: merged(on)), 2)
                except Exception as e:  # noqa: BLE001 - recorded
                    row["routed_op_pdl"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                for name, kw in VARIANTS.items():
                    kw = {**launch, **kw}
                    try:
                        got = pairs(kw)
                    except Exception as e:  # noqa: BLE001 - a variant the compiler or the GPU refuses
                        row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                        continue
                    row[name + "_equal"] = (cb.beq(got[0][full], ref[0][full]) and cb.beq(got[1][full], ref[1][full])
                                            and cb.beq(got[2], ref[2]))
                    row[name + "_pairs_us"] = round(b.graph_us(lambda kw=kw: pairs(kw)), 2)
                    op = merged(kw)
                    row[name + "_op_equal"] = cb.beq(op[0], ref_op[0]) and cb.beq(op[1], ref_op[1])
                    row[name + "_op_us"] = round(b.graph_us(lambda kw=kw: merged(kw)), 2)
                    if VARIANT_PDL:
                        on = {**kw, "pdl": True}
                        op = merged(on)
                        row[name + "_op_pdl_equal"] = cb.beq(op[0], ref_op[0]) and cb.beq(op[1], ref_op[1])
                        row[name + "_op_pdl_us"] = round(b.graph_us(lambda on=on: merged(on)), 2)
                if FA4_ROUTE:
                    for name, pf in (("fa4_route", None), ("fa4_route_l2", (kc, vc))):
                        def route(pf=pf, q=q, kc=kc, vc=vc, pt=pt, sl=sl, c=c, bsz=bsz):
                            qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, page, c, prefetch=pf)
                            o, l = fa4_kernels.pair_attention(qp, kc, vc, ptab, klens, b.scale)
                            return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                                        state_lens=plens.view(n, bsz))
                        got = route()
                        row[name + "_op_equal"] = cb.beq(got[0], ref_op[0]) and cb.beq(got[1], ref_op[1])
                        row[name + "_op_us"] = round(b.graph_us(route), 2)
                if FUSED:
                    for name, kw in FUSED_VARIANTS.items():
                        fused = {**routed, "merge": True, **kw}
                        try:
                            got = pairs(fused)[4:]
                        except Exception as e:  # noqa: BLE001 - as above
                            row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                            continue
                        row[name + "_equal"] = cb.beq(got[0], ref_op[0]) and cb.beq(got[1], ref_op[1])
                        row[name + "_us"] = round(b.graph_us(lambda fused=fused: pairs(fused)), 2)
                print(row, flush=True)
                res.append(row)
                write_rows(out, res)   # after every row: a time limit keeps the rows done so far
    write_rows(out, res)


if __name__ == "__main__":
    main()
