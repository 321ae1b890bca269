"""FX boundary inspection: which rlk ops a compiled function runs, forward and backward.

``inspect_boundary(fn, *args)`` compiles ``fn`` with a capturing backend (AOT
autograd, then the graphs run as captured), calls it, runs one backward when an
output requires grad, and reports per graph the ordered rlk op nodes (op, tags,
determinism spec, input/output shapes and dtypes), graph breaks, the number of
compiled graphs, and *leaks*: compute nodes that are not rlk ops. Inductor may fuse
and reorder any such node, so each one is a place where compiled and eager, or
training and rollout, can stop agreeing bit for bit.

Not leaks (they move or relabel bytes, never round): views and reshapes, getitem,
shape arithmetic, copies/concatenation/splits, tensor creation, and the wrappers
AOT puts around mutating ops (``auto_functionalized_v2``, whose real op is its
first argument, and the ``copy_`` that writes the result back to the cache).
"""
from __future__ import annotations

import copy
import functools
import json
import operator
from dataclasses import asdict, dataclass, field

import torch
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from rlk_ops.compile.element_maps import (ATTENTION, computed_label, element_map, holds, moves, node_label,
                                          product_label)
from rlk_ops.meta.specs import REGISTRY

_aten = torch.ops.aten
# ATen ops that only move, copy or relabel bytes (exact), or create tensors.
_MOVEMENT = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze",
    "slice", "select", "split", "split_with_sizes", "narrow", "alias", "as_strided", "unbind",
    "cat", "stack", "clone", "contiguous", "detach", "copy", "copy_", "lift_fresh_copy",
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full", "new_empty", "new_zeros",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_assert_tensor_metadata",
}


@dataclass
class RlkNode:
    index: int
    op: str
    via: str | None  # e.g. "auto_functionalized_v2" for a mutating op
    tags: list[str]
    spec: dict
    inputs: list[str]
    outputs: list[str]
    # Non-tensor arguments by schema name, as the graph passes them (eps, theta,
    # rotary_dim, causal, softmax_scale, split_kv, ...); a symbolic value is its str.
    args: dict = field(default_factory=dict)
    # Tensor arguments by schema name -> [index, output] of the rlk node (same list)
    # that produced them, followed back through views/splits/getitem; None when the
    # tensor comes from a graph input or a non-movement op. Lets a reader follow the
    # q/k chain (projection -> norm -> rope -> attention) instead of guessing by order.
    producers: dict = field(default_factory=dict)
    # Tensor arguments by schema name -> the graph input they are, followed back through
    # views that keep the elements (and casts): a parameter or buffer of the module the compiled
    # callable runs on, as its dotted path ("layers.0.self_attn.q_norm.weight", found by
    # identity), or "input:<graph input name>" for anything else. Lets the binding see which
    # weight feeds which norm, not only its eps.
    sources: dict = field(default_factory=dict)
    # Forward graphs only: tensor arguments by schema name -> which elements of which leaf (an rlk op's
    # output, a parameter, a graph input, a computing node) they hold, replayed on coordinates through
    # the movement ops between (compile/element_maps.py). Lets the binding see that k is built from
    # Wk's rows and heads are read in order, not only that a linear produced it.
    maps: dict = field(default_factory=dict)


@dataclass
class Leak:
    graph: str
    node: str
    target: str
    outputs: list[str]


@dataclass
class BoundaryReport:
    forward: list[RlkNode] = field(default_factory=list)
    backward: list[RlkNode] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    graphs: int = 0
    # the breaks Dynamo reported while compiling the first call: a break at a call (counters
    # "graph_break") and one it raised elsewhere (counters "unimplemented": a data-dependent branch,
    # a break inside a loop, which skips the whole frame); the first alone missed the others (a
    # session 34 audit). ``skipped_frames``: frames Dynamo gave up on, which ran eagerly, their
    # non-rlk compute in no graph and so in no leak.
    graph_breaks: int = 0
    skipped_frames: int = 0
    recompiles: int = 0
    calls: int = 1           # the first call and the more_calls: recompiles are measured over calls > 1
    movement_nodes: dict[str, int] = field(default_factory=dict)
    # the first call (and its backward): how often each reported graph ran, forward then backward (more
    # than once: Dynamo reused it for another frame after a graph break, and its nodes name the first
    # run's tensors only); rlk calls no reported graph accounts for, per op (run outside the compiled
    # graphs: torch.compiler.disable, a frame compiled earlier); whether its outputs were bitwise an eager
    # run's on copies of its arguments (None: not compared)
    graph_runs: dict[str, list[int]] = field(default_factory=lambda: {"forward": [], "backward": []})
    outside_calls: dict[str, int] = field(default_factory=dict)
    eager_equal: bool | None = None
    eager_note: str = ""   # what was compared (outputs, gradients), or why nothing was
    # the element maps of what the entry returns (the forward graph's user outputs, not the tensors its
    # backward keeps; session 37): the last graph with rlk ops; None: not seen (``outputs_note``: why)
    output_maps: list[dict] | None = None
    outputs_note: str = ""
    output_structure: str = ""   # the pytree structure of what the first call returned (dict keys, nesting)
    # the element maps of what the forward graphs write into their inputs (the KV cache), every graph;
    # None: not known (session 37)
    write_maps: list[dict] | None = field(default_factory=list)

    @property
    def forward_ops(self) -> list[str]:
        return [n.op for n in self.forward]

    @property
    def backward_ops(self) -> list[str]:
        return [n.op for n in self.backward]

    def to_json(self) -> dict:
        return asdict(self)

    def table(self, title: str = "") -> str:
        lines = [title] if title else []
        recompiles = self.recompiles if self.calls > 1 else "- (one call)"
        lines.append(f"graphs: {self.graphs}  graph breaks: {self.graph_breaks}  recompiles: {recompiles}  "
                     f"leaks: {len(self.leaks)}")
        if self.skipped_frames:
            lines.append(f"  SKIPPED FRAMES: {self.skipped_frames} (Dynamo ran them eagerly: their non-rlk "
                         f"compute is in no graph and no leak)")
        if self.outside_calls:
            lines.append(f"  rlk calls outside the reported graphs: {self.outside_calls}")
        reruns = [n for n in self.graph_runs["forward"] + self.graph_runs["backward"] if n != 1]
        if reruns:
            lines.append(f"  graph runs in the first call: {self.graph_runs} (1 each expected)")
        if self.eager_equal is not None:
            lines.append(f"  bitwise equal to eager: {self.eager_equal} ({self.eager_note})")
        for name, nodes in (("forward", self.forward), ("backward", self.backward)):
            if not nodes:
                lines.append(f"  {name} graph: none")
                continue
            lines.append(f"  {name} graph: {len(nodes)} rlk ops   (spec flags: run-to-run, batch-invariant, "
                         f"prefill/decode-invariant; y/n/- = yes/no/not applicable)")
            lines.append(f"    {'#':>3}  {'op':<31} {'tags':<28} {'spec per backend':<22} outputs")
            for n in nodes:
                tags = ",".join(_TAG_SHORT.get(t, t) for t in n.tags) or "-"
                specs = " ".join(f"{b}:{_flags(s)}" for b, s in n.spec.get("backends", {}).items())
                op = n.op + (" [mutates]" if n.via else "")
                lines.append(f"    {n.index:>3}  {op:<31} {tags:<28} {specs:<22} {' '.join(n.outputs)}")
        for leak in self.leaks:
            lines.append(f"  LEAK in {leak.graph}: {leak.target} ({leak.node}) -> {' '.join(leak.outputs)}")
        return "\n".join(lines)


_TAG_SHORT = {"pt2_compliant_tag": "pt2_compliant", "nondeterministic_bitwise": "NONDETERMINISTIC"}


def _flags(spec: dict) -> str:
    def f(v):
        return "-" if v is None else ("y" if v else "n")

    return f(spec["run_to_run"]) + f(spec["batch_invariant"]) + f(spec["prefill_decode_invariant"])


def _describe(val) -> list[str]:
    if isinstance(val, torch.Tensor):
        shape = "x".join(str(s) for s in val.shape)
        return [f"{str(val.dtype).replace('torch.', '')}[{shape}]"]
    if isinstance(val, (list, tuple)):
        return [d for v in val for d in _describe(v)]
    return []


def _arg_vals(args) -> list:
    vals = []
    for a in args:
        if isinstance(a, torch.fx.Node):
            vals.append(a.meta.get("val"))
        elif isinstance(a, (list, tuple)):
            vals.extend(_arg_vals(a))
    return vals


def _is_shape_math(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


# Single-input movement ops a value can be followed back through to its producer.
_PASS_THROUGH = _MOVEMENT - {"cat", "stack", "copy", "copy_", "empty", "empty_like", "empty_strided", "zeros",
                             "zeros_like", "full", "new_empty", "new_zeros", "sym_size", "sym_stride", "sym_numel",
                             "sym_storage_offset", "_assert_tensor_metadata"}


def _schema_value(node: torch.fx.Node, arg, pos: int, via: str | None):
    """The value ``node`` passes for schema argument ``arg`` (positional or by name).
    auto_functionalized_v2 passes a mutated tensor as an index into ``_all_bases``."""
    if via:
        if arg.name in node.kwargs:
            return node.kwargs[arg.name]
        base = node.kwargs.get(f"_{arg.name}_base_index")
        if base is not None:
            return node.kwargs["_all_bases"][base]
        return arg.default_value if arg.has_default_value() else None
    if pos < len(node.args):
        return node.args[pos]
    if arg.name in node.kwargs:
        return node.kwargs[arg.name]
    return arg.default_value if arg.has_default_value() else None


def _scalar(val):
    if isinstance(val, torch.fx.Node):
        val = val.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(val)
    return val if isinstance(val, (bool, int, float, str)) or val is None else str(val)


def _producer(val, produced: dict) -> list | None:
    out = 0
    while isinstance(val, torch.fx.Node):
        if val in produced:
            return [produced[val], out]
        if val.op != "call_function":
            return None
        if val.target is operator.getitem:
            src = val.args[0]
            if src in produced:
                return [produced[src], val.args[1]]
            val = src  # getitem of a split/unbind
            continue
        name = getattr(val.target, "_opname", None)
        if not (isinstance(val.target, torch._ops.OpOverload) and name in _PASS_THROUGH):
            return None
        val = val.args[0]
    return None


# Ops a parameter is followed through to the rlk op that takes it (a slice or select of a stacked weight
# is not followed: w[0] and w[1] would both be "w"). Views in memory order and copies keep each element's
# place; so do casts that lose nothing the consumer's dtype holds (fp32 master weights cast to bf16 in the
# graph). A reordering view (w.reshape(4, 4).t().reshape(16)) or a cast through a narrower dtype
# (bf16 -> float8 -> bf16) is not the same weight: the chain is written into the source's name
# (``_source``), so two sides bind only when they transform the parameter alike.
_SAME_ORDER = {"view", "_unsafe_view", "reshape", "expand", "squeeze", "unsqueeze", "alias", "clone",
               "contiguous", "detach", "lift_fresh_copy"}
_REORDER = {"permute", "transpose", "t"}
_CAST = {"_to_copy"}
_SAME_ELEMENTS = _SAME_ORDER | _REORDER | _CAST


def _step(node: torch.fx.Node) -> tuple[str, bool, torch.dtype | None]:
    """How one followed op transforms the tensor: (text, whether it changes which value sits where, the
    dtype a cast makes: judged once the parameter's dtype is known, in ``_source``)."""
    name = node.target._opname
    val = node.meta.get("val")
    shape = list(val.shape) if isinstance(val, torch.Tensor) else None
    if name in _CAST:
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
        return f".to({str(dtype).replace('torch.', '')})", dtype is None, dtype
    if name in _REORDER:
        src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        rank = src.dim() if isinstance(src, torch.Tensor) else None
        if name == "permute":
            dims = [int(d) % rank if rank else int(d) for d in node.args[1]]
        elif rank is None:
            return f".{name}{tuple(node.args[1:])}", True
        else:
            a, b = ((0, 1) if name == "t" else (int(node.args[1]) % rank, int(node.args[2]) % rank)) if rank >= 2 \
                else (0, 0)
            dims = list(range(rank))
            dims[a], dims[b] = dims[b], dims[a]
        return f".permute({', '.join(map(str, dims))})", dims != sorted(dims), None
    if name in ("clone", "contiguous", "detach", "alias", "lift_fresh_copy"):
        return "", False, None
    return (f".{'expand' if name == 'expand' else 'reshape'}({', '.join(map(str, shape))})" if shape is not None
            else f".{name}"), False, None


# Wrapper modules whose attribute adds a path segment without changing the model (DDP, torch.compile,
# FSDP, activation checkpointing): dropped, so a wrapped and a bare model name a parameter alike.
_WRAPPER_SEGMENTS = {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _root_module(fn) -> torch.nn.Module | None:
    """The module ``fn`` runs on: ``fn`` itself, a bound method's ``__self__``, or a
    ``functools.partial``'s first argument; None when there is none."""
    root = fn
    if isinstance(fn, functools.partial):
        root = fn.args[0] if fn.args else None
    elif not isinstance(fn, torch.nn.Module):
        root = getattr(fn, "__self__", None)
    return root if isinstance(root, torch.nn.Module) else None


def parameter_names(fn) -> dict[int, str]:
    """id -> dotted path of every parameter and buffer of the module ``fn`` runs on (``_root_module``),
    wrapper segments dropped; {} when there is none."""
    root = _root_module(fn)
    if root is None:
        return {}
    named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    names: dict[int, str] = {}
    for name, t in named:
        names.setdefault(id(t), ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS))
    return names


def _agrees(val, shape, dtype) -> bool:
    """An AOT graph input against a Dynamo graph input: both tensors (same dtype, rank, and every
    dim that is a plain int on both sides) or both not. Symbolic dims are not compared: comparing
    a SymInt with an int would specialize the graph's shapes (it guards on the value)."""
    if not isinstance(val, torch.Tensor) or shape is None:
        return not isinstance(val, torch.Tensor) and shape is None
    return val.dtype == dtype and val.dim() == len(shape) and all(
        a == b for a, b in zip(val.shape, shape) if type(a) is int and type(b) is int)


def _source(val, inputs: dict) -> str | None:
    """The graph input (a module parameter's path, or ``input:...``) that ``val`` is, followed back through
    _SAME_ELEMENTS; when the way there reorders elements or casts through a narrower dtype, the steps are
    appended (``k_norm.weight.to(float8_e4m3fn).to(bfloat16)``), None when it is not such an input."""
    final = _dtype(val)
    steps, changed, casts = [], False, []
    while isinstance(val, torch.fx.Node):
        if val in inputs:
            # a cast keeps the weight when it makes the consumer's dtype, or one that holds the parameter's
            # exactly (bf16 -> fp32 -> bf16); through a narrower one (bf16 -> float8, fp64 -> fp32 -> bf16:
            # rounded twice) the values may differ
            start = _dtype(val)
            changed |= any(d is None or start is None or final is None or not (d == final or holds(d, start))
                           for d in casts)
            return inputs[val] + ("".join(reversed(steps)) if changed else "")
        name = getattr(val.target, "_opname", None)
        if not (val.op == "call_function" and isinstance(val.target, torch._ops.OpOverload)
                and name in _SAME_ELEMENTS and moves(val)):   # moves: not a view into another dtype (a bitcast)
            return None
        text, moved, cast = _step(val)
        steps.append(text)
        changed |= moved
        if name in _CAST:
            casts.append(cast)
        val = val.args[0]
    return None


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _call_record(node: torch.fx.Node, target, via: str | None, produced: dict, inputs: dict,
                 maps: tuple | None = None) -> tuple[dict, dict, dict, dict]:
    """``maps``: (rlk op labels by node, node positions, computing nodes' labels) to write element maps
    with; None: none."""
    args, producers, sources, elements = {}, {}, {}, {}
    for pos, arg in enumerate(target._schema.arguments):
        val = _schema_value(node, arg, pos, via)
        if "Tensor" in str(arg.type):
            producers[arg.name] = _producer(val, produced)
            src = _source(val, inputs)
            if src is not None:
                sources[arg.name] = src
            if maps is not None:
                m = element_map(val, produced, maps[0], inputs, maps[1], maps[2])
                if m:
                    elements[arg.name] = m
        else:
            args[arg.name] = _scalar(val)
    return args, producers, sources, elements


def analyse_graph(gm: torch.fx.GraphModule, graph: str, report: BoundaryReport,
                  first_index: int = 0, input_names: list | None = None) -> list[RlkNode]:
    """``first_index``: index of this graph's first rlk node in the report's list
    (several graphs after a break), so ``producers`` indices point into that list.
    ``input_names``: (source, shape, dtype) of the Dynamo graph's inputs, one per placeholder of
    ``gm`` in order (the AOT forward graph takes them in that order), for ``sources``; used only
    if every position agrees in shape and dtype."""
    nodes = []
    produced: dict[torch.fx.Node, int] = {}
    op_names: dict[torch.fx.Node, tuple[str, str]] = {}
    memo: dict[torch.fx.Node, str] = {}   # computing nodes' labels (element_maps.computed_label), in graph order
    maps = (op_names, {n: i for i, n in enumerate(gm.graph.nodes)}, memo) if graph == "forward" else None
    layer = sum(n.op.split("::")[1] in ATTENTION for n in report.forward) if graph == "forward" else 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = {}
    if input_names is not None and len(input_names) == len(placeholders):
        vals = [ph.meta.get("val") for ph in placeholders]
        if all(_agrees(v, shape, dtype) for v, (_, shape, dtype) in zip(vals, input_names)):
            inputs = {ph: src for ph, (src, _, _) in zip(placeholders, input_names)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        via = None
        if isinstance(target, torch._ops.HigherOrderOperator) and "auto_functionalized" in target.name():
            via, target = target.name(), node.args[0]
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "rlk":
            name = target._schema.name.split("::")[1]
            spec = REGISTRY[name].as_dict()
            kw_vals = _arg_vals(node.kwargs.values()) if via else _arg_vals(node.args)
            args, producers, sources, elements = _call_record(node, target, via, produced, inputs, maps)
            produced[node] = first_index + len(nodes)
            op_names[node] = _label(node, name, layer, sources, elements) if maps is not None else (name, "", None)
            layer += name in ATTENTION
            nodes.append(RlkNode(
                index=first_index + len(nodes), op=f"rlk::{name}", via=via,
                tags=[str(t).split(".")[-1] for t in target.tags],
                spec={"backends": spec["backends"], "mutates": spec["mutates"]},
                inputs=[d for v in kw_vals for d in _describe(v)],
                outputs=_describe(node.meta.get("val")), args=args, producers=producers, sources=sources,
                maps=elements))
            continue
        if target is operator.getitem or _is_shape_math(node):
            continue
        if maps is not None and not moves(node):
            computed_label(node, produced, op_names, inputs, *maps[1:])
        name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and name in _MOVEMENT \
                and not _converting_copy(name, node):
            report.movement_nodes[name] = report.movement_nodes.get(name, 0) + 1
            continue
        report.leaks.append(Leak(graph, node.name, str(target), _describe(node.meta.get("val"))))
    if maps is not None and report.write_maps is not None:
        writes = _write_maps(gm, produced, op_names, inputs, maps)
        report.write_maps = None if writes is None else report.write_maps + writes
    if maps is not None and nodes:
        report.output_maps, report.outputs_note = _output_maps(gm, produced, op_names, inputs, maps)
    elif maps is not None and report.output_maps is not None:   # a graph after the last rlk op's (a break)
        report.output_maps = None
        report.outputs_note = ("a graph break after the last rlk op: a later graph may change what the entry "
                               "returns")
    return nodes


def _output_maps(gm, produced: dict, op_names: dict, inputs: dict, maps: tuple) -> tuple[list | None, str]:
    """The element maps of the graph's user outputs (the entry's return values; AOT's forward graph also
    returns the inputs it mutates first and the tensors its backward keeps after: ``fw_compiler`` records
    which are which), a narrowing cast named even as the last step: what the entry hands back (the
    logits). A rollout that reordered the vocabulary after ``lm_head`` (``cat([y[..., 32:], y[..., :32]],
    -1)``) bound while it sampled from other logits (a session 37 audit): nothing compared the outputs.
    (None, why) when the user outputs are not known."""
    span = gm.meta.get("rlk_user_outputs")
    if span is None:
        return None, "the graph's user outputs could not be told from the tensors its backward keeps"
    outs = pytree.tree_leaves(gm.graph.output_node().args)[span[0]:span[1]]
    return _as_outputs(outs, produced, op_names, inputs, maps), ""


def _write_maps(gm, produced: dict, op_names: dict, inputs: dict, maps: tuple) -> list[dict] | None:
    """The element maps of the values the graph writes into its inputs: the first outputs of AOT's forward
    graph (mutations applied after it runs) and any ``copy_`` into a graph input in it. A rollout that
    changed its KV cache after the logits (``v_cache.mul_(2)``: the next step reads it) bound (a session
    37 audit). None when the graph's outputs are not known."""
    span = gm.meta.get("rlk_writes")
    if span is None:
        return None
    vals = pytree.tree_leaves(gm.graph.output_node().args)[span[0]:span[1]]
    vals += [n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target in _COPIES
             and len(n.args) > 1 and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"]
    return _as_outputs(vals, produced, op_names, inputs, maps)


def _as_outputs(vals: list, produced: dict, op_names: dict, inputs: dict, maps: tuple) -> list[dict]:
    """The element maps of the tensor nodes among ``vals``, read as what the graph hands out (a narrowing
    last cast named)."""
    return [element_map(v, produced, op_names, inputs, *maps[1:], as_output=True) for v in vals
            if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)]


_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten.copy.default)


def _label(node: torch.fx.Node, name: str, layer: int, sources: dict, elements: dict) -> tuple:
    """An rlk output's leaf name parts for element maps: (op, where, a product's columns or None). A norm
    carries its weight, a linear its input and the weight rows behind its columns (session 37)."""
    if name == "linear":
        return (name, *product_label(layer, elements, node))
    return name, node_label(layer, sources.get("weight") if name == "qk_rmsnorm" else None), None


def _converting_copy(name: str, node: torch.fx.Node) -> bool:
    """copy(dst, src) / copy_ into a tensor of another dtype rounds (fp32 -> bf16): a leak, as
    the same conversion written ``.to()`` (_to_copy) is."""
    if name not in ("copy", "copy_") or len(node.args) < 2:
        return False
    dst, src = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[:2])
    return not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.dtype == src.dtype)


@dataclass
class EagerRun:
    """What ``eager_outputs`` saw: the output tree's leaves and structure, the gradients of the root
    module's parameters (None: not taken), or why it could not run (``skipped``)."""
    leaves: list = field(default_factory=list)
    spec: object = None
    grads: list | None = None
    skipped: str | None = None


def eager_outputs(fn, args: tuple, kwargs: dict | None = None, backward: bool = False) -> EagerRun:
    """``fn`` run eagerly on deep copies of its arguments (a KV cache it appends to is a copy; describe_rollout's
    cache is small, a production one would be copied whole; the root module's parameters and buffers are
    never copied), in the caller's grad mode, with the RNG of the CPU and every CUDA device forked and the
    root module's buffers put back afterwards (each buffer is cloned for that), so the compiled run that
    follows starts from the same state: what ``inspect_boundary(..., eager=...)`` compares its first call
    with. With ``backward`` (and grad mode on), also the gradients of the sum of the outputs that require
    grad w.r.t. the root module's parameters, as inspect_boundary's backward takes them. Call it outside
    any ``provenance.capture()`` that should hold only the compiled run."""
    root = _root_module(fn)
    own = [*root.parameters(), *root.buffers()] if root is not None else []
    try:   # a non-leaf tensor cannot be deep-copied: its values, detached, are what the call reads
        a, kw = copy.deepcopy(pytree.tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor) and t.grad_fn is not None else t, (args, kwargs or {})),
            {id(t): t for t in own})   # the model's own tensors stay themselves (and take the gradients)
    except Exception as e:  # noqa: BLE001 - any object deepcopy refuses (a lock in an engine object)
        return EagerRun(skipped=f"the arguments could not be copied for an eager run ({type(e).__name__}: {e})")
    # by module and name, so a forward that rebinds a buffer (self.step = self.step + 1) is put back too
    buffers = [(m, name, b, b.detach().clone()) for m in (root.modules() if root is not None else ())
               for name, b in m._buffers.items() if b is not None]
    params = [p for p in root.parameters() if p.requires_grad] \
        if root is not None and backward and torch.is_grad_enabled() else []
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else []
    try:
        with torch.random.fork_rng(devices=cuda):
            leaves, spec = pytree.tree_flatten(fn(*a, **kw))
            grads = None
            wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if params and wanted:
                grads = list(torch.autograd.grad(sum(t.float().sum() for t in wanted), params, allow_unused=True))
    finally:
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b
                b.copy_(saved)
    return EagerRun([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], spec, grads)


def _same_bits(a, b) -> bool:
    """Bitwise equality of two output leaves: tensors of one dtype and shape whose bytes are equal (NaNs
    with one payload are equal, -0 and +0 are not), anything else by == (NaN floats equal; a value that
    cannot say: unequal)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        try:
            return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
        except Exception:  # noqa: BLE001 - an object whose == is not a bool
            return False
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _compare_eager(eager: EagerRun, out, params: list) -> tuple[bool | None, str]:
    """(bitwise equal, what was compared) of the compiled first call against the eager run."""
    if eager.skipped:
        return None, eager.skipped
    leaves, spec = pytree.tree_flatten(out)
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        return None, "the entry returned no tensor to compare"
    if spec != eager.spec or len(leaves) != len(eager.leaves):
        return False, "the compiled call returned another structure than the eager run"
    if not all(_same_bits(a, b) for a, b in zip(leaves, eager.leaves)):
        return False, "outputs"
    if eager.grads is None:
        return True, "outputs"
    same = all((g is None and p.grad is None) or (g is not None and p.grad is not None and _same_bits(p.grad, g))
               for p, g in zip(params, eager.grads))
    return same, "outputs and parameter gradients"


def inspect_boundary(fn, *args, dynamic: bool | None = None, backward: bool = True,
                     more_calls: tuple[tuple, ...] = (), eager: EagerRun | None = None, roles: dict | None = None,
                     packed: dict | None = None, **kwargs) -> BoundaryReport:
    """Compile ``fn`` (no fullgraph requirement, so breaks are counted rather than
    raised), run it on ``args`` and, if ``backward`` and an output requires grad,
    run one backward of the sum of its outputs (this accumulates ``.grad`` on leaves).
    ``more_calls`` are further argument tuples (e.g. other sequence lengths): the
    graphs compiled for them beyond the first call's are counted as ``recompiles``;
    the reported rlk nodes are those of the first call's graphs. ``eager``: ``eager_outputs``
    of the same call (``backward`` alike), compared bitwise with the first call's outputs and its
    parameters' gradients (``eager_equal``, ``eager_note``; gradients held before the call are set aside
    during it and the new ones added to them after, as autograd accumulates). ``roles``: {role: tensor}
    for arguments the graphs should name by what they are (``input:=positions``), not by Dynamo's
    spelling of the caller's variable (``l_positions_``, ``l_args_1_``), so two sides' element maps
    can say which input feeds rope. ``packed``: fused parameters named as the checkpoint's parts in the
    element maps (meta/packing.py; validated there)."""
    from rlk_ops.meta import provenance

    if not callable(fn):
        raise TypeError(f"inspect_boundary: fn must be a callable (a function or module), got {type(fn).__name__}")
    report = BoundaryReport()
    fw_graphs: list[torch.fx.GraphModule] = []
    bw_graphs: list[torch.fx.GraphModule] = []
    runs: dict[str, list[int]] = {"forward": [], "backward": []}

    def counted(kind: str, gm):
        i = len(runs[kind])
        runs[kind].append(0)
        inner = gm.forward

        def run(*a):
            runs[kind][i] += 1
            return inner(*a)
        return make_boxed_func(run)

    def fw_compiler(gm, _inputs):
        fw_graphs.append(gm)
        # which of the graph's outputs the user gets: AOT returns the inputs it mutates first, then the
        # user outputs, then what the backward keeps (``_output_maps``)
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        first, n = (getattr(meta, k, None) for k in ("num_mutated_inp_runtime_indices", "num_outputs"))
        tokens = getattr(meta, "tokens", None)   # effect tokens come first (an op with side effects)
        if isinstance(first, int) and isinstance(n, int) and tokens is not None:
            first += len(tokens)
            gm.meta["rlk_user_outputs"] = (first, first + n)
            gm.meta["rlk_writes"] = (len(tokens), first)
        return counted("forward", gm)

    def bw_compiler(gm, _inputs):
        bw_graphs.append(gm)
        return counted("backward", gm)

    aot_backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)
    dynamo_graphs = []
    dynamo_inputs = []
    params = parameter_names(fn)
    if packed:
        from rlk_ops.meta import packing
        root = _root_module(fn)
        params = packing.labels(root, params, packing.check(packed, root))
    named = {id(t): f"input:={role}" for role, t in (roles or {}).items() if isinstance(t, torch.Tensor)}

    def backend(gm, example_inputs):
        # Dynamo may call the backend again after restarting its analysis (e.g. when
        # AOT specialises a dynamic dim); only compilations that finish are graphs.
        compiled_fn = aot_backend(gm, example_inputs)
        dynamo_graphs.append(gm)
        # each input as a source: the parameter it is (by identity), else the input's graph name
        phs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        dynamo_inputs.append([
            (params.get(id(t)) or named.get(id(t), f"input:{ph}"), tuple(t.shape), t.dtype)
            if isinstance(t, torch.Tensor)
            else (f"input:{ph}", None, None) for ph, t in zip(phs, example_inputs)]
            if len(phs) == len(example_inputs) else None)
        return compiled_fn

    counters = torch._dynamo.utils.counters

    def breaks():
        return (sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values()),
                counters["frames"]["total"] - counters["frames"]["ok"])
    breaks_before = breaks()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    root = _root_module(fn)
    trained = [p for p in root.parameters() if p.requires_grad] if root is not None else []
    held = [p.grad for p in trained]   # set aside: .grad after the backward is then this call's gradient
    for p in trained:
        p.grad = None
    try:
        with provenance.capture() as first_call:
            out = compiled(*args, **kwargs)
            report.output_structure = str(pytree.tree_structure(out))
            outs = _tensors(out)
            ran_backward = backward and any(o.requires_grad for o in outs)
            if ran_backward:
                sum(o.float().sum() for o in outs if o.requires_grad).backward()
        if eager is not None:
            report.eager_equal, report.eager_note = _compare_eager(eager, out, trained)
    finally:   # what the backward accumulates onto a held gradient: held += new, as autograd adds
        for p, g in zip(trained, held):
            if g is not None:
                p.grad = g if p.grad is None else g.add_(p.grad)
    # backward graphs only where a backward ran (with dynamic shapes AOT compiles the backward with the
    # forward: a graph of nodes that never executed is not the call's evidence)
    first_fw, first_bw = list(fw_graphs), list(bw_graphs) if ran_backward else []
    report.graph_runs = {"forward": list(runs["forward"]), "backward": list(runs["backward"][:len(first_bw)])}
    report.graphs = len(dynamo_graphs)
    now = breaks()
    report.graph_breaks, report.skipped_frames = now[0] - breaks_before[0], now[1] - breaks_before[1]
    report.calls = 1 + len(more_calls)
    for more in more_calls:
        outs = _tensors(compiled(*more, **kwargs))
        if backward and any(o.requires_grad for o in outs):
            sum(o.float().sum() for o in outs if o.requires_grad).backward()
    report.recompiles = len(dynamo_graphs) - report.graphs
    # the AOT forward graphs in the order Dynamo's graphs were compiled: their inputs named
    # (for each rlk node's ``sources``) only when the two lists line up one to one
    names = dynamo_inputs[:report.graphs] if len(first_fw) == report.graphs else [None] * len(first_fw)
    accounted: dict[str, int] = {}   # rlk calls the reported graphs made in the first call: nodes x runs

    def account(nodes, n_runs):
        for node in nodes:
            accounted[node.op] = accounted.get(node.op, 0) + n_runs
        return nodes
    for k, (gm, input_names) in enumerate(zip(first_fw, names)):
        report.forward.extend(account(analyse_graph(gm, "forward", report, len(report.forward), input_names),
                                      report.graph_runs["forward"][k]))
    for k, gm in enumerate(first_bw):
        report.backward.extend(account(analyse_graph(gm, "backward", report, len(report.backward)),
                                       report.graph_runs["backward"][k]))
    made: dict[str, int] = {}        # the top-level rlk calls of the first call (nested ones: inside a kernel)
    for r in first_call.records():
        if not r.nested:
            made[f"rlk::{r.op}"] = made.get(f"rlk::{r.op}", 0) + r.calls
    report.outside_calls = {op: n - accounted.get(op, 0) for op, n in sorted(made.items())
                            if n > accounted.get(op, 0)}
    for i, n in enumerate(report.forward):
        n.index = i
    for i, n in enumerate(report.backward):
        n.index = i
    return report


def dumps(reports: dict[str, BoundaryReport]) -> str:
    return json.dumps({k: v.to_json() for k, v in reports.items()}, indent=2)
