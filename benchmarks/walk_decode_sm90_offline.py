"""Compile rlk_ops/kernels/triton/walk_decode.py (Gluon) for sm90 on a machine without a GPU and
report what the compiler made of it: the block loop's SASS (instructions per warp per key block,
top opcodes), registers, spills and shared memory, TMA copies and CTA barriers in the PTX.

    python benchmarks/walk_decode_sm90_offline.py [--merge] [--chunk 768] [--page 128] [--np 64]
                                                  [--dsl 8] [--probe 0] [--warps 4] [--ws] [--rows]
                                                  [--sass FILE]

Use the Triton the GPU runs (the H200 has 3.6.0; 3.9 builds it too). Nothing here runs the kernel: bits and speed
are measured on the GPU (tests/test_walk_decode.py, benchmarks/probe_walk_decode.py).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from pair_decode_sm90_offline import assembled  # noqa: E402
from rlk_ops.kernels.triton import walk_decode as wd  # noqa: E402
from rlk_ops.kernels.triton import walk_rows as wr  # noqa: E402


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--merge", action="store_true", help="the in-program merge (MERGE)")
    ap.add_argument("--chunk", type=int, default=768)
    ap.add_argument("--page", type=int, default=128)
    ap.add_argument("--np", type=int, default=64, help="merge: states side by side (a power of two)")
    ap.add_argument("--dsl", type=int, default=wd.MERGE_DSL, help="merge: head-dim columns per step")
    ap.add_argument("--probe", type=int, default=0, help="walk_decode's probe variant (PROBE)")
    ap.add_argument("--warps", type=int, default=wd.NUM_WARPS, help="warps per program (4 or 8)")
    ap.add_argument("--ws", action="store_true", help="the producer-warp variant (WS, maxnreg WS_MAXNREG)")
    ap.add_argument("--rows", action="store_true", help="walk_rows.py: one warp, the queries on M")
    ap.add_argument("--sass", help="write the whole kernel's SASS here (TTGIR to FILE.ttgir)")
    return ap


def build(args: argparse.Namespace):
    """The sm90 compile of the walk with ``parser()``'s options (tests/test_sm90_compile.py)."""
    consts = {"G": 4, "HQ": 16, "HKV": 4, "D": 128, "BN": wd.BLOCK_N, "M": wd.COLS, "NB": args.chunk // wd.BLOCK_N,
              "PAGE": args.page, "NS": wd.STAGES, "MERGE": int(args.merge), "NP": args.np, "DSL": args.dsl,
              "PROBE": args.probe, "NW": args.warps, "WS": int(args.ws)}
    if args.rows:
        consts = {k: v for k, v in consts.items() if k not in ("PROBE", "NW", "WS", "DSL")}
        consts.update(M=wr.ROWS, KS=wr.KSTEP, DS=wr.DSLAB, GP=4, SB=wr.MERGE_STEP)
    hkv, d = consts["HKV"], consts["D"]
    block = [wd.BLOCK_N // hkv, hkv * d] if args.probe == 3 else [wd.BLOCK_N, d]   # probe 3: whole cache rows
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    desc = f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"
    types = {"q": "*bf16", "k_desc": desc, "v_desc": desc, "table": "*i32", "seq_lens": "*i32", "out": "*bf16",
             "lse": "*fp32", "pair_lens": "*i32", "scale_log2": "fp32", "bsz": "i32", "width": "i32", "chunk": "i32",
             "n_pairs": "i32", "merged_out": "*bf16", "merged_lse": "*fp32", "log_c": "*fp64"}
    fn = wr._walk_rows if args.rows else wd._walk_decode
    names = list(fn.arg_names)
    sig = {n: types.get(n, "constexpr") for n in names}
    divisible = [n for n, t in types.items() if t.startswith("*")] + ["chunk"]
    src = GluonASTSource(fn=fn, signature=sig,
                         constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 1 if args.rows else args.warps, "enable_fp_fusion": False,
                                     **({"maxnreg": wd.WS_MAXNREG} if args.ws else {})})
    return kernel


def main():
    args = parser().parse_args()
    kernel = build(args)
    ttgir, ptx, usage, body, ops = assembled(kernel, args.sass)
    warps = "1 warp, queries on M (rows)" if args.rows else f"{args.warps} warps"
    print(f"walk_decode sm90 (Triton {triton.__version__}), merge {args.merge}, C {args.chunk}, page {args.page}, "
          f"{warps}{', producer warp' if args.ws else ''}")
    print(f"  loop SASS per warp per key block: {len(body)} instructions; {ops.most_common(12)}")
    print(f"  PTX: TMA copies {len(re.findall(r'cp[.]async[.]bulk[.]tensor', ptx))}, CTA barriers "
          f"{len(re.findall(r'bar[.]sync|barrier[.]sync', ptx))}, mma.sync {len(re.findall(r'mma[.]sync', ptx))}; "
          f"TTGIR convert_layout {ttgir.count('convert_layout')}; shared memory {kernel.metadata.shared} bytes")
    print("  ptxas:", "; ".join(usage))


if __name__ == "__main__":
    main()
