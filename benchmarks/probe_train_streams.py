"""Probe (H200): side streams for canonical:C training's calls now that its full calls are dense
(fa4 canonical.DENSE_SLOTS; FA4's dense grid is not persistent on SM90, so a call's last wave can
overlap the next call's first on another stream), with the diagonal call varlen and as dense runs
(DENSE_DIAGONAL_RUNS). B=4, S=8192, the forward (kernels/cpu/canonical.attention_fwd with the fa4
in-place calls) on 1..6 side streams, interleaved (canonical.py's eager method, median), and its
out/lse torch.equal to the 1-stream varlen-diagonal forward's.
Usage: [CHUNKS=768] python3 benchmarks/probe_train_streams.py OUT.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import add_row, write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.cpu import canonical  # noqa: E402
from rlk_ops.kernels.fa4 import canonical as fa4_canonical  # noqa: E402

CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "768").split(","))
STREAMS = (1, 2, 3, 4, 6)


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    sh = cb.Shapes()
    b = cb.Bench("cuda", sh, None, False)
    q, k, v, _ = b.train_inputs()
    rows = []
    for c in CHUNKS:
        def fwd(n, diag):
            with fa4_canonical.dense_diagonal(diag):
                return canonical.attention_fwd(q, k, v, True, b.scale, None, None, c,
                                               attend_into=fa4_canonical.attend_into, streams=n)

        fns = {f"streams_{n}{'_diag' if diag else ''}": (lambda n=n, diag=diag: fwd(n, diag))
               for diag in (0, 8) for n in STREAMS}
        ref = fns["streams_1"]()
        row = {"C": c, "routed_streams": fa4_canonical.STREAMS, "dense_slots": fa4_canonical.DENSE_SLOTS,
               "routed_diagonal_runs": fa4_canonical.DENSE_DIAGONAL_RUNS}
        for name, fn in fns.items():
            got = fn()
            row[name + "_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
        t = b.eager_us(fns)
        row.update({name + "_fwd_us": t[name] for name in fns})
        add_row(out_path, rows, row)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main()
