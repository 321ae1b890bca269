"""Mutation audit (session 42) of the block both sides run and what drives it: compile/block.py
(Qwen3Attention and its config), meta/contract.py (SplitKVPolicy, AttentionContract),
rollout/engine.py (the rollout loop) and compile/module_checks.py.

Each test kills mutants the earlier suite let through (the audit report has the table): a config
bound off by one (rope_theta 1, rms_norm_eps at the smallest normal float32, rotary_dim 0 and at
head_dim), the GQA grouping check dropped, the hidden_size check dropped; a config field the block does
not forward to its op (rms_norm_eps, rope_theta, rotary_dim: the earlier tests ran the defaults,
where a constant is right), the rollout's positions read column-major for B > 1 and Sq > 1;
a policy built directly that skips the text form's rules (a bool size, a size for disabled / auto,
an empty kind), fixed:N's inclusive int32 bound, the contract's string fields; in the engine a prompt
one token past a chunk boundary, pages taken outside a running run, cache_for's size, the forced-token
count, the seed's bound and hash; a hook on a torch.compile'd submodule's wrapper. The block is checked
against the rlk ops composed by hand from its parameters with every setting off its default; bitwise
claims use torch.equal (conftest.bitwise_equal).
"""
import pytest
import torch

import rlk_ops
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.block import Qwen3AttentionConfig
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.rollout.cache import CacheFullError, PagedKVCache
from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for, noise_seed

from conftest import bitwise_equal

# every field away from its default (the default is what a constant in the block would also give)
ODD = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=5e3, rms_norm_eps=3e-2,
           rotary_dim=8, attention_bias=True, split_kv="canonical:128")


def _odd_block(**kw):
    return init_block(Qwen3Attention(**{**ODD, **kw}), seed=4, std=0.05)


def _by_hand(block, x, pos, cu):
    """The block's training forward composed from rlk ops, each config field passed explicitly."""
    c = block.config
    n, hq, hkv, d = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    w = torch.cat([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight])
    b = torch.cat([block.q_proj.bias, block.k_proj.bias, block.v_proj.bias])
    q, k, v = rlk_ops.linear(x, w, b).split([hq * d, hkv * d, hkv * d], -1)
    q = rlk_ops.rope(rlk_ops.qk_rmsnorm(q.reshape(n, hq, d), block.q_norm.weight, 3e-2), pos, 5e3, 8)
    k = rlk_ops.rope(rlk_ops.qk_rmsnorm(k.reshape(n, hkv, d), block.k_norm.weight, 3e-2), pos, 5e3, 8)
    attn, _ = rlk_ops.attention(q, k, v.reshape(n, hkv, d), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                split_kv="canonical:128")
    return rlk_ops.linear(attn.reshape(n, hq * d), block.o_proj.weight, block.o_proj.bias)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kw,message", [
    (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (dict(rotary_dim=0), r"rotary_dim must be None or even and in \(0, head_dim=128\], got 0"),
    (dict(rotary_dim=130), r"rotary_dim must be None or even and in \(0, head_dim=128\], got 130"),
])
def test_config_refuses_gqa_and_rotary_dim_edges(kw, message):
    """Kills B1 (the num_heads % num_kv_heads check dropped: 6 heads over 4 KV heads was built and
    failed in the first forward), B5 (rotary_dim 0 accepted) and B39 (rotary_dim past head_dim accepted)."""
    with pytest.raises(ValueError, match=message):
        Qwen3AttentionConfig(**kw)


def test_config_accepts_its_inclusive_bounds():
    """Kills B2 (rope_theta >= 1 made > 1), B3 (rms_norm_eps >= the smallest normal float32 made >) and
    B6 (rotary_dim <= head_dim made <): each bound is accepted, and the block runs at it."""
    tiny = torch.finfo(torch.float32).tiny
    cfg = Qwen3AttentionConfig(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1,
                               rms_norm_eps=tiny, rotary_dim=16)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.rotary_dim) == (1, tiny, 16)
    block = init_block(Qwen3Attention(cfg, dtype=torch.float32))
    x, pos, cu = packed_batch([5], 32, dtype=torch.float32, requires_grad=False)
    assert torch.isfinite(block(x, pos, cu)).all()


def test_hidden_states_of_another_width_are_named():
    """Kills B17 (the hidden_size check dropped: [T, 64] into a 128-wide block then failed later, in an
    op's own check, without naming the block's hidden_size)."""
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    x, pos, cu = packed_batch([5], 64, requires_grad=False)
    with pytest.raises(ValueError, match=r"hidden_states must be 2-D \[T, hidden_size\] with hidden_size 128, got "
                                         r"\[5, 64\]"):
        block(x, pos, cu)
    with pytest.raises(ValueError, match=r"hidden_states must be 3-D \[B, Sq, hidden_size\] with hidden_size 128, "
                                         r"got \[1, 5, 64\]"):
        block.forward_rollout(x[None], pos[None], None, None, None, None, None)


# ------------------------------------------------------------------ forwarding of the config
def test_training_forward_is_the_ops_composed_with_every_config_field():
    """Kills B22-B24 (k's rms_norm_eps, q's rope_theta, k's rotary_dim replaced by the default: every
    earlier test built the block with the defaults). It also catches the forwarding mutants the suite
    kills elsewhere (B21 norms swapped, B25 q's heads transposed, B26 causal False, B27 training's split_kv
    dropped, B29 o_proj's input in [D, Hq] order, B40 K and V biases swapped). With every field off its
    default, the block's output is the hand-composed ops' output, bitwise."""
    block = _odd_block()
    x, pos, cu = packed_batch([150, 40], 128, requires_grad=False, seed=2)
    with torch.no_grad():
        assert bitwise_equal(block(x, pos, cu), _by_hand(block, x, pos, cu))


def test_rollout_with_several_sequences_of_several_tokens():
    """Kills B37 (positions [B, Sq] flattened column-major: with B > 1 and Sq > 1 each token took another
    sequence's position). Two sequences prefill 3 tokens each in one call: training's bits."""
    block = _odd_block(split_kv="disabled")
    c = block.config
    x, pos, cu = packed_batch([3, 3], 128, requires_grad=False, seed=5)
    cache = PagedKVCache(1, 8, 4, c.num_kv_heads, c.head_dim, dtype=x.dtype, seed=1)
    for s in (0, 1):
        cache.add(s)
    slots = cache.reserve_batch([(0, 3), (1, 3)])
    with torch.no_grad():
        want = block(x, pos, cu)
        got = block.forward_rollout(x.view(2, 3, 128), pos.view(2, 3), cache.k[0], cache.v[0],
                                    cache.page_table([0, 1]), cache.seq_lens([0, 1]), slots)
    assert bitwise_equal(got.reshape(6, 128), want)


# ------------------------------------------------------------------------------ the contract
@pytest.mark.parametrize("kind,size,message", [
    ("fixed", True, r"split_kv fixed size must be an int or None, got bool True"),
    ("canonical", False, r"split_kv canonical size must be an int or None, got bool False"),
    ("disabled", 5, r"split_kv disabled takes no size, got 5"),
    ("auto", 128, r"split_kv auto takes no size, got 128"),
])
def test_a_policy_built_directly_is_checked_like_its_text(kind, size, message):
    """Kills C5 (a bool size accepted: SplitKVPolicy("fixed", True) printed as fixed:True, a spelling no
    op accepts) and C6 (disabled / auto with a size accepted, printed as "disabled:5", a spelling the text
    form refuses). Built directly, a policy obeys the text form's rules."""
    from rlk_ops.meta.contract import SplitKVPolicy

    with pytest.raises(ValueError, match=message):
        SplitKVPolicy(kind, size)


def test_fixed_split_bounds_are_inclusive_at_int32_max():
    """Kills C11 (fixed:N <= MAX_FIXED_SPLIT made <: fixed:2147483647, FlashInfer's largest split, refused)
    and C12 (MAX_FIXED_SPLIT 2**31: fixed:2147483648 accepted, which wraps to FlashInfer's automatic split)."""
    from rlk_ops.meta.contract import MAX_FIXED_SPLIT, SplitKVPolicy

    assert MAX_FIXED_SPLIT == 2 ** 31 - 1
    assert SplitKVPolicy.parse("fixed:2147483647") == SplitKVPolicy("fixed", 2 ** 31 - 1)
    with pytest.raises(ValueError, match=r"fixed:N needs 0 < N <= 2147483647 \(MAX_FIXED_SPLIT\), got 2147483648"):
        SplitKVPolicy.parse("fixed:2147483648")


@pytest.mark.parametrize("field", ["accumulation", "lse", "p_rounding"])
def test_contract_string_fields_are_checked(field):
    """Kills C21 (only dtype checked for a string: AttentionContract(accumulation=32) was built, and the
    binding then compared an int against the other side's "fp32")."""
    from rlk_ops.meta.contract import AttentionContract

    with pytest.raises(ValueError, match=rf"AttentionContract {field} must be a string, got 32"):
        AttentionContract(**{field: 32})


def test_an_empty_policy_kind_is_refused():
    """Kills C26 (KINDS admitting a kind the text form cannot spell: SplitKVPolicy("") was built and
    printed as the empty string, which every op then refused as a spelling)."""
    from rlk_ops.meta.contract import KINDS, SplitKVPolicy

    assert KINDS == ("disabled", "fixed", "auto", "canonical")
    with pytest.raises(ValueError, match=r"split_kv kind must be one of disabled, fixed, auto, canonical, got ''"):
        SplitKVPolicy("")


# ------------------------------------------------------------------------------- the engine
def test_noise_seed_is_the_documented_hash():
    """Kills E38 (the generator seed reduced mod 2**31 instead of 2**63): the seed of (seed, sequence,
    position) is the first 8 bytes of sha256("seed,seq,position"), little-endian, mod 2**63; sampled
    tokens are reproducible across versions only while this stays."""
    import hashlib

    for key in ((0, 0, 0), (5, 3, 17), (2 ** 32 - 1, 2 ** 63 - 1, 40_000)):
        want = int.from_bytes(hashlib.sha256(",".join(map(str, key)).encode()).digest()[:8], "little") % 2 ** 63
        assert noise_seed(*key) == want
    assert any(noise_seed(0, q, 0) >= 2 ** 31 for q in range(8))


def test_sampler_seed_bound_and_forced_count_boundary():
    """Kills E16 (seed 2**32 accepted: the bound is [0, 2**32)) and E23 (one forced token short of
    max_new_tokens accepted, then an IndexError in the last step)."""
    from test_rollout import _engine

    assert Sampler(seed=2 ** 32 - 1).seed == 2 ** 32 - 1
    with pytest.raises(ValueError, match=r"Sampler seed must be None \(greedy\) or an int in \[0, 2\*\*32\), got "
                                         r"4294967296"):
        Sampler(seed=2 ** 32)
    eng, cache = _engine(num_pages=4)
    with pytest.raises(ValueError, match=r"request 0: 2 forced tokens < max_new_tokens 3"):
        eng.run([Request(0, [1, 2], 3, forced=[5, 6])])
    assert cache.free_pages == 4


def test_cache_for_holds_the_longest_requests_at_once():
    """Kills E30 (one request fewer counted), E40 (the shortest requests counted, not the longest) and
    E31 (spare_pages=0 refused): pages = the max_running largest ceil((prompt + new) / page_size)
    plus spare_pages."""
    from test_rollout import _tiny

    model = _tiny()
    reqs = [Request(0, [1] * 3, 2), Request(1, [1] * 30, 3), Request(2, [1] * 9, 8), Request(3, [1] * 12, 1)]
    # ceil(n / 4): 5 -> 2, 33 -> 9, 17 -> 5, 13 -> 4
    assert cache_for(model, reqs, 4, 2).num_pages == 9 + 5 + 4
    assert cache_for(model, reqs, 4, 3, spare_pages=0).num_pages == 9 + 5 + 4
    assert cache_for(model, reqs, 4, 9, spare_pages=1).num_pages == 20 + 1


def test_a_prompt_one_token_past_a_chunk_boundary_emits_once_at_its_end():
    """Kills E39 (the first token emitted when a chunk stops one token short of the prompt's end: with
    chunk 4, a 5- or 9-token prompt emitted from position 3's (8's) logits, then again at the end).
    Prefill emits only from the prompt's last token: the same tokens as one chunk for the whole prompt."""
    from test_rollout import _engine

    reqs = [Request(0, [1, 2, 3, 4, 5], 2), Request(1, list(range(1, 10)), 3)]
    runs = []
    for chunk in (4, 16):
        eng, _ = _engine(num_pages=12, max_running=2, chunk=chunk, sampler=Sampler(1))
        runs.append(eng.run(reqs))
    assert [(s, a, b) for st in eng.log for (s, a, b) in st.prefill] == [(0, 0, 5), (1, 0, 9)]
    for a, b, r in zip(*runs, reqs):
        assert len(a.generated) == r.max_new_tokens and a.generated == b.generated and a.logprobs == b.logprobs


def test_pages_taken_outside_the_run_midway_are_named_not_waited_for():
    """Kills E41 (with nothing of the run running, a request short of pages waited for a finish that could
    never come: the loop spun forever). Pages taken by a sequence outside the run after the run began:
    the next request is refused with CacheFullError naming it, and the run leaves the cache as it found
    it (the outside sequence keeps its pages). The cache counts its free_pages reads so that the
    mutant's endless loop fails here instead of hanging."""
    from test_rollout import _tiny

    class Counting(PagedKVCache):
        reads = 0

        @property
        def free_pages(self):
            Counting.reads += 1
            if Counting.reads > 10_000:
                raise RuntimeError("the engine spun on free_pages")
            return super().free_pages

    model = _tiny()
    c = model.config
    cache = Counting(c.num_layers, 4, 4, c.num_kv_heads, c.head_dim, dtype=model.embed_tokens.weight.dtype)

    def grab_pages(m, *args, **kwargs):
        if 99 not in cache:   # the first forward: another user takes 3 of the 4 pages
            cache.add(99)
            cache.reserve(99, 12)
        return type(m).forward_rollout(m, *args, **kwargs)

    eng = RolloutEngine(model, cache, max_running=1, forward=grab_pages)
    with pytest.raises(CacheFullError, match=r"request 1: needs 2 pages of 4 tokens but only 1 of 4 are free"):
        eng.run([Request(0, [1, 2, 3], 2), Request(1, list(range(1, 8)), 2)])
    assert cache.free_pages == 1 and list(cache._lens) == [99]


# ---------------------------------------------------------------------------- module checks
def test_a_hook_on_a_compiled_submodules_wrapper_is_refused():
    """Kills M3 (hooks checked on the module torch.compile wraps but not on the OptimizedModule wrapper:
    a forward hook registered on torch.compile(k_proj) never ran, without a word)."""
    block = init_block(Qwen3Attention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16))
    x, pos, cu = packed_batch([5], 64, requires_grad=False)
    block.k_proj = torch.compile(block.k_proj)
    handle = block.k_proj.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"k_proj has module hooks \(forward_hooks\), which would never run"):
        block(x, pos, cu)
    handle.remove()
    assert block(x, pos, cu).shape == (5, 64)
