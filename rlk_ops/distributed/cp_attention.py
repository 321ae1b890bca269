"""Context-parallel attention over the cp mesh dim, built from rlk ops.

Forward (per cp rank): ``rlk::all_gather`` K and V (one buffer) over cp (exact: the cp layout of
the whole batch), pick each local query segment's key prefix (``layout.key_index``),
and run ``rlk::attention_fwd`` varlen with bottom-right-aligned causal masking. A
query row then sees exactly the keys it sees on one device, at the same absolute
positions, and the reference kernels define a row's result by 128-key blocks
aligned to key 0: out, lse and dQ are bitwise equal to the single-device run.

Backward: ``rlk::attention_bwd`` gives dQ (per row: exact) and per-segment dK/dV
partials. Two ways to turn those into dK/dV of the local keys:

* default: fold the partials of this rank's pieces in fp32, ascending piece order
  (zigzag has two), round, then ``rlk::reduce_scatter`` over cp (fp32 sum in rank
  order). Deterministic run to run; the bits depend on the cp degree and sharding
  because the partial sums are cut differently.
* canonical (``layout.canonical``): every canonical chunk is its own segment, and
  each kv head its own attention call, so a chunk's partial is computed from the
  same operands with the same shapes on every topology; partials are
  ``rlk::all_gather``-ed over cp and summed in fp32 in ascending global chunk
  order. Bitwise equal across topologies, one device included, when the one-device
  run uses the same ``chunks``. Cost: every rank receives ``chunks`` partials of
  the gathered K and V (``chunks`` x the gathered K/V bytes, instead of one
  reduce-scatter), one attention call per kv head, and each partial is rounded to
  the input dtype before the fp32 sum.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlk_ops.distributed.checks import (LAYOUT_KEYS, DistributedInputError, collect, dtype_code, preflight, show_bool,
                                        show_choice, show_dtype, show_or_none)
from rlk_ops.distributed.layout import MODES, CPLayout
from rlk_ops.distributed.reductions import ordered_sum
from rlk_ops.ops._validate import finite, short_repr


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout,
                               group=None, softmax_scale: float | None = None,
                               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this rank's queries against the whole (cp-sharded) batch.

    q [T_l, Hq, D], k/v [T_l, Hkv, D]: this rank's tokens in ``layout`` order (RoPE
    already applied at their positions). ``group``: the cp process group (None: one
    process, ``layout.cp`` must be 1). Returns out [T_l, Hq, D], lse [Hq, T_l] (fp32).
    Differentiable in q, k, v.

    ``check`` (eager only; skipped while torch.compile traces): every rank checks its
    arguments and the ranks compare shapes, dtype and batch layout in one small
    all_gather, so bad input raises on every rank instead of hanging the others.
    Compiled callers run those checks eagerly beforehand (``ParallelQwen3Attention.prepare``)."""
    if not torch.compiler.is_compiling():  # argument types, before the preflight uses them
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise DistributedInputError(f"context_parallel_attention: group must be the cp ProcessGroup (e.g. "
                                        f"mesh.get_group('cp')) or None, got {type(group).__name__}")
    scale_ok = softmax_scale is None or (isinstance(softmax_scale, (int, float))
                                         and not isinstance(softmax_scale, bool) and finite(softmax_scale))

    def check_scale():
        if not scale_ok:
            raise DistributedInputError(f"context_parallel_attention: softmax_scale must be a finite float or None, "
                                        f"got {type(softmax_scale).__name__} {short_repr(softmax_scale)}")

    def check_flag():   # a check that is not a bool is exchanged as a problem: check=None on one rank skipped
        if not isinstance(check, bool):   # the exchange there, and its K/V met the others' (a session 38 audit)
            raise DistributedInputError(f"context_parallel_attention: check must be a bool, got "
                                        f"{type(check).__name__} {short_repr(check)}")

    if check is False and not torch.compiler.is_compiling():
        check_scale()
    if check is not False and not torch.compiler.is_compiling():
        problem = collect([check_flag, check_scale, lambda: check_local(q, k, v, layout, group)])
        if group is None:
            if problem:
                raise DistributedInputError(problem)
        else:
            meta = {"local_tokens": _dim(q, 0), "num_heads": _dim(q, 1), "num_kv_heads": _dim(k, 1),
                    "head_dim": _dim(q, -1), "dtype": dtype_code(getattr(q, "dtype", None)),
                    # each rank's own scale would run silently (a float: compared bit for bit). None is NaN,
                    # which no accepted scale is (-1.0 was, so None on one rank beside -1.0 passed; session 35)
                    "softmax_scale": float(softmax_scale) if scale_ok and softmax_scale is not None else math.nan}
            lay_meta = layout.metadata() if isinstance(layout, CPLayout) else [-1] * len(LAYOUT_KEYS)
            meta.update(zip(LAYOUT_KEYS, lay_meta))
            preflight(group, "context_parallel_attention", problem, meta,
                      show={"dtype": show_dtype, "softmax_scale": show_or_none(math.nan), "mode": show_choice(MODES),
                            "canonical": show_bool})
    return cp_attention(q, k, v, layout, None if group is None else group.group_name, softmax_scale)


def _dim(t, i):
    return int(t.shape[i]) if isinstance(t, torch.Tensor) and t.dim() > max(i, -i - 1) else -1


def cp_attention(q, k, v, layout: CPLayout, group_name: str | None, softmax_scale: float | None = None):
    """``context_parallel_attention`` without its checks, taking the cp group's name
    (what compiled callers pass: a string is a constant to torch.compile)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    order = tuple(layout.canonical_order()) if layout.canonical else None
    return _CPAttention.apply(q, k, v, layout.key_index, layout.piece_index, layout.cu_seqlens_q,
                              layout.cu_seqlens_k, layout.max_seqlen_q, layout.max_seqlen_k, scale, group_name,
                              order, layout.rank, layout.local_tokens)


def check_local(q, k, v, layout: CPLayout, group) -> None:
    """Metadata checks (no data read, no communication); raise ValueError naming the argument."""
    what = "context_parallel_attention"
    if not isinstance(layout, CPLayout):
        raise ValueError(f"{what}: layout must be a CPLayout (rlk_ops.distributed.build_layout), "
                         f"got {type(layout).__name__}")
    if group is None:
        if layout.cp != 1:
            raise ValueError(f"{what}: group is None (one process) but the layout shards over cp = {layout.cp}")
    else:
        import torch.distributed as dist

        if dist.get_world_size(group) != layout.cp or dist.get_rank(group) != layout.rank:
            raise ValueError(f"{what}: layout is for cp rank {layout.rank} of {layout.cp}, but this process is "
                             f"rank {dist.get_rank(group)} of {dist.get_world_size(group)} in the cp group")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{what}: {name} must be 3-D [T_local, H, D], got shape {list(t.shape)}")
        if t.shape[0] != layout.local_tokens:
            raise ValueError(f"{what}: {name}.shape[0] must be this rank's token count {layout.local_tokens} "
                             f"(layout), got {t.shape[0]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"{what}: q must be bfloat16, float16, float32 or float64, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: k and v must have q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or q.shape[1] % max(k.shape[1], 1) or k.shape[1] == 0:
        raise ValueError(f"{what}: need k.shape == v.shape == [T_local, Hkv, D] with Hq % Hkv == 0 and q's D; "
                         f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[-1] < 1:
        raise ValueError(f"{what}: q, k and v need head_dim (their last dim) >= 1, got q {list(q.shape)}")


def _attend(q, ks, vs, cu_q, cu_k, max_q, max_k, scale, per_kv_head):
    if not per_kv_head:
        return torch.ops.rlk.attention_fwd(q, ks, vs, 1, scale, cu_q, cu_k, max_q, max_k, "disabled")
    g = q.shape[1] // ks.shape[1]
    outs, lses = [], []
    for h in range(ks.shape[1]):
        o, l = torch.ops.rlk.attention_fwd(q[:, h * g:(h + 1) * g], ks[:, h:h + 1], vs[:, h:h + 1], 1, scale,
                                           cu_q, cu_k, max_q, max_k, "disabled")
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 1), torch.cat(lses, 0)


def _attend_bwd(dout, q, ks, vs, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, per_kv_head):
    if not per_kv_head:
        return torch.ops.rlk.attention_bwd(dout, q, ks, vs, out, lse, dlse, 1, scale, cu_q, cu_k, max_q, max_k,
                                           "disabled")
    g = q.shape[1] // ks.shape[1]
    parts = []
    for h in range(ks.shape[1]):
        hq = slice(h * g, (h + 1) * g)
        parts.append(torch.ops.rlk.attention_bwd(
            dout[:, hq].contiguous(), q[:, hq].contiguous(), ks[:, h:h + 1].contiguous(),
            vs[:, h:h + 1].contiguous(), out[:, hq].contiguous(), lse[hq].contiguous(),
            None if dlse is None else dlse[hq].contiguous(), 1, scale, cu_q, cu_k, max_q, max_k, "disabled"))
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(3))


def _pieces(d_seg, piece_index):
    """Segment-key gradients [K, H, D] -> per-piece gradients on the gathered keys
    [P, cp*T_l, H, D] (zero where a piece does not see a key). Exact (gathers)."""
    padded = torch.cat([d_seg, d_seg.new_zeros((1, *d_seg.shape[1:]))])
    return torch.stack([padded.index_select(0, piece_index[p]) for p in range(piece_index.shape[0])])


def _fold(dks, dvs, piece_index, group_name, order, rank, local_tokens):
    """Segment-key gradients of K and V -> gradients of this rank's K and V. K and V
    travel in one buffer: one collective, so no two collectives can be reordered."""
    hkv = dks.shape[1]
    parts = torch.cat([_pieces(dks, piece_index), _pieces(dvs, piece_index)], 2)  # [P, cp*T_l, 2*Hkv, D]
    if order is None:  # default: this rank's pieces, then the cp reduce-scatter
        total = ordered_sum(parts, dks.dtype)
        if group_name is not None:
            total = torch.ops.rlk.reduce_scatter(total, 0, group_name)
    else:  # canonical: every chunk's partial to every rank, then one ordered sum
        if group_name is not None:
            parts = torch.ops.rlk.all_gather(parts, 0, group_name)
            parts = parts[:, rank * local_tokens:(rank + 1) * local_tokens]
        total = ordered_sum(torch.stack([parts[i] for i in order]), dks.dtype)
    return total[:, :hkv], total[:, hkv:]


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_index, piece_index, cu_q, cu_k, max_q, max_k, scale, group_name, order, rank,
                local_tokens):
        if group_name is None:
            k_all, v_all = k, v
        else:  # one buffer, one collective (see reductions: collective order)
            kv_all = torch.ops.rlk.all_gather(torch.cat([k, v], 1), 0, group_name)
            k_all, v_all = kv_all[:, :k.shape[1]], kv_all[:, k.shape[1]:]
        ks, vs = k_all.index_select(0, key_index), v_all.index_select(0, key_index)
        per_kv_head = order is not None
        out, lse = _attend(q, ks, vs, cu_q, cu_k, max_q, max_k, scale, per_kv_head)
        ctx.save_for_backward(q, k_all, v_all, out, lse, key_index, piece_index, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, group_name, order, rank, local_tokens)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k_all, v_all, out, lse, key_index, piece_index, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, group_name, order, rank, local_tokens = ctx.args
        ks, vs = k_all.index_select(0, key_index), v_all.index_select(0, key_index)
        dq, dks, dvs = _attend_bwd(dout.contiguous(), q, ks, vs, out, lse, dlse.contiguous(), cu_q, cu_k, max_q,
                                   max_k, scale, order is not None)
        dk, dv = _fold(dks, dvs, piece_index, group_name, order, rank, local_tokens)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None
