"""Checks that a session 40 mutation-testing pass over meta/packing.py, meta/specs.py, meta/drift.py,
rollout/plain.py, rollout/demo.py, __main__.py, ops/paged_attention*.py, ops/_library.py and
compile/examples.py found missing: each test failed on a deliberate breakage that the rest of the
suite let through (and passes on the real code)."""
import io
import json

import pytest
import torch

import rlk_ops
from rlk_ops.meta import packing, provenance
from rlk_ops.meta.drift import bits_differ, drift_stats
from rlk_ops.meta.specs import REGISTRY, spec


# ------------------------------------------------------------------ __main__: inspect's exit code
def _small_block_class(kind="clean"):
    """A small Qwen3Attention (fast to trace) standing in for the CLI's default 8B shard; ``break``
    puts a graph break after the attention in both entry points."""
    from rlk_ops.compile import Qwen3Attention

    class Small(Qwen3Attention):
        def __init__(self):
            super().__init__(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)

        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            if kind == "break":
                torch._dynamo.graph_break()
            return out

        def forward_rollout(self, *a, **k):
            out = super().forward_rollout(*a, **k)
            if kind == "break":
                torch._dynamo.graph_break()
            return out

    return Small


@pytest.mark.parametrize("kind, code", [("clean", 0), ("break", 1)])
def test_inspect_cli_exits_1_on_a_graph_break(monkeypatch, capsys, kind, code):
    """``python -m rlk_ops inspect`` must exit 1 when the compiled graph has a graph break: no test
    reached that path (with ``graph_breaks == 0`` dropped from the verdict the CLI exited 0 on a
    broken graph)."""
    import rlk_ops.compile as compile_pkg
    from rlk_ops.__main__ import main

    monkeypatch.setattr(compile_pkg, "Qwen3Attention", _small_block_class(kind))
    assert main(["inspect"]) == code
    out = capsys.readouterr().out
    assert "== Qwen3Attention training graph (hidden 64" in out and "== Qwen3Attention decode graph" in out


class _Report:
    """A stand-in boundary report: only the fields ``_inspect``'s verdict and printing read."""

    def __init__(self, **bad):
        self.graph_breaks, self.skipped_frames, self.leaks, self.outside_calls = 0, 0, [], {}
        for k, v in bad.items():
            setattr(self, k, v)

    def table(self, title):
        return title


@pytest.mark.parametrize("entry", ["training", "decode"])
@pytest.mark.parametrize("bad", [{"graph_breaks": 1}, {"skipped_frames": 1}, {"leaks": ["aten.mul"]},
                                 {"outside_calls": {"rlk::linear": 1}}, {}])
def test_inspect_cli_verdict_reads_every_failure(monkeypatch, capsys, entry, bad):
    """Each of a graph break, a skipped frame, a leak and an rlk call outside the graphs, in either
    entry point's report, makes ``inspect`` exit 1; a clean pair exits 0. ``--json`` prints the JSON."""
    import rlk_ops.compile as compile_pkg
    import rlk_ops.compile.boundary as boundary
    from rlk_ops.__main__ import main

    def fake_inspect(fn, *args, **kwargs):
        name = "decode" if getattr(fn, "__name__", "") == "forward_rollout" else "training"
        return _Report(**(bad if name == entry else {}))

    monkeypatch.setattr(compile_pkg, "Qwen3Attention", _small_block_class())
    monkeypatch.setattr(compile_pkg, "inspect_boundary", fake_inspect)
    monkeypatch.setattr(boundary, "dumps", lambda reports: json.dumps(sorted(reports)))
    assert main(["inspect"]) == (1 if bad else 0)
    assert "== Qwen3Attention training graph" in capsys.readouterr().out
    assert main(["inspect", "--json"]) == (1 if bad else 0)
    assert json.loads(capsys.readouterr().out) == ["decode", "training"]


# ------------------------------------------------------------------ __main__: argument types and plumbing
def test_cli_argument_types_at_their_bounds():
    import argparse

    from rlk_ops.__main__ import MAX_LAYERS, MAX_PAGE_SIZE, _at_most, _page_size, _seed

    assert _seed("0") == 0 and _seed(str(2 ** 32 - 1)) == 2 ** 32 - 1
    for bad in (str(2 ** 32), "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an int in \[0, 2\*\*32\)"):
            _seed(bad)
    assert _at_most(MAX_LAYERS, "a layer count")(str(MAX_LAYERS)) == MAX_LAYERS
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a layer count in \[1, 256\], got 257"):
        _at_most(MAX_LAYERS, "a layer count")("257")
    assert _page_size(str(MAX_PAGE_SIZE)) == MAX_PAGE_SIZE
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a page size in \[1, 4096\], got 4097"):
        _page_size("4097")


@pytest.fixture
def fake_demo(monkeypatch):
    """demo.run / summary / exit_code replaced: what the CLI passes, and what it returns."""
    from rlk_ops.rollout import demo

    seen = {}

    def run(**kwargs):
        seen.update(kwargs, strict=rlk_ops.strict_mode())
        return {"fake": True}

    monkeypatch.setattr(demo, "run", run)
    monkeypatch.setattr(demo, "summary", lambda report: "SUMMARY")
    monkeypatch.setattr(demo, "exit_code", lambda report: seen.get("code", 3))
    yield seen
    rlk_ops.set_strict_mode(True)


def test_demo_cli_passes_its_options_and_returns_the_reports_exit_code(fake_demo, capsys, tmp_path):
    from rlk_ops.__main__ import main

    assert main(["demo"]) == 3   # INCONCLUSIVE is not folded into 1 or 0
    assert "SUMMARY" in capsys.readouterr().out
    # the defaults: chunk 96 (not a multiple of 128), disabled split-KV, progress on, backward on, strict
    assert fake_demo == dict(device="cpu", layers=2, sequences=8, split_kv="disabled", chunk=96, page_size=16,
                             max_running=4, seed=0, greedy=False, backward=True, progress=True, compile=False,
                             hf_model=None, strict=True)
    fake_demo.clear()
    assert main(["demo", "--layers", "3", "--sequences", "5", "--split-kv", "canonical:256", "--chunk", "40",
                 "--page-size", "8", "--max-running", "2", "--seed", "7", "--greedy", "--compile", "--no-backward",
                 "--no-strict", "--quiet"]) == 3
    assert fake_demo == dict(device="cpu", layers=3, sequences=5, split_kv="canonical:256", chunk=40, page_size=8,
                             max_running=2, seed=7, greedy=True, backward=False, progress=False, compile=True,
                             hf_model=None, strict=False)
    fake_demo.clear()
    (tmp_path / "config.json").write_text("{}")   # (the preflight looks for it; the fake demo loads nothing)
    assert main(["demo", "--hf-model", str(tmp_path)]) == 3
    assert fake_demo["hf_model"] == str(tmp_path) and fake_demo["layers"] == 2


def test_describe_cli_returns_2_when_its_output_cannot_be_written(monkeypatch, tmp_path, capsys):
    import builtins

    from rlk_ops.__main__ import main
    from rlk_ops.meta import probe

    monkeypatch.setattr(probe, "describe_train", lambda model, **kw: {"side": "train"})
    real_open, target = builtins.open, str(tmp_path / "side.json")

    def refusing_open(path, *a, **k):
        if str(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", refusing_open)
    assert main(["describe", "--side", "train", "--out", target, "--layers", "1"]) == 2
    assert f"error: --out {target}: cannot write it" in capsys.readouterr().err


# ------------------------------------------------------------------ demo: verdicts on synthetic reports
def _report(**kw):
    rep = {"mismatched_tokens": 0, "mismatched_attention_positions": 0,
           "training_backward": {"grads_bitwise_run_to_run": True, "loss_logprobs_mismatched_tokens": 0},
           "negative_control": {"mismatched_tokens": 3, "mismatched_attention_positions": 2}}
    rep.update(kw)
    return rep


def test_demo_exit_code_counts_attention_mismatches_alone():
    """Log-probs bitwise equal but an attention (out, lse) position that differs: still a FAIL."""
    from rlk_ops.rollout import demo

    assert demo.exit_code(_report()) == 0
    assert demo.exit_code(_report(mismatched_attention_positions=1)) == 1
    assert demo.exit_code(_report(mismatched_tokens=1)) == 1


def test_demo_backward_check_sees_gradients_that_differ_run_to_run(monkeypatch):
    """``_backward_check`` compares the two runs' gradients: with a forward that is not run-to-run
    deterministic it must say so (comparing a run with itself said True)."""
    from rlk_ops.rollout import demo
    from rlk_ops.rollout.engine import SeqResult
    from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config

    model = TinyQwen3(TinyQwen3Config(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2,
                                      num_kv_heads=1, head_dim=32, vocab_size=32), seed=0)
    results = [SeqResult(0, [1, 2, 3], generated=[4, 5], logprobs=[-1.0, -2.0]),
               SeqResult(1, [6, 7], generated=[8], logprobs=[-3.0])]
    assert demo._backward_check(model, results, "cpu")["grads_bitwise_run_to_run"] is True
    real, n = model.forward_train, [0]

    def drifting(*a, **k):
        n[0] += 1
        return real(*a, **k) * (1 + 2 ** -6 * n[0])

    monkeypatch.setattr(model, "forward_train", drifting)
    assert demo._backward_check(model, results, "cpu")["grads_bitwise_run_to_run"] is False


def test_demo_progress_lines():
    from rlk_ops.rollout.demo import Progress

    s = io.StringIO()   # not a tty: one line when the phase is done
    p = Progress(3, "rollout", stream=s)
    p()
    p()
    assert s.getvalue() == ""
    p()
    assert s.getvalue() == "rollout: 3/3 tokens\n"
    s = io.StringIO()
    q = Progress(2, "rollout", stream=s, enabled=False)
    q(2)
    assert s.getvalue() == "" and q.done == 2


# ------------------------------------------------------------------ drift
def test_bits_differ_refuses_other_dtypes_and_shapes():
    """Same element size, other dtype (float32 vs int32) or broadcastable shapes: refused, not compared."""
    with pytest.raises(ValueError, match=r"bits_differ: needs one dtype and shape, got torch.float32 \[2\] and "
                                         r"torch.int32 \[2\]"):
        bits_differ(torch.zeros(2), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"needs one dtype and shape"):
        bits_differ(torch.zeros(4, 1), torch.zeros(4))
    x = torch.ones(3, requires_grad=True)   # a tensor that requires grad: compared by its bits
    assert bits_differ(x, x.detach().clone()).tolist() == [False, False, False]


def test_drift_is_measured_in_float64_not_the_inputs_dtype():
    """|512 - 1| in bfloat16 rounds to 512; the drift is 511 exactly."""
    a = torch.tensor([512.0, 0.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    d = drift_stats(a, b)
    assert (d["max"], d["mismatched"], d["mean"]) == (511.0, 1, 255.5)
    big = torch.tensor([3e38], dtype=torch.float32)
    assert drift_stats(big, -big)["max"] == float(big.double() * 2)   # finite, not inf


# ------------------------------------------------------------------ packing
def _qkv_module(bias=False, top=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6, bias=bias)
    if top:
        m = torch.nn.Module()
        m.qkv_proj = lin
        return m
    m = torch.nn.Module()
    m.attn = torch.nn.Module()
    m.attn.qkv_proj = lin
    return m


QKV = {"qkv_proj": [("q_proj", 2), ("k_proj", 3), ("v_proj", 1)]}


def test_a_top_level_packed_module_is_split():
    """``qkv_proj.weight`` (a packed module at the model's top level, two dotted parts) reads as its parts."""
    m = _qkv_module(top=True)
    assert packing.check(QKV, m) == QKV
    items = dict(packing.state_items(m, QKV))
    w = m.qkv_proj.weight
    assert sorted(items) == ["k_proj.weight", "q_proj.weight", "v_proj.weight"]
    assert torch.equal(items["q_proj.weight"], w[0:2]) and torch.equal(items["k_proj.weight"], w[2:5])
    assert torch.equal(items["v_proj.weight"], w[5:6])


def test_packed_parts_rows_and_labels_of_weight_and_bias():
    from rlk_ops.compile.element_maps import packed_label

    m = _qkv_module(bias=True)
    packed = packing.check(QKV, m)
    w, b = m.attn.qkv_proj.weight, m.attn.qkv_proj.bias
    assert packing.parts("attn.qkv_proj.weight", w, packed) == [
        ("attn.q_proj.weight", 0, 2), ("attn.k_proj.weight", 2, 5), ("attn.v_proj.weight", 5, 6)]
    items = dict(packing.state_items(m, packed))
    assert torch.equal(items["attn.k_proj.bias"], b[2:5]) and torch.equal(items["attn.v_proj.weight"], w[5:6])
    names = {id(w): "attn.qkv_proj.weight", id(b): "attn.qkv_proj.bias"}
    labels = packing.labels(m, names, packed)
    # a bias row is one element, a weight row in_features (4) elements
    assert labels[id(b)] == packed_label([("attn.q_proj.bias", 2), ("attn.k_proj.bias", 3), ("attn.v_proj.bias", 1)])
    assert labels[id(w)] == packed_label([("attn.q_proj.weight", 8), ("attn.k_proj.weight", 12),
                                          ("attn.v_proj.weight", 4)])


@pytest.mark.parametrize("packed, match", [
    ({"qkv_proj": [("q_proj", 2), ("k_proj", True), ("v_proj", 3)]}, r"rows > 0\), got \('k_proj', True\)"),
    ({"0": [("q_proj", 2), ("k_proj", 4)]}, "a key must be a module name"),
    ({"qkv_proj": [("q_proj", 3), ("q_proj", 3)]}, "part names must be distinct"),
    ({"qkv_proj": [("qkv_proj", 3), ("k_proj", 3)]}, "part names must be distinct and differ from the key"),
])
def test_packing_refusals_name_the_problem(packed, match):
    with pytest.raises(ValueError, match=match):
        packing.check(packed, _qkv_module())


def test_packing_needs_the_model():
    with pytest.raises(ValueError, match="packed: needs the model whose parameters it names"):
        packing.check(QKV, None)
    assert packing.check(None, None) == {} and packing.check({}, None) == {}


# ------------------------------------------------------------------ specs
# The determinism table the binding and the boundary report read: (run_to_run, batch_invariant,
# prefill_decode_invariant, world_size_invariant) per op and backend. A flag flipped here changes
# what a side claims; each is backed by the tests named in specs.py.
_TABLE = {
    "qk_rmsnorm": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "qk_rmsnorm_bwd": {"cpu": (True, None, None, None), "triton": (True, None, None, None)},
    "rope": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "rope_bwd": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "qk_norm_rope": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "paged_kv_append": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "paged_kv_gather": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "attention_fwd": {"cpu": (True, True, True, None), "fa4": (True, True, True, None)},
    "attention_bwd": {"cpu": (True, None, None, None), "fa4": (True, None, None, None)},
    "paged_attention": {"cpu": (True, True, True, None), "fa4": (True, True, True, None),
                        "flashinfer": (True, True, False, None)},
    "merge_attn_states": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "merge_attn_states_bwd": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "paged_attention_auto": {"cpu": (True, True, True, None), "flashinfer": (True, False, False, None)},
    "linear": {"cpu": (True, True, None, None), "triton": (True, True, None, None)},
    "linear_bwd": {"cpu": (True, None, None, None), "triton": (True, None, None, None)},
    "linear_bias_bwd": {"cpu": (True, None, None, None), "triton": (True, None, None, None)},
    "all_gather": {"c10d": (True, True, None, True)},
    "reduce_scatter": {"c10d": (True, True, None, False)},
}


def test_determinism_table():
    got = {name: {b: (d.run_to_run, d.batch_invariant, d.prefill_decode_invariant, d.world_size_invariant)
                  for b, d in s.backends.items()} for name, s in REGISTRY.items()}
    assert got == _TABLE
    # strict (deterministic) ops: every backend batch-invariant or not applicable
    for name, s in REGISTRY.items():
        if s.deterministic:
            assert all(d.batch_invariant in (True, None) for d in s.backends.values()), name


def test_spec_lookup_and_tags():
    assert spec("rlk::linear.default") is REGISTRY["linear"] and spec("linear") is REGISTRY["linear"]
    assert spec("paged_attention_auto").as_dict()["tags"] == ["pt2_compliant_tag", "nondeterministic_bitwise"]
    assert spec("linear").as_dict()["tags"] == ["pt2_compliant_tag"]
    assert not spec("paged_attention_auto").deterministic and spec("paged_attention").deterministic


def _backward_ops(fn, *inputs):
    with provenance.capture() as log:
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() for o in out).backward()
    return {r.op for r in log.records()}


def test_the_backward_a_spec_names_is_the_backward_that_runs():
    """``OpSpec.backward`` is what the op's backward calls (linear with a bias: linear_bwd and linear_bias_bwd)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((3, 8), (4, 8), (4,)))
    assert _backward_ops(rlk_ops.linear, x, w, b) - {"linear"} == set(REGISTRY["linear"].backward)
    xn, nw = torch.randn(2, 3, 16, generator=g, requires_grad=True), torch.ones(16, requires_grad=True)
    assert _backward_ops(lambda a, c: rlk_ops.qk_rmsnorm(a, c, 1e-6), xn, nw) - {"qk_rmsnorm"} == \
        set(REGISTRY["qk_rmsnorm"].backward)


# ------------------------------------------------------------------ examples
def test_decode_batch_lays_out_each_sequence_in_its_own_pages():
    """context[b] cached tokens plus the new one: seq_lens n + 1, position n, the slot of token n in the
    sequence's own pages (enough pages for n + 1 tokens, none shared between sequences)."""
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import decode_batch, init_block

    block = init_block(Qwen3Attention(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32))
    context, ps = [16, 0, 5, 31, 32], 16
    x, pos, kc, vc, table, lens, slots = decode_batch(block, context, page_size=ps)
    assert lens.tolist() == [n + 1 for n in context] and pos.flatten().tolist() == context
    assert x.shape == (5, 1, 64) and lens.dtype == torch.int32 and table.dtype == torch.int32
    used = []
    for b, n in enumerate(context):
        need = (n + 1 + ps - 1) // ps
        pages = table[b, :need].tolist()
        used += pages
        assert int(slots[b]) == pages[n // ps] * ps + n % ps
    assert len(set(used)) == len(used) and max(used) < kc.shape[0]
    with torch.no_grad():
        out = block.forward_rollout(x, pos, kc, vc, table, lens, slots)
    assert out.shape == x.shape


def test_packed_batch_layout():
    from rlk_ops.compile.examples import packed_batch

    x, pos, cu = packed_batch([3, 0, 2], 8, requires_grad=False)
    assert pos.tolist() == [0, 1, 2, 0, 1] and cu.tolist() == [0, 3, 3, 5] and cu.dtype == torch.int32
    assert x.shape == (5, 8) and not x.requires_grad
    assert packed_batch([2], 8)[0].requires_grad
    with pytest.raises(ValueError, match=r"packed_batch lengths must be a non-empty list of ints >= 0, got \[True\]"):
        packed_batch([True], 8)


# ------------------------------------------------------------------ plain.py: the negative control
# measured on the clean code (2 layers, 3 sequences, bf16): max |dlogp| 0.016, |d out| 0.020, |d lse| 0.015
LOGP_TOL = OUT_TOL = LSE_TOL = 0.1


@pytest.fixture(scope="module")
def plain_vs_rlk():
    """The same tiny model and tokens through the rlk rollout and through the plain PyTorch rollout."""
    from rlk_ops.rollout.demo import make_requests
    from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for
    from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config
    from rlk_ops.rollout.plain import plain_forward_rollout, plain_log_softmax

    model = TinyQwen3(TinyQwen3Config(num_layers=2), seed=0)
    reqs = make_requests(3, model.config.vocab_size, seed=0, min_prompt=20, max_prompt=70, min_new=4, max_new=6)
    rlk = RolloutEngine(model, cache_for(model, reqs, 16, 2), max_running=2, chunk=40, sampler=Sampler(0)).run(reqs)
    forced = [Request(r.seq_id, r.prompt, len(r.generated), forced=r.generated) for r in rlk]
    plain = RolloutEngine(model, cache_for(model, forced, 16, 2), max_running=2, chunk=40,
                          forward=plain_forward_rollout, logprobs=plain_log_softmax).run(forced)
    return rlk, plain


def test_the_negative_control_computes_the_same_model(plain_vs_rlk):
    """The plain rollout must differ from the rlk one in bits only (the control shows the check can fail),
    not compute another model: log-probs, attention outputs and LSEs agree to bf16 rounding. A rotation of
    the wrong sign, a causal mask off by one, GQA heads paired wrongly or an unmasked LSE still 'failed'
    the bitwise comparison, so the demo's negative control kept passing."""
    rlk, plain = plain_vs_rlk
    assert [r.generated for r in rlk] == [p.generated for p in plain]
    lp_r = torch.tensor([x for r in rlk for x in r.logprobs])
    lp_p = torch.tensor([x for p in plain for x in p.logprobs])
    assert not torch.equal(lp_r, lp_p)                      # it is a negative control
    assert float((lp_r - lp_p).abs().max()) < LOGP_TOL
    out_d = lse_d = 0.0
    for r, p in zip(rlk, plain):
        assert sorted(r.attn) == sorted(p.attn)
        for pos in r.attn:
            for layer in range(2):
                out_d = max(out_d, float((r.attn[pos][layer].float() - p.attn[pos][layer].float()).abs().max()))
                lse_d = max(lse_d, float((r.lse[pos][layer] - p.lse[pos][layer]).abs().max()))
    assert out_d < OUT_TOL and lse_d < LSE_TOL, (out_d, lse_d)


def test_plain_log_softmax_is_fp32_on_the_host():
    from rlk_ops.rollout.plain import plain_log_softmax

    logits = (torch.randn(3, 50) * 4).bfloat16()
    got = plain_log_softmax(logits)
    assert got.dtype == torch.float32 and torch.equal(got, torch.log_softmax(logits.float(), -1))


# ------------------------------------------------------------------ paged_attention and the auto lane: checks
def _paged_small(sq=3):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, sq, 4, 8, generator=g)
    kc, vc = torch.randn(4, 16, 2, 8, generator=g), torch.randn(4, 16, 2, 8, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    return q, kc, vc, table, lens


@pytest.mark.parametrize("fn", ["paged_attention", "paged_attention_auto"])
def test_paged_ops_check_their_inputs_in_every_lane(fn):
    """Both paged ops (the auto lane outside strict mode too) refuse: a sequence with fewer cached tokens
    than new queries, a cache of another dtype, a q that requires grad, a page table with another row count."""
    op = getattr(rlk_ops, fn)
    q, kc, vc, table, lens = _paged_small()
    with rlk_ops.strict(False):
        out, lse = op(q, kc, vc, table, lens)
        assert out.shape == q.shape and lse.shape == (2, 4, 3)
        with pytest.raises(ValueError, match=rf"rlk::{fn}: .*seq_lens"):
            op(q, kc, vc, table, torch.tensor([20, 2], dtype=torch.int32))
        with pytest.raises(ValueError, match=rf"rlk::{fn}: .*k_cache"):
            op(q, kc.double(), vc.double(), table, lens)
        with pytest.raises(ValueError, match=rf"rlk::{fn}: q must not require grad"):
            op(q.clone().requires_grad_(), kc, vc, table, lens)
        with pytest.raises(ValueError, match=rf"rlk::{fn}: page_table must have one row per sequence of q"):
            op(q, kc, vc, table[:1], lens[:1])


def test_paged_attention_spells_canonical_out():
    """``split_kv="canonical"`` reaches the op as ``canonical:768`` (one spelling for reports and the binding)."""
    from rlk_ops.compile.boundary import inspect_boundary

    q, kc, vc, table, lens = _paged_small(sq=1)
    with torch.no_grad():
        rep = inspect_boundary(lambda *a: rlk_ops.paged_attention(*a, split_kv="canonical")[0], q, kc, vc, table,
                               lens, backward=False)
    (node,) = rep.forward
    assert node.args["split_kv"] == "canonical:768"
