"""canonical:C decode in one FA4 SM90 program per (sequence, KV head): the chunk walk.

The routed canonical:C decode (kernels/fa4/canonical.py) computes every (chunk, sequence) pair's
partial in one launch and merges them in a second. Its pairs are FA4's bits; its speed at large
batch is ~2% behind FA4's single pass (results/h200/canonical_history.md), because a Triton
kernel does not overlap softmax with the key loads the way FA4's warp-specialized pipeline does.

This module runs FA4's own SM90 forward kernel (``FlashAttentionForwardSm90``: its producer warp,
its pipelines, its per-block steps ``first_half_block_overlap`` / ``mma_one_n_block_intrawg_overlap``
/ ``last_half_block_overlap``, its ``Softmax``, its epilogue) with one method replaced: the
consumer's main loop (``mma``). FA4's single pass visits a sequence's 128-key blocks from the last
to the first. So does this walk; it only closes a partial at every chunk boundary:

    for chunk c = last .. 0:                           (the same block order as FA4's single pass)
        FA4's steps over the chunk's blocks, top to bottom, the first one as FA4's first block
        finalize (FA4's Softmax.finalize and rescale_O): the chunk's bf16 out and fp32 lse,
        exactly what FA4's pair call over that chunk writes; stored to the pair buffers
    merge the stored partials in ascending chunk order with the formula of
    kernels/cpu/merge.py (the same IEEE steps as kernels/triton/merge.py), in the same program
    write the merged row through FA4's epilogue

The producer is FA4's, unchanged: it loads the blocks top to bottom without a break, so the next
chunk's keys are in flight while a chunk is finalized. Every step that makes a partial's bits is
FA4's (the same methods, the same configuration as the pair call: tile, overlap, MMA variant).

Measured (results/h100/session30/ and session31/, H100; page 128, batch 64, over FA4 single pass in
the same run): every partial equals FA4's pair call and the merged row the pairs + merge op route,
bit for bit. It is slower than that route: merged 1.055x at C = 768 (1.033 at 1536, 1.029 at 2048),
the partials alone 1.020 / 1.011 / 1.006, against the routed pairs + merge 1.017-1.030. So
kernels/fa4/canonical.py does not route it (DECODE_WALK None). Closing a partial costs about 0.2% per
chunk boundary; the merge in the program a fixed ~2.2-3.4% (sixteen threads hold the query's rows,
and each chunk's step waits on global loads while the SM has nothing else to run). The walk over one
chunk holding the whole sequence costs nothing over FA4 (0.9997-1.0021x). Three variants were built
and measured in session 31 and removed: the next chunk's first QK^T issued with the closing chunk's
last PV (no change), the merge unrolled with selects (with the carried overlap: 1.07-1.19x),
3 K/V pipeline stages (+0.4-1.4%).

Only where it applies: sm90, head_dim 128, one query token per sequence (decode), G = 4 (where
FA4's pair call takes the 64-row tile), page size = FA4's key tile (128: its TMA path), no window,
no sink, C a multiple of 128. ``supported`` says so.

The merge's arithmetic is written in PTX, one rounded instruction each (``mul.rn``, ``add.rn``,
``div.rn``, ``cvt.rni``...): a plain ``a * b + c`` may be contracted into an FMA by the compiler,
which rounds once where the reference rounds twice.
"""
from __future__ import annotations

import torch

# FA4's tile for a decode step at G = 4 (kernels/fa4/kernels.DECODE_TILE) and its key tile = page size
TILE_N = 128


def supported(q: torch.Tensor, k_cache: torch.Tensor, chunk_size: int, arch: str | None) -> bool:
    """Whether the walk computes this canonical:C decode (else the pair route does): where FA4's pair
    call takes kernels.DECODE_TILE (sm90, head_dim 128, one query token, G = 4: the tile whose rows were
    measured equal to training's), page size = FA4's key tile, C a multiple of it."""
    from rlk_ops.kernels.fa4.kernels import DECODE_TILE, decode_tile
    return (q.dim() == 4 and k_cache.dim() == 4 and q.dtype == torch.bfloat16   # fp16: never run on a GPU
            and decode_tile(q, k_cache, arch) == DECODE_TILE and k_cache.shape[1] == TILE_N
            and chunk_size % TILE_N == 0)


def pair_lengths(seq_lens: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """``[N, B]`` int32: sequence b's keys in chunk c, ``clamp(seq_lens[b] - c*C, 0, C)`` (0: a pair
    the walk does not write, which the merge op skips)."""
    starts = torch.arange(n, device=seq_lens.device, dtype=torch.int64)[:, None] * chunk_size
    return (seq_lens.to(torch.int64)[None, :] - starts).clamp(0, chunk_size).to(torch.int32)


# FA4's SM90 configuration for the pair call at DECODE_TILE (interface._get_fwd_config with
# tile_mn given: its defaults mma_pv_is_rs=True, intra_wg_overlap=True; num_threads 384, 2 stages)
_TILE_M = 64
_COMPILED: dict = {}


def _cute_args(q, k_cache, v_cache, out, lse, seq_lens, page_table, pair_out, pair_lse):
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.utils import AuxData
    aux = [to_cute_tensor(t, assumed_align=4, fully_dynamic=True) for t in (pair_out, pair_lse)]
    return ([to_cute_tensor(t) for t in (q, k_cache, v_cache)]
            + [to_cute_tensor(out, assumed_align=16), to_cute_tensor(lse, assumed_align=4)],
            to_cute_tensor(seq_lens, assumed_align=4, leading_dim=0),
            to_cute_tensor(page_table, assumed_align=4, leading_dim=1), AuxData(aux, None))



def _compiled(q, k_cache, v_cache, out, lse, seq_lens, page_table, pair_out, pair_lse, chunk_size, merge):
    import cutlass.cute as cute
    from flash_attn.cute.interface import torch2cute_dtype_map

    from rlk_ops.kernels.fa4.walk_sm90 import CanonicalWalkSm90
    d, group = q.shape[-1], q.shape[2] // k_cache.shape[2]
    key = (q.dtype, d, group, chunk_size, bool(merge))
    fn = _COMPILED.get(key)
    if fn is None:
        kernel = CanonicalWalkSm90(
            torch2cute_dtype_map[q.dtype], d, d, group, is_causal=True, is_local=False, pack_gqa=True,
            tile_m=_TILE_M, tile_n=TILE_N, num_stages=2, num_threads=384, Q_in_regs=False,
            intra_wg_overlap=True, mma_pv_is_rs=True, mask_mod=None, score_mod=None, has_aux_tensors=True,
            q_subtile_factor=1, paged_kv_non_tma=False, chunk_blocks=chunk_size // TILE_N, merge=merge)
        qkvol, used, table, aux = _cute_args(q, k_cache, v_cache, out, lse, seq_lens, page_table, pair_out,
                                             pair_lse)
        fn = _COMPILED[key] = cute.compile(
            kernel, *qkvol, 1.0, None, None, None, used, table, None, None, None, None, aux, None, None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    return fn


def _check(q, k_cache, v_cache, page_table, seq_lens, chunk_size):
    """What FA4's interface asserts for this call, and the walk's own shape rule, as errors naming
    the argument (the op checks these before; a direct call gets them here)."""
    def bad(msg):
        raise ValueError(f"fa4 walk.decode: {msg}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.dtype != q.dtype:
        bad(f"q {q.dtype}, k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
            f"{v_cache.dtype} must share dtype, and the caches their shape")
    for name, t in (("seq_lens", seq_lens), ("page_table", page_table)):
        if t.dtype != torch.int32:
            bad(f"{name} must be int32, got {t.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table)):
        if t.stride(-1) != 1:
            bad(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")
    if seq_lens.shape != (q.shape[0],) or page_table.shape[0] != q.shape[0]:
        bad(f"seq_lens {tuple(seq_lens.shape)} and page_table {tuple(page_table.shape)} must have q's batch "
            f"{q.shape[0]} rows")
    if chunk_size % TILE_N or k_cache.shape[1] != TILE_N or q.shape[1] != 1:
        bad(f"needs one query token, page size {TILE_N} and C a multiple of {TILE_N}; got q {tuple(q.shape)}, "
            f"page size {k_cache.shape[1]}, C {chunk_size}")


def decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size, merge=True):
    """canonical:C decode by the walk: ``(out [B, 1, Hq, D], lse [B, Hq, 1], pair_out [N, B, 1, Hq, D],
    pair_lse [N, B, Hq, 1])``, N = the chunk slots of ``page_table``'s width (canonical.pair_count).
    The pairs past a sequence's last chunk are not written (their lengths say they are empty).
    ``merge=False``: out/lse are not the merged rows (the merge op takes the pairs instead).
    ``seq_lens >= 1`` (the op checks it under value checks): for a 0, FA4's producer reads
    ``page_table[b, -1]`` (as in FA4's single pass), before the table for b = 0; the row is then
    out 0, lse -inf. Caches finite in every slot of a sequence's pages (FA4 reads whole pages)."""
    _check(q, k_cache, v_cache, page_table, seq_lens, chunk_size)
    from flash_attn.cute.utils import AuxData

    from rlk_ops.kernels.cpu.canonical import pair_count
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    bsz, _, hq, d = q.shape
    n = pair_count(page_table.shape[1], k_cache.shape[1], chunk_size)
    out = torch.empty(bsz, 1, hq, d, dtype=q.dtype, device=q.device)   # contiguous, as FA4 allocates it
    lse = torch.empty(bsz, hq, 1, dtype=torch.float32, device=q.device)
    pair_out = torch.empty(n, bsz, hq, d, dtype=q.dtype, device=q.device)
    pair_lse = torch.empty(n, bsz, hq, dtype=torch.float32, device=q.device)
    fn = _compiled(q, k_cache, v_cache, out, lse, seq_lens, page_table, pair_out, pair_lse, chunk_size, merge)
    from flash_attn.cute.testing import is_fake_mode
    if not is_fake_mode():
        fn(q, k_cache, v_cache, out, lse, float(softmax_scale), None, None, None, seq_lens, page_table, None, None,
           None, None, AuxData([pair_out, pair_lse], None), None, None)
    return out, lse, pair_out.view(n, bsz, 1, hq, d), pair_lse.view(n, bsz, hq, 1)
