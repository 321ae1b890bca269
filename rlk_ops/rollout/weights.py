"""The rollout model's weights: exactly the values the trainer's forward computes with.

    sync_weights(trainer, rollout)     # after every optimizer step, on every rank of the trainer's mesh
    send_weights(trainer, src=, group=) / receive_weights(rollout, src=, group=)   # a rollout in other processes

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

``send_weights``/``receive_weights`` move the same values to rollout models in other processes: the
trainer's ranks produce them in an order fixed before any collective (``_plan``), rank ``src`` broadcasts
each over ``group`` as bytes, after a manifest that every receiver checks (the same checks) and verdicts
that reach every rank of the group and of the trainer's mesh.
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


def _mesh_of(dtensors: list[torch.Tensor]):
    """The mesh of the DTensor parameters (one set of ranks: the verdicts go over it, ``preflight_mesh``)."""
    meshes = {id(t.device_mesh): t.device_mesh for t in dtensors}
    ranks = {tuple(sorted(m.mesh.flatten().tolist())) for m in meshes.values()}
    if len(ranks) != 1:
        raise RlkInputError(f"{WHERE}: the trainer's DTensor parameters live on meshes over different ranks "
                            f"({sorted(ranks)}); sync_weights needs one set of ranks")
    return next(iter(meshes.values()))


def _spec(trainer_params: dict, compute: dict[int, torch.dtype]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (whole shape, the dtype the trainer computes with) of each trainer parameter."""
    return {name: (tuple(p.shape), compute.get(id(p), p.dtype))   # (a DTensor's shape is the whole tensor's)
            for name, p in trainer_params.items()}


def _problem(spec, trainer_ties, rollout_params, rollout_ties) -> str | None:
    t_names, r_names = [*spec, *trainer_ties], [*rollout_params, *rollout_ties]
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
    for name, (shape, want) in spec.items():
        r = rollout_params[name]
        if tuple(r.shape) != shape:
            return f"rollout parameter {name} must have the trainer's shape {list(shape)}, got {list(r.shape)}"
        if r.dtype != want:
            return (f"rollout parameter {name} must be {want}, the dtype the trainer computes with, got {r.dtype}: "
                    f"cast the rollout model to {want} (a rollout computing in another dtype gives other log-probs)")
        if dtensor is not None and isinstance(r, dtensor):
            return f"rollout parameter {name} is a DTensor: the rollout model holds whole tensors"
    return None


def _plan(trainer: nn.Module, trainer_params: dict) -> list[tuple]:
    """The order the trainer's whole values come in, fixed before any collective (a receiver in another
    process reads it first): for each FSDP2 module, ("fsdp", module, [(name, its path in the module)]) for the
    parameters its state manages (``unshard`` makes those whole; an inner module's stay sharded); then
    ("gathered" | "plain", name) for each other parameter, in the model's order."""
    fsdp, dtensor = _fsdp_module_type(), _dtensor_type()
    name_of = {id(p): name for name, p in trainer_params.items()}
    planned: set[str] = set()
    plan: list[tuple] = []
    for m in trainer.modules():
        if fsdp is None or not isinstance(m, fsdp):
            continue
        managed = {id(fp.sharded_param) for g in _param_groups(m._get_fsdp_state()) for fp in g.fsdp_params}
        own = []
        for raw, p in m.named_parameters():
            if id(p) in managed and name_of[id(p)] not in planned:
                own.append((name_of[id(p)], raw))
                planned.add(name_of[id(p)])
        plan.append(("fsdp", m, own))
    for name, p in trainer_params.items():
        if name not in planned:
            plan.append(("gathered" if dtensor is not None and isinstance(p, dtensor) else "plain", name))
    return plan


def _plan_names(plan: list[tuple]) -> list[str]:
    """The parameter names in the order ``_values`` yields them (the manifest's order)."""
    return [n for step in plan for n in ([name for name, _ in step[2]] if step[0] == "fsdp" else [step[1]])]


def _rollout_of(rollout: nn.Module) -> nn.Module:
    """The model whose parameters receive: the rollout engine's view of an HF model stands for its model."""
    return rollout.__dict__.get("hf_model", rollout)


def _values(plan: list[tuple], trainer_params: dict):
    """Yields (name, whole value in the compute dtype, kind) in the plan's order: an FSDP2 module unsharded
    (its all-gather) for its parameters and resharded after, one module at a time; a DTensor gathered
    (``full_tensor``, a collective); a plain parameter as it is. Collective: every trainer rank runs it."""
    dtensor = _dtensor_type()
    for step in plan:
        if step[0] == "fsdp":
            _, m, own = step
            m.unshard()
            try:
                for name, raw in own:
                    value = m.get_parameter(raw)
                    if dtensor is not None and isinstance(value, dtensor):
                        raise RuntimeError(f"{WHERE}: internal error: {name} is still sharded after unshard()")
                    yield name, value, "unsharded"
            finally:
                m.reshard()
            yield None, None, "fsdp_module"
        elif step[0] == "gathered":
            yield step[1], trainer_params[step[1]].full_tensor(), "gathered"
        else:
            yield step[1], trainer_params[step[1]], "plain"


def _new_report() -> dict:
    return {"tensors": 0, "elements": 0, "bytes": 0, "fsdp_modules": 0, "unsharded": 0, "gathered": 0, "plain": 0}


def _count(report: dict, kind: str, value: torch.Tensor | None) -> None:
    if kind == "fsdp_module":
        report["fsdp_modules"] += 1
        return
    report[kind] += 1
    report["tensors"] += 1
    report["elements"] += value.numel()
    report["bytes"] += value.numel() * value.element_size()


def _check_modules(where: str, **models) -> None:
    for arg, m in models.items():
        if not isinstance(m, nn.Module):
            raise RlkInputError(f"{where}: {arg} must be a torch.nn.Module, got {type(m).__module__}."
                                f"{type(m).__qualname__}")


@torch.no_grad()
def sync_weights(trainer: nn.Module, rollout: nn.Module) -> dict:
    """Copies into ``rollout``'s parameters the values ``trainer``'s forward computes with (module doc).
    Collective when the trainer has DTensor parameters (FSDP2 or tensor parallel): every rank of its mesh
    calls it. Returns counts: {"tensors", "elements", "bytes" (copied), "fsdp_modules" (unsharded and
    resharded), "unsharded", "gathered", "plain" (tensors copied each way)}."""
    _check_modules(WHERE, trainer=trainer, rollout=rollout)
    rollout = _rollout_of(rollout)
    if rollout is trainer:
        raise RlkInputError(f"{WHERE}: rollout is the trainer itself; the rollout copy must be its own model")
    dtensor = _dtensor_type()
    t_params, t_ties = _parameters(trainer)
    r_params, r_ties = _parameters(rollout)
    dparams = [p for p in t_params.values() if dtensor is not None and isinstance(p, dtensor)]
    mesh = _mesh_of(dparams) if dparams else None
    try:
        problem = _problem(_spec(t_params, _fsdp_compute_dtypes(trainer)), t_ties, r_params, r_ties)
        plan = _plan(trainer, t_params) if problem is None else []
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before any collective
        problem = f"{type(e).__name__}: {e}"
    if dparams:
        from rlk_ops.distributed.checks import preflight_mesh
        preflight_mesh(mesh, WHERE, problem, {"parameters": len(t_params), "dtensors": len(dparams)})
    elif problem is not None:
        raise RlkInputError(f"{WHERE}: {problem}")

    report = _new_report()
    for name, value, kind in _values(plan, t_params):
        if name is not None:
            r = r_params[name]
            if value.dtype != r.dtype or tuple(value.shape) != tuple(r.shape):   # (checked above: a bug if so)
                raise RuntimeError(f"{WHERE}: internal error: {name} came as {value.dtype} {list(value.shape)}, "
                                   f"the rollout holds {r.dtype} {list(r.shape)}")
            r.copy_(value)
        _count(report, kind, value)
    return report


# ------------------------------------------------------------------ to rollout workers in other processes
SEND, RECEIVE = "send_weights", "receive_weights"


def _wire_type(group, device: torch.device) -> str:
    """Where a value travels: "cuda" for an NCCL-only group, "cpu" for a gloo-only one, else (a
    "cpu:gloo,cuda:nccl" group) the sender's device type, which the manifest names so that every rank
    posts its buffer on the same backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return "cuda"
    if "nccl" not in backend:
        return "cpu"
    return "cuda" if device.type == "cuda" else "cpu"


def _local(wire_type: str) -> torch.device:
    """This rank's device of the wire's type (its current CUDA device: the sender's index means nothing here)."""
    return torch.device("cuda", torch.cuda.current_device()) if wire_type == "cuda" else torch.device("cpu")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8 (every backend moves bytes; the bits arrive as they left)."""
    return t.reshape(-1).view(torch.uint8)


def _gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _exchange(role: str, src: int, problem: str | None, group) -> str | None:
    """Every rank of ``group`` says its role, the source it was given and its problem; returns the first
    problem any rank has (every rank finds one if any has), naming the rank."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    said = _gather_objects((role, src, problem), group)
    for rank, (r_role, r_src, r_problem) in zip(ranks, said):
        if r_src != src:
            return f"rank {rank} ({r_role}) was given src={r_src}, rank {dist.get_rank()} src={src}"
        if r_problem is not None:
            return f"rank {rank} ({r_role}): {r_problem}"
    senders = [rank for rank, (r_role, _, _) in zip(ranks, said) if r_role == SEND]
    if src not in ranks or src not in senders:
        return (f"src={src} must be a rank of the group that calls {SEND} (the group's ranks {ranks}; "
                       f"calling {SEND}: {senders})")
    if len(senders) == len(ranks):
        return f"no rank of the group {ranks} calls {RECEIVE}"
    return None


@torch.no_grad()
def send_weights(trainer: nn.Module, *, src: int, group=None) -> dict:
    """Sends the values ``trainer``'s forward computes with (as ``sync_weights`` copies them) to rollout
    models in other processes: rank ``src`` broadcasts each whole value over ``group`` (default: every
    rank), whose other ranks call ``receive_weights`` (a trainer rank in ``group`` other than ``src`` takes
    the values in and drops them: give a group of ``src`` and the rollout ranks to save that).

    Every rank of the trainer's mesh calls it (FSDP2's unshard and ``full_tensor`` are collectives over it);
    a trainer without DTensor parameters is one process, ``src``. Before any value moves: ``src`` sends the
    manifest (names in sending order, whole shapes, compute dtypes, ties), every receiver checks its model
    against it as ``sync_weights`` does, and every verdict reaches every rank of ``group`` and of the
    trainer's mesh, so a refusal raises everywhere, naming the rank and the problem, and changes no model.
    Returns ``sync_weights``' counts (the tensors src sent)."""
    _check_modules(SEND, trainer=trainer)
    from rlk_ops.distributed.checks import DistributedInputError, preflight_mesh, require_initialized
    require_initialized(SEND)
    dtensor = _dtensor_type()
    t_params, t_ties = _parameters(trainer)
    dparams = [p for p in t_params.values() if dtensor is not None and isinstance(p, dtensor)]
    me = dist.get_rank()
    problem, agreed, mesh, plan, spec = None, None, None, [], {}
    try:
        if dparams:
            mesh = _mesh_of(dparams)   # (refused: the same verdict on every trainer rank, which then skip the preflights)
        if not dparams and me != src:
            problem = (f"the trainer has no DTensor parameters, so it is one process, src={src}; rank {me} calls "
                       f"{SEND} too")
        spec = _spec(t_params, _fsdp_compute_dtypes(trainer))
        plan = _plan(trainer, t_params)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it before any collective
        problem = f"{type(e).__name__}: {e}"
    if mesh is not None:
        try:   # the trainer's ranks agree first (a rank that failed above is named on all of them)
            preflight_mesh(mesh, SEND, problem, {"parameters": len(t_params), "dtensors": len(dparams)})
        except DistributedInputError as e:
            problem, agreed = str(e), e
    in_group = group is None or me in dist.get_process_group_ranks(group)
    verdict = None
    if in_group:
        verdict = _exchange(SEND, src, problem, group)
        if verdict is None:
            order = _plan_names(plan)
            wire = _wire_type(group, next(iter(t_params.values())).device if t_params else torch.device("cpu"))
            manifest = [{"order": order, "spec": spec, "ties": t_ties, "wire": wire}] if me == src else [None]
            dist.broadcast_object_list(manifest, src=src, group=group)
            manifest = manifest[0]
            verdict = next((v for v in _gather_objects(None, group) if v is not None), None)
    if mesh is not None:   # the verdict of the group reaches the trainer ranks outside it
        preflight_mesh(mesh, SEND, verdict if in_group else None, {"parameters": len(t_params)})
    if verdict is not None:
        raise DistributedInputError(f"{SEND}: {verdict}")
    if agreed is not None or problem is not None:   # (a trainer rank outside the group; the group heard it via src)
        raise agreed or DistributedInputError(f"{SEND}: {problem}")

    report = _new_report()
    wire = _local(manifest["wire"]) if in_group else None
    for name, value, kind in _values(plan, t_params):
        if name is not None and in_group:
            if me == src:
                buf = _as_bytes(value.detach().to(wire).contiguous())
            else:
                buf = torch.empty(value.numel() * value.element_size(), dtype=torch.uint8, device=wire)
            dist.broadcast(buf, src=src, group=group)
        _count(report, kind, value)
    return report


@torch.no_grad()
def receive_weights(rollout: nn.Module, *, src: int, group=None) -> dict:
    """Receives into ``rollout``'s parameters what ``send_weights`` on rank ``src`` sends over ``group``
    (every rank of ``group`` but the trainer's calls this). Checked against the sender's manifest before
    any value moves (``send_weights``): a refusal raises on every rank and leaves this model as it was.
    ``rollout`` may be the rollout engine's view of an HF model. Returns {"tensors", "elements", "bytes"}."""
    _check_modules(RECEIVE, rollout=rollout)
    from rlk_ops.distributed.checks import DistributedInputError, require_initialized
    require_initialized(RECEIVE)
    rollout = _rollout_of(rollout)
    r_params, r_ties = _parameters(rollout)
    verdict = _exchange(RECEIVE, src, None, group)
    if verdict is None:
        manifest = [None]
        dist.broadcast_object_list(manifest, src=src, group=group)
        manifest = manifest[0]
        try:
            mine = _problem(manifest["spec"], manifest["ties"], r_params, r_ties)
        except Exception as e:  # noqa: BLE001 - the sender must hear of it
            mine = f"{type(e).__name__}: {e}"
        if mine is not None:
            mine = f"rank {dist.get_rank()} ({RECEIVE}): {mine}"
        verdict = next((v for v in _gather_objects(mine, group) if v is not None), None)
    if verdict is not None:
        raise DistributedInputError(f"{RECEIVE}: {verdict}")
    wire = _local(manifest["wire"])
    report = {"tensors": 0, "elements": 0, "bytes": 0}
    for name in manifest["order"]:
        r = r_params[name]
        direct = r.device == wire and r.is_contiguous()
        buf = _as_bytes(r.data) if direct else torch.empty(r.numel() * r.element_size(), dtype=torch.uint8,
                                                            device=wire)
        dist.broadcast(buf, src=src, group=group)
        if not direct:
            r.copy_(buf.view(r.dtype).reshape(r.shape))
        report["tensors"] += 1
        report["elements"] += r.numel()
        report["bytes"] += r.numel() * r.element_size()
    return report
