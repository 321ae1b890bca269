"""CPU reference backend: deterministic by construction, and batch-invariant for the forward ops
(meta/specs.py: the backward ops' weight and key gradients sum over the batch, so no such claim).

Kernels are plain functions named like their ops (the dispatch point looks them up
by name). ``numerics`` holds the fixed-order reductions and transcendental functions
every kernel here is built from.
"""
from rlk_ops.kernels.cpu.attention import attention_bwd, attention_fwd, paged_attention
from rlk_ops.kernels.cpu.linear import linear, linear_bias_bwd, linear_bwd
from rlk_ops.kernels.cpu.merge import merge_attn_states, merge_attn_states_bwd
from rlk_ops.kernels.cpu.norm import qk_rmsnorm, qk_rmsnorm_bwd
from rlk_ops.kernels.cpu.paged_attention_auto import paged_attention_auto
from rlk_ops.kernels.cpu.paged_kv import paged_kv_append, paged_kv_gather
from rlk_ops.kernels.cpu.qk_norm_rope import qk_norm_rope
from rlk_ops.kernels.cpu.rope import rope, rope_bwd

__all__ = [
    "attention_bwd", "attention_fwd", "paged_attention", "linear", "linear_bias_bwd", "linear_bwd",
    "qk_rmsnorm", "qk_rmsnorm_bwd", "paged_kv_append", "paged_kv_gather", "rope", "rope_bwd",
    "qk_norm_rope", "paged_attention_auto", "merge_attn_states", "merge_attn_states_bwd",
]
