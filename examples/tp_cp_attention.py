"""The Qwen3 attention block on a (tp, cp) mesh vs one device: which tensors are bitwise equal.

    torchrun --nproc-per-node 4 examples/tp_cp_attention.py              # 2x2 mesh, gloo on CPU
    torchrun --nproc-per-node 4 examples/tp_cp_attention.py --compile    # also torch.compile(fullgraph)

With GPUs the mesh is on CUDA and the process group uses NCCL (plus gloo for the small
CPU metadata checks). Every rank builds the same block and global packed batch from a
seed, runs it sharded (forward + backward) and as a single process, and compares its
own shards; rank 0 prints one table per sharding mode:

* contiguous and zigzag (default mode): attention out, lse and dQ are claimed
  bitwise equal; the rest is deterministic run to run with its drift shown.
* zigzag with canonical chunks: every tensor is claimed bitwise equal to a
  single-process run with the same chunks.

Exit status 0 iff every claim held on every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: 2 if world >= 2)")
    parser.add_argument("--lengths", default="200,48,136", help="packed sequence lengths (multiples of --chunks)")
    parser.add_argument("--chunks", type=int, default=8, help="canonical token chunks per sequence (0: skip)")
    parser.add_argument("--compile", action="store_true", help="also run torch.compile(fullgraph=True)")
    parser.add_argument("--json", default=None, help="rank 0 writes the comparison here")
    args = parser.parse_args()

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import init_block, packed_batch
    from rlk_ops.distributed import init_mesh
    from rlk_ops.distributed.compare import compare_block

    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tp or (2 if world % 2 == 0 else 1)
    mesh = init_mesh(tp, world // tp, device)
    rank = dist.get_rank()
    config = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32)
    block = init_block(Qwen3Attention(**config, device=device))
    lengths = [int(n) for n in args.lengths.split(",")]
    x, positions, cu_seqlens = packed_batch(lengths, config["hidden_size"], requires_grad=False)
    x, positions = x.to(device), positions.to(device)

    runs = [("contiguous", None), ("zigzag", None)] + ([("zigzag", args.chunks)] if args.chunks else [])
    results = []
    for sharding, chunks in runs:
        results.append(compare_block(block, mesh, x, positions, cu_seqlens, sharding, chunks, compile=args.compile))
        if rank == 0:
            print(results[-1].table(), "\n", flush=True)
    ok = all(r.claims_hold() for r in results)
    if rank == 0:
        print(f"world {world}, device {device}, lengths {lengths}: " + ("ALL CLAIMS HOLD" if ok else "CLAIM FAILED"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([r.to_json() for r in results], f, indent=2)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
