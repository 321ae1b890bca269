"""Deterministic reductions across ranks, as autograd functions, built on
``rlk::reduce_scatter`` (all_to_all + fp32 sum in ascending rank order) and
``rlk::all_gather`` (exact).

* ``all_reduce``: reduce-scatter then all-gather of the flattened tensor (zero
  padded to a multiple of the group size): every element is summed in rank order.
  Its bits depend on the group size (a different number of fp32 terms).
* ``reduce_forward`` (Megatron's "g"): all-reduce in the forward, identity in the
  backward: the row-parallel o_proj output is replicated over tp, so is its gradient.
* ``reduce_grad`` (Megatron's "f"): identity in the forward, all-reduce of the
  gradient: for tensors replicated over a group whose uses produce partial grads
  (the block input over tp, the weights over cp).
* ``fanout`` / ``canonical_reduce``: the topology-invariant versions. A tensor is
  handed out as n aliases, one per canonical cell (token chunk, kv-head group); the
  cells' gradients are all-gathered (exact) and summed in fp32 in one fixed global
  order that does not depend on how cells are spread over ranks.
"""
from __future__ import annotations

import torch

Groups = tuple[tuple[str, int], ...]  # (group_name, world_size) per step, applied in order


def all_reduce(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    n = x.numel()
    flat = x.reshape(-1)
    pad = (-n) % world_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    part = torch.ops.rlk.reduce_scatter(flat, 0, group_name)
    return torch.ops.rlk.all_gather(part, 0, group_name)[:n].reshape(x.shape)


def ordered_sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right in fp32 (fp64 for fp64), one rounding."""
    if parts.shape[0] == 1:
        return parts[0].to(dtype)
    acc_t = torch.float64 if dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_t)
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i].to(acc_t)
    return acc.to(dtype)


def _gather_and_sum(parts: torch.Tensor, gathers: tuple[str, ...], order: tuple[int, ...], dtype) -> torch.Tensor:
    for name in gathers:  # each all_gather prepends that group's rank to the cell index
        parts = torch.ops.rlk.all_gather(parts.unsqueeze(0), 0, name).flatten(0, 1)
    return ordered_sum(torch.stack([parts[i] for i in order]), dtype)


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name, world_size):
        return all_reduce(x, group_name, world_size)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for name, ws in ctx.groups:
            grad = all_reduce(grad, name, ws)
        return grad, None


class _Fanout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, gathers, order):
        ctx.gathers, ctx.order = gathers, order
        return tuple(x.view_as(x) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        return _gather_and_sum(torch.stack(grads), ctx.gathers, ctx.order, grads[0].dtype), None, None, None


class _CanonicalReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts, gathers, order):
        ctx.n = parts.shape[0]
        return _gather_and_sum(parts, gathers, order, parts.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(0).expand(ctx.n, *grad.shape).contiguous(), None, None


def reduce_forward(x: torch.Tensor, group: tuple[str, int] | None) -> torch.Tensor:
    return x if group is None else _ReduceForward.apply(x, *group)


def reduce_grad(x: torch.Tensor, groups: Groups) -> torch.Tensor:
    return _ReduceGrad.apply(x, groups) if groups else x


def fanout(x: torch.Tensor, n: int, gathers: tuple[str, ...], order: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """n aliases of x; x's gradient = sum over every rank's cells, in ``order``
    (indices into the cells gathered over ``gathers``, in that nesting)."""
    return _Fanout.apply(x, n, gathers, order)


def canonical_reduce(parts: torch.Tensor, gathers: tuple[str, ...], order: tuple[int, ...]) -> torch.Tensor:
    """Sum of every rank's ``parts`` [n_local, ...] in ``order``; gradient: identity per part."""
    return _CanonicalReduce.apply(parts, gathers, order)
