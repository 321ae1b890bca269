"""Probe (H200): canonical:C training's full calls as dense FA4 calls (fa4 canonical.DENSE_SLOTS).

A dense [B, S] batch's full pieces (the queries after chunk c against chunk c's keys, in every
sequence) form one strided batch, so each full call can be one dense non-causal FA4 call on
strided views of q/k/v and of its state slot, which FA4 schedules persistently, instead of a
varlen call with seqused_q (one program per tile). B=4, S=8192 (Qwen3-8B TP=2 shard), for each C:
every state row (out and lse, torch.equal, rows no call writes excluded by their lse = -inf) and
the merged forward and the backward's gradients, dense against varlen; then, interleaved,
forward and forward+backward through the ops with DENSE_SLOTS off and on and single pass, timed
two ways (each call alone, synchronized before and after, median of SYNCED_REPS; and
benchmarks/canonical.py's training method: each function's calls back to back, interleaved
repetitions, median); and the FA4 forward kernels' time summed under torch.profiler.
Usage: [CHUNKS=768,1024] [SYNCED_REPS=15] python3 benchmarks/probe_train_dense_slots.py OUT.json
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402  (benchmarks/_report.py)
from profile_training import profiled  # noqa: E402  (benchmarks/profile_training.py)

import torch  # noqa: E402

from rlk_ops.kernels.cpu import canonical  # noqa: E402
from rlk_ops.kernels.fa4 import canonical as fa4_canonical  # noqa: E402

CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "768,1024").split(","))
SYNCED_REPS = int(os.environ.get("SYNCED_REPS", "15"))


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
        states = {}
        for on in (False, True):
            with fa4_canonical.dense_slots(on):
                states[on] = canonical.run(plan, qf, kf, vf, b.scale, fa4_canonical.attend_into,
                                           lambda o, l: (o.clone(), l.clone()), streams=1)
        (o0, l0), (o1, l1) = states[False], states[True]
        written = (l0 != -math.inf).transpose(1, 2)                    # [N, T, H]: rows a call wrote
        row["state_lse_equal"] = cb.beq(l0, l1)
        row["state_out_equal"] = bool(torch.equal(o0[written], o1[written]))
        res = {}
        for on in (False, True):
            with fa4_canonical.dense_slots(on):
                out, lse = fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, pol)
                res[on] = (out, lse, *bwd_op(dout, q, k, v, out, lse, None, 1, b.scale, None, None, 0, 0, pol))
        row["fwd_bwd_equal"] = all(cb.beq(x, y) for x, y in zip(res[False], res[True]))
        del states, o0, l0, o1, l1, res

        fns = {}
        for name, p, on in (("single", "disabled", False), ("varlen", pol, False), ("dense", pol, True)):
            def fwd(p=p, on=on):
                with fa4_canonical.dense_slots(on):
                    return fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, p)

            def fwd_bwd(p=p, on=on):
                with fa4_canonical.dense_slots(on):
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
        for name in ("varlen", "dense"):
            for ph in ("fwd", "fwd_bwd"):
                row[f"{name}_{ph}_synced_over_single"] = round(row[f"{name}/{ph}_synced_us"]
                                                               / row[f"single/{ph}_synced_us"], 3)
                row[f"{name}_{ph}_table_over_single"] = round(row[f"{name}/{ph}_table_us"]
                                                              / row[f"single/{ph}_table_us"], 3)
        for name in ("single", "varlen", "dense"):  # kernel time per kind, forward
            per = profiled(fns[f"{name}/fwd"], 3)[1]
            row[f"{name}_fwd_kernel_us"] = {x: round(y, 1) for x, y in sorted(per.items())}
        print(row, flush=True)
        rows.append(row)
        write_rows(out_path, rows)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main()
