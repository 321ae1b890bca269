"""Probe (GPU): what int64 K offsets cost the Triton linear against int32 ones (``gemm.matmul(offs64=)``).

Session 32's audit found the K offsets of ``kernels/triton/gemm.py`` in int32: the weight gradient reads
dy^T with its K (the tokens) strided by N, and (tokens - 1) * N passes 2^31 at 14k tokens of a 152k-word
lm_head, so dW was wrong there. This probe times both offset widths in one run, interleaved
(``_report.graph_times_us``), at Qwen3-8B projection shapes, forward and weight gradient, and checks that
the two give the same bits wherever int32 does not wrap. Its first run (gemm_offsets_run1.json) timed
another int64 form, the arange cast before the add, against the int32 kernel rebuilt from the old source:
forward 0.97-0.99x, dW 1.10-1.13x at 4096 tokens; the form in gemm.py measured 0.98-1.01x
(gemm_offsets.json), and matmul takes it only where int32 would wrap.
Usage (GPU): python3 benchmarks/probe_gemm_offsets.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _report import graph_times_us, source_digest  # noqa: E402
from rlk_ops.kernels.triton import gemm as G  # noqa: E402

# (M, K, N, what): Qwen3-8B TP=2 projections at decode and prefill sizes, then dW = dy^T @ x of a projection
SHAPES = [(1, 4096, 3072, "qkv"), (64, 4096, 3072, "qkv"), (4096, 4096, 3072, "qkv"), (64, 2048, 4096, "o"),
          (4096, 2048, 4096, "o"), (4096, 4096, 12288, "gate_up")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k, n, what in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
        y_new, y_old = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, n, device="cuda",
                                                                                         dtype=torch.bfloat16)
        dw_new, dw_old = torch.empty(n, k, device="cuda", dtype=torch.bfloat16), torch.empty(n, k, device="cuda",
                                                                                           dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
        fns = {"fwd_int64": lambda: G.matmul(x, w.t(), y_new, offs64=True),
               "fwd_int32": lambda: G.matmul(x, w.t(), y_old, offs64=False),
               "dw_int64": lambda: G.matmul(dy.t(), x, dw_new, offs64=True),
               "dw_int32": lambda: G.matmul(dy.t(), x, dw_old, offs64=False)}
        t = graph_times_us(fns)
        for fn in fns.values():
            fn()
        rows.append({"M": m, "K": k, "N": n, "what": what,
                     "us": {name: round(v["us"], 2) for name, v in t.items()},
                     "fwd_ratio_int64_over_int32": round(t["fwd_int64"]["us"] / t["fwd_int32"]["us"], 4),
                     "dw_ratio_int64_over_int32": round(t["dw_int64"]["us"] / t["dw_int32"]["us"], 4),
                     "fwd_equal": torch.equal(y_new, y_old), "dw_equal": torch.equal(dw_new, dw_old)})
        print(rows[-1], flush=True)
    res = {"script": "benchmarks/probe_gemm_offsets.py", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "source_digest": source_digest(), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gemm_offsets.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
