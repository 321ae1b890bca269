"""canonical:C split-KV on the CPU reference.

Bitwise claims (torch.equal): training rows == paged decode rows == chunked-prefill rows
under canonical:C, for several C, page sizes, batch compositions and positions on and
off chunk boundaries; run-to-run forward and backward; the merge skips empty states
exactly. Accuracy against float64 math, gradcheck in float64, and the backward checked
against the explicit chain rule through rlk::merge_attn_states_bwd.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlk_ops
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.kernels.cpu import canonical
from rlk_ops.kernels.cpu import merge as merge_kernels
from rlk_ops.rollout.cache import PagedKVCache

from conftest import TOL, bitwise_equal, fill_paged_cache, ref_attention, rel_err

DT = torch.bfloat16
B, S, HQ, HKV, D = 2, 300, 4, 2, 16
BOUNDARY_POSITIONS = (0, 127, 128, 129, 255, 256, 257, S - 1)


def _qkv(seed=1, b=B, s=S, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


@pytest.fixture(scope="module")
def qkv():
    return _qkv()


@pytest.fixture(scope="module")
def train(qkv):
    """Training forward (dense prefill) under each policy the tests use."""
    return {c: rlk_ops.attention(*qkv, split_kv=f"canonical:{c}") for c in (128, 256)} | {
        "disabled": rlk_ops.attention(*qkv)}


def _fill_cache(k, v, page_size, seed):
    return fill_paged_cache(k, v, page_size, torch.Generator().manual_seed(seed), extra_pages=3, pad=10**6)


# ------------------------------------------------------------------ the definition
def test_plan_pieces_are_the_documented_ones():
    p = canonical.plan([(0, 300, 0, 300), (300, 50, 300, 260)], 128, causal=True)
    assert p.num_slots == 3
    # (seq, chunk, first query row, queries, first key row, keys), piece by piece
    def pieces(c):
        return list(zip(c.seq, c.chunk, c.q_start, c.q_len, c.k_start, c.k_len))
    # the diagonal call writes the last slot, chunk c's full call slot c; chunk 2 has no full piece
    assert [(c.causal, c.slot) for c in p.calls] == [(True, 2), (False, 0), (False, 1)]
    diag, full0, full1 = p.calls
    # sequence 1: 50 queries at positions 210..259 of 260 keys (bottom-right)
    assert pieces(diag) == [(0, 0, 0, 128, 0, 128), (0, 1, 128, 128, 128, 128), (0, 2, 256, 44, 256, 44),
                            (1, 1, 300, 46, 428, 128), (1, 2, 346, 4, 556, 4)]
    assert pieces(full0) == [(0, 0, 128, 172, 0, 128), (1, 0, 300, 50, 300, 128)]
    assert pieces(full1) == [(0, 1, 256, 44, 128, 128), (1, 1, 346, 4, 428, 128)]
    # FA4's varlen convention: starts (plus the end of the last piece) and lengths
    assert full1.cu_seqlens_q.tolist() == [256, 346, 350] and full1.seqused_q.tolist() == [44, 4]
    assert full1.cu_seqlens_k.tolist() == [128, 428, 556] and full1.seqused_k.tolist() == [128, 128]
    assert (full1.max_seqlen_q, full1.max_seqlen_k) == (44, 128)
    assert full1.q_index.tolist() == list(range(256, 300)) + list(range(346, 350))
    for c in p.calls:  # a call's pieces are disjoint, ascending row ranges
        ends = [a + n for a, n in zip(c.q_start, c.q_len)]
        assert all(e <= a for e, a in zip(ends, c.q_start[1:]))
    nc = canonical.plan([(0, 5, 0, 300)], 256, causal=False)
    assert [(c.causal, c.slot, c.chunk, c.k_start, c.k_len) for c in nc.calls] == [
        (False, 0, (0,), (0,), (256,)), (False, 1, (1,), (256,), (44,))]
    with pytest.raises(ValueError, match="multiple of 128, got 100"):
        canonical.plan([(0, 1, 0, 1)], 100, causal=True)


def test_bare_canonical_is_the_default_chunk():
    """``canonical`` means canonical:DEFAULT_CANONICAL_CHUNK: the same bits, and the full
    spelling is what the contract and the op calls carry."""
    from rlk_ops.meta.contract import DEFAULT_CANONICAL_CHUNK, AttentionContract, SplitKVPolicy, spell

    assert DEFAULT_CANONICAL_CHUNK == 768
    assert SplitKVPolicy.parse("canonical") == SplitKVPolicy("canonical", 768)
    assert spell("canonical") == "canonical:768" and spell("canonical:256") == "canonical:256"
    assert AttentionContract(split_kv="canonical").split_kv == "canonical:768"
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1100, h, 8, generator=g).to(torch.bfloat16) for h in (2, 1, 1))  # 2 chunks
    got, ref = rlk_ops.attention(q, k, v, split_kv="canonical"), rlk_ops.attention(q, k, v, split_kv="canonical:768")
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])
    assert not bitwise_equal(got[0], rlk_ops.attention(q, k, v)[0])  # really split: rows past 768 differ
    other = rlk_ops.attention(q, k, v, split_kv="canonical:1024")
    assert not bitwise_equal(got[0], other[0])  # and at 768, not 1024


def test_gathered_writes_only_the_calls_rows():
    """``gathered`` (the cpu backend's in-place kernel) writes a call's rows and nothing else:
    the rows no piece covers keep what the slot held (-inf lse: skipped by the merge)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((350, 2), (560, 1), (560, 1)))
    p = canonical.plan([(0, 300, 0, 300), (300, 50, 300, 260)], 128, causal=True)
    attend_into = canonical.gathered(rlk_ops.kernels.cpu.attention_fwd)
    for c in p.calls:
        out = torch.full((350, 2, 8), 7.0)
        lse = torch.full((2, 350), -math.inf)
        attend_into(q, k, v, c, 8 ** -0.5, out, lse)
        covered = torch.zeros(350, dtype=torch.bool)
        covered[c.q_index] = True
        assert bool((out[~covered] == 7.0).all()) and bool((lse[:, ~covered] == -math.inf).all())
        assert bool(torch.isfinite(lse[:, covered]).all())


def test_decode_pairs_layout():
    table = torch.tensor([[7, 3, 9, 1, 4], [2, 8, 77, -1, 5]], dtype=torch.int32)  # row 1 past page 1: padding
    pair_table, pair_lens, n = canonical.decode_pairs(table, torch.tensor([300, 40], dtype=torch.int32), 64, 128)
    assert n == 3  # ceil(5 pages * 64 / 128) chunks, from the table width alone
    assert pair_table.tolist() == [[7, 3], [2, 8], [9, 1], [0, 0], [4, 0], [0, 0]]  # chunk-major; empty pairs: 0
    assert pair_lens.tolist() == [128, 40, 128, 0, 44, 0]
    with pytest.raises(ValueError, match="chunk_size % page_size == 0"):
        canonical.decode_pairs(table, torch.tensor([1, 1], dtype=torch.int32), 48, 128)


def test_rows_within_the_first_chunk_equal_single_pass(train):
    """One state merges to itself exactly (w = exp(0) = 1, log(1) = 0), so rows whose keys
    all sit in chunk 0 are the single-pass rows; later rows merge >= 2 states and do differ."""
    for c in (128, 256):
        out, lse = train[c]
        assert bitwise_equal(out[:, :c], train["disabled"][0][:, :c])
        assert bitwise_equal(lse[:, :, :c], train["disabled"][1][:, :, :c])
        differs = (out[:, c:] != train["disabled"][0][:, c:]).flatten(2).any(-1)
        assert differs.float().mean() > 0.5  # the policy is really in effect past chunk 0


# ------------------------------------------------------------------ train == rollout
@pytest.mark.parametrize("chunk", [128, 256])
@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
def test_paged_decode_and_chunked_prefill_equal_training(qkv, train, chunk, page_size):
    """page_size | C: decode takes the (chunk, sequence) pair layout; page size 3 and
    chunked prefill take the general plan over gathered K/V. Both == training bitwise."""
    q, k, v = qkv
    out, lse = train[chunk]
    policy = f"canonical:{chunk}"
    k_cache, v_cache, page_table = _fill_cache(k, v, page_size, seed=page_size)
    for p in BOUNDARY_POSITIONS:
        seq_lens = torch.full((B,), p + 1, dtype=torch.int32)
        o, l = rlk_ops.paged_attention(q[:, p:p + 1], k_cache, v_cache, page_table, seq_lens, split_kv=policy)
        assert bitwise_equal(o[:, 0], out[:, p]) and bitwise_equal(l[:, :, 0], lse[:, :, p]), p
    for start, stop in ((0, 77), (61, 250), (127, 129), (128, 257), (200, 300)):
        seq_lens = torch.full((B,), stop, dtype=torch.int32)
        o, l = rlk_ops.paged_attention(q[:, start:stop], k_cache, v_cache, page_table, seq_lens, split_kv=policy)
        assert bitwise_equal(o, out[:, start:stop]) and bitwise_equal(l, lse[:, :, start:stop]), (start, stop)


@pytest.mark.parametrize("page_size", [16, 3])
def test_a_chunk_size_that_is_not_a_power_of_two(page_size):
    """C = 384 (3 key blocks; the H200 runs measured C = 640 and 768, see README): decode rows on
    and off its chunk boundaries and chunked-prefill rows equal the training rows bitwise, with
    3 chunks per 900-token sequence (page 16 divides C: the pair layout; page 3: the general plan)."""
    s, chunk = 900, 384
    q, k, v = _qkv(seed=7, s=s)
    policy = f"canonical:{chunk}"
    out, lse = rlk_ops.attention(q, k, v, split_kv=policy)
    k_cache, v_cache, page_table = _fill_cache(k, v, page_size, seed=8)
    for p in (0, 383, 384, 385, 767, 768, s - 1):
        seq_lens = torch.full((B,), p + 1, dtype=torch.int32)
        o, l = rlk_ops.paged_attention(q[:, p:p + 1], k_cache, v_cache, page_table, seq_lens, split_kv=policy)
        assert bitwise_equal(o[:, 0], out[:, p]) and bitwise_equal(l[:, :, 0], lse[:, :, p]), p
    for start, stop in ((0, 400), (380, 770), (768, s)):
        seq_lens = torch.full((B,), stop, dtype=torch.int32)
        o, l = rlk_ops.paged_attention(q[:, start:stop], k_cache, v_cache, page_table, seq_lens, split_kv=policy)
        assert bitwise_equal(o, out[:, start:stop]) and bitwise_equal(l, lse[:, :, start:stop]), (start, stop)
    single = rlk_ops.attention(q, k, v)[0]
    assert bitwise_equal(out[:, :chunk], single[:, :chunk]) and not bitwise_equal(out[:, chunk:], single[:, chunk:])


@pytest.mark.parametrize("chunk", [128, 256])
def test_mixed_decode_batch_equals_alone_and_training(qkv, train, chunk):
    """Sequences with 1, 2 and 3 chunks in one decode batch: a row's padding states are skipped."""
    q, k, v = (torch.cat([t, t[:1]]) for t in qkv)  # sequence 2 is a copy of sequence 0
    out, lse = (torch.cat([t, t[:1]]) for t in train[chunk])
    k_cache, v_cache, page_table = _fill_cache(k, v, 16, seed=5)
    pos = [5, 299, 128]
    seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
    qd = torch.stack([q[b, p] for b, p in enumerate(pos)])[:, None]
    o, l = rlk_ops.paged_attention(qd, k_cache, v_cache, page_table, seq_lens, split_kv=f"canonical:{chunk}")
    for b, p in enumerate(pos):
        solo, solo_lse = rlk_ops.paged_attention(qd[b:b + 1], k_cache, v_cache, page_table[b:b + 1],
                                                 seq_lens[b:b + 1], split_kv=f"canonical:{chunk}")
        assert bitwise_equal(o[b], solo[0]) and bitwise_equal(l[b], solo_lse[0])
        assert bitwise_equal(o[b, 0], out[b, p]) and bitwise_equal(l[b, :, 0], lse[b, :, p])


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_and_batch_composition_equal_dense(qkv, train, causal):
    """Packed varlen rows == each sequence alone (dense B=1) == the dense B=2 batch."""
    q, k, v = qkv
    lens = [S, 140]  # sequence b is the first lens[b] tokens of batch row b
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pack = [torch.cat([t[b, :n] for b, n in enumerate(lens)]) for t in (q, k, v)]
    out, lse = rlk_ops.attention(*pack, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv="canonical:128")
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = rlk_ops.attention(*(t[b:b + 1, :n] for t in (q, k, v)), causal=causal, split_kv="canonical:128")
        assert bitwise_equal(out[rows], alone[0][0]) and bitwise_equal(lse[:, rows], alone[1][0])
        if causal:  # a causal prefix's rows are the batch's rows (they do not see the rest)
            assert bitwise_equal(alone[0][0], train[128][0][b, :n]) and bitwise_equal(alone[1][0], train[128][1][b, :, :n])


def test_rows_without_keys_match_single_pass():
    """A varlen sequence with queries but no keys (non-causal), and one with no queries."""
    q, k, v = _qkv(seed=3, b=1, s=140)
    cu_q = torch.tensor([0, 4, 4, 140], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 10, 140], dtype=torch.int32)
    args = (q[0], k[0, :140], v[0, :140])
    got = rlk_ops.attention(*args, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, split_kv="canonical:128")
    ref = rlk_ops.attention(*args, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert not got[0][:4].any() and bool((got[1][:, :4] == -math.inf).all())
    assert bitwise_equal(got[0][:4], ref[0][:4]) and bitwise_equal(got[1][:, :4], ref[1][:, :4])
    assert rel_err(got[0][4:], ref[0][4:]) < TOL[DT]


# ------------------------------------------------------------------ run-to-run, backward
@pytest.mark.parametrize("sq", [1, 4])
def test_cpu_paged_work_follows_seq_lens_not_the_table_width(monkeypatch, sq):
    """A table padded to a fixed width (columns past ceil(seq_lens / page_size) are never read): the CPU
    ran every pair of every column, 100-170x disabled's time at 8192 columns for 200 tokens (a session 34
    audit). The pairs (decode) and the gather (chunked prefill) now cover the used columns only, and the
    rows are bitwise those of the narrow table."""
    g = torch.Generator().manual_seed(3)
    ps, lens = 16, torch.tensor([200, 37], dtype=torch.int32)
    kc = torch.randn(40, ps, 2, 32, generator=g).bfloat16()
    vc = torch.randn_like(kc)
    narrow = torch.randperm(40, generator=g)[:26].view(2, 13).to(torch.int32)
    wide = torch.cat([narrow, torch.randint(0, 40, (2, 8192 - 13), generator=g, dtype=torch.int32)], 1)
    q = torch.randn(2, sq, 4, 32, generator=g).bfloat16()
    widths = []
    pairs, gather = canonical.decode_pairs, rlk_ops.kernels.dispatch.kernel_for

    def spy_pairs(table, *a):
        widths.append(table.shape[1])
        return pairs(table, *a)

    def spy_kernel_for(op, device, *a):
        fn = gather(op, device, *a)
        if op != "paged_kv_gather":
            return fn
        return lambda kc_, vc_, table, lens_: (widths.append(table.shape[1]), fn(kc_, vc_, table, lens_))[1]

    monkeypatch.setattr(canonical, "decode_pairs", spy_pairs)
    monkeypatch.setattr(canonical, "kernel_for", spy_kernel_for)
    got = rlk_ops.paged_attention(q, kc, vc, wide, lens, split_kv="canonical:128")
    assert widths == [13]    # ceil(200 / 16) columns, not 8192
    ref = rlk_ops.paged_attention(q, kc, vc, narrow, lens, split_kv="canonical:128")
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


def test_a_row_whose_score_overflows_is_nan_on_both_policies():
    """A finite scale that overflows one score: SDPA and the canonical merge give a NaN row; the single
    pass gave a finite 0 row (its where(l > 0) is False for NaN) beside a NaN lse (a session 34 audit)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 200, 1, 16, generator=g) for _ in range(3))
    k[0, 150] = q[0, 199] * 1e38          # row 199's score against key 150 overflows float32; k is finite
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert sdpa[0, 199].isnan().all()
    for policy in ("disabled", "canonical:128"):
        out, lse = rlk_ops.attention(q, k, v, split_kv=policy)
        assert out[0, 199].isnan().all() and lse[0, 0, 199].isnan(), policy
        assert out[0, :150].isfinite().all() and out[0, 198].isfinite().all(), policy


def test_forward_and_backward_run_to_run(qkv):
    q, k, v = (t[:1, :260].clone().requires_grad_() for t in qkv)
    dlse_w = torch.randn(1, HQ, 260)
    results = []
    for _ in range(2):
        out, lse = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        grads = torch.autograd.grad(out.float().square().sum() + (lse * dlse_w).sum(), (q, k, v))
        results.append((out, lse, *grads))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))


def _d(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def test_gradcheck_canonical_attention():
    """Two query rows at positions 128, 129 of 130 keys: each merges chunk 0 (full) and chunk 1
    (causal). Full Jacobian."""
    q, k, v = _d(1, 2, 2, 2, seed=1), _d(1, 130, 1, 2, seed=2), _d(1, 130, 1, 2, seed=3)
    assert torch.autograd.gradcheck(lambda q, k, v: rlk_ops.attention(q, k, v, split_kv="canonical:128"), (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_canonical_varlen(causal):
    """Packed sequences crossing chunk boundaries. fast_mode (random projections of the
    Jacobian, every input element involved): the full Jacobian of these sizes takes ~30 s."""
    cu_q = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 129, 260, 390], dtype=torch.int32)
    q, k, v = _d(7, 2, 2, seed=4), _d(390, 1, 2, seed=5), _d(390, 1, 2, seed=6)
    assert torch.autograd.gradcheck(lambda q, k, v: rlk_ops.attention(
        q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, split_kv="canonical:128"), (q, k, v),
        fast_mode=True)


def _chain_rule_backward(q, k, v, dout, dlse, chunk, causal):
    """The gradient the long way, for one dense sequence: per-chunk states, merge backward
    (rlk::merge_attn_states_bwd), then a single-pass attention_bwd per piece with the
    chunk's d_out and d_lse; dq/dk/dv summed over pieces."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5
    seen = []

    def merge(out_parts, lse_parts):
        seen.append((out_parts, lse_parts))
        return merge_kernels.merge_attn_states(out_parts, lse_parts)

    cpu = rlk_ops.kernels.cpu
    qp, kp, vp = q.reshape(sq, hq, d), k.reshape(sk, hkv, d), v.reshape(sk, hkv, d)
    chunk_plan = canonical.plan([(0, sq, 0, sk)], chunk, causal)
    out, lse = canonical.run(chunk_plan, qp, kp, vp, scale, canonical.gathered(cpu.attention_fwd), merge)
    out_parts, lse_parts = seen[0]
    d_out_parts, d_lse_parts = torch.ops.rlk.merge_attn_states_bwd(dout.reshape(sq, hq, d), dlse.reshape(hq, sq),
                                                                   out_parts, lse_parts, out, lse)
    dq, dk, dv = torch.zeros_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
    for c in chunk_plan.calls:
        cu_q, cu_k = c.tight
        rows = (c.slot, c.q_index)
        gq, gk, gv = torch.ops.rlk.attention_bwd(
            d_out_parts[rows], qp[c.q_index], kp[c.k_index], vp[c.k_index], out_parts[rows],
            lse_parts[c.slot][:, c.q_index].contiguous(), d_lse_parts[c.slot][:, c.q_index].contiguous(),
            int(c.causal), scale, cu_q, cu_k, c.max_seqlen_q, c.max_seqlen_k, "disabled")
        dq.index_add_(0, c.q_index, gq)
        dk.index_add_(0, c.k_index, gk)
        dv.index_add_(0, c.k_index, gv)
    return dq.view_as(q), dk.view_as(k), dv.view_as(v)


@pytest.mark.parametrize("causal", [True, False])
def test_backward_equals_chain_rule_through_the_merge(causal):
    """attention_bwd under canonical:C (one single-pass backward at the merged (out, lse))
    is the exact gradient of the merged forward: equal, in float64, to going chunk by
    chunk through merge_attn_states_bwd with each chunk's d_lse."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 200, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, 2, 200, generator=g, dtype=torch.float64)
    out, lse = rlk_ops.attention(q, k, v, causal=causal, split_kv="canonical:128")
    ours = torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dlse, int(causal), 8 ** -0.5, None, None, 0, 0,
                                       "canonical:128")
    long_way = _chain_rule_backward(q, k, v, dout, dlse, 128, causal)
    for a, b in zip(ours, long_way):
        assert rel_err(a, b) < 1e-12


# ------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("chunk,causal,dtype", [(128, True, DT), (256, True, DT), (128, False, DT),
                                                (128, True, torch.float32)])
def test_accuracy_against_float64(qkv, chunk, causal, dtype):
    """bf16 partial outs cost one more rounding than single pass: still inside the bf16 entry
    (measured ~1.1x the single-pass error; benchmarks/canonical_cpu.py)."""
    q, k, v = (t[:1].to(dtype) for t in qkv)
    out, lse = rlk_ops.attention(q, k, v, causal=causal, split_kv=f"canonical:{chunk}")
    ref_out, ref_lse = ref_attention(q, k, v, causal=causal)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5  # fp32 lse of O(1) values


# ------------------------------------------------------------------ the merge op
def _states(n, t=5, h=3, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out_parts = torch.randn(n, t, h, d, generator=g).to(dtype)
    lse_dt = torch.float64 if dtype == torch.float64 else torch.float32
    lse_parts = (torch.randn(n, h, t, generator=g) * 3).to(lse_dt)
    return out_parts, lse_parts


def test_merge_is_the_float64_formula():
    out_parts, lse_parts = _states(4)
    lse_parts[2, 1, 3] = -math.inf  # an empty state
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    w = torch.softmax(lse_parts.double(), dim=0).transpose(-1, -2)[..., None]  # [N, T, H, 1]
    assert rel_err(out, (w * out_parts.double()).sum(0)) < 1e-6
    assert (lse.double() - torch.logsumexp(lse_parts.double(), dim=0)).abs().max().item() < 1e-6


def test_merge_skips_empty_states_bitwise():
    out_parts, lse_parts = _states(3, dtype=DT)
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    pad_out = torch.full((1, *out_parts.shape[1:]), math.nan, dtype=DT)  # an empty state's out is never read
    pad_lse = torch.full((1, *lse_parts.shape[1:]), -math.inf)
    for at in (0, 1, 3):  # before, between and after the real states
        po = torch.cat([out_parts[:at], pad_out, out_parts[at:]])
        pl = torch.cat([lse_parts[:at], pad_lse, lse_parts[at:]])
        o, l = rlk_ops.merge_attn_states(po, pl)
        assert bitwise_equal(o, out) and bitwise_equal(l, lse)
    one, one_lse = rlk_ops.merge_attn_states(out_parts[:1], lse_parts[:1])
    assert bitwise_equal(one, out_parts[0]) and bitwise_equal(one_lse, lse_parts[0])
    empty, empty_lse = rlk_ops.merge_attn_states(pad_out, pad_lse)
    assert not empty.any() and bool((empty_lse == -math.inf).all())


def test_merge_rows_are_batch_invariant():
    out_parts, lse_parts = _states(5, t=37, dtype=DT, seed=2)
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    for r in (0, 17, 36):
        o, l = rlk_ops.merge_attn_states(out_parts[:, r:r + 1].contiguous(), lse_parts[:, :, r:r + 1].contiguous())
        assert bitwise_equal(o[0], out[r]) and bitwise_equal(l[:, 0], lse[:, r])
    dense_o, dense_l = rlk_ops.merge_attn_states(out_parts.view(5, 1, 37, 3, 8), lse_parts.view(5, 1, 3, 37))
    assert bitwise_equal(dense_o[0], out) and bitwise_equal(dense_l[0], lse)


def test_merge_is_the_ascending_fold_row_by_row():
    """The merge's order is the definition's: each row, transcribed on its own as the fp32
    fold over states 0, 1, ..., N-1 (numerics.exp / log, one IEEE step each), equals the op's
    row bitwise. A fold in another order (descending, by rows) rounds differently."""
    from rlk_ops.kernels.cpu import numerics as nx

    out_parts, lse_parts = _states(6, t=9, h=2, d=16, dtype=DT, seed=4)
    lse_parts[3, 1, 4] = -math.inf
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    for t in range(9):
        for h in range(2):
            ls = lse_parts[:, h, t]
            m = ls.max()
            total = torch.zeros((), dtype=torch.float32)
            acc = torch.zeros(16, dtype=torch.float32)
            for n in range(6):
                if ls[n] == -math.inf:
                    continue
                w = nx.exp((ls[n] - m).reshape(1))[0]
                total = total + w
                acc = acc + w * out_parts[n, t, h].float()
            assert bitwise_equal(out[t, h], (acc / total).to(DT)), (t, h)
            assert bitwise_equal(lse[h, t], (m + nx.log(total.reshape(1))[0])), (t, h)


@pytest.mark.parametrize("dtype", [DT, torch.float32])
def test_merge_backward_rows_are_batch_invariant_and_run_to_run(dtype):
    """merge_attn_states_bwd on the CPU: a row's gradients alone equal its gradients in the
    batch, and two calls are bitwise equal (the spec's claim for the cpu backend)."""
    out_parts, lse_parts = _states(4, t=23, h=3, d=32, dtype=dtype, seed=6)
    lse_parts[1, 2, 5] = -math.inf
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g)
    for dl in (dlse, None):
        got = torch.ops.rlk.merge_attn_states_bwd(dout, dl, out_parts, lse_parts, out, lse)
        again = torch.ops.rlk.merge_attn_states_bwd(dout, dl, out_parts, lse_parts, out, lse)
        assert bitwise_equal(got[0], again[0]) and bitwise_equal(got[1], again[1])
        for r in (0, 5, 22):
            s = slice(r, r + 1)
            one = torch.ops.rlk.merge_attn_states_bwd(
                dout[s].contiguous(), None if dl is None else dl[:, s].contiguous(), out_parts[:, s].contiguous(),
                lse_parts[:, :, s].contiguous(), out[s].contiguous(), lse[:, s].contiguous())
            assert bitwise_equal(one[0], got[0][:, s]) and bitwise_equal(one[1], got[1][:, :, s])


def test_gradcheck_merge():
    out_parts, lse_parts = _states(3, dtype=torch.float64, seed=3)
    lse_parts[1, 0, 2] = -math.inf
    args = (out_parts.requires_grad_(), lse_parts.requires_grad_())
    assert torch.autograd.gradcheck(rlk_ops.merge_attn_states, args)
    assert torch.autograd.gradcheck(lambda o, l: rlk_ops.merge_attn_states(o, l)[1], args)  # dout is None


def test_merge_errors_name_argument_expected_actual():
    out_parts, lse_parts = _states(2)
    with pytest.raises(rlk_ops.RlkInputError, match=r"lse_parts must have shape \[2, 3, 5\] .* got \[2, 5, 3\]"):
        rlk_ops.merge_attn_states(out_parts, lse_parts.transpose(1, 2))
    with pytest.raises(rlk_ops.RlkInputError, match=r"lse_parts must be torch.float32 .* got torch.bfloat16"):
        rlk_ops.merge_attn_states(out_parts, lse_parts.bfloat16())
    with pytest.raises(rlk_ops.RlkInputError, match=r"at least one state \(N >= 1\), got shape \[0, 5, 3, 8\]"):
        rlk_ops.merge_attn_states(out_parts[:0], lse_parts[:0])
    with pytest.raises(rlk_ops.RlkInputError, match=r"at least 4 dims, got shape \[2, 5, 8\]"):
        rlk_ops.merge_attn_states(out_parts[:, :, 0], lse_parts[:, 0])
    with pytest.raises(rlk_ops.RlkInputError, match=r"dout must have shape \[5, 3, 8\]"):
        torch.ops.rlk.merge_attn_states_bwd(out_parts, None, out_parts, lse_parts, out_parts[0], lse_parts[0])


def test_cpu_paged_fixed_split_is_refused_clearly():
    q, k, v = _qkv(seed=4, b=1, s=10)
    k_cache, v_cache, page_table = _fill_cache(k, v, 16, seed=1)
    with pytest.raises(ValueError, match=r"split_kv 'fixed:256' is not implemented by the cpu backend"):
        rlk_ops.paged_attention(q, k_cache, v_cache, page_table, torch.tensor([10], dtype=torch.int32),
                                split_kv="fixed:256")


# ------------------------------------------------------------------ property + block
@st.composite
def _batches(draw):
    chunk = draw(st.sampled_from([128, 256]))
    page_size = draw(st.sampled_from([1, 3, 16, 128]))
    lens = draw(st.lists(st.integers(1, 300), min_size=1, max_size=3))
    sq = draw(st.integers(1, min(lens)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))  # bf16/fp16 round P and the partials
    return (chunk, page_size, lens, sq, draw(st.integers(0, 2**31 - 1)), draw(st.permutations(range(len(lens)))),
            dtype)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_property_paged_rows_equal_packed_training(case):
    chunk, page_size, lens, sq, seed, order, dtype = case
    g = torch.Generator().manual_seed(seed)
    pack = [torch.randn(sum(lens), h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = rlk_ops.attention(*pack, cu_seqlens_q=cu, cu_seqlens_k=cu, split_kv=f"canonical:{chunk}")
    need = [math.ceil(n / page_size) for n in lens]
    k_cache = torch.randn(sum(need) + 2, page_size, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(k_cache.shape[0], generator=g)
    table = torch.randint(-5, 10**6, (len(lens), max(need) + 1), generator=g, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        pages = perm[used:used + need[b]]
        used += need[b]
        table[b, :need[b]] = pages.int()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        rows = slice(int(cu[b]), int(cu[b + 1]))
        rlk_ops.paged_kv_append(k_cache, v_cache, pack[1][rows], pack[2][rows], slots)
    idx = torch.tensor(order)
    q_new = torch.stack([pack[0][int(cu[b + 1]) - sq:int(cu[b + 1])] for b in order])
    o, l = rlk_ops.paged_attention(q_new, k_cache, v_cache, table[idx], torch.tensor(lens, dtype=torch.int32)[idx],
                                   split_kv=f"canonical:{chunk}")
    for i, b in enumerate(order):
        rows = slice(int(cu[b + 1]) - sq, int(cu[b + 1]))
        assert bitwise_equal(o[i], out[rows]) and bitwise_equal(l[i], lse[:, rows])


def test_qwen3_block_rollout_equals_training_under_canonical():
    """The block passes config.split_kv to both entry points: chunked prefill + batched
    decode through PagedKVCache == the packed training forward, every row, bitwise."""
    lengths, chunk, decode_steps = [37, 150, 9, 270], 50, 4
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                                      split_kv="canonical:128"))
    x, pos, cu = packed_batch(lengths, 128, requires_grad=False)
    cache = PagedKVCache(1, 64, 16, 2, 32, dtype=x.dtype, seed=7)
    starts = cu.tolist()
    with torch.no_grad():
        train_out = block(x, pos, cu)
        got = torch.empty_like(train_out)
        for s, n in enumerate(lengths):  # chunked prefill of each prompt, alone
            cache.add(s)
            for lo in range(0, n - decode_steps, chunk):
                hi = min(n - decode_steps, lo + chunk)
                rows = slice(starts[s] + lo, starts[s] + hi)
                slots = cache.reserve(s, hi - lo)  # first: seq_lens count the new tokens
                got[rows] = block.forward_rollout(x[None, rows], pos[None, rows], cache.k[0], cache.v[0],
                                                  cache.page_table([s]), cache.seq_lens([s]), slots)[0]
        seqs = list(range(len(lengths)))
        for step in range(decode_steps):  # batched decode, all sequences together
            rows = [starts[s] + n - decode_steps + step for s, n in enumerate(lengths)]
            slots = torch.cat([cache.reserve(s, 1) for s in seqs])
            got[rows] = block.forward_rollout(x[rows][:, None], pos[rows][:, None], cache.k[0], cache.v[0],
                                              cache.page_table(seqs), cache.seq_lens(seqs), slots)[:, 0]
        single_pass = Qwen3Attention(block.config, split_kv="disabled")
        single_pass.load_state_dict(block.state_dict())
        other = single_pass(x, pos, cu)
    assert (got != train_out).any(-1).sum().item() == 0
    assert (other != train_out).any(-1).sum().item() > 0  # the policy reached attention


def test_compiled_block_equals_eager_under_canonical():
    """torch.compile(fullgraph=True) keeps the canonical path inside rlk::attention_fwd/bwd:
    the training forward and every gradient equal eager bitwise."""
    block = init_block(Qwen3Attention(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                      split_kv="canonical:128"))
    x, pos, cu = packed_batch([150, 40], 64)
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        x.grad = None
        for p in block.parameters():
            p.grad = None
        out = fn(x, pos, cu)
        out.float().square().sum().backward()
        results.append([out.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    assert all(bitwise_equal(a, b) for a, b in zip(*results))


def test_default_chunk_at_qwen3_head_dim_and_gqa_8():
    """The other tests run canonical:C at head_dim 16 and C <= 384; here the default C (768) over a
    1700-token sequence at head_dim 128 with 8 query heads per KV head: training rows equal decode at
    positions on and off the chunk boundaries (767, 768, 1535, 1536) and a chunked prefill whose
    pieces cross one, with pages of 16 and 128, in float16 (session 32 audit: not covered before)."""
    from conftest import fill_paged_cache

    n, hq, hkv, d, dtype = 1700, 16, 2, 128, torch.float16
    gen = torch.Generator().manual_seed(32)
    q = torch.randn(1, n, hq, d, generator=gen).to(dtype)
    k = torch.randn(1, n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(1, n, hkv, d, generator=gen).to(dtype)
    out, lse = rlk_ops.attention(q, k, v, split_kv="canonical")
    for page_size in (16, 128):
        kc, vc, table = fill_paged_cache(k, v, page_size, gen)
        for p in (0, 767, 768, 1535, 1536, n - 1):
            lens = torch.tensor([p + 1], dtype=torch.int32)
            o, l = rlk_ops.paged_attention(q[:, p:p + 1], kc, vc, table, lens, split_kv="canonical")
            assert torch.equal(o[:, 0], out[:, p]) and torch.equal(l[:, :, 0], lse[:, :, p]), (page_size, p)
        for start, stop in ((700, 900), (1500, 1700)):
            lens = torch.tensor([stop], dtype=torch.int32)
            o, l = rlk_ops.paged_attention(q[:, start:stop], kc, vc, table, lens, split_kv="canonical")
            assert torch.equal(o, out[:, start:stop]) and torch.equal(l, lse[:, :, start:stop]), (start, stop)


def test_decode_pairs_width_is_capped_by_the_table():
    """A chunk wider than the table: one pair per sequence, the table's own width (not C / page_size columns;
    a session 39 mutation audit found the cap untested)."""
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    pair_table, pair_lens, n = canonical.decode_pairs(table, torch.tensor([7, 3], dtype=torch.int32), 4, 1024)
    assert n == 1 and tuple(pair_table.shape) == (2, 2) and pair_lens.tolist() == [7, 3]
