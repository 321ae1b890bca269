"""The Triton kernels CI otherwise checks only on CUDA, run on CPU tensors in the Triton interpreter.

norm_rope.py (qk_rmsnorm, qk_rmsnorm_bwd, rope, rope_bwd, qk_norm_rope), paged_kv.py (append,
gather), gemm.py (linear, linear_bwd, linear_bias_bwd, matmul), reduce.py (sum_partials, colsum)
and merge.py (merge_attn_states on both kernels and every walk, merge_attn_states_bwd) are called
directly (not through torch.ops: the dispatch refuses the interpreter on purpose) under
TRITON_INTERPRET=1, where they run with numpy. So a wrong index, mask, stride, order of a merge
step or formula in them fails on a CPU-only machine.

What is claimed exactly (torch.equal, through conftest.bitwise_equal) is only what the interpreter
decides exactly:

* data movement (paged KV) against the CPU reference;
* invariances (a row alone == in a batch, the fused norm+rope == norm then rope, the rope table ==
  in-kernel cos/sin, int64 offsets == int32, one merge blocking == another);
* results on inputs built so that every product and sum is exact (small integers; rows of +-2^k
  for the norm with eps = 2**-126), which any summation order must give bit for bit;
* the merge forward against the CPU merge on random inputs: both evaluate the same IEEE steps in
  the same order (the kernel's exp/log are numerics.exp/log transcribed; the interpreter has no
  approximate division or FMA), so they agree bitwise;
* the merge backward on small-integer outs (its rowsum is exact, so its order does not matter).

The merge is compared on float32 and float16 states, not bfloat16: the Triton 3.9 interpreter
rounds float32 -> bfloat16 toward zero (``interpreter.cast_impl`` passes no rounding mode to
``_convert_float``), where the GPU and torch round to nearest even, so a bf16 result that needs
rounding differs from the CPU's by an ulp there. (bf16 comparisons elsewhere are between two
kernels that both truncate, or on exact values that need no rounding.)

Accuracy against the CPU reference (random inputs, where the row sums of the norm run in another
order and the interpreter's cos/sin are numpy's rather than numerics.sincos) uses a tolerance;
those tests say so.

Skips unless TRITON_INTERPRET=1 and triton is importable.
"""
import math
import os

import pytest
import torch

from conftest import bitwise_equal
from rlk_ops.kernels import cpu

triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernels on CPU tensors)")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


def _ints(*shape, lo=-4, hi=5, dtype=torch.bfloat16, seed=0):
    return torch.randint(lo, hi, shape, generator=_g(seed)).to(dtype)


# The smallest normal fp32: the ops reject eps = 0 (and any eps below this, _validate.rms_eps). Added
# to a mean(x^2) of 4^k (k >= -2) it rounds away, so the exact-input norm tests stay exact.
TINY = 2.0 ** -126


@pytest.fixture
def bool_masks(monkeypatch):
    """Works around a Triton 3.9 interpreter bug: ``block_mask & scalar_mask`` (paged_kv's
    ``(offs < HD) & (slot >= 0)``) comes out as an integer array, which the interpreter's
    load/store then refuse ("mask has unsupported dtype"); on the GPU the mask is int1. The shim
    casts the mask to bool before the interpreter's load and store; nothing else changes."""
    from triton.runtime import interpreter as ti

    real = ti._interpreter

    class Shim:
        def __getattr__(self, name):
            return getattr(real, name)

        def load(self, ptrs, mask, other, dtype):
            return real.load(ptrs, mask.astype(bool), other, dtype)

        def store(self, ptrs, value, mask):
            return real.store(ptrs, value, mask.astype(bool))

    monkeypatch.setattr(ti, "_interpreter", Shim())


def _close(a, b, rtol, atol):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- paged KV
@pytest.mark.parametrize("ps,h,d,block", [(1, 2, 8, None), (16, 3, 700, None), (5, 3, 8, 16), (5, 2, 16, 16)])
def test_paged_kv_append_moves_exactly_the_kept_rows(ps, h, d, block, monkeypatch, bool_masks):
    """append == the CPU reference bit for bit: every kept token's k and v rows land in their
    slot, slot -1 skips, every other slot keeps its bits. H*D = 2100 spans two programs of the
    default BLOCK (2048); BLOCK 16 with H*D 24 a partial last chunk, with H*D 32 two full chunks
    (chunks that overlapped by one element would leave the last one unwritten)."""
    from rlk_ops.kernels.triton import paged_kv as tp

    if block:
        monkeypatch.setattr(tp, "BLOCK", block)
    pages, t = 20, 9 if d > 100 else 13
    kc, vc = _randn(pages, ps, h, d, seed=1), _randn(pages, ps, h, d, seed=2)
    k, v = _randn(t, h, d, seed=3), _randn(t, h, d, seed=4)
    slots = torch.randperm(pages * ps, generator=_g(5))[:t].to(torch.int64)
    slots[[1, t - 1]] = -1                       # skipped rows, the last one among them
    slots[0] = pages * ps - 1                    # the very last slot
    slots[2] = 0                                 # and slot 0
    kr, vr = kc.clone(), vc.clone()
    cpu.paged_kv_append(kr, vr, k, v, slots)
    k0, v0 = kc.clone(), vc.clone()
    tp.paged_kv_append(kc, vc, k, v, slots)
    assert bitwise_equal(kc, kr) and bitwise_equal(vc, vr)
    written = torch.zeros(pages * ps, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = lambda c: c.view(pages * ps, h, d)    # noqa: E731
    assert bitwise_equal(flat(kc)[~written], flat(k0)[~written])    # untouched slots unchanged
    assert bitwise_equal(flat(vc)[~written], flat(v0)[~written])
    assert not torch.equal(flat(kc)[written], flat(k0)[written])     # (something was written)


@pytest.mark.parametrize("ps,block", [(1, None), (4, None), (16, None), (4, 8)])
def test_paged_kv_gather_equals_the_reference_and_is_batch_invariant(ps, block, monkeypatch):
    """gather == the CPU reference bit for bit (ragged lengths: 0, 1, a page multiple, one past
    it, the full table; padding page ids out of range), zeros past seq_len, and a sequence
    gathered alone equals its row in the batch. BLOCK 8 splits a page into chunks."""
    from rlk_ops.kernels.triton import paged_kv as tp

    if block:
        monkeypatch.setattr(tp, "BLOCK", block)
    h, d, width = 2, 6, 5
    lens_l = [0, 1, 2 * ps, 2 * ps + 1, width * ps]
    bsz = len(lens_l)
    pages = bsz * width + 2
    kc, vc = _randn(pages, ps, h, d, seed=6), _randn(pages, ps, h, d, seed=7)
    table = torch.randperm(pages, generator=_g(8))[:bsz * width].view(bsz, width).to(torch.int32)
    lens = torch.tensor(lens_l, dtype=torch.int32)
    for b, n in enumerate(lens_l):
        table[b, -(-n // ps):] = -1000 - b       # padding: never read (out of range if it were)
    k, v = tp.paged_kv_gather(kc, vc, table, lens)
    rk, rv = cpu.paged_kv_gather(kc, vc, table, lens)
    assert bitwise_equal(k, rk) and bitwise_equal(v, rv)
    for b in range(bsz):
        k1, v1 = tp.paged_kv_gather(kc, vc, table[b:b + 1], lens[b:b + 1])
        assert bitwise_equal(k1[0], k[b]) and bitwise_equal(v1[0], v[b])
        assert not k[b, lens_l[b]:].any() and not v[b, lens_l[b]:].any()


# ------------------------------------------------------------------------------- norm, rope
@pytest.fixture
def small_table(monkeypatch):
    """TABLE_LEN 1024 (a fresh table cache): the interpreter would otherwise build cos/sin for
    65536 positions (4096 programs, ~9 s) per (theta, rotary_dim). Positions past it take the
    in-kernel path, which test_rope_table_equals_in_kernel_cos_sin ties to the table's bits."""
    from rlk_ops.kernels.triton import norm_rope as nr

    monkeypatch.setattr(nr, "TABLE_LEN", 1024)
    monkeypatch.setattr(nr, "_TABLES", {})


T_N, H_N, D_N = 37, 2, 24      # 37 tokens: 3 programs of TOK = 16 (and 2 of TOK_BWD = 32); D not a power of 2


def _exact_norm_input(t, h, d, dtype, seed):
    """Rows of +-2^k (k per row in -2..2): mean(x^2) = 4^k, rstd = 2^-k exactly, xhat = +-1. With
    eps = TINY every step of the norm and its backward is exact (D a power of two for proj)."""
    sign = torch.where(torch.rand(t, h, d, generator=_g(seed)) < 0.5, -1.0, 1.0)
    scale = 2.0 ** torch.randint(-2, 3, (t, h, 1), generator=_g(seed + 1))
    return (sign * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_qk_rmsnorm_accuracy_and_batch_invariance(dtype):
    """Accuracy against the CPU reference (tolerance: the kernel's row sum runs in another order,
    and 1/sqrt instead of rsqrt), with eps = 0.1 so that eps counts (and, not a binary fraction,
    that the fp64 path adds it in fp64); bitwise: each token alone ==
    its row in the 37-token batch, the 2-D [rows, D] view == the 3-D one; exact inputs (eps TINY) ==
    the reference bit for bit."""
    from rlk_ops.kernels.triton import norm_rope as nr

    x, w = _randn(T_N, H_N, D_N, dtype=dtype, seed=10), _randn(D_N, dtype=dtype, seed=11)
    y = nr.qk_rmsnorm(x, w, 0.1)
    tol = {torch.bfloat16: (1.6e-2, 1e-2), torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}[dtype]
    _close(y, cpu.qk_rmsnorm(x, w, 0.1), *tol)
    for t in (0, 15, 16, 17, 31, 32, 36):
        assert bitwise_equal(nr.qk_rmsnorm(x[t:t + 1], w, 0.1)[0], y[t])
    assert bitwise_equal(nr.qk_rmsnorm(x.reshape(-1, D_N), w, 0.1), y.reshape(-1, D_N))
    xe = _exact_norm_input(T_N, H_N, 16, dtype, seed=12)
    we = _ints(16, dtype=dtype, seed=13)
    assert bitwise_equal(nr.qk_rmsnorm(xe, we, TINY), cpu.qk_rmsnorm(xe, we, TINY))


def test_qk_rmsnorm_fp16_integer_rows_equal_the_reference():
    """fp16 rows of small integers: the sum of squares is exact in any order and var = ssq / D is
    one correctly rounded division on both sides; on the rows where torch.rsqrt(var + eps) equals
    1 / sqrt(var + eps) (the kernel's two IEEE steps; rows where they differ are left out), every
    later step is one IEEE operation in the same order and numpy rounds fp32 -> fp16 to nearest even
    as torch does. So the kernel == the CPU reference bit for bit, the rounding of xhat to fp16
    before the weight included; and the backward's dweight of one token (each element one product
    dy * fp16(xhat)) too."""
    from rlk_ops.kernels.triton import norm_rope as nr

    eps = 0.25
    x = _ints(200, 1, D_N, lo=-9, hi=10, dtype=torch.float16, seed=14)
    v = (x.float() ** 2).sum(-1) / D_N + eps
    x = x[(torch.rsqrt(v) == 1 / torch.sqrt(v)).flatten()][:40]
    assert x.shape[0] == 40
    w = _randn(D_N, dtype=torch.float16, seed=15)
    assert bitwise_equal(nr.qk_rmsnorm(x, w, eps), cpu.qk_rmsnorm(x, w, eps))
    dy = _randn(1, 1, D_N, dtype=torch.float16, seed=16)
    assert bitwise_equal(nr.qk_rmsnorm_bwd(dy, x[:1], w, eps)[1], cpu.qk_rmsnorm_bwd(dy, x[:1], w, eps)[1])


@pytest.mark.parametrize("rd", [D_N, 16])
def test_rope_accuracy_partial_rotary_and_batch_invariance(rd, small_table):
    """rope and rope_bwd against the CPU reference (tolerance: cos/sin are numpy's here, the
    reference's its own polynomial), dims past rotary_dim passed through bit for bit, a token
    alone == its row in the batch, the dense [B, S, H, D] layout == packed, and rope_bwd inverts
    rope (to rounding)."""
    from rlk_ops.kernels.triton import norm_rope as nr

    x = _randn(T_N, 3, D_N, dtype=torch.float32, seed=20)
    pos = torch.randint(0, 5000, (T_N,), generator=_g(21))
    y = nr.rope(x, pos, 1e4, rd)
    _close(y, cpu.rope(x, pos, 1e4, rd), 2e-6, 2e-6)
    assert bitwise_equal(y[..., rd:], x[..., rd:])
    dy = nr.rope_bwd(x, pos, 1e4, rd)
    _close(dy, cpu.rope_bwd(x, pos, 1e4, rd), 2e-6, 2e-6)
    _close(nr.rope_bwd(y, pos, 1e4, rd), x, 1e-5, 1e-5)
    for t in (0, 15, 16, 36):
        assert bitwise_equal(nr.rope(x[t:t + 1], pos[t:t + 1], 1e4, rd)[0], y[t])
        assert bitwise_equal(nr.rope_bwd(x[t:t + 1], pos[t:t + 1], 1e4, rd)[0], dy[t])
    assert bitwise_equal(nr.rope(x[:36].reshape(2, 18, 3, D_N), pos[:36].reshape(2, 18), 1e4, rd).reshape(36, 3, D_N),
                         y[:36])
    xb = x.to(torch.bfloat16)
    _close(nr.rope(xb, pos, 1e4, rd), cpu.rope(xb, pos, 1e4, rd), 1.6e-2, 1e-2)


def test_rope_table_equals_in_kernel_cos_sin(monkeypatch):
    """A program whose positions are all below TABLE_LEN reads cos/sin from the table, others
    compute them: both give the same bits (TABLE_LEN shrunk to 64 so the interpreter builds a
    small table; positions 0..95 with a 40-position program straddling it)."""
    from rlk_ops.kernels.triton import norm_rope as nr

    x = _randn(48, 2, D_N, dtype=torch.float32, seed=22)
    pos = torch.cat([torch.arange(40, 64), torch.arange(0, 8), torch.arange(60, 76)])
    monkeypatch.setattr(nr, "_TABLES", {})
    monkeypatch.setattr(nr, "TABLE_LEN", 0)        # everything computed in the kernel
    ref = nr.rope(x, pos, 1e4, 16)
    monkeypatch.setattr(nr, "TABLE_LEN", 64)       # programs 0 and 1 from the table, program 2 computed
    monkeypatch.setattr(nr, "_TABLES", {})
    got = nr.rope(x, pos, 1e4, 16)
    assert bitwise_equal(got, ref)
    monkeypatch.setattr(nr, "TABLE_LEN", 0)
    monkeypatch.setattr(nr, "_TABLES", {})
    bwd_ref = nr.rope_bwd(x, pos, 1e4, 16)
    monkeypatch.setattr(nr, "TABLE_LEN", 64)
    monkeypatch.setattr(nr, "_TABLES", {})
    assert bitwise_equal(nr.rope_bwd(x, pos, 1e4, 16), bwd_ref)


@pytest.mark.parametrize("rd,dtype", [(D_N, torch.bfloat16), (16, torch.float32)])
def test_qk_norm_rope_equals_norm_then_rope(rd, dtype, small_table):
    """The fused kernel's claim: qk_norm_rope(q, k) == rope(qk_rmsnorm(.)) bit for bit, for q and k
    (different head counts and weights), whole and partial rotary_dim; and == the CPU reference
    to a tolerance."""
    from rlk_ops.kernels.triton import norm_rope as nr

    q, k = _randn(T_N, 3, D_N, dtype=dtype, seed=30), _randn(T_N, 2, D_N, dtype=dtype, seed=31)
    qw, kw = _randn(D_N, dtype=dtype, seed=32), _randn(D_N, dtype=dtype, seed=33)
    pos = torch.randint(0, 3000, (T_N,), generator=_g(34))
    qo, ko = nr.qk_norm_rope(q, k, qw, kw, pos, 0.25, 1e4, rd)
    assert bitwise_equal(qo, nr.rope(nr.qk_rmsnorm(q, qw, 0.25), pos, 1e4, rd))
    assert bitwise_equal(ko, nr.rope(nr.qk_rmsnorm(k, kw, 0.25), pos, 1e4, rd))
    rq, rk = cpu.qk_norm_rope(q, k, qw, kw, pos, 0.25, 1e4, rd)
    tol = (3.2e-2, 2e-2) if dtype == torch.bfloat16 else (2e-5, 2e-5)   # bf16: the interpreter truncates twice
    _close(qo, rq, *tol)
    _close(ko, rk, *tol)


@pytest.mark.parametrize("t", [T_N, 70])
def test_qk_rmsnorm_bwd(t):
    """Exact inputs (rows of +-2^k, eps TINY, D 16, small-integer dy and weight): dx and dweight ==
    the CPU reference bit for bit (dweight sums over 70 tokens x heads: 3 partials of TOK_BWD
    tokens, then sum_partials). Random inputs: to a tolerance (sums in another order), and dx of
    a token alone == its row in the batch."""
    from rlk_ops.kernels.triton import norm_rope as nr

    x = _exact_norm_input(t, H_N, 16, torch.float32, seed=40)
    w, dy = _ints(16, dtype=torch.float32, seed=41), _ints(t, H_N, 16, dtype=torch.float32, seed=42)
    for eps in (TINY, 0.0):   # 0.0 (refused by the ops, not by the kernel): the rows past the last
        dx, dw = nr.qk_rmsnorm_bwd(dy, x, w, eps)         # token must add nothing to dweight (not 0 * inf)
        rdx, rdw = cpu.qk_rmsnorm_bwd(dy, x, w, eps)
        assert bitwise_equal(dx, rdx) and bitwise_equal(dw, rdw)
    x, w, dy = (_randn(t, H_N, D_N, seed=43), _randn(D_N, seed=44), _randn(t, H_N, D_N, seed=45))
    dx, dw = nr.qk_rmsnorm_bwd(dy, x, w, 0.25)
    rdx, rdw = cpu.qk_rmsnorm_bwd(dy, x, w, 0.25)
    _close(dx, rdx, 1.6e-2, 2e-2)
    _close(dw, rdw, 1.6e-2, 5e-2)
    for r in (0, 31, 32, t - 1):
        assert bitwise_equal(nr.qk_rmsnorm_bwd(dy[r:r + 1], x[r:r + 1], w, 0.25)[0][0], dx[r])


# ------------------------------------------------------------------------------- gemm
def _small_config():
    from rlk_ops.kernels.triton import gemm
    return gemm.GemmConfig(16, 32, 16, 1, 1, group_m=2)   # BLOCK_M != BLOCK_N: a swapped use shows


def _exact_linear(m, n, k, dtype, bias, seed):
    """Small integers: |products| <= 16, |sums| <= 16 K + 4 < 2048, exact in fp32 and in fp16. (Not
    bf16: the Triton 3.9 interpreter's tl.dot multiplies bf16 operands as their raw uint16 bits,
    ``interpreter.create_dot``; on the GPU bf16 is the main dtype.)"""
    x, w = _ints(m, k, dtype=dtype, seed=seed), _ints(n, k, dtype=dtype, seed=seed + 1)
    b = _ints(n, dtype=dtype, seed=seed + 2) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype,bias,small", [(torch.float16, True, False), (torch.float32, False, False),
                                              (torch.float16, True, True)])
def test_linear_exact_and_row_invariant(dtype, bias, small):
    """Exact inputs: linear == the exact product (the CPU reference, exact too) bit for bit, with
    and without bias, M, N, K not multiples of the tiles (default tile 64x128x64: 2x2 tiles, K in
    2 steps; a 16x32x16 config with GROUP_M 2: 5x2 tiles over 4 persistent programs, in groups).
    Each row alone (and the first 16) == its row in the batch."""
    from rlk_ops.kernels.triton import gemm

    cfg = _small_config() if small else None
    m, n, k = (70, 57, 40) if small else (70, 130, 72)
    x, w, b = _exact_linear(m, n, k, dtype, bias, seed=50)
    y = gemm.linear(x, w, b, cfg)
    assert bitwise_equal(y, cpu.linear(x, w, b))
    for r in (0, 17, 63, 64, m - 1):
        assert bitwise_equal(gemm.linear(x[r:r + 1], w, b, cfg)[0], y[r])
    assert bitwise_equal(gemm.linear(x[:16], w, b, cfg), y[:16])
    assert bitwise_equal(gemm.linear(x.view(2, m // 2, k), w, b, cfg).view(m, n), y)


def test_linear_row_invariance_random_inputs_past_one_wave():
    """Random fp32 inputs (sums not exact, so the K order shows): 10 tiles of 16x32 on 4
    persistent programs; a row alone (one tile, program 0) == its row in the batch, where a later
    tile of another program computed it. Also == the CPU reference to a tolerance (fp32
    accumulation)."""
    from rlk_ops.kernels.triton import gemm

    cfg = _small_config()
    x, w = _randn(70, 40, dtype=torch.float32, seed=55), _randn(57, 40, dtype=torch.float32, seed=56)
    y = gemm.linear(x, w, None, cfg)
    _close(y, cpu.linear(x, w, None), 1e-5, 1e-5)     # accuracy (tolerance: another summation order)
    for r in (5, 33, 50, 69):
        assert bitwise_equal(gemm.linear(x[r:r + 1], w, None, cfg)[0], y[r])


def test_matmul_int64_offsets_and_strides():
    """matmul with int64 K offsets == int32 offsets (same bits), on transposed (strided) operands,
    and == the exact product of small integers."""
    from rlk_ops.kernels.triton import gemm

    a = _ints(40, 33, dtype=torch.float32, seed=57).t()        # [33, 40], strides (1, 33)
    b = _ints(29, 40, dtype=torch.float32, seed=58).t()        # [40, 29], strides (1, 40)
    cfg = _small_config()
    o32 = gemm.matmul(a, b, torch.empty(33, 29), config=cfg, offs64=False)
    o64 = gemm.matmul(a, b, torch.empty(33, 29), config=cfg, offs64=True)
    assert bitwise_equal(o32, (a.double() @ b.double()).float()) and bitwise_equal(o64, o32)


@pytest.mark.parametrize("m", [70, 300])
def test_linear_backward_exact(m):
    """Exact inputs: linear_bwd's dx = dy @ w and dw = dy^T @ x, and linear_bias_bwd (colsum over
    M = 300 rows: 2 first-stage chunks of RPP 256; N = 130 past BLOCK_N 128) == the CPU reference
    bit for bit; dx of a row alone == its row."""
    from rlk_ops.kernels.triton import gemm

    n, k = 130, 40
    dtype = torch.float16 if m == 70 else torch.float32   # (fp16: sums of up to 70 * 4 are exact)
    x, w = _ints(m, k, lo=-2, hi=3, dtype=dtype, seed=60), _ints(n, k, lo=-2, hi=3, dtype=dtype, seed=61)
    dy = _ints(m, n, lo=-2, hi=3, dtype=dtype, seed=62)
    dx, dw = gemm.linear_bwd(dy, x, w)
    rdx, rdw = cpu.linear_bwd(dy, x, w)
    assert bitwise_equal(dx, rdx) and bitwise_equal(dw, rdw)
    assert bitwise_equal(gemm.linear_bias_bwd(dy), cpu.linear_bias_bwd(dy))
    assert bitwise_equal(gemm.linear_bwd(dy[3:4], x[3:4], w)[0][0], dx[3])


# ------------------------------------------------------------------------------- reduce
@pytest.mark.parametrize("rows", [1, 31, 32, 70])
def test_sum_partials_exact(rows):
    """sum_partials over 1, 31, 32, 70 rows (ROWS 32 a tile) and 130 or 256 columns (BLOCK_N
    128: a partial and a full second program): integer partials whose sums pass 256 (an
    accumulator narrower than fp32 would round) == the exact column sums; fp32 and fp64 partials."""
    from rlk_ops.kernels.triton import reduce as tr

    for dtype, width in ((torch.float32, 130), (torch.float64, 256)):
        p = _ints(rows, width, lo=-3, hi=40, dtype=dtype, seed=70 + rows)
        p[:, 0] = 257.0       # the first column sums to 257 * rows: odd, > 256
        assert bitwise_equal(tr.sum_partials(p, dtype), p.sum(0))
        assert bitwise_equal(tr.sum_partials(p, torch.float32), p.sum(0).float())


@pytest.mark.parametrize("m", [1, 255, 257, 600])
def test_colsum_exact(m):
    """colsum over rows crossing RPP (256) and ROWS (32), 130 columns: == the exact sums (fp32
    input of integers, bf16 input with an fp32 result)."""
    from rlk_ops.kernels.triton import reduce as tr

    x = _ints(m, 130, lo=-3, hi=5, dtype=torch.float32, seed=80 + m)
    x[:, 1] = 3.0
    assert bitwise_equal(tr.colsum(x, torch.float32), x.sum(0))
    xb = x.to(torch.bfloat16)
    assert bitwise_equal(tr.colsum(xb, torch.float32), x.sum(0))


# ------------------------------------------------------------------------------- merge
def _states(n, lead, s, h, d, seed, empty=0.25, dtype=torch.float32):
    """out_parts [N, *lead, S, H, D] and lse_parts [N, *lead, H, S], random, about ``empty`` of
    the states -inf, plus one row with every state -inf."""
    gen = _g(seed)
    out = torch.randn(n, *lead, s, h, d, generator=gen).to(dtype)
    lse = torch.randn(n, *lead, h, s, generator=gen) * 3.0
    lse = torch.where(torch.rand(lse.shape, generator=gen) < empty, -math.inf, lse)
    lse[(slice(None),) + (0,) * len(lead) + (0, s - 1)] = -math.inf        # an empty row
    skipped = (lse == -math.inf).transpose(-1, -2)[..., None]
    return out.masked_fill(skipped, math.nan), lse                        # a skipped state's out is never used


def _ref_merge(out, lse, state_lens=None):
    if state_lens is not None:    # a state of length 0 is skipped as if its lse were -inf
        n = lse.shape[0]
        keep = (state_lens.reshape(n, *lse.shape[1:-2], 1, 1) > 0)
        lse = torch.where(keep, lse, -math.inf)
    return cpu.merge_attn_states(out, lse)


# (config, vec): the vec kernel with 1 and several groups, eager or not, head_dim sliced or not;
# the walk looped, unrolled (groups past N), with the 2D max, skipping absent states, eager loads
MERGE_ROUTES = {
    "vec32": ((1, 2, 0, 16), 32),
    "vec4_eager": ((1, 2, 0, 0, True), 4),
    "vec4_plain": ((2, 1, 0, 16, False), 4),
    "walk_loop": ((16, 1, 0), 0),
    "walk_unroll3": ((4, 2, 3), 0),
    "walk_2dmax": ((4, 1, 4, 16, True), 0),
    "walk_skip": ((8, 1, 1, 16, False, 1), 0),
    "walk_skip_unroll2": ((4, 4, 2, 16, True, 1, 2), 0),
}


@pytest.mark.parametrize("route", list(MERGE_ROUTES))
def test_merge_equals_the_cpu_merge(route):
    """Every kernel and walk of merge_attn_states == the CPU merge bit for bit (out and lse): 10
    states, dense [N, B, S, H, D] states (S > 1, so the lse's [H, S] layout is exercised), a row
    with every state -inf (out 0, lse -inf), state_lens with zeros (skipped like -inf). The out
    rows of skipped states hold NaN / inf (eager loads read them; they must never be used)."""
    from rlk_ops.kernels.triton import merge as tm

    config, vec = MERGE_ROUTES[route]
    n, b, s, h, d = 10, 2, 3, 3, 16
    out, lse = _states(n, (b,), s, h, d, seed=90)
    got = tm.merge_attn_states(out, lse, config=config, vec=vec)
    ref = _ref_merge(out, lse)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    lens = torch.randint(0, 3, (n, b), generator=_g(91)).to(torch.int32)
    out = out.clone()
    out[lens == 0] = math.inf                                              # states of length 0: never used
    got = tm.merge_attn_states(out, lse, state_lens=lens, config=config, vec=vec)
    ref = _ref_merge(out, lse, lens)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@pytest.mark.parametrize("route", ["walk_skip", "walk_2dmax", "vec4_eager"])
def test_merge_training_plan_states(route):
    """Varlen states [N, T, H, D] / [N, H, T] laid out as training's plan gives them (a row of
    chunk i holds states 0..i-1 and N - 1; the others -inf), where the skipping walk leaves out
    the states no row of its program holds: == the CPU merge bit for bit, non-power-of-2 D."""
    from rlk_ops.kernels.triton import merge as tm

    config, vec = MERGE_ROUTES[route]
    n, t, h, d = 5, 32, 2, 12
    gen = _g(92)
    out = torch.randn(n, t, h, d, generator=gen)
    lse = torch.randn(n, h, t, generator=gen) * 2.0
    chunk = torch.arange(t) // 8                              # token i in chunk i // 8 (4 chunks)
    states = torch.arange(n)[:, None]
    held = (states < chunk[None, :]) | (states == n - 1)
    lse = torch.where(held[:, None, :], lse, -math.inf)
    out = out.masked_fill((~held)[:, :, None, None], math.nan)           # never used
    got = tm.merge_attn_states(out, lse, config=config, vec=vec)
    ref = _ref_merge(out, lse)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_merge_routed_and_large_lse_offsets():
    """merge_route's own choice (no config) == the CPU merge, for a decode-like merge (vec) and a
    many-row one, states with lse far apart (weights underflowing to 0 and beside ones of 1) and
    fp16 states."""
    from rlk_ops.kernels.triton import merge as tm

    for shape, dtype in (((1,), torch.float32), ((3,), torch.float16)):
        out, lse = _states(5, shape, 2, 2, 32, seed=93, dtype=dtype)
        lse[1] += 120.0
        got = tm.merge_attn_states(out, lse)
        ref = _ref_merge(out, lse)
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@pytest.mark.parametrize("with_dlse", [False, True])
def test_merge_bwd_exact(with_dlse):
    """merge_attn_states_bwd == the CPU backward bit for bit, on small-integer outs and douts (the
    rowsum over head_dim is then exact in any order) and random lse with -inf states and an
    all--inf row; 20 rows (two programs of BLOCK_R 16), D 12 (masked columns)."""
    from rlk_ops.kernels.triton import merge as tm

    n, b, s, h, d = 4, 2, 2, 5, 12
    out_parts, lse_parts = _states(n, (b,), s, h, d, seed=94)
    out_parts = _ints(n, b, s, h, d, dtype=torch.float32, seed=95)
    _, lse = cpu.merge_attn_states(out_parts, lse_parts)
    out = _ints(b, s, h, d, dtype=torch.float32, seed=96)
    dout = _ints(b, s, h, d, dtype=torch.float32, seed=97)
    dlse = _ints(b, h, s, dtype=torch.float32, seed=98) if with_dlse else None
    got = tm.merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    ref = cpu.merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    assert got[1].ne(0).any() and got[0].ne(0).any()
