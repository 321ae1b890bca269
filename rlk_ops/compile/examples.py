"""Example inputs for the block's two entry points (used by the CLI and tests)."""
from __future__ import annotations

import torch

from rlk_ops.compile.block import Qwen3Attention
from rlk_ops.ops._validate import positive_ints


def packed_batch(lengths: list[int], hidden: int, dtype=torch.bfloat16, requires_grad=True, seed=0):
    """Packed varlen training inputs: (hidden_states [T, hidden], positions [T], cu_seqlens)."""
    _lengths("packed_batch", "lengths", lengths)
    positive_ints("packed_batch", hidden=hidden)
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = (torch.randn(total, hidden, generator=g) * 0.5).to(dtype).requires_grad_(requires_grad)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, positions, cu


def decode_batch(block: Qwen3Attention, context: list[int], page_size: int = 16, seed: int = 0):
    """One decode step for len(context) sequences whose caches hold context[b] tokens
    (random K/V in shuffled pages). Returns the forward_rollout arguments."""
    _lengths("decode_batch", "context", context)
    positive_ints("decode_batch", page_size=page_size)
    cfg = block.config
    dtype = block.o_proj.weight.dtype
    g = torch.Generator().manual_seed(seed)
    need = [(n + 1 + page_size - 1) // page_size for n in context]
    num_pages = sum(need) + 3
    k_cache = torch.randn(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.zeros(len(context), max(need), dtype=torch.int32)
    slots = []
    start = 0
    for b, n in enumerate(context):
        page_table[b, :need[b]] = perm[start:start + need[b]].int()
        start += need[b]
        slots.append(int(page_table[b, n // page_size]) * page_size + n % page_size)
    x = (torch.randn(len(context), 1, cfg.hidden_size, generator=g) * 0.5).to(dtype)
    positions = torch.tensor(context, dtype=torch.int64)[:, None]
    seq_lens = torch.tensor([n + 1 for n in context], dtype=torch.int32)
    return x, positions, k_cache, v_cache, page_table, seq_lens, torch.tensor(slots, dtype=torch.int64)


def _lengths(owner: str, name: str, values) -> None:
    """A non-empty list of token counts, each an int >= 0."""
    if not isinstance(values, (list, tuple)) or not values or any(
            not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in values):
        raise ValueError(f"{owner} {name} must be a non-empty list of ints >= 0, got {values!r}")


def init_block(block: Qwen3Attention, seed: int = 0, std: float = 0.02) -> Qwen3Attention:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return block
