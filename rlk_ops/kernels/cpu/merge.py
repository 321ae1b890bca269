"""Merging partial attention states (out, lse): forward and backward kernels.

Layout (the attention ops' own layouts, stacked along a new dim 0):
``out_parts [N, ..., S, H, D]`` and ``lse_parts [N, ..., H, S]`` (``...`` is ``B`` for
dense states or nothing for varlen ``[T, H, D]`` / ``[H, T]``). State ``n`` is the
partial attention of a row over the n-th key chunk; a state whose lse is ``-inf`` (no
key visible) is *skipped*, so padding a row with empty states never changes its bits.

The formula, fixed (the canonical:C definition; README "Split-KV policies"), per row:

    M   = max over non-skipped n of lse_n                       (exact)
    for n = 0, 1, ..., N-1, skipping empty states:              (ascending, fp32)
        w   = exp(lse_n - M)
        L   = L + w
        acc = acc + w * float(out_n)                            (a product, then a sum)
    out = acc / L, rounded once to out_parts' dtype;  lse = M + log(L)
    a row with every state skipped: out = 0, lse = -inf

Every step is an elementwise IEEE operation or ``numerics.exp``/``log``, so a row's
bits depend on its own states only (not on N, the batch, or the row's position in
the tensor), and the kernels are plain torch ops that run unchanged on any device.
float64 states accumulate in float64 (for gradcheck); every other dtype in float32.
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.cpu import numerics as nx



def merge_attn_states(out_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc_t = nx.acc_dtype(out_parts.dtype)
    # [N, ..., S, H], like out rows; contiguous so every result below is contiguous too
    lse_rows = lse_parts.transpose(-1, -2).to(acc_t).contiguous()
    present = lse_rows != -math.inf                                # NaN counts as present: it propagates
    m = lse_rows.amax(dim=0)                                       # N >= 1 (checked by the op)
    m_safe = torch.where(m == -math.inf, 0.0, m)
    total = torch.zeros_like(m_safe)
    acc = torch.zeros(out_parts.shape[1:], dtype=acc_t, device=out_parts.device)
    for n in range(out_parts.shape[0]):
        w = nx.exp(lse_rows[n] - m_safe)
        # where() rather than adding with weight 0: an empty state's out is never read
        # (it may hold anything; 0 * inf would be NaN)
        total = torch.where(present[n], total + w, total)
        acc = torch.where(present[n][..., None], acc + w[..., None] * out_parts[n].to(acc_t), acc)
    out = torch.where(total[..., None] == 0, 0.0, acc / total[..., None]).to(out_parts.dtype).contiguous()
    lse = (m + nx.log(total)).transpose(-1, -2).contiguous()       # log(0) = -inf for empty rows
    return out, lse.to(lse_parts.dtype)


def merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse):
    """Gradients of ``merge_attn_states`` w.r.t. (out_parts, lse_parts).

    With p_n = exp(lse_n - lse) (the share of state n; 0 for skipped states):
    d out_n = p_n * dout;  d lse_n = p_n * (rowsum(dout * (out_n - out)) + dlse).
    Per row: elementwise, plus one rowsum over head_dim (numerics.rowsum order)."""
    acc_t = nx.acc_dtype(out_parts.dtype)
    lse_n = lse_parts.transpose(-1, -2).to(acc_t).contiguous()     # [N, ..., S, H]
    lse_all = lse.transpose(-1, -2).to(acc_t).contiguous()         # [..., S, H]
    present = (lse_n != -math.inf) & (lse_all != -math.inf)
    p = torch.where(present, nx.exp(torch.where(present, lse_n - lse_all, 0.0)), 0.0)
    do = dout.to(acc_t)
    d_out_parts = (p[..., None] * do).to(out_parts.dtype).contiguous()
    dot = nx.rowsum(do * (out_parts.to(acc_t) - out.to(acc_t)))   # [N, ..., S, H]
    if dlse is not None:
        dot = dot + dlse.transpose(-1, -2).to(acc_t)
    d_lse = torch.where(present, p * dot, 0.0)
    return d_out_parts, d_lse.transpose(-1, -2).contiguous().to(lse_parts.dtype)
