"""FlashInfer lane: split-KV policy mapping, the strict refusal of the auto lane (CPU),
and under -m cuda: accuracy against the CPU reference, LSE in natural log, bitwise B=1
vs B=8 and run-to-run for the strict policies, the plan recorded per call."""
import math

import pytest
import torch

import rlk_ops
from rlk_ops import RlkInputError, StrictModeError
from rlk_ops.kernels.flashinfer import flashinfer_split_args

from conftest import TOL, bitwise_equal, rel_err


def _has_flashinfer() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


needs_flashinfer = pytest.mark.skipif(not _has_flashinfer(), reason="needs a CUDA GPU and flashinfer")
HQ, HKV, D, PS = 16, 4, 128, 16


def cuda_test(fn):
    return pytest.mark.cuda(needs_flashinfer(fn))


# ----------------------------------------------------------------------- CPU side
@pytest.mark.parametrize("policy,page_size,expected", [
    ("disabled", 16, {"disable_split_kv": True, "fixed_split_size": None}),
    ("fixed:256", 16, {"disable_split_kv": False, "fixed_split_size": 16}),
    ("fixed:1024", 128, {"disable_split_kv": False, "fixed_split_size": 8}),
    ("auto", 16, {"disable_split_kv": False, "fixed_split_size": None}),
])
def test_policy_maps_to_flashinfer_plan_arguments(policy, page_size, expected):
    assert flashinfer_split_args(policy, page_size) == expected


def test_policy_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"'fixed:100' must be a multiple of the cache's page_size 16"):
        flashinfer_split_args("fixed:100", 16)
    with pytest.raises(ValueError, match=r"'canonical:256' is not implemented by the flashinfer backend"):
        flashinfer_split_args("canonical:256", 16)


def test_fixed_split_past_int32_pages_is_refused():
    """FlashInfer takes fixed_split_size in pages as an int32: fixed:2**31 at page size 1 wrapped to a
    value <= 0, which FlashInfer reads as its automatic split (a session 34 audit)."""
    assert flashinfer_split_args(f"fixed:{2 ** 31 - 1}", 1)["fixed_split_size"] == 2 ** 31 - 1
    for n in (2 ** 31, 2 ** 35):
        with pytest.raises(ValueError, match=rf"fixed:N needs 0 < N <= 2147483647 \(MAX_FIXED_SPLIT\), got {n}"):
            flashinfer_split_args(f"fixed:{n}", 1)


def test_a_policy_built_directly_is_checked_like_its_text():
    """SplitKVPolicy(...) reached FlashInfer's plan unchecked: fixed:0 became FlashInfer's automatic split,
    canonical:100 and kinds nobody defined were accepted (a session 34 audit)."""
    from rlk_ops.meta.contract import DEFAULT_CANONICAL_CHUNK, SplitKVPolicy

    assert SplitKVPolicy("canonical").size == DEFAULT_CANONICAL_CHUNK
    assert SplitKVPolicy("fixed", 64) == SplitKVPolicy.parse("fixed:64")
    for args, pattern in ((("fixed", 0), r"fixed:N needs 0 < N"), (("fixed", None), r"fixed:N needs 0 < N"),
                          (("canonical", 100), r"canonical:C needs C a positive multiple of 128, got 100"),
                          (("auto", 7), r"split_kv auto takes no size, got 7"),
                          (("bogus",), r"split_kv kind must be one of disabled, fixed, auto, canonical, got 'bogus'"),
                          (("fixed", 64.0), r"split_kv fixed size must be an int or None, got float 64.0"),
                          (("fixed", True), r"split_kv fixed size must be an int or None, got bool True")):
        with pytest.raises(ValueError, match=pattern):
            SplitKVPolicy(*args)


def test_plan_and_run_hold_one_lock(monkeypatch):
    """One FlashInfer wrapper per device holds one plan: two threads' plan() and run() interleaved, and
    a thread ran with the other's lengths (a session 34 audit). A stand-in wrapper records what each
    run saw: every run sees its own plan."""
    import sys
    import threading
    import time
    import types

    from rlk_ops.kernels import flashinfer as FI

    class Wrapper:
        def __init__(self, *a, **k):
            self.resolved_backend = "stand-in"

        def plan(self, indptr, indices, last, *a, **k):
            self.lens = ((indptr[1:] - indptr[:-1] - 1) * 4 + last).clone()
            time.sleep(0.05)   # planning takes host time: another thread gets in here without the lock

        def run(self, q, kv, return_lse=False):
            out = torch.zeros_like(q) + self.lens.to(q.dtype).repeat_interleave(q.shape[0] // self.lens.shape[0])[:, None, None]
            return out, torch.zeros(q.shape[0], q.shape[1])

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    monkeypatch.setattr(FI, "_wrappers", {})
    kc = torch.zeros(16, 4, 1, 8, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32)[None]
    seen = {}

    def call(n):
        out, _ = FI._run(torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16), kc, kc, table,
                         torch.tensor([n], dtype=torch.int32), 0.35, "disabled")
        seen[n] = int(out.float()[0, 0, 0, 0])

    threads = [threading.Thread(target=call, args=(n,)) for n in (5, 30, 17, 9)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert seen == {5: 5, 30: 30, 17: 17, 9: 9}
    assert len(FI._wrappers) == 1


def _small_paged():
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 8, generator=g), torch.randn(6, 4, 2, 8, generator=g)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    return torch.randn(2, 1, 4, 8, generator=g), kc, vc, table, torch.tensor([9, 6], dtype=torch.int32)


def test_auto_lane_is_tagged_and_refused_in_strict_mode():
    assert torch.Tag.nondeterministic_bitwise in torch.ops.rlk.paged_attention_auto.default.tags
    assert not rlk_ops.OP_SPECS["paged_attention_auto"].deterministic
    with rlk_ops.provenance.capture() as log:
        with pytest.raises(StrictModeError, match=r"rlk::paged_attention_auto: the automatic split-KV depends on "
                                                  r"the batch .* strict mode \(the default\) refuses it"):
            rlk_ops.paged_attention_auto(*_small_paged())
    assert log.records() == []  # nothing ran


def test_auto_lane_outside_strict_mode_runs_and_is_recorded():
    args = _small_paged()
    with rlk_ops.strict(False), rlk_ops.provenance.capture() as log:
        out, lse = rlk_ops.paged_attention_auto(*args)
    ref = rlk_ops.paged_attention(*args)  # the cpu backend never splits: auto == one pass
    assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1])
    (rec,) = log.records()
    assert (rec.op, rec.actual_backend, rec.fallback) == ("paged_attention_auto", "cpu", False)


def test_cpu_auto_lane_is_one_pass_alone_and_in_a_batch():
    """The cpu backend's claim for the auto lane (never splits): with sequences past one
    128-key block and past a 128-key chunk, each row equals single-pass paged attention and
    the same sequence decoded alone (where a split would change bits)."""
    g = torch.Generator().manual_seed(3)
    ps, lens = 16, [300, 200, 129]
    pages = sum(-(-n // ps) for n in lens)
    kc, vc = torch.randn(pages, ps, 2, 8, generator=g), torch.randn(pages, ps, 2, 8, generator=g)
    perm = torch.randperm(pages, generator=g)
    width = max(-(-n // ps) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // ps)
        table[b, :need] = perm[used:used + need].to(torch.int32)
        used += need
    q = torch.randn(len(lens), 1, 4, 8, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32)
    with rlk_ops.strict(False):
        out, lse = rlk_ops.paged_attention_auto(q, kc, vc, table, sl)
        ref = rlk_ops.paged_attention(q, kc, vc, table, sl)
        split = rlk_ops.paged_attention(q, kc, vc, table, sl, split_kv="canonical:128")
        assert not torch.equal(split[0], ref[0])  # a split would show in these bits
        assert bitwise_equal(out, ref[0]) and bitwise_equal(lse, ref[1])
        for b in range(len(lens)):
            r = slice(b, b + 1)
            one = rlk_ops.paged_attention_auto(q[r], kc, vc, table[r], sl[r])
            assert bitwise_equal(one[0][0], out[b]) and bitwise_equal(one[1][0], lse[b])


def test_strict_op_refuses_auto_on_every_backend():
    with rlk_ops.use_backend(paged_attention="flashinfer"):
        with pytest.raises(RlkInputError, match=r"split_kv 'auto' is not allowed here"):
            rlk_ops.paged_attention(*_small_paged(), split_kv="auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_flashinfer_unavailable_without_cuda():
    with rlk_ops.use_backend(paged_attention="flashinfer"):
        with pytest.raises(StrictModeError, match=r"backend 'flashinfer' unavailable: it runs on cuda tensors, and "
                                                  r"these are on cpu"):
            rlk_ops.paged_attention(*_small_paged())


# ----------------------------------------------------------------------- CUDA side
LENS = [1000, 4, 17, 256, 2049, 700, 33, 4096]  # >= 4: the Sq=4 case needs 4 cached tokens


def _batch(sq=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / PS) for n in LENS]
    num_pages = sum(pages) + 5
    kc = torch.randn(num_pages, PS, HKV, D, generator=g).to(torch.bfloat16)  # stale slots hold finite garbage
    vc = torch.randn(num_pages, PS, HKV, D, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(LENS), max(pages) + 2), -9, dtype=torch.int32)  # padding may hold anything
    i = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    q = torch.randn(len(LENS), sq, HQ, D, generator=g).to(torch.bfloat16)
    return q, kc, vc, table, torch.tensor(LENS, dtype=torch.int32)


def _cuda(args):
    return [a.cuda() for a in args]


@pytest.fixture(scope="module")
def reference():
    return {sq: rlk_ops.paged_attention(*_batch(sq)) for sq in (1, 4)}  # CPU reference backend


@cuda_test
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("policy", ["disabled", "fixed:256", "fixed:1024"])
def test_strict_policies_accurate_batch_invariant_run_to_run(reference, sq, policy):
    from rlk_ops.kernels import flashinfer as FI

    q, kc, vc, table, lens = _cuda(_batch(sq))
    with rlk_ops.use_backend(paged_attention="flashinfer"), rlk_ops.provenance.capture() as log:
        out, lse = rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv=policy)
        plan = dict(FI.last_plan)
        again = rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv=policy)
        singles = [rlk_ops.paged_attention(q[b:b + 1], kc, vc, table[b:b + 1], lens[b:b + 1], split_kv=policy)
                   for b in range(len(LENS))]
    assert {(r.op, r.actual_backend) for r in log.records()} == {("paged_attention", "flashinfer")}
    ref_out, ref_lse = reference[sq]
    assert rel_err(out.cpu(), ref_out) < TOL[torch.bfloat16]
    # natural log: measured within 1.2e-3 of the fp32 reference (LSE ~7-9, H200); log2 units would be 30% off
    assert (lse.cpu() - ref_lse).abs().max().item() < 5e-3
    assert bitwise_equal(again[0], out) and bitwise_equal(again[1], lse)
    for b, (o1, l1) in enumerate(singles):
        assert bitwise_equal(o1[0], out[b]) and bitwise_equal(l1[0], lse[b]), f"sequence {b}"
    # the plan FlashInfer made is recorded with the policy
    assert plan["policy"] == policy and plan["use_tensor_cores"] and plan["q_len"] == sq
    if policy == "disabled":
        assert plan["disable_split_kv"] and plan["split_kv"] is False
    else:
        n = int(policy.split(":")[1])
        assert plan["fixed_split_size_pages"] == n // PS
        assert plan["split_kv"] is True and plan["kv_chunk_tokens"] == n  # LENS has sequences longer than n


@cuda_test
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("policy", ["disabled", "fixed:256", "fixed:1024"])
def test_strict_policies_ignore_which_pages_hold_the_keys(sq, policy):
    """Batch invariance includes the physical pages (meta/specs.py): the same K/V moved to other pages
    of a larger cache, the table following, gives the same bits. (The test above keeps the pages: a
    session 33 audit.)"""
    q, kc, vc, table, lens = _cuda(_batch(sq))
    pages = kc.shape[0]
    perm = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(9))[:pages].cuda()
    kc2 = torch.full((2 * pages, *kc.shape[1:]), float("nan"), dtype=kc.dtype, device="cuda")
    vc2 = torch.full_like(kc2, float("nan"))
    kc2[perm], vc2[perm] = kc, vc
    used = torch.arange(table.shape[1], device="cuda")[None] < ((lens + PS - 1) // PS)[:, None]
    table2 = torch.where(used, perm[table.long().clamp(0, pages - 1)], table.long()).to(torch.int32)
    with rlk_ops.use_backend(paged_attention="flashinfer"):
        out, lse = rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv=policy)
        out2, lse2 = rlk_ops.paged_attention(q, kc2, vc2, table2, lens, split_kv=policy)
    assert bitwise_equal(out2, out) and bitwise_equal(lse2, lse)


@cuda_test
def test_auto_lane_accurate_and_recorded(reference):
    from rlk_ops.kernels import flashinfer as FI

    args = _cuda(_batch(1))
    with rlk_ops.strict(False), rlk_ops.provenance.capture() as log:
        out, lse = rlk_ops.paged_attention_auto(*args)
        again = rlk_ops.paged_attention_auto(*args)
    (rec,) = log.records()
    assert (rec.actual_backend, FI.last_plan["policy"]) == ("flashinfer", "auto")
    assert rel_err(out.cpu(), reference[1][0]) < TOL[torch.bfloat16]
    assert bitwise_equal(again[0], out) and bitwise_equal(again[1], lse)  # run-to-run for a fixed batch


@cuda_test
def test_flashinfer_rejects_what_it_cannot_do():
    q, kc, vc, table, lens = _cuda(_batch(1))
    with rlk_ops.use_backend(paged_attention="flashinfer"):
        with pytest.raises(ValueError, match=r"'fixed:100' must be a multiple of the cache's page_size 16"):
            rlk_ops.paged_attention(q, kc, vc, table, lens, split_kv="fixed:100")
        with pytest.raises(ValueError, match=r"q must be bfloat16 or float16, got torch.float32"):
            rlk_ops.paged_attention(q.float(), kc.float(), vc.float(), table, lens)
