"""Issue 4: paged KV cache manager, rollout loop, train-vs-rollout report."""
import json
import subprocess
import sys

import pytest
import torch

import rlk_ops
from rlk_ops.meta import provenance
from rlk_ops.rollout import demo
from rlk_ops.rollout.cache import CacheFullError, PagedKVCache
from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for, noise_seed
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config


# ------------------------------------------------------------------ allocator
def test_allocator_slots_pages_and_reuse_after_free():
    cache = PagedKVCache(1, num_pages=6, page_size=4, num_kv_heads=1, head_dim=8, seed=1)
    cache.add(0)
    slots = cache.reserve(0, 6)  # 2 pages
    pages = cache.pages(0)
    assert len(pages) == 2 and cache.free_pages == 4
    assert slots.tolist() == [pages[0] * 4 + i for i in range(4)] + [pages[1] * 4, pages[1] * 4 + 1]
    assert cache.reserve(0, 2).tolist() == [pages[1] * 4 + 2, pages[1] * 4 + 3]  # fills the page, no new one
    assert cache.free_pages == 4 and cache.length(0) == 8
    cache.add(1)
    cache.reserve(1, 9)
    assert cache.page_table([0, 1]).tolist()[0][:2] == pages and cache.seq_lens([0, 1]).tolist() == [8, 9]
    cache.release(0)
    assert cache.free_pages == 3
    cache.add(2)
    cache.reserve(2, 12)  # needs 3 pages: must reuse the two pages seq 0 released
    assert set(pages) <= set(cache.pages(2))


def test_allocator_hands_out_non_contiguous_pages():
    cache = PagedKVCache(1, num_pages=64, page_size=2, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.reserve(0, 40)
    p = cache.pages(0)
    assert any(b != a + 1 for a, b in zip(p, p[1:]))


def test_allocator_exhaustion_is_a_clear_error_and_changes_nothing():
    cache = PagedKVCache(1, num_pages=3, page_size=4, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.reserve(0, 5)
    before = (cache.free_pages, cache.pages(0), cache.length(0))
    with pytest.raises(CacheFullError, match=r"sequence 0 needs 2 more pages for 8 tokens but only 1 of 3 pages"):
        cache.reserve(0, 8)
    assert (cache.free_pages, cache.pages(0), cache.length(0)) == before
    with pytest.raises(ValueError, match="already in the cache"):
        cache.add(0)
    with pytest.raises(KeyError, match="not in the cache"):
        cache.reserve(7, 1)


# ------------------------------------------------------------------ rollout loop
def _tiny(layers=1):
    return TinyQwen3(TinyQwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=layers,
                                     num_heads=2, num_kv_heads=1, head_dim=32), seed=3)


def _requests():
    prompts = [list(range(1, 41)), list(range(5, 15)), [t % 64 for t in range(2, 132)], [7] * 25, [1, 2, 3]]
    return [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, [3, 6, 2, 5, 4]))]


def _run(model, max_running, chunk=17, page_size=8):
    reqs = _requests()
    eng = RolloutEngine(model, cache_for(model, reqs, page_size, max_running), max_running=max_running, chunk=chunk,
                        sampler=Sampler(5))
    return eng, eng.run(reqs)


def test_rollout_scheduling_continuous_batching():
    eng, results = _run(_tiny(), max_running=2)
    log = eng.log
    assert [r.generated.__len__() for r in results] == [3, 6, 2, 5, 4]
    # at most 2 running; waiting requests join later, as others finish
    assert [r.admitted_step for r in results][:2] == [0, 0]
    assert max(r.admitted_step for r in results) > 0
    assert len({r.finished_step for r in results}) > 1
    for s in log:
        assert len(s.decode) <= 2
    # chunked prefill: each prompt split into ceil(len / 17) chunks of at most 17 tokens
    chunks = [(seq, a, b) for s in log for (seq, a, b) in s.prefill]
    assert len(chunks) == sum(-(-len(r.prompt) // 17) for r in results)
    assert all(b - a <= 17 for _, a, b in chunks)
    assert sorted({len(s.decode) for s in log if s.decode}) == [1, 2]
    assert eng.cache.free_pages == eng.cache.num_pages  # every page came back


def test_rollout_is_batch_invariant_across_schedules():
    """Different concurrency (batch composition) and chunking: same tokens, same log-probs, bitwise."""
    model = _tiny()
    _, a = _run(model, max_running=1, chunk=17)
    _, b = _run(model, max_running=5, chunk=50, page_size=16)
    for x, y in zip(a, b):
        assert x.generated == y.generated
        assert x.logprobs == y.logprobs


def test_a_stop_token_ends_its_sequence_and_the_rest_runs_on():
    """A sequence ends when it generates one of its stop tokens (kept, with its log-prob, finish_reason
    "stop"); the others run to max_new_tokens ("length") with the same tokens and log-probs as without any
    stop (batch invariance: the ended sequence leaving the batch changes no bit of the others); the trainer's
    packed rescoring of the shorter sequence is still the rollout's bitwise; pages all come back."""
    model = _tiny(2)
    free = _run(model, max_running=3)[1]
    stop = free[1].generated[2]   # sequence 1's third token: with it as a stop token, sequence 1 ends there
    reqs = [Request(r.seq_id, r.prompt, r.max_new_tokens, stop_tokens=[stop] if r.seq_id == 1 else [])
            for r in _requests()]
    eng = RolloutEngine(model, cache_for(model, reqs, 8, 3), max_running=3, chunk=17, sampler=Sampler(5))
    results = eng.run(reqs)
    cut = free[1].generated.index(stop) + 1
    assert results[1].generated == free[1].generated[:cut] and results[1].logprobs == free[1].logprobs[:cut]
    assert results[1].finish_reason == "stop" and len(results[1].generated) < reqs[1].max_new_tokens
    for a, b in zip(results, free):
        if a.seq_id != 1:
            assert (a.generated, a.logprobs, a.finish_reason) == (b.generated, b.logprobs, "length")
    logps, _, _ = demo.rescore(model, results, "cpu")
    assert all(torch.equal(lp, torch.tensor(r.logprobs)) for lp, r in zip(logps, results))
    assert eng.cache.free_pages == eng.cache.num_pages
    # a replay (forced tokens) is not cut by a stop token
    forced = [Request(1, free[1].prompt, len(free[1].generated), forced=free[1].generated, stop_tokens=[stop])]
    replay = RolloutEngine(model, cache_for(model, forced, 8, 1)).run(forced)[0]
    assert replay.generated == free[1].generated and replay.finish_reason == "length"


def test_rejects_bad_requests():
    model = _tiny()
    eng = RolloutEngine(model, cache_for(model, _requests(), 8, 2))
    with pytest.raises(ValueError, match="non-empty prompt"):
        eng.run([Request(0, [], 3)])
    with pytest.raises(ValueError, match="forced tokens"):
        eng.run([Request(0, [1], 3, forced=[1])])


# ------------------------------------------------------------------ the report
@pytest.fixture(scope="module")
def report():
    return demo.run(sequences=8, layers=2, progress=False)


def test_demo_report_zero_mismatches_and_negative_control(report):
    assert report["tokens"] >= 64 and len(set(report["prompt_lengths"])) > 1 and report["sequences"] >= 8
    assert report["mismatched_tokens"] == 0 and report["mismatched_attention_positions"] == 0
    for key in ("dlogp", "out", "lse"):
        assert set(report["drift"][key]) >= {"max", "mean", "p95", "p99"}
        assert report["drift"][key]["max"] == 0.0
    nc = report["negative_control"]
    assert nc["tokens"] == report["tokens"] and nc["mismatched_tokens"] > 0
    assert nc["drift"]["dlogp"]["max"] > 0
    sched = report["scheduling"]
    assert sched["prefill_chunks"] > report["sequences"]  # some prompts took several chunks
    assert len(sched["decode_batch_sizes"]) > 1 and max(sched["admitted_steps"]) > 0
    assert report["training_backward"]["grads_bitwise_run_to_run"] is True
    # the loss reads the rollout's log-probs through the differentiable token_logprobs, bit for bit, where
    # torch.log_softmax's differ on some tokens (so the check is not vacuous)
    assert report["training_backward"]["loss_logprobs_mismatched_tokens"] == 0
    assert report["training_backward"]["torch_log_softmax_mismatched_tokens"] > 0


def test_demo_exit_code_covers_the_backward_and_the_negative_control(report):
    """The exit code looked at the token and attention mismatches only: gradients that differ
    run to run, or a negative control that found nothing, still printed PASS and exited 0."""
    import copy

    assert demo.exit_code(report) == 0 and "RESULT: PASS" in demo.summary(report)
    bad = copy.deepcopy(report)
    bad["training_backward"]["grads_bitwise_run_to_run"] = False
    assert demo.exit_code(bad) == 1 and "FAIL - the training backward's gradients differ" in demo.summary(bad)
    loss = copy.deepcopy(report)
    loss["training_backward"]["loss_logprobs_mismatched_tokens"] = 1
    assert demo.exit_code(loss) == 1 and "log-probs are not the rollout's" in demo.summary(loss)
    blind = copy.deepcopy(report)
    blind["negative_control"].update(mismatched_tokens=0, mismatched_attention_positions=0)
    assert demo.exit_code(blind) == 3 and "INCONCLUSIVE" in demo.summary(blind)
    blind["negative_control"]["mismatched_attention_positions"] = 5   # it did show a difference
    assert demo.exit_code(blind) == 0
    off = copy.deepcopy(report)
    off["mismatched_tokens"] = 1
    assert demo.exit_code(off) == 1 and "FAIL - rollout and training disagree" in demo.summary(off)
    for key in ("training_backward", "negative_control"):  # --no-backward, or no control run: not judged
        del off[key]
    off["mismatched_tokens"] = 0
    assert demo.exit_code(off) == 0


def test_demo_report_contract_and_provenance(report):
    c = report["contract"]
    assert (c["dtype"], c["causal"], c["split_kv"], c["accumulation"], c["lse"]) == (
        "bfloat16", True, "disabled", "fp32", "natural_log")
    assert c["softmax_scale"] == 64 ** -0.5
    prov = report["provenance"]
    assert prov["strict"] is True and prov["fallbacks"] == 0
    ops = {(r["side"], r["op"]) for r in prov["records"]}
    assert ("rollout", "paged_attention") in ops and ("training", "attention_fwd") in ops
    assert ("rollout", "paged_kv_append") in ops and ("training", "linear") in ops
    for r in prov["records"]:
        assert set(r) >= {"requested_backend", "actual_backend", "fallback", "fallback_reason", "device"}
    env = prov["environment"]
    assert env["torch"] == torch.__version__ and "gpu_arch" in env and "flash_attn_4" in env
    json.dumps(report)  # serialisable


def test_strict_mode_rejects_auto_split_and_fallbacks():
    with pytest.raises(rlk_ops.StrictModeError, match="split_kv 'auto' is not batch-invariant"):
        demo.run(split_kv="auto", sequences=2, progress=False)
    model = _tiny()
    reqs = _requests()[:2]
    with rlk_ops.use_backend(linear="flashinfer"):  # a backend that cannot run here
        with pytest.raises(rlk_ops.StrictModeError, match="rlk::linear"):
            RolloutEngine(model, cache_for(model, reqs, 8, 2)).run(reqs)
        with rlk_ops.strict(False), provenance.capture() as log:
            RolloutEngine(model, cache_for(model, reqs, 8, 2)).run(reqs)
    (fb,) = [r for r in log.records() if r.fallback]
    assert fb.op == "linear" and fb.requested_backend == "flashinfer" and "unavailable" in fb.fallback_reason


def test_demo_cli_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "rlk_ops", "demo", "--sequences", "8", "--layers", "1",
                           "--no-backward", "--quiet", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: PASS" in proc.stdout and "negative control" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"tokens", "mismatched_tokens", "drift", "contract", "provenance", "negative_control"}
    assert set(data["negative_control"]) >= {"tokens", "mismatched_tokens"}


def test_demo_with_a_compiled_rollout():
    """demo --compile: the rollout under Inductor (compiled_rollout), the trainer eager; bitwise equal,
    and graphs were compiled (not a silent eager run)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    report = demo.run(sequences=4, layers=1, progress=False, negative_control=False, backward=False, compile=True)
    assert counters["stats"]["unique_graphs"] > before
    assert report["rollout_compiled"] is True and report["tokens"] > 0
    assert report["mismatched_tokens"] == 0 and report["mismatched_attention_positions"] == 0
    assert "rollout under torch.compile (Inductor)" in demo.summary(report)
    compiled = {f["field"]: f for f in report["binding"]["fields"]}.get("runtime.compiled")
    assert compiled is not None and compiled["rollout"] is True and compiled["train"] is False, compiled
    with pytest.raises(ValueError, match=r"demo: compile must be a bool, got 'yes'"):
        demo.run(sequences=2, progress=False, compile="yes")


def test_json_reports_are_strict_json(tmp_path):
    """A drift of inf or NaN was written as bare Infinity / NaN, which strict JSON parsers refuse; they
    are strings now, the rest unchanged (a session 35 review)."""
    from rlk_ops.__main__ import _write_json

    path = tmp_path / "r.json"
    report = {"drift": {"max": float("inf"), "min": -float("inf"), "mean": float("nan"), "p95": 0.5},
              "rows": [1, 2.5, (float("inf"), "x")], "ok": True, "n": None}
    assert _write_json(report, str(path), "--json", indent=1)
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data == {"drift": {"max": "inf", "min": "-inf", "mean": "nan", "p95": 0.5},
                    "rows": [1, 2.5, ["inf", "x"]], "ok": True, "n": None}


def test_batch_reservation_is_all_or_nothing():
    cache = PagedKVCache(1, num_pages=3, page_size=4, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.add(1)
    cache.reserve(0, 4)  # fills page 1 of 3
    with pytest.raises(CacheFullError, match="this step needs 3 more pages for 2 sequences but only 2 of 3"):
        cache.reserve_batch([(0, 1), (1, 5)])
    assert (cache.length(0), cache.length(1), cache.free_pages) == (4, 0, 2)
    slots = cache.reserve_batch([(0, 1), (1, 1)])
    assert slots.shape == (2,) and cache.free_pages == 0


def test_demo_refuses_policies_training_does_not_compute():
    with pytest.raises(ValueError, match=r"split_kv must be 'disabled' or 'canonical:C'.*got 'fixed:256'"):
        demo.run(split_kv="fixed:256", sequences=2, progress=False)


@pytest.mark.parametrize("name", ["layers", "sequences", "chunk", "page_size", "max_running"])
@pytest.mark.parametrize("value", [0, -3])
def test_demo_rejects_non_positive_counts_before_any_work(name, value):
    with pytest.raises(ValueError, match=rf"demo: {name} must be a positive int, got {value}"):
        demo.run(progress=False, **{name: value})


@pytest.mark.parametrize("args, message", [
    (["--page-size", "0"], "argument --page-size: expected a positive int, got 0"),
    (["--sequences", "x"], "argument --sequences: expected a positive int, got 'x'"),
    (["--layers", "-1"], "argument --layers: expected a positive int, got -1"),
    (["--split-kv", "canonical:100"], "argument --split-kv: split_kv canonical:C needs C a positive multiple "
                                      "of 128, got 100"),
    (["--split-kv", "bogus"], "argument --split-kv: split_kv must be 'disabled'"),
])
def test_demo_cli_bad_options_are_usage_errors(args, message, capsys):
    from rlk_ops.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--quiet", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_model_configs_reject_non_positive_sizes():
    from rlk_ops.compile.block import Qwen3AttentionConfig
    from rlk_ops.meta import probe

    with pytest.raises(ValueError, match="TinyQwen3Config num_layers must be a positive int, got 0"):
        TinyQwen3Config(num_layers=0)
    with pytest.raises(ValueError, match="Qwen3AttentionConfig num_kv_heads must be a positive int, got 0"):
        TinyQwen3Config(num_kv_heads=0)
    with pytest.raises(ValueError, match="Qwen3AttentionConfig head_dim must be a positive int, got -8"):
        Qwen3AttentionConfig(head_dim=-8)
    with pytest.raises(ValueError, match="describe_rollout page_size must be a positive int, got 0"):
        probe.describe_rollout(_tiny(), page_size=0)


# ------------------------------------------------------------------ bad input (session 25's review)
def _state(cache):
    return cache.free_pages, {s: (cache.length(s), cache.pages(s)) for s in list(cache._lens)}


def test_batch_reservation_checks_everything_before_taking_a_page():
    cache = PagedKVCache(1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.add(1)
    cache.reserve(0, 3)
    before = _state(cache)
    with pytest.raises(ValueError, match=r"n_new of sequence 1 must be an int >= 0, got -1"):
        cache.reserve_batch([(0, 4), (1, -1)])  # sequence 0 first: it must not have grown
    with pytest.raises(ValueError, match=r"reserve_batch: sequence 0 appears twice"):
        cache.reserve_batch([(0, 1), (0, 1)])
    with pytest.raises(ValueError, match=r"n_new of sequence 0 must be an int >= 0, got 1.5"):
        cache.reserve_batch([(0, 1.5)])
    with pytest.raises(KeyError, match=r"sequence 7 is not in the cache \(never added, or already released\)"):
        cache.reserve_batch([(0, 1), (7, 1)])
    assert _state(cache) == before
    assert cache.reserve_batch([]).shape == (0,)


def test_unknown_or_released_sequences_are_named():
    cache = PagedKVCache(1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8)
    cache.add(0)
    cache.release(0)
    for call in (lambda: cache.release(0), lambda: cache.length(0), lambda: cache.pages(0),
                 lambda: cache.page_table([0]), lambda: cache.seq_lens([0])):
        with pytest.raises(KeyError, match=r"sequence 0 is not in the cache \(never added, or already released\)"):
            call()
    assert cache.free_pages == 4
    assert cache.page_table([]).shape == (0, 1)


@pytest.mark.parametrize("name,value", [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 0), ("num_pages", 2.5),
                                        ("page_size", 0)])
def test_cache_sizes_must_be_positive_ints(name, value):
    args = {"num_layers": 1, "num_pages": 4, "page_size": 4, "num_kv_heads": 1, "head_dim": 8, name: value}
    with pytest.raises(ValueError, match=rf"PagedKVCache {name} must be a positive int, got {value}"):
        PagedKVCache(**args)


@pytest.mark.parametrize("kw,pattern", [
    ({"dtype": "bfloat16"}, r"dtype must be a floating-point torch.dtype, got 'bfloat16'"),
    ({"dtype": torch.int32}, r"dtype must be a floating-point torch.dtype, got torch.int32"),  # once: at the append
    # a float dtype no paged op takes: refused at the first append, after a forward (a session 35 audit)
    ({"dtype": torch.float8_e4m3fn}, r"dtype must be one the paged ops take, one of torch.bfloat16, torch.float16, "
                                     r"torch.float32, torch.float64, got torch.float8_e4m3fn"),
    ({"device": "foo"}, r"device must be a torch.device or its name, got 'foo'"),
    ({"seed": 1.5}, r"seed must be an int in \[0, 2\*\*63\) \(it shuffles the free list\), got 1.5"),
    ({"seed": None}, r"seed must be an int .*got None"),
])
def test_cache_dtype_device_and_seed_are_named(kw, pattern):
    with pytest.raises(ValueError, match="PagedKVCache " + pattern):
        PagedKVCache(1, 4, 4, 1, 8, **kw)
    cache = PagedKVCache(1, 4, 4, 1, 8)
    cache.add(0)
    with pytest.raises(ValueError, match=r"reserve_batch: each request must be a \(seq, n_new\) pair, got \(0,\)"):
        cache.reserve_batch([(0,)])
    assert cache.free_pages == 4


def _engine(num_pages=3, page_size=4, **kw):
    model = _tiny()
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                         dtype=model.embed_tokens.weight.dtype)
    return RolloutEngine(model, cache, **kw), cache


@pytest.mark.parametrize("reqs,pattern", [
    ([Request(0, [1, 2, 3], 2), Request(0, [4, 5], 2)], r"request 0: seq_id appears twice"),
    ([Request(0, [1, 64, 3], 2)], r"request 0: prompt\[1\] = 64 is not a token id in \[0, 64\)"),
    ([Request(0, [1, -1], 2)], r"request 0: prompt\[1\] = -1 is not a token id"),
    ([Request(0, [1, 2], 2, forced=[5, -1])], r"request 0: forced\[1\] = -1 is not a token id"),
    ([Request(0, [1, 2], 1, forced=[1.5])], r"request 0: forced\[0\] = 1.5 is not a token id"),
    ([Request(0, [1, 2], 1.5)], r"request 0: needs a non-empty prompt and an int max_new_tokens >= 1"),
    ([Request(0, [1, 2], 2, stop_tokens=[3, 64])], r"request 0: stop_tokens\[1\] = 64 is not a token id in \[0, 64\)"),
    ([Request(0, [1, 2], 2, stop_tokens=7)], r"request 0: stop_tokens must be a list or tuple of token ids, got int"),
    ([Request(0, list(range(10)), 4)], r"request 0: needs 13 cached tokens = 4 pages of 4, but the cache has 3"),
    # a tensor prompt once failed on its truth value, None on len()
    ([Request(1, torch.tensor([1, 2, 3]), 2)], r"request 1: prompt must be a list of token ids, got Tensor"),
    ([Request(1, None, 2)], r"request 1: prompt must be a list of token ids, got NoneType"),
    ([Request(1, [1, 2], 2, forced=torch.tensor([3, 4]))],
     r"request 1: forced must be a list of token ids or None, got Tensor"),
    ([(1, [1, 2], 2)], r"requests must be Request objects, got tuple"),
    # seq_id was never checked: these failed in the sampler after the first prefill, not naming it
    ([Request(1.5, [1, 2], 2)], r"request seq_id must be an int in \[0, 2\*\*63\), got float 1.5"),
    ([Request("a", [1, 2], 2)], r"request seq_id must be an int .* got str 'a'"),
    ([Request(None, [1, 2], 2)], r"request seq_id must be an int .* got NoneType None"),
    ([Request(2 ** 63, [1, 2], 2)], r"request seq_id must be an int .* got int 9223372036854775808"),
    ([Request(-1, [1, 2], 2)], r"request seq_id must be an int .* got int -1"),
    # a generator was consumed by the checks, and the run returned [] without running anything
    ((r for r in [Request(0, [1, 2], 2)]), r"requests must be a list or tuple of Request objects, got generator"),
])
def test_bad_requests_are_refused_before_any_is_admitted(reqs, pattern):
    eng, cache = _engine()
    with pytest.raises(ValueError, match=pattern):
        eng.run(reqs)
    assert cache.free_pages == 3 and not list(cache._lens)


def test_sampler_noise_is_distinct_per_seed_sequence_and_position():
    """The generator seed was a linear mix, seed * 1_000_003 + seq * 10_007 + position, so
    (seq 0, position 10007) drew the noise of (seq 1, position 0), and (seed 1, seq 0, position
    697) that of (seed 0, seq 100, position 0): the same token choice for any logits."""
    from rlk_ops.rollout.engine import noise_seed
    assert noise_seed(0, 0, 10_007) != noise_seed(0, 1, 0)
    assert noise_seed(1, 0, 697) != noise_seed(0, 100, 0)
    keys = {(s, q, p) for s in range(3) for q in range(40) for p in range(0, 30_000, 997)}
    assert len({noise_seed(*k) for k in keys}) == len(keys)
    assert all(0 <= noise_seed(*k) < 2 ** 63 for k in keys)
    logp = torch.log_softmax(torch.randn(64, dtype=torch.float64), -1)
    sampler = Sampler(seed=0)
    assert len({sampler(0, 10_007, logp), sampler(1, 0, logp)} | {sampler(q, 3, logp) for q in range(12)}) > 1


def test_a_request_waits_for_the_pages_it_needs():
    """Two requests that each fit, but not both at once (2 pages each, 3 in the cache): the
    second waits until the first finishes. Before, both were admitted and the run failed on a
    full cache mid-way, losing the finished sequence's result (a session 31 audit). A second run
    on the same engine logs its own steps only."""
    eng, cache = _engine(num_pages=3, max_running=2)
    reqs = [Request(0, list(range(1, 8)), 2), Request(1, list(range(1, 8)), 2)]
    res = eng.run(reqs)
    assert [len(r.generated) for r in res] == [2, 2] and cache.free_pages == 3
    assert res[1].admitted_step > res[0].finished_step
    steps = len(eng.log)
    eng2, _ = _engine(num_pages=3, max_running=1)
    assert [r.generated for r in eng2.run(reqs)] == [r.generated for r in res]
    assert len(eng.run(reqs)) == 2 and len(eng.log) == steps and eng.log[0].step == 0


def test_a_run_that_fails_midway_releases_what_it_admitted():
    """A run whose forward fails at its third step leaves the cache as it found it, so the next
    run can use the same ids; a request that cannot get its pages while nothing of the run is
    running (pages held outside the run) is named."""
    calls = []

    def failing(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("forward failed")
        return type(model).forward_rollout(model, *args, **kwargs)

    eng, cache = _engine(num_pages=6, max_running=2, forward=failing)
    reqs = [Request(0, list(range(1, 8)), 2), Request(1, list(range(1, 8)), 2)]
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.run(reqs)
    assert cache.free_pages == 6 and not list(cache._lens)
    eng2, cache2 = _engine(num_pages=4, max_running=1)
    cache2.add(99)
    cache2.reserve(99, 5)   # 2 of 4 pages held by a sequence outside the run
    small, big = Request(0, [1, 2, 3], 3), Request(1, list(range(1, 12)), 2)   # 2 and 3 pages
    with pytest.raises(CacheFullError, match=r"request 1: needs 3 pages of 4 tokens but only 2 of 4 are free"):
        eng2.run([small, big])   # refused before anything ran (it failed after request 0 had finished)
    assert cache2.free_pages == 2 and list(cache2._lens) == [99] and eng2.log == []


def test_engine_and_sampler_arguments_are_named():
    model = _tiny()
    wrong = PagedKVCache(2, 4, 4, model.config.num_kv_heads, model.config.head_dim)
    with pytest.raises(ValueError, match=r"RolloutEngine: the cache has num_layers = 2 but the model's config has 1"):
        RolloutEngine(model, wrong)
    for kw, pattern in (({"temperature": 0.0}, r"temperature must be a finite number > 0, got 0.0"),
                        ({"temperature": float("nan")}, r"temperature must be a finite number > 0, got nan"),
                        ({"seed": 10 ** 14}, r"seed must be None \(greedy\) or an int in \[0, 2\*\*32\)")):
        with pytest.raises(ValueError, match=pattern):
            Sampler(**kw)
    with pytest.raises(ValueError, match=r"cache_for page_size must be a positive int, got 0"):
        cache_for(model, _requests(), 0, 2)
    with pytest.raises(ValueError, match=r"RolloutEngine chunk must be a positive int, got 2.5"):
        RolloutEngine(model, cache_for(model, _requests(), 8, 2), chunk=2.5)


def test_engine_arguments_are_checked_before_anything_runs():
    """A session 33 audit: these failed after the first forward (an int sampler, a str on_token), with
    an AttributeError (cache None, a torch.compile wrapper), or at the first append (the dtype)."""
    model = _tiny()
    reqs = _requests()
    cache = cache_for(model, reqs, 8, 2)
    for kw, pattern in (({"sampler": 5}, r"RolloutEngine: sampler must be callable or None, got int 5"),
                        ({"on_token": "x"}, r"RolloutEngine: on_token must be callable or None, got str 'x'"),
                        ({"forward": 1.5}, r"RolloutEngine: forward must be callable or None, got float 1.5"),
                        ({"logprobs": []}, r"RolloutEngine: logprobs must be callable or None, got list \[\]")):
        with pytest.raises(ValueError, match=pattern):
            RolloutEngine(model, cache, **kw)
    with pytest.raises(ValueError, match=r"RolloutEngine: cache must be a PagedKVCache, got NoneType"):
        RolloutEngine(model, None)
    with pytest.raises(ValueError, match=r"RolloutEngine: model must have a forward_rollout method .* got "
                                         r"OptimizedModule: torch.compile\(model\) compiles model.forward only"):
        RolloutEngine(torch.compile(model), cache)
    wide = PagedKVCache(model.config.num_layers, 8, 8, model.config.num_kv_heads, model.config.head_dim,
                        dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the cache holds torch.float64 but the model's k_proj makes "
                                         r"torch.bfloat16; make the cache with dtype=torch.bfloat16"):
        RolloutEngine(model, wide)
    RolloutEngine(model, wide, forward=type(model).forward_rollout)   # a custom forward: its own casts
    for spare, pattern in ((-10, r"spare_pages must be an int >= 0, got int -10"),
                           (2.5, r"spare_pages must be an int >= 0, got float 2.5"),
                           (True, r"spare_pages must be an int >= 0, got bool True")):
        with pytest.raises(ValueError, match=pattern):
            cache_for(model, reqs, 8, 2, spare_pages=spare)
    with pytest.raises(ValueError, match=r"cache_for requests must be a list or tuple of Request objects, got "
                                         r"tuple \(0, \[1\], 2\)"):
        cache_for(model, [(0, [1], 2)], 8, 2)
    assert cache.free_pages == cache.num_pages   # nothing ran


def test_a_custom_samplers_token_is_checked():
    """The sampler's token was taken unchecked: -1 came back as a result with token vocab-1's log-prob
    (a negative index), past the vocabulary a step later the embedding raised an IndexError naming
    neither (a session 34 audit). Each run leaves the cache as it found it; a numpy int is stored as int."""
    import numpy as np

    model = _tiny()
    vocab = model.config.vocab_size
    reqs = [Request(0, [1, 2], 1), Request(1, [3], 3)]
    cache = cache_for(model, reqs, 8, 2)
    for bad in (-1, vocab, 2.0, True, torch.tensor(3)):
        engine = RolloutEngine(model, cache, sampler=lambda seq, pos, logp, bad=bad: bad)
        with pytest.raises(ValueError, match=rf"the sampler returned {type(bad).__name__} .* for request 0 at "
                                             rf"position 2; a token id must be an int in \[0, {vocab}\)"):
            engine.run(reqs)
        assert cache.free_pages == cache.num_pages
    res = RolloutEngine(model, cache, sampler=lambda seq, pos, logp: np.int64(5)).run(reqs)
    assert [type(t) for r in res for t in r.generated] == [int] * 4 and res[1].generated == [5, 5, 5]


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300, 1e-12])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    """logp / T overflowed to -inf in every entry below ~1e-306, and argmax then picked token 0 whatever
    the logits (a session 33 audit); the noise scaled by T picks the greedy token there."""
    logp = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0, -2.0], dtype=torch.float64), 0)
    picks = {Sampler(seed=7, temperature=temperature)(0, pos, logp) for pos in range(40)}
    assert picks == {1}


def test_the_sampler_keeps_its_tokens_where_the_division_does_not_overflow():
    """Only a row whose every score overflowed is scored the other way: every other row's token is
    argmax(logp / T + gumbel), as before."""
    gen = torch.Generator().manual_seed(3)
    for t in (1e-300, 0.3, 0.7, 0.99, 1.0, 3.0):
        s = Sampler(seed=11, temperature=t)
        for pos in range(50):
            logp = torch.log_softmax(torch.randn(64, generator=gen, dtype=torch.float64), 0)
            g = torch.Generator().manual_seed(noise_seed(11, 0, pos))
            u = torch.rand(logp.shape, generator=g, dtype=torch.float64).clamp_min(1e-300)
            assert s(0, pos, logp) == int((logp / t - torch.log(-torch.log(u))).argmax())


def test_a_float32_embedding_table_with_a_bfloat16_cache_runs():
    """The cache's dtype is what k_proj makes: a bf16 model whose embedding table stays in float32
    (its output cast to bf16) ran before the engine checked the dtype, and runs (a session 33 review:
    the first form of the check compared the embeddings' dtype and refused it)."""
    class Fp32Embedding(torch.nn.Embedding):
        def forward(self, x):
            return super().forward(x).to(torch.bfloat16)

    model = _tiny()
    emb = Fp32Embedding(model.config.vocab_size, model.config.hidden_size, dtype=torch.float32)
    with torch.no_grad():
        emb.weight.copy_(model.embed_tokens.weight.float())
    model.embed_tokens = emb
    reqs = [Request(0, [1, 2, 3, 4], 3)]
    cache = cache_for(model, reqs, 8, 1)
    assert cache.k[0].dtype == torch.bfloat16
    out = RolloutEngine(model, cache, max_running=1).run(reqs)
    assert len(out[0].generated) == 3


def test_inductor_compiled_model_equals_eager_training():
    """A compiled rollout (compiled_rollout: TinyQwen3.forward_paged under torch.compile) on the
    default backend (Inductor): its log-probs and attention rows equal the eager trainer's bits,
    and a compiled forward_train's logits and gradients equal eager's. As plain code the SwiGLU was
    fused by Inductor (silu's fp32 value kept for the product, exp evaluated its own way): 7 of 7
    tokens mismatched the eager trainer (a session 35 audit); it is an op now (rollout/glue.py). Without it
    the compiled training forward's logits differ from eager's too, and so every gradient."""
    cfg = TinyQwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16)
    model = TinyQwen3(cfg, seed=1)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(i, torch.randint(0, 64, (n,), generator=g).tolist(), m)
            for i, (n, m) in enumerate([(5, 40), (90, 3), (2, 50), (30, 20), (17, 9), (60, 30)])]
    from torch._inductor.compile_fx import compile_fx

    from rlk_ops.rollout.model import compiled_rollout
    graphs, calls = [], []

    def inductor(gm, example_inputs):   # Inductor, counting the graphs it compiles and their calls
        graphs.append(gm)
        compiled = compile_fx(gm, example_inputs)

        def run(*a):
            calls.append(1)
            return compiled(*a)
        return run

    # compiled_rollout: the allocator's lookups stay eager, so the graphs do not follow the page tables
    # (compiling forward_rollout whole compiled 35 graphs for 32 steps, past Dynamo's recompile limit
    # of 8, after which steps run eagerly, unseen)
    eng = RolloutEngine(model, cache_for(model, reqs, 8, 3), max_running=3, chunk=16, sampler=Sampler(None),
                        forward=compiled_rollout(dynamic=True, backend=inductor))
    results = eng.run(reqs)
    assert len(calls) >= len(eng.log) > 8 >= len(graphs), (len(calls), len(eng.log), len(graphs))
    # each compiled_rollout is a function of its own: Dynamo's recompile limit counts per code object, and
    # sharing one made a process's third model run eagerly (a session 35 review)
    for dtype in (torch.float32, torch.float16):
        other = TinyQwen3(cfg, seed=2, dtype=dtype)
        graphs.clear(), calls.clear()
        few = reqs[:3]
        e2 = RolloutEngine(other, cache_for(other, few, 8, 3), max_running=3, chunk=16, sampler=Sampler(None),
                           forward=compiled_rollout(dynamic=True, backend=inductor))
        e2.run(few)
        assert len(calls) >= len(e2.log) > 0 and graphs, (dtype, len(calls), len(e2.log), len(graphs))
    logps, trace, starts = demo.rescore(model, results, "cpu")
    rep = demo._compare(results, logps, trace, starts, cfg.num_layers)
    assert rep["tokens"] == 152 and rep["mismatched_tokens"] == 0
    assert rep["attention_positions"] > 0 and rep["mismatched_attention_positions"] == 0

    tokens = torch.randint(0, 64, (14,), generator=g)
    positions = torch.cat([torch.arange(9), torch.arange(5)])
    cu = torch.tensor([0, 9, 14], dtype=torch.int32)

    def train(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(model, tokens, positions, cu, 9)
        (logits.float() * torch.linspace(-1, 1, 64)).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = train(TinyQwen3.forward_train)
    compiled = train(torch.compile(TinyQwen3.forward_train, fullgraph=True))
    assert torch.equal(eager[0], compiled[0])
    # every gradient, the embedding's too: its backward (sums over repeated token ids) is an op of its own,
    # rlk_model::embedding_bwd (before session 46 Inductor summed them in its own order)
    assert tokens.unique().numel() < tokens.numel()
    grads = list(eager[1])
    assert len(grads) == 11 * cfg.num_layers + 3   # per layer 2 norms, 6 attention, 3 MLP; embedding, norm, lm_head
    assert all(torch.equal(eager[1][n], compiled[1][n]) for n in grads), \
        [n for n in grads if not torch.equal(eager[1][n], compiled[1][n])]


def test_swiglu_op_is_checked_and_its_gradient_is_silu_times_up():
    """rlk_model::swiglu: opcheck (fake, schema, autograd registration) and the analytic backward against
    gradcheck in float64; bf16 forward is silu rounded once, times up."""
    from rlk_ops.rollout import glue

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
    torch.library.opcheck(torch.ops.rlk_model.swiglu.default, (x.requires_grad_(),))
    torch.library.opcheck(torch.ops.rlk_model.swiglu_bwd.default, (torch.randn(5, 3, 4, dtype=torch.float64), x.detach()))
    assert torch.autograd.gradcheck(glue.swiglu, (x,))
    xb = torch.randn(7, 10, generator=g).to(torch.bfloat16)
    gate, up = xb.chunk(2, -1)
    assert torch.equal(glue.swiglu(xb), glue.silu(gate) * up)
    with pytest.raises(ValueError, match=r"rlk_model::swiglu: gate_up must be \[..., 2 \* intermediate\] .*got shape \[2, 3\]"):
        glue.swiglu(torch.zeros(2, 3))
    # a permuted gate_up: the op's output is contiguous as its fake says (it followed the input's strides,
    # and opcheck and Inductor failed), and dout must be the output's dtype and shape
    xt = torch.randn(8, 6, generator=g).t()
    torch.library.opcheck(torch.ops.rlk_model.swiglu.default, (xt,))
    torch.library.opcheck(torch.ops.rlk_model.swiglu.default, (torch.randn(4, 3, 6, generator=g).permute(1, 0, 2),))
    with pytest.raises(ValueError, match=r"swiglu_bwd: dout must be torch.bfloat16 \[7, 5\] .*got torch.float32 \[7, 5\]"):
        torch.ops.rlk_model.swiglu_bwd(torch.zeros(7, 5), xb)


# ----------------------------------------------------- the model's entry points (a session 38 audit)
def test_paged_caches_are_checked_before_any_layer_writes():
    """A cache made for fewer layers (a bare IndexError after layer 0 had written its cache), a later
    layer's cache of another dtype (layer 0 written first), and one tensor shared by two layers
    (accepted: each layer overwrote the other's keys, the logits wrong) are refused up front, and
    the caches are left as they were."""
    model = _tiny(layers=2)
    cfg = model.config
    short = PagedKVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim)
    short.add(0)
    before = short.k[0].clone()
    slots = short.reserve(0, 5)
    tokens, positions = torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5)[None]
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches must be a list of 2 caches \(one per layer\), got "
                                                    r"list of 1"):
        model.forward_rollout(tokens, positions, short, [0], slots)
    assert torch.equal(short.k[0], before)
    shape = (4, 4, cfg.num_kv_heads, cfg.head_dim)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    slot = torch.tensor([8])
    kc = [torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.float32)]
    vc = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches\[1\] must have the dtype and device of what its "
                                                    r"layer's k_proj makes, torch.bfloat16 on cpu, got torch.float32"):
        model.forward_paged(tokens[:, :1], positions[:, :1], kc, vc, table, lens, slot)
    assert not kc[0].any()
    shared = [torch.zeros(shape, dtype=torch.bfloat16)] * 2
    with pytest.raises(rlk_ops.RlkInputError, match=r"k_caches\[1\] shares memory with k_caches\[0\]"):
        model.forward_paged(tokens[:, :1], positions[:, :1], shared, vc, table, lens, slot)
    whole = torch.zeros(2, *shape, dtype=torch.bfloat16)   # halves of one buffer are caches of their own
    views = torch.zeros(2, *shape, dtype=torch.bfloat16)
    out = model.forward_paged(tokens[:, :1], positions[:, :1], list(whole), list(views), table, lens, slot)
    assert out.shape == (1, 1, cfg.vocab_size)
    with pytest.raises(rlk_ops.RlkInputError, match=r"v_caches\[0\] must be \[num_pages, page_size, "):
        model.forward_paged(tokens[:, :1], positions[:, :1], list(whole), [views[0][..., :1], views[1]], table,
                            lens, slot)
    with pytest.raises(rlk_ops.RlkInputError, match=r"v_caches\[1\] must have k_caches\[0\]'s shape"):
        model.forward_paged(tokens[:, :1], positions[:, :1], list(whole), [views[0], views[1, :2]], table, lens,
                            slot)


_CU3 = torch.tensor([0, 3], dtype=torch.int32)


@pytest.mark.parametrize("call,pattern", [
    (lambda m, c, s: m.forward_rollout(torch.tensor([[1, 2, m.config.vocab_size]]), torch.arange(3)[None], c, [0], s),
     r"forward_paged: tokens\[0, 2\] = \d+ is not a token id; token ids must be in \[0, \d+\) \(the vocabulary\)"),
    (lambda m, c, s: m.forward_rollout(torch.tensor([1, 2, 3]), torch.arange(3), c, [0], s),
     r"tokens must be 2-D \[B, Sq\] .*, got shape \[3\]"),
    (lambda m, c, s: m.forward_rollout(torch.tensor([[1., 2, 3]]), torch.arange(3)[None], c, [0], s),
     r"tokens must be torch.int64 or torch.int32 token ids, got torch.float32"),
    (lambda m, c, s: m.forward_rollout([[1, 2, 3]], torch.arange(3)[None], c, [0], s),
     r"tokens must be a torch.Tensor \[B, Sq\] .*, got list"),
    (lambda m, c, s: m.forward_train(torch.tensor([1, -2, 3]), torch.arange(3), _CU3),
     r"forward_train: tokens\[1\] = -2 is not a token id"),
    (lambda m, c, s: m.forward_train(torch.tensor([[1, 2, 3]]), torch.arange(3), _CU3),
     r"forward_train: tokens must be 1-D \[T\] \(packed\), got shape \[1, 3\]"),
])
def test_token_ids_are_named(call, pattern):
    """The embedding's own errors ("index out of range in self", "not enough values to unpack") named
    neither the argument nor the value; the cache is left as it was."""
    model = _tiny(layers=2)
    cache = cache_for(model, [Request(0, [1, 2, 3], 1)], 4, 1)
    cache.add(0)
    slots = cache.reserve(0, 3)
    with pytest.raises(rlk_ops.RlkInputError, match=pattern):
        call(model, cache, slots)
    assert not any(t.any() for t in cache.k + cache.v)


def test_allocator_lookups_take_lists_not_generators():
    """A generator was used up by the checks: seq_lens returned an empty tensor, reserve_batch failed
    in torch.cat naming nothing."""
    cache = PagedKVCache(1, 4, 4, 1, 8)
    for s in (0, 1):
        cache.add(s)
    cache.reserve(0, 3)
    with pytest.raises(ValueError, match=r"PagedKVCache.seq_lens: seqs must be a list, tuple or range of sequence "
                                         r"ids, got generator"):
        cache.seq_lens(s for s in [0, 1])
    with pytest.raises(ValueError, match=r"reserve_batch: requests must be a list, tuple or range of \(seq, "
                                         r"n_new\) pairs"):
        cache.reserve_batch((s, 1) for s in (0, 1))
    with pytest.raises(ValueError, match=r"page_table: seqs must be a list, tuple or range of sequence ids, got int 0"):
        cache.page_table(0)
    assert cache.length(1) == 0 and torch.equal(cache.seq_lens((0, 1)), torch.tensor([3, 0], dtype=torch.int32))
    assert torch.equal(cache.seq_lens(range(2)), cache.seq_lens([0, 1]))


def test_truncate_undoes_a_reservation_whose_forward_failed():
    """reserve() had no way back: after a forward that failed (bad tokens here) a caller that reserved
    again attended to slots nothing had written (a session 38 audit's observation). truncate() gives
    them back, and the retried step equals a run that never failed, bit for bit."""
    model = _tiny(layers=2)
    reqs = [Request(0, [1, 2, 3, 4, 5, 6], 1)]
    tokens, positions = torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.arange(6)[None]
    clean = cache_for(model, reqs, 4, 1)
    clean.add(0)
    want = model.forward_rollout(tokens, positions, clean, [0], clean.reserve(0, 6))
    cache = cache_for(model, reqs, 4, 1)
    cache.add(0)
    free = cache.free_pages
    slots = cache.reserve(0, 6)
    with pytest.raises(rlk_ops.RlkInputError, match="is not a token id"):
        model.forward_rollout(torch.tensor([[1, 2, 3, 4, 5, 999]]), positions, cache, [0], slots)
    cache.truncate(0, 0)
    assert cache.length(0) == 0 and cache.free_pages == free and cache.pages(0) == []
    got = model.forward_rollout(tokens, positions, cache, [0], cache.reserve(0, 6))
    assert torch.equal(got, want)
    cache.truncate(0, 5)   # a page boundary inside: page 1 (tokens 4..5) is kept for token 4
    assert cache.length(0) == 5 and len(cache.pages(0)) == 2
    with pytest.raises(ValueError, match=r"truncate: length must be at most sequence 0's length 5, got 6"):
        cache.truncate(0, 6)
    with pytest.raises(ValueError, match=r"length must be an int >= 0, got -1"):
        cache.truncate(0, -1)


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def _tiny_engine(num_pages):
    cfg = TinyQwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=32)
    cache = PagedKVCache(1, num_pages, 4, 1, 32, dtype=torch.bfloat16)
    return RolloutEngine(TinyQwen3(cfg), cache, max_running=2, chunk=8), cache


def test_a_request_that_needs_every_page_runs():
    eng, cache = _tiny_engine(2)
    (res,) = eng.run([Request(0, list(range(1, 8)), 2)])   # 7 + 2 - 1 = 8 cached tokens = 2 pages of 4
    assert len(res.generated) == 2 and cache.free_pages == 2


def test_a_request_whose_id_is_already_cached_is_refused_before_any_runs():
    eng, cache = _tiny_engine(8)
    cache.add(5)
    with pytest.raises(ValueError, match=r"request 5: seq_id appears twice in the requests or is already in the cache"):
        eng.run([Request(0, [1, 2, 3], 1), Request(5, [1, 2], 1)])
    assert eng.log == [] and 0 not in cache
