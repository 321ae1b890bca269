"""The differentiable token log-prob (``rlk_model::token_logprobs``, ``rollout/glue.py``): its forward is the
rollout's log_softmax at the token, bit for bit, so a trainer's loss reads the log-probs the rollout sampled
with; its backward is the exact gradient, deterministic and row-independent; eager == compiled; bad input
named."""
import pytest
import torch

import rlk_ops.rollout.glue  # noqa: F401 (registers the rlk_model ops)
from rlk_ops.rollout.model import log_softmax, token_logprobs

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])


def _logits(rows=7, vocab=300, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * 3
    z[1, min(5, vocab - 1)] = 2000.0   # a row whose exp would overflow without the max shift
    return z.to(dtype).to(device)


def _tokens(rows=7, vocab=300, device="cpu", seed=1):
    return torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_is_the_rollouts_log_softmax_at_the_token(device, dtype):
    z, t = _logits(dtype=dtype, device=device), _tokens(device=device)
    lp = token_logprobs(z, t)
    assert lp.dtype == torch.float32 and lp.device == z.device and lp.shape == (7,)
    assert torch.equal(lp.cpu(), log_softmax(z)[torch.arange(7), t.cpu()])   # the engine's function
    ref = torch.log_softmax(z.double().cpu(), -1)[torch.arange(7), t.cpu()]
    assert torch.allclose(lp.cpu().double(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_gradient_is_exact_and_includes_the_lse_output(device):
    z = _logits(dtype=torch.float32, device=device).requires_grad_(True)
    t = _tokens(device=device)
    w = torch.linspace(-1, 2, 7, device=device)
    (w * token_logprobs(z, t)).sum().backward()
    zd = z.detach().double().requires_grad_(True)
    (w.double() * torch.log_softmax(zd, -1)[torch.arange(7, device=device), t]).sum().backward()
    assert torch.allclose(z.grad.double(), zd.grad, rtol=1e-5, atol=1e-6)
    # the raw op's lse output carries its gradient too (d lse / dz = softmax)
    z.grad = None
    logp, lse = torch.ops.rlk_model.token_logprobs(z, t)
    (w * logp + 3 * lse).sum().backward()
    zd.grad = None
    (w.double() * torch.log_softmax(zd, -1)[torch.arange(7, device=device), t] + 3 * torch.logsumexp(zd, -1)).sum() \
        .backward()
    assert torch.allclose(z.grad.double(), zd.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_rows_are_independent_and_run_to_run_in_both_directions(device):
    z = _logits(rows=9, device=device).requires_grad_(True)
    t = _tokens(rows=9, device=device)
    lp = token_logprobs(z, t)
    lp.sum().backward()
    full = z.grad.clone()
    assert full.dtype == torch.bfloat16
    for r in (0, 1, 5, 8):
        one = z.detach()[r:r + 1].clone().requires_grad_(True)
        lp1 = token_logprobs(one, t[r:r + 1])
        lp1.sum().backward()
        assert torch.equal(lp1, lp[r:r + 1]) and torch.equal(one.grad, full[r:r + 1])
    z.grad = None
    token_logprobs(z, t).sum().backward()
    assert torch.equal(z.grad, full)


def test_rows_past_one_step_of_the_chunked_sum_are_the_rows_alone():
    """row_lse sums a few rows at a time (1 MiB of fp32 a step: 873 rows at vocab 300): rows on both sides
    of a step boundary, and the rollout's log_softmax over the same rows, give each row's bits alone."""
    z, t = _logits(rows=1800, vocab=300, seed=4), _tokens(rows=1800, vocab=300, seed=5)
    lp = token_logprobs(z, t)
    full = log_softmax(z)
    assert torch.equal(lp, full[torch.arange(1800), t])
    for r in (0, 872, 873, 874, 1745, 1746, 1799):
        assert torch.equal(token_logprobs(z[r:r + 1], t[r:r + 1]), lp[r:r + 1])
        assert torch.equal(log_softmax(z[r:r + 1])[0], full[r])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_log_probs_stay_on_the_device(monkeypatch):
    """CUDA logits: the trainer's op and the engine's log_softmax both read the Triton kernel's lse (the
    host path is not called: it is made to raise here), so they still agree bit for bit, rows alone and in
    a batch, at a temperature too; the temperature's division is the host's bits (one IEEE division, not
    ATen's z * (1 / T) for a Python float on CUDA)."""
    import rlk_ops.rollout.glue as glue

    z, t = _logits(rows=40, vocab=151936, device="cuda"), _tokens(rows=40, vocab=151936, device="cuda")
    for temp in (0.7, 1.3):
        assert torch.equal(glue.tempered(z.float(), temp).cpu(), glue.tempered(z.float().cpu(), temp))

    def host(*a):
        raise AssertionError("the host path ran for CUDA logits")

    monkeypatch.setattr(glue, "row_lse", host)
    for temp in (1.0, 0.7):
        lp = token_logprobs(z, t, temp)
        assert lp.device == z.device
        full = log_softmax(z, temp)
        assert torch.equal(lp.cpu(), full[torch.arange(40), t.cpu()])
        for r in (0, 1, 39):
            assert torch.equal(token_logprobs(z[r:r + 1], t[r:r + 1], temp), lp[r:r + 1])
            assert torch.equal(log_softmax(z[r:r + 1], temp)[0], full[r])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ops_pass_opcheck(dtype):
    z, t = _logits(dtype=dtype), _tokens()
    torch.library.opcheck(torch.ops.rlk_model.token_logprobs, (z.requires_grad_(True), t))
    logp, lse = torch.ops.rlk_model.token_logprobs(z.detach(), t)
    torch.library.opcheck(torch.ops.rlk_model.token_logprobs_bwd,
                          (torch.randn(7), torch.randn(7), z.detach(), t, lse))


def test_compiled_is_eager_forward_and_backward():
    """Under torch.compile(fullgraph=True) the ops stay opaque: the loss's log-probs and the gradient are
    eager's, bit for bit (the loss around them is plain torch code that Inductor compiles)."""
    z0, t = _logits(), _tokens()
    w = torch.linspace(-1, 2, 7)

    def loss(z):
        return -(w * token_logprobs(z, t)).mean()

    out = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        z = z0.clone().requires_grad_(True)
        val = fn(z)
        val.backward()
        out.append((val.detach(), z.grad))
    torch._dynamo.reset()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("args, fragment", [
    ((torch.zeros(5), torch.zeros(5, dtype=torch.long)), "logits must be a floating tensor [tokens, vocab], got "
                                                         "torch.float32 [5]"),
    ((torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long)), "logits must be a floating tensor"),
    ((torch.zeros(3, 5), torch.zeros(4, dtype=torch.long)), "tokens must be int64 or int32 [3] (one per logits row), "
                                                            "got torch.int64 [4]"),
    ((torch.zeros(3, 5), torch.zeros(3)), "tokens must be int64 or int32 [3]"),
    ((torch.zeros(3, 5), torch.tensor([0, 5, 1])), "tokens[1] must be in [0, 5) (the vocabulary), got 5"),
    ((torch.zeros(3, 5), torch.tensor([0, 1, -1])), "tokens[2] must be in [0, 5) (the vocabulary), got -1"),
    ((torch.zeros(3, 5), [0, 1, 2]), "token_logprobs: tokens must be a tensor, got list"),
    (("logits", torch.zeros(3, dtype=torch.long)), "token_logprobs: logits must be a tensor, got str"),
])
def test_bad_input_is_named(args, fragment):
    with pytest.raises(ValueError) as e:
        token_logprobs(*args)
    assert fragment in str(e.value)


def test_bad_backward_input_is_named():
    z, t = _logits(rows=3, vocab=5), torch.tensor([0, 1, 2])
    lse = torch.zeros(3)
    with pytest.raises(ValueError, match=r"dlse must be float32 \[3\] on cpu, got torch.bfloat16 \[3\]"):
        torch.ops.rlk_model.token_logprobs_bwd(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16), z, t, lse)
    with pytest.raises(ValueError, match=r"dlogp must be float32 \[3\] on cpu, got torch.float32 \[4\]"):
        torch.ops.rlk_model.token_logprobs_bwd(torch.zeros(4), torch.zeros(3), z, t, lse)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_temperature_divides_the_logits_in_fp32_on_both_sides(device):
    """log_softmax(logits / T): the trainer's token_logprobs and the rollout's log_softmax give the same bits
    (one IEEE division in fp32 for both), accurate against float64, with the exact gradient."""
    z = _logits(device=device).requires_grad_(True)
    t = _tokens(device=device)
    lp = token_logprobs(z, t, 0.7)
    assert torch.equal(lp.detach().cpu(), log_softmax(z, 0.7)[torch.arange(7), t.cpu()])
    assert not torch.equal(lp.detach(), token_logprobs(z, t).detach())
    zd = z.detach().double().requires_grad_(True)
    ref = torch.log_softmax(zd / 0.7, -1)[torch.arange(7, device=device), t]
    assert torch.allclose(lp.detach().double(), ref, rtol=1e-6, atol=1e-5)
    w = torch.linspace(-1, 2, 7, device=device)
    (w * lp).sum().backward()
    (w.double() * ref).sum().backward()
    assert torch.allclose(z.grad.double(), zd.grad, rtol=2e-2, atol=1e-2)   # (bf16 gradient)
    torch.library.opcheck(torch.ops.rlk_model.token_logprobs, (z.detach().float().requires_grad_(True), t, 0.7))


@pytest.mark.parametrize("t, got", [(0, "0"), (-1.0, "-1.0"), (float("nan"), "nan"), (float("inf"), "inf"),
                                    (True, "True"), ("1", "'1'")])
def test_a_bad_temperature_is_named(t, got):
    z, tok = _logits(rows=2, vocab=5), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=rf"temperature must be a finite number > 0, got {got}"):
        token_logprobs(z, tok, t)
    with pytest.raises(ValueError, match=rf"temperature must be a finite number > 0, got {got}"):
        log_softmax(z, t)


def test_a_temperature_that_overflows_the_logits_is_refused():
    """logits / 1e-300 is inf in fp32: the log-probs would be NaN (inf - inf), so both sides refuse it."""
    z, tok = _logits(rows=2, vocab=5), torch.tensor([0, 1])
    for call in (lambda: token_logprobs(z, tok, 1e-300), lambda: log_softmax(z, 1e-300)):
        with pytest.raises(ValueError, match=r"temperature 1e-300 overflows logits / temperature in torch.float32 "
                                             r"\(largest \|logit\| .*\): the log-probs would be NaN"):
            call()

