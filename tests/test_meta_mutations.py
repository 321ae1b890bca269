"""Checks on rlk_ops/meta and compile/boundary.py that a mutation-testing pass found
missing: each test here failed on a deliberate breakage of the library that the rest
of the suite let through (drift statistics, provenance counting, the weight hash,
environment blocking rules, split_kv bounds, the boundary report across a graph
break and its tags and spec flags)."""
import pytest
import torch

import rlk_ops
from rlk_ops import RlkInputError
from rlk_ops.compile.boundary import inspect_boundary
from rlk_ops.meta import probe, provenance
from rlk_ops.meta.contract import MAX_CANONICAL_CHUNK, SplitKVPolicy
from rlk_ops.meta.drift import bits_differ, drift_stats


# ------------------------------------------------------------------ drift
def test_drift_stats_values():
    a = torch.zeros(100, dtype=torch.float32)
    b = a.clone()
    b[7], b[40], b[99] = 0.5, -2.0, 1e-30  # a tiny difference still counts as a mismatch
    d = drift_stats(a, b)
    assert d["elements"] == 100 and d["mismatched"] == 3
    assert d["max"] == 2.0 and d["mean"] == (0.5 + 2.0 + 1e-30) / 100
    # nearest rank over the 100 sorted |diff| (97 zeros, 1e-30, 0.5, 2.0): p95 is rank 94, p99 rank 98
    assert d["p95"] == 0.0 and d["p99"] == 0.5
    # 21 distinct |diff| 0..20: the percentiles are nearest-rank, as torch.quantile's "nearest"
    diff = torch.randperm(21, generator=torch.Generator().manual_seed(0)).double()
    d = drift_stats(diff, torch.zeros(21, dtype=torch.float64))
    assert (d["p95"], d["p99"], d["max"], d["mismatched"]) == (19.0, 20.0, 20.0, 20)
    assert d["p99"] == float(torch.quantile(diff, 0.99, interpolation="nearest"))
    same = drift_stats(a, a.clone())
    assert same["mismatched"] == 0 and same["max"] == 0.0 and same["mean"] == 0.0
    assert drift_stats(torch.empty(0), torch.empty(0))["elements"] == 0


def test_demo_compares_bits_not_values():
    """-0.0 and +0.0 are equal values with other bits, and a NaN is unequal to itself: the demo and
    drift_stats compared values, so a rollout -0.0 beside a training +0.0 passed and a NaN in both
    sides would have failed (a session 34 audit)."""
    from rlk_ops.rollout import demo
    from rlk_ops.rollout.engine import SeqResult
    from rlk_ops.rollout.model import Trace

    def compare(roll_out, train_out, roll_lp, train_lp):
        lse = torch.zeros(2)
        r = SeqResult(0, [1], generated=[2], logprobs=[roll_lp])
        r.attn[0], r.lse[0] = [roll_out], [lse]
        rep = demo._compare([r], [torch.tensor([train_lp])], Trace(attn=[train_out[None]], lse=[lse[None]]), [0], 1)
        return rep["mismatched_tokens"], rep["mismatched_attention_positions"]

    zero = torch.zeros(2, 4, dtype=torch.bfloat16)
    neg = zero.clone()
    neg[0, 0] = -0.0
    nan = torch.full((2, 4), float("nan"), dtype=torch.bfloat16)
    assert compare(zero, zero.clone(), 0.0, 0.0) == (0, 0)
    assert compare(neg, zero, -0.0, 0.0) == (1, 1)
    assert compare(nan, nan.clone(), float("nan"), float("nan")) == (0, 0)
    assert drift_stats(torch.tensor([-0.0]), torch.tensor([0.0]))["mismatched"] == 1
    assert drift_stats(torch.tensor([float("nan")]), torch.tensor([float("nan")]))["mismatched"] == 0


def test_drift_stats_of_equal_infinities_and_nans_is_zero():
    """An lse of -inf (a row with no visible key) on both sides, or one NaN on both sides: 0 drift.
    inf - inf made the drift NaN, which the demo's JSON wrote as a bare NaN (a session 35 audit).
    A NaN or an opposite infinity beside another value drifts by inf."""
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([-inf, 1.0, 2.0, nan, inf])
    for b in (a.clone(), a.double()):           # one dtype (bits), and two dtypes (values)
        d = drift_stats(a, b)
        assert (d["mismatched"], d["max"], d["mean"], d["p95"], d["p99"]) == (0, 0.0, 0.0, 0.0, 0.0)
    b = torch.tensor([-inf, 1.5, nan, nan, -inf])
    d = drift_stats(a, b)
    assert d["mismatched"] == 3 and d["max"] == inf and d["mean"] == inf and d["p95"] == inf
    assert drift_stats(a[1:3], b[1:3]) == {"elements": 2, "mismatched": 2, "max": inf, "mean": inf,
                                           "p95": inf, "p99": inf}
    # an infinity beside another value is inf, not the largest double (nan_to_num's default)
    for x, y in (([inf], [-inf]), ([inf, 0.0], [1.0, 0.0]), ([0.0, -inf], [0.0, 2.0])):
        d = drift_stats(torch.tensor(x), torch.tensor(y))
        assert d["mismatched"] == 1 and d["max"] == inf and d["mean"] == inf, (x, y, d)
    # a NaN beside a NaN of other bits: a mismatch in one dtype, but no distance
    neg_nan = torch.tensor([nan]).neg()
    d = drift_stats(torch.tensor([nan, 1.0]), torch.cat([neg_nan, torch.tensor([1.0])]))
    assert bool(bits_differ(torch.tensor([nan]), neg_nan)) and (d["mismatched"], d["max"]) == (1, 0.0)


def test_drift_stats_refuses_broadcasting():
    with pytest.raises(ValueError, match=r"shapes differ: \[4, 1\] vs \[4\]"):
        drift_stats(torch.zeros(4, 1), torch.zeros(4))


# ------------------------------------------------------------------ provenance
def _qkv():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, 5, h, 8, generator=g) for h in (4, 2, 2))


def test_provenance_counts_calls_and_keeps_fallbacks_apart():
    q, k, v = _qkv()
    with provenance.capture() as log:
        rlk_ops.attention(q, k, v)
        rlk_ops.attention(q, k, v)
        with rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="flashinfer"):
            rlk_ops.attention(q, k, v)  # falls back to cpu: its own record
    recs = {(r.requested_backend, r.actual_backend, r.fallback): r.calls for r in log.records()}
    assert recs == {("cpu", "cpu", False): 2, ("flashinfer", "cpu", True): 1}
    (fell,) = log.fallbacks()
    assert fell.requested_backend == "flashinfer" and fell.calls == 1


# ------------------------------------------------------------------ probe
def test_weights_id_covers_dtype_and_values():
    def lin(dtype, fill=0.0):
        m = torch.nn.Linear(4, 4, bias=False).to(dtype)
        with torch.no_grad():
            m.weight.fill_(fill)
        return m

    # zeros are the same bytes in bf16 and fp16: only the dtype tells the two apart
    assert probe.weights_id(lin(torch.bfloat16)) != probe.weights_id(lin(torch.float16))
    assert probe.weights_id(lin(torch.bfloat16)) == probe.weights_id(lin(torch.bfloat16))
    assert probe.weights_id(lin(torch.bfloat16)) != probe.weights_id(lin(torch.bfloat16, 1.0))


def test_environment_blocking_on_cuda_and_context_parallel():
    cuda_fa4 = probe.path_of([{"device": "cuda:0", "actual_backend": "fa4"}])
    # Inductor compiles the non-rlk nodes of a CUDA graph to Triton even when no rlk triton kernel ran
    assert "Triton" in probe.blocking("version.triton", cuda_fa4)
    assert probe.blocking("version.triton", probe.path_of([{"device": "cpu", "actual_backend": "cpu"}])) is None
    # context parallelism alone (tp 1, cp 2) runs NCCL reductions too
    cp2 = probe.path_of([{"device": "cuda:0", "actual_backend": "fa4"}], tp=1, cp=2)
    assert cp2["ranks"] == 2 and probe.blocking("NCCL_PROTO", cp2)


def test_side_description_records_non_strict_runs():
    with rlk_ops.strict(False):
        side = probe.describe_side("train", [], model_id="m")
    assert side["runtime"]["strict"] is False
    assert probe.describe_side("train", [], model_id="m")["runtime"]["strict"] is True


def test_side_description_takes_the_mode_its_entries_ran_under():
    """describe_side once read the strict mode when it was called, not when the entries ran."""
    q, k, v = _qkv()
    with rlk_ops.strict(False):
        loose = probe.run_entry("attention", rlk_ops.attention, q, k, v)
    side = probe.describe_side("train", [loose], model_id="m")  # described in strict mode
    assert loose["strict"] is False and side["runtime"]["strict"] is False
    assert side["entries"][0]["strict"] is False  # each entry keeps its own
    strict = probe.run_entry("attention", rlk_ops.attention, q, k, v)
    with pytest.raises(ValueError, match=r"entries ran under different strict modes, got "
                                         r"\{'loose': False, 'strict': True\}"):
        probe.describe_side("train", [dict(loose, name="loose"), dict(strict, name="strict")], model_id="m")


# ------------------------------------------------------------------ contract
def test_split_kv_sizes_at_the_bounds():
    with pytest.raises(ValueError, match=r"canonical:C needs C a positive multiple of 128, got 0"):
        SplitKVPolicy.parse("canonical:0")
    with pytest.raises(ValueError, match=r"fixed:N needs 0 < N <= 2147483647 \(MAX_FIXED_SPLIT\), got 0"):
        SplitKVPolicy.parse("fixed:0")
    assert SplitKVPolicy.parse(f"canonical:{MAX_CANONICAL_CHUNK}").size == MAX_CANONICAL_CHUNK
    q, k, v = _qkv()
    with pytest.raises(RlkInputError, match=r"canonical:C needs C a positive multiple of 128, got 0"):
        rlk_ops.attention(q, k, v, split_kv="canonical:0")
    assert SplitKVPolicy.parse("fixed:1").strict and SplitKVPolicy.parse("canonical").strict
    assert not SplitKVPolicy.parse("auto").strict


# ------------------------------------------------------------------ boundary
def test_boundary_report_across_a_graph_break():
    """Two graphs: rlk nodes are numbered across both, and ``producers`` of the second
    graph's nodes point into the report's list, not into their own graph's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 32, generator=g), torch.randn(64, 32, generator=g)
    nw, pos = torch.ones(16), torch.arange(6)

    def fn(x, w, nw, pos):
        y = rlk_ops.linear(x, w)
        torch._dynamo.graph_break()
        h = rlk_ops.qk_rmsnorm(y.view(6, 4, 16), nw, 1e-6)
        return rlk_ops.rope(h, pos, 1e4, 16)

    with torch.no_grad():
        report = inspect_boundary(fn, x, w, nw, pos, backward=False)
    assert report.graph_breaks == 1 and report.graphs == 2
    assert report.forward_ops == ["rlk::linear", "rlk::qk_rmsnorm", "rlk::rope"]
    assert [n.index for n in report.forward] == [0, 1, 2]
    assert report.forward[2].producers["x"] == [1, 0]  # rope's input: the norm, node #1
    assert report.forward[1].producers["x"] is None  # a graph input of the second graph
    assert report.forward[2].args == {"theta": 1e4, "rotary_dim": 16}


def test_boundary_report_shows_a_diagnostic_lane_and_spec_flags():
    """The auto split-KV lane carries its nondeterministic_bitwise tag into the report
    and the table; the table's flags are run-to-run, batch, prefill/decode in that order."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 4, 8, generator=g)
    kc, vc = torch.randn(4, 16, 2, 8, generator=g), torch.randn(4, 16, 2, 8, generator=g)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)

    def fn(q, kc, vc, table, lens):
        a = rlk_ops.paged_attention(q, kc, vc, table, lens)[0]
        b = rlk_ops.paged_attention_auto(q, kc, vc, table, lens)[0]
        return a + b

    with rlk_ops.strict(False), torch.no_grad():
        report = inspect_boundary(fn, q, kc, vc, table, lens, backward=False)
    strict_node, auto_node = report.forward
    assert "nondeterministic_bitwise" in auto_node.tags and "nondeterministic_bitwise" not in strict_node.tags
    table_text = report.table()
    auto_line = next(line for line in table_text.splitlines() if "rlk::paged_attention_auto" in line)
    strict_line = next(line for line in table_text.splitlines() if "rlk::paged_attention " in line)
    assert "NONDETERMINISTIC" in auto_line and "NONDETERMINISTIC" not in strict_line
    # flashinfer paged_attention: run-to-run and batch-invariant, not prefill/decode invariant
    assert "flashinfer:yyn" in strict_line and "cpu:yyy" in strict_line
    assert "flashinfer:ynn" in auto_line  # FlashInfer's auto split is not batch-invariant


def test_boundary_report_names_what_a_mutating_op_writes():
    from rlk_ops.compile.examples import decode_batch, init_block
    from rlk_ops.compile import Qwen3Attention

    block = init_block(Qwen3Attention(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32))
    with torch.no_grad():
        report = inspect_boundary(block.forward_rollout, *decode_batch(block, [3]), backward=False)
    (append,) = [n for n in report.forward if n.op == "rlk::paged_kv_append"]
    assert append.via == "auto_functionalized_v2" and append.spec["mutates"] == ["k_cache", "v_cache"]
    assert "[mutates]" in report.table()


@pytest.mark.parametrize("field,value,want", [
    ("head_dim", 0, "a positive int"),  # once a ZeroDivisionError in fields()
    ("head_dim", "128", "a positive int"),
    ("key_block", True, "a positive int"),
    ("causal", "yes", "a bool"),
    ("softmax_scale", "a", r"None \(head_dim \*\* -0.5\) or a finite float"),  # once accepted
    ("softmax_scale", float("nan"), r"None \(head_dim \*\* -0.5\) or a finite float"),
    ("dtype", torch.bfloat16, "a string"),
])
def test_attention_contract_fields_are_checked_when_built(field, value, want):
    from rlk_ops.meta.contract import AttentionContract

    with pytest.raises(ValueError, match=rf"AttentionContract {field} must be {want}, got "):
        AttentionContract(**{field: value})
    assert AttentionContract(head_dim=64, softmax_scale=0.1).fields()["softmax_scale"] == 0.1


def _w_x():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g).bfloat16(), torch.randn(4, 8, generator=g).bfloat16()


def test_inspect_boundary_counts_breaks_dynamo_raises_outside_a_call():
    """Only breaks at a call reached counters["graph_break"]: a data-dependent branch and a break in
    a loop (Dynamo then skips the whole frame and runs it eagerly, its non-rlk compute in no graph)
    reported 0 breaks and a clean table (a session 34 audit)."""
    w, x = _w_x()

    def branch(x):
        y = rlk_ops.linear(x, w)
        if y.float().sum() > 0:          # data-dependent
            y = rlk_ops.linear(y, w)
        return y

    def loop(x):
        for _ in range(2):
            x = rlk_ops.linear(x, w).float().softmax(-1).to(torch.bfloat16) * 2
            torch._dynamo.graph_break()
        return x

    def clean(x):
        return rlk_ops.linear(rlk_ops.linear(x, w), w)

    r = inspect_boundary(branch, x, backward=False)
    assert r.graph_breaks >= 1 and r.skipped_frames == 0
    r = inspect_boundary(loop, x, backward=False)
    assert r.graph_breaks >= 1 and r.skipped_frames == 1
    table = r.table()
    assert "SKIPPED FRAMES: 1" in table and "graph runs in the first call" in table
    r = inspect_boundary(clean, x, backward=False)
    assert (r.graph_breaks, r.skipped_frames, r.calls) == (0, 0, 1) and "recompiles: - (one call)" in r.table()
    r = inspect_boundary(clean, x, backward=False, more_calls=((x[:2],),))
    assert r.calls == 2 and "recompiles: - " not in r.table()


def test_cli_json_that_cannot_be_written_is_named(tmp_path, monkeypatch, capsys):
    """The demo printed PASS, then a traceback and exit 1 ("rollout and training disagree") when its
    --json could not be written (a session 34 audit). Now exit 2, naming the option and the path."""
    import builtins

    from rlk_ops.__main__ import main

    real_open = builtins.open
    target = str(tmp_path / "out.json")

    def refusing_open(path, *a, **k):
        if str(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", refusing_open)
    assert main(["demo", "--quiet", "--layers", "1", "--sequences", "2", "--no-backward", "--json", target]) == 2
    out, err = capsys.readouterr()
    assert "RESULT: PASS" in out
    assert f"error: --json {target}: cannot write it: [Errno 13] Permission denied" in err and "Traceback" not in err


def test_inspect_boundary_names_a_function_that_is_not_callable():
    with pytest.raises(TypeError, match=r"inspect_boundary: fn must be a callable .*got NoneType"):
        inspect_boundary(None, torch.zeros(2))
