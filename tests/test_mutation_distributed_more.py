"""Killing tests for survivors of a session 41 mutation audit of rlk_ops/distributed (mesh, cp_attention,
parallel_block; the mutants a session 40 audit designed but did not run). Multi-process bodies run in gloo
processes (tests/dist_utils.py). The audit's fourth survivor (a bad timeout handed to init_process_group under
torchrun's environment) is a case of tests/test_distributed_tp_cp.py's torchrun-environment test."""
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from dist_tp_cp import block_inputs, expect_everywhere
from dist_utils import run_workers
from rlk_ops.distributed import ParallelQwen3Attention, init_mesh
from rlk_ops.distributed.mesh import groups

pytestmark = pytest.mark.distributed


# ------------------------------------------- a 1 x 2 mesh: the forward's DTensor outputs, a mesh of some ranks
def _outputs_and_partial_mesh_worker(rank, world_size):
    mesh = init_mesh(1, 2, "cpu")
    # mesh.groups: a size-1 dim has no group (nothing to communicate), so the module sends no tp collectives
    tp_group, cp_group, tp_rank, cp_rank = groups(mesh)
    assert tp_group is None and cp_group is not None and (tp_rank, cp_rank) == (0, rank), groups(mesh)
    block, x, pos, cu = block_inputs()
    # the forward's outputs are DTensors whose global view (full_tensor) is the whole batch in cp layout order
    # with every head: attention out and lse bitwise equal to one process, and so is y where tp = 1 (no o_proj
    # partial sums). Only their local shards were compared before, so a wrong declared placement went unseen.
    ref = ParallelQwen3Attention(block, None, "contiguous")
    with torch.no_grad():
        y1, attn1, lse1 = ref(*ref.prepare(x, pos, cu), return_attention=True)
    for tp, cp in ((1, 2), (2, 1)):
        pb = ParallelQwen3Attention(block, init_mesh(tp, cp, "cpu"), "zigzag")
        if tp == 1:
            assert pb.topology.tp_name is None and pb.topology.cp_name == cp_group.group_name, pb.topology
        xs, ps, lay = pb.prepare(x, pos, cu)
        with torch.no_grad():
            y, attn, lse = pb(xs, ps, lay, return_attention=True)
        full = {"block output y": (y.full_tensor(), 0, y1), "attention out": (attn.full_tensor(), 0, attn1),
                "lse": (lse.full_tensor(), 1, lse1)}
        for name, (got, dim, want) in full.items():
            assert got.shape == want.shape, f"{tp}x{cp} {name}: full_tensor() {list(got.shape)}, not {list(want.shape)}"
            if tp == 1 or name != "block output y":   # tp > 1: y's fp32 partial-sum order differs (not claimed)
                assert torch.equal(lay.from_cp_layout(got, dim), want), f"{tp}x{cp} {name}: differs from one process"
    # a mesh that leaves a rank out (made on every rank, as DeviceMesh must be) is named on every rank
    partial = DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=("tp", "cp"))
    expect_everywhere(lambda: ParallelQwen3Attention(block, partial), "the mesh must span all 2 ranks, got 1")


def test_forward_outputs_assemble_to_the_one_process_batch_and_a_partial_mesh_is_named():
    run_workers(_outputs_and_partial_mesh_worker, 2)
