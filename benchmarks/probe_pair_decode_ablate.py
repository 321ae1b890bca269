"""Probe (H200): where the 'keys' decode-pair kernel's time per key block goes. Each ablation
removes one piece of the block loop (wrong bits on purpose; timing only): 1 = K/V read from the
same 128 cache rows every block (L2-resident: no HBM traffic), 2 = no per-thread row sums,
4 = no P @ V MMA, 16 = no exponentials. Times at batch 1 / 8k for C = 512 and 2048 (4 and 16 key
blocks per pair, 32 and 8 pairs x 4 KV heads of CTAs); the slope is the per-block cost.
results/h200/pair_decode/ablate_transposed_pv.json came from commit fbf14d6's kernel (4 warps,
prefetch 2, the transposed P @ V); the kernel and its default prefetch have changed since.
Usage: python3 benchmarks/probe_pair_decode_ablate.py OUT.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import write_rows  # noqa: E402  (benchmarks/_report.py)

from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

ABLATIONS = (0, 1, 2, 4, 16, 2 | 4, 2 | 4 | 16, 1 | 2 | 4 | 16)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = []
    sh = cb.replace(cb.Shapes(), decode_page=16, target_ms=2.0, reps=3)
    b = cb.Bench("cuda", sh, None, False)
    for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(((1, 8192),)):
        for cfg in ((4, 3),):
            for abl in ABLATIONS:
                row = {"batch": bsz, "context": ctx, "config": cfg, "ablate": abl}
                for c in (512, 2048):
                    row[f"C{c}_us"] = round(b.graph_us(lambda c=c: pd.pair_decode(
                        q, kc, vc, pt, sl, b.scale, c, config=cfg, layout="keys", ablate=abl)), 2)
                row["us_per_block"] = round((row["C2048_us"] - row["C512_us"]) / 12, 3)
                print(row, flush=True)
                res.append(row)
    write_rows(out, res)


if __name__ == "__main__":
    main()
