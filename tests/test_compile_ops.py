"""Each op under torch.compile(fullgraph=True) (Inductor, CPU): no graph break, and
compiled == eager bitwise, forward and backward."""
import pytest
import torch

import rlk_ops

from conftest import bitwise_equal


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor")


def test_norm_rope_linear_compiled_fwd_bwd():
    x = torch.randn(9, 40, requires_grad=True)
    w = torch.randn(3 * 16, 40, requires_grad=True)
    nw = torch.randn(16, requires_grad=True)
    pos = torch.arange(9) * 3

    def fn(x, w, nw):
        h = rlk_ops.linear(x, w).view(9, 3, 16)
        h = rlk_ops.qk_rmsnorm(h, nw, 1e-6)
        h = rlk_ops.rope(h, pos, 1e6)
        return h

    eager = fn(x, w, nw)
    ge = torch.autograd.grad(eager.square().sum(), (x, w, nw))
    compiled = _compile(fn)(x, w, nw)
    gc = torch.autograd.grad(compiled.square().sum(), (x, w, nw))
    assert bitwise_equal(compiled, eager)
    assert all(bitwise_equal(a, b) for a, b in zip(gc, ge))


@pytest.mark.parametrize("varlen", [False, True])
def test_attention_compiled_fwd_bwd(varlen):
    if varlen:
        q, k, v = (torch.randn(12, h, 16, requires_grad=True) for h in (4, 2, 2))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    else:
        q, k, v = (torch.randn(2, 12, h, 16, requires_grad=True) for h in (4, 2, 2))
        kw = {}

    def fn(q, k, v):
        out, lse = rlk_ops.attention(q, k, v, **kw)
        return out, lse, out.float().square().sum() + lse.sum()

    eager, compiled = fn(q, k, v), _compile(fn)(q, k, v)
    assert bitwise_equal(compiled[0], eager[0]) and bitwise_equal(compiled[1], eager[1])   # out, lse
    ge = torch.autograd.grad(eager[2], (q, k, v))
    gc = torch.autograd.grad(compiled[2], (q, k, v))
    assert all(bitwise_equal(a, b) for a, b in zip(gc, ge))


def test_paged_path_compiled():
    k_cache = torch.zeros(8, 4, 2, 16)
    v_cache = torch.zeros(8, 4, 2, 16)
    page_table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    k, v, q = torch.randn(10, 2, 16), torch.randn(10, 2, 16), torch.randn(1, 10, 4, 16)
    slots = (page_table[0].long()[:, None] * 4 + torch.arange(4)).flatten()[:10]
    seq_lens = torch.tensor([10], dtype=torch.int32)

    def fn(k_cache, v_cache):
        rlk_ops.paged_kv_append(k_cache, v_cache, k, v, slots)
        return rlk_ops.paged_attention(q, k_cache, v_cache, page_table, seq_lens)

    kc_e, vc_e = k_cache.clone(), v_cache.clone()
    eager = fn(kc_e, vc_e)
    compiled = _compile(fn)(k_cache, v_cache)
    assert bitwise_equal(k_cache, kc_e) and bitwise_equal(v_cache, vc_e)  # the mutation happened
    assert bitwise_equal(compiled[0], eager[0]) and bitwise_equal(compiled[1], eager[1])
    gk, _ = rlk_ops.paged_kv_gather(k_cache, v_cache, page_table, seq_lens)
    assert bitwise_equal(gk[0, :10], k)
