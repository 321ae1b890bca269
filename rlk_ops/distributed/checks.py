"""Cross-rank preflight: catch bad input on every rank before the first collective.

A local check that raises on one rank while the others enter an all_gather leaves
them waiting until the process-group timeout. So distributed entry points collect
their local problem (or None) and a few metadata ints, and every rank calls
``preflight``: one all_gather of a small int64 tensor (the problem text rides along
as bytes), after which every rank raises the same error, naming the rank and the
argument, or proceeds knowing that all ranks agree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_MSG_BYTES = 480


class DistributedInputError(ValueError):
    """Bad input to a distributed rlk entry point, raised on every rank of the group."""


def require_initialized(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedInputError(
            f"{what}: torch.distributed is not initialized; call rlk_ops.distributed.init_mesh(tp, cp) "
            f"(or torch.distributed.init_process_group with a timeout) first")


def metadata_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def preflight(group, what: str, problem: str | None, metadata: dict[str, int]) -> None:
    """All ranks of ``group`` call this with their local ``problem`` (None if fine) and
    ``metadata`` (same keys on every rank). Raises ``DistributedInputError`` on every
    rank if any rank had a problem or any metadata value differs across ranks."""
    require_initialized(what)
    names = list(metadata)
    text = (problem or "").encode()[:_MSG_BYTES]
    row = torch.zeros(3 + len(names) + _MSG_BYTES, dtype=torch.int64)
    row[0] = 1 if problem is None else 0
    row[1] = len(names)
    row[2] = len(text)
    row[3:3 + len(names)] = torch.tensor([int(metadata[n]) for n in names], dtype=torch.int64)
    row[3 + len(names):3 + len(names) + len(text)] = torch.tensor(list(text), dtype=torch.int64)
    device = metadata_device(group)
    ws = dist.get_world_size(group)
    parts = [torch.empty(row.numel(), dtype=torch.int64, device=device) for _ in range(ws)]
    dist.all_gather(parts, row.to(device), group=group)
    rows = torch.stack(parts).cpu()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(ws))
    for i in range(ws):
        if int(rows[i, 0]) == 0:
            n = int(rows[i, 2])
            start = 3 + int(rows[i, 1])
            msg = bytes(rows[i, start:start + n].tolist()).decode(errors="replace")
            raise DistributedInputError(f"{what}: rank {ranks[i]} rejected its input: {msg}")
    for i in range(ws):
        if int(rows[i, 1]) != len(names):
            raise DistributedInputError(f"{what}: rank {ranks[i]} sent {int(rows[i, 1])} metadata values, "
                                        f"expected {len(names)} ({', '.join(names)})")
    for k, name in enumerate(names):
        col = rows[:, 3 + k]
        if bool((col != col[0]).any()):
            j = int((col != col[0]).nonzero()[0])
            raise DistributedInputError(f"{what}: ranks disagree on {name}: {int(col[0])} on rank {ranks[0]} "
                                        f"but {int(col[j])} on rank {ranks[j]}")


DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, 0)


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
