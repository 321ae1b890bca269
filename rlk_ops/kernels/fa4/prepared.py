"""FA4 calls prepared once per plan call: canonical:C training's partials without FA4's per-call
Python (``fa4 canonical.PREPARED_CALLS``, on since session 12: measured there).

Why: the training forward makes one FA4 call per state slot (13 at C = 640, S = 8k), and on the
H200 the host took 2.3 ms to issue a forward whose GPU time is 3.2 ms
(results/h200/session11/train_fwd_paths.json): ~125 us of Python per call inside FA4's
``_flash_attn_fwd`` (argument checks, tile and scheduler choices, the compile key), ~60 us for
our plan, buffers and streams. When the host runs slower than that the GPU waits, which is why
canonical:640's training ratio moved between 1.15 and 1.24 across runs.

How: the first call of a (plan call, input layout) runs FA4 as usual while its JIT cache
(``_flash_attn_fwd.compile_cache``) is swapped for a proxy that records the one compiled-kernel
call it makes: the compiled function and its arguments. Later calls with the same key call that
function directly with the arguments rebuilt on the new tensors: an argument that aliases one of
q, k, v, out, lse (same storage) becomes the same view (size, stride, offset from the tensor's
own) of the new one; every other argument is reused as recorded (the plan's index tensors, which
a cached plan keeps, and what FA4 derived from them, e.g. its per-piece tile counts, plus
scalars). So the same compiled kernel runs on the same argument values as FA4 would pass: no
bit can change, which tests/test_canonical_cuda.py checks with torch.equal on the GPU.
The kernel takes its CUDA stream from the caller's current stream (FA4 compiles it with
``use_tvm_ffi_env_stream``), so the side streams of kernels/cpu/canonical.run still apply.

Refused with ``PreparedCallError`` (raised after FA4's own call has written out/lse; nothing
cached): a call that made no or several compiled-kernel calls, passed an input tensor inside a
nested argument, or did not pass every input in place (a copy would be replayed stale). The key
holds every input's shape, stride, dtype, device and 16-byte alignment, which inputs share a
storage and at what offsets, the scale, the plan call itself and FA4's module (both kept alive by
the cache entry, so their ids cannot be reused; a reloaded FA4 records anew). Entries hold no
input tensor: only how to view the next ones.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import torch

from rlk_ops.ops._validate import span

INPUTS = ("q", "k", "v", "out", "lse")
MAX_ENTRIES = 512


class PreparedCallError(RuntimeError):
    pass


class _Recorder:
    """Stands in for FA4's ``compile_cache`` during one call: lookups and inserts go through;
    each compiled function it hands out to the recording thread records its arguments when
    called. Another thread's FA4 call meanwhile (the cache is FA4's, process-wide) gets the
    function as is: recorded, it failed the recording call and kept its tensors alive."""

    def __init__(self, real):
        self.real, self.calls, self.thread = real, [], threading.get_ident()

    def __contains__(self, key):
        return key in self.real

    def __getitem__(self, key):
        fn = self.real[key]
        if threading.get_ident() != self.thread:
            return fn

        def call(*args):
            self.calls.append((fn, args))
            return fn(*args)

        return call

    def __setitem__(self, key, value):
        self.real[key] = value

    def __getattr__(self, name):
        return getattr(self.real, name)


def _alias(t: torch.Tensor, live: dict) -> tuple | None:
    """(input name, size, stride, offset from the input's own storage offset) when ``t`` is a
    view of one of the live inputs: the input it is exactly (same start, size and stride), else
    the first input of its storage."""
    ptr = t.untyped_storage().data_ptr()
    same = [n for n, x in live.items() if x.untyped_storage().data_ptr() == ptr]
    if not same:
        return None
    exact = [n for n in same if live[n].data_ptr() == t.data_ptr() and live[n].shape == t.shape
             and live[n].stride() == t.stride()]
    name = (exact or same)[0]
    return name, tuple(t.shape), tuple(t.stride()), t.storage_offset() - live[name].storage_offset()


def _reads(arg: torch.Tensor, t: torch.Tensor) -> bool:
    """``arg`` is ``t``, a reshaped view or a slice of it: its bytes lie within ``t``'s span (a
    view of another input sharing the buffer, interleaved or adjacent, reaches past it)."""
    if arg.numel() == 0:
        return False
    (a0, a1), (t0, t1) = span(arg), span(t)
    return t0 <= a0 and a1 <= t1


def _nested_tensors(a) -> list:
    if isinstance(a, torch.Tensor):
        return [a]
    if isinstance(a, (tuple, list)):
        return [t for x in a for t in _nested_tensors(x)]
    return []


class Prepared:
    def __init__(self, fn: Callable, args: tuple, live: dict, owner):
        self.fn, self.owner = fn, owner   # owner: the plan call and FA4's module, kept alive with the entry
        self.slots = []
        for a in args:
            if isinstance(a, torch.Tensor):
                view = _alias(a, live)
                self.slots.append(("view", view) if view else ("keep", a))
            else:
                if any(_alias(t, live) for t in _nested_tensors(a)):
                    raise PreparedCallError("FA4 passed an input tensor inside a nested argument")
                self.slots.append(("keep", a))
        # an input is read in place when an argument passed as a view lies within its bytes (by
        # storage, or by overlapping spans, an input sharing a buffer with one read in place passed
        # as read: q and k as views of one buffer, adjacent or interleaved, with q copied by FA4,
        # replayed the first call's copy of q)
        views = [a for a, x in zip(args, self.slots) if x[0] == "view"]
        copied = [n for n, t in live.items() if t.numel() and not any(_reads(a, t) for a in views)]
        if copied:   # an input FA4 copied (say, made contiguous) would be replayed stale
            raise PreparedCallError(f"FA4's kernel call does not read {copied} in place")

    def __call__(self, live: dict):
        args = []
        for kind, x in self.slots:
            if kind == "keep":
                args.append(x)
            else:
                name, size, stride, rel = x
                base = live[name]
                args.append(base.as_strided(size, stride, base.storage_offset() + rel))
        return self.fn(*args)


_CACHE: "OrderedDict[tuple, Prepared]" = OrderedDict()
# One recording at a time, and the cache's order under the same lock: two threads recording at once
# swapped FA4's compile_cache in and out interleaved, and the last restore could put the other
# thread's recorder back for good (every later FA4 call recorded, its tensors kept alive; a session
# 34 audit). A replay runs outside the lock.
_LOCK = threading.RLock()


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.data_ptr() % 16


def _sharing(live: dict) -> tuple:
    """Which inputs share a storage (first input of each storage) and their offsets within it:
    an argument aliasing one input is rebuilt on that input alone, so the pattern must match."""
    first, out = {}, []
    for n in INPUTS:
        t = live[n]
        ptr = t.untyped_storage().data_ptr()
        owner = first.setdefault(ptr, n)
        out.append((owner, t.storage_offset() - live[owner].storage_offset()))
    return tuple(out)


def key(module, call, live: dict, scale: float, variant: tuple = ()) -> tuple:
    return (id(module), id(call), float(scale), variant, _sharing(live), *(_layout(live[n]) for n in INPUTS))


def run(module, call, live: dict, scale: float, normal: Callable[[], object], variant: tuple = ()) -> None:
    """One plan call: replay its prepared FA4 kernel call, or run ``normal()`` (FA4 as usual)
    while recording it and keep it for the next time. ``variant``: what else decides the FA4
    call ``normal()`` makes (a switch of the caller's), part of the key."""
    k = key(module, call, live, scale, variant)
    with _LOCK:
        prep = _CACHE.get(k)
        if prep is not None:
            _CACHE.move_to_end(k)
    if prep is not None:
        prep(live)
        return
    with _LOCK:
        fwd = module._flash_attn_fwd
        real = getattr(fwd, "compile_cache", None)
        if real is None:
            raise PreparedCallError(
                "this FA4 has no _flash_attn_fwd.compile_cache to record a prepared call from (flash-attn-4 "
                "4.0.0b36 has it); install that version, or call FA4 every time: rlk_ops.kernels.fa4.canonical."
                "PREPARED_CALLS = False, or `with rlk_ops.kernels.fa4.canonical.prepared_calls(False):` (same "
                "bits, ~125 us more host time per call)")
        rec = _Recorder(real)
        fwd.compile_cache = rec
        try:
            normal()
        finally:
            fwd.compile_cache = real
        if len(rec.calls) != 1:
            raise PreparedCallError(f"FA4 made {len(rec.calls)} compiled-kernel calls for one plan call; "
                                    "a prepared call needs exactly 1")
        fn, args = rec.calls[0]
        _CACHE[k] = Prepared(fn, args, live, (call, module))
        while len(_CACHE) > MAX_ENTRIES:
            _CACHE.popitem(last=False)


def clear() -> None:
    with _LOCK:
        _CACHE.clear()
