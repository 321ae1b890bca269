"""rlk::rope: rotate-half (NeoX / Qwen3) rotary embedding.

    x          [..., H, D]  (e.g. [T, H, D] packed or [B, S, H, D] dense)
    positions  [...]        int64, x's leading shape, absolute token positions >= 0
    theta      float >= 1   (Qwen3: 1e6; frequencies <= 1 keep the angles within MAX_POSITION)
    rotary_dim even, 0 < rotary_dim <= D (None in the public fn: D)
    y          x's shape, contiguous, x.dtype

    inv_freq_i = theta ** (-2i / rotary_dim); angle = position * inv_freq (fp32)
    y[:r/2] = x1*cos - x2*sin ; y[r/2:r] = x2*cos + x1*sin ; y[r:] = x[r:]
    (fp32 arithmetic, one final rounding.)

Gradient: the inverse rotation, ``rlk::rope_bwd(dy, positions, theta, rotary_dim)``.
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.cpu.numerics import SINCOS_MAX_ABS
from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl

# The largest position whose angle (position * inv_freq_0 = position) the reference
# sincos reduces exactly; every other angle is smaller while theta >= 1 (inv_freq_i <= 1).
MAX_POSITION = int(SINCOS_MAX_ABS)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 1e6, rotary_dim: int | None = None) -> torch.Tensor:
    """Apply RoPE to q or k. Differentiable in x."""
    V.tensors("rope", x=x, positions=positions)
    # (a 0-d x: rotary_dim 0 here, and the op's check names x's rank)
    rd = (x.shape[-1] if x.dim() else 0) if rotary_dim is None else V.int_arg("rope", "rotary_dim", rotary_dim)
    return torch.ops.rlk.rope(x, positions, V.float_arg("rope", "theta", theta), rd)


define("rope")


@impl("rope")
def _rope(x, positions, theta, rotary_dim):
    _check("rope", x, positions, theta, rotary_dim)
    _check_values("rope", positions)
    return kernel_for("rope", x.device)(x, positions, theta, rotary_dim)


@fake("rope")
def _rope_fake(x, positions, theta, rotary_dim):
    _check("rope", x, positions, theta, rotary_dim)
    return x.new_empty(x.shape)


define("rope_bwd")


@impl("rope_bwd")
def _rope_bwd(dy, positions, theta, rotary_dim):
    _check("rope_bwd", dy, positions, theta, rotary_dim, name="dy")
    _check_values("rope_bwd", positions)
    return kernel_for("rope_bwd", dy.device)(dy, positions, theta, rotary_dim)


@fake("rope_bwd")
def _rope_bwd_fake(dy, positions, theta, rotary_dim):
    _check("rope_bwd", dy, positions, theta, rotary_dim, name="dy")
    return dy.new_empty(dy.shape)


def _setup_context(ctx, inputs, output):
    _, positions, theta, rotary_dim = inputs
    ctx.save_for_backward(positions)
    ctx.theta, ctx.rotary_dim = theta, rotary_dim


def _backward(ctx, dy):
    (positions,) = ctx.saved_tensors
    return torch.ops.rlk.rope_bwd(dy, positions, ctx.theta, ctx.rotary_dim), None, None, None


autograd("rope", _backward, _setup_context)


def _check(op, x, positions, theta, rotary_dim, name="x"):
    V.float_dtype(op, name, x)
    if x.dim() < 2:
        V.fail(op, f"{name} must be [..., heads, head_dim] (at least 2-D), got shape {V.shape_str(x)}")
    V.check_positions(op, x, positions, "[..., heads, head_dim]")
    V.same_device(op, {name: x, "positions": positions})
    d = x.shape[-1]
    if rotary_dim <= 0 or rotary_dim > d or rotary_dim % 2:
        V.fail(op, f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim}")
    if not (theta >= 1 and math.isfinite(theta)):  # MAX_POSITION holds for frequencies <= 1
        V.fail(op, f"theta must be a finite number >= 1 (the RoPE base), got {theta}")


def _check_values(op, positions):
    V.check_positions_values(op, positions, MAX_POSITION)
