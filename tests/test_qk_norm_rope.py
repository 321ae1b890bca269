"""rlk::qk_norm_rope == rope(qk_rmsnorm(.)) for q and k, bitwise, forward and backward,
on every backend (CPU here; the Triton kernel under -m cuda)."""
import pytest
import torch

import rlk_ops
from rlk_ops import RlkInputError

from conftest import TOL, bitwise_equal, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(lead=(37,), hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu", max_pos=40000):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(*lead, hq, d, generator=g).to(dtype)
    k = torch.randn(*lead, hkv, d, generator=g).to(dtype)
    qw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    pos = torch.randint(0, max_pos, lead, generator=g)
    return [t.to(device) for t in (q, k, qw, kw, pos)]


def _unfused(q, k, qw, kw, pos, eps, theta, rd):
    return (rlk_ops.rope(rlk_ops.qk_rmsnorm(q, qw, eps), pos, theta, rd),
            rlk_ops.rope(rlk_ops.qk_rmsnorm(k, kw, eps), pos, theta, rd))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("lead,rd", [((37,), 16), ((2, 9), 8), ((5,), 2)])
def test_fused_equals_sequence_cpu(dtype, lead, rd):
    # The CPU kernel of the fused op *is* rope(qk_rmsnorm(.)), so on CPU this checks the
    # op's argument plumbing (q/k, weights, positions, rotary_dim), not a second kernel;
    # the fused Triton kernel is compared with the unfused ops under -m cuda.
    q, k, qw, kw, pos = _inputs(lead, dtype=dtype)
    fq, fk = rlk_ops.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6, rd)
    uq, uk = _unfused(q, k, qw, kw, pos, 1e-6, 1e6, rd)
    assert bitwise_equal(fq, uq) and bitwise_equal(fk, uk)


def test_gradients_equal_the_unfused_chain():
    q, k, qw, kw, pos = _inputs((11,), dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    fq, fk = rlk_ops.qk_norm_rope(*leaves, pos, 1e-6, 1e6)
    gf = torch.autograd.grad(fq.float().square().sum() + fk.float().sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, qw, kw)]
    uq, uk = _unfused(*leaves2, pos, 1e-6, 1e6, 16)
    gu = torch.autograd.grad(uq.float().square().sum() + uk.float().sum(), leaves2)
    assert all(bitwise_equal(a, b) for a, b in zip(gf, gu))


def test_only_q_used_gives_no_k_gradient():
    q, k, qw, kw, pos = (t.clone() for t in _inputs((6,)))
    leaves = [t.requires_grad_() for t in (q, k, qw, kw)]
    fq, _ = rlk_ops.qk_norm_rope(*leaves, pos)
    dq, dk, dqw, dkw = torch.autograd.grad(fq.sum(), leaves, allow_unused=True)
    assert dq is not None and dqw is not None
    assert dk is None or bool((dk == 0).all())  # autograd may materialize zeros
    assert dkw is None or bool((dkw == 0).all())


def test_gradcheck_fp64():
    q, k, qw, kw, pos = _inputs((3,), hq=2, hkv=1, d=8, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, qw, kw)]
    assert torch.autograd.gradcheck(lambda a, b, c, d: rlk_ops.qk_norm_rope(a, b, c, d, pos, 1e-6, 1e4, 8),
                                    leaves)


def test_compiled_equals_eager():
    q, k, qw, kw, pos = _inputs((9,))
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: rlk_ops.qk_norm_rope(*a, pos, 1e-6, 1e6), fullgraph=True)
    eager = rlk_ops.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6)
    comp = fn(q, k, qw, kw)
    assert bitwise_equal(comp[0], eager[0]) and bitwise_equal(comp[1], eager[1])


@pytest.mark.parametrize("mutate,pattern", [
    (lambda a: a.update(k=a["k"][:-1]), r"k must have q's leading shape \[37\], got \[36, 2, 16\]"),
    (lambda a: a.update(k=torch.randn(37, 2, 8)), r"k's head_dim \(8\) must equal q's head_dim \(16\)"),
    (lambda a: a.update(k=a["k"].double()), r"k must have the dtype of q \(torch.float32\), got torch.float64"),
    (lambda a: a.update(qw=torch.randn(8)), r"q_weight must have shape \[16\] \(the head_dim\), got \[8\]"),
    (lambda a: a.update(kw=torch.randn(16, 1)), r"k_weight must be 1-D \[head_dim\], got shape \[16, 1\]"),
    (lambda a: a.update(pos=a["pos"].int()), r"positions must be torch.int64, got torch.int32"),
    (lambda a: a.update(pos=a["pos"][:5]), r"positions must have x's leading shape \[37\]"),
    (lambda a: a.update(rd=7), r"rotary_dim must be even and in \(0, head_dim=16\], got 7"),
    (lambda a: a.update(eps=-1.0), r"eps must be a finite number > 0, got -1.0"),
    (lambda a: a.update(theta=0.0), r"theta must be a finite number >= 1 \(the RoPE base\), got 0.0"),
    # theta < 1 gives frequencies > 1: angles past what the reference sincos reduces exactly (once inf/NaN)
    (lambda a: a.update(theta=1e-30), r"theta must be a finite number >= 1 \(the RoPE base\), got 1e-30"),
    (lambda a: a["pos"].__setitem__(3, -2), r"positions\[3\] = -2 is negative"),
])
def test_bad_input_names_the_argument(mutate, pattern):
    q, k, qw, kw, pos = _inputs()
    a = dict(q=q, k=k, qw=qw, kw=kw, pos=pos, eps=1e-6, theta=1e6, rd=16)
    mutate(a)
    with pytest.raises(RlkInputError, match=r"rlk::qk_norm_rope: " + pattern):
        rlk_ops.qk_norm_rope(a["q"], a["k"], a["qw"], a["kw"], a["pos"], a["eps"], a["theta"], a["rd"])


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype,rd", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float32, 128)])
def test_triton_fused_equals_triton_sequence(dtype, rd):
    q, k, qw, kw, pos = _inputs((300,), hq=16, hkv=4, d=128, dtype=dtype, device="cuda")
    with rlk_ops.provenance.capture() as log:
        fq, fk = rlk_ops.qk_norm_rope(q, k, qw, kw, pos, 1e-6, 1e6, rd)
        uq, uk = _unfused(q, k, qw, kw, pos, 1e-6, 1e6, rd)
    assert {(r.op, r.actual_backend) for r in log.records()} == {
        ("qk_norm_rope", "triton"), ("qk_rmsnorm", "triton"), ("rope", "triton")}
    assert bitwise_equal(fq, uq) and bitwise_equal(fk, uk)
    # accuracy against the CPU reference (not bitwise: the norm sums in another order)
    cq, ck = rlk_ops.qk_norm_rope(*(t.cpu() for t in (q, k, qw, kw, pos)), 1e-6, 1e6, rd)
    assert rel_err(fq.cpu(), cq) < TOL[dtype] and rel_err(fk.cpu(), ck) < TOL[dtype]


@pytest.mark.cuda
@needs_cuda
def test_triton_fused_batch_invariant_and_run_to_run():
    q, k, qw, kw, pos = _inputs((300,), hq=16, hkv=4, d=128, dtype=torch.bfloat16, device="cuda")
    fq, fk = rlk_ops.qk_norm_rope(q, k, qw, kw, pos)
    again = rlk_ops.qk_norm_rope(q, k, qw, kw, pos)
    assert bitwise_equal(again[0], fq) and bitwise_equal(again[1], fk)
    for t in (0, 15, 16, 17, 299):
        oq, ok = rlk_ops.qk_norm_rope(q[t:t + 1], k[t:t + 1], qw, kw, pos[t:t + 1])
        assert bitwise_equal(oq[0], fq[t]) and bitwise_equal(ok[0], fk[t])


@pytest.mark.cuda
@needs_cuda
def test_triton_fused_with_no_q_heads_still_writes_k():
    """q with 0 heads: the launcher took the token count from q's numel (0), launched nothing and
    returned k's output uninitialised (session 32 audit). k's rows equal the unfused chain's."""
    q, k, qw, kw, pos = _inputs((37,), hq=16, hkv=4, d=128, dtype=torch.bfloat16, device="cuda")
    q0 = q[:, :0]
    fq, fk = rlk_ops.qk_norm_rope(q0, k, qw, kw, pos)
    _, uk = _unfused(q, k, qw, kw, pos, 1e-6, 1e6, 128)
    assert fq.shape == q0.shape and bitwise_equal(fk, uk)


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def test_qk_norm_rope_names_a_second_lead_dim_and_a_rotary_dim_past_head_dim():
    from rlk_ops import RlkInputError
    w = torch.ones(16)
    with pytest.raises(RlkInputError, match=r"rlk::qk_norm_rope: k must have q's leading shape \[2, 9\]"):
        rlk_ops.qk_norm_rope(torch.randn(2, 9, 4, 16), torch.randn(2, 8, 2, 16), w, w,
                             torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(RlkInputError, match=r"rlk::qk_norm_rope: rotary_dim must be even and in \(0, head_dim=16\], "
                                            r"got 18"):
        rlk_ops.qk_norm_rope(torch.randn(5, 4, 16), torch.randn(5, 2, 16), w, w, torch.arange(5), 1e-6, 1e6, 18)
