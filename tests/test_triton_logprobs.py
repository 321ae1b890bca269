"""The CUDA log-probs' Triton kernel (rlk_ops/kernels/triton/logprobs.py): one program per row, so a row's
lse never depends on the batch; the token's log-prob is the kernel's z[token] - lse; the temperature is one
IEEE division (torch's, by a tensor); NaN and infinities as the CPU path; accurate against float64.

Two lanes: under TRITON_INTERPRET=1 (make test's interpreter run: CPU tensors, numpy) the kernel's
arithmetic and indexing, and on a GPU (``cuda`` marker) the same claims at a real vocabulary on the
compiled kernel, plus the alignment the vector width depends on. The interpreter's sum order is numpy's,
not the GPU's, so nothing here compares the two lanes' bits; what the interpreter decides exactly is
said per test.
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from rlk_ops.kernels.cpu import numerics as nx  # noqa: E402
from rlk_ops.rollout import glue  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRET
INTERP = pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))
GPU = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")])
DEVICES = [INTERP, GPU]


def _kernels():
    from rlk_ops.kernels.triton import logprobs
    return logprobs


def _vocab(device):
    """A vocabulary that is not a multiple of the kernel's 1024 lanes: Qwen3's on the GPU, a smaller one
    in the interpreter (numpy runs every lane op)."""
    return 151936 + 3 if device == "cuda" else 2 * 1024 + 77


def _logits(rows, vocab, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * 4
    z[0, 3] = 900.0                      # exp would overflow without the max shift
    return z.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_lse_is_the_row_alone_whatever_the_batch(device):
    L, v = _kernels(), _vocab(device)
    z = _logits(37 if device == "cuda" else 9, v, device)
    lse = L.row_lse(z)
    assert lse.dtype == torch.float32 and lse.shape == (z.shape[0],) and lse.device == z.device
    for r in (0, 4, z.shape[0] - 1):
        assert torch.equal(L.row_lse(z[r:r + 1]), lse[r:r + 1])
    assert torch.equal(L.row_lse(z[2:7]), lse[2:7])
    assert torch.equal(L.row_lse(z), lse)                                   # run to run
    if device == "cuda":                                                    # a training-sized batch around it
        big = torch.cat([_logits(600, v, device, seed=1), z[4:5], _logits(500, v, device, seed=2)])
        assert torch.equal(L.row_lse(big)[600], lse[4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_the_tokens_log_prob_is_z_at_the_token_minus_lse(device, temperature):
    """z = logits in fp32 / T by one IEEE division (torch's, by a tensor, on any device), exactly."""
    L, v = _kernels(), _vocab(device)
    z = _logits(6, v, device)
    t = torch.tensor([3, 0, v - 1, 1024, 1023, 77], device=device)
    logp, lse = L.token_logprobs(z, t, temperature)
    assert torch.equal(lse, L.row_lse(z, temperature))
    zt = glue.tempered(z.float(), temperature)
    assert torch.equal(logp, zt[torch.arange(6, device=device), t] - lse)
    if temperature != 1.0:
        assert not torch.equal(lse, L.row_lse(z))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_kernel_computes_what_its_doc_says_step_for_step(temperature):
    """The kernel's arithmetic transcribed in torch: the max, each of the 1024 lanes adding numerics.exp(z - m)
    tile after tile (the lanes past V adding exp(-inf) = 0), the lanes summed, m + numerics.log(sum), bit for
    bit. The interpreter's tl.sum is numpy's sum over the lanes (its pairwise order; the GPU's is another), so
    the transcription sums with numpy. The rows are log-probabilities (lse near 0, where one ulp of the sum
    shows in lse): a lane scaled by 1 + 2^-23 or a lane dropped fails here, which the accuracy test allows."""
    import numpy as np

    L, v = _kernels(), _vocab("cpu")
    x = torch.log_softmax(torch.randn(24, v, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3,
                          -1).float()
    got = L.row_lse(x, temperature)
    for r in range(x.shape[0]):
        z = glue.tempered(x[r], temperature)
        m = z.max()
        acc = torch.zeros(L.BLOCK)
        for v0 in range(0, v, L.BLOCK):
            tile = torch.full((L.BLOCK,), float("-inf"))
            tile[:min(L.BLOCK, v - v0)] = z[v0:v0 + L.BLOCK]
            acc = acc + nx.exp(tile - m)
        total = torch.tensor([float(np.sum(acc.numpy()))], dtype=torch.float32)
        assert torch.equal(got[r:r + 1], m + nx.log(total)), r


@pytest.mark.parametrize("device", DEVICES)
def test_logits_are_read_in_their_dtype(device):
    L, v = _kernels(), _vocab(device)
    z = _logits(3, v, device)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(L.row_lse(z.to(dtype)), L.row_lse(z.to(dtype).float()))


@pytest.mark.parametrize("device", DEVICES)
def test_an_unaligned_view_gives_the_aligned_bits(device):
    """A row view starting off a 16-byte boundary is copied aligned first (the vector width, and with it
    the order in which a thread's lanes are summed, follows the pointer's alignment on the GPU)."""
    L, v = _kernels(), _vocab(device)
    base = _logits(4, v + 1, device, dtype=torch.float32)
    view = base[:, 1:]
    assert view.data_ptr() % 16
    assert torch.equal(L.row_lse(view), L.row_lse(view.clone()))


@pytest.mark.parametrize("device", DEVICES)
def test_exact_rows_give_the_exact_lse(device):
    """A row of zeros sums V ones (exact in any order): lse = numerics.log(V), bit for bit; a row with one
    finite value among -inf: lse = that value."""
    L, v = _kernels(), _vocab(device)
    z = torch.zeros(3, v, device=device)
    z[1] = float("-inf")
    z[1, 5] = 2.5
    z[2] = -7.0                          # the max shift: exp(0) everywhere
    want = torch.tensor([float(nx.log(torch.tensor([float(v)]))[0]), 2.5, 0.0])
    want[2] = -7.0 + want[0]
    assert torch.equal(L.row_lse(z).cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_infinities_are_the_cpu_paths(device):
    """A NaN logit, a row of -inf, a +inf logit: NaN lse, as row_lse gives (max - max of infinities); a
    -inf logit beside finite ones only adds exp(-inf) = 0."""
    L, v = _kernels(), _vocab(device)
    z = _logits(5, v, device, dtype=torch.float32)
    z[1, 9] = float("nan")
    z[2] = float("-inf")
    z[3, 1030] = float("inf")
    z[4, 100:200] = float("-inf")
    got, ref = L.row_lse(z).cpu(), glue.row_lse(z.cpu())
    assert got[1:4].isnan().all() and ref[1:4].isnan().all()
    assert torch.isfinite(got[[0, 4]]).all()
    assert abs(float(got[4]) - float(torch.logsumexp(z[4].cpu().double(), 0))) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_accuracy_against_float64(device):
    L, v = _kernels(), _vocab(device)
    z = _logits(8, v, device, dtype=torch.float32)
    for temperature in (1.0, 0.6):
        ref = torch.logsumexp(z.cpu().double() / temperature, -1)
        err = (L.row_lse(z, temperature).cpu().double() - ref).abs().max()
        assert float(err) < 4e-6 * max(1.0, float(ref.abs().max())), float(err)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    L = _kernels()
    z = torch.zeros(0, 50, device=device)
    logp, lse = L.token_logprobs(z, torch.zeros(0, dtype=torch.int64, device=device))
    assert logp.shape == lse.shape == (0,)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_the_glue_refuses_the_interpreter_for_cuda_logits():
    """On CUDA the log-probs run the kernel compiled; the interpreter's bits are not the GPU's, so the
    glue says so rather than run it (CPU logits take the host path whatever TRITON_INTERPRET says)."""
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 would run it in the interpreter"):
        glue._cuda_kernels()
    z = _logits(2, 40, "cpu")
    assert torch.equal(glue.lse_rows(z, 1.0, "x")[1], glue.row_lse(z.float()))


def test_a_temperature_is_one_ieee_division_on_the_host():
    """``tempered`` divides by a 0-dim tensor: on the CPU the bits are z / T's (what the committed host
    results were computed with); on CUDA, z / a Python float is z * (1 / T) (ATen's scalar path), which this
    avoids (the CUDA lane of test_token_logprobs compares the devices)."""
    z = torch.randn(64, 257, generator=torch.Generator().manual_seed(3)) * 9
    for t in (0.7, 1 / 3, 1.3, 0.001):
        assert torch.equal(glue.tempered(z, t), z / t)
    assert not torch.equal(z * (1 / torch.tensor(0.7)), z / 0.7)   # the reciprocal would differ


def test_overflow_check_reads_the_largest_finite_logit_in_any_dtype():
    z = torch.tensor([[1.0, -3.0e38, 2.0]])
    with pytest.raises(ValueError, match=r"x: temperature 0\.5 overflows logits / temperature in torch.float32 "
                                         r"\(largest \|logit\| 3\.0000000054977558e\+38\)"):
        glue.check_overflow(z, 0.5, "x")
    glue.check_overflow(z, 1.0, "x")                                # no division at 1
    glue.check_overflow(torch.tensor([[float("inf"), float("nan"), 1.0]]), 0.5, "x")   # infinities stay
    with pytest.raises(ValueError, match=r"largest \|logit\| 3\.0000000054977558e\+38"):   # a masked -inf beside it
        glue.check_overflow(torch.tensor([[float("-inf"), 3.0e38]]), 0.5, "x")
    glue.check_overflow(torch.zeros(0, 4), 0.5, "x")
    with pytest.raises(ValueError, match="overflows"):
        glue.check_overflow(torch.tensor([[3.0e38]]).bfloat16(), 0.5, "x")
