"""Mutation audit (session 41) of the CUDA backends' Python glue: kernels/fa4/{canonical, kernels,
loader, prepared, walk}.py, kernels/flashinfer.py, kernels/dispatch.py, on CPU stand-ins.

Each test kills mutants the earlier suite let through (session 41's audit report has the table):
an argument the glue forwards to FA4 / FlashInfer (scale, causal, lengths,
layout, overlap control, pdl, state lengths), a route boundary, a refusal, a cache key, the
fallback's copies. FA4 is tests/test_fa4.py's stand-in (the CPU reference), FlashInfer a wrapper
that records its plan; bitwise claims use torch.equal (conftest.bitwise_equal).
"""
import math
import sys
import types
import warnings

import pytest
import torch

import rlk_ops
from rlk_ops.kernels import dispatch
from rlk_ops.kernels import fa4 as fa4_backend
from rlk_ops.kernels.cpu import attention as cpu_attn
from rlk_ops.kernels.cpu import canonical as cpu_canonical
from rlk_ops.kernels.cpu import merge as cpu_merge
from rlk_ops.kernels.fa4 import canonical as fa4_canonical
from rlk_ops.kernels.fa4 import kernels as fa4_kernels
from rlk_ops.kernels.fa4 import loader, prepared, walk
from rlk_ops.meta import provenance

from conftest import bitwise_equal
from test_fa4 import _dense, _paged, fake, fresh_dispatch, install_fake  # noqa: F401 - fake, fresh_dispatch: fixtures
from test_fa4_prepared import Call, _inputs, _run, fake_fa4

BF16 = torch.bfloat16


@pytest.fixture
def gpu_fake(fake, monkeypatch):
    """The stand-in FA4 behind the dispatch point (check_available needs a GPU: pretend one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    prepared.clear()
    yield fake
    prepared.clear()


def _fwd_calls(fake):
    return [c[2] for c in fake.calls if c[0] == "_flash_attn_fwd"]


# ============================================================== fa4 canonical.py
def test_canonical_forward_passes_a_non_default_scale_on_every_route(gpu_fake):
    """Dense slots (a full call and a diagonal that is one strided batch) and varlen calls all hand FA4
    the op's scale; the tests before used the default d**-0.5, which FA4 would also take for None."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 256, h, 8, generator=g).to(BF16) for h in (2, 1, 1))
    cu = torch.tensor([0, 130, 140], dtype=torch.int32)
    qv, kv, vv = (torch.randn(140, h, 8, generator=g).to(BF16) for h in (2, 1, 1))
    for args, kw in (((q, k, v), {}), ((qv, kv, vv), dict(cu_seqlens_q=cu, cu_seqlens_k=cu))):
        ref = rlk_ops.attention(*args, softmax_scale=0.1, split_kv="canonical:128", **kw)   # cpu backend
        n = len(gpu_fake.calls)
        with rlk_ops.use_backend(attention_fwd="fa4"):
            got = rlk_ops.attention(*args, softmax_scale=0.1, split_kv="canonical:128", **kw)
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
        calls = [c[2] for c in gpu_fake.calls[n:]]
        assert calls and all(c["softmax_scale"] == 0.1 for c in calls)


def test_dense_diagonal_cap_admits_exactly_its_number_of_runs(gpu_fake):
    """DENSE_DIAGONAL_RUNS is 'at most this many dense calls': a 2 x 200 batch at C = 128 has 2 runs
    (the 128-row pieces, the 72-row ones), so a cap of 2 takes them dense (the suite checked 8 and 3
    with 4 runs only)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 200, h, 8, generator=g).to(BF16) for h in (2, 1, 1))
    ref = rlk_ops.attention(q, k, v, split_kv="canonical:128")
    with rlk_ops.use_backend(attention_fwd="fa4"), fa4_canonical.dense_diagonal(2):
        got = rlk_ops.attention(q, k, v, split_kv="canonical:128")
    diag = [c for c in _fwd_calls(gpu_fake) if c["causal"]]
    assert len(diag) == 2 and all(c.get("cu_seqlens_q") is None for c in diag)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_a_causal_call_goes_dense_only_with_the_setting_and_as_many_queries_as_keys(gpu_fake):
    """A diagonal call that is one strided batch goes dense only while DENSE_DIAGONAL_RUNS is on (0: the
    varlen call) and each piece has as many queries as keys (where the two alignments of FA4's causal
    mask coincide; the dense call at fewer queries than keys was never measured on the GPU)."""
    g = torch.Generator().manual_seed(9)
    cases = ((fa4_canonical.dense_diagonal(0), (256, 256)), (fa4_canonical.dense_diagonal(1), (50, 228)))
    for setting, (sq, sk) in cases:
        q = torch.randn(2, sq, 2, 8, generator=g).to(BF16)
        k, v = (torch.randn(2, sk, 1, 8, generator=g).to(BF16) for _ in range(2))
        ref = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        n = len(gpu_fake.calls)
        with rlk_ops.use_backend(attention_fwd="fa4"), setting:
            got = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        diag = [c[2] for c in gpu_fake.calls[n:] if c[2]["causal"]]
        assert len(diag) == 1 and diag[0].get("cu_seqlens_q") is not None, (sq, sk)
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_in_place_copies_a_misaligned_input_to_an_aligned_one():
    """FA4 copies a q/k/v whose base is not 16-byte aligned, and a prepared call refuses such a copy:
    _in_place hands it an aligned copy (the base of a contiguous slice at an odd element too)."""
    buf = torch.randn(8 * 4 * 16 + 1).to(BF16)
    for t in (buf[1:].view(8, 4, 16), buf[1:].view(8, 4, 16)[:, :2]):
        assert t.data_ptr() % 16
        got = fa4_canonical._in_place(t)
        assert got.data_ptr() % 16 == 0 and bitwise_equal(got, t)
    aligned = buf[:-1].view(8, 4, 16)
    assert fa4_canonical._in_place(aligned) is aligned


def _lens_merge(calls, pdl=True):
    """A merge that takes state lengths (and pdl) like the Triton one, computing with the CPU
    reference: a state of length 0 is skipped (its lse taken as -inf)."""
    def merge(out_parts, lse_parts, state_lens=None, pdl=None):
        calls.append(dict(state_lens=state_lens, pdl=pdl, n=out_parts.shape[0]))
        if state_lens is not None:
            lse_parts = lse_parts.masked_fill((state_lens == 0).view(*state_lens.shape, 1, 1), -math.inf)
        return cpu_merge.merge_attn_states(out_parts, lse_parts)
    merge.accepts_state_lens = True
    merge.accepts_pdl = pdl
    return merge


def _cpu_decode_pairs(q, page_table, seq_lens, page_size, chunk_size):
    """The Triton decode_pairs launch's layout (kernels/triton/merge.py), from the CPU policy."""
    table, lens, n = cpu_canonical.decode_pairs(page_table, seq_lens, page_size, chunk_size)
    return q.repeat(n, 1, 1, 1), table, lens, lens.clamp_min(1), n


def _decode_case(sq=1, lens=(300, 40, 129)):
    g = torch.Generator().manual_seed(21)
    ps = 16
    kc, vc = (torch.randn(60, ps, 2, 16, generator=g).to(BF16) for _ in range(2))
    table = torch.randperm(60, generator=g)[:3 * 19].view(3, 19).to(torch.int32)
    q = torch.randn(3, sq, 4, 16, generator=g).to(BF16)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("sq", [1, 3])
def test_fused_decode_route_merges_with_state_lengths(gpu_fake, monkeypatch, sq):
    """The route a merge taking state lengths enables (the GPU's Triton merge; the suite's CPU merge
    never took it): one query token goes through the pair layout and hands the merge the pair
    lengths (empty pairs' one-key partials are then skipped); Sq > 1 is chunked prefill, never this
    route. Bits of the cpu backend's canonical:C either way."""
    from rlk_ops.kernels.triton import merge as triton_merge

    merges = []
    monkeypatch.setattr(fa4_canonical, "kernel_for", lambda op, dev: _lens_merge(merges))
    monkeypatch.setattr(triton_merge, "decode_pairs", _cpu_decode_pairs)
    args = _decode_case(sq)
    ref = rlk_ops.paged_attention(*args, softmax_scale=0.2, split_kv="canonical:128")   # cpu backend
    got = fa4_canonical.paged_attention(*args, 0.2, 128, attend_paged=fa4_kernels.pair_attention)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    if sq == 1:
        (m,) = merges
        expect = cpu_canonical.decode_pairs(args[3], args[4], 16, 128)[1].view(m["n"], 3)
        assert m["state_lens"] is not None and torch.equal(m["state_lens"], expect)
    else:
        assert all(m["state_lens"] is None for m in merges)


@pytest.mark.parametrize("accepts_pdl", [True, False])
def test_triton_pair_route_forwards_pdl_to_a_merge_that_takes_it(gpu_fake, monkeypatch, accepts_pdl):
    """Where the Triton pair kernel computes the pairs, its launch's pdl goes to the merge (session 15
    dropped it: the one-wave PDL merge never launched), and only to a merge that accepts it."""
    from rlk_ops.kernels.triton import pair_decode as triton_pairs

    merges = []

    def pair_decode(q, k_cache, v_cache, page_table, seq_lens, scale, chunk_size, layout, pdl):
        qp, table, lens, klens, n = _cpu_decode_pairs(q, page_table, seq_lens, k_cache.shape[1], chunk_size)
        out, lse = cpu_attn.paged_attention(qp, k_cache, v_cache, table, klens, scale)
        return out, lse, lens, n

    monkeypatch.setattr(fa4_canonical, "kernel_for", lambda op, dev: _lens_merge(merges, accepts_pdl))
    monkeypatch.setattr(triton_pairs, "routable", lambda *a: True)
    monkeypatch.setattr(triton_pairs, "step_launch", lambda q, k_cache, n: {"pdl": "the launch's pdl"})
    monkeypatch.setattr(triton_pairs, "pair_decode", pair_decode)
    args = _decode_case()
    ref = rlk_ops.paged_attention(*args, softmax_scale=0.2, split_kv="canonical:128")
    with provenance.capture():
        got = fa4_canonical.paged_attention(*args, 0.2, 128, attend_paged=fa4_kernels.pair_attention)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    (m,) = merges
    assert m["pdl"] == ("the launch's pdl" if accepts_pdl else None) and m["state_lens"] is not None


@pytest.mark.parametrize("mode", ["merged", "states"])
def test_walk_route_merged_returns_the_walk_rows_states_merges_them_with_lengths(gpu_fake, monkeypatch, mode):
    """DECODE_WALK: "merged" returns the walk's own merged rows (no merge op), "states" merges the
    walk's partials with the merge op, handing it the pair lengths (pairs past a sequence's end are
    unwritten memory the merge must skip)."""
    merges, decodes = [], []
    args = _decode_case()
    q = args[0]
    n = cpu_canonical.pair_count(args[3].shape[1], 16, 128)
    pair_out = torch.randn(n, 3, 1, 4, 16).to(BF16)
    pair_lse = torch.randn(n, 3, 4, 1)

    def decode(q, k_cache, v_cache, page_table, seq_lens, scale, chunk_size, merge=True):
        decodes.append(merge)
        return torch.full_like(q, 5.0), torch.full((3, 4, 1), 7.0), pair_out, pair_lse

    monkeypatch.setattr(fa4_canonical, "kernel_for", lambda op, dev: _lens_merge(merges))
    monkeypatch.setattr(fa4_canonical, "DECODE_WALK", mode)
    monkeypatch.setattr(walk, "supported", lambda *a: True)
    monkeypatch.setattr(walk, "decode", decode)
    monkeypatch.setattr(fa4_canonical, "WALK_MIN_PROGRAMS", 1)
    out, lse = fa4_canonical.paged_attention(*args, 0.2, 128, attend_paged=fa4_kernels.pair_attention)
    if mode == "merged":
        assert decodes == [True] and merges == []
        assert bitwise_equal(out, torch.full_like(q, 5.0)) and bitwise_equal(lse, torch.full((3, 4, 1), 7.0))
    else:
        assert decodes == [False] and len(merges) == 1
        lens = walk.pair_lengths(args[4], n, 128)
        assert torch.equal(merges[0]["state_lens"], lens)
        ref = _lens_merge([])(pair_out, pair_lse, lens)
        assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1])


def test_walk_routing_counts_batch_times_kv_heads_from_the_minimum(gpu_fake, monkeypatch):
    """The walk takes a batch of at least WALK_MIN_PROGRAMS programs, one per (sequence, KV head)."""
    monkeypatch.setattr(fa4_canonical, "DECODE_WALK", "merged")
    monkeypatch.setattr(walk, "supported", lambda *a: True)
    kc = torch.empty(4, 128, 4, 8, dtype=BF16)
    assert fa4_canonical.walk_routed(torch.empty(64, 1, 16, 8, dtype=BF16), kc, 256)      # 64 x 4 = 256
    assert not fa4_canonical.walk_routed(torch.empty(63, 1, 16, 8, dtype=BF16), kc, 256)  # 252


# ============================================================== fa4 kernels.py
def test_head_dim_bounds_are_inclusive(fake):
    """head_dim 256 (the top of FA4's range) runs; canonical:C refuses 64 < d <= 96 only: 64 runs."""
    q, k, v = _dense(b=1, sq=3, sk=5, d=256)
    out, _ = fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "disabled")
    assert out.shape == q.shape
    q, k, v = _dense(b=1, sq=3, sk=5, d=64)
    got = fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "canonical:128")
    ref = rlk_ops.attention(q, k, v, softmax_scale=0.3, split_kv="canonical:128")   # cpu backend
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_varlen_forward_passes_the_scale_and_backward_the_causal_flag(fake):
    """A scale that is not d**-0.5 reaches the varlen call (the suite's 0.25 at d = 16 is the default
    FA4 would take for None); causal=0 reaches the backward (the suite ran it causal only)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(BF16) for t, h in ((11, 4), (13, 2), (13, 2)))
    cu_q = torch.tensor([0, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    out, lse = fa4_backend.attention_fwd(q, k, v, 1, 0.3, cu_q, cu_k, 0, 0, "disabled")
    assert fake.calls[-1][2]["softmax_scale"] == 0.3
    ref = cpu_attn.attention_fwd(q, k, v, 1, 0.3, cu_q, cu_k, 0, 0)
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1])
    q, k, v = _dense()
    out, lse = cpu_attn.attention_fwd(q, k, v, 0, 0.3, None, None, 0, 0)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    grads = fa4_backend.attention_bwd(dout, q, k, v, out, lse, None, 0, 0.3, None, None, 0, 0, "disabled")
    assert fake.calls[-1][2]["causal"] is False
    ref = cpu_attn.attention_bwd(dout, q, k, v, out, lse, None, 0, 0.3, None, None, 0, 0)
    assert all(bitwise_equal(a, b) for a, b in zip(grads, ref))


def test_length_tensors_reach_fa4_with_a_unit_stride(fake):
    """FA4 asserts a unit stride on cu_seqlens / seq_lens (an AssertionError, not an input error): a
    column of a bigger table is made contiguous first, in the forward, backward and paged calls."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(BF16) for t, h in ((11, 4), (13, 2), (13, 2)))
    cu = torch.tensor([[0, 0], [5, 6], [11, 13]], dtype=torch.int32)
    cu_q, cu_k = cu[:, 0], cu[:, 1]
    out, lse = fa4_backend.attention_fwd(q, k, v, 1, 0.3, cu_q, cu_k, 0, 0, "disabled")
    fa4_backend.attention_bwd(torch.ones_like(out), q, k, v, out, lse, None, 1, 0.3, cu_q, cu_k, 0, 0, "disabled")
    q, k_cache, v_cache, page_table, seq_lens = _paged()
    lens = torch.stack([seq_lens, seq_lens], 1)[:, 0]
    fa4_backend.paged_attention(q, k_cache, v_cache, page_table, lens, 0.25, "disabled")
    passed = [t for _, _, kw in fake.calls for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")
              if (t := kw.get(n)) is not None]
    assert len(passed) == 5 and all(t.is_contiguous() for t in passed)


def test_only_canonical_pair_calls_turn_the_overlap_off(fake, monkeypatch):
    """On sm90 with the decode tile at >= 512 CTAs, page 16: canonical:C's pair call passes
    intra_wg_overlap=False, strict single-pass decode keeps FA4's default (None), both with the tile."""
    monkeypatch.setattr(loader, "note_device", lambda fa4, device: "sm90")
    g = torch.Generator().manual_seed(3)
    kc, vc = (torch.randn(2, 16, 4, 128, generator=g).to(BF16) for _ in range(2))
    q = torch.randn(128, 1, 16, 128, generator=g).to(BF16)
    table = torch.zeros(128, 1, dtype=torch.int32)
    lens = torch.full((128,), 3, dtype=torch.int32)
    fa4_kernels.pair_attention(q, kc, vc, table, lens, 0.1)
    fa4_backend.paged_attention(q, kc, vc, table, lens, 0.1, "disabled")
    (pair, single) = (c[2] for c in fake.calls)
    assert pair["tile_mn"] == single["tile_mn"] == fa4_kernels.DECODE_TILE
    assert pair["intra_wg_overlap"] is False and single["intra_wg_overlap"] is None


# ============================================================== fa4 loader.py
def _backend_calls():
    """Every FA4 call the fa4 backend makes, per op, on every route (stand-in FA4)."""
    q, k, v = _dense(b=1, sq=136, sk=136, hq=2, hkv=1, d=8)
    g = torch.Generator().manual_seed(1)
    qv, kv, vv = (torch.randn(140, h, 8, generator=g).to(BF16) for h in (2, 1, 1))
    cu = torch.tensor([0, 130, 140], dtype=torch.int32)
    out, lse = cpu_attn.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0)
    outv, lsev = cpu_attn.attention_fwd(qv, kv, vv, 1, 0.3, cu, cu, 0, 0)
    paged = _decode_case()
    return {
        "attention_fwd": [lambda: fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "disabled"),
                          lambda: fa4_backend.attention_fwd(qv, kv, vv, 1, 0.3, cu, cu, 0, 0, "disabled"),
                          lambda: fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "canonical:128"),
                          lambda: fa4_backend.attention_fwd(qv, kv, vv, 1, 0.3, cu, cu, 0, 0, "canonical:128")],
        "attention_bwd": [lambda: fa4_backend.attention_bwd(out, q, k, v, out, lse, lse, 1, 0.3, None, None, 0, 0),
                          lambda: fa4_backend.attention_bwd(outv, qv, kv, vv, outv, lsev, None, 1, 0.3, cu, cu, 0, 0)],
        "paged_attention": [lambda: fa4_backend.paged_attention(*paged, 0.3, "disabled"),
                            lambda: fa4_backend.paged_attention(*paged, 0.3, "canonical:128"),
                            lambda: fa4_backend.paged_attention(*_decode_case(sq=3), 0.3, "canonical:128")],
    }


def test_every_keyword_the_backend_passes_is_a_checked_control(fake):
    """loader.REQUIRED is what strict mode checks before an op runs: every keyword the backend hands
    an FA4 function, on every route of the op, must be in it (an unchecked one is a TypeError inside
    FA4, or for the pinned controls a silently different reduction, instead of a named refusal)."""
    prepared.clear()
    try:
        for op, runs in _backend_calls().items():
            for run in runs:
                fake.calls.clear()
                run()
                assert fake.calls, op
                for fn, _, kw in fake.calls:
                    unchecked = set(kw) - set(loader.REQUIRED[op].get(fn, ()))
                    assert not unchecked, (op, fn, unchecked)
    finally:
        prepared.clear()


def test_a_failed_import_is_cached_until_reset(monkeypatch, fresh_dispatch):
    """A failed FA4 import is remembered (a non-strict fallback does not re-scan sys.path every call),
    until reset()."""
    monkeypatch.setitem(sys.modules, loader.INTERFACE_MODULE, None)
    with pytest.raises(dispatch.BackendUnavailable, match="cannot be imported"):
        loader.load()
    install_fake(monkeypatch)
    with pytest.raises(dispatch.BackendUnavailable, match="cannot be imported"):
        loader.load()
    loader.reset()
    assert loader.load().module is sys.modules[loader.INTERFACE_MODULE]


def test_reset_warns_again_and_archs_are_per_device(monkeypatch, fresh_dispatch):
    install_fake(monkeypatch)
    monkeypatch.setattr(loader, "installed_version", lambda: "4.1.0")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match=r"4\.1\.0 is not a version"):
            fa4 = loader.load()
        loader.reset()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: {0: (8, 0), 1: (9, 0)}[index])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert loader.note_device(fa4, torch.device("cuda", 1)) == "sm90"
        assert loader.note_device(fa4, torch.device("cuda", 0)) == "sm80"
    assert fa4.archs == {0: "sm80", 1: "sm90"}


# ============================================================== fa4 prepared.py
def test_a_misaligned_input_records_again():
    """The key holds each input's 16-byte alignment: FA4 compiles for it, so a replay on an input of
    the same shape and strides at another alignment would run a kernel built for the other one."""
    mod = fake_fa4()
    call = Call([0], [0], [40], [48])
    q, k, v, out_parts, lse_parts = _inputs(3)
    _run(mod, call, q, k, v, out_parts[0], lse_parts[0])
    buf = torch.empty(q.numel() + 1, dtype=q.dtype)
    q2 = buf[1:].view(q.shape)
    q2.copy_(q)
    assert q2.stride() == q.stride() and q2.data_ptr() % 16 != q.data_ptr() % 16
    _run(mod, call, q2, k, v, out_parts[1], lse_parts[1])
    assert mod.prelude == 2


def _flat_k_fa4():
    """A stand-in FA4 whose compiled kernel gets k as a flattened view (not k itself) and q, v, out,
    lse as they are: the kernel adds q + k + v."""
    mod = types.SimpleNamespace(prelude=0)

    def kernel(q, k_flat, v, out, lse):
        out.copy_(q + k_flat.view(q.shape) + v)
        lse.fill_(1.0)

    def _flash_attn_fwd(q, k, v, out, lse):
        mod.prelude += 1
        if "k" not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache["k"] = kernel
        _flash_attn_fwd.compile_cache["k"](q, k.reshape(-1), v, out, lse)

    _flash_attn_fwd.compile_cache = {}
    mod._flash_attn_fwd = _flash_attn_fwd
    return mod


def test_a_view_of_a_shared_buffer_is_rebuilt_only_for_the_same_sharing():
    """q and k in one buffer, k passed as a view that is not k itself: it is rebuilt from the buffer's
    first input (q) at the recorded offset, which is only k for the same offsets: k before q records
    again, and the result is FA4's own."""
    mod = _flat_k_fa4()
    call = object()
    out, lse = torch.zeros(4, 2, 8), torch.zeros(2, 4)

    def run(q, k, v):
        prepared.run(mod, call, {"q": q, "k": k, "v": v, "out": out, "lse": lse}, 1.0,
                     lambda: mod._flash_attn_fwd(q, k, v, out, lse))
        return out.clone()

    prepared.clear()
    try:
        g = torch.Generator().manual_seed(0)
        v = torch.randn(4, 2, 8, generator=g)
        a = torch.randn(2, 4, 2, 8, generator=g)
        run(a[0], a[1], v)
        b = torch.randn(3, 4, 2, 8, generator=g)
        got = run(b[1], b[0], v)     # k before q: the other offset
        assert bitwise_equal(got, b[1] + b[0] + v) and mod.prelude == 2
    finally:
        prepared.clear()


def test_the_cache_evicts_the_least_recently_used_entry(monkeypatch):
    monkeypatch.setattr(prepared, "MAX_ENTRIES", 2)
    prepared.clear()
    mod = fake_fa4()
    q, k, v, out_parts, lse_parts = _inputs(8)
    a, b, c = (Call([0], [0], [40], [48]) for _ in range(3))
    for call in (a, b, a, c):       # a used again after b: b is the least recently used when c comes
        _run(mod, call, q, k, v, out_parts[0], lse_parts[0])
    assert mod.prelude == 3
    _run(mod, a, q, k, v, out_parts[0], lse_parts[0])
    assert mod.prelude == 3


def test_an_input_inside_a_nested_argument_is_refused_and_an_fa4_error_restores_its_cache():
    mod = types.SimpleNamespace()

    def _flash_attn_fwd(q, k, v, out, lse):
        cc = _flash_attn_fwd.compile_cache
        if "k" not in cc:
            cc["k"] = lambda *a: None
        cc["k"](q, k, v, out, lse, (q,))

    _flash_attn_fwd.compile_cache = {}
    mod._flash_attn_fwd = _flash_attn_fwd
    q, k, v, out_parts, lse_parts = _inputs(2)
    live = {"q": q, "k": k, "v": v, "out": out_parts[0], "lse": lse_parts[0]}
    prepared.clear()
    with pytest.raises(prepared.PreparedCallError, match="input tensor inside a nested argument"):
        prepared.run(mod, object(), live, 1.0, lambda: mod._flash_attn_fwd(q, k, v, out_parts[0], lse_parts[0]))
    real = mod._flash_attn_fwd.compile_cache

    def failing():
        raise RuntimeError("FA4 failed")
    with pytest.raises(RuntimeError, match="FA4 failed"):
        prepared.run(mod, object(), live, 1.0, failing)
    assert mod._flash_attn_fwd.compile_cache is real and not prepared._CACHE


# ============================================================== fa4 walk.py
def test_walk_pair_lengths_and_its_one_token_check():
    got = walk.pair_lengths(torch.tensor([300, 128, 1, 129], dtype=torch.int32), 3, 128)
    assert got.dtype == torch.int32 and got.tolist() == [[128, 128, 1, 128], [128, 0, 0, 1], [44, 0, 0, 0]]
    q = torch.zeros(2, 2, 16, 128, dtype=BF16)
    kc = torch.zeros(4, 128, 4, 128, dtype=BF16)
    table, sl = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"needs one query token"):
        walk.decode(q, kc, kc, table, sl, 1.0, 256)


# ============================================================== flashinfer.py
def test_csr_reads_the_used_pages_only():
    from rlk_ops.kernels.flashinfer import _csr

    table = torch.tensor([[4, 1, 0], [2, 5, 3], [7, 7, 7], [6, 8, 9]], dtype=torch.int32)
    indptr, indices, last = _csr(table, torch.tensor([9, 4, 0, 8], dtype=torch.int32), 4)
    assert indptr.tolist() == [0, 3, 4, 4, 6] and indices.tolist() == [4, 1, 0, 2, 6, 8]
    assert last.tolist() == [1, 4, 0, 4]


class _Wrapper:
    """FlashInfer's decode wrapper, recording plan() and returning known out / log2 lse from run()."""
    made = 0

    def __init__(self, *a, **k):
        type(self).made += 1
        self.plans, self.resolved_backend = [], "stand-in"
        self._plan_info = [7, 0, 0, 16, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1]
        self._pin_memory_int_workspace_buffer = torch.tensor([9, 9, 44, 1, 0, 0], dtype=torch.uint8)  # 300

    def plan(self, *a, **k):
        self.plans.append((a, k))

    def run(self, q, kv, return_lse=False):
        return q + 1, torch.arange(q.shape[0] * q.shape[1], dtype=torch.float32).view(q.shape[0], q.shape[1]) / 8


@pytest.fixture
def fi(monkeypatch):
    from rlk_ops.kernels import flashinfer as FI

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Wrapper))
    monkeypatch.setattr(FI, "_wrappers", {})
    monkeypatch.setattr(FI, "_log", FI.PlanLog())   # the process-wide plan log and last plan, restored after
    monkeypatch.setattr(FI, "last_plan", None)
    _Wrapper.made = 0
    return FI


def test_flashinfer_plan_arguments_lse_units_and_layout(fi):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 4, 2, 8, generator=g).to(BF16)
    q = torch.randn(2, 3, 4, 8, generator=g).to(BF16)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([9, 6], dtype=torch.int32)
    out, lse = fi.paged_attention(q, kc, kc, table, lens, 0.3, "fixed:8")
    fi.paged_attention_auto(q[:, :1], kc, kc, table, lens, 0.3)
    (w,) = fi._wrappers.values()
    (a, kw), (a_auto, kw_auto) = w.plans
    assert a[3:] == (4, 2, 8, 4)                                   # hq, hkv, head_dim, page size
    assert (kw["sm_scale"], kw["q_len_per_req"], kw["disable_split_kv"], kw["fixed_split_size"]) == (0.3, 3, False, 2)
    assert (kw_auto["q_len_per_req"], kw_auto["disable_split_kv"], kw_auto["fixed_split_size"]) == (1, False, None)
    assert bitwise_equal(out, (q.reshape(6, 4, 8) + 1).view(2, 3, 4, 8))
    lse2 = torch.arange(24, dtype=torch.float32).view(6, 4) / 8
    assert bitwise_equal(lse, (lse2.view(2, 3, 4).permute(0, 2, 1) * fi.LN2).contiguous())
    assert fi.last_plan["policy"] == "auto"
    (fixed,) = [r for r in fi.plan_log().records() if r["policy"] == "fixed:8"]
    assert (fixed["split_kv"], fixed["kv_chunk_tokens"], fixed["work_items"], fixed["cta_tile_q"]) == (True, 300, 7, 16)
    # no query token: nothing to plan
    out, lse = fi.paged_attention(q[:, :0], kc, kc, table, lens, 0.3, "disabled")
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0) and lse.dtype == torch.float32 and len(w.plans) == 2
    assert _Wrapper.made == 1


def test_flashinfer_refusals_of_its_own(fi, monkeypatch):
    """The backend's own refusals, not only the op layer's and the dispatch point's: auto on
    rlk::paged_attention, an op it has no kernel for, no GPU."""
    args = _paged()
    with pytest.raises(ValueError, match=r"split_kv 'auto' is not batch-invariant"):
        fi.paged_attention(*args, 0.3, "auto")
    assert _Wrapper.made == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(dispatch.BackendUnavailable, match=r"has no kernel for rlk::linear"):
        fi.check_available("linear")
    fi.check_available("paged_attention")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(dispatch.BackendUnavailable, match=r"torch.cuda is not available"):
        fi.check_available("paged_attention_auto")


# ============================================================== dispatch.py
def test_a_fallback_for_gpu_tensors_runs_on_copies_and_writes_back(monkeypatch, fresh_dispatch):
    """Non-strict, a CUDA op the requested backend cannot run goes to the CPU reference on CPU copies:
    results go back to the op's device, and the arguments the op writes in place are copied back (per
    ``mutated``: a wrapper made for another ``mutated`` is not reused). Stand-ins for the device
    copies: a clone to 'the CPU', a recorded move back."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # the triton backend cannot run (on a GPU too)
    moved = []
    monkeypatch.setattr(dispatch, "_to_cpu", lambda x: x.clone() if isinstance(x, torch.Tensor) else x)
    monkeypatch.setattr(dispatch, "_to_device", lambda x, device: moved.append(device) or x)
    cuda = torch.device("cuda")
    k_cache, v_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    slots = torch.tensor([5, 0, -1])
    with rlk_ops.strict(False), rlk_ops.use_backend(paged_kv_append="triton"), provenance.capture() as log:
        dispatch.kernel_for("paged_kv_append", cuda)
        run = dispatch.kernel_for("paged_kv_append", cuda, (0, 1))
        run(k_cache, v_cache, k, v, slots)
    assert moved == [cuda]
    assert bitwise_equal(k_cache.view(8, 1, 8)[5], k[0]) and bitwise_equal(v_cache.view(8, 1, 8)[0], v[1])
    (rec,) = log.records()
    assert (rec.requested_backend, rec.actual_backend, rec.fallback, rec.device) == ("triton", "cpu", True, "cuda")


def test_nested_use_backend_of_one_op_restores_the_outer_request():
    with rlk_ops.use_backend(paged_attention="flashinfer"):
        with rlk_ops.use_backend(paged_attention="fa4"):
            assert dispatch.requested_backend("paged_attention", "cuda") == "fa4"
        assert dispatch.requested_backend("paged_attention", "cuda") == "flashinfer"
    assert dispatch.requested_backend("paged_attention", "cuda") == "fa4"
    assert dispatch.requested_backend("paged_attention", "cpu") == "cpu"
