"""Tensor and context parallelism for the Qwen3 attention block on a (tp, cp) DeviceMesh.

* ``mesh``: ``init_mesh(tp, cp)`` and the placement conventions (``PLACEMENTS``).
* ``layout``: host-built sequence sharding over cp (contiguous, zigzag, canonical chunks).
* ``cp_attention``: context-parallel attention (all-gather K/V, prefix attention,
  deterministic dK/dV reduction); forward and dQ bitwise equal to one device.
* ``reductions``: deterministic all-reduce and canonical (topology-invariant) sums.
* ``local_block`` / ``parallel_block``: the block on local shards, and as a module
  with DTensor parameters (``ParallelQwen3Attention``).
* ``sharding``: ``register_sharding`` rules so rlk ops accept DTensors (imported here).
* ``checks``: the cross-rank preflight that rejects bad input before any collective.

Importing this package needs torch.distributed; ``import rlk_ops`` does not import it.
"""
from rlk_ops.distributed import sharding as _sharding  # noqa: F401 - imported to register the DTensor rules
from rlk_ops.distributed.checks import DistributedInputError, preflight
from rlk_ops.distributed.cp_attention import context_parallel_attention
from rlk_ops.distributed.layout import CPLayout, LayoutError, build_layout
from rlk_ops.distributed.mesh import DIM_NAMES, PLACEMENTS, init_mesh
from rlk_ops.distributed.parallel_block import ParallelQwen3Attention

__all__ = [
    "init_mesh", "DIM_NAMES", "PLACEMENTS", "build_layout", "CPLayout", "LayoutError",
    "context_parallel_attention", "ParallelQwen3Attention", "preflight", "DistributedInputError",
]
