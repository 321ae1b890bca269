"""rlk::all_gather / rlk::reduce_scatter: deterministic collectives along a tensor dim.

    all_gather(x, dim, group_name)     -> x's shape with shape[dim] * world_size
                                          (rank r's block at position r): exact
    reduce_scatter(x, dim, group_name) -> x's shape with shape[dim] / world_size:
                                          block r of the sum over ranks, summed in
                                          ascending rank order in fp32

Each is the other's gradient. ``group_name`` is a ProcessGroup's ``group_name``; the
public functions take the group itself (None: the default group). Checks run before
any communication, so bad input raises on the rank that has it before it sends anything;
the other ranks then wait until the process group's timeout. To make every rank raise
together, check inputs across ranks first (rlk_ops.distributed.checks.preflight).
The checks are local: each rank's ``x`` must have the same shape and dtype, which nothing
here compares across ranks (that would cost a second collective per call). With shapes or
dtypes that differ between ranks, gloo has aborted a rank's process and another rank has
returned uninitialised memory (a session 31 audit). The block's callers
(rlk_ops.distributed) compare them in their preflight.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl


def group_name(group=None) -> str:
    """The registered name of ``group`` (None: the default group) for the op schemas."""
    if not dist.is_available() or not dist.is_initialized():
        raise V.RlkInputError(
            "rlk collectives: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (or rlk_ops.distributed.init_mesh) first")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise V.RlkInputError(f"rlk collectives: group must be a torch.distributed ProcessGroup or None (the "
                              f"default group), got {type(group).__name__} {group!r}")
    return group.group_name


def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order. Differentiable."""
    V.tensors("all_gather", x=x)
    return torch.ops.rlk.all_gather(x, V.int_arg("all_gather", "dim", dim), group_name(group))


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks (fixed rank order, fp32) and keep this rank's block of ``dim``."""
    V.tensors("reduce_scatter", x=x)
    return torch.ops.rlk.reduce_scatter(x, V.int_arg("reduce_scatter", "dim", dim), group_name(group))


define("all_gather")


@impl("all_gather")
def _all_gather(x, dim, group_name):
    ws = _check("all_gather", x, dim, group_name)
    del ws
    return kernel_for("all_gather", x.device)(x, dim % x.dim(), group_name)


@fake("all_gather")
def _all_gather_fake(x, dim, group_name):
    ws = _check("all_gather", x, dim, group_name)
    shape = list(x.shape)
    shape[dim % x.dim()] *= ws
    return x.new_empty(shape)


define("reduce_scatter")


@impl("reduce_scatter")
def _reduce_scatter(x, dim, group_name):
    _check("reduce_scatter", x, dim, group_name)
    return kernel_for("reduce_scatter", x.device)(x, dim % x.dim(), group_name)


@fake("reduce_scatter")
def _reduce_scatter_fake(x, dim, group_name):
    ws = _check("reduce_scatter", x, dim, group_name)
    shape = list(x.shape)
    shape[dim % x.dim()] //= ws
    return x.new_empty(shape)


def _setup_context(ctx, inputs, output):
    _, ctx.dim, ctx.group_name = inputs


def _all_gather_backward(ctx, grad):
    return torch.ops.rlk.reduce_scatter(grad, ctx.dim, ctx.group_name), None, None


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.rlk.all_gather(grad, ctx.dim, ctx.group_name), None, None


autograd("all_gather", _all_gather_backward, _setup_context)
autograd("reduce_scatter", _reduce_scatter_backward, _setup_context)


def _check(op, x, dim, group_name) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        V.fail(op, "torch.distributed is not initialized; call init_process_group first")
    try:
        pg = _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - c10d raises several types here
        V.fail(op, f"group_name {group_name!r} names no process group ({e})")
    ws = dist.get_world_size(pg)
    if x.dim() == 0:
        V.fail(op, "x must have at least 1 dim, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        V.fail(op, f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {V.shape_str(x)}, got {dim}")
    if op == "reduce_scatter":
        V.float_dtype(op, "x", x)
        if x.shape[dim] % ws:
            V.fail(op, f"x.shape[{dim}] = {x.shape[dim]} must be divisible by the world size {ws}")
    return ws
