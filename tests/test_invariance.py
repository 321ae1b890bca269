"""The CPU reference's bitwise claims (torch.equal): run-to-run, batch invariance,
prefill/decode invariance, chunked prefill, varlen == dense, paged == dense."""

import pytest
import torch

import rlk_ops

from conftest import bitwise_equal, fill_paged_cache

DT = torch.bfloat16
B, S, HQ, HKV, D = 4, 300, 8, 2, 64


@pytest.fixture(scope="module")
def qkv():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, HQ, D, generator=g).to(DT)
    k = torch.randn(B, S, HKV, D, generator=g).to(DT)
    v = torch.randn(B, S, HKV, D, generator=g).to(DT)
    return q, k, v


@pytest.fixture(scope="module")
def prefill(qkv):
    return rlk_ops.attention(*qkv)


def test_run_to_run(qkv, prefill):
    out, lse = rlk_ops.attention(*qkv)
    assert bitwise_equal(out, prefill[0]) and bitwise_equal(lse, prefill[1])


def test_batch_invariance_b1_vs_b4(qkv, prefill):
    q, k, v = qkv
    for b in range(B):
        out, lse = rlk_ops.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1])
        assert bitwise_equal(out[0], prefill[0][b]) and bitwise_equal(lse[0], prefill[1][b])


@pytest.mark.parametrize("p", [0, 1, 127, 128, 129, 255, 256, S - 1])
def test_decode_row_equals_prefill_row(qkv, prefill, p):
    q, k, v = qkv
    out, lse = rlk_ops.attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1])
    assert bitwise_equal(out[:, 0], prefill[0][:, p])
    assert bitwise_equal(lse[:, :, 0], prefill[1][:, :, p])


@pytest.mark.parametrize("start,stop", [(0, 77), (77, 200), (100, 129), (131, 300), (250, 251)])
def test_chunked_prefill_equals_prefill(qkv, prefill, start, stop):
    q, k, v = qkv
    out, lse = rlk_ops.attention(q[:, start:stop], k[:, :stop], v[:, :stop])
    assert bitwise_equal(out, prefill[0][:, start:stop])
    assert bitwise_equal(lse, prefill[1][:, :, start:stop])


def test_varlen_equals_dense(qkv, prefill):
    q, k, v = qkv
    lens = [S, 129, 1, 200]  # sequence b is the first lens[b] tokens of batch row b
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.cat([q[b, :n] for b, n in enumerate(lens)])
    kp = torch.cat([k[b, :n] for b, n in enumerate(lens)])
    vp = torch.cat([v[b, :n] for b, n in enumerate(lens)])
    out, lse = rlk_ops.attention(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert bitwise_equal(out[rows], prefill[0][b, :n])  # causal: a prefix's rows do not see the rest
        assert bitwise_equal(lse[:, rows], prefill[1][b, :, :n])


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_paged_decode_and_chunks_equal_prefill(qkv, prefill, page_size):
    q, k, v = qkv
    g = torch.Generator().manual_seed(page_size)
    k_cache, v_cache, page_table = fill_paged_cache(k, v, page_size, g)
    for p in (0, 127, 128, 129, S - 1):
        seq_lens = torch.full((B,), p + 1, dtype=torch.int32)
        out, lse = rlk_ops.paged_attention(q[:, p:p + 1], k_cache, v_cache, page_table, seq_lens)
        assert bitwise_equal(out[:, 0], prefill[0][:, p]), p
        assert bitwise_equal(lse[:, :, 0], prefill[1][:, :, p]), p
    start, stop = 61, 250  # a chunk that starts and ends off the 128 grid
    seq_lens = torch.full((B,), stop, dtype=torch.int32)
    out, lse = rlk_ops.paged_attention(q[:, start:stop], k_cache, v_cache, page_table, seq_lens)
    assert bitwise_equal(out, prefill[0][:, start:stop])
    assert bitwise_equal(lse, prefill[1][:, :, start:stop])


def test_cpu_auto_lane_decode_and_chunks_equal_prefill(qkv, prefill):
    """The CPU auto lane's prefill/decode claim (meta/specs.py): its decode rows and a chunk of new
    tokens equal the training prefill rows. Only its decode rows were compared, with paged attention,
    never with prefill: a CPU auto kernel that split chunks (Sq > 1) passed (a session 33 audit)."""
    q, k, v = qkv
    k_cache, v_cache, table = fill_paged_cache(k, v, 16, torch.Generator().manual_seed(7))
    with rlk_ops.strict(False):   # the auto lane is never strict
        for p in (0, 128, S - 1):
            out, lse = rlk_ops.paged_attention_auto(q[:, p:p + 1], k_cache, v_cache, table,
                                                    torch.full((B,), p + 1, dtype=torch.int32))
            assert bitwise_equal(out[:, 0], prefill[0][:, p]) and bitwise_equal(lse[:, :, 0], prefill[1][:, :, p]), p
        start, stop = 125, 133   # a chunk across the 128 grid
        out, lse = rlk_ops.paged_attention_auto(q[:, start:stop], k_cache, v_cache, table,
                                                torch.full((B,), stop, dtype=torch.int32))
    assert bitwise_equal(out, prefill[0][:, start:stop]) and bitwise_equal(lse, prefill[1][:, :, start:stop])


@pytest.mark.parametrize("split_kv", ["disabled", "canonical:128"])
def test_stale_cache_slots_never_reach_the_result(qkv, prefill, split_kv):
    """Slots past seq_len in a sequence's last page hold whatever was there (a freed page): NaN keys and
    infinite values there must not reach the rows, which equal the training rows bitwise. (Every fixture
    filled them with finite data, so zeroing them in the reference could be removed unseen: session 32
    audit.)"""
    q, k, v = qkv
    ps = 16
    k_cache, v_cache, table = fill_paged_cache(k, v, ps, torch.Generator().manual_seed(5))
    pos = [5, 130, 200, 250]
    lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        page = int(table[b, (n - 1) // ps])
        k_cache[page, n % ps or ps:] = float("nan")
        v_cache[page, n % ps or ps:] = float("inf")
    qd = torch.stack([q[b, p] for b, p in enumerate(pos)])[:, None]
    out, lse = rlk_ops.paged_attention(qd, k_cache, v_cache, table, lens, split_kv=split_kv)
    ref = prefill if split_kv == "disabled" else rlk_ops.attention(q, k, v, split_kv=split_kv)
    for b, p in enumerate(pos):
        assert bitwise_equal(out[b, 0], ref[0][b, p]) and bitwise_equal(lse[b, :, 0], ref[1][b, :, p]), b


def test_paged_decode_mixed_lengths_batch_invariant(qkv, prefill):
    """Each sequence at its own length in one decode batch == alone == prefill."""
    q, k, v = qkv
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, page_table = fill_paged_cache(k, v, 16, g)
    pos = [5, 299, 128, 64]
    seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
    qd = torch.stack([q[b, p] for b, p in enumerate(pos)])[:, None]
    out, lse = rlk_ops.paged_attention(qd, k_cache, v_cache, page_table, seq_lens)
    for b, p in enumerate(pos):
        solo, solo_lse = rlk_ops.paged_attention(qd[b:b + 1], k_cache, v_cache, page_table[b:b + 1], seq_lens[b:b + 1])
        assert bitwise_equal(out[b], solo[0]) and bitwise_equal(out[b, 0], prefill[0][b, p])
        assert bitwise_equal(lse[b, :, 0], prefill[1][b, :, p]) and bitwise_equal(lse[b], solo_lse[0])


def test_attention_backward_run_to_run(qkv):
    q, k, v = (t[:2, :200].clone().requires_grad_() for t in qkv)
    grads = []
    for _ in range(2):
        out, lse = rlk_ops.attention(q, k, v)
        dq, dk, dv = torch.autograd.grad((out.float().square().sum() + lse.sum()), (q, k, v))
        grads.append((dq, dk, dv))
    for a, b in zip(*grads):
        assert bitwise_equal(a, b)


def test_dq_batch_invariant(qkv):
    """dq of a row depends only on its sequence (dk/dv sum over rows: not claimed)."""
    q, k, v = (t[:, :150].clone().requires_grad_() for t in qkv)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DT)
    out, _ = rlk_ops.attention(q, k, v)
    (dq_all,) = torch.autograd.grad(out, q, dout)
    q1, k1, v1 = (t[1:2].detach().clone().requires_grad_() for t in (q, k, v))
    out1, _ = rlk_ops.attention(q1, k1, v1)
    (dq_one,) = torch.autograd.grad(out1, q1, dout[1:2])
    assert bitwise_equal(dq_one[0], dq_all[1])


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_of_a_head_subset_equals_its_slice(varlen):
    """Tensor parallelism gives each rank some of the heads: every gradient of a KV head and its
    query heads must not depend on how many other heads the call holds. dk/dv add up the query
    rows in chunks, and the chunks were sized by the number of KV heads, so with 300 rows x group 4
    they were cut differently for 4 KV heads than for 2 (a session 31 audit of the DTensor rules)."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 300, 16, 4, 32
    q, dout = (torch.randn(1, t, hq, d, generator=g).to(DT) for _ in range(2))
    k, v = (torch.randn(1, t, hkv, d, generator=g).to(DT) for _ in range(2))
    dlse = torch.randn(1, hq, t, generator=g)
    cu = torch.tensor([0, 180, 300], dtype=torch.int32)

    def grads(a, b, c, do, dl):
        a, b, c = (x.clone().requires_grad_() for x in (a, b, c))
        if varlen:
            out, lse = rlk_ops.attention(a[0], b[0], c[0], cu_seqlens_q=cu, cu_seqlens_k=cu)
            loss = (out.float() * do[0].float()).sum() + (lse * dl[0]).sum()
        else:
            out, lse = rlk_ops.attention(a, b, c)
            loss = (out.float() * do.float()).sum() + (lse * dl).sum()
        return torch.autograd.grad(loss, (a, b, c))

    full = grads(q, k, v, dout, dlse)
    for h0, h1 in ((0, 2), (2, 4), (1, 2)):   # KV heads [h0, h1) and their query heads
        qs = slice(h0 * hq // hkv, h1 * hq // hkv)
        part = grads(q[:, :, qs], k[:, :, h0:h1], v[:, :, h0:h1], dout[:, :, qs], dlse[:, qs])
        assert bitwise_equal(part[0], full[0][:, :, qs]), ("dq", h0, h1)
        assert bitwise_equal(part[1], full[1][:, :, h0:h1]), ("dk", h0, h1)
        assert bitwise_equal(part[2], full[2][:, :, h0:h1]), ("dv", h0, h1)


def test_batch_invariance_when_sequences_share_a_chunk():
    """The CPU kernel computes short sequences several to one temporary product (kernels/cpu/
    attention.py ``_chunks``); a sequence's rows, lse and dq alone must equal its rows in that
    batch. (At S = 300 above every chunk holds one sequence, so B = 1 and B = 4 run the same
    code there.)"""
    from rlk_ops.kernels.cpu import attention as cpu_attention

    b, s = 4, 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, s, HQ, D, generator=g).to(DT).requires_grad_()
    k = torch.randn(b, s, HKV, D, generator=g).to(DT).requires_grad_()
    v = torch.randn(b, s, HKV, D, generator=g).to(DT).requires_grad_()
    chunks = list(cpu_attention._chunks(b, s, HQ // HKV, HKV, D))
    assert any(b1 - b0 > 1 for b0, b1, _, _ in chunks), chunks  # the batch is really shared
    dout = torch.randn(q.shape, generator=g).to(DT)
    out, lse = rlk_ops.attention(q, k, v)
    (dq,) = torch.autograd.grad(out, q, dout)
    for i in range(b):
        qi, ki, vi = (t[i:i + 1].detach().clone().requires_grad_() for t in (q, k, v))
        oi, li = rlk_ops.attention(qi, ki, vi)
        (dqi,) = torch.autograd.grad(oi, qi, dout[i:i + 1])
        assert bitwise_equal(oi[0], out[i]) and bitwise_equal(li[0], lse[i]) and bitwise_equal(dqi[0], dq[i])


def test_dq_of_a_row_ignores_keys_it_does_not_see():
    """A row's dq must not depend on keys it cannot see, even huge finite ones: the backward walks a chunk
    of rows over the key blocks its last row sees, so row 10 of a 300-token sequence also walked key 200.
    With V there at 1e20, dp = rowsum(dout * V) overflowed to inf and 0 * inf made row 10's dq NaN, where
    the 11-token prefix gave finite values (session 32 audit); a context-parallel query split or padding
    changes those chunks."""
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 300, 4, 64, generator=g).to(DT) for _ in range(2))
    k, v = (torch.randn(1, 300, 2, 64, generator=g).to(DT) for _ in range(2))
    v[0, 200] = 1e20
    do[0, 10] = 1e20

    def dq(n):
        a = q[:, :n].clone().requires_grad_()
        out, _ = rlk_ops.attention(a, k[:, :n], v[:, :n])
        return torch.autograd.grad(out, a, do[:, :n])[0]
    full, prefix = dq(300)[0, 10], dq(11)[0, 10]
    assert torch.isfinite(prefix).all() and bitwise_equal(full, prefix)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_backward_batch_invariant_and_accurate(dtype):
    """rlk::rope_bwd (the inverse rotation) on the CPU: a token alone equals it in the batch,
    and the result is within rounding of the inverse rotation written out in float64 here (the
    reference was rope_bwd itself in float64, which a forward rotation in place of the inverse
    passed: session 32 audit)."""
    g = torch.Generator().manual_seed(12)
    dy = torch.randn(41, 4, 128, generator=g).to(dtype)
    pos = torch.randint(0, 40000, (41,), generator=g)
    for rd in (128, 64):
        full = torch.ops.rlk.rope_bwd(dy, pos, 1e6, rd)
        for i in (0, 13, 40):
            assert bitwise_equal(torch.ops.rlk.rope_bwd(dy[i:i + 1], pos[i:i + 1], 1e6, rd), full[i:i + 1])
        assert bitwise_equal(torch.ops.rlk.rope_bwd(dy, pos, 1e6, rd), full)
        inv = (1.0 / 1e6 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).float()
        ang = (pos.float()[:, None] * inv).double()                 # the forward's fp32 angle
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        d1, d2 = dy.double()[..., :rd // 2], dy.double()[..., rd // 2:rd]
        ref = torch.cat([d1 * cos + d2 * sin, d2 * cos - d1 * sin, dy.double()[..., rd:]], -1)   # R(-angle)
        err = (full.double() - ref).abs().max() / ref.abs().max()
        # fp32 angles (position x inverse frequency, as the forward computes them) carry ~6e-4 at
        # positions near 40000, the same as the forward's; a gradient off by 2^-6 is far outside
        assert err < (2 ** -7 if dtype == torch.bfloat16 else 2 ** -9), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_rmsnorm_batch_invariant(dtype):
    x = torch.randn(37, 16, 128, dtype=dtype)
    w = torch.randn(128, dtype=dtype)
    full = rlk_ops.qk_rmsnorm(x, w, 1e-6)
    for i in (0, 5, 36):
        assert bitwise_equal(rlk_ops.qk_rmsnorm(x[i:i + 1], w, 1e-6), full[i:i + 1])
        assert bitwise_equal(rlk_ops.qk_rmsnorm(x[i, :1], w, 1e-6), full[i, :1])
    assert bitwise_equal(rlk_ops.qk_rmsnorm(x, w, 1e-6), full)


def test_qk_rmsnorm_of_one_wide_row_is_batch_invariant():
    """A single row of >= 32768 elements (ATen's grain): ``mean`` split its sum across threads when
    the row was the whole input, not when another row came with it (session 28, found by review:
    2 of 20 fp32 rows of 40000 differed by 1 ulp with 2 threads; 16 of 27 tokens of a tiny model
    with hidden 40000 between rollout and training). The sums now go through numerics.rowsum. Two threads
    here whatever the machine: with one the split cannot happen and the test cannot fail."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _one_wide_row()
    finally:
        torch.set_num_threads(threads)


def _one_wide_row():
    w = torch.ones(40000)
    for seed in range(20):
        x = torch.randn(2, 1, 40000, generator=torch.Generator().manual_seed(seed))
        assert bitwise_equal(rlk_ops.qk_rmsnorm(x[:1], w, 1e-6), rlk_ops.qk_rmsnorm(x, w, 1e-6)[:1]), seed
        pos = torch.zeros(2, dtype=torch.int64)
        alone, both = rlk_ops.qk_norm_rope(x[:1], x[:1], w, w, pos[:1]), rlk_ops.qk_norm_rope(x, x, w, w, pos)
        assert bitwise_equal(alone[0], both[0][:1]) and bitwise_equal(alone[1], both[1][:1]), seed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_batch_invariant(dtype):
    x = torch.randn(41, 4, 128, dtype=dtype)
    pos = torch.randint(0, 40000, (41,))
    full = rlk_ops.rope(x, pos, 1e6)
    for i in (0, 13, 40):
        assert bitwise_equal(rlk_ops.rope(x[i:i + 1], pos[i:i + 1], 1e6), full[i:i + 1])
    # same token inside a dense [B, S] batch
    dense = rlk_ops.rope(x[None, :40].expand(3, 40, 4, 128).contiguous(), pos[None, :40].expand(3, 40), 1e6)
    assert bitwise_equal(dense[2], full[:40])
    assert bitwise_equal(rlk_ops.rope(x, pos, 1e6), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_batch_invariant(dtype):
    w = torch.randn(96, 256, dtype=dtype) / 16
    b = torch.randn(96, dtype=dtype)
    x = torch.randn(2048, 256, dtype=dtype)
    full = rlk_ops.linear(x, w, b)
    for m in (1, 3, 16, 257):
        assert bitwise_equal(rlk_ops.linear(x[:m], w, b), full[:m])
    assert bitwise_equal(rlk_ops.linear(x[-1:], w, b), full[-1:])
    assert bitwise_equal(rlk_ops.linear(x, w, b), full)


def test_linear_backward_run_to_run():
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(32, 128, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    dy = torch.randn(64, 32)
    g1 = torch.autograd.grad(rlk_ops.linear(x, w, b), (x, w, b), dy)
    g2 = torch.autograd.grad(rlk_ops.linear(x, w, b), (x, w, b), dy)
    assert all(bitwise_equal(a, c) for a, c in zip(g1, g2))
