"""canonical:C split-KV on FA4: the policy of kernels/cpu/canonical.py with FA4's single pass.

The definition is not restated here: ``canonical.attention_fwd`` / ``canonical.paged_attention``
(plan, executor, merge through the dispatch point) run unchanged with the FA4 single-pass
kernels of kernels.py as ``attend`` / ``attend_paged``. A partial is FA4's ordinary
single pass (``num_splits=1``, ``pack_gqa=PACK_GQA``): bf16 out as returned, fp32 lse.

Decode (one query per sequence, ``C % page_size == 0``) takes a faster route to the same
bits: the triton ``decode_pairs`` kernel lays out every (chunk, sequence) pair (page-table
slice, length, query copy) in one launch, ONE FA4 paged call attends all pairs
(``causal=True``, ``seqused_k`` = pair length), and the merge kernel skips empty pairs
through their lengths. That is three launches where the generic route takes ~15 (ten
small tensor ops for the pair layout, a mask, the merge); each costs ~2 us even inside a
CUDA graph, as much as the attention itself at batch 1 / 8k. The generic route stays for
a merge backend that cannot take lengths (the cpu one, e.g. under the stand-in FA4 of the
plumbing tests); tests/test_canonical_cuda.py checks both routes give the same bits.

Empty pairs: FA4 is handed ``max(len, 1)`` keys for them (one key of page 0, which
``decode_pairs`` puts in the table row), so the kernel never sees a zero-length
sequence; their state is skipped by the merge all the same.

Backward (kernels.attention_bwd): FA4's single-pass deterministic backward evaluated at
the merged (out, lse). Exact, because the merge is exact algebra (the argument is in
kernels/cpu/attention.py, checked there against the chain rule through the merge).
"""
from __future__ import annotations

from rlk_ops.kernels.cpu import canonical
from rlk_ops.kernels.dispatch import kernel_for


def attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, chunk_size, attend):
    return canonical.attention_fwd(q, k, v, bool(causal), softmax_scale, cu_seqlens_q, cu_seqlens_k, chunk_size,
                                   attend=attend)


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size, attend, attend_paged):
    page_size = k_cache.shape[1]
    merge = kernel_for("merge_attn_states", q.device)
    fused = q.shape[1] == 1 and chunk_size % page_size == 0 and getattr(merge, "accepts_state_lens", False)
    if not fused:
        def paged_nonempty(q, k_cache, v_cache, pair_table, pair_lens, scale):
            # empty pairs get one key; canonical.paged_attention masks their lse to -inf
            return attend_paged(q, k_cache, v_cache, pair_table, pair_lens.clamp_min(1), scale)

        return canonical.paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size,
                                         attend=attend, attend_paged=paged_nonempty)
    from rlk_ops.kernels.triton.merge import decode_pairs

    bsz, _, hq, d = q.shape
    q_pairs, pair_table, pair_lens, kernel_lens, n = decode_pairs(q, page_table, seq_lens, page_size, chunk_size)
    out, lse = attend_paged(q_pairs, k_cache, v_cache, pair_table, kernel_lens, softmax_scale)
    return merge(out.view(n, bsz, 1, hq, d), lse.view(n, bsz, hq, 1), state_lens=pair_lens.view(n, bsz))
