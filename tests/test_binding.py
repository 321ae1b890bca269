"""Issue 9: cross-configuration binding of the training and rollout sides.

Every side here is described from what ran: a warm-up compile of the entry point
through the capturing backend plus the provenance of its calls (meta/probe.py). Each
variant changes one thing in the model or the run, never in the description.
"""
import json
import subprocess
import sys
import types

import pytest
import torch

import rlk_ops
from rlk_ops.compile.block import Qwen3Attention
from rlk_ops.meta import binding, probe
from rlk_ops.meta.binding import IDENTICAL, RECORDED, SEMANTIC, Mandate, Unobservable, bind
from rlk_ops.meta.contract import AttentionContract
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config
from rlk_ops.rollout.plain import plain_forward_rollout

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
            head_dim=16)


def _model(seed=0, dtype=torch.bfloat16, **cfg):
    return TinyQwen3(TinyQwen3Config(**{**TINY, **cfg}), dtype=dtype, seed=seed)


def _decode(model, **kw):
    return probe.describe_rollout(model, entries=("decode",), **kw)


def _given_id(side, model_id="tiny-qwen3@seed0"):
    """The same evidence, bound under a stated checkpoint id instead of the weight hash."""
    return {**side, "model": {"id": model_id, "kind": "given"}}


def _fails(result, name, tier, train, rollout):
    f = result.failure(name)
    assert f is not None, f"{name} did not fail:\n{result.summary()}"
    assert (f.tier, binding._jsonable(f.train), binding._jsonable(f.rollout)) == (tier, train, rollout), f.message()
    assert name in f.message() and tier in f.message()
    return f


# ------------------------------------------------------------------ the sides
@pytest.fixture(scope="module")
def train():
    return probe.describe_train(_model())


@pytest.fixture(scope="module")
def rollout():
    return probe.describe_rollout(_model())  # chunked prefill + decode, page 16


def _forward_rollout_without_k_norm(self, hidden_states, positions, k_cache, v_cache, page_table, seq_lens,
                                    slot_mapping, return_attention=False):
    """Qwen3Attention.forward_rollout with k_norm left out: a rollout engine that forgot it."""
    cfg = self.config
    b, sq, hidden = hidden_states.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = hidden_states.reshape(b * sq, hidden)
    qkv = rlk_ops.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    pos = positions.reshape(b * sq)
    q = rlk_ops.rope(rlk_ops.qk_rmsnorm(q.reshape(-1, hq, d), self.q_norm.weight, cfg.rms_norm_eps), pos,
                     cfg.rope_theta, cfg.rotary_dim)
    k = rlk_ops.rope(k.reshape(-1, hkv, d), pos, cfg.rope_theta, cfg.rotary_dim)
    rlk_ops.paged_kv_append(k_cache, v_cache, k, v.reshape(-1, hkv, d), slot_mapping)
    attn, lse = rlk_ops.paged_attention(q.reshape(b, sq, hq, d), k_cache, v_cache, page_table, seq_lens)
    out = rlk_ops.linear(attn.reshape(b * sq, -1), self.o_proj.weight).reshape(b, sq, hidden)
    return (out, attn, lse) if return_attention else out


def _auto_lane(q, k_cache, v_cache, page_table, seq_lens, softmax_scale=None, split_kv="disabled"):
    """What an engine using FlashInfer's automatic split runs: the rlk auto lane."""
    return rlk_ops.paged_attention_auto(q, k_cache, v_cache, page_table, seq_lens, softmax_scale)


@pytest.fixture(scope="module")
def variants():
    """Rollout (or training) sides that differ from the default pair in one respect."""
    made = {}

    def get(name):
        if name in made:
            return made[name]
        if name == "theta":
            side = _decode(_model(rope_theta=1e4))
        elif name == "eps":
            side = _decode(_model(rms_norm_eps=1e-5))
        elif name == "auto":
            with pytest.MonkeyPatch.context() as mp, rlk_ops.strict(False):
                mp.setattr(rlk_ops, "paged_attention", _auto_lane)
                side = _decode(_model())
        elif name == "fp16":
            side = _decode(_model(dtype=torch.float16), model_id="tiny-qwen3@seed0")
        elif name == "tp2":  # what rank 0 of a TP=2 rollout runs: half the heads of the same model
            side = _decode(_model(num_heads=2, num_kv_heads=1), model_id="tiny-qwen3@seed0",
                           topology=probe.Topology(tp=2, head_ownership={"q": [0, 2], "kv": [0, 1]}))
        elif name == "no_k_norm":
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(Qwen3Attention, "forward_rollout", _forward_rollout_without_k_norm)
                side = _decode(_model())
        elif name == "fa4_fell_back":
            with rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="fa4"):
                side = probe.describe_train(_model(), backward=False)
        elif name == "weights":
            side = _decode(_model(seed=1))
        elif name == "decode16":
            side = _decode(_model(), page_size=16)
        elif name == "prefill128":
            side = probe.describe_rollout(_model(), page_size=128, entries=("prefill",))
        elif name.startswith("canonical"):  # "canonical:C/train" or "canonical:C/decode"
            policy, which = name.split("/")
            model = _model(split_kv=policy)
            side = probe.describe_train(model, backward=False) if which == "train" else _decode(model)
        elif name == "plain":
            side = _decode(_model(), forward=plain_forward_rollout)
        made[name] = side
        return side

    return get


# ------------------------------------------------------------------ acceptance
def test_default_demo_pair_binds():
    """The exact call the demo makes before it generates (demo config, page 16)."""
    cfg = TinyQwen3Config(num_layers=2)
    mandate = Mandate.from_contract(AttentionContract(dtype="bfloat16", head_dim=cfg.head_dim))
    result, train_side, rollout_side = binding.bind_model(TinyQwen3(cfg, seed=0), page_size=16, mandate=mandate)
    assert result.comparable and result.passed, result.summary()
    assert not result.failures
    names = {f.field for f in result.fields}
    for layer in (0, 1):  # every layer's contract was read from the graphs
        for f in ("attention.split_kv", "attention.split_plan", "q_norm.eps", "k_rope.theta", "q_rope.rotary_dim",
                  "attention.reduction_order", "attention.num_heads", "v.stages"):
            assert f"layer[{layer}].{f}" in names
    assert {e["name"] for e in rollout_side["entries"]} == {"prefill", "decode"}
    assert train_side["entries"][0]["graph"]["backward"]  # the training warm-up ran its backward too
    counts = result.to_json()["fields_by_tier"]
    assert counts[IDENTICAL] >= 8 and counts[SEMANTIC] >= 40 and counts[RECORDED] >= 10


def test_pair_fields_come_from_the_graphs_and_provenance(train, rollout):
    result = bind(train, rollout)
    assert result.comparable and result.passed, result.summary()
    by_name = {f.field: f for f in result.fields}
    attn = by_name["layer[0].attention.split_kv"]
    assert (attn.train, attn.rollout, attn.tier) == ("disabled", "disabled", SEMANTIC)
    assert "node #" in attn.source and "args" in attn.source
    assert by_name["layer[0].q_norm.eps"].train == 1e-6 and by_name["layer[0].k_rope.theta"].rollout == 1e6
    assert by_name["layer[0].k.stages"].rollout == "linear>rmsnorm>rope"  # followed back through the KV cache
    assert by_name["layer[0].attention.split_plan"].train == "single_pass"
    assert by_name["layer[0].attention.fallback"].source.startswith("provenance")
    assert by_name["model.id"].train.startswith("sha256:") and by_name["model.id"].tier == IDENTICAL
    assert by_name["topology.head_ownership"].train == {"q": [0, 4], "kv": [0, 2]}
    assert by_name["env.version.torch"].tier == SEMANTIC  # blocking on every path
    assert by_name["env.cuda.matmul.allow_tf32"].tier == RECORDED  # nothing ran on CUDA
    json.dumps(result.to_json())


def test_recorded_differences_pass(train, rollout, variants):
    decode16, prefill128 = variants("decode16"), variants("prefill128")
    for other in (rollout, decode16, prefill128):
        result = bind(train, other)
        assert result.comparable and result.passed, result.summary()
    result = bind(decode16, prefill128)  # decode vs prefill, page 16 vs 128
    assert result.comparable and result.passed, result.summary()
    diffs = {r["field"]: (r["train"], r["rollout"]) for r in result.to_json()["recorded_differences"]}
    assert diffs["runtime.mode"] == ("decode", "chunked prefill")
    assert diffs["runtime.page_size"] == (16, 128)
    modes = {r["field"]: r for r in bind(train, rollout).to_json()["recorded_differences"]}["runtime.mode"]
    assert (modes["train"], modes["rollout"], modes["tier"]) == ("prefill (packed varlen)",
                                                                  ["chunked prefill", "decode"], RECORDED)


def test_theta_on_one_side(train, variants):
    result = bind(train, variants("theta"))
    assert result.comparable and not result.passed
    for path in ("q", "k"):
        _fails(result, f"layer[0].{path}_rope.theta", SEMANTIC, 1e6, 1e4)
    assert {f.field for f in result.failures} == {"layer[0].q_rope.theta", "layer[0].k_rope.theta"}


def test_eps_on_one_side(train, variants):
    result = bind(train, variants("eps"))
    assert result.comparable and not result.passed
    for path in ("q", "k"):
        _fails(result, f"layer[0].{path}_norm.eps", SEMANTIC, 1e-6, 1e-5)
    # the model's own RMSNorms (outside attention: input, post-attention, final) passed the same eps:
    # also named, call by call
    norms = ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight")
    _fails(result, "model.qk_rmsnorm.args", SEMANTIC, [_norm_call(1e-6, w) for w in norms],
           [_norm_call(1e-5, w) for w in norms])


def _norm_call(eps, weight):
    """How the binding records a norm outside attention: its eps and the module parameter it takes."""
    return json.dumps({"eps": eps, "params": {"weight": weight}}, sort_keys=True)


def test_model_op_args_are_compared_call_by_call():
    """The model's rlk ops outside attention are compared in graph order, not as a set of
    distinct values: an eps moved to another layer, or a call dropped on one side, leaves the set
    unchanged while the logits differ (both once bound)."""
    train_m, roll_m = _model(num_layers=2), _model(num_layers=2)
    train_m.layers[0].input_layernorm.eps = 1e-2
    roll_m.layers[1].input_layernorm.eps = 1e-2
    moved = bind(probe.describe_train(train_m, backward=False), _decode(roll_m))
    f = moved.failure("model.qk_rmsnorm.args")
    assert f is not None and f.tier == SEMANTIC, moved.summary()
    assert f.train[0] == _norm_call(0.01, "layers.0.input_layernorm.weight")
    assert f.rollout[2] == _norm_call(0.01, "layers.1.input_layernorm.weight") and len(f.train) == len(f.rollout) == 5

    def no_final_norm(self, tokens, positions, cache, seqs, slot_mapping, trace=None):
        h = self.embed_tokens(tokens)
        page_table, seq_lens = cache.page_table(seqs), cache.seq_lens(seqs)
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn.forward_rollout(layer.input_layernorm(h), positions, cache.k[i], cache.v[i],
                                                    page_table, seq_lens, slot_mapping)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return rlk_ops.linear(h, self.lm_head.weight)        # self.norm skipped

    m = _model()
    dropped = bind(probe.describe_train(m, backward=False), _decode(m, forward=no_final_norm))
    f = dropped.failure("model.qk_rmsnorm.args")
    assert f is not None and (len(f.train), len(f.rollout)) == (3, 2), dropped.summary()


def _swapped_qk_norms(self, x, positions):
    """Qwen3Attention._qkv with q normed by k_norm's weight and k by q_norm's (a wiring bug that
    keeps every weight, eps and stage: only the graph's weight sources show it)."""
    cfg = self.config
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = rlk_ops.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    n = x.shape[0]
    q = rlk_ops.qk_rmsnorm(q.reshape(n, hq, d), self.k_norm.weight, cfg.rms_norm_eps)
    k = rlk_ops.qk_rmsnorm(k.reshape(n, hkv, d), self.q_norm.weight, cfg.rms_norm_eps)
    q = rlk_ops.rope(q, positions, cfg.rope_theta, cfg.rotary_dim)
    k = rlk_ops.rope(k, positions, cfg.rope_theta, cfg.rotary_dim)
    return q, k, v.reshape(n, hkv, d)


def test_norm_weights_are_bound_by_their_module_path():
    """Same checkpoint, same eps, same stages; the rollout's q and k norms take each other's
    weight in layer 0: binding names the two weights (before, it passed while the logits differed).
    A norm outside attention taking another layer's weight is named the same way."""
    train_m, roll_m = _model(), _model()
    assert probe.weights_id(train_m) == probe.weights_id(roll_m)
    train = probe.describe_train(train_m, backward=False)
    same = bind(train, _decode(train_m))
    assert same.passed
    norms = next(f for f in same.to_json()["fields"] if f["field"] == "model.qk_rmsnorm.args")
    assert [json.loads(c)["params"]["weight"] for c in norms["rollout"]] == [
        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight"]
    attn = roll_m.layers[0].self_attn
    attn._qkv = types.MethodType(_swapped_qk_norms, attn)
    swapped = bind(train, _decode(roll_m))
    assert swapped.comparable and not swapped.passed
    _fails(swapped, "layer[0].q_norm.weight", SEMANTIC, "layers.0.self_attn.q_norm.weight",
           "layers.0.self_attn.k_norm.weight")
    _fails(swapped, "layer[0].k_norm.weight", SEMANTIC, "layers.0.self_attn.k_norm.weight",
           "layers.0.self_attn.q_norm.weight")

    other = _model()
    other.layers[0].input_layernorm.forward = types.MethodType(
        lambda self, x: rlk_ops.qk_rmsnorm(x, other.norm.weight, self.eps), other.layers[0].input_layernorm)
    f = bind(train, _decode(other)).failure("model.qk_rmsnorm.args")
    assert f is not None and f.tier == SEMANTIC
    assert '"weight": "layers.0.input_layernorm.weight"' in f.train[0] and '"weight": "norm.weight"' in f.rollout[0]


def test_weight_sources_are_the_model_parameters_they_are():
    """Sources come from the parameters' identity in the module the entry point runs on, not from
    Dynamo's mangled input names: a weight of another model (a closure) is not this model's; a
    slice of a stacked weight has no single source (w[0] and w[1] are not both "w"); wrapper
    segments (DDP's module., torch.compile's _orig_mod.) are dropped."""
    from rlk_ops.compile.boundary import inspect_boundary, parameter_names

    m, other = _model(), _model()
    x = torch.randn(3, 4, TINY["head_dim"], dtype=torch.bfloat16)
    norm = m.layers[0].self_attn.q_norm

    def mine(self, x):
        return rlk_ops.qk_rmsnorm(x, self.layers[0].self_attn.q_norm.weight, 1e-6)

    def theirs(self, x):
        return rlk_ops.qk_rmsnorm(x, other.layers[0].self_attn.q_norm.weight, 1e-6)

    stacked = torch.nn.Parameter(torch.stack([norm.weight.detach()] * 2))
    m.register_parameter("stacked", stacked)

    def sliced(self, x):
        return rlk_ops.qk_rmsnorm(x, self.stacked[1], 1e-6)

    def source(fn):
        return inspect_boundary(types.MethodType(fn, m), x, backward=False).forward[0].sources.get("weight")

    assert source(mine) == "layers.0.self_attn.q_norm.weight"
    assert source(theirs).startswith("input:")
    assert source(sliced) is None
    # a lossy round trip or a reordering view is not the same weight (session 32 audit: both bound as
    # "q_norm.weight", with other logits); lossless casts and views in memory order are; a transpose
    # undone keeps its steps in the name (it binds only against the same steps: conservative)
    name = "layers.0.self_attn.q_norm.weight"
    w = (lambda self: self.layers[0].self_attn.q_norm.weight)
    for make, want in (
            (lambda t: t.to(torch.float8_e4m3fn).to(torch.bfloat16), name + ".to(float8_e4m3fn).to(bfloat16)"),
            (lambda t: t.reshape(4, 4).t().reshape(16), name + ".reshape(4, 4).permute(1, 0).reshape(16)"),
            (lambda t: t.reshape(4, 4).transpose(-1, 0).reshape(16), name + ".reshape(4, 4).permute(1, 0).reshape(16)"),
            (lambda t: t.float().to(torch.bfloat16), name),
            (lambda t: t.double().float().to(torch.bfloat16), name),       # widening steps: exact
            (lambda t: t.double().to(torch.float16).to(torch.bfloat16),    # bf16 -> fp16 rounds first
             name + ".to(float64).to(float16).to(bfloat16)"),
            (lambda t: t.reshape(2, 8).contiguous().view(16).clone(), name),
            (lambda t: t.reshape(4, 4).t().t().reshape(16), name + ".reshape(4, 4).permute(1, 0).permute(1, 0)"
                                                                  ".reshape(16)")):
        got = source(lambda self, x, make=make: rlk_ops.qk_rmsnorm(x, make(w(self)), 1e-6))
        assert got == want, (got, want)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner
    names = parameter_names(Wrapper(m))
    assert names[id(norm.weight)] == "layers.0.self_attn.q_norm.weight"


def test_a_side_without_weight_sources_fails_closed(train, rollout):
    """A side file written before the graphs named their parameters (no ``sources``) cannot show
    which weight feeds the q/k norms: norm.weight is unobservable there, and binding fails."""
    old = json.loads(json.dumps(rollout))
    for e in old["entries"]:
        for n in e["graph"]["forward"]:
            n.pop("sources", None)
    result = bind(train, old)
    f = result.failure("layer[0].q_norm.weight")
    assert f is not None and f.tier == SEMANTIC and not result.passed and result.comparable
    assert isinstance(f.rollout, Unobservable) and "no module parameter" in f.rollout.reason


def test_auto_split_kv_on_one_side(train, variants):
    result = bind(train, variants("auto"))
    f = _fails(result, "layer[0].attention.split_kv", SEMANTIC, "disabled", "auto")
    assert "not batch-invariant" in f.detail
    spec = result.failure("ops.paged_attention_auto.determinism")
    assert spec.tier == SEMANTIC and "nondeterministic_bitwise" in spec.detail
    assert result.comparable and not result.passed


def test_fp16_vs_bf16(train, variants):
    result = bind(_given_id(train), variants("fp16"))
    assert result.comparable and not result.passed  # same checkpoint id: comparable, not equal
    _fails(result, "layer[0].attention.dtype", SEMANTIC, "bfloat16", "float16")
    # bound by weight hash instead, fp16 weights are other numbers: not even comparable
    by_hash = bind(train, {**variants("fp16"), "model": {"id": probe.weights_id(_model(dtype=torch.float16)),
                                                          "kind": "weights_sha256"}})
    assert not by_hash.comparable and by_hash.failure("model.id").tier == IDENTICAL


def test_different_tp_degree(train, variants):
    result = bind(_given_id(train), variants("tp2"))
    assert not result.comparable and not result.passed
    _fails(result, "topology.tp", IDENTICAL, 1, 2)
    _fails(result, "topology.head_ownership", IDENTICAL, {"q": [0, 4], "kv": [0, 2]}, {"q": [0, 2], "kv": [0, 1]})
    _fails(result, "layer[0].attention.num_heads", IDENTICAL, 4, 2)


def test_rollout_graph_skips_qk_rmsnorm(train, variants):
    result = bind(train, variants("no_k_norm"))
    assert result.comparable and not result.passed
    _fails(result, "layer[0].k.stages", SEMANTIC, "linear>rmsnorm>rope", "linear>rope")
    _fails(result, "layer[0].k_norm.eps", SEMANTIC, 1e-6, "absent (no RMSNorm on the k path)")
    assert result.failure("layer[0].q.stages") is None  # q still has its norm


def test_fa4_backend_fell_back(variants, rollout):
    side = variants("fa4_fell_back")
    result = bind(side, rollout)
    assert result.comparable and not result.passed
    f = result.failure("layer[0].attention.fallback")
    assert f.tier == SEMANTIC and f.rollout is False
    assert f.train.startswith("requested fa4, ran cpu") and "unavailable" in f.train
    assert result.failure("ops.attention_fwd.fallback").tier == SEMANTIC
    by_name = {x.field: x for x in result.fields}
    assert by_name["layer[0].attention.backend"].train == "fa4->cpu"


def test_different_weights(train, variants):
    result = bind(train, variants("weights"))
    assert not result.comparable and not result.passed
    f = result.failure("model.id")
    assert f.tier == IDENTICAL and f.train != f.rollout and f.rollout.startswith("sha256:")
    assert [x.field for x in result.failures] == ["model.id"]  # the contract itself matches


def test_different_split_size(variants):
    """canonical:C split-KV runs on both sides; the chunk size is part of the contract."""
    train128 = variants("canonical:128/train")
    result = bind(train128, variants("canonical:256/decode"))
    assert result.comparable and not result.passed
    _fails(result, "layer[0].attention.split_kv", SEMANTIC, "canonical:128", "canonical:256")
    _fails(result, "layer[0].attention.split_plan", SEMANTIC, "canonical:128", "canonical:256")
    same = bind(train128, variants("canonical:128/decode"))
    assert same.passed, same.summary()
    strict_single_pass = Mandate(split_kv="disabled")  # a mandate that pins the policy
    f = bind(train128, variants("canonical:128/decode"), strict_single_pass).failure("layer[0].attention.split_kv")
    assert f.status == "violates" and "the mandate is 'disabled'" in f.detail


# ------------------------------------------------------------------ fail closed
def test_configured_never_executed_side_is_unobservable(train):
    configured = probe.describe_side("rollout", [], model_id=train["model"]["id"])
    result = bind(train, configured)
    assert not result.comparable and not result.passed
    f = result.failure("attention.layers")
    assert f.status == "unobservable" and f.tier == IDENTICAL and isinstance(f.rollout, Unobservable)


def test_graph_without_recorded_calls_is_unobservable(train, rollout):
    """A graph that compiled but whose calls were never recorded (provenance dropped)."""
    compiled_only = json.loads(json.dumps(rollout))
    for entry in compiled_only["entries"]:
        entry["provenance"] = []
    result = bind(train, compiled_only)
    assert result.comparable and not result.passed
    for name in ("layer[0].attention.split_plan", "layer[0].attention.reduction_order",
                 "ops.paged_attention.determinism"):
        f = result.failure(name)
        assert f.status == "unobservable" and f.tier == SEMANTIC and "never" in f.detail + str(f.rollout.reason)


def test_plain_pytorch_rollout_does_not_bind(train, variants):
    """The demo's negative control, caught before the first step: no rlk attention."""
    result = bind(train, variants("plain"))
    assert not result.comparable
    _fails(result, "attention.layers", IDENTICAL, 1, 0)


def test_rollout_that_disagrees_with_itself_fails(train, variants):
    """Two entry points of one side that ran different definitions cannot both match."""
    other = {**variants("theta")["entries"][0], "name": "decode (theta 1e4)"}
    mixed = {**variants("decode16"), "entries": variants("decode16")["entries"] + [other]}
    f = bind(train, mixed).failure("layer[0].q_rope.theta")
    assert f.tier == SEMANTIC and f.rollout == {"decode": 1e6, "decode (theta 1e4)": 1e4}


# ------------------------------------------------------------------ environment
def test_probe_reads_the_process():
    env = probe.probe()
    assert env["torch.deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert env["version.torch"] == torch.__version__
    assert {"cuda.matmul.allow_tf32", "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "gpu_arch",
            "cpu_capability", "cuda.matmul.allow_bf16_reduced_precision_reduction"} <= set(env)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not old
        assert probe.probe()["cuda.matmul.allow_tf32"] == (not old)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_environment_blocking_rules():
    cpu = probe.path_of([{"device": "cpu", "actual_backend": "cpu"}])
    gpu = probe.path_of([{"device": "cuda:0", "actual_backend": "fa4"}], tp=2)
    assert probe.blocking("cuda.matmul.allow_tf32", cpu) is None
    assert "CUDA" in probe.blocking("cuda.matmul.allow_tf32", gpu)
    assert probe.blocking("NCCL_ALGO", gpu) and probe.blocking("NCCL_ALGO", probe.path_of(
        [{"device": "cuda:0", "actual_backend": "fa4"}])) is None
    assert probe.blocking("version.flash_attn_4", gpu) and probe.blocking("version.flash_attn_4", cpu) is None
    assert probe.blocking("cpu_capability", cpu) and probe.blocking("version.torch", cpu)
    assert probe.blocking("python", gpu) is None


def test_environment_differences(train, rollout):
    other = json.loads(json.dumps(rollout))
    other["environment"]["cuda.matmul.allow_tf32"] = not other["environment"]["cuda.matmul.allow_tf32"]
    result = bind(train, other)  # a CUDA-only flag on a CPU path: recorded
    assert result.passed, result.summary()
    # fp32 matmul precision changes a CPU matmul's bits too (oneDNN; it was taken for CUDA-only: a
    # session 38 audit), so it blocks on a CPU path
    for key, value in (("torch.float32_matmul_precision", "medium"), ("mkldnn.matmul.fp32_precision", "bf16")):
        odd = json.loads(json.dumps(rollout))
        odd["environment"][key] = value
        f = bind(train, odd).failure(f"env.{key}")
        assert f is not None and f.tier == SEMANTIC and "oneDNN" in f.detail, key
    # oneDNN's own setting is read on the CPU only: a CUDA path records it
    cuda_path = {"devices": ["cuda"], "backends": ["fa4"], "ranks": 1}
    assert probe.blocking("mkldnn.matmul.fp32_precision", cuda_path) is None
    assert probe.blocking("torch.float32_matmul_precision", cuda_path) is not None
    # a version other than this torch's (a fixed "2.11.0+cu130" was this torch's on torch 2.11: session 38)
    version = next(v for v in ("2.11.0+cu130", "2.12.0+cu130") if v != train["environment"]["version.torch"])
    other["environment"]["version.torch"] = version
    f = bind(train, other).failure("env.version.torch")
    assert f.tier == SEMANTIC and f.rollout == version and "blocking" in f.detail
    del other["environment"]["cpu_capability"]
    assert bind(train, other).failure("env.cpu_capability").status == "unobservable"
    # another rlk_ops source under one package version (an editable install keeps its version over commits;
    # session 32 audit: two trees of one version bound)
    assert train["environment"]["source.rlk_ops"] == probe.source_digest() and len(probe.source_digest()) == 16
    other = json.loads(json.dumps(rollout))
    other["environment"]["source.rlk_ops"] = "0" * 16
    f = bind(train, other).failure("env.source.rlk_ops")
    assert f is not None and f.tier == SEMANTIC and "blocking: every path" in f.detail


def test_flashinfer_plan_records_are_normalised():
    recs = [{"policy": "fixed:256", "split_kv": True, "kv_chunk_tokens": 256, "calls": 3},
            {"policy": "disabled", "split_kv": False, "kv_chunk_tokens": None, "calls": 1},
            {"policy": "auto", "plan_info_error": "IndexError: x", "calls": 1}]
    assert [(p["op"], p["plan"]) for p in probe.flashinfer_plans(recs)] == [
        ("paged_attention", "chunks:256"), ("paged_attention", "single_pass"),
        ("paged_attention_auto", "unknown (IndexError: x)")]


# ------------------------------------------------------------------ CLI and demo
def test_cli_check(tmp_path, train, rollout, variants):
    from rlk_ops.__main__ import main

    paths = {}
    for name, side in (("train", train), ("rollout", rollout), ("theta", variants("theta"))):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(side))
    assert main(["check", "--train", str(paths["train"]), "--rollout", str(paths["rollout"])]) == 0
    assert main(["check", "--train", str(paths["train"]), "--rollout", str(paths["theta"])]) == 1
    (tmp_path / "bad.json").write_text("{}")
    assert main(["check", "--train", str(tmp_path / "bad.json"), "--rollout", str(paths["rollout"])]) == 2
    proc = subprocess.run([sys.executable, "-m", "rlk_ops", "check", "--train", str(paths["train"]), "--rollout",
                           str(paths["theta"]), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["comparable"], out["passed"]) == (True, False)
    assert {(f["field"], f["tier"], f["train"], f["rollout"]) for f in out["failures"]} == {
        ("layer[0].q_rope.theta", SEMANTIC, 1e6, 1e4), ("layer[0].k_rope.theta", SEMANTIC, 1e6, 1e4)}


def test_cli_check_refuses_a_side_given_as_the_other(tmp_path, train, rollout, capsys):
    """A rollout description passed as --train once bound against itself and printed PASS."""
    from rlk_ops.__main__ import main

    paths = {name: tmp_path / f"{name}.json" for name in ("train", "rollout")}
    paths["train"].write_text(json.dumps(train))
    paths["rollout"].write_text(json.dumps(rollout))
    assert main(["check", "--train", str(paths["rollout"]), "--rollout", str(paths["rollout"])]) == 2
    assert "describes the 'rollout' side, expected the 'train' side" in capsys.readouterr().err
    bad = tmp_path / "bad_entries.json"
    bad.write_text(json.dumps({**train, "entries": 5}))
    assert main(["check", "--train", str(bad), "--rollout", str(paths["rollout"])]) == 2
    assert "entries must be a list, got int" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["describe", "--side", "train", "--out", "OUT", "--rope-theta", "0"], "rope_theta must be a finite number >= 1"),
    (["describe", "--side", "train", "--out", "OUT", "--rms-norm-eps", "-1"], "rms_norm_eps must be a finite number"),
    (["describe", "--side", "train", "--out", "OUT", "--split-kv", "auto"],
     "split_kv must be 'disabled' or 'canonical:C'"),
    (["describe", "--side", "rollout", "--out", "OUT", "--entries", "bogus"], "--entries must be prefill, decode"),
    (["describe", "--side", "train", "--out", "/nonexistent/x.json"], "the folder /nonexistent does not exist"),
    (["demo", "--json", "/nonexistent/x.json"], "the folder /nonexistent does not exist"),
    (["demo", "--seed", "100000000000000"], "expected an int in [0, 2**32), got 100000000000000"),
    # a side described with tp or cp > 1 states no ownership and never bound (a session 35 audit)
    (["describe", "--side", "train", "--out", "OUT", "--tp", "2"], "--tp 2: describe runs the unsharded demo model"),
    (["describe", "--side", "rollout", "--out", "OUT", "--cp", "2"], "--cp 2: describe runs the unsharded demo"),
    # once a traceback after the whole run (a folder, an empty path) or from the allocator (the page size)
    (["demo", "--json", "DIR"], "is a folder; give a file path in it"),
    (["demo", "--json="], "--json needs a file path, got an empty string"),
    (["describe", "--side", "train", "--out", "DIR"], "is a folder; give a file path in it"),
    (["describe", "--side", "train", "--out="], "--out needs a file path, got an empty string"),
    (["describe", "--side", "rollout", "--out", "OUT", "--page-size", "100000000"],
     "expected a page size in [1, 4096], got 100000000"),
    (["demo", "--page-size", "100000000"], "expected a page size in [1, 4096], got 100000000"),
    # accepted by the option's type, then a StrictModeError / ValueError traceback from the demo
    (["demo", "--split-kv", "auto"], "--split-kv auto: the demo compares rollout with training"),
    (["demo", "--no-strict", "--split-kv", "fixed:256"], "fixed:N and auto are rollout-only lanes"),
    # '' fell back to the weights' sha256 silently (a session 34 audit)
    (["describe", "--side", "train", "--out", "OUT", "--model-id", ""], "--model-id must be a non-empty checkpoint id"),
])
def test_cli_usage_errors_before_any_work(tmp_path, capsys, argv, message):
    from rlk_ops.__main__ import main

    argv = [str(tmp_path / "out.json") if a == "OUT" else str(tmp_path) if a == "DIR" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_model_id_is_refused_not_replaced():
    from rlk_ops.meta import probe
    from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config

    model = TinyQwen3(TinyQwen3Config(num_layers=1))
    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match=r"model_id must be a non-empty string \(a checkpoint id\) or None"):
            probe.describe_train(model, model_id=bad)


@pytest.mark.parametrize("build, message", [
    ("13.0", "--device cuda: no CUDA device is available here"),
    # a CPU build of torch on a GPU machine (what pip may give): said as such (a session 34 audit)
    (None, "--device cuda: this torch (" + torch.__version__ + ") is a CPU build; install a CUDA build"),
])
def test_cli_cuda_without_a_gpu_is_a_usage_error(capsys, monkeypatch, build, message):
    from rlk_ops.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    for argv in (["demo", "--device", "cuda"], ["describe", "--side", "train", "--out", "x.json", "--device", "cuda"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_describe(tmp_path, train):
    from rlk_ops.__main__ import main

    out = tmp_path / "r.json"
    assert main(["describe", "--side", "rollout", "--out", str(out), "--layers", "1", "--entries", "decode",
                 "--page-size", "128"]) == 0
    side = binding.load_side(str(out))
    assert side["side"] == "rollout" and [e["name"] for e in side["entries"]] == ["decode"]
    result = bind(train, side)  # the demo model (hidden 256) vs the tiny one: other weights and heads
    assert not result.comparable and result.failure("model.id")


def test_demo_refuses_to_generate_when_binding_fails(monkeypatch):
    monkeypatch.setattr(Qwen3Attention, "forward_rollout", _forward_rollout_without_k_norm)
    with pytest.raises(rlk_ops.StrictModeError, match=r"(?s)do not bind.*\[SEMANTIC\] layer\[0\]\.k\.stages"):
        from rlk_ops.rollout import demo

        demo.run(layers=1, sequences=2, progress=False, negative_control=False, backward=False)


# ------------------------------------------------------------------ mandate on agreeing sides
# Each pair below agrees with itself field by field, so only the mandate can fail it
# (found by mutation testing: with a mandate check dropped the pair bound).
def _edit(side, fn):
    side = json.loads(json.dumps(side))
    for entry in side["entries"]:
        for node in entry["graph"]["forward"]:
            fn(entry, node)
    return side


def _violates(result, name, text):
    f = result.failure(name)
    assert f is not None, f"{name} did not fail:\n{result.summary()}"
    assert f.status == "violates" and text in f.detail, f.message()
    return f


def test_a_fallback_on_both_sides_is_not_strict(variants):
    side = variants("fa4_fell_back")
    result = bind(side, side)
    assert result.comparable and not result.passed
    _violates(result, "layer[0].attention.fallback", "a fallback is not strict")
    _violates(result, "ops.attention_fwd.fallback", "a fallback is not strict")


def test_head_ownership_must_match_the_graph(variants):
    """A TP rank that states the wrong head range for the heads its graph runs."""
    tp2 = variants("tp2")
    wrong = {**tp2, "topology": {**tp2["topology"], "head_ownership": {"q": [0, 4], "kv": [0, 2]}}}
    result = bind(wrong, wrong)
    assert not result.comparable
    _violates(result, "topology.head_ownership", "owns 4 q / 2 kv heads but the graph runs 2 / 1")


def test_two_plain_pytorch_sides_do_not_bind(variants):
    result = bind(variants("plain"), variants("plain"))
    assert not result.comparable and not result.passed
    _violates(result, "attention.layers", "no rlk attention op in the graph")


def test_both_sides_without_k_norm_is_not_qwen3(variants):
    result = bind(variants("no_k_norm"), variants("no_k_norm"))
    assert result.comparable and not result.passed
    _violates(result, "layer[0].k.stages", "the Qwen3 path is 'linear>rmsnorm>rope'")
    assert result.failure("layer[0].q.stages") is None


def test_a_split_plan_that_contradicts_the_policy_fails(train, variants):
    """Both sides' backends recorded a chunked plan under split_kv 'disabled'."""
    plan = {"backend": "flashinfer", "policy": "disabled", "plan": "chunks:256"}
    a = {**train, "plans": [{**plan, "op": "attention_fwd"}]}
    b = {**variants("decode16"), "plans": [{**plan, "op": "paged_attention"}]}
    result = bind(a, b)
    _violates(result, "layer[0].attention.split_plan", "policy 'disabled' means plan 'single_pass'")


def test_scale_spellings_equal_in_float32_bind():
    """1 / math.sqrt(d) and d ** -0.5 differ in a double's last bit at d = 32 (also 96, 128), but every kernel
    scales in float32, where they are one number, and the logits are bitwise equal. Binding compared the
    doubles: FAIL, and even two such sides "violated" the mandate (session 32 audit). A scale that differs
    in float32 still fails."""
    import math
    d = 32
    assert d ** -0.5 != 1 / math.sqrt(d)

    def rescale(value):
        def edit(entry, node):
            if "softmax_scale" in node["args"]:
                node["args"]["softmax_scale"] = value
        return edit

    m = _model(head_dim=d)
    train, rollout = probe.describe_train(m, backward=False), _decode(m)
    megatron = _edit(train, rescale(1 / math.sqrt(d)))
    result = bind(megatron, rollout)
    assert result.passed, result.summary()
    assert bind(megatron, megatron).passed
    field = next(f for f in result.fields if f.field == "layer[0].attention.softmax_scale")
    assert field.train == field.rollout == torch.tensor(d ** -0.5, dtype=torch.float32).item()
    moved = field.rollout * (1 + 2 ** -20)   # a few float32 ulps away
    off = _edit(train, rescale(moved))
    _fails(bind(off, rollout), "layer[0].attention.softmax_scale", SEMANTIC,
           torch.tensor(moved, dtype=torch.float32).item(), field.rollout)


def test_scale_causal_and_recompiles_are_checked_on_agreeing_sides(train):
    def scale(entry, node):
        if "softmax_scale" in node["args"]:
            node["args"]["softmax_scale"] = 0.3  # head_dim 16: the mandate is 0.25

    def not_causal(entry, node):
        if "causal" in node["args"]:
            node["args"]["causal"] = 0

    def recompiled(entry, node):
        entry["graph"]["recompiles"] = 1

    side = _edit(train, scale)
    _violates(bind(side, side), "layer[0].attention.softmax_scale", "head_dim ** -0.5")
    side = _edit(train, not_causal)
    _violates(bind(side, side), "layer[0].attention.causal", "the mandate is causal True")
    _fails(bind(train, side), "layer[0].attention.causal", SEMANTIC, True, False)
    side = _edit(train, recompiled)
    _violates(bind(side, side), "graph.recompiles", "not analysed")


def test_dtype_the_strict_kernels_do_not_cover(variants):
    side = _decode(_model(dtype=torch.float64))
    result = bind(side, side)
    assert result.comparable and not result.passed
    _violates(result, "layer[0].attention.dtype", "not a dtype the strict kernels cover")
    mandate = Mandate.from_contract(AttentionContract(dtype="bfloat16", head_dim=16))
    _violates(bind(variants("fp16"), variants("fp16"), mandate), "layer[0].attention.dtype", "the mandate is bfloat16")


def test_mandate_from_contract_pins_split_kv(train, rollout):
    mandate = Mandate.from_contract(AttentionContract(split_kv="canonical:128", head_dim=16))
    result = bind(train, rollout, mandate)
    assert result.comparable and not result.passed
    _violates(result, "layer[0].attention.split_kv", "the mandate is 'canonical:128'")


def test_forward_attention_spec_must_claim_prefill_decode_invariance(train, rollout, monkeypatch):
    """A forward attention op whose backend spec leaves prefill/decode invariance open
    (None) is not strict, even though nothing says False."""
    import dataclasses

    from rlk_ops.meta.specs import REGISTRY, DeterminismSpec

    spec = REGISTRY["paged_attention"]
    monkeypatch.setitem(REGISTRY, "paged_attention", dataclasses.replace(
        spec, backends={**spec.backends, "cpu": DeterminismSpec(True, True, None)}))
    result = bind(train, rollout)
    _violates(result, "ops.paged_attention.determinism", "prefill_decode_invariant must be True")


def test_flashinfer_decode_does_not_bind_to_training(train, variants):
    """What a rollout decoding with FlashInfer records: its spec says the decode bits are
    not attention_fwd's (prefill_decode_invariant False), so the op fails on its own."""
    side = json.loads(json.dumps(variants("decode16")))
    for entry in side["entries"]:
        for r in entry["provenance"]:
            if r["op"] == "paged_attention":
                r["requested_backend"] = r["actual_backend"] = "flashinfer"
    result = bind(train, side)
    f = result.failure("ops.paged_attention.determinism")
    assert f is not None and "prefill_decode_invariant" in f.detail, result.summary()


def test_a_cuda_flag_blocks_when_either_side_ran_on_cuda(train, rollout):
    other = json.loads(json.dumps(rollout))
    for entry in other["entries"]:
        for r in entry["provenance"]:
            r["device"] = "cuda:0"
    other["environment"]["cuda.matmul.allow_tf32"] = not train["environment"]["cuda.matmul.allow_tf32"]
    for a, b in ((train, other), (other, train)):
        f = bind(a, b).failure("env.cuda.matmul.allow_tf32")
        assert f is not None and f.tier == SEMANTIC and "blocking" in f.detail


def test_an_entry_point_that_ran_nothing_fails_its_side(train, variants):
    """A rollout side whose second entry point compiled nothing cannot borrow the first
    entry point's values for fields it never showed."""
    idle = {"name": "idle", "graph": None, "provenance": []}
    side = {**variants("decode16"), "entries": variants("decode16")["entries"] + [idle]}
    result = bind(train, side)
    assert not result.passed
    f = result.failure("layer[0].attention.split_kv")
    assert f is not None and f.rollout == {"decode": "disabled", "idle": "missing"}, result.summary()


def test_load_side_checks_the_format(tmp_path, train):
    path = tmp_path / "side.json"
    path.write_text(json.dumps({**train, "format": "something/else"}))
    with pytest.raises(ValueError, match="format must be 'rlk_ops.binding.side/1'"):
        binding.load_side(str(path))


@pytest.mark.parametrize("key", ["inputs", "outputs"])
def test_an_attention_node_without_its_tensors_is_named(tmp_path, train, rollout, key):
    """bind reads an attention node's q and k inputs and its lse output: an empty list was an
    IndexError from inside bind (exit 1, a failed binding, from the CLI)."""
    from rlk_ops.__main__ import main

    def emptied(side):
        out = json.loads(json.dumps(side))
        nodes = out["entries"][0]["graph"]["forward"]
        j = next(i for i, n in enumerate(nodes) if n["op"].split("::")[1] in binding.ATTENTION_OPS)
        nodes[j][key] = []
        return out, j

    for which, (bad, j) in (("training", emptied(train)), ("rollout", emptied(rollout))):
        pair = (bad, rollout) if which == "training" else (train, bad)
        with pytest.raises(binding.SideFormatError, match=rf"the {which} side: entries\[0\].graph.forward\[{j}\] "
                                                          rf"\(rlk::\w+\) must be an attention node with q, k inputs"):
            bind(*pair)
    (tmp_path / "bad.json").write_text(json.dumps(emptied(train)[0]))
    (tmp_path / "rollout.json").write_text(json.dumps(rollout))
    assert main(["check", "--train", str(tmp_path / "bad.json"), "--rollout", str(tmp_path / "rollout.json")]) == 2


def _malformed(side, path, value):
    """A deep copy of ``side`` with ``path`` (keys and indices) set to ``value`` (None: deleted)."""
    out = json.loads(json.dumps(side))
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize("path,value,message", [
    (("entries", 0, "graph", "forward"), None, r"entries\[0\].graph.forward must be a list, got NoneType"),
    (("entries", 0, "provenance", 0, "device"), None, r"entries\[0\].provenance\[0\] must be an object with op, "
                                                       r"device"),
    (("entries", 0, "graph", "forward", 0, "args"), None, r"entries\[0\].graph.forward\[0\] must be a node object"),
    (("entries", 0), "attention", r"entries\[0\] must be an object, got str 'attention'"),
    (("model",), "m", r"model must be an object, got str 'm'"),
    (("topology",), "tp=1", r"topology must be an object, got str"),
    (("environment",), [1], r"environment must be an object, got list \[1\]"),
    # bind reads these too: a KeyError, IndexError or AttributeError from inside bind before
    (("entries", 0, "graph", "forward", 0, "producers"), None, r"entries\[0\].graph.forward\[0\] must be a node"),
    (("entries", 0, "graph", "forward", 0, "outputs"), None, r"entries\[0\].graph.forward\[0\] must be a node"),
    (("entries", 0, "graph", "forward", 1, "producers", "x"), [99, 0],
     r"entries\[0\].graph.forward\[1\].producers.x must be null or a \[node index < \d+, output index 0..63\] pair"),
    (("entries", 0, "provenance", 0, "fallback"), None, r"entries\[0\].provenance\[0\] must be an object with "),
    (("entries", 0, "provenance", 0, "kernel"), [1], r"entries\[0\].provenance\[0\].kernel must be a string or "
                                                     r"null, got list \[1\]"),
    (("plans",), ["x"], r"plans\[0\] must be an object with plan, got str 'x'"),
    (("entries", 0, "graph", "forward", 0, "sources"), {"weight": 3},
     r"entries\[0\].graph.forward\[0\].sources must be an object of tensor argument -> source name"),
    # session 32 audit: each of these crashed bind (TypeError, IndexError, KeyError) or looped forever
    (("entries", 0, "provenance", 0, "device"), ["cpu"], r"entries\[0\].provenance\[0\].device must be a string, "
                                                         r"got list \['cpu'\]"),
    (("entries", 0, "provenance", 0, "op"), 0, r"entries\[0\].provenance\[0\].op must be a string, got int 0"),
    (("entries", 0, "provenance", 0, "fallback"), "no", r"entries\[0\].provenance\[0\].fallback must be a bool"),
    (("plans",), [{"plan": ["x"]}], r"plans\[0\].plan must be a string, got list"),
    (("entries", 0, "name"), ["train"], r"entries\[0\].name must be a string or null, got list"),
    (("topology", "tp"), "1", r"topology.tp must be an int >= 1, got str '1'"),
    (("entries", 0, "graph", "forward", 1, "producers", "x"), [1, 0],
     r"entries\[0\].graph.forward\[1\].producers.x must be null or a \[node index < 1, output index 0..63\] pair"),
    (("entries", 0, "graph", "forward", 0, "index"), 5,
     r"entries\[0\].graph.forward\[0\].index must be its position in the list \(0\), got int 5"),
    (("entries", 0, "graph", "forward", 0, "args", "extra"), {"a": 1},
     r"entries\[0\].graph.forward\[0\].args.extra must be a number, string, null or a list of them"),
    # session 34 audit: these bound
    (("entries", 0, "graph", "graph_breaks"), -1, r"entries\[0\].graph.graph_breaks must be an int >= 0, got int -1"),
    (("entries", 0, "graph", "recompiles"), True, r"entries\[0\].graph.recompiles must be an int >= 0, got bool"),
    # session 35 audit: these bound (the same NaN on both sides compared equal; an output index of 10**30; an
    # empty list of run counts summed to 0 reruns)
    (("entries", 0, "graph", "forward", 0, "args", "extra"), float("nan"),
     r"entries\[0\].graph.forward\[0\].args.extra must be finite \(no op records NaN or an infinity\)"),
    (("entries", 0, "graph", "forward", 0, "args", "extra"), [1.0, float("inf")],
     r"entries\[0\].graph.forward\[0\].args.extra must be finite"),
    (("entries", 0, "graph", "forward", 1, "producers", "x"), [0, 10 ** 30],
     r"entries\[0\].graph.forward\[1\].producers.x must be null or a \[node index < 1, output index 0..63\]"),
    (("entries", 0, "graph", "graph_runs"), {"forward": [], "backward": []},
     r"entries\[0\].graph.graph_runs.forward must be a run count for each of the 1 compiled graphs, got list \[\]"),
])
def test_malformed_side_descriptions_are_named(tmp_path, train, rollout, path, value, message):
    """Each of these once raised a bare KeyError / AttributeError / TypeError from inside bind,
    and the CLI printed a traceback with exit 1, the code of a binding that failed."""
    from rlk_ops.__main__ import main

    bad = _malformed(train, path, value)
    with pytest.raises(binding.SideFormatError, match="the training side: " + message):
        bind(bad, rollout)
    with pytest.raises(binding.SideFormatError, match="the rollout side: " + message):
        bind(train, _malformed(rollout, path, value))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "rollout.json").write_text(json.dumps(rollout))
    assert main(["check", "--train", str(tmp_path / "bad.json"), "--rollout", str(tmp_path / "rollout.json")]) == 2


@pytest.mark.parametrize("edit,message", [
    (lambda n: n["inputs"].__setitem__(0, "bfloat16"), r"inputs\[0\] must be a tensor description 'dtype\[d0x...\]'"),
    (lambda n: n["args"].__setitem__("causal", "0"), r"args.causal must be a bool or 0 / 1, got str '0'"),
    (lambda n: n["outputs"].__setitem__(1, 7), r"must be a node object"),
])
def test_malformed_attention_nodes_are_named(train, rollout, edit, message):
    """An attention node's q description without a shape was an IndexError inside bind; causal "0" bound as
    causal (bool("0") is True) (session 32 audit)."""
    for side, name in ((train, "training"), (rollout, "rollout")):
        bad = json.loads(json.dumps(side))
        nodes = bad["entries"][0]["graph"]["forward"]
        j = next(i for i, n in enumerate(nodes) if "attention" in n["op"])
        edit(nodes[j])
        pair = (bad, rollout) if name == "training" else (train, bad)
        with pytest.raises(binding.SideFormatError, match=rf"the {name} side: entries\[0\].graph.forward\[{j}\]"
                                                          rf"(\.| )" + message):
            bind(*pair)


@pytest.mark.parametrize("op,arg", [("rlk::rope", "theta"), ("rlk::rope", "rotary_dim"), ("rlk::qk_rmsnorm", "eps")])
def test_rope_and_norm_nodes_need_their_scalars(train, op, arg):
    """A rope or norm node without the scalar binding compares was a KeyError inside bind (session 32 audit)."""
    bad = json.loads(json.dumps(train))
    nodes = bad["entries"][0]["graph"]["forward"]
    j = next(i for i, n in enumerate(nodes) if n["op"] == op)
    del nodes[j]["args"][arg]
    with pytest.raises(binding.SideFormatError, match=rf"entries\[0\].graph.forward\[{j}\].args must be an object "
                                                      rf"with .*{arg}.* \({op}\)"):
        bind(bad, train)


# ------------------------------------------------ what the analysed graphs do not show (session 32 audit)
def test_rlk_calls_outside_the_analysed_graphs_fail_closed(train, monkeypatch):
    """An input norm run under torch.compiler.disable (eps 0.1 on the rollout) appears in no graph: its
    calls were recorded, never analysed, and the pair bound while the logits differed."""
    from rlk_ops.rollout import model as M

    m = _model()
    ln = m.layers[0].input_layernorm
    ln.forward = torch.compiler.disable(types.MethodType(M._RMSNorm.forward, ln))
    ln.eps = 0.1
    result = bind(train, _decode(m))
    f = result.failure("graph.outside_calls")
    assert f is not None and f.tier == SEMANTIC and f.rollout == {"rlk::qk_rmsnorm": 1}, result.summary()
    assert "outside the analysed graphs" in f.detail
    assert bind(train, train).failure("graph.outside_calls") is None


def test_a_graph_reused_across_frames_fails_closed(train, monkeypatch):
    """A graph break in shared code (the MLP): Dynamo compiles the norm's frame once and reuses its graph for
    the later norms, whose weights the report never names (a final norm taking another layer's weight bound)."""
    from rlk_ops.rollout import model as M

    mlp = M._MLP.forward

    def with_break(self, x):
        torch._dynamo.graph_break()
        return mlp(self, x)
    monkeypatch.setattr(M._MLP, "forward", with_break)
    side = _decode(_model())
    runs = side["entries"][0]["graph"]["graph_runs"]["forward"]
    assert max(runs) > 1, runs
    f = bind(train, side).failure("graph.reruns")
    assert f is not None and f.rollout == sum(r - 1 for r in runs if r > 1) and "ran more than once" in f.detail


def test_a_graph_that_is_not_the_eager_computation_fails(train, monkeypatch):
    """The engine and the rescore run the entry points eagerly; binding analyses a compiled trace. A rollout
    whose eager path differs from its traced one (a branch on torch.compiler.is_compiling(), RoPE theta
    1e4 when eager) bound with the traced branch's values."""
    import dataclasses

    orig = Qwen3Attention.forward_rollout

    def forward_rollout(self, *args, **kw):
        if torch.compiler.is_compiling():
            return orig(self, *args, **kw)
        saved = self.config
        self.config = dataclasses.replace(saved, rope_theta=1e4)
        try:
            return orig(self, *args, **kw)
        finally:
            self.config = saved
    monkeypatch.setattr(Qwen3Attention, "forward_rollout", forward_rollout)
    side = _decode(_model())
    _fails(bind(train, side), "graph.eager_equal", SEMANTIC, True, False)


def test_side_files_without_run_counts_fail_closed(train, rollout):
    """graph_runs, outside_calls and eager_equal are written since session 32: a side file without them
    cannot show that its graphs are what ran, so those fields are UNOBSERVABLE."""
    old = json.loads(json.dumps(rollout))
    for e in old["entries"]:
        for key in ("graph_runs", "outside_calls", "eager_equal"):
            del e["graph"][key]
    result = bind(train, old)
    for name in ("graph.reruns", "graph.outside_calls", "graph.eager_equal"):
        f = result.failure(name)
        assert f is not None and f.status == "unobservable" and "before session 32" in f.detail, name
    assert bind(train, rollout).passed


def test_a_path_cut_by_a_graph_break_is_unobservable_not_absent(train, monkeypatch):
    """A graph break between RoPE and the cache append (same numbers): the q/k paths in the attention's graph
    start at graph inputs. They were reported as having no RMSNorm and no RoPE ("absent"); the norm and
    RoPE ran in the graph before the break, so the fields are UNOBSERVABLE."""
    def with_break(self, hidden_states, positions, k_cache, v_cache, page_table, seq_lens, slot_mapping,
                   return_attention=False):
        b, sq, hidden = hidden_states.shape
        q, k, v = self._qkv(hidden_states.reshape(b * sq, hidden), positions.reshape(b * sq))
        torch._dynamo.graph_break()
        rlk_ops.paged_kv_append(k_cache, v_cache, k.detach(), v.detach(), slot_mapping, page_table, seq_lens,
                                positions)
        attn, lse = rlk_ops.paged_attention(q.reshape(b, sq, *q.shape[1:]), k_cache, v_cache, page_table,
                                            seq_lens, split_kv=self.config.split_kv)
        out = rlk_ops.linear(attn.reshape(b * sq, -1), self.o_proj.weight).reshape(b, sq, hidden)
        return (out, attn, lse) if return_attention else out
    monkeypatch.setattr(Qwen3Attention, "forward_rollout", with_break)
    result = bind(train, _decode(_model()))
    for name in ("layer[0].q_norm.eps", "layer[0].k_rope.theta", "layer[0].q.stages"):
        f = result.failure(name)
        assert f is not None and f.status == "unobservable" and "graph break" in f.detail, (name, result.summary())


def test_eager_comparison_follows_output_trees_state_and_gradients():
    """The eager run behind graph.eager_equal (session 32 review): outputs in a dict or nested tuple were
    not compared at all (equal by default); a non-leaf tensor argument crashed the copy; a buffer the
    forward updates was left updated and the RNG advanced, so a correct entry compared unequal; and a
    backward that differs when compiled went unseen."""
    from rlk_ops.compile.boundary import eager_outputs, inspect_boundary

    w = torch.nn.Parameter(torch.ones(8))

    def branchy(x):
        eps = 1e-6 if torch.compiler.is_compiling() else 0.5
        return {"y": rlk_ops.qk_rmsnorm(x, w.detach(), eps)}, (x.sum(),)

    x = torch.randn(3, 2, 8)
    report = inspect_boundary(branchy, x, backward=False, eager=eager_outputs(branchy, (x,)))
    assert report.eager_equal is False
    same = inspect_boundary(lambda t: {"y": rlk_ops.qk_rmsnorm(t, w.detach(), 1e-6)}, x, backward=False,
                            eager=eager_outputs(lambda t: {"y": rlk_ops.qk_rmsnorm(t, w.detach(), 1e-6)}, (x,)))
    assert same.eager_equal is True and same.eager_note == "outputs"

    class Stepper(torch.nn.Module):   # a buffer updated in forward, and a draw from the global RNG
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))
            self.register_buffer("step", torch.zeros((), dtype=torch.int64))

        def forward(self, t):
            self.step += 1
            return rlk_ops.qk_rmsnorm(t + torch.rand(t.shape), self.w, 1e-6) * self.step

    m = Stepper()
    nonleaf = torch.randn(3, 2, 8, requires_grad=True) * 2       # deepcopy refuses non-leaf tensors
    report = inspect_boundary(m, nonleaf, backward=True, eager=eager_outputs(m, (nonleaf,), backward=True))
    assert report.eager_equal is True and report.eager_note == "outputs and parameter gradients"
    assert int(m.step) == 1                                      # the eager run's update was undone

    class Grad(torch.autograd.Function):   # the backward differs when compiled
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * (2 if torch.compiler.is_compiling() else 3)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))

        def forward(self, t):
            return Grad.apply(rlk_ops.qk_rmsnorm(t, self.w, 1e-6))

    m = Twice()
    report = inspect_boundary(m, x, backward=True, eager=eager_outputs(m, (x,), backward=True))
    assert report.eager_equal is False and report.eager_note == "outputs and parameter gradients"
    import threading

    class Engine:   # an argument deepcopy refuses: not compared, and binding says why
        lock = threading.Lock()

        def __init__(self):
            self.lock = threading.Lock()
    run = eager_outputs(lambda t, e: rlk_ops.qk_rmsnorm(t, w.detach(), 1e-6), (x, Engine()))
    assert run.skipped and "could not be copied" in run.skipped


def test_graph_runs_of_zero_and_mandate_policy_spelling(train, rollout):
    """A reported graph that never ran is not the call's evidence either; a mandate's split_kv has one
    spelling, checked when the mandate is made (session 32 review)."""
    side = json.loads(json.dumps(rollout))
    side["entries"][0]["graph"]["graph_runs"]["forward"] = [0]
    f = bind(train, side).failure("graph.reruns")
    assert f is not None and "or not at all" in f.detail
    assert Mandate(split_kv="canonical").split_kv == "canonical:768"
    with pytest.raises(ValueError, match=r"Mandate.split_kv: split_kv must be 'disabled', .* got 'disabled '"):
        Mandate(split_kv="disabled ")
    with pytest.raises(ValueError, match=r"Mandate.split_kv: split_kv must be written 'canonical:768'"):
        Mandate(split_kv="canonical:0768")


def test_eager_comparison_keeps_the_callers_state():
    """Second review of session 32: a forward that rebinds a buffer kept the eager run's tensor; an argument
    that is a parameter of the model was deep-copied, so its gradient went to the copy; grad mode was
    forced rather than the caller's; gradients held before the call left them unchecked; and with dynamic
    shapes a backward graph compiled with the forward but never run counted as a rerun."""
    from functools import partial

    from rlk_ops.compile.boundary import eager_outputs, inspect_boundary

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))
            self.register_buffer("step", torch.zeros((), dtype=torch.int64))

        def forward(self, t, extra=None):
            self.step = self.step + 1                      # rebinds the buffer
            y = rlk_ops.qk_rmsnorm(t, self.w, 1e-6) * self.step
            return y if extra is None else y * extra

    m = Counter()
    x = torch.randn(3, 2, 8)
    m.w.grad = torch.full((8,), 0.5)                       # a gradient held from before
    held = m.w.grad
    report = inspect_boundary(m, x, m.w, backward=True, eager=eager_outputs(m, (x, m.w), backward=True))
    assert report.eager_equal is True and report.eager_note == "outputs and parameter gradients"
    assert int(m.step) == 1 and m.w.grad is held            # the eager run's step undone; accumulated in place
    fresh = Counter()
    fresh.forward(x, fresh.w).float().sum().backward()
    assert torch.equal(m.w.grad, torch.full((8,), 0.5) + fresh.w.grad)
    with torch.no_grad():                                  # the caller's grad mode, both runs
        report = inspect_boundary(partial(Counter.forward, Counter()), x, backward=True,
                                  eager=eager_outputs(partial(Counter.forward, Counter()), (x,), backward=True))
    assert report.eager_equal is True and report.eager_note == "outputs"
    y = torch.randn(5, 2, 8)
    torch._dynamo.mark_dynamic(y, 0)
    entry = probe.run_entry("dyn", Counter(), y, backward=False)
    assert entry["graph"]["graph_runs"]["backward"] == [] and entry["graph"]["backward"] == []


def test_bind_judges_every_probe_key_and_needs_causal(train, rollout):
    """A blocking environment key dropped from both files was never judged and bound; an attention_fwd
    node without causal bound as causal (a session 35 audit: its schema always records it)."""
    for key in ("version.torch", "source.rlk_ops", "cpu_capability"):
        a, b = json.loads(json.dumps(train)), json.loads(json.dumps(rollout))
        del a["environment"][key], b["environment"][key]
        res = bind(a, b)
        assert not res.passed and f"env.{key}" in {f.field for f in res.failures}, key
    assert bind(train, rollout).passed
    bad = json.loads(json.dumps(train))
    nodes = bad["entries"][0]["graph"]["forward"]
    j = next(i for i, n in enumerate(nodes) if n["op"] == "rlk::attention_fwd")
    del nodes[j]["args"]["causal"]
    with pytest.raises(binding.SideFormatError, match=rf"the training side: entries\[0\].graph.forward\[{j}\].args "
                                                      rf"must be an object with causal \(rlk::attention_fwd\)"):
        bind(bad, rollout)


def test_cli_check_json_is_strict_and_refusals_answer(tmp_path, train, rollout, capsys):
    """check --json printed Infinity for a scale the binding read as float32 inf (1e39), and a refused
    file printed nothing on stdout; a file nested too deeply was a RecursionError traceback, exit 1."""
    from rlk_ops.__main__ import main

    t, r = tmp_path / "t.json", tmp_path / "r.json"
    t.write_text(json.dumps(train))
    big = json.loads(json.dumps(rollout))
    for e in big["entries"]:
        for n in e["graph"]["forward"] if e.get("graph") else []:
            if "softmax_scale" in n["args"]:
                n["args"]["softmax_scale"] = 1e39
    r.write_text(json.dumps(big))
    assert main(["check", "--train", str(t), "--rollout", str(r), "--json"]) == 1
    out = capsys.readouterr().out
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert main(["check", "--train", str(t), "--rollout", str(deep), "--json"]) == 2
    captured = capsys.readouterr()
    assert "nested too deeply" in captured.err and "nested too deeply" in json.loads(captured.out)["refused"]


def test_cli_check_names_a_side_file_that_is_not_json(tmp_path, train, capsys):
    """Text that is not JSON, or not UTF-8, was refused as 'check: Expecting value: line 1 column 1', naming
    neither the file nor the flag (a session 38 audit)."""
    from rlk_ops.__main__ import main

    t = tmp_path / "t.json"
    t.write_text(json.dumps(train))
    for name, data in (("abc.json", b"abc\n"), ("ff.json", b"\xff")):
        bad = tmp_path / name
        bad.write_bytes(data)
        assert main(["check", "--train", str(t), "--rollout", str(bad)]) == 2
        assert f"{bad}: not a side description (not JSON text: " in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--sequences", "100000000000000000000"], "expected a sequence count in [1, 4096], got 1000"),
    (["demo", "--layers", "257"], "expected a layer count in [1, 256], got 257"),
    (["describe", "--side", "rollout", "--out", "x.json", "--layers", "100000000000000000000"],
     "expected a layer count in [1, 256], got 1000"),
])
def test_cli_sizes_past_the_demo_models_are_usage_errors(capsys, argv, message):
    """A huge --sequences or --layers reached the allocator: a MemoryError traceback with exit 1, the code
    for 'rollout and training disagree' (a session 38 audit)."""
    from rlk_ops.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_probe_reads_fp32_precision_set_through_the_newer_api():
    """After torch.backends.mkldnn.matmul.fp32_precision is set, torch.get_float32_matmul_precision() raises
    (the legacy and new APIs mixed): the probe, and so describe and demo, crashed on the very setting it
    blocks (a session 38 review). In a subprocess: the setting is process-wide."""
    code = ("import torch; torch.backends.mkldnn.matmul.fp32_precision = 'bf16'\n"
            "from rlk_ops.meta import probe; p = probe.probe()\n"
            "print(p['mkldnn.matmul.fp32_precision'], p['torch.float32_matmul_precision'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "bf16", out.stdout
