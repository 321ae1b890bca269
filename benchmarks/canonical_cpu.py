"""canonical:C vs single pass on the CPU reference: cost and accuracy against float64 math.

    .venv/bin/python benchmarks/canonical_cpu.py                  # writes results/cpu/canonical.json
    .venv/bin/python benchmarks/canonical_cpu.py --only cost      # re-measure one section, keep the others
    .venv/bin/python benchmarks/canonical_cpu.py --quick --out /tmp/c.json

1. ``accuracy``: bf16 (and fp32) inputs, one causal sequence; for single pass and each C:
   relative Frobenius error of out, max |lse - ref|, and the relative error of dq/dk/dv
   from (a) the backward rlk uses under canonical:C (one single-pass backward at the merged
   out/lse) and (b) the explicit chain rule through merge_attn_states_bwd, chunk by chunk.
   Two input scales: q ~ N(0, 1) (flat softmax) and q ~ N(0, 4^2) (peaked).
   ``accuracy_long``: the forward alone at 4096 tokens, so C=128 merges up to 32 states.
2. ``cost``: seconds (wall and process CPU; min and median of interleaved repeats: on a
   shared machine the min is the stabler estimate of the work) of the training forward,
   forward+backward, paged decode and chunked prefill, canonical:C / single pass.

The CPU reference is a readable definition, not a fast kernel: the costs say what CI pays,
not what a GPU backend will. Shapes are small because the reference is slow.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import rlk_ops  # noqa: E402
from conftest import ref_attention, rel_err  # noqa: E402
from test_canonical import _chain_rule_backward  # noqa: E402


def _inputs(s, hq, hkv, d, q_std, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, hq, d, generator=g) * q_std
    k = torch.randn(1, s, hkv, d, generator=g)
    v = torch.randn(1, s, hkv, d, generator=g)
    dout = torch.randn(1, s, hq, d, generator=g)
    dlse = torch.randn(1, hq, s, generator=g)
    return [t.to(dtype) for t in (q, k, v, dout)] + [dlse]


def _reference(q, k, v, dout, dlse):
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = ref_attention(qd, kd, vd)
    grads = torch.autograd.grad((out * dout.double()).sum() + (lse * dlse.double()).sum(), (qd, kd, vd))
    return out.detach(), lse.detach(), grads


def accuracy(s, hq, hkv, d, chunks, dtypes, q_stds, grads=True) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for q_std in q_stds:
            q, k, v, dout, dlse = _inputs(s, hq, hkv, d, q_std, dtype)
            if grads:
                ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, dlse)
            else:
                ref_out, ref_lse = ref_attention(q, k, v)
            for policy in ["disabled", *[f"canonical:{c}" for c in chunks]]:
                out, lse = rlk_ops.attention(q, k, v, split_kv=policy)
                row = {"dtype": str(dtype).split(".")[-1], "q_std": q_std, "split_kv": policy,
                       "out_rel_err": rel_err(out, ref_out),
                       "out_max_abs_err": (out.double() - ref_out).abs().max().item(),
                       "lse_max_abs_err": (lse.double() - ref_lse).abs().max().item()}
                line = (f"  {row['dtype']:>8} q_std {q_std:<3} {policy:<15} out {row['out_rel_err']:.3e}  "
                        f"lse {row['lse_max_abs_err']:.2e}")
                if grads:
                    got = torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dlse, 1, d ** -0.5, None, None, 0, 0,
                                                      policy)
                    row.update({f"{n}_rel_err": rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref_grads)})
                    line += "  " + "  ".join(f"{n} {row[n + '_rel_err']:.3e}" for n in ("dq", "dk", "dv"))
                    if policy != "disabled":
                        chain = _chain_rule_backward(q, k, v, dout, dlse, int(policy.split(":")[1]), True)
                        row.update({f"{n}_rel_err_chain_rule": rel_err(g, r)
                                    for n, g, r in zip(("dq", "dk", "dv"), chain, ref_grads)})
                        line += "  (chain rule: " + "  ".join(
                            f"{n} {row[n + '_rel_err_chain_rule']:.3e}" for n in ("dq", "dk", "dv")) + ")"
                rows.append(row)
                print(line, flush=True)
    return rows


def _time(fns: dict, repeats: int) -> dict:
    """Min and median wall and process-CPU seconds per callable, repeats interleaved."""
    wall = {n: [] for n in fns}
    cpu = {n: [] for n in fns}
    for name, fn in fns.items():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {n: {"wall_s": statistics.median(wall[n]), "cpu_s": statistics.median(cpu[n]),
                "wall_min_s": min(wall[n]), "cpu_min_s": min(cpu[n])} for n in fns}


def _paged(k, v, page_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    bsz, s, hkv, d = k.shape
    per = math.ceil(s / page_size)
    k_cache = torch.zeros(bsz * per, page_size, hkv, d, dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(bsz * per, generator=g)
    table = perm.view(bsz, per).int()
    for b in range(bsz):
        slots = (table[b].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:s]
        rlk_ops.paged_kv_append(k_cache, v_cache, k[b], v[b], slots)
    return k_cache, v_cache, table


def cost(s, bsz, hq, hkv, d, chunks, repeats) -> dict:
    q, k, v, dout, _ = _inputs(s, hq, hkv, d, 1.0, torch.bfloat16)
    policies = ["disabled", *[f"canonical:{c}" for c in chunks]]
    res = {}

    def fwd_bwd(policy):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = rlk_ops.attention(qr, kr, vr, split_kv=policy)
        torch.autograd.grad((out.float() * dout.float()).sum(), (qr, kr, vr))

    res["train_forward"] = _time({p: (lambda p=p: rlk_ops.attention(q, k, v, split_kv=p)) for p in policies}, repeats)
    res["train_forward_backward"] = _time({p: (lambda p=p: fwd_bwd(p)) for p in policies}, repeats)
    qb, kb, vb = (t.expand(bsz, *t.shape[1:]).contiguous() for t in (q, k, v))
    k_cache, v_cache, table = _paged(kb, vb, 16)
    lens = torch.full((bsz,), s, dtype=torch.int32)
    res["paged_decode"] = _time({p: (lambda p=p: rlk_ops.paged_attention(qb[:, -1:], k_cache, v_cache, table, lens,
                                                                       split_kv=p)) for p in policies}, repeats)
    start = s - s // 4
    res["paged_chunked_prefill"] = _time({p: (lambda p=p: rlk_ops.paged_attention(
        qb[:, start:], k_cache, v_cache, table, lens, split_kv=p)) for p in policies}, repeats)
    for case in res.values():
        base = case["disabled"]
        for p in policies[1:]:
            for key in ("wall_s", "cpu_s", "wall_min_s", "cpu_min_s"):
                case[p][key.replace("_s", "_ratio_vs_disabled")] = case[p][key] / base[key]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "cpu", "canonical.json"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the script, proves nothing")
    ap.add_argument("--only", choices=["accuracy", "accuracy_long", "cost"], default=None,
                    help="measure one section and keep the others of an existing --out file")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: process CPU time is not inflated by spinning threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        acc_shape, chunks, cost_shape, repeats = dict(s=300, hq=2, hkv=1, d=16), [128, 256], (300, 2, 2, 1, 16), 1
        long_shape, long_chunks = dict(s=600, hq=1, hkv=1, d=16), [128]
    else:
        acc_shape, chunks, cost_shape, repeats = dict(s=1024, hq=4, hkv=1, d=128), [128, 256, 512, 1024], \
            (1024, 4, 4, 1, 128), 15
        long_shape, long_chunks = dict(s=4096, hq=1, hkv=1, d=128), [128, 1024]
    report = {}
    if args.only and os.path.exists(args.out):
        with open(args.out) as f:
            report = json.load(f)
    report["what"] = "canonical:C vs single pass (split_kv disabled) on the CPU reference"
    metric = ("out: ||out - ref|| / ||ref|| (Frobenius); lse: max abs; grads: relative Frobenius; ref: float64 math; "
              "loss = sum(out*dout) + sum(lse*dlse)")
    if args.only in (None, "accuracy"):
        print("accuracy against float64 math:")
        acc = accuracy(**acc_shape, chunks=chunks, dtypes=(torch.bfloat16, torch.float32), q_stds=(1.0, 4.0))
        report["accuracy"] = {"shape": {**acc_shape, "causal": True, "batch": 1}, "metric": metric, "rows": acc}
    if args.only in (None, "accuracy_long"):
        print("accuracy against float64 math, long sequence, forward:")
        acc = accuracy(**long_shape, chunks=long_chunks, dtypes=(torch.bfloat16,), q_stds=(1.0, 4.0), grads=False)
        report["accuracy_long"] = {"shape": {**long_shape, "causal": True, "batch": 1}, "metric": metric, "rows": acc}
    if args.only in (None, "cost"):
        print("cost:")
        s, bsz, hq, hkv, d = cost_shape
        costs = cost(s, bsz, hq, hkv, d, chunks, repeats)
        for name, case in costs.items():
            print(f"  {name:<24}" + "  ".join(f"{p} {v['cpu_min_s']:.3f}s" for p, v in case.items()))
        report["cost"] = {"shape": dict(zip(("s", "batch_paged", "hq", "hkv", "d"), cost_shape)),
                          "dtype": "bfloat16", "page_size": 16, "chunked_prefill_queries": s // 4,
                          "repeats": repeats, "cases": costs,
                          "environment": {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                                          "load_avg_1m_at_end": os.getloadavg()[0]}}
    report["environment"] = {"torch": torch.__version__, "python": platform.python_version(), "quick": args.quick}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
