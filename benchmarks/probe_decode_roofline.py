"""Probe (H200): how close batch-64 decode runs to the memory roofline. Issue 8's batch-64 line
asks canonical:C decode (pair kernel + merge) to be no slower than FA4 single pass; at 64 x 8k
C = 768 it has measured 1.000-1.003x at page 16 and 1.034x at page 128 (sessions 11-13). This
probe times, in one interleaved run (_report.graph_times_us) and per case, what bounds that:

* ``fa4_strict``: FA4 single pass (the line's reference), ``op``: canonical:C through the op,
  ``pairs``: the routed pair kernel alone, ``merge``: the merge op alone on its states;
* ``pairs_tma`` / ``op_tma`` (pages a multiple of 128): the pair kernel with its K/V tiles by
  TMA (``prefetch=4``, not routed), alone and with the merge; ``tma_equal``: its merged out and
  lse torch.equal to the routed pairs + merge (the op's bits);
* sessions 14-16 also timed ``op_walk`` / ``op_walk_8x2`` (the op's work in one launch, one
  program per (sequence, KV head) walking all of its chunks and merging its own states), slower
  in every run and removed after session 16 (code at commit 6b83051);
* ``pairs_evict_last`` / ``op_evict_last`` (session 19): the routed pair kernel storing its states
  with the L2 policy evict_last (``pair_decode(state_evict=...)``, a hint), alone and with the
  merge, which then may read them from L2 rather than memory after ~1 GB of K/V streamed past;
  ``pairs_no_evict`` / ``op_no_evict``: the same without the hint (since session 19 the routed
  launch stores evict_last up to pair_decode.STATE_EVICT_MAX_BYTES of states, so one of the two
  pairs is the routed one); ``op_pdl``: the routed pairs + merge with the merge launched by
  programmatic dependent launch (``pdl=True``, off past one wave since session 13: mixed there);
  ``evict_last_equal`` / ``no_evict_equal`` / ``pdl_equal``: their merged out and lse torch.equal
  to the routed pairs + merge;
* ``pairs_no_math``: the pair kernel with its softmax sums, exponentials and P @ V removed
  (``ablate`` 2 | 4 | 16: wrong bits on purpose) - the same loads, QK^T and launch;
* ``read_flat``: a Triton kernel that reads every K and V byte of the cache once, contiguously
  (64 KB per program per tensor, pipelined loads) and sums them - the read roofline;
* ``read_paged``: a Triton kernel that reads exactly the rows the pair kernel reads, in its
  order (one program per (chunk, sequence) pair and KV head, heads_first, 128 rows of 256 bytes
  per block through the page table) and sums them - the roofline of that access pattern;
* ``read_paged_rows``: as read_paged but one program per pair reading its rows whole (all KV
  heads: 1 KB contiguous per token instead of four programs' 256 bytes each) - what the heads
  interleaved in a cache row cost, which heads_first (a pair's KV heads on adjacent programs)
  is meant to recover.

Each time is also given as TB/s over the K/V bytes of the batch (2 * B * ctx * Hkv * D * 2), so
the fraction of the read roofline each one reaches is in the same run. Where a page and batch
were timed at two or more contexts, ``fits`` (_report.fits) gives each implementation's
least-squares line over them, time = fixed + per_GB * K/V GB: its streaming rate and the cost it
pays whatever the context (launch, first and last wave, the merge), so a tie at one context can
be read as the sum of the two. The two read kernels' sums are checked against torch
(``read_*_rel``: relative error of the fp32 sum against a float64 one), so they read every byte
they should.

Usage: [PAGES=16,128] [CASES=64x8192,64x32768] [CHUNK=768]
       python3 benchmarks/probe_decode_roofline.py OUT.json
(DEVICE=cpu with TRITON_INTERPRET=1 and a small CASES: a smoke run of the plumbing, no FA4.)
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import canonical as cb  # noqa: E402  (benchmarks/canonical.py)
from _report import fits, write_rows  # noqa: E402  (benchmarks/_report.py)

import rlk_ops  # noqa: E402
from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402

PAGES = tuple(int(p) for p in os.environ.get("PAGES", "16,128").split(","))
CASES = tuple(tuple(int(x) for x in c.split("x")) for c in os.environ.get("CASES", "64x8192,64x32768").split(","))
CHUNK = int(os.environ.get("CHUNK", "768"))
DEVICE = os.environ.get("DEVICE", "cuda")
FLAT_BLOCK, FLAT_ITERS = 4096, 8          # read_flat: 8 KB loads, 64 KB per program per tensor


@triton.jit
def _read_flat(k, v, out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, ITERS, num_stages=3):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc += tl.load(k + offs, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(v + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _read_paged(k, v, table, seq_lens, out, bsz, width, chunk, page,
                HKV: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr = 0):
    """ROWS: a program per pair reads whole rows (HKV * D columns, BN of them per step);
    else a program per (pair, KV head) its head's D columns (the pair kernel's reads)."""
    pid = tl.program_id(0)
    h = 0 if ROWS else pid % HKV
    pair = pid if ROWS else pid // HKV      # chunk-major, as the routed kernel: c * bsz + b
    c = pair // bsz
    b = pair % bsz
    n_keys = tl.minimum(tl.maximum(tl.load(seq_lens + b) - c * chunk, 0), chunk)
    kk = tl.arange(0, BN)
    dd = tl.arange(0, HKV * D if ROWS else D)
    acc = tl.zeros([BN, HKV * D if ROWS else D], tl.float32)
    for j in tl.range(0, tl.cdiv(n_keys, BN), num_stages=2):
        pos = c * chunk + j * BN + kk
        valid = pos < c * chunk + n_keys
        pg = tl.load(table + b.to(tl.int64) * width + pos // page, mask=valid, other=0)
        row = (pg.to(tl.int64) * page + pos % page) * (HKV * D) + h * D
        acc += tl.load(k + row[:, None] + dd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v + row[:, None] + dd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def read_flat(kc, vc):
    n = kc.numel()
    out = torch.empty(triton.cdiv(n, FLAT_BLOCK * FLAT_ITERS), dtype=torch.float32, device=kc.device)
    _read_flat[(out.numel(),)](kc, vc, out, n, BLOCK=FLAT_BLOCK, ITERS=FLAT_ITERS, num_warps=8)
    return out


def read_paged(kc, vc, pt, sl, chunk, rows=False):
    bsz, hkv = pt.shape[0], kc.shape[2]
    n = pd.pair_count(pt.shape[1], kc.shape[1], chunk)
    out = torch.empty(n * bsz * (1 if rows else hkv), dtype=torch.float32, device=kc.device)
    _read_paged[(out.numel(),)](kc, vc, pt, sl, out, bsz, pt.shape[1], chunk, kc.shape[1], HKV=hkv, D=kc.shape[3],
                                BN=pd.BLOCK_N // hkv if rows else pd.BLOCK_N, ROWS=int(rows), num_warps=4)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(got.double().sum().item() - ref.item()) / max(abs(ref.item()), 1e-30)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else None
    res = []
    for page in PAGES:
        sh = cb.replace(cb.Shapes(), decode_page=page, target_ms=2.0, reps=5)
        b = cb.Bench(DEVICE, sh, None, False)
        for bsz, ctx, q, kc, vc, pt, sl in b.decode_inputs(list(CASES)):
            c = CHUNK
            n = pd.pair_count(pt.shape[1], page, c)
            launch = pd.step_launch(q, kc, n)
            routed = {"layout": "keys", **launch}
            o, lse, plens, n = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **routed)
            states = (o.view(n, bsz, 1, sh.hq, sh.d), lse.view(n, bsz, sh.hq, 1))
            lens = plens.view(n, bsz)
            # the cache holds exactly the batch's pages (decode_inputs): every byte is one the batch reads
            flat_ref = kc.double().sum() + vc.double().sum()
            row = {"page": page, "batch": bsz, "context": ctx, "C": c, "routed_launch": {**launch},
                   "kv_bytes": 2 * bsz * ctx * sh.hkv * sh.d * 2, "cache_bytes": 2 * kc.numel() * kc.element_size(),
                   "read_flat_rel": _rel(read_flat(kc, vc), flat_ref),
                   "read_paged_rel": _rel(read_paged(kc, vc, pt, sl, c), flat_ref),
                   "read_paged_rows_rel": _rel(read_paged(kc, vc, pt, sl, c, rows=True), flat_ref)}
            fns = {"op": lambda: rlk_ops.paged_attention(q, kc, vc, pt, sl, split_kv=f"canonical:{c}"),
                   "pairs": lambda: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **routed),
                   "merge": lambda: tm.merge_attn_states(*states, state_lens=lens),
                   "pairs_no_math": lambda: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, ablate=2 | 4 | 16,
                                                           **routed),
                   "read_flat": lambda: read_flat(kc, vc),
                   "read_paged": lambda: read_paged(kc, vc, pt, sl, c),
                   "read_paged_rows": lambda: read_paged(kc, vc, pt, sl, c, rows=True)}

            def op_with(pair_kw, merge_kw=None):
                o, l, pl, n = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **pair_kw)
                return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                            state_lens=pl.view(n, bsz), **(merge_kw or {}))

            evict = {**routed, "state_evict": "evict_last"}
            plain = {**routed, "state_evict": ""}
            pdl = ({**routed, "pdl": True}, {"pdl": True})
            ref = op_with(routed)
            for key, args in (("evict_last", (evict,)), ("no_evict", (plain,)), ("pdl", pdl)):
                got = op_with(*args)
                row[f"{key}_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
            for key, kw in (("evict_last", evict), ("no_evict", plain)):
                fns[f"pairs_{key}"] = lambda kw=kw: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **kw)
                fns[f"op_{key}"] = lambda kw=kw: op_with(kw)
            fns["op_pdl"] = lambda: op_with(*pdl)
            if page % pd.BLOCK_N == 0:
                tma = {**routed, "prefetch": 4}

                def op_tma(kw=tma):
                    o, l, pl, n = pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **kw)
                    return tm.merge_attn_states(o.view(n, bsz, 1, sh.hq, sh.d), l.view(n, bsz, sh.hq, 1),
                                                state_lens=pl.view(n, bsz))

                try:
                    got, ref = op_tma(), op_tma(routed)   # the routed pairs + merge: the op's bits (tests)
                    row["tma_equal"] = cb.beq(got[0], ref[0]) and cb.beq(got[1], ref[1])
                    fns["pairs_tma"] = lambda tma=tma: pd.pair_decode(q, kc, vc, pt, sl, b.scale, c, **tma)
                    fns["op_tma"] = op_tma
                except Exception as e:  # noqa: BLE001 - recorded: a variant the compiler or the GPU refuses
                    row["tma"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            if DEVICE == "cuda":
                from rlk_ops.kernels.fa4 import kernels as fa4

                fns = {"fa4_strict": lambda: fa4.paged_attention(q, kc, vc, pt, sl, b.scale), **fns}
            for name, us in b.graph_us_many(fns).items():
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_TBps"] = round(row["kv_bytes"] / us / 1e6, 3)
            if "fa4_strict_us" in row:
                row["op_over_fa4_strict"] = round(row["op_us"] / row["fa4_strict_us"], 4)
                row["pairs_over_fa4_strict"] = round(row["pairs_us"] / row["fa4_strict_us"], 4)
                row["fa4_strict_over_read_flat"] = round(row["fa4_strict_us"] / row["read_flat_us"], 4)
            row["pairs_over_read_paged"] = round(row["pairs_us"] / row["read_paged_us"], 4)
            row["read_paged_over_read_flat"] = round(row["read_paged_us"] / row["read_flat_us"], 4)
            print(row, flush=True)
            res.append(row)
            write_rows(out, res)   # after every case: a later failure keeps the rows before it
    for fit in fits(res):
        print({k: (v if not isinstance(v, dict) else (v["us_per_GB"], v["fixed_us"])) for k, v in fit.items()},
              flush=True)
        res.append({"fit": fit})
    write_rows(out, res)


if __name__ == "__main__":
    main()
