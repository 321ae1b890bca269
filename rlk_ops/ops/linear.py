"""rlk::linear: batch-invariant projection y = x @ weight.T (+ bias).

    x [..., K], weight [N, K], bias [N] or None (all one dtype) -> y [..., N]

A row's result never depends on how many rows came with it (fixed reduction order
over K, fp32 accumulation, no split-K). Gradients are ops of their own:
``rlk::linear_bwd(dy, x, weight) -> (dx, dweight)`` and ``rlk::linear_bias_bwd(dy)``.
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias``. Differentiable."""
    V.tensors("linear", ("bias",), x=x, weight=weight, bias=bias)
    return torch.ops.rlk.linear(x, weight, bias)


define("linear")


@impl("linear")
def _linear(x, weight, bias):
    _check("linear", x, weight, bias)
    return kernel_for("linear", x.device)(x, weight, bias)


@fake("linear")
def _linear_fake(x, weight, bias):
    _check("linear", x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


define("linear_bwd")


@impl("linear_bwd")
def _linear_bwd(dy, x, weight):
    _check("linear_bwd", x, weight, None)
    _check_dy("linear_bwd", dy, x, weight)
    return kernel_for("linear_bwd", x.device)(dy, x, weight)


@fake("linear_bwd")
def _linear_bwd_fake(dy, x, weight):
    _check("linear_bwd", x, weight, None)
    _check_dy("linear_bwd", dy, x, weight)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


define("linear_bias_bwd")


@impl("linear_bias_bwd")
def _linear_bias_bwd(dy):
    _check_bias_dy(dy)
    return kernel_for("linear_bias_bwd", dy.device)(dy)


@fake("linear_bias_bwd")
def _linear_bias_bwd_fake(dy):
    _check_bias_dy(dy)
    return dy.new_empty((dy.shape[-1],))


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.rlk.linear_bwd(dy, x, weight)
    db = torch.ops.rlk.linear_bias_bwd(dy) if ctx.has_bias else None
    return dx, dw, db


autograd("linear", _backward, _setup_context)


def _check(op, x, weight, bias):
    V.float_dtype(op, "x", x)
    if x.dim() < 1:
        V.fail(op, f"x must be [..., in_features], got shape {V.shape_str(x)}")
    V.ndim(op, "weight", weight, 2, "[out_features, in_features]")
    if weight.shape[1] != x.shape[-1]:
        V.fail(op, f"weight must be [out_features, {x.shape[-1]}] (x's in_features), got {V.shape_str(weight)}")
    V.same_dtype(op, "weight", weight, "x", x)
    if bias is not None:
        V.ndim(op, "bias", bias, 1, "[out_features]")
        if bias.shape[0] != weight.shape[0]:
            V.fail(op, f"bias must have shape [{weight.shape[0]}] (weight's out_features), got {V.shape_str(bias)}")
        V.same_dtype(op, "bias", bias, "x", x)
    V.same_device(op, {"x": x, "weight": weight, "bias": bias})


def _check_dy(op, dy, x, weight):
    want = (*x.shape[:-1], weight.shape[0])
    if tuple(dy.shape) != tuple(want):
        V.fail(op, f"dy must have shape {list(want)}, got {V.shape_str(dy)}")
    V.same_dtype(op, "dy", dy, "x", x)
    V.same_device(op, {"x": x, "dy": dy})


def _check_bias_dy(dy):
    V.float_dtype("linear_bias_bwd", "dy", dy)
    if dy.dim() < 1:
        V.fail("linear_bias_bwd", f"dy must be [..., out_features], got shape {V.shape_str(dy)}")
