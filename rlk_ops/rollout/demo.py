"""The train-vs-rollout bitwise check (``python -m rlk_ops demo``, ``make demo``).

1. Rollout: a small Qwen3-style model (random weights from a seed) serves B requests
   with different prompt lengths: chunked prefill (chunk not a multiple of 128), then
   decode with continuous batching (at most ``max_running`` at once; sequences finish
   at different steps and waiting ones join), pages handed out from a shuffled free
   list. Every generated token's log-prob is recorded, with each layer's attention
   output and LSE for every processed position.
2. Training: the same token sequences re-scored in ONE packed, teacher-forced varlen
   forward (optionally followed by a backward, twice, to show its gradients are
   run-to-run deterministic).
3. Comparison: every generated token's rollout log-prob vs training log-prob, bitwise;
   per-layer attention out / LSE; drift statistics.
4. Negative control, same run: the rollout replayed on the same tokens through a plain
   PyTorch path (rollout/plain.py). It must show mismatches: proof that the check can fail.
"""
from __future__ import annotations

import sys
import time

import torch

import rlk_ops
from rlk_ops.meta import binding, provenance
from rlk_ops.meta.contract import AttentionContract, SplitKVPolicy
from rlk_ops.meta.drift import bits_differ, drift_stats
from rlk_ops.ops._validate import positive_ints
from rlk_ops.rollout.engine import Request, RolloutEngine, Sampler, cache_for
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config, Trace, compiled_rollout
from rlk_ops.rollout.scoring import PackedBatch, completion_logprobs, pack, split
from rlk_ops.rollout.plain import plain_forward_rollout, plain_log_softmax


class Progress:
    def __init__(self, total: int, label: str, stream=sys.stderr, enabled: bool = True):
        self.total, self.done, self.label, self.stream, self.enabled = total, 0, label, stream, enabled
        self._last = -1

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if not self.stream.isatty():  # logs: one line when the phase is done
            if self.done == self.total:
                self.stream.write(f"{self.label}: {self.done}/{self.total} tokens\n")
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        if filled != self._last or self.done == self.total:
            self._last = filled
            end = "\n" if self.done >= self.total else ""
            self.stream.write(f"\r{self.label:<22} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}{end}")
            self.stream.flush()


def make_requests(n: int, vocab: int, seed: int, min_prompt: int = 20, max_prompt: int = 200,
                  min_new: int = 8, max_new: int = 16) -> list[Request]:
    g = torch.Generator().manual_seed(seed + 17)
    reqs = []
    for i in range(n):
        plen = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=g))
        new = int(torch.randint(min_new, max_new + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        reqs.append(Request(i, prompt, new))
    return reqs


def _batch(results, device) -> PackedBatch:
    """Every sequence's tokens but the last generated one (which the rollout never fed back), packed, with
    the rows that predict its generated tokens (``scoring.pack``)."""
    return pack([r.tokens for r in results], [len(r.prompt) for r in results], device)


def rescore(model: TinyQwen3, results, device) -> tuple[list[torch.Tensor], Trace, list[int]]:
    """One packed teacher-forced forward over every sequence (all tokens but the last
    generated one, which the rollout never fed back). Returns per-sequence log-probs
    of the generated tokens, the trace, and each sequence's start row."""
    batch = _batch(results, device)
    trace = Trace()
    with torch.no_grad():
        logits = model.forward_train(batch.tokens, batch.positions, batch.cu_seqlens, batch.longest, trace=trace)
    return split(completion_logprobs(logits, batch).cpu(), batch), trace, list(batch.starts)


def _hf_forward_check(model, results, device) -> dict:
    """The trainer's own call on an HF model (``compile/hf_model.py``): transformers' forward of the
    patched model over the same packed batch; its log-probs of the generated tokens against the rollout's,
    bitwise."""
    from rlk_ops.compile.hf_model import hf_logits

    batch = _batch(results, device)
    with torch.no_grad():
        logps = completion_logprobs(hf_logits(model.hf_model, batch.tokens, batch.positions, batch.cu_seqlens),
                                    batch).cpu()
    roll = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float32)
    return {"tokens": int(logps.numel()), "mismatched_tokens": int(bits_differ(roll, logps).sum()),
            "path": "transformers' Qwen3ForCausalLM.forward (patched by patch_qwen3_model), packed padding-free "
                    "(cu_seq_lens_q / cu_seq_lens_k), vs the rlk rollout"}


def _compare(results, train_logps, trace, starts, num_layers):
    """Bitwise comparison of every generated token's log-prob and every position's
    per-layer attention (out, lse); drift statistics."""
    roll_lp = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float32)
    train_lp = torch.cat(train_logps)
    # bits, not values: a rollout -0.0 beside a training +0.0 is a mismatch, two NaNs of one payload are
    # not (a session 34 audit)
    bad_tokens = int(bits_differ(roll_lp, train_lp).sum())
    r_out, t_out, r_lse, t_lse = [], [], [], []
    for r, st in zip(results, starts):
        positions = sorted(r.attn)
        for layer in range(num_layers):
            r_out.append(torch.stack([r.attn[p][layer] for p in positions]))
            r_lse.append(torch.stack([r.lse[p][layer] for p in positions]))
            rows = torch.tensor(positions) + st
            t_out.append(trace.attn[layer][rows].cpu())
            t_lse.append(trace.lse[layer][rows].cpu())
    r_out, t_out = torch.cat(r_out), torch.cat(t_out)
    r_lse, t_lse = torch.cat(r_lse), torch.cat(t_lse)
    pos_bad = int((bits_differ(r_out, t_out).flatten(1).any(1) | bits_differ(r_lse, t_lse).flatten(1).any(1)).sum())
    return {
        "tokens": int(train_lp.numel()),
        "mismatched_tokens": bad_tokens,
        "attention_positions": int(r_out.shape[0]),
        "mismatched_attention_positions": pos_bad,
        "drift": {"dlogp": drift_stats(roll_lp, train_lp), "out": drift_stats(r_out, t_out),
                  "lse": drift_stats(r_lse, t_lse)},
    }


def _backward_check(model, results, device) -> dict:
    """Training backward on the packed batch (a policy-gradient style loss over the generated tokens'
    log-probs, through the differentiable ``token_logprobs``), twice: are the weight gradients bitwise
    equal run to run, and are the log-probs the loss reads the rollout's, bitwise (an on-policy
    importance ratio of exactly 1)? For contrast: how many of those ``torch.log_softmax`` would give
    otherwise."""
    batch = _batch(results, device)
    roll = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float32)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        logits = model.forward_train(batch.tokens, batch.positions, batch.cu_seqlens, batch.longest)
        logp = completion_logprobs(logits, batch)
        (-logp.mean()).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    loss_lp = logp.detach().cpu()
    torch_lp = torch.log_softmax(logits.detach()[batch.rows].float(), -1).gather(-1, batch.targets[:, None]) \
        .squeeze(-1).cpu()
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads[0])))
    return {"ran": True, "grads_bitwise_run_to_run": same, "grad_norm": norm, "parameters": len(grads[0]),
            "loss_logprobs": "rlk_model::token_logprobs (differentiable; the rollout's log_softmax bits)",
            "loss_logprobs_mismatched_tokens": int(bits_differ(roll, loss_lp).sum()),
            "torch_log_softmax_mismatched_tokens": int(bits_differ(roll, torch_lp).sum())}


def run(device: str = "cpu", layers: int = 2, sequences: int = 8, split_kv: str = "disabled", chunk: int = 96,
        page_size: int = 16, max_running: int = 4, seed: int = 0, greedy: bool = False, backward: bool = True,
        negative_control: bool = True, progress: bool = True, compile: bool = False,
        hf_model: str | None = None) -> dict:
    """The train-vs-rollout check. ``compile``: the rollout runs under torch.compile (Inductor, through
    ``model.compiled_rollout``), the trainer eagerly: compiled == eager is part of what is compared.
    ``hf_model``: a local folder with a transformers Qwen3 checkpoint, run in place of the demo model
    (bf16, every stage on rlk ops: ``compile/hf_model.py``; ``layers`` and ``seed`` then leave the weights
    alone); transformers' own forward of it is compared with the rollout too."""
    positive_ints("demo:", layers=layers, sequences=sequences, chunk=chunk, page_size=page_size,
                  max_running=max_running)
    if not isinstance(compile, bool):
        raise ValueError(f"demo: compile must be a bool, got {compile!r}")
    policy = SplitKVPolicy.parse(split_kv)
    if not policy.strict and rlk_ops.strict_mode():
        raise rlk_ops.StrictModeError(f"split_kv {split_kv!r} is not batch-invariant; strict mode (the default) "
                                      f"refuses it")
    if policy.kind not in ("disabled", "canonical"):
        raise ValueError(f"demo: split_kv must be 'disabled' or 'canonical:C' (a policy both the training "
                         f"forward and the rollout compute), got {split_kv!r}")
    t0 = time.perf_counter()
    if hf_model is None:
        model = TinyQwen3(TinyQwen3Config(num_layers=layers, split_kv=str(policy)), device=device, seed=seed)
    else:
        from rlk_ops.compile.hf_model import load

        model = load(hf_model, device=device, split_kv=str(policy))
    cfg = model.config
    layers = cfg.num_layers
    contract = AttentionContract(dtype="bfloat16", head_dim=cfg.head_dim, split_kv=str(policy))
    # Before generating: do the two entry points run the same attention contract?
    # (warm-up compile + provenance of each; meta/binding.py). Strict mode refuses to go on.
    bound, _, _ = binding.bind_model(model, page_size=page_size, mandate=binding.Mandate.from_contract(contract),
                                     rollout_compiled=compile)
    if not bound.passed and rlk_ops.strict_mode():
        raise rlk_ops.StrictModeError("training and rollout do not bind; refusing to generate:\n" + bound.summary())
    t_bind = time.perf_counter()
    requests = make_requests(sequences, cfg.vocab_size, seed)
    sampler = Sampler(None if greedy else seed)
    with provenance.capture() as roll_log:
        engine = RolloutEngine(model, cache_for(model, requests, page_size, max_running, device, seed),
                               max_running=max_running, chunk=chunk, sampler=sampler,
                               forward=compiled_rollout(dynamic=True) if compile else None,
                               on_token=Progress(sum(r.max_new_tokens for r in requests), "rollout", enabled=progress))
        results = engine.run(requests)
    t_roll = time.perf_counter()
    with provenance.capture() as train_log:
        train_logps, trace, starts = rescore(model, results, device)
    t_train = time.perf_counter()
    report = _compare(results, train_logps, trace, starts, layers)
    if hf_model is not None:
        report["hf_forward"] = _hf_forward_check(model, results, device)
    records = [dict(r.as_dict(), side="rollout") for r in roll_log.records()] + \
              [dict(r.as_dict(), side="training") for r in train_log.records()]
    fallbacks = [r for r in records if r["fallback"]]
    if fallbacks and rlk_ops.strict_mode():  # cannot happen through dispatch; kept as a last guard
        raise rlk_ops.StrictModeError(f"fallbacks recorded in strict mode: {fallbacks}")
    report.update({
        "sequences": sequences,
        "prompt_lengths": [len(r.prompt) for r in results],
        "generated_lengths": [len(r.generated) for r in results],
        "scheduling": {
            "steps": len(engine.log), "chunk": chunk, "page_size": page_size, "max_running": max_running,
            "prefill_chunks": sum(len(s.prefill) for s in engine.log),
            "decode_batch_sizes": sorted({len(s.decode) for s in engine.log if s.decode}),
            "admitted_steps": [r.admitted_step for r in results],
            "finished_steps": [r.finished_step for r in results],
        },
        "contract": contract.fields(),
        "binding": bound.to_json(),
        "provenance": {"strict": rlk_ops.strict_mode(), "records": records, "fallbacks": len(fallbacks),
                       "environment": provenance.environment()},
        "model": {"layers": layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "seed": seed, "hf_model": hf_model,
                  "sampler": "greedy" if greedy else f"gumbel(seed={seed})"},
        "device": device,
        "rollout_compiled": compile,
        "seconds": {"binding": round(t_bind - t0, 2), "rollout": round(t_roll - t_bind, 2),
                    "training": round(t_train - t_roll, 2)},
    })
    if backward:
        report["training_backward"] = _backward_check(model, results, device)
    if negative_control:
        forced = [Request(r.seq_id, r.prompt, len(r.generated), forced=r.generated) for r in results]
        plain = RolloutEngine(model, cache_for(model, forced, page_size, max_running, device, seed),
                              max_running=max_running, chunk=chunk, forward=plain_forward_rollout,
                              logprobs=plain_log_softmax,
                              on_token=Progress(sum(r.max_new_tokens for r in forced), "negative control",
                                                enabled=progress))
        plain_results = plain.run(forced)
        nc = _compare(plain_results, train_logps, trace, starts, layers)
        nc["path"] = "plain PyTorch rollout (F.linear, HF-style RoPE, SDPA over padded batch K/V, F.silu, " \
                     "torch.log_softmax) vs the rlk training forward, same tokens and scheduling"
        report["negative_control"] = nc
    report["seconds"]["total"] = round(time.perf_counter() - t0, 2)
    return report


def summary(report: dict) -> str:
    d = report["drift"]
    lines = [
        f"train vs rollout on {report['device']}: {report['sequences']} sequences, prompts "
        f"{min(report['prompt_lengths'])}-{max(report['prompt_lengths'])} tokens, "
        f"{report['tokens']} generated tokens",
        f"  scheduling: chunked prefill (chunk {report['scheduling']['chunk']}), page size "
        f"{report['scheduling']['page_size']}, up to {report['scheduling']['max_running']} running, decode batch "
        f"sizes {report['scheduling']['decode_batch_sizes']}, {report['scheduling']['steps']} steps"
        + ("; rollout under torch.compile (Inductor), training eager" if report.get("rollout_compiled") else ""),
        f"  contract: {report['contract']['dtype']}, causal, scale {report['contract']['softmax_scale']:.4g}, "
        f"split-KV {report['contract']['split_kv']}, {report['contract']['accumulation']} accumulation, "
        f"{report['contract']['lse']} LSE; strict={report['provenance']['strict']}, "
        f"fallbacks={report['provenance']['fallbacks']}",
        f"  binding (checked before generating): {report['binding']['verdict']}",
        "",
        f"  {'comparison':<34} {'tokens':>7} {'mismatched':>11} {'max |dlogp|':>12} {'max |d out|':>12} "
        f"{'max |d lse|':>12}",
        f"  {'rlk rollout vs rlk training':<34} {report['tokens']:>7} {report['mismatched_tokens']:>11} "
        f"{d['dlogp']['max']:>12.3g} {d['out']['max']:>12.3g} {d['lse']['max']:>12.3g}",
    ]
    hf = report.get("hf_forward")
    if hf:
        lines.append(f"  {'transformers forward vs rollout':<34} {hf['tokens']:>7} {hf['mismatched_tokens']:>11}")
    nc = report.get("negative_control")
    if nc:
        lines.append(f"  {'negative control (plain rollout)':<34} {nc['tokens']:>7} {nc['mismatched_tokens']:>11} "
                     f"{nc['drift']['dlogp']['max']:>12.3g} {nc['drift']['out']['max']:>12.3g} "
                     f"{nc['drift']['lse']['max']:>12.3g}")
    lines.append(f"  attention (position, layer) pairs compared: {report['attention_positions']} "
                 f"(out and lse), mismatched: {report['mismatched_attention_positions']}")
    tb = report.get("training_backward")
    if tb:
        lines.append(f"  training backward: gradients bitwise equal run to run: {tb['grads_bitwise_run_to_run']}; "
                     f"the loss's log-probs vs the rollout's: {tb['loss_logprobs_mismatched_tokens']} of "
                     f"{report['tokens']} tokens mismatched (torch.log_softmax's would be "
                     f"{tb['torch_log_softmax_mismatched_tokens']})")
    code = exit_code(report)
    lines.append("")
    lines.append("RESULT: " + {0: "PASS - rollout and training log-probs are bitwise identical",
                               1: "FAIL - rollout and training disagree" if not _bitwise(report) else
                               "FAIL - the training backward's gradients differ run to run, or its loss's "
                               "log-probs are not the rollout's",
                               3: "INCONCLUSIVE - rollout and training agree, but the negative control found no "
                                  "mismatch: the check did not show it can fail"}[code])
    lines.append(f"({report['seconds']['total']} s)")
    return "\n".join(lines)


def _bitwise(report: dict) -> bool:
    hf = report.get("hf_forward")
    return report["mismatched_tokens"] == 0 and report["mismatched_attention_positions"] == 0 and \
        (hf is None or hf["mismatched_tokens"] == 0)


def exit_code(report: dict) -> int:
    """0: rollout and training agree bitwise (with an HF model, transformers' own forward too; and,
    where they ran, the training backward's gradients are bitwise equal run to run and the negative
    control found a mismatch);
    1: they disagree, or the gradients differ run to run, or the loss's log-probs at the generated tokens
    are not the rollout's; 3: they agree but the negative control
    (a plain PyTorch rollout) found no mismatch, in tokens or attention positions, so the run did
    not show the check can fail."""
    tb, nc = report.get("training_backward"), report.get("negative_control")
    if not _bitwise(report) or (tb and (not tb["grads_bitwise_run_to_run"] or tb["loss_logprobs_mismatched_tokens"])):
        return 1
    return 3 if nc and nc["mismatched_tokens"] == 0 and nc.get("mismatched_attention_positions", 0) == 0 else 0
