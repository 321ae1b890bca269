"""Probe (H200): where canonical:C training's time goes, kernel by kernel. B=4, S=8192 (Qwen3-8B
TP=2 shard, causal), forward + backward through the ops (torch.ops.rlk.attention_fwd / _bwd),
single pass and canonical:C: torch.profiler's CUDA kernel time summed per kernel kind (FA4's
forward, its backward's kernels, the merge, the rest) over REPS calls, per call, next to the
CUDA-synchronized wall clock of the same calls. benchmarks/canonical.py's training table gives
the ratio; this says which kernels make it (the partial calls' cost above the single pass, the
merge) and how much of the wall clock is no kernel at all (launch gaps, host). Then the same
forward + backward without the profiler, timed two ways in one run: each call alone
(synchronized before and after, policies alternating) and canonical.py's training method (each
policy's calls back to back, interleaved repetitions).
Usage: [CHUNKS=768] [REPS=5] [SYNCED_REPS=15] python3 benchmarks/profile_training.py OUT.json
"""
from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import add_row, write_rows  # noqa: E402  (benchmarks/_report.py)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


CHUNKS = tuple(int(c) for c in os.environ.get("CHUNKS", "768").split(","))
REPS = int(os.environ.get("REPS", "5"))
SYNCED_REPS = int(os.environ.get("SYNCED_REPS", "15"))


def kind(name: str) -> str:
    """A kernel's kind from its name (FA4's CuTe kernels carry their class names)."""
    low = name.lower()
    for key, label in (("merge", "merge"), ("bwd_preprocess", "fa4_bwd_pre"), ("bwdpreprocess", "fa4_bwd_pre"),
                       ("bwd_postprocess", "fa4_bwd_post"), ("bwdpostprocess", "fa4_bwd_post"),
                       ("backward", "fa4_bwd"), ("bwd", "fa4_bwd"), ("forward", "fa4_fwd"), ("fwd", "fa4_fwd")):
        if key in low:
            return label
    return "other"


def profiled(fn, reps: int) -> tuple[float, collections.Counter, collections.Counter]:
    """``reps`` calls of fn under torch.profiler: (wall us per call, CUDA kernel us per call by
    ``kind``, each kernel name's launch count over all calls)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6 / reps
    per_kind, names = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:   # a kernel (or a memset/copy)
            per_kind[kind(e.name)] += e.time_range.elapsed_us() / reps
            names[e.name[:90]] += 1
    return wall, per_kind, names


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    sh = cb.Shapes()
    b = cb.Bench("cuda", sh, None, False)
    q, k, v, dout = b.train_inputs()
    fwd_op, bwd_op = torch.ops.rlk.attention_fwd, torch.ops.rlk.attention_bwd
    rows = []
    for policy in ("disabled", *(f"canonical:{c}" for c in CHUNKS)):
        for phase in ("fwd", "fwd_bwd"):
            def call(p=policy, ph=phase):
                out, lse = fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, p)
                if ph == "fwd_bwd":
                    bwd_op(dout, q, k, v, out, lse, None, 1, b.scale, None, None, 0, 0, p)

            for _ in range(2):  # compiles, plans, recordings
                call()
            wall, per_kind, names = profiled(call, REPS)
            row = {"policy": policy, "phase": phase, "wall_us": round(wall, 1),
                   "kernel_us": {k2: round(v2, 1) for k2, v2 in sorted(per_kind.items())},
                   "kernel_sum_us": round(sum(per_kind.values()), 1),
                   "launches_per_call": round(sum(names.values()) / REPS, 1),
                   "kernels": {n: round(c / REPS, 2) for n, c in names.most_common(12)}}
            add_row(out_path, rows, row)
    # the same calls timed without the profiler, two ways in one run: each call alone (synchronized
    # before and after, the policies alternating, median of SYNCED_REPS), and benchmarks/canonical.py's
    # training method (each policy's calls back to back, interleaved repetitions, median)
    fns = {}
    for policy in ("disabled", *(f"canonical:{c}" for c in CHUNKS)):
        def fwd_bwd(p=policy):
            out, lse = fwd_op(q, k, v, 1, b.scale, None, None, 0, 0, p)
            return bwd_op(dout, q, k, v, out, lse, None, 1, b.scale, None, None, 0, 0, p)
        fns[policy] = fwd_bwd
    synced = b.alone_us(fns, SYNCED_REPS)
    table = b.eager_us(fns)
    for name in fns:
        row = {"policy": name, "phase": "fwd_bwd", "synced_us": round(synced[name], 1),
               "table_method_us": table[name]}
        row["synced_over_single"] = round(row["synced_us"] / synced["disabled"], 3)
        row["table_method_over_single"] = round(table[name] / table["disabled"], 3)
        print(row, flush=True)
        rows.append(row)
    write_rows(out_path, rows)


if __name__ == "__main__":
    main()
