"""The train-vs-rollout bitwise check (``python -m rlk_ops demo``).

Pipeline per sequence: q/k/v -> qk_rmsnorm -> rope -> attention. The training side
runs one full prefill per sequence; the rollout side appends K/V into a shuffled
paged cache in prefill chunks (not a multiple of 128) and then decodes the remaining
tokens one at a time, batched across sequences. Every token's attention output and
LSE must be bitwise equal.
"""
from __future__ import annotations

import math

import torch

import rlk_ops


def run(device: str = "cpu", sequences: int = 8, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
        page_size: int = 16, chunk: int = 100, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    lens = [int(x) for x in torch.randint(40, 300, (sequences,), generator=g)]
    decode_steps = 16
    norm_w = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dt).to(device)
    seqs = []
    for n in lens:
        q = torch.randn(n, heads, head_dim, generator=g).to(dt).to(device)
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dt).to(device)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dt).to(device)
        pos = torch.arange(n, device=device)
        q = rlk_ops.rope(rlk_ops.qk_rmsnorm(q, norm_w), pos)
        k = rlk_ops.rope(rlk_ops.qk_rmsnorm(k, norm_w), pos)
        seqs.append((q, k, v))
    # training: full prefill, one sequence at a time
    train = [rlk_ops.attention(q[None], k[None], v[None]) for q, k, v in seqs]
    # rollout: shuffled pages, chunked prefill of all but the last decode_steps tokens, then batched decode
    pages_per = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages_per) + 7
    perm = torch.randperm(num_pages, generator=g)
    k_cache = torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dt, device=device)
    v_cache = torch.zeros_like(k_cache)
    page_table = torch.zeros(sequences, max(pages_per), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[start:start + n].int()
        start += n
    page_table = page_table.to(device)
    rollout_out = [torch.empty_like(q) for q, _, _ in seqs]
    rollout_lse = [torch.empty(heads, q.shape[0], device=device) for q, _, _ in seqs]

    def slots(b, lo, hi):
        p = torch.arange(lo, hi)
        return (page_table[b].cpu().long()[p // page_size] * page_size + p % page_size).to(device)

    for b, (q, k, v) in enumerate(seqs):
        prompt = lens[b] - decode_steps
        for lo in range(0, prompt, chunk):
            hi = min(prompt, lo + chunk)
            rlk_ops.paged_kv_append(k_cache, v_cache, k[lo:hi], v[lo:hi], slots(b, lo, hi))
            seq_lens = torch.tensor([hi], dtype=torch.int32, device=device)
            o, lse = rlk_ops.paged_attention(q[None, lo:hi], k_cache, v_cache, page_table[b:b + 1], seq_lens)
            rollout_out[b][lo:hi], rollout_lse[b][:, lo:hi] = o[0], lse[0]
    for step in range(decode_steps):
        pos = [n - decode_steps + step for n in lens]
        for b, (_, k, v) in enumerate(seqs):
            rlk_ops.paged_kv_append(k_cache, v_cache, k[pos[b]:pos[b] + 1], v[pos[b]:pos[b] + 1],
                                    slots(b, pos[b], pos[b] + 1))
        q_step = torch.stack([seqs[b][0][p] for b, p in enumerate(pos)])[:, None]
        seq_lens = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=device)
        o, lse = rlk_ops.paged_attention(q_step, k_cache, v_cache, page_table, seq_lens)
        for b, p in enumerate(pos):
            rollout_out[b][p], rollout_lse[b][:, p] = o[b, 0], lse[b, :, 0]
    tokens = sum(lens)
    mismatched = 0
    for b in range(sequences):
        out_eq = (rollout_out[b] == train[b][0][0]).all(-1).all(-1)
        lse_eq = (rollout_lse[b] == train[b][1][0]).all(0)
        mismatched += int((~(out_eq & lse_eq)).sum())
    return {"tokens": tokens, "mismatched_tokens": mismatched, "sequences": sequences, "lengths": lens,
            "page_size": page_size, "chunk": chunk, "decode_steps": decode_steps, "device": device}
