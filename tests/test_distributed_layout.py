"""Issue 7, single process: the cp sequence layouts, the one-process paths that serve as
references, the canonical mode's cost, and the errors raised before any collective."""
import re

import pytest
import torch
import torch.distributed as dist

import rlk_ops
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.distributed import (DistributedInputError, LayoutError, ParallelQwen3Attention, build_layout,
                                 context_parallel_attention, init_mesh, preflight)
from rlk_ops.distributed.layout import owned_chunks
from rlk_ops.meta.drift import drift_stats

from conftest import bitwise_equal, rel_err

SMALL = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
LENS = [200, 48, 136]
CU = torch.tensor([0, 200, 248, 384], dtype=torch.int32)


@pytest.mark.parametrize("mode,cp,chunks", [("contiguous", 1, None), ("contiguous", 2, None), ("zigzag", 2, None),
                                            ("contiguous", 4, 8), ("zigzag", 2, 8), ("zigzag", 4, None)])
def test_layout_partitions_the_batch(mode, cp, chunks):
    lays = [build_layout(CU, cp, r, mode, chunks) for r in range(cp)]
    total = sum(LENS)
    everyone = torch.cat([lay.local_index for lay in lays])
    assert torch.equal(everyone.sort().values, torch.arange(total))            # every token exactly once
    assert torch.equal(everyone, lays[0].global_order)                         # cp layout = rank-major
    natural = torch.arange(total) * 3
    assert torch.equal(lays[0].from_cp_layout(lays[0].to_cp_layout(natural)), natural)
    seq_of = torch.repeat_interleave(torch.arange(3), torch.tensor(LENS))
    pos_of = torch.cat([torch.arange(n) for n in LENS])
    start_of = torch.tensor([0, 200, 248])
    for lay in lays:
        assert lay.local_tokens == total // cp and torch.equal(lay.positions, pos_of[lay.local_index])
        # segment s attends to the key prefix of its sequence that ends at its last query
        gathered = lay.global_order  # natural index of each gathered key
        cq, ck = lay.cu_seqlens_q.tolist(), lay.cu_seqlens_k.tolist()
        for s in range(len(cq) - 1):
            queries = lay.local_index[cq[s]:cq[s + 1]]
            keys = gathered[lay.key_index[ck[s]:ck[s + 1]]]
            b = int(seq_of[queries[0]])
            assert torch.equal(keys, start_of[b] + torch.arange(int(pos_of[queries[-1]]) + 1))
        # piece_index points back at the same keys (sentinel: not seen by that piece)
        n_keys = lay.key_index.numel()
        for p in range(lay.pieces):
            seen = lay.piece_index[p] < n_keys
            assert torch.equal(lay.key_index[lay.piece_index[p][seen]], torch.arange(total)[seen])


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    def work(lay):
        cq, ck = lay.cu_seqlens_q.tolist(), lay.cu_seqlens_k.tolist()
        return sum((cq[i + 1] - cq[i]) * (ck[i + 1] - ck[i]) for i in range(len(cq) - 1))

    zig = [work(build_layout(CU, 4, r, "zigzag")) for r in range(4)]
    contig = [work(build_layout(CU, 4, r, "contiguous")) for r in range(4)]
    assert max(zig) - min(zig) <= max(zig) // 50 and contig[3] > 3 * contig[0]
    assert owned_chunks("zigzag", 4, 1, 8) == [1, 6] and owned_chunks("zigzag", 2, 0, 8) == [0, 1, 6, 7]


@pytest.mark.parametrize("cu,mode,cp,chunks,fragments", [
    ([0, 200, 250, 384], "zigzag", 2, None, ["sequence 1 has length 50", "not divisible by 4", "zigzag"]),
    ([0, 9], "contiguous", 2, None, ["sequence 0 has length 9", "not divisible by 2"]),
    ([0, 200, 248, 384], "zigzag", 2, 6, ["chunks", "multiple of 2 * cp = 4", "got 6"]),
    ([0, 192, 232, 384], "contiguous", 2, 16, ["sequence 1 has length 40", "16 canonical chunks"]),
    ([1, 200], "contiguous", 1, None, ["cu_seqlens[0] must be 0, got 1"]),
    ([0, 200, 100], "contiguous", 1, None, ["non-decreasing", "cu_seqlens[2] = 100"]),
    ([0, 8], "diagonal", 1, None, ["mode must be one of", "'diagonal'"]),
    ([0, 8], "contiguous", 0, None, ["cp must be a positive int, got 0"]),
    # bool is an int subclass: True once passed as 1 (cp = 1, or 1 canonical chunk)
    ([0, 8], "contiguous", True, None, ["cp must be a positive int, got True"]),
    ([0, 8], "contiguous", 1, True, ["chunks (canonical token chunks per sequence) must be an int or None",
                                     "got bool True"]),
    ([0, 8], "contiguous", 2, 4.0, ["chunks", "must be an int or None, got float 4.0"]),
])
def test_layout_errors_name_the_argument(cu, mode, cp, chunks, fragments):
    with pytest.raises(LayoutError) as e:
        build_layout(cu, cp, 0, mode, chunks)
    for frag in fragments:
        assert frag in str(e.value), (frag, str(e.value))
    with pytest.raises(LayoutError, match="cu_seqlens must be torch.int32, got torch.int64"):
        build_layout(torch.tensor([0, 8]), 1, 0)
    with pytest.raises(LayoutError, match=r"rank must be in \[0, 1\], got 2"):
        build_layout([0, 8], 2, 2)
    with pytest.raises(LayoutError, match=r"rank must be in \[0, 1\], got True"):  # once taken as rank 1
        build_layout([0, 8], 2, True)
    for bad in ([0, 8.9, 24], ["0", "8"], None):  # once truncated by int(), or a TypeError
        with pytest.raises(LayoutError, match=r"cu_seqlens must be an int32 tensor or a list of ints"):
            build_layout(bad, 1, 0)


def test_a_local_problem_of_any_type_reaches_the_preflight():
    """checks.collect turns any exception of a local check into the problem text that
    preflight raises on every rank (a TypeError raised on one rank alone would leave the
    others waiting in the preflight's all_gather until the timeout)."""
    from rlk_ops.distributed.checks import collect

    def type_error():
        raise TypeError("'NoneType' object is not iterable")

    assert collect([lambda: None]) is None
    assert collect([type_error]) == "TypeError: 'NoneType' object is not iterable"
    assert collect([lambda: build_layout([0, 3], 2, 0)]).startswith("rlk_ops.distributed: sequence 0 has length 3")


def _attn_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return [torch.randn(t, h, 32, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4)]


def _fwd_bwd(fn, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    ((out.float() * dout.float()).sum() + lse.sum()).backward()
    return out, lse, q.grad, k.grad, v.grad


def test_one_process_cp_attention_equals_rlk_attention():
    q, k, v, dout = _attn_inputs()
    ref = _fwd_bwd(lambda a, b, c: rlk_ops.attention(a, b, c, True, cu_seqlens_q=CU, cu_seqlens_k=CU), q, k, v, dout)
    lay = build_layout(CU, 1, 0, "contiguous")  # one segment per sequence: the same computation
    got = _fwd_bwd(lambda a, b, c: context_parallel_attention(a, b, c, lay), q, k, v, dout)
    assert all(bitwise_equal(a, b) for a, b in zip(got, ref))
    zig = build_layout(CU, 1, 0, "zigzag")      # two segments per sequence, reordered tokens
    got = _fwd_bwd(lambda a, b, c: context_parallel_attention(a, b, c, zig), *(zig.shard(t) for t in (q, k, v, dout)))
    assert bitwise_equal(got[0], zig.shard(ref[0])) and bitwise_equal(got[1], ref[1][:, zig.local_index])
    assert bitwise_equal(got[2], zig.shard(ref[2]))


def _block_run(module, x, pos, lay_or_cu, dy):
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = module(x, pos, lay_or_cu)
    (y.float() * dy).sum().backward()
    return [y.detach(), x.grad] + [p.grad for _, p in module.named_parameters()]


def test_one_process_parallel_block_equals_qwen3attention():
    """The default-mode reference of the distributed tests is the plain block, bit for bit."""
    block = init_block(Qwen3Attention(**SMALL))
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    ref = _block_run(block, x, pos, cu, dy)
    pb = ParallelQwen3Attention(block, None)
    xl, pl, lay = pb.prepare(x, pos, cu)
    got = _block_run(pb, xl, pl, lay, dy)
    assert [n for n, _ in pb.named_parameters()] == [n for n, _ in block.named_parameters()]
    assert len(got) == 8 and all(bitwise_equal(a, b) for a, b in zip(got, ref))


def test_canonical_mode_cost_in_accuracy():
    """Canonical chunks round each chunk's partial to bf16 before the fp32 sum. Measured
    here against float64 math: its error stays at the default mode's scale (printed)."""
    block = init_block(Qwen3Attention(**SMALL))
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    exact = _block_run(init_block(Qwen3Attention(**SMALL, dtype=torch.float64)), x.double(), pos, cu, dy.double())
    default = _block_run(block, x, pos, cu, dy)
    pb = ParallelQwen3Attention(block, None, "zigzag", chunks=8)
    xl, pl, lay = pb.prepare(x, pos, cu)
    canon = _block_run(pb, xl, pl, lay, lay.shard(dy))
    canon[:2] = [lay.from_cp_layout(t) for t in canon[:2]]
    names = ["y", "dX"] + [n for n, _ in block.named_parameters()]
    rows = []
    for name, e, d, c in zip(names, exact, default, canon):
        err_d, err_c = rel_err(d, e), rel_err(c, e)
        diff = drift_stats(c, d)
        rows.append(f"{name:<15} rel err vs fp64: default {err_d:.2e} canonical {err_c:.2e}; canonical vs default "
                    f"max|diff| {diff['max']:.2e} mean {diff['mean']:.2e}")
        assert err_c < 2e-2 and err_c < 3 * err_d + 1e-3, rows[-1]
    print("\n" + "\n".join(rows))


def test_uninitialised_process_group_is_reported(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(DistributedInputError, match="not initialized.*torchrun"):
        init_mesh(1, 1, "cpu")
    with pytest.raises(DistributedInputError, match="torch.distributed is not initialized"):
        preflight(None, "test", None, {})


def test_local_errors_before_any_communication():
    q, k, v, _ = _attn_inputs()
    lay = build_layout(CU, 1, 0)
    cases = [
        ((q[:10], k, v, lay), "q.shape[0] must be this rank's token count 384 (layout), got 10"),
        ((q, k.float(), v, lay), "k and v must have q's dtype torch.bfloat16"),
        ((q, k[:, :1].expand(-1, 3, -1), v, lay), "Hq % Hkv == 0"),
        ((q, k, v, "layout"), "layout must be a CPLayout"),
        ((q, k, v, build_layout(CU, 2, 0)), "group is None (one process) but the layout shards over cp = 2"),
    ]
    for args, msg in cases:
        with pytest.raises(DistributedInputError) as e:
            context_parallel_attention(*args)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(DistributedInputError, match="num_kv_heads = 2 must be divisible by tp|attention_bias"):
        ParallelQwen3Attention(init_block(Qwen3Attention(**SMALL, attention_bias=True)), None)
    pb = ParallelQwen3Attention(init_block(Qwen3Attention(**SMALL)), None, "zigzag")
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    with pytest.raises(DistributedInputError, match=r"hidden_states must be \[384, 128\]"):
        pb.prepare(x[:100], pos, cu)
    with pytest.raises(DistributedInputError, match="positions must be int64"):
        pb.prepare(x, pos.int(), cu)
    xl, pl, lay = pb.prepare(x, pos, cu)
    with pytest.raises(ValueError, match="use the layout from this module's prepare"):
        pb(xl, pl, build_layout(cu, 1, 0, "contiguous"))
    # local=True checks the token count before building the layout too: a cu_seqlens[-1] of 2**24 beside
    # 4 rows built ~1.2 GiB of index rows first (2**31 - 1 would have ended the process, not raised)
    huge = torch.tensor([0, 2 ** 24], dtype=torch.int32)
    for local in (False, True):
        what = r"this rank's token count: cu_seqlens\[-1\] = 16777216 over cp = 1" if local else "the packed"
        with pytest.raises(DistributedInputError, match=rf"hidden_states must be \[16777216, 128\] \({what}"):
            pb.prepare(x[:4], pos[:4], huge, local=local)


def test_prepare_names_a_bad_input_type_or_device():
    """prepare() once said "got []" for a list hidden_states (not its type), accepted positions on
    another device than hidden_states or a batch on another device than the weights, and took
    chunks=True as 1 canonical chunk."""
    block = init_block(Qwen3Attention(**SMALL))
    pb = ParallelQwen3Attention(block, None, "zigzag")
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    with pytest.raises(DistributedInputError, match=r"hidden_states must be a torch.Tensor \[384, 128\], got list"):
        pb.prepare([], pos, cu)
    with pytest.raises(DistributedInputError, match=r"positions must be a torch.Tensor int64 \[384\], got tuple"):
        pb.prepare(x, tuple(pos.tolist()), cu)
    with pytest.raises(DistributedInputError, match=r"hidden_states must be a torch.Tensor \[384, 128\], got ndarray"):
        pb.prepare(x.float().numpy(), pos, cu, local=True)  # cp = 1: this rank's shard is the whole batch
    with pytest.raises(DistributedInputError, match=r"positions is on meta but hidden_states is on cpu; all inputs "
                                                     r"must share a device"):
        pb.prepare(x, pos.to("meta"), cu)
    with pytest.raises(DistributedInputError, match=r"hidden_states is on meta but positions is on cpu|"
                                                     r"positions is on cpu but hidden_states is on meta"):
        pb.prepare(x.to("meta"), pos, cu)
    with pytest.raises(DistributedInputError, match=r"hidden_states must be on the weights' device cpu, got meta"):
        pb.prepare(x.to("meta"), pos.to("meta"), cu)  # the inputs agree with each other, not with the weights
    with pytest.raises(DistributedInputError, match=r"chunks .* must be an int or None, got bool True"):
        ParallelQwen3Attention(block, None, "contiguous", chunks=True)


def test_reduction_helpers_name_bad_arguments():
    """canonical_reduce sums the parts in ``order``: a duplicate index once summed a part twice
    (order (0, 0) of [1, 10] gave 2); sync_grads needs one valid kind per tensor (a missing or
    unknown kind once skipped the gradient's reduction)."""
    from rlk_ops.distributed.reductions import canonical_reduce, sync_grads

    parts = torch.tensor([[1.0], [10.0]])
    assert canonical_reduce(parts, None, (1, 0)).item() == 11.0
    for order in ((0, 0), (0,), (0, 1, 2)):
        with pytest.raises(ValueError, match=r"canonical_reduce: order must be a permutation of the 2 gathered"):
            canonical_reduce(parts, None, order)
    t = torch.zeros(2, requires_grad=True)
    for kinds in (("xp",), ("cp", "tp")):
        with pytest.raises(ValueError, match=r"sync_grads needs one kind per tensor"):
            sync_grads([t], kinds, None, None)
    from rlk_ops.distributed.reductions import all_reduce, fanout, ordered_sum

    with pytest.raises(ValueError, match=r"ordered_sum needs at least one part along dim 0, got shape \[0, 2\]"):
        ordered_sum(torch.zeros(0, 2), torch.float32)
    with pytest.raises(ValueError, match=r"all_reduce: world_size must be a positive int, got 0"):
        all_reduce(torch.zeros(2), "unused", 0)
    w = torch.ones(2, requires_grad=True)
    (a, b) = fanout([w], [(2, (), (0, 1))], None, None)
    (a.sum() + 2 * b.sum()).backward()
    assert torch.equal(w.grad, torch.full((2,), 3.0))
    (c, d) = fanout([w], [(2, (), (1, 1))], None, None)  # cell 1 twice, cell 0 never
    with pytest.raises(ValueError, match=r"fanout: order must be a permutation of the 2 gathered cells"):
        (c.sum() + d.sum()).backward()


def test_comparison_names_a_missing_row():
    from rlk_ops.distributed.compare import Comparison, Row

    c = Comparison(1, 2, "contiguous", None, "gloo", [Row("lse", True, 0.0, 0.0, True, None, True)])
    assert c.row("lse").bitwise
    with pytest.raises(KeyError, match=r"Comparison has no row 'dq'; its rows are \['lse'\]"):
        c.row("dq")


def test_layout_moves_name_a_wrong_token_count_or_dim():
    """to_cp_layout / from_cp_layout once cut a longer x silently to the layout's tokens."""
    lay = build_layout([0, 8, 24], 2, 0)
    x = torch.arange(24.0)
    assert torch.equal(lay.from_cp_layout(lay.to_cp_layout(x)), x)
    for fn in (lay.to_cp_layout, lay.from_cp_layout, lay.shard):
        with pytest.raises(LayoutError, match=r"x.shape\[0\] must be the packed token count 24, got 30"):
            fn(torch.arange(30.0))
        with pytest.raises(LayoutError, match=r"dim must be in \[-1, 0\] for x of shape \[24\], got 5"):
            fn(x, dim=5)


def test_init_mesh_names_a_bad_device_type():
    from rlk_ops.distributed import init_mesh

    with pytest.raises(DistributedInputError, match=r"init_mesh: device_type must be 'cpu' or 'cuda'.*got 'gpu'"):
        init_mesh(1, 1, "gpu")


def test_cp_attention_names_a_bad_group_or_scale():
    from rlk_ops.distributed import context_parallel_attention

    q, k, v, _ = _attn_inputs()
    lay = build_layout([0, sum(LENS)], 1, 0)
    with pytest.raises(DistributedInputError, match=r"group must be the cp ProcessGroup .* got str"):
        context_parallel_attention(q, k, v, lay, group="cp")
    with pytest.raises(DistributedInputError, match=r"softmax_scale must be a finite float or None, got str 'a'"):
        context_parallel_attention(q, k, v, lay, softmax_scale="a")
    # an int past float's range raised OverflowError while the preflight row was built, outside the
    # checks that reach every rank (a session 33 audit); NaN passed the check
    for scale, check in ((10 ** 400, True), (10 ** 400, False), (float("nan"), True)):
        with pytest.raises(DistributedInputError, match=r"softmax_scale must be a finite float or None, got "):
            context_parallel_attention(q, k, v, lay, softmax_scale=scale, check=check)


def test_parallel_block_names_a_mesh_that_is_not_a_device_mesh():
    block = init_block(Qwen3Attention(**SMALL))
    for mesh, got in (("cpu", "str 'cpu'"), (2, "int 2")):
        with pytest.raises(DistributedInputError, match=rf"mesh must be a DeviceMesh from "
                                                        rf"rlk_ops.distributed.init_mesh, or None, got {got}"):
            ParallelQwen3Attention(block, mesh)


def test_a_frozen_parameter_stays_frozen():
    """nn.Parameter's default requires_grad=True made the block's frozen weights trainable in the
    parallel module, and an optimizer over it updated them (a session 33 audit)."""
    block = init_block(Qwen3Attention(**SMALL))
    block.q_norm.weight.requires_grad_(False)
    block.k_proj.weight.requires_grad_(False)
    pb = ParallelQwen3Attention(block, None)
    assert {n: p.requires_grad for n, p in pb.named_parameters()} == \
        {n: p.requires_grad for n, p in block.named_parameters()}
    x, pos, cu = packed_batch(LENS, SMALL["hidden_size"], requires_grad=False)
    xl, pl, lay = pb.prepare(x, pos, cu)
    pb(xl, pl, lay).float().sum().backward()
    assert pb.q_norm.weight.grad is None and pb.k_proj.weight.grad is None
    assert pb.q_proj.weight.grad is not None and pb.k_norm.weight.grad is not None


def test_parallel_block_runs_an_empty_batch_on_one_process():
    """prepare accepts a batch of empty sequences; forward once failed on a reshape of 0 elements."""
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    pb = ParallelQwen3Attention(block, None, "contiguous")
    x, pos, _ = packed_batch([8, 16], 128)
    xd, pd, lay = pb.prepare(x[:0], pos[:0], [0, 0])
    assert pb(xd, pd, lay).shape == (0, 128)


# Each step prints a marker before it starts, and the process runs with faulthandler on: the
# subprocess once aborted in a fresh-clone CI run (rc -6, "terminate called without an active
# exception", session 27) and did not again in 40 runs, alone or under load. Session 29's CI run
# hit it again, and the markers placed it: after "step: done", i.e. after every check and after
# destroy_process_group, in the interpreter's teardown, with no Python frame (a C++ thread of
# torch's gloo/c10d being destroyed while joinable). The script now ends with os._exit(0) once
# its output is flushed, so teardown, which it does not test, cannot abort it; an exception in
# any step still exits non-zero before that.
_MESH_CHECK = """
import datetime, tempfile
import torch.distributed as dist
print("step: init", flush=True)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
from rlk_ops.compile import Qwen3Attention
from rlk_ops.compile.examples import init_block, packed_batch
from rlk_ops.distributed import ParallelQwen3Attention, init_mesh
pb_block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
pb = ParallelQwen3Attention(pb_block, init_mesh(1, 1, "cpu"), "contiguous")
x, pos, cu = packed_batch([8, 16], 128)
print("step: prepare and forward", flush=True)
xd, pd, lay = pb.prepare(x, pos, cu)
print("ran", tuple(pb(xd, pd, lay).shape))
print("step: forward refusal", flush=True)
try:
    pb(xd.to_local(), pd, lay)
except ValueError as e:
    print("refused:", e)
# prepare() takes plain tensors and makes the DTensors itself (it once took a DTensor too)
from torch.distributed.tensor import Replicate, distribute_tensor
print("step: prepare refusals", flush=True)
x_dt = distribute_tensor(x, pb.mesh, (Replicate(), Replicate()))
for module, args in ((pb, (x_dt, pos, cu)), (pb, (xd, pd, cu)),
                     (ParallelQwen3Attention(pb_block, None), (x, distribute_tensor(pos, pb.mesh,
                                                                                   (Replicate(), Replicate())), cu))):
    try:
        module.prepare(*args)
        print("prepare took a DTensor")
    except ValueError as e:
        print("prepare refused:", type(e).__name__, e)
print("step: destroy", flush=True)
dist.destroy_process_group()
print("step: done", flush=True)
import os, sys
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def mesh_check():
    """_MESH_CHECK's output (stdout), run once for the tests below; a nonzero exit fails them
    with the last step reached and stderr (faulthandler's dump included)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _MESH_CHECK], capture_output=True,
                          text=True, timeout=300)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step: ")]
    assert proc.returncode == 0, (f"rc {proc.returncode} after {steps[-1] if steps else 'no step'}\n"
                                  f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}")
    assert steps[-1] == "step: done", proc.stdout
    return proc.stdout


def test_parallel_block_forward_names_inputs_not_from_prepare(mesh_check):
    """On a mesh, forward takes prepare()'s DTensors; a plain tensor (or one on another mesh)
    is named instead of failing inside local_map (a one-process, 1 x 1 mesh, in a subprocess)."""
    assert "ran (24, 128)" in mesh_check
    # through the forward's preflight (session 38), so that on a mesh every rank raises it
    assert ("refused: ParallelQwen3Attention.forward: rank 0 rejected its input: ParallelQwen3Attention: "
            "hidden_states must be the DTensor prepare() returned") in mesh_check


def test_parallel_block_prepare_names_a_dtensor_input(mesh_check):
    """prepare() takes the plain global batch (or this rank's plain shard) and makes the
    DTensors: a DTensor hidden_states or positions is named with its placements, on the
    mesh through the preflight (same 1 x 1 mesh subprocess as above)."""
    refused = [line for line in mesh_check.splitlines() if line.startswith("prepare ")]
    assert len(refused) == 3 and "prepare took a DTensor" not in mesh_check, mesh_check
    on_mesh = (r"prepare refused: DistributedInputError ParallelQwen3Attention.prepare: rank 0 rejected its input: "
               r"ParallelQwen3Attention: {} must be a plain torch.Tensor {} \(the global batch; prepare\(\) makes "
               r"the DTensor\), got a DTensor with placements \(Replicate\(\), {}\)")
    assert re.fullmatch(on_mesh.format("hidden_states", r"\[24, 128\]", "Replicate\\(\\)"), refused[0]), refused[0]
    assert re.fullmatch(on_mesh.format("hidden_states", r"\[24, 128\]", "Shard\\(dim=0\\)"), refused[1]), refused[1]
    assert re.fullmatch(r"prepare refused: DistributedInputError ParallelQwen3Attention: positions must be a plain "
                        r"torch.Tensor int64 \[24\] .*got a DTensor with placements \(Replicate\(\), "
                        r"Replicate\(\)\)", refused[2]), refused[2]


def test_layout_names_a_huge_or_meta_cu_seqlens():
    """cu_seqlens[-1] = 2**40 once went to the allocator (can't allocate memory), a meta tensor
    to a NotImplementedError; prepare compares the token count before building the layout."""
    with pytest.raises(LayoutError, match=r"cu_seqlens\[-1\] \(the packed token count\) must be below 2\*\*31, "
                                          r"got 1099511627776"):
        build_layout([0, 2 ** 40], 1, 0)
    with pytest.raises(LayoutError, match=r"cu_seqlens must hold values .* got a meta tensor"):
        build_layout(torch.tensor([0, 4], dtype=torch.int32, device="meta"), 1, 0)
    pb = ParallelQwen3Attention(init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2,
                                                          head_dim=32)), None)
    x, pos, _ = packed_batch([8, 16], 128)
    with pytest.raises(DistributedInputError, match=r"hidden_states must be \[2147483646, 128\] \(the packed token "
                                                    r"count, hidden_size\), got \[24, 128\]"):
        pb.prepare(x, pos, [0, 2 ** 31 - 2])  # valid int32, never built


def test_cp_attention_names_a_zero_head_dim():
    from rlk_ops.distributed import context_parallel_attention

    lay = build_layout([0, 24], 1, 0)
    q, kv = torch.zeros(24, 4, 0), torch.zeros(24, 2, 0)
    with pytest.raises(DistributedInputError, match=r"head_dim \(their last dim\) >= 1, got q \[24, 4, 0\]"):
        context_parallel_attention(q, kv, kv, lay)


def test_parallel_block_names_bad_positions_taps_and_block_in_one_process():
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    with pytest.raises(DistributedInputError, match=r"block must be an rlk_ops.compile.Qwen3Attention, got dict"):
        ParallelQwen3Attention({}, None)
    mixed = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    mixed.k_norm.float()
    with pytest.raises(DistributedInputError, match=r"block.k_norm.weight must have o_proj.weight's dtype "
                                                    r"torch.bfloat16 and device cpu, got torch.float32 on cpu"):
        ParallelQwen3Attention(mixed, None)
    pb = ParallelQwen3Attention(block, None, "contiguous")
    x, pos, cu = packed_batch([8, 16], 128)
    bad = pos.clone()
    bad[20] = 2 ** 62
    with pytest.raises(DistributedInputError, match=r"rlk::rope: positions\[20\] = 4611686018427387904 exceeds"):
        pb.prepare(x, bad, cu)
    xd, pd, lay = pb.prepare(x, pos, cu)
    with pytest.raises(ValueError, match=r"taps must be a dict or None, got list"):
        pb(xd, pd, lay, taps=[])


def test_preflight_encodes_floats_bit_for_bit():
    from rlk_ops.distributed import checks

    for value in (1e6, 0.1, -0.0, float("inf"), 1e-300):
        bits, problem = checks._encode("x", value)
        assert problem is None and checks._decode(bits, 1.0) == repr(value)
    assert checks._encode("x", 0.0)[0] != checks._encode("x", -0.0)[0]  # distinct bits, distinct values
    assert checks._encode("x", "1")[1] == "metadata x must be an int or a float, got '1'"
    assert checks._encode("x", 2 ** 64)[1] == "metadata x must be an int or a float, got 18446744073709551616"


def test_metadata_tells_apart_batches_of_one_size_and_total():
    """The cross-rank preflight compares each rank's layout metadata. Its lengths hash was a
    polynomial mod 2^61, for which a session 31 audit built two batches of one size and total with
    the same hash: both ranks' prepare accepted their own batch, and the forward would have run on
    layouts that disagree."""
    a = [1224, 1436, 892, 1608, 892, 892, 1160, 892]
    b = [892, 892, 1028, 892, 900, 1780, 892, 1720]
    assert len(a) == len(b) and sum(a) == sum(b)

    def meta(lens):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        return build_layout(cu, 2, 0, "contiguous").metadata()

    old = [0, 0]
    for j, lens in enumerate((a, b)):
        for i, n in enumerate(lens):
            old[j] = (old[j] * 1000003 + n * (i + 1)) % (1 << 61)
    assert old[0] == old[1]   # the collision the old hash had
    assert meta(a) != meta(b) and meta(a) == meta(list(a))


def test_metadata_rows_take_the_groups_cpu_backend(monkeypatch):
    """init_mesh's CUDA groups are "cpu:gloo,cuda:nccl": the preflight rows go over gloo on the CPU
    (any "nccl" in the name sent them to CUDA before); an NCCL-only group gets CUDA tensors."""
    from rlk_ops.distributed import checks

    monkeypatch.setattr(checks.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert checks.metadata_device(None) == torch.device("cpu")
    monkeypatch.setattr(checks.dist, "get_backend", lambda group=None: "gloo")
    assert checks.metadata_device(None) == torch.device("cpu")
    if torch.cuda.is_available():
        monkeypatch.setattr(checks.dist, "get_backend", lambda group=None: "nccl")
        assert checks.metadata_device(None).type == "cuda"


# ------------------------------------------- a session 39 mutation audit (round 2): gaps it found
def test_layout_metadata_tells_canonical_from_default_of_one_chunk_count():
    cu = [0, 8, 24]
    assert build_layout(cu, 2, 0, "contiguous").n_chunks == build_layout(cu, 2, 0, "contiguous", 2).n_chunks
    assert build_layout(cu, 2, 0, "contiguous").metadata() != build_layout(cu, 2, 0, "contiguous", 2).metadata()


def test_ordered_sum_is_left_to_right_in_fp32_or_fp64():
    from rlk_ops.distributed.reductions import ordered_sum
    g = torch.Generator().manual_seed(0)
    for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        parts = (torch.randn(6, 500, generator=g, dtype=torch.float64)
                 * 10.0 ** torch.randint(-4, 5, (6, 500), generator=g)).to(dtype)
        want = parts[0].to(acc)
        for i in range(1, 6):
            want = want + parts[i].to(acc)
        assert torch.equal(ordered_sum(parts, dtype), want.to(dtype)), dtype


def test_preflight_refuses_an_int_past_int64():
    from rlk_ops.distributed import checks
    assert checks._encode("x", 2 ** 63)[1] == "metadata x must be an int or a float, got 9223372036854775808"
    assert checks._encode("x", 2 ** 63 - 1) == (2 ** 63 - 1, None)


def test_comparison_claims_need_compiled_equal_and_claim_canonical_rows():
    from rlk_ops.distributed.compare import Comparison, Row, compare_block
    c = Comparison(1, 1, "contiguous", None, "none", [Row("lse", True, 0.0, 0.0, True, False, True)])
    assert not c.claims_hold()   # compiled != eager breaks the claims
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    x, pos, cu = packed_batch([8, 16], 128, requires_grad=False)
    res = compare_block(block, None, x, pos, cu, "contiguous", chunks=2)
    assert all(r.claimed for r in res.rows) and res.claims_hold(), res.table()


def test_compare_block_seeds_the_output_gradient(monkeypatch):
    """Every run of one comparison takes dy drawn from a generator seeded with ``seed`` alone (session 43's
    audit, P18: from the global generator, each rank of a mesh would draw its own dy)."""
    from rlk_ops.distributed import compare
    seen = []
    real = compare._run

    def spy(module, x, positions, layout, dy, fn=None):
        seen.append(dy.clone())
        return real(module, x, positions, layout, dy, fn)

    monkeypatch.setattr(compare, "_run", spy)
    block = init_block(Qwen3Attention(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32))
    x, pos, cu = packed_batch([8, 16], 128, requires_grad=False)
    compare.compare_block(block, None, x, pos, cu, seed=0)
    compare.compare_block(block, None, x, pos, cu, seed=1)
    assert not torch.equal(seen[0], seen[len(seen) // 2])
    assert len(seen) == 6   # the one-process reference and two eager runs, per call
    for i, dy in enumerate(seen):
        assert torch.equal(dy, torch.randn(x.shape, generator=torch.Generator().manual_seed(i // 3))), i


def test_canonical_order_finds_each_chunk_in_the_gathered_pieces():
    for mode, cp, n in (("contiguous", 2, 8), ("zigzag", 2, 8), ("contiguous", 4, 8)):
        gathered = [j for r in range(cp) for j in owned_chunks(mode, cp, r, n)]
        order = build_layout([0, 8 * n], cp, 0, mode, n).canonical_order()
        assert [gathered[i] for i in order] == list(range(n)), (mode, cp, order)
