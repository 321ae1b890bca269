"""rlk_ops.rollout.weights.sync_weights, and an RL loop with an FSDP2 trainer (examples/fsdp_rl_loop.py).

The loop's claims (trainer log-probs == rollout's every iteration on every rank, importance ratio exactly 1,
an unsynced rollout disagrees, a second run reproduces the master weights) run under torchrun on 2 gloo
ranks with compiled layers here, and eager with a rollout worker in its own process in
test_weight_transfer.py (which runs the colocated loop inside). Around it: what a sync copies (the trainer's compute-dtype values; ties, wrappers, the rollout
engine's view), what it refuses before copying anything, and a refusal on one rank raised on every rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

from dist_utils import run_workers  # noqa: E402
from test_hf import _cast, _config  # noqa: E402

from rlk_ops.compile.hf_model import patch_qwen3_model, rollout_model  # noqa: E402
from rlk_ops.ops._validate import RlkInputError  # noqa: E402
from rlk_ops.rollout.weights import sync_weights  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(dtype=torch.bfloat16, seed=0, **kw):
    torch.manual_seed(seed)
    return patch_qwen3_model(_cast(transformers.Qwen3ForCausalLM(_config(**kw)), dtype, "cpu"))


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _example(tmp_path, nproc, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", str(ROOT / "examples" / "fsdp_rl_loop.py"),
           "--json", str(tmp_path / "loop.json"), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "loop.json").read_text())
    assert "ALL CLAIMS HOLD" in proc.stdout and all(report["claims"].values()), proc.stdout
    rows = report["per_iteration"]
    assert len(rows) == 3 and all(r["tokens"] > 0 and r["mismatched"] == 0 and r["ratio_not_1"] == 0 for r in rows)
    assert all(r["unsharded"] == r["synced_tensors"] for r in rows)   # every parameter came through FSDP's unshard
    assert report["stale"]["mismatched"] > 0
    return report


@pytest.mark.distributed
def test_fsdp2_rl_loop_with_compiled_layers(tmp_path):
    """Each decoder layer under Inductor (then sharded): the trainer's log-probs are still the rollout's."""
    report = _example(tmp_path, 2, "--compile")
    assert report["compile"] and report["compiled_graphs_rank0"] > 0
    assert report["claims"]["the trainer's layers ran as compiled graphs"]
    key = "an eager run ends with the compiled run's master weights and tokens"   # (EAGER_BITS, from torch 2.13)
    assert (report["claims"] if TORCH >= (2, 13) else report["measured_not_claimed"])[key] == (TORCH >= (2, 13))


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("args", [(), ("--compile",)])
def test_fsdp2_rl_loop_on_one_gpu(tmp_path, args):
    assert _example(tmp_path, 1, *args)["device"] == "cuda"


def test_a_plain_trainer_is_copied_and_ties_and_views_are_followed():
    trainer = _model(tie_word_embeddings=True)
    rollout = _model(seed=1, tie_word_embeddings=True)
    assert not _same(_state(trainer), _state(rollout))
    report = sync_weights(trainer, rollout_model(rollout))   # the rollout engine's view: its HF model is synced
    assert _same(_state(trainer), _state(rollout))
    assert rollout.lm_head.weight is rollout.model.embed_tokens.weight   # still tied
    n = len(list(trainer.parameters()))
    assert report["tensors"] == report["plain"] == n and report["unsharded"] == report["gathered"] == 0
    assert report["bytes"] == sum(p.numel() * 2 for p in trainer.parameters())


def test_wrapper_segments_are_dropped_from_the_names():
    trainer, rollout = _model(), _model(seed=1)
    sync_weights(torch.compile(trainer), rollout)   # (names under _orig_mod.; nothing is compiled or run)
    assert _same(_state(trainer), _state(rollout))


@pytest.mark.parametrize("make, fragment", [
    (lambda: _model(torch.float32, seed=1), "rollout parameter model.embed_tokens.weight must be torch.bfloat16, the "
                                            "dtype the trainer computes with, got torch.float32"),
    (lambda: _model(seed=1, num_hidden_layers=1), "missing from the rollout: ['model.layers.1.self_attn.q_proj.weight'"),
    (lambda: _model(seed=1, num_hidden_layers=3), "not in the trainer: ['model.layers.2.self_attn.q_proj.weight'"),
    (lambda: _model(seed=1, intermediate_size=128), "rollout parameter model.layers.0.mlp.gate_proj.weight must have "
                                                    "the trainer's shape [96, 64], got [128, 64]"),
    (lambda: _model(seed=1, tie_word_embeddings=True), "must tie the parameters the trainer ties: trainer none, "
                                                       "rollout {'lm_head.weight': 'model.embed_tokens.weight'}"),
])
def test_a_refused_sync_names_the_problem_and_copies_nothing(make, fragment):
    trainer, rollout = _model(), make()
    before = _state(rollout)
    with pytest.raises(RlkInputError) as e:
        sync_weights(trainer, rollout)
    assert fragment in str(e.value) and str(e.value).startswith("sync_weights: ")
    assert _same(before, _state(rollout))


def test_arguments_that_are_no_rollout_copy_are_refused():
    trainer = _model()
    with pytest.raises(RlkInputError, match="rollout is the trainer itself"):
        sync_weights(trainer, trainer)
    with pytest.raises(RlkInputError, match="rollout must be a torch.nn.Module, got collections.OrderedDict"):
        sync_weights(trainer, trainer.state_dict())
    with pytest.raises(RlkInputError, match="trainer must be a torch.nn.Module, got builtins.str"):
        sync_weights("trainer", trainer)


def _fsdp_pair(rank, world, rollout_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    trainer = _model(torch.float32)
    rollout = _model(rollout_dtype, seed=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(trainer, mesh=mesh, mp_policy=policy)
    return trainer, rollout


def _fsdp_body(rank, world):
    # every rank gets the bf16 rounding of the float32 master weights, whole
    trainer, rollout = _fsdp_pair(rank, world, torch.bfloat16)
    report = sync_weights(trainer, rollout)
    full = _model(torch.float32)   # the same seed: the master weights before sharding
    assert all(torch.equal(rollout.get_parameter(n), p.to(torch.bfloat16)) for n, p in full.named_parameters())
    assert report["unsharded"] == report["tensors"] == len(list(full.parameters())) and report["fsdp_modules"] == 3
    assert all(type(p).__name__ == "DTensor" for p in trainer.parameters())   # resharded after the sync
    # a DTensor parameter outside FSDP (tensor parallel): gathered whole
    from torch.distributed.tensor import Shard, distribute_tensor
    plain, rollout = _model(), _model(seed=1)
    q = plain.model.layers[0].self_attn.q_proj
    want = q.weight.detach().clone()
    q.weight = torch.nn.Parameter(distribute_tensor(q.weight.detach(), trainer.model.embed_tokens.weight.device_mesh,
                                                    placements=[Shard(0)]))
    report = sync_weights(plain, rollout)
    assert report["gathered"] == 1 and torch.equal(rollout.model.layers[0].self_attn.q_proj.weight, want)
    assert _same({k: v for k, v in _state(plain).items() if "layers.0.self_attn.q_proj" not in k},
                 {k: v for k, v in _state(rollout).items() if "layers.0.self_attn.q_proj" not in k})
    # a rank whose rollout computes in float32: every rank raises, naming it, and nothing is copied
    rollout = _model(torch.float32 if rank == 1 else torch.bfloat16, seed=1)
    before = _state(rollout)
    from rlk_ops.distributed.checks import DistributedInputError
    try:
        sync_weights(trainer, rollout)
    except DistributedInputError as e:
        assert "sync_weights: rank 1 rejected its input: rollout parameter model.embed_tokens.weight must be " \
               "torch.bfloat16" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: no error")
    assert _same(before, _state(rollout))




def _hsdp_body(rank, world):
    """FSDP2 over a 2-D (replicate, shard) mesh spanning every rank (HSDP): the verdicts go over the default
    group, and every rank gets the whole compute-dtype weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    trainer, rollout = _model(torch.float32), _model(seed=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(trainer, mesh=mesh, mp_policy=policy)
    report = sync_weights(trainer, rollout)
    full = _model(torch.float32)
    assert report["unsharded"] == report["tensors"] and report["fsdp_modules"] == 1
    assert all(torch.equal(rollout.get_parameter(n), p.to(torch.bfloat16)) for n, p in full.named_parameters())
    bad = _model(torch.float32 if rank == 0 else torch.bfloat16, seed=1)
    from rlk_ops.distributed.checks import DistributedInputError
    try:
        sync_weights(trainer, bad)
    except DistributedInputError as e:
        assert "rank 0 rejected its input" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: no error")





def _tp_body(rank, world):
    """A tensor-parallel attention block (``ParallelQwen3Attention``: DTensor projections over a tp mesh)
    synced into a plain block: the rollout gets the whole weights the sharded block was built from."""
    import copy as _copy

    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import init_block
    from rlk_ops.distributed import ParallelQwen3Attention, init_mesh

    small = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    block = init_block(Qwen3Attention(**small))
    want = {n: p.detach().clone() for n, p in block.named_parameters()}
    pblock = ParallelQwen3Attention(_copy.deepcopy(block), init_mesh(tp=world, cp=1))
    assert any(type(p).__name__ == "DTensor" for p in pblock.parameters())
    rollout = Qwen3Attention(**small)
    report = sync_weights(pblock, rollout)
    assert report["gathered"] > 0 and report["fsdp_modules"] == 0
    assert all(torch.equal(rollout.get_parameter(n), w) for n, w in want.items())


def _meshes_body(rank, world):
    _fsdp_body(rank, world)
    _hsdp_body(rank, world)
    _tp_body(rank, world)


@pytest.mark.distributed
def test_fsdp2_hsdp_and_tensor_parallel_trainers_sync_whole_and_refusals_reach_every_rank():
    """The three bodies above on 2 gloo ranks, in one spawn (each spawn costs its processes' imports)."""
    run_workers(_meshes_body, 2)
