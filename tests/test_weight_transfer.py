"""rlk_ops.rollout.weights.send_weights / receive_weights: the trainer's compute weights to rollout models in
other processes, and the RL loop with its rollout worker in its own process (examples/fsdp_rl_loop.py
--rollout-ranks). Multi-process bodies are merged where they can share a spawn (each spawn costs its
processes' imports: this file was make test's longest, split from test_weight_sync.py in session 47)."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

from dist_utils import run_workers  # noqa: E402
from test_weight_sync import ROOT, _example, _model, _same, _state  # noqa: E402

from rlk_ops.compile.hf_model import rollout_model  # noqa: E402
from rlk_ops.ops._validate import RlkInputError  # noqa: E402
from rlk_ops.rollout.weights import receive_weights, send_weights, sync_weights  # noqa: E402


def _expect_refusal(fn, fragment, rank):
    from rlk_ops.distributed.checks import DistributedInputError
    try:
        fn()
    except DistributedInputError as e:
        assert fragment in str(e), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: no error")


def _sender_body(rank, world):
    """Ranks 0 and 1 train (FSDP2 over their own mesh, float32 master, bfloat16 compute), rank 2 is a rollout
    worker: it receives the bf16 rounding of the master weights, byte for byte, over a group of {0, 2} and
    over the default group (where trainer rank 1 takes the values in and drops them); refusals (a float32
    rollout, a source the ranks disagree on) raise on all three ranks, naming the problem, and change no
    model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    trainer_group, wire_group = dist.new_group([0, 1]), dist.new_group([0, 2])   # (every rank creates both)
    full = _model(torch.float32)
    want = {n: p.to(torch.bfloat16) for n, p in full.named_parameters()}
    if rank < 2:
        trainer = _model(torch.float32)
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in trainer.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(trainer, mesh=mesh, mp_policy=policy)
        for group in (wire_group, None):
            report = send_weights(trainer, src=0, group=group)
            assert report["unsharded"] == report["tensors"] == len(want) and report["fsdp_modules"] == 3
            assert all(type(p).__name__ == "DTensor" for p in trainer.parameters())   # resharded after
        _expect_refusal(lambda: send_weights(trainer, src=0, group=wire_group),
                        "rollout parameter model.embed_tokens.weight must be torch.bfloat16", rank)
        _expect_refusal(lambda: send_weights(trainer, src=0, group=wire_group), "was given src=1", rank)
    else:
        for group in (wire_group, None):
            rollout = _model(seed=1)
            report = receive_weights(rollout_model(rollout) if group is None else rollout, src=0, group=group)
            assert report["tensors"] == len(want)
            assert all(torch.equal(rollout.get_parameter(n), w) for n, w in want.items())
        bad = _model(torch.float32, seed=1)
        before = _state(bad)
        _expect_refusal(lambda: receive_weights(bad, src=0, group=wire_group),
                        "rank 2 (receive_weights): rollout parameter model.embed_tokens.weight must be torch.bfloat16",
                        rank)
        assert _same(before, _state(bad))
        before = _state(rollout)
        _expect_refusal(lambda: receive_weights(rollout, src=1, group=wire_group), "was given src=", rank)
        assert _same(before, _state(rollout))




def _plain_sender_body(rank, world):
    """A one-process trainer (no DTensors: rank 0 alone sends) with tied embeddings, to a rollout rank: the
    values arrive bitwise in the trainer's dtype and the tie is followed (checked against the manifest: an
    untied rollout is refused on both ranks); a second trainer rank with a plain model is refused."""
    trainer = _model(torch.float32, tie_word_embeddings=True)
    if rank == 0:
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.25)
        report = send_weights(trainer, src=0)
        assert report["plain"] == report["tensors"] and report["fsdp_modules"] == 0
        _expect_refusal(lambda: send_weights(trainer, src=0), "the rollout model must tie the parameters", rank)
    else:
        rollout = _model(torch.float32, seed=3, tie_word_embeddings=True)
        report = receive_weights(rollout, src=0)
        shifted = {n: p + 0.25 for n, p in trainer.named_parameters()}
        assert all(torch.equal(rollout.get_parameter(n), w) for n, w in shifted.items())
        assert rollout.lm_head.weight is rollout.model.embed_tokens.weight
        untied = _model(torch.float32, seed=3, tie_word_embeddings=False)
        _expect_refusal(lambda: receive_weights(untied, src=0), "the rollout model must tie the parameters", rank)




def _two_senders_body(rank, world):
    """Both ranks call send_weights with a plain trainer: rank 1 is no source and no FSDP rank, and nobody
    receives; every rank is told, none waits."""
    _expect_refusal(lambda: send_weights(_model(), src=0), "rank 1 calls send_weights too", rank)


def _two_ranks_body(rank, world):
    _plain_sender_body(rank, world)
    _two_senders_body(rank, world)


@pytest.mark.distributed
def test_a_one_process_trainer_sends_ties_and_bits_and_two_senders_are_refused():
    run_workers(_two_ranks_body, 2)


def test_send_and_receive_need_torch_distributed(monkeypatch):
    from rlk_ops.distributed.checks import DistributedInputError
    # (another test in this worker process may have left a process group: CI's loadfile workers run many files)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(DistributedInputError, match="send_weights: torch.distributed is not initialized"):
        send_weights(_model(), src=0)
    with pytest.raises(DistributedInputError, match="receive_weights: torch.distributed is not initialized"):
        receive_weights(_model(), src=0)
    with pytest.raises(RlkInputError, match="receive_weights: rollout must be a torch.nn.Module, got builtins.dict"):
        receive_weights({}, src=0)


def _hsdp_sender_body(rank, world):
    """An HSDP trainer (FSDP2 over a (1, 2) mesh of ranks 0-1) beside a rollout worker (rank 2): its mesh is
    2-D and spans 2 of the 3 ranks (refused until session 47); sync_weights on the trainer ranks and
    send_weights to rank 2 give the bf16 rounding of the master weights, and a refusal on rank 1 reaches
    rank 0 and the worker."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("replicate", "shard"))   # (every rank)
    wire = dist.new_group([0, 2])
    want = {n: p.to(torch.bfloat16) for n, p in _model(torch.float32).named_parameters()}
    if rank < 2:
        trainer = _model(torch.float32)
        fully_shard(trainer, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        rollout = _model(seed=1)
        assert sync_weights(trainer, rollout)["unsharded"] == len(want)
        assert all(torch.equal(rollout.get_parameter(n), w) for n, w in want.items())
        send_weights(trainer, src=0, group=wire)
        bad = _model(torch.float32 if rank == 1 else torch.bfloat16, seed=1)
        _expect_refusal(lambda: sync_weights(trainer, bad), "sync_weights: rank 1 rejected its input: rollout "
                        "parameter model.embed_tokens.weight must be torch.bfloat16", rank)
        import rlk_ops.rollout.weights as W
        plan = W._plan
        if rank == 1:   # a problem on trainer rank 1 alone, outside the wire group
            W._plan = lambda *a: (_ for _ in ()).throw(RuntimeError("no plan here"))
        try:
            _expect_refusal(lambda: send_weights(trainer, src=0, group=wire),
                            "send_weights: rank 1 rejected its input: RuntimeError: no plan here", rank)
        finally:
            W._plan = plan
    else:
        rollout = _model(seed=1)
        receive_weights(rollout, src=0, group=wire)
        assert all(torch.equal(rollout.get_parameter(n), w) for n, w in want.items())
        _expect_refusal(lambda: receive_weights(rollout, src=0, group=wire),
                        "send_weights: rank 1 rejected its input: RuntimeError: no plan here", rank)


def _three_ranks_body(rank, world):
    _sender_body(rank, world)
    _hsdp_sender_body(rank, world)


@pytest.mark.distributed
def test_fsdp2_and_hsdp_trainers_send_their_compute_weights_to_a_rollout_process():
    run_workers(_three_ranks_body, 3)


def test_a_world_of_one_has_no_receiver(single_process_group):
    """One process: send_weights finds nobody calling receive_weights, and says so (no wait)."""
    from rlk_ops.distributed.checks import DistributedInputError
    with pytest.raises(DistributedInputError, match=r"send_weights: no rank of the group \[0\] calls receive_weights"):
        send_weights(_model(), src=0)
    with pytest.raises(DistributedInputError, match=r"the trainer has no DTensor parameters, so it is one process, "
                                                    r"src=1; rank 0 calls send_weights too"):
        send_weights(_model(), src=1)


@pytest.mark.distributed
def test_the_weight_transfer_benchmark_runs_and_delivers_the_bits(tmp_path):
    """benchmarks/weight_transfer.py on a small model (one FSDP2 rank and the worker: the committed timing ran
    two and the worker): both kinds of transfer leave the worker holding the bf16 master weights, bitwise."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "wt.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "-m", "benchmarks.weight_transfer", "--layers", "1", "--hidden", "128",
           "--vocab", "512", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bitwise"] == {"checked": True, "bare": True} and report["tensors"] == 14   # (1 layer: 11; embedding, norm, lm_head)


@pytest.mark.distributed
def test_fsdp2_rl_loop_with_a_rollout_worker_in_its_own_process(tmp_path):
    """Ranks 0-1 train, rank 2 only rolls out on weights it receives (send_weights/receive_weights) and sends
    the sequences back: the log-probs still agree bitwise, and the colocated loop on ranks 0-1 (sync_weights,
    each rank rolling out itself: the example's default mode, run inside this one) ends with the same master
    weights and tokens (a receiver that drops the values fails that claim and the first)."""
    report = _example(tmp_path, 3, "--rollout-ranks", "1")
    assert report["world"] == 3 and report["rollout_ranks"] == 1 and report["device"] == "cpu"
    # the contrast: torch.log_softmax of the same logits would have mismatched some tokens
    assert sum(r["mismatched_torch_log_softmax"] for r in report["per_iteration"]) > 0
    assert report["claims"]["the colocated loop on the trainer ranks ends with the same master weights and tokens"]
