"""rlk::paged_attention_auto: paged attention where the backend picks the split-KV.

Same layouts and meaning as ``rlk::paged_attention`` (q [B, Sq, Hq, D] = the newest Sq
tokens of each sequence; out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32 natural log), but the
backend chooses how to split each row's keys from the whole batch (FlashInfer's
automatic split-KV). That choice depends on the batch, so a row's bits depend on which
other sequences came with it: measured on the H200 (results/h200/kernels.json), a
sequence decoded alone and in a batch of 8 differ.

So this op is tagged ``torch.Tag.nondeterministic_bitwise`` and refuses to run in strict
mode (the default). It exists as a diagnostic and speed lane: compare it against the
strict lanes, never use it where trainer and rollout must agree. The cpu backend never
splits, so its "automatic" choice is a single pass (== paged_attention "disabled").
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.dispatch import StrictModeError, kernel_for, strict_mode
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import define, fake, impl
from rlk_ops.ops.attention import lse_dtype
from rlk_ops.ops.paged_attention import check_paged_inputs
from rlk_ops.ops.paged_kv import check_page_values

OP = "paged_attention_auto"


def paged_attention_auto(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         seq_lens: torch.Tensor, softmax_scale: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Diagnostic lane: batch-dependent split-KV. Refused in strict mode."""
    V.tensors(OP, q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens)
    V.no_gradient_inputs(OP, q=q, k_cache=k_cache, v_cache=v_cache)
    scale = V.softmax_scale(OP, q, softmax_scale)
    return torch.ops.rlk.paged_attention_auto(q, k_cache, v_cache, page_table, seq_lens, scale)


define(OP)


@impl(OP)
def _paged_attention_auto(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale)
    if strict_mode():
        raise StrictModeError(
            f"rlk::{OP}: the automatic split-KV depends on the batch on the GPU (FlashInfer's plan: not "
            f"batch-invariant), so strict mode "
            f"(the default) refuses it. Use rlk_ops.paged_attention(split_kv='disabled' or 'fixed:N'), or run "
            f"this diagnostic lane inside rlk_ops.strict(False).")
    check_page_values(OP, k_cache, page_table, seq_lens, min_len=q.shape[1])
    return kernel_for(OP, q.device)(q, k_cache, v_cache, page_table, seq_lens, softmax_scale)


@fake(OP)
def _paged_attention_auto_fake(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale)
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=lse_dtype(q))


def _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    check_paged_inputs(OP, q, k_cache, v_cache, page_table, seq_lens, softmax_scale)
