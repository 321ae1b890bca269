"""The Qwen3 attention block on one rank's shards (plain tensors): the function that
``ParallelQwen3Attention`` runs inside ``local_map``.

Default mode (``layout.canonical`` False), Megatron-style:

    x -f-> rlk::linear (column-parallel fused QKV of the local heads) -> q/k norm -> rope
      -> context-parallel attention over cp -> rlk::linear (row-parallel o_proj) -g-> y

``f`` all-reduces the input gradient over tp, ``g`` all-reduces the o_proj partial
sums over tp (identity backward); weights all-reduce their gradients over cp, norm
weights over cp then tp. Every reduction is ``rlk::reduce_scatter`` + ``rlk::all_gather``
(fp32, rank order), so the run is deterministic, and attention out/lse and dQ are
bitwise equal to one device; y, dX and the weight gradients depend on the (tp, cp)
degrees through the number of fp32 partial sums.

Canonical mode (``layout.canonical``): the block is evaluated on a grid of cells,
(canonical token chunk j) x (kv-head group g: one kv head and its q heads). Each cell
runs its own QKV and o_proj ``rlk::linear`` and norm calls, so every partial sum
(over a chunk's tokens, or over a group's heads) has the same operands and shapes on
every topology; partials are all-gathered and summed in fp32 in the fixed (j, g)
order. Then y, dX, dK/dV and every weight gradient are bitwise equal on every
(tp, cp), one process included, as long as ``chunks`` is the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import rlk_ops
from rlk_ops.distributed.cp_attention import cp_attention
from rlk_ops.distributed.layout import CPLayout
from rlk_ops.distributed.reductions import canonical_reduce, fanout, reduce_forward, sync_grads


@dataclass(frozen=True)
class Topology:
    """Static per-rank facts the local block needs (hashable: torch.compile guards on it)."""

    tp: int
    cp: int
    tp_rank: int
    cp_rank: int
    tp_name: str | None   # process group names; None for a size-1 dim
    cp_name: str | None
    num_heads: int        # global
    num_kv_heads: int
    head_dim: int
    eps: float
    theta: float
    rotary_dim: int | None


def _tp(topo):
    return None if topo.tp_name is None else (topo.tp_name, topo.tp)


def _cp(topo):
    return None if topo.cp_name is None else (topo.cp_name, topo.cp)


def _qkv(x, w_qkv, qn, kn, positions, hq, hkv, topo):
    d = topo.head_dim
    n = x.shape[0]
    q, k, v = rlk_ops.linear(x, w_qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rlk_ops.rope(rlk_ops.qk_rmsnorm(q.reshape(n, hq, d), qn, topo.eps), positions, topo.theta, topo.rotary_dim)
    k = rlk_ops.rope(rlk_ops.qk_rmsnorm(k.reshape(n, hkv, d), kn, topo.eps), positions, topo.theta, topo.rotary_dim)
    return q, k, v.reshape(n, hkv, d)


def local_forward(x, positions, wq, wk, wv, wo, qn, kn, layout: CPLayout, topo: Topology, taps=None):
    """x [T_l, hidden], positions [T_l]; local weight shards. Returns (y [T_l, hidden],
    attention out [T_l, Hq_l, D], lse [Hq_l, T_l]); the last two are detached
    diagnostics: a compiled DTensor graph whose outputs are not all used in the
    loss fails in backward ("Expected a DTensor tangent but got a plain Tensor",
    pytorch/pytorch#172556), so only y carries gradients. ``taps`` (eager only): a dict
    that receives q, k, v (post-RoPE, gradients retained) for inspecting dQ/dK/dV."""
    if layout.canonical:
        return _canonical(x, positions, wq, wk, wv, wo, qn, kn, layout, topo, taps)
    hq, hkv = topo.num_heads // topo.tp, topo.num_kv_heads // topo.tp
    tp, cp = _tp(topo), _cp(topo)
    # x is replicated over tp (its gradient: partial sums over the local heads), weights
    # over cp (partial sums over the local tokens), norm weights over both
    x, wq, wk, wv, wo, qn, kn = sync_grads((x, wq, wk, wv, wo, qn, kn),
                                           ("tp", "cp", "cp", "cp", "cp", "cp+tp", "cp+tp"), cp, tp)
    q, k, v = _tap(taps, *_qkv(x, torch.cat([wq, wk, wv]), qn, kn, positions, hq, hkv, topo))
    attn, lse = cp_attention(q, k, v, layout, topo.cp_name)
    y = reduce_forward(rlk_ops.linear(attn.reshape(attn.shape[0], attn.shape[1] * attn.shape[2]), wo), tp)
    return y, attn.detach(), lse.detach()


def _tap(taps, q, k, v):
    if taps is not None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.requires_grad:
                t.retain_grad()
            taps[name] = t
    return q, k, v


def _canonical(x, positions, wq, wk, wv, wo, qn, kn, layout, topo, taps):
    d = topo.head_dim
    hkv = topo.num_kv_heads // topo.tp          # local kv-head groups
    g = topo.num_heads // topo.num_kv_heads     # q heads per group
    pieces = layout.pieces
    chunk_order = tuple(layout.canonical_order())       # gathered piece index of chunk 0, 1, ...
    group_order = tuple(range(topo.num_kv_heads))       # gathered over tp: global group ids ascending
    cell_order = tuple(((gg // hkv) * topo.cp * pieces + chunk_order[j]) * hkv + gg % hkv
                       for j in range(layout.n_chunks) for gg in range(topo.num_kv_heads))
    xs = x.split(list(layout.piece_tokens))
    ps = positions.split(list(layout.piece_tokens))
    # split (not slicing): its backward is one cat, so each weight's gradient is exact movement
    wqs, wks, wvs, wos = wq.split(g * d), wk.split(d), wv.split(d), wo.split(g * d, dim=1)
    w_qkv = [torch.cat([wqs[i], wks[i], wvs[i]]) for i in range(hkv)]
    # one fanout for everything, so the backward has one gather over cp and one over tp
    specs = ([(hkv, ("tp",), group_order)] * pieces            # x pieces: dX sums over kv groups
             + [(pieces, ("cp",), chunk_order)] * (2 * hkv)    # QKV rows, o_proj columns: over chunks
             + [(pieces * hkv, ("cp", "tp"), cell_order)] * 2)  # norms: over chunks and groups
    cells = iter(fanout((*xs, *w_qkv, *wos, qn, kn), specs, topo.cp_name, topo.tp_name))
    x_cells = [[next(cells) for _ in range(hkv)] for _ in range(pieces)]
    w_cells = [[next(cells) for _ in range(pieces)] for _ in range(hkv)]
    wo_cells = [[next(cells) for _ in range(pieces)] for _ in range(hkv)]
    qn_cells = [next(cells) for _ in range(pieces * hkv)]
    kn_cells = [next(cells) for _ in range(pieces * hkv)]
    qs, ks, vs = [], [], []
    for i in range(hkv):
        per_piece = [_qkv(x_cells[p][i], w_cells[i][p], qn_cells[p * hkv + i], kn_cells[p * hkv + i], ps[p], g, 1,
                          topo) for p in range(pieces)]
        qs.append(torch.cat([c[0] for c in per_piece]))
        ks.append(torch.cat([c[1] for c in per_piece]))
        vs.append(torch.cat([c[2] for c in per_piece]))
    q, k, v = _tap(taps, torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1))
    attn, lse = cp_attention(q, k, v, layout, topo.cp_name)
    per_group = []
    for i in range(hkv):  # o_proj partial of group i, piece by piece: [T_l, hidden]
        heads = attn[:, i * g:(i + 1) * g]
        per_group.append(torch.cat([rlk_ops.linear(a.reshape(a.shape[0], g * d), wo_cells[i][p])
                                    for p, a in enumerate(heads.split(list(layout.piece_tokens)))]))
    y = canonical_reduce(torch.stack(per_group), topo.tp_name, group_order)
    return y, attn.detach(), lse.detach()
