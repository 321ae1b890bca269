"""Mutation audit (session 43) of distributed/{layout, reductions, checks, compare}.py.

Gaps it found (each test below names the mutant it kills): layout's argument checks at their
boundaries (chunks=0, a 2-D or one-entry cu_seqlens, a token count of exactly 2**31, a negative or
one-past-the-end dim) and the metadata's mode and length order; the order canonical_reduce and
fanout sum in, and the chain element that orders the collectives; preflight's message truncation,
metadata limit, empty problem text, rank naming in a subgroup and the value names (show_*) of a
disagreement; compare_block's seed bounds, weight digest, output gradient (its seeded draw: in
tests/test_distributed_layout.py), reference module,
run-to-run and compiled verdicts, drift statistics and table. All single process: preflight runs on
the world-1 gloo group of conftest, or on a fake two-rank group whose all_gather hands back rows
that preflight itself built for each rank.
"""
import math

import pytest
import torch

from dist_utils import run_workers

from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.distributed import DistributedInputError, LayoutError, ParallelQwen3Attention, build_layout
from rlk_ops.distributed import checks, compare, init_mesh
from rlk_ops.distributed import reductions
from rlk_ops.distributed.reductions import (_chain, all_reduce, canonical_reduce, fanout, ordered_sum, reduce_forward,
                                             sync_grads)

TINY = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)


# ------------------------------------------------------------------------------------------ layout.py
@pytest.mark.parametrize("cu, cp, chunks, match", [
    ([0, 8], 1, 0, r"chunks \(canonical token chunks per sequence\) must be a positive multiple of cp = 1 for "
                   r"contiguous sharding, got 0"),
    (torch.tensor([[0, 8]], dtype=torch.int32), 1, None, r"cu_seqlens must be 1-D \[batch \+ 1\], got shape \[1, 2\]"),
    ([0], 1, None, r"cu_seqlens must have at least 2 entries \[batch \+ 1\], got 1"),
    ([0, 2 ** 31], 3, None, r"cu_seqlens\[-1\] \(the packed token count\) must be below 2\*\*31, got 2147483648"),
])
def test_layout_refuses_arguments_at_their_bounds(cu, cp, chunks, match):
    """Kills L02 (chunks=0 accepted: a ZeroDivisionError), L07 (a 2-D cu_seqlens not refused), L08 (a
    one-entry cu_seqlens taken as an empty batch), L09 (a token count of exactly 2**31 let through)."""
    with pytest.raises(LayoutError, match=match):
        build_layout(cu, cp, 0, "contiguous", chunks)


def test_layout_moves_take_every_valid_dim_and_refuse_one_past_the_end():
    """Kills L11 (dim = -x.dim() refused) and L12 (dim = x.dim() accepted: an IndexError, not a LayoutError)."""
    lay = build_layout([0, 8, 24], 2, 0, "zigzag")
    x = torch.arange(3 * 24.0).reshape(3, 24)
    for fn in (lay.to_cp_layout, lay.from_cp_layout, lay.shard):
        assert torch.equal(fn(x.T, dim=-2), fn(x.T, dim=0))
        assert torch.equal(fn(x[0], dim=-1), fn(x[0], dim=0))
        with pytest.raises(LayoutError, match=r"dim must be in \[-1, 0\] for x of shape \[24\], got 1"):
            fn(x[0], dim=1)


def test_layout_metadata_tells_apart_the_mode_and_the_order_of_the_lengths():
    """Kills L16 (the mode left out of the metadata: contiguous and zigzag over 8 canonical chunks agreed)
    and L18 (the lengths hashed in sorted order: batches [8, 16] and [16, 8] agreed)."""
    assert build_layout([0, 16, 32], 2, 0, "contiguous", 8).metadata() != \
        build_layout([0, 16, 32], 2, 0, "zigzag", 8).metadata()
    assert build_layout([0, 8, 24], 2, 0).metadata() != build_layout([0, 16, 24], 2, 0).metadata()


def test_layout_metadata_fits_int64_and_names_the_token_count():
    """Kills L15 (all 64 bits of the lengths hash kept: past int64, the preflight refused it as not a number)
    and L17 (the token count replaced by the batch size)."""
    metas = [build_layout([0, 8 * n, 8 * n + 16], 2, 0).metadata() for n in range(1, 9)]
    assert all(0 <= v < 2 ** 63 for m in metas for v in m), metas
    assert [m[:2] for m in metas] == [[2, 8 * n + 16] for n in range(1, 9)]


def test_layout_to_moves_every_index_tensor():
    """Kills L25 (CPLayout.to left piece_index behind: the backward indexed across devices)."""
    lay = build_layout([0, 8, 24], 2, 1, "zigzag")
    moved = lay.to("meta")
    tensors = [f for f, v in vars(lay).items() if isinstance(v, torch.Tensor)]
    assert len(tensors) == 7 and all(getattr(moved, f).device.type == "meta" for f in tensors), tensors
    assert lay.to("cpu") is lay


# -------------------------------------------------------------------------------------- reductions.py
# fp32 parts whose sum depends on the order: 1e8 + 1 rounds to 1e8 in fp32
_ORDERED = torch.tensor([[1e8], [-1e8], [1.0]])


def test_canonical_reduce_and_fanout_sum_in_the_given_order():
    """Kills R13 (canonical_reduce summed the parts in ascending index order, not ``order``) and R12
    (fanout the same): (1e8 + -1e8) + 1 = 1 but (1 + 1e8) + -1e8 = 0 in fp32."""
    for order, want in (((0, 1, 2), 1.0), ((2, 0, 1), 0.0)):
        assert torch.equal(ordered_sum(_ORDERED[list(order)], torch.float32), torch.tensor([want]))
        assert torch.equal(canonical_reduce(_ORDERED, None, order), torch.tensor([want]))
        w = torch.zeros(1, requires_grad=True)
        cells = fanout([w], [(3, (), order)], None, None)
        sum((c * g).sum() for c, g in zip(cells, _ORDERED)).backward()
        assert torch.equal(w.grad, torch.tensor([want])), (order, w.grad)


def test_chain_appends_one_element_of_the_previous_collective():
    """Kills R06 (_chain returned the buffer alone: the collectives of a backward were left independent,
    free to be reordered differently on two ranks; module doc of reductions.py)."""
    buf = torch.zeros(3, dtype=torch.bfloat16)
    assert _chain(buf, None)[1] == 0 and _chain(buf, None)[0] is buf
    chained, extra = _chain(buf, torch.tensor([[7.0, 8.0]]))
    assert extra == 1 and torch.equal(chained, torch.tensor([0.0, 0.0, 0.0, 7.0], dtype=torch.bfloat16))


def test_all_reduce_pads_to_a_multiple_of_the_group_size(monkeypatch):
    """Kills R01 (padding n % ws elements instead of -n % ws: 5 elements over 4 ranks padded to 6, which
    reduce_scatter cannot split; on 2 ranks the two agree). A fake group of 4 ranks that all hold x."""
    seen = {}

    def reduce_scatter(flat, dim, name):
        if flat.numel() % 4:
            raise ValueError(f"reduce_scatter: {flat.numel()} elements over 4 ranks")
        seen["flat"] = flat
        return 4 * flat.view(4, -1)[0]

    monkeypatch.setattr(torch.ops.rlk, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(torch.ops.rlk, "all_gather", lambda part, dim, name: 4 * seen["flat"])
    x = torch.arange(5.0)
    assert torch.equal(all_reduce(x, "g", 4), 4 * x) and seen["flat"].numel() == 8


def test_sync_grads_and_reduce_forward_reduce_over_the_named_groups(monkeypatch):
    """Kills R07 (tp reduced before cp), R08 (a cp+tp gradient not reduced over tp), R22 (nor over cp), R09
    (no reduction when only one group is given) and R15 / R16 (reduce_forward's backward not the identity, or
    its forward not reduced). A fake all_reduce multiplies by the group size and records each call."""
    calls = []

    def fake(buf, name, ws):
        calls.append((name, buf.numel()))
        return buf * ws

    monkeypatch.setattr(reductions, "all_reduce", fake)
    a, b, c = (torch.ones(n, requires_grad=True) for n in (2, 3, 5))
    outs = sync_grads([a, b, c], ["cp", "tp", "cp+tp"], ("cp", 2), ("tp", 3))
    sum(o.sum() for o in outs).backward()
    assert calls == [("cp", 7), ("tp", 9)], calls   # tp's buffer: b, c and one element of the cp result
    assert [t.grad.unique().tolist() for t in (a, b, c)] == [[2.0], [3.0], [6.0]]
    calls.clear()
    a.grad = None
    sync_grads([a], ["cp"], ("cp", 2), None)[0].sum().backward()
    assert calls == [("cp", 2)] and torch.equal(a.grad, torch.full((2,), 2.0))
    x = torch.ones(3, requires_grad=True)
    y = reduce_forward(x, ("tp", 2))
    y.sum().backward()
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(x.grad, torch.ones(3))


def test_fanout_gathers_over_cp_then_tp_rank_major(monkeypatch):
    """Kills R11 (the chain element dropped from the front of the gathered row, not its end), R17 (the
    second tensor's cells taken from the first's) and R21 (the gathered cells taken cell-major, not
    rank-major). A fake gather of two ranks: rank 1's cell gradients are 10 x this rank's."""
    calls = []

    def fake_gather(buf, dim, name):
        calls.append((name, buf.shape[1]))
        return torch.cat([buf, buf * 10])

    monkeypatch.setattr(torch.ops.rlk, "all_gather", fake_gather)
    w = torch.zeros(2, requires_grad=True)
    v = torch.zeros(3, requires_grad=True)
    # w's cells, gathered rank-major: [1e9, -1e8, 1e10, -1e9]; summed in order (0, 1, 2, 3) in fp32 that is
    # 9899999232, cell-major [1e9, 1e10, -1e8, -1e9] would give 9900001280
    w0, w1, v0 = fanout([w, v], [(2, ("cp",), (0, 1, 2, 3)), (1, ("cp", "tp"), (3, 2, 1, 0))], "cp", "tp")
    g = torch.tensor([1.0, 2.0, 3.0])
    ((w0 * 1e9).sum() - (w1 * 1e8).sum() + (v0 * g).sum()).backward()
    assert calls == [("cp", 7), ("tp", 7)], calls
    assert torch.equal(w.grad, torch.full((2,), 9899999232.0)), w.grad
    assert torch.equal(v.grad, g * 121), v.grad   # (1 + 10) over cp, then (1 + 10) over tp


# ------------------------------------------------------------------------------------------- checks.py
class _Row(Exception):
    """Raised by the capturing all_gather: the row this rank's preflight built."""


def _preflight_across(monkeypatch, per_rank, ranks=(0, 1), show=None):
    """checks.preflight as rank 0 of a fake group of len(per_rank) ranks: per_rank[i] = (problem, metadata)
    of rank i. Each rank's row is built by preflight itself (captured at its all_gather); rank 0's call then
    gets them all back. The group is a token whose global ranks are ``ranks``."""
    group = object()
    monkeypatch.setattr(checks.dist, "is_available", lambda: True)
    monkeypatch.setattr(checks.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(checks.dist, "get_backend", lambda g=None: "gloo")
    monkeypatch.setattr(checks.dist, "get_world_size", lambda g=None: len(per_rank))
    monkeypatch.setattr(checks.dist, "get_process_group_ranks", lambda g: list(ranks))
    rows = []

    def capture(parts, row, group=None):
        rows.append(row.clone())
        raise _Row

    monkeypatch.setattr(checks.dist, "all_gather", capture)
    for problem, meta in per_rank:
        with pytest.raises(_Row):
            checks.preflight(group, "t", problem, meta, show)

    def gather(parts, row, group=None):
        for p, r in zip(parts, rows):
            p.copy_(r)

    monkeypatch.setattr(checks.dist, "all_gather", gather)
    checks.preflight(group, "t", *per_rank[0], show)


def test_preflight_names_the_global_rank_of_a_subgroup(monkeypatch):
    """Kills C08 (a problem named by the rank's index in the group, not its global rank) and C13 (a
    disagreement named rank 0 for the group's first rank, whatever its global rank)."""
    with pytest.raises(DistributedInputError, match=r"^t: rank 3 rejected its input: bad q$"):
        _preflight_across(monkeypatch, [(None, {"a": 1}), ("bad q", {"a": 1})], ranks=(1, 3))
    with pytest.raises(DistributedInputError, match=r"^t: ranks disagree on a: 1 on rank 1 but 2 on rank 3$"):
        _preflight_across(monkeypatch, [(None, {"a": 1}), (None, {"a": 2})], ranks=(1, 3))


def test_preflight_names_the_first_rank_that_differs_and_a_key_count(monkeypatch):
    """Kills C11 (the last differing rank named), C10 (only neighbouring ranks compared, and all of them had
    to differ: three ranks where only the last differs passed), C09 (ranks with other numbers of keys not named: the
    values were compared column by column) and C30 (only rank 0's problem raised)."""
    with pytest.raises(DistributedInputError, match=r"ranks disagree on a: 1 on rank 0 but 2 on rank 1$"):
        _preflight_across(monkeypatch, [(None, {"a": 1}), (None, {"a": 2}), (None, {"a": 3})], ranks=(0, 1, 2))
    with pytest.raises(DistributedInputError, match=r"ranks disagree on a: 1 on rank 0 but 2 on rank 2$"):
        _preflight_across(monkeypatch, [(None, {"a": 1}), (None, {"a": 1}), (None, {"a": 2})], ranks=(0, 1, 2))
    with pytest.raises(DistributedInputError, match=r"rank 1 sent 2 metadata values, expected 1 \(a\)$"):
        _preflight_across(monkeypatch, [(None, {"a": 1}), (None, {"a": 1, "b": 0})])
    with pytest.raises(DistributedInputError, match=r"^t: rank 2 rejected its input: bad k$"):
        _preflight_across(monkeypatch, [(None, {}), (None, {}), ("bad k", {})], ranks=(0, 1, 2))


def test_preflight_names_values_through_show(monkeypatch):
    """Kills C12 (a float value handed to ``show`` as its int64 bits: softmax_scale None was named as
    its NaN bits) and C19 (a NaN sentinel compared with ==, so None was named 'nan')."""
    show = {"softmax_scale": checks.show_or_none(math.nan)}
    with pytest.raises(DistributedInputError, match=r"ranks disagree on softmax_scale: None on rank 0 but 0.5 on "
                                                    r"rank 1$"):
        _preflight_across(monkeypatch, [(None, {"softmax_scale": math.nan}), (None, {"softmax_scale": 0.5})],
                          show=show)


def test_preflight_truncates_a_long_problem_and_refuses_too_many_keys(single_process_group):
    """Kills C06 (a problem past 480 bytes not cut: the row could not hold it, a RuntimeError on that rank
    alone), C27 (the message length counted in characters, cutting a non-ASCII text short), C04 (every value
    written to the row: 600 do not fit, a RuntimeError), C05 (33 values: only 32 compared, no error) and C07 (an empty problem
    text taken as no problem)."""
    with pytest.raises(DistributedInputError, match=r"^t: rank 0 rejected its input: x{480}$"):
        checks.preflight(None, "t", "x" * 600, {})
    with pytest.raises(DistributedInputError, match=r"^t: rank 0 rejected its input: dim é = 2$"):
        checks.preflight(None, "t", "dim é = 2", {})
    for n in (33, 600):   # 600 values do not fit the row at all
        with pytest.raises(DistributedInputError, match=rf"preflight carries at most 32 metadata values, got {n}$"):
            checks.preflight(None, "t", None, {f"k{i}": i for i in range(n)})
    with pytest.raises(DistributedInputError, match=r"^t: rank 0 rejected its input: $"):
        checks.preflight(None, "t", "", {})
    checks.preflight(None, "t", None, {f"k{i}": i for i in range(32)})


def test_preflight_takes_the_int64_bounds_and_refuses_a_value_that_is_no_number(single_process_group):
    """Kills C01 (-2**63, a valid int64, refused as metadata) and C26 (a metadata value that is not a number
    sent as 0 instead of being this rank's problem)."""
    assert checks._encode("x", -2 ** 63) == (-2 ** 63, None)
    checks.preflight(None, "t", None, {"lo": -2 ** 63, "hi": 2 ** 63 - 1})
    with pytest.raises(DistributedInputError, match=r"^t: rank 0 rejected its input: metadata a must be an int or a "
                                                    r"float, got None$"):
        checks.preflight(None, "t", None, {"a": None})


def test_dtype_codes_and_value_names():
    """Kills C14 (an unknown dtype coded as bfloat16's code), C15 (float16 and bfloat16 one code), C16
    (show_dtype's 'no float dtype' lost), C17 / C18 (show_choice's None sentinel, or a negative index,
    named as a choice), C20 (show_flags one bit off), C21 (show_bool named 1, not True), C29 (show_flags
    without its prefix) and C22 (LAYOUT_KEYS naming the layout metadata in another order)."""
    codes = [checks.dtype_code(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)]
    assert len(set(codes)) == 4 and 0 not in codes and checks.dtype_code(torch.int64) == 0
    assert [checks.show_dtype(c) for c in codes] == ["torch.bfloat16", "torch.float16", "torch.float32",
                                                      "torch.float64"]
    assert checks.show_dtype(0) == "no float dtype"
    show = checks.show_choice(("contiguous", "zigzag"), none=-1)
    assert (show(1), show(-1), checks.show_choice(("a", "b"))(-1)) == ("'zigzag'", "None", "no valid choice of "
                                                                                         "('a', 'b')")
    assert checks.show_flags(["a", "b", "c"], "True for ")(0b101) == "True for [a, c]"
    assert (checks.show_bool(1), checks.show_bool(0)) == ("True", "False")
    assert (checks.show_or_none(math.nan)(math.nan), checks.show_or_none(-1)(-1), checks.show_or_none(-1)(4)) == \
        ("None", "None", "4")
    lay = build_layout([0, 16, 48], 2, 1, "zigzag", 8)
    meta = dict(zip(checks.LAYOUT_KEYS, lay.metadata()))
    assert (meta["batch"], meta["tokens"], meta["mode"], meta["n_chunks"], meta["canonical"]) == (2, 48, 1, 8, 1)


# ------------------------------------------------------------------------------------------ compare.py
def _tiny():
    block = init_block(Qwen3Attention(**TINY))
    x, pos, cu = packed_batch([16, 8], TINY["hidden_size"], requires_grad=False)
    return block, x, pos, cu


@pytest.mark.parametrize("seed, ok", [(2 ** 63, False), (-2 ** 63, True)])
def test_compare_block_seed_bounds(seed, ok):
    """Kills P12 (seed 2**63 accepted) and P13 (seed -2**63, a valid int64, refused)."""
    block, x, pos, cu = _tiny()
    if ok:
        assert compare.compare_block(block, None, x, pos, cu, seed=seed).claims_hold()
    else:
        with pytest.raises(DistributedInputError, match=rf"seed must be an int in \[-2\*\*63, 2\*\*63\) .*, got {seed}"):
            compare.compare_block(block, None, x, pos, cu, seed=seed)


def test_digest_reads_every_tensor():
    """Kills P14 (the digest hashed the first tensor only: ranks whose k_norm weights differed agreed) and P15
    (all 64 bits kept: past int64, the preflight refused the digest as not a number)."""
    a, b = torch.zeros(4), torch.ones(3)
    assert compare._digest(a, b) != compare._digest(a, b + 1) and compare._digest(a, b) == compare._digest(a, b.clone())
    digests = [compare._digest(torch.full((3,), float(i))) for i in range(8)]
    assert len(set(digests)) == 8 and all(0 <= d < 2 ** 63 for d in digests), digests   # one int64 metadata value


def test_run_backpropagates_the_given_output_gradient():
    """Kills P06 (the output gradient dy left out of the loss; the backward is linear in dy, so -dy gives
    exactly the negated gradients) and P34 (dX reported as zeros: every run agreed on them)."""
    block, x, pos, cu = _tiny()
    pb = ParallelQwen3Attention(block, None)
    xs, ps, lay = pb.prepare(x, pos, cu)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    plus, minus = compare._run(pb, xs, ps, lay, dy), compare._run(pb, xs, ps, lay, -dy)
    for name in ("dX", "dQ", "d q_proj.weight"):
        assert torch.equal(minus[name], -plus[name]) and plus[name].abs().sum() > 0, name


def test_compare_block_reference_is_the_plain_contiguous_block(monkeypatch):
    """Kills P19 (the default mode's one-process reference built with the mesh's sharding, not the plain
    block's contiguous order)."""
    made = []
    real = compare.ParallelQwen3Attention

    def spy(block, mesh, sharding="contiguous", chunks=None):
        made.append((sharding, chunks))
        return real(block, mesh, sharding, chunks)

    monkeypatch.setattr(compare, "ParallelQwen3Attention", spy)
    block, x, pos, cu = _tiny()
    compare.compare_block(block, None, x, pos, cu, "zigzag")
    compare.compare_block(block, None, x, pos, cu, "zigzag", 4)
    assert made == [("zigzag", None), ("contiguous", None), ("zigzag", 4), ("zigzag", 4)], made


def test_compare_block_rows_report_the_first_runs_drift_and_the_second_runs_verdict(monkeypatch):
    """Kills P20 (the second eager run not made: run_to_run always true), P25 (max and mean swapped), P27
    (the mean from the max) and P26 (compiled_equal a bool without a compiled run). The first mesh run's
    dX is moved off the reference at two elements, by known amounts."""
    calls = []
    real = compare._run

    def spy(module, x, positions, layout, dy, fn=None):
        out = real(module, x, positions, layout, dy, fn)
        calls.append(out)
        if len(calls) == 2:   # the reference, then the first eager run on the "mesh"
            out["dX"] = out["dX"].clone()
            out["dX"][0, 0] += 1.0
            out["dX"][3, 5] -= 0.5
        return out

    monkeypatch.setattr(compare, "_run", spy)
    block, x, pos, cu = _tiny()
    c = compare.compare_block(block, None, x, pos, cu)
    d = (calls[1]["dX"].double() - calls[0]["dX"].double()).abs()
    assert float(d.max()) > float(d.sum()) / d.numel() > 0
    row = c.row("dX")
    assert (row.bitwise, row.run_to_run) == (False, False), row
    assert row.max_abs == float(d.max()) and row.mean_abs == float(d.sum() / d.numel()), row
    assert all(r.compiled_equal is None for r in c.rows) and all(r.run_to_run for r in c.rows if r.name != "dX")


def test_compare_block_compiled_row_compares_the_compiled_run(monkeypatch):
    """Kills P21 (compiled_equal compared the eager run with itself): a "compiled" function whose block
    output is off by one must give compiled_equal False for that row, True for the others."""
    def fake_compile(module, fullgraph=False):
        def fn(*args, **kwargs):
            y, attn, lse = module(*args, **kwargs)
            return y + 1, attn, lse
        return fn

    monkeypatch.setattr(compare.torch, "compile", fake_compile)
    block, x, pos, cu = _tiny()
    c = compare.compare_block(block, None, x, pos, cu, compile=True)
    assert c.row("block output y").compiled_equal is False and c.row("attention out").compiled_equal is True
    assert c.row("dQ").compiled_equal is None and not c.claims_hold()


def test_comparison_claims_and_table():
    """Kills P01 (run_to_run left out of claims_hold), P02 (an unclaimed row's drift breaking the claims),
    P03 (the table's bitwise column always yes) and P04 (the table's verdict always yes)."""
    Comparison, Row = compare.Comparison, compare.Row
    fine = Row("lse", True, 0.0, 0.0, True, None, True)
    drift = Row("dK", False, 0.25, 0.125, True, None, False)
    assert Comparison(1, 2, "zigzag", None, "gloo", [fine, drift]).claims_hold()
    flaky = Comparison(1, 2, "zigzag", None, "gloo", [Row("lse", True, 0.0, 0.0, False, None, True)])
    assert not flaky.claims_hold()
    lines = flaky.table().splitlines()
    assert lines[-1] == "claims hold: NO" and lines[2].split()[1:3] == ["yes", "yes"]
    lines = Comparison(1, 2, "zigzag", None, "gloo", [fine, drift]).table().splitlines()
    assert lines[3].split() == ["dK", "no", "-", "2.500e-01", "1.250e-01", "yes", "-"] and lines[-1] == "claims hold: yes"


def _one_rank_drifts_worker(rank, world_size):
    """Rank 1's first run moves one dX element off the reference; rank 0's agrees bitwise (canonical mode)."""
    stash = {}
    real = compare._run

    def spy(module, x, positions, layout, dy, fn=None):
        out = real(module, x, positions, layout, dy, fn)
        stash["calls"] = stash.get("calls", 0) + 1
        if rank == 1 and stash["calls"] == 2:
            bumped = out["dX"].clone()
            bumped[0, 0] += 1.0
            stash["delta"] = float((bumped[0, 0].double() - out["dX"][0, 0].double()).abs())
            stash["numel"] = out["dX"].numel()
            out["dX"] = bumped
        return out

    compare._run = spy
    block, x, pos, cu = _tiny()
    c = compare.compare_block(block, init_mesh(1, 2, "cpu"), x, pos, cu, "zigzag", 4)
    row = c.row("dX")
    assert c.backend == "gloo" and not row.bitwise and not row.run_to_run and row.max_abs > 0, c.table()
    assert all(r.bitwise for r in c.rows if r.name != "dX"), c.table()
    if rank == 1:
        assert row.max_abs == stash["delta"], (row, stash)
        assert row.mean_abs == stash["delta"] / (2 * stash["numel"]), (row, stash)


def test_compare_block_combines_the_ranks_verdicts_and_drift():
    """Kills P22 (a row bitwise if it is on any rank: all_reduce MAX, not MIN), P23 (max|diff| the smallest
    rank's: MIN, not MAX), P24 (the drift sums and counts taken from one rank: MAX, not SUM) and P33 (the
    backend reported as "none" on a mesh). Two gloo
    ranks, 1 x 2 mesh; only rank 1's dX differs from the reference."""
    run_workers(_one_rank_drifts_worker, 2)


def _mesh_preflight_body(rank, world):
    """preflight_mesh over a (2, 2) mesh of ranks 0-3 (rank 4 outside it): a problem on rank 3 reaches
    rank 0, which shares no group with it, in two stages; without problems all proceed; a metadata value
    that differs is named too."""
    from torch.distributed.device_mesh import DeviceMesh

    from rlk_ops.distributed.checks import preflight_mesh
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("replicate", "shard"))
    if rank == 4:
        return
    preflight_mesh(mesh, "x", None, {"n": 7})
    cases = (("bad input" if rank == 3 else None, {"n": 7}, "x: rank 3 rejected its input: bad input"),
             (None, {"n": 8 if rank == 0 else 7}, "x: ranks disagree on n"))
    for problem, meta, fragment in cases:
        try:
            preflight_mesh(mesh, "x", problem, meta)
        except DistributedInputError as e:
            assert fragment in str(e), f"rank {rank}: {e}"
        else:
            raise AssertionError(f"rank {rank}: no error")


@pytest.mark.distributed
def test_a_mesh_preflight_reaches_every_rank_of_a_2d_mesh_not_spanning_the_job():
    run_workers(_mesh_preflight_body, 5)
