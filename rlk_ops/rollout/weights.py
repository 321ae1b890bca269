"""The rollout model's weights: exactly the values the trainer's forward computes with.

    sync_weights(trainer, rollout)     # after every optimizer step, on every rank of the trainer's mesh

An RL trainer usually keeps float32 master weights and computes in bfloat16 (FSDP2's
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``), sharded over its ranks; the rollout engine holds
one bfloat16 copy. The rollout's log-probs are the trainer's, bitwise, only when that copy holds the bits
the trainer's forward reads: the same rounding of each master weight, gathered whole. ``sync_weights``
copies them so:

* a module sharded by ``fully_shard`` (FSDP2): ``unshard()`` (its all-gather, in the policy's
  ``param_dtype``, the tensors its forward reads), copy, ``reshard()``; one module at a time (``unshard`` is
  not recursive), so at most one module's parameters are held whole besides the rollout copy;
* any other DTensor parameter (tensor parallel): ``full_tensor()``;
* a plain parameter: as it is.

Everything is checked before anything is copied, on every rank: the two models have the same parameter
names (wrapper segments such as ``_orig_mod`` or ``_checkpoint_wrapped_module`` dropped), the same tied
parameters, the same shapes, and each rollout parameter has the dtype the trainer computes with (a float32
rollout beside a bfloat16 trainer would compute other bits; a cast here would hide that). With DTensor
parameters the ranks exchange their verdicts first, so bad input raises on every rank and none is left
waiting in an all-gather. A refused call leaves the rollout as it was.

``rollout`` may be the rollout engine's view (``rlk_ops.compile.hf_model.rollout_model``): its HF model is
synced. Call it on every rank of the trainer's mesh, between steps (not inside a forward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# wrapper modules that add a path segment without changing the model (the binding check's set)
from rlk_ops.compile.boundary import _WRAPPER_SEGMENTS
from rlk_ops.ops._validate import RlkInputError

WHERE = "sync_weights"


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # (a torch built without distributed)
        return None
    return DTensor


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _parameters(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, str]]:
    """(name -> parameter for each distinct parameter, in the model's order; alias -> the name it ties to)."""
    first: dict[int, str] = {}
    params: dict[str, nn.Parameter] = {}
    ties: dict[str, str] = {}
    for raw, p in model.named_parameters(remove_duplicate=False):
        name = _clean(raw)
        if id(p) in first:
            if first[id(p)] != name:
                ties[name] = first[id(p)]
            continue
        first[id(p)] = name
        params[name] = p
    return params, ties


def _param_groups(state):
    """An FSDP2 state's parameter groups (torch 2.11: one ``_fsdp_param_group``; 2.13: ``_fsdp_param_groups``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _fsdp_compute_dtypes(trainer: nn.Module) -> dict[int, torch.dtype]:
    """id(sharded parameter) -> the dtype its module's forward computes with (the mixed-precision policy's
    ``param_dtype``, else the parameter's own), for every parameter an FSDP2 module manages."""
    fsdp = _fsdp_module_type()
    out: dict[int, torch.dtype] = {}
    if fsdp is None:
        return out
    for m in trainer.modules():
        if not isinstance(m, fsdp):
            continue
        groups = _param_groups(m._get_fsdp_state())
        for g in groups:
            policy, params = getattr(g, "mp_policy", None), getattr(g, "fsdp_params", None)
            if policy is None or params is None:
                raise RuntimeError(f"{WHERE}: this torch ({torch.__version__})'s FSDP2 keeps its mixed-precision "
                                   f"policy where rlk_ops does not look (supported: torch 2.11-2.13)")
            for fp in params:
                sharded = fp.sharded_param
                out[id(sharded)] = policy.param_dtype or sharded.dtype
    return out


def _group_of(dtensors: list[torch.Tensor]):
    """The process group spanning the ranks of every DTensor parameter's mesh: the mesh's own group when
    it is one-dimensional, the default group when the mesh spans every rank."""
    meshes = {id(t.device_mesh): t.device_mesh for t in dtensors}
    ranks = {tuple(sorted(m.mesh.flatten().tolist())) for m in meshes.values()}
    if len(ranks) != 1:
        raise RlkInputError(f"{WHERE}: the trainer's DTensor parameters live on meshes over different ranks "
                            f"({sorted(ranks)}); sync_weights needs one set of ranks")
    mesh = next(iter(meshes.values()))
    if mesh.ndim == 1:
        return mesh.get_group()
    if len(next(iter(ranks))) == dist.get_world_size():
        return None
    raise RlkInputError(f"{WHERE}: the trainer's mesh is {mesh.ndim}-dimensional over {len(next(iter(ranks)))} of "
                        f"{dist.get_world_size()} ranks; sync_weights supports a one-dimensional mesh or one over "
                        f"every rank")


def _problem(trainer_params, trainer_ties, rollout_params, rollout_ties, compute) -> str | None:
    t_names, r_names = [*trainer_params, *trainer_ties], [*rollout_params, *rollout_ties]
    missing = [n for n in t_names if n not in r_names]
    extra = [n for n in r_names if n not in t_names]
    if missing or extra:
        return ("the rollout model's parameters must be the trainer's: "
                + (f"missing from the rollout: {missing[:6]}{' ...' if len(missing) > 6 else ''}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"not in the trainer: {extra[:6]}{' ...' if len(extra) > 6 else ''}" if extra else ""))
    if trainer_ties != rollout_ties:
        return (f"the rollout model must tie the parameters the trainer ties: trainer {trainer_ties or 'none'}, "
                f"rollout {rollout_ties or 'none'} (alias -> parameter)")
    dtensor = _dtensor_type()
    for name, p in trainer_params.items():
        r = rollout_params[name]
        shape = tuple(p.shape)   # (a DTensor's shape is the whole tensor's)
        if tuple(r.shape) != shape:
            return f"rollout parameter {name} must have the trainer's shape {list(shape)}, got {list(r.shape)}"
        want = compute.get(id(p), p.dtype)
        if r.dtype != want:
            return (f"rollout parameter {name} must be {want}, the dtype the trainer computes with, got {r.dtype}: "
                    f"cast the rollout model to {want} (a rollout computing in another dtype gives other log-probs)")
        if dtensor is not None and isinstance(r, dtensor):
            return f"rollout parameter {name} is a DTensor: the rollout model holds whole tensors"
    return None


@torch.no_grad()
def sync_weights(trainer: nn.Module, rollout: nn.Module) -> dict:
    """Copies into ``rollout``'s parameters the values ``trainer``'s forward computes with (module doc).
    Collective when the trainer has DTensor parameters (FSDP2 or tensor parallel): every rank of its mesh
    calls it. Returns counts: {"tensors", "elements", "bytes" (copied), "fsdp_modules" (unsharded and
    resharded), "unsharded", "gathered", "plain" (tensors copied each way)}."""
    for arg, m in (("trainer", trainer), ("rollout", rollout)):
        if not isinstance(m, nn.Module):
            raise RlkInputError(f"{WHERE}: {arg} must be a torch.nn.Module, got {type(m).__module__}."
                                f"{type(m).__qualname__}")
    rollout = rollout.__dict__.get("hf_model", rollout)   # the rollout engine's view of an HF model
    if rollout is trainer:
        raise RlkInputError(f"{WHERE}: rollout is the trainer itself; the rollout copy must be its own model")
    dtensor = _dtensor_type()
    t_params, t_ties = _parameters(trainer)
    r_params, r_ties = _parameters(rollout)
    dparams = [p for p in t_params.values() if dtensor is not None and isinstance(p, dtensor)]
    group = _group_of(dparams) if dparams else None
    try:
        problem = _problem(t_params, t_ties, r_params, r_ties, _fsdp_compute_dtypes(trainer))
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before any collective
        problem = f"{type(e).__name__}: {e}"
    if dparams:
        from rlk_ops.distributed.checks import preflight
        preflight(group, WHERE, problem, {"parameters": len(t_params), "dtensors": len(dparams)})
    elif problem is not None:
        raise RlkInputError(f"{WHERE}: {problem}")

    copied: set[str] = set()
    report = {"tensors": 0, "elements": 0, "bytes": 0, "fsdp_modules": 0, "unsharded": 0, "gathered": 0, "plain": 0}

    def put(name: str, value: torch.Tensor, kind: str) -> None:
        r = r_params[name]
        if value.dtype != r.dtype or tuple(value.shape) != tuple(r.shape):   # (checked above: a bug if so)
            raise RuntimeError(f"{WHERE}: internal error: {name} came as {value.dtype} {list(value.shape)}, the "
                               f"rollout holds {r.dtype} {list(r.shape)}")
        r.copy_(value)
        copied.add(name)
        report[kind] += 1
        report["tensors"] += 1
        report["elements"] += value.numel()
        report["bytes"] += value.numel() * value.element_size()

    fsdp = _fsdp_module_type()
    fsdp_modules = [(n, m) for n, m in trainer.named_modules() if fsdp is not None and isinstance(m, fsdp)]
    for prefix, m in fsdp_modules:   # unshard() is not recursive: an inner module's parameters stay sharded DTensors
        m.unshard()
        try:
            for raw, p in m.named_parameters(prefix=prefix):
                name = _clean(raw)
                if name in copied or (dtensor is not None and isinstance(p, dtensor)):
                    continue   # (a tie, or an inner module's parameter, sharded again)
                put(name, p, "unsharded")
        finally:
            m.reshard()
        report["fsdp_modules"] += 1
    for name, p in t_params.items():   # (in the same order on every rank: full_tensor is a collective)
        if name not in copied:
            if dtensor is not None and isinstance(p, dtensor):
                put(name, p.full_tensor(), "gathered")
            else:
                put(name, p, "plain")
    return report
