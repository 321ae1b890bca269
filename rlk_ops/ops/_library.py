"""Registration helpers: every rlk op is defined here from its spec in ``meta/specs.py``.

Ops are registered with ``torch.library.define`` + ``impl`` (not ``custom_op``):
the eager per-call cost is lower (benchmarks/dispatch.py measures both; numbers in
the README), and the schema, tags and per-device kernels stay explicit.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.autograd.forward_ad as _forward_ad

from rlk_ops.meta.specs import spec

LIB = torch.library.Library("rlk", "DEF")  # noqa: TOR901 - kept alive for the process


def define(name: str) -> None:
    s = spec(name)
    torch.library.define(s.qualname, s.schema, lib=LIB, tags=s.tags)
    if not s.differentiable and not s.mutates:   # (PyTorch takes autograd formulas for functional ops only)
        no_backward(s.qualname, lib=LIB)


def no_backward(qualname: str, lib=None) -> None:
    """An op without a derivative (a backward op, the rollout's paged ops): backpropagating through it
    raises, naming it. Without an autograd kernel PyTorch's fallback only warned: eagerly the result came
    from whatever the kernel was made of (the CPU reference's torch ops: right; a CUDA kernel: not), and a
    compiled graph gave a zero gradient (double backward through the block, or a gradient through
    ``rlk::paged_attention``; a session 39 audit). Outputs still require grad where an input does, so
    only a backward that reaches the op fails; under torch.compile that is when AOTAutograd traces the
    backward, at the first call. (The public functions of the rollout-side ops refuse inputs that require
    grad under grad mode before the call.) Cost: the Python autograd kernel adds ~6.5 us per call outside
    ``torch.inference_mode``."""
    def backward(ctx, *grads):
        raise RuntimeError(f"{qualname} has no derivative, so no gradient can pass through it (a backward, or "
                           f"AOTAutograd tracing one at a compiled call whose inputs require grad): "
                           + ("double backward (create_graph=True, then a gradient of a gradient) is not supported "
                              "by rlk ops" if qualname.endswith("_bwd") else
                              "it is a rollout-side op (detach its inputs, or compute the gradient with the training "
                              "ops)"))
    torch.library.register_autograd(qualname, backward, lib=lib)


def impl(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the op's CPU and CUDA kernel (it picks the backend itself). The kernel
    refuses forward-mode AD (``no_forward_ad``)."""

    qualname = f"rlk::{name}"

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            if _forward_ad._current_level >= 0:   # (one global read per call: the eager hot path)
                no_forward_ad(qualname)
            return fn(*args, **kwargs)
        for key in ("CPU", "CUDA"):
            torch.library.impl(spec(name).qualname, key, lib=LIB)(kernel)
        return fn

    return register


def no_forward_ad(qualname: str) -> None:
    """The ops register a backward only: under forward-mode AD (``torch.autograd.forward_ad``,
    ``torch.func.jvp``) PyTorch ran them without a tangent, so a JVP came back as exactly 0 (a
    session 38 audit). Inside a forward-AD level every rlk op refuses, whatever its inputs (under
    ``torch.func.jvp`` the kernel cannot see which inputs carry tangents)."""
    if _forward_ad._current_level < 0:
        return
    raise RuntimeError(f"{qualname} has no forward-mode AD formula (torch.autograd.forward_ad, torch.func.jvp): "
                       f"its tangent would come back as zero. Use reverse mode (.backward() or torch.autograd.grad; of "
                       f"torch.func's transforms only vmap runs rlk ops), or call it outside the dual level.")


def fake(name: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        torch.library.register_fake(spec(name).qualname, fn, lib=LIB)
        return fn

    return register


def autograd(name: str, backward: Callable, setup_context: Callable) -> None:
    torch.library.register_autograd(spec(name).qualname, backward, setup_context=setup_context, lib=LIB)
