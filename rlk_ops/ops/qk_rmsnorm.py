"""rlk::qk_rmsnorm: per-head RMSNorm over the last dim, in Qwen3's order.

    x       [..., D]   (q or k: [T, H, D] or [B, S, H, D]); bf16/fp16/fp32/fp64
    weight  [D]        same dtype as x
    y       x's shape, contiguous, x.dtype

    y = weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)

Gradient: ``rlk::qk_rmsnorm_bwd(dy, x, weight, eps) -> (dx, dweight)``, its own op
because dweight reduces over every token and head (fixed order, no atomics).
"""
from __future__ import annotations


import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl


def qk_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3 q_norm/k_norm. Differentiable."""
    V.tensors("qk_rmsnorm", x=x, weight=weight)
    return torch.ops.rlk.qk_rmsnorm(x, weight, V.float_arg("qk_rmsnorm", "eps", eps))


define("qk_rmsnorm")


@impl("qk_rmsnorm")
def _qk_rmsnorm(x, weight, eps):
    _check("qk_rmsnorm", x, weight, eps)
    return kernel_for("qk_rmsnorm", x.device)(x, weight, eps)


@fake("qk_rmsnorm")
def _qk_rmsnorm_fake(x, weight, eps):
    _check("qk_rmsnorm", x, weight, eps)
    return x.new_empty(x.shape)


define("qk_rmsnorm_bwd")


@impl("qk_rmsnorm_bwd")
def _qk_rmsnorm_bwd(dy, x, weight, eps):
    _check("qk_rmsnorm_bwd", x, weight, eps)
    _check_grad("qk_rmsnorm_bwd", dy, x)
    dx, dw = kernel_for("qk_rmsnorm_bwd", x.device)(dy, x, weight, eps)
    # contiguous, as the fake says: the CPU kernel's dx took dy's strides (a transposed dy made Inductor's
    # stride assert fail in a compiled backward; a session 38 audit)
    return dx.contiguous(), dw.contiguous()


@fake("qk_rmsnorm_bwd")
def _qk_rmsnorm_bwd_fake(dy, x, weight, eps):
    _check("qk_rmsnorm_bwd", x, weight, eps)
    _check_grad("qk_rmsnorm_bwd", dy, x)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight = torch.ops.rlk.qk_rmsnorm_bwd(dy, x, weight, ctx.eps)
    return dx, dweight, None


autograd("qk_rmsnorm", _backward, _setup_context)


def _check(op, x, weight, eps):
    V.float_dtype(op, "x", x)
    if x.dim() < 1:
        V.fail(op, f"x must have at least 1 dim [..., head_dim], got shape {V.shape_str(x)}")
    V.ndim(op, "weight", weight, 1, "[head_dim]")
    if weight.shape[0] != x.shape[-1]:
        V.fail(op, f"weight must have shape [{x.shape[-1]}] (x's head_dim), got {V.shape_str(weight)}")
    V.same_dtype(op, "weight", weight, "x", x)
    V.same_device(op, {"x": x, "weight": weight})
    V.rms_eps(op, eps, x.dtype)


def _check_grad(op, dy, x):
    if dy.shape != x.shape:
        V.fail(op, f"dy must have x's shape {V.shape_str(x)}, got {V.shape_str(dy)}")
    V.same_dtype(op, "dy", dy, "x", x)
    V.same_device(op, {"x": x, "dy": dy})
