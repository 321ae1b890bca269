"""Mutation audit (session 42) of the CPU reference kernels: rlk_ops/kernels/cpu/{attention, canonical,
linear, merge, norm, numerics, paged_attention_auto, paged_kv, qk_norm_rope, rope}.py.

98 hand mutants (an order of arithmetic, a dropped term or rescale, an off-by-one at a block,
page, chunk or causal edge, a mask, an accumulation dtype, -inf / NaN / empty-row handling); most were
killed by the suite before. Each test here kills mutants it let through (session 42's audit report has
the table): sincos's range reduction at the largest rope position, the float64 rope angle, rope's one
rounding (its backward's only accuracy test allows 2**-7), the norm backward's unrounded xhat, a lone
NaN merge state, the merge backward's cancellation and its float64 log, the single-pass attention's
definition (128-key blocks, numerics.exp / log, the division), dS rounded to bf16 for dQ / dK, and two
boundaries of canonical.py's plan (a 0-query diagonal piece, the strided-run cut).
Claims are bitwise (conftest.bitwise_equal, torch.equal) against the documented formula or float64
math rounded once, or accuracy against float64 math.
"""
import importlib
import math

import torch

import rlk_ops
from rlk_ops.kernels.cpu import numerics as nx
from rlk_ops.ops.rope import MAX_POSITION

from conftest import TOL, bitwise_equal, rel_err

# the package re-exports the kernel functions under the module names (rlk_ops.kernels.cpu.rope is a function)
cpu_rope = importlib.import_module("rlk_ops.kernels.cpu.rope")
cpu_canonical = importlib.import_module("rlk_ops.kernels.cpu.canonical")


# ------------------------------------------------------------------------------ numerics / rope
def test_sincos_is_accurate_up_to_the_largest_rope_position():
    """rope takes positions up to MAX_POSITION (~1.65e6 rad at inv_freq 1); sincos reduces them by pi/2
    in three parts. Kills dropping the third part (_PIO2_3): k * 2e-21 is ~2e-15 at k = 2**20, an error
    test_sincos_accuracy (angles < 40000) cannot see. Clean: within 1 ulp of 1 (2.2e-16)."""
    x = torch.cat([torch.linspace(1e5, MAX_POSITION, 20001, dtype=torch.float64).float().double(),
                   torch.arange(MAX_POSITION - 4000, MAX_POSITION + 1, dtype=torch.float64)])
    s, c = nx.sincos(x)
    assert (s - torch.sin(x)).abs().max().item() <= 2.5e-16
    assert (c - torch.cos(x)).abs().max().item() <= 2.5e-16


def test_float64_rope_is_accurate_from_the_float64_angle():
    """float64 inputs (the gradcheck path) form the angle position * inv_freq in float64 (inv_freq rounded to
    fp32 as everywhere); that rotation is accurate to float64 rounding. Kills forming the float64 angle in
    fp32 (off by ~1e-3 rad at position 3e4), which gradcheck (the same function both ways) passes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, 64, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 40000, (40,), generator=g)
    inv = cpu_rope.inv_freq(1e6, 64).double()
    ang = pos.double()[:, None] * inv
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :32], x[..., 32:]
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    assert rel_err(rlk_ops.rope(x, pos, 1e6, 64), ref) < TOL[torch.float64]
    back = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)
    assert rel_err(torch.ops.rlk.rope_bwd(x, pos, 1e6, 64), back) < TOL[torch.float64]


def test_rope_and_its_backward_round_once_from_fp32():
    """The module's formula (rope.py): x1*cos - x2*sin and x2*cos + x1*sin in fp32 from cos_sin's fp32
    tables, one rounding to the input dtype; the backward the same with sin negated. Bitwise for bf16 and
    fp16, whole and partial rotary_dim. Kills a term of the backward rounded to bf16 before the sum (the
    backward's only accuracy test allows 2**-7)."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(37, 3, 64, generator=g).to(dtype)
        pos = torch.randint(0, 30000, (37,), generator=g)
        for rd in (64, 32):
            cos, sin = cpu_rope.cos_sin(pos, 1e6, rd, torch.float32)
            cos, sin = cos[:, None, :], sin[:, None, :]
            x1, x2 = x.float()[..., :rd // 2], x.float()[..., rd // 2:rd]
            tail = x[..., rd:]
            fwd = torch.cat([(x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype), tail], -1)
            bwd = torch.cat([(x1 * cos + x2 * sin).to(dtype), (x2 * cos - x1 * sin).to(dtype), tail], -1)
            assert bitwise_equal(rlk_ops.rope(x, pos, 1e6, rd), fwd)
            assert bitwise_equal(torch.ops.rlk.rope_bwd(x, pos, 1e6, rd), bwd)


# ------------------------------------------------------------------------------------- norm
def test_qk_rmsnorm_bwd_dx_is_accurate_where_its_terms_cancel():
    """dx = rstd * (g - xhat * proj) treats the forward's final rounding as identity (norm.py): proj sums
    g * xhat with xhat unrounded. With dy along xhat the two terms cancel to ~1e-2 of their size, so dx
    is checked against float64 math to 2**-8 of itself plus 1e-5 of the terms. Kills proj built from xhat
    rounded to bf16 / fp16 (an error ~1e-4 of the terms), which fp64 gradcheck (no rounding) passes."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(9, 4, 128, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
        xd, wd = x.double(), w.double()
        rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
        xhat = xd * rstd
        dy = (xhat / wd + 0.01 * torch.randn(x.shape, generator=g, dtype=torch.float64)).to(dtype)
        gd = dy.double() * wd
        ref = rstd * (gd - xhat * (gd * xhat).sum(-1, keepdim=True) / 128)
        dx, _ = torch.ops.rlk.qk_rmsnorm_bwd(dy, x, w, 1e-6)
        scale = (rstd * gd).abs().amax(-1, keepdim=True)
        assert bool(((dx.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5 * scale).all()), dtype


# ------------------------------------------------------------------------------------ merge
def test_merge_of_a_lone_nan_state_is_nan():
    """A NaN lse is a present state (merge.py: only -inf is empty), also when it is a row's only one:
    out and lse NaN, as the single pass gives for a row whose score overflows. Kills testing
    presence with lse > -inf (False for NaN): the row came back out = 0 beside a NaN lse
    (test_merge_propagates_a_nan_or_inf_state has a finite state beside the NaN one, whose NaN max
    hides the skip)."""
    out_parts = torch.randn(2, 3, 2, 4)
    lse_parts = torch.tensor([[[math.nan, 0.3, -math.inf], [1.0, math.nan, 0.2]],
                              [[-math.inf, -math.inf, -math.inf], [-math.inf, 0.1, -math.inf]]])
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    assert bool(out[0, 0].isnan().all()) and bool(lse[0, 0].isnan())
    assert bool(out[1, 1].isnan().all()) and bool(lse[1, 1].isnan())
    assert not out[2, 0].any() and lse[0, 2] == -math.inf            # an all-empty row: 0, -inf
    assert bool(out[1, 0].isfinite().all()) and bool(out[2, 1].isfinite().all())


def test_merge_backward_lse_gradient_is_accurate_when_a_state_is_the_merge():
    """d lse_n = p_n * (rowsum(dout * (out_n - out)) + dlse): out_n - out first, then the row sum. With one
    state dominating (the other 2**-20 of its weight), out_0 - out is tiny and exact in fp32, and d lse_0
    is accurate against float64 math of the formula from the same (out, lse). Kills the row sum split as
    rowsum(dout * out_n) - rowsum(dout * out), which cancels catastrophically (fp64 gradcheck cannot tell)."""
    g = torch.Generator().manual_seed(7)
    out_parts = torch.randn(2, 6, 3, 64, generator=g)
    lse_parts = torch.stack([torch.randn(3, 6, generator=g), torch.full((3, 6), -20 * math.log(2.0))])
    lse_parts[1] += lse_parts[0]
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    dout, dlse = torch.randn(6, 3, 64, generator=g), torch.zeros(3, 6)
    _, d_lse = torch.ops.rlk.merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    p = torch.exp(lse_parts.double() - lse.double())                        # [N, H, T]
    dot = (dout.double() * (out_parts.double() - out.double())).sum(-1)     # [N, T, H]
    ref = p * dot.transpose(-1, -2)
    assert (d_lse.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_float64_merge_is_the_numerics_fold():
    """float64 states (the gradcheck path) fold in float64 with numerics.exp / numerics.log: bitwise the
    fold written out. Kills lse = m + torch.log(total): in fp32 the two logs agree on nearly every total
    (test_merge_is_the_numerics_exp_fold_on_many_rows and the Triton merge tests pass it), in float64
    numerics.log is up to ~3 ulp and differs on most rows."""
    g = torch.Generator().manual_seed(11)
    out_parts = torch.randn(3, 64, 4, 8, generator=g, dtype=torch.float64)
    lse_parts = torch.randn(3, 4, 64, generator=g, dtype=torch.float64) * 3
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    ls = lse_parts.transpose(-1, -2)
    m = ls.amax(0)
    total, acc = torch.zeros_like(m), torch.zeros(out_parts.shape[1:], dtype=torch.float64)
    for n in range(3):
        w = nx.exp(ls[n] - m)
        total, acc = total + w, acc + w[..., None] * out_parts[n]
    assert bitwise_equal(lse, (m + nx.log(total)).transpose(0, 1))
    assert bitwise_equal(out, acc / total[..., None])


# --------------------------------------------------------------------------------- attention
def _documented_forward(q, k, v, scale, causal):
    """attention.py's definition written out for one dense sequence (q [1, Sq, Hq, D], k/v [1, Sk, Hkv, D]):
    128-key blocks from key 0, scores rowsum(q * k) * scale, the fp32 online softmax with numerics.exp,
    P rounded to the 16-bit input dtype for the PV product only, out = acc / l rounded once,
    lse = m + numerics.log(l). Rows are (head, query); the order of every sum depends on its length only."""
    _, sq, hq, d = q.shape
    sk, grp = k.shape[1], hq // k.shape[2]
    n_keys = 128 * math.ceil(sk / 128)
    acc_t = nx.acc_dtype(q.dtype)                                                  # fp64 for fp64 (gradcheck)
    qf = q[0].to(acc_t).transpose(0, 1)                                              # [Hq, Sq, D]
    kf = torch.zeros(hq, n_keys, d, dtype=acc_t)
    vf = torch.zeros(hq, n_keys, d, dtype=acc_t)
    kf[:, :sk] = k[0].to(acc_t).repeat_interleave(grp, 1).transpose(0, 1)
    vf[:, :sk] = v[0].to(acc_t).repeat_interleave(grp, 1).transpose(0, 1)
    pos = torch.arange(sq) + sk - sq
    m = torch.full((hq, sq), -math.inf, dtype=acc_t)
    l = torch.zeros(hq, sq, dtype=acc_t)
    acc = torch.zeros(hq, sq, d, dtype=acc_t)
    for j0 in range(0, n_keys, 128):
        kb, vb_t = kf[:, j0:j0 + 128], vf[:, j0:j0 + 128].transpose(-1, -2)
        s = nx.rowsum(qf[:, :, None, :] * kb[:, None, :, :]) * scale                # [Hq, Sq, 128]
        key = torch.arange(j0, j0 + 128)
        valid = (key[None, :] < sk) & ((key[None, :] <= pos[:, None]) if causal else True)
        s = torch.where(valid, s, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha, p = nx.exp(m - m_safe), nx.exp(s - m_safe[..., None])
        l = l * alpha + nx.rowsum(p)
        acc = acc * alpha[..., None] + nx.rowsum(p.to(q.dtype).to(acc_t)[:, :, None, :] * vb_t[:, None, :, :])
        m = m_new
    out = torch.where(l[..., None] == 0, 0.0, acc / l[..., None]).to(q.dtype).transpose(0, 1)
    return out[None], (m + nx.log(l))[None]


def test_attention_forward_is_the_documented_online_softmax_bitwise():
    """The single pass is bitwise the module docstring's definition (written out above), bf16, fp16, fp32, fp64,
    causal and not, GQA, 300 keys (two full 128-key blocks and a partial one), a non-default scale.
    Kills (all invariance- and accuracy-neutral, so the suite let them through): 64-key blocks,
    out = acc * (1 / l), lse = m + torch.log(l) and the rescale alpha by torch.exp (no test compared
    these bits with anything but the same kernel; P fed unrounded to PV dies here too, and in
    test_attention_bf16_feeds_p_rounded_to_bf16_into_pv)."""
    g = torch.Generator().manual_seed(8)
    # float64 (the gradcheck path): numerics.log is up to ~3 ulp there, so torch.log differs on many rows
    cases = [(dtype, 40, 4, 300, 64) for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)]
    for dtype, sq, hq, sk, d in cases:
        q = torch.randn(1, sq, hq, d, generator=g).to(dtype)
        k, v = (torch.randn(1, sk, 2, d, generator=g).to(dtype) for _ in range(2))
        for causal in (True, False) if sk >= sq else (False,):
            out, lse = rlk_ops.attention(q, k, v, causal=causal, softmax_scale=0.11)
            ref_out, ref_lse = _documented_forward(q, k, v, 0.11, causal)
            assert bitwise_equal(out, ref_out), (dtype, sq, causal)
            assert bitwise_equal(lse, ref_lse), (dtype, sq, causal)


def test_attention_bwd_bf16_dq_dk_use_ds_rounded_to_bf16():
    """dQ = scale * dS K and dK = scale * dS^T Q with dS = P * (dP - delta) rounded to bf16 for those products,
    as P is for dV (test_attention_bwd_bf16_dv_uses_p_rounded_to_bf16): against float64 math of that formula.
    Kills dS fed to the products unrounded (gradcheck runs in fp64, where the rounding is the identity)."""
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 16, 1, 8, generator=g).to(bf) for _ in range(4))
    q.requires_grad_()
    k.requires_grad_()
    out, lse = rlk_ops.attention(q, k, v, causal=False)
    dq, dk = torch.autograd.grad(out, (q, k), dout)
    scale = 8 ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    p = torch.exp(s - lse.double()[..., None])
    dp = torch.einsum("bqhd,bkhd->bhqk", dout.double(), v.double())
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)          # [b, h, q]
    ds = (p * (dp - delta[..., None])).to(bf).double()
    assert torch.equal(dq, (torch.einsum("bhqk,bkhd->bqhd", ds, k.double()) * scale).to(bf))
    assert torch.equal(dk, (torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale).to(bf))


# --------------------------------------------------------------------------------- canonical
def test_plan_has_no_diagonal_piece_without_queries_when_the_first_query_starts_a_chunk():
    """A causal sequence whose first query sits exactly at a chunk boundary (here 256 keys, 128 queries,
    C = 128: the first query is key 128) has no diagonal piece for the chunk before it: the pieces are
    chunk 0's full piece and chunk 1's diagonal one, none of 0 queries. Kills the diagonal test lo < ce
    written lo <= ce (a 0-query piece: no bit changes on the CPU, but a call FA4 is handed with an empty
    piece, and a diagonal call that is no longer one strided batch); the documented-pieces test has no
    sequence on that boundary."""
    p = cpu_canonical.plan([(0, 128, 0, 256), (128, 128, 256, 256)], 128, causal=True)
    pieces = [(c.causal, c.slot, *zip(c.seq, c.chunk, c.q_start, c.q_len, c.k_start, c.k_len)) for c in p.calls]
    assert pieces == [(True, 1, (0, 1, 0, 128, 128, 128), (1, 1, 128, 128, 384, 128)),
                      (False, 0, (0, 0, 0, 128, 0, 128), (1, 0, 128, 128, 256, 128))]
    assert p.calls[0].strided_batch == (128, 256)


def test_strided_runs_cut_where_the_third_piece_changes_the_spacing():
    """Call.strided_runs (the fa4 glue's dense fast path) cuts a call into runs that are each one strided
    batch. Pieces of one shape at rows 0, 10, 30: the spacing changes at the third piece, so the runs are
    (0, 10) and (30,), each strided. Kills the cut tested only once a run holds 3 pieces (len(run) > 2):
    the three pieces came back as one 'run' that is no strided batch, and the glue tests' calls (at most
    two spacings, or runs already long) never showed it."""
    c = cpu_canonical._Call(False, 0)
    for seq, start in enumerate((0, 10, 30)):
        c.add(seq, 0, start, 5, start, 5)
    runs = c.build(None).strided_runs
    assert [r.q_start for r in runs] == [(0, 10), (30,)]
    assert all(r.strided_batch is not None for r in runs)
