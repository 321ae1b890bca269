"""CPU reference batch-invariant linear: y = x @ w.T (+ b), fp32 accumulation.

Each output element is one ``numerics.rowsum`` over K of fp32 products: its order
depends on K alone, never on how many rows came with it (BLAS picks kernels by M).
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.cpu import numerics as nx

_BUDGET = 1 << 22  # elements of one temporary product



def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K].T in a's (acc) dtype; row m reduced over K by rowsum."""
    m, k = a.shape
    n = b.shape[0]
    out = a.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    n_step = max(1, min(n, _BUDGET // max(k, 1)))
    m_step = max(1, _BUDGET // (n_step * k))
    for n0 in range(0, n, n_step):
        bn = b[n0:n0 + n_step]
        for m0 in range(0, m, m_step):
            out[m0:m0 + m_step, n0:n0 + n_step] = nx.rowsum(a[m0:m0 + m_step, None, :] * bn[None, :, :])
    return out


def linear(x, weight, bias):
    acc = nx.acc_dtype(x.dtype)
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k).to(acc)
    y = _matmul_nt(x2, weight.to(acc).contiguous())
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def linear_bwd(dy, x, weight):
    """dx = dy @ w (reduce over N per row); dw = dy.T @ x (reduce over tokens M)."""
    acc = nx.acc_dtype(x.dtype)
    n, k = weight.shape
    dy2 = dy.reshape(math.prod(dy.shape[:-1]), n).to(acc)
    x2 = x.reshape(math.prod(x.shape[:-1]), k).to(acc)
    dx = _matmul_nt(dy2, weight.to(acc).t().contiguous())
    dw = _matmul_nt(dy2.t().contiguous(), x2.t().contiguous())
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype)


def linear_bias_bwd(dy):
    n = dy.shape[-1]
    acc = nx.acc_dtype(dy.dtype)
    return nx.rowsum(dy.reshape(math.prod(dy.shape[:-1]), n).to(acc).t()).to(dy.dtype)
