"""CPU reference paged KV cache append and gather (pure data movement: exact)."""
from __future__ import annotations

import torch

from rlk_ops.kernels.cpu.attention import gather_pages


def paged_kv_append(k_cache, v_cache, k, v, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_kv_gather(k_cache, v_cache, page_table, seq_lens):
    bsz, max_pages = page_table.shape
    ps = k_cache.shape[1]
    k = gather_pages(k_cache, page_table, max_pages)
    v = gather_pages(v_cache, page_table, max_pages)
    valid = torch.arange(max_pages * ps).view(1, -1) < seq_lens.to(torch.int64).view(-1, 1)
    valid = valid[:, :, None, None]
    return torch.where(valid, k, 0), torch.where(valid, v, 0)
