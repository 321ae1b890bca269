"""canonical:C split-KV on FA4: the policy of kernels/cpu/canonical.py with FA4's single pass.

The definition is not restated here: ``canonical.attention_fwd`` / ``canonical.paged_attention``
(plan, executor, merge through the dispatch point) run unchanged with FA4 as the
single-pass kernel. A partial is FA4's ordinary single pass (``num_splits=1``,
``pack_gqa=PACK_GQA``): bf16 out as returned, fp32 lse.

Training (and chunked prefill): ``attend_into`` runs one FA4 call per state slot of the
plan, in place (a full call over a dense batch: one dense call on strided views, DENSE_SLOTS;
otherwise varlen): ``cu_seqlens_q``/``cu_seqlens_k`` are the pieces' first rows in the
packed q/k, ``seqused_q``/``seqused_k`` their lengths, and ``out=``/``lse=`` the slot
of the state buffer (FA4's private ``_flash_attn_fwd``, the entry point that takes
output buffers; the public varlen function allocates its own). So no query row is
copied and no partial is scattered: the earlier executor gathered each full piece's
queries (a query row once per earlier chunk) and scattered every partial, ~2 GiB of
copies at B=4, S=8k, C=1024 on top of the partials themselves. The bits are those of
the gathering route (a row's partial depends on its piece alone), which
benchmarks/canonical.py checks on the GPU with torch.equal.

Decode (one query per sequence, ``C % page_size == 0``) takes a faster route to the same
bits: where ``DECODE_PAIRS`` and the shapes allow, kernels/triton/pair_decode.py computes
every (chunk, sequence) pair's FA4 partial in one launch, bit for bit; otherwise the
triton ``decode_pairs`` kernel lays out every pair (page-table slice, length, query copy)
in one launch and ONE FA4 paged call attends all pairs (``causal=True``, ``seqused_k`` =
pair length). Either way the merge kernel skips empty pairs through their lengths. That is
two or three launches where the generic route takes ~15 (ten small tensor ops for the pair
layout, a mask, the merge); each costs ~2 us even inside a CUDA graph, as much as the
attention itself at batch 1 / 8k. The generic route stays for
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

import contextlib
import functools

import torch

from rlk_ops.kernels.cpu import canonical
from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.kernels.fa4 import loader
from rlk_ops.kernels.fa4.loader import NUM_SPLITS, PACK_GQA
from rlk_ops.meta import provenance


def attend_into(q, k, v, call: canonical.Call, scale, out, lse, prepare: bool = True):
    """One plan call: FA4 single pass over the call's pieces, written into ``out``/``lse``
    (through kernels/fa4/prepared.py when PREPARED_CALLS and ``prepare``: a plan that is used
    again, training's cached plans; a rollout chunked-prefill step's plan is new every step and
    would record without ever replaying, pushing training's recordings out of the bounded cache);
    a diagonal call as dense calls, one per strided run of its pieces, where DENSE_DIAGONAL_RUNS allows."""
    runs = _diagonal_runs(q, k, v, call, out, lse)
    if runs:
        for run in runs:
            attend_into(q, k, v, run, scale, out, lse, prepare)
        return
    if PREPARED_CALLS and prepare:
        from rlk_ops.kernels.fa4 import prepared
        with torch.no_grad():
            prepared.run(loader.load().module, call, {"q": q, "k": k, "v": v, "out": out, "lse": lse}, scale,
                         lambda: _fa4_call(q, k, v, call, scale, out, lse),
                         variant=(DENSE_SLOTS, bool(DENSE_DIAGONAL_RUNS)))
        return
    _fa4_call(q, k, v, call, scale, out, lse)


# Training's FA4 calls replayed from a recording (kernels/fa4/prepared.py: the same compiled
# kernel on the same argument values, without FA4's ~125 us of Python per call). Measured on the
# H200 (results/h200/session12/train_fwd_paths.json, B=4, S=8k, forward, direct call): the host
# time to issue it 2614 -> 1966 us at C=640, 2551 -> 1822 at C=768, 1228 -> 843 at C=1024, GPU
# time unchanged (3145 / 2924 / 2664 us), so the host now stays ahead of the GPU; out and lse
# torch.equal to FA4's own calls (there and tests/test_canonical_cuda.py). A call it cannot
# replay raises PreparedCallError; False (or ``prepared_calls(False)``) calls FA4 every time.
PREPARED_CALLS = True


@contextlib.contextmanager
def _setting(name: str, value):
    """This module's setting ``name`` is ``value`` inside the block (process-wide, restored on exit)."""
    settings = globals()
    old, settings[name] = settings[name], value
    try:
        yield
    finally:
        settings[name] = old


def prepared_calls(enabled: bool = True):
    """PREPARED_CALLS inside the block (benchmarks)."""
    return _setting("PREPARED_CALLS", bool(enabled))


# A full (non-causal) call whose pieces form one strided batch (``Call.strided_batch``: a dense
# [B, S] training batch) as a dense FA4 call on strided views of q/k/v and of the slot, instead
# of a varlen one. On SM90 FA4 launches a dense call on its SingleTileScheduler (a grid of (query
# tile, head, batch), each program's tile read from its block index) and a varlen one on its
# SingleTileVarlenScheduler (a grid sized for the worst-case padding of every piece, each program
# finding its piece by a warp prefix scan over the piece lengths); neither is persistent (session
# 17's comment here said the dense one was: wrong, FA4's static persistent schedule is its SM100
# kernel's). Why the dense grid is faster is our reading, not measured: a full call's tiles are
# short (C / 128 key blocks each), so a program's scheduling work is a larger share of it. Same
# tiles, same rows: the bits are the varlen call's. Measured on the H200
# (results/h200/session17/train_dense_slots.json, B=4, S=8k, every state row, the merged forward
# and the gradients torch.equal to the varlen calls):
# FA4's forward kernels 2594 -> 2251 us at C = 768 (2458 -> 2070 at 1024), forward + backward over
# single pass 1.200 -> 1.139 (each call alone) and 1.203 -> 1.088 (canonical.py's training method)
# at C = 768, 1.154 -> 1.108 and 1.082 -> 1.045 at 1024. False: the varlen calls.
DENSE_SLOTS = True


def dense_slots(enabled: bool = True):
    """DENSE_SLOTS inside the block (benchmarks, tests)."""
    return _setting("DENSE_SLOTS", bool(enabled))


# The diagonal (causal) call of a dense batch as dense causal FA4 calls, one per strided run of
# its pieces (``Call.strided_runs``: at B = 4, S = 8k, C = 768 one run of ten 768-row pieces per
# sequence and one of the four 512-row last pieces; at S % C == 0 one run), each piece as many
# queries as keys, so FA4's causal mask is the varlen call's (its bottom-right alignment is then
# top-left too). Same tiles, same rows: the varlen call's bits. At most this many dense calls for
# one diagonal call (a ragged batch has a run per length); 0: the varlen call. Measured on the
# H200 (results/h200/session18/train_dense_diag.json, B=4, S=8k, every state row, the forward and
# the gradients torch.equal to the varlen diagonal; us, varlen -> dense diagonal): at C = 1024 (one
# run) FA4's forward kernels 2107 -> 2082, forward 2555 -> 2388 (back to back) and 2888 -> 2776
# (each call alone), forward + backward 7911 -> 7697 and 8051 -> 7853; at C = 768 (five runs)
# mixed: kernels 2239 -> 2220, forward 2783 -> 2597 and 3005 -> 3111, forward + backward 8045 ->
# 7912 and 8050 -> 8130, and on 2 side streams no faster (train_streams*.json: 2509 / 2519 ->
# 2535 / 2528). So 1: only a diagonal call that is one strided batch goes dense (S % C == 0).
DENSE_DIAGONAL_RUNS = 1


def dense_diagonal(runs: int):
    """DENSE_DIAGONAL_RUNS inside the block (benchmarks, tests)."""
    return _setting("DENSE_DIAGONAL_RUNS", int(runs))


def _contiguous(*ts) -> bool:
    return all(t.is_contiguous() for t in ts)


def _diagonal_runs(q, k, v, call: canonical.Call, out, lse) -> tuple:
    """The causal call's strided runs when they go as separate dense calls (DENSE_DIAGONAL_RUNS),
    else () (also when the call is one strided batch: ``_dense_call`` makes it one dense call)."""
    if not (DENSE_SLOTS and DENSE_DIAGONAL_RUNS > 1 and call.causal and call.strided_batch is None):
        return ()
    runs = call.strided_runs
    if len(runs) > DENSE_DIAGONAL_RUNS or call.q_len != call.k_len or not _contiguous(q, k, v, out, lse):
        return ()
    return runs


def _strided(t: torch.Tensor, start: int, count: int, length: int, stride: int) -> torch.Tensor:
    """Rows ``start + b * stride + [0, length)`` of a packed ``[T, H, D]`` t as ``[count, length, H, D]``."""
    _, h, d = t.shape
    return t.as_strided((count, length, h, d), (stride * h * d, h * d, d, 1), t.storage_offset() + start * h * d)


def _dense_call(q, k, v, call: canonical.Call, scale, out, lse) -> bool:
    """The call as one dense FA4 call on strided views (DENSE_SLOTS; a causal call also needs
    DENSE_DIAGONAL_RUNS and as many queries as keys in every piece), if it can be: False if not."""
    batch = call.strided_batch
    if not DENSE_SLOTS or batch is None or not _contiguous(q, k, v, out, lse):
        return False
    if call.causal and not (DENSE_DIAGONAL_RUNS and call.q_len == call.k_len):
        return False
    (qs, ks), n, q0, k0 = batch, len(call.q_start), call.q_start[0], call.k_start[0]
    nq, nk = call.q_len[0], call.k_len[0]
    lse_view = lse.as_strided((n, lse.shape[0], nq), (qs, lse.shape[1], 1), lse.storage_offset() + q0)
    with torch.no_grad():
        loader.load().module._flash_attn_fwd(
            _strided(q, q0, n, nq, qs), _strided(k, k0, n, nk, ks), _strided(v, k0, n, nk, ks),
            softmax_scale=scale, causal=call.causal, num_splits=NUM_SPLITS, pack_gqa=PACK_GQA,
            return_lse=True, out=_strided(out, q0, n, nq, qs), lse=lse_view)
    return True


def _fa4_call(q, k, v, call: canonical.Call, scale, out, lse):
    if _dense_call(q, k, v, call, scale, out, lse):
        return
    with torch.no_grad():
        loader.load().module._flash_attn_fwd(
            q, k, v, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
            seqused_q=call.seqused_q, seqused_k=call.seqused_k,
            max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
            softmax_scale=scale, causal=call.causal, num_splits=NUM_SPLITS, pack_gqa=PACK_GQA,
            return_lse=True, out=out, lse=lse)


# Side streams for the training forward's per-slot calls (canonical.run): the calls of a
# long sequence are many (C=1024, S=8k: 9) and each ends in a partial wave; on side
# streams one call's tail overlaps the next one's work. Measured on the H200
# (results/h200/canonical.json, training 'fwd, 4 side streams', varlen calls then): forward at
# B=4, S=8k 2654 -> 2571 us at C=1024, 6417 -> 5684 at C=256, every state row bitwise equal
# (in_place_streams cells); tests/test_canonical_cuda.py checks 3 streams. With the full calls
# dense (DENSE_SLOTS), two streams beat four: forward at C = 768, us, streams 1 / 2 / 3 / 4 / 6,
# two runs (results/h200/session18/train_streams.json, train_streams_run2.json, every forward
# torch.equal to one stream's): 2623 / 2509 / 2537 / 2560 / 2547 and 2621 / 2519 / 2528 / 2573 /
# 2556. 1 turns it off.
STREAMS = 2


# Decode pairs (one query token, C a multiple of the page size): "triton" computes every
# (chunk, sequence) pair in one launch of kernels/triton/pair_decode.py ("keys" layout: its
# out and lse equal FA4's pair call bit for bit, tests/test_triton_pair_decode.py on the H200)
# where that kernel's checked shapes allow (``pair_decode.routable``); "fa4" (and every other
# shape) lays the pairs out and makes one FA4 paged call over them. Measured on the H200, op =
# pairs + the merge, page 16, C = 1024 (results/h200/pair_decode/configs_run5_split.json, one
# run): 1 x 8k 18.3 vs 18.5 us, 1 x 32k 26.6 vs 29.4, 8 x 8k 42.9 vs 46.0, 8 x 32k 138.2 vs
# 146.7, 64 x 8k 260.0 vs 272.0. Same bits either way. Correction (session 6): that "fa4"
# side was FA4's pair call without the 64-row tile the route uses; with it the pair call is
# 11.5 us at 1 x 8k C = 1024 (canonical.json decode profile), so there the "fa4" route (~16.4
# us) beats "triton" (18.5); "triton" is faster at every other measured cell (results/h200/canonical_history.md).
DECODE_PAIRS = "triton"
# Decode by FA4's chunk walk (kernels/fa4/walk.py: one program per (sequence, KV head), FA4's own
# SM90 kernel closing a partial at every chunk boundary) where it applies (walk.supported) and
# the batch has at least WALK_MIN_PROGRAMS programs (batch x KV heads). "merged": the walk's own
# merge (the formula of kernels/cpu/merge.py, bitwise equal to the merge op on the GPU);
# "states": the walk writes the partials and the merge op merges them; None (the default): the
# pair route. Not routed: on an H100 (session 30, results/h100/session30/walk_fa4_probe.json,
# page 128, C = 768, Hq 16 / Hkv 4, over FA4 single pass in the same run) the walk is slower
# than the pair route: 64 x 8k merged 1.057x, states 1.019x, states + merge op 1.039x; 64 x 32k
# 1.055x / 1.021x / 1.029x; the pair route (pairs + merge op) measured 1.020x / 1.018x on an
# H100 in session 29 and 1.047x at 32 x 8k, 1.016x at 16 x 32k in this run. Session 31 (64 x 8k,
# C = 768 / 1536 / 2048, results/h100/session31/): merged 1.055 / 1.033 / 1.029x against the pair
# route's 1.017 / 1.020 / 1.025x in the same runs. Every bit equal (tests/test_fa4_walk.py, the route
# test in tests/test_canonical_cuda.py).
DECODE_WALK = None
WALK_MIN_PROGRAMS = 256


def walk_routed(q, k_cache, chunk_size) -> bool:
    """Whether canonical:C decode of q goes through the walk (DECODE_WALK, walk.supported, WALK_MIN_PROGRAMS)."""
    if DECODE_WALK is None:
        return False
    if DECODE_WALK not in ("merged", "states"):
        raise ValueError(f"fa4 canonical.DECODE_WALK must be 'merged', 'states' or None, got {DECODE_WALK!r}")
    from rlk_ops.kernels.fa4 import walk
    arch = loader.note_device(loader.load(), q.device)
    return walk.supported(q, k_cache, chunk_size, arch) and q.shape[0] * k_cache.shape[2] >= WALK_MIN_PROGRAMS


def _in_place(t: torch.Tensor) -> torch.Tensor:
    """``t`` as FA4 reads it in place (a unit last stride, a 16-byte aligned base, 16-byte multiples for the
    other strides: a split of a fused qkv qualifies), else a contiguous aligned copy: FA4 copies any other
    q/k/v before its kernel, and a prepared call (PREPARED_CALLS) refuses to replay an input FA4 copied
    (PreparedCallError, session 32 audit)."""
    size = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1]):
        return t
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, chunk_size):
    q, k, v = _in_place(q), _in_place(k), _in_place(v)
    return canonical.attention_fwd(q, k, v, bool(causal), softmax_scale, cu_seqlens_q, cu_seqlens_k, chunk_size,
                                   attend_into=attend_into, streams=STREAMS)


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size, attend_paged):
    page_size = k_cache.shape[1]
    merge = kernel_for("merge_attn_states", q.device)
    fused = q.shape[1] == 1 and chunk_size % page_size == 0 and getattr(merge, "accepts_state_lens", False)
    if not fused:
        q = _in_place(q)

        def paged_nonempty(q, k_cache, v_cache, pair_table, pair_lens, scale):
            # empty pairs get one key; canonical.paged_attention masks their lse to -inf
            return attend_paged(q, k_cache, v_cache, pair_table, pair_lens.clamp_min(1), scale)

        # chunked prefill's plan is built per step (not cached): FA4 called directly, no recording (a
        # session 34 audit: every step recorded anew and evicted training's prepared calls)
        return canonical.paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size,
                                         attend_into=functools.partial(attend_into, prepare=False),
                                         attend_paged=paged_nonempty, merge=merge)
    bsz, _, hq, d = q.shape
    if walk_routed(q, k_cache, chunk_size):
        from rlk_ops.kernels.fa4 import walk
        provenance.note_kernel("fa4.walk")
        if DECODE_WALK == "states":   # the walk's partials, merged by the merge op
            _, _, pair_out, pair_lse = walk.decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale,
                                                   chunk_size, merge=False)
            return merge(pair_out, pair_lse, state_lens=walk.pair_lengths(seq_lens, pair_out.shape[0], chunk_size))
        out, lse, _, _ = walk.decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, chunk_size)
        return out, lse
    from rlk_ops.kernels.triton import pair_decode as triton_pairs
    from rlk_ops.kernels.triton.merge import decode_pairs

    merge_kw = {}
    if DECODE_PAIRS not in ("triton", "fa4"):
        raise ValueError(f"fa4 canonical.DECODE_PAIRS must be 'triton' or 'fa4', got {DECODE_PAIRS!r}")
    arch = provenance.gpu_arch(q.device) if q.device.type == "cuda" else None
    if DECODE_PAIRS == "triton" and triton_pairs.routable(q, k_cache, chunk_size, arch):
        n = canonical.pair_count(page_table.shape[1], page_size, chunk_size)
        launch = triton_pairs.step_launch(q, k_cache, n)
        provenance.note_kernel("triton.pair_decode")
        out, lse, pair_lens, n = triton_pairs.pair_decode(q, k_cache, v_cache, page_table, seq_lens, softmax_scale,
                                                          chunk_size, layout="keys", **launch)
        # the merge dispatch hands over is the Triton backend's wrapper (kernels/triton/__init__.py), which
        # forwards pdl (session 15: it dropped it, so the one-wave PDL merge was never launched)
        if getattr(merge, "accepts_pdl", False):   # the merge launched as the pair kernel expects
            merge_kw["pdl"] = launch["pdl"]
    else:
        q_pairs, pair_table, pair_lens, kernel_lens, n = decode_pairs(q, page_table, seq_lens, page_size,
                                                                      chunk_size)
        out, lse = attend_paged(q_pairs, k_cache, v_cache, pair_table, kernel_lens, softmax_scale)
    return merge(out.view(n, bsz, 1, hq, d), lse.view(n, bsz, hq, 1), state_lens=pair_lens.view(n, bsz), **merge_kw)
