"""rlk::all_gather / rlk::reduce_scatter: deterministic collectives along a tensor dim.

    all_gather(x, dim, group_name)     -> x's shape with shape[dim] * world_size
                                          (rank r's block at position r): exact
    reduce_scatter(x, dim, group_name) -> x's shape with shape[dim] / world_size:
                                          block r of the sum over ranks, summed in
                                          ascending rank order in fp32

Each is the other's gradient. ``group_name`` is a ProcessGroup's ``group_name``; the
public functions take the group itself (None: the default group).

Every rank must pass an ``x`` of one shape and dtype: with shapes or dtypes that differ
between ranks, gloo has aborted a rank's process and another rank has returned
uninitialised memory (a session 31 audit). So the public functions check across ranks
first (``check=True``, eager): every rank checks its own arguments, and one small
all_gather of metadata (``rlk_ops.distributed.checks.preflight``) compares shape, dtype,
device and dim, after which either every rank raises the same ``DistributedInputError``
(naming the rank and the argument) or every rank goes on. That costs one extra
collective per call; ``check=False`` skips it, and it is skipped while torch.compile
traces (compiled callers check beforehand, as ``ParallelQwen3Attention.prepare`` does).
``check`` decides whether that exchange is sent, so, like ``group``, it must be the same on
every rank: a rank with ``check=False`` beside ranks with ``True`` sends its data into their
exchange (garbage or an abort, which no check can see without the exchange it skips).
Without the cross-rank check, bad input raises on the rank that has it before it sends
anything, and the other ranks wait until the process group's timeout.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl


def group_name(group=None, op: str = "collectives") -> str:
    """The registered name of ``group`` (None: the default group) for the op schemas."""
    if not dist.is_available() or not dist.is_initialized():
        raise V.RlkInputError(
            f"rlk {op}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (or rlk_ops.distributed.init_mesh) first")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:   # what new_group returns on a rank outside it
        raise V.RlkInputError(f"rlk {op}: this process (rank {dist.get_rank()}) is not a member of group; call it "
                              f"only on the group's ranks")
    if not isinstance(group, dist.ProcessGroup):
        raise V.RlkInputError(f"rlk {op}: group must be a torch.distributed ProcessGroup or None (the "
                              f"default group), got {type(group).__name__} {group!r}")
    return group.group_name


def all_gather(x: torch.Tensor, dim: int = 0, group=None, check: bool = True) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order. Differentiable.
    ``check``: compare shape, dtype, device and dim across ranks first (module doc)."""
    name, dim = _public("all_gather", x, dim, group, check)
    return torch.ops.rlk.all_gather(x, dim, name)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None, check: bool = True) -> torch.Tensor:
    """Sum ``x`` over ranks (fixed rank order, fp32) and keep this rank's block of ``dim``.
    ``check``: compare shape, dtype, device and dim across ranks first (module doc)."""
    name, dim = _public("reduce_scatter", x, dim, group, check)
    return torch.ops.rlk.reduce_scatter(x, dim, name)


# the preflight's row holds 32 values: 4, these dims one by one, and a hash of any dims past them
_SHAPE_DIMS = 27
_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str))
_DEVICES = ("cpu", "cuda", "meta", "xpu", "mps", "hpu", "mtia", "xla", "lazy", "privateuseone")


def _show_device(i: int) -> str:
    return repr(_DEVICES[i]) if 0 <= i < len(_DEVICES) else "a device type other than " + ", ".join(_DEVICES)


def _check_flag(op, check) -> None:
    if not isinstance(check, bool):
        V.fail(op, f"check must be a bool, got {type(check).__name__} {V.short_repr(check)}")


def _public(op, x, dim, group, check):
    """The public functions' checks. ``check`` (eager): every rank collects its own problem and
    the ranks compare their metadata in one preflight, so all raise together or none does. A
    ``check`` that is not a bool takes part in the exchange as a problem, so that every rank raises
    (raised on its rank alone, it left the others waiting). ``check`` decides whether the exchange
    is sent, so it must be the same on every rank, like ``group``: a rank with False would send its
    data into the others' exchange (module doc)."""
    if torch.compiler.is_compiling():   # what the op and its fake do not check; the rest runs there, where
        _check_flag(op, check)          # c10d's group lookup does not break the graph
        V.tensors(op, x=x)
        return group_name(group, op), V.int_arg(op, "dim", dim)
    if not dist.is_available() or not dist.is_initialized():  # one process: its arguments first, as before
        V.tensors(op, x=x)
        V.int_arg(op, "dim", dim)
    name = group_name(group, op)  # a bad group raises here, on its rank: without a group nothing can be compared
    state = {}

    def local():
        _check_flag(op, check)
        V.tensors(op, x=x)
        state["dim"] = V.int_arg(op, "dim", dim)
        _check(op, x, state["dim"], name)

    if check is False or dist.get_world_size(group) == 1:   # one rank: nothing to compare
        local()
        return name, state["dim"]
    from rlk_ops.distributed.checks import collect, preflight, show_choice

    problem = collect([local])
    ok = problem is None
    shape = tuple(x.shape) if ok else ()
    meta = {"x.dim()": len(shape) if ok else -1,
            "x.dtype": _DTYPES.index(x.dtype) if ok else -1,
            "x.device": _DEVICES.index(x.device.type) if ok and x.device.type in _DEVICES else len(_DEVICES),
            # dim as the dim it names: -1 and 1 of a 2-d x gather the same way
            "dim": state["dim"] % len(shape) if ok else -1}
    meta.update({f"x.shape[{i}]": shape[i] if i < len(shape) else -1 for i in range(_SHAPE_DIMS)})
    rest = ",".join(map(str, shape[_SHAPE_DIMS:])).encode()
    meta[f"x.shape past dim {_SHAPE_DIMS - 1} (hashed)"] = \
        int.from_bytes(hashlib.blake2b(rest, digest_size=8).digest(), "little") >> 1
    preflight(group, f"rlk_ops.{op}", problem, meta,
              show={"x.dtype": show_choice(_DTYPES, none=-1), "x.device": _show_device})
    return name, state["dim"]


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


# all_gather moves x's bytes (kernels/c10d.py), so every dtype travels, on gloo too (int16 and float8
# once failed there with gloo's "Invalid scalar type"), but a quantized one: its values are bytes plus a
# scale and zero point that the bytes do not carry
QUANTIZED_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2",
                                                                        "quint2x4")) if isinstance(d, torch.dtype))


def _check(op, x, dim, group_name) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        V.fail(op, "torch.distributed is not initialized; call init_process_group first")
    try:
        pg = _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - c10d raises several types here
        V.fail(op, f"group_name {group_name!r} names no process group ({e})")
    ws = dist.get_world_size(pg)
    if op == "all_gather" and x.dtype in QUANTIZED_DTYPES:
        V.fail(op, f"x must not be quantized (its bytes do not carry its scale), got {x.dtype}")
    if x.dim() == 0:
        V.fail(op, "x must have at least 1 dim, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        V.fail(op, f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {V.shape_str(x)}, got {dim}")
    if op == "reduce_scatter":
        V.float_dtype(op, "x", x)
        if x.shape[dim] % ws:
            V.fail(op, f"x.shape[{dim}] = {x.shape[dim]} must be divisible by the world size {ws}")
    return ws
