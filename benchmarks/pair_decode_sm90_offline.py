"""Compile rlk_ops/kernels/triton/pair_decode.py for sm90 on a machine without a GPU and report
what the compiler made of it: layout conversions and async copies (TTGIR), shared-memory
traffic and barriers, in the key-block loop and in all (PTX), registers and spills (ptxas).

    python benchmarks/pair_decode_sm90_offline.py [--warps 4] [--stages 2]

Needs triton (its bundled ptxas; the sm90-capable one is ``ptxas-blackwell`` in Triton 3.9).
Pointer and size arguments are marked 16-divisible, as a launch specialises them; without that
the compiler cannot vectorise the K/V loads and the report would describe another kernel.
Nothing here runs the kernel: speed and bits are measured on the GPU
(benchmarks/probe_pair_decode.py, tests/test_triton_pair_decode.py).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

POINTERS = {"q": "*bf16", "kc": "*bf16", "vc": "*bf16", "table": "*i32", "seq_lens": "*i32", "out": "*bf16",
            "lse": "*fp32", "pair_lens": "*i32", "sums": "*fp32"}
SCALARS = {"scale_log2": "fp32", "bsz": "i32", "width": "i32", "chunk": "i32", "page": "i32"}
CONSTS = {"G": 4, "HQ": 16, "HKV": 4, "D": 128, "M": pd.ROWS, "BN": pd.BLOCK_N, "EMU": False, "SUMS": False,
          "INIT_FMA": True}
DIVISIBLE = (*POINTERS, "chunk", "page")


def ptxas() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"no ptxas in {folder}")


def loop_body(ptx: str) -> str:
    """The PTX of the key-block loop: from LLVM's inner-loop header label to its back edge."""
    start = ptx.find("Inner Loop Header")
    if start < 0:
        return ""
    label = ptx.rfind("\n", 0, start)
    name = ptx[label + 1:start].split(":")[0].strip()
    end = ptx.find(f"bra \t{name};", start)
    return ptx[start:end if end > 0 else len(ptx)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warps", type=int, default=pd.NUM_WARPS)
    ap.add_argument("--stages", type=int, default=pd.NUM_STAGES)
    args = ap.parse_args()
    sig = {**POINTERS, **SCALARS, **{k: "constexpr" for k in CONSTS}}
    names = list(sig)
    src = ASTSource(fn=pd._pair_decode, signature=sig,
                    constexprs={(names.index(k),): v for k, v in CONSTS.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": args.warps, "num_stages": args.stages, "enable_fp_fusion": False})
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    loop_ir = ttgir[ttgir.find("scf.for"):]
    body = loop_body(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    usage = [line.split("info    :")[-1].strip() for line in out.stderr.splitlines()
             if "registers" in line or "spill" in line]
    print(f"pair_decode sm90, num_warps {args.warps}, num_stages {args.stages}")
    print(f"  TTGIR from the loop on: convert_layout {loop_ir.count('convert_layout')}, "
          f"async copies {ttgir.count('async_copy_global_to_local')}")
    print(f"  PTX loop body: bar.sync {body.count('bar.sync')}, st.shared {body.count('st.shared')}, "
          f"ld.shared {body.count('ld.shared')}, mma.sync {len(re.findall(r'mma.sync', body))}, "
          f"cp.async {body.count('cp.async.')}")
    print(f"  PTX whole kernel: bar.sync {ptx.count('bar.sync')}, cp.async {ptx.count('cp.async.')}")
    print("  ptxas:", "; ".join(usage) or out.stderr.strip()[-300:])


if __name__ == "__main__":
    main()
