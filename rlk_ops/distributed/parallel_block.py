"""``ParallelQwen3Attention``: the Qwen3 attention block on a (tp, cp) mesh.

Parameters become DTensors with the placements of ``mesh.PLACEMENTS`` (same HF names,
so ``state_dict`` keys are unchanged); inputs are DTensors with tokens ``Shard(0)``
on cp (in the layout's cp order). The forward is ``local_map`` of
``local_block.local_forward``: DTensor supplies the local shards and wraps the
results, and every cross-rank reduction inside is an rlk collective with a fixed
order (DTensor never inserts its own). ``mesh=None`` runs the same code in one
process (tp = cp = 1, no process group): the single-device reference for the
canonical mode.

    mesh = init_mesh(tp=2, cp=2)
    pblock = ParallelQwen3Attention(block, mesh, sharding="zigzag")
    x, positions, layout = pblock.prepare(hidden_states, positions, cu_seqlens)  # checks, every rank
    y = pblock(x, positions, layout)                      # DTensor [T, hidden], (Replicate, Shard(0))

Bad input (heads or kv heads not divisible by tp, sequence lengths not divisible
by the cp chunking, shapes, dtypes or batch layout that differ between ranks) is
rejected on every rank by ``checks.preflight`` before the first collective.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import local_map

from rlk_ops.compile.block import Qwen3Attention, _Norm
from rlk_ops.compile.module_checks import check_autocast, check_weight_modules
from rlk_ops.distributed.checks import (LAYOUT_KEYS, DistributedInputError, collect, dtype_code, preflight, show_bool,
                                        show_choice, show_dtype, show_flags, show_or_none)
from rlk_ops.distributed.layout import MODES, CPLayout, build_layout, n_chunks_for, seq_lens_from_cu
from rlk_ops.distributed.local_block import Topology, local_forward
from rlk_ops.distributed.mesh import PLACEMENTS, groups, mesh_sizes
from rlk_ops.ops import _validate as V
from rlk_ops.ops._validate import same_device
from rlk_ops.ops.rope import MAX_POSITION

_PARAMS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")


class _Holder(nn.Module):
    """Keeps HF parameter names (``q_proj.weight``) for the sharded parameters."""

    def __init__(self, weight, requires_grad: bool):
        super().__init__()
        # the block's own flag: nn.Parameter's default True made a frozen weight trainable here
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)


class _TapBox:
    """Passes the caller's taps dict through local_map by reference (not a pytree)."""

    def __init__(self, taps: dict):
        self.taps = taps

    def __setitem__(self, name, value):
        self.taps[name] = value


def _fail(msg):
    raise ValueError(f"ParallelQwen3Attention: {msg}")


class ParallelQwen3Attention(nn.Module):
    def __init__(self, block: Qwen3Attention, mesh=None, sharding: str = "contiguous", chunks: int | None = None):
        super().__init__()
        tp, cp = mesh_sizes(mesh)
        is_block = isinstance(block, Qwen3Attention)
        cfg = block.config if is_block else None
        self.mesh, self.sharding, self.chunks, self.config = mesh, sharding, chunks, cfg
        dtype = block.o_proj.weight.dtype if is_block else None

        def local_checks():
            if not is_block:
                _fail(f"block must be an rlk_ops.compile.Qwen3Attention, got {type(block).__name__}")
            # the shards are copied from these modules' parameters: a wrapper (LoRA) would be left out
            check_weight_modules("ParallelQwen3Attention: block", block, ("q_proj", "k_proj", "v_proj", "o_proj"),
                                 nn.Linear)
            check_weight_modules("ParallelQwen3Attention: block", block, ("q_norm", "k_norm"), _Norm)
            for name, p in block.named_parameters():  # each rank's own: the preflight compares o_proj's
                if p.dtype != dtype or p.device != block.o_proj.weight.device:
                    _fail(f"block.{name} must have o_proj.weight's dtype {dtype} and device "
                          f"{block.o_proj.weight.device}, got {p.dtype} on {p.device}")
            if sharding not in MODES:
                _fail(f"sharding must be one of {MODES}, got {sharding!r}")
            n_chunks_for(sharding, cp, chunks)
            for name, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
                if n % tp:
                    _fail(f"config.{name} = {n} must be divisible by tp = {tp} (heads are sharded over tp)")
            if cfg.attention_bias:
                _fail("attention_bias=True is not supported (Qwen3 has no attention bias)")
            if cfg.split_kv != "disabled":
                _fail(f"config.split_kv must be 'disabled' for training, got {cfg.split_kv!r}")

        problem = collect([local_checks])
        if mesh is None:
            if problem:
                raise DistributedInputError(problem)
        else:
            if mesh.size() != dist.get_world_size():
                raise DistributedInputError(f"ParallelQwen3Attention: the mesh must span all {dist.get_world_size()} "
                                            f"ranks, got {mesh.size()}")
            # every config field the forward reads: a rank built with another rope_theta or eps would
            # otherwise run with its own value, silently
            fields = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps")
            # floats as floats: 1000000 (HF's config.json) and 1e6 compute the same, compare the same
            meta = {f: (float if f in ("rope_theta", "rms_norm_eps") else int)(getattr(cfg, f)) if is_block else -1
                    for f in fields}
            meta.update({"rotary_dim": (cfg.rotary_dim or 0) if is_block else -1, "dtype": dtype_code(dtype),
                         "tp": tp, "cp": cp, "sharding": MODES.index(sharding) if sharding in MODES else -1,
                         "chunks": chunks if isinstance(chunks, int) else -1,
                         # which parameters train: a rank that froze another set would update its own
                         "requires_grad": sum(1 << i for i, n in enumerate(_PARAMS)
                                              if is_block and dict(block.named_parameters())[n].requires_grad)})
            preflight(None, "ParallelQwen3Attention", problem, meta,
                      show={"dtype": show_dtype, "sharding": show_choice(MODES), "chunks": show_or_none(-1),
                            "rotary_dim": show_or_none(0), "requires_grad": show_flags(_PARAMS, "True for ")})
        tp_group, cp_group, tp_rank, cp_rank = groups(mesh)
        self.topology = Topology(
            tp=tp, cp=cp, tp_rank=tp_rank, cp_rank=cp_rank,
            tp_name=None if tp_group is None else tp_group.group_name,
            cp_name=None if cp_group is None else cp_group.group_name,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim)
        params = dict(block.named_parameters())
        for name in _PARAMS:
            w = params[name].detach()
            # a copy either way: distribute_tensor broadcasts rank 0's replicated weights into the tensor it is
            # given, which would overwrite the caller's block on the other ranks
            w = w.clone() if mesh is None else distribute_tensor(w.clone(), mesh, PLACEMENTS[name])
            setattr(self, name.split(".")[0], _Holder(w, params[name].requires_grad))

    # ------------------------------------------------------------------ inputs
    def prepare(self, hidden_states: torch.Tensor, positions: torch.Tensor, cu_seqlens, local: bool = False):
        """Check the batch on every rank and shard it over cp.

        hidden_states [T, hidden] and positions [T] int64 are the global packed batch
        (natural order), or with ``local=True`` already this rank's shard in layout
        order; cu_seqlens (int32 [B+1], global) must be the same on every rank.
        Returns (hidden_states, positions, layout): DTensors on the mesh (plain
        tensors when mesh is None), and the host-built ``CPLayout``."""
        cfg = self.config
        cp = self.topology.cp
        state = {}

        def local_checks():
            cu = [0, *itertools.accumulate(seq_lens_from_cu(cu_seqlens))]  # read once (a device copy on CUDA)
            # before the layout, which holds int64 index rows of the packed token count per chunk: a huge
            # cu_seqlens[-1] is refused, not built (with local=True it was built, ~1.2 GiB per 16M tokens;
            # a session 35 audit)
            if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 1 \
                    and cu[-1] != hidden_states.shape[0] * (cp if local else 1):
                rows = (f"{cu[-1] // cp}" if cu[-1] % cp == 0 else f"{cu[-1]} / {cp}") if local else f"{cu[-1]}"
                why = (f"this rank's token count: cu_seqlens[-1] = {cu[-1]} over cp = {cp}" if local
                       else "the packed token count")
                _fail(f"hidden_states must be [{rows}, {cfg.hidden_size}] ({why}, hidden_size), "
                      f"got {list(hidden_states.shape)}")
            state["layout"] = lay = build_layout(cu, cp, self.topology.cp_rank, self.sharding, self.chunks)
            want = lay.local_tokens if local else lay.total_tokens
            which = "this rank's token count (local=True)" if local else "the packed token count"
            plain = "this rank's shard (local=True)" if local else "the global batch"
            for name, t, shape in (("hidden_states", hidden_states, f"[{want}, {cfg.hidden_size}]"),
                                   ("positions", positions, f"int64 [{want}]")):
                if isinstance(t, DTensor):  # prepare() shards the batch itself and returns the DTensors
                    _fail(f"{name} must be a plain torch.Tensor {shape} ({plain}; prepare() makes the DTensor), "
                          f"got a DTensor with placements {tuple(t.placements)}")
                if not isinstance(t, torch.Tensor):
                    _fail(f"{name} must be a torch.Tensor {shape}, got {type(t).__name__}")
            if hidden_states.dim() != 2 or tuple(hidden_states.shape) != (want, cfg.hidden_size):
                _fail(f"hidden_states must be [{want}, {cfg.hidden_size}] ({which}, hidden_size), got "
                      f"{list(hidden_states.shape)}")
            if hidden_states.dtype != self.o_proj.weight.dtype:
                _fail(f"hidden_states must have the weights' dtype {self.o_proj.weight.dtype}, "
                      f"got {hidden_states.dtype}")
            if positions.dtype != torch.int64 or tuple(positions.shape) != (want,):
                _fail(f"positions must be int64 [{want}], got {positions.dtype} {list(positions.shape)}")
            same_device("ParallelQwen3Attention.prepare", {"hidden_states": hidden_states, "positions": positions})
            w = self.o_proj.weight
            w_dev = w.to_local().device if isinstance(w, DTensor) else w.device
            if hidden_states.device != w_dev:
                _fail(f"hidden_states must be on the weights' device {w_dev}, got {hidden_states.device}")
            # the values too: rope would refuse a bad position on the rank that holds it alone, after
            # the others had entered the cp all_gather
            V.check_positions_values("rope", positions, MAX_POSITION)

        problem = collect([local_checks])
        if self.mesh is None:
            if problem:
                raise DistributedInputError(problem)
        else:
            lay = state.get("layout")
            meta = dict(zip(LAYOUT_KEYS, lay.metadata() if lay else [-1] * len(LAYOUT_KEYS)))
            meta["dtype"] = dtype_code(getattr(hidden_states, "dtype", None))
            preflight(None, "ParallelQwen3Attention.prepare", problem, meta,
                      show={"mode": show_choice(MODES), "canonical": show_bool, "dtype": show_dtype})
        lay = state["layout"].to(hidden_states.device)
        x = hidden_states if local else lay.shard(hidden_states)
        pos = positions if local else lay.shard(positions)
        if self.mesh is not None:
            x = DTensor.from_local(x, self.mesh, PLACEMENTS["hidden_states"], run_check=False)
            pos = DTensor.from_local(pos, self.mesh, PLACEMENTS["positions"], run_check=False)
        return x, pos, lay

    # ----------------------------------------------------------------- forward
    def forward(self, hidden_states, positions, layout, return_attention: bool = False, taps=None,
                check: bool = True):
        """hidden_states [T, hidden] and positions [T] from ``prepare``. Returns y [T, hidden]
        (and the detached attention out [T, Hq, D], lse [Hq, T] with ``return_attention``),
        as DTensors in cp layout order (plain tensors when mesh is None). ``taps``
        (eager only): a dict that receives this rank's q, k, v with gradients retained.

        ``check`` (eager, on a mesh; skipped while torch.compile traces): the ranks compare,
        in one small all_gather before the first collective, whether each passed prepare()'s
        inputs and layout for this module and taps of an accepted kind, their batch layouts, and
        whether each runs with gradients; any problem raises on every rank (before, a rank that failed these
        checks raised alone and the others waited in the first collective until the timeout).
        ``check`` decides whether that exchange is sent, so it must be the same on every rank."""
        def local_checks():
            if not isinstance(check, bool):
                _fail(f"check must be a bool, got {type(check).__name__} {V.short_repr(check)}")
            if taps is not None and not isinstance(taps, dict):
                _fail(f"taps must be a dict or None, got {type(taps).__name__}")
            check_weight_modules("ParallelQwen3Attention", self, tuple(n.split(".")[0] for n in _PARAMS), _Holder)
            if isinstance(hidden_states, torch.Tensor):
                check_autocast("ParallelQwen3Attention", hidden_states.device.type, self.o_proj.weight.dtype)
            self._check_forward(hidden_states, positions, layout)

        if self.mesh is None or check is False or torch.compiler.is_compiling():
            local_checks()
        else:   # a check that is not a bool is exchanged too (raised alone, it left the others waiting)
            problem = collect([local_checks])
            # a rank that builds no graph would skip the backward's collectives the others enter: trained
            # weights, or an input that requires grad (frozen weights, gradients for the input only)
            grad = torch.is_grad_enabled() and (any(p.requires_grad for p in self.parameters())
                                                or getattr(hidden_states, "requires_grad", False) is True)
            # and the batch layout: ranks given layouts of other batches (each valid for this module) ran, one
            # of them with wrong results (a session 38 audit)
            meta = dict(zip(LAYOUT_KEYS, layout.metadata() if isinstance(layout, CPLayout) else
                            [-1] * len(LAYOUT_KEYS)))
            meta["with gradients"] = grad
            preflight(None, "ParallelQwen3Attention.forward", problem, meta,
                      show={"with gradients": show_bool, "mode": show_choice(MODES), "canonical": show_bool})
        weights = [getattr(self, n.split(".")[0]).weight for n in _PARAMS]
        if self.mesh is None:
            y, attn, lse = local_forward(hidden_states, positions, *weights, layout, self.topology, taps)
        else:
            fn = local_map(local_forward,
                           out_placements=(PLACEMENTS["output"], PLACEMENTS["attention"], PLACEMENTS["lse"]),
                           in_placements=(PLACEMENTS["hidden_states"], PLACEMENTS["positions"],
                                          *(PLACEMENTS[n] for n in _PARAMS), None, None, None),
                           device_mesh=self.mesh)
            # local_map flattens its arguments as pytrees: a dict would arrive as a copy
            box = None if taps is None else _TapBox(taps)
            y, attn, lse = fn(hidden_states, positions, *weights, layout, self.topology, box)
        return (y, attn, lse) if return_attention else y

    def _check_forward(self, hidden_states, positions, layout):
        """Metadata only (shapes, the layout's identity): identical on every rank after
        ``prepare``'s preflight, so a failure raises everywhere before any collective."""
        topo = self.topology
        if not isinstance(layout, CPLayout):
            _fail(f"layout must be the CPLayout returned by prepare(), got {type(layout).__name__}")
        # the chunk count too: a layout of 8 chunks given to a module of 4 computed with 8, silently (a
        # session 38 audit)
        n_chunks = n_chunks_for(self.sharding, topo.cp, self.chunks)
        if (layout.cp, layout.rank, layout.mode, layout.canonical, layout.n_chunks) != \
                (topo.cp, topo.cp_rank, self.sharding, self.chunks is not None, n_chunks):
            _fail(f"layout is for cp rank {layout.rank} of {layout.cp} ({layout.mode}, {layout.n_chunks} chunks, "
                  f"canonical={layout.canonical}); this module is cp rank {topo.cp_rank} of {topo.cp} "
                  f"({self.sharding}, {n_chunks} chunks, canonical={self.chunks is not None}): use the layout from "
                  f"this module's prepare()")
        if self.mesh is not None:  # prepare's DTensors on this module's mesh, in its placements
            for name, t in (("hidden_states", hidden_states), ("positions", positions)):
                if not isinstance(t, DTensor) or t.device_mesh != self.mesh \
                        or tuple(t.placements) != tuple(PLACEMENTS[name]):
                    _fail(f"{name} must be the DTensor prepare() returned (on this module's mesh, placements "
                          f"{tuple(PLACEMENTS[name])}), got {type(t).__name__}"
                          + (f" on mesh {t.device_mesh.mesh_dim_names} with placements {tuple(t.placements)}"
                             if isinstance(t, DTensor) else ""))
        want = (layout.total_tokens, self.config.hidden_size)
        if tuple(hidden_states.shape) != want:
            _fail(f"hidden_states must be {list(want)} (the layout's tokens, hidden_size), "
                  f"got {list(hidden_states.shape)}")
        if tuple(positions.shape) != want[:1]:
            _fail(f"positions must be [{want[0]}], got {list(positions.shape)}")
