"""Mutation audit (session 42) of the op layer: ops/_validate.py, ops/paged_kv.py, ops/qk_rmsnorm.py,
ops/rope.py, ops/qk_norm_rope.py, ops/linear.py, ops/merge.py, ops/attention.py and rollout/cache.py.

Each test kills mutants the earlier suite let through (session 42's audit report has the table): a device
check that skipped the second tensor, the bias or the append's positions; an overlap span one element
short; the float32 scale check skipped for bfloat16; the float64 eps bound; a bound off by one (a 1-entry
cu_seqlens, a rotary_dim past an odd head_dim, theta = 1 or inf, one query more than keys in a varlen
sequence); the append's v row count; the append's fake taking one tensor as both caches; the fakes' lse
dtype for bfloat16 inputs; autograd formulas that took a default (eps, softmax_scale) instead of the
call's; the cache manager's token counts taking a bool. Error tests check the type and that the message
names the argument and the values; gradient claims are float64 gradcheck.
"""
import math

import pytest
import torch

import rlk_ops
from rlk_ops import RlkInputError
from rlk_ops.rollout.cache import PagedKVCache

from samples import _paged as _sample_paged
from test_accuracy import _d, _rope_ref
from test_validation import _cache

F64 = torch.float64


# ============================================================== _validate.py
def test_same_device_checks_the_second_tensor():
    """Kills V08 (same_device compared items[2:] with the first: a two-tensor op's second tensor was never
    compared; the mixed-device cases before all had a third tensor on the first one's device)."""
    with pytest.raises(RlkInputError, match=r"rlk::qk_rmsnorm: weight is on meta but x is on cpu"):
        rlk_ops.qk_rmsnorm(torch.randn(3, 2, 8), torch.ones(8, device="meta"))


def test_rows_whose_last_strided_element_is_the_caches_first_are_refused():
    """Kills V11 (span of a non-contiguous tensor ended at its last element's first byte, not past its last
    byte: rows whose last element is the cache's first element were not seen as overlapping, and the
    append read a row while it wrote it)."""
    big = torch.zeros(400)
    k_cache = big[100:228].view(2, 4, 2, 8)
    k = big.as_strided((2, 2, 8), (50, 8, 1), 35)   # elements 35..100: the last one is k_cache[0, 0, 0, 0]
    assert not k.is_contiguous() and k.storage_offset() + 50 + 8 + 7 == 100
    before = big.clone()
    with pytest.raises(RlkInputError, match=r"rlk::paged_kv_append: k must not overlap k_cache in memory"):
        rlk_ops.paged_kv_append(k_cache, torch.zeros(2, 4, 2, 8), k, torch.zeros(2, 2, 8),
                                torch.tensor([0, 1]))
    assert torch.equal(big, before)


def test_a_scale_past_float32_is_refused_for_bfloat16_inputs():
    """Kills V13 (the float32 range check of softmax_scale ran for float32 inputs only: bfloat16 ones, which the
    kernels also scale in float32, took 1e39 and returned NaN)."""
    q = torch.randn(1, 2, 2, 8).bfloat16()
    with pytest.raises(RlkInputError, match=r"softmax_scale = 1e\+39 is inf in float32, the dtype the kernels "
                                            r"scale torch.bfloat16 inputs in"):
        rlk_ops.attention(q, q, q, softmax_scale=1e39)


def test_float64_inputs_take_an_eps_below_float32s_smallest_normal():
    """Kills V15 (rms_eps bounded eps by float32's smallest normal for every dtype: float64 inputs, which
    accumulate in float64, refused eps = 1e-300). And float64's own bound holds: 1e-310 (subnormal) is refused."""
    x = torch.randn(3, 2, 8, dtype=F64)
    w = torch.randn(8, dtype=F64)
    y = rlk_ops.qk_rmsnorm(x, w, 1e-300)
    ref = w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-300))
    torch.testing.assert_close(y, ref, rtol=1e-14, atol=0)
    with pytest.raises(RlkInputError, match=r"eps must be at least 2.2250738585072014e-308, the smallest normal "
                                            r"torch.float64 \(the accumulation dtype of torch.float64 inputs\), "
                                            r"got 1e-310"):
        rlk_ops.qk_rmsnorm(x, w, 1e-310)


def test_cu_seqlens_with_one_entry_is_named():
    """Kills V21 (check_cu_seqlens took a 1-entry cu_seqlens, [batch + 1] with no sequence: the error then named
    the token count instead, and with no tokens lens.max() of nothing crashed)."""
    cu = torch.tensor([0], dtype=torch.int32)
    for t in (5, 0):
        q, k = torch.randn(t, 4, 8), torch.randn(t, 2, 8)
        with pytest.raises(RlkInputError, match=r"rlk::attention_fwd: cu_seqlens_q must be 1-D \[batch \+ 1\] with "
                                                r"at least 2 entries, got shape \[1\]"):
            rlk_ops.attention(q, k, k.clone(), cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_a_long_argument_is_cut_to_60_characters_in_the_message():
    """Kills V24 (short_repr returned the whole repr: a long list printed in full in the error)."""
    with pytest.raises(RlkInputError) as e:
        rlk_ops.attention(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8),
                          softmax_scale=[1.0] * 40)
    msg = str(e.value)
    shown = msg.split("got list ", 1)[1]
    assert shown.startswith("[1.0, 1.0, ") and shown.endswith("...") and len(shown) == 60, msg


# ============================================================== paged_kv.py
def test_append_refuses_one_tensor_as_both_caches_in_its_fake():
    """Kills P03 (_check_append's ``k_cache is v_cache`` test dropped: the eager op still refused through the
    overlap test, which needs data pointers, but the fake (meta tensors, torch.compile tracing) took it)."""
    kc = torch.zeros(2, 4, 2, 8, device="meta")
    rows = torch.zeros(1, 2, 8, device="meta")
    with pytest.raises(RlkInputError, match=r"k_cache and v_cache must not overlap in memory"):
        rlk_ops.paged_kv_append(kc, kc, rows, rows, torch.zeros(1, dtype=torch.int64, device="meta"))


def test_append_v_rows_must_match_k_rows():
    """Kills P07 (v's row count unchecked: with fewer v rows than k rows and slots the append read past v)."""
    kc, vc = _cache()
    before = kc.clone(), vc.clone()
    with pytest.raises(RlkInputError, match=r"rlk::paged_kv_append: v must have k's token count 3, got 2"):
        rlk_ops.paged_kv_append(kc, vc, torch.randn(3, 2, 8), torch.randn(2, 2, 8), torch.tensor([0, 5, 9]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def _placed_append():
    """samples.py's placed append: seq 0's token 8 into slot 0, seq 1's token 5 into slot 21."""
    k_cache, v_cache, page_table, seq_lens = _sample_paged()
    return k_cache, v_cache, torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.tensor([0, 21]), page_table, seq_lens


def test_append_positions_on_another_device_are_named():
    """Kills P35 (the device check of positions dropped: positions on meta sent the append to its fake, which
    accepted it and wrote nothing, without an error)."""
    kc, vc, k, v, slots, table, lens = _placed_append()
    before = kc.clone()
    with pytest.raises(RlkInputError, match=r"positions is on meta but k_cache is on cpu"):
        rlk_ops.paged_kv_append(kc, vc, k, v, slots, table, lens, torch.tensor([[8], [5]], device="meta"))
    assert torch.equal(kc, before)


def test_gather_refuses_caches_that_require_grad_at_the_call():
    """Kills P36 (paged_kv_gather's public check of caches that require grad dropped: the call then succeeded
    and only a backward reaching the op raised, where a compiled call raises at the first call)."""
    kc, vc = _cache()
    table, lens = torch.tensor([[3, 1, 0]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)
    with pytest.raises(RlkInputError, match=r"rlk::paged_kv_gather: k_cache must not require grad: "
                                            r"rlk::paged_kv_gather has no derivative"):
        rlk_ops.paged_kv_gather(kc.requires_grad_(), vc, table, lens)
    with torch.no_grad():
        k, _ = rlk_ops.paged_kv_gather(kc, vc, table, lens)
    assert torch.equal(k[0, :4], kc[3].detach())


# ============================================================== qk_rmsnorm.py, rope.py, qk_norm_rope.py
def test_qk_rmsnorm_fake_keeps_a_bfloat16_dtype():
    """Kills R01 (qk_rmsnorm's fake returned float32: right for opcheck's float32 samples, but a bfloat16 call
    traced a float32 output where the op returns bfloat16)."""
    x = torch.empty(3, 2, 8, dtype=torch.bfloat16, device="meta")
    y = rlk_ops.qk_rmsnorm(x, torch.empty(8, dtype=torch.bfloat16, device="meta"))
    assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (3, 2, 8))
    assert rlk_ops.qk_rmsnorm(torch.randn(3, 2, 8).bfloat16(), torch.ones(8).bfloat16()).dtype == y.dtype


def test_gradcheck_qk_rmsnorm_with_a_large_eps():
    """Kills R03 (the backward took eps = 1e-6 instead of the call's; every gradient test used 1e-6)."""
    assert torch.autograd.gradcheck(lambda x, w: rlk_ops.qk_rmsnorm(x, w, 0.5), (_d(3, 2, 8), _d(8)))


def test_gradcheck_qk_norm_rope_with_a_large_eps():
    """Kills Q06 (the fused op's backward took eps = 1e-6 instead of the call's)."""
    pos = torch.tensor([0, 3, 70])
    leaves = (_d(3, 2, 8), _d(3, 1, 8), _d(8), _d(8))
    assert torch.autograd.gradcheck(lambda a, b, c, d: rlk_ops.qk_norm_rope(a, b, c, d, pos, 0.5, 1e4, 8), leaves)


def test_rotary_dim_past_an_odd_head_dim_is_refused():
    """Kills O02 (rotary_dim bounded by >= head_dim + 2: with an odd head_dim, the even rotary_dim = head_dim + 1
    was taken)."""
    x = torch.randn(3, 2, 7)
    with pytest.raises(RlkInputError, match=r"rotary_dim must be even and in \(0, head_dim=7\], got 8"):
        rlk_ops.rope(x, torch.arange(3), 1e6, 8)


def test_theta_one_is_a_valid_base_and_inf_is_not():
    """Kills O03 (theta > 1 refused theta = 1, which the contract allows: every frequency 1) and O04 (the
    finiteness of theta unchecked: inf made every frequency but the first 0 without an error). At theta 1
    the angle is the position itself, exact in fp32, so test_accuracy's reference (fp32 angle) is exact."""
    x, pos = torch.randn(4, 2, 8, dtype=F64), torch.tensor([0, 1, 5, 300])
    torch.testing.assert_close(rlk_ops.rope(x, pos, 1.0, 8), _rope_ref(x, pos, 1.0, 8), rtol=0, atol=1e-6)
    with pytest.raises(RlkInputError, match=r"rlk::rope: theta must be a finite number >= 1 \(the RoPE base\), got inf"):
        rlk_ops.rope(x, pos, math.inf, 8)


# ============================================================== linear.py
def test_linear_bias_on_another_device_is_named():
    """Kills L08 (the bias left out of linear's device check)."""
    with pytest.raises(RlkInputError, match=r"rlk::linear: bias is on meta but x is on cpu"):
        rlk_ops.linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, device="meta"))


# ============================================================== merge.py, attention.py
def test_fakes_give_float32_lse_for_bfloat16_inputs():
    """Kills M01 and A07 (the fakes' lse took the inputs' dtype: right for the float32 samples opcheck runs, but
    a bfloat16 merge or attention traced an lse of bfloat16 where the op returns float32)."""
    out_parts = torch.empty(2, 1, 3, 2, 4, dtype=torch.bfloat16, device="meta")
    lse_parts = torch.empty(2, 1, 2, 3, dtype=torch.float32, device="meta")
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    assert (out.dtype, lse.dtype, tuple(lse.shape)) == (torch.bfloat16, torch.float32, (1, 2, 3))
    q = torch.empty(1, 3, 2, 8, dtype=torch.bfloat16, device="meta")
    out, lse = rlk_ops.attention(q, q, q)
    assert (out.dtype, lse.dtype, tuple(lse.shape)) == (torch.bfloat16, torch.float32, (1, 2, 3))
    eager_out, eager_lse = rlk_ops.attention(*(torch.randn(1, 3, 2, 8).bfloat16() for _ in range(3)))
    assert eager_lse.dtype == lse.dtype


def test_merge_backward_names_a_dlse_of_the_wrong_shape():
    """Kills M05 (merge_attn_states_bwd left dlse out of its shape checks: a dlse of another shape reached the
    kernel, which broadcast it or failed inside)."""
    out_parts, lse_parts = torch.randn(2, 1, 3, 2, 4), torch.randn(2, 1, 2, 3)
    out, lse = rlk_ops.merge_attn_states(out_parts, lse_parts)
    dout = torch.randn_like(out)
    with pytest.raises(RlkInputError, match=r"rlk::merge_attn_states_bwd: dlse must have shape \[1, 2, 3\] \(lse_parts "
                                            r"without its state dim\), got \[1, 2, 1\]"):
        torch.ops.rlk.merge_attn_states_bwd(dout, torch.randn(1, 2, 1), out_parts, lse_parts, out, lse)
    d_out_parts, d_lse_parts = torch.ops.rlk.merge_attn_states_bwd(dout, torch.randn_like(lse), out_parts, lse_parts,
                                                                   out, lse)
    assert d_out_parts.shape == out_parts.shape and d_lse_parts.shape == lse_parts.shape


def test_attention_backward_names_a_dout_or_lse_that_does_not_fit():
    """Kills A10 (attention_bwd left the lse / dlse dtype unchecked: a float64 lse for float32 inputs reached the
    kernel) and A11 (attention_bwd left dout out of its shape checks: a dout of another head_dim reached the
    kernel)."""
    q = torch.randn(1, 3, 2, 4)
    out, lse = rlk_ops.attention(q, q, q)

    def bwd(dout, lse_arg, dlse_arg):
        return torch.ops.rlk.attention_bwd(dout, q, q, q, out, lse_arg, dlse_arg, 1, 0.5, None, None, 0, 0, "disabled")

    for lse_arg, dlse_arg, name in ((lse.double(), None, "lse"), (lse, lse.double(), "dlse")):
        with pytest.raises(RlkInputError, match=rf"rlk::attention_bwd: {name} must be torch.float32, got torch.float64"):
            bwd(torch.randn_like(out), lse_arg, dlse_arg)
    with pytest.raises(RlkInputError, match=r"rlk::attention_bwd: dout must have q's shape \[1, 3, 2, 4\], "
                                            r"got \[1, 3, 2, 5\]"):
        bwd(torch.randn(1, 3, 2, 5), lse, None)
    assert all(g.shape == q.shape for g in bwd(torch.randn_like(out), lse, None))


def test_gradcheck_attention_with_a_non_default_scale():
    """Kills A13 (the backward took head_dim ** -0.5 instead of the call's softmax_scale; every gradcheck used
    the default)."""
    q, k, v = _d(1, 3, 4, 4), _d(1, 5, 2, 4), _d(1, 5, 2, 4)
    assert torch.autograd.gradcheck(lambda q, k, v: rlk_ops.attention(q, k, v, softmax_scale=0.3), (q, k, v))


def test_varlen_causal_refuses_one_more_query_than_keys():
    """Kills A08 (the varlen causal test let a sequence with exactly one query more than its keys through; the
    case before had 4 queries and 2 keys)."""
    q, k = torch.randn(5, 4, 8), torch.randn(6, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(RlkInputError, match=r"causal attention needs at least as many keys as queries: sequence 0 "
                                            r"has 3 queries but 2 keys"):
        rlk_ops.attention(q, k, k.clone(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# ============================================================== rollout/cache.py
def test_cache_counts_refuse_a_bool():
    """Kills C12 (the token-count check took a bool: reserve(seq, True) grew the sequence by one token and
    truncate(seq, False) emptied it, where an int is required)."""
    cache = PagedKVCache(1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.reserve(0, 3)
    before = (cache.length(0), cache.pages(0), cache.free_pages)
    with pytest.raises(ValueError, match=r"n_new must be an int >= 0, got True"):
        cache.reserve(0, True)
    with pytest.raises(ValueError, match=r"length must be an int >= 0, got False"):
        cache.truncate(0, False)
    with pytest.raises(ValueError, match=r"n_new of sequence 0 must be an int >= 0, got True"):
        cache.reserve_batch([(0, True)])
    assert (cache.length(0), cache.pages(0), cache.free_pages) == before
