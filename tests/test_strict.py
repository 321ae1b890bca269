"""Strict mode (the default) never falls back; non-strict falls back and records it."""
import pytest
import torch

import rlk_ops
from rlk_ops.meta import provenance


def _qkv():
    return torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)


def test_default_is_strict_and_records_provenance():
    assert rlk_ops.strict_mode()
    with provenance.capture() as log:
        rlk_ops.attention(*_qkv())
    (rec,) = log.records()
    assert (rec.op, rec.requested_backend, rec.actual_backend, rec.fallback, rec.calls) == (
        "attention_fwd", "cpu", "cpu", False, 1)


def test_records_name_the_kernel_a_backend_noted(monkeypatch):
    """``kernel``: the backend's name, or what the backend's code noted for that call (the fa4
    canonical decode notes Triton's pair kernel), each name once, in order. A nested dispatched op
    keeps its own notes, also when it raises and the outer kernel goes on (its slot is popped: the
    outer kernel's next note is the outer call's). A call that raised is not recorded."""
    from rlk_ops.kernels import cpu as cpu_pkg
    from rlk_ops.kernels import dispatch

    plain_paged, plain_merge = cpu_pkg.paged_attention, cpu_pkg.merge_attn_states

    def merge(out, lse, *args, **kwargs):
        provenance.note_kernel("test.inner")
        if out.shape[0] == 3:
            raise ValueError("inner refused")
        return plain_merge(out, lse, *args, **kwargs)

    def paged(*args, **kwargs):
        provenance.note_kernel("test.outer")
        rlk_ops.merge_attn_states(torch.randn(2, 1, 1, 4, 8), torch.randn(2, 1, 4, 1))
        with pytest.raises(ValueError, match="inner refused"):
            rlk_ops.merge_attn_states(torch.randn(3, 1, 1, 4, 8), torch.randn(3, 1, 4, 1))
        provenance.note_kernel("test.after")
        provenance.note_kernel("test.outer")
        if args[1].shape[1] == 3:
            raise ValueError("refused")
        return plain_paged(*args, **kwargs)

    monkeypatch.setattr(cpu_pkg, "paged_attention", paged)
    monkeypatch.setattr(cpu_pkg, "merge_attn_states", merge)
    monkeypatch.setattr(dispatch, "_cache", {})
    kc = torch.randn(4, 4, 2, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 8)
    with provenance.capture() as log:
        rlk_ops.paged_attention(q, kc, kc, table, torch.tensor([5, 3], dtype=torch.int32))
        with pytest.raises(ValueError, match="refused"):
            rlk_ops.paged_attention(q, kc[:, :3], kc[:, :3], table, torch.tensor([5, 3], dtype=torch.int32))
        rlk_ops.attention(*_qkv())
    got = {(r.op, r.actual_backend, r.kernel, r.calls) for r in log.records()}
    assert got == {("paged_attention", "cpu", "test.outer+test.after", 1),
                   ("merge_attn_states", "cpu", "test.inner", 2), ("attention_fwd", "cpu", "cpu", 1)}
    assert provenance.call_slots() == []   # every slot popped, the raising calls' too
    provenance.note_kernel("outside")   # no dispatched call: nothing to note into, nothing raised
    assert provenance.call_slots() == []


def test_strict_refuses_unavailable_backend():
    with rlk_ops.use_backend(attention_fwd="flashinfer"), provenance.capture() as log:
        with pytest.raises(rlk_ops.StrictModeError, match=r"rlk::attention_fwd on cpu: backend 'flashinfer' "
                                                          r"unavailable: .*Strict mode .* never falls back"):
            rlk_ops.attention(*_qkv())
    assert log.records() == []  # nothing ran


def test_non_strict_falls_back_and_records_why():
    q, k, v = _qkv()
    ref = rlk_ops.attention(q, k, v)
    with rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="flashinfer"), provenance.capture() as log:
        out = rlk_ops.attention(q, k, v)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    (rec,) = log.fallbacks()
    assert rec.requested_backend == "flashinfer" and rec.actual_backend == "cpu"
    assert "unavailable" in rec.fallback_reason
    assert rlk_ops.strict_mode()  # the context restored strictness


def test_a_fallback_that_refuses_says_it_was_the_fallback():
    """Non-strict, flashinfer requested on CPU tensors: the CPU reference refuses fixed:4, and its
    error alone did not say that flashinfer was asked for and why it did not run (a session 34 audit)."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    args = (torch.randn(2, 1, 4, 8, generator=g), kc, vc, torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32),
            torch.tensor([9, 6], dtype=torch.int32))
    with rlk_ops.strict(False), rlk_ops.use_backend(paged_attention="flashinfer"):
        with pytest.raises(ValueError, match="not implemented by the cpu backend") as info:
            rlk_ops.paged_attention(*args, split_kv="fixed:4")
    (note,) = info.value.__notes__
    assert note.startswith("rlk::paged_attention ran on the fallback backend 'cpu' (non-strict): backend "
                           "'flashinfer' unavailable: it runs on cuda tensors")
    with pytest.raises(ValueError, match="not implemented by the cpu backend") as info:   # no fallback: no note
        rlk_ops.paged_attention(*args, split_kv="fixed:4")
    assert not getattr(info.value, "__notes__", None)


def test_a_fallback_inside_a_nested_capture_reaches_every_enclosing_log():
    """The binding probe opens a capture of its own: its calls once went to that inner log only,
    so an outer capture (and the process-wide log) never saw their fallbacks (review)."""
    provenance.current().clear()
    with rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="flashinfer"):
        with provenance.capture() as outer:
            with provenance.capture() as inner:
                rlk_ops.attention(*_qkv())
            rlk_ops.attention(*_qkv())
    (rec,) = inner.fallbacks()
    assert rec.calls == 1 and rec.actual_backend == "cpu"
    for log in (outer, provenance.current()):
        (rec,) = log.fallbacks()
        assert (rec.op, rec.requested_backend, rec.actual_backend, rec.calls) == ("attention_fwd", "flashinfer",
                                                                                  "cpu", 2)


def test_two_fallback_reasons_are_two_records():
    """Keyed without the reason, the second reason of one op's fallbacks was lost under the first's
    count (a session 34 audit)."""
    log = provenance.ProvenanceLog()
    for reason in ("it runs on cuda tensors", "no kernel for rlk::attention_fwd", "it runs on cuda tensors"):
        log.record("attention_fwd", "triton", "cpu", True, reason, "cpu")
    assert sorted((r.fallback_reason, r.calls) for r in log.fallbacks()) == [
        ("it runs on cuda tensors", 2), ("no kernel for rlk::attention_fwd", 1)]


def test_log_readers_wait_for_the_lock():
    """records(), snapshot(), fallbacks() and clear() take the lock record() takes: iterating the dict
    while another thread's first call of an op grew it raised (a session 34 audit). Each reader is
    started while the test holds the lock and must still be waiting when it is let go."""
    import threading

    log = provenance.ProvenanceLog()
    log.record("linear", "cpu", "cpu", False, None, "cpu")
    for read in (log.records, log.snapshot, log.fallbacks, log.clear):
        done = threading.Event()
        with log._lock:
            t = threading.Thread(target=lambda: (read(), done.set()))
            t.start()
            assert not done.wait(0.2), f"{read.__name__} ran without the lock"
        t.join(5)
        assert done.is_set()


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        with rlk_ops.use_backend(attention_fwd="cudnn"):
            pass


def test_environment_record():
    env = provenance.environment()
    assert env["torch"] == torch.__version__ and "gpu_arch" in env and "flash_attn_4" in env



def _paged_args():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    return torch.randn(2, 1, 4, 8, generator=g), kc, vc, table, torch.tensor([9, 6], dtype=torch.int32)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_settings_inside_a_compiled_function_apply_to_its_ops(backend):
    """strict(), use_backend() and set_strict_mode() inside a torch.compile'd function: traced,
    Dynamo applied each global's set and restore together after the graph, so the ops inside ran
    with the outer setting: a strict block served the non-strict lane, and a backend request
    was ignored (a session 34 audit). They now run eagerly at a graph break; compiled behaves
    as eager, and the state is restored after."""
    args = _paged_args()

    def strict_inside(*a):
        with rlk_ops.strict(True):
            return rlk_ops.paged_attention_auto(*a)

    def relaxed_inside(*a):
        with rlk_ops.strict(False):
            return rlk_ops.paged_attention_auto(*a)

    def backend_inside(q, k, v):
        with rlk_ops.use_backend(attention_fwd="flashinfer"):   # flashinfer cannot run on CPU tensors
            return rlk_ops.attention(q, k, v)

    def set_inside(*a):
        rlk_ops.set_strict_mode(False)
        out = rlk_ops.paged_attention_auto(*a)
        rlk_ops.set_strict_mode(True)
        return out

    for fn in (lambda f: f, lambda f: torch.compile(f, backend=backend)):
        torch._dynamo.reset()
        with rlk_ops.strict(False):
            with pytest.raises(rlk_ops.StrictModeError, match="automatic split-KV depends on the batch"):
                fn(strict_inside)(*args)
            assert not rlk_ops.strict_mode()
        with pytest.raises(rlk_ops.StrictModeError, match="backend 'flashinfer' unavailable"):
            fn(backend_inside)(*_qkv())
        assert rlk_ops.kernels.dispatch._overrides == {} and rlk_ops.strict_mode()
        with provenance.capture() as log:
            a, b = fn(relaxed_inside)(*args), fn(set_inside)(*args)
        assert rlk_ops.strict_mode()
        assert torch.equal(a[0], b[0]) and {r.op for r in log.records()} == {"paged_attention_auto"}


def test_settings_inside_fullgraph_are_refused_by_name():
    def fn(q, k, v):
        with rlk_ops.strict(False):
            return rlk_ops.attention(q, k, v)

    def checks_off(q, k, v):   # value_checks() too (traced, it was ignored; a session 38 audit)
        with rlk_ops.value_checks(False):
            return rlk_ops.attention(q, k, v)

    for f in (fn, checks_off):
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported,
                           match=r"rlk_ops.strict\(\) / rlk_ops.use_backend\(\) / rlk_ops.value_checks\(\) changes "
                                 r"process-wide state"):
            torch.compile(f, fullgraph=True, backend="eager")(*_qkv())
    assert rlk_ops.strict_mode()


def test_value_checks_inside_a_compiled_function_apply_to_its_ops():
    """Traced, value_checks(False) set and restored the flag together after the graph: an op inside read
    the outer setting (a session 38 audit). Now the block runs eagerly at a graph break. The op reads
    the flag when it runs, as the rlk ops' value checks do."""
    from rlk_ops.ops import _validate as V

    seen = []

    @torch.library.custom_op("rlk_test::read_value_checks", mutates_args=())
    def read(x: torch.Tensor) -> torch.Tensor:
        seen.append(V.VALUE_CHECKS)
        return x.clone()

    @read.register_fake
    def _(x):
        return torch.empty_like(x)

    def fn(x):
        with rlk_ops.value_checks(False):
            return read(x) + 1
    outer = V.VALUE_CHECKS
    with rlk_ops.value_checks(True):
        torch._dynamo.reset()
        torch.compile(fn, backend="eager")(torch.zeros(2))
    assert seen[-1] is False and V.VALUE_CHECKS is outer


@pytest.mark.parametrize("value", [None, 0, [], "off"])
def test_value_checks_takes_a_bool(value):
    """None, 0 and [] turned the checks off, "off" on (bool(enabled); a session 38 audit)."""
    with pytest.raises(TypeError, match=rf"value_checks: enabled must be a bool, got {type(value).__name__}"):
        rlk_ops.value_checks(value)


def test_settings_refuse_to_decorate_a_generator():
    """A decorated generator function ran its body after the block had closed: a requested backend was
    dropped without a trace (a session 38 audit)."""
    def gen():
        yield rlk_ops.strict_mode()

    async def coro():
        return None
    for setting in (rlk_ops.strict(False), rlk_ops.use_backend(attention_fwd="cpu"), rlk_ops.value_checks(False)):
        for fn in (gen, coro):
            with pytest.raises(TypeError, match=rf"cannot decorate \S*{fn.__name__}, a generator or coroutine "
                                                rf"function"):
                setting(fn)


def test_strict_as_a_decorator_and_nested():
    @rlk_ops.strict(False)
    def relaxed():
        with rlk_ops.strict(True):
            assert rlk_ops.strict_mode()
        return rlk_ops.strict_mode()

    assert relaxed() is False and relaxed() is False and rlk_ops.strict_mode()
    scoped = rlk_ops.strict(False)
    with scoped:
        with scoped:   # the same object entered twice restores in order
            assert not rlk_ops.strict_mode()
        assert not rlk_ops.strict_mode()
    assert rlk_ops.strict_mode()


@pytest.mark.parametrize("value", [None, [], 0, "off"])
def test_strict_mode_takes_a_bool_only(value):
    """bool(None) and bool([]) once turned strict mode off silently, while "off" left it on."""
    with pytest.raises(TypeError, match=rf"set_strict_mode: enabled must be a bool, got {type(value).__name__}"):
        rlk_ops.set_strict_mode(value)
    with pytest.raises(TypeError, match=r"strict: enabled must be a bool"):
        with rlk_ops.strict(value):
            pass
    assert rlk_ops.strict_mode()


def test_use_backend_names_a_backend_that_is_not_a_name():
    with pytest.raises(ValueError, match=r"use_backend: the backend for linear must be a backend name \(str\), got "
                                         r"list \['cpu'\]"):
        with rlk_ops.use_backend(linear=["cpu"]):
            pass


def test_fa4_names_an_op_it_does_not_cover():
    """Once a KeyError from the loader's table of required controls (reached with FA4 installed)."""
    from rlk_ops.kernels.dispatch import BackendUnavailable
    from rlk_ops.kernels.fa4 import loader

    with pytest.raises(BackendUnavailable, match=r"FA4 has no kernel for rlk::linear \(it covers attention_bwd, "):
        loader.check_available("linear")


def test_a_collective_falls_back_to_c10d_not_to_the_cpu_reference(single_process_group):
    """Non-strict, an unavailable backend for a collective once fell back to 'cpu', which has no
    collectives, and the error lost the first backend's reason; its fallback is c10d, recorded."""
    x = torch.randn(4, 3)
    with pytest.raises(rlk_ops.StrictModeError, match=r"rlk::all_gather on cpu: backend 'triton' unavailable"):
        with rlk_ops.use_backend(all_gather="triton"):
            rlk_ops.all_gather(x)
    with rlk_ops.strict(False), rlk_ops.use_backend(all_gather="triton"), provenance.capture() as log:
        out = rlk_ops.all_gather(x)
    assert torch.equal(out, x)
    (rec,) = log.fallbacks()
    assert (rec.requested_backend, rec.actual_backend) == ("triton", "c10d") and "unavailable" in rec.fallback_reason


@pytest.mark.parametrize("env, strict, checks", [({}, True, True), ({"RLK_STRICT": "0"}, False, True),
                                                  ({"RLK_STRICT": "off", "RLK_VALUE_CHECKS": "0"}, False, False),
                                                  ({"RLK_VALUE_CHECKS": "no"}, True, False),
                                                  ({"RLK_STRICT": "yes", "RLK_VALUE_CHECKS": "1"}, True, True)])
def test_environment_variables_set_the_process_defaults(env, strict, checks):
    """RLK_STRICT and RLK_VALUE_CHECKS (README) had no test. A new process reads them at import: RLK_STRICT=0
    lets an unavailable backend fall back, recorded; the default refuses."""
    import os
    import subprocess
    import sys

    code = ("import torch, rlk_ops; from rlk_ops.ops import _validate as V; from rlk_ops.meta import provenance\n"
            "q = torch.randn(1, 4, 2, 16)\n"
            "try:\n"
            "    with rlk_ops.use_backend(attention_fwd='flashinfer'), provenance.capture() as log:\n"
            "        rlk_ops.attention(q, q, q)\n"
            "    ran = [r.actual_backend for r in log.fallbacks()]\n"
            "except rlk_ops.StrictModeError:\n"
            "    ran = 'refused'\n"
            "print(rlk_ops.strict_mode(), V.VALUE_CHECKS, ran)")
    base = {k: v for k, v in os.environ.items() if k not in ("RLK_STRICT", "RLK_VALUE_CHECKS")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(strict), str(checks), "refused" if strict else "['cpu']"]


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def test_a_dispatched_op_inside_another_kernel_is_recorded_nested(monkeypatch):
    from rlk_ops.kernels import cpu, dispatch
    inner = cpu.rope

    def rope_calling_an_op(x, positions, theta, rotary_dim):
        torch.ops.rlk.qk_rmsnorm(x, torch.ones(x.shape[-1], dtype=x.dtype), 1e-6)   # a nested dispatched call
        return inner(x, positions, theta, rotary_dim)

    monkeypatch.setattr(cpu, "rope", rope_calling_an_op)
    monkeypatch.setattr(dispatch, "_cache", {})
    with provenance.capture() as log:
        rlk_ops.rope(torch.randn(3, 2, 8), torch.arange(3))
    assert {(r.op, r.nested) for r in log.records()} == {("rope", False), ("qk_rmsnorm", True)}


def test_environment_marks_verification_only_for_a_gpu():
    from rlk_ops.meta.provenance import VERIFIED_ARCHS, environment
    env = environment()
    want = (env["gpu_arch"] in VERIFIED_ARCHS) if env["gpu_arch"] else None
    assert env["gpu_arch_verified"] is want


def test_an_unavailable_reference_is_not_blamed_on_strict_mode(monkeypatch):
    from rlk_ops.kernels import dispatch
    monkeypatch.setattr(dispatch, "_cache", {})
    monkeypatch.setitem(dispatch._BACKEND_MODULES, "cpu", "rlk_ops.no_such_backend_module")
    with pytest.raises(dispatch.BackendUnavailable, match=r"rlk_ops.no_such_backend_module cannot be imported"):
        dispatch.kernel_for("rope", torch.device("cpu"))


def test_the_dry_run_needs_the_triton_interpreter_too(monkeypatch):
    from rlk_ops.kernels import dispatch
    monkeypatch.setenv("RLK_FA4_DRY_RUN", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not dispatch._dry_run("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch._dry_run("triton", torch.device("cpu"))
