"""Triton and FlashInfer kernels on one GPU: invariance matrix and speed ratios from one run.

    python benchmarks/kernel_bench.py --out DIR          # writes DIR/kernels.json and DIR/kernels.md

Invariance (every cell a bitwise ``torch.equal``): each op's B=1 rows against the same
rows computed in a larger batch, and run-to-run; ``linear`` rows at M=1/16/256 against
M=4096; FlashInfer policies with one sequence alone against the same sequence in a batch
of 8 (``auto`` is the diagnostic lane, expected to differ).

Speed, all ratios from this one run: the memory-bound kernels (norm, rope, fused,
gather, append) as a fraction of the device-to-device copy bandwidth measured here, and
against the eager PyTorch formula; ``linear`` TFLOP/s against ``torch.matmul``
(cuBLAS) at Qwen3-8B TP=2 shapes; FlashInfer decode per split-KV policy against FA4
paged decode (called directly through ``flash_attn.cute.interface``).

Times are medians of CUDA-graph replays (no launch overhead), except the rlk op-layer
times, which run eagerly because the op's value checks copy to the host.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rlk_ops  # noqa: E402
from _report import graph_time_us  # noqa: E402  (benchmarks/_report.py)
from rlk_ops.kernels import cpu  # noqa: E402
from rlk_ops.kernels.cpu.rope import inv_freq  # noqa: E402
from rlk_ops.meta import provenance  # noqa: E402

HQ, HKV, D = 16, 4, 128  # Qwen3-8B, TP=2 shard
DT = torch.bfloat16
DEV = "cuda"


# ------------------------------------------------------------------------ timing
def gpu_time_us(fn, target_ms: float = 8.0, graph: bool = True) -> dict:
    """Median per-call microseconds of ``fn``: ``_report.graph_time_us`` (n calls captured in
    one CUDA graph, replayed 5 times), falling back to events around eager calls (recorded
    as such) if capture fails; ``graph=False`` times eager calls."""
    return graph_time_us(fn, target_ms, reps=5, max_calls=500, graph=graph, fallback=True)


def eager_time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


# ------------------------------------------------------------------------ helpers
def eq(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def drift(a: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far a CUDA result is from a reference: not a bitwise claim, a report."""
    a, ref = a.detach().cpu(), ref.detach().cpu()
    diff = (a.double() - ref.double()).abs()
    return {"bitwise_equal_fraction": float((a == ref).double().mean()),
            "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
            "rel_err": float(diff.norm() / ref.double().norm().clamp_min(1e-30))}


def randn(*shape, dtype=DT, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


class Report:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.data: dict = {"sections": {}, "errors": {}}

    def section(self, name, fn):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            self.data["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            self.data["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(self.data["errors"][name], flush=True)
        self.data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        self.save()

    def save(self):
        with open(os.path.join(self.out_dir, "kernels.json"), "w") as f:
            json.dump(self.data, f, indent=1)


# --------------------------------------------------------------- copy bandwidth
def _triton_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return lambda s, d: copy_kernel[(triton.cdiv(s.numel(), 4096),)](s, d, s.numel(), BLOCK=4096)


def copy_bandwidth():
    """The best of three device-to-device copies of 512 MiB (bytes read + written). A first
    run timed only ``copy_`` replayed in a CUDA graph and got 2.76 TB/s, below what the
    kernels here reached: in a graph the copy may become a copy-engine memcpy node."""
    src = randn(1 << 28)  # 512 MiB of bf16, far beyond L2
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    tcopy = _triton_copy()
    ways = {"torch_copy_graph": gpu_time_us(lambda: dst.copy_(src)),
            "torch_copy_eager_events": gpu_time_us(lambda: dst.copy_(src), graph=False),
            "triton_copy_kernel_graph": gpu_time_us(lambda: tcopy(src, dst))}
    assert torch.equal(dst, src)
    best = min(ways, key=lambda k: ways[k]["us"])
    return {"bytes": nbytes, "ways_us": {k: v["us"] for k, v in ways.items()},
            "ways_GBps": {k: nbytes / v["us"] / 1e3 for k, v in ways.items()},
            "used": best, "us": ways[best]["us"], "GBps": nbytes / ways[best]["us"] / 1e3}


# ---------------------------------------------------- memory-bound Triton kernels
def memory_bound(copy_gbps: float, tokens: int):
    from rlk_ops.kernels.triton import norm_rope as NR
    from rlk_ops.kernels.triton import paged_kv as PK

    res = {}
    T = tokens
    q, k = randn(T, HQ, D, seed=1), randn(T, HKV, D, seed=2)
    qw, kw = (1 + 0.1 * randn(D, seed=3).float()).to(DT), (1 + 0.1 * randn(D, seed=4).float()).to(DT)
    pos = torch.randint(0, 32768, (T,), device=DEV)
    inv_cpu = inv_freq(1e6, D).to(DEV)

    def eager_norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def eager_rope(x, p):  # the usual formula: cos/sin from positions, rotate-half
        ang = p.float()[:, None] * inv_cpu
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x32 = x.float()
        rot = torch.cat([-x32[..., D // 2:], x32[..., :D // 2]], -1)
        return (x32 * cos + rot * sin).to(x.dtype)

    sub = slice(0, 512)  # rows checked against the CPU reference (kept small: the CPU is slow)
    rows = (0, 1, 15, 16, 17, T - 1)
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731

    # ---- qk_rmsnorm (q)
    y = NR.qk_rmsnorm(q, qw, 1e-6)
    inv = {"b1_vs_batch": all(eq(NR.qk_rmsnorm(q[t:t + 1], qw, 1e-6)[0], y[t]) for t in rows),
           "run_to_run": eq(NR.qk_rmsnorm(q, qw, 1e-6), y)}
    res["qk_rmsnorm"] = _mem_entry(
        lambda: NR.qk_rmsnorm(q, qw, 1e-6), lambda: eager_norm(q, qw), lambda: rlk_ops.qk_rmsnorm(q, qw),
        nb(q, y), copy_gbps, inv, drift(y[sub], cpu.qk_rmsnorm(q[sub].cpu(), qw.cpu(), 1e-6)))
    # ---- rope (q)
    y = NR.rope(q, pos, 1e6, D)
    inv = {"b1_vs_batch": all(eq(NR.rope(q[t:t + 1], pos[t:t + 1], 1e6, D)[0], y[t]) for t in rows),
           "run_to_run": eq(NR.rope(q, pos, 1e6, D), y)}
    res["rope"] = _mem_entry(
        lambda: NR.rope(q, pos, 1e6, D), lambda: eager_rope(q, pos), lambda: rlk_ops.rope(q, pos, 1e6),
        nb(q, y, pos), copy_gbps, inv, drift(y[sub], cpu.rope(q[sub].cpu(), pos[sub].cpu(), 1e6, D)))
    far = pos + NR.TABLE_LEN  # past the cos/sin table: every program evaluates fp64 sin/cos itself
    res["rope"]["in_kernel_cos_sin_us"] = gpu_time_us(lambda: NR.rope(q, far, 1e6, D))["us"]
    res["rope"]["in_kernel_cos_sin_drift_vs_cpu"] = drift(NR.rope(q[sub], far[sub], 1e6, D),
                                                         cpu.rope(q[sub].cpu(), far[sub].cpu(), 1e6, D))
    # ---- fused qk_norm_rope (q and k)
    fq, fk = NR.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6, D)
    seq_q = NR.rope(NR.qk_rmsnorm(q, qw, 1e-6), pos, 1e6, D)
    seq_k = NR.rope(NR.qk_rmsnorm(k, kw, 1e-6), pos, 1e6, D)

    def fused_row(t):
        a, b = NR.qk_norm_rope(q[t:t + 1], k[t:t + 1], qw, kw, pos[t:t + 1], 1e-6, 1e6, D)
        return eq(a[0], fq[t]) and eq(b[0], fk[t])

    again = NR.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6, D)
    inv = {"b1_vs_batch": all(fused_row(t) for t in rows),
           "run_to_run": eq(again[0], fq) and eq(again[1], fk),
           "equals_norm_then_rope": eq(fq, seq_q) and eq(fk, seq_k)}
    ref_q, ref_k = cpu.qk_norm_rope(q[sub].cpu(), k[sub].cpu(), qw.cpu(), kw.cpu(), pos[sub].cpu(), 1e-6, 1e6, D)
    res["qk_norm_rope"] = _mem_entry(
        lambda: NR.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6, D),
        lambda: (eager_rope(eager_norm(q, qw), pos), eager_rope(eager_norm(k, kw), pos)),
        lambda: rlk_ops.qk_norm_rope(q, k, qw, kw, pos),
        nb(q, k, fq, fk, pos), copy_gbps, inv, drift(torch.cat([fq[sub].flatten(), fk[sub].flatten()]),
                                                     torch.cat([ref_q.flatten(), ref_k.flatten()])))
    res["qk_norm_rope"]["unfused_triton_us"] = gpu_time_us(
        lambda: (NR.rope(NR.qk_rmsnorm(q, qw, 1e-6), pos, 1e6, D), NR.rope(NR.qk_rmsnorm(k, kw, 1e-6), pos, 1e6, D)))["us"]
    del q, k, fq, fk, seq_q, seq_k, again, y

    # ---- paged gather: 16 sequences of 4k-8k tokens, page 16, shuffled pages
    ps, bsz, max_pages = 16, 16, 512
    num_pages = bsz * max_pages + 64
    kc, vc = randn(num_pages, ps, HKV, D, seed=5), randn(num_pages, ps, HKV, D, seed=6)
    table = torch.randperm(num_pages, device=DEV)[:bsz * max_pages].view(bsz, max_pages).int()
    lens = torch.randint(4096, max_pages * ps + 1, (bsz,), device=DEV).int()
    gk, gv = PK.paged_kv_gather(kc, vc, table, lens)
    inv = {"b1_vs_batch": all(eq(PK.paged_kv_gather(kc, vc, table[b:b + 1], lens[b:b + 1])[0][0], gk[b])
                              for b in (0, 7, bsz - 1)),
           "run_to_run": eq(PK.paged_kv_gather(kc, vc, table, lens)[1], gv)}
    exact = eq(gk[1].cpu(), cpu.paged_kv_gather(kc.cpu(), vc.cpu(), table[1:2].cpu(), lens[1:2].cpu())[0][0])
    valid_bytes = int(lens.sum()) * HKV * D * 2 * 2
    mask = (torch.arange(max_pages * ps, device=DEV)[None, :] < lens[:, None])[:, :, None, None]

    def eager_gather():
        kk = kc[table.long()].view(bsz, -1, HKV, D)
        vv = vc[table.long()].view(bsz, -1, HKV, D)
        return torch.where(mask, kk, 0), torch.where(mask, vv, 0)

    res["paged_kv_gather"] = _mem_entry(
        lambda: PK.paged_kv_gather(kc, vc, table, lens), eager_gather,
        lambda: rlk_ops.paged_kv_gather(kc, vc, table, lens),
        valid_bytes + nb(gk, gv), copy_gbps, inv, {"bitwise_equal_to_cpu": exact})
    del gk, gv

    # ---- paged append: T new rows to scattered slots
    slots = torch.randperm(num_pages * ps, device=DEV)[:T]
    kn, vn = randn(T, HKV, D, seed=7), randn(T, HKV, D, seed=8)
    kc2, vc2 = kc.clone(), vc.clone()
    PK.paged_kv_append(kc2, vc2, kn[:1], vn[:1], slots[:1])
    kc3, vc3 = kc.clone(), vc.clone()
    PK.paged_kv_append(kc3, vc3, kn, vn, slots)
    s0 = int(slots[0])
    flat = lambda c: c.view(-1, HKV, D)  # noqa: E731
    inv = {"b1_vs_batch": eq(flat(kc2)[s0], flat(kc3)[s0]) and eq(flat(vc2)[s0], flat(vc3)[s0]),
           "run_to_run": True}
    kc4, vc4 = kc.clone(), vc.clone()
    PK.paged_kv_append(kc4, vc4, kn, vn, slots)
    inv["run_to_run"] = eq(kc4, kc3) and eq(vc4, vc3)
    exact = eq(flat(kc3)[slots].cpu(), kn.cpu()) and eq(flat(vc3)[slots].cpu(), vn.cpu())
    res["paged_kv_append"] = _mem_entry(
        lambda: PK.paged_kv_append(kc3, vc3, kn, vn, slots),
        lambda: (flat(kc3).index_copy_(0, slots, kn), flat(vc3).index_copy_(0, slots, vn)),
        lambda: rlk_ops.paged_kv_append(kc3, vc3, kn, vn, slots),
        2 * nb(kn, vn) + nb(slots), copy_gbps, inv, {"bitwise_equal_to_input_rows": exact})
    res["shapes"] = {"tokens": T, "hq": HQ, "hkv": HKV, "head_dim": D, "dtype": str(DT),
                     "gather": {"batch": bsz, "page_size": ps, "max_pages": max_pages, "lens": lens.tolist()},
                     "append_tokens": T}
    return res


def _mem_entry(kernel, eager, op, nbytes, copy_gbps, invariance, drift_vs_cpu):
    t_kernel = gpu_time_us(kernel)
    t_eager = gpu_time_us(eager)
    gbps = nbytes / t_kernel["us"] / 1e3
    return {"bytes": nbytes, "kernel_us": t_kernel["us"], "kernel_spread_us": t_kernel["spread_us"],
            "timing": t_kernel["method"], "GBps": gbps, "fraction_of_copy_bw": gbps / copy_gbps,
            "eager_pytorch_us": t_eager["us"], "speedup_vs_eager": t_eager["us"] / t_kernel["us"],
            "op_layer_eager_us": eager_time_us(op), "invariance": invariance, "drift_vs_cpu_reference": drift_vs_cpu}


# --------------------------------------------------------------------------- linear
LINEAR_SHAPES = {"qkv_4096_to_3072": (4096, 3072), "o_proj_2048_to_4096": (2048, 4096)}
LINEAR_MS = (1, 16, 256, 4096)


def linear_bench():
    from rlk_ops.kernels.triton import gemm as G

    ms, shapes = LINEAR_MS, LINEAR_SHAPES
    out = {"default_config": G.CONFIG.name, "shapes": {}}
    n_w = 4  # weights rotated per timed call: 4 x 25 MB > the 60 MB L2
    for name, (kdim, ndim) in shapes.items():
        ws = [randn(ndim, kdim, seed=10 + i) / math.sqrt(kdim) for i in range(n_w)]
        x_big = randn(max(ms), kdim, seed=20)
        entry = {"K": kdim, "N": ndim, "configs": {}}
        cublas_big = x_big @ ws[0].t()
        entry["cublas_rows_invariant"] = {
            f"M{m}_vs_M{max(ms)}": eq(x_big[:m] @ ws[0].t(), cublas_big[:m]) for m in ms if m != max(ms)}
        entry["cublas"] = {}
        for m in ms:
            x = x_big[:m].contiguous()
            t = gpu_time_us(lambda: [torch.matmul(x, w.t()) for w in ws])
            entry["cublas"][f"M{m}"] = {"us": t["us"] / n_w, "TFLOPs": 2 * m * ndim * kdim / (t["us"] / n_w) / 1e6}
        for cname, cfg in G.CANDIDATES.items():
            big = G.linear(x_big, ws[0], None, config=cfg)
            c = {"invariant": {f"M{m}_vs_M{max(ms)}": eq(G.linear(x_big[:m], ws[0], None, config=cfg), big[:m])
                               for m in ms if m != max(ms)},
                 "run_to_run": eq(G.linear(x_big, ws[0], None, config=cfg), big)}
            c["drift_vs_cpu_reference"] = drift(big[:8], cpu.linear(x_big[:8].cpu(), ws[0].cpu(), None))
            for m in ms:
                x = x_big[:m].contiguous()
                t = gpu_time_us(lambda: [G.linear(x, w, None, config=cfg) for w in ws])
                us = t["us"] / n_w
                c[f"M{m}"] = {"us": us, "TFLOPs": 2 * m * ndim * kdim / us / 1e6,
                              "vs_cublas": entry["cublas"][f"M{m}"]["us"] / us}
            entry["configs"][cname] = c
        out["shapes"][name] = entry
        del ws, x_big
    # gradients of the default config: run-to-run (dweight sums over tokens in a fixed order)
    (kdim, ndim), m = next(iter(LINEAR_SHAPES.values())), max(ms)
    x, w, dy = randn(m, kdim, seed=30), randn(ndim, kdim, seed=31) / 64, randn(m, ndim, seed=32)
    dx, dw = G.linear_bwd(dy, x, w)
    dx2, dw2 = G.linear_bwd(dy, x, w)
    out["backward"] = {"run_to_run": eq(dx, dx2) and eq(dw, dw2),
                       "dx_rows_invariant_M1_vs_M4096": eq(G.linear_bwd(dy[:1], x[:1], w)[0][0], dx[0]),
                       "dx_us": gpu_time_us(lambda: G.matmul(dy, w, torch.empty_like(x)))["us"],
                       "dweight_us": gpu_time_us(lambda: G.matmul(dy.t(), x, torch.empty_like(w)))["us"],
                       "cublas_dx_us": gpu_time_us(lambda: dy @ w)["us"],
                       "cublas_dweight_us": gpu_time_us(lambda: dy.t() @ x)["us"]}
    return out


# ------------------------------------------------------------- FlashInfer vs FA4
def _paged_batch(lens, ps=16, seed=40, sq=1):
    bsz = len(lens)
    pages = [math.ceil(n / ps) for n in lens]
    num_pages = sum(pages) + 8
    kc, vc = randn(num_pages, ps, HKV, D, seed=seed), randn(num_pages, ps, HKV, D, seed=seed + 1)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(bsz, max(pages), dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    q = randn(bsz, sq, HQ, D, seed=seed + 2)
    return q, kc, vc, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def _fa4_paged(q, kc, vc, table, lens):
    from flash_attn.cute.interface import flash_attn_varlen_func

    with torch.no_grad():  # the controls the fa4 backend pins (rlk_ops/kernels/fa4/loader.py)
        return flash_attn_varlen_func(q, kc, vc, page_table=table, seqused_k=lens, causal=True, num_splits=1,
                                      pack_gqa=True, return_lse=True, softmax_scale=D ** -0.5)


def _ref64(q, kc, vc, table, lens):
    """fp64 attention of each sequence's newest Sq rows (bottom-right causal), on the GPU."""
    outs, lses = [], []
    ps = kc.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        pages = table[b, :math.ceil(n / ps)].long()
        k = kc[pages].reshape(-1, HKV, D)[:n].double().repeat_interleave(HQ // HKV, 1)
        v = vc[pages].reshape(-1, HKV, D)[:n].double().repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("qhd,khd->hqk", q[b].double(), k) * D ** -0.5
        sq = q.shape[1]
        qpos = torch.arange(sq, device=DEV) + n - sq
        s = s.masked_fill(torch.arange(n, device=DEV)[None, None, :] > qpos[None, :, None], -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
    return torch.stack(outs), torch.stack(lses)


POLICIES = ("disabled", "fixed:256", "fixed:1024", "auto")


def flashinfer_invariance(fa4_ok: bool):
    from rlk_ops.kernels import flashinfer as FI

    res = {"policies": {}}
    for sq in (1, 4):
        lens = [32768, 5000, 17, 4, 12000, 257, 8192, 30000]
        q, kc, vc, table, lens_t = _paged_batch(lens, sq=sq)
        ref_o, ref_l = _ref64(q, kc, vc, table, lens_t)
        fa4 = None
        if fa4_ok:
            try:
                fa4 = _fa4_paged(q, kc, vc, table, lens_t)
            except Exception as e:  # noqa: BLE001
                res[f"fa4_error_sq{sq}"] = f"{type(e).__name__}: {e}"
        for policy in POLICIES:
            FI.plan_log().clear()
            run = (lambda *a: FI.paged_attention_auto(*a, D ** -0.5)) if policy == "auto" else \
                (lambda *a, p=policy: FI.paged_attention(*a, D ** -0.5, p))
            out, lse = run(q, kc, vc, table, lens_t)
            plan_batch = dict(FI.last_plan)
            again = run(q, kc, vc, table, lens_t)
            b1 = {}
            plans_b1 = {}
            for b in (0, 4, 7):
                o1, l1 = run(q[b:b + 1], kc, vc, table[b:b + 1], lens_t[b:b + 1])
                b1[b] = eq(o1[0], out[b]) and eq(l1[0], lse[b])
                plans_b1[b] = {k: FI.last_plan.get(k) for k in ("split_kv", "kv_chunk_tokens", "work_items")}
            cell = {"b1_vs_b8": all(b1.values()), "b1_vs_b8_per_sequence": b1,
                    "run_to_run": eq(again[0], out) and eq(again[1], lse),
                    "rel_err_vs_fp64": drift(out.float(), ref_o.float())["rel_err"],
                    "lse_max_abs_diff_vs_fp64": float((lse.double() - ref_l).abs().max()),
                    "plan_batch8": plan_batch, "plans_b1": plans_b1, "strict": policy != "auto"}
            if fa4 is not None:
                cell["drift_vs_fa4"] = drift(out, fa4[0])
                cell["lse_max_abs_diff_vs_fa4"] = float((lse - fa4[1]).abs().max())
            res["policies"][f"sq{sq}/{policy}"] = cell
        if fa4 is not None:
            fa4_b1 = _fa4_paged(q[:1], kc, vc, table[:1], lens_t[:1])
            res[f"fa4_sq{sq}"] = {"b1_vs_b8": eq(fa4_b1[0][0], fa4[0][0]) and eq(fa4_b1[1][0], fa4[1][0]),
                                 "rel_err_vs_fp64": drift(fa4[0].float(), ref_o.float())["rel_err"]}
        res[f"lens_sq{sq}"] = lens
    return res


def decode_speed(fa4_ok: bool):
    import flashinfer  # noqa: F401 - fail here, clearly, if it is missing

    from rlk_ops.kernels import flashinfer as FI

    cases = [(1, 8192), (1, 32768), (8, 32768), (64, 8192)]
    res = {}
    for bsz, ctx in cases:
        q, kc, vc, table, lens = _paged_batch([ctx] * bsz, seed=50)
        row = {}
        for policy in POLICIES:
            # plan once (host work, outside the timing), then time the kernel launches only
            w = FI._wrapper(q.device)
            indptr, indices, last = FI._csr(table, lens, kc.shape[1])
            args = FI.flashinfer_split_args(policy, kc.shape[1])
            w.plan(indptr, indices, last, HQ, HKV, D, kc.shape[1], q_data_type=q.dtype, kv_data_type=kc.dtype,
                   sm_scale=D ** -0.5, q_len_per_req=1, **args)
            plan = FI._read_plan(w, policy, args, bsz, 1, kc.shape[1])
            qq = q.reshape(bsz, HQ, D)
            t = gpu_time_us(lambda: w.run(qq, (kc, vc), return_lse=True))
            row[policy] = {"us": t["us"], "timing": t["method"], "split_kv": plan.get("split_kv"),
                           "kv_chunk_tokens": plan.get("kv_chunk_tokens"), "work_items": plan.get("work_items")}
            row[policy]["op_layer_eager_us"] = eager_time_us(
                (lambda: FI.paged_attention_auto(q, kc, vc, table, lens, D ** -0.5)) if policy == "auto" else
                (lambda p=policy: FI.paged_attention(q, kc, vc, table, lens, D ** -0.5, p)), reps=10)
        if fa4_ok:
            try:
                t = gpu_time_us(lambda: _fa4_paged(q, kc, vc, table, lens))
                row["fa4_strict"] = {"us": t["us"], "timing": t["method"]}
                for policy in POLICIES:
                    row[policy]["fa4_over_flashinfer"] = t["us"] / row[policy]["us"]
            except Exception as e:  # noqa: BLE001
                row["fa4_error"] = f"{type(e).__name__}: {e}"
        kv_bytes = 2 * bsz * ctx * HKV * D * 2
        row["kv_bytes"] = kv_bytes
        res[f"B{bsz}_ctx{ctx}"] = row
        del q, kc, vc
    return res


# -------------------------------------------------------------------------- summary
def summary(data: dict) -> tuple[dict, str]:
    """Every invariance cell in one flat dict, plus the markdown report."""
    s = data["sections"]
    cells: dict[str, bool] = {}
    lines = ["# Kernel report (H200)", "",
             f"Generated by `benchmarks/kernel_bench.py` from `kernels.json`. GPU: {data['env'].get('gpu')}, "
             f"torch {data['env'].get('torch')}, triton {data['env'].get('triton')}, "
             f"flashinfer {data['env'].get('flashinfer')}, flash-attn-4 {data['env'].get('flash_attn_4')}.", ""]
    mem = s.get("memory_bound", {})
    if mem:
        cb = s["copy_bandwidth"]
        bw = cb["GBps"]
        lines += [f"Device copy bandwidth (read + write) measured in this run: **{bw:.0f} GB/s** (best of "
                  + ", ".join(f"{k} {v:.0f}" for k, v in cb.get("ways_GBps", {}).items()) + ").", "",
                  "| op | bytes | kernel us | GB/s | fraction of copy BW | eager PyTorch us | speedup vs eager | "
                  "op layer us (eager, with checks) | B=1 vs batch | run-to-run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for op in ("qk_rmsnorm", "rope", "qk_norm_rope", "paged_kv_gather", "paged_kv_append"):
            e = mem.get(op)
            if not e:
                continue
            inv = e["invariance"]
            for k, v in inv.items():
                cells[f"triton/{op}/{k}"] = v
            lines.append(f"| {op} | {e['bytes'] / 1e6:.0f} MB | {e['kernel_us']:.1f} | {e['GBps']:.0f} | "
                         f"{e['fraction_of_copy_bw']:.2f} | {e['eager_pytorch_us']:.1f} | {e['speedup_vs_eager']:.2f}x | "
                         f"{e['op_layer_eager_us']:.1f} | {inv['b1_vs_batch']} | {inv['run_to_run']} |")
        lines += ["", "Drift against the CPU reference (not a bitwise claim): " + ", ".join(
            f"{op} {mem[op]['drift_vs_cpu_reference']}" for op in ("qk_rmsnorm", "rope", "qk_norm_rope") if op in mem),
            ""]
        if "in_kernel_cos_sin_us" in mem.get("rope", {}):
            lines += [f"rope with cos/sin evaluated in the kernel (positions past the table): "
                      f"{mem['rope']['in_kernel_cos_sin_us']:.1f} us vs {mem['rope']['kernel_us']:.1f} us "
                      f"from the table.", ""]
        if "qk_norm_rope" in mem:
            lines += [f"Fused qk_norm_rope == qk_rmsnorm then rope (bitwise): "
                      f"{mem['qk_norm_rope']['invariance']['equals_norm_then_rope']}; fused "
                      f"{mem['qk_norm_rope']['kernel_us']:.1f} us vs unfused Triton "
                      f"{mem['qk_norm_rope']['unfused_triton_us']:.1f} us.", ""]
    lin = s.get("linear", {})
    if lin:
        mkeys = list(next(iter(lin["shapes"].values()))["cublas"])
        lines += [f"## linear (default tile config `{lin['default_config']}`), TFLOP/s", "",
                  "| shape | config | " + " | ".join(mkeys) + f" | rows invariant vs {mkeys[-1]} |",
                  "|---|---|" + "---|" * (len(mkeys) + 1)]
        for sname, e in lin["shapes"].items():
            cb = e["cublas"]
            lines.append(f"| {sname} | cuBLAS | " + " | ".join(
                f"{cb[m]['TFLOPs']:.1f} ({cb[m]['us']:.1f} us)" for m in mkeys) +
                f" | {all(e['cublas_rows_invariant'].values())} |")
            for cname, c in e["configs"].items():
                ok = all(c["invariant"].values()) and c["run_to_run"]
                if cname == lin["default_config"]:
                    for k, v in c["invariant"].items():
                        cells[f"triton/linear/{sname}/{k}"] = v
                    cells[f"triton/linear/{sname}/run_to_run"] = c["run_to_run"]
                tag = f"**{cname}**" if cname == lin["default_config"] else cname
                lines.append(f"| {sname} | {tag} | " + " | ".join(
                    f"{c[m]['TFLOPs']:.1f} ({c[m]['vs_cublas']:.2f}x)" for m in mkeys) +
                    f" | {ok} |")
        if "backward" in lin:
            cells["triton/linear_bwd/run_to_run"] = lin["backward"]["run_to_run"]
            cells["triton/linear_bwd/dx_rows_invariant"] = lin["backward"]["dx_rows_invariant_M1_vs_M4096"]
        lines += ["", "cuBLAS cells: TFLOP/s (us per call); Triton cells: TFLOP/s (speed relative to cuBLAS, "
                  ">1 is faster).", ""]
    fi = s.get("flashinfer_invariance", {})
    if fi:
        lines += ["## FlashInfer paged attention: invariance (B=1 vs B=8, bitwise) and drift", "",
                  "| Sq / policy | strict | B=1 vs B=8 | run-to-run | rel err vs fp64 | drift vs FA4 (max abs, equal fraction) | "
                  "plan (B=8): split, chunk tokens |", "|---|---|---|---|---|---|---|"]
        for key, c in fi["policies"].items():
            if c["strict"]:
                cells[f"flashinfer/{key}/b1_vs_b8"] = c["b1_vs_b8"]
                cells[f"flashinfer/{key}/run_to_run"] = c["run_to_run"]
            d4 = c.get("drift_vs_fa4")
            d4s = f"{d4['max_abs_diff']:.2e}, {d4['bitwise_equal_fraction']:.3f}" if d4 else "-"
            p = c["plan_batch8"]
            lines.append(f"| {key} | {c['strict']} | {c['b1_vs_b8']} | {c['run_to_run']} | {c['rel_err_vs_fp64']:.2e} | "
                         f"{d4s} | {p.get('split_kv')}, {p.get('kv_chunk_tokens')} |")
        lines.append("")
    dec = s.get("decode_speed", {})
    if dec:
        lines += ["## Decode speed: FlashInfer per policy vs FA4 strict (us, CUDA-graph replay, page 16)", "",
                  "| batch, context | FA4 strict | " + " | ".join(POLICIES) + " |",
                  "|---|---|" + "---|" * len(POLICIES)]
        for case, row in dec.items():
            fa4 = row.get("fa4_strict", {}).get("us")
            lines.append(f"| {case} | {fa4 if fa4 is None else f'{fa4:.1f}'} | " + " | ".join(
                f"{row[p]['us']:.1f}" for p in POLICIES) + " |")
        lines.append("")
    strict_ok = all(cells.values()) if cells else False
    lines += [f"All strict invariance cells true: **{strict_ok}** ({sum(cells.values())}/{len(cells)}).", ""]
    if data.get("errors"):
        lines += ["Sections that failed: " + ", ".join(data["errors"]), ""]
    return {"cells": cells, "all_strict_cells_true": strict_ok}, "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--skip-flashinfer", action="store_true")
    p.add_argument("--skip-fa4", action="store_true")
    p.add_argument("--commit", default=None, help="git commit of the code that ran")
    p.add_argument("--only", default=None, help="comma-separated sections to run (default: all)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rep = Report(args.out)
    rep.data["env"] = provenance.environment()
    rep.data["commit"] = args.commit
    rep.data["command"] = " ".join(sys.argv)
    from rlk_ops.kernels.triton import gemm

    rep.data["linear_default_config"] = gemm.CONFIG.name
    only = set(args.only.split(",")) if args.only else None
    want = lambda name: only is None or name in only  # noqa: E731
    rep.section("copy_bandwidth", copy_bandwidth)
    bw = rep.data["sections"].get("copy_bandwidth", {}).get("GBps", float("nan"))
    if want("memory_bound"):
        rep.section("memory_bound", lambda: memory_bound(bw, args.tokens))
    if want("linear"):
        rep.section("linear", linear_bench)
    fa4_ok = False
    if not args.skip_fa4:
        try:
            t0 = time.perf_counter()
            import flash_attn.cute.interface  # noqa: F401

            fa4_ok = True
            rep.data["fa4_import_s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # noqa: BLE001
            rep.data["errors"]["fa4_import"] = f"{type(e).__name__}: {e}"
    if not args.skip_flashinfer:
        if want("flashinfer_invariance"):
            rep.section("flashinfer_invariance", lambda: flashinfer_invariance(fa4_ok))
        if want("decode_speed"):
            rep.section("decode_speed", lambda: decode_speed(fa4_ok))
    summ, md = summary(rep.data)
    rep.data["summary"] = summ
    rep.save()
    with open(os.path.join(args.out, "kernels.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
