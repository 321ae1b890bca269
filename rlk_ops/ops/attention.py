"""rlk::attention_fwd / rlk::attention_bwd: training-side attention (dense or packed varlen).

Dense:   q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]  -> out [B, Sq, Hq, D], lse [B, Hq, Sq]
Varlen:  q [T, Hq, D],     k/v [Tk, Hkv, D], cu_seqlens_q/k int32 [B+1]
                                               -> out [T, Hq, D],     lse [Hq, T]

* GQA: Hq % Hkv == 0; q head h reads kv head h // (Hq / Hkv).
* causal is bottom-right aligned: query i of a sequence with Sq queries and Sk keys
  sits at absolute position Sk - Sq + i (so Sq <= Sk is required).
* lse is the natural-log sum of exp of the scaled scores, fp32 (fp64 for fp64 inputs).
* softmax_scale None means head_dim ** -0.5. max_seqlen None (0 in the op) means
  "derive from cu_seqlens inside the op" (one host read of cu_seqlens per call). The schema
  takes max_seqlen_q/k as SymInt: under torch.compile a max_seqlen that changes with every
  batch is a symbol of the graph (with dynamic=True, or after automatic dynamic's one
  recompile), not a guard per value. On CUDA a given max_seqlen saves the host read.
* split_kv is the split-KV policy (meta/contract.py): "disabled" is single pass;
  "canonical:C" splits keys into C-token chunks merged in a fixed order.

The backward is its own op, ``rlk::attention_bwd`` (deterministic on every backend;
it also takes the gradient of lse, so (out, lse) states can be merged downstream).
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.meta.contract import SplitKVPolicy, spell
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              softmax_scale: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, split_kv: str = "disabled") -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention; returns (out, lse)."""
    op = "attention_fwd"
    V.tensors(op, ("cu_seqlens_q", "cu_seqlens_k"), q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k)
    scale = V.softmax_scale(op, q, softmax_scale)
    max_q = 0 if max_seqlen_q is None else V.int_arg(op, "max_seqlen_q", max_seqlen_q)
    max_k = 0 if max_seqlen_k is None else V.int_arg(op, "max_seqlen_k", max_seqlen_k)
    return torch.ops.rlk.attention_fwd(q, k, v, int(V.bool_arg(op, "causal", causal)), scale, cu_seqlens_q,
                                       cu_seqlens_k, max_q, max_k, spell(split_kv))


define("attention_fwd")


@impl("attention_fwd")
def _attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, split_kv):
    op = "attention_fwd"
    check_attention(op, q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, split_kv)
    check_varlen_values(op, q, k, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return kernel_for(op, q.device)(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, split_kv)


@fake("attention_fwd")
def _attention_fwd_fake(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, split_kv):
    check_attention("attention_fwd", q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, split_kv)
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens_q), dtype=lse_dtype(q))


define("attention_bwd")


@impl("attention_bwd")
def _attention_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, split_kv):
    op = "attention_bwd"
    check_attention(op, q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, split_kv)
    _check_bwd(op, dout, q, out, lse, dlse, cu_seqlens_q)
    check_varlen_values(op, q, k, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return kernel_for(op, q.device)(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, split_kv)


@fake("attention_bwd")
def _attention_bwd_fake(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, split_kv):
    check_attention("attention_bwd", q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, split_kv)
    _check_bwd("attention_bwd", dout, q, out, lse, dlse, cu_seqlens_q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, cu_q, cu_k, max_q, max_k, split_kv = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (causal, scale, max_q, max_k, split_kv)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    causal, scale, max_q, max_k, split_kv = ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.rlk.attention_bwd(dout, q, k, v, out, lse, dlse, causal, scale, cu_q, cu_k,
                                             max_q, max_k, split_kv)
    return dq, dk, dv, None, None, None, None, None, None, None


autograd("attention_fwd", _backward, _setup_context)


# ------------------------------------------------------------------ validation
def lse_shape(q, cu_seqlens_q):
    if cu_seqlens_q is None:
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[1], q.shape[0])


def lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_heads(op, hq, hkv):
    if hq < 1 or hkv < 1 or hq % hkv:
        V.fail(op, f"q heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA, both >= 1")


def check_split_kv(op, split_kv, allowed=("disabled", "canonical")):
    try:
        policy = SplitKVPolicy.parse(split_kv)
    except ValueError as e:
        V.fail(op, str(e))
    if policy.kind not in allowed:
        V.fail(op, f"split_kv {split_kv!r} is not allowed here (allowed: {', '.join(allowed)})" +
               ("; 'auto' depends on the batch and is never strict" if policy.kind == "auto" else ""))
    return policy


def check_attention(op, q, k, v, causal, softmax_scale, cu_q, cu_k, split_kv="disabled"):
    check_split_kv(op, split_kv)
    varlen = cu_q is not None or cu_k is not None
    if (cu_q is None) != (cu_k is None):
        V.fail(op, "cu_seqlens_q and cu_seqlens_k must be given together (packed varlen) or both be None")
    n, layout = (3, "[T, H, D]") if varlen else (4, "[B, S, H, D]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.ndim(op, name, t, n, layout + (" (varlen: cu_seqlens given)" if varlen else ""))
        V.float_dtype(op, name, t)
    V.same_dtype(op, "k", k, "q", q)
    V.same_dtype(op, "v", v, "q", q)
    if v.shape != k.shape:
        V.fail(op, f"v must have k's shape {V.shape_str(k)}, got {V.shape_str(v)}")
    if k.shape[-1] != q.shape[-1]:
        V.fail(op, f"k's head_dim ({k.shape[-1]}) must equal q's head_dim ({q.shape[-1]})")
    V.head_dim(op, "q", q)
    check_heads(op, q.shape[-2], k.shape[-2])
    if not varlen:
        if k.shape[0] != q.shape[0]:
            V.fail(op, f"k must have q's batch size {q.shape[0]}, got {k.shape[0]}")
        if causal and q.shape[1] > k.shape[1]:
            V.fail(op, f"causal attention needs at least as many keys as queries (bottom-right aligned): "
                       f"q has {q.shape[1]} queries, k has {k.shape[1]} keys")
    else:
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            V.int_dtype(op, name, cu, torch.int32)
            V.ndim(op, name, cu, 1, "[batch + 1]")
        if cu_q.shape != cu_k.shape:
            V.fail(op, f"cu_seqlens_k must have cu_seqlens_q's shape {V.shape_str(cu_q)}, got {V.shape_str(cu_k)}")
    V.scale_value(op, softmax_scale, q.dtype)
    if causal not in (0, 1):
        V.fail(op, f"causal must be 0 or 1, got {causal}")
    V.same_device(op, {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})


def check_varlen_values(op, q, k, causal, cu_q, cu_k, max_q, max_k):
    if cu_q is None:
        return
    if V.on_device(cu_q) and V.value_checks_enabled(cu_q, op) and min(cu_q.shape[0], cu_k.shape[0]) >= 2:
        cq, ck = cu_q.long(), cu_k.long()  # int64 differences (int32 ones wrap: see V.check_cu_seqlens)
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        masks = [cu_q[:1] != 0, cu_k[:1] != 0, lq < 0, lk < 0, cu_q[-1:] != q.shape[0], cu_k[-1:] != k.shape[0],
                 lq > (max_q or q.shape[0]), lk > (max_k or k.shape[0])]
        if causal:
            masks.append(lq > lk)
        if V.all_clear(*masks):
            return
        cu_q, cu_k = cu_q.cpu(), cu_k.cpu()  # build the message on the host
    V.check_cu_seqlens(op, "cu_seqlens_q", cu_q, q.shape[0], max_q or q.shape[0], "max_seqlen_q")
    V.check_cu_seqlens(op, "cu_seqlens_k", cu_k, k.shape[0], max_k or k.shape[0], "max_seqlen_k")
    if causal and V.value_checks_enabled(cu_q, op):
        cq, ck = cu_q.cpu().long(), cu_k.cpu().long()
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        bad = lq > lk
        if bool(bad.any()):
            i = V.first_bad(bad)[0]
            V.fail(op, f"causal attention needs at least as many keys as queries: sequence {i} has "
                       f"{int(lq[i])} queries but {int(lk[i])} keys")


def _check_bwd(op, dout, q, out, lse, dlse, cu_q):
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != q.shape:
            V.fail(op, f"{name} must have q's shape {V.shape_str(q)}, got {V.shape_str(t)}")
        V.same_dtype(op, name, t, "q", q)
    want = tuple(lse_shape(q, cu_q))
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is None:
            continue
        if tuple(t.shape) != want:
            V.fail(op, f"{name} must have shape {list(want)}, got {V.shape_str(t)}")
        if t.dtype != lse_dtype(q):
            V.fail(op, f"{name} must be {lse_dtype(q)}, got {t.dtype}")
    V.same_device(op, {"q": q, "dout": dout, "out": out, "lse": lse, "dlse": dlse})
