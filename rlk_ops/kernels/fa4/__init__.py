"""FA4 (flash_attn.cute) backend for rlk::attention_fwd, attention_bwd and paged_attention.

Importing this package does not import FA4: ``loader.load()`` does, on the first call.
``check_available(op)`` (called by the dispatch point) raises ``BackendUnavailable``
when FA4 is missing, lacks a control ``op`` needs, or there is no GPU; strict mode
turns that into an error, non-strict mode into a recorded CPU fallback.

``split_kv="canonical:C"`` runs the policy of kernels/cpu/canonical.py with these kernels'
single pass as the chunk partials and the Triton merge (kernels/fa4/canonical.py; proven
bitwise train == rollout on sm90 by benchmarks/canonical.py, results/h200/canonical.json).

Pinned controls (see loader.py for why): ``num_splits=1``, ``pack_gqa=True``,
``deterministic=True``, ``return_lse=True``. Proven bitwise on sm90 (H200) with
flash-attn-4 4.0.0b36 by benchmarks/attention.py (results/h200/attention.json).
"""
from rlk_ops.kernels.fa4.kernels import attention_bwd, attention_fwd, paged_attention
from rlk_ops.kernels.fa4.loader import NUM_SPLITS, PACK_GQA, backend_info, check_available

__all__ = ["attention_fwd", "attention_bwd", "paged_attention", "check_available", "backend_info",
           "NUM_SPLITS", "PACK_GQA"]
