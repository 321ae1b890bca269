"""Element maps: which elements of what an rlk op's tensor argument holds (session 36).

The boundary report names, for every tensor argument of an rlk op, the rlk op that produced it
(``producers``) and, when it is a module parameter, which one (``sources``). Neither says which
*elements*: a rollout whose fused QKV weight is ``cat([Wq, Wv, Wk])``, or that reads its heads as
``q.view(n, d, h).transpose(1, 2)``, or feeds rope ``positions * 2``, or multiplies by
``o_proj.weight.t()``, has the same producers and sources as the stock code and computes other
numbers (a session 35 audit: all four bound).

``element_map`` follows an argument back through the movement ops between rlk ops (views, reshapes,
transposes, slices, splits, cats, copies, casts) to its *leaves*: rlk op outputs, graph inputs
(a parameter by its dotted path), or the first node that computes. It then replays those ops on
coordinates: every leaf element gets one integer, the graph's own movement ops run on them with the
first call's sizes (each symbolic size's hint), and what arrives at the argument says, element by
element, where it came from. The result is written in a form that does not depend on the batch
layout (packed ``[T, ...]`` for training, ``[B, S, ...]`` for rollout), so the binding can compare
a training side with a rollout side:

* ``"w"`` (only when every leaf is a parameter or buffer: weights): the argument's elements in
  order as runs ``[leaf, start, stop]`` of flat indices into each leaf;
* ``"0"``, ``"1"``, ``"2"`` (f below the argument's rank; not for weights): the argument read as rows of its last f dims (f = 0: one element per
  row, e.g. positions; 1: the last dim, e.g. a linear's input; 2: ``[..., H, D]``, e.g. q, k, v):
  ``{"leaf", "cols", "rows"}`` when every row comes from one leaf row with the same column pattern
  (``cols``: runs ``[start, stop]`` of that leaf row's columns, in the argument's order; ``rows``:
  ``"in order"`` when row i is the leaf's row i), else ``{"mixed": digest}``;
* ``{"unresolved": why}`` when the replay was not possible (a size without a hint, more than
  ``LIMIT`` elements, an op that failed on coordinates): the binding reads that as unobservable.

A leaf's row is the smallest run of its trailing dims that holds an argument row: a ``[T, N]``
projection output feeding ``q [T, H, D]`` has rows of N; a ``[T, H, D]`` rope output feeding
attention has rows of ``H * D``.
"""
from __future__ import annotations

import hashlib
import operator

import torch

# Ops replayed on coordinates: they move, copy, select or relabel elements, or cast (a cast keeps each
# element's place; whether it loses precision is the sources' business, boundary._source).
REPLAYED = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze",
    "slice", "select", "split", "split_with_sizes", "narrow", "alias", "as_strided", "unbind", "cat", "stack",
    "clone", "contiguous", "detach", "lift_fresh_copy", "_to_copy",
}
LIMIT = 1 << 26          # coordinates replayed for one argument (int64: 512 MiB)
MAX_RUNS = 4096          # longer run lists are written as a digest
# rlk outputs as leaves, named by role so that the training and the rollout graph name them alike
_ROLE = {"attention_fwd": "attention", "paged_attention": "attention", "paged_attention_auto": "attention",
         "qk_norm_rope": "rope"}


def leaf_name(op: str, out: int) -> str:
    """An rlk op's output as a leaf name: ``rlk:<role>`` (``.lse`` for attention's second output, the
    cache for paged_kv_append's)."""
    if op == "paged_kv_append":
        return f"rlk:kv_cache.{'kv'[out - 1] if out in (1, 2) else out}"
    role = _ROLE.get(op, op)
    if role == "attention" and out == 1:
        return "rlk:attention.lse"
    return f"rlk:{role}" + (f".{out}" if out and role not in ("rope", "attention") else "")


def _hint(v):
    """A concrete int for a size (the first call's, for a symbol)."""
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, torch.SymInt):
        h = v.node.hint
        if h is None:
            raise ValueError("a symbolic size without a hint")
        return int(h)
    if isinstance(v, (torch.SymFloat, torch.SymBool)):
        raise ValueError("a symbolic float or bool argument")
    return v


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name} has no tensor value")
    return tuple(_hint(s) for s in val.shape)


def _leaves(val, produced: dict, names: dict, inputs: dict):
    """Walk back from ``val`` through REPLAYED ops. Returns (chain nodes, {leaf node: name})."""
    chain, leaves, stack = set(), {}, [val]
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in chain or n in leaves:
            continue
        if n in produced:
            leaves[n] = leaf_name(names[n], 0)
        elif n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if src in produced:
                leaves[n] = leaf_name(names[src], int(n.args[1]))
            else:   # an item of a split / unbind
                chain.add(n)
                stack.append(src)
        elif n.op == "placeholder":
            leaves[n] = inputs.get(n, "input:?")
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and n.target.namespace == "aten" and n.target._opname in REPLAYED:
            chain.add(n)
            for a in (*n.args, *n.kwargs.values()):
                for x in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), (torch.Tensor, list, tuple)):
                        stack.append(x)
        else:
            leaves[n] = f"computed:{n.target}"
    return chain, leaves


def _dt(node) -> str:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else "?"


def holds(a: torch.dtype, b: torch.dtype) -> bool:
    """Every value of dtype ``b`` is one of ``a``'s (floats: precision and range at least ``b``'s)."""
    if a == b:
        return True
    if not (a.is_floating_point and b.is_floating_point):
        return False
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fa.eps <= fb.eps and fa.max >= fb.max and fa.smallest_normal <= fb.smallest_normal


def _widens(node: torch.fx.Node) -> bool:
    """A ``_to_copy`` into a dtype that holds every value of its input's."""
    a, b = node.meta.get("val"), node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and holds(a.dtype, b.dtype)


def _runs(keys: torch.Tensor, idx: torch.Tensor) -> list[list[int]]:
    """Maximal runs of consecutive ``idx`` (step 1) with one ``keys`` value: [[key, start, stop], ...]."""
    if idx.numel() == 0:
        return []
    brk = torch.ones(idx.numel(), dtype=torch.bool)
    brk[1:] = (keys[1:] != keys[:-1]) | (idx[1:] != idx[:-1] + 1)
    starts = brk.nonzero().flatten()
    stops = torch.cat([starts[1:], torch.tensor([idx.numel()])])
    return [[int(keys[s]), int(idx[s]), int(idx[e - 1]) + 1] for s, e in zip(starts.tolist(), stops.tolist())]


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.numpy().tobytes() if isinstance(p, torch.Tensor) else repr(p).encode())
    return "sha256:" + h.hexdigest()[:16]


def _rows_view(key, local, shape, f, names, leaf_shapes):
    """The ``"f"`` form (module docstring) of one argument's coordinates."""
    rank = len(shape)
    feat = 1
    for s in shape[rank - f:]:
        feat *= s
    rows = key.numel() // feat if feat else 0
    if rows == 0:
        return {"mixed": "empty"}
    k2, l2 = key.reshape(rows, feat), local.reshape(rows, feat)
    if not bool((k2 == k2[0, 0]).all()):
        return {"mixed": _digest(names, k2, l2)}
    leaf = int(k2[0, 0])
    width = 1   # the leaf's row: the smallest run of its trailing dims that holds ``feat`` elements
    for s in reversed(leaf_shapes[leaf]):
        if width >= feat:
            break
        width *= s
    row, col = l2 // width, l2 % width
    if not (bool((row == row[:, :1]).all()) and bool((col == col[:1]).all())):
        return {"mixed": _digest(names, k2, l2)}   # a row from several leaf rows, or columns that vary by row
    runs = _runs(torch.zeros_like(col[0]), col[0])
    token = row[:, 0]
    ordered = bool((token == torch.arange(rows)).all())
    return {"leaf": names[leaf], "cols": [r[1:] for r in runs] if len(runs) <= MAX_RUNS else _digest(col[0]),
            "rows": "in order" if ordered else _digest(token)}


def element_map(val, produced: dict, names: dict, inputs: dict, order: dict) -> dict:
    """The element map of one tensor argument ``val`` (module docstring). ``produced``: the rlk op
    nodes seen so far; ``names``: node -> rlk op name; ``inputs``: placeholder -> its source;
    ``order``: node -> position in the graph."""
    if not isinstance(val, torch.fx.Node) or not isinstance(val.meta.get("val"), torch.Tensor):
        return {}
    try:
        chain, leaves = _leaves(val, produced, names, inputs)
        leaf_nodes = sorted(leaves, key=order.__getitem__)
        shapes = [_shape(n) for n in leaf_nodes]
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if sum(sizes) > LIMIT:
            return {"unresolved": f"{sum(sizes)} leaf elements (more than {LIMIT} are not replayed)"}
        base = torch.tensor([0, *sizes]).cumsum(0)
        env = {n: (torch.arange(sizes[i]) + base[i]).reshape(shapes[i]) for i, n in enumerate(leaf_nodes)}

        def sub(a):
            if isinstance(a, torch.fx.Node):
                return env[a] if a in env else _hint(a)
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a
        for n in sorted(chain, key=order.__getitem__):
            if n.target is operator.getitem:
                env[n] = env[n.args[0]][n.args[1]]
            elif n.target._opname == "_to_copy":
                env[n] = env[n.args[0]]
            else:
                env[n] = n.target(*sub(n.args), **sub(n.kwargs))
        out = env[val]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != _shape(val):
            return {"unresolved": "the replay gave another shape than the graph's"}
    except Exception as e:  # noqa: BLE001 - any op that does not replay on coordinates: say so, bind nothing
        return {"unresolved": f"{type(e).__name__}: {e}"[:200]}
    # casts keep each element's place, but one through a narrower dtype than both ends (bf16 -> float8 ->
    # bf16, fp64 -> fp32 -> bf16) changes values: named, so two sides bind only when they cast alike
    final = val.meta["val"].dtype
    lossy = sorted({f"{_dt(n.args[0])}->{_dt(n)}" for n in chain
                    if n.target is not operator.getitem and n.target._opname == "_to_copy"
                    and _dt(n) != str(final).replace("torch.", "") and not _widens(n)})
    flat = out.reshape(-1)
    key = torch.searchsorted(base[1:], flat, right=True)
    local = flat - base[key]
    label = [leaves[n] for n in leaf_nodes]
    result = {"casts": lossy} if lossy else {}
    if all(not (x.startswith(("input:", "computed:", "rlk:"))) for x in label):
        runs = _runs(key, local)
        result["w"] = [[label[k], s, e] for k, s, e in runs] if len(runs) <= MAX_RUNS \
            else _digest(label, key, local)
        return result   # a weight: its rows are not tokens
    for f in range(min(out.dim() - 1, 2) + 1):   # f < rank: at least one row dim (the tokens)
        result[str(f)] = _rows_view(key, local, tuple(out.shape), f, label, shapes)
    return result
