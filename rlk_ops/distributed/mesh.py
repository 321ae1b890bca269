"""The 2-D (tp, cp) DeviceMesh and the placement conventions of the parallel block.

Mesh: ``init_device_mesh(device_type, (tp, cp), mesh_dim_names=("tp", "cp"))``; global
rank = tp_index * cp + cp_index, so the ranks of one cp group are adjacent.

Placements, as (tp, cp) pairs (the DTensor ``placements`` of a tensor on this mesh):

=====================  ==========================  ==================================
tensor                 placements                  why
=====================  ==========================  ==================================
hidden_states [T, h]   (Replicate, Shard(0))       tokens split over cp (cp layout)
positions [T]          (Replicate, Shard(0))       travel with their tokens
q_proj/k_proj/v_proj   (Shard(0), Replicate)       column-parallel: output rows = heads
o_proj [h, Hq*D]       (Shard(1), Replicate)       row-parallel: input columns = heads
q_norm/k_norm [D]      (Replicate, Replicate)      shared by every head and token
attention out [T,H,D]  (Shard(1), Shard(0))        heads over tp, tokens over cp
lse [Hq, T]            (Shard(0), Shard(1))        heads over tp, tokens over cp
block output [T, h]    (Replicate, Shard(0))       o_proj partial sums reduced over tp
=====================  ==========================  ==================================

"Shard(0) on cp" means the tensor's global view is in the *cp layout* (every rank's
tokens, rank after rank; ``layout.CPLayout``), which for zigzag sharding is not the
natural packed order.
"""
from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from rlk_ops.distributed.checks import DistributedInputError, preflight, show_bool, show_choice

DIM_NAMES = ("tp", "cp")
DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)

R = Replicate()
PLACEMENTS = {
    "hidden_states": (R, Shard(0)),
    "positions": (R, Shard(0)),
    "q_proj.weight": (Shard(0), R),
    "k_proj.weight": (Shard(0), R),
    "v_proj.weight": (Shard(0), R),
    "o_proj.weight": (Shard(1), R),
    "q_norm.weight": (R, R),
    "k_norm.weight": (R, R),
    "attention": (Shard(1), Shard(0)),
    "lse": (Shard(0), Shard(1)),
    "output": (R, Shard(0)),
}


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DEVICE_TYPES = ("cpu", "cuda")
# init_mesh's meshes, by (tp, cp, device_type, timeout in s): each init_device_mesh call makes new
# process groups (3 threads and 4 file descriptors a rank each on gloo, never freed), so a repeated
# call returns the mesh it made (a session 35 audit); with the default group it was made under
_MESHES: dict[tuple, tuple] = {}
# released at exit, before the interpreter's teardown: a cached mesh kept its gloo groups alive past
# destroy_process_group into module teardown, where their destruction aborted the process after every
# check had passed ("terminate called without an active exception", 1 run in 3 of the torchrun example)
atexit.register(_MESHES.clear)


def init_mesh(tp: int, cp: int, device_type: str | None = None,
              timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> DeviceMesh:
    """A (tp, cp) DeviceMesh over all ranks.

    Initialises the default process group when it is not (under torchrun: the
    environment names rank and world size), with ``timeout`` so a collective that
    cannot complete raises instead of hanging; NCCL for CUDA (plus gloo for the small
    CPU metadata checks), gloo for CPU. The mesh's tp and cp groups get ``timeout`` too:
    DeviceMesh makes them with the backend's default (30 minutes for gloo), so until
    session 33 a collective on a 2-D mesh's group waited that long. A dim that spans
    every rank is the default group itself, whose timeout is left as it was made.

    Checks on every rank, before the mesh's sub-groups are created, that all ranks ask for
    the same (tp, cp, device_type, timeout) and that each argument is valid: a rank with a bad
    one raises with the others, naming it (before session 35 a bad ``device_type`` or ``timeout``
    raised on its rank alone while the others waited in the check). With no process group and no
    RANK/WORLD_SIZE a bad argument raises at once (there is nobody to tell); under torchrun a rank
    with one joins the group (gloo, the default timeout) and raises with the others. A second call
    with the same arguments under the same default process group returns the same mesh. A call that
    raises makes every rank forget the mesh of its arguments, so ranks that disagree on whether they
    have one (the check names it) agree again at the next call."""
    device_type = device_type or default_device_type()
    problem = None
    if device_type not in DEVICE_TYPES:
        problem = f"init_mesh: device_type must be 'cpu' or 'cuda' (None: this machine's), got {device_type!r}"
    elif not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        problem = f"init_mesh: timeout must be a positive datetime.timedelta, got {timeout!r}"
    elif device_type == "cuda" and not torch.cuda.is_available():
        problem = "init_mesh: device_type 'cuda' but no CUDA device is available here"
    if not dist.is_available():
        raise DistributedInputError("init_mesh: torch.distributed is not available in this build")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise DistributedInputError(problem or (
                "init_mesh: the default process group is not initialized and RANK/WORLD_SIZE are not set; "
                "launch with torchrun or call torch.distributed.init_process_group(..., timeout=...) first"))
        # the other ranks are joining this group: a rank with a bad argument joins too (gloo, the default
        # timeout) and says so in the check below, rather than raising alone while they wait
        cuda = device_type == "cuda" and problem is None
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                                timeout=DEFAULT_TIMEOUT if problem else timeout)
    world = dist.get_world_size()
    for name, val in (("tp", tp), ("cp", cp)):
        if problem is None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            problem = f"init_mesh: {name} must be a positive int, got {val!r}"
    if problem is None and tp * cp != world:
        problem = f"init_mesh: tp * cp = {tp} * {cp} = {tp * cp} must equal the world size {world}"
    timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else -1.0
    world_group = dist.distributed_c10d._get_default_group()
    key = (tp, cp, device_type, timeout_s)
    made = _MESHES.get(key) if problem is None else None
    if made is not None and made[0] is not world_group:   # made under a process group since destroyed
        made = None
    try:
        preflight(None, "init_mesh", problem,
                  {"tp": tp if isinstance(tp, int) else -1, "cp": cp if isinstance(cp, int) else -1,
                   "device_type": DEVICE_TYPES.index(device_type) if device_type in DEVICE_TYPES else -1,
                   "timeout_s": timeout_s,
                   # a rank that would make new groups while the others reuse theirs would wait in new_group
                   "an existing mesh": int(made is not None)},
                  show={"device_type": show_choice(DEVICE_TYPES), "an existing mesh": show_bool})
    except DistributedInputError:
        _MESHES.pop(key, None)   # on every rank: the next call with these arguments makes a new mesh everywhere
        raise
    if made is not None:
        return made[1]
    mesh = init_device_mesh(device_type, (tp, cp), mesh_dim_names=DIM_NAMES)
    for name in DIM_NAMES:
        group = mesh.get_group(name)
        # a dim that spans the world reuses the default group: its timeout is whoever made it's
        # (this function's when it made it), not to be changed under the caller's other collectives
        if group.group_name != world_group.group_name:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    _MESHES[key] = (world_group, mesh)
    return mesh


def mesh_sizes(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(tp, cp) of a mesh made by init_mesh; (1, 1) for None (one process, no mesh)."""
    if mesh is None:
        return 1, 1
    check_mesh(mesh)
    return mesh.size(0), mesh.size(1)


def check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):   # before: AttributeError on mesh_dim_names
        raise DistributedInputError(f"mesh must be a DeviceMesh from rlk_ops.distributed.init_mesh, or None, got "
                                    f"{type(mesh).__name__} {mesh!r}"[:300])
    names = tuple(mesh.mesh_dim_names or ())
    if names != DIM_NAMES:
        raise DistributedInputError(f"mesh must be 2-D with mesh_dim_names {DIM_NAMES} (rlk_ops.distributed."
                                    f"init_mesh), got mesh_dim_names {names or None} and shape "
                                    f"{tuple(mesh.mesh.shape)}")


def groups(mesh: DeviceMesh | None):
    """(tp_group, cp_group, tp_rank, cp_rank); groups are None for a size-1 dim
    (nothing to communicate) and for mesh None."""
    if mesh is None:
        return None, None, 0, 0
    tp, cp = mesh_sizes(mesh)
    tp_rank, cp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("cp")
    tp_group = mesh.get_group("tp") if tp > 1 else None
    cp_group = mesh.get_group("cp") if cp > 1 else None
    return tp_group, cp_group, tp_rank, cp_rank
