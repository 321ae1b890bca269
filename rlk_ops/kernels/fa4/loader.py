"""Finding FA4 (``flash_attn.cute.interface``) and checking it has the controls we need.

Nothing here imports FA4 at module import time: ``load()`` imports it on first use and
caches the outcome (a failed import is cached too, so a non-strict fallback does not
re-scan ``sys.path`` on every call; ``reset()`` forgets it, for tests).

What is checked, per op, against the installed FA4's function signatures (parameter
names, read with ``inspect``; the public functions' names are FA4's documented API,
``_flash_attn_bwd`` is the one entry point that runs a backward on its own and
``_flash_attn_fwd`` the one that takes output buffers):

* ``num_splits``     we pass 1 (one pass over the keys; FA4 on SM90 has no split-KV);
* ``pack_gqa``       we pass a fixed value (``PACK_GQA``), never FA4's per-shape default;
* ``return_lse``     LSE export (the contract returns it);
* ``deterministic``  the semaphore-ordered backward;
* ``dlse``           the gradient of lse, folded into the backward's row term;
* ``page_table`` / ``seqused_k``  paged KV read in place (no gather);
* ``seqused_q`` / ``out`` / ``lse`` in ``_flash_attn_fwd``  canonical:C partials
  computed and written in place (kernels/fa4/canonical.py).

A missing control raises ``BackendUnavailable`` naming it; the dispatch point turns
that into ``StrictModeError`` in strict mode, or a recorded CPU fallback otherwise.

The installed version and each GPU's architecture are recorded (``backend_info()``).
Invariance was proven on ``VERIFIED_ARCHS`` (``meta/provenance.py``) with
``VERIFIED_VERSIONS``; anything else runs but is marked unverified and warned about
once (FA4 on SM100 picks ``q_stage`` from the batch's longest query, and another
project saw it fail batch invariance on B200).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import threading
import warnings
from dataclasses import dataclass, field
from types import ModuleType

import torch

from rlk_ops.kernels.dispatch import BackendUnavailable
from rlk_ops.meta.provenance import VERIFIED_ARCHS

INTERFACE_MODULE = "flash_attn.cute.interface"
DISTRIBUTION = "flash-attn-4"
VERIFIED_VERSIONS = ("4.0.0b36",)
INSTALL_HINT = "pip install 'flash-attn-4==4.0.0b36' (CUDA, sm90)"

# One pass over the keys: the single-pass result is what training computes, and FA4
# asserts num_splits > 1 on SM90 anyway.
NUM_SPLITS = 1
# Fixed, not FA4's per-shape default (None). True packs the G = Hq/Hkv query heads that
# share a KV head into one M-tile: decode then reads each KV head once instead of G
# times (decode is memory-bound), and it is FA4's own choice for GQA on SM90, the
# configuration whose invariance was measured. Each row's reduction over keys is
# row-local either way; fixing it only keeps a future heuristic from switching
# kernels per shape. The SM90 backward ignores it (FA4 forces pack_gqa=False there).
PACK_GQA = True

# canonical:C partials are written in place (kernels/fa4/canonical.attend_into)
_IN_PLACE = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
             "softmax_scale", "causal", "num_splits", "pack_gqa", "return_lse", "out", "lse")

# op -> {FA4 function: parameters it must accept}
REQUIRED: dict[str, dict[str, tuple[str, ...]]] = {
    "attention_fwd": {
        "_flash_attn_fwd": _IN_PLACE,
        "flash_attn_func": ("softmax_scale", "causal", "num_splits", "pack_gqa", "return_lse"),
        "flash_attn_varlen_func": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                   "softmax_scale", "causal", "num_splits", "pack_gqa", "return_lse"),
    },
    "attention_bwd": {
        "_flash_attn_bwd": ("softmax_scale", "causal", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                            "max_seqlen_k", "deterministic", "dlse"),
    },
    "paged_attention": {  # paged single pass (with tile_mn) and canonical:C chunked prefill
        "_flash_attn_fwd": ("page_table", "seqused_k", "tile_mn", "intra_wg_overlap") + _IN_PLACE,
    },
}
_WHAT = {
    "num_splits": "split-KV control (num_splits)",
    "pack_gqa": "pack_gqa control",
    "return_lse": "LSE export (return_lse)",
    "deterministic": "deterministic backward (deterministic=)",
    "dlse": "lse gradient input (dlse=)",
    "page_table": "paged KV (page_table=)",
    "seqused_k": "per-sequence KV length (seqused_k=)",
    "seqused_q": "per-sequence query length (seqused_q=)",
    "out": "output buffer (out=)",
    "lse": "lse buffer (lse=)",
    "tile_mn": "tile size control (tile_mn=)",
    "intra_wg_overlap": "intra-warpgroup overlap control (intra_wg_overlap=)",
}


@dataclass
class FA4:
    """The imported interface and what was found out about it."""
    module: ModuleType
    version: str | None
    params: dict[str, frozenset[str] | None]  # function -> parameter names (None: function missing)
    archs: dict[int, str] = field(default_factory=dict)  # device index -> "sm90"

    def missing(self, op: str) -> list[str]:
        out = []
        for fn, needed in REQUIRED[op].items():
            have = self.params.get(fn)
            if have is None:
                out.append(f"{INTERFACE_MODULE}.{fn}")
                continue
            out += [f"{_WHAT.get(p, p)} in {fn}" for p in needed if p not in have]
        return out


_lock = threading.Lock()
_loaded: FA4 | None = None
_failure: str | None = None
_warned: set[str] = set()


def reset() -> None:
    """Forget the cached import outcome (tests swap FA4 in and out)."""
    global _loaded, _failure
    with _lock:
        _loaded, _failure = None, None
        _warned.clear()


def _signature_params(fn) -> frozenset[str] | None:
    if fn is None:
        return None
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def load() -> FA4:
    """The FA4 interface, imported once; raises BackendUnavailable with the reason."""
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise BackendUnavailable(_failure)
        try:
            module = importlib.import_module(INTERFACE_MODULE)
        except Exception as e:  # ImportError, or a broken CUDA toolchain under it
            _failure = f"{INTERFACE_MODULE} cannot be imported ({type(e).__name__}: {e}); {INSTALL_HINT}"
            raise BackendUnavailable(_failure) from e
        fns = {fn for needs in REQUIRED.values() for fn in needs}
        params = {fn: _signature_params(getattr(module, fn, None)) for fn in sorted(fns)}
        _loaded = FA4(module, installed_version(), params)
        if _loaded.version not in VERIFIED_VERSIONS:
            _warn_once(f"version:{_loaded.version}",
                       f"rlk_ops fa4: flash-attn-4 {_loaded.version or '(version unknown)'} is not a version "
                       f"whose invariance this project verified ({', '.join(VERIFIED_VERSIONS)}); "
                       "its bitwise claims are unproven with it")
        return _loaded


def check_available(op: str) -> None:
    """Raise BackendUnavailable unless FA4 is importable, has ``op``'s controls and a GPU exists."""
    if op not in REQUIRED:  # e.g. use_backend(linear="fa4"): once a KeyError from missing()
        raise BackendUnavailable(f"FA4 has no kernel for rlk::{op} (it covers {', '.join(sorted(REQUIRED))})")
    fa4 = load()
    missing = fa4.missing(op)
    if missing:
        raise BackendUnavailable(
            f"the installed FA4 ({DISTRIBUTION} {fa4.version or 'version unknown'}) lacks what rlk::{op} needs: "
            f"{'; '.join(missing)}. Without it the result is not the strict single-pass, deterministic one; "
            f"{INSTALL_HINT}")
    if not torch.cuda.is_available():
        raise BackendUnavailable("FA4 needs a CUDA GPU and torch.cuda.is_available() is False")


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def note_device(fa4: FA4, device: torch.device) -> str | None:
    """Record (once per device) the GPU architecture FA4 runs on; warn if unverified."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = fa4.archs.get(index)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = fa4.archs[index] = f"sm{major}{minor}"
        if arch not in VERIFIED_ARCHS:
            _warn_once(f"arch:{arch}",
                       f"rlk_ops fa4: {arch} is not an architecture on which this project verified FA4's "
                       f"invariance (verified: {', '.join(sorted(VERIFIED_ARCHS))}); FA4 runs, but its "
                       "batch/prefill-decode invariance there is unproven (results/h200/attention.json "
                       "covers sm90 only)")
    return arch


def backend_info() -> dict:
    """What the fa4 backend runs with, for provenance and reports (never raises)."""
    try:
        fa4 = load()
    except BackendUnavailable as e:
        return {"available": False, "reason": str(e)}
    return {
        "available": True,
        "module": INTERFACE_MODULE,
        "version": fa4.version,
        "version_verified": fa4.version in VERIFIED_VERSIONS,
        "verified_versions": list(VERIFIED_VERSIONS),
        "num_splits": NUM_SPLITS,
        "pack_gqa": PACK_GQA,
        "deterministic_backward": True,
        "missing": {op: fa4.missing(op) for op in REQUIRED},
        "gpu_archs": {str(i): a for i, a in sorted(fa4.archs.items())},
        "archs_verified": {str(i): a in VERIFIED_ARCHS for i, a in sorted(fa4.archs.items())},
        "verified_archs": sorted(VERIFIED_ARCHS),
    }


def jit_cache_sizes(fa4: FA4) -> dict[str, int | None]:
    """Number of compiled FA4 kernels held in-process, per entry point (None: not found).
    Used to show JIT work happens once per configuration."""
    out = {}
    for name in ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert"):
        cache = getattr(getattr(fa4.module, name, None), "compile_cache", None)
        inner = getattr(cache, "cache", None)
        out[name] = len(inner) if isinstance(inner, dict) else None
    return out
