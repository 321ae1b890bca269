"""Shared pieces of the Triton kernels: dtype mapping, cached constants, launch options.

Every launch passes ``enable_fp_fusion=False``: with fusion on, LLVM may contract
``a * b + c`` into one FMA in one kernel and not in another, and the fused
``qk_norm_rope`` kernel must give the same bits as ``qk_rmsnorm`` then ``rope``.
Without contraction each arithmetic step is one IEEE operation, as written.
"""
from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

# TRITON_INTERPRET=1 runs the kernels on CPU tensors (numpy); used to debug the index
# arithmetic without a GPU. libdevice has no interpreter implementation, so the
# interpreter uses tl.sin/tl.cos instead (numpy's, also float64).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LAUNCH = {"enable_fp_fusion": False}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype, as in the CPU reference: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=256)
def scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 1-element tensor: Triton passes Python floats as fp32, but the fp64
    path needs eps in fp64 (the CPU reference adds a double eps)."""
    return torch.tensor([value], dtype=dtype, device=device)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with a 16-byte aligned base pointer. Triton specialises a kernel on
    pointer alignment, and the vector width it picks fixes how a row reduction is split
    over threads: an unaligned slice would otherwise get a different summation order."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
