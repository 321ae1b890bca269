"""Checks on how a model built from rlk ops is set up, run at each forward.

The blocks read their submodules' parameters (``q_proj.weight``) and hand them to rlk ops; they never
call those submodules. So a submodule that is not what the block assumes would be bypassed, silently:

* a wrapper whose ``weight`` is its base layer's (a LoRA adapter as peft builds it) would add nothing
  to the output and its adapter weights would get no gradient, on both sides alike, so the train-vs-rollout
  comparison still held while the policy was not the one trained (a session 39 audit);
* hooks on such a submodule would never fire.

And rlk ops compute in their inputs' dtype: they do not autocast. Under ``torch.autocast`` a module
whose parameters are float32 ran in float32 without a word while the caller expected bfloat16, and a
bfloat16 rollout then computed other bits (a session 39 audit). Both are refused with the reason.
"""
from __future__ import annotations

import torch
from torch import nn

from rlk_ops.ops._validate import RlkInputError

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def check_weight_modules(where: str, owner: nn.Module, names: tuple[str, ...], kind: type[nn.Module]) -> None:
    """Each ``owner.<name>`` is a module with ``kind``'s forward (``nn.Linear``, or a parameter holder
    that has none) and no module hooks. A subclass that keeps the forward passes (a parametrized
    ``nn.Linear``, whose ``weight`` the parametrization computes on every read)."""
    for name in names:
        m = getattr(owner, name, None)
        inner = getattr(m, "_orig_mod", None)   # torch.compile(m): its weights are m's; never called either way
        if type(m).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
            _no_hooks(where, name, m)
            m = inner
        if not isinstance(m, nn.Module) or type(m).forward is not kind.forward or "forward" in m.__dict__:
            want = f"torch.nn.{kind.__qualname__}" if kind.__module__.startswith("torch.nn.") else \
                f"{kind.__module__}.{kind.__qualname__}"
            got = "None (missing)" if m is None else f"{type(m).__module__}.{type(m).__qualname__}" + (
                " with its forward replaced on the instance" if "forward" in getattr(m, "__dict__", {}) else "")
            raise RlkInputError(
                f"{where}: {name} must be a {want} (or a subclass that keeps its "
                f"forward), got {got}. The block reads {name}'s parameters "
                f"and calls rlk ops on them; it never calls {name}, so a wrapper's forward (a LoRA adapter) would "
                f"be bypassed. Merge the adapter into the weight, or build the block from rlk ops around it")
        _no_hooks(where, name, m)


def _no_hooks(where: str, name: str, m: nn.Module) -> None:
    hooks = [h.strip("_") for h in _HOOKS if getattr(m, h, None)]
    if hooks:
        raise RlkInputError(
            f"{where}: {name} has module hooks ({', '.join(hooks)}), which would never run: the block reads "
            f"{name}'s parameters and never calls it. Register the hooks on the block instead")


def check_autocast(where: str, device_type: str, dtype: torch.dtype) -> None:
    """Refuse a ``torch.autocast`` region for ``device_type`` whose dtype is not the parameters' ``dtype``
    (the same dtype changes nothing and passes). Device types without autocast (meta) pass. For cpu and
    cuda ``torch.amp.is_autocast_available`` is not called: Dynamo of torch 2.11 cannot trace it and broke
    the graph there (the block under torch.compile; session 40, on the GPU); the other two calls it folds."""
    if device_type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(device_type):
        return
    if torch.is_autocast_enabled(device_type):
        want = torch.get_autocast_dtype(device_type)
        if want != dtype:
            raise RlkInputError(
                f"{where}: torch.autocast is on for {device_type} with {want}, and the parameters are {dtype}. "
                f"rlk ops compute in their inputs' dtype and do not autocast, so this would run in {dtype}, not "
                f"{want}. Cast the module (.to({want})) and its inputs, or call it outside the autocast region")
