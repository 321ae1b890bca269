"""Issue 7: TP and CP on (tp, cp) meshes, gloo, several processes.

On 2x2, 1x2 and 2x1 meshes, contiguous and zigzag sharding:
* attention out, lse and dQ are bitwise equal to the single-process run (attention
  level with random q/k/v, and inside the block via taps); compiled == eager;
* dK, dV, the block output (tp > 1), dX and the weight gradients are deterministic
  run to run; their drift against the single-process run is written and printed;
* canonical chunks: every tensor bitwise equal to the one-process canonical run;
* DTensor inputs to rlk ops (register_sharding) give the plain-tensor bits;
* bad input raises on every rank before any collective; a collective with a missing
  peer times out instead of hanging;
* compare_block's own bad arguments are rejected before any work (one process here;
  across ranks, including ranks whose global inputs differ, in the 2x2 worker).
"""
import json
import os

import pytest
import torch

from dist_tp_cp import CHUNKS, block_inputs, worker_1x2_2x1, worker_2x2
from dist_utils import run_workers
from rlk_ops.distributed import DistributedInputError
from rlk_ops.distributed import compare

pytestmark = pytest.mark.distributed


def _report(out_dir):
    """Print the drift numbers (visible with -s / -rP) and check they were written."""
    names = sorted(os.listdir(out_dir))
    for name in names:
        with open(os.path.join(out_dir, name)) as f:
            data = json.load(f)
        if name.startswith("attention_drift"):
            for key, s in data.items():
                print(f"{name[16:-5]} {key}: max|diff| {s['max']:.3e} mean|diff| {s['mean']:.3e} "
                      f"mismatched {s['mismatched']}/{s['elements']}")
                assert s["elements"] > 0 and s["max"] < 0.05
    return names


def test_mesh_2x2(tmp_path):
    run_workers(worker_2x2, 4, str(tmp_path))
    assert _report(tmp_path) == ["attention_drift_2x2.json", "block_2x2.json"]


def test_meshes_1x2_and_2x1(tmp_path):
    run_workers(worker_1x2_2x1, 2, str(tmp_path))
    assert _report(tmp_path) == ["attention_drift_1x2.json", "attention_drift_2x1.json", "block_1x2.json",
                                 "block_2x1.json"]


@pytest.mark.parametrize("bad", ["device_type", "timeout"])
def test_init_mesh_under_torchrun_env_refuses_a_bad_argument_on_every_rank(bad):
    import socket

    import torch.multiprocessing as mp

    from dist_tp_cp import env_init_worker
    with socket.socket() as sock:   # a free port for the TCP rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(env_init_worker, args=(2, port, bad), nprocs=2, join=True)


def _nan_at(t, idx, value=float("nan")):
    t = t.detach().clone()
    t[idx] = value
    return t


_BLOCK, _X, _POS, _CU = block_inputs()
_INF_BLOCK = block_inputs()[0]
with torch.no_grad():
    _INF_BLOCK.q_proj.weight[1, 2] = float("inf")


@pytest.mark.parametrize("kwargs, match", [
    (dict(block=None), r"compare_block: block must be a rlk_ops.compile.Qwen3Attention, got NoneType"),
    (dict(block=torch.nn.Linear(2, 2)), r"block must be a rlk_ops.compile.Qwen3Attention, got Linear"),
    (dict(mesh="cpu"), r"mesh must be a DeviceMesh from rlk_ops.distributed.init_mesh, or None .*, got str"),
    (dict(compile="no"), r"compile must be a bool, got 'no'"),
    (dict(seed="0"), r"seed must be an int in \[-2\*\*63, 2\*\*63\) .*, got '0'"),
    (dict(seed=1.0), r"seed must be an int .*, got 1.0"),
    (dict(seed=True), r"seed must be an int .*, got True"),
    (dict(seed=2 ** 64), rf"seed must be an int .*, got {2 ** 64}"),
    (dict(hidden_states=_X.to("meta")), r"hidden_states must hold data .*, got a tensor on the meta device"),
    (dict(positions=_POS.to("meta")), r"positions must hold data .*, got a tensor on the meta device"),
    (dict(hidden_states=_nan_at(_X, (5, 7))), r"hidden_states must be finite .*, got nan at hidden_states\[5, 7\]"),
    (dict(hidden_states=_nan_at(_X, (0, 1), float("-inf"))), r"got -inf at hidden_states\[0, 1\]"),
    (dict(block=_INF_BLOCK), r"block.q_proj.weight must be finite .*, got inf at block.q_proj.weight\[1, 2\]"),
])
def test_compare_block_bad_input(monkeypatch, kwargs, match):
    """One process (mesh=None): the error names the argument, and comes before any forward."""
    def no_run(*a, **k):
        raise AssertionError("compare_block ran the block before rejecting its input")

    monkeypatch.setattr(compare, "_run", no_run)
    args = dict(block=_BLOCK, mesh=None, hidden_states=_X, positions=_POS, cu_seqlens=_CU)
    with pytest.raises(DistributedInputError, match=match):
        compare.compare_block(**{**args, **kwargs})


def test_compare_block_one_process_accepts_good_input():
    """The checks reject nothing valid: a negative seed, list cu_seqlens, canonical chunks. (In one
    process the canonical reference is the module's own computation, so bitwise rows say nothing
    here; the meshes' tests compare across processes.)"""
    for chunks in (None, CHUNKS):
        c = compare.compare_block(_BLOCK, None, _X, _POS, _CU.tolist(), "zigzag", chunks, seed=-1)
        assert c.claims_hold() and c.rows, c.table()


def test_forward_refuses_a_layout_of_another_chunk_count():
    """The forward compared cp, rank, mode and canonical but not the chunk count: a layout of 8 chunks given
    to a module of 4 ran with 8 chunks, silently (a session 38 audit)."""
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import init_block, packed_batch
    from rlk_ops.distributed import ParallelQwen3Attention, build_layout

    block = init_block(Qwen3Attention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16))
    x, pos, cu = packed_batch([16, 8], 64, requires_grad=False)
    pb = ParallelQwen3Attention(block, None, "contiguous", chunks=4)
    xs, ps, lay4 = pb.prepare(x, pos, cu)
    with pytest.raises(ValueError, match=r"layout is for cp rank 0 of 1 \(contiguous, 8 chunks, canonical=True\); "
                                         r"this module is cp rank 0 of 1 \(contiguous, 4 chunks"):
        pb(xs, ps, build_layout(cu, 1, 0, "contiguous", 8))
    assert pb(xs, ps, lay4).shape == (24, 64)


def test_compare_block_with_a_frozen_weight():
    """A frozen weight has no gradient: compare_block crashed on None.double() (a session 38 audit); its row
    is left out and the rest are compared."""
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import init_block, packed_batch

    block = init_block(Qwen3Attention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16))
    block.q_norm.weight.requires_grad_(False)
    x, pos, cu = packed_batch([16, 8], 64, requires_grad=False)
    c = compare.compare_block(block, None, x, pos, cu, "contiguous", 4)
    names = [r.name for r in c.rows]
    assert c.claims_hold() and "d q_norm.weight" not in names and "d k_norm.weight" in names, c.table()
