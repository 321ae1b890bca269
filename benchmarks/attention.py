"""Proves and times the fa4 attention backend on one GPU; writes JSON and a markdown table.

    python benchmarks/attention.py --out results/h200/attention.json --md results/h200/attention.md
    python benchmarks/attention.py --md-only --out results/h200/attention.json --md results/h200/attention.md
    python benchmarks/attention.py --dry-run --out /tmp/a.json --md /tmp/a.md   # CPU, stand-in FA4

What it records (Qwen3-8B bf16, D=128, TP=2 shard Hq=16/Hkv=4 and TP=1 32/8):

* ``bitwise``: every invariance claim as torch.equal cells (run-to-run; B=1 vs B=4 rows;
  decode vs prefill rows at block boundaries; chunked prefill at offsets that are not
  multiples of 128; varlen vs dense, also next to unrelated neighbours; paged decode and
  chunked prefill with page sizes 16/64/128 over shuffled pages with garbage in unused
  slots; backward run-to-run with and without dlse; torch.compile(fullgraph=True) vs eager).
* ``drift``: CPU reference vs CUDA (not bitwise: FA4 visits key blocks last to first, the
  reference first to last, and FA4 uses ex2.approx): max difference and equal fraction.
* ``accuracy``: against float64 math.
* ``timings``: ratios measured in the same run, interleaved: rlk_ops vs raw FA4 with the same
  arguments (wrapper overhead), vs SDPA cuDNN / flash, deterministic vs non-deterministic
  backward, paged decode vs raw FA4 paged decode (eager and CUDA-graph replay), eager
  per-call overhead. Medians of several repetitions; CUDA events.
* ``jit``: FA4 compile-cache sizes; new shapes of a compiled configuration add no kernels.

--dry-run runs the same code on the CPU with tiny shapes against the stand-in FA4 of
tests/test_fa4.py (it computes with the CPU reference): it checks this script, it proves
nothing about FA4. Exit status 1 if any bitwise cell is false or any section failed.
"""
from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rlk_ops  # noqa: E402
from rlk_ops.kernels.fa4 import loader  # noqa: E402
from rlk_ops.meta import provenance  # noqa: E402
from rlk_ops.ops import _validate  # noqa: E402
from _report import Report, arguments, device_and_shapes, rewrite_markdown  # noqa: E402  (benchmarks/_report.py)

BF16 = torch.bfloat16


@dataclass
class Shapes:
    d: int = 128
    layouts: dict = field(default_factory=lambda: {"tp2": (16, 4), "tp1": (32, 8)})
    s: int = 4096  # the sequence of the bitwise matrix
    positions: tuple = (0, 1, 127, 128, 129, 255, 256, 1000, 2047, 2048, 4095)
    chunks: tuple = ((1000, 1300), (1500, 1577), (2049, 2050), (100, 2148), (3001, 4096))
    varlen_others: tuple = (77, 1000, 513, 1)
    neighbours: tuple = (1, 32, 33, 129, 1000)
    page_sizes: tuple = (16, 64, 128)
    bwd: tuple = (2, 2048)
    drift_s: int = 640
    drift_bwd_s: int = 256
    acc_bwd_s: int = 2048
    fwd: tuple = ((1, 32768), (4, 8192), (8, 4096), (32, 1024), (1, 4096))
    bwd_timed: tuple = ((4, 8192), (8, 4096))
    paged_batches: tuple = (1, 8, 64)
    paged_ctx: tuple = (1024, 4096, 8192, 32768)
    paged_pages: tuple = (16, 128)
    rep_ms: float = 25.0  # time per timed repetition
    reps: int = 5


DRY = Shapes(d=16, layouts={"tp2": (4, 1), "tp1": (8, 2)}, s=300, positions=(0, 1, 127, 128, 129, 299),
             chunks=((100, 177), (131, 300)), varlen_others=(77, 1), neighbours=(1, 33), page_sizes=(16, 64, 128),
             bwd=(2, 140), drift_s=140, drift_bwd_s=70, acc_bwd_s=140, fwd=((2, 256),), bwd_timed=((2, 256),),
             paged_batches=(1, 3), paged_ctx=(256,), paged_pages=(16, 128), rep_ms=5.0, reps=2)


def beq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Bench(Report):
    def __init__(self, dev: str, shapes: Shapes, out_path: str, dry: bool):
        super().__init__("benchmarks/attention.py", dev, shapes, out_path, dry)
        self.fa4 = loader.load()
        self.raw = self.fa4.module

    # ------------------------------------------------------------- helpers
    def qkv(self, b, s, layout, sk=None):
        hq, hkv = self.sh.layouts[layout]
        return self.rand(b, s, hq, self.sh.d), self.rand(b, sk or s, hkv, self.sh.d), self.rand(b, sk or s, hkv, self.sh.d)

    def cell(self, name, layout, equal, what, **extra):
        self.res["bitwise"].append({"name": name, "layout": layout, "equal": bool(equal), "what": what, **extra})
        print(f"  [{'ok' if equal else 'FAIL'}] {layout} {name}: {what}", flush=True)

    def _elapsed_us(self, fn, iters):
        if self.dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e6 / iters

    def timeit(self, fns: dict) -> dict:
        """Median microseconds per call of each fn; the fns are interleaved per repetition,
        so clock and thermal drift hit them alike. Back-to-back calls between two events:
        host overhead shows when the host is the bottleneck (small shapes)."""
        iters = {}
        for name, fn in fns.items():
            fn()
            self.sync()
            one = self._elapsed_us(fn, 1)
            iters[name] = max(2, min(500, int(self.sh.rep_ms * 1e3 / max(one, 1.0))))
        times = {name: [] for name in fns}
        for _ in range(self.sh.reps):
            for name, fn in fns.items():
                times[name].append(self._elapsed_us(fn, iters[name]))
        return {name: round(statistics.median(t), 2) for name, t in times.items()}

    def graph_us(self, fn, per_graph=10):
        """Median microseconds per call when ``per_graph`` calls are replayed as one CUDA graph."""
        fn()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(per_graph):
                fn()
        return self.timeit({"g": g.replay})["g"] / per_graph

    def raw_fwd(self, q, k, v, causal=True):
        return self.raw.flash_attn_func(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                                        num_splits=1, pack_gqa=True, return_lse=True)

    def raw_paged(self, q, kc, vc, pt, sl):
        """The FA4 call the op makes (its decode tile included: fa4 kernels.decode_tile)."""
        from rlk_ops.kernels.fa4.kernels import decode_tile

        tile = decode_tile(q, kc, loader.note_device(self.fa4, q.device))
        return self.raw._flash_attn_fwd(q, kc, vc, seqused_k=sl, page_table=pt,
                                        softmax_scale=q.shape[-1] ** -0.5, causal=True, num_splits=1,
                                        pack_gqa=True, return_lse=True, tile_mn=tile)[:2]

    def raw_bwd(self, dout, q, k, v, out, lse, deterministic):
        return self.raw._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=q.shape[-1] ** -0.5, causal=True,
                                        deterministic=deterministic)

    def paged(self, k, v, lens, page_size, kv_heads):
        """Sequences (prefixes of k/v [1, S, H, D]) in shuffled pages; unused slots hold finite garbage,
        page_table padding holds -7 (never read)."""
        d = self.sh.d
        n = [math.ceil(t / page_size) for t in lens]
        num_pages = sum(n) + 5
        perm = torch.randperm(num_pages, device=self.dev, generator=self.gen).to(torch.int32)
        kc, vc = self.rand(num_pages, page_size, kv_heads, d), self.rand(num_pages, page_size, kv_heads, d)
        pt = torch.full((len(lens), max(n) + 1), -7, dtype=torch.int32, device=self.dev)
        used = 0
        for b, t in enumerate(lens):
            pages = perm[used:used + n[b]]
            used += n[b]
            pt[b, :n[b]] = pages
            slots = (pages.long()[:, None] * page_size + torch.arange(page_size, device=self.dev)).flatten()[:t]
            kc.view(-1, kv_heads, d)[slots] = k[0, :t]
            vc.view(-1, kv_heads, d)[slots] = v[0, :t]
        return kc, vc, pt, torch.tensor(lens, dtype=torch.int32, device=self.dev)

    # ------------------------------------------------------------- sections
    def environment(self):
        self.res["environment"] = provenance.environment()
        self.res["fa4"] = loader.backend_info()
        self.res["fa4_persistent_jit_cache"] = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1"

    def bitwise(self, layout):
        sh, (hq, hkv) = self.sh, self.sh.layouts[layout]
        q, k, v = self.qkv(1, sh.s, layout)
        t0 = time.perf_counter()
        out, lse = rlk_ops.attention(q, k, v)
        self.sync()
        self.res.setdefault("first_call_seconds", {})[f"{layout}_prefill"] = round(time.perf_counter() - t0, 2)

        runs = [rlk_ops.attention(q, k, v) for _ in range(3)]
        self.cell("run_to_run", layout, all(beq(o, out) and beq(l, lse) for o, l in runs),
                  f"4 calls, B=1 S={sh.s}: out and lse")

        oq, ok, ov = self.qkv(3, sh.s, layout)
        bad = []
        for pos in (0, 3):
            qb, kb, vb = (torch.cat([o[:pos], x, o[pos:]]) for o, x in zip((oq, ok, ov), (q, k, v)))
            ob, lb = rlk_ops.attention(qb, kb, vb)
            if not (beq(ob[pos], out[0]) and beq(lb[pos], lse[0])):
                bad.append(pos)
        self.cell("batch_1_vs_4", layout, not bad, "the sequence as row 0 and row 3 of B=4 vs B=1", failing=bad)

        bad = []
        for p in sh.positions:
            o, l = rlk_ops.attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1])
            if not (beq(o[:, 0], out[:, p]) and beq(l[:, :, 0], lse[:, :, p])):
                bad.append(p)
        self.cell("decode_vs_prefill", layout, not bad,
                  f"Sq=1, Sk=p+1 vs prefill row p, p in {list(sh.positions)}", failing=bad)

        bad = []
        for a, b in sh.chunks:
            o, l = rlk_ops.attention(q[:, a:b], k[:, :b], v[:, :b])
            if not (beq(o, out[:, a:b]) and beq(l, lse[:, :, a:b])):
                bad.append([a, b])
        self.cell("chunked_prefill", layout, not bad,
                  f"queries [a, b) over keys [0, b) vs prefill rows, (a, b) in {[list(c) for c in sh.chunks]}",
                  failing=bad)

        # varlen: the sequence packed with others; each packed sequence equals its dense B=1 result
        others = [self.qkv(1, n, layout) for n in sh.varlen_others]
        seqs = [(q, k, v)] + others
        lens = [x[0].shape[1] for x in seqs]
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=self.dev)
        pq, pk, pv = (torch.cat([x[i][0] for x in seqs]) for i in range(3))
        vo, vl = rlk_ops.attention(pq, pk, pv, cu_seqlens_q=cu, cu_seqlens_k=cu)
        ok_all = vl.shape == (hq, sum(lens))
        for (sq, sk, sv), a, n in zip(seqs, cu[:-1].tolist(), lens):
            do, dl = (out, lse) if sq is q else rlk_ops.attention(sq, sk, sv)
            ok_all &= beq(vo[a:a + n], do[0]) and beq(vl[:, a:a + n], dl[0])
        self.cell("varlen_vs_dense", layout, ok_all, f"packed lengths {lens} vs each dense B=1 (lse [Hq, T])")

        bad = []
        for nb in sh.neighbours:  # decode row next to an unrelated prefill: max_seqlen_q changes with nb
            p = sh.positions[-1]
            nq, nk, nv = self.qkv(1, nb, layout)
            cq = torch.tensor([0, 1, 1 + nb], dtype=torch.int32, device=self.dev)
            ck = torch.tensor([0, p + 1, p + 1 + nb], dtype=torch.int32, device=self.dev)
            o, l = rlk_ops.attention(torch.cat([q[0, p:p + 1], nq[0]]), torch.cat([k[0, :p + 1], nk[0]]),
                                     torch.cat([v[0, :p + 1], nv[0]]), cu_seqlens_q=cq, cu_seqlens_k=ck)
            if not (beq(o[0], out[0, p]) and beq(l[:, 0], lse[0, :, p])):
                bad.append(nb)
        self.cell("varlen_decode_next_to_prefill", layout, not bad,
                  f"varlen decode row {sh.positions[-1]} beside a prefill of nb tokens, nb in {list(sh.neighbours)} "
                  "(changes max_seqlen_q)", failing=bad)

        for ps in sh.page_sizes:
            kc, vc, pt, sl = self.paged(k, v, [p + 1 for p in sh.positions], ps, hkv)
            t0 = time.perf_counter()
            o, l = rlk_ops.paged_attention(q[0, list(sh.positions)][:, None], kc, vc, pt, sl)
            self.sync()
            self.res["first_call_seconds"][f"{layout}_paged_{ps}"] = round(time.perf_counter() - t0, 2)
            bad = [p for i, p in enumerate(sh.positions)
                   if not (beq(o[i, 0], out[0, p]) and beq(l[i, :, 0], lse[0, :, p]))]
            o1, l1 = rlk_ops.paged_attention(q[:, sh.positions[-1]:][:, :1], kc, vc, pt[-1:], sl[-1:])
            b1 = beq(o1[0, 0], out[0, sh.positions[-1]]) and beq(l1[0, :, 0], lse[0, :, sh.positions[-1]])
            self.cell(f"paged_decode_page{ps}", layout, not bad and b1,
                      f"B={len(sh.positions)} decode rows (seq_len p+1) over shuffled pages vs prefill rows; "
                      "and the last as B=1", failing=bad + ([] if b1 else ["B=1"]))
            (a, b), bad = sh.chunks[1], []
            kc, vc, pt, sl = self.paged(k, v, [b, sh.s], ps, hkv)
            qq = torch.stack([q[0, a:b], q[0, sh.s - (b - a):]])
            o, l = rlk_ops.paged_attention(qq, kc, vc, pt, sl)
            ok_c = beq(o[0], out[0, a:b]) and beq(l[0], lse[0, :, a:b])
            ok_c &= beq(o[1], out[0, sh.s - (b - a):]) and beq(l[1], lse[0, :, sh.s - (b - a):])
            self.cell(f"paged_chunked_prefill_page{ps}", layout, ok_c,
                      f"chunks [{a}, {b}) and [{sh.s - (b - a)}, {sh.s}) in one paged batch vs prefill rows")

        self.bitwise_backward(layout)
        self.bitwise_compile(layout, q, k, v)

    def bitwise_backward(self, layout):
        b, s = self.sh.bwd
        q, k, v = self.qkv(b, s, layout)
        out, lse = rlk_ops.attention(q, k, v)
        dout, dlse = self.rand(*out.shape), self.rand(*lse.shape, dtype=torch.float32)
        scale = self.sh.d ** -0.5
        det = None
        for tag, dl in (("", None), ("_with_dlse", dlse)):
            t0 = time.perf_counter()
            runs = [torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dl, 1, scale, None, None, 0, 0, "disabled")
                    for _ in range(3)]
            self.sync()
            self.res["first_call_seconds"].setdefault(f"{layout}_bwd", round(time.perf_counter() - t0, 2))
            self.cell(f"backward_run_to_run{tag}", layout, all(beq(x, y) for r in runs[1:] for x, y in zip(r, runs[0])),
                      f"3 calls, B={b} S={s}: dq, dk, dv" + (" (nonzero dlse)" if dl is not None else ""))
            det = det or runs[0]
        if layout == "tp2":  # what deterministic=True buys: FA4's default backward on the same inputs
            self.observe_nondeterministic(dout, q, k, v, out, lse, det)
        # varlen backward: the packed batch, 3 runs
        lens = [s, s // 2 + 3, 1]
        cu = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)], dtype=torch.int32, device=self.dev)
        pq, pk, pv = (self.rand(sum(lens), h, self.sh.d) for h in (q.shape[2], k.shape[2], k.shape[2]))
        po, pl = rlk_ops.attention(pq, pk, pv, cu_seqlens_q=cu, cu_seqlens_k=cu)
        pdo = self.rand(*po.shape)
        runs = [torch.ops.rlk.attention_bwd(pdo, pq, pk, pv, po, pl, None, 1, scale, cu, cu, 0, 0, "disabled")
                for _ in range(3)]
        self.cell("backward_run_to_run_varlen", layout, all(beq(x, y) for r in runs[1:] for x, y in zip(r, runs[0])),
                  f"3 calls, packed lengths {lens}: dq, dk, dv")

    def observe_nondeterministic(self, dout, q, k, v, out, lse, det):
        try:
            raw = [self.raw_bwd(dout, q, k, v, out, lse, deterministic=False)[:3] for _ in range(3)]
            names = ("dq", "dk", "dv")
            self.res["observations"] = {
                "fa4_nondeterministic_backward_equal_run_to_run": {
                    n: all(beq(r[i], raw[0][i]) for r in raw[1:]) for i, n in enumerate(names)},
                "deterministic_equals_nondeterministic_bits": {n: beq(det[i], raw[0][i]) for i, n in enumerate(names)},
            }
        except Exception as e:
            self.res["observations"] = {"error": f"{type(e).__name__}: {e}"}

    def bitwise_compile(self, layout, q, k, v):
        torch._dynamo.reset()
        n = min(q.shape[1], 1024)
        q, k, v = (t[:, :n].clone().requires_grad_() for t in (q, k, v))
        dout = self.rand(*q.shape)
        dlse = self.rand(1, q.shape[2], n, dtype=torch.float32)

        def fn(q, k, v):
            return rlk_ops.attention(q, k, v)

        res = []
        for f in (fn, torch.compile(fn, fullgraph=True)):
            o, l = f(q, k, v)
            res.append((o, l, *torch.autograd.grad((o, l), (q, k, v), (dout, dlse))))
        self.cell("compile_vs_eager", layout, all(beq(a, b) for a, b in zip(*res)),
                  f"torch.compile(fullgraph=True) vs eager, S={n}: out, lse, dq, dk, dv (dlse nonzero)")

    def drift(self):
        """CPU reference vs CUDA on the same inputs (tp2): reported, not bitwise."""
        from rlk_ops.kernels.cpu import attention as cpu

        s, d = self.sh.drift_s, self.sh.d
        q, k, v = self.qkv(1, s, "tp2")
        out, lse = rlk_ops.attention(q, k, v)
        t0 = time.perf_counter()
        co, cl = cpu.attention_fwd(q.cpu(), k.cpu(), v.cpu(), 1, d ** -0.5, None, None, 0, 0)
        ref_o, ref_l = ref64(q, k, v)
        rep = {"shape": f"B=1 S={s} Hq/Hkv={self.sh.layouts['tp2']} D={d} bf16 causal",
               "cpu_seconds": round(time.perf_counter() - t0, 1)}
        rep.update(diff("out", out, co.to(self.dev)))
        rep.update(diff("lse", lse, cl.to(self.dev)))
        rep["out_rel_err_vs_fp64"] = {"cuda": rel(out, ref_o), "cpu": rel(co.to(self.dev), ref_o)}
        rep["lse_max_abs_err_vs_fp64"] = {"cuda": (lse.double() - ref_l).abs().max().item(),
                                          "cpu": (cl.to(self.dev).double() - ref_l).abs().max().item()}
        sb = self.sh.drift_bwd_s
        q, k, v = (t[:, :sb].contiguous() for t in (q, k, v))
        out, lse = rlk_ops.attention(q, k, v)
        dout = self.rand(*out.shape)
        g = torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, None, 1, d ** -0.5, None, None, 0, 0, "disabled")
        cg = cpu.attention_bwd(*(t.cpu() for t in (dout, q, k, v, out, lse)), None, 1, d ** -0.5, None, None, 0, 0)
        rep["backward_shape"] = f"B=1 S={sb}"
        for n, a, b in zip(("dq", "dk", "dv"), g, cg):
            rep.update(diff(n, a, b.to(self.dev)))
        self.res["drift_cpu_vs_cuda"] = rep

    def accuracy(self):
        rep = {}
        for layout in self.sh.layouts:
            q, k, v = self.qkv(1, self.sh.s, layout)
            out, lse = rlk_ops.attention(q, k, v)
            ro, rl = ref64(q, k, v)
            r = {"forward_shape": f"B=1 S={self.sh.s}", "out_rel_err": rel(out, ro),
                 "out_max_abs_err": (out.double() - ro).abs().max().item(),
                 "lse_max_abs_err": (lse.double() - rl).abs().max().item(), "lse_dtype": str(lse.dtype)}
            del ro, rl
            s = self.sh.acc_bwd_s
            q, k, v = (t[:, :s].contiguous() for t in (q, k, v))
            out, lse = rlk_ops.attention(q, k, v)
            dout, dlse = self.rand(*out.shape), self.rand(*lse.shape, dtype=torch.float32)
            g = torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dlse, 1, self.sh.d ** -0.5, None, None, 0, 0,
                                            "disabled")
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            o64, l64 = ref64(q64, k64, v64)
            ref = torch.autograd.grad((o64 * dout.double()).sum() + (l64 * dlse.double()).sum(), (q64, k64, v64))
            r["backward_shape"] = f"B=1 S={s}, nonzero dlse"
            r.update({f"{n}_rel_err": rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), g, ref)})
            rep[layout] = r
            del o64, l64, ref
        rep["reference"] = "float64 math on the same bf16 inputs (einsum, logsumexp, softmax)"
        self.res["accuracy_vs_fp64"] = rep

    def timings_forward(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        rows = []
        for layout in self.sh.layouts:
            hq, hkv = self.sh.layouts[layout]
            for b, s in self.sh.fwd:
                q, k, v = self.qkv(b, s, layout)
                t = self.timeit({"rlk": lambda: rlk_ops.attention(q, k, v), "raw": lambda: self.raw_fwd(q, k, v)})
                row = {"layout": layout, "B": b, "S": s, "tokens": b * s, "rlk_us": t["rlk"], "raw_fa4_us": t["raw"],
                       "raw_over_rlk": round(t["raw"] / t["rlk"], 4),
                       "rlk_tflops": round(4 * b * s * s * hq * self.sh.d / 2 / t["rlk"] / 1e6, 1)}
                qt = q.transpose(1, 2).contiguous()
                kt, vt = (x.repeat_interleave(hq // hkv, 2).transpose(1, 2).contiguous() for x in (k, v))
                for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        with sdpa_kernel([backend]):
                            ts = self.timeit({name: lambda: sdpa(qt, kt, vt, is_causal=True)})[name]
                        row[f"{name}_us"] = ts
                        row[f"{name}_over_rlk"] = round(ts / t["rlk"], 4)
                    except Exception as e:
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print("   ", row, flush=True)
                del q, k, v, qt, kt, vt
        self.res["timings_forward"] = {
            "rows": rows, "ratio_meaning": "x_over_rlk = time(x) / time(rlk_ops.attention): >1 means rlk_ops is faster",
            "goal": "raw_over_rlk >= 0.97 at B*S >= 32k tokens",
            "goal_met": all(r["raw_over_rlk"] >= 0.97 for r in rows if r["tokens"] >= 32768)}

    def timings_backward(self):
        rows = []
        scale = self.sh.d ** -0.5
        for layout in self.sh.layouts:
            for b, s in self.sh.bwd_timed:
                q, k, v = self.qkv(b, s, layout)
                out, lse = rlk_ops.attention(q, k, v)
                dout = self.rand(*out.shape)
                t = self.timeit({
                    "rlk": lambda: torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, None, 1, scale, None, None,
                                                               0, 0, "disabled"),
                    "raw_det": lambda: self.raw_bwd(dout, q, k, v, out, lse, True),
                    "raw_nondet": lambda: self.raw_bwd(dout, q, k, v, out, lse, False)})
                hq = self.sh.layouts[layout][0]
                row = {"layout": layout, "B": b, "S": s, "rlk_us": t["rlk"], "raw_det_us": t["raw_det"],
                       "raw_nondet_us": t["raw_nondet"], "raw_det_over_rlk": round(t["raw_det"] / t["rlk"], 4),
                       "nondet_over_det": round(t["raw_nondet"] / t["raw_det"], 4),
                       "rlk_tflops": round(2.5 * 4 * b * s * s * hq * self.sh.d / 2 / t["rlk"] / 1e6, 1)}
                rows.append(row)
                print("   ", row, flush=True)
                del q, k, v, out, lse, dout
        self.res["timings_backward"] = {
            "rows": rows, "nondet_over_det": "time(FA4 deterministic=False) / time(deterministic=True): the "
                                             "speed kept by determinism (1.0 = free)"}

    def timings_paged(self):
        rows = []
        old = _validate.VALUE_CHECKS
        try:
            for layout in self.sh.layouts:
                hq, hkv = self.sh.layouts[layout]
                for ps in (self.sh.paged_pages if layout == "tp2" else self.sh.paged_pages[-1:]):
                    for b in self.sh.paged_batches:
                        for ctx in self.sh.paged_ctx:
                            rows.append(self._paged_row(layout, hq, hkv, ps, b, ctx))
        finally:
            _validate.VALUE_CHECKS = old
        self.res["timings_paged_decode"] = {
            "rows": rows, "value_checks": "off (RLK_VALUE_CHECKS=0) except value_checks_on_us",
            "ratio_meaning": "raw_over_rlk = time(raw FA4 paged decode) / time(rlk_ops.paged_attention)"}

    def _paged_row(self, layout, hq, hkv, ps, b, ctx):
        n = ctx // ps
        kc, vc = self.rand(b * n, ps, hkv, self.sh.d), self.rand(b * n, ps, hkv, self.sh.d)
        pt = torch.randperm(b * n, device=self.dev, generator=self.gen).to(torch.int32).view(b, n)
        sl = torch.full((b,), ctx, dtype=torch.int32, device=self.dev)
        q = self.rand(b, 1, hq, self.sh.d)
        _validate.VALUE_CHECKS = False
        t = self.timeit({"rlk": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl),
                         "raw": lambda: self.raw_paged(q, kc, vc, pt, sl)})
        row = {"layout": layout, "page_size": ps, "batch": b, "context": ctx, "rlk_us": t["rlk"], "raw_fa4_us": t["raw"],
               "raw_over_rlk": round(t["raw"] / t["rlk"], 4),
               "kv_gb_per_s": round(2 * b * ctx * hkv * self.sh.d * 2 / t["rlk"] / 1e3, 1)}
        if self.dev == "cuda":
            try:
                g_rlk = self.graph_us(lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl))
                g_raw = self.graph_us(lambda: self.raw_paged(q, kc, vc, pt, sl))
                row.update(graph_rlk_us=round(g_rlk, 2), graph_raw_us=round(g_raw, 2),
                           graph_raw_over_rlk=round(g_raw / g_rlk, 4))
            except Exception as e:
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if (b, ctx) == (self.sh.paged_batches[-1], self.sh.paged_ctx[0]):
            _validate.VALUE_CHECKS = True
            row["value_checks_on_us"] = self.timeit({"c": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl)})["c"]
            _validate.VALUE_CHECKS = False
        print("   ", row, flush=True)
        return row

    def overhead(self):
        """Host cost per eager call where the GPU work is tiny (decode, context 128)."""
        layout = "tp2"
        hq, hkv = self.sh.layouts[layout]
        q, k, v = self.qkv(1, 1, layout, sk=128)
        scale = self.sh.d ** -0.5
        kc, vc, pt, sl = self.paged(k, v, [128], 16, hkv)
        out, lse = rlk_ops.attention(q, k, v)
        dout = self.rand(*out.shape)
        old = _validate.VALUE_CHECKS
        try:
            _validate.VALUE_CHECKS = False
            t = self.timeit({
                "rlk_attention": lambda: rlk_ops.attention(q, k, v),
                "torch_ops_rlk_attention_fwd": lambda: torch.ops.rlk.attention_fwd(q, k, v, 1, scale, None, None, 0, 0,
                                                                                   "disabled"),
                "raw_flash_attn_func": lambda: self.raw_fwd(q, k, v),
                "rlk_paged_attention": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl),
                "raw_paged": lambda: self.raw_paged(q, kc, vc, pt, sl),
                "rlk_attention_bwd": lambda: torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, None, 1, scale,
                                                                         None, None, 0, 0, "disabled"),
                "raw_bwd_deterministic": lambda: self.raw_bwd(dout, q, k, v, out, lse, True)})
            _validate.VALUE_CHECKS = True
            t["rlk_paged_attention_value_checks_on"] = self.timeit(
                {"c": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl)})["c"]
        finally:
            _validate.VALUE_CHECKS = old
        self.res["eager_overhead"] = {
            "shape": f"decode: B=1, Sq=1, context 128, {layout}; paged page_size 16", "us_per_call": t,
            "attention_overhead_us": round(t["rlk_attention"] - t["raw_flash_attn_func"], 2),
            "paged_overhead_us": round(t["rlk_paged_attention"] - t["raw_paged"], 2),
            "paged_value_checks_us": round(t["rlk_paged_attention_value_checks_on"] - t["rlk_paged_attention"], 2),
            "bwd_overhead_us": round(t["rlk_attention_bwd"] - t["raw_bwd_deterministic"], 2)}

    def jit(self):
        """New shapes of already-compiled configurations must not compile again."""
        before = loader.jit_cache_sizes(self.fa4)
        for layout in self.sh.layouts:
            for b, s in ((3, 1000), (2, 333)):
                q, k, v = self.qkv(b, s, layout)
                out, lse = rlk_ops.attention(q, k, v)
                torch.ops.rlk.attention_bwd(self.rand(*out.shape), q, k, v, out, lse, None, 1, self.sh.d ** -0.5, None,
                                            None, 0, 0, "disabled")
                rlk_ops.attention(q[:, -1:], k, v)  # decode
        after = loader.jit_cache_sizes(self.fa4)
        self.res["jit"] = {"compiled_kernels_before": before, "compiled_kernels_after": after,
                           "no_recompile_for_new_shapes": before == after and before["_flash_attn_fwd"] is not None,
                           "shapes": "B in {3, 2}, S in {1000, 333}: prefill, decode, backward, both layouts",
                           "first_call_seconds": self.res.get("first_call_seconds")}


def ref64(q, k, v):
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    sk, g = k.shape[1], hq // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * d ** -0.5
    qp = torch.arange(sq, device=q.device) + sk - sq
    s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > qp[:, None], -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double().repeat_interleave(g, 2)), \
        torch.logsumexp(s, -1)


def diff(name, a, b):
    d = (a.double() - b.double()).abs()
    return {f"{name}_max_abs_diff": d.max().item(), f"{name}_rel_diff": rel(a, b),
            f"{name}_equal_fraction": (a == b).double().mean().item()}


# ----------------------------------------------------------------- markdown
def markdown(r: dict) -> str:
    env, fa4 = r.get("environment", {}), r.get("fa4", {})
    cells = r.get("bitwise", [])
    layouts = list(dict.fromkeys(c["layout"] for c in cells))
    names = list(dict.fromkeys(c["name"] for c in cells))
    by = {(c["name"], c["layout"]): c for c in cells}
    out = [f"FA4 backend on {env.get('gpu')} ({env.get('gpu_arch')}), flash-attn-4 {fa4.get('version')}, "
           f"torch {env.get('torch')}; `num_splits=1`, `pack_gqa=True`, deterministic backward. "
           f"Produced by `{r.get('command')}` ({r.get('finished')})." + (" DRY RUN: proves nothing." if r.get("dry_run") else ""),
           "", "Bitwise (torch.equal) cells, Qwen3-8B shapes, bf16, D=128 (tp2: Hq=16/Hkv=4, tp1: 32/8):", "",
           "| claim | " + " | ".join(layouts) + " | what |", "|---|" + "---|" * len(layouts) + "---|"]
    for n in names:
        vals = [("yes" if by[(n, lay)]["equal"] else "**NO**") if (n, lay) in by else "-" for lay in layouts]
        what = next(by[(n, lay)]["what"] for lay in layouts if (n, lay) in by)
        out.append(f"| {n} | " + " | ".join(vals) + f" | {what} |")
    acc = r.get("accuracy_vs_fp64", {})
    if acc:
        out += ["", "Accuracy vs float64 math:", "", "| layout | out rel err | lse max abs err | dq | dk | dv |",
                "|---|---|---|---|---|---|"]
        for lay in layouts:
            a = acc.get(lay, {})
            if a:
                out.append(f"| {lay} | {a['out_rel_err']:.2e} | {a['lse_max_abs_err']:.2e} | {a['dq_rel_err']:.2e} | "
                           f"{a['dk_rel_err']:.2e} | {a['dv_rel_err']:.2e} |")
    dr = r.get("drift_cpu_vs_cuda")
    if dr:
        out += ["", f"CPU reference vs CUDA ({dr['shape']}; not bitwise: FA4 visits key blocks last to first and "
                "uses ex2.approx): " + ", ".join(f"{n} max |diff| {dr[n + '_max_abs_diff']:.2e} "
                                                  f"({100 * dr[n + '_equal_fraction']:.1f}% equal)"
                                                  for n in ("out", "lse", "dq", "dk", "dv") if n + "_max_abs_diff" in dr)
                + "."]
    tf = r.get("timings_forward", {}).get("rows", [])
    if tf:
        out += ["", "Forward, causal, microseconds (ratio = other / rlk_ops; >1: rlk_ops faster; raw = "
                "`flash_attn_func` with the same arguments):", "",
                "| layout | B x S | rlk_ops | TFLOP/s | raw FA4 | raw/rlk | SDPA cuDNN | cuDNN/rlk | SDPA flash | flash/rlk |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for x in tf:
            out.append(f"| {x['layout']} | {x['B']} x {x['S']} | {x['rlk_us']:.0f} | {x['rlk_tflops']} | "
                       f"{x['raw_fa4_us']:.0f} | {x['raw_over_rlk']:.3f} | {x.get('sdpa_cudnn_us', '-')} | "
                       f"{x.get('sdpa_cudnn_over_rlk', '-')} | {x.get('sdpa_flash_us', '-')} | "
                       f"{x.get('sdpa_flash_over_rlk', '-')} |")
    tb = r.get("timings_backward", {}).get("rows", [])
    if tb:
        out += ["", "Backward, causal, microseconds:", "",
                "| layout | B x S | rlk_ops (deterministic) | TFLOP/s | raw FA4 deterministic | raw/rlk | "
                "FA4 non-deterministic | nondet/det |", "|---|---|---|---|---|---|---|---|"]
        for x in tb:
            out.append(f"| {x['layout']} | {x['B']} x {x['S']} | {x['rlk_us']:.0f} | {x['rlk_tflops']} | "
                       f"{x['raw_det_us']:.0f} | {x['raw_det_over_rlk']:.3f} | {x['raw_nondet_us']:.0f} | "
                       f"{x['nondet_over_det']:.3f} |")
    tp = r.get("timings_paged_decode", {}).get("rows", [])
    if tp:
        out += ["", "Paged decode (Sq=1, value checks off), microseconds, eager and CUDA-graph replay:", "",
                "| layout | page | batch | context | rlk_ops | raw FA4 | raw/rlk | graph rlk | graph raw | raw/rlk | KV GB/s |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in tp:
            out.append(f"| {x['layout']} | {x['page_size']} | {x['batch']} | {x['context']} | {x['rlk_us']:.1f} | "
                       f"{x['raw_fa4_us']:.1f} | {x['raw_over_rlk']:.3f} | {x.get('graph_rlk_us', '-')} | "
                       f"{x.get('graph_raw_us', '-')} | {x.get('graph_raw_over_rlk', '-')} | {x['kv_gb_per_s']} |")
    oh = r.get("eager_overhead")
    if oh:
        out += ["", f"Eager per-call overhead ({oh['shape']}): attention +{oh['attention_overhead_us']} us, "
                f"paged +{oh['paged_overhead_us']} us (value checks +{oh['paged_value_checks_us']} us), "
                f"backward +{oh['bwd_overhead_us']} us over raw FA4."]
    j = r.get("jit")
    if j:
        out += ["", f"FA4 JIT: compiled kernels {j['compiled_kernels_after']}; new shapes of compiled "
                f"configurations compile nothing: {j['no_recompile_for_new_shapes']}."]
    if r.get("errors"):
        out += ["", "Sections that failed: " + ", ".join(r["errors"])]
    return "\n".join(out) + "\n"


def print_summary(r):
    cells = r.get("bitwise", [])
    print("\n==== summary")
    print(f"bitwise cells: {sum(c['equal'] for c in cells)}/{len(cells)} true")
    for c in cells:
        if not c["equal"]:
            print(f"  FALSE: {c['layout']} {c['name']} {c.get('failing')}")
    for x in r.get("timings_forward", {}).get("rows", []):
        print(f"fwd {x['layout']} {x['B']}x{x['S']}: rlk {x['rlk_us']:.0f}us raw/rlk {x['raw_over_rlk']:.3f} "
              f"cudnn/rlk {x.get('sdpa_cudnn_over_rlk')} flash/rlk {x.get('sdpa_flash_over_rlk')}")
    for x in r.get("timings_backward", {}).get("rows", []):
        print(f"bwd {x['layout']} {x['B']}x{x['S']}: rlk {x['rlk_us']:.0f}us raw/rlk {x['raw_det_over_rlk']:.3f} "
              f"nondet/det {x['nondet_over_det']:.3f}")
    if "eager_overhead" in r:
        o = r["eager_overhead"]
        print(f"overhead us: attention {o['attention_overhead_us']} paged {o['paged_overhead_us']} "
              f"bwd {o['bwd_overhead_us']}")
    print("errors:", list(r.get("errors", {})) or "none")


def install_dry_run():
    """CPU, stand-in FA4 (tests/test_fa4.py), ops routed to the fa4 backend."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_fa4 import make_fake_fa4

    from rlk_ops.kernels import dispatch
    from rlk_ops.kernels import fa4 as fa4_backend

    sys.modules[loader.INTERFACE_MODULE] = make_fake_fa4()
    loader.installed_version = lambda: "dry-run"
    fa4_backend.check_available = lambda op: None  # no GPU here; the tensors stay on the CPU
    dispatch._DEVICES["fa4"] = ("cuda", "cpu")   # the stand-in runs on CPU tensors (the device gate refused it)
    rlk_ops.use_backend(attention_fwd="fa4", attention_bwd="fa4", paged_attention="fa4").__enter__()


def main():
    args = arguments(__doc__.split("\n")[0]).parse_args()
    if args.md_only:
        return rewrite_markdown(args.out, args.md, markdown, print_summary)
    dev, shapes = device_and_shapes(args, "benchmarks/attention.py", install_dry_run, DRY, Shapes)
    t0 = time.perf_counter()
    bench = Bench(dev, shapes, args.out, args.dry_run)
    bench.res["fa4_import_seconds"] = round(time.perf_counter() - t0, 2)
    sections = [("environment", bench.environment)]
    sections += [(f"bitwise_{lay}", lambda lay=lay: bench.bitwise(lay)) for lay in shapes.layouts]
    sections += [("drift", bench.drift), ("accuracy", bench.accuracy), ("timings_forward", bench.timings_forward),
                 ("timings_backward", bench.timings_backward), ("timings_paged", bench.timings_paged),
                 ("overhead", bench.overhead), ("jit", bench.jit), ("environment_after", bench.environment)]
    bench.run_sections(sections, args.sections)
    return bench.finish(t0, args.md, markdown, print_summary)


if __name__ == "__main__":
    sys.exit(main())
