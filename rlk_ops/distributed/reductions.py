"""Deterministic reductions across ranks, as autograd functions, built on
``rlk::reduce_scatter`` (all_to_all + fp32 sum in ascending rank order) and
``rlk::all_gather`` (exact).

* ``reduce_forward`` (Megatron's "g"): all-reduce in the forward, identity in the
  backward: the row-parallel o_proj output is replicated over tp, so is its gradient.
* ``sync_grads`` (Megatron's "f", for several tensors at once): identity in the
  forward; in the backward the gradients are all-reduced, first over cp, then over tp.
* ``fanout`` / ``canonical_reduce``: the topology-invariant versions. A tensor is
  handed out as aliases, one per canonical cell (token chunk, kv-head group); the
  cells' gradients are all-gathered (exact) and summed in fp32 in one fixed global
  order that does not depend on how the cells are spread over ranks.

An all-reduce is a reduce-scatter then an all-gather of the flattened tensor (zero
padded to a multiple of the group size): each element is summed in rank order, and
its bits depend on the group size (a different number of fp32 terms).

Collective order. Every rank must issue the same collectives in the same order, but
a compiled graph is free to reorder nodes that do not depend on each other: measured
on torch 2.13, Inductor's ``reorder_for_peak_memory`` scheduled two independent
``rlk::all_gather`` calls of one backward graph in different orders on two ranks
(their graphs differ in rank-dependent sizes), and gloo aborted on the size mismatch;
registering the ops as ordered effects (``with_effects`` tokens) did not prevent it.
So the code never leaves two collectives independent: tensors that travel together
are concatenated into one buffer (K with V; all gradients of one group), and each
collective's input is built from the previous one's output, so the collectives of a
block form one data-dependent chain in the forward and one in the backward.
"""
from __future__ import annotations

import torch


def all_reduce(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"all_reduce: world_size must be a positive int, got {world_size!r}")
    n = x.numel()
    flat = x.reshape(-1)
    pad = (-n) % world_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    part = torch.ops.rlk.reduce_scatter(flat, 0, group_name)
    return torch.ops.rlk.all_gather(part, 0, group_name)[:n].reshape(x.shape)


def ordered_sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right in fp32 (fp64 for fp64), one rounding."""
    if parts.dim() == 0 or parts.shape[0] == 0:
        raise ValueError(f"ordered_sum needs at least one part along dim 0, got shape {list(parts.shape)}")
    if parts.shape[0] == 1:
        return parts[0].to(dtype)
    acc_t = torch.float64 if dtype == torch.float64 else torch.float32
    acc = parts[0].to(acc_t)
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i].to(acc_t)
    return acc.to(dtype)


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1)


def _chain(buf: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Append one element of the previous collective's output to ``buf`` (dropped again
    after the collective): a data dependency that forces the order (module doc)."""
    if prev is None:
        return buf, 0
    return torch.cat([buf, prev.reshape(-1)[:1].to(buf.dtype)]), 1


def _unflat(flat, like, lead=()):
    """Split the last dim of ``flat`` [*lead, sum numel] back into tensors shaped like ``like``."""
    sizes = [t.numel() for t in like]
    return [p.reshape(*lead, *t.shape) for p, t in zip(flat.split(sizes, dim=-1), like)]


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name, world_size):
        return all_reduce(x, group_name, world_size)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def reduce_forward(x: torch.Tensor, group: tuple[str, int] | None) -> torch.Tensor:
    return x if group is None else _ReduceForward.apply(x, *group)


class _SyncGrads(torch.autograd.Function):
    """kinds[i] in {"cp", "tp", "cp+tp"}: which groups reduce tensor i's gradient."""

    @staticmethod
    def forward(ctx, cp, tp, kinds, *tensors):
        ctx.cp, ctx.tp, ctx.kinds = cp, tp, kinds
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        cp_ids = [i for i, k in enumerate(ctx.kinds) if "cp" in k]
        tp_ids = [i for i, k in enumerate(ctx.kinds) if "tp" in k and "cp" not in k] + \
                 [i for i, k in enumerate(ctx.kinds) if k == "cp+tp"]
        prev = None
        for group, ids in ((ctx.cp, cp_ids), (ctx.tp, tp_ids)):  # cp first, then tp, chained
            if group is None or not ids:
                continue
            buf, extra = _chain(_flat([grads[i] for i in ids]), prev)
            prev = all_reduce(buf, *group)
            for i, g in zip(ids, _unflat(prev[:prev.numel() - extra], [grads[i] for i in ids])):
                grads[i] = g
        return (None, None, None, *grads)


def sync_grads(tensors, kinds, cp: tuple[str, int] | None, tp: tuple[str, int] | None):
    """Aliases of ``tensors``; in the backward their gradients are all-reduced over the
    groups named by ``kinds`` ("cp", "tp" or "cp+tp"), in one chain: one all-reduce
    over cp of every cp gradient, then one over tp (whose buffer includes the cp results)."""
    kinds = tuple(k for k in kinds)
    tensors = tuple(tensors)
    if len(kinds) != len(tensors) or any(k not in ("cp", "tp", "cp+tp") for k in kinds):
        raise ValueError(f"sync_grads needs one kind per tensor, each 'cp', 'tp' or 'cp+tp': got {len(tensors)} "
                         f"tensors and kinds {kinds!r}")
    if (cp is None or not any("cp" in k for k in kinds)) and (tp is None or not any("tp" in k for k in kinds)):
        return tuple(tensors)
    return _SyncGrads.apply(cp, tp, kinds, *tensors)


class _Fanout(torch.autograd.Function):
    """specs[i] = (n_cells, gathers, order) for tensor i; see ``fanout``."""

    @staticmethod
    def forward(ctx, specs, cp_name, tp_name, *tensors):
        ctx.specs, ctx.cp_name, ctx.tp_name = specs, cp_name, tp_name
        return tuple(t.view_as(t) for t, (n, _, _) in zip(tensors, specs) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        parts, start = [], 0
        for n, _, _ in ctx.specs:  # the cells' gradients of each tensor: [n, *shape]
            parts.append(torch.stack(grads[start:start + n]))
            start += n
        prev = None
        for name, axis in ((ctx.cp_name, "cp"), (ctx.tp_name, "tp")):  # cp first, then tp, chained
            ids = [i for i, (_, gathers, _) in enumerate(ctx.specs) if axis in gathers]
            if name is None or not ids:
                continue
            buf, extra = _chain(_flat([parts[i] for i in ids]), prev)
            prev = torch.ops.rlk.all_gather(buf.unsqueeze(0), 0, name)  # [ws, numel (+1)]
            gathered = prev[:, :prev.shape[1] - extra]
            for i, p in zip(ids, _unflat(gathered, [parts[i] for i in ids], (prev.shape[0],))):
                parts[i] = p.flatten(0, 1)  # [ws * cells, *shape]: the rank's index leads
        for p, (_, _, order) in zip(parts, ctx.specs):  # the same on every rank: all raise
            if sorted(order) != list(range(p.shape[0])):
                raise ValueError(f"fanout: order must be a permutation of the {p.shape[0]} gathered cells, "
                                 f"got {order!r}")
        sums = [ordered_sum(torch.stack([p[j] for j in order]), p.dtype)
                for p, (_, _, order) in zip(parts, ctx.specs)]
        return (None, None, None, *sums)


def fanout(tensors, specs, cp_name: str | None, tp_name: str | None):
    """For tensor i, ``specs[i] = (n, gathers, order)``: n aliases (one per local cell);
    its gradient is the sum of every rank's cell gradients, all-gathered over
    ``gathers`` ("cp", then "tp"; the gather prepends the rank), taken in ``order``
    (indices into the gathered cells) in fp32. All tensors share one gather per group.
    Returns the aliases of every tensor, flattened in order."""
    specs = tuple((n, tuple(g for g in gathers if {"cp": cp_name, "tp": tp_name}[g]), tuple(order))
                  for n, gathers, order in specs)
    return _Fanout.apply(specs, cp_name, tp_name, *tensors)


class _CanonicalReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts, group_name, order):
        ctx.n = parts.shape[0]
        if group_name is not None:
            parts = torch.ops.rlk.all_gather(parts, 0, group_name)
        if sorted(order) != list(range(parts.shape[0])):  # the same on every rank: all raise
            raise ValueError(f"canonical_reduce: order must be a permutation of the {parts.shape[0]} gathered "
                             f"parts, got {order!r}")
        return ordered_sum(torch.stack([parts[i] for i in order]), parts.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(0).expand(ctx.n, *grad.shape).contiguous(), None, None


def canonical_reduce(parts: torch.Tensor, group_name: str | None, order: tuple[int, ...]) -> torch.Tensor:
    """Sum of every rank's ``parts`` [n_local, ...] (gathered over ``group_name``) in
    ``order``, fp32, one rounding. Gradient: identity for each part (the result is
    replicated over the group, like Megatron's row-parallel output)."""
    return _CanonicalReduce.apply(parts, group_name, tuple(order))
