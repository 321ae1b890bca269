"""canonical:C split-KV on the CUDA backends: FA4 partials, the Triton merge.

CPU part (always runs): the fa4 backend's canonical:C routing against the stand-in FA4
of tests/test_fa4.py (it computes with the CPU reference, so the fa4 route must give the
cpu backend's canonical bits exactly, and the calls it makes are checked).

CUDA part (``-m cuda``; skipped without a GPU): bitwise (torch.equal) claims on FA4 +
Triton: the Triton merge equals the CPU reference merge; training rows == paged decode
rows == chunked-prefill rows for several C, page sizes, batch compositions and positions
on and off chunk boundaries; the two FA4 equalities the policy rests on (a training
diagonal row vs its decode pair, a training full row vs a causal decode pair that sees
every key); the fused decode route == the generic one; run-to-run forward and backward.
Accuracy against float64 math. benchmarks/canonical.py runs the Qwen3-8B-shape matrix
and the timings (results/h200/canonical.json).

RLK_FA4_DRY_RUN=1 (with TRITON_INTERPRET=1 and triton importable) runs the CUDA part on
the CPU against the stand-in FA4 and the Triton interpreter: it checks the tests, it
proves nothing about FA4 or the GPU. Under Triton 3.9's interpreter the bf16 cells of the
merge (and the decode cells built on it) fail: the interpreter rounds fp32 -> bf16 toward
zero (checked: its casts equal truncation, with or without fp_downcast_rounding="rtne"),
the GPU to nearest even like torch; fp16/fp32 cells and the routing checks pass.
"""
import math
import os

import pytest
import torch

import rlk_ops
from rlk_ops.kernels import dispatch
from rlk_ops.kernels import fa4 as fa4_backend
from rlk_ops.kernels.cpu import canonical
from rlk_ops.kernels.cpu import merge as cpu_merge
from rlk_ops.kernels.fa4 import loader
from rlk_ops.meta import provenance

from conftest import bitwise_equal, rel_err
from test_fa4 import install_fake

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
DRY = os.environ.get("RLK_FA4_DRY_RUN") == "1"
DEV = "cpu" if DRY else "cuda"
cuda = pytest.mark.skipif(not (HAS_CUDA or DRY), reason="needs a CUDA GPU (FA4 and triton)")

HQ, HKV, D = 8, 2, 128  # G = 4, D = 128: the FA4 kernels of the Qwen3-8B shapes
# (lengths, chunk sizes): every sequence crosses chunk boundaries; 129 = one key past a block
LENS, CHUNKS = ([300, 140, 129], (128, 256)) if DRY else ([1300, 700, 129], (256, 512))
# Accuracy against float64 math (invariance is bitwise, never a tolerance):
OUT_TOL = 8e-3    # bf16 out rounding (2**-9) + P in bf16 for the PV MMA; canonical adds one bf16
                  # rounding per partial (measured ~1.1x single pass on the CPU reference)
LSE_TOL = 1e-3    # fp32 softmax statistics with ex2.approx (tests/test_fa4.py)
GRAD_TOL = 2e-2   # P and dS fed to bf16 MMAs; dq/dk/dv rounded to bf16 once
MERGE_BWD_TOL = 1e-6  # fp32 arithmetic; only the rowsum's summation order differs from the CPU


# ===================================================================== CPU plumbing
@pytest.fixture
def fake(monkeypatch):
    loader.reset()
    monkeypatch.setattr(dispatch, "_cache", {})
    f = install_fake(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the stand-in needs no GPU
    yield f
    loader.reset()


def _cpu_qkv(seed=1, s=300):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, h, 16, generator=g).to(BF16) for h in (4, 2, 2))


def test_fa4_canonical_forward_routes_to_single_pass_partials(fake):
    q, k, v = _cpu_qkv()
    cu = torch.tensor([0, 170, 300], dtype=torch.int32)
    with rlk_ops.use_backend(attention_fwd="fa4"):
        got = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")
    ref = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")  # cpu backend
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    # two state slots: the diagonal (causal) call writes slot 1, chunk 0's full (non-causal)
    # call slot 0; both single pass, in place (out/lse are the slots of one buffer)
    calls = [c for c in fake.calls if c[0] == "_flash_attn_fwd"]
    assert [(c[2]["causal"], c[2]["num_splits"], c[2]["pack_gqa"]) for c in calls] == [(True, 1, True),
                                                                                          (False, 1, True)]
    assert len(calls) == len(fake.calls)
    diag, full = (c[2] for c in calls)
    assert diag["cu_seqlens_q"].tolist() == [0, 128, 170, 298, 300] and diag["seqused_q"].tolist() == [128, 42, 128, 2]
    assert full["cu_seqlens_q"].tolist() == [128, 298, 300] and full["seqused_q"].tolist() == [42, 2]
    assert full["cu_seqlens_k"].tolist() == [0, 170, 298] and full["seqused_k"].tolist() == [128, 128]
    slots = diag["out"]._base if diag["out"]._base is not None else diag["out"]
    assert full["out"]._base is slots and slots.shape == (2, 300, 4, 16)


@pytest.mark.parametrize("sq", [1, 3])   # decode through the generic pair route, chunked prefill
def test_fa4_canonical_paged_records_each_merge_once(fake, monkeypatch, sq):
    """fa4's canonical paged route looked the merge up, then the generic route looked it up
    again: provenance recorded 2 merge calls for 1 merge run (review; since provenance is
    recorded when a kernel returns, the second lookup is counted here, not in provenance)."""
    import rlk_ops.kernels.cpu as cpu_pkg
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    runs, lookups = [], []
    orig = cpu_pkg.merge_attn_states

    def counted(*a, **k):
        runs.append(1)
        return orig(*a, **k)

    def looked_up(module):
        real = module.kernel_for

        def kernel_for(op, *a, **k):
            lookups.append(op)
            return real(op, *a, **k)
        return kernel_for

    monkeypatch.setattr(cpu_pkg, "merge_attn_states", counted)
    monkeypatch.setattr(fa4_canonical, "kernel_for", looked_up(fa4_canonical))
    monkeypatch.setattr(canonical, "kernel_for", looked_up(canonical))
    g = torch.Generator().manual_seed(0)
    ps = 16
    kc = torch.randn(40, ps, 2, 16, generator=g).to(BF16)
    vc = torch.randn(40, ps, 2, 16, generator=g).to(BF16)
    table = torch.zeros(2, 19, dtype=torch.int32)
    table[0] = torch.arange(19)
    table[1, :3] = torch.tensor([30, 25, 21])
    q = torch.randn(2, sq, 4, 16, generator=g).to(BF16)
    with rlk_ops.use_backend(paged_attention="fa4"), provenance.capture() as log:
        rlk_ops.paged_attention(q, kc, vc, table, torch.tensor([300, 40], dtype=torch.int32), split_kv="canonical:128")
    merges = [r for r in log.records() if r.op == "merge_attn_states"]
    assert len(runs) == 1 and [r.calls for r in merges] == [1] and lookups.count("merge_attn_states") == 1


def test_fa4_canonical_forward_replays_prepared_calls(fake):
    """PREPARED_CALLS (the default): the second forward of a plan replays the recorded kernel
    calls (no FA4 Python runs: the stand-in logs none) with the same bits; prepared_calls(False)
    runs FA4's Python again."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import prepared

    q, k, v = _cpu_qkv(seed=4)
    cu = torch.tensor([0, 170, 300], dtype=torch.int32)
    prepared.clear()
    try:
        with rlk_ops.use_backend(attention_fwd="fa4"):
            first = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")
            n = len(fake.calls)
            again = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")
            assert n == 2 and len(fake.calls) == n
            with fa4_canonical.prepared_calls(False):
                own = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")
            assert len(fake.calls) == 2 * n
    finally:
        prepared.clear()
    for got in (again, own):
        assert bitwise_equal(got[0], first[0]) and bitwise_equal(got[1], first[1])


def test_fa4_canonical_dense_slots_make_full_calls_dense(fake):
    """DENSE_SLOTS (the default): a dense batch's full calls (equal lengths, evenly spaced pieces) run as dense
    FA4 calls on strided views of q/k/v and of the slot (no cu_seqlens), the diagonal call stays
    varlen; every state row and the merged result are the varlen route's bits (stand-in FA4), also
    when the calls are replayed from a recording."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import prepared

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 300, h, 16, generator=g).to(BF16) for h in (4, 2, 2))
    prepared.clear()
    try:
        with rlk_ops.use_backend(attention_fwd="fa4"):
            with fa4_canonical.dense_slots(False):
                ref = rlk_ops.attention(q, k, v, split_kv="canonical:128")
            assert all(c[2].get("cu_seqlens_q") is not None for c in fake.calls)   # varlen calls only
            assert fa4_canonical.DENSE_SLOTS   # restored: the route
            n = len(fake.calls)
            got = rlk_ops.attention(q, k, v, split_kv="canonical:128")
            calls = [c[2] for c in fake.calls[n:]]
            again = rlk_ops.attention(q, k, v, split_kv="canonical:128")   # replayed: no FA4 Python
            assert len(fake.calls) == n + len(calls)
    finally:
        prepared.clear()
    assert [(c["causal"], c.get("cu_seqlens_q") is None) for c in calls] == [(True, False), (False, True), (False, True)]
    full0 = fake.calls[n + 1][1][0]                                   # chunk 0's full call: q rows 128..299
    assert full0.shape == (3, 172, 4, 16) and bitwise_equal(full0, q[:, 128:])
    assert calls[1]["out"].shape == (3, 172, 4, 16) and calls[1]["lse"].shape == (3, 4, 172)
    for res in (got, again):
        assert bitwise_equal(res[0], ref[0]) and bitwise_equal(res[1], ref[1])


def test_strided_batch_is_found_only_for_evenly_spaced_equal_pieces():
    dense = canonical.plan([(b * 300, 300, b * 300, 300) for b in range(3)], 128, True)
    full = [c for c in dense.calls if not c.causal]
    assert [c.strided_batch for c in full] == [(300, 300), (300, 300)]
    assert dense.calls[0].causal and dense.calls[0].strided_batch is None   # diagonal pieces 128, 128, 44
    ragged = canonical.plan([(0, 300, 0, 300), (300, 200, 300, 200)], 128, True)
    assert all(c.strided_batch is None for c in ragged.calls if not c.causal and len(c.q_start) > 1)
    one = canonical.plan([(0, 300, 0, 300)], 128, False)
    assert one.calls[0].strided_batch == (300, 128)


def _pieces(call):
    return sorted(zip(call.seq, call.chunk, call.q_start, call.q_len, call.k_start, call.k_len))


def test_strided_runs_cut_a_call_into_evenly_spaced_runs_of_equal_pieces():
    """Call.strided_runs: every piece in exactly one run, each run one strided batch of the call's
    kind and slot; a dense batch's diagonal call is a run per sequence plus one of the short last
    pieces (S % C != 0), or a single run (S % C == 0)."""
    dense = canonical.plan([(b * 300, 300, b * 300, 300) for b in range(3)], 128, True)
    diag = dense.calls[0]
    runs = diag.strided_runs
    assert [(r.q_start, r.strided_batch) for r in runs] == [
        ((0, 128), (128, 128)), ((256, 556, 856), (300, 300)), ((300, 428), (128, 128)), ((600, 728), (128, 128))]
    assert sorted(p for r in runs for p in _pieces(r)) == _pieces(diag)
    assert all(r.causal and r.slot == diag.slot for r in runs)
    even = canonical.plan([(b * 256, 256, b * 256, 256) for b in range(3)], 128, True).calls[0]
    assert even.strided_batch == (128, 128) and even.strided_runs == (even,)
    ragged = canonical.plan([(0, 300, 0, 300), (300, 200, 300, 200)], 128, True).calls[0]
    assert [(r.q_start, r.q_len) for r in ragged.strided_runs] == [
        ((0, 128), (128, 128)), ((256,), (44,)), ((300,), (128,)), ((428,), (72,))]
    # a spacing that changes mid-group cuts the run there
    uneven = canonical.plan([(0, 256, 0, 256), (300, 256, 300, 256)], 128, True).calls[0]
    assert [r.q_start for r in uneven.strided_runs] == [(0, 128), (300, 428)]


def test_fa4_canonical_dense_diagonal_runs_give_the_varlen_bits(fake):
    """DENSE_DIAGONAL_RUNS: the diagonal call of a dense batch as one dense causal FA4 call per
    strided run (stand-in FA4): the state rows and the merged result are the varlen call's bits, also
    replayed from the recordings; past the run cap the diagonal call stays one varlen call."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import prepared

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(3, 300, h, 16, generator=g).to(BF16) for h in (4, 2, 2))
    prepared.clear()
    try:
        with rlk_ops.use_backend(attention_fwd="fa4"):
            ref = rlk_ops.attention(q, k, v, split_kv="canonical:128")
            prepared.clear()   # the full calls' recordings: made again below, so every call shows
            n = len(fake.calls)
            with fa4_canonical.dense_diagonal(8):
                got = rlk_ops.attention(q, k, v, split_kv="canonical:128")
                calls = [c[2] for c in fake.calls[n:]]
                again = rlk_ops.attention(q, k, v, split_kv="canonical:128")   # replayed: no FA4 Python
                assert len(fake.calls) == n + len(calls)
            m = len(fake.calls)
            with fa4_canonical.dense_diagonal(3):                              # 4 runs: over the cap
                capped = rlk_ops.attention(q, k, v, split_kv="canonical:128")
            capped_calls = [c[2] for c in fake.calls[m:]]
    finally:
        prepared.clear()
    assert fa4_canonical.DENSE_DIAGONAL_RUNS == 1   # restored: the route (one strided batch only)
    # four dense causal calls (sequences' 128-row pieces, the three 44-row last pieces), then the full calls
    assert [(c["causal"], c.get("cu_seqlens_q") is None) for c in calls] == [(True, True)] * 4 + [(False, True)] * 2
    assert [c["out"].shape[:2] for c in calls[:4]] == [(2, 128), (3, 44), (2, 128), (2, 128)]
    assert [(c["causal"], c.get("cu_seqlens_q") is None) for c in capped_calls][0] == (True, False)
    for res in (got, again, capped):
        assert bitwise_equal(res[0], ref[0]) and bitwise_equal(res[1], ref[1])


def test_fa4_canonical_routes_a_diagonal_that_is_one_strided_batch_dense(fake):
    """The route (DENSE_DIAGONAL_RUNS = 1): at S % C == 0 the diagonal call is one strided batch and
    goes as one dense causal FA4 call; at S % C != 0 (several runs) it stays one varlen call. Same bits
    as every call varlen (stand-in FA4)."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    g = torch.Generator().manual_seed(9)
    for s, dense_diag in ((256, True), (300, False)):
        q, k, v = (torch.randn(2, s, h, 16, generator=g).to(BF16) for h in (4, 2, 2))
        with rlk_ops.use_backend(attention_fwd="fa4"):
            with fa4_canonical.dense_slots(False):
                ref = rlk_ops.attention(q, k, v, split_kv="canonical:128")
            n = len(fake.calls)
            got = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        diag = [c[2] for c in fake.calls[n:] if c[2]["causal"]]
        assert len(diag) == 1 and (diag[0].get("cu_seqlens_q") is None) == dense_diag, s
        if dense_diag:
            assert diag[0]["out"].shape[:2] == (4, 128)     # 2 sequences x 2 chunks, C rows each
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1]), s


def test_fa4_canonical_decode_is_one_paged_call_over_pairs(fake):
    q, k, v = _cpu_qkv(seed=2)
    page_size, lens = 16, [300, 40]
    k_cache = torch.zeros(40, page_size, 2, 16, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    table = torch.full((2, 19), 10**6, dtype=torch.int32)  # padding may hold anything
    table[0, :19] = torch.arange(19)
    table[1, :3] = torch.tensor([30, 25, 21], dtype=torch.int32)
    for b, n in enumerate(lens):
        slots = (table[b, :math.ceil(n / page_size), None].long() * page_size + torch.arange(page_size)).flatten()[:n]
        k_cache.view(-1, 2, 16)[slots] = k[:n]
        v_cache.view(-1, 2, 16)[slots] = v[:n]
    qd = torch.stack([q[n - 1] for n in lens])[:, None]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    with rlk_ops.use_backend(paged_attention="fa4"):
        got = rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv="canonical:128")
    ref = rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv="canonical:128")
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    (name, args, kw), = fake.calls
    assert name == "_flash_attn_fwd" and kw["causal"] is True and kw["num_splits"] == 1
    assert args[0].shape == (3 * 2, 1, 4, 16)  # N = ceil(19 * 16 / 128) = 3 chunks x 2 sequences
    # pair lengths: empty pairs are handed one key (their state is skipped by the merge)
    assert kw["seqused_k"].tolist() == [128, 40, 128, 1, 44, 1]


def test_fa4_canonical_backward_is_single_pass_at_merged_state(fake):
    q, k, v = (t[None, :200].clone().requires_grad_() for t in _cpu_qkv(seed=3))
    with rlk_ops.use_backend(attention_fwd="fa4", attention_bwd="fa4"):
        out, lse = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        got = torch.autograd.grad(out.float().square().sum() + lse.sum(), (q, k, v))
    out_r, lse_r = rlk_ops.attention(q, k, v, split_kv="canonical:128")
    ref = torch.autograd.grad(out_r.float().square().sum() + lse_r.sum(), (q, k, v))
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))
    bwd = [c for c in fake.calls if c[0] == "_flash_attn_bwd"]
    assert len(bwd) == 1 and bwd[0][2]["deterministic"] is True and bwd[0][2]["dlse"] is not None
    assert bitwise_equal(bwd[0][1][3], out.detach()) and bitwise_equal(bwd[0][1][5], lse.detach())


def test_demo_binds_and_matches_under_canonical():
    """Rollout chunked prefill gathers K/V (rlk::paged_kv_gather) and decode does not: the
    binding judges that op where it runs (it used to flag the decode entry as 'missing' and
    refuse to generate). Rows here merge one or two chunk states (C = 128)."""
    from rlk_ops.rollout import demo

    report = demo.run(device="cpu", layers=1, sequences=3, split_kv="canonical:128", backward=False,
                      negative_control=False, progress=False)
    assert report["binding"]["verdict"].startswith("PASS")
    assert report["mismatched_tokens"] == 0 and report["mismatched_attention_positions"] == 0
    assert max(report["prompt_lengths"]) > 128  # some rows really merge two states


def test_fa4_refuses_fixed_split(fake):
    q, k, v = _cpu_qkv()
    with pytest.raises(ValueError, match=r"split_kv 'fixed:256' is not supported by the fa4 backend"):
        fa4_backend.attention_fwd(q[None], k[None], v[None], 1, 0.25, None, None, 0, 0, "fixed:256")
    assert fake.calls == []


# ===================================================================== CUDA
@pytest.fixture(autouse=True)
def _dry_run(request, monkeypatch):
    if not DRY or "cuda" not in request.keywords:
        yield
        return
    pytest.importorskip("triton", reason="the dry run needs triton (TRITON_INTERPRET=1) for the merge kernels")
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 for the dry run"
    from rlk_ops.kernels import triton as triton_backend

    install_fake(monkeypatch)
    loader.reset()
    monkeypatch.setattr(dispatch, "_cache", {})
    monkeypatch.setattr(fa4_backend, "check_available", lambda op: None)  # no GPU here
    monkeypatch.setattr(triton_backend, "check_available", lambda op: None)
    with rlk_ops.use_backend(attention_fwd="fa4", attention_bwd="fa4", paged_attention="fa4",
                             merge_attn_states="triton", merge_attn_states_bwd="triton"):
        yield
    loader.reset()


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, seed, dtype=BF16):
    return torch.randn(*shape, device=DEV, generator=_gen(seed)).to(dtype)


def _states(n, rows, h, d, dtype, seed, lead=()):
    out_parts = _randn(n, *lead, rows, h, d, seed=seed, dtype=dtype)
    lse_parts = _randn(n, *lead, h, rows, seed=seed + 1, dtype=torch.float32) * 4
    return out_parts, lse_parts


def _with_empty(out_parts, lse_parts):
    """Empty states (lse = -inf, out NaN: never read), a row with no state at all."""
    out_parts, lse_parts = out_parts.clone(), lse_parts.clone()
    lse_parts[1, ..., 0, 3] = -math.inf
    out_parts[1, ..., 3, 0, :] = math.nan
    lse_parts[:, ..., 1, 5] = -math.inf
    out_parts[:, ..., 5, 1, :] = math.nan
    lse_parts[0, ..., 2, :] = -math.inf
    return out_parts, lse_parts


def _cpu_merge(out_parts, lse_parts):
    o, l = cpu_merge.merge_attn_states(out_parts.cpu(), lse_parts.cpu())
    return o.to(out_parts.device), l.to(out_parts.device)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_cuda_merge_equals_cpu_reference(dtype, lead):
    """The Triton merge is the CPU merge's formula op for op: same bits (fp32 exp/log polynomials)."""
    base = _states(5, 37, 3, 128, dtype, seed=1, lead=lead)
    out_parts, lse_parts = _with_empty(*base)
    with provenance.capture() as log:
        out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    assert {(r.op, r.actual_backend, r.fallback) for r in log.records()} == {("merge_attn_states", "triton", False)}
    ref = _cpu_merge(out_parts, lse_parts)
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1])
    assert not out[..., 5, 1, :].any() and bool((lse[..., 1, 5] == -math.inf).all())
    one = rlk_ops.merge_attn_states(base[0][2:3], base[1][2:3])  # one state merges to itself
    assert bitwise_equal(one[0], base[0][2]) and bitwise_equal(one[1], base[1][2])
    # a wide spread of lse values exercises exp's range reduction and log's frexp
    wide = _states(4, 301, 2, 64, dtype, seed=3, lead=lead)
    wide = (wide[0], wide[1] * 10)
    got, ref = rlk_ops.merge_attn_states(*wide), _cpu_merge(*wide)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("config", [(16, 1, 0), (1, 4, 5), (2, 2, 0), (4, 1, 5), (1, 4, 5, 8), (4, 1, 0, 8),
                                    (1, 4, 2, 8), (4, 1, 3), (1, 4, 5, 8, True), (2, 1, 5, 0, True),
                                    (4, 1, 3, 0, True), (16, 1, 0, 0, True)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_cuda_merge_config_changes_no_bit(config, dtype):
    """Rows per program, head_dim slices, unrolled (whole or in groups of 2 or 3, the last
    one partly past N) or looped walk, looped or 2D max, eager loads (the skipped states'
    NaN rows loaded and never selected): the CPU reference's bits. (fp32 states: the cells
    the dry run's interpreter can check, see the module docstring.)"""
    from rlk_ops.kernels.triton import merge as triton_merge

    out_parts, lse_parts = _with_empty(*_states(5, 37, 3, 128, dtype, seed=11))
    got = triton_merge.merge_attn_states(out_parts, lse_parts, config=config, vec=0)   # the walk kernel
    ref = _cpu_merge(out_parts, lse_parts)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    assert triton_merge.merge_config(37 * 3, 5, 128, out_parts.device)[2] == 5  # default: unrolled


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("config", [(16, 1, 3, 8, False, True), (4, 1, 2, 8, True, True), (1, 4, 7, 8, False, True),
                                    (4, 2, 1, 8, False, True), (16, 1, 2, 8, True, True, 8),
                                    (8, 2, 1, 8, True, True, 2)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_cuda_merge_skipping_absent_states_changes_no_bit(config, dtype):
    """The walk that leaves out the states no row of a program holds (config[5], _merge_fwd
    SKIP), on training's pattern (rows in chunk i hold states 0..i-1 and the last; here chunks of
    9 rows, 7 states) plus the empty states and row of _with_empty: the CPU reference's bits, in
    groups of 1, 2, 3 and 7 states, and on 2 or 8 warps (config[6])."""
    from rlk_ops.kernels.triton import merge as triton_merge

    n, rows, h = 7, 45, 3
    out_parts, lse_parts = _with_empty(*_states(n, rows, h, 128, dtype, seed=21))
    chunk = torch.arange(rows, device=DEV) // 9                       # rows' chunk: 0..4
    for st in range(n - 1):
        lse_parts[st][:, chunk <= st] = -math.inf                    # states i..N-2 of chunk-i rows
    got = triton_merge.merge_attn_states(out_parts, lse_parts, config=config, vec=0)
    ref = _cpu_merge(out_parts, lse_parts)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_cuda_routed_training_merge_skips_absent_states_with_the_same_bits(dtype):
    """Past VEC_ROWS_MAX rows merge_route takes the skipping walk (training's merges): on
    training's pattern, chunks of 300 rows, the CPU reference's bits."""
    from rlk_ops.kernels.triton import merge as triton_merge

    n, rows, h = 7, 1500, 3
    out_parts, lse_parts = _with_empty(*_states(n, rows, h, 128, dtype, seed=22))
    assert rows * h > triton_merge.VEC_ROWS_MAX
    assert triton_merge.merge_route(rows * h, n, 128, out_parts.device)[0][5:] == (1,)
    chunk = torch.arange(rows, device=DEV) // 300
    for st in range(n - 1):
        lse_parts[st][:, chunk <= st] = -math.inf
    got = triton_merge.merge_attn_states(out_parts, lse_parts)
    ref = _cpu_merge(out_parts, lse_parts)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_merge_skip_needs_the_2d_max_and_an_unrolled_walk():
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    parts = torch.zeros(3, 2, 1, 4, 8), torch.zeros(3, 2, 4, 1)
    with pytest.raises(ValueError, match=r"needs the 2D max and an unrolled walk .*got \(4, 1, 3, 0, False, True\)"):
        triton_merge.merge_attn_states(*parts, config=(4, 1, 3, 0, False, True), vec=0)
    with pytest.raises(ValueError, match=r"needs the 2D max and an unrolled walk .*got \(4, 1, 0, 4, False, True\)"):
        triton_merge.merge_attn_states(*parts, config=(4, 1, 0, 4, False, True), vec=0)


def test_merge_refuses_an_explicit_config_that_drops_states_or_head_dims():
    """A 2D max narrower than the state count read only the first states (10 states, width 4: NaN out
    and +inf lse where state 9 held the row), and a head_dim split past its width made an empty slice
    (a session 35 audit; merge_config never makes either, an explicit config could)."""
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    parts = torch.zeros(10, 2, 1, 4, 8), torch.zeros(10, 2, 4, 1)
    for vec in (0, 4):
        with pytest.raises(ValueError, match=r"2D max width config\[3\] must be 0 or a power of two >= the state "
                                             r"count 10, got 4"):
            triton_merge.merge_attn_states(*parts, config=(1, 1, 4, 4), vec=vec)
    with pytest.raises(ValueError, match=r"2D max width config\[3\] .*got 12"):
        triton_merge.merge_attn_states(*parts, config=(1, 1, 0, 12), vec=0)
    tiny = torch.zeros(3, 2, 1, 4, 2), torch.zeros(3, 2, 4, 1)
    with pytest.raises(ValueError, match=r"head_dim split config\[1\] must be a power of two dividing 2 "
                                         r"\(head_dim 2 rounded up\), got 4"):
        triton_merge.merge_attn_states(*tiny, config=(1, 4, 0, 4), vec=0)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block,split,vec,two_d_max,dtype", [
    (1, 4, 32, True, BF16), (1, 4, 32, False, BF16), (1, 1, 32, True, torch.float32), (1, 1, 32, True, BF16),
    (1, 1, 32, False, BF16), (2, 2, 8, False, BF16),
    (1, 4, 4, True, torch.float32), (4, 1, 1, False, BF16)])
@pytest.mark.parametrize("n", [5, 37])
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_merge_vec_changes_no_bit(block, split, vec, two_d_max, dtype, n, eager):
    """_merge_vec (states side by side in groups of vec, the last group partly past N; skipped
    states' NaN rows loaded and never selected; a row with no state): the CPU reference's
    bits, with and without the 2D max, with the first group's loads before the max or not
    (EAGER), and with pair lengths in place of -inf lse."""
    from rlk_ops.kernels.triton import merge as triton_merge

    out_parts, lse_parts = _with_empty(*_states(n, 37, 3, 128, dtype, seed=13))
    config = (block, split, 0, triton_merge.C.pow2(n) if two_d_max else 0, eager)
    got = triton_merge.merge_attn_states(out_parts, lse_parts, config=config, vec=vec)
    ref = _cpu_merge(out_parts, lse_parts)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    # decode's form: [N, B, 1, H, D] states whose empty pairs are named by a 0 length
    dec_out = _randn(n, 9, 1, 3, 128, seed=14, dtype=dtype)
    dec_lse = _randn(n, 9, 3, 1, seed=15, dtype=torch.float32) * 4
    lens = (torch.arange(n * 9, device=DEV).view(n, 9) % 3).to(torch.int32)   # every third pair empty
    masked = torch.where((lens > 0)[:, :, None, None], dec_lse, -math.inf)
    got = triton_merge.merge_attn_states(dec_out, dec_lse, state_lens=lens, config=config, vec=vec)
    ref = _cpu_merge(dec_out, masked)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_merge_vec_is_routed_only_for_one_row_one_warp_programs():
    """The measured rule (triton merge.VEC_STATES, VEC_ROWS_MAX): decode's 1-row programs over a
    quarter of head_dim (fewer rows than SMs: up to batch 8 on the H200) take _merge_vec, 32
    states a group; with a config that gives multi-row programs vec_states keeps the walk (the
    quarter-head_dim vec blocking was slower at batch 64); merge_route gives larger decode
    batches _merge_vec over all of head_dim, training the walk that skips absent states
    (SKIP_UNROLL, on SKIP_BLOCK rows while the grid keeps two programs per SM)."""
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    cpu_dev = torch.device("cpu")  # merge_config assumes 4 SMs off CUDA: 2 rows get 1-row programs, 4 slices
    block, split, _, _ = triton_merge.merge_config(2, 16, 128, cpu_dev)
    assert (block, split) == (1, 4) and triton_merge.vec_states(block, 128 // split) == 32
    block, split, _, _ = triton_merge.merge_config(4096, 16, 128, cpu_dev)
    assert block > 1 and triton_merge.vec_states(block, 128 // split) == 0
    assert triton_merge.vec_states(1, 128) == 0   # over all of head_dim: merge_route decides, not vec_states
    assert triton_merge.vec_config(40, 128) == (1, 4, 0, 64)
    assert triton_merge.vec_config(300, 128) == (1, 4, 0, 0)   # past MAX_2D: the looped max
    # merge_route (no explicit config): past one program per SM up to VEC_ROWS_MAX rows, _merge_vec
    # on 1-row programs over all of head_dim (batch 64 decode); beyond, and head_dim > 128, the walk
    assert triton_merge.merge_route(2, 16, 128, cpu_dev) == ((1, 4, 16, 16), 32)   # unroll unused by vec
    assert triton_merge.merge_route(8, 16, 128, cpu_dev) == ((1, 1, 0, 16), 32)
    assert triton_merge.merge_route(4096, 300, 128, cpu_dev) == ((1, 1, 0, 0), 32)
    assert triton_merge.merge_route(4097, 16, 128, cpu_dev) == ((32, 1, 1, 16, False, 1), 0)   # skipping walk
    assert triton_merge.merge_route(4097, 300, 128, cpu_dev) == ((16, 1, 32, 0), 0)   # no 2D max: no skipping
    cfg, vec = triton_merge.merge_route(8, 16, 256, cpu_dev)
    assert vec == 0 and len(cfg) == 4   # the walk, not skipping (few rows)


def test_merge_vec_refuses_a_width_that_is_not_a_power_of_two():
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    parts = torch.zeros(3, 2, 1, 4, 8), torch.zeros(3, 2, 4, 1)
    with pytest.raises(ValueError, match="vec must be a power of two .*got 12"):
        triton_merge.merge_attn_states(*parts, vec=12)


def test_merge_config_uses_the_2d_max_up_to_max_2d_states():
    """The measured rule (triton merge.MAX_2D): 1-row (decode) and multi-row (training) programs
    take the 2D max over up to MAX_2D states; more states walk the lse chain."""
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    cpu_dev = torch.device("cpu")  # merge_config assumes 4 SMs off CUDA: 4 rows get 1-row programs
    block, _, unroll, max2d = triton_merge.merge_config(4, 8, 128, cpu_dev)
    assert (block, unroll, max2d) == (1, 8, 8)
    assert triton_merge.merge_config(4, 300, 128, cpu_dev)[2:] == (triton_merge.MAX_UNROLL, 0)  # groups
    block, _, _, max2d = triton_merge.merge_config(4096, 13, 128, cpu_dev)
    assert block > 1 and max2d == 16
    assert triton_merge.merge_config(4096, 300, 128, cpu_dev)[3] == 0


def test_decode_pairs_prefetch_refuses_caches_it_cannot_prefetch():
    """decode_pairs(prefetch=...) names what it needs and what it got (checked before a launch)."""
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import merge as triton_merge

    q = torch.zeros(1, 1, HQ, D)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    cache = torch.zeros(4, 16, HKV, D, dtype=BF16)
    with pytest.raises(ValueError, match=rf"contiguous 16-byte aligned caches of one shape.*got shapes "
                                         rf"\(4, 16, {HKV}, 128\) / \(4, 16, {HKV}, 64\)"):
        triton_merge.decode_pairs(q, table, lens, 16, 128, prefetch=(cache, cache[..., :64]))
    assert not triton_merge.prefetchable(cache, cache.transpose(1, 2))


@cuda
@pytest.mark.cuda
def test_cuda_merge_rows_batch_invariant_run_to_run_and_state_lens():
    from rlk_ops.kernels.triton import merge as triton_merge

    out_parts, lse_parts = _with_empty(*_states(4, 50, 4, 128, BF16, seed=5))
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    again = rlk_ops.merge_attn_states(out_parts, lse_parts)
    assert bitwise_equal(out, again[0]) and bitwise_equal(lse, again[1])
    for r in (0, 17, 49):
        o, l = rlk_ops.merge_attn_states(out_parts[:, r:r + 1].contiguous(), lse_parts[:, :, r:r + 1].contiguous())
        assert bitwise_equal(o[0], out[r]) and bitwise_equal(l[:, 0], lse[:, r])
    # decode layout [N, B, 1, H, D]: a zero state length skips the state like lse = -inf
    op, lp = _states(3, 1, 4, 128, BF16, seed=6, lead=(5,))
    lens = torch.tensor([[3, 0, 9, 1, 0], [0, 0, 4, 1, 7], [2, 5, 0, 0, 0]], dtype=torch.int32, device=DEV)
    got = triton_merge.merge_attn_states(op, lp, lens)
    masked = torch.where(lens[:, :, None, None] > 0, lp, -math.inf)
    ref = rlk_ops.merge_attn_states(op, masked)
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@cuda
@pytest.mark.cuda
def test_cuda_merge_backward():
    """Accuracy against the CPU backward (fp32; only the rowsum order differs), run to run,
    batch invariance of rows, and the op's autograd on CUDA."""
    out_parts, lse_parts = _with_empty(*_states(4, 40, 3, 128, torch.float32, seed=7))
    out_parts = torch.nan_to_num(out_parts)
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    dout, dlse = _randn(40, 3, 128, seed=8, dtype=torch.float32), _randn(3, 40, seed=9, dtype=torch.float32)
    for dl in (dlse, None):
        got = torch.ops.rlk.merge_attn_states_bwd(dout, dl, out_parts, lse_parts, out, lse)
        ref = cpu_merge.merge_attn_states_bwd(*(None if t is None else t.cpu()
                                                for t in (dout, dl, out_parts, lse_parts, out, lse)))
        assert rel_err(got[0].cpu(), ref[0]) < MERGE_BWD_TOL and rel_err(got[1].cpu(), ref[1]) < MERGE_BWD_TOL
        again = torch.ops.rlk.merge_attn_states_bwd(dout, dl, out_parts, lse_parts, out, lse)
        assert bitwise_equal(got[0], again[0]) and bitwise_equal(got[1], again[1])
    got = torch.ops.rlk.merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    r = slice(11, 12)
    one = torch.ops.rlk.merge_attn_states_bwd(dout[r].contiguous(), dlse[:, r].contiguous(),
                                              out_parts[:, r].contiguous(), lse_parts[:, :, r].contiguous(),
                                              out[r].contiguous(), lse[:, r].contiguous())
    assert bitwise_equal(one[0], got[0][:, r]) and bitwise_equal(one[1], got[1][:, :, r])
    op = out_parts.clone().requires_grad_()
    lp = lse_parts.clone().requires_grad_()
    o, l = rlk_ops.merge_attn_states(op, lp)
    g = torch.autograd.grad((o * dout).sum() + (torch.nan_to_num(l, neginf=0.0) * dlse).sum(), (op, lp))
    assert all(torch.isfinite(t).all() for t in g)
    if not DRY:
        torch.library.opcheck(torch.ops.rlk.merge_attn_states.default,
                              (out_parts[:, :8].contiguous(), lse_parts[:, :, :8].contiguous()))


@cuda
@pytest.mark.cuda
def test_cuda_decode_pairs_kernel_equals_policy_layout():
    from rlk_ops.kernels.triton import merge as triton_merge

    table = torch.randint(-5, 10**6, (4, 13), dtype=torch.int32, device=DEV)  # padding: garbage
    table[:, :7] = torch.randperm(28, device=DEV, generator=_gen(3)).view(4, 7).int()
    seq_lens = torch.tensor([100, 1, 112, 65], dtype=torch.int32, device=DEV)  # <= 7 pages of 16
    q = _randn(4, 1, HQ, D, seed=4)
    for page_size, chunk in ((16, 128), (64, 128), (32, 256)):
        q_pairs, pair_table, pair_lens, kernel_lens, n = triton_merge.decode_pairs(q, table, seq_lens, page_size,
                                                                                  chunk)
        ref_table, ref_lens, ref_n = canonical.decode_pairs(table, seq_lens, page_size, chunk)
        assert n == ref_n and bitwise_equal(pair_table, ref_table) and bitwise_equal(pair_lens, ref_lens)
        assert bitwise_equal(kernel_lens, ref_lens.clamp_min(1))
        assert bitwise_equal(q_pairs, q[None].expand(n, *q.shape).reshape(n * 4, *q.shape[1:]))
        # prefetch: the same layout; only pages under a pair's keys are requested (the
        # garbage entries past them would be addresses far outside this 28-page cache)
        cache = torch.zeros(28, page_size, HKV, D, dtype=BF16, device=DEV)
        got = triton_merge.decode_pairs(q, table, seq_lens, page_size, chunk, prefetch=(cache, cache.clone()))
        torch.cuda.synchronize()
        assert got[4] == n and all(bitwise_equal(a, b) for a, b in zip(got[:4], (q_pairs, pair_table, pair_lens,
                                                                                  kernel_lens)))


# ------------------------------------------------------------------ train == rollout
@pytest.fixture(scope="module")
def packed():
    """Three packed sequences and their training forward under each canonical:C."""
    total = sum(LENS)
    q, k, v = (_randn(total, h, D, seed=10 + i) for i, h in enumerate((HQ, HKV, HKV)))
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    train = {}
    for c in CHUNKS:
        train[c] = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENS),
                                     max_seqlen_k=max(LENS), split_kv=f"canonical:{c}")
    train["disabled"] = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LENS),
                                          max_seqlen_k=max(LENS))
    return q, k, v, cu.tolist(), train


def _cache(k, v, cu, page_size, seed):
    """Every sequence's K/V in shuffled pages, finite garbage elsewhere, padded tables."""
    need = [math.ceil((cu[b + 1] - cu[b]) / page_size) for b in range(len(cu) - 1)]
    num_pages = sum(need) + 5
    k_cache = _randn(num_pages, page_size, HKV, D, seed=seed)
    v_cache = _randn(num_pages, page_size, HKV, D, seed=seed + 1)
    perm = torch.randperm(num_pages, device=DEV, generator=_gen(seed + 2))
    table = torch.full((len(need), max(need) + 3), 10**6, dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(need):
        pages = perm[used:used + n]
        used += n
        table[b, :n] = pages.int()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=DEV)).flatten()[:cu[b + 1] - cu[b]]
        k_cache.view(-1, HKV, D)[slots] = k[cu[b]:cu[b + 1]]
        v_cache.view(-1, HKV, D)[slots] = v[cu[b]:cu[b + 1]]
    return k_cache, v_cache, table


@pytest.mark.skipif(not HAS_CUDA or DRY, reason="needs a CUDA GPU (FA4's JIT cache)")
@pytest.mark.cuda
def test_cuda_prepared_fa4_calls_give_the_same_bits(packed):
    """fa4 canonical.PREPARED_CALLS (kernels/fa4/prepared.py, the default): the training
    forward with FA4's kernel calls recorded, then replayed, equals the forward through FA4's
    own calls, also on new inputs of the same layout (the replay reads the new tensors)."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import prepared

    q, k, v, cu, _ = packed
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    kw = dict(cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS))
    q2, k2, v2 = (t * -0.5 for t in (q, k, v))
    with fa4_canonical.prepared_calls(False):
        own = {c: rlk_ops.attention(q, k, v, split_kv=f"canonical:{c}", **kw) for c in CHUNKS}
        fresh = {c: rlk_ops.attention(q2, k2, v2, split_kv=f"canonical:{c}", **kw) for c in CHUNKS}
    prepared.clear()
    try:
        assert fa4_canonical.PREPARED_CALLS
        for c in CHUNKS:
            for _ in range(2):   # recorded, then replayed
                got = rlk_ops.attention(q, k, v, split_kv=f"canonical:{c}", **kw)
                assert bitwise_equal(got[0], own[c][0]) and bitwise_equal(got[1], own[c][1]), c
            got = rlk_ops.attention(q2, k2, v2, split_kv=f"canonical:{c}", **kw)
            assert bitwise_equal(got[0], fresh[c][0]) and bitwise_equal(got[1], fresh[c][1]), c
        assert prepared._CACHE
    finally:
        prepared.clear()


def _positions(n, chunk):
    return sorted({p for p in (0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, 2 * chunk + 3, n - 1)
                   if 0 <= p < n})


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_cuda_decode_and_chunked_prefill_rows_equal_training(packed, page_size):
    q, k, v, cu, train = packed
    k_cache, v_cache, table = _cache(k, v, cu, page_size, seed=page_size)
    for chunk in CHUNKS:
        out, lse = train[chunk]
        policy = f"canonical:{chunk}"
        for b in range(len(LENS)):
            for p in _positions(LENS[b], chunk):  # decode alone (B = 1): the row at position p
                row = cu[b] + p
                o, l = rlk_ops.paged_attention(q[None, row:row + 1], k_cache, v_cache, table[b:b + 1],
                                               torch.tensor([p + 1], dtype=torch.int32, device=DEV),
                                               split_kv=policy)
                assert bitwise_equal(o[0, 0], out[row]) and bitwise_equal(l[0, :, 0], lse[:, row]), (chunk, b, p)
            n = LENS[b]
            for start, stop in ((chunk - 50, chunk + 70), (0, 77), (n - 200, n)):  # chunked prefill
                start, stop = max(start, 0), min(stop, n)
                if start >= stop:
                    continue
                o, l = rlk_ops.paged_attention(q[None, cu[b] + start:cu[b] + stop], k_cache, v_cache,
                                               table[b:b + 1], torch.tensor([stop], dtype=torch.int32, device=DEV),
                                               split_kv=policy)
                rows = slice(cu[b] + start, cu[b] + stop)
                assert bitwise_equal(o[0], out[rows]) and bitwise_equal(l[0], lse[:, rows]), (chunk, b, start, stop)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("chunk", CHUNKS)
def test_cuda_mixed_decode_batch_equals_training(packed, chunk):
    """One decode batch: sequences at different positions (1 to several chunks, and one
    repeated), a table wider than needed (extra empty pairs), the fused route == the
    generic route (torch pair layout, lse mask, merge) == training rows."""
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    q, k, v, cu, train = packed
    out, lse = train[chunk]
    k_cache, v_cache, table = _cache(k, v, cu, 16, seed=3)
    seqs = [0, 1, 2, 0]
    pos = [LENS[0] - 1, min(chunk, LENS[1] - 1), 5, chunk - 1]
    rows = [cu[b] + p for b, p in zip(seqs, pos)]
    qd = q[rows][:, None]
    wide = torch.cat([table[seqs], torch.zeros(4, 70, dtype=torch.int32, device=DEV)], 1)
    seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=DEV)
    o, l = rlk_ops.paged_attention(qd, k_cache, v_cache, wide, seq_lens, split_kv=f"canonical:{chunk}")
    generic = canonical.paged_attention(qd, k_cache, v_cache, wide, seq_lens, D ** -0.5, chunk,
                                        attend_into=canonical.gathered(fa4_kernels.attention_fwd),
                                        attend_paged=lambda *a: (
                                            fa4_kernels.paged_attention(*a[:4], a[4].clamp_min(1), a[5])))
    assert bitwise_equal(o, generic[0]) and bitwise_equal(l, generic[1])
    for i, r in enumerate(rows):
        assert bitwise_equal(o[i, 0], out[r]) and bitwise_equal(l[i, :, 0], lse[:, r]), i


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("chunk", CHUNKS)
def test_cuda_pair_call_overlap_off_changes_no_bit(packed, chunk, monkeypatch):
    """The decode pair call with FA4's intra-warpgroup overlap off (every call) and on (never
    off) gives the same rows, and both the training rows (fa4 kernels.pair_overlap)."""
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    q, k, v, cu, train = packed
    out, lse = train[chunk]
    k_cache, v_cache, table = _cache(k, v, cu, 16, seed=4)
    seqs, pos = [0, 1, 0], [LENS[0] - 1, LENS[1] - 1, chunk + 1]
    rows = [cu[b] + p for b, p in zip(seqs, pos)]
    seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=DEV)
    got = {}
    for ctas in (1, 10**9):
        monkeypatch.setattr(fa4_kernels, "PAIR_NO_OVERLAP_CTAS", ctas)  # page 16: the rule applies
        got[ctas] = rlk_ops.paged_attention(q[rows][:, None], k_cache, v_cache, table[seqs], seq_lens,
                                            split_kv=f"canonical:{chunk}")
    assert bitwise_equal(got[1][0], got[10**9][0]) and bitwise_equal(got[1][1], got[10**9][1])
    for i, r in enumerate(rows):
        assert bitwise_equal(got[1][0][i, 0], out[r]) and bitwise_equal(got[1][1][i, :, 0], lse[:, r]), i


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_in_place_partials_equal_gathered(packed, causal):
    """FA4 writing each slot's pieces in place (seqused_q/seqused_k, out=/lse=; the fa4
    backend's route) gives the bits of copying every piece out and running the tight
    varlen single pass (the cpu backend's route): every slot, every row, and no row
    outside a call's pieces written; the calls on side streams give the same bits. Bottom-right query ranges (chunked-prefill shapes)
    next to whole sequences."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    q, k, v, cu, _ = packed
    nq = [LENS[0], 70, LENS[2]]
    seqs = [(cu[b + 1] - nq[b], nq[b], cu[b], LENS[b]) for b in range(len(LENS))]
    for chunk in CHUNKS:
        chunk_plan = canonical.plan(seqs, chunk, causal, DEV)
        seen = []

        def merge(o, l):
            seen.append((o.clone(), l.clone()))
            return rlk_ops.merge_attn_states(o, l)

        got = canonical.run(chunk_plan, q, k, v, D ** -0.5, fa4_canonical.attend_into, merge)
        ref = canonical.run(chunk_plan, q, k, v, D ** -0.5, canonical.gathered(fa4_kernels.attention_fwd), merge)
        multi = canonical.run(chunk_plan, q, k, v, D ** -0.5, fa4_canonical.attend_into, merge, streams=3)
        assert bitwise_equal(multi[0], got[0]) and bitwise_equal(multi[1], got[1]), chunk  # side streams
        (out_a, lse_a), (out_b, lse_b) = seen[:2]
        assert bitwise_equal(lse_a, lse_b), chunk
        present = (lse_a != -math.inf).transpose(1, 2)  # [N, T, H]
        assert int(present.sum()) > 0 and bitwise_equal(out_a[present], out_b[present]), chunk
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1]), chunk


@cuda
@pytest.mark.cuda
def test_cuda_dense_slots_equal_the_varlen_calls():
    """DENSE_SLOTS: a dense batch's full calls as dense FA4 calls on strided views (FA4's
    dense grid) write every state row with the varlen calls' bits, and so do the diagonal call's
    strided runs as dense causal calls (DENSE_DIAGONAL_RUNS; S % C != 0: several runs, S % C ==
    0: one, the route); the merged forward and the backward's gradients are
    equal too."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    g = torch.Generator(device=DEV).manual_seed(12)
    bsz = 2
    for s, chunk in [(LENS[0], c) for c in CHUNKS] + [(2 * CHUNKS[-1], c) for c in CHUNKS]:
        q, k, v = (torch.randn(bsz, s, h, D, generator=g, device=DEV).to(BF16) for h in (HQ, HKV, HKV))
        dout = torch.randn(bsz, s, HQ, D, generator=g, device=DEV).to(BF16)
        qf, kf, vf = (t.reshape(-1, t.shape[2], D) for t in (q, k, v))
        chunk_plan = canonical.plan([(b * s, s, b * s, s) for b in range(bsz)], chunk, True, DEV)
        assert any(c.strided_batch is not None for c in chunk_plan.calls if not c.causal)
        # S % C != 0: several runs (separate dense calls); S % C == 0: one (the routed dense diagonal)
        assert (len(chunk_plan.calls[0].strided_runs) > 1) == (s % chunk != 0), (s, chunk)
        states, res = {}, {}
        for on, diag in ((False, 0), (True, 0), (True, 8)):
            with fa4_canonical.dense_slots(on), fa4_canonical.dense_diagonal(diag):
                states[on, diag] = canonical.run(chunk_plan, qf, kf, vf, D ** -0.5, fa4_canonical.attend_into,
                                                 lambda o, l: (o.clone(), l.clone()))
                out, lse = torch.ops.rlk.attention_fwd(q, k, v, 1, D ** -0.5, None, None, 0, 0, f"canonical:{chunk}")
                res[on, diag] = (out, lse, *torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, None, 1, D ** -0.5,
                                                                         None, None, 0, 0, f"canonical:{chunk}"))
        out_a, lse_a = states[False, 0]
        present = (lse_a != -math.inf).transpose(1, 2)
        assert int(present.sum()) > 0, chunk
        for key in ((True, 0), (True, 8)):
            out_b, lse_b = states[key]
            assert bitwise_equal(lse_a, lse_b), (s, chunk, key)
            assert bitwise_equal(out_a[present], out_b[present]), (s, chunk, key)
            for a, b in zip(res[False, 0], res[key]):
                assert bitwise_equal(a, b), (s, chunk, key)


@cuda
@pytest.mark.cuda
def test_cuda_fa4_partial_equalities(packed):
    """The two FA4 equalities canonical:C rests on, measured directly on FA4's single pass:
    a training diagonal row (causal varlen piece) == the decode pair of its last chunk, and a
    training full row (non-causal, C keys) == a decode pair (causal=True, seqused_k = C)."""
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    q, k, v, cu, _ = packed
    chunk, scale = CHUNKS[0], D ** -0.5
    n = LENS[0]
    k_cache, v_cache, table = _cache(k, v, cu, 16, seed=4)
    per = chunk // 16
    cu1 = lambda m: torch.tensor([0, m], dtype=torch.int32, device=DEV)  # noqa: E731
    # diagonal piece of chunk 1: queries chunk..2*chunk-1 against that chunk's keys
    c0 = chunk
    qs, ks = q[c0:c0 + chunk], k[c0:c0 + chunk]
    diag = fa4_kernels.attention_fwd(qs, ks, v[c0:c0 + chunk], 1, scale, cu1(chunk), cu1(chunk), chunk, chunk)
    # full piece of chunk 0: queries chunk..n-1 against keys 0..chunk-1
    full = fa4_kernels.attention_fwd(q[chunk:n], k[:chunk], v[:chunk], 0, scale, cu1(n - chunk), cu1(chunk),
                                     n - chunk, chunk)
    for i in sorted({i for i in (0, 1, 63, 64, 127, 128, chunk - 1) if i < chunk}):
        p = c0 + i
        o, l = fa4_kernels.paged_attention(q[None, p:p + 1], k_cache, v_cache, table[:1, per:2 * per].contiguous(),
                                           torch.tensor([i + 1], dtype=torch.int32, device=DEV), scale)
        assert bitwise_equal(o[0, 0], diag[0][i]) and bitwise_equal(l[0, :, 0], diag[1][:, i]), ("diag", i)
    for p in (chunk, chunk + 1, 2 * chunk + 7, n - 1):
        o, l = fa4_kernels.paged_attention(q[None, p:p + 1], k_cache, v_cache, table[:1, :per].contiguous(),
                                           torch.tensor([chunk], dtype=torch.int32, device=DEV), scale)
        i = p - chunk
        assert bitwise_equal(o[0, 0], full[0][i]) and bitwise_equal(l[0, :, 0], full[1][:, i]), ("full", p)


@cuda
@pytest.mark.cuda
def test_cuda_first_chunk_rows_are_single_pass_and_later_rows_are_not(packed):
    _, _, _, cu, train = packed
    for chunk in CHUNKS:
        rows = slice(0, chunk)  # sequence 0's first chunk: one state, merged to itself exactly
        assert bitwise_equal(train[chunk][0][rows], train["disabled"][0][rows])
        assert bitwise_equal(train[chunk][1][:, rows], train["disabled"][1][:, rows])
        later = slice(chunk, LENS[0])
        differs = (train[chunk][0][later] != train["disabled"][0][later]).flatten(1).any(-1)
        assert differs.float().mean() > 0.5  # the policy is in effect past chunk 0


def _ref64(q, k, v, causal=True):
    """float64 attention of one sequence [S, H, D] (bottom-right causal): (out, lse [H, S])."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[0], k.shape[0]
        qp = torch.arange(sq, device=q.device) + sk - sq
        s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > qp[:, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double().repeat_interleave(g, 1)), \
        torch.logsumexp(s, -1)


@cuda
@pytest.mark.cuda
def test_cuda_accuracy_run_to_run_and_backward(packed):
    q, k, v, cu, train = packed
    n = LENS[0]
    ref_out, ref_lse = _ref64(q[:n], k[:n], v[:n])
    single = rel_err(train["disabled"][0][:n], ref_out)
    for chunk in CHUNKS:
        out, lse = train[chunk]
        err = rel_err(out[:n], ref_out)
        assert err < OUT_TOL and err < 1.5 * single, (chunk, err, single)
        assert (lse[:, :n].double() - ref_lse).abs().max().item() < LSE_TOL
    # run to run, forward and backward (dlse nonzero), and the gradient against float64
    chunk = CHUNKS[-1]
    qs, ks, vs = (t[None, :n].clone().requires_grad_() for t in (q, k, v))
    dout = _randn(1, n, HQ, D, seed=20)
    dlse = _randn(1, HQ, n, seed=21, dtype=torch.float32)
    results = []
    for _ in range(2):
        o, l = rlk_ops.attention(qs, ks, vs, split_kv=f"canonical:{chunk}")
        grads = torch.autograd.grad((o.float() * dout.float()).sum() + (l * dlse).sum(), (qs, ks, vs))
        results.append((o, l, *grads))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qs, ks, vs))
    o64, l64 = _ref64(q64[0], k64[0], v64[0])
    ref = torch.autograd.grad((o64 * dout[0].double()).sum() + (l64 * dlse[0].double()).sum(), (q64, k64, v64))
    for got, want in zip(results[0][2:], ref):
        assert rel_err(got, want) < GRAD_TOL


@cuda
@pytest.mark.cuda
def test_cuda_provenance_names_fa4_and_triton(packed):
    q, k, v, cu, _ = packed
    with provenance.capture() as log:
        rlk_ops.attention(q[None, :300], k[None, :300], v[None, :300], split_kv=f"canonical:{CHUNKS[0]}")
    assert {(r.op, r.actual_backend, r.fallback) for r in log.records()} == {
        ("attention_fwd", "fa4", False), ("merge_attn_states", "triton", False)}


@pytest.mark.skipif(not HAS_CUDA or DRY, reason="needs a CUDA GPU (graph capture)")
@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture records nothing
def test_cuda_graph_captured_decode_replays_the_same_bits(packed, pdl, monkeypatch):
    """The decode route makes no host sync: it captures into a CUDA graph (value checks off:
    with them on, capture raises ValueChecksInCapture) and replays bitwise, with or without
    programmatic dependent launch for its two Triton launches (merge.PDL, and the pair route's
    own choice in one wave, pair_decode.PDL_ONE_WAVE)."""
    from rlk_ops.kernels.triton import merge as triton_merge
    from rlk_ops.kernels.triton import pair_decode
    from rlk_ops.ops import _validate

    monkeypatch.setattr(triton_merge, "PDL", pdl)
    monkeypatch.setattr(pair_decode, "PDL_ONE_WAVE", pdl)
    q, k, v, cu, train = packed
    chunk = CHUNKS[0]
    k_cache, v_cache, table = _cache(k, v, cu, 16, seed=6)
    rows = [cu[0] + LENS[0] - 1, cu[1] + chunk + 1, cu[2] + 100]
    qd = q[rows][:, None].contiguous()
    seq_lens = torch.tensor([LENS[0], chunk + 2, 101], dtype=torch.int32, device=DEV)
    checks = _validate.VALUE_CHECKS
    with rlk_ops.value_checks(True), pytest.raises(rlk_ops.ValueChecksInCapture,
                                                   match="rlk::paged_attention: value checks"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):  # checks on: a clear error, nothing captured
            rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv=f"canonical:{chunk}")
    with rlk_ops.value_checks(False):  # value checks sync (not capturable)
        eager = rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv=f"canonical:{chunk}")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv=f"canonical:{chunk}")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = rlk_ops.paged_attention(qd, k_cache, v_cache, table, seq_lens, split_kv=f"canonical:{chunk}")
        for t in captured:  # what the replay writes, not what the pool held
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert _validate.VALUE_CHECKS == checks  # restored
    assert bitwise_equal(captured[0], eager[0]) and bitwise_equal(captured[1], eager[1])
    out, lse = train[chunk]
    for i, r in enumerate(rows):
        assert bitwise_equal(eager[0][i, 0], out[r]) and bitwise_equal(eager[1][i, :, 0], lse[:, r])


def test_cpu_reference_merge_is_the_cpu_default():
    """On CPU tensors the merge stays the reference (no triton needed to import rlk_ops)."""
    assert dispatch.requested_backend("merge_attn_states", "cpu") == "cpu"
    assert dispatch.requested_backend("merge_attn_states", "cuda") == "triton"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("page", [16, 128])
def test_cuda_decode_pair_routes_give_the_same_bits(packed, chunk, page, monkeypatch):
    """fa4 canonical.DECODE_PAIRS: the Triton pair kernel ("triton") and the pair layout + FA4
    call ("fa4") give the same decode rows, and both the training rows (sequences at different
    positions, one repeated, a padded table). So does FA4's chunk walk (DECODE_WALK, page 128:
    "walk" merging in its program, "walk_states" through the merge op), routed at any batch here."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    q, k, v, cu, train = packed
    out, lse = train[chunk]
    k_cache, v_cache, table = _cache(k, v, cu, page, seed=7)
    seqs = [0, 1, 2, 0]
    pos = [LENS[0] - 1, min(chunk, LENS[1] - 1), 5, chunk - 1]
    rows = [cu[b] + p for b, p in zip(seqs, pos)]
    qd = q[rows][:, None]
    seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=DEV)
    got = {}
    monkeypatch.setattr(fa4_canonical, "WALK_MIN_PROGRAMS", 0)
    sm90 = not DRY and torch.cuda.get_device_capability()[0] == 9   # the walk is FA4's SM90 kernel
    walks = {"walk": "merged", "walk_states": "states"} if page == 128 and sm90 else {}
    for route in ("fa4", "triton", *walks):
        monkeypatch.setattr(fa4_canonical, "DECODE_PAIRS", "triton" if route in walks else route)
        monkeypatch.setattr(fa4_canonical, "DECODE_WALK", walks.get(route))
        assert fa4_canonical.walk_routed(qd, k_cache, chunk) == (route in walks)
        with provenance.capture() as log:
            got[route] = rlk_ops.paged_attention(qd, k_cache, v_cache, table[seqs], seq_lens,
                                                 split_kv=f"canonical:{chunk}")
        # provenance names what computed the pairs inside the fa4 backend (the merge: its own record)
        from rlk_ops.kernels.triton import pair_decode
        kernel = ("fa4.walk" if route in walks else "triton.pair_decode"
                  if route == "triton" and pair_decode.routable(qd, k_cache, chunk, "sm90" if sm90 else None)
                  else "fa4")
        merged_apart = set() if route == "walk" else {("merge_attn_states", "triton", "triton")}
        assert {(r.op, r.actual_backend, r.kernel) for r in log.records()} == {
            ("paged_attention", "fa4", kernel), *merged_apart}, route
    for route, (o, l) in got.items():
        assert bitwise_equal(got["fa4"][0], o) and bitwise_equal(got["fa4"][1], l), route
        for i, r in enumerate(rows):
            assert bitwise_equal(o[i, 0], out[r]) and bitwise_equal(l[i, :, 0], lse[:, r]), (route, i)
