"""The FA4 (flash_attn.cute) backend.

CPU part (always runs): FA4 is replaced by a stand-in module with FA4's parameter names
that computes with the CPU reference and records what it was called with. It shows
strict mode refusing (clear error) when FA4 is absent or lacks a control, non-strict
mode falling back to the CPU kernel with the reason recorded, and that the backend
passes the pinned controls and the contract's layouts through unchanged.

CUDA part (``-m cuda``, skipped without a GPU): the real FA4 on the GPU, bitwise claims
with torch.equal and accuracy against float64 math. benchmarks/attention.py runs the
full matrix at Qwen3-8B shapes and writes results/h200/attention.json.
"""
import inspect
import math
import os
import sys
import types
import warnings

import pytest
import torch

import rlk_ops
from rlk_ops.kernels import dispatch
from rlk_ops.kernels import fa4 as fa4_backend
from rlk_ops.kernels.cpu import attention as cpu_attn
from rlk_ops.kernels.fa4 import loader
from rlk_ops.meta import provenance
from rlk_ops.ops._validate import RlkInputError

from conftest import bitwise_equal

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------- stand-in FA4
def _sig(*names):
    return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])


_FWD = ("q", "k", "v", "softmax_scale", "causal", "window_size", "num_splits", "pack_gqa", "deterministic",
        "return_lse")
_VARLEN = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q",
           "seqused_k", "page_table", "softmax_scale", "causal", "num_splits", "pack_gqa", "deterministic",
           "return_lse")
_FWD_IN_PLACE = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q",
                 "max_seqlen_k", "page_table", "softmax_scale", "causal", "num_splits", "pack_gqa", "return_lse",
                 "out", "lse", "tile_mn", "intra_wg_overlap")
_BWD = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "pack_gqa", "cu_seqlens_q", "cu_seqlens_k",
        "max_seqlen_q", "max_seqlen_k", "deterministic", "dlse")


def make_fake_fa4(drop=()):
    """A module with FA4's entry points and parameter names (minus ``drop``), computing with
    the CPU reference. ``calls`` records (function, positional args, keyword args)."""
    mod = types.ModuleType("flash_attn.cute.interface")
    mod.calls = []

    def flash_attn_func(q, k, v, **kw):
        mod.calls.append(("flash_attn_func", (q, k, v), kw))
        return cpu_attn.attention_fwd(q, k, v, int(kw["causal"]), kw["softmax_scale"], None, None, 0, 0)

    def flash_attn_varlen_func(q, k, v, **kw):
        mod.calls.append(("flash_attn_varlen_func", (q, k, v), kw))
        if kw.get("page_table") is not None:
            assert kw["causal"] is True
            return cpu_attn.paged_attention(q, k, v, kw["page_table"], kw["seqused_k"], kw["softmax_scale"])
        return cpu_attn.attention_fwd(q, k, v, int(kw["causal"]), kw["softmax_scale"], kw["cu_seqlens_q"],
                                      kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"])

    def _flash_attn_fwd(q, k, v, **kw):
        """FA4's varlen convention as canonical:C uses it: piece j reads q rows
        [cu_seqlens_q[j], + seqused_q[j]) and key rows [cu_seqlens_k[j], + seqused_k[j]) and
        writes its rows of ``out``/``lse`` in place; no other row is touched."""
        mod.calls.append(("_flash_attn_fwd", (q, k, v), kw))
        if kw.get("page_table") is not None:  # paged decode (benchmarks/canonical.py's profile)
            assert kw["causal"] is True
            out, lse = cpu_attn.paged_attention(q, k, v, kw["page_table"], kw["seqused_k"], kw["softmax_scale"])
            return out, lse, None, None, None
        out, lse = kw["out"], kw["lse"]
        if kw.get("cu_seqlens_q") is None:  # dense [B, S, H, D] into (strided) out / lse [B, H, S]
            assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and kw["return_lse"]
            key = (q.dtype, q.shape[-1], bool(kw["causal"]), "dense")
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = _dense_kernel
            _flash_attn_fwd.compile_cache[key](q, k, v, out, lse, kw["softmax_scale"], int(kw["causal"]))
            return out, lse, None, None, None
        assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and kw["return_lse"]
        lens_q, lens_k = kw["seqused_q"].tolist(), kw["seqused_k"].tolist()
        assert max(lens_q) <= kw["max_seqlen_q"] and max(lens_k) <= kw["max_seqlen_k"]
        # FA4's JIT shape (kernels/fa4/prepared.py records and replays it): the Python work
        # above, then one compiled kernel looked up and called with positional arguments
        key = (q.dtype, q.shape[-1], bool(kw["causal"]))
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = _pieces_kernel
        _flash_attn_fwd.compile_cache[key](q, k, v, out, lse, kw["softmax_scale"], int(kw["causal"]),
                                           kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_q"], kw["seqused_k"])
        return out, lse, None, None, None

    def _pieces_kernel(q, k, v, out, lse, scale, causal, cu_q, cu_k, used_q, used_k):
        for a, n, b, m in zip(cu_q.tolist(), used_q.tolist(), cu_k.tolist(), used_k.tolist()):
            o, l = cpu_attn.attention_fwd(q[a:a + n], k[b:b + m], v[b:b + m], causal, scale,
                                          torch.tensor([0, n], dtype=torch.int32),
                                          torch.tensor([0, m], dtype=torch.int32), n, m)
            out[a:a + n], lse[:, a:a + n] = o, l

    def _dense_kernel(q, k, v, out, lse, scale, causal):
        for b in range(q.shape[0]):
            o, l = cpu_attn.attention_fwd(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal, scale, None, None, 0, 0)
            out[b], lse[b] = o[0], l[0]

    _flash_attn_fwd.compile_cache = {}

    def _flash_attn_bwd(q, k, v, out, dout, lse, **kw):
        mod.calls.append(("_flash_attn_bwd", (q, k, v, out, dout, lse), kw))
        return cpu_attn.attention_bwd(dout, q, k, v, out, lse, kw.get("dlse"), int(kw["causal"]),
                                      kw["softmax_scale"], kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"),
                                      kw.get("max_seqlen_q") or 0, kw.get("max_seqlen_k") or 0)

    for fn, names in ((flash_attn_func, _FWD), (flash_attn_varlen_func, _VARLEN), (_flash_attn_fwd, _FWD_IN_PLACE),
                      (_flash_attn_bwd, _BWD)):
        fn.__signature__ = _sig(*(n for n in names if n not in drop))
        setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """Forget cached FA4 imports and dispatch lookups before and after the test."""
    loader.reset()
    monkeypatch.setattr(dispatch, "_cache", {})
    yield
    loader.reset()


@pytest.fixture
def fa4_absent(monkeypatch, fresh_dispatch):
    # None in sys.modules makes the import raise ModuleNotFoundError, as when not installed
    monkeypatch.setitem(sys.modules, loader.INTERFACE_MODULE, None)
    # these tests call the ops on CPU tensors: let the device check pass, so the import is what fails
    monkeypatch.setitem(dispatch._DEVICES, "fa4", ("cuda", "cpu"))


def install_fake(monkeypatch, drop=()):
    fake = make_fake_fa4(drop)
    monkeypatch.setitem(sys.modules, loader.INTERFACE_MODULE, fake)
    monkeypatch.setitem(dispatch._DEVICES, "fa4", ("cuda", "cpu"))   # the stand-in runs on CPU tensors
    monkeypatch.setattr(loader, "installed_version", lambda: loader.VERIFIED_VERSIONS[0])
    return fake


def _dense(b=2, sq=9, sk=11, hq=4, hkv=2, d=16, dtype=BF16):
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _paged(dtype=BF16, d=16):
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(6, 4, 2, d, generator=g).to(dtype)
    v_cache = torch.randn(6, 4, 2, d, generator=g).to(dtype)
    page_table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 6], dtype=torch.int32)
    q = torch.randn(2, 3, 4, d, generator=g).to(dtype)
    return q, k_cache, v_cache, page_table, seq_lens


def _call(op):
    """Run ``op`` through its public path on small bf16 CPU inputs (with fa4 requested)."""
    if op == "attention_fwd":
        return rlk_ops.attention(*_dense())
    if op == "paged_attention":
        return rlk_ops.paged_attention(*_paged())
    q, k, v = _dense()
    out, lse = cpu_attn.attention_fwd(q, k, v, 1, 0.25, None, None, 0, 0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    return torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, None, 1, 0.25, None, None, 0, 0, "disabled")


OPS = ("attention_fwd", "attention_bwd", "paged_attention")


# ------------------------------------------------------- strict mode / fallback
@pytest.mark.parametrize("op", OPS)
def test_strict_refuses_when_fa4_absent(fa4_absent, op):
    with rlk_ops.use_backend(**{op: "fa4"}), provenance.capture() as log:
        with pytest.raises(rlk_ops.StrictModeError,
                           match=rf"rlk::{op} on cpu: backend 'fa4' unavailable: flash_attn\.cute\.interface "
                                 r"cannot be imported .*flash-attn-4==4\.0\.0b36.*Strict mode"):
            _call(op)
    assert [r.op for r in log.records()] == []  # nothing ran


@pytest.mark.parametrize("backend,op", [("fa4", "attention_fwd"), ("triton", "linear"),
                                        ("flashinfer", "paged_attention")])
def test_a_cuda_backend_is_not_given_cpu_tensors(fresh_dispatch, monkeypatch, backend, op):
    """use_backend applies to every device: a CPU-reference call was sent to the CUDA backend
    (FA4's entry points called with CPU tensors, or Triton failing inside with 'Torch not compiled
    with CUDA enabled'), even on a GPU host. Strict: refused naming the device; non-strict: the
    CPU reference, recorded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU host, as far as checks go
    with rlk_ops.use_backend(**{op: backend}), provenance.capture() as log:
        with pytest.raises(rlk_ops.StrictModeError, match=rf"rlk::{op} on cpu: backend '{backend}' unavailable: it "
                                                          r"runs on cuda tensors, and these are on cpu"):
            dispatch.kernel_for(op, torch.device("cpu"))
    assert log.records() == []
    q, k, v = _dense()
    call = {"attention_fwd": lambda: rlk_ops.attention(q, k, v),
            "linear": lambda: rlk_ops.linear(torch.randn(3, 8), torch.randn(5, 8)),
            "paged_attention": lambda: rlk_ops.paged_attention(*_paged())}[op]
    with rlk_ops.strict(False), rlk_ops.use_backend(**{op: backend}), provenance.capture() as log:
        call()
    (rec,) = [r for r in log.records() if r.op == op]
    assert (rec.requested_backend, rec.actual_backend, rec.fallback) == (backend, "cpu", True)
    assert "runs on cuda tensors" in rec.fallback_reason


def test_the_triton_backend_refuses_the_interpreter(fresh_dispatch, monkeypatch):
    """TRITON_INTERPRET=1 ran every Triton op in the interpreter under strict mode, recorded as
    plain 'triton', though its bits are not the GPU's (its fp32 -> bf16 casts truncate; review).
    The CUDA tests' dry run (RLK_FA4_DRY_RUN=1) still may."""
    pytest.importorskip("triton")
    from rlk_ops.kernels.triton import _common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_common, "INTERPRET", True)
    monkeypatch.delenv("RLK_FA4_DRY_RUN", raising=False)
    with pytest.raises(rlk_ops.StrictModeError, match=r"rlk::linear on cuda: backend 'triton' unavailable: "
                                                      r"TRITON_INTERPRET=1 runs Triton kernels in the interpreter"):
        dispatch.kernel_for("linear", torch.device("cuda"))
    monkeypatch.setenv("RLK_FA4_DRY_RUN", "1")
    assert dispatch.kernel_for("linear", torch.device("cuda")) is not None


@pytest.mark.parametrize("op", OPS)
def test_non_strict_falls_back_to_cpu_when_fa4_absent(fa4_absent, op):
    ref = _call(op)  # the cpu backend, requested directly
    with rlk_ops.strict(False), rlk_ops.use_backend(**{op: "fa4"}), provenance.capture() as log:
        got = _call(op)
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))
    (rec,) = [r for r in log.records() if r.op == op]
    assert (rec.requested_backend, rec.actual_backend, rec.fallback) == ("fa4", "cpu", True)
    assert "flash_attn.cute.interface cannot be imported" in rec.fallback_reason


MISSING = [
    ("attention_fwd", "num_splits", r"split-KV control \(num_splits\) in flash_attn_func"),
    ("attention_fwd", "pack_gqa", r"pack_gqa control in flash_attn_func"),
    ("attention_fwd", "return_lse", r"LSE export \(return_lse\) in flash_attn_func"),
    ("attention_bwd", "deterministic", r"deterministic backward \(deterministic=\) in _flash_attn_bwd"),
    ("attention_bwd", "dlse", r"lse gradient input \(dlse=\) in _flash_attn_bwd"),
    ("paged_attention", "page_table", r"paged KV \(page_table=\) in _flash_attn_fwd"),
    ("paged_attention", "seqused_k", r"per-sequence KV length \(seqused_k=\)"),
    ("paged_attention", "num_splits", r"split-KV control \(num_splits\) in _flash_attn_fwd"),
    ("paged_attention", "tile_mn", r"tile size control \(tile_mn=\) in _flash_attn_fwd"),
    ("paged_attention", "intra_wg_overlap", r"intra-warpgroup overlap control \(intra_wg_overlap=\) in _flash_attn_fwd"),
    ("attention_fwd", "seqused_q", r"per-sequence query length \(seqused_q=\) in _flash_attn_fwd"),
    ("attention_fwd", "out", r"output buffer \(out=\) in _flash_attn_fwd"),
]


@pytest.mark.parametrize("op,dropped,what", MISSING)
def test_strict_refuses_fa4_lacking_a_control(monkeypatch, fresh_dispatch, op, dropped, what):
    install_fake(monkeypatch, drop=(dropped,))
    with rlk_ops.use_backend(**{op: "fa4"}):
        with pytest.raises(rlk_ops.StrictModeError, match=rf"rlk::{op} on cpu: backend 'fa4' unavailable: the "
                                                          rf"installed FA4 .* lacks what rlk::{op} needs: .*{what}"):
            _call(op)


@pytest.mark.parametrize("op,dropped,what", MISSING[:1] + MISSING[3:4] + MISSING[5:6])
def test_non_strict_falls_back_when_fa4_lacks_a_control(monkeypatch, fresh_dispatch, op, dropped, what):
    fake = install_fake(monkeypatch, drop=(dropped,))
    ref = _call(op)
    with rlk_ops.strict(False), rlk_ops.use_backend(**{op: "fa4"}), provenance.capture() as log:
        got = _call(op)
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))
    assert fake.calls == []  # the incomplete FA4 was never called
    (rec,) = [r for r in log.records() if r.op == op]
    assert (rec.requested_backend, rec.actual_backend, rec.fallback) == ("fa4", "cpu", True)
    assert "lacks" in rec.fallback_reason and dropped in rec.fallback_reason


def test_a_missing_function_is_named(monkeypatch, fresh_dispatch):
    fake = install_fake(monkeypatch)
    del fake._flash_attn_bwd
    with pytest.raises(dispatch.BackendUnavailable, match=r"flash_attn\.cute\.interface\._flash_attn_bwd"):
        fa4_backend.check_available("attention_bwd")
    assert loader.load().missing("attention_fwd") == []  # the forward does not need it


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU refusal")
def test_complete_fa4_without_gpu_is_unavailable(monkeypatch, fresh_dispatch):
    install_fake(monkeypatch)
    for op in OPS:
        with pytest.raises(dispatch.BackendUnavailable, match="needs a CUDA GPU"):
            fa4_backend.check_available(op)


def test_unverified_version_and_arch_are_marked(monkeypatch, fresh_dispatch):
    install_fake(monkeypatch)
    monkeypatch.setattr(loader, "installed_version", lambda: "4.1.0")
    with pytest.warns(RuntimeWarning, match=r"flash-attn-4 4\.1\.0 is not a version .* verified"):
        fa4 = loader.load()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    with pytest.warns(RuntimeWarning, match=r"sm100 is not an architecture on which this project verified"):
        assert loader.note_device(fa4, torch.device("cuda", 0)) == "sm100"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per arch, then silent
        loader.note_device(fa4, torch.device("cuda", 0))
    info = fa4_backend.backend_info()
    assert info["version"] == "4.1.0" and info["version_verified"] is False
    assert info["gpu_archs"] == {"0": "sm100"} and info["archs_verified"] == {"0": False}
    assert (info["num_splits"], info["pack_gqa"], info["missing"]) == (
        1, True, {op: [] for op in OPS})


def test_backend_info_when_absent(fa4_absent):
    info = fa4_backend.backend_info()
    assert info["available"] is False and "cannot be imported" in info["reason"]


# ------------------------------------------------------------ argument plumbing
@pytest.fixture
def fake(monkeypatch, fresh_dispatch):
    return install_fake(monkeypatch)


@pytest.mark.parametrize("causal", [1, 0])
def test_forward_pins_controls_and_maps_arguments(fake, causal):
    q, k, v = _dense()
    out, lse = fa4_backend.attention_fwd(q, k, v, causal, 0.3, None, None, 0, 0, "disabled")
    ((name, args, kw),) = fake.calls
    assert name == "flash_attn_func" and all(a is b for a, b in zip(args, (q, k, v)))
    assert kw == dict(softmax_scale=0.3, causal=bool(causal), num_splits=1, pack_gqa=True, return_lse=True)
    ref = cpu_attn.attention_fwd(q, k, v, causal, 0.3, None, None, 0, 0)
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1]) and lse.shape == (2, 4, 9)


@pytest.mark.parametrize("given", [(0, 0), (8, 9)])
def test_varlen_forward_derives_or_passes_max_seqlen(fake, given):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(BF16) for t, h in ((11, 4), (13, 2), (13, 2)))
    cu_q = torch.tensor([0, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    out, lse = fa4_backend.attention_fwd(q, k, v, 1, 0.25, cu_q, cu_k, *given, "disabled")
    ((name, _, kw),) = fake.calls
    assert name == "flash_attn_varlen_func" and kw["cu_seqlens_q"] is cu_q and kw["cu_seqlens_k"] is cu_k
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == ((6, 7) if given == (0, 0) else given)
    assert (kw["num_splits"], kw["pack_gqa"], kw["return_lse"], kw["causal"]) == (1, True, True, True)
    ref = cpu_attn.attention_fwd(q, k, v, 1, 0.25, cu_q, cu_k, 0, 0)
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1]) and lse.shape == (4, 11)


@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_is_deterministic_and_passes_dlse(fake, with_dlse):
    q, k, v = _dense()
    out, lse = cpu_attn.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    grads = fa4_backend.attention_bwd(dout, q, k, v, out, lse, dlse, 1, 0.3, None, None, 0, 0, "disabled")
    ((name, args, kw),) = fake.calls
    assert name == "_flash_attn_bwd" and all(a is b for a, b in zip(args, (q, k, v, out, dout, lse)))
    assert kw["deterministic"] is True and kw["dlse"] is dlse and kw["causal"] is True
    assert kw["softmax_scale"] == 0.3 and kw["max_seqlen_q"] is None and kw["cu_seqlens_q"] is None
    ref = cpu_attn.attention_bwd(dout, q, k, v, out, lse, dlse, 1, 0.3, None, None, 0, 0)
    assert all(bitwise_equal(a, b) for a, b in zip(grads, ref))


def test_varlen_backward_derives_max_seqlen(fake):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(BF16) for t, h in ((11, 4), (13, 2), (13, 2)))
    cu_q = torch.tensor([0, 5, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    out, lse = cpu_attn.attention_fwd(q, k, v, 1, 0.25, cu_q, cu_k, 0, 0)
    dout = torch.randn_like(out)
    fa4_backend.attention_bwd(dout, q, k, v, out, lse, None, 1, 0.25, cu_q, cu_k, 0, 0, "disabled")
    (_, _, kw), = fake.calls
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["cu_seqlens_q"] is cu_q) == (6, 7, True)


def test_paged_reads_pages_in_place(fake):
    q, k_cache, v_cache, page_table, seq_lens = _paged()
    out, lse = fa4_backend.paged_attention(q, k_cache, v_cache, page_table, seq_lens, 0.25, "disabled")
    ((name, args, kw),) = fake.calls
    # the cache, page_table and seq_lens themselves: nothing is gathered or copied
    assert name == "_flash_attn_fwd" and args[1] is k_cache and args[2] is v_cache and args[0] is q
    assert kw["page_table"] is page_table and kw["seqused_k"] is seq_lens and kw["causal"] is True
    assert (kw["num_splits"], kw["pack_gqa"], kw["return_lse"]) == (1, True, True)
    assert kw["tile_mn"] is None  # FA4's default tile off sm90 (fa4 kernels.decode_tile)
    assert kw["intra_wg_overlap"] is None  # FA4's default: strict decode never turns it off
    ref = cpu_attn.paged_attention(q, k_cache, v_cache, page_table, seq_lens, 0.25)
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1]) and lse.shape == (2, 4, 3)


def test_the_decode_tile_only_where_it_was_measured():
    """The 64-row tile was measured for decode at G = 4; any call of at most 64 packed rows (a
    chunked prefill of up to 16 tokens, G up to 64) took it unmeasured until session 29 (review)."""
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    cache = torch.empty(4, 16, 4, 128)
    assert fa4_kernels.decode_tile(torch.empty(8, 1, 16, 128), cache, "sm90") == fa4_kernels.DECODE_TILE
    for q in (torch.empty(8, 4, 16, 128), torch.empty(8, 1, 32, 128), torch.empty(8, 1, 8, 128)):
        assert fa4_kernels.decode_tile(q, cache, "sm90") is None
    assert fa4_kernels.decode_tile(torch.empty(8, 1, 16, 128), cache, "sm100") is None
    assert fa4_kernels.decode_tile(torch.empty(8, 1, 16, 64), torch.empty(4, 16, 4, 64), "sm90") is None


def test_pair_call_overlap_off_only_from_512_ctas_with_the_decode_tile():
    """canonical:C pair calls turn FA4's intra-warpgroup overlap off where it was measured
    faster (>= 512 CTAs = pairs x KV heads, decode tile); otherwise FA4's default."""
    from rlk_ops.kernels.fa4 import kernels as fa4_kernels

    cache = torch.empty(1, 16, 4, 128)
    tile = fa4_kernels.DECODE_TILE
    assert fa4_kernels.pair_overlap(torch.empty(128, 1, 16, 128), cache, tile) is False
    assert fa4_kernels.pair_overlap(torch.empty(127, 1, 16, 128), cache, tile) is None
    assert fa4_kernels.pair_overlap(torch.empty(4096, 1, 16, 128), cache, None) is None
    # page 128 (FA4's TMA path): measured no faster off
    assert fa4_kernels.pair_overlap(torch.empty(4096, 1, 16, 128), torch.empty(1, 128, 4, 128), tile) is None


def test_a_call_the_backend_refuses_is_not_recorded(fake, monkeypatch):
    """Provenance was recorded when the kernel was looked up, so an fp32 call FA4 refused
    counted as a call that ran on fa4 (review); now it is recorded once the kernel returns."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q, k, v = (t.float() for t in _dense())
    with rlk_ops.use_backend(attention_fwd="fa4"), provenance.capture() as log:
        with pytest.raises(rlk_ops.RlkInputError, match="the fa4 backend needs bfloat16 or float16"):
            rlk_ops.attention(q, k, v)
        assert log.records() == []
        rlk_ops.attention(*_dense())
    (rec,) = log.records()
    assert (rec.op, rec.actual_backend, rec.calls) == ("attention_fwd", "fa4", 1)


def test_the_recording_wrapper_keeps_the_kernels_attributes(fresh_dispatch, monkeypatch):
    """fa4's canonical decode reads the merge's accepts_state_lens / accepts_pdl through the
    dispatch point: without them it would take the generic route (same bits, slower)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fn = dispatch.kernel_for("merge_attn_states", torch.device("cuda"))
    assert fn.accepts_state_lens is True and fn.accepts_pdl is True


def test_through_the_dispatch_point(fake, monkeypatch):
    """With FA4 'available', the op bodies route to it and provenance says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q, k, v = _dense()
    with rlk_ops.use_backend(attention_fwd="fa4", paged_attention="fa4"), provenance.capture() as log:
        out, lse = rlk_ops.attention(q, k, v)
        rlk_ops.paged_attention(*_paged())
    assert [c[0] for c in fake.calls] == ["flash_attn_func", "_flash_attn_fwd"]
    assert {(r.op, r.actual_backend, r.fallback) for r in log.records()} == {
        ("attention_fwd", "fa4", False), ("paged_attention", "fa4", False)}


def test_rollout_chunked_prefill_records_no_prepared_calls(fake, monkeypatch):
    """canonical:C chunked prefill builds its plan per step: through prepared calls every step recorded
    anew, never replayed, and pushed training's recordings out of the bounded cache (a session 34 audit).
    Training replays; the prefill steps leave the cache as training left it."""
    from rlk_ops.kernels.fa4 import prepared

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    prepared.clear()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, h, 16, generator=g).to(BF16) for h in (4, 2, 2))
    with rlk_ops.use_backend(attention_fwd="fa4"), torch.no_grad():
        first = rlk_ops.attention(q, k, v, split_kv="canonical:128")
        fwd_calls = sum(1 for c in fake.calls if c[0] == "_flash_attn_fwd")
        second = rlk_ops.attention(q, k, v, split_kv="canonical:128")
    assert sum(1 for c in fake.calls if c[0] == "_flash_attn_fwd") == fwd_calls   # replayed
    assert bitwise_equal(first[0], second[0]) and bitwise_equal(first[1], second[1])
    training = dict(prepared._CACHE)
    kc, vc = (torch.randn(64, 16, 2, 16, generator=g).to(BF16) for _ in range(2))
    table = torch.arange(26, dtype=torch.int32).view(2, 13)
    for step in range(3):
        lens = torch.tensor([200 + step, 190 + step], dtype=torch.int32)
        with rlk_ops.use_backend(paged_attention="fa4"):
            out = rlk_ops.paged_attention(torch.randn(2, 8, 4, 16, generator=g).to(BF16), kc, vc, table, lens,
                                          split_kv="canonical:128")
        assert out[0].shape == (2, 8, 4, 16)
    assert prepared._CACHE == training
    prepared.clear()


@pytest.mark.parametrize("policy", ["fixed:512", "auto"])
def test_split_kv_other_than_disabled_or_canonical_is_refused(fake, policy):
    q, k, v = _dense()
    with pytest.raises(ValueError, match=rf"split_kv '{policy}' is not supported by the fa4 backend"):
        fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, policy)
    with pytest.raises(ValueError, match="not supported by the fa4 backend"):
        fa4_backend.paged_attention(*_paged(), 0.25, policy)
    assert fake.calls == []


def test_dtype_and_head_dim_are_checked(fake):
    q, k, v = _dense(dtype=torch.float32)
    with pytest.raises(RlkInputError, match=r"rlk::attention_fwd: the fa4 backend needs bfloat16 or float16 "
                                            r"inputs, got torch.float32"):
        fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "disabled")
    q, k, v = _dense(d=12)
    with pytest.raises(RlkInputError, match=r"head_dim in \[8, 256\] and a multiple of 8, got 12"):
        fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "disabled")
    # canonical:C where FA4's causal and non-causal key tiles differ (a session 34 audit)
    for d in (72, 80, 96):
        q, k, v = _dense(d=d)
        with pytest.raises(RlkInputError, match=rf"canonical:C on the fa4 backend needs head_dim <= 64 or > 96, "
                                                 rf"got {d}"):
            fa4_backend.attention_fwd(q, k, v, 1, 0.3, None, None, 0, 0, "canonical:768")
        with pytest.raises(RlkInputError, match=r"needs head_dim <= 64 or > 96"):
            fa4_backend.paged_attention(*_paged(d=d), 0.25, "canonical:768")
    assert fake.calls == []


# ===================================================================== CUDA
# RLK_FA4_DRY_RUN=1 runs this part on the CPU against the stand-in FA4: it checks the
# tests themselves (shapes, fixtures) before GPU time is spent; it proves nothing about FA4.
DRY = os.environ.get("RLK_FA4_DRY_RUN") == "1"
DEV = "cpu" if DRY else "cuda"
cuda = pytest.mark.skipif(not (HAS_CUDA or DRY), reason="needs a CUDA GPU (and FA4)")


@pytest.fixture(autouse=True)
def _dry_run(request, monkeypatch):
    if not DRY or "cuda" not in request.keywords:
        yield
        return
    fake = install_fake(monkeypatch)
    loader.reset()
    monkeypatch.setattr(fa4_backend, "check_available", lambda op: None)  # no GPU here
    with rlk_ops.use_backend(attention_fwd="fa4", attention_bwd="fa4", paged_attention="fa4"):
        yield
    assert fake.calls or "refuses" in request.node.name, "the dry run did not reach the stand-in FA4"
    loader.reset()
HQ, HKV, D = 8, 2, 128  # G = 4 and D = 128 as in Qwen3-8B: the same FA4 kernels the benchmark proves
# Accuracy against float64 math (invariance is bitwise, never a tolerance):
OUT_TOL = 8e-3   # bf16 output rounding (2**-9) plus P fed to the PV MMA in bf16 (another 2**-9)
LSE_TOL = 1e-3   # fp32 softmax statistics with ex2.approx; |lse| ~ 10, so ~1e-4 relative
GRAD_TOL = 2e-2  # P and dS are fed to bf16 MMAs and dq/dk/dv are rounded to bf16 once


def _ref64(q, k, v, causal=True, scale=None):
    """float64 attention on [B, S, H, D] (bottom-right causal): (out, lse)."""
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    sk, g = k.shape[1], hq // k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * scale
    if causal:
        qp = torch.arange(sq, device=q.device) + sk - sq
        s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > qp[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double().repeat_interleave(g, 2)), lse


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def seq():
    g = torch.Generator(device=DEV).manual_seed(7)
    s = 700
    return tuple(torch.randn(1, s, h, D, device=DEV, generator=g).to(BF16) for h in (HQ, HKV, HKV))


@pytest.fixture(scope="module")
def prefill(seq):
    return rlk_ops.attention(*seq)


@cuda
@pytest.mark.cuda
def test_cuda_runs_on_fa4_with_provenance(seq):
    with provenance.capture() as log:
        rlk_ops.attention(*seq)
    (rec,) = log.records()
    assert (rec.requested_backend, rec.actual_backend, rec.fallback) == ("fa4", "fa4", False)
    info = fa4_backend.backend_info()
    arch = provenance.gpu_arch()
    assert info["available"] and info["missing"] == {op: [] for op in OPS}
    assert info["gpu_archs"][str(torch.cuda.current_device())] == arch
    assert info["archs_verified"][str(torch.cuda.current_device())] == (arch in provenance.VERIFIED_ARCHS)


@cuda
@pytest.mark.cuda
def test_cuda_forward_accuracy_and_run_to_run(seq, prefill):
    out, lse = prefill
    ref_out, ref_lse = _ref64(*seq)
    assert lse.dtype == torch.float32 and lse.shape == (1, HQ, 700)
    assert _rel(out, ref_out) < OUT_TOL
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL  # natural log, not log2
    for _ in range(2):
        again = rlk_ops.attention(*seq)
        assert bitwise_equal(again[0], out) and bitwise_equal(again[1], lse)


@cuda
@pytest.mark.cuda
def test_cuda_batch_invariance(seq, prefill):
    q, k, v = seq
    g = torch.Generator(device=DEV).manual_seed(8)
    others = [torch.randn(3, 700, h, D, device=DEV, generator=g).to(BF16) for h in (HQ, HKV, HKV)]
    for pos in (0, 2):
        qb, kb, vb = (torch.cat([o[:pos], x, o[pos:]]) for o, x in zip(others, (q, k, v)))
        out, lse = rlk_ops.attention(qb, kb, vb)
        assert bitwise_equal(out[pos], prefill[0][0]) and bitwise_equal(lse[pos], prefill[1][0])


@cuda
@pytest.mark.cuda
def test_cuda_decode_and_chunked_prefill_equal_prefill_rows(seq, prefill):
    q, k, v = seq
    for p in (0, 127, 128, 129, 383, 699):
        out, lse = rlk_ops.attention(q[:, p:p + 1], k[:, :p + 1], v[:, :p + 1])
        assert bitwise_equal(out[:, 0], prefill[0][:, p]) and bitwise_equal(lse[:, :, 0], prefill[1][:, :, p])
    for start, stop in ((300, 377), (129, 700), (650, 651)):
        out, lse = rlk_ops.attention(q[:, start:stop], k[:, :stop], v[:, :stop])
        assert bitwise_equal(out, prefill[0][:, start:stop]) and bitwise_equal(lse, prefill[1][:, :, start:stop])


@cuda
@pytest.mark.cuda
def test_cuda_varlen_equals_dense_and_ignores_neighbours(seq, prefill):
    q, k, v = seq
    g = torch.Generator(device=DEV).manual_seed(9)
    for p, nb in ((699, 1), (699, 33), (128, 129), (383, 700)):
        # sequence 0: the decode row of position p; sequence 1: an unrelated prefill of nb tokens.
        # nb changes max_seqlen_q (the FA3 failure: a neighbour switching the kernel's tiling)
        oq, ok, ov = (torch.randn(nb, h, D, device=DEV, generator=g).to(BF16) for h in (HQ, HKV, HKV))
        qp = torch.cat([q[0, p:p + 1], oq])
        kp, vp = torch.cat([k[0, :p + 1], ok]), torch.cat([v[0, :p + 1], ov])
        cu_q = torch.tensor([0, 1, 1 + nb], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, p + 1, p + 1 + nb], dtype=torch.int32, device=DEV)
        out, lse = rlk_ops.attention(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        assert lse.shape == (HQ, 1 + nb)
        assert bitwise_equal(out[0], prefill[0][0, p]) and bitwise_equal(lse[:, 0], prefill[1][0, :, p])
    cu = torch.tensor([0, 700], dtype=torch.int32, device=DEV)
    out, lse = rlk_ops.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700,
                                 max_seqlen_k=700)
    assert bitwise_equal(out, prefill[0][0]) and bitwise_equal(lse, prefill[1][0])


def _page(k, v, lens, page_size, generator):
    """Scatter sequences (prefixes of k/v [1, S, H, D]) into shuffled pages of a cache whose
    unused slots hold finite garbage. Returns (k_cache, v_cache, page_table, seq_lens)."""
    n = [math.ceil(n_tok / page_size) for n_tok in lens]
    num_pages = sum(n) + 3
    perm = torch.randperm(num_pages, device=DEV, generator=generator).to(torch.int32)
    k_cache = torch.randn(num_pages, page_size, k.shape[2], D, device=DEV, generator=generator).to(BF16)
    v_cache = torch.randn(num_pages, page_size, k.shape[2], D, device=DEV, generator=generator).to(BF16)
    page_table = torch.full((len(lens), max(n) + 2), -7, dtype=torch.int32, device=DEV)  # padding: never read
    used = 0
    for b, n_tok in enumerate(lens):
        pages = perm[used:used + n[b]]
        used += n[b]
        page_table[b, :n[b]] = pages
        slots = (pages.long()[:, None] * page_size + torch.arange(page_size, device=DEV)).flatten()[:n_tok]
        k_cache.view(-1, k.shape[2], D)[slots] = k[0, :n_tok]
        v_cache.view(-1, k.shape[2], D)[slots] = v[0, :n_tok]
    return k_cache, v_cache, page_table, torch.tensor(lens, dtype=torch.int32, device=DEV)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_cuda_paged_equals_prefill(seq, prefill, page_size, monkeypatch):
    q, k, v = seq
    g = torch.Generator(device=DEV).manual_seed(10 + page_size)
    positions = [0, 127, 128, 383, 699]
    caches = _page(k, v, [p + 1 for p in positions], page_size, g)
    monkeypatch.setattr(rlk_ops.ops._validate, "VALUE_CHECKS", True)  # checks the table (padding is -7)
    out, lse = rlk_ops.paged_attention(q[0, positions][:, None], *caches)
    for i, p in enumerate(positions):
        assert bitwise_equal(out[i, 0], prefill[0][0, p]) and bitwise_equal(lse[i, :, 0], prefill[1][0, :, p])
    # chunked prefill over pages: 77 new tokens at offset 300, then the one-sequence batch
    caches = _page(k, v, [377], page_size, g)
    out, lse = rlk_ops.paged_attention(q[:, 300:377], *caches)
    assert bitwise_equal(out, prefill[0][:, 300:377]) and bitwise_equal(lse, prefill[1][:, :, 300:377])


@cuda
@pytest.mark.cuda
def test_cuda_strided_lengths_and_a_misaligned_q(seq, prefill):
    """seq_lens and cu_seqlens taken as a column of a bigger table (stride 2): FA4 asserted a unit stride
    (an AssertionError, not an input error); a q starting 2 bytes into its buffer under canonical:C: FA4
    copied it and the prepared replay raised PreparedCallError (session 32 audit). Both now compute the
    rows of the contiguous, aligned inputs."""
    q, k, v = seq
    positions = [0, 383, 699]
    caches = _page(k, v, [p + 1 for p in positions], 128, torch.Generator(device=DEV).manual_seed(12))
    wide = torch.stack([caches[3], caches[3]], 1)           # [B, 2]: column 0 has stride 2
    out, lse = rlk_ops.paged_attention(q[0, positions][:, None], *caches[:3], wide[:, 0])
    for i, p in enumerate(positions):
        assert bitwise_equal(out[i, 0], prefill[0][0, p]) and bitwise_equal(lse[i, :, 0], prefill[1][0, :, p])
    cu = torch.tensor([[0, 0], [700, 700]], dtype=torch.int32, device=DEV)[:, 0]
    assert cu.stride(0) == 2
    out, lse = rlk_ops.attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=700,
                                 max_seqlen_k=700)
    assert bitwise_equal(out, prefill[0][0]) and bitwise_equal(lse, prefill[1][0])
    buf = torch.empty(q.numel() + 1, dtype=BF16, device=DEV)
    q_off = buf[1:].view(q.shape)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16
    ref = rlk_ops.attention(q, k, v, split_kv="canonical:256")
    got = rlk_ops.attention(q_off, k, v, split_kv="canonical:256")
    assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1])


@cuda
@pytest.mark.cuda
def test_cuda_backward_deterministic_accurate_with_dlse():
    g = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (torch.randn(2, 640, h, D, device=DEV, generator=g).to(BF16) for h in (HQ, HKV, HKV))
    dout = torch.randn(2, 640, HQ, D, device=DEV, generator=g).to(BF16)
    dlse = torch.randn(2, HQ, 640, device=DEV, generator=g)
    out, lse = rlk_ops.attention(q, k, v)
    runs = [torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dlse, 1, D ** -0.5, None, None, 0, 0, "disabled")
            for _ in range(3)]
    for r in runs[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(r, runs[0]))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = _ref64(q64, k64, v64)
    ref = torch.autograd.grad((ro * dout.double()).sum() + (rl * dlse.double()).sum(), (q64, k64, v64))
    for got, want in zip(runs[0], ref):
        assert _rel(got, want) < GRAD_TOL
    # through autograd: the same bits as the op called directly
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    o, l = rlk_ops.attention(qa, ka, va)
    torch.autograd.backward((o, l), (dout, dlse))
    assert all(bitwise_equal(a.grad, b) for a, b in zip((qa, ka, va), runs[0]))


@cuda
@pytest.mark.cuda
def test_cuda_compile_fullgraph_equals_eager(seq):
    torch._dynamo.reset()
    q, k, v = (t.clone().requires_grad_() for t in seq)
    g = torch.Generator(device=DEV).manual_seed(12)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(BF16)
    dlse = torch.randn(1, HQ, 700, device=DEV, generator=g)

    def fn(q, k, v):
        return rlk_ops.attention(q, k, v)

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        out, lse = f(q, k, v)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
        results.append((out, lse, *grads))
    assert all(bitwise_equal(a, b) for a, b in zip(*results))


@cuda
@pytest.mark.cuda
def test_cuda_jit_once_per_configuration(seq):
    fa4 = loader.load()
    q, k, v = seq
    rlk_ops.attention(q, k, v)  # compiled by now (earlier tests, or here)
    before = loader.jit_cache_sizes(fa4)
    assert before["_flash_attn_fwd"]
    g = torch.Generator(device=DEV).manual_seed(13)
    for b, s in ((2, 300), (3, 1000)):  # other batch sizes and lengths, same configuration
        rlk_ops.attention(*(torch.randn(b, s, h, D, device=DEV, generator=g).to(BF16) for h in (HQ, HKV, HKV)))
    assert loader.jit_cache_sizes(fa4) == before


@cuda
@pytest.mark.cuda
def test_cuda_refuses_unsupported_inputs(seq):
    q, k, v = seq
    with pytest.raises(RlkInputError, match="the fa4 backend needs bfloat16 or float16 inputs, got torch.float32"):
        rlk_ops.attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="split_kv 'fixed:256' is not supported by the fa4 backend"):
        fa4_backend.attention_fwd(q, k, v, 1, D ** -0.5, None, None, 0, 0, "fixed:256")
