"""CPU reference for rlk::qk_norm_rope: literally qk_rmsnorm then rope (bitwise by construction)."""
from __future__ import annotations

from rlk_ops.kernels.cpu.norm import qk_rmsnorm
from rlk_ops.kernels.cpu.rope import rope


def qk_norm_rope(q, k, q_weight, k_weight, positions, eps, theta, rotary_dim):
    return (rope(qk_rmsnorm(q, q_weight, eps), positions, theta, rotary_dim),
            rope(qk_rmsnorm(k, k_weight, eps), positions, theta, rotary_dim))
