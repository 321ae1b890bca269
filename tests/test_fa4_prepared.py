"""kernels/fa4/prepared.py on a stand-in FA4 (CPU): the recording, the replay on new tensors and
the refusals. The stand-in has FA4's shape where it matters: ``_flash_attn_fwd`` does its
Python work, then looks its compiled kernel up in ``_flash_attn_fwd.compile_cache`` and calls it
with positional arguments (out as a ``detach()`` view, an internal tensor derived from the
plan's index tensors, the scale). The H200 check (same bits as FA4's own calls) is in
tests/test_canonical_cuda.py."""
from __future__ import annotations

import types

import pytest
import torch

from rlk_ops.kernels.fa4 import prepared
from conftest import bitwise_equal


def _kernel(q, k, v, out, lse, scale, cu_q, cu_k, seqused_q, seqused_k, derived):
    """The 'compiled kernel': piece j's rows attend its keys (non-causal), written in place."""
    assert bool((derived == seqused_q * 2).all())
    for a, n, b, m in zip(cu_q.tolist(), seqused_q.tolist(), cu_k.tolist(), seqused_k.tolist()):
        s = torch.einsum("qhd,khd->hqk", q[a:a + n].float(), k[b:b + m].float()) * scale
        lse[:, a:a + n] = torch.logsumexp(s, -1)
        out[a:a + n] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[b:b + m].float()).to(out.dtype)


def fake_fa4(kernel_calls=1, copy_q=False):
    mod = types.SimpleNamespace(prelude=0)

    def _flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, softmax_scale, out, lse):
        mod.prelude += 1
        key = (q.dtype, q.shape[-1])
        if key not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[key] = _kernel
        derived = seqused_q * 2     # FA4-internal, from the plan's tensors alone
        qq = q.clone() if copy_q else q
        for _ in range(kernel_calls):
            _flash_attn_fwd.compile_cache[key](qq, k, v, out.detach(), lse, softmax_scale, cu_seqlens_q,
                                              cu_seqlens_k, seqused_q, seqused_k, derived)

    _flash_attn_fwd.compile_cache = {}
    mod._flash_attn_fwd = _flash_attn_fwd
    return mod


class Call:   # a plan call: the index tensors a cached plan keeps
    def __init__(self, cu_q, cu_k, used_q, used_k):
        self.cu_seqlens_q, self.cu_seqlens_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
        self.seqused_q, self.seqused_k = torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32)


def _inputs(seed, t=40, tk=48, h=2, d=8, slots=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g).to(torch.bfloat16) for n in (t, tk, tk))
    out_parts = torch.full((slots, t, h, d), 7.0, dtype=torch.bfloat16)
    lse_parts = torch.full((slots, h, t), float("-inf"))
    return q, k, v, out_parts, lse_parts


def _run(mod, call, q, k, v, out, lse, scale=0.3):
    def normal():
        mod._flash_attn_fwd(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k, scale,
                            out, lse)
    prepared.run(mod, call, {"q": q, "k": k, "v": v, "out": out, "lse": lse}, scale, normal)


@pytest.fixture(autouse=True)
def _clear():
    prepared.clear()
    yield
    prepared.clear()


def test_replay_on_new_tensors_equals_the_normal_call():
    """Recorded once (FA4's Python runs once), then replayed on other q/k/v and another slot of
    other state buffers: each result equals FA4's own call on those tensors bitwise; rows no
    piece covers keep their values."""
    mod, ref_mod = fake_fa4(), fake_fa4()
    call = Call([0, 25], [0, 20], [10, 15], [20, 28])
    for seed, slot in ((1, 0), (2, 2), (3, 1)):
        q, k, v, out_parts, lse_parts = _inputs(seed)
        ref_o, ref_l = out_parts.clone(), lse_parts.clone()
        _run(mod, call, q, k, v, out_parts[slot], lse_parts[slot])
        ref_mod._flash_attn_fwd(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k, 0.3,
                                ref_o[slot], ref_l[slot])   # FA4's own call, not through prepared
        assert bitwise_equal(out_parts, ref_o) and bitwise_equal(lse_parts, ref_l)
        assert bool((out_parts[slot, 10:25] == 7.0).all()) and bool((out_parts[slot - 1] == 7.0).all())
    assert mod.prelude == 1 and ref_mod.prelude == 3   # every call after the first was a replay


def test_replays_skip_fa4s_python():
    mod = fake_fa4()
    call = Call([0], [0], [40], [48])
    q, k, v, out_parts, lse_parts = _inputs(4)
    for _ in range(5):
        _run(mod, call, q, k, v, out_parts[0], lse_parts[0])
    assert mod.prelude == 1


def test_a_new_layout_or_plan_call_or_scale_records_again():
    mod = fake_fa4()
    call, other = Call([0], [0], [40], [48]), Call([0], [0], [40], [48])
    q, k, v, out_parts, lse_parts = _inputs(5)
    _run(mod, call, q, k, v, out_parts[0], lse_parts[0])
    _run(mod, other, q, k, v, out_parts[0], lse_parts[0])                 # another plan call
    _run(mod, call, q, k, v, out_parts[0], lse_parts[0], scale=0.5)       # another scale
    q2, k2, v2, out2, lse2 = _inputs(5, t=41)
    _run(mod, call, q2, k2, v2, out2[0], lse2[0])                         # another shape
    kv = torch.stack([k, v])                                              # k and v in one storage
    _run(mod, call, q, kv[0], kv[1], out_parts[0], lse_parts[0])
    assert mod.prelude == 5
    _run(mod, call, q, kv[0], kv[1], out_parts[1], lse_parts[1])          # same sharing: a replay
    assert mod.prelude == 5


@pytest.mark.parametrize("fake,match", [(dict(kernel_calls=2), "2 compiled-kernel calls"),
                                        (dict(kernel_calls=0), "0 compiled-kernel calls"),
                                        (dict(copy_q=True), r"does not read \['q'\] in place")])
@pytest.mark.parametrize("shared", ["", "adjacent", "interleaved"])
def test_refusals_are_named_and_cache_nothing(fake, match, shared):
    """shared: q and k as views of one buffer. The copy check once compared storages (then
    overlapping spans), so with q copied by FA4 and k read in place q passed as read, and every
    replay used the first call's copy of q (wrong out and lse, silently; reviews)."""
    mod = fake_fa4(**fake)
    call = Call([0], [0], [40], [48])
    q, k, v, out_parts, lse_parts = _inputs(6, tk=40)
    if shared == "adjacent":
        buf = torch.cat([q.flatten(), k.flatten()])
        q, k = buf[:q.numel()].view(q.shape), buf[q.numel():].view(k.shape)
    elif shared == "interleaved":
        both = torch.stack([q, k], 1)
        q, k = both[:, 0], both[:, 1]
    with pytest.raises(prepared.PreparedCallError, match=match):
        _run(mod, call, q, k, v, out_parts[0], lse_parts[0])
    assert not prepared._CACHE
    assert isinstance(mod._flash_attn_fwd.compile_cache, dict)   # the real cache is back


def test_an_fa4_without_a_compile_cache_is_refused():
    mod = types.SimpleNamespace(_flash_attn_fwd=lambda *a, **kw: None)
    q, k, v, out_parts, lse_parts = _inputs(7)
    with pytest.raises(prepared.PreparedCallError, match=r"no _flash_attn_fwd.compile_cache.*PREPARED_CALLS = False, or `with .*prepared_calls\(False\):`"):
        _run(mod, Call([0], [0], [40], [48]), q, k, v, out_parts[0], lse_parts[0])


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(prepared, "MAX_ENTRIES", 3)
    mod = fake_fa4()
    q, k, v, out_parts, lse_parts = _inputs(8)
    for _ in range(5):
        _run(mod, Call([0], [0], [40], [48]), q, k, v, out_parts[0], lse_parts[0])
    assert len(prepared._CACHE) == 3


def test_the_switch_is_restored():
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    assert fa4_canonical.PREPARED_CALLS is True   # the default since session 12
    with pytest.raises(KeyError):
        with fa4_canonical.prepared_calls(False):
            assert fa4_canonical.PREPARED_CALLS is False
            raise KeyError("inside")
    assert fa4_canonical.PREPARED_CALLS is True



def test_recordings_in_two_threads_keep_fa4s_cache_and_each_other_apart():
    """FA4's compile_cache is process-wide: two threads recording at once swapped it in and out
    interleaved, the last restore could leave the other thread's recorder installed for good (every
    later FA4 call recorded, its tensors kept alive), and a call of another thread made during a
    recording was recorded with it, failing that call (a session 34 audit). Recordings now take turns,
    and only the recording thread's calls are recorded."""
    import threading

    mod = fake_fa4()
    real = mod._flash_attn_fwd.compile_cache
    inside, release, a_done = threading.Event(), threading.Event(), threading.Event()
    errors, results = [], {}

    def recording(name, seed, hold):
        q, k, v, out_parts, lse_parts = _inputs(seed)
        call = Call([0], [0], [40], [48])

        def normal():
            if hold:
                inside.set()
                release.wait(5)        # another thread's plain FA4 call and a second recording arrive now
            else:
                a_done.wait(5)         # B's recording ends after A's: B's restore comes last
            mod._flash_attn_fwd(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, call.seqused_k,
                                0.3, out_parts[0], lse_parts[0])
        try:
            prepared.run(mod, call, {"q": q, "k": k, "v": v, "out": out_parts[0], "lse": lse_parts[0]}, 0.3, normal)
            results[name] = out_parts[0].clone()
        except Exception as e:   # noqa: BLE001 - reported by the assert below
            errors.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            if hold:
                a_done.set()

    def plain_call():   # FA4 used directly by this thread while A records (e.g. a strict decode)
        q, k, v, out_parts, lse_parts = _inputs(9)
        c = Call([0], [0], [40], [48])
        mod._flash_attn_fwd(q, k, v, c.cu_seqlens_q, c.cu_seqlens_k, c.seqused_q, c.seqused_k, 0.3,
                            out_parts[0], lse_parts[0])

    a = threading.Thread(target=recording, args=("A", 1, True))
    b = threading.Thread(target=recording, args=("B", 2, False))
    a.start()
    assert inside.wait(5)
    b.start()
    p = threading.Thread(target=plain_call)
    p.start()
    p.join(5)
    release.set()
    a.join(10)
    b.join(10)
    assert errors == [] and set(results) == {"A", "B"}
    assert mod._flash_attn_fwd.compile_cache is real and len(prepared._CACHE) == 2
    for name, seed in (("A", 1), ("B", 2)):   # each equals FA4's own call on its inputs
        q, k, v, out_parts, lse_parts = _inputs(seed)
        c = Call([0], [0], [40], [48])
        fake_fa4()._flash_attn_fwd(q, k, v, c.cu_seqlens_q, c.cu_seqlens_k, c.seqused_q, c.seqused_k, 0.3,
                                   out_parts[0], lse_parts[0])
        assert bitwise_equal(results[name], out_parts[0])
