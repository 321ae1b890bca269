"""Workers for tests/test_distributed_tp_cp.py (module-level so mp.spawn can pickle them).

Each spawn runs many checks (process start + import torch costs seconds per process
on 2 cores). Assertions raise inside the worker; mp.spawn re-raises them in pytest
with the rank's traceback. Rank 0 writes tables and drift numbers to ``out_dir``."""
from __future__ import annotations

import copy
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import rlk_ops
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.distributed import (DistributedInputError, ParallelQwen3Attention, build_layout,
                                 context_parallel_attention, init_mesh, preflight)
from rlk_ops.distributed.compare import compare_block
from rlk_ops.meta.drift import drift_stats

SMALL = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
LENS = [200, 48, 136]  # multiples of 8: zigzag on cp=2 (4 chunks) and 8 canonical chunks; > 128 keys
CHUNKS = 8
DT = torch.bfloat16


def _write(out_dir, name, obj):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2)


# ------------------------------------------------------------------ attention level
def attention_inputs(seed=0, hq=4, hkv=2):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q = torch.randn(t, hq, 32, generator=g).to(DT)
    k = torch.randn(t, hkv, 32, generator=g).to(DT)
    v = torch.randn(t, hkv, 32, generator=g).to(DT)
    dout = torch.randn(t, hq, 32, generator=g).to(DT)
    dlse = torch.randn(hq, t, generator=g)  # the loss also uses lse: exercises its gradient
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout, dlse, cu


def _loss_grads(fn, q, k, v, dout, dlse):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def attention_reference(q, k, v, dout, dlse, cu):
    return _loss_grads(lambda a, b, c: rlk_ops.attention(a, b, c, True, cu_seqlens_q=cu, cu_seqlens_k=cu),
                       q, k, v, dout, dlse)


def canonical_reference(q, k, v, dout, dlse, cu, mode, chunks):
    """One process, same canonical chunks; returned in natural order."""
    lay = build_layout(cu, 1, 0, mode, chunks)
    res = _loss_grads(lambda a, b, c: context_parallel_attention(a, b, c, lay), lay.shard(q), lay.shard(k),
                      lay.shard(v), lay.shard(dout), lay.shard(dlse, 1))
    return {n: lay.from_cp_layout(t, 1 if n == "lse" else 0) for n, t in res.items()}


def _local_slices(full, lay, tp, tp_rank):
    hq, hkv = slice(tp_rank * 4 // tp, (tp_rank + 1) * 4 // tp), slice(tp_rank * 2 // tp, (tp_rank + 1) * 2 // tp)
    idx = lay.local_index
    return {"out": full["out"][idx][:, hq], "lse": full["lse"][hq][:, idx], "dq": full["dq"][idx][:, hq],
            "dk": full["dk"][idx][:, hkv], "dv": full["dv"][idx][:, hkv]}


def attention_checks(mesh, tp, cp, compile_modes=(), modes=("contiguous", "zigzag"), canonical=True):
    """Attention level on this mesh: heads split over tp, tokens over cp. Returns drift of dK/dV."""
    tp_rank, cp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("cp")
    group = mesh.get_group("cp") if cp > 1 else None
    q, k, v, dout, dlse, cu = attention_inputs()
    ref = attention_reference(q, k, v, dout, dlse, cu)
    drift = {}
    for mode in modes:
        lay = build_layout(cu, cp, cp_rank, mode)
        hq = slice(tp_rank * 4 // tp, (tp_rank + 1) * 4 // tp)
        hkv = slice(tp_rank * 2 // tp, (tp_rank + 1) * 2 // tp)
        args = (lay.shard(q)[:, hq], lay.shard(k)[:, hkv], lay.shard(v)[:, hkv], lay.shard(dout)[:, hq],
                lay.shard(dlse, 1)[hq])
        want = _local_slices(ref, lay, tp, tp_rank)

        def fn(a, b, c, lay=lay):
            return context_parallel_attention(a, b, c, lay, group)

        first, second = _loss_grads(fn, *args), _loss_grads(fn, *args)
        for name in ("out", "lse", "dq"):
            assert torch.equal(first[name], want[name]), f"{tp}x{cp} {mode}: {name} differs from one process"
        for name in first:
            assert torch.equal(first[name], second[name]), f"{tp}x{cp} {mode}: {name} not run-to-run"
        for name in ("dk", "dv"):
            drift[f"{mode} {name}"] = drift_stats(first[name], want[name])
        if mode in compile_modes:
            torch._dynamo.reset()
            compiled = _loss_grads(torch.compile(fn, fullgraph=True), *args)
            for name in first:
                assert torch.equal(first[name], compiled[name]), f"{tp}x{cp} {mode}: compiled {name} != eager"
    if canonical:
        for mode in modes:
            lay = build_layout(cu, cp, cp_rank, mode, CHUNKS)
            hq = slice(tp_rank * 4 // tp, (tp_rank + 1) * 4 // tp)
            hkv = slice(tp_rank * 2 // tp, (tp_rank + 1) * 2 // tp)
            got = _loss_grads(lambda a, b, c, lay=lay: context_parallel_attention(a, b, c, lay, group),
                              lay.shard(q)[:, hq], lay.shard(k)[:, hkv], lay.shard(v)[:, hkv],
                              lay.shard(dout)[:, hq], lay.shard(dlse, 1)[hq])
            want = _local_slices(canonical_reference(q, k, v, dout, dlse, cu, mode, CHUNKS), lay, tp, tp_rank)
            for name in got:
                assert torch.equal(got[name], want[name]), \
                    f"{tp}x{cp} {mode} canonical: {name} differs from the one-process canonical run"
    return drift


# ---------------------------------------------------------------------- block level
def block_inputs():
    block = init_block(Qwen3Attention(**SMALL))
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    return block, x, pos, cu


def block_checks(mesh, runs, out_dir, tag):
    """runs: [(sharding, chunks, compile)]. Asserts each mode's claims; writes the tables."""
    block, x, pos, cu = block_inputs()
    tables = []
    for sharding, chunks, compile_ in runs:
        c = compare_block(block, mesh, x, pos, cu, sharding, chunks, compile=compile_)
        tables.append(c.to_json())
        assert c.claims_hold(), "\n" + c.table()
        if chunks is None:
            assert [r.name for r in c.rows if r.bitwise][:3] == ["attention out", "lse", "dQ"], c.table()
            if c.tp == 1:  # no o_proj reduction: the block output is row-wise, hence equal
                assert c.row("block output y").bitwise, c.table()
            else:          # tp partial sums: a different fp32 sum than one device
                assert not c.row("block output y").bitwise, c.table()
            for r in c.rows:  # drift, where there is any, stays at bf16 rounding scale
                assert r.mean_abs < 5e-3, c.table()
        else:
            assert all(r.bitwise for r in c.rows), c.table()
        if dist.get_rank() == 0:
            print(c.table(), flush=True)
    if dist.get_rank() == 0:
        _write(out_dir, f"block_{tag}.json", tables)


# ------------------------------------------------------------------ DTensor rules
def dtensor_rule_checks(mesh):
    """rlk ops on DTensors via register_sharding: heads-sharded attention and column-parallel
    linear, forward and backward, bitwise equal to plain tensors. Heads that do not split evenly
    over the mesh (Hq 12, Hkv 3 here) take the replicated strategy: before, they were sharded,
    each rank's query heads mapped onto the wrong KV heads, and the result was wrong."""
    for hq, hkv, sharded in ((8, 4, True), (12, 3, False)):
        q, k, v, dout, dlse, cu = attention_inputs(seed=1, hq=hq, hkv=hkv)
        ref = attention_reference(q, k, v, dout, dlse, cu)
        heads = (Shard(1), Replicate())
        qd, kd, vd = (distribute_tensor(t, mesh, heads).requires_grad_() for t in (q, k, v))
        cud = distribute_tensor(cu, mesh, (Replicate(), Replicate()))
        out, lse = rlk_ops.attention(qd, kd, vd, True, cu_seqlens_q=cud, cu_seqlens_k=cud)
        want = (heads, (Shard(0), Replicate())) if sharded else ((Replicate(),) * 2,) * 2
        assert (out.placements, lse.placements) == want, (hq, hkv, out.placements, lse.placements)
        dout_d = distribute_tensor(dout, mesh, heads)
        dlse_d = distribute_tensor(dlse, mesh, (Shard(0), Replicate()))
        ((out.float() * dout_d.float()).sum() + (lse * dlse_d).sum()).backward()
        for name, t in (("out", out), ("lse", lse), ("dq", qd.grad), ("dk", kd.grad), ("dv", vd.grad)):
            assert torch.equal(t.full_tensor(), ref[name]), f"DTensor attention (Hq {hq}, Hkv {hkv}): {name} differs"
    x = torch.randn(48, 128, generator=torch.Generator().manual_seed(2)).to(DT)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)).to(DT)
    y = rlk_ops.linear(distribute_tensor(x, mesh, (Replicate(), Shard(0))), distribute_tensor(w, mesh, (Shard(0),
                                                                                                         Replicate())))
    assert y.placements == (Shard(1), Shard(0)) and torch.equal(y.full_tensor(), rlk_ops.linear(x, w))


# ---------------------------------------------------------------------- bad input
def expect_everywhere(fn, *fragments):
    """fn must raise DistributedInputError (on this rank; every rank runs this)."""
    try:
        fn()
    except DistributedInputError as e:
        for frag in fragments:
            assert frag in str(e), f"error {str(e)!r} lacks {frag!r}"
        return str(e)
    raise AssertionError(f"no DistributedInputError; expected one mentioning {fragments}")


def bad_input_checks(mesh, rank):
    block, x, pos, cu = block_inputs()
    # heads not divisible by tp: rejected by every rank at construction
    bad_block = init_block(Qwen3Attention(**{**SMALL, "num_kv_heads": 1}))
    expect_everywhere(lambda: ParallelQwen3Attention(bad_block, mesh), "num_kv_heads = 1", "tp = 2")
    # one rank froze a weight: it would train another set of parameters than the others
    frozen = init_block(Qwen3Attention(**SMALL))
    frozen.k_norm.weight.requires_grad_(rank != 3)
    all_six = "q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight, q_norm.weight"
    expect_everywhere(lambda: ParallelQwen3Attention(frozen, mesh),
                      f"ranks disagree on requires_grad: True for [{all_six}, k_norm.weight] on rank 0 but True for "
                      f"[{all_six}] on rank 3")
    # disagreements name values, not the codes the check sends (session 35: "sharding: 0 ... but 1")
    expect_everywhere(lambda: ParallelQwen3Attention(block, mesh, "zigzag" if rank == 1 else "contiguous"),
                      "ranks disagree on sharding: 'contiguous' on rank 0 but 'zigzag' on rank 1")
    expect_everywhere(lambda: ParallelQwen3Attention(block, mesh, "contiguous", 4 if rank == 2 else None),
                      "ranks disagree on chunks: None on rank 0 but 4 on rank 2")
    # init_mesh: a bad timeout or device_type on one rank raises on every rank (it raised on that rank
    # alone, the others waiting in the check); a repeated call returns the mesh it made (new groups each
    # time: threads and file descriptors that are never freed)
    assert init_mesh(2, 2, "cpu") is mesh
    expect_everywhere(lambda: init_mesh(2, 2, "cpu", timeout=datetime.timedelta(0) if rank == 1 else
                                        datetime.timedelta(seconds=120)),
                      "init_mesh: rank 1 rejected its input: init_mesh: timeout must be a positive datetime.timedelta")
    expect_everywhere(lambda: init_mesh(2, 2, "gpu" if rank == 2 else "cpu"),
                      "rank 2 rejected its input", "device_type must be 'cpu' or 'cuda'", "got 'gpu'")
    expect_everywhere(lambda: init_mesh(2, 2, "cpu", timeout=datetime.timedelta(seconds=100 + (rank == 3))),
                      "ranks disagree on timeout_s: 100.0 on rank 0 but 101.0 on rank 3")
    # a rank that lost its mesh (the others kept theirs): every rank raises once and forgets it, and the
    # next call makes a new mesh everywhere (the disagreement stayed for good)
    from rlk_ops.distributed import mesh as mesh_mod
    kept = init_mesh(2, 2, "cpu")   # (the failed calls above made every rank forget theirs)
    assert init_mesh(2, 2, "cpu") is kept
    if rank == 1:
        mesh_mod._MESHES.clear()
    expect_everywhere(lambda: init_mesh(2, 2, "cpu"), "ranks disagree on an existing mesh: True on rank 0 but False "
                                                      "on rank 1")
    again = init_mesh(2, 2, "cpu")
    assert again is not kept and init_mesh(2, 2, "cpu") is again
    # the caller's block is left as it was: rank 0's replicated weights are copied into the module, not into it
    other = init_block(Qwen3Attention(**SMALL))
    with torch.no_grad():
        other.k_norm.weight.add_(float(rank))
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    ParallelQwen3Attention(other, mesh, "zigzag")
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters()), "the caller's block was changed"
    pb = ParallelQwen3Attention(block, mesh, "zigzag")
    # a sequence not divisible by the cp chunking (2 * cp = 4 for zigzag)
    cu_bad = torch.tensor([0, 200, 250, 384], dtype=torch.int32)
    expect_everywhere(lambda: pb.prepare(x, pos, cu_bad), "sequence 1 has length 50", "not divisible by 4")
    # only rank 1 has a bad dtype: all ranks raise, naming rank 1
    x_r = x.float() if rank == 1 else x
    expect_everywhere(lambda: pb.prepare(x_r, pos, cu), "rank 1 rejected", "hidden_states must have")
    # only rank 1 passes a DTensor (prepare makes them itself), only rank 2 positions on another device
    x_dt = distribute_tensor(x, mesh, (Replicate(), Replicate()))  # a collective: every rank makes it
    expect_everywhere(lambda: pb.prepare(x_dt if rank == 1 else x, pos, cu), "rank 1 rejected",
                      "hidden_states must be a plain torch.Tensor [384, 128] (the global batch",
                      "got a DTensor with placements (Replicate(), Replicate())")
    expect_everywhere(lambda: pb.prepare(x, pos.to("meta") if rank == 2 else pos, cu), "rank 2 rejected",
                      "positions is on meta but hidden_states is on cpu")
    # ranks disagree on the batch layout (each one valid on its own)
    cu_r = torch.tensor([0, 200, 248, 384] if rank == 0 else [0, 48, 248, 384], dtype=torch.int32)
    expect_everywhere(lambda: pb.prepare(x, pos, cu_r), "ranks disagree on seq_lens_hash")
    # standalone cp attention (preflight over the cp group): head count differs within each cp group
    group = mesh.get_group("cp")
    cp_rank = mesh.get_local_rank("cp")
    lay = build_layout(cu, 2, cp_rank, "contiguous")
    t = lay.local_tokens
    hq = 4 if cp_rank == 0 else 2
    q = torch.zeros(t, hq, 32, dtype=DT)
    kv = torch.zeros(t, 2, 32, dtype=DT)
    expect_everywhere(lambda: context_parallel_attention(q, kv, kv, lay, group), "ranks disagree on num_heads")
    q4, kv4 = torch.zeros(t, 4, 32, dtype=DT), kv
    if cp_rank == 1:
        q4, kv4 = q4.float(), kv.float()
    expect_everywhere(lambda: context_parallel_attention(q4, kv4, kv4, lay, group),
                      "ranks disagree on dtype: torch.bfloat16 on rank", "but torch.float32 on rank")
    # None on one rank beside -1.0 on the other: -1.0 stood for None, so the two passed as one scale
    expect_everywhere(lambda: context_parallel_attention(q4.to(DT), kv, kv, lay, group,
                                                         softmax_scale=-1.0 if cp_rank else None),
                      "ranks disagree on softmax_scale: None on rank", "but -1.0 on rank")
    # a local problem on one rank (wrong token count) reaches every rank with its text
    q_bad = torch.zeros(t + (cp_rank == 1), 4, 32, dtype=DT)
    k_bad = torch.zeros(q_bad.shape[0], 2, 32, dtype=DT)
    expect_everywhere(lambda: context_parallel_attention(q_bad, k_bad, k_bad, lay, group),
                      "rejected its input", f"must be this rank's token count {t}")
    # check=None on one rank skipped its exchange there, and its K/V met the others' preflight (gloo aborted)
    expect_everywhere(lambda: context_parallel_attention(torch.zeros(t, 4, 32, dtype=DT), kv, kv, lay, group,
                                                         check=None if cp_rank else True),
                      "rejected its input", "check must be a bool, got NoneType None")
    # per-rank differences the preflight once missed: a config field the forward reads (each rank ran
    # with its own rope_theta), one rank's parameter dtype, no block at all, and a softmax_scale
    odd = init_block(Qwen3Attention(**{**SMALL, "rope_theta": 1e4 if rank == 3 else 1e6}))
    expect_everywhere(lambda: ParallelQwen3Attention(odd, mesh), "ranks disagree on rope_theta: 1000000.0 on rank 0 "
                      "but 10000.0 on rank 3")
    # the same value as an int on one rank (HF's config.json writes rope_theta 1000000) is the same theta
    ParallelQwen3Attention(init_block(Qwen3Attention(**{**SMALL, "rope_theta": 1000000 if rank == 1 else 1e6})), mesh)
    mixed = copy.deepcopy(block)
    if rank == 1:
        mixed.q_proj.float()
    expect_everywhere(lambda: ParallelQwen3Attention(mixed, mesh), "rank 1 rejected",
                      "block.q_proj.weight must have o_proj.weight's dtype torch.bfloat16")
    expect_everywhere(lambda: ParallelQwen3Attention(None if rank == 2 else block, mesh), "rank 2 rejected",
                      "block must be an rlk_ops.compile.Qwen3Attention, got NoneType")
    q4 = torch.zeros(t, 4, 32, dtype=DT)
    expect_everywhere(lambda: context_parallel_attention(q4, kv, kv, lay, group, softmax_scale=0.5 + cp_rank),
                      "ranks disagree on softmax_scale: 0.5 on rank", "but 1.5 on rank")
    expect_everywhere(lambda: context_parallel_attention(q4, kv, kv, lay, group,
                                                         softmax_scale="a" if cp_rank else None),
                      "rejected its input", "softmax_scale must be a finite float or None, got str 'a'")
    # the forward's own checks: one rank passing another module's layout, bad taps, or running without
    # gradients raises on every rank (each raised on its rank alone, the others waiting in the first
    # collective until the timeout: a session 33 audit)
    xs, ps, lay_z = pb.prepare(x, pos, cu)
    other_lay = ParallelQwen3Attention(block, mesh, "contiguous").prepare(x, pos, cu)[2]
    expect_everywhere(lambda: pb(xs, ps, other_lay if rank == 3 else lay_z), "ParallelQwen3Attention.forward: "
                      "rank 3 rejected its input", "use the layout from this module's prepare()")
    expect_everywhere(lambda: pb(xs, ps, lay_z, taps=[] if rank == 2 else None), "rank 2 rejected its input",
                      "taps must be a dict or None, got list")

    def forward_grad_on_all_but_rank_1():
        with torch.set_grad_enabled(rank != 1):
            pb(xs, ps, lay_z)
    expect_everywhere(forward_grad_on_all_but_rank_1, "ranks disagree on with gradients: True on rank 0 but False "
                                                      "on rank 1")
    expect_everywhere(lambda: pb(xs, ps, lay_z, check=None), "check must be a bool, got NoneType None")
    # the forward compares the batch layouts too: rank 1 given another batch's layout (valid for this module,
    # same token count) ran with wrong results (a session 38 audit)
    lay_other = pb.prepare(x, pos, torch.tensor([0, 48, 248, 384], dtype=torch.int32))[2]
    expect_everywhere(lambda: pb(xs, ps, lay_other if rank == 1 else lay_z),
                      "ParallelQwen3Attention.forward: ranks disagree on seq_lens_hash")
    expect_everywhere(lambda: pb(xs, ps, lay_z, check=1 if rank == 2 else True), "rank 2 rejected its input",
                      "check must be a bool, got int 1")
    # frozen weights, gradients for the input only: a rank under no_grad builds no graph either
    frozen_pb = ParallelQwen3Attention(init_block(Qwen3Attention(**SMALL)).requires_grad_(False), mesh, "zigzag")
    xf, pf, lf = frozen_pb.prepare(x, pos, cu)
    xf = xf.detach().requires_grad_()

    def input_grad_on_all_but_rank_3():
        with torch.set_grad_enabled(rank != 3):
            frozen_pb(xf, pf, lf)
    expect_everywhere(input_grad_on_all_but_rank_3, "ranks disagree on with gradients: True on rank 0 but False "
                                                    "on rank 3")
    # a bad position (the same batch on every rank): rope once refused it on the rank holding that
    # token alone, after the others had entered the cp all_gather
    pos_bad = pos.clone()
    pos_bad[20] = -1
    expect_everywhere(lambda: pb.prepare(x, pos_bad, cu), "rank 0 rejected", "positions[20] = -1 is negative")
    # preflight itself: ranks with other keys (gloo once aborted the process on rows of other
    # lengths), a value that is not a number on one rank (once a TypeError there alone)
    expect_everywhere(lambda: preflight(None, "keys", None, {"a": 1} if rank == 1 else {"a": 1, "b": 2}),
                      "metadata values, expected")
    expect_everywhere(lambda: preflight(None, "values", None, {"a": None if rank == 2 else 1}), "rank 2 rejected",
                      "metadata a must be an int or a float, got None")
    compare_bad_input_checks(mesh, rank, block, x, pos, cu)
    # after all that, every rank reaches the same next collective (none is stuck in one)
    preflight(None, "after the bad inputs", None, {"step": 1})


def compare_bad_input_checks(mesh, rank, block, x, pos, cu):
    """compare_block: a bad argument on one rank, or ranks whose global inputs differ (which
    would make the verdicts wrong rather than fail), raise on every rank before any forward."""
    def run(**kw):
        args = dict(block=block, mesh=mesh, hidden_states=x, positions=pos, cu_seqlens=cu, sharding="zigzag")
        return lambda: compare_block(**{**args, **kw})

    expect_everywhere(run(seed="0" if rank == 1 else 0), "rank 1 rejected", "seed must be an int", "got '0'")
    expect_everywhere(run(sharding="zigzag" if rank else "ring", chunks=8), "rank 0 rejected",
                      "sharding must be one of")
    expect_everywhere(run(seed=rank), "ranks disagree on seed: 0 on rank 0 but 1 on rank 1")
    expect_everywhere(run(compile=rank == 3), "ranks disagree on compile: 0 on rank 0 but 1 on rank 3")
    expect_everywhere(run(hidden_states=x + (rank == 2)), "ranks disagree on the values of hidden_states")
    expect_everywhere(run(positions=pos.flip(0) if rank == 1 else pos), "ranks disagree on the values of positions")
    other = copy.deepcopy(block)
    with torch.no_grad():
        other.k_norm.weight[3] += 1
    expect_everywhere(run(block=other if rank == 3 else block), "ranks disagree on the block's weights")
    x_nan = x.clone()
    x_nan[5, 7] = float("nan") if rank == 2 else x_nan[5, 7]
    expect_everywhere(run(hidden_states=x_nan), "rank 2 rejected", "hidden_states must be finite",
                      "got nan at hidden_states[5, 7]")
    expect_everywhere(run(positions=pos.to("meta")), "positions must be on the mesh's device type 'cpu', got meta")
    xd = distribute_tensor(x, mesh, (Replicate(), Replicate()))
    expect_everywhere(run(hidden_states=xd), "hidden_states must be the global batch as a plain tensor",
                      "got a DTensor")


def timeout_check(rank, group=None):
    """A collective that one rank never joins raises after the group's timeout (no hang). Without
    ``group``, a new group of ranks 0 and 1 with a 3 s timeout."""
    if group is None:
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        t0 = time.time()
        try:
            rlk_ops.all_gather(torch.ones(4), 0, group=group)
        except RuntimeError as e:
            assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), str(e)
        else:
            raise AssertionError("all_gather with a missing peer returned instead of timing out")
        assert time.time() - t0 < 60, f"the collective raised after {time.time() - t0:.0f} s, not the group's 3 s"
    dist.barrier()


def mesh_timeout_check(rank):
    """init_mesh's timeout holds on the mesh's own groups: on a 2-D mesh DeviceMesh made them with
    gloo's 30-minute default, so a collective missing a peer waited that long (a session 33 audit).
    Rank 0's cp group is ranks 0 and 1; rank 1 never joins."""
    mesh = init_mesh(2, 2, "cpu", timeout=datetime.timedelta(seconds=3))
    cp = mesh.get_group("cp")
    if rank in (0, 1):
        assert dist.get_process_group_ranks(cp) == [0, 1], dist.get_process_group_ranks(cp)
    timeout_check(rank, cp)


# -------------------------------------------------------------------------- workers
class _Clock:
    """Phase timings, printed by rank 0 (pytest -s shows them): the suite's time budget."""

    def __init__(self, rank):
        self.rank, self.t = rank, time.time()

    def __call__(self, what):
        now = time.time()
        if self.rank == 0:
            print(f"[timing] {what}: {now - self.t:.1f} s", flush=True)
        self.t = now


def worker_2x2(rank, world_size, out_dir):
    clock = _Clock(rank)
    mesh = init_mesh(2, 2, "cpu")
    drift = attention_checks(mesh, 2, 2, compile_modes=("zigzag",))
    clock("2x2 attention checks")
    if rank == 0:
        _write(out_dir, "attention_drift_2x2.json", drift)
    # the eager 2x2 block tables (contiguous, zigzag, canonical) are the torchrun example's
    # (tests/test_distributed_example.py); here: zigzag eager twice and compiled
    block_checks(mesh, [("zigzag", None, True)], out_dir, "2x2")
    clock("2x2 block checks")
    dtensor_rule_checks(mesh)
    clock("2x2 DTensor rules")
    bad_input_checks(mesh, rank)
    clock("2x2 bad input")
    mesh_timeout_check(rank)
    clock("2x2 mesh timeout")


def worker_1x2_2x1(rank, world_size, out_dir):
    clock = _Clock(rank)
    for tp, cp in ((1, 2), (2, 1)):
        mesh = init_mesh(tp, cp, "cpu")
        drift = attention_checks(mesh, tp, cp, compile_modes=("contiguous",) if cp == 2 else ())
        if rank == 0:
            _write(out_dir, f"attention_drift_{tp}x{cp}.json", drift)
        # compile budget: one compiled block graph per mesh (cold Inductor cache on 2 cores:
        # ~10 s for the default graph; the canonical graph has a cell per (chunk, kv group),
        # measured 87 s cold with 8 chunks, hence 4 chunks for the compiled canonical run)
        runs = [("contiguous", None, tp == 2), ("zigzag", None, False),
                ("contiguous", CHUNKS // 2 if tp == 1 else CHUNKS, tp == 1)]
        clock(f"{tp}x{cp} attention checks")
        block_checks(mesh, runs, out_dir, f"{tp}x{cp}")
        clock(f"{tp}x{cp} block checks")
    timeout_check(rank)
    clock("timeout check")
    world_timeout_kept_check(rank)
    clock("world timeout kept")


def world_timeout_kept_check(rank):
    """init_mesh leaves the default group's timeout as its maker set it (60 s here): a 1x2 mesh's cp
    dim is the default group itself, and setting init_mesh's timeout on it cut every other collective
    of the caller to that (a session 33 review)."""
    init_mesh(1, 2, "cpu", timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)
    dist.barrier()


def env_init_worker(rank, world_size, port, bad="device_type"):
    """init_mesh under torchrun's environment (no process group yet): a rank with a bad device_type
    joined no group and raised alone while the others waited in init_process_group until its timeout
    (a session 35 review); it now joins and raises with them. ``bad="timeout"``: rank 1's timeout is not
    a timedelta; it must join with the default timeout, not hand its own to init_process_group (which
    raised there alone: a session 41 audit's mutant)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    device = "gpu" if rank == 1 and bad == "device_type" else "cpu"
    timeout = "30" if rank == 1 and bad == "timeout" else datetime.timedelta(seconds=30)
    why = {"device_type": "device_type must be 'cpu' or 'cuda'",
           "timeout": "timeout must be a positive datetime.timedelta, got '30'"}[bad]
    msg = expect_everywhere(lambda: init_mesh(2, 1, device, timeout=timeout),
                            "init_mesh: rank 1 rejected its input", why)
    assert time.time() - t0 < 20, f"rank {rank} raised after {time.time() - t0:.0f} s: {msg}"
    dist.barrier()
    os._exit(0)
