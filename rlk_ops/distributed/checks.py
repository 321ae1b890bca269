"""Cross-rank preflight: catch bad input on every rank before the first collective.

A local check that raises on one rank while the others enter an all_gather leaves
them waiting until the process-group timeout. So distributed entry points collect
their local problem (or None) and a few metadata ints, and every rank calls
``preflight``: one all_gather of a small int64 tensor (the problem text rides along
as bytes), after which every rank raises the same error, naming the rank and the
argument, or proceeds knowing that all ranks agree.
"""
from __future__ import annotations

import math
import struct
from typing import Callable

import torch
import torch.distributed as dist

from rlk_ops.ops._validate import RlkInputError

_MSG_BYTES = 480
# metadata values a row carries: the row has one length on every rank whatever each rank
# passes (gloo aborts the process on an all_gather of rows of different lengths)
_MAX_META = 32


# marks a verdict that preflight_mesh carries from one stage into the next: raised as it is
_RELAYED = "\x1e"


class DistributedInputError(RlkInputError):
    """Bad input to a distributed rlk entry point, raised on every rank of the group (an
    ``RlkInputError``, so one ``except`` catches bad input to any rlk function)."""


def require_initialized(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedInputError(
            f"{what}: torch.distributed is not initialized; call rlk_ops.distributed.init_mesh(tp, cp) "
            f"(or torch.distributed.init_process_group with a timeout) first")


def metadata_device(group) -> torch.device:
    """Where the preflight's small metadata rows go: the CPU (gloo) when the group has a CPU backend,
    as init_mesh's "cpu:gloo,cuda:nccl" groups do (until session 33 any "nccl" in the name sent them
    over NCCL, one device sync each); CUDA for an NCCL-only group."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(name: str, value) -> tuple[int, str | None]:
    """A metadata value as one int64: an int as itself, a float as its IEEE bits (so that ranks
    compare floats exactly); anything else is this rank's problem (the row still goes out)."""
    if isinstance(value, bool):
        return int(value), None
    if isinstance(value, int) and -(2 ** 63) <= value < 2 ** 63:
        return value, None
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0], None
    return 0, f"metadata {name} must be an int or a float, got {value!r}"


def _decode(value: int, like) -> str:
    if isinstance(like, float):
        x = struct.unpack("<d", struct.pack("<q", value))[0]
        return repr(x) if not math.isnan(x) else "nan"
    return str(value)


def preflight(group, what: str, problem: str | None, metadata: dict[str, int | float],
              show: dict[str, Callable[[int | float], str]] | None = None) -> None:
    """All ranks of ``group`` call this with their local ``problem`` (None if fine) and
    ``metadata`` (same keys on every rank; ints, or floats compared bit for bit). Raises
    ``DistributedInputError`` on every rank if any rank had a problem or any metadata value
    differs across ranks. Every rank sends one row of the same length whatever it passed,
    so a rank with other keys, or a value that is not a number, is named, not a crash.
    ``show``: for a value that is a code (a dtype's, a choice's index, a sentinel for None), how
    the disagreement names it; other values are named as they are."""
    require_initialized(what)
    names = list(metadata)
    values = []
    for n in names[:_MAX_META]:
        v, bad = _encode(n, metadata[n])
        values.append(v)
        problem = problem or bad
    if len(names) > _MAX_META:
        problem = problem or f"preflight carries at most {_MAX_META} metadata values, got {len(names)}"
    text = (problem or "").encode()[:_MSG_BYTES]
    row = torch.zeros(3 + _MAX_META + _MSG_BYTES, dtype=torch.int64)
    row[0] = 1 if problem is None else 0
    row[1] = len(names)
    row[2] = len(text)
    row[3:3 + len(values)] = torch.tensor(values, dtype=torch.int64)
    row[3 + _MAX_META:3 + _MAX_META + len(text)] = torch.tensor(list(text), dtype=torch.int64)
    device = metadata_device(group)
    ws = dist.get_world_size(group)
    parts = [torch.empty(row.numel(), dtype=torch.int64, device=device) for _ in range(ws)]
    dist.all_gather(parts, row.to(device), group=group)
    rows = torch.stack(parts).cpu()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(ws))
    for i in range(ws):
        if int(rows[i, 0]) == 0:
            n = int(rows[i, 2])
            start = 3 + _MAX_META
            msg = bytes(rows[i, start:start + n].tolist()).decode(errors="replace")
            if msg.startswith(_RELAYED):
                raise DistributedInputError(msg[len(_RELAYED):])
            raise DistributedInputError(f"{what}: rank {ranks[i]} rejected its input: {msg}")
    for i in range(ws):
        if int(rows[i, 1]) != len(names):
            raise DistributedInputError(f"{what}: rank {ranks[i]} sent {int(rows[i, 1])} metadata values, "
                                        f"expected {len(names)} ({', '.join(names)})")
    vals = rows[:, 3:3 + len(names)]
    odd = (vals != vals[0]).any(0)   # one comparison for every value (a loop of 32 cost ~0.2 ms a call)
    if bool(odd.any()):
        k = int(odd.nonzero()[0])
        name, col = names[k], vals[:, k]
        j = int((col != col[0]).nonzero()[0])
        like = metadata[name]
        named = (show or {}).get(name)

        def value(v):
            text = _decode(v, like)
            if named is None:
                return text
            return named(struct.unpack("<d", struct.pack("<q", v))[0] if isinstance(like, float) else v)

        raise DistributedInputError(f"{what}: ranks disagree on {name}: {value(int(col[0]))} on rank "
                                    f"{ranks[0]} but {value(int(col[j]))} on rank {ranks[j]}")


def preflight_mesh(mesh, what: str, problem: str | None, metadata: dict[str, int | float],
                   show: dict[str, Callable[[int | float], str]] | None = None) -> None:
    """``preflight`` over every rank of a DeviceMesh of any number of dimensions, which need not span the
    job (an HSDP trainer beside rollout workers): over each dimension's groups in turn, every rank of the
    mesh taking part in every stage, a verdict raised in one stage carried as this rank's problem into the
    next (and raised as it is). After the last stage every rank of the mesh has raised, naming the rank
    that rejected its input, or all agree."""
    stages = [mesh.get_group(d) for d in range(mesh.ndim)]
    for d, group in enumerate(stages):
        try:
            preflight(group, what, problem, metadata, show)
        except DistributedInputError as e:
            if d == len(stages) - 1:
                raise
            problem = _RELAYED + str(e)


DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, 0)


_CODE_DTYPES = {c: d for d, c in DTYPE_CODES.items()}


def show_dtype(code: int) -> str:
    return str(_CODE_DTYPES[code]) if code in _CODE_DTYPES else "no float dtype"


def show_choice(choices, none: int | None = None) -> Callable[[int], str]:
    """An index into ``choices`` named as the choice; ``none`` (a sentinel) as None."""
    def show(i: int) -> str:
        if none is not None and i == none:
            return "None"
        return repr(choices[i]) if 0 <= i < len(choices) else f"no valid choice of {tuple(choices)}"
    return show


def show_or_none(sentinel) -> Callable:
    """A value as itself, the sentinel that stands for None as None (a NaN sentinel: any NaN)."""
    nan = isinstance(sentinel, float) and math.isnan(sentinel)

    def show(v) -> str:
        return "None" if (nan and isinstance(v, float) and math.isnan(v)) or (not nan and v == sentinel) else repr(v)
    return show


def show_flags(names, prefix: str = "") -> Callable[[int], str]:
    """A bit mask over ``names`` as ``prefix`` and the list of names whose bit is set."""
    return lambda mask: prefix + "[" + ", ".join(n for i, n in enumerate(names) if mask >> i & 1) + "]"


def show_bool(v: int) -> str:
    return repr(bool(v))


# how the layout's metadata (CPLayout.metadata()) is named in a disagreement
LAYOUT_KEYS = ("batch", "tokens", "seq_lens_hash", "mode", "n_chunks", "canonical")


def collect(checks) -> str | None:
    """Run local check callables in order; return the first problem's text, or None. Any
    exception counts (a TypeError from a wrong argument type too): raised here on one rank
    alone, it would leave the others waiting in the preflight's all_gather."""
    for check in checks:
        try:
            check()
        except ValueError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - reported on every rank by preflight
            return f"{type(e).__name__}: {e}"
    return None
