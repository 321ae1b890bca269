"""Bad input gets a clear error naming the argument, expected and actual value.
Never a crash, a hang, a wrong answer, or a corrupted KV cache."""
import re

import pytest
import torch

import rlk_ops
from rlk_ops import RlkInputError
from rlk_ops.ops import _validate as V

F = torch.float32


def _cache(num_pages=8, ps=4, h=2, d=8, dtype=F):
    return torch.randn(num_pages, ps, h, d, dtype=dtype), torch.randn(num_pages, ps, h, d, dtype=dtype)


def _paged(q_len=1, table=((3, 1, 0),), lens=(9,), num_pages=8):
    kc, vc = _cache(num_pages)
    q = torch.randn(len(lens), q_len, 4, 8)
    return q, kc, vc, torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def pa(**kw):
    return lambda: rlk_ops.paged_attention(*_paged(**kw))


def append(k_rows=3, slots=(0, 5, 9), kdtype=F, h=2, cache_kw=None, slot_dtype=torch.int64):
    kc, vc = _cache(**(cache_kw or {}))
    k = torch.randn(k_rows, h, 8, dtype=kdtype)
    return lambda: rlk_ops.paged_kv_append(kc, vc, k, k.clone(), torch.tensor(slots, dtype=slot_dtype))


def attn(qs=(2, 5, 4, 8), ks=(2, 7, 2, 8), causal=True, dtype_k=F, **kw):
    q, k = torch.randn(*qs), torch.randn(*ks, dtype=dtype_k)
    return lambda: rlk_ops.attention(q, k, k.clone(), causal=causal, **kw)


def varlen(cu_q=(0, 3, 5), cu_k=(0, 4, 6), tq=5, tk=6, dtype=torch.int32, **kw):
    q, k = torch.randn(tq, 4, 8), torch.randn(tk, 2, 8)
    cq = None if cu_q is None else torch.tensor(cu_q, dtype=dtype)
    ck = None if cu_k is None else torch.tensor(cu_k, dtype=dtype)
    return lambda: rlk_ops.attention(q, k, k.clone(), cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)


def rope(x_shape=(5, 2, 8), pos=None, theta=1e6, rotary_dim=None):
    x = torch.randn(*x_shape)
    p = torch.arange(x_shape[0]) if pos is None else pos
    return lambda: rlk_ops.rope(x, p, theta, rotary_dim)


def norm(w_shape=(8,), w_dtype=F, eps=1e-6, x_dtype=F):
    x = torch.ones(3, 2, 8).to(x_dtype)
    return lambda: rlk_ops.qk_rmsnorm(x, torch.ones(*w_shape, dtype=w_dtype), eps)


def lin(w_shape=(4, 8), b_shape=None, w_dtype=F):
    x = torch.randn(3, 8)
    b = None if b_shape is None else torch.randn(*b_shape)
    return lambda: rlk_ops.linear(x, torch.randn(*w_shape, dtype=w_dtype), b)


CASES = [
    # paged KV / page tables
    ("page id out of range", pa(table=((3, 11, 0),)), r"page_table\[0, 1\] = 11 is out of range for 8 pages"),
    ("page id negative", pa(table=((3, -2, 0),)), r"page_table\[0, 1\] = -2 is negative for 8 pages"),
    ("duplicate page in a sequence", pa(table=((3, 5, 3),)), r"page_table\[0, 2\] = 3 duplicates page_table\[0, 0\]"),
    ("seq_lens beyond capacity", pa(lens=(13,)), r"seq_lens\[0\] = 13 exceeds the page_table capacity 3 pages"),
    ("seq_lens shorter than new tokens", pa(q_len=4, lens=(3,)), r"seq_lens\[0\] = 3 is shorter than the 4 new"),
    ("seq_lens negative", pa(lens=(-1,)), r"seq_lens\[0\] = -1 is negative"),
    ("page_table wrong dtype", lambda: rlk_ops.paged_attention(*_paged()[:3], torch.tensor([[0, 1, 2]]),
                                                              torch.tensor([9], dtype=torch.int32)),
     r"page_table must be torch.int32, got torch.int64"),
    ("page_table rows != batch", lambda: rlk_ops.paged_attention(torch.randn(2, 1, 4, 8), *_paged()[1:]),
     r"page_table must have one row per sequence of q \(2\), got 1"),
    ("seq_lens length mismatch", lambda: rlk_ops.paged_attention(*_paged()[:4], torch.tensor([9, 9], dtype=torch.int32)),
     r"seq_lens must have one entry per page_table row \(1\), got 2"),
    ("paged q head_dim mismatch", lambda: rlk_ops.paged_attention(torch.randn(1, 1, 4, 16), *_paged()[1:]),
     r"k_cache's head_dim \(8\) must equal q's head_dim \(16\)"),
    ("paged GQA not divisible", lambda: rlk_ops.paged_attention(torch.randn(1, 1, 3, 8), *_paged()[1:]),
     r"q heads \(3\) must be a multiple of kv heads \(2\)"),
    ("gather page out of range", lambda: rlk_ops.paged_kv_gather(*_paged(table=((3, 99, 0),))[1:]),
     r"page_table\[0, 1\] = 99 is out of range"),
    ("slot out of range", append(slots=(0, 5, 32)), r"slot_mapping\[2\] = 32 is out of range for 32 slots"),
    ("slot below -1", append(slots=(0, -3, 1)), r"slot_mapping\[1\] = -3 is out of range"),
    ("slot duplicated", append(slots=(4, 7, 4)), r"slot_mapping\[2\] = 4 duplicates slot_mapping\[0\]"),
    ("slot_mapping wrong length", append(slots=(0, 1)), r"slot_mapping must have one slot per row of k \(3\), got 2"),
    ("slot_mapping wrong dtype", append(slot_dtype=torch.int32), r"slot_mapping must be torch.int64, got torch.int32"),
    ("append dtype mismatch", append(kdtype=torch.bfloat16), r"k must have the dtype of k_cache \(torch.float32\)"),
    ("append heads mismatch", append(h=3), r"k must be \[T, 2, 8\] to match the cache's \[H_kv, D\], got \[3, 3, 8\]"),
    ("k/v cache shape mismatch", lambda: rlk_ops.paged_kv_append(torch.zeros(4, 4, 2, 8), torch.zeros(4, 2, 2, 8),
                                                                 torch.zeros(1, 2, 8), torch.zeros(1, 2, 8),
                                                                 torch.zeros(1, dtype=torch.int64)),
     r"v_cache must have k_cache's shape \[4, 4, 2, 8\], got \[4, 2, 2, 8\]"),
    ("non-contiguous cache", lambda: rlk_ops.paged_kv_append(torch.zeros(4, 8, 2, 4).transpose(1, 3),
                                                             torch.zeros(4, 8, 2, 4).transpose(1, 3),
                                                             torch.zeros(1, 2, 8), torch.zeros(1, 2, 8),
                                                             torch.zeros(1, dtype=torch.int64)),
     r"k_cache must be contiguous"),
    # attention
    ("attention dtype mismatch", attn(dtype_k=torch.bfloat16), r"k must have the dtype of q \(torch.float32\), got torch.bfloat16"),
    ("attention head_dim mismatch", attn(ks=(2, 7, 2, 16)), r"k's head_dim \(16\) must equal q's head_dim \(8\)"),
    ("GQA heads not divisible", attn(qs=(2, 5, 3, 8)), r"q heads \(3\) must be a multiple of kv heads \(2\)"),
    ("causal more queries than keys", attn(qs=(2, 9, 4, 8)), r"q has 9 queries, k has 7 keys"),
    ("attention batch mismatch", attn(ks=(3, 7, 2, 8)), r"k must have q's batch size 2, got 3"),
    ("attention wrong ndim", attn(qs=(5, 4, 8)), r"q must be 4-D \[B, S, H, D\], got shape \[5, 4, 8\]"),
    ("softmax_scale nan", attn(softmax_scale=float("nan")), r"softmax_scale must be finite, got nan"),
    # finite as a double, inf or 0 as the float32 the kernels scale by: every score inf, the output NaN
    # (session 32 review)
    ("softmax_scale past float32", attn(softmax_scale=1e39),
     r"softmax_scale = 1e\+39 is inf in float32, the dtype the kernels scale torch.float32 inputs in"),
    ("softmax_scale under float32", attn(softmax_scale=1e-50), r"softmax_scale = 1e-50 is 0 in float32"),
    ("paged softmax_scale past float32", lambda: rlk_ops.paged_attention(*_paged(), softmax_scale=-1e39),
     r"paged_attention: softmax_scale = -1e\+39 is inf in float32"),
    ("attention int dtype", lambda: rlk_ops.attention(torch.ones(1, 2, 2, 4, dtype=torch.int32),
                                                      torch.ones(1, 2, 2, 4, dtype=torch.int32),
                                                      torch.ones(1, 2, 2, 4, dtype=torch.int32)),
     r"q must be bfloat16, float16, float32 or float64, got torch.int32"),
    ("cu_seqlens decreasing", varlen(cu_q=(0, 4, 3), tq=3, cu_k=(0, 4, 6)),
     r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 4"),
    # int32 differences wrapped INT32_MAX -> INT32_MIN to +1: accepted, then a crash (or 16 GiB) in the kernel
    ("cu_seqlens wrapping int32", varlen(cu_q=(0, 2 ** 31 - 1, -2 ** 31 + 5, 5), cu_k=(0, 2, 4, 6), causal=False,
                                         max_seqlen_q=2 ** 31 - 1),
     r"cu_seqlens_q must be non-decreasing, but cu_seqlens_q\[2\] = -2147483643 < cu_seqlens_q\[1\] = 2147483647"),
    ("cu_seqlens wrong total", varlen(cu_q=(0, 3, 4)), r"cu_seqlens_q\[-1\] must equal the packed token count 5, got 4"),
    ("cu_seqlens not starting at 0", varlen(cu_k=(1, 4, 6)), r"cu_seqlens_k\[0\] must be 0, got 1"),
    ("cu_seqlens wrong dtype", varlen(dtype=torch.int64), r"cu_seqlens_q must be torch.int32, got torch.int64"),
    ("only one cu_seqlens", varlen(cu_k=None), r"cu_seqlens_q and cu_seqlens_k must be given together"),
    ("cu_seqlens shape mismatch", varlen(cu_k=(0, 6)), r"cu_seqlens_k must have cu_seqlens_q's shape \[3\], got \[2\]"),
    ("varlen causal more queries", varlen(cu_q=(0, 4, 5), cu_k=(0, 2, 6)),
     r"sequence 0 has 4 queries but 2 keys"),
    ("max_seqlen too small", varlen(max_seqlen_q=2), r"max_seqlen_q = 2 is smaller than the longest sequence in cu_seqlens_q \(3\)"),
    # rope
    ("positions not int64", rope(pos=torch.arange(5, dtype=torch.int32)), r"positions must be torch.int64, got torch.int32"),
    ("positions negative", rope(pos=torch.tensor([0, 1, -4, 2, 3])), r"positions\[2\] = -4 is negative"),
    ("positions wrong shape", rope(pos=torch.arange(6)), r"positions must have x's leading shape \[5\]"),
    ("positions too large", rope(pos=torch.tensor([0, 1, 2, 3, 10**8])), r"positions\[4\] = 100000000 exceeds"),
    ("odd rotary_dim", rope(rotary_dim=5), r"rotary_dim must be even and in \(0, head_dim=8\], got 5"),
    ("rotary_dim too large", rope(rotary_dim=10), r"rotary_dim must be even and in \(0, head_dim=8\], got 10"),
    ("theta <= 0", rope(theta=0.0), r"theta must be a finite number >= 1 \(the RoPE base\), got 0.0"),
    ("theta < 1", rope(theta=1e-30), r"theta must be a finite number >= 1 \(the RoPE base\), got 1e-30"),
    ("rope 1-D x", rope(x_shape=(8,), pos=torch.arange(1)), r"x must be \[..., heads, head_dim\]"),
    # 0-d x or q with rotary_dim None: an IndexError in the wrapper (session 32 audit)
    ("rope 0-d x", lambda: rlk_ops.rope(torch.tensor(1.0), torch.tensor(0)),
     r"rope: x must be \[..., heads, head_dim\] \(at least 2-D\), got shape \[\]"),
    ("qk_norm_rope 0-d q", lambda: rlk_ops.qk_norm_rope(torch.tensor(1.0), torch.tensor(1.0), torch.ones(8),
                                                       torch.ones(8), torch.tensor(0)),
     r"qk_norm_rope: q must be \[..., heads, head_dim\] \(at least 2-D\), got shape \[\]"),
    # norm
    ("eps < 0", norm(eps=-1e-6), r"eps must be a finite number > 0, got -1e-06"),
    # an all-zero row normalised to NaN without an error (session 32 audit)
    ("eps 0", norm(eps=0.0), r"eps must be a finite number > 0, got 0.0 \(with 0 an all-zero row normalises to NaN\)"),
    ("eps 0 in float32", norm(eps=1e-300), r"eps must be at least 1.17549\d*e-38, the smallest normal torch.float32 "
                                           r"\(the accumulation dtype of torch.float32 inputs\), got 1e-300"),
    ("qk_norm_rope eps 0", lambda: rlk_ops.qk_norm_rope(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.ones(8),
                                                        torch.ones(8), torch.arange(2), eps=0.0),
     r"qk_norm_rope: eps must be a finite number > 0, got 0.0"),
    ("norm weight shape", norm(w_shape=(16,)), r"weight must have shape \[8\] \(x's head_dim\), got \[16\]"),
    ("norm weight dtype", norm(w_dtype=torch.float64), r"weight must have the dtype of x \(torch.float32\), got torch.float64"),
    ("norm int input", norm(x_dtype=torch.int64, w_dtype=torch.int64), r"x must be bfloat16, float16, float32 or float64"),
    # linear
    ("linear weight shape", lin(w_shape=(4, 9)), r"weight must be \[out_features, 8\] \(x's in_features\), got \[4, 9\]"),
    ("linear bias shape", lin(b_shape=(5,)), r"bias must have shape \[4\] \(weight's out_features\), got \[5\]"),
    ("linear dtype mismatch", lin(w_dtype=torch.bfloat16), r"weight must have the dtype of x \(torch.float32\)"),
    ("linear 1-D weight", lin(w_shape=(8,)), r"weight must be 2-D \[out_features, in_features\], got shape \[8\]"),
    # empty dimensions (session 25): each once crashed inside a kernel or the wrapper
    ("no q heads", attn(qs=(2, 5, 0, 8)), r"q heads \(0\) must be a multiple of kv heads \(2\) for GQA, both >= 1"),
    ("paged no q heads", lambda: rlk_ops.paged_attention(torch.randn(1, 1, 0, 8), *_paged()[1:]),
     r"q heads \(0\) must be a multiple of kv heads \(2\) for GQA, both >= 1"),
    ("head_dim 0", lambda: rlk_ops.attention(torch.randn(1, 2, 4, 0), torch.randn(1, 2, 2, 0), torch.randn(1, 2, 2, 0)),
     r"q must have head_dim >= 1 \(its last dim\), got shape \[1, 2, 4, 0\]"),
    ("head_dim 0 with a scale", lambda: rlk_ops.attention(torch.randn(1, 2, 4, 0), torch.randn(1, 2, 2, 0),
                                                          torch.randn(1, 2, 2, 0), softmax_scale=1.0),
     r"q must have head_dim >= 1"),
    ("paged head_dim 0", lambda: rlk_ops.paged_attention(torch.randn(1, 1, 4, 0), *_cache(d=0), *_paged()[3:]),
     r"q must have head_dim >= 1 \(its last dim\), got shape \[1, 1, 4, 0\]"),
    ("page_size 0", lambda: rlk_ops.paged_kv_gather(*_cache(ps=0), *_paged()[3:]),
     r"k_cache must have num_pages, page_size, H_kv and D >= 1, got shape \[8, 0, 2, 8\]"),
    ("no pages", lambda: rlk_ops.paged_kv_gather(*_cache(num_pages=0), torch.zeros(1, 3, dtype=torch.int32),
                                                 torch.zeros(1, dtype=torch.int32)),
     r"k_cache must have num_pages, page_size, H_kv and D >= 1, got shape \[0, 4, 2, 8\]"),
    ("append to no pages", append(slots=(0, 1, 2), cache_kw={"num_pages": 0}),
     r"k_cache must have num_pages, page_size, H_kv and D >= 1"),
    ("softmax_scale not a number", attn(softmax_scale="x"), r"softmax_scale must be a float or None, got str 'x'"),
    ("paged softmax_scale not a number", lambda: rlk_ops.paged_attention(*_paged(), softmax_scale=[1.0]),
     r"softmax_scale must be a float or None, got list \[1.0\]"),
    # float("0.5") and float(True) once converted (session 32 audit)
    ("softmax_scale a numeric string", attn(softmax_scale="0.5"),
     r"softmax_scale must be a float or None, got str '0.5'"),
    ("softmax_scale a bool", attn(softmax_scale=True), r"softmax_scale must be a float or None, got bool True"),
    ("softmax_scale too large", attn(softmax_scale=10 ** 400),
     r"softmax_scale must be a float or None, got int 1000.*, too large for a float"),
    # devices
    ("mixed devices", lambda: rlk_ops.attention(torch.randn(1, 2, 2, 4, device="meta"), torch.randn(1, 2, 2, 4),
                                                torch.randn(1, 2, 2, 4)),
     r"is on .* but q is on meta"),
]


def test_at_least_30_distinct_bad_inputs():
    assert len({name for name, _, _ in CASES}) == len(CASES) >= 30


@pytest.mark.parametrize("name,call,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_clear_message(name, call, pattern):
    with pytest.raises(RlkInputError, match=pattern) as info:
        call()
    assert str(info.value).startswith("rlk::"), "errors name the op"


@pytest.mark.parametrize("slots", [(0, 5, 5), (0, 1, 999), (3, 4, -2)])
def test_rejected_append_leaves_cache_untouched(slots):
    k_cache, v_cache = _cache()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(3, 2, 8)
    with pytest.raises(RlkInputError):
        rlk_ops.paged_kv_append(k_cache, v_cache, k, k, torch.tensor(slots))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def _rollout_step(context=(7, 30), page_size=16, sq=1):
    """A block and one forward_rollout step over caches holding context[b] tokens (Sq = 1),
    or its last sq tokens re-run as a chunk (sq > 1: the slots of tokens n - sq + 1 .. n)."""
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import decode_batch, init_block
    blk = init_block(Qwen3Attention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16))
    x, pos, kc, vc, pt, sl, slots = decode_batch(blk, list(context), page_size=page_size)
    if sq > 1:
        p = sl.long()[:, None] - sq + torch.arange(sq)
        slots = (pt.long().gather(1, p // page_size) * page_size + p % page_size).reshape(-1)
        x, pos = x.expand(-1, sq, -1).contiguous(), p
    return blk, [x, pos, kc, vc, pt, sl, slots]


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("case,pattern", [
    ("slot in another sequence's page", r"slot_mapping\[0\] = \d+ is not the slot of its token: row 0 is token \d+ "
                                       r"of sequence 0 .* whose slot is page_table\[0, \d+\] = \d+ \* page_size 16"),
    ("seq_lens one short", r"slot_mapping\[\d+\] = \d+ is not the slot of its token"),
    ("positions off", r"positions\[0, 0\] = \d+ is not its token's position \d+ \(seq_lens\[0\] = \d+ with"),
    ("seq_lens shorter than the new tokens", r"seq_lens\[0\] = 0 is shorter than the \d+ new query tokens"),
    ("a page in two tables", r"slot_mapping\[\d+\] = \d+ \(page \d+, offset \d+\) holds token \d+ of sequence 1, "
                             r"already cached \(page_table\[1, 0\] = \d+, seq_lens\[1\] = \d+ with \d+ new tokens\): the "
                             r"append would overwrite another sequence's K/V"),
])
@pytest.mark.parametrize("device_path", [False, True])
def test_rollout_slots_must_be_where_page_table_and_seq_lens_put_the_tokens(case, pattern, sq, device_path,
                                                                            monkeypatch):
    """forward_rollout's four descriptions of where the new tokens sit (positions, slot_mapping,
    page_table, seq_lens) must agree. Before, each op checked its own arguments only: a slot in
    another sequence's page overwrote that sequence's cached K/V, and seq_lens or positions that
    disagreed gave a wrong answer, all without an error (review). So did a slot where its own table
    puts it but in a page another row's table holds with that row's cached tokens (session 31
    audit). Refused before any write.
    device_path: the masks CUDA tensors take (page checks and placement in one sync), on CPU."""
    if device_path:
        monkeypatch.setattr(V, "on_device", lambda t: True)
    blk, args = _rollout_step(sq=sq)
    x, pos, kc, vc, pt, sl, slots = args
    with torch.no_grad():
        ref = blk.forward_rollout(*[a.clone() for a in args])
    if case == "slot in another sequence's page":
        slots = slots.clone()
        slots[0] = int(pt[1, 0]) * 16 + 3           # sequence 1's token 3
    elif case == "seq_lens one short":
        sl = sl - 1
    elif case == "positions off":
        pos = pos + 5
    elif case == "a page in two tables":   # every slot where its own table puts it, in a page sequence 1 fills
        pt = pt.clone()
        pt[0, 0] = pt[1, 0]
        p = sl.long()[:, None] - sq + torch.arange(sq)
        slots = (pt.long().gather(1, p // 16) * 16 + p % 16).reshape(-1)
    else:
        sl = sl.clone()
        sl[0] = 0
    before = kc.clone(), vc.clone()
    with torch.no_grad(), pytest.raises(RlkInputError, match=pattern):
        blk.forward_rollout(x, pos, kc, vc, pt, sl, slots)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert ref.shape == x.shape


@pytest.mark.parametrize("device_path", [False, True])
def test_append_refuses_a_slot_another_row_skips_as_cached(device_path, monkeypatch):
    """A -1 slot means the token is already in the cache, where the row's table puts it. Row 1
    skips its token 6 (slot 6, page 1, shared with row 0) and row 0 writes its token 6 there, while
    row 1 writes row 0's skipped token 5: both overwrite a cached token (session 31 review)."""
    if device_path:
        monkeypatch.setattr(V, "on_device", lambda t: True)
    kc, vc = torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)
    k = torch.full((4, 1, 2), 5.0)
    table, lens = torch.tensor([[0, 1], [3, 1]], dtype=torch.int32), torch.tensor([7, 7], dtype=torch.int32)
    with pytest.raises(RlkInputError, match=r"slot_mapping\[1\] = 6 is where sequence 1 keeps its token 6, which its "
                                            r"slot_mapping\[3\] = -1 says is cached"):
        torch.ops.rlk.paged_kv_append(kc, vc, k, k, torch.tensor([-1, 6, 5, -1]), table, lens, None)
    assert not kc.any() and not vc.any()
    # each row skipping its own cached token and writing its own: accepted
    torch.ops.rlk.paged_kv_append(kc, vc, k, k, torch.tensor([-1, 6, -1, 14]), torch.tensor([[0, 1], [2, 3]],
                                                                                              dtype=torch.int32), lens, None)
    assert int(kc.ne(0).sum()) == 4


_ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA GPU")])


def _placement_args(case, sq, device):
    """Two sequences (7 and 10 tokens cached, the last sq of each new; pages of 4), the slots where their
    tables put the new tokens, changed as ``case`` says."""
    ps = 4
    g = torch.Generator().manual_seed(3)
    kc, vc = (torch.randn(8, ps, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    table, lens = torch.tensor([[3, 1, 0], [5, 2, 7]], dtype=torch.int32), torch.tensor([7, 10], dtype=torch.int32)
    if case == "a page in two tables":   # sequence 0's new tokens go to page 5, which sequence 1 has filled
        table[0, 1] = table[1, 0]
    elif case == "a -1 slot's token written by another row":  # both rows' token 9 in page 7; row 1 skips its own
        table[0, 2], lens[0] = table[1, 2], 10
    pos = lens.long()[:, None] - sq + torch.arange(sq)
    slots = (table.long().gather(1, pos // ps) * ps + pos % ps).reshape(-1)
    if case == "slot in another sequence's page":
        slots[0] = int(table[1, 0]) * ps + 1
    elif case == "seq_lens one short":
        lens = lens - 1
    elif case == "positions off":
        pos = pos + 5
    elif case == "seq_lens shorter than the new tokens":
        lens[0] = 0
    elif case == "a -1 slot's token written by another row":
        slots[sq:] = -1
    k, v = (torch.randn(2 * sq, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    return [t.to(device) for t in (kc, vc, k, v, slots, table, lens, pos)]


@pytest.mark.parametrize("device", ["cpu", "cpu, device path", _ON_CUDA])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("case,pattern", [
    ("slot in another sequence's page", r"slot_mapping\[0\] = 21 is not the slot of its token: row 0 is token \d of "
                                       r"sequence 0"),
    ("seq_lens one short", r"slot_mapping\[\d\] = \d+ is not the slot of its token"),
    ("positions off", r"positions\[0, 0\] = \d+ is not its token's position \d"),
    ("seq_lens shorter than the new tokens", r"seq_lens\[0\] = 0 is shorter than the \d new query tokens"),
    ("a page in two tables", r"slot_mapping\[0\] = \d+ \(page 5, offset \d\) holds token \d of sequence 1, already "
                             r"cached"),
    ("a -1 slot's token written by another row", r"slot_mapping\[\d\] = \d+ is where sequence 1 keeps its token \d, "
                                                 r"which its slot_mapping\[\d\] = -1 says is cached"),
])
def test_append_placement_refusals_on_the_tensors_device(case, pattern, sq, device, monkeypatch):
    """The placement checks on each device's own path: on CUDA the page checks, the slots and the
    placement are device-side masks read in one sync (session 31's cached-token masks had run on CPU
    only, with on_device patched). Each refusal leaves both caches unchanged; the same call with the
    slots where the tables put the tokens writes what the unchecked append writes. ("cpu, device
    path": the CUDA masks on CPU tensors.)"""
    if device == "cpu, device path":
        device = "cpu"
        monkeypatch.setattr(V, "on_device", lambda t: True)
    kc, vc, k, v, slots, table, lens, pos = _placement_args(case, sq, device)
    before = kc.clone(), vc.clone()
    with pytest.raises(RlkInputError, match=pattern):
        torch.ops.rlk.paged_kv_append(kc, vc, k, v, slots, table, lens, pos)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    kc, vc, k, v, slots, table, lens, pos = _placement_args("none", sq, device)
    kc2, vc2 = kc.clone(), vc.clone()
    torch.ops.rlk.paged_kv_append(kc, vc, k, v, slots, table, lens, pos)
    torch.ops.rlk.paged_kv_append(kc2, vc2, k, v, slots, None, None, None)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and not torch.equal(kc, before[0])


@pytest.mark.parametrize("device_path", [False, True])
def test_a_zero_row_append_still_checks_the_page_values(device_path, monkeypatch):
    """No rows to write (Sq = 0 for each page_table row): the page ids and seq_lens are still checked
    (they were skipped before session 41); good ones write nothing."""
    if device_path:
        monkeypatch.setattr(V, "on_device", lambda t: True)
    kc, vc = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    k = torch.zeros(0, 1, 8)
    slots = torch.zeros(0, dtype=torch.int64)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    torch.ops.rlk.paged_kv_append(kc, vc, k, k, slots, table, lens, torch.zeros(2, 0, dtype=torch.int64))
    assert not kc.any() and not vc.any()
    with pytest.raises(RlkInputError, match=r"page_table\[1, 0\] = 9 is out of range"):
        torch.ops.rlk.paged_kv_append(kc, vc, k, k, slots, torch.tensor([[0, 1], [9, 3]], dtype=torch.int32), lens)
    with pytest.raises(RlkInputError, match=r"seq_lens\[1\] = 5 .*capacity"):
        torch.ops.rlk.paged_kv_append(kc, vc, k, k, slots, table, torch.tensor([3, 5], dtype=torch.int32))


def test_append_placement_arguments_go_together():
    blk, (x, pos, kc, vc, pt, sl, slots) = _rollout_step()
    k = torch.zeros(2, 2, 16, dtype=kc.dtype)
    with pytest.raises(RlkInputError, match=r"page_table and seq_lens go together .* got page_table=a tensor, "
                                            r"seq_lens=None"):
        rlk_ops.paged_kv_append(kc, vc, k, k, slots, pt)
    with pytest.raises(RlkInputError, match=r"positions are checked against page_table and seq_lens; pass them too"):
        rlk_ops.paged_kv_append(kc, vc, k, k, slots, positions=pos)
    with pytest.raises(RlkInputError, match=r"slot_mapping must hold Sq rows for each of the 2 page_table rows "
                                            r"\(B \* Sq\), got 3 rows"):
        k3 = torch.zeros(3, 2, 16, dtype=kc.dtype)
        rlk_ops.paged_kv_append(kc, vc, k3, k3, torch.tensor([0, 1, 2]), pt, sl)
    with pytest.raises(RlkInputError, match=r"positions must be \[B, Sq\] = \[2, 1\] \(or \[2\]\), got \[1, 2\]"):
        rlk_ops.paged_kv_append(kc, vc, k, k, slots, pt, sl, pos.reshape(1, 2))
    with pytest.raises(RlkInputError, match=r"positions must be torch.int64, got torch.int32"):
        rlk_ops.paged_kv_append(kc, vc, k, k, slots, pt, sl, pos.int())
    # the slots where page_table and seq_lens put the tokens: written, and equal to the unchecked append
    k = torch.randn(2, 2, 16).to(kc.dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    rlk_ops.paged_kv_append(kc, vc, k, k, slots, pt, sl, pos)
    rlk_ops.paged_kv_append(kc2, vc2, k, k, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # a skipped row (slot -1, e.g. padding to a captured batch size) is not checked, whatever its position
    skip, pad_pos = slots.clone(), pos.clone()
    skip[1], pad_pos[1] = -1, 999
    rlk_ops.paged_kv_append(kc, vc, k, k, skip, pt, sl, pad_pos)


def test_padding_past_used_pages_is_not_validated():
    """Only ceil(seq_len / page_size) entries are read; the rest may hold anything."""
    q, kc, vc, _, _ = _paged()
    table = torch.tensor([[3, 1, 0, -99, 10**6]], dtype=torch.int32)
    out, _ = rlk_ops.paged_attention(q, kc, vc, table, torch.tensor([9], dtype=torch.int32))
    ref, _ = rlk_ops.paged_attention(q, kc, vc, table[:, :3].contiguous(), torch.tensor([9], dtype=torch.int32))
    assert torch.equal(out, ref)


def test_collectives_need_an_initialized_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RlkInputError, match=re.escape("torch.distributed is not initialized")):
        rlk_ops.all_gather(torch.zeros(2))


def test_split_kv_policy_errors():
    q, kc, vc, table, lens = _paged()
    with pytest.raises(RlkInputError, match=r"split_kv 'auto' is not allowed here .*never strict"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="auto")
    with pytest.raises(RlkInputError, match=r"split_kv must be 'disabled', 'auto', 'fixed:N', 'canonical' or 'canonical:C', got 'sometimes'"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="sometimes")
    with pytest.raises(RlkInputError, match=r"canonical:C needs C a positive multiple of 128, got 100"):
        rlk_ops.attention(*(torch.randn(1, 2, 2, 4) for _ in range(3)), split_kv="canonical:100")
    with pytest.raises(RlkInputError, match=r"split_kv 'fixed:256' is not allowed here"):
        rlk_ops.attention(*(torch.randn(1, 2, 2, 4) for _ in range(3)), split_kv="fixed:256")
    # a sign reaches the size message, not the generic one
    with pytest.raises(RlkInputError, match=r"canonical:C needs C a positive multiple of 128, got -128"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="canonical:-128")
    with pytest.raises(RlkInputError, match=r"fixed:N needs 0 < N <= 2147483647 \(MAX_FIXED_SPLIT\), got -1"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="fixed:-1")
    # C is bounded: the decode layout allocates C / page_size table columns per pair
    with pytest.raises(RlkInputError, match=r"canonical:C needs C <= 1048576 \(MAX_CANONICAL_CHUNK\), got 128000"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv=f"canonical:{128 * 10**15}")
    # one spelling per policy, ASCII digits, no whitespace (reports and the binding compare the text; session 32
    # audit: these ran, and 5000 digits raised int()'s own error, naming no argument)
    generic = r"split_kv must be 'disabled', 'auto', 'fixed:N', 'canonical' or 'canonical:C', got "
    for text, pattern in ((" canonical:128\n", generic + r"' canonical:128\\n'"),
                          ("canonical:\uff11\uff12\uff18", generic + "'canonical:"),
                          ("canonical:" + "1" * 5000, generic + r"'canonical:1+'\.\.\.$"),
                          ("canonical:0768", r"split_kv must be written 'canonical:768', got 'canonical:0768'")):
        with pytest.raises(RlkInputError, match=pattern):
            rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv=text)
    # a backend that lacks a policy says so as an input error
    with pytest.raises(RlkInputError, match=r"split_kv 'fixed:4' is not implemented by the cpu backend"):
        rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="fixed:4")


def test_chunk_wider_than_the_table_decodes_without_padding_to_c():
    """canonical:C with C far past the table's capacity: one chunk, whose pair table is the
    page table itself (not C / page_size columns), and the single-pass bits where the
    policy's one state is merged (decode rows equal under the two largest C)."""
    from rlk_ops.kernels.cpu.canonical import decode_pairs

    q, kc, vc, table, lens = _paged()
    pair_table, pair_lens, n = decode_pairs(table, lens, 4, 1 << 20)
    assert n == 1 and torch.equal(pair_table, table) and torch.equal(pair_lens, lens)
    big = rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="canonical:1048576")
    small = rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="canonical:128")
    assert all(torch.equal(a, b) for a, b in zip(big, small))  # 9 keys: one chunk under either C


@pytest.mark.parametrize("name,call,pattern", CASES, ids=[c[0] for c in CASES])
def test_device_fast_path_rejects_the_same(name, call, pattern, monkeypatch):
    """On CUDA the value checks first test device-side masks with one sync; simulate
    that path on CPU tensors: bad input must still raise the detailed message."""
    from rlk_ops.ops import _validate as V

    monkeypatch.setattr(V, "on_device", lambda t: True)
    with pytest.raises(RlkInputError, match=pattern):
        call()


def test_device_fast_path_accepts_valid_input(monkeypatch):
    from rlk_ops.ops import _validate as V

    monkeypatch.setattr(V, "on_device", lambda t: True)
    q, kc, vc, table, lens = _paged(q_len=2)
    ref = rlk_ops.paged_attention(q, kc, vc, table, lens)
    kc2, vc2 = kc.clone(), vc.clone()
    rlk_ops.paged_kv_append(kc2, vc2, torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([-1, 7]))
    assert kc2.view(-1, 2, 8)[7].eq(1).all()
    rlk_ops.rope(torch.randn(3, 2, 8), torch.tensor([0, 5, 9]))
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    rlk_ops.attention(torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8), cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert torch.equal(rlk_ops.paged_attention(q, kc, vc, table, lens)[0], ref[0])


def test_one_storage_for_k_and_v_cache_is_rejected():
    cache = torch.zeros(4, 4, 2, 8)
    before = cache.clone()
    with pytest.raises(RlkInputError, match="k_cache and v_cache must not overlap in memory"):
        rlk_ops.paged_kv_append(cache, cache, torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0), torch.tensor([3]))
    assert torch.equal(cache, before)
    # overlapping views of one buffer (not the same tensor object)
    buf = torch.zeros(6, 4, 2, 8)
    with pytest.raises(RlkInputError, match="k_cache and v_cache must not overlap in memory"):
        rlk_ops.paged_kv_append(buf[:4], buf[2:], torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.tensor([3]))
    assert not buf.any()


def test_rows_read_from_the_cache_itself_are_refused():
    """k (or v) a view of the cache the append writes: whether a row is read before or after
    it is overwritten would decide the result, so the append refuses it, cache untouched."""
    k_cache, v_cache = _cache()
    before = (k_cache.clone(), v_cache.clone())
    rows = k_cache.view(-1, 2, 8)[:2]
    with pytest.raises(RlkInputError, match=r"k must not overlap k_cache in memory .* k.clone\(\)"):
        rlk_ops.paged_kv_append(k_cache, v_cache, rows, torch.ones(2, 2, 8), torch.tensor([1, 2]))
    with pytest.raises(RlkInputError, match=r"v must not overlap k_cache in memory"):
        rlk_ops.paged_kv_append(k_cache, v_cache, torch.ones(2, 2, 8), rows, torch.tensor([1, 2]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    rlk_ops.paged_kv_append(k_cache, v_cache, rows.clone(), torch.ones(2, 2, 8), torch.tensor([1, 2]))  # a copy: fine
    assert torch.equal(k_cache.view(-1, 2, 8)[1:3], before[0].view(-1, 2, 8)[:2])


def test_k_and_v_halves_of_one_buffer_are_separate_caches():
    """kv [2, num_pages, page_size, H, D] with k_cache = kv[0], v_cache = kv[1]: the halves do
    not overlap, so the append writes each (session 25: the one-storage check refused them)."""
    kv = torch.zeros(2, 4, 4, 2, 8)
    rlk_ops.paged_kv_append(kv[0], kv[1], torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0), torch.tensor([5]))
    assert torch.equal(kv[0].view(-1, 2, 8)[5], torch.ones(2, 8))
    assert torch.equal(kv[1].view(-1, 2, 8)[5], torch.full((2, 8), 2.0))
    assert int(kv.ne(0).sum()) == 2 * 2 * 8  # nothing else written
    k, v = rlk_ops.paged_kv_gather(kv[0], kv[1], torch.tensor([[1]], dtype=torch.int32),
                                   torch.tensor([2], dtype=torch.int32))
    assert torch.equal(k[0, 1], torch.ones(2, 8)) and torch.equal(v[0, 1], torch.full((2, 8), 2.0))


def test_k_and_v_halves_under_torch_compile():
    """The same halves through torch.compile(fullgraph=True): the functionalized append
    writes both views of the one base, as eager does."""
    def step(kv, k, v, slots, table, lens):
        rlk_ops.paged_kv_append(kv[0], kv[1], k, v, slots)
        return rlk_ops.paged_kv_gather(kv[0], kv[1], table, lens)

    kv, kv_eager = torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8)
    args = (torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0), torch.tensor([5]), torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32))
    got = torch.compile(step, fullgraph=True)(kv, *args)
    want = step(kv_eager, *args)
    assert torch.equal(kv, kv_eager) and int(kv.ne(0).sum()) == 2 * 2 * 8
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_append_to_a_cache_that_cannot_be_written_leaves_both_untouched(which):
    """A cache that requires grad, or an inference tensor outside inference mode, cannot be
    written in place: the append raises before writing either cache (it once wrote K, then
    failed on V)."""
    for make in ("requires_grad", "inference"):
        k_cache, v_cache = _cache()
        if make == "inference":
            with torch.inference_mode():
                bad = torch.randn(8, 4, 2, 8)
        else:
            bad = torch.randn(8, 4, 2, 8).requires_grad_()
        if which == "k_cache":
            k_cache = bad
        else:
            v_cache = bad
        before = (k_cache.detach().clone(), v_cache.detach().clone())
        pattern = "must not require grad" if make == "requires_grad" else "is an inference tensor"
        with pytest.raises(RlkInputError, match=f"{which} {pattern}"):
            rlk_ops.paged_kv_append(k_cache, v_cache, torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([0, 5]))
        assert torch.equal(k_cache.detach(), before[0]) and torch.equal(v_cache.detach(), before[1])


def test_linear_with_no_input_features_is_the_bias():
    """K = 0: an empty sum, so y = bias (or 0), as torch.nn.functional.linear; its gradients
    are empty (dx, dw) and the bias gradient the row count."""
    x = torch.randn(3, 0, requires_grad=True)
    w = torch.randn(4, 0, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    y = rlk_ops.linear(x, w, b)
    assert torch.equal(y, b.detach().expand(3, 4))
    assert torch.equal(rlk_ops.linear(x, w), torch.zeros(3, 4))
    y.sum().backward()
    assert x.grad.shape == (3, 0) and w.grad.shape == (4, 0) and torch.equal(b.grad, torch.full((4,), 3.0))


def test_use_backend_names_an_unknown_op():
    with pytest.raises(ValueError, match=r"use_backend: unknown op 'paged_atention'; known: \["):
        with rlk_ops.use_backend(paged_atention="flashinfer"):
            pass


def test_collectives_name_a_bad_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RlkInputError, match=r"group must be a torch.distributed ProcessGroup or None .*got str 'x'"):
        rlk_ops.reduce_scatter(torch.zeros(2), 0, group="x")


def test_zero_width_page_table_is_rejected():
    q, kc, vc, _, _ = _paged()
    with pytest.raises(RlkInputError, match=r"page_table must have at least one page column, got shape \[1, 0\]"):
        rlk_ops.paged_attention(q[:, :0], kc, vc, torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


def test_value_checks_off_keeps_checking_cpu_inputs_and_restores():
    """rlk_ops.value_checks(False) turns off the CUDA value checks only: CPU inputs are always
    checked (no sync to save). The previous setting comes back, also after an exception."""
    from rlk_ops.ops import _validate as V

    before = V.VALUE_CHECKS
    with pytest.raises(RlkInputError, match=r"page_table\[0, 1\] = 99 is out of range for 8 pages"):
        with rlk_ops.value_checks(False):
            assert V.VALUE_CHECKS is False
            rlk_ops.paged_attention(*_paged(table=((3, 99, 0),)))
    assert V.VALUE_CHECKS == before
    with rlk_ops.value_checks(True):
        assert V.VALUE_CHECKS is True
    assert V.VALUE_CHECKS == before


def test_value_checks_during_cuda_graph_capture_raise_a_clear_error(monkeypatch):
    """A value check on a CUDA tensor needs a host sync, which CUDA graph capture forbids:
    it raises ValueChecksInCapture naming the op and the way out, rather than skipping the
    check or failing inside the capture. Off (value_checks(False)) it is skipped, as asked.
    Simulated here (no GPU): a stand-in with a CUDA device and a capturing stream;
    tests/test_canonical_cuda.py captures a real graph."""
    import types

    from rlk_ops.ops import _validate as V

    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with rlk_ops.value_checks(True):
        with pytest.raises(rlk_ops.ValueChecksInCapture,
                           match=r"rlk::paged_attention: value checks .* CUDA graph capture forbids.*"
                                 r"rlk_ops\.value_checks\(False\)"):
            V.value_checks_enabled(on_cuda, "paged_attention")
        # a caller's own name is not an op's: TinyQwen3's token check read "rlk::TinyQwen3.forward_paged"
        with pytest.raises(rlk_ops.ValueChecksInCapture, match=r"^TinyQwen3.forward_paged: value checks"):
            V.value_checks_enabled(on_cuda, "TinyQwen3.forward_paged")
        assert V.value_checks_enabled(torch.zeros(1), "paged_attention") is True  # CPU: checked, no sync
    with rlk_ops.value_checks(False):
        assert V.value_checks_enabled(on_cuda, "paged_attention") is False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with rlk_ops.value_checks(True):
        assert V.value_checks_enabled(on_cuda, "paged_attention") is True


_X = torch.randn(2, 3, 2, 8)


@pytest.mark.parametrize("call,pattern", [
    (lambda: rlk_ops.qk_rmsnorm(_X, torch.ones(8), "a"), r"qk_rmsnorm: eps must be a float, got str 'a'"),
    (lambda: rlk_ops.qk_rmsnorm(_X, torch.ones(8), None), r"qk_rmsnorm: eps must be a float, got NoneType None"),
    (lambda: rlk_ops.qk_rmsnorm([1.0], torch.ones(8)), r"qk_rmsnorm: x must be a torch.Tensor, got list \[1.0\]"),
    (lambda: rlk_ops.rope(_X, torch.zeros(2, 3, dtype=torch.int64), 1e6, 4.0),
     r"rope: rotary_dim must be an int, got float 4.0"),
    (lambda: rlk_ops.rope(_X, torch.zeros(2, 3, dtype=torch.int64), "1e6"), r"rope: theta must be a float, got str"),
    (lambda: rlk_ops.rope(_X, [0, 1]), r"rope: positions must be a torch.Tensor, got list \[0, 1\]"),
    (lambda: rlk_ops.qk_norm_rope(_X, _X, torch.ones(8), torch.ones(8), torch.zeros(2, 3, dtype=torch.int64),
                                  rotary_dim=True), r"qk_norm_rope: rotary_dim must be an int, got bool True"),
    (lambda: rlk_ops.attention(1.0, _X, _X), r"attention_fwd: q must be a torch.Tensor, got float 1.0"),
    (lambda: rlk_ops.attention(_X, _X, _X, max_seqlen_q=3.0), r"max_seqlen_q must be an int, got float 3.0"),
    (lambda: rlk_ops.attention(_X, _X, _X, max_seqlen_k=2 ** 70), r"max_seqlen_k must fit in int64, got 1180591"),
    # any non-empty string once ran causal
    (lambda: rlk_ops.attention(_X, _X, _X, causal="no"), r"attention_fwd: causal must be a bool, got str 'no'"),
    (lambda: rlk_ops.attention(_X[0], _X[0], _X[0], cu_seqlens_q=[0, 3], cu_seqlens_k=[0, 3]),
     r"cu_seqlens_q must be a torch.Tensor or None, got list"),
    (lambda: rlk_ops.linear(torch.randn(2, 3), torch.randn(4, 3), 1.0),
     r"linear: bias must be a torch.Tensor or None, got float 1.0"),
    (lambda: rlk_ops.merge_attn_states(None, torch.zeros(1)), r"merge_attn_states: out_parts must be a torch.Tensor"),
    (lambda: rlk_ops.paged_attention(_X, *_paged()[1:4], [9]), r"paged_attention: seq_lens must be a torch.Tensor"),
    (lambda: rlk_ops.paged_kv_append(*_cache(), torch.ones(1, 2, 8), torch.ones(1, 2, 8), 3),
     r"paged_kv_append: slot_mapping must be a torch.Tensor, got int 3"),
    (lambda: rlk_ops.paged_kv_gather(*_cache(), None, torch.ones(1, dtype=torch.int32)),
     r"paged_kv_gather: page_table must be a torch.Tensor, got NoneType"),
    (lambda: rlk_ops.all_gather(_X, 1.0), r"all_gather: dim must be an int, got float 1.0"),
    # an OverflowError and Tensor.item()'s RuntimeError on a meta tensor (session 32 audit)
    (lambda: rlk_ops.rope(_X, torch.zeros(2, 3, dtype=torch.int64), 10 ** 400),
     r"rope: theta must be a float, got int 1000.*, too large for a float"),
    (lambda: rlk_ops.rope(_X, torch.zeros(2, 3, dtype=torch.int64), 1e4, torch.tensor(4, device="meta")),
     r"rope: rotary_dim must be an int, got a meta Tensor \(it has no value\)"),
    (lambda: rlk_ops.qk_rmsnorm(_X, torch.ones(8), torch.tensor(1e-6, device="meta")),
     r"qk_rmsnorm: eps must be a float, got a meta Tensor \(it has no value\)"),
    (lambda: rlk_ops.attention(_X, _X, _X, softmax_scale=torch.tensor(0.1, device="meta")),
     r"attention_fwd: softmax_scale must be a float or None, got a meta Tensor"),
    # a sparse tensor reached the dispatcher: "Could not run 'rlk::linear' ... 'SparseCPU' backend"
    (lambda: rlk_ops.linear(torch.randn(3, 8).to_sparse(), torch.randn(4, 8)),
     r"linear: x must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    (lambda: rlk_ops.reduce_scatter(_X, "1"), r"reduce_scatter: dim must be an int, got str '1'"),
])
def test_public_arguments_of_the_wrong_type_are_named(call, pattern):
    """Python arguments of the wrong type: once float("a")'s ValueError, the op schema's
    "Expected a value of type 'int'", or an AttributeError from inside a check."""
    with pytest.raises(RlkInputError, match=pattern):
        call()


def test_public_arguments_take_numpy_scalars():
    np = pytest.importorskip("numpy")
    x, pos = torch.randn(3, 2, 8), torch.arange(3)
    assert torch.equal(rlk_ops.rope(x, pos, np.float64(1e4), np.int64(8)), rlk_ops.rope(x, pos, 1e4, 8))
    q = torch.randn(1, 3, 2, 8)
    assert torch.equal(rlk_ops.attention(q, q, q, causal=np.bool_(False))[0], rlk_ops.attention(q, q, q, causal=False)[0])
    # 0-d tensors, which float() / bool() took before the argument checks
    assert torch.equal(rlk_ops.rope(x, pos, torch.tensor(1e4)), rlk_ops.rope(x, pos, 1e4))
    assert torch.equal(rlk_ops.attention(q, q, q, causal=torch.tensor(False))[0],
                       rlk_ops.attention(q, q, q, causal=False)[0])
    with pytest.raises(RlkInputError, match=r"causal must be a bool, got int64 np.int64\(2\)"):
        rlk_ops.attention(q, q, q, causal=np.int64(2))
    # under torch.compile a numpy scalar arrives as an array (a numbers.Real test once refused it)
    compiled = torch.compile(lambda a, p: rlk_ops.rope(a, p, np.float64(1e4), 8), fullgraph=True)
    assert torch.equal(compiled(x, pos), rlk_ops.rope(x, pos, 1e4, 8))


def test_append_of_rows_that_require_grad_is_refused_before_writing():
    """k or v requiring grad: the append once wrote K and then failed on V (a cache view taken
    under no_grad), or wrote both and left the cache requiring grad, so that every later append
    was refused. Under torch.no_grad the same rows are written, and the cache records nothing."""
    kv = torch.zeros(2, 8, 4, 2, 8)
    k_cache, v_cache = kv.unbind(0)
    rows = torch.ones(2, 2, 8, requires_grad=True)
    for k, v, name in ((rows, torch.ones(2, 2, 8), "k"), (torch.ones(2, 2, 8), rows, "v")):
        with pytest.raises(RlkInputError, match=rf"paged_kv_append: {name} must not require grad: .*{name}.detach\(\)"):
            rlk_ops.paged_kv_append(k_cache, v_cache, k, v, torch.tensor([0, 1]))
        assert not kv.any() and not kv.requires_grad
    with torch.no_grad():
        rlk_ops.paged_kv_append(k_cache, v_cache, rows, rows * 2, torch.tensor([0, 1]))
    assert int(kv[0].sum()) == 32 and int(kv[1].sum()) == 64 and not k_cache.requires_grad
    rlk_ops.paged_kv_append(k_cache, v_cache, torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.tensor([2]))
    assert int(kv[0].sum()) == 48


def test_caches_that_share_memory_through_two_storages_are_refused():
    """Two storages over one buffer (torch.from_numpy of overlapping numpy views): the overlap
    check once compared storage objects and let V rows overwrite K rows."""
    np = pytest.importorskip("numpy")
    buf = np.zeros((12, 4, 2, 8), np.float32)
    k_cache, v_cache = torch.from_numpy(buf[:8]), torch.from_numpy(buf[4:])
    with pytest.raises(RlkInputError, match="k_cache and v_cache must not overlap in memory"):
        rlk_ops.paged_kv_append(k_cache, v_cache, torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0), torch.tensor([16]))
    assert not buf.any()
    rows = torch.from_numpy(buf[:8].reshape(-1, 2, 8)[:1])  # k read from k_cache's memory
    with pytest.raises(RlkInputError, match="k must not overlap k_cache in memory"):
        rlk_ops.paged_kv_append(k_cache, torch.zeros(8, 4, 2, 8), rows, torch.ones(1, 2, 8), torch.tensor([5]))


def test_float64_inputs_keep_the_double_scale():
    """The float32 rule is for the dtypes the kernels scale in float32; float64 inputs scale in float64:
    with q . k ~ 1e50, a scale of 1e-50 (0 in float32) gives scores of order 1, not a uniform softmax."""
    q = torch.randn(1, 3, 2, 4, dtype=torch.float64) * 1e25
    out, lse = rlk_ops.attention(q, q, q, softmax_scale=1e-50)
    uniform, _ = rlk_ops.attention(q, q, q, softmax_scale=0.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and not torch.equal(out, uniform)
    out, _ = rlk_ops.attention(q.float() / 1e25, q.float() / 1e25, q.float() / 1e25, softmax_scale=0.0)
    assert torch.isfinite(out).all()   # 0 stays allowed


def test_an_int_past_4300_digits_is_named_not_printed():
    """Python refuses to print an int of more than 4300 digits: the error for such an argument raised
    that ValueError instead of the op's (a session 33 review); it is now written as a power of two."""
    from rlk_ops.distributed import build_layout, context_parallel_attention
    from rlk_ops.distributed.checks import DistributedInputError
    from rlk_ops.rollout.engine import Sampler

    x = torch.randn(4, 2, 8)
    with pytest.raises(RlkInputError, match=r"rlk::qk_rmsnorm: eps must be a float, got int ~2\*\*16609, too large"):
        rlk_ops.qk_rmsnorm(x, torch.ones(8), 10 ** 5000)
    with pytest.raises(RlkInputError, match=r"rlk::rope: rotary_dim must fit in int64, got -~2\*\*16609"):
        rlk_ops.rope(x, torch.arange(4), 1e4, -10 ** 5000)
    for t, got in ((10 ** 400, "1000000000"), (10 ** 5000, "~2**16609")):
        with pytest.raises(ValueError, match=r"Sampler temperature must be a finite number > 0, got " + re.escape(got)):
            Sampler(temperature=t)
    lay = build_layout([0, 24], 1, 0)
    q, kv = torch.randn(24, 4, 16), torch.randn(24, 2, 16)
    with pytest.raises(DistributedInputError, match=r"softmax_scale must be a finite float or None, got int ~2\*\*16609"):
        context_parallel_attention(q, kv, kv, lay, softmax_scale=10 ** 5000)


# ------------------------------------------- a session 39 mutation audit: bounds no test pinned down
def test_int_arg_refuses_two_to_the_63():
    q = torch.randn(3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(RlkInputError, match=r"max_seqlen_q must fit in int64"):
        rlk_ops.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2 ** 63)


def test_rope_takes_the_largest_position_and_refuses_one_past_it():
    from rlk_ops.ops.rope import MAX_POSITION

    x = torch.randn(2, 1, 8)
    rlk_ops.rope(x, torch.tensor([0, MAX_POSITION]), 1e6)
    with pytest.raises(RlkInputError, match=r"positions\[1\] = .* exceeds the largest supported position"):
        rlk_ops.rope(x, torch.tensor([0, MAX_POSITION + 1]), 1e6)


def test_append_refuses_the_last_cached_token_of_a_row_sharing_the_page():
    """Rows 0 and 1 both hold page 0; row 1 has cached tokens 0 and 1 (seq_lens 3, one new token). Row 0's
    new token 1 going to slot 1 would overwrite row 1's last cached token."""
    kc, vc = torch.zeros(4, 4, 1, 2), torch.zeros(4, 4, 1, 2)
    table = torch.tensor([[0], [0]], dtype=torch.int32)
    lens = torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(RlkInputError, match=r"slot_mapping\[0\] = 1 \(page 0, offset 1\) holds token 1 of "
                                            r"sequence 1"):
        rlk_ops.paged_kv_append(kc, vc, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([1, 2]), table, lens)
    assert not kc.any() and not vc.any()


def test_attention_op_refuses_causal_other_than_0_or_1():
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(RlkInputError, match=r"causal must be 0 or 1, got 2"):
        torch.ops.rlk.attention_fwd(q, q, q, 2, 0.5, None, None, 0, 0, "disabled")


def test_causal_attention_refuses_one_more_query_than_keys():
    q, k = torch.randn(1, 3, 1, 8), torch.randn(1, 2, 1, 8)
    with pytest.raises(RlkInputError, match=r"q has 3 queries, k has 2 keys"):
        rlk_ops.attention(q, k, k, causal=True)


def test_backward_ops_check_their_own_arguments():
    """Called directly (not through autograd), the backward ops validate what the forward would."""
    x, w = torch.randn(2, 1, 8), torch.ones(8)
    with pytest.raises(RlkInputError, match=r"dy must have x's shape"):
        torch.ops.rlk.qk_rmsnorm_bwd(torch.randn(1, 1, 8), x, w, 1e-6)
    with pytest.raises(RlkInputError, match=r"positions\[1\] = -1 is negative"):
        torch.ops.rlk.rope_bwd(x, torch.tensor([0, -1]), 1e6, 8)


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def test_linear_and_its_backward_ops_name_dtype_and_shape():
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(RlkInputError, match=r"rlk::linear: bias must have the dtype of x \(torch.float32\)"):
        rlk_ops.linear(x, w, torch.randn(4).bfloat16())
    with pytest.raises(RlkInputError, match=r"rlk::linear_bwd: dy must have the dtype of x \(torch.float32\)"):
        torch.ops.rlk.linear_bwd(torch.randn(3, 4).bfloat16(), x, w)
    with pytest.raises(RlkInputError, match=r"rlk::linear_bwd: dy must have shape \[3, 4\], got \[4, 3\]"):
        torch.ops.rlk.linear_bwd(torch.randn(4, 3), x, w)
    with pytest.raises(RlkInputError, match=r"rlk::linear_bias_bwd: dy must be \[..., out_features\], got shape \[\]"):
        torch.ops.rlk.linear_bias_bwd(torch.tensor(1.0))


def test_contract_fields_resolve_the_default_scale_and_canonical_needs_128():
    from rlk_ops.meta.contract import AttentionContract, SplitKVPolicy
    assert AttentionContract(head_dim=64).fields()["softmax_scale"] == 0.125
    for c in (64, 192, 320):
        with pytest.raises(ValueError, match=rf"canonical:C needs C a positive multiple of 128, got {c}"):
            SplitKVPolicy.parse(f"canonical:{c}")
