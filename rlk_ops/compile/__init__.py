"""The Qwen3 attention block on rlk ops, and FX boundary inspection. ``rlk_ops.compile.hf`` puts the block
into transformers Qwen3 models (it imports transformers when called)."""
from rlk_ops.compile.block import Qwen3Attention, Qwen3AttentionConfig
from rlk_ops.compile.boundary import BoundaryReport, inspect_boundary

__all__ = ["Qwen3Attention", "Qwen3AttentionConfig", "inspect_boundary", "BoundaryReport"]
