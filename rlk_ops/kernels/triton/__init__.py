"""Triton backend (CUDA): norm, rope, fused norm+rope, paged KV cache, linear, and the
canonical:C merge of partial attention states (merge.py; bitwise equal to the CPU merge).

Functions are named like the ops and take the CPU kernels' arguments. Nothing here
imports triton until a kernel runs: ``check_available`` (called by the dispatch point
before the first use of an op) says why the backend cannot run, and the kernel
modules are imported on the first call.

Claims (bitwise, proven on the H200 by tests/test_triton.py and
benchmarks/kernels.py -> results/h200/kernels.json): every kernel is run-to-run
deterministic; the forward kernels are batch-invariant (a row's bits do not depend on
how many rows came with it); ``qk_norm_rope`` equals ``rope(qk_rmsnorm(.))``. They are
not bitwise equal to the CPU reference (different summation order in the norm and the
GEMM); the drift is reported there.
"""
from __future__ import annotations

import importlib
import os

from rlk_ops.kernels.dispatch import BackendUnavailable

_MODULE = {
    "qk_rmsnorm": "norm_rope", "qk_rmsnorm_bwd": "norm_rope", "rope": "norm_rope", "rope_bwd": "norm_rope",
    "qk_norm_rope": "norm_rope", "paged_kv_append": "paged_kv", "paged_kv_gather": "paged_kv",
    "linear": "gemm", "linear_bwd": "gemm", "linear_bias_bwd": "gemm",
    "merge_attn_states": "merge", "merge_attn_states_bwd": "merge",
}


def check_available(op: str) -> None:
    if op not in _MODULE:
        raise BackendUnavailable(f"the triton backend has no kernel for rlk::{op} (it has: {', '.join(_MODULE)})")
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("torch.cuda is not available (no CUDA GPU, or a CPU-only torch build)")
    from rlk_ops.kernels.triton import _common

    if _common.INTERPRET and os.environ.get("RLK_FA4_DRY_RUN") != "1":
        # its bits are not the GPU's (fp32 -> bf16 casts truncate), which the op specs' claims are
        raise BackendUnavailable("TRITON_INTERPRET=1 runs Triton kernels in the interpreter, whose bits are not "
                                 "the GPU's; unset it (RLK_FA4_DRY_RUN=1 allows it for the CUDA tests' dry run, "
                                 "which proves nothing about the GPU)")
    try:
        importlib.import_module(f"rlk_ops.kernels.triton.{_MODULE[op]}")
    except ImportError as e:
        raise BackendUnavailable(f"triton cannot be imported: {e}") from e


def _kernel(op: str):
    return getattr(importlib.import_module(f"rlk_ops.kernels.triton.{_MODULE[op]}"), op)


def qk_rmsnorm(x, weight, eps):
    return _kernel("qk_rmsnorm")(x, weight, eps)


def qk_rmsnorm_bwd(dy, x, weight, eps):
    return _kernel("qk_rmsnorm_bwd")(dy, x, weight, eps)


def rope(x, positions, theta, rotary_dim):
    return _kernel("rope")(x, positions, theta, rotary_dim)


def rope_bwd(dy, positions, theta, rotary_dim):
    return _kernel("rope_bwd")(dy, positions, theta, rotary_dim)


def qk_norm_rope(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    return _kernel("qk_norm_rope")(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim)


def paged_kv_append(k_cache, v_cache, k, v, slot_mapping):
    return _kernel("paged_kv_append")(k_cache, v_cache, k, v, slot_mapping)


def paged_kv_gather(k_cache, v_cache, page_table, seq_lens):
    return _kernel("paged_kv_gather")(k_cache, v_cache, page_table, seq_lens)


def linear(x, weight, bias):
    return _kernel("linear")(x, weight, bias)


def linear_bwd(dy, x, weight):
    return _kernel("linear_bwd")(dy, x, weight)


def linear_bias_bwd(dy):
    return _kernel("linear_bias_bwd")(dy)


def merge_attn_states(out_parts, lse_parts, state_lens=None, pdl=None):
    return _kernel("merge_attn_states")(out_parts, lse_parts, state_lens, pdl=pdl)


# kernels/fa4/canonical.py passes decode pair lengths instead of masking lse first, and the pair
# kernel's PDL choice (merge.merge_attn_states(pdl=)); this wrapper is what dispatch hands it, so
# it must forward both (until session 15 it dropped pdl, so the op never took the one-wave PDL
# merge that the direct-call benchmarks measured)
merge_attn_states.accepts_state_lens = True
merge_attn_states.accepts_pdl = True


def merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse):
    return _kernel("merge_attn_states_bwd")(dout, dlse, out_parts, lse_parts, out, lse)
