"""rlk_ops.compile.hf: a transformers Qwen3 model with every self_attn replaced by the rlk block.

Against transformers' own Qwen3 (float64, SDPA): logits and every parameter's gradient, one sequence per
row, packed padding-free (cu_seq_lens) and padded. The patched layers' training rows equal their own
rollout (chunked prefill + decode over a paged cache) bitwise, and a padded batch's rows each sequence's
alone; the model compiles with fullgraph=True, forward and backward, with the rlk ops in both graphs;
what the block does not compute is refused."""
import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

import rlk_ops  # noqa: E402
from rlk_ops.compile.hf import HFQwen3Attention, attention_config, patch_qwen3  # noqa: E402
from rlk_ops.ops._validate import RlkInputError  # noqa: E402
from rlk_ops.rollout.cache import PagedKVCache  # noqa: E402

VOCAB = 96
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA GPU")])
# head_dim 128 on CUDA: FA4's SM90 tiles
CUDA_SIZES = dict(hidden_size=256, head_dim=128)


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=5000.0,
                rms_norm_eps=1e-5, attn_implementation="sdpa")
    base.update(kw)
    rope_theta = base.pop("rope_theta")
    cfg = transformers.Qwen3Config(**base)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return cfg


def _cast(model, dtype, device):
    """``model.to(dtype, device)`` with HF's RoPE frequencies kept in float32, as ``from_pretrained(dtype=...)``
    leaves them: ``.to(torch.bfloat16)`` also rounds the ``inv_freq`` buffer, and over 200 positions (theta
    5000, head_dim 128) HF's rotated q then had elements off by up to 1.09 against float64, so HF's bf16
    model was no fair reference (the rlk block computes its frequencies from theta)."""
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.float().clone()
    model.to(dtype=dtype, device=device)
    rotary.inv_freq = inv_freq.to(device)
    rotary.original_inv_freq = inv_freq.clone().to(device)
    return model


def _models(dtype=torch.float64, device="cpu", **kw):
    """(HF's model, the same weights patched). Norm weights moved off 1 and biases (if any) off 0, so a
    norm or bias that went missing shows."""
    torch.manual_seed(0)
    ref = _cast(transformers.Qwen3ForCausalLM(_config(**kw)), dtype, device)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    patched = _cast(transformers.Qwen3ForCausalLM(copy.deepcopy(ref.config)), dtype, device)  # (own config: the
    patched.load_state_dict(ref.state_dict())                                                # patch changes it)
    return ref, patch_qwen3(patched)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _assert_model_matches(ref, patched, ids, logits_tol, grad_tol):
    """Every attention replaced; logits, then every parameter's gradient of the LM loss, within the
    tolerances of HF's (relative to each tensor's largest value)."""
    assert all(type(layer.self_attn) is HFQwen3Attention for layer in patched.model.layers)
    want = ref(ids, labels=ids, use_cache=False)
    got = patched(ids, labels=ids)
    assert _rel(got.logits, want.logits) < logits_tol
    want.loss.backward()
    got.loss.backward()
    for (name, p_ref), (name2, p) in zip(ref.named_parameters(), patched.named_parameters()):
        assert name == name2
        if p_ref.grad is not None or p.grad is not None:   # (a Qwen3-MoE expert no token was routed to has none)
            assert _rel(p.grad, p_ref.grad) < grad_tol, name


@pytest.mark.parametrize("bias", [False, True])
def test_logits_and_gradients_match_transformers(bias):
    """float64: HF computes cos/sin from fp32 angles, as rlk::rope does, so the two agree to ~1e-7 (measured:
    logits 1.1-1.4e-7, gradients up to 4.3e-7 relative to each tensor's largest); a convention error
    (interleaved RoPE, norm order, theta, GQA grouping, a missing bias) is orders of magnitude more, and eps
    1e-6 in place of the config's 1e-5 fails it too."""
    ref, patched = _models(attention_bias=bias)
    _assert_model_matches(ref, patched, torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)),
                          1e-6, 1e-5)


def test_qwen3_moe_logits_and_gradients_match_transformers():
    """Qwen3-MoE's attention is Qwen3's: its Qwen3MoeAttention modules are replaced (the experts and router stay
    HF's) and the model matches transformers' own. In float32 (HF's experts take no float64): measured 3.0e-7
    on the logits and up to 1.1e-6 on the gradients, as the dense model in float32 (3.1e-7, 9.2e-7)."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, attn_implementation="sdpa")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    torch.manual_seed(0)
    ref = _cast(transformers.Qwen3MoeForCausalLM(cfg), torch.float32, "cpu")   # (its experts: no float64)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    patched = patch_qwen3(copy.deepcopy(ref))
    _assert_model_matches(ref, patched, torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(16)),
                          2e-6, 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_logits_and_gradients_match_transformers():
    """bf16 on CUDA (FA4 forward and deterministic backward, the Triton linear and norm/RoPE kernels) against
    transformers' own bf16 SDPA model, with HF's model in float64 on the CPU as the judge: the rlk model's
    logits and every gradient no further from it than twice HF's own bf16 error (plus 1e-3 of the tensor's
    largest value, for gradients HF gets almost exact)."""
    ref, patched = _models(torch.bfloat16, "cuda", **CUDA_SIZES)
    judge = _cast(copy.deepcopy(ref), torch.float64, "cpu")
    ids = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(11))
    outs = [m(i, labels=i, use_cache=False) for m, i in ((judge, ids), (ref, ids.cuda()), (patched, ids.cuda()))]
    for o in outs:
        o.loss.backward()
    exact, hf, rlk = (o.logits.double().cpu() for o in outs)
    assert _rel(rlk, exact) <= 2 * _rel(hf, exact)
    for (name, p_exact), p_hf, p_rlk in zip(judge.named_parameters(), ref.parameters(), patched.parameters()):
        err_hf, err_rlk = (_rel(p.grad.double().cpu(), p_exact.grad) for p in (p_hf, p_rlk))
        assert err_rlk <= 2 * err_hf + 1e-3, (name, err_rlk, err_hf)


def test_packed_sequences_match_transformers_per_sequence():
    """cu_seq_lens (padding-free packing, one row): each sequence's rows are HF's for that sequence alone
    (attention stays inside each sequence). No bitwise claim here: HF's MLP and norms are not rlk ops
    (float64 rows packed and alone differed in the last bits)."""
    ref, patched = _models()
    lens = [11, 1, 30]
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 11, 12, 42], dtype=torch.int32)
    packed = patched(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=30,
                     max_length_k=30).logits[0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = ref(ids[:, a:b], use_cache=False).logits[0]
        assert _rel(packed[a:b], alone) < 1e-6


def _attention_calls(model, ids, **kw):
    """(module, keyword arguments, output) of every patched layer's self_attn call in one no-grad forward."""
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, kw, out: seen.append((m, kw, out[0])),
                                                   with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(model.model.layers)
    return seen


def _padding():
    """Rows of 12: left padding, padding only, right padding, a gap (9, 0, 10 and 8 tokens: no two
    boundaries alike, so a packing in another row order shows)."""
    mask = torch.ones(4, 12, dtype=torch.int64)
    mask[0, :3] = 0
    mask[1] = 0
    mask[2, -2:] = 0
    mask[3, 4:8] = 0
    return mask, (mask.cumsum(1) - 1).clamp(min=0)   # positions as the rollout numbers the tokens


def test_padded_batch_matches_transformers():
    """Each row's unmasked tokens are one sequence (the keys HF's causal padding mask leaves each query):
    logits at the tokens and every gradient of a loss over the tokens' logits only match HF's padded SDPA
    model in float64 (padding positions differ: the block gives them zeros), and each row's tokens match
    HF on that sequence alone."""
    ref, patched = _models()
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(12))
    mask, pos = _padding()
    real = mask.bool()
    weights = torch.randn(int(real.sum()), VOCAB, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    want = ref(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    got = patched(ids, attention_mask=mask, position_ids=pos).logits
    assert _rel(got[real], want[real]) < 1e-6
    assert not got.isnan().any()   # (the padding-only row: zeros from the block, no 0/0)
    (want[real] * weights).sum().backward()
    (got[real] * weights).sum().backward()
    for (name, p_ref), p in zip(ref.named_parameters(), patched.parameters()):
        assert _rel(p.grad, p_ref.grad) < 1e-5, name
    for r in (0, 2, 3):
        alone = ref(ids[r:r + 1, real[r]], use_cache=False).logits[0]
        assert _rel(got[r][real[r]], alone) < 1e-6


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_padded_rows_are_bitwise_the_sequences_alone(device):
    """The block's rows in a padded batch are bitwise its rows for each sequence alone (batch invariance
    through the packing); padding positions get zeros."""
    _, model = _models(torch.bfloat16, device, **(CUDA_SIZES if device == "cuda" else {}))
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(13)).to(device)
    mask, pos = (t.to(device) for t in _padding())
    real = mask.bool()
    for attn, kw, out in _attention_calls(model, ids, attention_mask=mask, position_ids=pos):
        assert torch.equal(out[~real], torch.zeros_like(out[~real]))
        for r in (0, 2, 3):
            x, p = kw["hidden_states"][r][real[r]], pos[r][real[r]]
            with torch.no_grad():
                alone = attn.forward_train(x, p, torch.tensor([0, x.shape[0]], dtype=torch.int32, device=device))
            assert torch.equal(out[r][real[r]], alone)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_padded_batch_compiles_fullgraph_with_eagers_bits(device):
    """The padded path has static shapes (a stable sort per row, 2B packed sequences): it traces under
    torch.compile(fullgraph=True), and with the AOT eager backend (the traced ops as eager runs them) a padded
    batch gives eager's logits and gradients bitwise; a second mask of the same shape reuses the graph.
    (Inductor would recompile HF's own norms and MLP, which this patch leaves HF's, in other bits: measured
    on CPU; tests/test_hf_model.py runs Inductor on the model patched whole.)"""
    _, model = _models(torch.bfloat16, device, **(CUDA_SIZES if device == "cuda" else {}))
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(14)).to(device)
    mask, pos = (t.to(device) for t in _padding())
    weights = torch.randn(4, 12, VOCAB, generator=torch.Generator().manual_seed(17)).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    runs = []
    for m in (model, compiled):
        model.zero_grad(set_to_none=True)
        logits = m(ids, attention_mask=mask, position_ids=pos).logits
        (logits.float() * weights * mask[..., None]).sum().backward()
        runs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    other = mask.flip(1)   # right padding where there was left padding: new values, the same graph
    with torch.no_grad():
        assert torch.equal(compiled(ids, attention_mask=other, position_ids=pos).logits,
                           model(ids, attention_mask=other, position_ids=pos).logits)
    torch._dynamo.reset()


def test_parameters_are_shared_not_copied():
    """The patch keeps the layer's nn.Linear modules and norm Parameters: the parameter set, the
    state-dict keys and an optimizer built before the patch are unchanged, and a patched model's state
    dict loads into an unpatched one."""
    ref, _ = _models()
    model = copy.deepcopy(ref)   # (its config a copy too, shared by its submodules as in ref)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    patch_qwen3(model)
    assert not any(m.training for m in model.modules())   # the new modules take the model's mode
    model.train()
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    opt.step()
    attn = model.model.layers[1].self_attn
    assert not torch.equal(attn.k_norm.weight, ref.model.layers[1].self_attn.k_norm.weight)  # stepped in place
    fresh = transformers.Qwen3ForCausalLM(copy.deepcopy(ref.config)).to(torch.float64)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert _rel(fresh(ids, use_cache=False).logits, model(ids).logits) < 1e-6
    assert model.config._attn_implementation == "rlk"
    # the config's use_cache is the model's own (a saved checkpoint keeps it); a call that does not pass it runs
    # without HF's cache, the base model's too, and one that asks for the cache is refused
    assert model.config.use_cache is ref.config.use_cache is True
    assert model.model(ids).past_key_values is None
    with pytest.raises(RlkInputError, match="HF's KV cache is not supported"):
        model(ids, use_cache=True)


def test_activation_checkpointing_recomputes_the_same_bits():
    """HF's activation checkpointing runs each layer's forward again in the backward: the rlk block
    recomputes the same bits, so the gradients are bitwise those without checkpointing."""
    _, model = _models()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(10))
    model.train()
    model(ids, labels=ids).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.activation_checkpointing_enable({"use_reentrant": False})   # (transformers 5's name)
    assert model.model.gradient_checkpointing
    model(ids, labels=ids).loss.backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def _rollout_rows(attn, x, lens, prefill, page_size=4):
    """The block's rollout over one paged cache: each sequence's first ``prefill`` tokens as one chunk,
    then one token per step for all sequences together (continuous batching: a finished sequence leaves
    the batch). x: [sum(lens), hidden]. Returns the rows in x's order."""
    cfg = attn.config
    pages = sum(-(-n // page_size) for n in lens) + 3
    cache = PagedKVCache(1, pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=x.dtype, device=x.device, seed=5)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    out = torch.empty_like(x)

    def step(seqs, offsets, n):
        slots = cache.reserve_batch([(s, n) for s in seqs])
        rows = torch.stack([x[starts[s] + o:starts[s] + o + n] for s, o in zip(seqs, offsets)])
        positions = torch.tensor([[o + j for j in range(n)] for o in offsets], device=x.device)
        y = attn.forward_rollout(rows, positions, cache.k[0], cache.v[0], cache.page_table(seqs),
                                 cache.seq_lens(seqs), slots)
        for s, o, row in zip(seqs, offsets, y):
            out[starts[s] + o:starts[s] + o + n] = row
    for s in range(len(lens)):
        cache.add(s)
        step([s], [0], min(prefill, lens[s]))
    t = prefill
    while any(t < n for n in lens):
        live = [s for s, n in enumerate(lens) if t < n]
        step(live, [t] * len(live), 1)
        t += 1
    return out


@pytest.mark.parametrize("device, page_size, lens, prefill", [
    ("cpu", 4, [9, 14], 5),
    pytest.param(*CUDA.values, 16, [150, 301], 130, marks=CUDA.marks, id="cuda-page16"),
    pytest.param(*CUDA.values, 128, [150, 301], 130, marks=CUDA.marks, id="cuda-page128"),
])
def test_patched_layers_train_rows_equal_their_rollout_rows(device, page_size, lens, prefill):
    """The mission on an HF model: each patched layer's training forward (packed, bf16) and its rollout over
    a paged cache (chunked prefill, then batched decode) give the same bits, row for row. On CUDA: FA4's
    varlen forward against the routed decode (page 128: FA4's TMA path)."""
    _, model = _models(torch.bfloat16, device, **(CUDA_SIZES if device == "cuda" else {}))
    ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=torch.Generator().manual_seed(4)).to(device)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    for attn, kw, train_out in _attention_calls(model, ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu):
        x = kw["hidden_states"][0]
        with torch.inference_mode():
            roll = _rollout_rows(attn, x, lens, prefill, page_size)
        assert torch.equal(roll, train_out[0])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_compiles_fullgraph_forward_and_backward_with_rlk_ops_in_both_graphs(device):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = {}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compiler
    _, model = _models(torch.bfloat16, device, **(CUDA_SIZES if device == "cuda" else {}))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6)).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True,
                             backend=aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward")))
    out = compiled(ids, labels=ids)
    out.loss.backward()
    eager = model(ids, labels=ids)
    assert torch.equal(out.logits, eager.logits)   # (aot_eager: the same ops run, so the same bits)
    for op in ("rlk.linear.default", "rlk.qk_rmsnorm.default", "rlk.rope.default", "rlk.attention_fwd.default"):
        assert op in graphs["forward"], op
    for op in ("rlk.attention_bwd.default", "rlk.linear_bwd.default"):
        assert any(t.startswith(op.rsplit(".", 1)[0]) for t in graphs["backward"]), op
    if device == "cuda":   # (there the in-graph assert is a device-side assert, which ends the CUDA context)
        return
    # a row with a position reset is refused inside the compiled graph too (an in-graph assert)
    bad = torch.arange(12).repeat(2, 1)
    bad[1, 6:] = torch.arange(6)
    with pytest.raises(RuntimeError, match="value check failed"):
        compiled(ids, position_ids=bad)
    torch._dynamo.reset()


def _call(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw)


@pytest.mark.parametrize("kw, fragment", [
    (dict(use_cache=True), "HF's KV cache is not supported"),
    (dict(attention_mask=torch.ones(2, 1, 10, 10, dtype=torch.bool)), r"must be the 2-D padding mask \[B, S\] = \[2, 10\]"),
    (dict(position_ids=torch.tensor([list(range(5)) + list(range(5))] * 2)),
     r"position_ids\[0, 4:6\] = \[4, 0\]: packed sequences need cu_seq_lens_q"),
    (dict(cu_seq_lens_q=torch.tensor([0, 10, 20], dtype=torch.int32),
          cu_seq_lens_k=torch.tensor([0, 10, 20], dtype=torch.int32)), "hidden_states must have batch size 1, got 2"),
    (dict(output_attentions=True), "output_attentions=True"),
])
def test_what_the_block_does_not_compute_is_refused(kw, fragment):
    _, model = _models(torch.float32)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    with pytest.raises(RlkInputError, match=fragment):
        _call(model, ids, **kw)


def test_a_padding_mask_is_refused_with_packed_sequences():
    _, model = _models(torch.float32)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    with pytest.raises(RlkInputError, match="attention_mask and cu_seq_lens_q / cu_seq_lens_k together"):
        _call(model, torch.ones(1, 10, dtype=torch.int64), attention_mask=torch.tensor([[1] * 9 + [0]]),
              position_ids=torch.cat([torch.arange(5), torch.arange(5)])[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu)


@pytest.mark.parametrize("cu_k, fragment", [
    (None, "come together, as tensors"),
    (torch.tensor([0, 4, 10], dtype=torch.int32), r"must equal cu_seq_lens_q .* got \[0, 4, 10\] and \[0, 5, 10\]"),
    (torch.tensor([0, 10], dtype=torch.int32), r"got shapes \[2\] and \[3\]"),
])
def test_packed_arguments_are_checked(cu_k, fragment):
    _, model = _models(torch.float32)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(8))
    pos = torch.cat([torch.arange(5), torch.arange(5)])[None]
    with pytest.raises(RlkInputError, match=fragment):
        _call(model, ids, position_ids=pos, cu_seq_lens_q=torch.tensor([0, 5, 10], dtype=torch.int32),
              cu_seq_lens_k=cu_k)


@pytest.mark.parametrize("change, fragment", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 128}), "RoPE type must be 'default'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor must be 1.0"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "every layer must be full attention"),
    (dict(use_sliding_window=True), "every layer must be full attention"),
    (dict(attention_dropout=0.1), "attention_dropout must be 0"),
    (dict(model_type="llama"), "model_type must be one of"),
])
def test_configs_the_block_does_not_compute_are_refused(change, fragment):
    cfg = copy.deepcopy(_config())
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(RlkInputError, match=fragment):
        attention_config(cfg)


def test_an_adapter_on_a_projection_is_refused():
    """A LoRA-style wrapper on q_proj (its weight the base layer's, its own forward adding the adapter): the
    block reads q_proj.weight and never calls q_proj, so the adapter would add nothing; refused."""
    class LoraLike(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0
    _, model = _models(torch.float32)
    base = model.model.layers[1].self_attn.q_proj
    wrapped = LoraLike(base.in_features, base.out_features, bias=False)
    wrapped.weight = base.weight
    model.model.layers[1].self_attn.q_proj = wrapped
    with pytest.raises(RlkInputError, match="q_proj"):
        _call(model, torch.zeros(1, 4, dtype=torch.int64))


def test_transformers_4_config_reads_rope_theta():
    """transformers 4.x configs carry rope_theta (and rope_scaling) instead of rope_parameters."""
    v4 = types.SimpleNamespace(model_type="qwen3", rope_theta=12345.0, rope_scaling=None, hidden_size=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                               attention_bias=True, use_sliding_window=False, attention_dropout=0.0)
    cfg = attention_config(v4, split_kv="canonical:256")
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cfg.attention_bias,
            cfg.split_kv) == (12345.0, 16, 4, 2, 1e-5, True, "canonical:256")
    v4.rope_scaling = {"type": "linear", "factor": 2.0}
    with pytest.raises(RlkInputError, match="got 'linear'"):
        attention_config(v4)
    v4.rope_scaling, v4.rope_theta = None, None
    with pytest.raises(RlkInputError, match="RoPE base .* as a number, got None"):
        attention_config(v4)


def test_patch_refuses_other_models_and_a_second_patch():
    with pytest.raises(RlkInputError, match="must be a transformers PreTrainedModel"):
        patch_qwen3(torch.nn.Linear(2, 2))
    _, model = _models(torch.float32)
    with pytest.raises(RlkInputError, match=r"no transformers Qwen3Attention module .* \['HFQwen3Attention'\]"):
        patch_qwen3(model)


def test_an_unpatched_attention_under_the_rlk_implementation_raises():
    """A Qwen3Attention left in place (a config shared with the patched model) would otherwise run
    an attention function nobody chose."""
    ref, patched = _models(torch.float32)
    ref.config._attn_implementation = patched.config._attn_implementation
    with pytest.raises(RuntimeError, match="was not replaced by patch_qwen3"):
        _call(ref, torch.zeros(1, 4, dtype=torch.int64), use_cache=False)


def test_benchmarks_shadow_no_module_transformers_imports():
    """Tests put benchmarks/ first on sys.path (test_benchmark_routes, test_report_fits, test_sm90_compile),
    and an xdist worker keeps it for the next file: benchmarks/kernels.py then stood in for the PyPI
    ``kernels`` package transformers imports, and this file failed in make test (session 44; renamed
    kernel_bench.py)."""
    import importlib.metadata
    import pathlib
    benchmarks = {p.stem for p in (pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py")}
    deps = {"transformers"}
    for req in importlib.metadata.requires("transformers") or ():
        if "extra ==" not in req:
            deps.add(req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0]
                     .strip().replace("-", "_"))
    top_level = {m for d in deps for m in _top_level_modules(d)}
    assert "kernels" in top_level and "huggingface_hub" in top_level   # (the check sees what it should)
    assert not benchmarks & top_level


def _top_level_modules(dist_name):
    import importlib.metadata
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return {dist_name}
    names = (dist.read_text("top_level.txt") or "").split()
    if not names:
        names = {f.parts[0].removesuffix(".py") for f in dist.files or () if len(f.parts) and not
                 f.parts[0].endswith((".dist-info", ".data")) and f.parts[0] not in ("..", "__pycache__")}
    return set(names) | {dist_name}


def test_split_kv_policy_reaches_the_blocks():
    ref = _models(torch.float32)[0]
    model = patch_qwen3(copy.deepcopy(ref), split_kv="canonical:128")
    assert {layer.self_attn.config.split_kv for layer in model.model.layers} == {"canonical:128"}
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(9))
    with rlk_ops.strict():
        assert _rel(model(ids).logits, ref(ids, use_cache=False).logits) < 1e-4
