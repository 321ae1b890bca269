"""Provenance: which backend actually ran each rlk op, and on what.

The dispatch point (``kernels/dispatch.py``) records one entry per distinct
(op, requested backend, actual backend, fallback, its reason, device, kernel, nested) with a call count, when the
kernel returns (a call the kernel refused ran nothing). Records are cheap (a dict update
per call) and always on; ``capture()`` scopes them.

``kernel`` is what computed the call inside its backend: the backend's name when the backend ran
its own kernel, else what the backend's code said through ``note_kernel`` (the fa4 backend's
canonical decode runs Triton's pair kernel where that kernel's shapes allow: "triton.pair_decode";
FA4's chunk walk, where routed: "fa4.walk"). It names what computed the values: a kernel that only
lays data out (the fa4 pair route's Triton ``decode_pairs``, before FA4 computes the pairs) is not
named, and another rlk op called inside (the merge) has its own record.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import threading
from dataclasses import asdict, dataclass

import torch

# GPU architectures on which this project has verified the CUDA backends' invariance
# claims (results/h200/*.json). Anything else is recorded as unverified.
VERIFIED_ARCHS = {"sm90"}


@dataclass
class CallRecord:
    op: str
    requested_backend: str
    actual_backend: str
    fallback: bool
    fallback_reason: str | None
    device: str
    kernel: str | None = None   # the log fills it: the backend's name unless its code noted another
    calls: int = 0
    nested: bool = False        # called inside another dispatched call's kernel (the merge inside decode)

    def as_dict(self) -> dict:
        return asdict(self)


class ProvenanceLog:
    def __init__(self) -> None:
        self._records: dict[tuple, CallRecord] = {}
        self._lock = threading.Lock()

    def record(self, op: str, requested: str, actual: str, fallback: bool,
               reason: str | None, device: str, kernel: str | None = None, nested: bool = False) -> None:
        kernel = kernel or actual
        # the reason is part of the key: two fallbacks of one op for two reasons are two records
        # (keyed without it, the second reason was lost under the first's count; a session 34 audit)
        key = (op, requested, actual, fallback, reason, device, kernel, nested)
        with self._lock:  # the count too: ``+=`` on an attribute is a read and a write
            rec = self._records.get(key)
            if rec is None:
                rec = self._records[key] = CallRecord(op, requested, actual, fallback, reason, device, kernel,
                                                      nested=nested)
            rec.calls += 1

    # Readers take the lock too: a dict that another thread's first call of an op grows while it is
    # iterated raises "dictionary changed size during iteration" (a session 34 audit).
    def records(self) -> list[CallRecord]:
        with self._lock:
            return list(self._records.values())

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [r.as_dict() for r in self._records.values()]

    def fallbacks(self) -> list[CallRecord]:
        return [r for r in self.records() if r.fallback]

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


_stack: list[ProvenanceLog] = [ProvenanceLog()]


def current() -> ProvenanceLog:
    return _stack[-1]


def record(op: str, requested: str, actual: str, fallback: bool, reason: str | None, device: str,
           kernel: str | None = None, nested: bool = False) -> None:
    """Into every open log: the process-wide one and each enclosing ``capture()``. (Into the
    innermost only, a capture opened inside another, e.g. the binding probe's, hid its calls and
    fallbacks from the outer one and from ``current()`` afterwards.)"""
    for log in tuple(_stack):
        log.record(op, requested, actual, fallback, reason, device, kernel, nested)


# The kernels noted by each dispatched call running on this thread, innermost call last (None: none
# noted): an op's kernel may call another dispatched op (the fa4 canonical decode calls the merge
# op), whose notes are its own. The dispatch wrapper pushes a slot before the kernel runs and pops
# it after, also when the kernel raises.
_calls = threading.local()


def call_slots() -> list:
    """This thread's stack of note slots (the dispatch wrapper appends None, runs, pops)."""
    try:
        return _calls.stack
    except AttributeError:
        _calls.stack = []
        return _calls.stack


def note_kernel(name: str) -> None:
    """Called by a backend's code: ``name`` computed (part of) the current dispatched call; several
    names are joined with "+" in the order noted, each once. Outside a dispatched call (a kernel called
    directly) there is no record, and nothing to note."""
    stack = call_slots()
    if stack:
        have = stack[-1]
        stack[-1] = name if have is None else have if name in have.split("+") else f"{have}+{name}"


@contextlib.contextmanager
def capture():
    """Collect the provenance of the rlk op calls made inside the block (they also reach every
    enclosing capture and the process-wide log)."""
    log = ProvenanceLog()
    _stack.append(log)
    try:
        yield log
    finally:
        _stack.remove(log)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_arch(device: torch.device | int | None = None) -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def environment() -> dict:
    """Versions and hardware that determine what the recorded backends compute."""
    arch = gpu_arch()
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rlk_ops": _version("rlk-ops"),
        "flash_attn_4": _version("flash-attn-4"),
        "nvidia_cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "flashinfer": _version("flashinfer-python"),
        "triton": _version("triton"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if arch else None,
        "gpu_arch": arch,
        "gpu_arch_verified": (arch in VERIFIED_ARCHS) if arch else None,
    }
    return env
