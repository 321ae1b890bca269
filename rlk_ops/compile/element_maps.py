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
element, where it came from. An argument that is its leaf, unchanged, is written without a replay.
The result is written so that the binding can compare a training side with a rollout side, whose
batch layouts differ (packed ``[T, ...]`` and ``[B, S, ...]``):

* ``"w"`` (only when every leaf is a parameter or buffer: weights): the argument's elements in
  order as runs ``[leaf, start, stop]`` of flat indices into each leaf (a digest past MAX_RUNS);
* ``"0"``, ``"1"``, ``"2"`` (each f below the argument's rank; not for weights): the argument read as
  rows of its last f dims (f = 0: one element per row, e.g. positions; 1: the last dim, e.g. a
  linear's input; 2: ``[..., H, D]``, e.g. q, k, v). ``{"leaf", "cols", "width", "rows"}`` when every
  row comes from one leaf row with the same column pattern: ``cols`` are runs ``[start, stop]`` of that
  leaf row's columns in the argument's order, ``width`` the leaf row's length, ``rows`` is
  ``"in order"`` when row i is the leaf's row i for every leaf row (``"N of M in order (<digest of which>)"``: some of
  them, in their order). Else ``{"mixed": digest}``. These two forms do not depend on the batch
  layout; a digest (mixed, or rows out of order) is one of this call's layout, so it binds only
  against the same digest;
* ``{"unresolved": why}`` when the replay was not possible (a size without a hint, more than
  ``LIMIT`` leaf or made elements, ``as_strided`` over a tensor not dense from offset 0, one node
  reached through different lossy casts, an op that failed on coordinates): the binding reads that as
  unobservable.

A leaf reached through a cast that loses values is named with the casts (``... via lossy casts
bfloat16->float8_e4m3fn``), so two sides bind only when they cast the same elements alike. A leaf's
row is the smallest run of its trailing dims that holds an argument row (for f >= 1, its last dim at
least): a ``[T, N]`` projection output feeding ``q [T, H, D]`` has rows of N; a ``[T, H, D]`` rope
output feeding attention has rows of ``H * D``.
"""
from __future__ import annotations

import hashlib
import json
import math
import operator

import torch

# Ops replayed on coordinates: they move, copy, select or relabel elements, or cast (a cast keeps each
# element's place; one that loses values is named on the leaf, _leaves).
REPLAYED = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze",
    "slice", "select", "split", "split_with_sizes", "narrow", "alias", "as_strided", "unbind", "cat", "stack",
    "clone", "contiguous", "detach", "lift_fresh_copy", "_to_copy",
}
LIMIT = 1 << 26          # leaf elements replayed for one argument (int64 coordinates: 512 MiB a copy)
MAX_RUNS = 4096          # longer run lists are written as a digest
# rlk outputs as leaves, named by role so that the training and the rollout graph name them alike
_ROLE = {"attention_fwd": "attention", "paged_attention": "attention", "paged_attention_auto": "attention",
         "qk_norm_rope": "rope"}


ATTENTION = ("attention_fwd", "paged_attention", "paged_attention_auto")


def leaf_name(op: str, out: int, where: str = "") -> str:
    """An rlk op's output as a leaf name: ``rlk:<role>`` (``.lse`` for attention's second output, the
    cache for paged_kv_append's), then ``where`` (``node_label``)."""
    if op == "paged_kv_append":
        return f"rlk:kv_cache.{'kv'[out - 1] if out in (1, 2) else out}{where}"
    role = _ROLE.get(op, op)
    if role == "attention" and out == 1:
        return f"rlk:attention.lse{where}"
    return f"rlk:{role}" + (f".{out}" if out and role not in ("rope", "attention") else "") + where


def node_label(layer: int, weight: str | None) -> str:
    """Which call an rlk output is, in words both sides share: ``@L<layer>``, the number of attention
    calls before it (layer 1's input norm is ``@L1``, layer 0's o_proj too), and a norm's weight, so
    that a projection fed by another layer's or another norm's output is not named alike (a session 36
    audit)."""
    return f"@L{layer}" + (f"({input_name(weight)})" if weight else "")


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


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(int(torch.Size([_hint(s) for s in v.shape]).numel()) for v in vals if isinstance(v, torch.Tensor))


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name} has no tensor value")
    return tuple(_hint(s) for s in val.shape)


def _leaves(val, produced: dict, names: dict, inputs: dict, order: dict, memo: dict | None, as_output: bool = False):
    """Walk back from ``val`` through REPLAYED ops. Returns (chain nodes, {leaf node: name}). A leaf reached
    through a cast that loses values (``_lossy``) has the casts in its name, so they stay with the
    elements they touched."""
    final = None if as_output else val.meta["val"].dtype   # an output: no consumer's rounding to exempt
    chain, leaves, stack, seen = set(), {}, [(val, ())], {}
    while stack:
        n, casts = stack.pop()
        if not isinstance(n, torch.fx.Node):
            continue
        via = _lossy(n, casts, final)
        suffix = f" via lossy casts {', '.join(f'{_dt(c.args[0])}->{_dt(c)}' for c in via)}" if via else ""
        if n in seen:   # one node reached by two routes: its elements carry one name, so the casts must agree
            if seen[n] != suffix:   # (else a cast on one route was lost: a session 36 review)
                raise ValueError(f"{n.name} is reached through different lossy casts")
            continue
        seen[n] = suffix
        if n in produced:
            leaves[n] = leaf_name(*names[n][:1], 0, names[n][1]) + suffix
        elif n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if src in produced:
                leaves[n] = leaf_name(names[src][0], int(n.args[1]), names[src][1]) + suffix
            else:   # an item of a split / unbind
                chain.add(n)
                stack.append((src, casts))
        elif n.op == "placeholder":
            leaves[n] = inputs.get(n, "input:?") + suffix
        elif _fixed_index(n) is not None:   # x[idx] with idx fixed by the graph: a move (session 37)
            chain.add(n)
            stack.append((n.args[0], casts))
        elif moves(n):
            chain.add(n)
            more = casts + (n,) if n.target._opname == "_to_copy" else casts
            for a in (*n.args, *n.kwargs.values()):
                for x in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), (torch.Tensor, list, tuple)):
                        stack.append((x, more))
        else:
            leaves[n] = (computed_label(n, produced, names, inputs, order, memo) if memo is not None
                         else f"computed:{n.target}") + suffix
    return chain, leaves


def _fixed_index(n):
    """``n`` picks slices of its input along one dim (``x[idx]``, ``x[:, idx]``, ``index_select(x, d, idx)``:
    vLLM's ``hidden_states[logits_indices]``, HF's last token ``h[:, [s - 1]]``) by an index the graph fixes
    from sizes and constants alone (``arange(b) * s + s - 1``): (dim, the index's values) (``_evaluate``),
    else None. An index that is data (a graph input) leaves the pick a computing node."""
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and n.args
            and isinstance(n.args[0], torch.fx.Node) and isinstance(n.args[0].meta.get("val"), torch.Tensor)):
        return None
    rank = n.args[0].meta["val"].dim()
    if n.target is torch.ops.aten.index.Tensor and len(n.args) == 2:
        given = [(d, i) for d, i in enumerate(n.args[1]) if i is not None]
        if len(given) != 1:
            return None
        dim, idx = given[0]
    elif n.target is torch.ops.aten.index_select.default and len(n.args) == 3 and isinstance(n.args[1], int) \
            and -rank <= n.args[1] < rank:
        dim, idx = n.args[1] % rank, n.args[2]
    else:
        return None
    iv = idx.meta.get("val") if isinstance(idx, torch.fx.Node) else None
    if not (isinstance(iv, torch.Tensor) and iv.dim() == 1 and iv.dtype in (torch.int64, torch.int32)):
        return None
    if "rlk_fixed_index" not in n.meta:   # evaluated once: every map through this pick asks again
        try:
            n.meta["rlk_fixed_index"] = dim, _evaluate(idx, {})
        except (ValueError, RuntimeError, TypeError, IndexError, AttributeError):
            n.meta["rlk_fixed_index"] = None
    return n.meta["rlk_fixed_index"]


_UNSET = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}   # values never written


def _evaluate(n, memo: dict, depth: int = 0):
    """The value of node ``n`` when the graph computes it from sizes and constants alone (aten ops, first
    call's sizes, tensor constants the graph holds, on the CPU); ValueError when it reads a graph input, a
    parameter, a random op or one that writes. A pick fixed from sizes is judged at the describe step's
    sizes (an index clipped by the page size could differ at other sizes)."""
    if not isinstance(n, torch.fx.Node):
        return n
    if n in memo:
        return memo[n]
    val = n.meta.get("val")
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return _hint(val)
    if n.op == "get_attr" and isinstance(n.target, str):   # a constant the graph holds (torch.tensor([4, 9]))
        value = n.graph.owning_module
        for part in n.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            memo[n] = value.detach().cpu().clone()   # a copy: the evaluation never touches the graph's own
            return memo[n]
    if depth > 64 or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
            or n.target.namespace != "aten" or torch.Tag.nondeterministic_seeded in n.target.tags \
            or n.target._schema.is_mutable or n.target._opname in _UNSET:
        raise ValueError(f"{n.name} is not fixed by the graph")
    if isinstance(val, torch.Tensor) and int(torch.Size([_hint(x) for x in val.shape]).numel()) > LIMIT:
        raise ValueError(f"{n.name} is too large to evaluate")

    def sub(a):
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return _evaluate(a, memo, depth + 1) if isinstance(a, torch.fx.Node) else _hint(a)
    kwargs = {k: sub(v) for k, v in n.kwargs.items() if k not in _PLACEMENT}
    memo[n] = n.target(*sub(n.args), **kwargs)
    return memo[n]


def moves(n) -> bool:
    """``n`` is a REPLAYED aten op that keeps its input's dtype, or a cast (``_to_copy``). A view into another
    dtype (``w.view(torch.int16)``) reinterprets the bits: a computing node, not a move."""
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "aten" and n.target._opname in REPLAYED):
        return False
    if n.target._opname == "_to_copy":
        return True
    src = n.args[0] if n.args else None
    src = src[0] if isinstance(src, (list, tuple)) and src else src
    a = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    b = n.meta.get("val")
    b = b[0] if isinstance(b, (list, tuple)) and b else b
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def _lossy(node: torch.fx.Node, casts: tuple, final: torch.dtype) -> list:
    """The casts on the way from ``node`` to the argument (``casts``: argument first) that change values:
    each into a dtype that cannot hold every value the elements can have by then (``node``'s dtype, or a
    narrower one an earlier cast made), unless it is the one rounding into the consumer's dtype (fp32
    master weights cast to bf16 once). bf16 -> float8 -> bf16 and fp64 -> fp32 -> bf16 are lossy; bf16 ->
    fp64 -> fp32 -> bf16 is not (every bf16 value survives each step)."""
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (list, tuple)) and val else val   # a split's pieces share its dtype
    narrowest = val.dtype if isinstance(val, torch.Tensor) else None
    out = []
    for c in reversed(casts):
        dst = c.meta.get("val")
        dst = dst.dtype if isinstance(dst, torch.Tensor) else None
        if dst is None or narrowest is None:
            out.append(c)
            narrowest = dst
        elif not holds(dst, narrowest):
            if dst != final:
                out.append(c)
            narrowest = dst
    return out


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


def _runs(keys: torch.Tensor, idx: torch.Tensor) -> list[list[int]] | None:
    """Maximal runs of consecutive ``idx`` (step 1) with one ``keys`` value: [[key, start, stop], ...];
    None when there are more than MAX_RUNS (a permutation: written as a digest)."""
    if idx.numel() == 0:
        return []
    brk = torch.ones(idx.numel(), dtype=torch.bool)
    brk[1:] = (keys[1:] != keys[:-1]) | (idx[1:] != idx[:-1] + 1)
    starts = brk.nonzero().flatten()
    if starts.numel() > MAX_RUNS:
        return None
    stops = torch.cat([starts[1:], torch.tensor([idx.numel()])])
    return torch.stack([keys[starts], idx[starts], idx[stops - 1] + 1], 1).tolist()


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.numpy().tobytes() if isinstance(p, torch.Tensor) else repr(p).encode())
    return "sha256:" + h.hexdigest()[:16]


def _rows_view(key, local, shape, f, names, leaf_shapes, columns=None):
    """The ``"f"`` form (module docstring) of one argument's coordinates. ``columns``: per leaf, None or a
    product's columns (``_products``: its sorted column ids and their labels)."""
    feat = _feat(shape, f)
    rows = key.numel() // feat if feat else 0
    if rows == 0:
        return {"mixed": "empty"}
    k2, l2 = key.reshape(rows, feat), local.reshape(rows, feat)
    if not bool((k2 == k2[0, 0]).all()):
        whole = _whole_leaves(key, local, leaf_shapes) if f == 0 else None
        if whole is not None:   # cat([zeros(1), cumsum(lengths)]): leaves one after another, each whole
            return {"leaf": "cat(" + " + ".join(names[k] for k in whole) + ")", "cols": [[0, 1]], "width": 1,
                    "rows": "in order"}
        return {"mixed": _digest(names, k2, l2)}
    leaf = int(k2[0, 0])
    width = _width(leaf_shapes[leaf], feat, f)
    row, col = l2 // width, l2 % width
    product = columns[leaf] if columns else None
    uniform = bool((row == row[:, :1]).all()) and bool((col == col[:1]).all())   # each row one leaf row, alike
    if product is not None and not (width == product[0].numel() and uniform):
        return {"mixed": _product_digest(names[leaf], product, l2)}   # not rows of one token's same columns
    if not uniform:
        return {"mixed": _digest(names, k2, l2)}   # a row from several leaf rows, or columns that vary by row
    if product is not None:   # the columns as the weight rows (and bias elements) that make them
        cols = _labelled(product[0][col[0]], product[1])
    else:
        runs = _runs(torch.zeros_like(col[0]), col[0])
        cols = [r[1:] for r in runs] if runs is not None else _digest(col[0])
    token = row[:, 0]
    leaf_rows = int(torch.Size(leaf_shapes[leaf]).numel()) // width
    ordered = bool((token == torch.arange(rows)).all())
    rising = bool((token[1:] > token[:-1]).all())
    return {"leaf": names[leaf], "cols": cols, "width": width,
            "rows": ("in order" if rows == leaf_rows else f"the first {rows} of {leaf_rows} in order") if ordered
            else f"{rows} of {leaf_rows} in order ({_digest(token)})" if rising else _digest(token)}


def _product_digest(label: str, product, l2) -> str:
    """A product's elements that are not rows of one token's columns, as a digest of (token, weight label,
    row) per element: the same whichever other outputs the product was merged with (``_products``)."""
    uniq, labels = product
    n = uniq.numel()
    ids = uniq[l2 % n]
    used, lid = torch.unique(ids >> _SHIFT, return_inverse=True)
    return _digest("product", label, [labels[i] for i in used.tolist()], l2 // n, lid, ids & _ROW)


def _product_forms(forms: dict, shape, force: bool = False) -> dict:
    """When the ``"1"`` form is a product's rows (``labelled``; ``force``: a product's, its columns a
    digest), the other forms are its elements grouped otherwise: written as a digest of the ``"1"`` form and
    the grouping, so that they do not depend on how the map was made (a replay or ``_product_identity``)."""
    if not (force or labelled(forms.get("1"))):
        return forms
    one = repr({k: v for k, v in forms["1"].items() if k != "width"})   # the width is the merged product's
    return {f: v if f == "1" or labelled(v) else
            {"mixed": _digest("rows of", one, tuple(shape[len(shape) - int(f):]))} for f, v in forms.items()}


def _product_identity(label: str, shape, table: list) -> dict:
    """The map of an argument that is an rlk::linear output, unchanged: its rows' columns from the call's
    table (``product_label``), no replay (Qwen3-8B's gate_up output over 2731 tokens holds more than LIMIT
    elements). None when it holds a weight row twice: replayed, as through a view."""
    names = sorted({c[0] for c in table})
    ids = _column_ids(table, names)
    if torch.unique(ids).numel() != ids.numel():   # a weight row twice (cat([W, W])): the replay's map
        return None
    if math.prod(shape[:-1]) == 0:
        return {str(f): {"mixed": "empty"} for f in range(min(len(shape) - 1, 2) + 1)}
    one = {"leaf": label, "cols": _labelled(ids, names), "width": ids.numel(), "rows": "in order"}
    return _product_forms({str(f): one if f == 1 else {"mixed": ""} for f in range(min(len(shape) - 1, 2) + 1)},
                          shape, force=True)   # the others: digests of this one


def last_tokens_digest(b: int, s: int) -> str:
    """The digest ``_rows_view`` writes for rows that are each of b sequences' last of s tokens."""
    return _digest(torch.arange(b) * s + s - 1)


def _feat(shape, f: int) -> int:
    """Elements in one row of the ``"f"`` form: the product of the last f dims."""
    return math.prod(shape[len(shape) - f:])


_SHIFT = 40   # a product's column id: (label number << _SHIFT) + weight row
_ROW = (1 << _SHIFT) - 1


def _column_ids(table: list, names: list[str]) -> torch.Tensor:
    """A product's columns (runs ``[label, first row, stop]``) as ids, labels numbered by ``names``."""
    return torch.cat([torch.arange(a, b) + (names.index(c) << _SHIFT) for c, a, b in table])


def _labelled(ids: torch.Tensor, names: list[str]):
    """Column ids back as runs ``[label, first row, stop]`` (a digest past MAX_RUNS)."""
    runs = _runs(ids >> _SHIFT, ids & _ROW)
    return [[names[k], a, b] for k, a, b in runs] if runs is not None else _digest(names, ids)


def _columns(node, names: dict):
    """The columns of an rlk::linear output leaf (``product_label``), else None."""
    entry = names.get(node) if isinstance(node, torch.fx.Node) else None
    return entry[2] if entry is not None and len(entry) > 2 else None


def _products(key, local, labels, shapes, tables):
    """rlk::linear outputs as their products (session 37). A linear's output element (token t, column c) is
    the product of its input's row t with weight row r(c) (plus bias element e(c)): ``tables`` gives, per
    leaf, those columns as runs ``[label, first row, stop]`` (``product_label``), else None. Outputs that
    share a label (the same input, the same layer) are one product whose columns are every weight row
    they hold, sorted by label and row: a fused ``cat([Wg, Wu])`` and two linears over Wg and Wu are one
    leaf, and ``cat([gate, up], -1)`` of the two reads the same columns as the fused output. Returns the
    coordinates renumbered over the merged leaves (a product's shape is [tokens, its columns]) and, per
    leaf, None or (its sorted column ids, their labels)."""
    groups: dict[tuple, list[int]] = {}
    for k, t in enumerate(tables):
        if t:
            groups.setdefault((labels[k], math.prod(shapes[k][:-1])), []).append(k)
    if not groups:
        return key, local, labels, shapes, [None] * len(labels)
    member = {k: g for g, ks in groups.items() for k in ks}
    remap, local = torch.empty(len(labels), dtype=torch.long), local.clone()
    out_labels, out_shapes, columns, made = [], [], [], {}
    for k in range(len(labels)):
        g = member.get(k)
        if g in made:
            remap[k] = made[g]
            continue
        remap[k] = len(out_labels)
        out_labels.append(labels[k])
        if g is None:
            out_shapes.append(shapes[k])
            columns.append(None)
            continue
        made[g] = remap[k]
        names = sorted({c[0] for kk in groups[g] for c in tables[kk]})
        ids = {kk: _column_ids(tables[kk], names) for kk in groups[g]}
        uniq = torch.unique(torch.cat(list(ids.values())))
        for kk in groups[g]:
            at, n = key == kk, shapes[kk][-1]
            loc = local[at]
            local[at] = loc // n * uniq.numel() + torch.searchsorted(uniq, ids[kk][loc % n])
        out_shapes.append((g[1], uniq.numel()))
        columns.append((uniq, names))
    return remap[key], local, out_labels, out_shapes, columns


def product_columns(maps: dict, n_out: int):
    """An rlk::linear call's output columns as runs ``[label, first, stop]`` of whole weight rows, each with
    its bias element when there is a bias (``"<weight> + <bias>"``, ``@<shift>`` when the bias element is not
    the row's index): from its weight's (and bias's) element maps. A string saying why not otherwise (a
    weight that is not whole rows of parameters: computed, a graph input, permuted, unresolved)."""
    w = maps.get("weight") or {}
    runs = w.get("w")
    if not isinstance(runs, list):
        return "weight " + ("#unresolved" if "unresolved" in w else _arg_text(w))
    k = _row_width(runs, n_out)
    if k == 0 or any(s % k or e % k for _, s, e in runs):
        return f"weight {runs!r}" if len(runs) <= 16 else f"weight {len(runs)} runs {_digest(runs)}"
    cols = [[label, s // k, e // k] for label, s, e in runs]
    b = maps.get("bias")
    if b is None:
        return cols
    bruns = b.get("w")
    if not isinstance(bruns, list) or sum(e - s for _, s, e in bruns) != n_out:
        return "bias " + ("#unresolved" if "unresolved" in b else _arg_text(b))
    out, wi, bi = [], [list(r) for r in cols], [list(r) for r in bruns]
    i = j = 0
    while i < len(wi) and j < len(bi):
        (wl, ws, we), (bl, bs, be) = wi[i], bi[j]
        n = min(we - ws, be - bs)
        append_run(out, f"{wl} + {bl}" + (f"@{bs - ws:+d}" if bs != ws else ""), ws, ws + n)
        wi[i][1] += n
        bi[j][1] += n
        i += wi[i][1] == we
        j += bi[j][1] == be
    return out


def append_run(runs: list, label: str, start: int, stop: int) -> None:
    """Add ``[label, start, stop]`` to ``runs``, joined to the last run when it continues it."""
    if runs and runs[-1][0] == label and runs[-1][2] == start:
        runs[-1][2] = stop
    else:
        runs.append([label, start, stop])


def _row_width(runs: list, n_out: int) -> int:
    """The elements of one weight row (the product's input width): the runs' total over the output
    columns; 0 when that is not a whole number."""
    total = sum(e - s for _, s, e in runs)
    return total // n_out if n_out > 0 and total % n_out == 0 else 0


def product_label(layer: int, maps: dict, node: torch.fx.Node) -> tuple[str, list | None]:
    """An rlk::linear output as a leaf (session 37): ``@L<layer>(x: <its input's element map>)`` and its
    columns (``product_columns``), so that a consumer's map names the weight rows behind the columns it
    takes. Before, every linear of a layer was ``rlk:linear@L<n>``: an MLP written ``silu(gate) * up``
    bound with gate and up swapped. Without whole weight rows the label names the weight and the
    columns are None (positions, as for any leaf). ``node``: the call's output."""
    x = maps.get("x") or {}
    text = "#unresolved" if "unresolved" in x else _arg_text(x) if x else "none"
    try:
        n_out = _shape(node)[-1]
    except ValueError:   # no size hint
        return f"@L{layer}(x: {text}; #unresolved)", None
    cols = product_columns(maps, n_out)
    if isinstance(cols, str):
        return f"@L{layer}(x: {text}; {cols})", None
    # the rows' width is in the label: "rows 0:3" of a weight read through w.reshape(12, 4) are not w's
    # rows 0:3 (a session 37 audit)
    return f"@L{layer}(x: {text}; rows of {_row_width(maps['weight']['w'], n_out)})", cols


def _whole_leaves(key, local, leaf_shapes) -> list[int] | None:
    """The leaves, in order, when the elements are whole leaves one after another, each in its order."""
    order, at = [], 0
    while at < key.numel():
        k = int(key[at])
        n = int(torch.Size(leaf_shapes[k]).numel())
        if k in order or at + n > key.numel() or not bool((key[at:at + n] == k).all()) \
                or not bool((local[at:at + n] == torch.arange(n)).all()):
            return None
        order.append(k)
        at += n
    return order


def _width(shape, feat: int, f: int) -> int:
    """A leaf's row: the smallest run of its trailing dims that holds ``feat`` elements, and for rows of a
    last dim or more (f >= 1) at least the leaf's last dim (one column of a [B, P] page table is a column of
    its rows, not a row of its own)."""
    width = 1
    for i, s in enumerate(reversed(shape)):
        if width >= feat and not (i == 0 and f >= 1):
            break
        width *= s
    return width


def _identity(label: str, shape: tuple[int, ...], weight: bool) -> dict:
    """The map of an argument that is its leaf, unchanged (no replay: an lm_head weight alone can hold
    more than LIMIT elements)."""
    if weight:
        n = int(torch.Size(shape).numel())
        return {"w": _unpack([[label, 0, n]]) if n else []}
    out = {}
    for f in range(min(len(shape) - 1, 2) + 1):
        feat = _feat(shape, f)
        rows = math.prod(shape) // feat if feat else 0
        out[str(f)] = {"mixed": "empty"} if rows == 0 else {"leaf": label, "cols": [[0, feat]], "width": feat,
                                                            "rows": "in order"}
    return out


# single-input ops that keep the row-major order of the elements (a cast keeps their places)
_FLAT_ORDER = {"view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "alias", "clone", "contiguous", "detach",
               "lift_fresh_copy", "_to_copy"}


def _flat_runs(node, leaves: dict) -> list | None:
    """The ``"w"`` runs of ``node`` when it is whole leaves, in row-major order, concatenated along dim 0
    (``cat([Wq, Wk, Wv])``, through views and casts): read off the graph, no replay. None otherwise."""
    if node in leaves:
        n = int(torch.Size(_shape(node)).numel())
        return [[leaves[node], 0, n]] if n else []
    if not moves(node):
        return None
    name = node.target._opname
    if name in _FLAT_ORDER:
        return _flat_runs(node.args[0], leaves) if isinstance(node.args[0], torch.fx.Node) else None
    if name == "cat":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim != 0 and dim != -len(_shape(node)):
            return None
        runs = []
        for part in node.args[0]:
            more = _flat_runs(part, leaves) if isinstance(part, torch.fx.Node) else None
            if more is None:
                return None
            for r in more:
                append_run(runs, *r)
        return runs
    return None


def packed_label(parts: list[tuple[str, int]]) -> str:
    """A packed parameter's leaf name (meta/packing.py): its parts and their element counts in order, as
    JSON (a module path may hold any character: a separator in it once split the parts wrongly)."""
    return "packed:" + json.dumps([[name, n] for name, n in parts])


def _unpack(runs: list) -> list:
    """``"w"`` runs with every packed parameter's elements named as its parts' (``packed_label``), a cast on
    the way kept on each part; adjacent runs of one leaf merged."""
    out = []
    for label, s, e in runs:
        if not label.startswith("packed:"):
            pieces = [(label, s, e)]
        else:
            parts, end = json.JSONDecoder().raw_decode(label, len("packed:"))
            casts = label[end:]   # " via lossy casts ..." on the way, kept on each part
            pieces, at = [], 0
            for name, n in parts:
                lo, hi = max(s, at), min(e, at + n)
                if lo < hi:
                    pieces.append((name + casts, lo - at, hi - at))
                at += n
        for piece in pieces:
            append_run(out, *piece)
    return out


def _is_weight(label: str) -> bool:
    return not label.startswith(("input:", "computed:", "rlk:"))


def _dense_at_zero(node: torch.fx.Node) -> bool:
    """The graph's value of ``node`` is contiguous and starts at its storage's first element."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    shape, stride = [_hint(s) for s in val.shape], [_hint(s) for s in val.stride()]
    expect, acc = [], 1
    for s in reversed(shape):
        expect.append(acc)
        acc *= s
    return _hint(val.storage_offset()) == 0 and all(
        sz == 1 or st == e for sz, st, e in zip(shape, stride, reversed(expect)))


def element_map(val, produced: dict, names: dict, inputs: dict, order: dict, memo: dict | None = None,
                as_output: bool = False) -> dict:
    """The element map of one tensor argument ``val`` (module docstring). ``produced``: the rlk op
    nodes seen so far; ``names``: node -> (rlk op name, ``node_label``); ``inputs``: placeholder -> its source;
    ``order``: node -> position in the graph; ``memo``: computing node -> its label (``computed_label``;
    None: computing nodes are named by their op only); ``as_output``: ``val`` is a graph output, so a cast
    that narrows is named even as the last step (an rlk argument's last cast rounds into the op's dtype)."""
    if not isinstance(val, torch.fx.Node) or not isinstance(val.meta.get("val"), torch.Tensor):
        return {}
    try:
        chain, leaves = _leaves(val, produced, names, inputs, order, memo, as_output)
        if not chain:   # the argument is its leaf
            ((node, label),) = leaves.items()
            table = _columns(node, names)
            made = _product_identity(label, _shape(val), table) if table else None
            if made is not None:
                return made
            if not table:
                return _identity(label, _shape(val), _is_weight(label))
        if all(_is_weight(x) for x in leaves.values()):
            runs = _flat_runs(val, leaves)
            if runs is not None:   # a weight stacked from whole parameters: no replay (Qwen3-8B's gate_up
                return {"w": _unpack(runs)}  # cat alone holds more than LIMIT elements)
        leaf_nodes = sorted(leaves, key=order.__getitem__)
        shapes = [_shape(n) for n in leaf_nodes]
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if sum(sizes) > LIMIT:
            return {"unresolved": f"{sum(sizes)} leaf elements (more than {LIMIT} are not replayed)"}
        made = max((_numel(n) for n in chain), default=0)   # an expand copied makes more than it reads
        if made > LIMIT:
            return {"unresolved": f"a movement op makes {made} elements (more than {LIMIT} are not replayed)"}
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
            elif (pick := _fixed_index(n)) is not None:   # the pick, with the values the graph fixes
                dim, values = pick
                env[n] = torch.index_select(env[n.args[0]], dim, values.long() % env[n.args[0]].shape[dim])
            elif n.target._opname == "_to_copy":   # a new tensor, its values' places kept
                env[n] = env[n.args[0]].clone()
            else:
                if n.target._opname == "as_strided" and not (
                        _dense_at_zero(n.args[0]) and env[n.args[0]].is_contiguous()
                        and env[n.args[0]].storage_offset() == 0):
                    # it reads storage: the coordinates' storage is laid out as the graph's only when both
                    # are dense from their first element
                    raise ValueError("as_strided over a tensor that is not contiguous from offset 0")
                env[n] = n.target(*sub(n.args), **sub(n.kwargs))
        out = env[val]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != _shape(val):
            return {"unresolved": "the replay gave another shape than the graph's"}
    except Exception as e:  # noqa: BLE001 - any op that does not replay on coordinates: say so, bind nothing
        return {"unresolved": f"{type(e).__name__}: {e}"[:200]}
    flat = out.reshape(-1).contiguous()
    key = torch.searchsorted(base[1:], flat, right=True)
    local = flat - base[key]
    label = [leaves[n] for n in leaf_nodes]
    if all(_is_weight(x) for x in label):
        runs = _runs(key, local)
        return {"w": _unpack([[label[k], s, e] for k, s, e in runs]) if runs is not None
                else _digest(label, key, local)}
    key, local, label, shapes, columns = _products(key, local, label, shapes,
                                                   [_columns(n, names) for n in leaf_nodes])
    forms = {str(f): _rows_view(key, local, tuple(out.shape), f, label, shapes, columns)
             for f in range(min(out.dim() - 1, 2) + 1)}   # f < rank: at least one row dim (the tokens)
    return _product_forms(forms, tuple(out.shape))


# where a made tensor lives, not what it holds: left out of a computing node's digest (a trainer on cuda:0
# and a rollout on cuda:1 compute the same numbers)
_PLACEMENT = {"device", "pin_memory", "layout"}


def computed_label(n: torch.fx.Node, produced: dict, names: dict, inputs: dict, order: dict, memo: dict) -> str:
    """A computing node (a residual add, the embedding, an op of another namespace) as a leaf name:
    ``computed:<op>#<digest>`` of its op, output dtype, scalar arguments and the element maps of its tensor
    arguments (their own computing leaves by their digests). Two sides name one alike only when the same
    op takes the same elements of the same leaves: a residual that scales the attention output, the
    embedding of other tokens or another table, a norm fed the residual of another point bound while
    their leaves were "computed:<op>" alike (a session 36 audit). Graph inputs count by their role, else
    by kind (``input_name``), when an argument is a plain run of rows; a mixed or reordered argument is a
    digest of this call's layout, raw names included. Symbolic sizes, placement (device) and the
    embedding's gradient-only arguments (padding_idx, ...) are left out. ``memo`` holds the labels made so
    far: a graph is labelled in its order, so a label's arguments are already there."""
    if n in memo:
        return memo[n]
    unresolved = []

    def part(a):
        if isinstance(a, torch.fx.Node):
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return "sym"
            m = element_map(a, produced, names, inputs, order, memo)
            if "unresolved" in m:
                unresolved.append(m["unresolved"])
            return _arg_text(m)
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(part(x) for x in a) + "]"
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return "sym"
        return repr(a)
    args = n.args[:2] if n.target is torch.ops.aten.embedding.default else n.args   # padding_idx and the rest
    text = ", ".join([part(a) for a in args] + [f"{k}={part(v)}" for k, v in sorted(n.kwargs.items())   # only
                                                if k not in _PLACEMENT])                                   # steer grads
    full = f"{n.target}[{_dt(n)}]({text})"
    memo[n] = f"computed:{n.target}#" + ("unresolved" if unresolved else
                                         hashlib.sha256(full.encode()).hexdigest()[:16])
    return memo[n]


def input_name(leaf: str) -> str:
    """A leaf as the binding words it: a graph input named by its role (``input:=positions``, from
    ``inspect_boundary(roles=...)``) as "graph input positions"; any other graph input as "graph input"
    (Dynamo spells it after the caller's variable); anything else as it is."""
    base, sep, casts = leaf.partition(" via ")   # a cast on the way stays in the name
    if base.startswith("input:="):
        base = "graph input " + base[len("input:="):]
    elif base.startswith("input:"):
        base = "graph input"
    return base + sep + casts


def whole(v: dict | None, leaf: str | None = None) -> bool:
    """A rows form (``"0"``, ``"1"``, ``"2"``) that is its leaf as it is: every row in order, every column
    (``leaf``: that leaf; None: any leaf)."""
    return isinstance(v, dict) and "leaf" in v and v["rows"] == "in order" and v["cols"] == [[0, v["width"]]] and (
        leaf is None or v["leaf"] == leaf)


def _arg_text(m: dict) -> str:
    """One tensor argument of a computing node, from its element map: the leaf whole (every element in
    order: the flat form), else its rows' form."""
    if "unresolved" in m:
        return "unresolved"
    if "w" in m:
        return repr(m["w"])
    f0 = m.get("0")
    if whole(f0):
        return f"{input_name(f0['leaf'])} whole"
    v = m.get("1") or f0
    if v is None or "mixed" in v:
        return f"mixed {v['mixed'] if v else ''}"
    if labelled(v):   # a product: its columns name weight rows, its width is how many the merged leaf has
        return f"{v['leaf']}[{v['cols']}] rows {v['rows']}"
    return f"{input_name(v['leaf'])}[{v['cols']}]/{v['width']} rows {v['rows']}"


def labelled(v) -> bool:
    """A rows form whose columns are a product's weight rows (``[label, first, stop]`` runs)."""
    return isinstance(v, dict) and isinstance(v.get("cols"), list) and bool(v["cols"]) and len(v["cols"][0]) == 3
