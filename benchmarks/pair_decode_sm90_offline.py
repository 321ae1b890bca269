"""Compile rlk_ops/kernels/triton/pair_decode.py for sm90 on a machine without a GPU and report
what the compiler made of it: the key-block loop's SASS (instructions per warp per block, top
opcodes; nvdisasm), registers, spills and shared memory (ptxas), layout conversions and async
copies (TTGIR).

    python benchmarks/pair_decode_sm90_offline.py [--layout keys] [--warps 8] [--stages 3]
                                                  [--prefetch 3] [--split 8] [--merge] [--ahead] [--l2]
                                                  [--slices 4] [--pdl] [--early] [--ablate BITS]
                                                  [--sass FILE]

Use the Triton the GPU runs (the H200 has 3.6.0; 3.9 makes other choices, e.g. wgmma for the
'keys' dots): ``pip install triton==3.6.0`` next to torch. Pointer and size arguments are marked
16-divisible, as a launch specialises them; without that the compiler cannot vectorise the K/V
loads and the report would describe another kernel. Nothing here runs the kernel: speed and
bits are measured on the GPU (benchmarks/probe_pair_decode.py, tests/test_triton_pair_decode.py).
On the H200 the loop's instruction count tracked the time per key block (ncu, run 4: ~1,175
executed per warp per block at ~4 cycles each): 966 (rows of S^T on every warp) -> 644 (split, 4
warps) -> 412 (8 warps) offline, ~2.2 -> ~1.7 us per block measured.
"""
from __future__ import annotations

import argparse
import collections
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
FUSED = {"n_chunks": "i32", "counts": "*i32", "merged_out": "*bf16", "merged_lse": "*fp32", "log_c": "*fp64"}
CONSTS = {"G": 4, "HQ": 16, "HKV": 4, "D": 128, "BN": pd.BLOCK_N, "EMU": False, "SUMS": False, "INIT_FMA": True}
DIVISIBLE = (*POINTERS, "chunk", "page", "counts", "merged_out", "merged_lse", "log_c")


def bindir() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def ptxas() -> str:
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bindir(), name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"no ptxas in {bindir()}")


def loop_sass(sass: str) -> list[str]:
    """The instructions of the longest backward-branch loop that holds a tensor-core op, its
    back edge before the kernel's last EXIT (with TMA loads, the out-of-line retries of a barrier
    wait sit past it and branch back into the loop: not loops of the program's own)."""
    labels, instrs, pending = {}, [], None
    for line in sass.splitlines():
        lab = re.match(r"\s*\.L_x_(\d+):", line)
        if lab:
            pending = lab.group(1)
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            if pending is not None:
                labels[pending], pending = addr, None
            instrs.append((addr, m.group(2)))
    exits = [addr for addr, ins in instrs if re.search(r"\bEXIT\b", ins)]
    loops = []
    for addr, ins in instrs:
        if exits and addr > exits[-1]:
            continue
        t = re.search(r"BRA.*\.L_x_(\d+)", ins)
        if t and labels.get(t.group(1), addr + 1) < addr:
            body = [i for a, i in instrs if labels[t.group(1)] <= a <= addr]
            if any("HMMA" in i or "HGMMA" in i for i in body):
                loops.append(body)
    return max(loops, key=len) if loops else []


def assembled(kernel, sass_path: str | None = None):
    """A compiled kernel's TTGIR and PTX, ptxas's register and spill lines, its block loop's
    SASS (``loop_sass``) and that loop's opcode counts; ``sass_path``: the whole SASS written
    there (the TTGIR to sass_path + ".ttgir")."""
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
        cubin = os.path.join(tmp, "k.cubin")
        sass = subprocess.run([os.path.join(bindir(), "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True).stdout if os.path.exists(cubin) else ""
    usage = [line.split("info    :")[-1].strip() for line in out.stderr.splitlines()
             if "registers" in line or "spill" in line] or [out.stderr.strip()[-300:]]
    if sass_path:
        with open(sass_path, "w") as f:
            f.write(sass)
        with open(sass_path + ".ttgir", "w") as f:
            f.write(ttgir)
    body = loop_sass(sass)
    ops = collections.Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in body)
    return ttgir, ptx, usage, body, ops


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=sorted(pd.LAYOUTS), default="keys")
    ap.add_argument("--warps", type=int, default=pd.NUM_WARPS)
    ap.add_argument("--stages", type=int, default=pd.NUM_STAGES)
    ap.add_argument("--prefetch", type=int, default=3, help="keys: PF (see pair_decode; 4: K/V tiles by TMA)")
    ap.add_argument("--split", type=int, default=None, help="keys: key groups of QK^T (default: warps)")
    ap.add_argument("--blocks", type=int, default=8, help="keys: key blocks per chunk (NBC)")
    ap.add_argument("--merge", action="store_true", help="keys: the fused merge")
    ap.add_argument("--nmax", type=int, default=8, help="keys, merge: the states side by side (a power of two)")
    ap.add_argument("--seq-major", action="store_true", help="keys: programs in sequence-major order")
    ap.add_argument("--off64", action="store_true", help="tile: int64 cache offsets")
    ap.add_argument("--page", type=int, default=16, help="tile: page size (compile time)")
    ap.add_argument("--heads-first", action="store_true", help="keys, tile: one pair's KV heads adjacent")
    ap.add_argument("--ahead", action="store_true", help="keys: next block's scores before this block's softmax")
    ap.add_argument("--l2", action="store_true", help="keys: every K/V line prefetched into L2 up front")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread (Triton's maxnreg)")
    ap.add_argument("--slices", type=int, default=1, help="keys: head-dim slices of V and O (DS)")
    ap.add_argument("--pdl", action="store_true", help="keys: let the next launch start early (PDL)")
    ap.add_argument("--early", action="store_true", help="keys: page-table loads not waiting for seq_lens (EARLY)")
    ap.add_argument("--ablate", type=int, default=0, help="keys: ABL, pieces of the loop removed (wrong bits; "
                                                           "what each costs offline: pair_decode's ablate)")
    ap.add_argument("--sass", help="write the whole kernel's SASS here (to diff two builds; TTGIR to FILE.ttgir)")
    return ap


def build(args: argparse.Namespace):
    """The sm90 compile of the variant ``args`` names (``parser()``'s options): ``(kernel, consts)``.
    tests/test_sm90_compile.py compiles every layout this way on CI's CPU machine, so a variant
    that no longer builds is caught before a GPU run."""
    fn, rows = pd.LAYOUTS[args.layout](CONSTS["G"])
    consts = dict(CONSTS, M=rows)
    sig = {**POINTERS, **SCALARS}
    if args.layout == "keys":
        sig.update(FUSED)
        consts.update(PF=args.prefetch, NBC=args.blocks, ABL=args.ablate, SPLIT=args.warps if args.split is None else args.split,
                      FUSE=int(args.merge), LIBDEVICE=1, NMAX=args.nmax,
                      SEQ_MAJOR=int(args.seq_major), GP=triton.next_power_of_2(CONSTS["G"]),
                      LOG_NP=max(args.nmax, 1).bit_length() - 1,
                      DSL=max(min(CONSTS["D"], pd.VEC_TILE // (triton.next_power_of_2(CONSTS["G"]) * max(args.nmax, 1))), 1))
    if args.layout == "tile":
        consts.update(OFF32=int(not args.off64), HEADS_FIRST=int(args.heads_first), PAGE=args.page)
    elif args.layout == "keys":
        consts.update(HEADS_FIRST=int(args.heads_first), AHEAD=int(args.ahead), L2PF=int(args.l2), DS=args.slices,
                      PDL=int(args.pdl), EVICT="", EARLY=int(args.early))
    if args.layout == "keys" and args.prefetch == 4:   # K/V tiles by TMA: host-side tensor descriptors
        sig.update(kc=f"tensordesc<bf16[{pd.BLOCK_N},1,{CONSTS['D']}]>",
                   vc=f"tensordesc<bf16[{pd.BLOCK_N},1,{CONSTS['D'] // args.slices}]>")
    sig.update({k: "constexpr" for k in consts})
    sig = {name: sig[name] for name in fn.arg_names if name in sig}    # the kernel's parameter order
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items() if k in names},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE
                           if n in names and not sig[n].startswith("tensordesc")})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": args.warps, "num_stages": args.stages, "enable_fp_fusion": False,
                                     **({"maxnreg": args.maxnreg} if args.maxnreg else {})})
    return kernel, consts


def main():
    args = parser().parse_args()
    kernel, consts = build(args)
    ttgir, ptx, usage, body, ops = assembled(kernel, args.sass)
    print(f"pair_decode sm90 (Triton {triton.__version__}), layout {args.layout}, num_warps {args.warps}, "
          f"num_stages {args.stages}" + (f", prefetch {args.prefetch}, split {consts['SPLIT']}, merge {args.merge}"
                                         if args.layout == "keys" else ""))
    print(f"  loop SASS per warp per key block: {len(body)} instructions; {ops.most_common(12)}")
    print(f"  TTGIR: convert_layout {ttgir.count('convert_layout')}, async copies "
          f"{ttgir.count('async_copy_global_to_local')}; shared memory {kernel.metadata.shared} bytes")
    print("  ptxas:", "; ".join(usage))


if __name__ == "__main__":
    main()
