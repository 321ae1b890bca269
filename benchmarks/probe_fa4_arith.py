"""Probe (H200): what exactly FA4's SM90 decode call computes, so that a faster decode kernel
for canonical:C (issue 8: batch 1 / 8k) could reproduce its bits.

FA4 is run as canonical:C runs it (rlk_ops.kernels.fa4.kernels.pair_attention: paged, one
query token, pack_gqa, tile (64, 128)) and its (out, lse) are compared bit for bit with an
emulation built from separately checkable pieces:

* QK^T and P @ V: Triton ``tl.dot`` with fp32 accumulation, 64 rows (Hopper wgmma, as FA4)
  or 16 rows (mma.sync); which instruction Triton emitted is read from its PTX;
* ex2 / lg2 / rcp: the PTX approximations (``.approx``, with or without ``.ftz``) through
  Triton inline asm, FMA through ``tl.math.fma``;
* everything else in torch fp32 elementwise ops (IEEE, correctly rounded, one op at a time),
  in the order FA4's source (flash_fwd_sm90.py, softmax.py) gives: key blocks last to first,
  the first one masked past the sequence end; per block the row max, ``exp2(S * scale_log2 -
  max * scale_log2)``, the row sum, O rescaled then ``O += bf16(P) @ V``; at the end
  ``out = O * rcp(row_sum)`` and ``lse = (max * scale_log2 + lg2(row_sum)) * ln 2``.

The open choices are the variants: tensor-core instruction, FMA in the exponent and in the
lse, ``.ftz``, and the order of the row sum: ``thread_seq`` (each of the 4 threads of a quad
keeps its own running sum over its 32 columns of a block, 8j + 2t + e in order, carried across
blocks, then (s0 + s1) + (s2 + s3) at the end: FA4's Softmax.online_softmax/finalize with an
in-order reduce), ``row_seq`` (one running sum over the 128 columns in order) and
``thread_tree`` (per-thread pairwise halving tree, added to the carried sum).

Two datasets: ``random`` (randn q/k/v, scale 128^-0.5) and ``exact`` (integer scores with a 0
in every key block, one-hot V): there S is exact, the running max is 0 throughout, so every
exponent argument is one rounding of ``S * scale_log2`` whatever the FMA choice, and only the
summation order and the approximations can move a bit.

Usage: python3 benchmarks/probe_fa4_arith.py OUT.json   (--dry-run: CPU, Triton interpreter,
no asm, the CPU reference in place of FA4: checks the script only)
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"
HQ, HKV, D, G, BLK = 16, 4, 128, 4, 128
LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


@triton.jit
def _bdot(a, b, c, o, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
          EMU: tl.constexpr):
    """o[i] = (c[i] +) a[i] @ b[i]; a [M, K] bf16; b [N, K] (BT) or [K, N] bf16; fp32 out.
    EMU (dry run): the interpreter's bf16 dot reads raw bits, so it multiplies in fp32."""
    i = tl.program_id(0)
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    x = tl.load(a + i * M * K + rm[:, None] * K + rk[None, :])
    if BT:
        y = tl.load(b + i * N * K + rn[None, :] * K + rk[:, None])
    else:
        y = tl.load(b + i * K * N + rk[:, None] * N + rn[None, :])
    if EMU:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    if ACC:
        r = tl.dot(x, y, tl.load(c + i * M * N + rm[:, None] * N + rn[None, :]))
    else:
        r = tl.dot(x, y)
    tl.store(o + i * M * N + rm[:, None] * N + rn[None, :], r)


@triton.jit
def _unary(x, y, n, OP: tl.constexpr, EMU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x + offs, mask=m, other=1.0)
    if EMU:  # the interpreter has no inline asm: the dry run only checks the plumbing
        if OP < 2:
            r = tl.math.exp2(v)
        elif OP < 4:
            r = tl.math.log2(v)
        else:
            r = 1.0 / v
    elif OP == 0:
        r = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif OP == 1:
        r = tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif OP == 2:
        r = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif OP == 3:
        r = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    elif OP == 4:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.inline_asm_elementwise("rcp.approx.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    tl.store(y + offs, r, mask=m)


@triton.jit
def _fma(a, b, c, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.math.fma(tl.load(a + offs, mask=m, other=0.0), tl.load(b + offs, mask=m, other=0.0),
                    tl.load(c + offs, mask=m, other=0.0))
    tl.store(y + offs, r, mask=m)


PTX = {}


def bdot(a, b, c=None, bt=True):
    n, m, k = a.shape
    nn = b.shape[1] if bt else b.shape[2]
    o = torch.empty(n, m, nn, dtype=torch.float32, device=a.device)
    h = _bdot[(n,)](a.contiguous(), b.contiguous(), c.contiguous() if c is not None else o, o, M=m, N=nn, K=k,
                    ACC=c is not None, BT=bt, EMU=DRY, num_warps=4)
    if not DRY and m not in PTX:
        ptx = getattr(h, "asm", {}).get("ptx", "")
        PTX[m] = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "other")
    return o


def unary(x, op: str, ftz: bool):
    code = {"ex2": 0, "lg2": 2, "rcp": 4}[op] + (0 if ftz else 1)
    x = x.contiguous().float()
    y = torch.empty_like(x)
    _unary[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), OP=code, EMU=DRY, BLOCK=1024)
    return y


def fma(a, b, c):
    a, b, c = torch.broadcast_tensors(a, b, c)
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    y = torch.empty_like(a)
    _fma[(triton.cdiv(a.numel(), 1024),)](a, b, c, y, a.numel(), BLOCK=1024)
    return y


def thread_sum(p, carried, how):
    """p [R, 128] of one block; carried [R, 4] (thread partials) or None (first block).
    Returns the new partials [R, 4] (thread_* orders) or [R, 1] (row_seq)."""
    if how == "row_seq":
        acc = carried[:, :1].clone() if carried is not None else None
        for c in range(p.shape[1]):
            acc = p[:, c:c + 1].clone() if acc is None else acc + p[:, c:c + 1]
        return acc
    cols = torch.tensor([[8 * j + 2 * t + e for j in range(16) for e in range(2)] for t in range(4)],
                        device=p.device)  # [4, 32]: thread t's columns in register order
    v = p[:, cols]  # [R, 4, 32]
    if how == "thread_seq":
        acc = carried.clone() if carried is not None else None
        for k in range(32):
            acc = v[:, :, k].clone() if acc is None else acc + v[:, :, k]
        return acc
    w = v  # thread_tree: halving tree, then added to the carried sum
    while w.shape[-1] > 1:
        h = w.shape[-1] // 2
        w = w[..., :h] + w[..., h:]
    return w[..., 0] if carried is None else carried + w[..., 0]


def scale_log2(scale):
    """FA4 multiplies in the kernel: fp32(softmax_scale) * fp32(log2 e) (utils.compute_softmax_scale_log2
    on a Float32 argument)."""
    return torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2_E, dtype=torch.float32)


def emulate(q, kseq, vseq, length, scale, var, cache, key):
    """One (sequence, KV head): q [G, D] bf16, kseq/vseq [L, D] bf16 -> (out [G, D], lse [G]).
    ``cache``/``key``: S of every block per tile height, shared by the variants."""
    mma, exp_fma, how, lse_fma, ftz = var
    m_rows = 64 if mma == "wgmma" else 16
    nb = -(-length // BLK)
    pad = nb * BLK - kseq.shape[0]
    kp = torch.nn.functional.pad(kseq, (0, 0, 0, pad))
    vp = torch.nn.functional.pad(vseq, (0, 0, 0, pad))
    key = (m_rows, *key)
    if key not in cache:  # S for every block, rows 0..G-1 of the tile
        qt = torch.zeros(nb, m_rows, D, dtype=q.dtype, device=q.device)
        qt[:, :G] = q
        cache[key] = bdot(qt, kp.view(nb, BLK, D))[:, :G]
    s_all = cache[key]
    sl2 = scale_log2(scale).to(q.device)
    row_max = torch.full((G,), -math.inf, device=q.device)
    partial = None
    o = torch.zeros(m_rows, D, dtype=torch.float32, device=q.device)
    for i, j in enumerate(range(nb - 1, -1, -1)):
        s = s_all[j].clone()
        s[:, torch.arange(BLK, device=q.device) >= length - j * BLK] = -math.inf
        prev = row_max
        row_max = torch.maximum(s.max(dim=1).values, prev)
        cur = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)
        cur_scaled = cur * sl2
        arg = fma(s, sl2.expand_as(s), -cur_scaled[:, None]) if exp_fma else s * sl2 - cur_scaled[:, None]
        p = unary(arg, "ex2", ftz)
        if i:
            row_scale = unary((prev - cur) * sl2, "ex2", ftz)
            partial = partial * row_scale[:, None]
            o[:G] = o[:G] * row_scale[:, None]
        partial = thread_sum(p, partial, how)
        pt = torch.zeros(1, m_rows, BLK, dtype=torch.bfloat16, device=q.device)
        pt[0, :G] = p.to(torch.bfloat16)
        o = bdot(pt, vp[j * BLK:(j + 1) * BLK][None], c=o[None], bt=False)[0]
    total = partial[:, 0] if partial.shape[1] == 1 else (partial[:, 0] + partial[:, 1]) + (partial[:, 2] + partial[:, 3])
    out = (o[:G] * unary(total, "rcp", ftz)[:, None]).to(torch.bfloat16)
    lg = unary(total, "lg2", ftz)
    lse = (fma(row_max, sl2.expand_as(row_max), lg) if lse_fma else row_max * sl2 + lg) * LN2
    return out, lse


def dataset(kind, lens, gen):
    bsz, lmax = len(lens), max(lens)
    if kind == "random":
        q = torch.randn(bsz, 1, HQ, D, generator=gen).to(torch.bfloat16)
        k = torch.randn(bsz, lmax, HKV, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(bsz, lmax, HKV, D, generator=gen).to(torch.bfloat16)
        return q, k, v, D ** -0.5
    # exact: q one-hot (1 at dim 0), integer scores in [-40, 0] with a 0 in every key block (the
    # running max is 0 from the first block on: every rescale is exp2(0) = 1 and every exponent
    # argument is one rounding of S * scale_log2, FMA or not), one-hot V
    q = torch.zeros(bsz, 1, HQ, D)
    q[..., 0] = 1.0
    k = torch.zeros(bsz, lmax, HKV, D)
    k[..., 0] = -torch.randint(0, 41, (bsz, lmax, HKV), generator=gen).float()
    k[:, ::BLK, :, 0] = 0.0
    v = torch.zeros(bsz, lmax, HKV, D)
    idx = torch.arange(lmax) % D
    v[:, torch.arange(lmax), :, idx] = 1.0
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), 0.3


def fa4_call(q, k, v, lens, scale):
    bsz, lmax = k.shape[0], k.shape[1]
    per = -(-lmax // BLK)
    kc = torch.zeros(bsz * per, BLK, HKV, D, dtype=k.dtype, device=DEV)
    vc = torch.zeros_like(kc)
    kc.view(bsz, per * BLK, HKV, D)[:, :lmax] = k.to(DEV)
    vc.view(bsz, per * BLK, HKV, D)[:, :lmax] = v.to(DEV)
    table = torch.arange(bsz * per, dtype=torch.int32, device=DEV).view(bsz, per)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if DRY:
        import rlk_ops
        return rlk_ops.paged_attention(q.to(DEV), kc, vc, table, seq, softmax_scale=scale)
    from rlk_ops.kernels.fa4.kernels import pair_attention
    return pair_attention(q.to(DEV), kc, vc, table, seq, scale)


def main():
    out_path = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    gen = torch.Generator().manual_seed(0)
    lens = [1024, 700, 129, 128] if not DRY else [300, 129]
    variants = list(itertools.product(("wgmma", "mma_sync"), (True, False), ("thread_seq", "row_seq", "thread_tree"),
                                      (False, True), (True, False)))
    if DRY:
        variants = variants[:2]
    res = {"lens": lens, "variants": ["mma, exp_fma, row_sum, lse_fma, ftz"], "datasets": {}}
    # the two tensor-core paths on the same operands (wide exponent range), with and without an
    # fp32 accumulator: do 16-row (mma.sync) and 64-row (wgmma) tiles give the same bits?
    x = (torch.randn(8, 64, D, generator=gen) * 2.0 ** torch.randint(-8, 9, (8, 64, 1), generator=gen))
    y = (torch.randn(8, BLK, D, generator=gen) * 2.0 ** torch.randint(-8, 9, (8, BLK, 1), generator=gen))
    acc = torch.randn(8, 64, BLK, generator=gen) * 2.0 ** torch.randint(-8, 9, (8, 64, 1), generator=gen)
    x, y, acc = x.to(torch.bfloat16).to(DEV), y.to(torch.bfloat16).to(DEV), acc.to(DEV)
    res["tile_16_vs_64_rows"] = {
        "qk_equal": bool(torch.equal(bdot(x, y)[:, :16], bdot(x[:, :16].contiguous(), y))),
        "pv_with_accumulator_equal": bool(torch.equal(bdot(x, y, c=acc, bt=False)[:, :16],
                                                      bdot(x[:, :16].contiguous(), y, c=acc[:, :16], bt=False)))}
    print("16 vs 64 rows:", res["tile_16_vs_64_rows"], flush=True)
    for kind in ("exact", "random"):
        q, k, v, scale = dataset(kind, lens, gen)
        ref_out, ref_lse = fa4_call(q, k, v, lens, scale)  # [B, 1, HQ, D], [B, HQ, 1]
        rows = {}
        cache = {}
        for var in variants:
            eq_out = eq_lse = n = 0
            worst_out = worst_lse = 0.0
            for b, h in itertools.product(range(len(lens)), range(HKV)):
                qg = q[b, 0, h * G:(h + 1) * G].to(DEV)
                o, lse = emulate(qg, k[b, :lens[b], h].to(DEV), v[b, :lens[b], h].to(DEV), lens[b], scale, var,
                                 cache, (b, h))
                ro, rl = ref_out[b, 0, h * G:(h + 1) * G], ref_lse[b, h * G:(h + 1) * G, 0]
                eq_out += int((o == ro).all(dim=1).sum())
                eq_lse += int((lse == rl).sum())
                worst_out = max(worst_out, float((o.float() - ro.float()).abs().max()))
                worst_lse = max(worst_lse, float((lse - rl).abs().max()))
                n += G
            rows[", ".join(str(x) for x in var)] = {"rows": n, "out_rows_equal": eq_out, "lse_rows_equal": eq_lse,
                                                    "out_max_abs_diff": worst_out, "lse_max_abs_diff": worst_lse}
            print(kind, var, rows[", ".join(str(x) for x in var)], flush=True)
        res["datasets"][kind] = rows
    res["tensor_core_instruction_by_tile_rows"] = PTX
    res["scale_log2_fp32_vs_double"] = {str(sc): [float(scale_log2(sc)), float(torch.tensor(sc * LOG2_E))]
                                        for sc in (D ** -0.5, 0.3)}
    full = [name for name, r in res["datasets"]["random"].items()
            if r["out_rows_equal"] == r["rows"] == r["lse_rows_equal"]]
    res["variants_equal_on_every_random_row"] = full
    print("tensor core instruction:", PTX)
    print("variants equal to FA4 on every random row:", full)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
