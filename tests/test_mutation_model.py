"""Mutation audit (session 43) of rollout/{model, glue}.py.

Gaps the earlier suite let through (the session 43 audit report has the table): TinyQwen3Config's Qwen3
defaults (eps, theta) and its split_kv reaching the attention block were never pinned; the model was never
measured against an independent computation with a non-default eps / theta (the negative control's
tolerance of 0.1 is far above such errors, and it reads the config's eps itself), nor were the seed and
the norm weights of the initialisation; log_softmax / token_logprobs were checked only against each other
(train == rollout), never for accuracy or overflow (the max shift changed on both sides passed), and
only the minutes-long demo tied them together bit for bit; a rollout trace of B > 1 sequences of Sq > 1
tokens (never run by the engine) was never compared with the trainer's; the SwiGLU op was opchecked in
float64 only and its backward's d_up never held to the forward's silu bits; its checks for a 0-d or
integer gate_up and a dout of the wrong shape, the model's checks for int32 tokens, a device, too many
caches, a cache on another device, forward_paged's hook / autocast checks, k_weight's packed
``qkv_proj`` and compiled_rollout's eager cache check were untested.
"""
import pytest
import torch

import rlk_ops
from rlk_ops.rollout import glue
from rlk_ops.rollout.cache import PagedKVCache
from rlk_ops.rollout.model import (TinyQwen3, TinyQwen3Config, Trace, compiled_rollout, k_weight, log_softmax,
                                   token_logprobs)
from rlk_ops.rollout.plain import plain_forward_rollout

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16)


# ------------------------------------------------------------------ the config
def test_config_defaults_are_qwen3s_and_reach_the_attention_block():
    """Kills M01/M02 (rms_norm_eps / rope_theta defaults changed) and M06/M07/M08 (attention() dropping
    the config's eps, theta or split_kv: the block got its own defaults)."""
    cfg = TinyQwen3Config()
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.split_kv) == (1e-6, 1e6, "disabled")
    att = TinyQwen3Config(**SMALL, rms_norm_eps=0.25, rope_theta=1e4, split_kv="canonical:128").attention()
    assert (att.rms_norm_eps, att.rope_theta, att.split_kv) == (0.25, 1e4, "canonical:128")
    assert (att.hidden_size, att.num_heads, att.num_kv_heads, att.head_dim) == (64, 4, 2, 16)


# ------------------------------------------------------------------ the model against plain.py in float64
def _caches(cfg, dtype=torch.float64):
    c = PagedKVCache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    c.add(0)
    c.add(1)
    return c, c.reserve_batch([(0, 7), (1, 7)])


def test_float64_model_computes_qwen3_with_its_configured_eps_and_theta():
    """Kills M06/M07 (the attention block's q/k norms and RoPE not given the config's eps / theta), M17
    (RMSNorm's weight ignored), M18/M19 (RMSNorm's eps ignored or fixed), M20 (gate and up weights swapped),
    M23-M27 (a residual, the final norm or the norms' order changed on both entry points) and G03/G13 (silu
    of the wrong sign, gate and up halves swapped in the op): both entry points of a float64 model with a
    large eps (0.25) and theta 1e4 against plain.py's independent forward (RMSNorm, RoPE, SDPA, F.silu in
    torch), to 1e-5 (plain.py's RMSNorm and RoPE angle are fp32: 4e-7 measured on clean code)."""
    cfg = TinyQwen3Config(**SMALL, rms_norm_eps=0.25, rope_theta=1e4)
    model = TinyQwen3(cfg, dtype=torch.float64, seed=3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    positions = torch.arange(7).expand(2, 7)
    cache, slots = _caches(cfg)
    want = plain_forward_rollout(model, tokens, positions, cache, [0, 1], slots)
    cache, slots = _caches(cfg)
    rollout = model.forward_rollout(tokens, positions, cache, [0, 1], slots)
    train = model.forward_train(tokens.flatten(), positions.flatten(), torch.tensor([0, 7, 14], dtype=torch.int32), 7)
    assert want.abs().max() > 1
    assert (rollout - want).abs().max() < 1e-5
    assert (train.view(2, 7, -1) - want).abs().max() < 1e-5


def test_a_rollout_trace_of_several_sequences_and_tokens_is_the_trainers_rows():
    """Kills M32 (the rollout trace's attention rows taken sequence-minor: the engine never saw it, as its
    steps are one sequence's prefill or one token of several sequences, but a forward_rollout of B = 2
    sequences of Sq = 5 tokens recorded rows of the wrong sequence): per layer, the rollout's traced
    attention output and LSE rows are the packed trainer's, bit for bit."""
    cfg = TinyQwen3Config(**SMALL)
    model = TinyQwen3(cfg, seed=4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=g)
    positions = torch.arange(5).expand(2, 5)
    cache = PagedKVCache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim)
    cache.add(0)
    cache.add(1)
    roll, train = Trace(), Trace()
    model.forward_rollout(tokens, positions, cache, [0, 1], cache.reserve_batch([(0, 5), (1, 5)]), trace=roll)
    model.forward_train(tokens.flatten(), positions.flatten(), torch.tensor([0, 5, 10], dtype=torch.int32), 5,
                        trace=train)
    assert len(roll.attn) == len(train.attn) == cfg.num_layers
    for layer in range(cfg.num_layers):
        assert torch.equal(roll.attn[layer], train.attn[layer]) and torch.equal(roll.lse[layer], train.lse[layer])


def test_seeds_and_norm_weights_of_the_initialisation():
    """Kills M55 (the seed ignored: every model the same) and M54 (norm weights all ones: a norm whose
    weight is dropped computes the same model)."""
    a, b = TinyQwen3(TinyQwen3Config(**SMALL), seed=0), TinyQwen3(TinyQwen3Config(**SMALL), seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert torch.equal(a.lm_head.weight, TinyQwen3(TinyQwen3Config(**SMALL), seed=0).lm_head.weight)
    for norm in (a.norm, a.layers[0].input_layernorm, a.layers[1].post_attention_layernorm):
        assert (norm.weight != 1).any()


# ------------------------------------------------------------------ log-probs
def _logits():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(6, 50, generator=g) * 4
    z[1, 7] = 3000.0          # past fp32 exp's range without the max shift, also against the row's mean
    z[2] -= 500.0
    return z.to(torch.bfloat16)


def test_log_softmax_is_accurate_fp32_with_the_max_shift():
    """Kills M12/M13 (the max shift replaced by the mean or dropped: exp overflowed) and M14 (no fp32 conversion:
    numerics refuses bf16) on both log_softmax and token_logprobs together: against
    float64 log_softmax of the same bf16 values, to 1e-5 absolute plus 1e-6 relative (fp32 exp / log / sum
    over 50 terms, and the fp32 spacing of a log-prob near -3000)."""
    z = _logits()
    ref = torch.log_softmax(z.double(), -1)
    got = log_softmax(z)
    assert got.dtype == torch.float32 and got.shape == z.shape
    assert torch.allclose(got.double(), ref, rtol=1e-6, atol=1e-5)
    tokens = torch.tensor([0, 7, 3, 49, 20, 11])
    lp = token_logprobs(z, tokens)
    assert lp.dtype == torch.float32 and torch.allclose(lp.double(), ref[torch.arange(6), tokens], rtol=1e-6, atol=1e-5)


def test_token_logprobs_are_log_softmax_bits_at_the_token_and_row_independent():
    """Kills M09/M10/M11/M62 (token_logprobs or log_softmax alone changed: the lse without the max, the
    token off by one, no fp32 conversion, the mean shift), which only the demo (minutes) caught: the
    trainer's token_logprobs are the rollout's log_softmax at the token, bit for bit, and a row's bits do
    not depend on the rows beside it."""
    z = _logits()
    tokens = torch.tensor([0, 7, 3, 49, 20, 11])
    full = log_softmax(z)
    lp = token_logprobs(z, tokens)
    assert torch.equal(lp, full[torch.arange(6), tokens])
    for r in range(6):
        assert torch.equal(log_softmax(z[r:r + 1])[0], full[r])
        assert torch.equal(token_logprobs(z[r:r + 1], tokens[r:r + 1]), lp[r:r + 1])


# ------------------------------------------------------------------ the SwiGLU op
def test_swiglu_ops_are_opchecked_in_bfloat16():
    """Kills G20 (d_gate left in fp32: swiglu_bwd returned float32 for bf16 inputs while its fake said
    bf16) and G05 (silu not rounded: the forward's dtype not the fake's); the suite opchecked float64 only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.rlk_model.swiglu.default, (x,))
    torch.library.opcheck(torch.ops.rlk_model.swiglu_bwd.default,
                          (torch.randn(5, 3, 4, generator=g).to(torch.bfloat16), x))


def test_swiglu_backward_d_up_is_dout_times_the_forwards_silu():
    """Kills G04 (the forward's silu computed as x * (1 / d): other bits than the backward's x / d), G21
    (d_up's product in fp32, rounded once) and G23 (d_up from x * s): d(silu(gate) * up)/d up is dout times
    the very silu the forward multiplied, a product in the dtype (autograd's rule for the op's
    product), bitwise in bf16 and float32 (where one fp32 rounding of silu is not hidden by a bf16 one)."""
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32):
        gate_up = (torch.randn(64, 2 * 40, generator=g) * 3).to(dtype)
        dout = torch.randn(64, 40, generator=g).to(dtype)
        gate, up = gate_up.chunk(2, -1)
        assert torch.equal(glue.swiglu(gate_up), glue.silu(gate) * up)
        d = torch.ops.rlk_model.swiglu_bwd(dout, gate_up)
        assert d.dtype == dtype and torch.equal(d[:, 40:], dout * glue.silu(gate))


def test_swiglu_checks_rank_dtype_and_douts_shape():
    """Kills G07 (a 0-d gate_up: an IndexError naming nothing), G08 (an integer gate_up: a result in
    integers) and G10 (dout of the output's dtype but another shape: broadcast into a wrong gradient)."""
    with pytest.raises(ValueError, match=r"rlk_model::swiglu: gate_up must be \[\.\.\., 2 \* intermediate\] "
                                         r".*got shape \[\]"):
        glue.swiglu(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"rlk_model::swiglu: gate_up must be a floating tensor, got torch.int64"):
        glue.swiglu(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"swiglu_bwd: dout must be torch.float32 \[3, 2\] "
                                         r".*got torch.float32 \[1, 2\]"):
        torch.ops.rlk_model.swiglu_bwd(torch.ones(1, 2), torch.ones(3, 4))


# ------------------------------------------------------------------ the model's input checks
def test_tokens_int32_accepted_and_another_device_named():
    """Kills M39 (int32 token ids refused) and M40 (tokens on another device than the model's not named:
    the embedding failed naming nothing)."""
    model = TinyQwen3(TinyQwen3Config(**SMALL))
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert torch.equal(model.forward_train(torch.tensor([1, 2, 3], dtype=torch.int32), torch.arange(3), cu),
                       model.forward_train(torch.tensor([1, 2, 3]), torch.arange(3), cu))
    with pytest.raises(rlk_ops.RlkInputError, match=r"forward_train: tokens must be on the model's device cpu, "
                                                    r"got meta"):
        model.forward_train(torch.zeros(3, dtype=torch.int64, device="meta"), torch.arange(3), cu)


_CACHE = (4, 4, 2, 16)   # [pages, page_size, Hkv, D] of SMALL


def _one_token(dtype=torch.bfloat16):
    """forward_paged's arguments for one token of one sequence in a fresh cache of SMALL's 2 layers:
    (tokens, positions, k_caches, v_caches, page_table, seq_lens, slots)."""
    return (torch.tensor([[1]]), torch.tensor([[0]]), [torch.zeros(_CACHE, dtype=dtype) for _ in range(2)],
            [torch.zeros(_CACHE, dtype=dtype) for _ in range(2)], torch.tensor([[2, 0]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([8]))


def test_paged_caches_too_many_and_on_another_device_are_refused():
    """Kills M42 (a list of more caches than layers accepted, the extras ignored) and M45 (a cache on
    another device than its layer's k_proj accepted)."""
    model = TinyQwen3(TinyQwen3Config(**SMALL))
    tokens, positions, kc, vc, *rest = _one_token()
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches must be a list of 2 caches \(one per layer\), got "
                                                    r"list of 3"):
        model.forward_paged(tokens, positions, kc + [torch.zeros(_CACHE, dtype=torch.bfloat16)], vc, *rest)
    meta = [kc[0], torch.zeros(_CACHE, dtype=torch.bfloat16, device="meta")]
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches\[1\] must have the dtype and device of what its "
                                                    r"layer's k_proj makes, torch.bfloat16 on cpu, got "
                                                    r"torch.bfloat16 on meta"):
        model.forward_paged(tokens, positions, meta, vc, *rest)


def test_k_weight_finds_k_proj_or_a_packed_qkv_proj():
    """Kills M48 (a packed qkv_proj not looked at: its caches' dtype went unchecked) and M61 (q_proj's
    weight taken for the keys')."""
    attn = TinyQwen3(TinyQwen3Config(**SMALL)).layers[0].self_attn
    assert k_weight(attn) is attn.k_proj.weight
    packed = torch.nn.Module()
    packed.q_proj = torch.nn.Linear(4, 4, dtype=torch.float16)
    packed.qkv_proj = torch.nn.Linear(4, 12)
    assert k_weight(packed) is packed.qkv_proj.weight
    assert k_weight(torch.nn.Module()) is None


def test_compiled_rollout_checks_the_caches_before_the_compiled_call():
    """Kills M50 (compiled_rollout's eager cache check dropped: the compiled core skips its own, so one
    tensor given as both layers' K cache ran, each layer overwriting the other's keys). A cache of too few
    layers is no witness: tracing fails on it and Dynamo falls back to the eager frame, whose check raises.
    Compiles with the eager backend (a few seconds): the gap is compile-only."""
    model = TinyQwen3(TinyQwen3Config(**SMALL))
    cache = PagedKVCache(2, 8, 4, 2, 16)
    cache.add(0)
    slots = cache.reserve(0, 3)
    cache.k = [cache.k[0]] * 2
    fwd = compiled_rollout(backend="eager")
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches\[1\] shares memory with k_caches\[0\]"):
        fwd(model, torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, [0], slots)
    assert not cache.k[0].any()


def test_rollout_entry_refuses_a_hooked_lm_head_and_autocast():
    """Kills M36 (forward_paged's _check_setup dropped: a hook on lm_head, which the model reads and never
    calls, and an autocast the rlk ops ignore were refused by forward_train only)."""
    model = TinyQwen3(TinyQwen3Config(**SMALL))
    handle = model.lm_head.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"TinyQwen3.forward_paged: lm_head has module hooks"):
        model.forward_paged(*_one_token())
    handle.remove()
    model32 = TinyQwen3(TinyQwen3Config(**SMALL), dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            ValueError, match=r"TinyQwen3.forward_paged: torch.autocast is on for cpu"):
        model32.forward_paged(*_one_token(torch.float32))
