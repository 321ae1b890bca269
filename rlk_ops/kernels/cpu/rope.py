"""CPU reference rotate-half (NeoX / Qwen3) RoPE.

``inv_freq[i] = theta ** (-2i / rotary_dim)`` (evaluated in float64, rounded to fp32),
angle = fp32(position) * inv_freq in fp32, cos/sin by ``numerics.sincos`` rounded to
fp32, then ``x1*cos - x2*sin`` and ``x2*cos + x1*sin`` in fp32, one final rounding.
Dims past ``rotary_dim`` pass through unchanged.
"""
from __future__ import annotations

import functools

import torch

from rlk_ops.kernels.cpu import numerics as nx


@functools.lru_cache(maxsize=64)
def inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (1.0 / torch.tensor(theta, dtype=torch.float64) ** exps).float()


def cos_sin(positions: torch.Tensor, theta: float, rotary_dim: int, dtype: torch.dtype):
    """cos, sin [*positions.shape, rotary_dim/2] in ``dtype`` (fp32, or fp64 for fp64)."""
    if dtype == torch.float64:
        angle = positions.double()[..., None] * inv_freq(theta, rotary_dim).double()
    else:
        angle = positions.float()[..., None] * inv_freq(theta, rotary_dim)
    sin, cos = nx.sincos(angle)
    return cos.to(dtype), sin.to(dtype)


def _rotate(x, positions, theta, rotary_dim, sign):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = rotary_dim // 2
    cos, sin = cos_sin(positions, theta, rotary_dim, acc)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    x32 = x.to(acc)
    x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
    if sign > 0:
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
    else:  # inverse rotation (the transpose): the backward
        y1 = x1 * cos + x2 * sin
        y2 = x2 * cos - x1 * sin
    out = x.clone(memory_format=torch.contiguous_format)  # the op's (and its fake's) layout, whatever x's
    out[..., :half] = y1.to(x.dtype)
    out[..., half:rotary_dim] = y2.to(x.dtype)
    return out


def rope(x, positions, theta, rotary_dim):
    return _rotate(x, positions, theta, rotary_dim, +1)


def rope_bwd(dy, positions, theta, rotary_dim):
    return _rotate(dy, positions, theta, rotary_dim, -1)
