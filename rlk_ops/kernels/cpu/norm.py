"""CPU reference per-head RMSNorm in Qwen3's order.

Forward is Qwen3RMSNorm exactly (so it is bitwise equal to the Hugging Face module):
``w * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``. ``mean`` reduces over the
contiguous last dim: per row, in an order fixed by head_dim (see numerics.rowsum).
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.cpu import numerics as nx



def _normalized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in the accumulation dtype and mean(x**2) over the last dim, as ATen's mean (the sum, then
    a division by the count) but with the sum from nx.rowsum: ``.mean`` split one row of >= 32768
    elements across threads when it was the whole input and not when other rows came with it, so a
    row's variance once depended on the batch (session 28: fp32 rows of 40000, 1 ulp)."""
    x32 = x.to(nx.acc_dtype(x.dtype)).contiguous()
    return x32, (nx.rowsum(x32.pow(2)) / x.shape[-1])[..., None]


def qk_rmsnorm(x, weight, eps):
    x32, var = _normalized(x)
    xhat = x32 * torch.rsqrt(var + eps)
    return weight * xhat.to(x.dtype)


def qk_rmsnorm_bwd(dy, x, weight, eps):
    """Gradient of the forward (the final rounding treated as identity).
    dweight sums over every token and head: a fixed-order rowsum over rows."""
    d = x.shape[-1]
    x32, var = _normalized(x)
    rstd = torch.rsqrt(var + eps)
    xhat = x32 * rstd
    dy32 = dy.to(x32.dtype)
    dw = nx.rowsum((dy32 * xhat.to(x.dtype).to(x32.dtype)).reshape(-1, d).t())
    g = dy32 * weight.to(x32.dtype)
    proj = nx.rowsum(g * xhat)[..., None] / d
    dx = rstd * (g - xhat * proj)
    return dx.to(x.dtype), dw.to(weight.dtype)
