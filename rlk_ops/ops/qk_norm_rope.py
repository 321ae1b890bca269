"""rlk::qk_norm_rope: Qwen3's q_norm/k_norm followed by RoPE, for q and k in one op.

    q          [..., Hq, D]   (e.g. [T, Hq, D] packed or [B, S, Hq, D] dense)
    k          [..., Hkv, D]  same leading shape, D and dtype as q
    q_weight, k_weight [D]    q's dtype
    positions  [...]          int64, the leading shape, absolute positions >= 0
    eps a normal number of the accumulation dtype (> 0); theta finite and >= 1; rotary_dim even in (0, D]
    -> (q_out, k_out)         q's and k's shapes, contiguous

    q_out = rope(qk_rmsnorm(q, q_weight, eps), positions, theta, rotary_dim)  (bitwise)
    k_out = rope(qk_rmsnorm(k, k_weight, eps), positions, theta, rotary_dim)  (bitwise)

One launch instead of four on CUDA (cos/sin computed once per token for q and k). Every
backend must give exactly the bits of the two ops in sequence; tests check it.

Gradient: rope_bwd then qk_rmsnorm_bwd, the ops the unfused chain's backward calls, so
the gradients are also bitwise those of the unfused chain.
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl
from rlk_ops.ops.rope import _check_values as check_position_values


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, eps: float = 1e-6, theta: float = 1e6,
                 rotary_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(qk_rmsnorm(q))`` and ``rope(qk_rmsnorm(k))`` in one op. Differentiable."""
    op = "qk_norm_rope"
    V.tensors(op, q=q, k=k, q_weight=q_weight, k_weight=k_weight, positions=positions)
    # (a 0-d q: rotary_dim 0 here, and the op's check names q's rank)
    rd = (q.shape[-1] if q.dim() else 0) if rotary_dim is None else V.int_arg(op, "rotary_dim", rotary_dim)
    return torch.ops.rlk.qk_norm_rope(q, k, q_weight, k_weight, positions, V.float_arg(op, "eps", eps),
                                      V.float_arg(op, "theta", theta), rd)


define("qk_norm_rope")


@impl("qk_norm_rope")
def _qk_norm_rope(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    op = "qk_norm_rope"
    _check(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim)
    check_position_values(op, positions)
    return kernel_for(op, q.device)(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim)


@fake("qk_norm_rope")
def _qk_norm_rope_fake(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    _check(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, positions, eps, theta, rotary_dim = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, positions)
    ctx.args = (eps, theta, rotary_dim)


def _backward(ctx, dq_out, dk_out):
    q, k, q_weight, k_weight, positions = ctx.saved_tensors
    eps, theta, rotary_dim = ctx.args
    grads = []
    for x, w, dy in ((q, q_weight, dq_out), (k, k_weight, dk_out)):
        if dy is None:
            grads += [None, None]
            continue
        dx, dw = torch.ops.rlk.qk_rmsnorm_bwd(torch.ops.rlk.rope_bwd(dy, positions, theta, rotary_dim), x, w, eps)
        grads += [dx, dw]
    dq, dqw, dk, dkw = grads
    return dq, dk, dqw, dkw, None, None, None, None


autograd("qk_norm_rope", _backward, _setup_context)


def _check(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    op = "qk_norm_rope"
    V.float_dtype(op, "q", q)
    for name, t in (("q", q), ("k", k)):
        if t.dim() < 2:
            V.fail(op, f"{name} must be [..., heads, head_dim] (at least 2-D), got shape {V.shape_str(t)}")
    V.same_dtype(op, "k", k, "q", q)
    if tuple(k.shape[:-2]) != tuple(q.shape[:-2]):
        V.fail(op, f"k must have q's leading shape {list(q.shape[:-2])}, got {V.shape_str(k)} "
                   f"(q is {V.shape_str(q)})")
    d = q.shape[-1]
    if k.shape[-1] != d:
        V.fail(op, f"k's head_dim ({k.shape[-1]}) must equal q's head_dim ({d})")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        V.ndim(op, name, w, 1, "[head_dim]")
        if w.shape[0] != d:
            V.fail(op, f"{name} must have shape [{d}] (the head_dim), got {V.shape_str(w)}")
        V.same_dtype(op, name, w, "q", q)
    V.check_positions(op, q, positions, "[..., heads, head_dim]")
    V.same_device(op, {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight, "positions": positions})
    V.rms_eps(op, eps, q.dtype)
    if not (theta >= 1 and math.isfinite(theta)):  # MAX_POSITION holds for frequencies <= 1
        V.fail(op, f"theta must be a finite number >= 1 (the RoPE base), got {theta}")
    if rotary_dim <= 0 or rotary_dim > d or rotary_dim % 2:
        V.fail(op, f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim}")
