"""rlk::paged_attention: rollout-side attention over the paged KV cache.

    q          [B, Sq, Hq, D]   the newest Sq tokens of each sequence (decode: Sq = 1)
    k_cache, v_cache [num_pages, page_size, Hkv, D]   (already holding those tokens)
    page_table [B, max_pages] int32;  seq_lens [B] int32 (>= Sq, cached tokens incl. new)
    -> out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32 natural log

split_kv is the split-KV policy (meta/contract.py): "disabled" (single pass, the
default), "fixed:N" (backends that prove it batch-invariant) or "canonical:C".
"auto" is not batch-invariant and is refused here.

Causal, bottom-right aligned: query i sits at position seq_lens[b] - Sq + i. Each
row's result is bitwise the row ``attention_fwd`` computes for the same token in
full prefill (prefill/decode invariance), whatever the page size or placement.
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.meta.contract import spell
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import define, fake, impl
from rlk_ops.ops.attention import check_heads, check_split_kv, lse_dtype
from rlk_ops.ops.paged_kv import check_cache, check_page_table, check_page_values


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    seq_lens: torch.Tensor, softmax_scale: float | None = None,
                    split_kv: str = "disabled") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the newest Sq tokens of each sequence over its paged KV; (out, lse)."""
    V.tensors("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens)
    V.no_gradient_inputs("paged_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    scale = V.softmax_scale("paged_attention", q, softmax_scale)
    return torch.ops.rlk.paged_attention(q, k_cache, v_cache, page_table, seq_lens, scale, spell(split_kv))


define("paged_attention")


@impl("paged_attention")
def _paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv):
    op = "paged_attention"
    _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv)
    check_page_values(op, k_cache, page_table, seq_lens, min_len=q.shape[1])
    return kernel_for(op, q.device)(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv)


@fake("paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv):
    _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv)
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=lse_dtype(q))


def _check(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv):
    check_split_kv("paged_attention", split_kv, allowed=("disabled", "fixed", "canonical"))
    check_paged_inputs("paged_attention", q, k_cache, v_cache, page_table, seq_lens, softmax_scale)


def check_paged_inputs(op, q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    """Metadata checks shared by every paged attention op (also run by the fakes)."""
    V.ndim(op, "q", q, 4, "[B, Sq, Hq, D]")
    V.float_dtype(op, "q", q)
    check_cache(op, k_cache, v_cache)
    V.same_dtype(op, "k_cache", k_cache, "q", q)
    if k_cache.shape[-1] != q.shape[-1]:
        V.fail(op, f"k_cache's head_dim ({k_cache.shape[-1]}) must equal q's head_dim ({q.shape[-1]})")
    V.head_dim(op, "q", q)
    check_heads(op, q.shape[2], k_cache.shape[2])
    check_page_table(op, k_cache, page_table, seq_lens)
    if page_table.shape[0] != q.shape[0]:
        V.fail(op, f"page_table must have one row per sequence of q ({q.shape[0]}), got {page_table.shape[0]}")
    V.scale_value(op, softmax_scale, q.dtype)
    V.same_device(op, {"q": q, "k_cache": k_cache})
