"""Probe (H200): where the canonical:C training forward's op-path time goes. benchmarks/canonical.py's
training table times the forward through torch.ops.rlk.attention_fwd ("fwd") and, for the same C
and side streams, kernels/cpu/canonical.attention_fwd called directly ("fwd, 4 side streams"); in
session 11 the op path was 90-440 us slower at C=640 and varied run to run while the direct one
did not. Here, interleaved (eager, CUDA-synchronized, median of REPS): the op, the op with value
checks off, the fa4 backend function (no op wrapper), the direct call, the direct call with FA4's
kernel calls replayed from a recording (fa4 canonical.PREPARED_CALLS, kernels/fa4/prepared.py),
and the host time each takes to return (no sync: the launch overhead the GPU may wait on). Same
bits expected everywhere (checked).
Usage: [CHUNKS=640,1024] [REPS=10] python3 benchmarks/probe_train_fwd_paths.py OUT.json
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import add_row  # noqa: E402  (benchmarks/_report.py)

import torch  # noqa: E402

import rlk_ops  # noqa: E402
from rlk_ops.kernels.cpu import canonical  # noqa: E402
from rlk_ops.kernels.fa4 import canonical as fa4_canonical  # noqa: E402
from rlk_ops.kernels.fa4 import kernels as fa4_kernels  # noqa: E402

CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "640,1024").split(","))
REPS = int(os.environ.get("REPS", "10"))


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    sh = cb.replace(cb.Shapes(), reps=REPS)
    b = cb.Bench("cuda", sh, None, False)
    bsz, s = sh.train
    q, k, v = b.rand(bsz, s, sh.hq, sh.d), b.rand(bsz, s, sh.hkv, sh.d), b.rand(bsz, s, sh.hkv, sh.d)
    rows = []
    for c in CHUNKS:
        pol = f"canonical:{c}"

        def op():
            return torch.ops.rlk.attention_fwd(q, k, v, 1, b.scale, None, None, 0, 0, pol)

        def op_unchecked():
            with rlk_ops.value_checks(False):
                return op()

        fns = {"op": op, "op_value_checks_off": op_unchecked,
               "backend_fn": lambda: fa4_kernels.attention_fwd(q, k, v, 1, b.scale, None, None, 0, 0, pol),
               "direct": lambda: canonical.attention_fwd(q, k, v, True, b.scale, None, None, c,
                                                         attend_into=fa4_canonical.attend_into,
                                                         streams=fa4_canonical.STREAMS),
               "direct_prepared": lambda: canonical.attention_fwd(q, k, v, True, b.scale, None, None, c,
                                                                  attend_into=prepared_attend,
                                                                  streams=fa4_canonical.STREAMS)}

        def prepared_attend(*args):
            with fa4_canonical.prepared_calls():
                fa4_canonical.attend_into(*args)

        ref = op()
        row = {"C": c, "streams": fa4_canonical.STREAMS}
        for name, fn in list(fns.items()):
            try:
                got = fn()
            except Exception as e:  # noqa: BLE001 - recorded (say, a prepared call refused); the rest is timed
                row[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                del fns[name]
                continue
            row[name + "_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
        t = b.eager_us(fns)
        for name, fn in fns.items():
            row[name + "_us"] = t[name]
            host = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
            row[name + "_host_us"] = round(statistics.median(host), 1)
        add_row(out_path, rows, row)


if __name__ == "__main__":
    main()
