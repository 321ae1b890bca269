"""Session 40 mutation audit of meta/binding.py and meta/probe.py: tests for the mutants that survived the
existing suite. Each test names the mutant it kills. Sides come from one small module fixture (a forward-only
training entry and a prefill + decode rollout of the tiny model, a few seconds); the rest calls the binding's
rules directly on hand-made facts."""
import json

import pytest
import torch

from rlk_ops.meta import binding, probe
from rlk_ops.meta.binding import IDENTICAL, SEMANTIC, Fact, Mandate, Unobservable, bind
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
            head_dim=16)


@pytest.fixture(scope="module")
def pair():
    model = TinyQwen3(TinyQwen3Config(**TINY), dtype=torch.bfloat16, seed=0)
    return probe.describe_train(model, backward=False), probe.describe_rollout(model)


def _copy(side):
    return json.loads(json.dumps(side))


def _records(side, op):
    return [r for e in side["entries"] for r in e["provenance"] if r["op"] == op]


def _judge(name, rule, a, b, mandate=None, ctx=None):
    ctx = ctx or {}
    return binding._judge(name, binding.RULES[rule], Fact(a, rule, "test") if a is not _ABSENT else None,
                          Fact(b, rule, "test") if b is not _ABSENT else None, mandate or Mandate(), (ctx, ctx))


_ABSENT = object()


def test_the_clean_pair_binds(pair):
    """The baseline every edit below starts from."""
    assert bind(*pair).passed, bind(*pair).summary()


# ------------------------------------------------------------------ reduction order (a SEMANTIC field)
def test_attention_on_another_reduction_order_fails(pair):
    """Mutant: ``attention.reduction_order`` demoted to RECORDED (the suite killed it only through a tier
    assertion on an unobservable field; this is the pair it lets through). Training's attention on fa4 (128-key tiles
    last to first) and the rollout's on the cpu reference (ascending) agree in every other attention field
    (fp32, natural log, P in the input dtype, single pass), and their determinism specs are one-sided (other
    ops): the reduction order is the only field that tells them apart."""
    train, rollout = pair
    fa4 = _copy(train)
    for r in _records(fa4, "attention_fwd"):
        r["requested_backend"] = r["actual_backend"] = "fa4"
    result = bind(fa4, rollout)
    assert result.comparable and not result.passed, result.summary()
    f = result.failure("layer[0].attention.reduction_order")
    assert f is not None and f.tier == SEMANTIC and f.status == "differs", result.summary()
    assert (f.train, f.rollout) == (binding.ATTENTION_NUMERICS["fa4"]["reduction_order"],
                                    binding.ATTENTION_NUMERICS["cpu"]["reduction_order"])
    # and nothing else separates them: the other attention numerics agree
    assert [x.field for x in result.failures] == ["layer[0].attention.reduction_order"], result.summary()


# ------------------------------------------------------------------ topology stated, not guessed
@pytest.mark.parametrize("key, value, field", [
    ("tp", 2, "topology.head_ownership"),
    ("cp", 2, "topology.sequence_ownership"),
])
def test_a_parallel_side_must_state_what_it_owns(pair, key, value, field):
    """Mutants: the head ownership derived from the graph when tp > 1, the sequence ownership taken as
    "whole" when cp > 1. Two ranks of a TP=2 (CP=2) run own other heads (tokens); a side that does not
    say which is not comparable, even against one alike."""
    train, rollout = (_copy(s) for s in pair)
    for side in (train, rollout):
        side["topology"][key] = value
        side["topology"]["head_ownership" if key == "tp" else "sequence_ownership"] = None
    result = bind(train, rollout)
    assert not result.comparable and not result.passed, result.summary()
    f = result.failure(field)
    assert f is not None and f.tier == IDENTICAL and f.status == "unobservable", result.summary()
    assert f"{key}={value} but the side does not state which" in f.detail


# ------------------------------------------------------------------ split-KV policy and plan
def test_fixed_split_kv_violates_the_mandate():
    """Mutant: ``fixed:N`` accepted by the split_kv mandate. With plan records (FlashInfer plans per call)
    nothing else fails a fixed:N pair: its plan has no policy-implied value."""
    ctx = {"layer[0].attention.split_kv": "fixed:4"}
    r = _judge("layer[0].attention.split_kv", "attention.split_kv", "fixed:4", "fixed:4")
    assert r.status == "violates" and not r.ok
    assert "fixed:N is batch-invariant but merges partials" in r.detail
    plan = _judge("layer[0].attention.split_plan", "attention.split_plan", "chunks:256", "chunks:256", ctx=ctx)
    assert plan.ok   # so the policy field alone fails such a pair


def test_a_plan_that_varied_across_calls_says_so():
    """Mutant: the "varied across calls" check dropped (the list then failed only as 'policy means plan')."""
    ctx = {"layer[0].attention.split_kv": "disabled"}
    r = _judge("layer[0].attention.split_plan", "attention.split_plan", ["chunks:256", "single_pass"],
               ["chunks:256", "single_pass"], ctx=ctx)
    assert r.status == "violates" and "the plan varied across calls: ['chunks:256', 'single_pass']" in r.detail


# ------------------------------------------------------------------ determinism specs
def _determinism(op, backend):
    facts = {}
    record = {"op": op, "requested_backend": backend, "actual_backend": backend, "fallback": False,
              "fallback_reason": None, "device": "cpu"}
    binding._op_facts(lambda n, rule, v, s: facts.__setitem__(n, v), {"forward": [], "backward": []},
                      {op: [record]})
    return facts[f"ops.{op}.determinism"]


def test_an_op_tagged_nondeterministic_is_not_strict():
    """Mutants: the ``nondeterministic_bitwise`` tag ignored by the spec mandate (survived), or never set
    (also killed by test_binding.py::test_auto_split_kv_on_one_side). The auto lane's
    cpu spec claims every invariance; only the op's tag says its bits depend on the batch."""
    spec = _determinism("paged_attention_auto", "cpu")
    assert spec["nondeterministic_bitwise"] is True and spec["batch_invariant"] is True
    r = _judge("ops.paged_attention_auto.determinism", "ops.determinism", _ABSENT, spec)
    assert r.status == "violates" and r.detail == "rollout violates the mandate: not strict: tagged " \
        "nondeterministic_bitwise", r.message()


def test_a_spec_that_is_not_batch_invariant_is_named():
    """Mutant: ``batch_invariant`` False no longer named (FlashInfer's auto lane still failed, on
    prefill_decode_invariant only)."""
    spec = _determinism("paged_attention_auto", "flashinfer")
    r = _judge("ops.paged_attention_auto.determinism", "ops.determinism", spec, _ABSENT)
    assert r.status == "violates"
    assert "batch_invariant, prefill_decode_invariant, tagged nondeterministic_bitwise" in r.detail, r.message()


# ------------------------------------------------------------------ one side's entries
def test_a_field_unseen_in_one_entry_is_unseen_for_the_side(pair):
    """Mutant (also killed by test_binding_flow.py::test_unresolved_maps_and_older_side_files_fail_closed):
    an UNOBSERVABLE value in one entry point no longer made the side's value UNOBSERVABLE. The
    per-entry dict it left instead equals itself: bound against itself, a rollout whose decode step recorded
    no attention call passed ``reduction_order`` (no mandate) as "ok"."""
    _, rollout = pair
    side = _copy(rollout)
    decode = next(e for e in side["entries"] if e["name"] == "decode")
    decode["provenance"] = [r for r in decode["provenance"] if r["op"] != "paged_attention"]
    result = bind(side, side)
    assert not result.passed
    for name in ("layer[0].attention.reduction_order", "layer[0].attention.accumulation"):
        f = result.failure(name)
        assert f is not None and f.status == "unobservable", result.summary()
        assert "compiled, never executed" in f.detail
    merged = binding._merge_entries([
        ("prefill", {"x": Fact("a", "attention.reduction_order", "s")}),
        ("decode", {"x": Fact(Unobservable("never ran"), "attention.reduction_order", "s")})])
    assert isinstance(merged["x"].value, Unobservable) and merged["x"].value.reason == "never ran"


# ------------------------------------------------------------------ values that disagree within a side
def test_one_layer_on_two_backends_does_not_bind_to_one(pair):
    """Mutant (also killed by test_binding.py::test_recorded_differences_pass, through runtime.mode):
    ``_one`` returning the first value when the values disagree. A training entry whose attention
    calls ran partly on fa4 and partly on the cpu reference bound to a cpu-only rollout: the reduction order
    and the determinism spec collapsed to the cpu's."""
    train, rollout = pair
    mixed = _copy(train)
    entry = mixed["entries"][0]
    cpu = next(r for r in entry["provenance"] if r["op"] == "attention_fwd")
    entry["provenance"].append({**cpu, "requested_backend": "fa4", "actual_backend": "fa4", "kernel": "fa4"})
    result = bind(mixed, rollout)
    assert not result.passed, result.summary()
    f = result.failure("layer[0].attention.reduction_order")
    assert f is not None and f.status == "differs"
    assert f.train == [binding.ATTENTION_NUMERICS["cpu"]["reduction_order"],
                       binding.ATTENTION_NUMERICS["fa4"]["reduction_order"]]
    assert next(x for x in result.fields if x.field == "layer[0].attention.kernel").train == ["cpu", "fa4"]
    # a backend's per-call plans that varied stay a list too
    plans = [{"op": "paged_attention", "plan": "single_pass"}, {"op": "paged_attention", "plan": "chunks:256"}]
    assert binding._plan("paged_attention", ["flashinfer"], "disabled", plans) == ["chunks:256", "single_pass"]


# ------------------------------------------------------------------ a field on one side only
def test_a_field_only_one_side_has_is_unobservable_on_the_other():
    """Mutant: every field missing on one side judged as a one-sided op (only the side that has it). A
    rollout that ran no rlk RMSNorm outside the attention paths (its final norm in plain PyTorch) had no
    ``model.qk_rmsnorm.args``: the training side's eps, checked alone, passed."""
    args = [json.dumps({"eps": 1e-6}, sort_keys=True)]
    r = _judge("model.qk_rmsnorm.args", "model.op_args", args, _ABSENT)
    assert r.status == "unobservable" and not r.ok
    assert r.detail == "rollout: no such field on this side"
    # a one-sided op is still judged on the side that ran it
    op = _judge("ops.paged_kv_append.fallback", "ops.fallback", _ABSENT, False)
    assert op.ok and op.train == "not run on this side"


# ------------------------------------------------------------------ split plan by construction
def test_a_backend_with_no_plan_record_and_none_by_construction_is_unobservable():
    """Mutant: such a backend skipped. FlashInfer plans per call; without its plan records the split of a
    layer that ran on it and on the cpu reference was taken as the cpu's single pass."""
    for backends in (["flashinfer"], ["cpu", "flashinfer"]):
        plan = binding._plan("paged_attention", backends, "disabled", [])
        assert isinstance(plan, Unobservable), plan
        assert "backend 'flashinfer' recorded no split plan for disabled" in plan.reason
    assert binding._plan("paged_attention", ["cpu"], "disabled", []) == "single_pass"


# ------------------------------------------------------------------ probe.run_entry's plan records
def test_run_entry_keeps_only_the_plans_its_own_call_made(monkeypatch):
    """Mutant: every plan record in the backend's log attributed to the entry. A FlashInfer plan made by an
    earlier call (another side, a warm-up) is not this entry's evidence."""
    import rlk_ops

    old = {"policy": "disabled", "split_kv": True, "kv_chunk_tokens": 256}
    new = {"policy": "disabled", "split_kv": False}
    logs = iter([{("old",): (old, 3)},                              # before the capture
                 {("old",): (old, 3), ("new",): (new, 1)}])        # after: old made no new call
    monkeypatch.setattr(probe, "_plan_logs", lambda: next(logs))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=g, dtype=torch.float32) for _ in range(3))
    entry = probe.run_entry("attention", rlk_ops.attention, q, k, v)
    assert entry["plans"] == probe.flashinfer_plans([new])
    assert entry["plans"] == [{"op": "paged_attention", "backend": "flashinfer", "policy": "disabled",
                               "plan": "single_pass"}]


# ------------------------------------------------------------------ probe.describe_train leaves no gradients
def test_describe_train_clears_the_gradients_it_made():
    """Mutant: ``model.zero_grad`` dropped. Describing the training side runs one backward; the gradients it
    left would be added to the caller's next step."""
    model = TinyQwen3(TinyQwen3Config(**TINY), dtype=torch.bfloat16, seed=0)
    side = probe.describe_train(model, model_id="tiny")
    assert side["entries"][0]["graph"]["backward"], "the backward ran"
    assert all(p.grad is None for p in model.parameters())
