"""Accuracy against float64 math, and gradcheck in float64 for every differentiable op."""
import math

import pytest
import torch

import rlk_ops
from rlk_ops.kernels.cpu import numerics as nx

from conftest import TOL, ref_attention, rel_err


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_log_accuracy(dtype):
    eps = torch.finfo(dtype).eps
    x = torch.cat([torch.linspace(-87.0, 0.0, 20001, dtype=dtype), torch.randn(5000, dtype=dtype) * 4])
    ref = torch.exp(x.double())
    err = ((nx.exp(x).double() - ref).abs() / (ref * eps)).max().item()
    assert err < 2.0, err
    specials = nx.exp(torch.tensor([0.0, -math.inf, math.inf, -1e4, math.nan], dtype=dtype))
    assert specials[0] == 1.0 and specials[1] == 0.0 and specials[2] == math.inf and specials[3] == 0.0
    assert torch.isnan(specials[4])
    y = torch.rand(5000, dtype=dtype) * 1e5 + 1e-3
    ref = torch.log(y.double())
    assert ((nx.log(y).double() - ref).abs() / (ref.abs().clamp_min(1e-300) * eps)).max().item() < 2.0
    assert nx.log(torch.tensor([1.0, 0.0], dtype=dtype)).tolist() == [0.0, -math.inf]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_is_finite_up_to_the_largest_float(dtype):
    """The overflow cut was emax * log(2) (88.03 in fp32), under log(max) (88.72): exp gave inf
    there, and the tiny model's silu -0.0 for x in [-88.72, -88.03) (review)."""
    eps = torch.finfo(dtype).eps
    top = math.log(torch.finfo(dtype).max)
    x = torch.linspace(top - 1.5, top, 5001, dtype=dtype)[:-1]
    y = nx.exp(x)
    assert bool(torch.isfinite(y).all())
    ref = torch.exp(x.double()) if dtype == torch.float32 else torch.exp(x.to(torch.float64))
    assert ((y.double() - ref).abs() / (ref * eps)).max().item() < 2.0
    assert nx.exp(torch.tensor([top * 1.0001], dtype=dtype)).item() == math.inf


def _exp_allocating(x):
    """numerics.exp as written before session 46, every step a new tensor (the in-place version must give
    these bits: the same IEEE operations in the same order)."""
    dt = x.dtype
    _, _, emin, _, _ = nx._FLOAT_LAYOUT[dt]
    lo, hi = emin * math.log(2.0), math.log(torch.finfo(dt).max)
    xc = x.clamp(lo, hi)
    n = torch.round(xc * nx._LOG2E)
    r = (xc - n * nx._LN2_HI[dt]) - n * nx._LN2_LO[dt]
    p = torch.full_like(r, nx._EXP_COEFFS[dt][0])
    for c in nx._EXP_COEFFS[dt][1:]:
        p = p * r + c
    half = torch.floor(n * 0.5)
    y = (p * nx._pow2(half, dt)) * nx._pow2(n - half, dt)
    y = torch.where(x < lo, torch.zeros_like(y), y)
    y = torch.where(x > hi, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.float64, torch.int64)])
def test_exp_in_place_is_the_allocating_transcription_bitwise(dtype, bits):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(1 << 16, generator=g, dtype=dtype) * s for s in (0.01, 1, 10, 100)] +
                  [torch.linspace(-800, 800, 1 << 16, dtype=dtype),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 88.72, 88.73, -87.34, -103.98, -745.2,
                                 709.79, 709.8, 1e-30], dtype=dtype)])
    keep = x.clone()
    assert torch.equal(nx.exp(x).view(bits), _exp_allocating(x).view(bits))
    assert torch.equal(x.view(bits), keep.view(bits))   # the input is not written


def test_sincos_accuracy():
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    angle = (torch.arange(0, 40000, 7).double()[:, None] * inv_freq).float()
    s, c = nx.sincos(angle)
    assert (s - torch.sin(angle.double())).abs().max().item() < 1e-15
    assert (c - torch.cos(angle.double())).abs().max().item() < 1e-15


def test_numerics_bits_do_not_depend_on_position():
    """The scalar-tail / vector-body split of ATen loops must not change a value."""
    x = torch.randn(1000) * 5 - 3
    full_exp, full_log = nx.exp(x), nx.log(x.abs() + 0.1)
    s_full, c_full = nx.sincos(x * 1000)
    for i in (0, 1, 7, 15, 16, 17, 31, 999):
        assert torch.equal(nx.exp(x[i:i + 1]), full_exp[i:i + 1])
        assert torch.equal(nx.log(x[i:i + 1].abs() + 0.1), full_log[i:i + 1])
        s, c = nx.sincos(x[i:i + 1] * 1000)
        assert torch.equal(s, s_full[i:i + 1]) and torch.equal(c, c_full[i:i + 1])


def test_rowsum_single_row_large_does_not_split():
    """With 2 threads (set here: with one the split cannot happen and the test cannot fail)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1, 50000)
        rows = torch.cat([x, torch.randn(3, 50000)])
        assert torch.equal(nx.rowsum(x), nx.rowsum(rows)[:1])
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ ops vs float64
def hf_qwen3_rmsnorm(x, weight, eps):
    """Qwen3RMSNorm.forward, written out as in Hugging Face transformers."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qk_rmsnorm_is_the_qwen3_formula_bitwise(dtype):
    x = torch.randn(7, 5, 16, 128, dtype=dtype)
    w = (1 + 0.1 * torch.randn(128)).to(dtype)
    assert torch.equal(rlk_ops.qk_rmsnorm(x, w, 1e-6), hf_qwen3_rmsnorm(x, w, 1e-6))


def _rope_ref(x, positions, theta, rotary_dim):
    # The contract (and Hugging Face) forms the angle position * inv_freq in fp32;
    # at position 3e4 that product alone is off by up to ~1e-3 rad from exact math.
    # Measure the op against float64 math from that same fp32 angle.
    inv = (1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)).float()
    ang = (positions.float()[..., None] * inv).double()
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    xd = x.double()
    h = rotary_dim // 2
    x1, x2 = xd[..., :h], xd[..., h:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xd[..., rotary_dim:]], -1)


@pytest.mark.parametrize("dtype,rotary_dim", [(torch.bfloat16, 128), (torch.float32, 128), (torch.float32, 64)])
def test_rope_accuracy(dtype, rotary_dim):
    x = torch.randn(50, 4, 128, dtype=dtype)
    positions = torch.randint(0, 30000, (50,))
    y = rlk_ops.rope(x, positions, 1e6, rotary_dim)
    assert rel_err(y, _rope_ref(x, positions, 1e6, rotary_dim)) < TOL[dtype]
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_accuracy(dtype, causal):
    q = torch.randn(2, 150, 8, 64, dtype=dtype)
    k = torch.randn(2, 200, 2, 64, dtype=dtype)
    v = torch.randn(2, 200, 2, 64, dtype=dtype)
    out, lse = rlk_ops.attention(q, k, v, causal=causal)
    ref_out, ref_lse = ref_attention(q, k, v, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (2, 8, 150)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_varlen_attention_accuracy():
    lens_q, lens_k = [5, 130, 1], [9, 130, 300]
    q = torch.randn(sum(lens_q), 4, 32)
    k = torch.randn(sum(lens_k), 2, 32)
    v = torch.randn(sum(lens_k), 2, 32)
    cu_q = torch.tensor([0, 5, 135, 136], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 139, 439], dtype=torch.int32)
    out, lse = rlk_ops.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=130, max_seqlen_k=300)
    assert lse.shape == (4, sum(lens_q))
    for i in range(3):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ro, rl = ref_attention(q[None, qs], k[None, ks], v[None, ks])
        assert rel_err(out[qs], ro[0]) < TOL[torch.float32]
        assert (lse[:, qs].double() - rl[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_accuracy(dtype):
    x = torch.randn(33, 300, dtype=dtype)
    w = torch.randn(70, 300, dtype=dtype) / 17
    b = torch.randn(70, dtype=dtype)
    ref = x.double() @ w.double().t() + b.double()
    assert rel_err(rlk_ops.linear(x, w, b), ref) < TOL[dtype]


def test_paged_attention_accuracy():
    q = torch.randn(2, 3, 4, 16)
    k_cache = torch.randn(10, 8, 2, 16)
    v_cache = torch.randn(10, 8, 2, 16)
    page_table = torch.tensor([[3, 7, 1], [9, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 5], dtype=torch.int32)
    out, lse = rlk_ops.paged_attention(q, k_cache, v_cache, page_table, seq_lens)
    for b in range(2):
        n = int(seq_lens[b])
        keys = torch.cat([k_cache[int(p)] for p in page_table[b]])[:n]
        vals = torch.cat([v_cache[int(p)] for p in page_table[b]])[:n]
        ro, rl = ref_attention(q[b:b + 1], keys[None], vals[None])
        assert rel_err(out[b], ro[0]) < TOL[torch.float32]
        assert (lse[b].double() - rl[0]).abs().max().item() < 1e-5


# ------------------------------------------------------------------ gradcheck (float64)
def _d(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_gradcheck_qk_rmsnorm():
    assert torch.autograd.gradcheck(lambda x, w: rlk_ops.qk_rmsnorm(x, w, 1e-6), (_d(3, 2, 8), _d(8)))


def test_gradcheck_rope():
    pos = torch.tensor([0, 5, 1000], dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda x: rlk_ops.rope(x, pos, 1e4, 6), (_d(3, 2, 8),))


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_attention_dense(causal):
    def f(q, k, v):
        out, lse = rlk_ops.attention(q, k, v, causal=causal)
        return out, lse

    assert torch.autograd.gradcheck(f, (_d(1, 3, 4, 4), _d(1, 5, 2, 4), _d(1, 5, 2, 4)))


def test_gradcheck_attention_crosses_key_blocks():
    q, k, v = _d(1, 2, 2, 2), _d(1, 130, 1, 2), _d(1, 130, 1, 2)
    assert torch.autograd.gradcheck(lambda q, k, v: rlk_ops.attention(q, k, v), (q, k, v))


def test_gradcheck_attention_varlen():
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)

    def f(q, k, v):
        return rlk_ops.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4)

    assert torch.autograd.gradcheck(f, (_d(5, 2, 4), _d(7, 1, 4), _d(7, 1, 4)))


def test_gradcheck_linear():
    assert torch.autograd.gradcheck(rlk_ops.linear, (_d(2, 3, 5), _d(4, 5), _d(4)))
    assert torch.autograd.gradcheck(lambda x, w: rlk_ops.linear(x, w), (_d(3, 5), _d(4, 5)))


# ------------------------------------------- a session 39 mutation audit: arithmetic no test pinned down
def test_linear_bf16_products_and_bias_are_fp32_exact():
    """fp32 accumulation: bf16 products are exact in fp32, and the bias is added before the one rounding.
    (1+2^-7)(1-2^-7) - 1 = -2^-14 exactly (bf16 accumulation gave 0); 1 + 2^-8 - 1 = 2^-8 exactly (rounding
    before the bias gave 0)."""
    bf = torch.bfloat16
    x = torch.tensor([[1 + 2 ** -7, -1.0]], dtype=bf)
    w = torch.tensor([[1 - 2 ** -7, 1.0]], dtype=bf)
    assert rlk_ops.linear(x, w).item() == -2 ** -14
    x = torch.tensor([[1.0, 1.0]], dtype=bf)
    w = torch.tensor([[1.0, 2 ** -8]], dtype=bf)
    assert rlk_ops.linear(x, w, torch.tensor([-1.0], dtype=bf)).item() == 2 ** -8


def test_qk_rmsnorm_dweight_uses_the_rounded_xhat():
    """dweight sums dy * xhat rounded to x's dtype (the forward multiplies the weight by the rounded xhat):
    against float64 math of that formula on an fp16 case."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 16, generator=g).half()
    w = torch.ones(16, dtype=torch.half, requires_grad=True)
    dy = torch.randn(64, 1, 16, generator=g).half()
    (dw,) = torch.autograd.grad(rlk_ops.qk_rmsnorm(x, w, 1e-6), w, dy)
    x32 = x.float()
    xhat = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert torch.equal(dw, (dy.double() * xhat.double()).reshape(-1, 16).sum(0).half())


def test_attention_bf16_feeds_p_rounded_to_bf16_into_pv():
    """Scores 0 and -1 (D=1, scale 1): p = [1, e^-1], V = [0, 1]. P is rounded to bf16 for the PV product (as
    FA4's MMA) but not in the row sum: out = bf16(bf16(e^-1) / (1 + e^-1)) = 0.267578125 (unrounded: 0.26953125)."""
    bf = torch.bfloat16
    q = torch.ones(1, 1, 1, 1, dtype=bf)
    k = torch.tensor([0.0, -1.0], dtype=bf).view(1, 2, 1, 1)
    v = torch.tensor([0.0, 1.0], dtype=bf).view(1, 2, 1, 1)
    out, _ = rlk_ops.attention(q, k, v, causal=False, softmax_scale=1.0)
    p = torch.tensor(math.exp(-1.0), dtype=torch.float32)
    assert out.item() == (p.to(bf).float() / (1 + p)).to(bf).item()


def test_attention_bwd_bf16_dv_uses_p_rounded_to_bf16():
    """dV = P^T dO with P rounded to bf16, as in the forward's PV product: against float64 math of that formula."""
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 16, 1, 8, generator=g).to(bf) for _ in range(2))
    v = torch.randn(1, 16, 1, 8, generator=g).to(bf).requires_grad_()
    dout = torch.randn(1, 16, 1, 8, generator=g).to(bf)
    out, lse = rlk_ops.attention(q, k, v, causal=False)
    (dv,) = torch.autograd.grad(out, v, dout)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 8 ** -0.5
    p = torch.exp(s - lse.double()[..., None]).to(bf).double()
    assert torch.equal(dv, torch.einsum("bhqk,bqhd->bkhd", p, dout.double()).to(bf))


def test_fp32_exp_is_within_one_ulp():
    """numerics.exp in fp32 is under 1 ulp (0.76 measured); a shorter polynomial drifts to ~2 ulp, which the
    2-ulp bound of test_exp_log_accuracy lets through."""
    x = torch.cat([torch.linspace(-87.0, 0.0, 20001), torch.linspace(-0.35, 0.35, 20001)])
    ref = torch.exp(x.double())
    err = ((nx.exp(x).double() - ref).abs() / (ref * torch.finfo(torch.float32).eps)).max().item()
    assert err < 1.0, err


def test_merge_is_the_numerics_exp_fold_on_many_rows():
    """The merge's ascending fold uses numerics.exp and divides by the total (torch.exp, or a multiply by the
    reciprocal, agree on most inputs, not all): 8192 rows, bitwise against the fold written out."""
    g = torch.Generator().manual_seed(0)
    out_parts = torch.randn(4, 1024, 8, 4, generator=g)
    lse_parts = torch.randn(4, 8, 1024, generator=g) * 3
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    ls = lse_parts.transpose(-1, -2)
    m = ls.amax(0)
    total, acc = torch.zeros_like(m), torch.zeros(out_parts.shape[1:])
    for n in range(4):
        w = nx.exp(ls[n] - m)
        total = total + w
        acc = acc + w[..., None] * out_parts[n]
    assert torch.equal(lse, (m + nx.log(total)).transpose(0, 1))
    assert torch.equal(out, acc / total[..., None])


def test_merge_propagates_a_nan_or_inf_state():
    """Only lse = -inf marks an empty state; a NaN or +inf lse is present and makes the row NaN (not skipped)."""
    out_parts = torch.randn(2, 2, 1, 4)
    out, lse = rlk_ops.merge_attn_states(out_parts, torch.tensor([[[0.5, 0.5]], [[math.nan, math.inf]]]))
    assert bool(torch.isnan(out).all()) and bool(torch.isnan(lse).all())


def test_public_defaults_are_qwen3s():
    """qk_rmsnorm's eps defaults to 1e-6 and rope's theta to 1e6 (Qwen3's rms_norm_eps and rope_theta)."""
    x = torch.randn(3, 2, 16) * 1e-3          # small rows: eps shows in rsqrt(var + eps)
    w = torch.ones(16)
    assert torch.equal(rlk_ops.qk_rmsnorm(x, w), rlk_ops.qk_rmsnorm(x, w, 1e-6))
    assert not torch.equal(rlk_ops.qk_rmsnorm(x, w), rlk_ops.qk_rmsnorm(x, w, 1e-5))
    pos = torch.tensor([0, 7, 5000])
    assert torch.equal(rlk_ops.rope(x, pos), rlk_ops.rope(x, pos, 1e6, 16))
    assert not torch.equal(rlk_ops.rope(x, pos), rlk_ops.rope(x, pos, 1e4, 16))
