"""canonical:C decode pairs in FA4's arithmetic: one Triton launch instead of the pair layout
plus FA4's paged call, with the same bits. kernels/fa4/canonical.py routes decode steps here
(``DECODE_PAIRS = "triton"``, ``routable`` shapes, ``decode_launch`` arguments).

canonical:C defines a chunk partial as FA4's single pass over the chunk (kernels/fa4/canonical.py).
FA4's SM90 forward walks the key blocks of a chunk one after another on a 64-row tile; a decode
pair fills 4 of those rows. This module computes the same partial on tensor-core tiles sized
for decode, reading the page table itself, and reproduces FA4's arithmetic step for step, as
measured on the H200 (benchmarks/probe_fa4_arith.py, results/h200/fa4_arith.json):

    key blocks of 128 from the last to the first; the first one masked past the pair's length
    S = q @ K^T (fp32 accumulate);  m = max(m_prev, rowmax S);  m' = 0 if m = -inf else m
    P = ex2(fma(S, scale_log2, -(m' * scale_log2)))                 (ex2.approx.ftz)
    r = ex2((m_prev - m') * scale_log2)   (0 before the first block, where sums and O are 0)
    thread sums: 4 per row; thread t adds its 32 columns 8j + 2t + e in order (j, e), the
      first add fused with the rescale: fma(sum_t, r, P[first column])   (INIT_FMA)
    O = O * r + bf16(P) @ V (the product accumulated onto O * r in the tensor core)
    at the end: L = (s0 + s1) + (s2 + s3);  out = bf16(O * rcp(L));  lse = fma(m, scale_log2, lg2(L)) * ln 2

with ``scale_log2 = fp32(softmax_scale) * fp32(log2 e)`` and rcp / lg2 the PTX approximations
(``.approx.ftz``). The fused first add is ptxas contracting FA4's ``sum * r`` with the first
addition of its in-order reduce (unfused, a few lse were one ulp off).

Three tile layouts (``layout``), all equal to FA4's pair call on every pair on the H200:
* "rows" (``_pair_decode``): queries on the MMA's M axis (16 rows, mma.sync), keys split over
  the warps. ~2.5 us per key block (Triton 3.6 on the H200): the first working version.
* "keys" (``_pair_decode_keys``, the one routed): S^T = K @ Q^T with the keys on M and the G
  query heads on N (padded to 8 or 16), computed as a batched dot over ``SPLIT`` key groups so
  each warp owns its keys (with one 2-D dot, Triton 3.6's chained-dot heuristic gave every
  warp the whole S^T and softmax); then S is turned back and O = P @ V as usual (V the natural
  B operand, copied to shared memory asynchronously). A tensor-core output element is the same
  dot in either operand role: measured equal. ``prefetch`` (PF) decides how K/V addresses are
  made: 0 = page table read in the loop (the pipeliner then waits for every copy: no overlap),
  1 = one block ahead by hand, 2 = every block's token rows preloaded (no load feeds an
  address), 3 = as 2 with int32 offsets and unmasked K reads (keys past the pair read page 0,
  their scores are masked; V stays masked so garbage there cannot reach O).
  4 = K and V tiles by TMA (session 13; not routed: slower on the H200; pages a
  multiple of 128 keys, so a block never leaves its page): host-side tensor descriptors of the
  caches as [rows, HKV, D], one [128, 1, D] load per block and tensor; the pair's last block
  (the walk's first) is peeled, the only one whose V rows past the pair are zeroed. Offline
  (Triton 3.6, sm90) its loop is 441 instructions per warp per block at 4 warps against
  prefetch 3's 649 (297 against 364 at 8 warps, 2 slices), but 188 registers at 4 warps
  against 168 (two programs per SM instead of three). Measured on the H200 (session 14,
  results/h200/session14/roofline.json, page 128, C = 768, batch-64 launch, bitwise equal to
  prefetch 3): pairs 64 x 8k 247.1 against 244.0 us, 64 x 32k 962.7 against 952.8: fewer
  instructions, but the third program per SM was worth more.
  ``merge=True`` folds the merge in (not routed): the last program of each (sequence, KV head)
  merges the chunk states with the merge op's steps (``_merge_last_vec``: merge.py's
  ``_merge_vec`` steps, every state's out rows in one tile load per head-dim slice; offline
  168 registers, no spill). Equal bits to the merge op on the H200, but no faster than the
  merge launch in any cell, with or without ``seq_major`` (sequence-major programs: a
  sequence's merge runs while later ones stream) (results/h200/session10/canonical_decode.json,
  fused / unfused in one run, C = 1024: 1 x 8k 19.3 / 18.1 us, 1 x 32k 29.2 / 24.0, 8 x 8k
  40.8 / 40.9, 8 x 32k 138.8 / 133.8, 64 x 8k 257.4 / 255.5, 64 x 32k 992.5 / 963.5). Not
  measured, our reading: every program's acq_rel counter update (its stores drained, then an
  L2 round trip) keeps its SM slot busy, and over the waves of batch 64 that costs as much as
  the merge launch. Its first versions walked the states (one dependent L2 load after another:
  1 x 8k 22.0 against 18.3 us for kernel + merge; unrolled, variants_run1.json: 20.8 against
  18.1; session 10's probe, fused walk / vec, C = 1024: 1 x 8k 21.0 / 19.8, 64 x 8k 264.9 /
  263.1), removed in session 10 (code at commit 1528e6d). The pairs alone in sequence-major
  order: 64 x 8k C = 1024 254.4 against 254.8 us (session10/variants_partial.log).
  ``walk`` (sessions 14-16, removed after session 16; code at commit 6b83051): each program
  walked consecutive chunks of one sequence (the whole sequence: one program per (sequence, KV
  head), merging its own states after a CTA barrier, no counter, no second launch). Bitwise
  equal to the routed op and slower in three runs (results/h200/session15 and session16
  roofline.json, C = 768, 64 x 8k: the walk with its merge 1.077x / 1.085x FA4 single pass at
  page 16, 1.099x / 1.112x at page 128, against the op's 1.003x / 1.004x and 1.034x / 1.040x;
  its pair stores alone 263.5 us against the routed pairs' 252.0; 2 or 4 chunks per program
  261.4 / 262.1): fewer programs walking in turn keep HBM less busy than one program per pair,
  by more than the merge launch they save. ``walk_ahead`` and ``walk_flat`` went in session 15
  (code at 71e54b0).
* "tile" (``_pair_decode_tile``): FA4's own tile, the G query heads on the first rows of a
  64-row wgmma tile over 4 warps, every row reduction inside a warp, the thread sums each
  thread's own registers, the masked block peeled off the loop (529 SASS per warp per block
  offline against FA4-like ~450). Equal bits, but slower everywhere (variants_run1.json,
  pairs: 1 x 8k C=1024 17.3 against 15.6 us; 64 x 8k 352.8 against 254.6: a 213 KB tile, one
  program per SM): FA4's ~1 us per block comes from its warp specialisation (a producer warp,
  softmax of one block overlapping the next block's QK^T), which these kernels do not have.
``heads_first``: a 1-D grid whose consecutive programs are one pair's KV heads (same bits).
``l2_prefetch`` ("keys", prefetch >= 2: every K/V line of the chunk requested into L2 before the
walk) and ``ahead`` ("keys": the next block's scores issued before this block's softmax, FA4's
order of issue): same bits (CUDA tests), both slower on the H200 (variants_run2.json, C = 1024,
pairs: 1 x 8k 15.7 -> 18.1 and 16.8 us; 64 x 8k 257 -> 388 and 271), so not routed.
Two reorderings were built, checked equal to FA4's pair call on the H200 and removed as slower
(session 8; code in commits 50e6b04..633a33d): "split", a pair's key blocks scored side by side
in one launch (program per pair, KV head, block) and the walk in a second launch per head-dim
slice (variants_run3_split.json, op at C = 1024: 1 x 8k 20.0 against 18.8 us, 64 x 8k 356
against 261); "phased", one launch that scores every block, then takes every block's max,
exponentials and rescale factor at once (a max is exact in any order, so the running max before
and after each block is known up front), so only the O and thread-sum chains walk the blocks
(variants_run4_phased.json: 1 x 8k 20.1 against 19.4 us, 64 x 8k 295 against 259). From C =
512 to 1024 at 1 x 8k the split's walk grew 1.16 us per block, the phased kernel 1.47: the walk
keeps its layout conversions and CTA barriers per block in Triton, and each added launch or
phase costs more than the parallel scoring saves. A register cap for four programs per SM
(``config`` (4, 1, 128) or (8, 1, 64)) was slower too (64 x 8k pairs 312 and 453 against 252
us), and so were persistent programs (2 or 3 per SM walking the items in the heads_first order,
with or without the next item's page-table entries loaded ahead, capped at the routed kernel's
168 registers; session12/variants_persist.json: 5-8% slower at 64 x 8k, 8 x 32k and 64 x 32k, C =
640..1024; removed in session 13, code at commit cb4bc17). The early merge
(``decode_early_merge``, also removed in session 13, code at cb4bc17: sequence-major pair
programs each counting themselves per (sequence, KV head) with a release atomic, the merge
launched by PDL with each row polling its own counter) was bitwise equal to pairs + merge op on
every cell but gained nothing where it was built for: 64 x 8k C = 768 256.1 against 255.5 us at
page 16, 252.9 against 253.1 at page 128 (session13/canonical_speed.md, canonical_p128.md). At
batch 1 it was faster at C = 640 (1 x 8k 12.7 against 13.7 us at page 16) but 0-1.7% at the
default 768, and within about 1% at batch 8. Like the fused merge below, it hides the ~3 us
merge launch only to pay about as much in its per-program release (stores drained, then an L2
round trip, in every slot of every wave): our reading, not measured. In the latency regime
(programs fit one wave) decode_launch splits the head dim over 2 programs (SLICES_ONE_WAVE;
session12/variants_b1.json).

Measured (results/h200/pair_decode/, H200, page 16, C = 1024; op = pairs + merge; the FA4
route in brackets without its 64-row tile: with it, 1 x 8k is ~16.4, faster than this kernel):
1 x 8k 18.3 us (FA4 route 18.5), 1 x 32k 26.6 (29.4), 8 x 8k 42.9 (46.0), 8 x 32k 138.2 (146.7),
64 x 8k 260.0 (272.0). Per key block ~1.7 us at 8 warps against FA4's ~1 us: at batch 1 the
kernel is latency-bound (ncu: one or two warps per scheduler, ~4 cycles per instruction,
~400-650 instructions per warp per block), so 1 x 8k, the cell canonical:1024 still misses, is
not closed by it. ``ABL`` (``ablate``) removes pieces of the loop for timing probes only (wrong
bits on purpose): benchmarks/probe_pair_decode_ablate.py.

Checks (tests/test_triton_pair_decode.py): on the H200, every pair's out and lse equal FA4's own
pair call (pages 16 and 128, C = 128 .. 2048, lengths on and off block and chunk boundaries,
empty pairs, inputs with subnormal exponentials, each layout / prefetch / launch config), run to
run and batch invariant, the fused merge equal to the merge op; on the Triton interpreter, the
summation order against a torch transcription of the steps above (every layout and prefetch)
and the fused merge against the merge op. Offline sm90 compiles (Triton 3.6, the H200's):
benchmarks/pair_decode_sm90_offline.py.

Output: what kernels/fa4/canonical.py's pair call returns, ``out [N*B, 1, Hq, D]``, ``lse
[N*B, Hq, 1]`` (pair index chunk-major, c * B + b), plus ``pair_lens [N*B]`` (0 for an empty
pair: out 0, lse -inf, skipped by the merge through its length) and N.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.cpu.canonical import pair_count
from rlk_ops.kernels.triton import _common as C
from rlk_ops.kernels.triton import merge as merge_mod
from rlk_ops.kernels.triton.merge import _exp as _mexp, _log as _mlog, _log_constants, _max_lse, _pick

BLOCK_N = 128    # FA4's key block on SM90 for head_dim 128 (its tile_n)
ROWS = 16        # the query tile: mma.sync height; G = Hq / Hkv query heads fill it
TILE_ROWS = 64   # layout "tile": FA4's 64-row wgmma tile
NUM_WARPS = 4
NUM_STAGES = 2
_LN2 = tl.constexpr(math.log(2.0))
_NEG_INF = tl.constexpr(float("-inf"))
_INF = tl.constexpr(float("inf"))


def scale_log2(softmax_scale: float) -> float:
    """FA4 multiplies in the kernel, in fp32: fp32(softmax_scale) * fp32(log2 e)."""
    return float(torch.tensor(softmax_scale, dtype=torch.float32) * torch.tensor(math.log2(math.e),
                                                                                 dtype=torch.float32))


@triton.jit
def _approx(x, OP: tl.constexpr, EMU: tl.constexpr):
    """The PTX approximation FA4 uses: OP "ex2", "lg2" or "rcp" (``.approx.ftz.f32``). The
    interpreter has no inline asm: there exp2 / log2 / 1/x (its tests use exact arguments)."""
    if EMU:
        if OP == "ex2":
            return tl.math.exp2(x)
        if OP == "lg2":
            return tl.math.log2(x)
        return 1.0 / x
    return tl.inline_asm_elementwise(OP + ".approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _bf16(x, EMU: tl.constexpr):
    """fp32 -> bf16, round to nearest even (cvt.rn, as FA4 and torch). The interpreter's cast
    truncates, so there the rounding is done on the bits first (finite values)."""
    if EMU:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _thread_sums(prev, r, p, M: tl.constexpr, INIT_FMA: tl.constexpr):
    """FA4's per-thread row sums: prev [M, 4] rescaled by r [M], then p's columns 8j + 2t + e
    added for thread t in the order (j, e) = (0, 0), (0, 1), (1, 0), ... (15, 1): 32 sequential
    fp32 adds per thread sum, the first fused with the rescale (INIT_FMA; off: a separate
    multiply, the variant FA4 was measured not to use). Column k of thread t is picked out with
    reshapes and splits (no arithmetic)."""
    x = tl.reshape(tl.permute(tl.reshape(p, [M, 16, 4, 2]), (0, 2, 1, 3)), [M, 4, 32])  # [M, t, 2j + e]
    for k in tl.static_range(32):
        y0, y1 = tl.split(tl.reshape(x, [M, 4, 16, 2]))
        y = y1 if k % 2 == 1 else y0
        y0, y1 = tl.split(tl.reshape(y, [M, 4, 8, 2]))
        y = y1 if (k // 2) % 2 == 1 else y0
        y0, y1 = tl.split(tl.reshape(y, [M, 4, 4, 2]))
        y = y1 if (k // 4) % 2 == 1 else y0
        y0, y1 = tl.split(tl.reshape(y, [M, 4, 2, 2]))
        y = y1 if (k // 8) % 2 == 1 else y0
        y0, y1 = tl.split(y)
        y = y1 if (k // 16) % 2 == 1 else y0
        if k == 0:
            if INIT_FMA:
                acc = tl.math.fma(prev, r[:, None], y)
            else:
                acc = prev * r[:, None] + y
        else:
            acc = acc + y
    return acc


@triton.jit
def _pair(seq_lens, pair_lens, bsz, chunk, HKV: tl.constexpr = 1, HEADS_FIRST: tl.constexpr = 0,
          DS: tl.constexpr = 1, SEQ_MAJOR: tl.constexpr = 0, n_chunks=1, STORE_LENS: tl.constexpr = 1):
    """This program's (chunk, sequence) pair, KV head and head-dim slice (of DS), the pair's key
    count (written once). HEADS_FIRST: a 1-D grid whose consecutive programs are one pair's KV
    heads (and their slices; they read the same cache rows at about the same time) instead of
    a (pair, head, slice) grid. SEQ_MAJOR: programs in sequence-major order (a sequence's
    chunks on consecutive pair slots, so its states are done early and, with the fused merge,
    merged while later sequences stream) instead of chunk-major; the pair index (where the
    state is stored) stays chunk-major, c * bsz + b. STORE_LENS off: the caller stores the
    key count (``_store_lens``) later, so no store waits here for the seq_lens load."""
    if HEADS_FIRST:
        pid = tl.program_id(0)
        ds = pid % DS
        slot = pid // DS // HKV
        h = pid // DS % HKV
    else:
        slot = tl.program_id(0)
        h = tl.program_id(1)
        ds = tl.program_id(2) if DS > 1 else 0
    if SEQ_MAJOR:
        b = slot // n_chunks
        c = slot % n_chunks
        pair = c * bsz + b
    else:
        pair = slot
        c = pair // bsz
        b = pair % bsz
    n_keys = tl.minimum(tl.maximum(tl.load(seq_lens + b) - c * chunk, 0), chunk)
    if STORE_LENS:
        _store_lens(pair_lens, pair, h, ds, n_keys)
    return pair, h, c, b, n_keys, ds


@triton.jit
def _store_lens(pair_lens, pair, h, ds, n_keys):
    """The pair's key count, written once (by its first KV head's first head-dim slice)."""
    if (h == 0) & (ds == 0):
        tl.store(pair_lens + pair, n_keys)


@triton.jit
def _head_rows(pg, pos, page, h, HKV: tl.constexpr, D: tl.constexpr):
    """Element offsets (int64) of KV head h's rows for the keys at positions ``pos``, whose
    pages ``pg`` the page table gave."""
    return (pg.to(tl.int64) * page + pos % page) * (HKV * D) + h * D


@triton.jit
def _finish(out, lse, sums, pair, head, hmask, dd, part, acc, m, n_keys, scale_log2, M: tl.constexpr,
            HQ: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr, SUMS: tl.constexpr, first,
            EVICT: tl.constexpr):
    """Every layout's end of a pair: L = (s0 + s1) + (s2 + s3) from the thread sums, out =
    bf16(O * rcp(L)), lse = fma(m, scale_log2, lg2(L)) * ln 2 (an empty pair: out 0, lse -inf),
    stored for the query heads ``head`` and head-dim columns ``dd`` (row sums L too when SUMS);
    lse and L only where ``first`` (one of a pair's head-dim slices). EVICT: the L2 eviction
    policy of the out and lse stores (a cache hint: no value changes). No defaults: Triton 3.6
    rejected this nested call's EVICT default of "" where a caller left it out (session 24)."""
    even_t, odd_t = tl.split(tl.reshape(part, [M, 2, 2]))  # (s0, s2), (s1, s3)
    s01, s23 = tl.split(even_t + odd_t)                     # s0 + s1, s2 + s3
    total = s01 + s23
    empty = n_keys == 0
    o = tl.where(empty, 0.0, acc * _approx(total, "rcp", EMU)[:, None])
    l = tl.where(empty, _NEG_INF, tl.math.fma(m, scale_log2, _approx(total, "lg2", EMU)) * _LN2)
    tl.store(out + pair.to(tl.int64) * (HQ * D) + head[:, None] * D + dd[None, :], _bf16(o, EMU),
             mask=hmask[:, None], eviction_policy=EVICT)
    lmask = hmask
    if first is not None:
        lmask = tl.where(first, hmask, False)
    tl.store(lse + pair.to(tl.int64) * HQ + head, l, mask=lmask, eviction_policy=EVICT)
    if SUMS:
        tl.store(sums + pair.to(tl.int64) * HQ + head, total, mask=lmask)


@triton.jit
def _rows_start(q, b, h, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BN: tl.constexpr):
    """A queries-on-rows kernel's start: sequence b's G query heads of KV head h on the first
    rows of an M-row tile, and the empty running state (max -inf, thread sums and O zero)."""
    rows = tl.arange(0, M)
    rmask = rows < G
    dd = tl.arange(0, D)
    qt = tl.load(q + b.to(tl.int64) * (HQ * D) + (h * G + rows)[:, None] * D + dd[None, :], mask=rmask[:, None],
                 other=0.0)
    return (rows, rmask, dd, tl.arange(0, BN), qt, tl.full([M], _NEG_INF, tl.float32), tl.zeros([M, 4], tl.float32),
            tl.zeros([M, D], tl.float32))


@triton.jit
def _pair_decode(q, kc, vc, table, seq_lens, out, lse, pair_lens, sums,
                 scale_log2, bsz, width, chunk, page,
                 G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                 BN: tl.constexpr, EMU: tl.constexpr, SUMS: tl.constexpr, INIT_FMA: tl.constexpr):
    pair, h, c, b, n_keys, _ = _pair(seq_lens, pair_lens, bsz, chunk)
    rows, rmask, dd, kk, qt, m, part, acc = _rows_start(q, b, h, G, HQ, D, M, BN)
    nb = tl.cdiv(n_keys, BN)
    for it in range(0, nb):
        j = nb - 1 - it
        in_pair = j * BN + kk
        valid = in_pair < n_keys
        pos = c * chunk + in_pair
        pg = tl.load(table + b.to(tl.int64) * width + pos // page, mask=valid, other=0)
        tok = _head_rows(pg, pos, page, h, HKV, D)
        k = tl.load(kc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        if EMU:  # the interpreter's bf16 dot reads raw bits: multiply in fp32 (exact products)
            s = tl.dot(qt.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(qt, tl.trans(k))
        s = tl.where(valid[None, :], s, _NEG_INF)
        m_prev = m
        m = tl.maximum(tl.max(s, axis=1), m_prev)
        m_use = tl.where(m == _NEG_INF, 0.0, m)
        p = _approx(tl.math.fma(s, scale_log2, -(m_use * scale_log2)[:, None]), "ex2", EMU)
        r = _approx((m_prev - m_use) * scale_log2, "ex2", EMU)  # 0 before the first block: part and acc are 0
        part = _thread_sums(part, r, p, M, INIT_FMA)
        v = tl.load(vc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
        acc = acc * r[:, None]
        if EMU:
            acc = tl.dot(_bf16(p, EMU).to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(_bf16(p, EMU), v, acc)
    _finish(out, lse, sums, pair, h * G + rows, rmask, dd, part, acc, m, n_keys, scale_log2, M, HQ, D, EMU, SUMS,
            None, "")


@triton.jit
def _merge_last_vec(out, lse, count, merged_out, merged_lse, log_c, b, h, bsz, n_chunks, G: tl.constexpr,
                    GP: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, LIBDEVICE: tl.constexpr, NP: tl.constexpr,
                    LOG_NP: tl.constexpr, DSL: tl.constexpr):
    """rlk::merge_attn_states of sequence b's chunk states for KV head h's G query heads, by
    the program that finishes last, with merge.py's ``_merge_vec`` steps. Each of the
    ``n_chunks`` programs of (b, h) counts itself in ``count`` after its state is written (a
    CTA barrier, then one acq_rel atomic); the one that sees n_chunks - 1 (or the only one: no
    count, the barrier alone orders its own stores before its loads) resets the counter for the
    next launch, loads every state's lse in one [GP, NP] load from L2 (.cg; NP a power of two
    >= n_chunks, GP = G rounded up to a power of two; an empty pair's lse is -inf, skipped),
    takes the max and the weights w = exp(lse - M) as one tile, then per DSL columns of
    head_dim loads every state's out rows in one [GP, DSL, NP] load, forms every w * out at
    once and walks only the two sums over the states in ascending order (L + w, acc + w * out,
    each a where() on "present"): the merge op's operations and order (no FMA contraction,
    div_rn, its exp and log), so its bits. No reduction crosses the state axis except the max
    (exact in any order): the walk that did (session 6-9, removed in session 10) paid a
    cross-thread sum and layout conversion per state."""
    tl.debug_barrier()
    last = n_chunks == 1
    if n_chunks > 1:
        done = tl.atomic_add(count, 1, sem="acq_rel")
        last = done == n_chunks - 1
        if last:
            tl.store(count, 0)
    if last:
        rows = bsz * HQ                                      # merge rows: (sequence, query head)
        g = tl.arange(0, GP)
        hmask = g < G
        r = b.to(tl.int64) * HQ + h * G + g
        ks = tl.arange(0, NP)
        live = hmask[:, None] & (ks < n_chunks)[None, :]
        l2 = tl.load(lse + ks[None, :] * rows + r[:, None], mask=live, other=_NEG_INF, cache_modifier=".cg")
        mx = _max_lse(l2, 1)
        m_safe = tl.where(mx == _NEG_INF, 0.0, mx)
        w = _mexp(l2 - m_safe[:, None], LIBDEVICE)           # [GP, NP]: one exp per element
        present = tl.where(l2 != _NEG_INF, 1, 0)             # an empty pair's lse is -inf: skipped
        w1 = tl.reshape(w, [GP, 1, NP])
        p1 = tl.reshape(present, [GP, 1, NP])
        total = tl.zeros([GP, 1], tl.float32)                # L: the states walked in order, once per row
        for k in tl.static_range(NP):
            total = tl.where(_pick(p1, k, GP, 1, LOG_NP) != 0, total + _pick(w1, k, GP, 1, LOG_NP), total)
        w3 = tl.broadcast_to(w1, [GP, DSL, NP])
        p3 = tl.broadcast_to(p1, [GP, DSL, NP])
        for sl in tl.static_range(D // DSL):
            d = sl * DSL + tl.arange(0, DSL)
            o = tl.load(out + ((ks[None, None, :] * rows + r[:, None, None]) * D + d[None, :, None]),
                        mask=live[:, None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            wo = w3 * o
            acc = tl.zeros([GP, DSL], tl.float32)
            for k in tl.static_range(NP):
                acc = tl.where(_pick(p3, k, GP, DSL, LOG_NP) != 0, acc + _pick(wo, k, GP, DSL, LOG_NP), acc)
            res = tl.math.div_rn(acc, tl.broadcast_to(total, [GP, DSL]))
            res = tl.where(total == 0.0, 0.0, res)
            tl.store(merged_out + r[:, None] * D + d[None, :], res.to(merged_out.dtype.element_ty),
                     mask=hmask[:, None])
        tl.store(merged_lse + r, mx + _mlog(tl.reshape(total, [GP]), log_c), mask=hmask)


@triton.jit
def _l2_prefetch(ptrs, EMU: tl.constexpr):
    """``prefetch.global.L2`` of the 128-byte lines at ``ptrs``: no register waits for them (the
    interpreter has no inline asm: nothing)."""
    if not EMU:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _keys_tok(row, tok_all, blk, j, kk, c, chunk, page, n_keys, h, HKV: tl.constexpr, D: tl.constexpr,
              BN: tl.constexpr, PF: tl.constexpr, ABL: tl.constexpr):
    """Key block j's element offsets (head h) and its valid keys, for prefetch 0, 2 and 3
    (prefetch 1 carries the next page entries through the loop: inline there); prefetch 4: the
    cache row of the block's first key (``tok_all`` holds one per block there)."""
    in_pair = j * BN + kk
    valid = in_pair < n_keys
    if PF == 4:
        tok = tl.sum(tl.where(blk == j, tok_all, 0), axis=0)
    elif PF == 3:  # int32 element offsets (the cache has < 2**31 elements); keys past the pair read page 0
        tok = tl.sum(tl.where(blk[:, None] == j, tok_all, 0), axis=0) * (HKV * D) + h * D
    elif PF == 2:
        tok = tl.sum(tl.where(blk[:, None] == j, tok_all, 0), axis=0).to(tl.int64) * (HKV * D) + h * D
    else:
        pos = c * chunk + in_pair
        pg = tl.load(row + pos // page, mask=valid, other=0)
        tok = _head_rows(pg, pos, page, h, HKV, D)
    if ABL & 1:
        tok = kk.to(tl.int64) * (HKV * D) + h * D
    return tok, valid


@triton.jit
def _keys_scores(kc, qt, tok, valid, dd, BN: tl.constexpr, M: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr,
                 PF: tl.constexpr, SPLIT: tl.constexpr, h=0):
    """S [M, BN] of one key block, computed as S^T = K @ Q^T, keys past the pair -inf. PF 4:
    ``kc`` is a tensor descriptor of the cache as [rows, HKV, D] and ``tok`` the block's first
    row: the whole [BN, D] tile in one TMA load (keys past the pair are read and masked)."""
    if PF == 4:
        k = tl.reshape(kc.load([tok, h, 0]), [BN, D])
    elif PF == 3:
        k = tl.load(kc + (tok[:, None] + dd[None, :]))
    else:
        k = tl.load(kc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
    if EMU:
        s = tl.dot(k.to(tl.float32), qt.to(tl.float32))
    elif SPLIT:  # a batched dot over SPLIT key groups: a warp each (Triton gives a 3-D dot's
        s = tl.reshape(tl.dot(tl.reshape(k, [SPLIT, BN // SPLIT, D]),  # warps to its batch axis)
                              tl.broadcast_to(qt[None, :, :], [SPLIT, D, M])), [BN, M])
    else:
        s = tl.dot(k, qt)                                                # S^T [BN, M]
    return tl.trans(tl.where(valid[:, None], s, _NEG_INF))               # S [M, BN]


@triton.jit
def _keys_update(s, vc, tok, valid, dd, m, part, acc, scale_log2, M: tl.constexpr, EMU: tl.constexpr,
                 PF: tl.constexpr, ABL: tl.constexpr, INIT_FMA: tl.constexpr, h=0, col0=0,
                 MASKV: tl.constexpr = True):
    """One key block's online softmax step given its scores: max, exponentials, thread sums,
    O = O * r + bf16(P) @ V. PF 4: V's [BN, len(dd)] tile from column ``col0`` in one TMA load,
    its rows past the pair zeroed (P is 0 there, but 0 * a non-finite value in a cache slot
    past the pair is not) unless MASKV is off (a block wholly inside the pair)."""
    m_prev = m
    m = tl.maximum(tl.max(s, axis=1), m_prev)
    m_use = tl.where(m == _NEG_INF, 0.0, m)
    if ABL & 16:
        p = s
        r = m_use
    else:
        p = _approx(tl.math.fma(s, scale_log2, -(m_use * scale_log2)[:, None]), "ex2", EMU)
        r = _approx((m_prev - m_use) * scale_log2, "ex2", EMU)  # 0 before the first block: part and acc are 0
    if not (ABL & 2):
        part = _thread_sums(part, r, p, M, INIT_FMA)
    if PF == 4:
        v = tl.reshape(vc.load([tok, h, col0]), [valid.shape[0], dd.shape[0]])
        if MASKV:
            v = tl.where(valid[:, None], v, 0.0)
    elif PF == 3:
        v = tl.load(vc + (tok[:, None] + dd[None, :]), mask=valid[:, None], other=0.0)
    else:
        v = tl.load(vc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
    acc = acc * r[:, None]
    if EMU:
        acc = tl.dot(_bf16(p, EMU).to(tl.float32), v.to(tl.float32), acc)
    elif ABL & 4:
        acc = acc + tl.sum(p, axis=1)[:, None] + tl.max(v.to(tl.float32), axis=0)[None, :]
    else:
        acc = tl.dot(_bf16(p, EMU), v, acc)
    return m, part, acc


@triton.jit
def _pair_decode_keys(q, kc, vc, table, seq_lens, out, lse, pair_lens, sums,
                      scale_log2, bsz, width, chunk, page, n_chunks, counts, merged_out, merged_lse, log_c,
                      G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                      BN: tl.constexpr, EMU: tl.constexpr, SUMS: tl.constexpr, INIT_FMA: tl.constexpr,
                      PF: tl.constexpr = 0, NBC: tl.constexpr = 1, ABL: tl.constexpr = 0,
                      SPLIT: tl.constexpr = 0, FUSE: tl.constexpr = 0, LIBDEVICE: tl.constexpr = 1,
                      NMAX: tl.constexpr = 0, HEADS_FIRST: tl.constexpr = 0, L2PF: tl.constexpr = 0,
                      AHEAD: tl.constexpr = 0, DS: tl.constexpr = 1, SEQ_MAJOR: tl.constexpr = 0,
                      GP: tl.constexpr = 4, LOG_NP: tl.constexpr = 0, DSL: tl.constexpr = 128,
                      PDL: tl.constexpr = 0, EVICT: tl.constexpr = "", EARLY: tl.constexpr = 0):
    """``_pair_decode`` with the scores transposed: keys on the MMA's M axis, the G query heads
    (padded to M = 8 or 16) on its N axis, S^T = K @ Q^T; then P^T is turned back and
    O = P @ V as usual (V the natural B operand, so it is copied to shared memory
    asynchronously). Same operations per element (a tensor-core output element is the same dot
    in either operand role, measured on the H200), half the padded QK^T work and a quarter of
    the exponentials at G = 4. L2PF (prefetch >= 2): every K/V line of the pair is requested
    into L2 up front, so the block walk waits on L2 rather than on memory. AHEAD: the next
    block's scores are issued before this block's softmax (FA4's order of issue; the same
    operations on every block). DS: the head dim of V and O split over DS programs (a slice
    each, ``dv``); each one scores the whole block itself (the same scores, max, exponentials
    and sums in every slice) and keeps only its columns of O, each the same tensor-core chain
    as in the whole tile. PDL: the next launch (the merge, launched with programmatic dependent
    launch) may start once every program has started; it waits for this kernel's end and writes
    in-kernel (griddepcontrol.wait), so its programs take the SM slots that free up in the last
    wave instead of launching after it. EVICT: the state stores' L2 eviction policy (``_finish``).
    EARLY (prefetch 2 and 3): the chunk's page-table entries are loaded without waiting for the
    sequence length (bounded by the table's width; entries past the pair then zeroed, the same
    values as the masked load) and the pair's key count is stored at the end, so the seq_lens
    and page-table loads are in flight together instead of one after the other (a program's
    start at batch 1 is a chain of dependent loads: seq_lens, page table, the first K/V block)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pair, h, c, b, n_keys, ds = _pair(seq_lens, pair_lens, bsz, chunk, HKV, HEADS_FIRST, DS, SEQ_MAJOR, n_chunks,
                                      STORE_LENS=not EARLY)
    _keys_pair(q, kc, vc, table, out, lse, sums, scale_log2, width, chunk, page, pair, h, c, b, n_keys, ds,
               G, HQ, HKV, D, M, BN, EMU, SUMS, INIT_FMA, PF, NBC, ABL, SPLIT, L2PF, AHEAD, DS, EVICT, EARLY)
    if EARLY:
        _store_lens(pair_lens, pair, h, ds, n_keys)
    if FUSE:  # the last program of (sequence, KV head) to finish merges its chunks' states
        _merge_last_vec(out, lse, counts + b * HKV + h, merged_out, merged_lse, log_c, b, h, bsz, n_chunks, G, GP,
                        HQ, D, LIBDEVICE, NMAX, LOG_NP, DSL)


@triton.jit
def _keys_pair(q, kc, vc, table, out, lse, sums, scale_log2, width, chunk, page, pair, h, c, b, n_keys, ds,
               G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
               BN: tl.constexpr, EMU: tl.constexpr, SUMS: tl.constexpr, INIT_FMA: tl.constexpr, PF: tl.constexpr,
               NBC: tl.constexpr, ABL: tl.constexpr, SPLIT: tl.constexpr, L2PF: tl.constexpr, AHEAD: tl.constexpr,
               DS: tl.constexpr, EVICT: tl.constexpr, EARLY: tl.constexpr):
    """One pair's walk in the "keys" layout (``_pair_decode_keys``): its state stored."""
    cols = tl.arange(0, M)
    cmask = cols < G
    dd = tl.arange(0, D)
    col0 = ds * (D // DS)
    dv = col0 + tl.arange(0, D // DS)                                    # this program's columns of V and O
    kk = tl.arange(0, BN)
    qt = tl.load(q + b.to(tl.int64) * (HQ * D) + (h * G + cols)[None, :] * D + dd[:, None], mask=cmask[None, :],
                 other=0.0)                                              # Q^T [D, M]
    m = tl.full([M], _NEG_INF, tl.float32)
    part = tl.zeros([M, 4], tl.float32)
    acc = tl.zeros([M, D // DS], tl.float32)
    nb = tl.cdiv(n_keys, BN)
    row = table + b.to(tl.int64) * width
    blk = tl.arange(0, NBC)
    tok_all = tl.zeros([NBC, BN], tl.int32)
    if PF == 1:  # the page-table entries one block ahead, by hand
        in_pair = (nb - 1) * BN + kk
        pg_next = tl.load(row + (c * chunk + in_pair) // page, mask=in_pair < n_keys, other=0)
    if PF == 4:  # every block's first cache row up front (page % BN == 0: a block never leaves its page)
        starts = c * chunk + blk * BN
        tok_all = tl.load(row + starts // page, mask=blk * BN < n_keys, other=0) * page + starts % page
    if (PF == 2) | (PF == 3):  # every block's token rows up front (NBC = chunk / BN blocks): no load feeds an address
        at = blk[:, None] * BN + kk[None, :]
        if EARLY:  # not waiting for n_keys: every entry of the chunk in the table, then those past the pair 0
            entry = (c * chunk + at) // page
            pg_all = tl.where(at < n_keys, tl.load(row + entry, mask=(at < chunk) & (entry < width), other=0), 0)
        else:
            pg_all = tl.load(row + (c * chunk + at) // page, mask=at < n_keys, other=0)
        tok_all = pg_all * page + (c * chunk + at) % page                # [NBC, BN] cache rows (int32)
        if L2PF:  # both 128-byte lines of every K and V row (keys past the pair: page 0's rows)
            lines = (tok_all * (HKV * D) + h * D)[:, :, None] + (tl.arange(0, 2) * (D // 2))[None, None, :]
            _l2_prefetch(kc + lines, EMU)
            _l2_prefetch(vc + lines, EMU)
    if AHEAD:
        j0 = tl.maximum(nb - 1, 0)  # an empty pair reads block 0, all masked (not used)
        tok, valid = _keys_tok(row, tok_all, blk, j0, kk, c, chunk, page, n_keys, h, HKV, D, BN, PF, ABL)
        s = _keys_scores(kc, qt, tok, valid, dd, BN, M, D, EMU, PF, SPLIT, h)
        for it in range(0, nb - 1):
            j = nb - 1 - it
            tok_n, valid_n = _keys_tok(row, tok_all, blk, j - 1, kk, c, chunk, page, n_keys, h, HKV, D, BN, PF, ABL)
            s_n = _keys_scores(kc, qt, tok_n, valid_n, dd, BN, M, D, EMU, PF, SPLIT, h)
            m, part, acc = _keys_update(s, vc, tok, valid, dv, m, part, acc, scale_log2, M, EMU, PF, ABL, INIT_FMA,
                                          h, col0)
            s = s_n
            tok = tok_n
            valid = valid_n
        if nb > 0:
            m, part, acc = _keys_update(s, vc, tok, valid, dv, m, part, acc, scale_log2, M, EMU, PF, ABL, INIT_FMA,
                                          h, col0)
    elif PF == 4:  # the walk's first block (the pair's last) is the only one that can end early: peeled
        if nb > 0:
            tok, valid = _keys_tok(row, tok_all, blk, nb - 1, kk, c, chunk, page, n_keys, h, HKV, D, BN, PF, ABL)
            s = _keys_scores(kc, qt, tok, valid, dd, BN, M, D, EMU, PF, SPLIT, h)
            m, part, acc = _keys_update(s, vc, tok, valid, dv, m, part, acc, scale_log2, M, EMU, PF, ABL, INIT_FMA, h,
                                        col0)
        for it in range(1, nb):
            tok, valid = _keys_tok(row, tok_all, blk, nb - 1 - it, kk, c, chunk, page, n_keys, h, HKV, D, BN, PF, ABL)
            s = _keys_scores(kc, qt, tok, valid, dd, BN, M, D, EMU, PF, SPLIT, h)
            m, part, acc = _keys_update(s, vc, tok, valid, dv, m, part, acc, scale_log2, M, EMU, PF, ABL, INIT_FMA,
                                        h, col0, False)
    else:
        for it in range(0, nb):
            j = nb - 1 - it
            if PF == 1:
                in_pair = j * BN + kk
                valid = in_pair < n_keys
                pg = pg_next
                nxt = in_pair - BN
                pg_next = tl.load(row + (c * chunk + nxt) // page, mask=(nxt >= 0) & (nxt < n_keys), other=0)
                tok = _head_rows(pg, c * chunk + in_pair, page, h, HKV, D)
                if ABL & 1:
                    tok = kk.to(tl.int64) * (HKV * D) + h * D
            else:
                tok, valid = _keys_tok(row, tok_all, blk, j, kk, c, chunk, page, n_keys, h, HKV, D, BN, PF, ABL)
            s = _keys_scores(kc, qt, tok, valid, dd, BN, M, D, EMU, PF, SPLIT, h)
            m, part, acc = _keys_update(s, vc, tok, valid, dv, m, part, acc, scale_log2, M, EMU, PF, ABL, INIT_FMA,
                                          h, col0)
    head = h * G + cols
    _finish(out, lse, sums, pair, head, cmask, dv, part, acc, m, n_keys, scale_log2, M, HQ, D, EMU, SUMS,
            (ds == 0) if DS > 1 else None, EVICT)


@triton.jit
def _native_sums(prev, r, p, M: tl.constexpr, EMU: tl.constexpr):
    """``_thread_sums`` for p in the wgmma accumulator layout (64-row tile, warps on rows): there
    a thread's columns 8j + 2t + e of a row are its own registers in (j, e) order, so the
    reshape is free and the sum is Triton's in-thread reduction, sequential in register order,
    with element 0 replaced by the fused rescale fma(prev, r, p0). The interpreter's sum is
    numpy's (pairwise): there the explicit chain."""
    if EMU:
        return _thread_sums(prev, r, p, M, True)
    x = tl.reshape(tl.permute(tl.reshape(p, [M, 16, 4, 2]), (0, 2, 1, 3)), [M, 4, 32])   # [M, t, 2j + e]
    first = tl.arange(0, 32)[None, None, :] == 0
    return tl.sum(tl.where(first, tl.math.fma(prev[:, :, None], r[:, None, None], x), x), axis=2)


@triton.jit
def _tile_rows(pg, pos, h, PAGE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, OFF32: tl.constexpr):
    """Element offsets of head h's cache rows at positions ``pos`` on pages ``pg``: int32 when
    the cache has fewer than 2**31 elements (OFF32), else int64."""
    if OFF32:
        tok = (pg * PAGE + pos % PAGE) * (HKV * D) + h * D
    else:
        tok = (pg.to(tl.int64) * PAGE + pos % PAGE) * (HKV * D) + h * D
    return tok


@triton.jit
def _tile_block(qt, kc, vc, tok, valid, dd, m, part, acc, scale_log2, M: tl.constexpr, EMU: tl.constexpr,
                MASK: tl.constexpr):
    """One key block of ``_pair_decode_tile``: MASK for the pair's last (first walked) block."""
    if MASK:
        k = tl.load(kc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
    else:
        k = tl.load(kc + tok[:, None] + dd[None, :])
    if EMU:
        s = tl.dot(qt.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(qt, tl.trans(k))
    if MASK:
        s = tl.where(valid[None, :], s, _NEG_INF)
    m_prev = m
    m = tl.maximum(tl.max(s, axis=1), m_prev)
    m_use = tl.where(m == _NEG_INF, 0.0, m)
    p = _approx(tl.math.fma(s, scale_log2, -(m_use * scale_log2)[:, None]), "ex2", EMU)
    r = _approx((m_prev - m_use) * scale_log2, "ex2", EMU)   # 0 before the first block: part and acc are 0
    part = _native_sums(part, r, p, M, EMU)
    if MASK:
        v = tl.load(vc + tok[:, None] + dd[None, :], mask=valid[:, None], other=0.0)
    else:
        v = tl.load(vc + tok[:, None] + dd[None, :])
    acc = acc * r[:, None]
    if EMU:
        acc = tl.dot(_bf16(p, EMU).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(_bf16(p, EMU), v, acc)
    return m, part, acc


@triton.jit
def _pair_decode_tile(q, kc, vc, table, seq_lens, out, lse, pair_lens, sums,
                      scale_log2, bsz, width, chunk, page,
                      G: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                      BN: tl.constexpr, EMU: tl.constexpr, SUMS: tl.constexpr, INIT_FMA: tl.constexpr,
                      HEADS_FIRST: tl.constexpr = 0, OFF32: tl.constexpr = 0, PAGE: tl.constexpr = 16):
    """FA4's own tile shape: the G query heads on the first rows of a 64-row tile over 4 warps
    (wgmma, each warp 16 rows), so every row reduction stays inside a warp and the thread sums
    are each thread's own registers (``_native_sums``); the pair's last key block (the only
    masked one) is peeled off the loop, the rest load unmasked; the page-table entries of the
    next block are read one block ahead. INIT_FMA is always on here."""
    pair, h, c, b, n_keys, _ = _pair(seq_lens, pair_lens, bsz, chunk, HKV, HEADS_FIRST)
    rows, rmask, dd, kk, qt, m, part, acc = _rows_start(q, b, h, G, HQ, D, M, BN)
    nb = tl.cdiv(n_keys, BN)
    row = table + b.to(tl.int64) * width
    if nb > 0:
        in_pair = (nb - 1) * BN + kk
        valid = in_pair < n_keys
        pos = c * chunk + in_pair
        pg = tl.load(row + pos // PAGE, mask=valid, other=0)
        tok = _tile_rows(pg, pos, h, PAGE, HKV, D, OFF32)
        m, part, acc = _tile_block(qt, kc, vc, tok, valid, dd, m, part, acc, scale_log2, M, EMU, True)
        pos = c * chunk + (nb - 2) * BN + kk
        pg = tl.load(row + pos // PAGE, mask=pos >= c * chunk, other=0)    # block nb - 2, if any
        for it in range(1, nb):
            j = nb - 1 - it
            tok = _tile_rows(pg, pos, h, PAGE, HKV, D, OFF32)
            pos = c * chunk + (j - 1) * BN + kk
            pg = tl.load(row + pos // PAGE, mask=pos >= c * chunk, other=0)
            m, part, acc = _tile_block(qt, kc, vc, tok, kk < BN, dd, m, part, acc, scale_log2, M, EMU, False)
    _finish(out, lse, sums, pair, h * G + rows, rmask, dd, part, acc, m, n_keys, scale_log2, M, HQ, D, EMU, SUMS,
            None, "")


# layout -> (kernel, query tile for G query heads per KV head): "rows" puts the queries on the
# MMA's M axis (16 rows), "keys" puts the keys there and the queries on N (8 or 16).
MAX_PRELOADED_BLOCKS = 16   # "keys", prefetch 2: a chunk's token rows held in registers up to 16 blocks
VEC_TILE = 4096             # merge=True: elements of one [GP, DSL, NP] state tile (head_dim in DSL slices)
MERGE_VEC_MAX = 128         # merge=True: chunks per sequence at most (DSL >= 8 at G = 4)
STATE_EVICTIONS = ("", "evict_first", "evict_last")   # state_evict: Triton's store eviction policies

LAYOUTS = {"rows": lambda g: (_pair_decode, ROWS),
           "keys": lambda g: (_pair_decode_keys, 8 if g <= 8 else 16),
           "tile": lambda g: (_pair_decode_tile, TILE_ROWS)}


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Where this kernel's bits are FA4's (as checked): one query token, bf16, head_dim 128,
    at most ROWS query heads per KV head."""
    g = q.shape[2] // k_cache.shape[2]
    return q.shape[1] == 1 and q.dtype == torch.bfloat16 and q.shape[-1] == 128 and 1 <= g <= ROWS


def preloadable(k_cache: torch.Tensor, chunk_size: int) -> bool:
    """Prefetch 3 applies: a chunk's token rows fit the registers (at most MAX_PRELOADED_BLOCKS
    key blocks) and the cache's element offsets fit int32."""
    return chunk_size // BLOCK_N <= MAX_PRELOADED_BLOCKS and k_cache.numel() < 2 ** 31


def routable(q: torch.Tensor, k_cache: torch.Tensor, chunk_size: int, arch: str | None) -> bool:
    """Where kernels/fa4/canonical.py may take this kernel ("keys" layout, prefetch 3) for a
    decode step: on sm90 only (``arch``: provenance.gpu_arch's; the kernel transcribes FA4's SM90
    arithmetic, and on another architecture FA4's own kernel computes training's partials: until
    session 34 an sm80 or sm100 GPU took this route too), the shapes its bits were checked on against FA4's pair call on the GPU
    (tests/test_triton_pair_decode.py): one query token, bf16, head_dim 128, a (query heads per
    KV head, page size) pair of ROUTED (G = 4 at pages 16, 128, 256, the CUDA tests' shape since
    session 5; G = 1, 2, 5, 8 at pages 16 and 128, test_cuda_pairs_at_other_group_sizes, passed
    on an H100 in session 30), C a multiple of the page size and of 128 with at most
    MAX_PRELOADED_BLOCKS key blocks, a cache of fewer than 2**31 elements. Never on the Triton
    interpreter: it has no PTX approximations, so its bits are not FA4's. Other shapes take the
    FA4 pair route (same bits by construction: FA4's own kernel)."""
    g = q.shape[2] // k_cache.shape[2]
    page = k_cache.shape[1]
    return (not C.INTERPRET and arch == "sm90" and q.shape[1] == 1 and q.dtype == torch.bfloat16
            and q.shape[-1] == 128 and page in ROUTED.get(g, ())
            and chunk_size % page == 0 and chunk_size % BLOCK_N == 0 and preloadable(k_cache, chunk_size))


# query heads per KV head -> the page sizes where the GPU checked the bits against FA4's pair call
ROUTED = {4: (16, 128, 256), 1: (16, 128), 2: (16, 128), 5: (16, 128), 8: (16, 128)}


# Head-dim slices while the pair programs are one wave (decode_launch): each (pair, KV head) on
# SLICES_ONE_WAVE programs, each scoring the whole block and keeping its half of O (same bits).
# Batch 1 / 8k is latency-bound on a few dozen programs; measured on the H200, page 16, op =
# pairs + merge, us, routed -> 2 slices (results/h200/session12/variants_b1.json, bitwise equal):
# C=640 14.8 -> 13.66, C=768 15.54 -> 14.42 (session 9, C=1024: pairs 16.4 -> 15.2; 4 slices
# 15.6, 8 slices 22.9; past one wave, 8 x 8k, 2 slices were slower: 40.0 -> 51.9). 1 turns it off.
SLICES_ONE_WAVE = 2
# Programmatic dependent launch from the pair kernel to the merge while the pair programs are one
# wave (decode_launch ``pdl``; the merge op's ``pdl``): the merge launches once every pair program
# has started and waits in-kernel for the pair kernel's end, so its launch latency overlaps the
# pair kernel. Same bits (the same programs on the same data). Measured on the H200, page 16, op =
# pairs + merge, us, without -> with, every one-wave cell faster: session11/variants_pdl_c.json
# 1 x 8k C=512 12.47 -> 11.90, C=640 15.04 -> 14.60, C=768 15.14 -> 14.55, C=1024 18.52 -> 17.85,
# 1 x 32k C=1024 27.76 -> 24.43; session12/variants_b1.json (2 head-dim slices) 1 x 8k C=640 13.66
# -> 12.78, C=768 14.42 -> 14.13. Past one wave it was mixed (1 x 32k C=512..768 -1.5..+3.5 us,
# batch 8 and 64 x 8k noise, 64 x 32k 2-3 us slower), so there it follows merge.PDL (off). False:
# merge.PDL decides everywhere.
PDL_ONE_WAVE = True
# The "keys" kernel's EARLY (``early_table``) while the pair programs are one wave (decode_launch):
# a chunk's page-table entries are loaded without waiting for seq_lens, so a pair program's start
# is one dependent load shorter (same bits: entries past the pair are zeroed, as the masked load
# gave them). Built in session 20 for batch 1 / 8k, the latency-bound cell. Off: measured on the
# H200 at 2ece7f0 (results/h200/session21/d_*.log, page 16, C = 768, op us) it made 1 x 8k slower,
# 13.91 -> 15.43 alone (there 1 x 32k 30.13 -> 29.11, no other cell slower by more than 0.2 us)
# and 13.16 -> 15.26 with the merge's eager loads; bitwise equal to FA4's pair call in its CUDA tests.
EARLY_TABLE_ONE_WAVE = False
# Past one wave, the pair kernel stores its states with the L2 policy evict_last (``state_evict``)
# when they take at most this many bytes (out and lse of every pair; ``state_bytes``): the merge
# right after then reads them from L2 instead of memory, though ~1 GB of K/V streamed past them.
# A hint: same bits (evict_last_equal in every cell). Measured on the H200, C = 768, op = pairs +
# merge, us, plain -> evict_last, two runs (results/h200/session19/roofline_02547de.json,
# roofline_02547de_run2.json; states in MB): page 16, 64 x 8k (2.9) 258.75 -> 256.05 and 257.0 ->
# 253.62 (FA4 single pass 256.79, 254.83), 8 x 32k (1.4) 136.84 -> 135.54, 8 x 8k (0.36) 41.9 ->
# 42.26; page 128, 64 x 8k 255.83 -> 252.75 and 256.08 -> 253.49, 8 x 32k 135.75 -> 133.74; but
# 64 x 16k (5.8) 499.52 -> 500.59 and 498.88 -> 500.0, 64 x 32k (11.3) 987.5 -> 992.85 (page 16),
# 980.31 -> 985.27 (page 128): the fitted streaming rate grows with the states kept (226.4 ->
# 228.8 us/GB at page 16) while the fixed cost falls (14.8 -> 9.9 us). So up to 4 MiB. Not
# measured in one wave (there the merge's launch already overlaps by PDL): off. The speed table with
# it routed (results/h200/session19/decode_p16_7bb0117*.md, page 16): 64 x 8k 0.990x / 0.994x FA4
# single pass (1.000-1.014x without it in sessions 11-19). 0 turns it off.
STATE_EVICT_MAX_BYTES = 4 << 20


def state_bytes(q: torch.Tensor, n: int) -> int:
    """Bytes of the states of a decode step's ``n`` chunks per sequence: out and lse per pair."""
    bsz, _, hq, d = q.shape
    return n * bsz * hq * (d * q.element_size() + 4)


def step_launch(q: torch.Tensor, k_cache: torch.Tensor, n: int) -> dict:
    """``decode_launch`` for a decode step of ``n`` chunks per sequence: its (pair, KV head)
    programs and its states' bytes taken from q and the cache."""
    return decode_launch(n * q.shape[0] * k_cache.shape[2], q.device, state_bytes(q, n))


def decode_launch(programs: int, device: torch.device, states: int = 0) -> dict:
    """``pair_decode`` launch arguments for ``programs`` (pair, KV head) programs, as measured on
    the H200 (no bit depends on them). Up to one program per SM, latency decides: 8 warps with
    two K/V blocks in flight (results/h200/pair_decode/configs_run5_split.json: 1 x 8k C=1024
    15.6 us against 18.4 for 4 warps, one block). Beyond, throughput: 4 warps, one block in
    flight (67 KB of shared memory, three programs per SM; 64 x 8k: 254.5 us against 272.6),
    and one pair's KV heads on adjacent programs, which read the same cache rows together
    (variants_run1.json: 64 x 8k pairs 248.9 against 254.6 us, 8 x 32k 128.5 against 130.3;
    at batch 1 it was no faster). Where even SLICES_ONE_WAVE times the programs fit one per SM,
    the head dim of V and O is split over that many programs (``slices``; see SLICES_ONE_WAVE).
    Up to one wave the merge is also launched by PDL (``pdl``, for the pair kernel and the merge
    op alike; see PDL_ONE_WAVE); past it, and where PDL_ONE_WAVE is off, merge.PDL decides.
    Up to one wave EARLY_TABLE_ONE_WAVE decides ``early_table`` (the op's launches have prefetch 3,
    see routable). Past one wave, states of at most STATE_EVICT_MAX_BYTES (``states``: ``state_bytes``) are
    stored evict_last (``state_evict``; see STATE_EVICT_MAX_BYTES). A step whose states grow past
    that bound compiles the kernel once more (the hint is a compile-time constant)."""
    sms = C.num_sms(0 if device.index is None else device.index) if device.type == "cuda" else 4
    if programs <= sms:
        slices = SLICES_ONE_WAVE if SLICES_ONE_WAVE > 1 and programs * SLICES_ONE_WAVE <= sms else 1
        return {"config": (8, 3), "heads_first": False, "slices": slices, "pdl": PDL_ONE_WAVE or merge_mod.PDL,
                "state_evict": "", "early_table": EARLY_TABLE_ONE_WAVE}
    evict = "evict_last" if 0 < states <= STATE_EVICT_MAX_BYTES else ""
    return {"config": (4, 2), "heads_first": True, "slices": 1, "pdl": merge_mod.PDL, "state_evict": evict,
            "early_table": False}



def pair_decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale: float, chunk_size: int,
                sums: bool = False, init_fma: bool = True, config: tuple[int, int] | None = None,
                layout: str = "rows", prefetch: int | None = None, ablate: int = 0, split: int | None = None,
                merge: bool = False, heads_first: bool = False, l2_prefetch: bool = False, ahead: bool = False,
                slices: int = 1, seq_major: bool = False, pdl: bool | None = None, state_evict: str = "",
                early_table: bool = False):
    """``(out [N*B, 1, Hq, D], lse [N*B, Hq, 1], pair_lens [N*B], N[, row sums])`` of every
    (chunk, sequence) pair of a decode step; ``chunk_size % page_size == 0``. ``sums``: also
    the final row sums L (tests); ``init_fma=False``: the unfused rescale (probes only);
    ``config``: (num_warps, num_stages[, maxnreg]) instead of (NUM_WARPS, NUM_STAGES) (probes;
    maxnreg caps the registers per thread so that more programs fit an SM; no bit depends on
    them: every reduction order above is fixed by the code, not the launch);
    ``l2_prefetch`` / ``ahead``: the "keys" kernel's L2PF / AHEAD (same bits); ``slices``: its
    DS, the head dim of V and O over that many programs per (pair, KV head) (same bits);
    ``merge``: the merge fused in (``_merge_last_vec``, up to MERGE_VEC_MAX chunks; not routed);
    ``seq_major``: programs in sequence-major order ("keys"; the states' layout is unchanged,
    same bits); ``pdl``: the "keys" kernel lets the next launch start early (its PDL; default:
    merge.PDL, the switch that launches the merge that way; no effect on the interpreter);
    ``state_evict``: the "keys" kernel's L2 eviction policy for its out and lse stores, one of
    STATE_EVICTIONS ("evict_last": keep the states in L2 for the merge that reads them next
    while the cache streams past; a hint, same bits; decode_launch routes it, see
    STATE_EVICT_MAX_BYTES); ``early_table``: the "keys" kernel's EARLY, prefetch 2 or 3 (the
    page-table loads not waiting for seq_lens; same bits; not routed, not yet timed)."""
    bsz, _, hq, d = q.shape
    page = k_cache.shape[1]
    hkv = k_cache.shape[2]
    if chunk_size % page or chunk_size % BLOCK_N:
        raise ValueError(f"pair_decode needs chunk_size a multiple of page_size {page} and of {BLOCK_N}, "
                         f"got {chunk_size}")
    width = page_table.shape[1]
    n = pair_count(width, page, chunk_size)
    dev = q.device
    out = torch.empty((n * bsz, 1, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty((n * bsz, hq, 1), dtype=torch.float32, device=dev)
    pair_lens = torch.empty(n * bsz, dtype=torch.int32, device=dev)
    row_sums = torch.empty((n * bsz, hq), dtype=torch.float32, device=dev) if sums else lse
    config = tuple(config or (NUM_WARPS, NUM_STAGES))
    if len(config) not in (2, 3):
        raise ValueError(f"pair_decode config must be (num_warps, num_stages[, maxnreg]), got {config}")
    warps, stages = config[:2]
    maxnreg = {"maxnreg": config[2]} if len(config) == 3 else {}
    if layout not in LAYOUTS:
        raise ValueError(f"pair_decode layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    kernel, rows = LAYOUTS[layout](hq // hkv)
    extra = {}
    if layout == "keys":
        blocks = chunk_size // BLOCK_N
        if prefetch is None:
            prefetch = 3 if preloadable(k_cache, chunk_size) else 0
        if split is None:
            split = warps if BLOCK_N % (16 * warps) == 0 else 0
        if prefetch not in (0, 1, 2, 3, 4):
            raise ValueError(f"pair_decode prefetch must be 0, 1, 2, 3 or 4, got {prefetch}")
        if prefetch == 4 and ablate & 1:
            raise ValueError(f"pair_decode prefetch=4 reads whole tiles: ablate must leave bit 1 off, got {ablate}")
        if l2_prefetch and prefetch not in (2, 3):
            raise ValueError(f"pair_decode l2_prefetch=True needs prefetch 2 or 3, got {prefetch}")
        if prefetch == 4 and (page % BLOCK_N or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            raise ValueError(f"pair_decode prefetch=4 (TMA tiles) needs contiguous caches with page_size a multiple of "
                             f"{BLOCK_N}, got page_size {page}, contiguous {k_cache.is_contiguous()} and "
                             f"{v_cache.is_contiguous()}")
        if ahead and prefetch == 1:
            raise ValueError("pair_decode ahead=True needs prefetch 0, 2 or 3, got 1")
        if merge and n > MERGE_VEC_MAX:
            raise ValueError(f"pair_decode merge=True takes up to {MERGE_VEC_MAX} chunks per sequence, got {n} "
                             f"(page_table width {width} x page {page} / chunk_size {chunk_size})")
        extra = {"PF": prefetch, "NBC": triton.next_power_of_2(blocks), "ABL": ablate, "SPLIT": split,
                 "FUSE": int(merge), "LIBDEVICE": int(not C.INTERPRET), "L2PF": int(l2_prefetch),
                 "AHEAD": int(ahead), "SEQ_MAJOR": int(seq_major)}
        if merge:  # only then: any other launch keeps one compile whatever the chunk count
            np_ = triton.next_power_of_2(n)
            gp = triton.next_power_of_2(hq // hkv)
            extra.update(NMAX=np_, GP=gp, LOG_NP=np_.bit_length() - 1, DSL=max(min(d, VEC_TILE // (gp * np_)), 1))
        if slices not in (1, 2, 4, 8) or d % slices or d // slices < 16:
            raise ValueError(f"pair_decode slices must be 1, 2, 4 or 8 with head_dim / slices >= 16, got {slices} "
                             f"for head_dim {d}")
        if merge and slices > 1:
            raise ValueError(f"pair_decode merge=True needs slices=1, got {slices}")
        extra["DS"] = slices
        if state_evict not in STATE_EVICTIONS:
            raise ValueError(f"pair_decode state_evict must be one of {STATE_EVICTIONS}, got {state_evict!r}")
        if state_evict:  # only then: the routed launch keeps its one compile
            extra["EVICT"] = state_evict
        if early_table and prefetch not in (2, 3):
            raise ValueError(f"pair_decode early_table=True needs prefetch 2 or 3, got {prefetch}")
        if early_table:
            extra["EARLY"] = 1
        if merge_mod._pdl(pdl):  # PDL launches only (never on the interpreter): else one compile either way
            extra["PDL"] = 1
    elif pdl or merge or l2_prefetch or ahead or slices != 1 or seq_major or state_evict or early_table:
        raise ValueError("pair_decode merge, l2_prefetch, ahead, slices, seq_major, pdl, state_evict and early_table "
                         "need layout='keys'")
    if heads_first and layout == "rows":
        raise ValueError("pair_decode heads_first=True needs layout 'keys' or 'tile'")
    if layout == "tile" and not init_fma:
        raise ValueError("pair_decode init_fma=False needs layout 'rows' or 'keys'")
    if layout == "tile" and warps != 4:  # 4 warps = one warpgroup on the rows: the sums stay in-thread
        raise ValueError(f"pair_decode layout 'tile' needs num_warps 4, got config {config}")
    if heads_first:
        extra["HEADS_FIRST"] = 1
    if layout == "tile":
        extra["OFF32"] = int(k_cache.numel() < 2 ** 31)
        extra["PAGE"] = page        # a compile-time page size: shifts instead of divisions
    merged = (torch.empty((bsz, 1, hq, d), dtype=q.dtype, device=dev),
              torch.empty((bsz, hq, 1), dtype=torch.float32, device=dev)) if merge else (out, lse)
    slots = n * bsz                                      # (chunk, sequence) pairs
    fused_args = (n, _counts(dev, bsz * hkv) if merge else pair_lens, *merged,
                  _log_constants(dev) if merge else lse) if layout == "keys" else ()
    kv = (C.aligned(k_cache), C.aligned(v_cache))
    if layout == "keys" and prefetch == 4:
        kv = _tma_tiles(k_cache, v_cache, slices)
    if bsz:
        kernel[(slots * hkv * slices,) if heads_first else (slots, hkv, slices)](
            C.aligned(q), *kv, C.aligned(page_table), C.aligned(seq_lens),
            out, lse, pair_lens, row_sums, scale_log2(softmax_scale), bsz, width, chunk_size, page, *fused_args,
            G=hq // hkv, HQ=hq, HKV=hkv, D=d, M=rows, BN=BLOCK_N, EMU=C.INTERPRET, SUMS=sums, INIT_FMA=init_fma, **extra,
            num_warps=warps, num_stages=stages, **maxnreg, **C.LAUNCH)
    res = (out, lse, pair_lens, n, row_sums) if sums else (out, lse, pair_lens, n)
    return res + merged if merge else res


def _tma_tiles(k_cache: torch.Tensor, v_cache: torch.Tensor, slices: int) -> tuple:
    """prefetch 4: host-side tensor descriptors of the caches as [rows, HKV, D], tiles of BLOCK_N
    rows of one KV head (K: all of head_dim, V: a head-dim slice), for TMA loads."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    pages, page, hkv, d = k_cache.shape
    shape, strides = [pages * page, hkv, d], [hkv * d, d, 1]
    return (TensorDescriptor(k_cache.view(shape), shape, strides, [BLOCK_N, 1, d]),
            TensorDescriptor(v_cache.view(shape), shape, strides, [BLOCK_N, 1, d // slices]))


_COUNTS: dict = {}


def _counts(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused merge, one per (sequence, KV head); every launch
    leaves them zero again. Kept per (device, stream), grown outside graph capture; inside a
    capture with none big enough, a fresh zeroed buffer is captured with the launch."""
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).stream_id)
    t = _COUNTS.get(key)
    if t is None or t.numel() < size:
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(size, dtype=torch.int32, device=device)
        t = _COUNTS[key] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return t
