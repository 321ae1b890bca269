"""CPU kernel of the diagnostic rlk::paged_attention_auto lane. The reference backend
never splits the keys, so the split it picks "automatically" is always one pass."""
from __future__ import annotations

from rlk_ops.kernels.cpu.attention import paged_attention


def paged_attention_auto(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    return paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, "disabled")
