"""Eager per-call dispatch overhead of rlk ops (run: `make bench` or this script).

Measures, on tiny tensors where the kernel itself costs little:
1. registration styles for a trivial op: a plain Python call, `Library.define` +
   `impl` (what rlk_ops uses), and `torch.library.custom_op`;
2. each rlk op through `torch.ops.rlk` vs calling its CPU kernel function directly
   (the difference is dispatcher + validation + backend choice + provenance).
Writes results/cpu/dispatch.json: microseconds per call, the minimum over repeats (the
least-disturbed run: this is a shared 2-core machine), op and kernel timed interleaved.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import rlk_ops
from rlk_ops.kernels import cpu as K


def per_call_us(fn, n: int = 2000, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return min(times)


def registration_styles() -> dict:
    lib = torch.library.Library("rlk_bench", "DEF")
    lib.define("clone_lib(Tensor x) -> Tensor")
    lib.impl("clone_lib", lambda x: x.clone(), "CPU")

    @torch.library.custom_op("rlk_bench::clone_co", mutates_args=())
    def clone_co(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    x = torch.randn(8)
    res = {
        "plain_python_call": per_call_us(lambda: x.clone()),
        "library_define_impl": per_call_us(lambda: torch.ops.rlk_bench.clone_lib(x)),
        "custom_op": per_call_us(lambda: clone_co(x)),
    }
    lib._destroy()
    return res


def rlk_ops_vs_kernels() -> dict:
    x = torch.randn(2, 2, 16)
    w = torch.randn(16)
    pos = torch.arange(2)
    lw = torch.randn(8, 16)
    q = torch.randn(1, 1, 2, 16)
    kc = torch.randn(4, 4, 1, 16)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    cases = {
        "qk_rmsnorm": (lambda: rlk_ops.qk_rmsnorm(x, w, 1e-6), lambda: K.qk_rmsnorm(x, w, 1e-6)),
        "rope": (lambda: rlk_ops.rope(x, pos, 1e6), lambda: K.rope(x, pos, 1e6, 16)),
        "linear": (lambda: rlk_ops.linear(x, lw), lambda: K.linear(x, lw, None)),
        "paged_attention": (lambda: rlk_ops.paged_attention(q, kc, kc, table, lens),
                            lambda: K.paged_attention(q, kc, kc, table, lens, 0.25, "disabled")),
    }
    out = {}
    for name, (op, kernel) in cases.items():
        a, b = [], []
        for _ in range(5):  # interleave, so machine noise hits both alike
            a.append(per_call_us(op, n=300, repeats=3))
            b.append(per_call_us(kernel, n=300, repeats=3))
        a, b = min(a), min(b)
        out[name] = {"op_us": round(a, 2), "kernel_us": round(b, 2), "overhead_us": round(a - b, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/cpu/dispatch.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    styles = {k: round(v, 2) for k, v in registration_styles().items()}
    ops = rlk_ops_vs_kernels()
    result = {"registration_us_per_call": styles, "rlk_op_vs_kernel": ops,
              "environment": rlk_ops.provenance.environment(), "threads": 1}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'registration style':<24} us/call")
    for k, v in styles.items():
        print(f"{k:<24} {v:8.2f}")
    print(f"\n{'rlk op (tiny inputs)':<18} {'op us':>8} {'kernel us':>10} {'overhead':>9}")
    for k, v in ops.items():
        print(f"{k:<18} {v['op_us']:>8.1f} {v['kernel_us']:>10.1f} {v['overhead_us']:>9.1f}")


if __name__ == "__main__":
    main()
