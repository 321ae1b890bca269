"""Run the block on a (tp, cp) mesh and on one device, and say which tensors agree.

``compare_block`` is what ``examples/tp_cp_attention.py`` prints and what the tests
assert on. Every rank compares its own shards with the matching slices of a
single-process run of the same global inputs (computed on every rank: no data is
moved for the comparison); the per-rank verdicts and drift sums are then combined
with one all_reduce. Bitwise means ``torch.equal`` on every rank.

The single-process reference is ``ParallelQwen3Attention(block, mesh=None)``: for
the default mode that is the plain block (``tests/test_distributed_layout.py``
checks it equals ``Qwen3Attention`` bitwise), for canonical mode the same
canonical chunking on one process.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rlk_ops.compile.block import Qwen3Attention
from rlk_ops.distributed.checks import DistributedInputError, collect, metadata_device, preflight
from rlk_ops.distributed.parallel_block import ParallelQwen3Attention
from rlk_ops.ops._validate import first_bad, fmt_index, same_device

# What each tensor is claimed to do against one device (README "CP-invariant").
BITWISE_DEFAULT = ("attention out", "lse", "dQ")


@dataclass
class Row:
    name: str
    bitwise: bool                 # equal to the single-process run on every rank
    max_abs: float                # over all ranks
    mean_abs: float
    run_to_run: bool              # two eager runs on the mesh agree bitwise
    compiled_equal: bool | None   # torch.compile(fullgraph) == eager, None if not compiled
    claimed: bool                 # the mode claims bitwise equality for this tensor


@dataclass
class Comparison:
    tp: int
    cp: int
    sharding: str
    chunks: int | None
    backend: str
    rows: list[Row] = field(default_factory=list)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"Comparison has no row {name!r}; its rows are {[r.name for r in self.rows]}")

    def claims_hold(self) -> bool:
        return all(r.bitwise for r in self.rows if r.claimed) and all(r.run_to_run for r in self.rows) \
            and all(r.compiled_equal is not False for r in self.rows)

    def table(self) -> str:
        mode = self.sharding + ("" if self.chunks is None else f", canonical chunks={self.chunks}")
        ref = "one process, same canonical chunks" if self.chunks else "one process"
        lines = [f"mesh (tp={self.tp}, cp={self.cp}), {mode}, backend {self.backend}; reference: {ref}",
                 f"{'tensor':<22} {'bitwise':<8} {'claim':<6} {'max|diff|':>11} {'mean|diff|':>11} "
                 f"{'run-to-run':<10} {'compiled==eager'}"]
        for r in self.rows:
            comp = "-" if r.compiled_equal is None else ("yes" if r.compiled_equal else "NO")
            lines.append(f"{r.name:<22} {'yes' if r.bitwise else 'no':<8} {'yes' if r.claimed else '-':<6} "
                         f"{r.max_abs:>11.3e} {r.mean_abs:>11.3e} {'yes' if r.run_to_run else 'NO':<10} {comp}")
        lines.append("claims hold: " + ("yes" if self.claims_hold() else "NO"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "rows"}, "rows": [asdict(r) for r in self.rows]}


def _run(module, x, positions, layout, dy, fn=None):
    """Forward + backward of ``module`` (or its compiled ``fn``); local results by name."""
    for p in module.parameters():
        p.grad = None
    local = getattr(x, "to_local", None)
    x_leaf = (x.to_local() if local else x).detach().requires_grad_()
    if local:
        from torch.distributed.tensor import DTensor

        x_in = DTensor.from_local(x_leaf, x.device_mesh, x.placements, run_check=False)
    else:
        x_in = x_leaf
    taps = {} if fn is None else None
    if fn is None:
        y, attn, lse = module(x_in, positions, layout, return_attention=True, taps=taps)
    else:
        y, attn, lse = fn(x_in, positions, layout, return_attention=True)
    y_l, attn_l, lse_l = (t.to_local() if hasattr(t, "to_local") else t for t in (y, attn, lse))
    (y_l.float() * dy).sum().backward()
    out = {"attention out": attn_l, "lse": lse_l, "block output y": y_l.detach(), "dX": x_leaf.grad}
    if taps:
        out.update({"dQ": taps["q"].grad, "dK": taps["k"].grad, "dV": taps["v"].grad})
    for name, p in module.named_parameters():
        if not p.requires_grad:   # a frozen weight has no gradient row (it crashed the table: a session 38 audit)
            continue
        g = p.grad
        out[f"d {name}"] = g.to_local() if hasattr(g, "to_local") else g
    return out


def _shard_of(full: dict, layout, tp: int, tp_rank: int, cfg) -> dict:
    """The slices of single-process results that this rank's shards should equal."""
    def heads(t, dim, n):
        per = n // tp
        return t.narrow(dim, tp_rank * per, per)

    idx = layout.local_index
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    want = {
        "attention out": heads(full["attention out"][idx], 1, hq),
        "lse": heads(full["lse"], 0, hq)[:, idx],
        "dQ": heads(full["dQ"][idx], 1, hq),
        "dK": heads(full["dK"][idx], 1, hkv),
        "dV": heads(full["dV"][idx], 1, hkv),
        "block output y": full["block output y"][idx],
        "dX": full["dX"][idx],
    }
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        n = hq if name.startswith("q") else hkv
        if f"d {name}" in full:   # (a frozen weight has none)
            want[f"d {name}"] = heads(full[f"d {name}"].view(n, d, -1), 0, n).reshape(-1, cfg.hidden_size)
    if "d o_proj.weight" in full:
        want["d o_proj.weight"] = heads(full["d o_proj.weight"].view(cfg.hidden_size, hq, d), 1, hq).reshape(
            cfg.hidden_size, -1)
    for name in ("q_norm.weight", "k_norm.weight"):
        if f"d {name}" in full:
            want[f"d {name}"] = full[f"d {name}"]
    return want


def _to_natural(res: dict, layout) -> dict:
    """One-process results (cp = 1: layout order) -> natural packed order."""
    out = dict(res)
    for name in ("attention out", "dQ", "dK", "dV", "block output y", "dX"):
        out[name] = layout.from_cp_layout(res[name])
    out["lse"] = layout.from_cp_layout(res["lse"], 1)
    return out


def _fail(msg):
    raise ValueError(f"compare_block: {msg}")


def _check_args(block, mesh, hidden_states, positions, compile, seed):
    """compare_block's own arguments (the rest are ParallelQwen3Attention's and prepare()'s)."""
    if not isinstance(block, Qwen3Attention):
        _fail(f"block must be a rlk_ops.compile.Qwen3Attention, got {type(block).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        _fail(f"mesh must be a DeviceMesh from rlk_ops.distributed.init_mesh, or None (one process), "
              f"got {type(mesh).__name__}")
    device = mesh.device_type if isinstance(mesh, DeviceMesh) else None
    for name, t in (("hidden_states", hidden_states), ("positions", positions)):
        if isinstance(t, DTensor):
            _fail(f"{name} must be the global batch as a plain tensor, the same on every rank (compare_block "
                  f"shards it), got a DTensor with placements {tuple(t.placements)}")
        if isinstance(t, torch.Tensor) and device not in (None, t.device.type):
            _fail(f"{name} must be on the mesh's device type {device!r}, got {t.device}")
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            _fail(f"{name} must hold data (the comparison reads it), got a tensor on the meta device")
    if isinstance(hidden_states, torch.Tensor) and isinstance(positions, torch.Tensor):
        same_device("compare_block", {"hidden_states": hidden_states, "positions": positions})
    if not isinstance(compile, bool):
        _fail(f"compile must be a bool, got {compile!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2 ** 63 <= seed < 2 ** 63:
        _fail(f"seed must be an int in [-2**63, 2**63) (it seeds the output gradient), got {seed!r}")


def _check_finite(tensors):
    """NaN is unequal to itself: with a non-finite input no tensor could compare bitwise."""
    for name, t in tensors:
        t = t.detach()
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            i = first_bad(bad)
            _fail(f"{name} must be finite (NaN or inf makes NaN outputs, unequal to themselves: nothing could "
                  f"compare bitwise), got {float(t[i])} at {fmt_index(name, i)}")


def _digest(*tensors) -> int:
    """63 bits of a hash of the tensors' bytes: whether ranks hold the same values."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def compare_block(block, mesh, hidden_states, positions, cu_seqlens, sharding: str = "contiguous",
                  chunks: int | None = None, compile: bool = False, seed: int = 0) -> Comparison:
    """Forward + backward of ``block`` on ``mesh`` (twice eagerly, once compiled if
    asked) and on one process, from the same global inputs (identical on every rank).

    Bad input raises ``DistributedInputError`` on every rank before any work: the
    arguments, then ParallelQwen3Attention's and prepare()'s checks, then that inputs
    are finite and that every rank holds the same hidden_states, positions, weights
    and seed (a rank with other values would make the verdicts wrong, not fail)."""
    meta = {"compile": 0, "seed": 0, "the block's weights": 0}

    def args():
        _check_args(block, mesh, hidden_states, positions, compile, seed)
        _check_finite((f"block.{n}", p) for n, p in block.named_parameters())
        # each rank's own weights: ParallelQwen3Attention would run with rank 0's replicated ones whatever they are
        meta.update({"compile": int(compile), "seed": seed, "the block's weights": _digest(*block.parameters())})

    problem = collect([args])
    if not isinstance(mesh, DeviceMesh):  # one process (or a bad mesh, the same on every rank)
        if problem:
            raise DistributedInputError(problem)
    else:  # a bad argument on one rank must not leave the others waiting in the next collective
        preflight(None, "compare_block", problem, meta)
    cfg = block.config
    pb = ParallelQwen3Attention(block, mesh, sharding, chunks)
    x, pos, lay = pb.prepare(hidden_states, positions, cu_seqlens)
    digests = {"the values of hidden_states": 0, "the values of positions": 0}

    def values():
        _check_finite([("hidden_states", hidden_states)])
        if mesh is not None:
            digests.update(zip(digests, (_digest(hidden_states), _digest(positions))))

    problem = collect([values])
    if mesh is None:
        if problem:
            raise DistributedInputError(problem)
    else:
        preflight(None, "compare_block", problem, digests)

    g = torch.Generator().manual_seed(seed)
    dy_full = torch.randn(hidden_states.shape, generator=g).to(hidden_states.device)
    ref_mod = ParallelQwen3Attention(block, None, sharding if chunks else "contiguous", chunks)
    x1, p1, lay1 = ref_mod.prepare(hidden_states, positions, cu_seqlens)
    ref = _to_natural(_run(ref_mod, x1, p1, lay1, lay1.shard(dy_full)), lay1)

    dy = lay.shard(dy_full)
    first = _run(pb, x, pos, lay, dy)
    second = _run(pb, x, pos, lay, dy)
    compiled = None
    if compile:
        torch._dynamo.reset()
        compiled = _run(pb, x, pos, lay, dy, fn=torch.compile(pb, fullgraph=True))
    topo = pb.topology
    want = _shard_of(ref, lay, topo.tp, topo.tp_rank, cfg)
    names = list(want)
    local = []
    for name in names:
        a, b = first[name], want[name]
        diff = (a.double() - b.double()).abs()
        # compiled runs have no taps (retain_grad is eager only): dQ/dK/dV are not compared there
        same_compiled = 1.0 if compiled is None or name not in compiled else float(torch.equal(a, compiled[name]))
        local.append([float(a.shape == b.shape and torch.equal(a, b)), float(torch.equal(a, second[name])),
                      same_compiled, float(diff.max()) if diff.numel() else 0.0, float(diff.sum()),
                      float(diff.numel())])
    stats = torch.tensor(local, dtype=torch.float64)
    if mesh is not None:
        stats = stats.to(metadata_device(None))
        lo = stats[:, :3].clone()
        hi = stats[:, 3:4].clone()
        sums = stats[:, 4:].clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        stats = torch.cat([lo, hi, sums], 1).cpu()
    backend = "none" if mesh is None else str(dist.get_backend())
    result = Comparison(topo.tp, topo.cp, sharding, chunks, backend)
    for i, name in enumerate(names):
        claimed = chunks is not None or name in BITWISE_DEFAULT
        compared = compiled is not None and name in compiled
        result.rows.append(Row(name, bool(stats[i, 0]), float(stats[i, 3]), float(stats[i, 4] / max(stats[i, 5], 1)),
                               bool(stats[i, 1]), bool(stats[i, 2]) if compared else None, claimed))
    return result
