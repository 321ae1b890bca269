"""The one dispatch point: which backend runs an rlk op, strict mode, provenance.

Every op body calls ``kernel_for(op, device)``. It returns the kernel function of
the requested backend, wrapped to record what ran once it returns
(``meta/provenance.py``). When the requested backend cannot run here:

* strict mode (the default) raises ``StrictModeError`` naming the op, the backend
  and why it is unavailable: a silent fallback would break the determinism claim;
* non-strict mode falls back to the CPU reference kernel (moving tensors to the CPU
  and back) and records ``fallback=True`` with the reason.

Backends are imported lazily: ``import rlk_ops`` needs no CUDA package.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable

import torch

from rlk_ops.meta import provenance


class BackendUnavailable(RuntimeError):
    """A backend cannot run on this machine (missing package, GPU, or control)."""


class StrictModeError(RuntimeError):
    """Strict mode refused to run an op on anything but its deterministic backend."""


# Where each backend's kernels live: backend -> module (imported on first use).
# A kernel is the module attribute named like the op.
_BACKEND_MODULES = {
    "cpu": "rlk_ops.kernels.cpu",
    "fa4": "rlk_ops.kernels.fa4",
    "triton": "rlk_ops.kernels.triton",
    "flashinfer": "rlk_ops.kernels.flashinfer",
    "c10d": "rlk_ops.kernels.c10d",
}
# the device types whose tensors a backend runs on (cpu and c10d: any). A use_backend override
# applies to every device, so without this a CPU-reference call was sent to a CUDA backend
_DEVICES = {"fa4": ("cuda",), "triton": ("cuda",), "flashinfer": ("cuda",)}

# Default backend per device type. CUDA backends are filled in per op as they exist.
_COLLECTIVES = {"all_gather": "c10d", "reduce_scatter": "c10d"}
_DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": dict(_COLLECTIVES),
    "cuda": {
        **_COLLECTIVES,
        "attention_fwd": "fa4",
        "attention_bwd": "fa4",
        "paged_attention": "fa4",
        "paged_attention_auto": "flashinfer",  # the diagnostic auto split-KV lane (never strict)
    },
}
_DEFAULT_CUDA = "triton"

_strict = os.environ.get("RLK_STRICT", "1").lower() not in ("0", "false", "no", "off")
_overrides: dict[str, str] = {}
_cache: dict[tuple[str, str], Callable] = {}


# ----------------------------------------------------------------- strict mode
def strict_mode() -> bool:
    return _strict


def _mode(what: str, enabled) -> bool:
    """A bool, nothing else: ``bool(None)`` or ``bool([])`` once turned strict mode off silently
    while ``"off"`` left it on."""
    if not isinstance(enabled, bool):
        raise TypeError(f"{what}: enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    return enabled


_EAGER = ("{what} changes process-wide state that rlk ops read when they run. Inside a torch.compile'd "
          "function it runs eagerly, at a graph break (traced, Dynamo would apply its set and its restore "
          "together after the graph, so the ops inside would run with the outer setting); under "
          "fullgraph=True, set it around the compiled call instead.")


@torch.compiler.disable(reason=_EAGER.format(what="rlk_ops.set_strict_mode"))
def set_strict_mode(enabled: bool) -> None:
    """Process-wide (every thread), like ``use_backend`` and ``provenance.capture``. Inside a
    torch.compile'd function it runs eagerly at a graph break (an error under fullgraph)."""
    global _strict
    _strict = _mode("set_strict_mode", enabled)


class _Scoped(contextlib.ContextDecorator):
    """A process-wide setting for a block (or a decorated function): ``strict()``,
    ``use_backend()``, ``value_checks()``. Entering and leaving run eagerly even inside a
    torch.compile'd function, at a graph break (an error under fullgraph): traced, Dynamo applied
    the globals' set and restore after the graph, and the ops inside the block ran with the outer
    setting, silently (a session 34 audit; ``value_checks`` until a session 38 audit). A generator
    or coroutine function is refused as the decorated function: the block would open and close
    when the generator is made, before its body runs (a session 38 audit)."""

    def __init__(self, apply: Callable[[], Callable[[], None]], what: str):
        self._apply = apply            # sets the state; returns what restores it
        self._what = what
        self._restore: list[Callable[[], None]] = []

    _REASON = _EAGER.format(what="rlk_ops.strict() / rlk_ops.use_backend() / rlk_ops.value_checks()")

    @classmethod
    def module_global(cls, module_name: str, name: str, value, what: str) -> "_Scoped":
        """The block sets the module global ``module_name.name`` to ``value`` and restores the old value."""
        module = sys.modules[module_name]

        def apply():
            old = getattr(module, name)
            setattr(module, name, value)
            return lambda: setattr(module, name, old)
        return cls(apply, what)

    def __call__(self, fn):
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(f"{self._what} cannot decorate {getattr(fn, '__qualname__', fn)!s}, a generator or "
                            "coroutine function: the block would end before its body runs; use a with-block "
                            "inside it")
        return super().__call__(fn)

    @torch.compiler.disable(reason=_REASON)
    def __enter__(self) -> None:
        self._restore.append(self._apply())

    @torch.compiler.disable(reason=_REASON)
    def __exit__(self, *exc) -> bool:
        self._restore.pop()()
        return False


def strict(enabled: bool = True) -> _Scoped:
    """Strict mode ``enabled`` inside the block, process-wide: threads share it, so set it
    around work in one thread (two threads entering and leaving blocks interleaved restore
    each other's modes)."""
    return _Scoped.module_global(__name__, "_strict", _mode("strict", enabled), "rlk_ops.strict()")


# ------------------------------------------------------------ backend choice
def requested_backend(op: str, device_type: str) -> str:
    if op in _overrides:
        return _overrides[op]
    if device_type == "cpu":
        return _DEFAULTS["cpu"].get(op, "cpu")
    return _DEFAULTS.get(device_type, {}).get(op, _DEFAULT_CUDA)


def use_backend(**op_to_backend: str) -> _Scoped:
    """Request a backend per op for the block, e.g. ``use_backend(paged_attention="flashinfer")``.
    Process-wide (every thread), like strict mode."""
    from rlk_ops.meta.specs import REGISTRY  # the op list (meta/specs.py imports nothing from here)

    for op, backend in op_to_backend.items():
        if not isinstance(backend, str):
            raise ValueError(f"use_backend: the backend for {op} must be a backend name (str), got "
                             f"{type(backend).__name__} {backend!r}; known: {sorted(_BACKEND_MODULES)}")
        if op not in REGISTRY:
            raise ValueError(f"use_backend: unknown op {op!r}; known: {sorted(REGISTRY)}")
        if backend not in _BACKEND_MODULES:
            raise ValueError(f"use_backend: unknown backend {backend!r} for {op}; known: {sorted(_BACKEND_MODULES)}")
    requested = dict(op_to_backend)

    def apply():
        old = dict(_overrides)
        _overrides.update(requested)

        def restore():
            _overrides.clear()
            _overrides.update(old)
        return restore
    return _Scoped(apply, "rlk_ops.use_backend()")


def _load(op: str, backend: str) -> Callable:
    key = (op, backend)
    fn = _cache.get(key)
    if fn is not None:
        return fn
    module_name = _BACKEND_MODULES.get(backend)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {backend!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailable(f"{module_name} cannot be imported: {e}") from e
    check = getattr(module, "check_available", None)
    if check is not None:
        check(op)  # raises BackendUnavailable with the reason
    fn = getattr(module, op, None)
    if fn is None:
        raise BackendUnavailable(f"backend {backend!r} has no kernel for rlk::{op}")
    _cache[key] = fn
    return fn


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


def _cpu_fallback(fn: Callable, device: torch.device, mutated: tuple[int, ...]) -> Callable:
    def run(*args):
        cpu_args = [_to_cpu(a) for a in args]
        out = fn(*cpu_args)
        for i in mutated:
            args[i].copy_(cpu_args[i])
        return _to_device(out, device)

    return run


def kernel_for(op: str, device: torch.device, mutated: tuple[int, ...] = ()) -> Callable:
    """The kernel that runs ``rlk::op`` on ``device``; records provenance.

    ``mutated`` lists the argument positions the op writes in place (needed to run
    the CPU reference on copies of non-CPU tensors)."""
    requested = requested_backend(op, device.type)
    # the fallback: the op's CPU default (the reference, or c10d for the collectives)
    target = _DEFAULTS["cpu"].get(op, "cpu")
    try:
        devices = _DEVICES.get(requested)
        if devices is not None and device.type not in devices and not _dry_run(requested, device):
            raise BackendUnavailable(f"it runs on {' or '.join(devices)} tensors, and these are on {device}")
        fn = _load(op, requested)
        actual, fallback, reason = requested, False, None
    except BackendUnavailable as e:
        if requested == target:
            raise
        reason = f"backend {requested!r} unavailable: {e}"
        if _strict:
            raise StrictModeError(
                f"rlk::{op} on {device}: {reason}. Strict mode (the default) never falls back, "
                f"because another backend does not compute the same bits. Install/enable the backend, "
                f"or allow a recorded fallback with rlk_ops.set_strict_mode(False)."
            ) from e
        try:
            fn = _load(op, target)
        except BackendUnavailable as e2:
            raise BackendUnavailable(f"rlk::{op} on {device}: {reason}; its fallback {target!r} too: {e2}") from e2
        actual, fallback = target, True
    if actual == "cpu" and device.type != "cpu":
        fn = _cpu_fallback(fn, device, mutated)  # the reference runs on CPU copies
    record = (op, requested, actual, fallback, reason, str(device))
    key = ("recorded", *record, mutated)
    run = _cache.get(key)  # one wrapper per record (building it per call cost ~1.5 us)
    if run is None:
        # Triton and FA4 launch on the current device's current stream: with several GPUs, inputs on
        # cuda:1 while cuda:0 is current ran on the wrong device (or raced with cuda:1's stream). One GPU:
        # nothing to guard, no cost. (Not exercised here: the project's GPU machines have one GPU.)
        guard = device.type == "cuda" and torch.cuda.device_count() > 1

        @functools.wraps(fn)  # (its attributes too, e.g. the merge's accepts_state_lens)
        def run(*args, **kwargs):
            slots = provenance.call_slots()
            slots.append(None)   # this call's kernel notes (provenance.note_kernel)
            try:
                if guard:
                    with torch.cuda.device(device):
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
            except Exception as e:
                if fallback:  # the fallback's refusal alone did not say that the request was not served
                    e.add_note(f"rlk::{op} ran on the fallback backend {actual!r} (non-strict): {reason}")
                raise
            finally:
                kernel = slots.pop()
            # once it has run: a call the kernel refused ran nothing; slots left: inside another call
            provenance.record(*record, kernel, bool(slots))
            return out

        _cache[key] = run
    return run


def _dry_run(backend: str, device: torch.device) -> bool:
    """The CUDA tests' dry run (RLK_FA4_DRY_RUN=1 with TRITON_INTERPRET=1): Triton's interpreter
    on CPU tensors, asked for explicitly; it proves nothing about the GPU."""
    return (backend == "triton" and device.type == "cpu" and os.environ.get("RLK_FA4_DRY_RUN") == "1"
            and os.environ.get("TRITON_INTERPRET") == "1")
