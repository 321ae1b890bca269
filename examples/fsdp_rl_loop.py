"""An RL loop with an FSDP2 trainer and the rlk rollout engine: are their log-probs bitwise equal?

    torchrun --nproc-per-node 2 examples/fsdp_rl_loop.py          # gloo on CPU
    torchrun --nproc-per-node 1 examples/fsdp_rl_loop.py          # on a GPU: NCCL, FA4 and the Triton kernels
    torchrun --nproc-per-node 3 examples/fsdp_rl_loop.py --rollout-ranks 1   # rank 2 only rolls out

Every rank builds the same transformers Qwen3ForCausalLM from a seed, patched whole onto rlk ops
(``patch_qwen3_model``): a trainer sharded with ``fully_shard`` (float32 master weights, bfloat16 compute:
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) and a bfloat16 rollout copy of its own. Each
iteration: ``sync_weights(trainer, rollout)``; the rollout engine generates for this rank's prompts (chunked
prefill, paged decode, continuous batching, seeded sampling); the trainer's forward (FSDP, packed,
transformers' own call) scores the same tokens through the differentiable ``token_logprobs``; a PPO-style
loss (advantage times the importance ratio exp(logp - rollout logp)), backward, AdamW step. Claimed, on
every rank and every iteration: each generated token's log-prob is bitwise the rollout's, so the ratio is
exactly 1 (torch.log_softmax's log-probs are counted beside, for contrast). Controls: after
the last step a rollout left unsynced disagrees with the trainer; a second run from the same seeds ends
with bitwise the same master weights. Rank 0 prints a table; exit status 0 iff every claim held.
``--rollout-ranks N``: the last N ranks are rollout workers in their own processes (an engine apart from
the trainer, as RL systems run one): each iteration the trainer ranks ``send_weights`` to them (rank 0
broadcasts over a group of itself and the workers) and they send the sequences back; claimed besides: the
colocated loop on the trainer ranks ends with bitwise the same master weights and tokens.
``--compile``: each decoder layer runs under torch.compile (Inductor, ``EAGER_BITS``), then is sharded; a
third run, eager, is compared with the compiled one (claimed from torch 2.13: compiling changes no bit of
training; on older torch shown, not claimed).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


# compiled with EAGER_BITS, the trainer's gradients are eager's from torch 2.13 (on 2.11 the first layer's differ)
_EAGER_BITS_HOLD = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def build(device: str, seed: int):
    """(trainer: float32, patched whole; rollout view of a bfloat16 copy)."""
    import transformers

    from rlk_ops.compile.hf_model import patch_qwen3_model, rollout_model

    big = device == "cuda"   # head_dim 128: FA4's tiles on SM90
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=256 if big else 64, intermediate_size=192,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=128 if big else 16, max_position_embeddings=512, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).to(device)
    with torch.no_grad():   # norm weights off 1, so a norm that went missing would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    rollout = copy.deepcopy(model)
    rollout.to(torch.bfloat16)
    return patch_qwen3_model(model), rollout_model(patch_qwen3_model(rollout))


def shard(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def trainer_logprobs(trainer, results, device, grad: bool):
    """The trainer's forward over the rollout's sequences, packed: (log-probs of the generated tokens
    through ``completion_logprobs``, differentiable [N]; the same through torch.log_softmax, for contrast [N])."""
    from rlk_ops.compile.hf_model import hf_logits
    from rlk_ops.rollout.scoring import completion_logprobs, pack

    batch = pack([r.tokens for r in results], [len(r.prompt) for r in results], device)
    with torch.set_grad_enabled(grad):
        logits = hf_logits(trainer, batch.tokens, batch.positions, batch.cu_seqlens)
        logp = completion_logprobs(logits, batch)
    plain = torch.log_softmax(logits.detach()[batch.rows].float(), -1).gather(-1, batch.targets[:, None]).squeeze(-1)
    return logp, plain


def rollout(lm, rank: int, iteration: int, device: str, seed: int):
    from rlk_ops.rollout.demo import make_requests
    from rlk_ops.rollout.engine import RolloutEngine, Sampler, cache_for

    requests = make_requests(3, lm.config.vocab_size, seed=1000 * seed + 10 * iteration + rank, min_prompt=5,
                             max_prompt=40, min_new=4, max_new=9)
    engine = RolloutEngine(lm, cache_for(lm, requests, page_size=16, max_running=2, device=device, seed=seed),
                           max_running=2, chunk=16, sampler=Sampler(seed + iteration))
    with torch.inference_mode():
        return engine.run(requests)


def make_trainer(trainer, mesh, compile: bool):
    """Shards the trainer over ``mesh`` (each decoder layer first under Inductor with ``compile``); returns it
    and its AdamW."""
    if compile:   # each decoder layer under Inductor, then sharded (torchtitan's order); EAGER_BITS: Inductor
        from rlk_ops.compile.hf_model import EAGER_BITS   # rounds where eager does, so gradients are eager's

        for layer in trainer.model.layers:
            layer.compile(dynamic=True, options=EAGER_BITS)
    trainer = shard(trainer, mesh)
    return trainer, torch.optim.AdamW(trainer.parameters(), lr=3e-2, weight_decay=0.0)


def train_step(trainer, opt, results, device: str, iteration: int, sync: dict) -> dict:
    """Scores the rollout's sequences with the trainer, steps a PPO-style loss; the iteration's row."""
    from rlk_ops.meta.drift import bits_differ

    roll = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float32)
    logp, plain = trainer_logprobs(trainer, results, device, grad=True)
    advantage = torch.tensor([(-1.0) ** r.seq_id * 0.5 for r in results for _ in r.generated], device=device)
    ratio = torch.exp(logp - roll.to(device))   # PPO's importance ratio: exactly 1 on-policy
    loss = -(advantage * ratio).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"iteration": iteration, "tokens": int(roll.numel()),
            "mismatched": int(bits_differ(roll, logp.detach().cpu()).sum()),
            "ratio_not_1": int((ratio.detach() != 1).sum()),
            "mismatched_torch_log_softmax": int(bits_differ(roll, plain.cpu()).sum()),
            "synced_tensors": sync["tensors"], "synced_bytes": sync["bytes"],
            "unsharded": sync.get("unsharded", 0), "loss": float(loss.detach())}


def finish(trainer, results, device: str, rows: list) -> dict:
    """The control (the last rollout, not synced since the step, scored again) and the master weights."""
    from rlk_ops.meta.drift import bits_differ

    roll = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float32)
    logp, _ = trainer_logprobs(trainer, results, device, grad=False)
    master = [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
              for p in trainer.parameters()]
    return {"rows": rows, "stale_mismatched": int(bits_differ(roll, logp.cpu()).sum()),
            "stale_tokens": int(roll.numel()), "master": master}


def loop(mesh, device: str, iterations: int, seed: int, compile: bool = False) -> dict:
    """Colocated: every rank trains (its shard) and rolls out its own prompts on its own rollout copy."""
    from rlk_ops.rollout.weights import sync_weights

    trainer, lm = build(device, seed)
    trainer, opt = make_trainer(trainer, mesh, compile)
    rows = []
    for it in range(iterations):
        sync = sync_weights(trainer, lm)
        results = rollout(lm, dist.get_rank(), it, device, seed)
        rows.append(train_step(trainer, opt, results, device, it, sync))
    return finish(trainer, results, device, rows)


@dataclass
class Sequence:
    """What a rollout worker sends a trainer rank back for one request (no attention traces)."""
    seq_id: int
    prompt: list
    generated: list
    logprobs: list

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated


def loop_disaggregated(mesh, wire, trainers: int, device: str, iterations: int, seed: int,
                       compile: bool = False) -> dict:
    """Ranks [0, trainers) train; the others only roll out, on their own model, which they receive from
    the trainer each iteration (``send_weights``/``receive_weights`` over ``wire``: rank 0 and the rollout
    ranks). Rollout rank j generates trainer rank i's prompts for every i with i % (rollout ranks) == j and
    sends the sequences back (one all_gather_object)."""
    from rlk_ops.rollout.weights import receive_weights, send_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    trainer, lm = build(device, seed)
    if rank < trainers:
        trainer, opt = make_trainer(trainer, mesh, compile)
    rows, results = [], []
    for it in range(iterations):
        if rank < trainers:
            sync = send_weights(trainer, src=0, group=wire)
        else:
            sync = receive_weights(lm, src=0, group=wire)
        mine = {i: [Sequence(r.seq_id, r.prompt, r.generated, r.logprobs) for r in rollout(lm, i, it, device, seed)]
                for i in range(trainers) if rank >= trainers and i % (world - trainers) == rank - trainers}
        bundles = [None] * world
        dist.all_gather_object(bundles, mine)
        if rank < trainers:
            results = next(b[rank] for b in bundles if rank in b)
            rows.append(train_step(trainer, opt, results, device, it, sync))
        else:   # (a row of zeros: the claims sum over every rank)
            rows.append({"iteration": it, "tokens": 0, "mismatched": 0, "ratio_not_1": 0,
                         "mismatched_torch_log_softmax": 0, "synced_tensors": sync["tensors"],
                         "synced_bytes": sync["bytes"], "unsharded": 0, "loss": 0.0})
    if rank < trainers:
        return finish(trainer, results, device, rows)
    return {"rows": rows, "stale_mismatched": 0, "stale_tokens": 0, "master": []}


def _sum(values: list[int], device: str) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="each trainer layer under torch.compile (Inductor, "
                        "EAGER_BITS), and an eager run compared with it")
    parser.add_argument("--rollout-ranks", type=int, default=0, help="the last N ranks only roll out, in their own "
                        "processes: the trainer sends them its weights each iteration (send_weights) and they send "
                        "the sequences back; compared with the colocated loop on the trainer ranks")
    parser.add_argument("--json", default=None, help="rank 0 writes the table's numbers here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = world - args.rollout_ranks
    if not 0 <= args.rollout_ranks < world:
        parser.error(f"--rollout-ranks must be in [0, {world}) (the world size {world}; one rank at least trains), "
                     f"got {args.rollout_ranks}")
    if args.rollout_ranks:
        from torch.distributed.device_mesh import DeviceMesh

        trainer_group = dist.new_group(list(range(trainers)))   # (every rank creates every group)
        wire = dist.new_group([0, *range(trainers, world)])
        mesh = DeviceMesh.from_group(trainer_group, device) if rank < trainers else None

        def run(compile: bool) -> dict:
            return loop_disaggregated(mesh, wire, trainers, device, args.iterations, args.seed, compile)
    else:
        mesh = init_device_mesh(device, (world,))

        def run(compile: bool) -> dict:
            return loop(mesh, device, args.iterations, args.seed, compile)
    first = run(args.compile)
    again = run(args.compile)

    def agree(a, b) -> list[int]:   # [ranks with the same master weights, ranks with the same rows]
        same_master = all(torch.equal(x, y) for x, y in zip(a["master"], b["master"]))
        return _sum([int(same_master), int(a["rows"] == b["rows"])], device)

    rerun = agree(first, again)
    per_it = [_sum([r["tokens"], r["mismatched"], r["ratio_not_1"], r["mismatched_torch_log_softmax"]], device)
              for r in first["rows"]]
    stale = _sum([first["stale_tokens"], first["stale_mismatched"]], device)
    claims = {
        "rollout == trainer, every iteration, every rank": all(m == 0 for _, m, _, _ in per_it),
        "the importance ratio is exactly 1 on every token": all(r == 0 for _, _, r, _ in per_it),
        "an unsynced rollout disagrees after the step (control)": stale[1] > 0,
        "a second run ends with the same master weights on every rank": rerun[0] == world,
        "a second run generates the same tokens with the same counts": rerun[1] == world,
    }
    measured = {}
    if args.rollout_ranks:   # the same trainer ranks rolling out themselves: the same weights and sequences
        coloc = loop(mesh, device, args.iterations, args.seed, args.compile) if rank < trainers else first
        claims["the colocated loop on the trainer ranks ends with the same master weights and tokens"] = \
            agree(first, coloc) == [world, world]
    if args.compile:   # compiled (EAGER_BITS) against an eager run: claimed from torch 2.13 (tests/test_hf_model.py)
        eager = agree(first, run(False))
        key = "an eager run ends with the compiled run's master weights and tokens"
        if _EAGER_BITS_HOLD:
            claims[key] = eager == [world, world]
        else:
            measured[key] = eager == [world, world]
    graphs = 0
    if args.compile:   # (else the claims could hold on layers that fell back to eager)
        from torch._dynamo.utils import counters
        graphs = int(counters["stats"]["unique_graphs"])
        claims["the trainer's layers ran as compiled graphs"] = \
            _sum([int(graphs > 0 and rank < trainers)], device)[0] == trainers   # (a rollout worker compiles nothing)
    if rank == 0:
        print(f"FSDP2 trainer (float32 master, bfloat16 compute{', torch.compile' if args.compile else ''}) vs rlk "
              f"rollout: world {world}, device {device}, {args.iterations} iterations"
              + (f"; ranks {list(range(trainers, world))} only roll out (weights sent to them)" if args.rollout_ranks else ""))
        print(f"{'iteration':>9} {'tokens':>7} {'mismatched':>10} {'ratio != 1':>10} {'torch.log_softmax':>17} "
              f"{'synced tensors':>14} {'synced bytes':>12}")
        for r, (tokens, bad, ratio, bad_torch) in zip(first["rows"], per_it):
            print(f"{r['iteration']:>9} {tokens:>7} {bad:>10} {ratio:>10} {bad_torch:>17} {r['synced_tensors']:>14} "
                  f"{r['synced_bytes']:>12}")
        print("(mismatched: the trainer's differentiable log-probs (token_logprobs) against the rollout's, bitwise; "
              "torch.log_softmax: how many would mismatch computed that way)")
        print(f"control: the last rollout, not synced after the step: {stale[1]} of {stale[0]} tokens mismatched")
        for claim, held in claims.items():
            print(f"{'yes' if held else 'NO ':>4}  {claim}")
        for what, held in measured.items():
            print(f"{'yes' if held else 'no':>4}  {what} (not claimed on torch {torch.__version__}: Inductor's "
                  f"emulate_precision_casts rounds the residual stream's gradients as eager from torch 2.13)")
        print("ALL CLAIMS HOLD" if all(claims.values()) else "A CLAIM FAILED")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "rollout_ranks": args.rollout_ranks, "device": device,
                           "iterations": args.iterations, "seed": args.seed,
                       "compile": args.compile, "compiled_graphs_rank0": graphs,
                           "per_iteration": [dict(r, tokens=t, mismatched=b, ratio_not_1=q, mismatched_torch_log_softmax=bt)
                                             for r, (t, b, q, bt) in zip(first["rows"], per_it)],
                           "stale": {"tokens": stale[0], "mismatched": stale[1]},
                           "claims": claims, "measured_not_claimed": measured, "torch": torch.__version__}, f,
                          indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(claims.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
