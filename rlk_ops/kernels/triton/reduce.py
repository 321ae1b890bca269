"""Fixed-order column sums (no atomics): the second stage of every reduction over
tokens (norm and bias gradients). Partials are added in ascending row order, in tiles
of ROWS rows, so the result depends only on the partials, never on scheduling."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.triton import _common as C

ROWS = 32
BLOCK_N = 128
RPP = 256  # rows per program in colsum's first stage


@triton.jit(do_not_specialize=["n_rows"])
def _sum_rows_kernel(src_ptr, out_ptr, n_rows, N, ROWS_: tl.constexpr, BLOCK_N_: tl.constexpr,
                     ACC: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N_ + tl.arange(0, BLOCK_N_)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N_], ACC)
    for r0 in range(0, n_rows, ROWS_):
        rows = r0 + tl.arange(0, ROWS_)
        tile = tl.load(src_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < n_rows)[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(tile.to(ACC), axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["n_rows"])
def _colsum_stage1(src_ptr, part_ptr, n_rows, N, RPP_: tl.constexpr, ROWS_: tl.constexpr,
                   BLOCK_N_: tl.constexpr, ACC: tl.constexpr):
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N_ + tl.arange(0, BLOCK_N_)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N_], ACC)
    for r0 in tl.static_range(0, RPP_, ROWS_):
        rows = chunk.to(tl.int64) * RPP_ + r0 + tl.arange(0, ROWS_)
        tile = tl.load(src_ptr + rows[:, None] * N + cols[None, :],
                       mask=(rows < n_rows)[:, None] & cmask[None, :], other=0.0)
        acc += tl.sum(tile.to(ACC), axis=0)
    tl.store(part_ptr + chunk.to(tl.int64) * N + cols, acc, mask=cmask)


def sum_partials(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[n, N] partial sums (acc dtype) -> [N] in out_dtype, rows added in ascending order."""
    n, width = partials.shape
    out = torch.empty(width, dtype=out_dtype, device=partials.device)
    if width == 0:
        return out
    _sum_rows_kernel[(triton.cdiv(width, BLOCK_N),)](
        partials, out, n, width, ROWS_=ROWS, BLOCK_N_=BLOCK_N, ACC=C.tl_acc(partials.dtype), **C.LAUNCH)
    return out


def colsum(x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum of the rows of a contiguous [M, N] tensor in a fixed order (fp32/fp64 acc)."""
    m, width = x2.shape
    if width == 0:
        return torch.empty(0, dtype=out_dtype, device=x2.device)
    acc = C.acc_dtype(x2.dtype)
    n_chunks = max(1, triton.cdiv(m, RPP))
    partials = torch.empty((n_chunks, width), dtype=acc, device=x2.device)
    _colsum_stage1[(n_chunks, triton.cdiv(width, BLOCK_N))](
        x2, partials, m, width, RPP_=RPP, ROWS_=ROWS, BLOCK_N_=BLOCK_N, ACC=C.tl_acc(x2.dtype), **C.LAUNCH)
    return sum_partials(partials, out_dtype)
