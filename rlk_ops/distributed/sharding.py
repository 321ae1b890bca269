"""DTensor sharding rules for the rlk ops (``register_sharding``).

With these rules an rlk op accepts DTensor arguments whose placements let it run
shard-locally, with no communication: heads sharded (attention and its backward where Hq
and Hkv split evenly over the mesh; per-head norm, RoPE), tokens sharded (row-wise ops),
column-parallel ``linear``.
No rule produces ``Partial``: a reduction across ranks would then be DTensor's own
all-reduce, whose order we do not control. When no local strategy fits (e.g. the
weight gradient of a token-sharded ``linear``), DTensor falls back to the
all-Replicate strategy, i.e. all-gathers (exact) and computes the whole result on
every rank, so DTensor-level use stays bitwise equal to one device, at the cost of
redundant work. The block's reductions (o_proj over tp, gradients over cp) are done
explicitly with rlk collectives in ``local_block``; context parallelism is not a
sharding rule (a query shard needs every key) but ``cp_attention``.

Schemas take an ``int`` before any flag that changes placements (``register_sharding``
caches strategies on the arguments from the first int onward).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

_ops = torch.ops.rlk
R = Replicate()


def _spec(x):
    """Replicate for a tensor argument, None for None / non-tensors (the rule format)."""
    return None if x is None or not hasattr(x, "placements") else R


def _ndim(spec) -> int:
    """Rank of a tensor argument as the rule sees it (a DTensorSpec; its tensor_meta on older torch)."""
    ndim = getattr(spec, "ndim", None)
    return int(ndim) if ndim is not None else len(spec.tensor_meta.shape)


def _heads_split_evenly(q, k) -> bool:
    """Whether heads may be sharded: Hq and Hkv both divisible by the mesh's size (every mesh dim's,
    and their product, in case the heads are sharded over several). Split unevenly, a rank's query
    heads no longer map onto its own KV heads as the global ones do (Hq 12, Hkv 3 over 2 ranks: 6 / 2
    and 6 / 1 heads), which the kernels accept and compute wrongly (a session 31 audit). Otherwise
    DTensor takes the replicated strategy, exact."""
    mesh = getattr(q, "mesh", None)
    if mesh is None:
        return False
    hq, hkv = _shape(q)[-2], _shape(k)[-2]
    return all(hq % n == 0 and hkv % n == 0 for n in (*mesh.shape, mesh.size()))


def _shape(spec) -> tuple:
    shape = getattr(spec, "shape", None)
    return tuple(shape if shape is not None else spec.tensor_meta.shape)


def _token_dims(x) -> range:
    """Dims of a [..., H, D] tensor that are neither heads nor head_dim."""
    return range(_ndim(x) - 2)


@register_sharding(_ops.attention_fwd.default)
def _attention_fwd(q, k, v, causal, softmax_scale, cu_q, cu_k, max_q, max_k, split_kv):
    rest = [None, None, _spec(cu_q), _spec(cu_k), None, None, None]
    rules = [([R, R], [R, R, R, *rest])]
    head = _ndim(q) - 2
    lse_head = 0 if _ndim(q) == 3 else 1   # varlen lse [Hq, T], dense [B, Hq, S]
    if _heads_split_evenly(q, k):
        rules.append(([Shard(head), Shard(lse_head)], [Shard(head)] * 3 + rest))
    if _ndim(q) == 4:  # dense: batch rows are independent
        rules.append(([Shard(0), Shard(0)], [Shard(0)] * 3 + rest))
    return rules


@register_sharding(_ops.attention_bwd.default)
def _attention_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_q, cu_k, max_q, max_k, split_kv):
    rest = [None, None, _spec(cu_q), _spec(cu_k), None, None, None]
    has_dlse = dlse is not None
    rules = [([R, R, R], [R] * 6 + [R if has_dlse else None] + rest)]
    head = _ndim(q) - 2
    lse_head = 0 if _ndim(q) == 3 else 1
    sh, sl = Shard(head), Shard(lse_head)
    if _heads_split_evenly(q, k):
        rules.append(([sh, sh, sh], [sh] * 5 + [sl, sl if has_dlse else None] + rest))
    if _ndim(q) == 4:
        s0 = Shard(0)
        rules.append(([s0, s0, s0], [s0] * 6 + [s0 if has_dlse else None] + rest))
    return rules


@register_sharding(_ops.qk_rmsnorm.default)
def _qk_rmsnorm(x, weight, eps):
    return [([R], [R, R, None])] + [([Shard(d)], [Shard(d), R, None]) for d in range(_ndim(x) - 1)]


@register_sharding(_ops.qk_rmsnorm_bwd.default)
def _qk_rmsnorm_bwd(dy, x, weight, eps):
    # dweight sums over every token and head: only the replicated form is local
    return [([R, R], [R, R, R, None])]


def _rope_rules(x, positions):
    rules = [([R], [R, R, None, None])]
    for d in _token_dims(x):          # tokens: positions travel with them
        rules.append(([Shard(d)], [Shard(d), Shard(d), None, None]))
    rules.append(([Shard(_ndim(x) - 2)], [Shard(_ndim(x) - 2), R, None, None]))  # heads
    return rules


@register_sharding(_ops.rope.default)
def _rope(x, positions, theta, rotary_dim):
    return _rope_rules(x, positions)


@register_sharding(_ops.rope_bwd.default)
def _rope_bwd(dy, positions, theta, rotary_dim):
    return _rope_rules(dy, positions)


@register_sharding(_ops.linear.default)
def _linear(x, weight, bias):
    b = _spec(bias)
    rules = [([R], [R, R, b])]
    rules += [([Shard(d)], [Shard(d), R, b]) for d in range(_ndim(x) - 1)]           # rows
    rules.append(([Shard(_ndim(x) - 1)], [R, Shard(0), None if b is None else Shard(0)]))  # column-parallel
    return rules


@register_sharding(_ops.linear_bwd.default)
def _linear_bwd(dy, x, weight):
    # dx reduces over out_features, dweight over rows: neither is local when sharded
    return [([R, R], [R, R, R])]


@register_sharding(_ops.linear_bias_bwd.default)
def _linear_bias_bwd(dy):
    return [([R], [R])]
