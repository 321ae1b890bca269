"""rlk::all_gather (exact) and rlk::reduce_scatter (fp32 sum in rank order) on gloo,
with 2 and 4 processes; their autograd (each is the other's gradient)."""
import pytest
import torch
import torch.distributed as dist

import rlk_ops

from dist_utils import run_workers

pytestmark = pytest.mark.distributed


def _inputs(world_size, dtype):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(4 * world_size, 6, generator=g).to(dtype) for _ in range(world_size)]


def _worker(rank, world_size, dtype):
    xs = _inputs(world_size, dtype)
    x = xs[rank]
    # all_gather: exact concatenation in rank order, along any dim
    assert torch.equal(rlk_ops.all_gather(x, 0), torch.cat(xs, 0))
    assert torch.equal(rlk_ops.all_gather(x, -1), torch.cat(xs, -1))
    # reduce_scatter: block `rank` of sum_r xs[r], summed in ascending rank order in fp32
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expect = xs[0].to(acc)
    for r in range(1, world_size):
        expect = expect + xs[r].to(acc)
    expect = expect.to(dtype).chunk(world_size, 0)[rank]
    out = rlk_ops.reduce_scatter(x, 0)
    assert out.dtype == dtype and torch.equal(out, expect)
    assert torch.equal(rlk_ops.reduce_scatter(x, 0), out)  # run to run
    # autograd: d/dx_rank sum_r(w_r * all_gather(x)) = block `rank` of sum_r w_r (a reduce_scatter), and
    # d/dx_rank sum_r(w2_r * reduce_scatter(x)) = all_gather(w2): each rank's w differs, and the expected
    # values are written out from every rank's w (with one w on every rank, a backward that exchanged
    # nothing, rank-local block x world size, passed: session 32 audit)
    xr = x.clone().requires_grad_()

    def w_of(r):
        return (torch.arange(4 * world_size * world_size * 6, dtype=torch.float32).reshape(-1, 6) + 1000 * r).to(dtype)
    (gx,) = torch.autograd.grad((rlk_ops.all_gather(xr, 0) * w_of(rank)).sum(), xr)
    want = w_of(0).to(acc)
    for r in range(1, world_size):
        want = want + w_of(r).to(acc)
    assert torch.equal(gx, want.to(dtype).chunk(world_size, 0)[rank])
    (gx2,) = torch.autograd.grad((rlk_ops.reduce_scatter(xr, 0) * w_of(rank)[:4]).sum(), xr)
    assert torch.equal(gx2, torch.cat([w_of(r)[:4] for r in range(world_size)], 0))
    # bad input on every rank fails on every rank, before any data is sent (no hang)
    try:
        rlk_ops.reduce_scatter(torch.zeros(world_size + 1, 2, dtype=dtype), 0)
    except rlk_ops.RlkInputError as e:
        assert f"must be divisible by the world size {world_size}" in str(e)
    else:
        raise AssertionError("reduce_scatter accepted an indivisible dim")
    # a subgroup works through its group_name
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        assert torch.equal(rlk_ops.all_gather(x, 0, group=sub), torch.cat(xs[:2], 0))


def _rows_worker(rank, world_size):
    """reduce_scatter is batch-invariant: a token's summed row does not depend on how many tokens were
    reduced with it. With 4 ranks a size-dependent summation order changes bits (with 2 it cannot):
    the test above has one shape per world size, and a kernel that reversed its order past 128
    elements passed it (a session 33 audit)."""
    g = torch.Generator().manual_seed(100 + rank)
    pool = torch.randn(1000, 6 * world_size, generator=g) * (10.0 ** torch.randint(-3, 4, (1000, 1), generator=g))
    full = rlk_ops.reduce_scatter(pool, -1)
    for t in (1, 2, 64, 999):
        assert torch.equal(rlk_ops.reduce_scatter(pool[:t].contiguous(), -1), full[:t]), t
    for t in (1, 37):   # rows later in the batch: their own call
        assert torch.equal(rlk_ops.reduce_scatter(pool[500:500 + t].contiguous(), -1), full[500:500 + t]), t


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_rows_are_batch_invariant(world_size):
    run_workers(_rows_worker, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_gloo(world_size):
    run_workers(_worker, world_size, torch.float32)


def test_collectives_gloo_bf16():
    run_workers(_worker, 2, torch.bfloat16)


def _raises_everywhere(fn, match):
    """fn() must raise DistributedInputError matching ``match`` on this rank; afterwards the ranks
    still communicate (a rank left inside a collective would hang the next one)."""
    import re

    from rlk_ops.distributed import DistributedInputError
    try:
        fn()
    except DistributedInputError as e:
        assert re.search(match, str(e)), str(e)
    else:
        raise AssertionError(f"no DistributedInputError (expected {match!r})")


def _mismatch_worker(rank, world_size):
    """Shapes, dtypes, dims that differ between ranks, or bad input on one rank alone: every rank
    raises the same error naming the rank and the argument (before, gloo aborted a process or
    another rank returned uninitialised memory, and a rank's own bad input left the others waiting
    until the timeout); the next call with agreeing input then works."""
    last = world_size - 1
    x = torch.full((4, 6), float(rank))
    good = torch.cat([torch.full((4, 6), float(r)) for r in range(world_size)])
    assert torch.equal(rlk_ops.all_gather(x, 0), good)
    for op in (rlk_ops.all_gather, rlk_ops.reduce_scatter):
        name = op.__name__
        n = 4 * world_size
        y = torch.zeros(n, 7) if rank == last else torch.zeros(n, 6)
        _raises_everywhere(lambda: op(y, 0), rf"rlk_ops.{name}: ranks disagree on x.shape\[1\]: 6 on rank 0 "
                                             rf"but 7 on rank {last}")
        y = torch.zeros(n, 6, 1) if rank == last else torch.zeros(n, 6)
        _raises_everywhere(lambda: op(y, 0), rf"ranks disagree on x.dim\(\): 2 on rank 0 but 3 on rank {last}")
        y = torch.zeros(n, 6, dtype=torch.float64 if rank == last else torch.float32)
        _raises_everywhere(lambda: op(y, 0), rf"ranks disagree on x.dtype: torch.float32 on rank 0 but "
                                             rf"torch.float64 on rank {last}")
        y = torch.zeros(4 * world_size, 6)
        _raises_everywhere(lambda: op(y, 1 if rank == last else 0),
                           rf"ranks disagree on dim: 0 on rank 0 but 1 on rank {last}")
        # the 27 dims named one by one, and those past them through their hash
        shape = [1] * 25 + [4 * world_size, 2 if rank == last else 3]
        _raises_everywhere(lambda: op(torch.zeros(shape), 25), rf"ranks disagree on x.shape\[26\]: 3 on rank 0 but 2 "
                                                               rf"on rank {last}")
        shape = [1] * 27 + [4 * world_size, 2 if rank == last else 3]
        _raises_everywhere(lambda: op(torch.zeros(shape), 27), r"ranks disagree on x.shape past dim 26 \(hashed\)")
        _raises_everywhere(lambda: op(torch.zeros(n, 6, device="meta" if rank == last else "cpu"), 0),
                           rf"ranks disagree on x.device: 'cpu' on rank 0 but 'meta' on rank {last}")
        # check must be a bool: raised on its rank alone, it left the others waiting in the exchange
        _raises_everywhere(lambda: op(torch.zeros(n, 6), 0, check=1 if rank == last else True),
                           rf"rank {last} rejected its input: rlk::{name}: check must be a bool, got int 1")
        # one rank's own bad input: every rank raises with its message
        _raises_everywhere(lambda: op("x" if rank == last else torch.zeros(4 * world_size, 6), 0),
                           rf"rlk_ops.{name}: rank {last} rejected its input: rlk::{name}: x must be a torch.Tensor")
        _raises_everywhere(lambda: op(torch.zeros(4 * world_size, 6), 5 if rank == last else 0),
                           rf"rank {last} rejected its input: rlk::{name}: dim must be in \[-2, 1\]")
    # -1 and 1 name the same dim of a 2-d x
    assert torch.equal(rlk_ops.all_gather(x, -1 if rank == 0 else 1), torch.cat(good.chunk(world_size), 1))
    # check=False skips the exchange (the local checks still run)
    assert torch.equal(rlk_ops.all_gather(x, 0, check=False), good)
    _raises_everywhere(lambda: rlk_ops.all_gather(x, 0, check="yes"), "check must be a bool, got str 'yes'")
    # the bytes travel: dtypes gloo cannot send as they are ("Invalid scalar type": int16, float8), bool,
    # the sub-byte shells (one byte an element), float4 pairs
    for dtype in (torch.int16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint16, torch.complex64,
                  torch.float4_e2m1fn_x2, torch.int3):
        def mine(r):
            raw = ((torch.arange(48) * 7 + 16 * r) % (2 if dtype == torch.bool else 256)).to(torch.uint8)
            return raw.view(dtype).reshape(3, -1)
        got = rlk_ops.all_gather(mine(rank), 1)
        want = torch.cat([mine(r).view(torch.uint8) for r in range(world_size)], 1)   # (ATen: no float4 cat)
        assert got.dtype == dtype and got.shape == (3, 16 // dtype.itemsize * world_size), dtype
        assert torch.equal(got.view(torch.uint8), want), dtype
    # quantized: the bytes are not the values (no scale); refused on every rank
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qx = torch.quantize_per_tensor(torch.ones(4, 2), 0.5, 0, torch.qint8)
    _raises_everywhere(lambda: rlk_ops.all_gather(qx, 0), r"all_gather: x must not be quantized \(its bytes do not "
                                                         r"carry its scale\), got torch.qint8")
    # a rank outside a subgroup is told so (it was "group must be a ProcessGroup, got int -100")
    if world_size == 3:
        sub = dist.new_group([1, 2])
        if rank == 0:
            try:
                rlk_ops.all_gather(x, 0, group=sub)
            except rlk_ops.RlkInputError as e:
                assert "all_gather: this process (rank 0) is not a member of group" in str(e), str(e)
            else:
                raise AssertionError("a rank outside the group was not told")
        else:
            assert torch.equal(rlk_ops.all_gather(x, 0, group=sub), torch.cat([torch.full((4, 6), float(r))
                                                                                for r in (1, 2)]))
    # under torch.compile the public functions trace without a break (the exchange is the caller's, as
    # prepare's is; a session 38 audit found the first form of the checks breaking the graph), and check is
    # still a bool there
    fn = torch.compile(lambda t: rlk_ops.all_gather(t * 2, 0) + 1, fullgraph=True, backend="eager")
    assert torch.equal(fn(x), good * 2 + 1)
    bad = torch.compile(lambda t: rlk_ops.all_gather(t, 0, check="yes"), fullgraph=True, backend="eager")
    try:
        bad(x)
    except Exception as e:   # Dynamo wraps what the traced code raises
        assert "check must be a bool, got str 'yes'" in str(e), str(e)
    else:
        raise AssertionError("check='yes' accepted under torch.compile")
    assert torch.equal(rlk_ops.reduce_scatter(torch.ones(2 * world_size, 3), 0), torch.full((2, 3), float(world_size)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_compare_ranks_first(world_size):
    run_workers(_mismatch_worker, world_size)


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def _dim27_fp64_worker(rank, world_size):
    from rlk_ops.distributed import DistributedInputError
    shape = [2] + [1] * 26 + [2 if rank else 3, 5]   # differs only in dim 27, the first hashed dim
    try:
        rlk_ops.all_gather(torch.zeros(shape), 0)
    except DistributedInputError as e:
        assert "ranks disagree on x.shape past dim 26 (hashed)" in str(e), str(e)
    else:
        raise AssertionError("a dim-27 mismatch went through")
    xs = [torch.full((2, 3), 1.0 + r * 2.0 ** -40, dtype=torch.float64) for r in range(world_size)]
    out = rlk_ops.reduce_scatter(xs[rank], 0)        # fp64 is summed in fp64
    want = (xs[0] + xs[1]).chunk(world_size, 0)[rank]
    assert out.dtype == torch.float64 and torch.equal(out, want), (out, want)


@pytest.mark.distributed
def test_collectives_hash_dim_27_and_sum_fp64_in_fp64():
    run_workers(_dim27_fp64_worker, 2)


def _bf16_sum_worker(rank, world_size):
    """Three bf16 ranks: the sum is in fp32, rounded once (summing in bf16 rounds after every add, which two
    ranks cannot show: one add either way)."""
    g = torch.Generator().manual_seed(7)
    xs = [(torch.randn(world_size * 4, 64, generator=g) * 3).bfloat16() for _ in range(world_size)]
    out = rlk_ops.reduce_scatter(xs[rank], 0)
    total = xs[0].float()
    for r in range(1, world_size):
        total = total + xs[r].float()
    assert torch.equal(out, total.bfloat16().chunk(world_size, 0)[rank])


@pytest.mark.distributed
def test_reduce_scatter_sums_bf16_in_fp32_over_three_ranks():
    run_workers(_bf16_sum_worker, 3)
