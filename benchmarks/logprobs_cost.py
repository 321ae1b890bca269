"""What the rollout's log-prob arithmetic costs a trainer: ``token_logprobs`` (rlk_model::token_logprobs, the
rollout engine's bits: on the CPU reference path for CPU logits, the Triton kernel of kernels/triton/logprobs.py
for CUDA ones) against ``torch.log_softmax`` + gather, forward and
backward, on the logits' own device; the rollout engine's per-step ``log_softmax`` (rows to the host) against
torch.log_softmax and the copy. Also the embedding op's backward against ``nn.Embedding``'s.

    python -m benchmarks.logprobs_cost [--device cuda] [--out results/.../logprobs_cost.json]

Times are the median of ``--repeats`` runs (CUDA: synchronised), each in milliseconds; ratios are rlk over torch,
from the same run, interleaved.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import rlk_ops.rollout.glue  # noqa: F401 (registers the rlk_model ops)
from rlk_ops.rollout.model import RlkEmbedding, log_softmax, token_logprobs


def _time(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _pair(a, b, device: str, repeats: int) -> tuple[float, float]:
    a(), b()   # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(_time(a, device))
        tb.append(_time(b, device))
    return statistics.median(ta), statistics.median(tb)


def logprobs(rows: int, vocab: int, device: str, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    z0 = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(device)
    tokens = torch.randint(0, vocab, (rows,), generator=g).to(device)

    def rlk():
        z = z0.detach().requires_grad_(True)
        token_logprobs(z, tokens).sum().backward()

    def plain():
        z = z0.detach().requires_grad_(True)
        torch.log_softmax(z.float(), -1).gather(-1, tokens[:, None]).sum().backward()

    t_rlk, t_torch = _pair(rlk, plain, device, repeats)
    return {"rows": rows, "vocab": vocab, "rlk_ms": round(t_rlk, 3), "torch_ms": round(t_torch, 3),
            "ratio": round(t_rlk / t_torch, 2)}


def engine_log_softmax(rows: int, vocab: int, device: str, repeats: int) -> dict:
    """A rollout step's log-probs, as the engine reads them (the rows on the host for its sampler):
    ``rollout.model.log_softmax`` against torch.log_softmax then the copy."""
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).to(device)
    t_rlk, t_torch = _pair(lambda: log_softmax(z), lambda: torch.log_softmax(z.float(), -1).cpu(), device, repeats)
    return {"rows": rows, "vocab": vocab, "rlk_ms": round(t_rlk, 3), "torch_ms": round(t_torch, 3),
            "ratio": round(t_rlk / t_torch, 2)}


def embedding(tokens: int, vocab: int, dim: int, device: str, repeats: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    ref = torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16, device=device)
    emb = RlkEmbedding.sharing(ref)
    dout = torch.randn(tokens, dim, generator=g).to(torch.bfloat16).to(device)

    def run(m):
        def f():
            ref.weight.grad = None
            m(ids).backward(dout)
        return f

    t_rlk, t_torch = _pair(run(emb), run(ref), device, repeats)
    return {"tokens": tokens, "vocab": vocab, "dim": dim, "rlk_ms": round(t_rlk, 3), "torch_ms": round(t_torch, 3),
            "ratio": round(t_rlk / t_torch, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "token_logprobs_fwd_bwd": [logprobs(r, v, args.device, args.repeats)
                                         for r, v in ((256, 32768), (256, 151936), (1024, 151936))],
              "engine_log_softmax": [engine_log_softmax(r, 151936, args.device, args.repeats) for r in (1, 64)],
              "embedding_fwd_bwd": [embedding(t, 151936, 1024, args.device, args.repeats)
                                    for t in (1024, 8192)]}
    print(f"{'':<26} {'shape':>22} {'rlk ms':>9} {'torch ms':>9} {'ratio':>6}")
    for r in report["token_logprobs_fwd_bwd"]:
        print(f"{'token_logprobs fwd+bwd':<26} {str((r['rows'], r['vocab'])):>22} {r['rlk_ms']:>9} {r['torch_ms']:>9} "
              f"{r['ratio']:>6}")
    for r in report["engine_log_softmax"]:
        print(f"{'engine log_softmax (host)':<26} {str((r['rows'], r['vocab'])):>22} {r['rlk_ms']:>9} {r['torch_ms']:>9} "
              f"{r['ratio']:>6}")
    for r in report["embedding_fwd_bwd"]:
        print(f"{'embedding fwd+bwd':<26} {str((r['tokens'], r['vocab'], r['dim'])):>22} {r['rlk_ms']:>9} "
              f"{r['torch_ms']:>9} {r['ratio']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
