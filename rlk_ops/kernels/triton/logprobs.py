"""Triton log-softmax statistics for rlk_model::token_logprobs and the rollout engine's log-probs on CUDA.

    row_lse(logits [R, V], temperature) -> lse [R] fp32
    token_logprobs(logits [R, V], tokens [R], temperature) -> (logp [R], lse [R]) fp32

One program per row (``_lse_kernel``), so a row's bits never depend on how many rows came with it
(batch-invariant: a decode step's row = the same row in a training batch), and nothing is atomic
(run-to-run deterministic). Per row, with z = logits in fp32 divided by the temperature (one IEEE
division, ``div_rn``; none at 1.0), in two passes over the row:

    m   = max of z                                   (exact in any order)
    acc = BLOCK lanes, lane j adds exp(z[v0 + j] - m) for v0 = 0, BLOCK, 2 BLOCK, ... in that order
    lse = m + log(tl.sum(acc))                        the lanes summed in the order BLOCK and NUM_WARPS fix
    logp = z[token] - lse

``exp`` and ``log`` are ``numerics.exp`` / ``numerics.log`` transcribed (merge.py's ``_exp``/``_log``:
Cody-Waite + Horner, float64 atanh series, no FMA contraction); the lanes past V read -inf and add
exp(-inf) = 0, and a NaN logit makes its lane, the sum and lse NaN (as on the CPU path). The result is not the CPU reference's bits (``glue.row_lse`` sums a row in ATen's
order), so a trainer and a rollout engine agree bitwise when both run on CUDA (both call this) or
both on the CPU, which is what ``rlk_model::token_logprobs`` and ``rollout.model.log_softmax`` do.

The order depends on BLOCK, NUM_WARPS, the vocabulary size and the input's alignment (Triton picks
the vector width from it, and the width fixes which lanes a thread sums first): the first two are
constants here, the input is made contiguous and 16-byte aligned (``_common.aligned``), and V is the
model's. A logits row is read in its own dtype (bf16, fp16 or fp32) and converted in the kernel, so
the T x V fp32 copy the host path made is not made.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.triton import _common as C
from rlk_ops.kernels.triton.merge import _exp, _log, _log_constants

BLOCK = 1024      # lanes of the row sum; with NUM_WARPS it fixes the summation order (never the batch)
NUM_WARPS = 4

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _z(row_ptr, cols, V, temperature, TEMPERED: tl.constexpr):
    """logits[cols] in fp32, divided by the temperature (one IEEE division); -inf past V."""
    z = tl.load(row_ptr + cols, mask=cols < V, other=_NEG_INF).to(tl.float32)
    if TEMPERED:
        z = tl.math.div_rn(z, tl.zeros_like(z) + temperature)
    return z


@triton.jit
def _lse_kernel(x_ptr, tok_ptr, lse_ptr, logp_ptr, V, temperature, c_ptr, BLOCK_: tl.constexpr,
                TEMPERED: tl.constexpr, HAS_TOK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * V
    lanes = tl.arange(0, BLOCK_)
    m = tl.full([BLOCK_], _NEG_INF, tl.float32)
    for v0 in range(0, V, BLOCK_):
        m = tl.maximum(m, _z(row_ptr, v0 + lanes, V, temperature, TEMPERED))
    mx = tl.max(m, axis=0)   # (a NaN logit may be passed over here; its lane's exp(NaN) makes the sum NaN below)
    acc = tl.zeros([BLOCK_], tl.float32)
    for v0 in range(0, V, BLOCK_):
        z = _z(row_ptr, v0 + lanes, V, temperature, TEMPERED)
        acc += _exp(z - mx, LIBDEVICE)
    lse = mx + _log(tl.sum(acc, axis=0), c_ptr)
    tl.store(lse_ptr + row, lse)
    if HAS_TOK:
        one = tl.arange(0, 1)
        zt = _z(row_ptr, tl.load(tok_ptr + row + one), V, temperature, TEMPERED)
        tl.store(logp_ptr + row + one, zt - lse)


def _launch(logits: torch.Tensor, tokens: torch.Tensor | None, temperature: float):
    x = C.aligned(logits.reshape(-1, logits.shape[-1]))
    rows, vocab = x.shape
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    logp = torch.empty(rows if tokens is not None else 0, dtype=torch.float32, device=x.device)
    if rows:
        tok = tokens.reshape(-1).long().contiguous() if tokens is not None else lse
        _lse_kernel[(rows,)](x, tok, lse, logp, vocab, float(temperature), _log_constants(x.device),
                             BLOCK_=BLOCK, TEMPERED=temperature != 1.0, HAS_TOK=tokens is not None,
                             LIBDEVICE=not C.INTERPRET, num_warps=NUM_WARPS, **C.LAUNCH)
    return logp, lse


def row_lse(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """lse of each row of ``logits`` [..., V] (bf16/fp16/fp32) divided by ``temperature``: fp32 [rows]."""
    return _launch(logits, None, temperature)[1]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(z[token] - lse, lse) per row of ``logits`` [R, V], z = logits / temperature in fp32; ``tokens``
    [R] must be in [0, V) (the caller checks: the kernel reads logits[row, token] unchecked)."""
    return _launch(logits, tokens, temperature)
