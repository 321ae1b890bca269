"""canonical:C split-KV on the H200 (FA4 partials + Triton merge): bitwise matrix, accuracy, speed.

    python benchmarks/canonical.py --out results/h200/canonical.json --md results/h200/canonical.md --commit SHA
    python benchmarks/canonical.py --md-only --out results/h200/canonical.json --md results/h200/canonical.md
    RLK_FA4_DRY_RUN=1 TRITON_INTERPRET=1 python benchmarks/canonical.py --dry-run --out /tmp/c.json --md /tmp/c.md

Shapes: Qwen3-8B TP=2 shard, Hq=16, Hkv=4, D=128, bf16, causal.

* ``bitwise`` (every cell a torch.equal): the Triton merge vs the CPU reference merge; the
  two FA4 equalities the policy rests on (training diagonal row vs its decode pair,
  training full row vs a causal decode pair that sees every key); for each C and page
  size: every decode row (alone, B = 1) and all of them in one batch (with a table padded
  wider, i.e. extra empty pairs) vs the packed training forward, at positions on and off
  chunk boundaries; chunked-prefill rows vs training; run-to-run forward and backward.
* ``accuracy``: out and lse against float64 math, single pass next to canonical:C.
* ``decode``: paged decode (page 16, Sq=1, value checks off), CUDA-graph replay medians:
  FA4 strict single pass and canonical:C for several C, the generic route (sessions 14-15 also
  timed the whole-sequence walk with --walk, removed after session 16; the report still renders
  those rows);
  ratios against FlashInfer auto split (measured here when flashinfer is installed, else read
  from results/h200/kernels.json, named in ``flashinfer_auto_source``).
* ``training``: forward and forward+backward at B=4, S=8192, single pass vs canonical:C
  (eager, CUDA events, interleaved repetitions; canonical's host-side plan is included).

--dry-run: CPU, tiny shapes, stand-in FA4 (tests/test_fa4.py) and the Triton interpreter
for the merge: checks the script, proves nothing. Exit status 1 if a bitwise cell is false
or a section failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rlk_ops  # noqa: E402
from _report import Report, arguments, device_and_shapes, graph_time_us, graph_times_us, rewrite_markdown  # noqa: E402  (benchmarks/_report.py)
from rlk_ops.kernels.cpu import canonical  # noqa: E402
from rlk_ops.kernels.dispatch import kernel_for  # noqa: E402
from rlk_ops.kernels.cpu import merge as cpu_merge  # noqa: E402
from rlk_ops.meta import provenance  # noqa: E402
from rlk_ops.ops import _validate  # noqa: E402

BF16 = torch.bfloat16
TARGET_DECODE_VS_FI = 1.15      # canonical decode / FlashInfer auto, batch 1 and 8
TARGET_TRAIN_VS_SINGLE = 1.15   # canonical fwd+bwd / single-pass fwd+bwd, B=4 S=8k


@dataclass
class Shapes:
    hq: int = 16
    hkv: int = 4
    d: int = 128
    lens: tuple = (8192, 3000, 1029)        # packed training sequences of the bitwise matrix
    chunks: tuple = (256, 768, 1024, 2048)  # C of the bitwise matrix
    pages: tuple = (16, 128)
    acc_s: int = 8192
    acc_chunks: tuple = (512, 640, 768, 1024)
    decode_cases: tuple = ((1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 8192), (64, 32768))
    decode_chunks: tuple = (512, 640, 768, 1024)
    decode_page: int = 16
    train: tuple = (4, 8192)
    train_chunks: tuple = (512, 640, 768, 1024)
    target_ms: float = 8.0
    reps: int = 5
    synced_reps: int = 41                   # training's fwd+bwd timed call by call (15 until session 18)


DRY = Shapes(hq=4, hkv=1, d=128, lens=(300, 140, 129), chunks=(128, 256), pages=(16, 128), acc_s=300,
             acc_chunks=(128,), decode_cases=((1, 512), (3, 320)), decode_chunks=(128,), train=(1, 300),
             train_chunks=(128,), target_ms=1.0, reps=2, synced_reps=2)


def beq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Bench(Report):
    def __init__(self, dev, sh: Shapes, out_path, dry):
        super().__init__("benchmarks/canonical.py", dev, sh, out_path, dry)
        self.scale = sh.d ** -0.5

    # ------------------------------------------------------------ helpers
    def cell(self, name, equal, what, **extra):
        self.res["bitwise"].append({"name": name, "equal": bool(equal), "what": what, **extra})
        print(f"  [{'ok' if equal else 'FAIL'}] {name}: {what} {extra or ''}", flush=True)

    def graph_us(self, fn):
        """Median us per call: _report.graph_time_us (CUDA graph of up to 200 calls, replayed
        ``reps`` times; GPU time of every launch the call makes, no host overhead). CPU: wall
        clock of 2 calls."""
        if self.dev != "cuda":
            fn()
            t0 = time.perf_counter()
            for _ in range(2):
                fn()
            return (time.perf_counter() - t0) * 1e6 / 2
        return graph_time_us(fn, self.sh.target_ms, self.sh.reps, max_calls=200)["us"]

    def graph_us_many(self, fns: dict) -> dict:
        """``graph_us`` of functions compared by ratio: _report.graph_times_us (each its own CUDA
        graph, the graphs replayed in turn, ``reps`` rounds). CPU: ``graph_us`` of each."""
        if self.dev != "cuda":
            return {name: self.graph_us(fn) for name, fn in fns.items()}
        return {name: t["us"] for name, t in graph_times_us(fns, self.sh.target_ms, self.sh.reps,
                                                           max_calls=200).items()}

    def timed_row(self, row: dict, fns: dict, ref: str = "fa4_strict") -> dict:
        """``graph_us_many(fns)`` into ``row``: ``<name>_us`` each, and ``<name>_over_<ref>`` for
        every other name (the ratios of one interleaved run). Returns row."""
        for name, us in self.graph_us_many(fns).items():
            row[f"{name}_us"] = round(us, 2)
        for name in fns:
            if name != ref:
                row[f"{name}_over_{ref}"] = round(row[f"{name}_us"] / row[f"{ref}_us"], 4)
        return row

    def eager_us(self, fns: dict) -> dict:
        """Median us per call of each fn, interleaved per repetition (eager, CUDA events)."""
        iters = {}
        for name, fn in fns.items():
            fn()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            iters[name] = max(2, min(50, int(self.sh.target_ms * 5e-3 / max(time.perf_counter() - t0, 1e-6))))
        times = {name: [] for name in fns}
        for _ in range(self.sh.reps):
            for name, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    fn()
                self.sync()
                times[name].append((time.perf_counter() - t0) * 1e6 / iters[name])
        return {name: round(statistics.median(t), 1) for name, t in times.items()}

    def alone_us(self, fns: dict, reps: int) -> dict:
        """Median us per call of each fn, each call alone: synchronized before and after, the fns
        alternating, ``reps`` rounds (no call overlaps another's host work or kernels)."""
        return {name: statistics.median(t) for name, t in self.alone_samples(fns, reps).items()}

    def alone_samples(self, fns: dict, reps: int) -> dict:
        """``alone_us``'s samples: per fn, its us in each round (round i of every fn is one pass of the fns)."""
        times = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                times[name].append((time.perf_counter() - t0) * 1e6)
        return times

    def fa4_single(self):
        from rlk_ops.kernels.fa4 import kernels as fa4_kernels

        return fa4_kernels

    def cache(self, k, v, starts, lens, page_size, extra_cols=3):
        """Sequences' K/V in shuffled pages (finite garbage elsewhere), padded tables."""
        sh = self.sh
        need = [math.ceil(n / page_size) for n in lens]
        num_pages = sum(need) + 4
        k_cache = self.rand(num_pages, page_size, sh.hkv, sh.d)
        v_cache = self.rand(num_pages, page_size, sh.hkv, sh.d)
        perm = torch.randperm(num_pages, device=self.dev, generator=self.gen)
        table = torch.full((len(lens), max(need) + extra_cols), 10**6, dtype=torch.int32, device=self.dev)
        used = 0
        for b, n in enumerate(need):
            pages = perm[used:used + n]
            used += n
            table[b, :n] = pages.int()
            slots = (pages[:, None] * page_size + torch.arange(page_size, device=self.dev)).flatten()[:lens[b]]
            k_cache.view(-1, sh.hkv, sh.d)[slots] = k[starts[b]:starts[b] + lens[b]]
            v_cache.view(-1, sh.hkv, sh.d)[slots] = v[starts[b]:starts[b] + lens[b]]
        return k_cache, v_cache, table

    # ------------------------------------------------------------ sections
    def decode_inputs(self, cases):
        """Per (batch, context): ``(bsz, ctx, q, k_cache, v_cache, page_table, seq_lens)``, every
        sequence ``ctx`` long in shuffled pages of ``decode_page``; value checks off meanwhile
        (they sync, which a CUDA graph cannot hold); the allocator's cache emptied between cases."""
        sh = self.sh
        old, _validate.VALUE_CHECKS = _validate.VALUE_CHECKS, False
        try:
            for bsz, ctx in cases:
                ps = sh.decode_page
                n = -(-ctx // ps)
                kc, vc = self.rand(bsz * n, ps, sh.hkv, sh.d), self.rand(bsz * n, ps, sh.hkv, sh.d)
                pt = torch.randperm(bsz * n, device=self.dev, generator=self.gen).to(torch.int32).view(bsz, n)
                sl = torch.full((bsz,), ctx, dtype=torch.int32, device=self.dev)
                yield bsz, ctx, self.rand(bsz, 1, sh.hq, sh.d), kc, vc, pt, sl
                del kc, vc, pt, sl
                if self.dev == "cuda":
                    torch.cuda.empty_cache()
        finally:
            _validate.VALUE_CHECKS = old

    def environment(self):
        from rlk_ops.kernels.fa4 import loader

        self.res["env"] = provenance.environment()
        self.res["fa4"] = loader.backend_info()

    def merge(self):
        """Triton merge == CPU reference merge (bitwise), at training and decode layouts."""
        sh = self.sh
        t = 512 if self.dry else 4096
        for n, lead, rows in ((8, (), t), (32, (64,), 1)):
            out_parts = self.rand(n, *lead, rows, sh.hq, sh.d)
            lse_parts = self.rand(n, *lead, sh.hq, rows, dtype=torch.float32) * 3
            lse_parts[n // 2, ..., 1, :] = -math.inf  # empty states
            with provenance.capture() as log:
                got = rlk_ops.merge_attn_states(out_parts, lse_parts)
            backends = sorted({r.actual_backend for r in log.records()})
            ref = cpu_merge.merge_attn_states(out_parts.cpu(), lse_parts.cpu())
            self.cell(f"merge_vs_cpu_N{n}_{'x'.join(map(str, lead)) or 'varlen'}",
                      beq(got[0].cpu(), ref[0]) and beq(got[1].cpu(), ref[1]),
                      "triton merge == cpu reference merge (out and lse)", backend=backends)
            again = rlk_ops.merge_attn_states(out_parts, lse_parts)
            self.cell(f"merge_run_to_run_N{n}", beq(got[0], again[0]) and beq(got[1], again[1]), "run to run")
        if self.dev == "cuda":
            out_parts = self.rand(8, 4 * 8192, sh.hq, sh.d)
            lse_parts = self.rand(8, sh.hq, 4 * 8192, dtype=torch.float32)
            us = self.graph_us(lambda: rlk_ops.merge_attn_states(out_parts, lse_parts))
            gb = (out_parts.numel() * 2 + out_parts[0].numel() * 2) / 1e9
            self.res["merge_timing"] = {"states": 8, "rows": 4 * 8192, "us": round(us, 1),
                                        "GBps": round(gb / (us * 1e-6), 1)}

    def fa4_equalities(self):
        """The two FA4 single-pass equalities, measured directly (no merge involved)."""
        sh, fa4 = self.sh, self.fa4_single()
        n = sh.lens[0]
        q, k, v = self.rand(n, sh.hq, sh.d), self.rand(n, sh.hkv, sh.d), self.rand(n, sh.hkv, sh.d)
        cu1 = lambda m: torch.tensor([0, m], dtype=torch.int32, device=self.dev)  # noqa: E731
        for page_size in sh.pages:
            k_cache, v_cache, table = self.cache(k, v, [0], [n], page_size)
            for chunk in sh.chunks:
                if 2 * chunk > n or chunk % page_size:
                    continue
                per = chunk // page_size
                c0 = chunk  # chunk 1's diagonal piece; chunk 0's full piece
                diag = fa4.attention_fwd(q[c0:c0 + chunk], k[c0:c0 + chunk], v[c0:c0 + chunk], 1, self.scale,
                                         cu1(chunk), cu1(chunk), chunk, chunk)
                full = fa4.attention_fwd(q[chunk:n], k[:chunk], v[:chunk], 0, self.scale, cu1(n - chunk),
                                         cu1(chunk), n - chunk, chunk)
                ok_d, ok_f = True, True
                idx_d = sorted({i for i in (0, 1, 63, 64, 127, 128, 129, chunk // 2, chunk - 2, chunk - 1)
                                if i < chunk})
                for i in idx_d:
                    o, l = fa4.paged_attention(q[None, c0 + i:c0 + i + 1], k_cache, v_cache,
                                               table[:1, per:2 * per].contiguous(),
                                               torch.tensor([i + 1], dtype=torch.int32, device=self.dev), self.scale)
                    ok_d &= beq(o[0, 0], diag[0][i]) and beq(l[0, :, 0], diag[1][:, i])
                idx_f = sorted({p for p in (chunk, chunk + 1, chunk + 127, 2 * chunk, n // 2, n - 1) if p < n})
                for p in idx_f:
                    o, l = fa4.paged_attention(q[None, p:p + 1], k_cache, v_cache, table[:1, :per].contiguous(),
                                               torch.tensor([chunk], dtype=torch.int32, device=self.dev), self.scale)
                    ok_f &= beq(o[0, 0], full[0][p - chunk]) and beq(l[0, :, 0], full[1][:, p - chunk])
                self.cell(f"fa4_diag_row_vs_decode_pair_C{chunk}_p{page_size}", ok_d,
                          "training diagonal row (causal varlen piece) == decode pair of its chunk "
                          "(causal paged, seqused_k = keys seen)", rows=idx_d)
                self.cell(f"fa4_full_row_vs_decode_pair_C{chunk}_p{page_size}", ok_f,
                          "training full row (non-causal, C keys) == decode pair (causal paged, seqused_k = C)",
                          positions=idx_f)

    def in_place(self):
        """FA4 writing each state slot in place (the fa4 backend's executor) == copying each
        piece out and running the tight single pass (the gathering executor): every state
        row, merged out and lse; causal whole sequences, bottom-right query ranges
        (chunked-prefill shapes), non-causal, and a batch of equal lengths (its full calls dense
        FA4 calls on strided views: fa4 canonical.DENSE_SLOTS)."""
        from rlk_ops.kernels.fa4 import canonical as fa4_canonical

        sh, fa4 = self.sh, self.fa4_single()
        lens = list(sh.lens)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        total = sum(lens)
        q, k, v = self.rand(total, sh.hq, sh.d), self.rand(total, sh.hkv, sh.d), self.rand(total, sh.hkv, sh.d)
        nq = [lens[0], min(333, lens[1]), lens[2]]
        shapes = {"causal_whole": ([(a, n, a, n) for a, n in zip(starts, lens)], True),
                  "causal_bottom_right": ([(a + n - m, m, a, n) for a, n, m in zip(starts, lens, nq)], True),
                  "noncausal": ([(a, n, a, n) for a, n in zip(starts, lens)], False),
                  # equal lengths: the full calls are strided batches, dense FA4 calls (DENSE_SLOTS)
                  "causal_dense_batch": ([(b * (total // 3), total // 3, b * (total // 3), total // 3)
                                          for b in range(3)], True)}
        for chunk in sh.chunks:
            for name, (seqs, causal) in shapes.items():
                chunk_plan = canonical.plan(seqs, chunk, causal, self.dev)
                seen = []

                def merge(o, l, seen=seen):
                    seen.append((o.clone(), l.clone()))
                    return rlk_ops.merge_attn_states(o, l)

                got = canonical.run(chunk_plan, q, k, v, self.scale, fa4_canonical.attend_into, merge)
                ref = canonical.run(chunk_plan, q, k, v, self.scale, canonical.gathered(fa4.attention_fwd), merge)
                multi = canonical.run(chunk_plan, q, k, v, self.scale, fa4_canonical.attend_into, merge, streams=4)
                (oa, la), (ob, lb), (om, lm) = seen
                self.cell(f"in_place_streams_C{chunk}_{name}",
                          beq(la, lm) and beq(oa[(la != -math.inf).transpose(1, 2)],
                                              om[(lm != -math.inf).transpose(1, 2)])
                          and beq(got[0], multi[0]) and beq(got[1], multi[1]),
                          "the in-place calls on 4 side streams == on one stream: every state row, merged out and lse")
                present = (la != -math.inf).transpose(1, 2)
                ok = beq(la, lb) and beq(oa[present], ob[present]) and beq(got[0], ref[0]) and beq(got[1], ref[1])
                self.cell(f"in_place_vs_gathering_C{chunk}_{name}", ok,
                          "FA4 in place per state slot (seqused_q/seqused_k, out=/lse=) == pieces copied out, "
                          "tight single pass: every state row, merged out and lse",
                          calls=len(chunk_plan.calls), slots=chunk_plan.num_slots)
                del seen

    def decode_profile(self):
        """Where canonical:C decode time goes: each of its three launches timed alone
        (CUDA-graph replay), the merge with its former blocking (16 rows per program, looped
        walk) next to merge_config's, and FA4's pair call with FA4's default SM90 tile
        (128 x 128, two MMA warpgroups) next to tile (64, 128) (one warpgroup; decode has
        G = 4 query rows per tile): same bits (every pair's out and lse) and time. Also
        measured, for adoption if equal and faster: the tile-64 pair call without FA4's
        intra-warpgroup overlap, the merge's 2D max, and the whole op with programmatic
        dependent launch for its two Triton launches (merge.PDL)."""
        from rlk_ops.kernels.fa4 import loader
        from rlk_ops.kernels.triton import merge as tm

        sh = self.sh
        mod = loader.load().module
        rows = []
        cases = ((1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 8192)) if not self.dry else sh.decode_cases
        chunks = (256, 512, 1024, 2048) if not self.dry else sh.decode_chunks
        ps = sh.decode_page
        for bsz, ctx, q, kc, vc, pt, sl in self.decode_inputs(cases):

            def strict(tile=None, pack=True):
                return mod._flash_attn_fwd(q, kc, vc, page_table=pt, seqused_k=sl, softmax_scale=self.scale,
                                           causal=True, num_splits=1, pack_gqa=pack, return_lse=True,
                                           tile_mn=tile)[:2]

            so, sl_ = strict()
            so64, sl64 = strict((64, 128))
            sonp, slnp = strict((64, 128), False)
            row = {"batch": bsz, "context": ctx,
                   "strict_us": round(self.graph_us(strict), 2),
                   "strict_tile64_us": round(self.graph_us(lambda: strict((64, 128))), 2),
                   "strict_tile64_equal": beq(so, so64) and beq(sl_, sl64),
                   "strict_tile64_nopack_us": round(self.graph_us(lambda: strict((64, 128), False)), 2),
                   "strict_tile64_nopack_equal": beq(so, sonp) and beq(sl_, slnp)}
            for c in chunks:
                qp, ptab, plens, klens, n = tm.decode_pairs(q, pt, sl, ps, c)

                def pairs(tile=None, pack=True, overlap=None, qp=qp, ptab=ptab, klens=klens):
                    return mod._flash_attn_fwd(qp, kc, vc, page_table=ptab, seqused_k=klens,
                                               softmax_scale=self.scale, causal=True, num_splits=1,
                                               pack_gqa=pack, return_lse=True, tile_mn=tile,
                                               intra_wg_overlap=overlap)[:2]

                o, l = pairs()
                o64, l64 = pairs((64, 128))
                onp, lnp = pairs((64, 128), False)
                ono, lno = pairs((64, 128), True, False)
                st = (o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1), plens.view(n, bsz))
                old_cfg = (16, 1, 0)
                m_new, m_old = tm.merge_attn_states(*st), tm.merge_attn_states(*st, config=old_cfg)
                cfg_2d = (*tm.merge_config(bsz * sh.hq, n, sh.d, q.device)[:3], tm.C.pow2(n))
                m_2d = tm.merge_attn_states(*st, config=cfg_2d)

                def op(c=c):
                    return rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}")

                m_op = op()
                tm.PDL = True
                try:
                    m_pdl = op()
                    pdl_us, pdl_equal = round(self.graph_us(op), 2), beq(m_pdl[0], m_op[0]) and beq(m_pdl[1], m_op[1])
                except Exception as e:  # noqa: BLE001 - recorded: PDL is a measured option, off by default
                    pdl_us, pdl_equal = f"{type(e).__name__}: {str(e)[:200]}", False
                finally:
                    tm.PDL = False
                row[f"C{c}"] = {
                    "pairs": n * bsz,
                    "layout_us": round(self.graph_us(lambda: tm.decode_pairs(q, pt, sl, ps, c)), 2),
                    "fa4_pairs_us": round(self.graph_us(pairs), 2),
                    "fa4_pairs_tile64_us": round(self.graph_us(lambda: pairs((64, 128))), 2),
                    "tile64_equal": beq(o, o64) and beq(l, l64),
                    "fa4_pairs_tile64_nopack_us": round(self.graph_us(lambda: pairs((64, 128), False)), 2),
                    "tile64_nopack_equal": beq(o, onp) and beq(l, lnp),
                    "fa4_pairs_tile64_no_overlap_us": round(self.graph_us(lambda: pairs((64, 128), True, False)), 2),
                    "tile64_no_overlap_equal": beq(o, ono) and beq(l, lno),
                    "merge_us": round(self.graph_us(lambda: tm.merge_attn_states(*st)), 2),
                    "merge_old_config_us": round(self.graph_us(
                        lambda: tm.merge_attn_states(*st, config=old_cfg)), 2),
                    "merge_config": list(tm.merge_config(bsz * sh.hq, n, sh.d, q.device)),
                    "merge_configs_equal": beq(m_new[0], m_old[0]) and beq(m_new[1], m_old[1]),
                    "merge_2d_max_us": round(self.graph_us(lambda: tm.merge_attn_states(*st, config=cfg_2d)), 2),
                    "merge_2d_max_equal": beq(m_2d[0], m_old[0]) and beq(m_2d[1], m_old[1]),
                    "total_us": round(self.graph_us(op), 2),
                    "total_pdl_us": pdl_us, "pdl_equal": pdl_equal}
            rows.append(row)
            print("   ", row, flush=True)
        self.res["decode_profile"] = {"rows": rows, "page_size": self.sh.decode_page,
                                      "timing": "CUDA-graph replay median (us per call), each launch alone"}

    def seqused_zero_probe(self):
        """Does FA4 accept seqused_k = 0? The decode route never relies on it (an empty pair is
        handed one key and skipped by the merge). Last section: a kernel fault would poison
        the CUDA context, and everything else is saved by then."""
        sh, fa4 = self.sh, self.fa4_single()
        n = 256
        q, k, v = self.rand(n, sh.hq, sh.d), self.rand(n, sh.hkv, sh.d), self.rand(n, sh.hkv, sh.d)
        k_cache, v_cache, table = self.cache(k, v, [0], [n], 16)
        try:
            o, l = fa4.paged_attention(q[None, :1].expand(2, 1, sh.hq, sh.d).contiguous(), k_cache, v_cache,
                                       table[:2 if table.shape[0] > 1 else 1].expand(2, -1).contiguous(),
                                       torch.tensor([0, 5], dtype=torch.int32, device=self.dev), self.scale)
            self.sync()
            self.res["fa4_seqused_k_zero"] = {"ran": True, "out_all_zero": bool((o[0] == 0).all()),
                                              "lse": str(l[0, :2, 0].tolist())}
        except Exception as e:  # noqa: BLE001 - recorded, the policy does not depend on it
            self.res["fa4_seqused_k_zero"] = {"ran": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}

    def bitwise(self):
        """Training rows == decode rows (alone and batched) == chunked-prefill rows, per C and page size."""
        sh = self.sh
        lens = list(sh.lens)
        total = sum(lens)
        starts = [0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]
        q, k, v = self.rand(total, sh.hq, sh.d), self.rand(total, sh.hkv, sh.d), self.rand(total, sh.hkv, sh.d)
        cu = torch.tensor([*starts, total], dtype=torch.int32, device=self.dev)
        old, _validate.VALUE_CHECKS = _validate.VALUE_CHECKS, True
        for chunk in sh.chunks:
            policy = f"canonical:{chunk}"
            args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
            out, lse = rlk_ops.attention(q, k, v, split_kv=policy, **args)
            again = rlk_ops.attention(q, k, v, split_kv=policy, **args)
            self.cell(f"train_run_to_run_C{chunk}", beq(out, again[0]) and beq(lse, again[1]),
                      "packed training forward, run to run", lens=lens)
            single = rlk_ops.attention(q, k, v, **args)
            first = slice(0, chunk)
            self.cell(f"first_chunk_rows_equal_single_pass_C{chunk}",
                      beq(out[first], single[0][first]) and beq(lse[:, first], single[1][:, first]),
                      "rows whose keys all sit in chunk 0 are single-pass rows (one state merges exactly)")
            later = slice(chunk, lens[0])
            self.res.setdefault("policy_in_effect", {})[policy] = round(
                (out[later] != single[0][later]).flatten(1).any(-1).float().mean().item(), 4)
            for page_size in sh.pages:
                if chunk % page_size:
                    continue
                k_cache, v_cache, table = self.cache(k, v, starts, lens, page_size)
                rows, positions, seqs = [], [], []
                for b, n in enumerate(lens):
                    for p in sorted({p for p in (0, 1, 127, 128, chunk - 1, chunk, chunk + 1, 2 * chunk - 1,
                                                 2 * chunk, 2 * chunk + 129, 5 * chunk + 3, n // 2, n - 1)
                                     if 0 <= p < n}):
                        rows.append(starts[b] + p)
                        positions.append(p)
                        seqs.append(b)
                alone_ok = True
                for r, p, b in zip(rows, positions, seqs):
                    o, l = rlk_ops.paged_attention(q[None, r:r + 1], k_cache, v_cache, table[b:b + 1],
                                                   torch.tensor([p + 1], dtype=torch.int32, device=self.dev),
                                                   split_kv=policy)
                    alone_ok &= beq(o[0, 0], out[r]) and beq(l[0, :, 0], lse[:, r])
                self.cell(f"decode_alone_C{chunk}_p{page_size}", alone_ok,
                          "decode (B=1) row == training row, every listed position", n_rows=len(rows))
                seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=self.dev)
                qd = q[rows][:, None]
                batch_table = table[seqs]
                for name, tab in (("batch", batch_table),
                                  ("batch_wide_table", torch.cat([batch_table, torch.zeros(
                                      len(rows), 2 * chunk // page_size + 1, dtype=torch.int32,
                                      device=self.dev)], 1))):
                    o, l = rlk_ops.paged_attention(qd, k_cache, v_cache, tab, seq_lens, split_kv=policy)
                    self.cell(f"decode_{name}_C{chunk}_p{page_size}",
                              beq(o[:, 0], out[rows]) and beq(l[:, :, 0], lse[:, rows].t()),
                              f"all positions in one decode batch (B={len(rows)}) == training rows"
                              + (" (table padded: extra empty pairs)" if "wide" in name else ""))
                ok = True
                ranges = []
                for b, n in enumerate(lens):
                    for a, z in ((chunk - 70, chunk + 57), (0, 100), (n - 300, n), (2 * chunk - 1, 2 * chunk + 1)):
                        a, z = max(a, 0), min(z, n)
                        if a >= z:
                            continue
                        ranges.append((b, a, z))
                        o, l = rlk_ops.paged_attention(q[None, starts[b] + a:starts[b] + z], k_cache, v_cache,
                                                       table[b:b + 1],
                                                       torch.tensor([z], dtype=torch.int32, device=self.dev),
                                                       split_kv=policy)
                        rr = slice(starts[b] + a, starts[b] + z)
                        ok &= beq(o[0], out[rr]) and beq(l[0], lse[:, rr])
                self.cell(f"chunked_prefill_C{chunk}_p{page_size}", ok,
                          "chunked-prefill rows (query ranges across chunk boundaries) == training rows",
                          ranges=ranges)
        _validate.VALUE_CHECKS = old
        # backward run to run (dlse nonzero), one sequence
        n = sh.lens[0]
        qs, ks, vs = (t[None, :n].clone().requires_grad_() for t in (q, k, v))
        dout, dlse = self.rand(1, n, sh.hq, sh.d), self.rand(1, sh.hq, n, dtype=torch.float32)
        for chunk in sh.chunks:
            res = []
            for _ in range(3):
                o, l = rlk_ops.attention(qs, ks, vs, split_kv=f"canonical:{chunk}")
                res.append(torch.autograd.grad((o.float() * dout.float()).sum() + (l * dlse).sum(), (qs, ks, vs)))
            self.cell(f"backward_run_to_run_C{chunk}", all(beq(a, b) for r in res[1:] for a, b in zip(res[0], r)),
                      "dq, dk, dv over 3 runs (dlse nonzero)", S=n)

    def accuracy(self):
        """out and lse vs float64 math (one sequence), single pass next to canonical:C."""
        sh = self.sh
        s = sh.acc_s
        q, k, v = self.rand(1, s, sh.hq, sh.d), self.rand(1, s, sh.hkv, sh.d), self.rand(1, s, sh.hkv, sh.d)
        g = sh.hq // sh.hkv
        ref_o = torch.empty(s, sh.hq, sh.d, dtype=torch.float64, device=self.dev)
        ref_l = torch.empty(sh.hq, s, dtype=torch.float64, device=self.dev)
        mask = torch.arange(s, device=self.dev)[None, :] > torch.arange(s, device=self.dev)[:, None]
        for h in range(sh.hq):  # one head at a time: [S, S] float64 scores
            sc = (q[0, :, h].double() @ k[0, :, h // g].double().t()) * self.scale
            sc.masked_fill_(mask, -math.inf)
            ref_l[h] = torch.logsumexp(sc, -1)
            ref_o[:, h] = torch.softmax(sc, -1) @ v[0, :, h // g].double()
            del sc
        rows = {}
        for policy in ("disabled", *(f"canonical:{c}" for c in sh.acc_chunks)):
            o, l = rlk_ops.attention(q, k, v, split_kv=policy)
            rows[policy] = {"out_rel_err": rel(o[0], ref_o), "out_max_abs_err": (o[0].double() - ref_o).abs().max().item(),
                            "lse_max_abs_err": (l[0].double() - ref_l).abs().max().item()}
            print("   ", policy, rows[policy], flush=True)
        base = rows["disabled"]["out_rel_err"]
        for r in rows.values():
            r["out_err_over_single_pass"] = round(r["out_rel_err"] / base, 4)
        self.res["accuracy"] = {"S": s, "reference": "float64 math on the GPU (per head)", "rows": rows}

    def _fi_auto(self):
        """FlashInfer auto split: measured here if flashinfer is installed, else kernels.json."""
        try:
            import flashinfer  # noqa: F401
            have = self.dev == "cuda"
        except ImportError:
            have = False
        if have:
            return "measured in this run (flashinfer installed)", None
        path = os.path.join(ROOT, "results", "h200", "kernels.json")
        with open(path) as f:
            data = json.load(f)
        ds = data["sections"]["decode_speed"]
        table = {k: v["auto"]["us"] for k, v in ds.items() if isinstance(v, dict) and "auto" in v}
        return (f"results/h200/kernels.json (benchmarks/kernels.py at {data.get('commit', '?')[:10]}, same machine "
                f"kind, earlier run; page 16, CUDA-graph replay of the FlashInfer wrapper's run())"), table

    def decode(self):
        sh = self.sh
        fa4 = self.fa4_single()
        source, fi_table = self._fi_auto()
        self.res["flashinfer_auto_source"] = source
        rows = []
        ps = sh.decode_page
        for bsz, ctx, q, kc, vc, pt, sl in self.decode_inputs(sh.decode_cases):
            row = {"batch": bsz, "context": ctx, "page_size": ps}
            # every implementation of this case timed in one interleaved measurement (ratios)
            fns = {"fa4_strict_raw_us": lambda: fa4.paged_attention(q, kc, vc, pt, sl, self.scale),
                   "fa4_strict_rlk_us": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl)}
            for c in sh.decode_chunks:
                fns[f"canonical_{c}_us"] = lambda c=c: rlk_ops.paged_attention(q, kc, vc, pt, sl,
                                                                               split_kv=f"canonical:{c}")
            if fi_table is None:
                fns["flashinfer_auto_us"] = self._fi_run(q, kc, vc, pt, sl)
            row.update({name: round(us, 2) for name, us in self.graph_us_many(fns).items()})
            if bsz == 1:  # the generic route (torch pair layout + mask + merge), for comparison
                c = sh.decode_chunks[0]
                row[f"canonical_{c}_generic_route_us"] = round(self.graph_us(
                    lambda: canonical.paged_attention(q, kc, vc, pt, sl, self.scale, c,
                                                      attend_into=canonical.gathered(fa4.attention_fwd),
                                                      attend_paged=lambda *a: fa4.paged_attention(
                                                          *a[:4], a[4].clamp_min(1), a[5]))), 2)
            fi = row.get("flashinfer_auto_us") if fi_table is None else fi_table.get(f"B{bsz}_ctx{ctx}")
            row["flashinfer_auto_us"] = None if fi is None else round(fi, 2)
            for c in sh.decode_chunks:
                t = row[f"canonical_{c}_us"]
                row[f"canonical_{c}_over_fa4_strict"] = round(t / row["fa4_strict_raw_us"], 3)
                if fi is not None:
                    row[f"canonical_{c}_over_fi_auto"] = round(t / fi, 3)
            row["kv_GB"] = round(2 * bsz * ctx * sh.hkv * sh.d * 2 / 1e9, 3)
            rows.append(row)
            print("   ", row, flush=True)
        self.res["decode"] = {"rows": rows, "timing": "CUDA-graph replay median (us per call), value checks off, "
                              "every implementation of a case replayed in turn (graph_times_us)",
                              "fa4_strict": "FA4 single pass (num_splits=1), one CTA per (sequence, kv head)"}

    def _fi_run(self, q, kc, vc, pt, sl):
        """FlashInfer's auto-split decode of this batch, planned: the call to time (run())."""
        from rlk_ops.kernels import flashinfer as FI

        bsz, _, hq, d = q.shape
        w = FI._wrapper(q.device)
        indptr, indices, last = FI._csr(pt, sl, kc.shape[1])
        args = FI.flashinfer_split_args("auto", kc.shape[1])
        w.plan(indptr, indices, last, hq, self.sh.hkv, d, kc.shape[1], q_data_type=q.dtype, kv_data_type=kc.dtype,
               sm_scale=self.scale, q_len_per_req=1, **args)
        qq = q.reshape(bsz, hq, d)
        return lambda: w.run(qq, (kc, vc), return_lse=True)

    def train_inputs(self) -> tuple:
        """(q, k, v, dout) of the training shape: dense [B, S, H, D], causal."""
        sh = self.sh
        bsz, s = sh.train
        return (self.rand(bsz, s, sh.hq, sh.d), self.rand(bsz, s, sh.hkv, sh.d), self.rand(bsz, s, sh.hkv, sh.d),
                self.rand(bsz, s, sh.hq, sh.d))

    def training(self):
        sh = self.sh
        bsz, s = sh.train
        q, k, v, dout = self.train_inputs()
        fwd_op, bwd_op = torch.ops.rlk.attention_fwd, torch.ops.rlk.attention_bwd
        fns = {}
        for policy in ("disabled", *(f"canonical:{c}" for c in sh.train_chunks)):
            def fwd(p=policy):
                return fwd_op(q, k, v, 1, self.scale, None, None, 0, 0, p)

            def fwd_bwd(p=policy):
                out, lse = fwd_op(q, k, v, 1, self.scale, None, None, 0, 0, p)
                return bwd_op(dout, q, k, v, out, lse, None, 1, self.scale, None, None, 0, 0, p)

            fns[f"{policy}/fwd"] = fwd
            fns[f"{policy}/fwd_bwd"] = fwd_bwd
        policies = dict(fns)   # the ratios' own group (below)
        # the executor before the in-place one (queries copied per piece, partials scattered),
        # and the in-place one on 4 side streams (fa4 canonical.STREAMS streams otherwise)
        from rlk_ops.kernels.fa4 import canonical as fa4_canonical
        from rlk_ops.kernels.fa4 import kernels as fa4_kernels
        gathering = canonical.gathered(fa4_kernels.attention_fwd)
        for c in sh.train_chunks:
            fns[f"canonical:{c} gathering executor/fwd"] = lambda c=c: canonical.attention_fwd(
                q, k, v, True, self.scale, None, None, c, attend_into=gathering)
            fns[f"canonical:{c} 4 streams/fwd"] = lambda c=c: canonical.attention_fwd(
                q, k, v, True, self.scale, None, None, c, attend_into=fa4_canonical.attend_into, streams=4)
        # forward+backward through FA4's own calls (its Python every call): the route replays
        # them from a recording (fa4 canonical.PREPARED_CALLS, on since session 12)
        def own_calls(fn):
            def run():
                with fa4_canonical.prepared_calls(False):
                    return fn()
            return run

        for c in sh.train_chunks:
            fns[f"canonical:{c} own calls/fwd_bwd"] = own_calls(fns[f"canonical:{c}/fwd_bwd"])
        # the merge alone on one forward's state buffers (its share of the forward)
        merge = kernel_for("merge_attn_states", q.device)
        for c in sh.train_chunks:
            fns[f"canonical:{c} merge alone/fwd"] = lambda st=self.forward_states(q, k, v, c): merge(*st)
        self.res["train_streams"] = fa4_canonical.STREAMS
        # each call's peak above what was allocated when it started: the inputs and every buffer this
        # section holds for other calls (the merge-alone states of every C) left out (until session 16
        # the absolute peak was reported, which grew with the number of C timed: 5.2 -> 7.23 GiB for
        # single pass from 3 to 4 C values)
        extra = {}
        for name, fn in fns.items():
            if self.dev == "cuda":
                self.sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            fn()
            self.sync()
            if self.dev == "cuda":
                extra[name] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
        # The policies timed in a group of their own (until session 17 they were interleaved with the
        # columns' extra functions, which moved the ratio: canonical:768 at 0731a23 measured 1.138x
        # there against 1.216x in a group of its own and 1.204x call by call, one run,
        # results/h200/session17/train_profile_0731a23.json), then each fwd+bwd call alone
        # (synchronized before and after, the policies alternating); the line is judged on the larger.
        t = self.eager_us(policies)
        t.update(self.eager_us({name: fn for name, fn in fns.items() if name not in policies}))
        samples = self.alone_samples({name: fn for name, fn in policies.items() if name.endswith("/fwd_bwd")},
                                     self.sh.synced_reps)
        alone = {name: statistics.median(x) for name, x in samples.items()}
        # host cost of a plan (what a forward pays when its shape is new: canonical.cached_plan misses)
        seqs = _dense_seqs(bsz, s)
        plan_ms = {}
        for c in sh.train_chunks:
            ts = []
            for _ in range(3):
                self.sync()
                t0 = time.perf_counter()
                canonical.plan(list(seqs), c, True, self.dev)
                self.sync()
                ts.append((time.perf_counter() - t0) * 1e3)
            plan_ms[f"canonical:{c}"] = round(statistics.median(ts), 2)
        rows = []
        for policy in ("disabled", *(f"canonical:{c}" for c in sh.train_chunks)):
            r = {"policy": policy, "fwd_us": t[f"{policy}/fwd"], "fwd_bwd_us": t[f"{policy}/fwd_bwd"],
                 "extra_GiB_fwd_bwd": extra.get(f"{policy}/fwd_bwd"), "plan_build_ms": plan_ms.get(policy),
                 "fwd_us_gathering_executor": t.get(f"{policy} gathering executor/fwd"),
                 "fwd_us_4_streams": t.get(f"{policy} 4 streams/fwd"),
                 "merge_alone_us": t.get(f"{policy} merge alone/fwd"),
                 "fwd_bwd_us_own_calls": t.get(f"{policy} own calls/fwd_bwd")}
            r["fwd_over_single"] = round(r["fwd_us"] / t["disabled/fwd"], 3)
            r["fwd_bwd_over_single"] = round(r["fwd_bwd_us"] / t["disabled/fwd_bwd"], 3)
            r["fwd_bwd_alone_us"] = round(alone[f"{policy}/fwd_bwd"], 1)
            r["fwd_bwd_alone_over_single"] = round(alone[f"{policy}/fwd_bwd"] / alone["disabled/fwd_bwd"], 3)
            r["fwd_bwd_line_ratio"] = max(r["fwd_bwd_over_single"], r["fwd_bwd_alone_over_single"])
            # the spread (session 18): each round's call over the single pass call of the same round
            r["fwd_bwd_alone_round_ratio_quartiles"] = _quartiles(
                [a / b for a, b in zip(samples[f"{policy}/fwd_bwd"], samples["disabled/fwd_bwd"])])
            if r["fwd_bwd_us_own_calls"]:
                r["fwd_bwd_own_calls_over_single"] = round(r["fwd_bwd_us_own_calls"] / t["disabled/fwd_bwd"], 3)
            rows.append(r)
            print("   ", r, flush=True)
        self.res["training"] = {"B": bsz, "S": s, "rows": rows,
                                "timing": "eager, CUDA-synchronized wall clock, interleaved repetitions, median; "
                                          "the policies in a group of their own, the other columns in another; "
                                          "'alone': each fwd+bwd call synchronized before and after, policies "
                                          "alternating, median; its spread: the quartiles of each round's "
                                          "ratio to that round's single pass call",
                                "plan": "cached per shape (canonical.cached_plan); plan_build_ms is the host cost "
                                        "of a shape not seen before, paid once"}

    def forward_states(self, q, k, v, chunk: int) -> tuple:
        """The state buffers (out_parts, lse_parts) one canonical:chunk training forward of dense
        causal q/k/v [B, S, H, D] hands its merge (FA4 partials, kernels/cpu/canonical.run)."""
        from rlk_ops.kernels.fa4 import canonical as fa4_canonical

        (bsz, s, hq, d), hkv = q.shape, k.shape[2]
        merge = kernel_for("merge_attn_states", q.device)
        held = []

        def keep(o, l):
            held.append((o, l))
            return merge(o, l)

        canonical.run(canonical.cached_plan(_dense_seqs(bsz, s), chunk, True, str(q.device)),
                      q.reshape(bsz * s, hq, d), k.reshape(bsz * s, hkv, d), v.reshape(bsz * s, hkv, d), self.scale,
                      fa4_canonical.attend_into, keep)
        return held[0]

    def verdict(self):
        sh = self.sh
        out = {}
        dec = {(r["batch"], r["context"]): r for r in self.res.get("decode", {}).get("rows", [])}
        train = {r["policy"]: r for r in self.res.get("training", {}).get("rows", [])}
        for c in sh.decode_chunks:
            v = {"decode_vs_fi_auto": {}, "decode_vs_fa4_strict_b64": {}, "train_fwd_bwd_over_single": None}
            for (b, ctx), r in dec.items():
                if b in (1, 8):
                    v["decode_vs_fi_auto"][f"{b}x{ctx}"] = r.get(f"canonical_{c}_over_fi_auto")
                if b == 64:
                    v["decode_vs_fa4_strict_b64"][f"{b}x{ctx}"] = r.get(f"canonical_{c}_over_fa4_strict")
            tr = train.get(f"canonical:{c}")
            # the larger of the two timings since session 17 (fwd_bwd_line_ratio), the one timing before
            v["train_fwd_bwd_over_single"] = tr and tr.get("fwd_bwd_line_ratio", tr["fwd_bwd_over_single"])
            fi_vals = [x for x in v["decode_vs_fi_auto"].values() if x is not None]
            v["decode_target_met"] = bool(fi_vals) and all(x <= TARGET_DECODE_VS_FI for x in fi_vals)
            v["decode_fi_cells_missing"] = [k for k, x in v["decode_vs_fi_auto"].items() if x is None]
            b64 = list(v["decode_vs_fa4_strict_b64"].values())
            v["b64_target_met"] = bool(b64) and all(x is not None and x <= 1.0 for x in b64)
            v["train_target_met"] = v["train_fwd_bwd_over_single"] is not None and \
                v["train_fwd_bwd_over_single"] <= TARGET_TRAIN_VS_SINGLE
            out[f"canonical:{c}"] = v
        self.res["verdict"] = out


# ----------------------------------------------------------------------- report
def markdown(r: dict) -> str:
    env = r.get("env", {})
    cells = r.get("bitwise", [])
    lines = ["# canonical:C split-KV on the H200 (FA4 partials + Triton merge)", "",
             f"Generated by `benchmarks/canonical.py` from `{os.path.basename(r.get('out_path') or 'canonical.json')}` "
             f"(commit {str(r.get('commit'))[:10]}, sections: {', '.join(r.get('section_seconds', {})) or '-'}). "
             f"GPU: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"flash-attn-4 {env.get('flash_attn_4')}. Qwen3-8B TP=2 shard: Hq=16, Hkv=4, D=128, bf16, causal.", "",
             *([f"Runs: {r['runs']}", ""] if r.get("runs") else []),
             *([f"Route switches set for this run (--route): "
                f"{', '.join(f'{k}={v}' for k, v in r['routes_set'].items())}", ""] if r.get("routes_set") else []),
             f"**Bitwise cells: {sum(c['equal'] for c in cells)}/{len(cells)} true** (torch.equal).", ""]
    if cells:
        lines += ["| cell | equal | what |", "|---|---|---|"]
        lines += [f"| {c['name']} | {'yes' if c['equal'] else '**NO**'} | {c['what']} |" for c in cells]
        lines.append("")
    dec = r.get("decode", {}).get("rows", [])
    if dec:
        chunks = r["shapes"]["decode_chunks"]
        lines += [f"## Paged decode (page {dec[0]['page_size']}, us, {r['decode']['timing']})", "",
                  f"FlashInfer auto split: {r.get('flashinfer_auto_source')}. Ratios: time / FlashInfer auto "
                  f"(target <= {TARGET_DECODE_VS_FI} at batch 1 and 8) and time / FA4 strict (target <= 1 at "
                  "batch 64).", "",
                  "| batch x context | FA4 strict | FlashInfer auto | " +
                  " | ".join(f"canonical:{c}" for c in chunks) + " |",
                  "|---|---|---|" + "---|" * len(chunks)]
        for x in dec:
            fi = x.get("flashinfer_auto_us")
            cols = []
            for c in chunks:
                t = x[f"canonical_{c}_us"]
                ratio = x.get(f"canonical_{c}_over_fi_auto") if x["batch"] in (1, 8) else \
                    x.get(f"canonical_{c}_over_fa4_strict")
                tag = "vs FI" if x["batch"] in (1, 8) else "vs FA4"
                cols.append(f"{t:.1f} ({ratio if ratio is not None else '-'}x {tag})")
            lines.append(f"| {x['batch']} x {x['context']} | {x['fa4_strict_raw_us']:.1f} | "
                         f"{'-' if fi is None else f'{fi:.1f}'} | " + " | ".join(cols) + " |")
        walked = [(x, c) for x in dec for c in chunks if f"canonical_{c}_walk_us" in x]   # sessions 14-15
        if walked:
            lines += ["", "Whole-sequence walk (fa4 canonical.walk_sequences(): one launch of pair_decode(walk, "
                      "merge=True), each program merging its own sequence; not routed), same run, us (ratio to FA4 "
                      "strict; equal: torch.equal to the routed op): " +
                      "; ".join(_walk_cell(x, c) for x, c in walked) + "."]
        gen = [(x, k) for x in dec for k in x if k.endswith("_generic_route_us")]
        if gen:
            lines += ["", "Generic decode route (torch pair layout + lse mask + merge, ~15 launches) at batch 1: " +
                      ", ".join(f"{x['batch']}x{x['context']} {x[k]:.1f} us" for x, k in gen) + "."]
        lines.append("")
    tr = r.get("training", {}).get("rows", [])
    if tr:
        # since session 16 the call's peak above its start (extra_GiB_fwd_bwd); before, the absolute peak
        new_mem = any("extra_GiB_fwd_bwd" in x for x in tr)
        mem_key = "extra_GiB_fwd_bwd" if new_mem else "peak_GiB_fwd_bwd"
        mem = "fwd+bwd GiB above its start" if new_mem else "peak GiB"
        alone = any("fwd_bwd_alone_us" in x for x in tr)
        lines += [f"## Training forward and forward+backward, B={r['training']['B']}, S={r['training']['S']} "
                  f"(us, {r['training']['timing']})", "",
                  "| policy | fwd | fwd+bwd | fwd / single | fwd+bwd / single"
                  + (" | fwd+bwd alone | alone / single | per-round ratio quartiles | the larger" if alone else "")
                  + f" (target <= {TARGET_TRAIN_VS_SINGLE}) "
                  f"| {mem} | plan build ms (new shape) | fwd, gathering executor | fwd, 4 side streams "
                  "| merge alone | fwd+bwd, FA4's own calls (/ single) |", "|---" * (15 if alone else 11) + "|"]
        lines += [f"| {x['policy']} | {x['fwd_us']:.0f} | {x['fwd_bwd_us']:.0f} | {x['fwd_over_single']} | "
                  f"{x['fwd_bwd_over_single']} | "
                  + (f"{x.get('fwd_bwd_alone_us', '-')} | {x.get('fwd_bwd_alone_over_single', '-')} | "
                     f"{_spread(x)} | {x.get('fwd_bwd_line_ratio', '-')} | " if alone else "")
                  + f"{x.get(mem_key)} | {x.get('plan_build_ms', '-')} | "
                  f"{x.get('fwd_us_gathering_executor') or '-'} | {x.get('fwd_us_4_streams') or '-'} | "
                  f"{x.get('merge_alone_us') or '-'} | "
                  f"{_own_calls_cell(x)} |" for x in tr]
        lines += ["", "The gathering executor is the one before the in-place one (each full piece's queries "
                  "copied out, every partial scattered into its slot); same bits (in_place_vs_gathering cells). "
                  "Merge alone: the merge op on one forward's state buffers (its share of the forward). "
                  "The policies' fwd and fwd+bwd replay FA4's kernel calls from a recording (fa4 "
                  "canonical.PREPARED_CALLS, kernels/fa4/prepared.py); FA4's own calls: with its per-call Python "
                  "(prepared_calls(False)), same bits."]
        if r["training"].get("plan"):
            lines += ["", f"Plan: {r['training']['plan']}."]
        lines.append("")
    prof = r.get("decode_profile", {}).get("rows", [])
    if prof:
        lines += [f"## Where canonical:C decode time goes (page {r['decode_profile']['page_size']}, us, "
                  f"{r['decode_profile']['timing']})", "",
                  "The three launches alone: pair layout (triton), FA4 paged call over the (chunk, sequence) pairs "
                  "with FA4's default SM90 tile (128, 128) and with (64, 128), the merge with its current blocking "
                  "(merge_config: rows per program, head_dim slices, unrolled states) and with the former one "
                  "(16, 1, looped); total = the op. 'equal': torch.equal of every pair's out and lse (tile) or "
                  "of the merged out and lse (merge). 'no overlap': tile 64 without FA4's intra-warpgroup "
                  "overlap; 'total PDL': the op with programmatic dependent launch for the layout and merge "
                  "(triton merge.PDL), its bits compared with the op's.", "",
                  "| batch x context | C | pairs | layout | FA4 tile 128 | FA4 tile 64 | no overlap | tile equal | "
                  "merge | merge before | merge config | merge equal | total | total PDL |", "|---" * 14 + "|"]
        for x in prof:
            for key in sorted((k for k in x if k.startswith("C")), key=lambda k: int(k[1:])):
                y = x[key]
                merge_eq = y['merge_configs_equal'] and y.get('merge_2d_max_equal', True)
                merge_us = f"{y['merge_us']}" + (f" (2D max: {y['merge_2d_max_us']})" if "merge_2d_max_us" in y else "")
                tile_eq = y['tile64_equal'] and y.get('tile64_no_overlap_equal', True)
                pdl = y.get('total_pdl_us', '-')
                pdl = f"{pdl}" + ("" if y.get('pdl_equal', True) else " (**not equal**)")
                lines.append(f"| {x['batch']} x {x['context']} | {key[1:]} | {y['pairs']} | {y['layout_us']} | "
                             f"{y['fa4_pairs_us']} | {y['fa4_pairs_tile64_us']} | "
                             f"{y.get('fa4_pairs_tile64_no_overlap_us', '-')} | {'yes' if tile_eq else '**NO**'} | "
                             f"{merge_us} | {y['merge_old_config_us']} | {tuple(y['merge_config'])} | "
                             f"{'yes' if merge_eq else '**NO**'} | {y['total_us']} | {pdl} |")
        lines += ["", "Strict single pass, FA4 default tile vs (64, 128): " + "; ".join(
            f"{x['batch']}x{x['context']} {x['strict_us']} vs {x['strict_tile64_us']} us "
            f"({'equal' if x['strict_tile64_equal'] else 'NOT equal'})" for x in prof) + ".", ""]
    acc = r.get("accuracy")
    if acc:
        lines += [f"## Accuracy against {acc['reference']}, S={acc['S']}", "",
                  "| policy | out rel. error | out / single pass | out max abs | lse max abs |", "|---|---|---|---|---|"]
        lines += [f"| {p} | {x['out_rel_err']:.3e} | {x['out_err_over_single_pass']} | {x['out_max_abs_err']:.3e} | "
                  f"{x['lse_max_abs_err']:.3e} |" for p, x in acc["rows"].items()]
        lines.append("")
    v = r.get("verdict")
    if v:
        lines += ["## Targets per C", "", "| policy | decode <= 1.15x FI auto (b1, b8) | b64 <= FA4 strict | "
                  "training fwd+bwd <= 1.15x |", "|---|---|---|---|"]
        for p, x in v.items():
            miss = f" (no FI number: {', '.join(x['decode_fi_cells_missing'])})" if x["decode_fi_cells_missing"] else ""
            lines.append(f"| {p} | {'yes' if x['decode_target_met'] else 'no'}{miss} | "
                         f"{'yes' if x['b64_target_met'] else 'no'} | "
                         f"{'yes' if x['train_target_met'] else 'no'} ({x['train_fwd_bwd_over_single']}) |")
        lines.append("")
    if r.get("merge_timing"):
        m = r["merge_timing"]
        lines += [f"Triton merge, {m['states']} states x {m['rows']} rows x 16 heads: {m['us']} us "
                  f"({m['GBps']} GB/s of bf16 states read + out written).", ""]
    if r.get("fa4_seqused_k_zero"):
        lines += [f"FA4 with seqused_k = 0 (not relied on): {r['fa4_seqused_k_zero']}.", ""]
    if r.get("errors"):
        lines += ["Sections that failed: " + ", ".join(r["errors"]), ""]
    return "\n".join(lines)


def summary(r):
    cells = r.get("bitwise", [])
    print("\n==== summary")
    print(f"bitwise cells: {sum(c['equal'] for c in cells)}/{len(cells)} true")
    for c in cells:
        if not c["equal"]:
            print("  FALSE:", c["name"])
    for x in r.get("decode", {}).get("rows", []):
        print(f"decode {x['batch']}x{x['context']}: fa4 {x['fa4_strict_raw_us']} fi {x.get('flashinfer_auto_us')} " +
              " ".join(f"C{c}={x[f'canonical_{c}_us']}" for c in r["shapes"]["decode_chunks"]) +
              "".join(f" C{c}walk={x[f'canonical_{c}_walk_us']}({x.get(f'canonical_{c}_walk_equal')})"
                      for c in r["shapes"]["decode_chunks"] if f"canonical_{c}_walk_us" in x))
    for x in r.get("training", {}).get("rows", []):
        alone = f" alone {x['fwd_bwd_alone_over_single']}" if "fwd_bwd_alone_over_single" in x else ""
        print(f"train {x['policy']}: fwd {x['fwd_us']} fwd+bwd {x['fwd_bwd_us']} ratio {x['fwd_bwd_over_single']}{alone}")
    for p, x in r.get("verdict", {}).items():
        print(f"{p}: decode {x['decode_target_met']} b64 {x['b64_target_met']} train {x['train_target_met']}")
    print("errors:", list(r.get("errors", {})) or "none")


def install_dry_run():
    """CPU, stand-in FA4 (tests/test_fa4.py), merge on the Triton interpreter."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_fa4 import make_fake_fa4

    from rlk_ops.kernels import dispatch
    from rlk_ops.kernels import fa4 as fa4_backend
    from rlk_ops.kernels import triton as triton_backend
    from rlk_ops.kernels.fa4 import loader

    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run needs TRITON_INTERPRET=1 (the merge runs on the Triton interpreter)")
    sys.modules[loader.INTERFACE_MODULE] = make_fake_fa4()
    loader.installed_version = lambda: "dry-run"
    fa4_backend.check_available = lambda op: None
    dispatch._DEVICES["fa4"] = ("cuda", "cpu")   # the stand-in runs on CPU tensors (the device gate refused it)
    triton_backend.check_available = lambda op: None
    rlk_ops.use_backend(attention_fwd="fa4", attention_bwd="fa4", paged_attention="fa4",
                        merge_attn_states="triton", merge_attn_states_bwd="triton").__enter__()


def _dense_seqs(bsz: int, s: int) -> tuple:
    """A dense batch as packed sequences (q_start, q_len, k_start, k_len), canonical.plan's input."""
    return tuple((i * s, s, i * s, s) for i in range(bsz))


def _walk_cell(x: dict, c: int) -> str:
    key = f"canonical_{c}_walk"
    return (f"{x['batch']}x{x['context']} C{c} {x[key + '_us']:.1f} ({x.get(key + '_over_fa4_strict')}x, "
            f"equal {x.get(key + '_equal')})")


def _quartiles(xs: list) -> list:
    """[25th, 50th, 75th] percentile of xs, rounded (statistics.quantiles' exclusive method)."""
    if len(xs) < 2:
        return [round(x, 3) for x in xs * 3][:3]
    return [round(q, 3) for q in statistics.quantiles(xs, n=4)]   # the exclusive method's middle cut is the median


def _spread(x: dict) -> str:
    q = x.get("fwd_bwd_alone_round_ratio_quartiles")
    return " / ".join(str(v) for v in q) if q else "-"


def _own_calls_cell(x: dict) -> str:
    us = x.get("fwd_bwd_us_own_calls")
    return f"{us:.0f} ({x.get('fwd_bwd_own_calls_over_single')})" if us else "-"


def chunk_list(flag: str, text: str) -> tuple:
    cs = tuple(int(c) for c in text.split(","))
    if any(c <= 0 or c % 128 for c in cs):
        sys.exit(f"{flag} must be positive multiples of 128, got {text}")
    return cs


# Route switches --route may set for one run (module, attribute, type): the decode op's launch
# choices, so that a route not yet taken is timed against FlashInfer in the same run as the
# routed one (session 21). The report records every switch's value under "routes".
ROUTES = {"EARLY_TABLE_ONE_WAVE": ("rlk_ops.kernels.triton.pair_decode", bool),
          "PDL_ONE_WAVE": ("rlk_ops.kernels.triton.pair_decode", bool),
          "SLICES_ONE_WAVE": ("rlk_ops.kernels.triton.pair_decode", int),
          "STATE_EVICT_MAX_BYTES": ("rlk_ops.kernels.triton.pair_decode", int),
          "VEC_EAGER": ("rlk_ops.kernels.triton.merge", bool)}


def route_setting(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` of --route: NAME one of ROUTES, VALUE 0/1 (true/false) for a switch or an
    integer (argparse type: a bad one is a usage error naming the flag)."""
    name, sep, value = text.partition("=")
    if not sep or name not in ROUTES:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {sorted(ROUTES)}, got {text!r}")
    kind = ROUTES[name][1]
    if kind is bool:
        if value.lower() not in ("0", "1", "true", "false"):
            raise argparse.ArgumentTypeError(f"{name} takes 0, 1, true or false, got {text!r}")
        return name, value.lower() in ("1", "true")
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} takes an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{name} takes an integer >= 0, got {text!r}")
    return name, n


def apply_routes(settings: list) -> dict:
    """Set each (name, value) of --route; returns every ROUTES switch's value for the report."""
    import importlib

    for name, value in settings:
        setattr(importlib.import_module(ROUTES[name][0]), name, value)
    return {name: getattr(importlib.import_module(mod), name) for name, (mod, _) in ROUTES.items()}


def main():
    ap = arguments(__doc__.split("\n")[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--decode-page", type=int, default=None,
                    help="page size of the decode and decode_profile sections (default 16)")
    ap.add_argument("--chunks", default=None,
                    help="C values of the decode, training and accuracy sections, comma-separated multiples of "
                         "128 (default 512,640,768,1024)")
    ap.add_argument("--bitwise-chunks", default=None,
                    help="C values of the bitwise sections, comma-separated multiples of 128 (default "
                         "256,768,1024,2048)")
    ap.add_argument("--route", type=route_setting, action="append", default=[], metavar="NAME=VALUE",
                    help=f"set a decode route switch for this run (repeatable; recorded under 'routes'): "
                         f"{', '.join(ROUTES)}")
    args = ap.parse_args()
    if args.md_only:
        return rewrite_markdown(args.out, args.md, markdown, summary)
    dev, sh = device_and_shapes(args, "benchmarks/canonical.py", install_dry_run, DRY, Shapes)
    if args.decode_page:
        sh = replace(sh, decode_page=args.decode_page)
    if args.chunks:
        cs = chunk_list("--chunks", args.chunks)
        sh = replace(sh, decode_chunks=cs, train_chunks=cs, acc_chunks=cs)
    if args.bitwise_chunks:
        sh = replace(sh, chunks=chunk_list("--bitwise-chunks", args.bitwise_chunks))
    t0 = time.perf_counter()
    b = Bench(dev, sh, args.out, args.dry_run)
    b.res["commit"] = args.commit
    b.res["out_path"] = args.out
    b.res["routes"] = apply_routes(args.route)
    b.res["routes_set"] = dict(args.route)
    sections = [("environment", b.environment), ("merge", b.merge), ("fa4_equalities", b.fa4_equalities),
                ("in_place", b.in_place), ("bitwise", b.bitwise), ("decode_profile", b.decode_profile),
                ("decode", b.decode), ("training", b.training), ("accuracy", b.accuracy),
                ("seqused_zero_probe", b.seqused_zero_probe)]
    b.run_sections(sections, args.sections)
    b.verdict()
    return b.finish(t0, args.md, markdown, summary)


if __name__ == "__main__":
    sys.exit(main())
