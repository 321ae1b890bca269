"""Probe (H200): canonical:C training's calls as dense FA4 calls (fa4 canonical.DENSE_SLOTS and
DENSE_DIAGONAL_RUNS).

A dense [B, S] batch's full pieces (the queries after chunk c against chunk c's keys, in every
sequence) form one strided batch, so each full call can be one dense non-causal FA4 call on
strided views of q/k/v and of its state slot (FA4's SM90 SingleTileScheduler: a grid of (query
tile, head, batch)) instead of a varlen call with seqused_q (its SingleTileVarlenScheduler: each
program looks its piece up); the diagonal call's pieces form a few strided runs (one per sequence
and one of the short last pieces when S % C != 0; one run otherwise), each a dense causal call.
B=4, S=8192 (Qwen3-8B TP=2 shard), for each C and each variant (``varlen``: every call varlen;
``dense``: the full calls dense; ``dense_diag``: the diagonal runs too): every state row (out and
lse, torch.equal to ``varlen``'s, rows no call writes excluded by their lse = -inf) and the
merged forward and the backward's gradients; then, interleaved, forward and forward+backward
through the ops under each variant and single pass, timed two ways (each call alone,
synchronized before and after, median of SYNCED_REPS; and benchmarks/canonical.py's training
method: each function's calls back to back, interleaved repetitions, median); and the forward's
kernel time by kind under torch.profiler.
Usage: [CHUNKS=768,1024] [VARIANTS=varlen,dense,dense_diag] [SYNCED_REPS=15]
       python3 benchmarks/probe_train_dense_slots.py OUT.json
"""
from __future__ import annotations

import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import add_row, write_rows  # noqa: E402  (benchmarks/_report.py)
from profile_training import profiled  # noqa: E402  (benchmarks/profile_training.py)

import torch  # noqa: E402

from rlk_ops.kernels.cpu import canonical  # noqa: E402
from rlk_ops.kernels.fa4 import canonical as fa4_canonical  # noqa: E402

CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "768,1024").split(","))
SYNCED_REPS = int(os.environ.get("SYNCED_REPS", "15"))
VARIANTS = tuple(os.environ.get("VARIANTS", "varlen,dense,dense_diag").split(","))


@contextlib.contextmanager
def variant(name: str):
    """The switches of a variant (process-wide inside the block, restored after)."""
    slots, diag = {"varlen": (False, 0), "dense": (True, 0), "dense_diag": (True, 8)}[name]
    with fa4_canonical.dense_slots(slots), fa4_canonical.dense_diagonal(diag):
        yield


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    sh = cb.Shapes()
    b = cb.Bench("cuda", sh, None, False)
    bsz, s = sh.train
    q, k, v, dout = b.train_inputs()
    fwd_op, bwd_op = torch.ops.rlk.attention_fwd, torch.ops.rlk.attention_bwd
    qf, kf, vf = (t.reshape(-1, t.shape[2], t.shape[3]) for t in (q, k, v))
    seqs = tuple((i * s, s, i * s, s) for i in range(bsz))
    rows = []
    for c in CHUNKS:
        pol = f"canonical:{c}"
        plan = canonical.cached_plan(seqs, c, True, str(q.device))
        row = {"C": c, "full_calls": sum(not x.causal for x in plan.calls),
               "strided_full_calls": sum(not x.causal and x.strided_batch is not None for x in plan.calls)}
        row["diagonal_runs"] = len(plan.calls[0].strided_runs)
        states, res = {}, {}
        for name in VARIANTS:
            with variant(name):
                states[name] = canonical.run(plan, qf, kf, vf, b.scale, fa4_canonical.attend_into,
                                             lambda o, l: (o.clone(), l.clone()), streams=1)
                out, lse = fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, pol)
                res[name] = (out, lse, *bwd_op(dout, q, k, v, out, lse, None, 1, b.scale, None, None, 0, 0, pol))
        o0, l0 = states[VARIANTS[0]]
        written = (l0 != -math.inf).transpose(1, 2)                    # [N, T, H]: rows a call wrote
        for name in VARIANTS[1:]:
            o1, l1 = states[name]
            row[f"{name}_state_lse_equal"] = cb.beq(l0, l1)
            row[f"{name}_state_out_equal"] = bool(torch.equal(o0[written], o1[written]))
            row[f"{name}_fwd_bwd_equal"] = all(cb.beq(x, y) for x, y in zip(res[VARIANTS[0]], res[name]))
        del states, o0, l0, res, written

        fns = {}
        for name, p in (("single", "disabled"), *((n, pol) for n in VARIANTS)):
            def fwd(p=p, name=name):
                with variant("varlen" if name == "single" else name):
                    return fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, p)

            def fwd_bwd(p=p, name=name):
                with variant("varlen" if name == "single" else name):
                    out, lse = fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, p)
                    return bwd_op(dout, q, k, v, out, lse, None, 1, b.scale, None, None, 0, 0, p)
            fns[f"{name}/fwd"], fns[f"{name}/fwd_bwd"] = fwd, fwd_bwd
        for fn in fns.values():  # compiles, plans, recordings
            fn()
        synced = b.alone_us(fns, SYNCED_REPS)
        table = b.eager_us(fns)
        for name in fns:
            row[f"{name}_synced_us"] = round(synced[name], 1)
            row[f"{name}_table_us"] = table[name]
        for name in VARIANTS:
            for ph in ("fwd", "fwd_bwd"):
                row[f"{name}_{ph}_synced_over_single"] = round(row[f"{name}/{ph}_synced_us"]
                                                               / row[f"single/{ph}_synced_us"], 3)
                row[f"{name}_{ph}_table_over_single"] = round(row[f"{name}/{ph}_table_us"]
                                                              / row[f"single/{ph}_table_us"], 3)
        for name in ("single", *VARIANTS):  # kernel time per kind, forward
            per = profiled(fns[f"{name}/fwd"], 3)[1]
            row[f"{name}_fwd_kernel_us"] = {x: round(y, 1) for x, y in sorted(per.items())}
        add_row(out_path, rows, row)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main()
