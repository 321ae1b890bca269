"""A transformers Qwen3 training step with rlk attention (rlk_ops.compile.hf.patch_qwen3) and with every
stage on rlk ops (rlk_ops.compile.hf_model.patch_qwen3_model: norms, MLPs and lm_head too) against the
same model on transformers' SDPA attention, in one run on one GPU: step time (forward + backward),
forward time, the loss of each, and whether each lane's gradients are bitwise equal run to run. Each rlk
model runs twice: with the CUDA value checks (the default: ``cu_seqlens`` is read on the host once per
attention call, a sync) and under ``rlk_ops.value_checks(False)``.

    python -m benchmarks.hf_train_step --out results/.../hf_train_step.json [--layers 28 --batch 4 --seq 2048]

(from the repository root)

Random weights in a Qwen3-0.6B shape (hidden 1024, 16/8 heads, head_dim 128, intermediate 3072,
vocab 151936); one sequence per row, no padding; bf16. Between hf_sdpa and rlk only the attention blocks
differ (HF's MLP, norms, embedding and lm_head are the same modules in both); rlk_whole runs the MLPs
(batch-invariant Triton GEMM), norms and lm_head on rlk ops as well."""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def _lane(model, ids, steps, warmup):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    grads = [p.grad.clone() for p in model.parameters()]
    step()
    rerun_equal = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    fwd = []
    with torch.no_grad():
        for i in range(warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(ids, use_cache=False)
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                fwd.append(start.elapsed_time(end))
    return {"step_ms": statistics.median(times), "step_ms_all": times, "forward_ms": statistics.median(fwd),
            "loss": loss.item(), "grads_bitwise_run_to_run": rerun_equal}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", help="also write each lane's top CUDA kernels of one step to this file")
    args = ap.parse_args()
    import transformers

    import rlk_ops
    from rlk_ops.compile.hf import patch_qwen3
    from rlk_ops.compile.hf_model import patch_qwen3_model

    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                   num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                                   head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                   tie_word_embeddings=True, attn_implementation="sdpa")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.Qwen3ForCausalLM(cfg)
    rotary = hf.model.rotary_emb
    inv_freq = rotary.inv_freq.float().clone()
    hf.to(torch.bfloat16)
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()   # (as from_pretrained keeps them)
    rlk = copy.deepcopy(hf)   # (with its own config, which its submodules share: the patch changes it)
    patch_qwen3(rlk)
    whole = patch_qwen3_model(copy.deepcopy(hf))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
    t0 = time.time()
    lanes = {"hf_sdpa": _lane(hf, ids, args.steps, args.warmup), "rlk": _lane(rlk, ids, args.steps, args.warmup)}
    lanes["rlk_whole"] = _lane(whole, ids, args.steps, args.warmup)
    with rlk_ops.value_checks(False):   # cu_seqlens' value check is a host sync per attention call (fwd and bwd)
        lanes["rlk_no_value_checks"] = _lane(rlk, ids, args.steps, args.warmup)
        lanes["rlk_whole_no_value_checks"] = _lane(whole, ids, args.steps, args.warmup)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
        "shape": {"layers": args.layers, "batch": args.batch, "seq": args.seq, "hidden": 1024, "heads": "16/8",
                  "head_dim": 128, "dtype": "bfloat16"},
        "lanes": lanes,
        "rlk_over_hf_step": lanes["rlk"]["step_ms"] / lanes["hf_sdpa"]["step_ms"],
        "rlk_over_hf_forward": lanes["rlk"]["forward_ms"] / lanes["hf_sdpa"]["forward_ms"],
        "rlk_no_value_checks_over_hf_step": lanes["rlk_no_value_checks"]["step_ms"] / lanes["hf_sdpa"]["step_ms"],
        "over_hf_step": {name: lane["step_ms"] / lanes["hf_sdpa"]["step_ms"] for name, lane in lanes.items()},
        "over_hf_forward": {name: lane["forward_ms"] / lanes["hf_sdpa"]["forward_ms"] for name, lane in lanes.items()},
        "wall_s": time.time() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with open(args.profile, "w") as f:
            for name, model, checks in (("hf_sdpa", hf, True), ("rlk", rlk, True), ("rlk_no_value_checks", rlk, False),
                                        ("rlk_whole_no_value_checks", whole, False)):
                with rlk_ops.value_checks(checks), profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model(ids, labels=ids, use_cache=False).loss.backward()
                    torch.cuda.synchronize()
                events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
                total = sum(e.self_device_time_total for e in events)
                f.write(f"== {name}: one step (forward + backward), GPU time {total / 1e3:.1f} ms; kernels by GPU time ==\n")
                for e in events[:20]:
                    f.write(f"{e.device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:110]}\n")
    print(f"{'lane':26} {'step ms':>9} {'fwd ms':>8} {'/ hf step':>9} {'loss':>8}  grads run-to-run")
    for name, lane in lanes.items():
        print(f"{name:26} {lane['step_ms']:9.2f} {lane['forward_ms']:8.2f} {report['over_hf_step'][name]:9.3f} "
              f"{lane['loss']:8.4f}  {'bitwise' if lane['grads_bitwise_run_to_run'] else 'differ'}")


if __name__ == "__main__":
    main()
