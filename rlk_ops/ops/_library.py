"""Registration helpers: every rlk op is defined here from its spec in ``meta/specs.py``.

Ops are registered with ``torch.library.define`` + ``impl`` (not ``custom_op``):
the eager per-call cost is lower (benchmarks/dispatch.py measures both; numbers in
the README), and the schema, tags and per-device kernels stay explicit.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from rlk_ops.meta.specs import spec

LIB = torch.library.Library("rlk", "DEF")  # noqa: TOR901 - kept alive for the process


def define(name: str) -> None:
    s = spec(name)
    torch.library.define(s.qualname, s.schema, lib=LIB, tags=s.tags)


def impl(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the op's CPU and CUDA kernel (it picks the backend itself)."""

    def register(fn: Callable) -> Callable:
        for key in ("CPU", "CUDA"):
            torch.library.impl(spec(name).qualname, key, lib=LIB)(fn)
        return fn

    return register


def fake(name: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        torch.library.register_fake(spec(name).qualname, fn, lib=LIB)
        return fn

    return register


def autograd(name: str, backward: Callable, setup_context: Callable) -> None:
    torch.library.register_autograd(spec(name).qualname, backward, setup_context=setup_context, lib=LIB)
