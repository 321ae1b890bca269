"""Killing tests for survivors of a session 40 mutation audit of rlk_ops/distributed (sharding, local_block,
mesh, cp_attention, parallel_block). Multi-process bodies run in gloo processes (tests/dist_utils.py)."""
import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import rlk_ops
from dist_tp_cp import DT, SMALL, attention_inputs, block_inputs, expect_everywhere
from dist_utils import run_workers
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.distributed import (DistributedInputError, ParallelQwen3Attention, build_layout,
                                 context_parallel_attention, init_mesh)

pytestmark = pytest.mark.distributed


# ---------------------------------------------------------------- sharding.py (register_sharding rules)
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _sharding_rules_worker(rank, world_size):
    """rlk ops on DTensors whose placements the existing tests never pass: each must give the plain
    tensor's bits (a wrong rule computes shard-locally what needs every shard)."""
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(7)
    R, S = Replicate(), Shard
    x = torch.randn(16, 4, 32, generator=g).to(DT)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(DT)
    dy = torch.randn(16, 4, 32, generator=g).to(DT)
    pos = torch.randint(0, 1000, (16,), generator=g)

    def fwd_bwd(fn, args, dist_args):
        plain = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
        ref = fn(*plain)
        ref.backward(dist_args[-1][0])
        dts = [distribute_tensor(a, mesh, [p]).requires_grad_(a.is_floating_point())
               for a, p in zip(args, dist_args[:-1])]
        out = fn(*dts)
        out.backward(distribute_tensor(dist_args[-1][0], mesh, [dist_args[-1][1]]))
        return ref, plain, out, dts

    # qk_rmsnorm with head_dim sharded: the norm needs every element of a row (rule on D: wrong)
    out = rlk_ops.qk_rmsnorm(distribute_tensor(x, mesh, [S(2)]), distribute_tensor(w, mesh, [R]))
    assert torch.equal(_full(out), rlk_ops.qk_rmsnorm(x, w)), "qk_rmsnorm, D sharded"
    # qk_rmsnorm backward, tokens sharded: dweight sums over every token (a local rule drops half)
    ref, plain, out, dts = fwd_bwd(lambda a, b: rlk_ops.qk_rmsnorm(a, b), (x, w), (S(0), R, (dy, S(0))))
    assert torch.equal(_full(out), ref), "qk_rmsnorm, tokens sharded"
    assert torch.equal(_full(dts[0].grad), plain[0].grad), "qk_rmsnorm dx, tokens sharded"
    assert torch.equal(_full(dts[1].grad), plain[1].grad), "qk_rmsnorm dweight, tokens sharded"
    # rope: tokens sharded, positions with them; and head_dim sharded (a rotation needs both halves)
    for xp, pp in ((S(0), S(0)), (S(2), R), (S(1), R)):
        ref, plain, out, dts = fwd_bwd(lambda a, p: rlk_ops.rope(a, p), (x, pos), (xp, pp, (dy, xp)))
        assert torch.equal(_full(out), ref), f"rope, x {xp}, positions {pp}"
        assert torch.equal(_full(dts[0].grad), plain[0].grad), f"rope backward, x {xp}, positions {pp}"
    # linear: in_features sharded (a rule on it would multiply half the columns by the whole weight);
    # column-parallel with a bias (the bias must be sharded with the weight's rows); tokens sharded in the
    # backward (dweight and dbias sum over every token: a local rule would keep each rank's half)
    xl = torch.randn(24, 64, generator=g).to(DT)
    wl = torch.randn(48, 64, generator=g).to(DT)
    bl = torch.randn(48, generator=g).to(DT)
    dyl = torch.randn(24, 48, generator=g).to(DT)
    y = rlk_ops.linear(distribute_tensor(xl, mesh, [S(1)]), distribute_tensor(wl, mesh, [R]))
    assert torch.equal(_full(y), rlk_ops.linear(xl, wl)), "linear, in_features sharded"
    y = rlk_ops.linear(distribute_tensor(xl, mesh, [R]), distribute_tensor(wl, mesh, [S(0)]),
                       distribute_tensor(bl, mesh, [S(0)]))
    assert torch.equal(_full(y), rlk_ops.linear(xl, wl, bl)), "column-parallel linear with bias"
    ref, plain, out, dts = fwd_bwd(lambda a, b, c: rlk_ops.linear(a, b, c), (xl, wl, bl), (S(0), R, R, (dyl, S(0))))
    assert torch.equal(_full(out), ref), "linear, tokens sharded"
    for i, name in enumerate(("dx", "dweight", "dbias")):
        assert torch.equal(_full(dts[i].grad), plain[i].grad), f"linear {name}, tokens sharded"
    # dense attention, batch sharded, with an lse gradient: forward and backward shard-local and exact
    q = torch.randn(4, 40, 4, 32, generator=g).to(DT)
    k = torch.randn(4, 40, 2, 32, generator=g).to(DT)
    v = torch.randn(4, 40, 2, 32, generator=g).to(DT)
    dout = torch.randn(4, 40, 4, 32, generator=g).to(DT)
    dlse = torch.randn(4, 4, 40, generator=g)
    pq, pk, pv = (t.clone().requires_grad_() for t in (q, k, v))
    o, l = rlk_ops.attention(pq, pk, pv, True)
    ((o.float() * dout.float()).sum() + (l * dlse).sum()).backward()
    dq, dk, dv = (distribute_tensor(t, mesh, [S(0)]).requires_grad_() for t in (q, k, v))
    od, ld = rlk_ops.attention(dq, dk, dv, True)
    assert (od.placements, ld.placements) == ((S(0),), (S(0),)), (od.placements, ld.placements)
    ((od.float() * distribute_tensor(dout, mesh, [S(0)]).float()).sum()
     + (ld * distribute_tensor(dlse, mesh, [S(0)])).sum()).backward()
    for name, a, b in (("out", od, o), ("lse", ld, l), ("dq", dq.grad, pq.grad), ("dk", dk.grad, pk.grad),
                       ("dv", dv.grad, pv.grad)):
        assert torch.equal(_full(a), b), f"dense attention, batch sharded: {name}"
    # the batch-sharded backward stays shard-local (no all-gather to the replicated strategy)
    assert dq.grad.placements == (S(0),), dq.grad.placements


def test_sharding_rules_keep_every_placement_exact():
    run_workers(_sharding_rules_worker, 2)


_HEADS_OVER_BOTH_DIMS = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
import rlk_ops
import rlk_ops.distributed  # registers the sharding rules
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
mesh = init_device_mesh("cpu", (2, 2))
q = torch.zeros(64, 4, 32, dtype=torch.bfloat16)
kv = torch.zeros(64, 2, 32, dtype=torch.bfloat16)
cu = torch.tensor([0, 64], dtype=torch.int32)
both = (Shard(1), Shard(1))
qd, kd, vd = (distribute_tensor(t, mesh, both) for t in (q, kv, kv))
cud = distribute_tensor(cu, mesh, (Replicate(), Replicate()))
out, lse = rlk_ops.attention(qd, kd, vd, True, cu_seqlens_q=cud, cu_seqlens_k=cud)
print("PLACEMENTS", tuple(out.placements), tuple(lse.placements))
dist.destroy_process_group()
"""


def test_heads_sharded_over_both_mesh_dims_need_the_product_to_divide():
    """Hq 4, Hkv 2 sharded over both dims of a 2 x 2 mesh: each dim's size divides both head counts, their
    product (4) does not divide Hkv, so a rank's query head would not map onto its own KV head. The rule must
    fall back to the replicated strategy (placements only: a fake 4-rank group in one subprocess)."""
    proc = subprocess.run([sys.executable, "-c", _HEADS_OVER_BOTH_DIMS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("PLACEMENTS"))
    assert line == "PLACEMENTS (Replicate(), Replicate()) (Replicate(), Replicate())", line


# ---------------------------------------------------------------- local_block.py: the o_proj reduction over tp
def _tp_output_worker(rank, world_size):
    """tp = 2, cp = 1: y is declared Replicate over tp, so both ranks must hold the same bits, and those must
    be the whole o_proj sum (the one-process y up to the fp32 partial-sum order), not each rank's partial."""
    mesh = init_mesh(2, 1, "cpu")
    block, x, pos, cu = block_inputs()
    pb = ParallelQwen3Attention(block, mesh, "contiguous")
    xs, ps, lay = pb.prepare(x, pos, cu)
    with torch.no_grad():
        y = pb(xs, ps, lay).to_local()
        ref = ParallelQwen3Attention(block, None, "contiguous")
        want = ref(*ref.prepare(x, pos, cu))
    ys = [torch.empty_like(y) for _ in range(world_size)]
    dist.all_gather(ys, y.contiguous())
    assert torch.equal(ys[0], ys[1]), "the tp ranks hold different block outputs"
    err = (y.double() - want.double()).abs().max() / want.double().abs().max()
    assert err < 0.02, f"block output differs from one process by {float(err):.3e} of its largest value"


def test_tp_block_output_is_the_whole_o_proj_sum_on_every_tp_rank():
    run_workers(_tp_output_worker, 2)


def _canonical_fp32_worker(rank, world_size):
    """Canonical mode, fp32: partial sums are order-sensitive in fp32 (bf16 partials summed in fp32 are
    mostly exact in any order, which hid a topology-dependent summation order), so every tensor must equal
    the one-process canonical run bitwise only if the chunks and cells are summed in the canonical order."""
    from rlk_ops.distributed.compare import compare_block

    mesh = init_mesh(1, 2, "cpu")
    block = init_block(Qwen3Attention(**SMALL)).float()
    x, pos, cu = packed_batch([64, 32, 32], SMALL["hidden_size"], dtype=torch.float32, requires_grad=False)
    c = compare_block(block, mesh, x, pos, cu, "zigzag", 8)
    assert all(r.bitwise for r in c.rows), "\n" + c.table()


def test_canonical_fp32_block_is_bitwise_equal_to_one_process_on_1x2():
    run_workers(_canonical_fp32_worker, 2)


# ---------------------------------------------------- a 1 x 2 mesh: init_mesh, cp attention and prepare/forward
def _cp2_worker(rank, world_size, store_dir):
    # init_mesh's own argument checks (a bool is not a size; tp * cp must be the world)
    expect_everywhere(lambda: init_mesh(True, 2, "cpu"), "init_mesh: tp must be a positive int, got True")
    expect_everywhere(lambda: init_mesh(2, 2, "cpu"), "init_mesh: tp * cp = 2 * 2 = 4 must equal the world size 2")
    mesh = init_mesh(1, 2, "cpu")
    group = mesh.get_group("cp")
    block, x, pos, cu = block_inputs()
    # context_parallel_attention: a layout built for the other cp rank raises on every rank (it ran, wrong)
    q, k, v, _, _, _ = attention_inputs()
    lay0 = build_layout(cu, 2, 0, "contiguous")
    t = lay0.local_tokens
    expect_everywhere(lambda: context_parallel_attention(q[:t], k[:t], v[:t], lay0, group),
                       "layout is for cp rank 0 of 2, but this process is rank 1 of 2")
    # a 1-D q on one rank is a problem that rank reports to both (building the check's row failed there alone)
    lay = build_layout(cu, 2, rank, "contiguous")
    q_bad = torch.zeros(lay.local_tokens, dtype=DT) if rank == 1 else lay.shard(q)
    expect_everywhere(lambda: context_parallel_attention(q_bad, lay.shard(k), lay.shard(v), lay, group),
                       "rank 1 rejected its input", "q must be 3-D")
    # ParallelQwen3Attention: prepare(local=True) takes this rank's shard (cu_seqlens[-1] is cp x its rows)
    pb = ParallelQwen3Attention(block, mesh, "zigzag")
    xs, ps, lay_z = pb.prepare(x, pos, cu)
    xl, pl, lay_l = pb.prepare(lay_z.shard(x), lay_z.shard(pos), cu, local=True)
    assert torch.equal(xl.to_local(), xs.to_local()) and torch.equal(pl.to_local(), ps.to_local())
    with torch.no_grad():
        assert torch.equal(pb(xl, pl, lay_l).to_local(), pb(xs, ps, lay_z).to_local())
    # the forward refuses the layout of the other cp rank (same batch, mode and chunks), on every rank
    other = build_layout(cu, 2, 1 - rank, "zigzag")
    expect_everywhere(lambda: pb(xs, ps, other), "layout is for cp rank", "use the layout from this module's prepare()")
    # a DeviceMesh not made by init_mesh (other dim names) is named, not indexed
    cp_only = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    expect_everywhere(lambda: ParallelQwen3Attention(block, cp_only), "mesh must be 2-D with mesh_dim_names ('tp', 'cp')")
    # a mesh cached under a process group since destroyed is not returned by the next init_mesh
    old = init_mesh(1, 2, "cpu")
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store2", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    new = init_mesh(1, 2, "cpu")
    assert new is not old, "init_mesh returned a mesh of a destroyed process group"
    out = rlk_ops.all_gather(torch.full((2,), float(rank)), 0, group=new.get_group("cp"))
    assert torch.equal(out, torch.tensor([0.0, 0.0, 1.0, 1.0])), out


def test_init_mesh_cp_attention_and_prepare_on_a_1x2_mesh(tmp_path):
    run_workers(_cp2_worker, 2, str(tmp_path))


# ------------------------------------------------------------------------------- one process
def test_parallel_block_copies_the_block_weights_on_one_process():
    """mesh=None: the module's parameters are copies; an update to them must leave the caller's block alone."""
    block = init_block(Qwen3Attention(**SMALL))
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    pb = ParallelQwen3Attention(block, None)
    with torch.no_grad():
        for p in pb.parameters():
            p.add_(1)
    assert all(torch.equal(p, before[n]) for n, p in block.named_parameters()), "the caller's block was changed"


def test_parallel_block_refuses_a_split_kv_block():
    block = init_block(Qwen3Attention(**SMALL, split_kv="canonical:256"))
    with pytest.raises(DistributedInputError, match=r"config.split_kv must be 'disabled' for training, got 'canonical:256'"):
        ParallelQwen3Attention(block, None)


def test_parallel_block_forward_names_positions_of_another_length():
    pb = ParallelQwen3Attention(init_block(Qwen3Attention(**SMALL)), None, "contiguous")
    x, pos, cu = packed_batch([16, 8], SMALL["hidden_size"], requires_grad=False)
    xs, ps, lay = pb.prepare(x, pos, cu)
    with pytest.raises(ValueError, match=r"positions must be \[24\], got \[23\]"):
        pb(xs, ps[:-1], lay)


def test_cp_attention_names_bad_v_dtype_zero_kv_heads_and_int_q():
    lay = build_layout(torch.tensor([0, 16, 24], dtype=torch.int32), 1, 0)
    q, k, v = torch.randn(24, 4, 32).to(DT), torch.randn(24, 2, 32).to(DT), torch.randn(24, 2, 32).to(DT)
    cases = [((q, k, v.float()), "k and v must have q's dtype torch.bfloat16, got torch.bfloat16 and torch.float32"),
             ((q, k[:, :0], v[:, :0]), "Hq % Hkv == 0"),
             ((q.long(), k.long(), v.long()), "q must be bfloat16, float16, float32 or float64, got torch.int64")]
    for args, msg in cases:
        with pytest.raises(DistributedInputError) as e:
            context_parallel_attention(*args, lay)
        assert msg in str(e.value), (msg, str(e.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_init_mesh_names_cuda_without_a_device(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(DistributedInputError, match=r"device_type 'cuda' but no CUDA device is available here"):
        init_mesh(1, 1, "cuda")
