"""rlk_model::embedding (``rollout/glue.py``) and ``RlkEmbedding`` (``rollout/model.py``): the gather, and a
backward that sums each id's rows in fp32 in position order and rounds once, the same kernel eagerly and
under torch.compile; padding_idx as nn.Embedding's; the deterministic mode it sets is its own; bad input
named."""
import pytest
import torch
from torch import nn

from rlk_ops.ops._validate import RlkInputError
from rlk_ops.rollout.model import RlkEmbedding

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])


def _case(device="cpu", vocab=11, dim=24, shape=(5, 37), seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=g).to(dtype).to(device)
    ids = torch.randint(0, vocab, shape, generator=g).to(device)   # 185 ids over 11 rows: many repeats
    dout = torch.randn(*shape, dim, generator=g).to(dtype).to(device)
    return weight, ids, dout


def _sequential(dout, ids, vocab, padding_idx=-1):
    """The definition: each id's rows added in fp32 in ascending position order, rounded once."""
    acc = torch.zeros(vocab, dout.shape[-1], dtype=torch.float32)
    for row, i in zip(dout.reshape(-1, dout.shape[-1]).float().cpu(), ids.reshape(-1).tolist()):
        acc[i] += row
    if padding_idx >= 0:
        acc[padding_idx] = 0
    return acc.to(dout.dtype)


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_forward_is_the_gather_and_backward_the_ordered_fp32_sum(padding_idx):
    weight, ids, dout = _case()
    emb = RlkEmbedding(11, 24, padding_idx=padding_idx, dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.copy_(weight)
    out = emb(ids)
    assert torch.equal(out, weight[ids])
    out.backward(dout)
    want = _sequential(dout, ids, 11, -1 if padding_idx is None else padding_idx)
    assert torch.equal(emb.weight.grad, want)
    ref = nn.Embedding(11, 24, padding_idx=padding_idx).double()   # torch's own, in float64
    with torch.no_grad():
        ref.weight.copy_(weight.double())
    ref(ids).backward(dout.double())
    assert torch.allclose(emb.weight.grad.double(), ref.weight.grad, rtol=1e-2, atol=1e-2)
    if padding_idx is not None:
        assert not emb.weight.grad[padding_idx].any()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_backward_is_bitwise_run_to_run(device):
    weight, ids, dout = _case(device, vocab=7, shape=(4096,))   # ~585 rows per id
    weight.requires_grad_(True)
    grads = []
    for _ in range(3):
        weight.grad = None
        torch.ops.rlk_model.embedding(weight, ids, -1).backward(dout)
        grads.append(weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    assert torch.allclose(grads[0].float().cpu(), _sequential(dout, ids, 7).float(), rtol=2e-2, atol=1e-1)


def test_the_deterministic_mode_it_sets_is_restored():
    weight, ids, dout = _case()
    weight.requires_grad_(True)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.ops.rlk_model.embedding(weight, ids, -1).backward(dout)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.ops.rlk_model.embedding(weight, ids, -1).backward(dout)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_compiled_is_eager_forward_and_backward():
    weight, ids, dout = _case()

    def f(w):
        return torch.ops.rlk_model.embedding(w, ids, 2) * 2   # (a doubling: exact in both directions)

    out = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        w = weight.clone().requires_grad_(True)
        val = fn(w)
        val.backward(dout)
        out.append((val.detach(), w.grad))
    torch._dynamo.reset()
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_ops_pass_opcheck():
    weight, ids, dout = _case(shape=(3, 5))
    torch.library.opcheck(torch.ops.rlk_model.embedding, (weight.requires_grad_(True), ids, 4))
    torch.library.opcheck(torch.ops.rlk_model.embedding_bwd, (dout, ids, 11, -1))


def test_sharing_shares_the_weight_and_settings():
    base = nn.Embedding(9, 4, padding_idx=1)
    emb = RlkEmbedding.sharing(base)
    assert emb.weight is base.weight and emb.padding_idx == 1 and (emb.num_embeddings, emb.embedding_dim) == (9, 4)
    for name, value in (("max_norm", 1.0), ("scale_grad_by_freq", True), ("sparse", True)):
        odd = nn.Embedding(9, 4, **{name: value})
        with pytest.raises(RlkInputError, match=rf"RlkEmbedding.sharing: {name} must be .*, got {value}"):
            RlkEmbedding.sharing(odd)
        direct = RlkEmbedding(9, 4, **{name: value})
        with pytest.raises(RlkInputError, match=rf"RlkEmbedding: {name} must be"):
            direct(torch.tensor([1]))


@pytest.mark.parametrize("call, fragment", [
    (lambda w, i, d: torch.ops.rlk_model.embedding(w, torch.tensor([0, 11]), -1),
     "ids[1] = 11 is not a token id; token ids must be in [0, 11) (the embedding's rows)"),
    (lambda w, i, d: torch.ops.rlk_model.embedding(w, torch.tensor([[0, 1], [-2, 3]]), -1),
     "ids[1, 0] = -2 is not a token id"),
    (lambda w, i, d: torch.ops.rlk_model.embedding(w, i.float(), -1), "ids must be int64 or int32 token ids, got "
                                                                      "torch.float32"),
    (lambda w, i, d: torch.ops.rlk_model.embedding(w[0], i, -1), "weight must be a floating tensor "
                                                                 "[num_embeddings, dim], got torch.bfloat16 [24]"),
    (lambda w, i, d: torch.ops.rlk_model.embedding(w, i, 11), "padding_idx must be -1 (none) or in [0, 11), got 11"),
    (lambda w, i, d: torch.ops.rlk_model.embedding_bwd(d[:, :3], i, 11, -1),
     "dout must be a floating tensor [*ids.shape, dim] = [5, 37, dim], got torch.bfloat16 [5, 3, 24]"),
    (lambda w, i, d: torch.ops.rlk_model.embedding_bwd(d, i, 11, 11),
     "num_weights must be >= 1 and padding_idx -1 (none) or in [0, num_weights), got num_weights 11, padding_idx 11"),
    (lambda w, i, d: torch.ops.rlk_model.embedding_bwd(d, i.float(), 11, -1),
     "ids must be int64 or int32 token ids on dout's device cpu, got torch.float32 on cpu"),
])
def test_bad_input_is_named(call, fragment):
    weight, ids, dout = _case()
    with pytest.raises(ValueError) as e:
        call(weight, ids, dout)
    assert fragment in str(e.value)
