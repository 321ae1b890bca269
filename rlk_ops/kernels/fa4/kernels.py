"""The three FA4 kernels, with the CPU kernels' signatures (kernels/cpu/attention.py).

``split_kv``: "disabled" (one pass) or "canonical:C" (kernels/fa4/canonical.py: the chunk
partials are these same single-pass calls, merged by rlk::merge_attn_states).

Every call pins what decides the reduction order: ``num_splits=1`` (one pass over the
keys), ``pack_gqa=PACK_GQA`` and ``deterministic=True`` in the backward. Layouts are
FA4's own and the contract's: dense ``[B, S, H, D]`` with lse ``[B, Hq, Sq]``, varlen
``[T, H, D]`` with lse ``[Hq, T]``, paged cache ``[num_pages, page_size, Hkv, D]``;
lse is fp32 natural log. Causal masking is bottom-right aligned in both.

* Forward: FA4's public ``flash_attn_func`` / ``flash_attn_varlen_func`` under
  ``no_grad`` (our own autograd owns the backward; FA4's autograd.Function must not
  record a graph inside an op body).
* Backward: ``_flash_attn_bwd(..., deterministic=True, dlse=dlse)``. FA4 folds ``dlse``
  into its preprocessed row term exactly as the CPU reference does
  (``D_i = rowsum(dO * O)_i - dlse_i``; flash_bwd_preprocess.py), so a nonzero ``dlse``
  is exact and ``None`` skips it.
* Paged: ``_flash_attn_fwd(q, k_cache, v_cache, page_table=..., seqused_k=..., tile_mn=...)``
  reads the pages in place (``decode_tile``: a 64-row tile for decode, where verified;
  ``pair_attention``, canonical:C's call over (chunk, sequence) pairs, also sets
  ``intra_wg_overlap`` per ``pair_overlap``). Page size 128 (= FA4's key tile up to head_dim 128) takes FA4's TMA path,
  which loads whole pages: rows past ``seq_lens[b]`` in a sequence's last page are
  multiplied by P = 0, so they must be finite (a NaN there poisons the row); other
  page sizes take the cp.async path, which skips them. Allocate caches with zeros
  (stale finite values are fine). Unused ``page_table`` entries are never read.

``max_seqlen_* = 0`` (varlen) is derived from ``cu_seqlens`` here, which costs one
device-to-host copy; pass the maxima to avoid it (FA4 sizes its grid from them and the
backward's semaphores; any upper bound gives the same bits).
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.fa4 import canonical, loader
from rlk_ops.kernels.fa4.loader import NUM_SPLITS, PACK_GQA
from rlk_ops.meta.contract import SplitKVPolicy
from rlk_ops.ops._validate import fail

_DTYPES = (torch.bfloat16, torch.float16)


def _fa4(op: str, q: torch.Tensor, split_kv: str) -> tuple["loader.FA4", SplitKVPolicy]:
    policy = SplitKVPolicy.parse(split_kv)
    if policy.kind not in ("disabled", "canonical"):
        raise ValueError(
            f"rlk::{op}: split_kv {split_kv!r} is not supported by the fa4 backend (supported: 'disabled', "
            "'canonical:C'). FA4 on SM90 has no split-KV of its own (num_splits > 1 asserts); canonical:C "
            "splits outside the kernel, with a merge whose bits both sides share.")
    if q.dtype not in _DTYPES:
        fail(op, f"the fa4 backend needs bfloat16 or float16 inputs, got {q.dtype} "
                 "(FA4 has no fp32/fp64 kernels; run those on the cpu backend)")
    d = q.shape[-1]
    if not (8 <= d <= 256 and d % 8 == 0):
        fail(op, f"the fa4 backend needs head_dim in [8, 256] and a multiple of 8, got {d}")
    if policy.kind == "canonical" and 64 < d <= 96:
        # FA4's SM90 tile choice (flash_attn/cute/interface.py, _tile_size_fwd_sm90) gives non-causal calls
        # 144-key blocks and causal calls 128-key blocks at 64 < head_dim <= 96: training's full chunks
        # (non-causal) and decode's (chunk, sequence) pairs (causal) would reduce the same keys in other
        # blocks, so train != rollout (a session 34 audit; head_dim 128 is the one verified on the GPU)
        fail(op, f"canonical:C on the fa4 backend needs head_dim <= 64 or > 96, got {d}: FA4's SM90 key tile "
                 f"there is 144 for non-causal calls and 128 for causal ones, so training's full chunks and "
                 f"decode's pairs would not share their blocks")
    fa4 = loader.load()
    loader.note_device(fa4, q.device)
    return fa4, policy


def _max_len(cu: torch.Tensor, given: int) -> int:
    if given:
        return int(given)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _lengths(t):
    """FA4 asserts a unit stride on cu_seqlens / seq_lens (an AssertionError, not an input error, for a
    column of a bigger table: session 32 audit); the values are what matter."""
    return None if t is None else t.contiguous()


def attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  split_kv="disabled"):
    fa4, policy = _fa4("attention_fwd", q, split_kv)
    cu_seqlens_q, cu_seqlens_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    if policy.kind == "canonical":  # partials: FA4's single pass, written in place (canonical.attend_into)
        return canonical.attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, policy.size)
    with torch.no_grad():
        if cu_seqlens_q is None:
            out, lse = fa4.module.flash_attn_func(
                q, k, v, softmax_scale=softmax_scale, causal=bool(causal),
                num_splits=NUM_SPLITS, pack_gqa=PACK_GQA, return_lse=True)
        else:
            out, lse = fa4.module.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=_max_len(cu_seqlens_q, max_seqlen_q), max_seqlen_k=_max_len(cu_seqlens_k, max_seqlen_k),
                softmax_scale=softmax_scale, causal=bool(causal),
                num_splits=NUM_SPLITS, pack_gqa=PACK_GQA, return_lse=True)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, split_kv="disabled"):
    # canonical:C needs nothing else: the single-pass backward at the merged (out, lse) is its
    # exact gradient (kernels/fa4/canonical.py)
    fa4, _ = _fa4("attention_bwd", q, split_kv)
    cu_seqlens_q, cu_seqlens_k = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    with torch.no_grad():
        grads = fa4.module._flash_attn_bwd(
            q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=bool(causal),
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=_max_len(cu_seqlens_q, max_seqlen_q) if varlen else None,
            max_seqlen_k=_max_len(cu_seqlens_k, max_seqlen_k) if varlen else None,
            deterministic=True, dlse=dlse)
    dq, dk, dv = grads[:3]
    return dq, dk, dv


# FA4's SM90 forward tile for head_dim 128 is (128, 128): two MMA warpgroups of 64 query
# rows each. A decode step packs only Sq * G rows into it (G = Hq / Hkv; 4 for the Qwen3-8B
# TP=2 shard), so with (64, 128) one warpgroup computes them: the same 128-key blocks, the
# same per-row instructions (each warpgroup's rows are independent of the other's), and
# measured bitwise equal to the default tile on the H200 for strict and canonical:C decode
# (results/h200/canonical.json decode_profile; the train == rollout cells run with it),
# 7-32% faster. Only where that was measured: sm90, head_dim 128, one query token, G = 4 (a
# chunked-prefill call of up to 16 tokens, or another G, packs at most 64 rows too, but took it
# unmeasured until session 29: they get FA4's default tile).
DECODE_TILE = (64, 128)


def decode_tile(q: torch.Tensor, k_cache: torch.Tensor, arch: str | None) -> tuple[int, int] | None:
    """``tile_mn`` for a paged call: DECODE_TILE where verified, else FA4's default (None).
    ``arch``: what ``loader.note_device`` recorded for q's device (None off CUDA)."""
    if arch != "sm90" or q.shape[-1] != 128 or q.shape[1] != 1 or q.shape[2] != 4 * k_cache.shape[2]:
        return None
    return DECODE_TILE


# FA4's SM90 forward overlaps, inside each MMA warpgroup, one key block's softmax with the
# next block's QK^T (intra_wg_overlap, on by default). Turning it off changes when
# instructions issue, not what they compute: the canonical:C decode pair calls were measured
# bitwise equal with it on and off at 20 shapes, pages 16 and 128, on the H200
# (decode_profile, tile64_no_overlap_equal). Speed differs by KV path: at page 16 (FA4's
# cp.async page gather) off is 1-4% faster once the pair call has >= 512 CTAs (pairs x KV
# heads: batch 8 / 32k, batch 64) and mixed below (up to 11% slower at batch 1 / 8k); at
# page 128 (TMA, page = FA4's 128-key tile) off is no faster anywhere. So the pair call turns
# it off only at page 16 from PAIR_NO_OVERLAP_CTAS on; strict single-pass decode keeps FA4's
# default (not measured off).
PAIR_NO_OVERLAP_CTAS = 512
PAIR_NO_OVERLAP_PAGE = 16


def pair_overlap(q: torch.Tensor, k_cache: torch.Tensor, tile: tuple[int, int] | None) -> bool | None:
    """``intra_wg_overlap`` for a canonical:C decode pair call: False (off) where measured
    faster, else None (FA4's default)."""
    if tile != DECODE_TILE or k_cache.shape[1] != PAIR_NO_OVERLAP_PAGE:
        return None
    return False if q.shape[0] * k_cache.shape[2] >= PAIR_NO_OVERLAP_CTAS else None


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv="disabled"):
    fa4, policy = _fa4("paged_attention", q, split_kv)
    seq_lens = _lengths(seq_lens)
    if policy.kind == "canonical":
        return canonical.paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, policy.size,
                                         attend_paged=pair_attention)
    return _paged(fa4, q, k_cache, v_cache, page_table, seq_lens, softmax_scale, pairs=False)


def pair_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale):
    """The single pass over canonical:C (chunk, sequence) pairs (one pair per batch row)."""
    fa4, _ = _fa4("paged_attention", q, "disabled")
    return _paged(fa4, q, k_cache, v_cache, page_table, seq_lens, softmax_scale, pairs=True)


def _paged(fa4, q, k_cache, v_cache, page_table, seq_lens, softmax_scale, pairs):
    tile = decode_tile(q, k_cache, loader.note_device(fa4, q.device))
    with torch.no_grad():  # the private entry point: the public one takes no tile_mn
        out, lse = fa4.module._flash_attn_fwd(
            q, k_cache, v_cache, seqused_k=seq_lens, page_table=page_table,
            softmax_scale=softmax_scale, causal=True, num_splits=NUM_SPLITS, pack_gqa=PACK_GQA,
            return_lse=True, tile_mn=tile,
            intra_wg_overlap=pair_overlap(q, k_cache, tile) if pairs else None)[:2]
    return out, lse
