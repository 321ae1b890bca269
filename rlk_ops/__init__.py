"""rlk_ops: the Qwen3 attention block, bitwise identical between trainer and rollout.

Every stage is a ``torch.ops.rlk`` custom op with a fake kernel and a determinism
spec (``rlk_ops.meta.specs``). Importing this package registers them all; it needs
no CUDA package (CUDA backends are imported on first use).
"""
from rlk_ops import ops as _ops  # noqa: F401 - registers torch.ops.rlk.*
from rlk_ops.kernels.dispatch import (
    BackendUnavailable,
    StrictModeError,
    set_strict_mode,
    strict,
    strict_mode,
    use_backend,
)
from rlk_ops.meta import provenance
from rlk_ops.meta.specs import REGISTRY as OP_SPECS
from rlk_ops.ops._validate import RlkInputError, ValueChecksInCapture, value_checks
from rlk_ops.ops.attention import attention
from rlk_ops.ops.collectives import all_gather, reduce_scatter
from rlk_ops.ops.linear import linear
from rlk_ops.ops.merge import merge_attn_states
from rlk_ops.ops.paged_attention import paged_attention
from rlk_ops.ops.paged_attention_auto import paged_attention_auto
from rlk_ops.ops.paged_kv import paged_kv_append, paged_kv_gather
from rlk_ops.ops.qk_norm_rope import qk_norm_rope
from rlk_ops.ops.qk_rmsnorm import qk_rmsnorm
from rlk_ops.ops.rope import rope

__version__ = "0.1.0"

__all__ = [
    "attention", "paged_attention", "paged_kv_append", "paged_kv_gather", "qk_rmsnorm", "rope",
    "linear", "all_gather", "reduce_scatter", "qk_norm_rope", "paged_attention_auto", "merge_attn_states",
    "strict_mode", "set_strict_mode", "strict", "use_backend", "provenance", "OP_SPECS",
    "RlkInputError", "StrictModeError", "BackendUnavailable", "value_checks", "ValueChecksInCapture",
    "__version__",
]
