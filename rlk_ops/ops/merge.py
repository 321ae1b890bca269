"""rlk::merge_attn_states: merge partial attention states in a fixed order.

    out_parts [N, ..., S, H, D]  (N states of the attention ops' out layout:
                                  dense [N, B, S, H, D] or varlen [N, T, H, D])
    lse_parts [N, ..., H, S]     (their lse: [N, B, H, S] or [N, H, T]; fp32, fp64 for fp64)
    -> out [..., S, H, D] (out_parts' dtype), lse [..., H, S]

State n is a row's attention over one key chunk. The states are merged in ascending n
with one fp32 formula (kernels/cpu/merge.py has it written out); a state with
lse = -inf (no visible key) is skipped, so padding never changes a row's bits. This is
the merge of the ``canonical:C`` split-KV policy: training (``attention_fwd``) and
rollout (``paged_attention``) both end in it, so they share its bits.

Gradient: ``rlk::merge_attn_states_bwd(dout, dlse?, out_parts, lse_parts, out, lse)
-> (d_out_parts, d_lse_parts)``, its own op (it reduces over head_dim).
"""
from __future__ import annotations

import torch

from rlk_ops.kernels.dispatch import kernel_for
from rlk_ops.ops import _validate as V
from rlk_ops.ops._library import autograd, define, fake, impl
from rlk_ops.ops.attention import lse_dtype


def merge_attn_states(out_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial (out, lse) states stacked on dim 0; returns (out, lse). Differentiable."""
    V.tensors("merge_attn_states", out_parts=out_parts, lse_parts=lse_parts)
    return torch.ops.rlk.merge_attn_states(out_parts, lse_parts)


define("merge_attn_states")


@impl("merge_attn_states")
def _merge(out_parts, lse_parts):
    _check("merge_attn_states", out_parts, lse_parts)
    return kernel_for("merge_attn_states", out_parts.device)(out_parts, lse_parts)


@fake("merge_attn_states")
def _merge_fake(out_parts, lse_parts):
    _check("merge_attn_states", out_parts, lse_parts)
    return out_parts.new_empty(out_parts.shape[1:]), lse_parts.new_empty(lse_parts.shape[1:])


define("merge_attn_states_bwd")


@impl("merge_attn_states_bwd")
def _merge_bwd(dout, dlse, out_parts, lse_parts, out, lse):
    _check_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    return kernel_for("merge_attn_states_bwd", out_parts.device)(dout, dlse, out_parts, lse_parts, out, lse)


@fake("merge_attn_states_bwd")
def _merge_bwd_fake(dout, dlse, out_parts, lse_parts, out, lse):
    _check_bwd(dout, dlse, out_parts, lse_parts, out, lse)
    return out_parts.new_empty(out_parts.shape), lse_parts.new_empty(lse_parts.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, dout, dlse):
    out_parts, lse_parts, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return torch.ops.rlk.merge_attn_states_bwd(dout, dlse, out_parts, lse_parts, out, lse)


autograd("merge_attn_states", _backward, _setup_context)


# ------------------------------------------------------------------ validation
def _check(op, out_parts, lse_parts):
    V.float_dtype(op, "out_parts", out_parts)
    if out_parts.dim() < 4:
        V.fail(op, f"out_parts must be [N, ..., S, H, D] with at least 4 dims, got shape {V.shape_str(out_parts)}")
    if out_parts.shape[0] < 1:
        V.fail(op, f"out_parts must hold at least one state (N >= 1), got shape {V.shape_str(out_parts)}")
    *lead, s, h, _ = out_parts.shape
    want = (*lead, h, s)
    if tuple(lse_parts.shape) != want:
        V.fail(op, f"lse_parts must have shape {list(want)} ([N, ..., H, S] for out_parts "
                   f"{V.shape_str(out_parts)}), got {V.shape_str(lse_parts)}")
    if lse_parts.dtype != lse_dtype(out_parts):
        V.fail(op, f"lse_parts must be {lse_dtype(out_parts)} (for {out_parts.dtype} out_parts), got {lse_parts.dtype}")
    V.same_device(op, {"out_parts": out_parts, "lse_parts": lse_parts})


def _check_bwd(dout, dlse, out_parts, lse_parts, out, lse):
    op = "merge_attn_states_bwd"
    _check(op, out_parts, lse_parts)
    for name, t, ref, ref_name in (("dout", dout, out_parts, "out_parts"), ("out", out, out_parts, "out_parts"),
                                   ("lse", lse, lse_parts, "lse_parts"), ("dlse", dlse, lse_parts, "lse_parts")):
        if t is None:
            continue
        if t.shape != ref.shape[1:]:
            V.fail(op, f"{name} must have shape {list(ref.shape[1:])} ({ref_name} without its state dim), "
                       f"got {V.shape_str(t)}")
        V.same_dtype(op, name, t, ref_name, ref)
    V.same_device(op, {"out_parts": out_parts, "dout": dout, "dlse": dlse, "out": out, "lse": lse})
