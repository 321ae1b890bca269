"""Deterministic collectives over torch.distributed (gloo on CPU, NCCL on GPUs).

* all_gather moves bytes only (sent as uint8, so every dtype but the quantized ones travels): exact,
  independent of the world size.
* reduce_scatter is all_to_all (bytes only) followed by a sum of the received
  blocks in ascending rank order in fp32 (fp64 for fp64). NCCL's own reduce-scatter
  picks ring/tree algorithms and orders at run time; this one has a single order.
  The result still depends on the world size (a different number of terms).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def process_group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def all_gather(x, dim, group_name):
    pg = process_group(group_name)
    ws = dist.get_world_size(pg)
    x = x.contiguous()
    if ws == 1:
        return x.clone()
    # as bytes, each element's bytes along a trailing dim: every dtype travels on every backend (gloo has no
    # int16 or float8) and is joined as bytes (ATen's cat has no float4 kernel)
    raw = x.reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(ws)]
    dist.all_gather(parts, raw, group=pg)
    joined = torch.cat([p.view(*x.shape, x.element_size()) for p in parts], dim)
    return joined.view(x.dtype).squeeze(-1)


def reduce_scatter(x, dim, group_name):
    pg = process_group(group_name)
    ws = dist.get_world_size(pg)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if ws == 1:
        return x.clone(memory_format=torch.contiguous_format)  # a one-term sum is exact
    send = torch.stack([c.contiguous() for c in x.chunk(ws, dim)])  # [ws, *block]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    total = recv[0].to(acc)
    for r in range(1, ws):
        total = total + recv[r].to(acc)
    return total.to(x.dtype)
