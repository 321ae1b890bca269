"""What the checks of ``send_weights``/``receive_weights`` cost against the bare transfer, in one run.

    torchrun --nproc-per-node 3 -m benchmarks.weight_transfer [--out results/.../weight_transfer.json]

The last rank is a rollout worker; the others train a transformers Qwen3ForCausalLM sharded with FSDP2
(float32 master, bfloat16 compute). Each repeat times, interleaved:

* ``checked``: ``send_weights`` on the trainer ranks, ``receive_weights`` on the worker (the roles and sources
  exchanged, the manifest sent and checked, the verdicts gathered, then every value);
* ``bare``: the same values in the same order (``weights._values``: FSDP2's unshard, reshard), each broadcast
  as bytes into the worker's parameters, nothing exchanged or checked first.

Times are the worker's wall clock from a barrier to the end of its last receive, the median of ``--repeats``;
the ratio is checked over bare. The worker's parameters are compared with the bfloat16 rounding of the master
weights after each kind (bitwise). Rank 0 of the trainers sends (over a group of it and the worker).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _model(dtype, layers: int, hidden: int, vocab: int):
    import transformers

    from rlk_ops.compile.hf_model import patch_qwen3_model

    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                   num_key_value_heads=max(1, hidden // 256), head_dim=64,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   attn_implementation="sdpa")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(0)
    return patch_qwen3_model(transformers.Qwen3ForCausalLM(cfg).to(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = world - 1
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from rlk_ops.rollout import weights as W

    trainer_group, wire = dist.new_group(list(range(trainers))), dist.new_group([0, trainers])
    master = _model(torch.float32, args.layers, args.hidden, args.vocab)
    want = {n: p.detach().to(torch.bfloat16) for n, p in master.named_parameters()}
    if rank < trainers:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        for layer in master.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        model = fully_shard(master, mesh=mesh, mp_policy=policy)
        params = W._parameters(model)[0]
        plan = W._plan(model, params)
    else:
        model = _model(torch.bfloat16, args.layers, args.hidden, args.vocab)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        order: list[str] = []

    def checked():
        if rank < trainers:
            W.send_weights(model, src=0, group=wire)
        else:
            W.receive_weights(model, src=0, group=wire)

    def bare():
        if rank < trainers:
            for name, value, _ in W._values(plan, params):
                if name is not None and rank == 0:
                    dist.broadcast(W._as_bytes(value.detach().contiguous()), src=0, group=wire)
        else:
            for name in order:
                dist.broadcast(W._as_bytes(model.get_parameter(name).data), src=0, group=wire)

    if rank < trainers:
        sent = W._plan_names(plan)
        if rank == 0:
            dist.send_object_list([sent], dst=trainers)
    else:
        got = [None]
        dist.recv_object_list(got, src=0)   # the plan's order, told once, outside the timing
        order[:] = got[0]

    times = {"checked": [], "bare": []}
    same = {"checked": True, "bare": True}
    for i in range(args.repeats + 1):
        for kind, fn in (("checked", checked), ("bare", bare)):
            if rank == trainers:
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
            dist.barrier()
            t = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t
            if rank == trainers:
                same[kind] &= all(torch.equal(model.get_parameter(n), w) for n, w in want.items())
                if i:   # (the first repeat warms up)
                    times[kind].append(elapsed * 1e3)
    if rank == trainers:
        nbytes = sum(w.numel() * w.element_size() for w in want.values())
        report = {"world": world, "trainer_ranks": trainers, "backend": "gloo", "torch": torch.__version__,
                  "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "tensors": len(want),
                  "bytes": nbytes, "repeats": args.repeats,
                  "checked_ms": round(statistics.median(times["checked"]), 2),
                  "bare_ms": round(statistics.median(times["bare"]), 2),
                  "bitwise": same}
        report["ratio"] = round(report["checked_ms"] / report["bare_ms"], 3)
        print(f"{len(want)} tensors, {nbytes / 2**20:.1f} MiB bf16, {trainers} FSDP2 ranks -> 1 worker (gloo): "
              f"checked {report['checked_ms']} ms, bare {report['bare_ms']} ms, ratio {report['ratio']}; "
              f"worker bitwise the bf16 master: {same}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
