"""Triton batch-invariant linear: y = x @ weight.T (+ bias), and its gradients.

What makes a row's result independent of how many rows came with it (M):

* one tile shape for every M (``CONFIG``: BLOCK_M x BLOCK_N x BLOCK_K, warps,
  stages); M only changes how many tiles there are and which rows are masked;
* no split-K: each output tile is owned by one program, which walks K in BLOCK_K
  steps in ascending order, accumulating in fp32 through ``tl.dot`` (the same MMA
  instruction sequence for every tile);
* M is not specialised (``do_not_specialize``): Triton would otherwise compile a
  separate kernel for M == 1 or M % 16 == 0;
* persistent scheduling: min(#SMs, #tiles) programs loop over the tiles (grouped
  ordering for L2 reuse), which changes who computes a tile, never how.

fp32 inputs use ``input_precision="ieee"`` (no TF32). float64 is not supported here.

Gradients use the same kernel: dx = dy @ weight (a row of dx reduces over N for its
own row only); dweight = dy.T @ x reduces over tokens in ascending BLOCK_K steps (no
split, no atomics: run-to-run deterministic); dbias is ``reduce.colsum``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.triton import _common as C
from rlk_ops.kernels.triton.reduce import colsum


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}"
                f"w{self.num_warps}s{self.num_stages}")


# Candidates timed by benchmarks/kernels.py (each checked for invariance there).
CANDIDATES = {
    c.name: c for c in (
        GemmConfig(128, 128, 64, 8, 3),
        GemmConfig(128, 64, 64, 4, 4),
        GemmConfig(64, 64, 64, 4, 4),
        GemmConfig(64, 128, 64, 4, 4),
    )
}
# Measured on the H200 (results/h200/kernels.json, QKV 4096->3072 and o_proj 2048->4096):
# 128x128 tiles reach 0.64-0.67x cuBLAS at M=4096 but 0.33-0.47x at M <= 256; 64x128
# tiles stay at 0.52-0.66x at every M in {1, 16, 256, 4096}. Rollout decode lives at
# small M, so the balanced tile is the default.
CONFIG = CANDIDATES["m64n128k64w4s4"]

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                 s_am, s_ak, s_bk, s_bn, s_cm, s_cn, n_progs,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, OFFS64: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N] (+ bias[N]), arbitrary strides, fp32 accumulation."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tiles_m * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * tiles_n
    for tile in range(pid, n_tiles, n_progs):
        group = tile // per_group
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows_in_group
        pid_n = (tile % per_group) // rows_in_group
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(0, k_steps):
            offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
            if OFFS64:   # (the same arithmetic: only the addresses differ; see matmul)
                offs_k = offs_k.to(tl.int64)
            k_mask = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * s_cm + offs_n[None, :] * s_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _TL:
        raise ValueError(f"the triton linear kernel supports bfloat16, float16 and float32, got {dtype}; "
                         f"use the cpu backend for float64")


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
           config: GemmConfig | None = None, offs64: bool | None = None) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] (+ bias), any strides, with a fixed tile config. ``offs64``: K offsets
    in int64 (None: where int32 would wrap). The weight gradient reads dy^T, whose K runs over the tokens
    with stride N: (tokens - 1) * N passes 2^31 at 14k tokens of a 152k-word lm_head, where int32 offsets
    gave a wrong dW (session 32 audit). The bits are the same either way. On an H100 the first int64 form
    (the arange cast before the add) cost dW 10-13% at 4096 tokens (results/h100/session32/
    gemm_offsets_run1.json); this one 0.98-1.01x of int32, forward and dW (gemm_offsets.json). It is
    still taken only where int32 would wrap."""
    cfg = config or CONFIG
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    if offs64 is None:
        offs64 = (triton.cdiv(k, cfg.block_k) * cfg.block_k) * max(abs(a.stride(1)), abs(b.stride(0)), 1) >= 2 ** 31
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    dev = a.device.index if a.device.type == "cuda" else 0
    n_progs = min(tiles, C.num_sms(dev))
    _gemm_kernel[(n_progs,)](
        a, b, out, bias if bias is not None else out, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), n_progs,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PRECISION="ieee" if a.dtype == torch.float32 else "tf32", OFFS64=bool(offs64),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def linear(x, weight, bias, config: GemmConfig | None = None):
    _check_dtype(x.dtype)
    k = x.shape[-1]
    x2 = C.aligned(x.reshape(math.prod(x.shape[:-1]), k))
    w = C.aligned(weight)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    matmul(x2, w.t(), y, None if bias is None else C.aligned(bias), config)
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear_bwd(dy, x, weight):
    _check_dtype(x.dtype)
    n, k = weight.shape
    dy2 = C.aligned(dy.reshape(math.prod(dy.shape[:-1]), n))
    x2 = C.aligned(x.reshape(math.prod(x.shape[:-1]), k))
    w = C.aligned(weight)
    dx = torch.empty((dy2.shape[0], k), dtype=x.dtype, device=x.device)
    matmul(dy2, w, dx)
    dw = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
    if x2.shape[0] == 0:
        dw.zero_()
    else:
        matmul(dy2.t(), x2, dw)
    return dx.reshape(x.shape), dw


def linear_bias_bwd(dy):
    n = dy.shape[-1]
    return colsum(C.aligned(dy.reshape(math.prod(dy.shape[:-1]), n)), dy.dtype)
