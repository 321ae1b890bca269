"""Cross-configuration binding: do a training side and a rollout side run the same
attention contract? Checked before the first step, from what each side ran.

A side description (``meta/probe.py``: ``describe_train``, ``describe_rollout``,
``describe_side``) holds evidence only: the FX boundary reports of the compiled entry
points (ordered rlk ops, their scalar arguments, which rlk op fed which), the
provenance of the calls that ran, the environment probe, the model identity and the
topology the caller states. ``bind(train, rollout)`` derives the same named fields
from each side and classifies every one:

* IDENTICAL  must be equal, else the pair is not comparable at all (``comparable``):
             model identity, heads and head_dim, layers, tp/cp and head/sequence ownership.
* SEMANTIC   must be equal on both sides *and* meet the strict mandate (``Mandate``),
             else ``passed`` is False: dtype, causal, scale, fp32 accumulation, LSE dtype
             and domain, reduction order, split-KV policy and executed plan, the q/k path
             (RMSNorm eps, RoPE theta / rotary_dim / rotate-half, rope's positions), which
             elements flow along q/k/v from the projection's weight rows to attention and
             into every other rlk op (element maps, compile/element_maps.py), fallbacks, the
             determinism spec of every executed backend, blocking environment settings.
* RECORDED   free to differ, reported: mode (prefill/decode), page size, backend and kernel ids
             whose numerics class is the same, compile on/off, strict flag, leaks.

Fail closed: a field nobody observed is UNOBSERVABLE, which fails its tier (an op in a
graph with no recorded call was compiled but never executed; a side with no graph was
only configured). Every failure names the field, both values and the tier.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlk_ops.compile.element_maps import (ATTENTION, append_run, input_name, labelled, last_tokens_digest, leaf_name,
                                          node_label, product_columns, whole)
from rlk_ops.meta.contract import AttentionContract, SplitKVPolicy
from rlk_ops.meta.probe import blocking, path_of, probe_keys
from rlk_ops.meta.specs import REGISTRY

IDENTICAL, SEMANTIC, RECORDED = "IDENTICAL", "SEMANTIC", "RECORDED"
ATTENTION_OPS = ATTENTION


@dataclass(frozen=True)
class Unobservable:
    reason: str

    def as_json(self) -> dict:
        return {"unobservable": self.reason}


# What each backend's attention computes, for the fields no graph shows. Two backends
# are "proven equivalent" for an op only when they share a reduction_order class here
# (then their ids differ only as RECORDED). Sources: kernels/cpu/attention.py; FA4 and
# FlashInfer facts measured on the H200 (DESIGN.md; FlashInfer's log2 LSE is scaled by
# ln 2 in kernels/flashinfer.py).
ATTENTION_NUMERICS = {
    "cpu": {"accumulation": "fp32", "lse_domain": "natural_log", "p_rounding": "input_dtype",
            "reduction_order": "cpu-reference: 128-key blocks from key 0, ascending, fp32 online softmax"},
    "fa4": {"accumulation": "fp32", "lse_domain": "natural_log", "p_rounding": "input_dtype",
            "reduction_order": "fa4: 128-key tiles, last to first, num_splits=1, pack_gqa fixed"},
    "flashinfer": {"accumulation": "fp32", "lse_domain": "natural_log", "p_rounding": "input_dtype",
                   "reduction_order": "flashinfer-fa2 tensor-core decode"},
}
# Split plans fixed by a backend's construction (it records no plan of its own): the
# cpu reference never splits "disabled" or its auto lane and runs canonical:C as C-token
# chunks merged ascending (kernels/cpu/canonical.py); fa4 is pinned to num_splits=1.
# A backend that plans per call (FlashInfer) reports plan records instead (probe.py).
_PLAN_BY_CONSTRUCTION: dict[tuple[str, str], Callable[[SplitKVPolicy], str]] = {
    ("cpu", "disabled"): lambda p: "single_pass",
    ("cpu", "auto"): lambda p: "single_pass",
    ("cpu", "canonical"): lambda p: f"canonical:{p.size}",
    ("fa4", "disabled"): lambda p: "single_pass",
    # fa4 runs canonical:C through the same plan (kernels/fa4/canonical.py), partials at num_splits=1
    ("fa4", "canonical"): lambda p: f"canonical:{p.size}",
}


# ---------------------------------------------------------------------- mandate
@dataclass(frozen=True)
class Mandate:
    """The strict values. ``None`` means "any value, as long as both sides agree"."""
    dtype: str | None = None              # None: bfloat16, float16 or float32
    causal: bool = True
    softmax_scale: float | None = None    # None: head_dim ** -0.5
    head_dim: int | None = None
    split_kv: str | None = None           # None: any policy training reproduces (disabled, canonical:C)
    accumulation: str = "fp32"
    p_rounding: str = "input_dtype"       # P enters the PV product in the input dtype
    lse_dtype: str = "float32"
    lse_domain: str = "natural_log"
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.split_kv is not None:   # one spelling (the sides' values are compared as parsed policies)
            try:
                policy = SplitKVPolicy.parse(self.split_kv)
            except ValueError as e:
                raise ValueError(f"Mandate.split_kv: {e}") from None
            object.__setattr__(self, "split_kv", str(policy))

    @classmethod
    def from_contract(cls, contract: AttentionContract, **qk_definition) -> "Mandate":
        return cls(dtype=contract.dtype, causal=contract.causal, softmax_scale=contract.softmax_scale,
                   head_dim=contract.head_dim, split_kv=contract.split_kv, accumulation=contract.accumulation,
                   p_rounding=contract.p_rounding, lse_domain=contract.lse, **qk_definition)


def _want(expected, what: str):
    return lambda v, m, ctx: None if getattr(m, expected) is None or v == getattr(m, expected) \
        else f"the mandate is {what} {getattr(m, expected)!r}"


def _m_dtype(v, m, ctx):
    if m.dtype is not None:
        return None if v == m.dtype else f"the mandate is {m.dtype}"
    return None if v in ("bfloat16", "float16", "float32") else "not a dtype the strict kernels cover"


def _as_run(scale, dtype: str):
    """The softmax scale the kernels use: the float64 value for float64 inputs, else rounded to float32
    (the CPU reference multiplies float32 scores by it, FA4, FlashInfer and the Triton kernels take a
    float32): ``1 / math.sqrt(128)`` and ``128 ** -0.5`` differ in the last bit of a double only."""
    if not isinstance(scale, float) or dtype == "float64":
        return scale
    from rlk_ops.ops._validate import as_float32
    return as_float32(scale)


def _m_scale(v, m, ctx):
    head_dim = ctx.get(ctx["name"].replace("softmax_scale", "head_dim"))
    dtype = ctx.get(ctx["name"].replace("softmax_scale", "dtype"))
    want = m.softmax_scale if m.softmax_scale is not None else \
        (head_dim ** -0.5 if isinstance(head_dim, int) else None)
    return None if want is None or v == _as_run(want, dtype) else \
        f"the mandate is {_as_run(want, dtype)!r} (head_dim ** -0.5 unless given; as the kernels use it)"


def _m_split(v, m, ctx):
    try:
        policy = SplitKVPolicy.parse(v)
    except ValueError as e:
        return str(e)
    if policy.kind == "auto":
        return "auto split-KV is chosen from the batch: not batch-invariant, never strict"
    if policy.kind == "fixed":
        return "fixed:N is batch-invariant but merges partials in an order single-pass training does not reproduce"
    if m.split_kv is not None and str(policy) != str(SplitKVPolicy.parse(m.split_kv)):
        return f"the mandate is {m.split_kv!r}"
    return None


def _m_plan(v, m, ctx):
    if isinstance(v, list):
        return f"the plan varied across calls: {v}"
    policy = ctx.get(ctx["name"].replace("split_plan", "split_kv"))
    try:
        p = SplitKVPolicy.parse(policy)
    except (ValueError, TypeError):
        return None  # the policy field fails on its own
    want = "single_pass" if p.kind == "disabled" else (f"canonical:{p.size}" if p.kind == "canonical" else None)
    return None if want is None or v == want else f"policy {policy!r} means plan {want!r}"


def _m_stages(v, m, ctx):
    want = "linear" if ctx["name"].endswith("].v.stages") else "linear>rmsnorm>rope"
    return None if v == want else f"the Qwen3 path is {want!r}"


def _m_spec(v, m, ctx):
    op = ctx["name"].split(".")[1]
    bad = []
    for spec in v if isinstance(v, list) else [v]:
        bad += [k for k in ("run_to_run",) if spec.get(k) is not True]
        bad += [k for k in ("batch_invariant", "prefill_decode_invariant") if spec.get(k) is False]
        if spec.get("nondeterministic_bitwise"):
            bad.append("tagged nondeterministic_bitwise")
        if op in ATTENTION_OPS and spec.get("prefill_decode_invariant") is not True:
            bad.append("prefill_decode_invariant must be True for a forward attention op")
    return f"not strict: {', '.join(dict.fromkeys(bad))}" if bad else None


@dataclass(frozen=True)
class Rule:
    tier: str
    mandate: Callable | None = None  # (value, Mandate, ctx) -> violation text or None
    one_sided: bool = False          # may exist on one side only (an op only one side runs)


RULES: dict[str, Rule] = {
    "model.id": Rule(IDENTICAL),
    "topology.tp": Rule(IDENTICAL), "topology.cp": Rule(IDENTICAL),
    "topology.head_ownership": Rule(IDENTICAL, lambda v, m, ctx: ctx["heads_check"](v)),
    "topology.sequence_ownership": Rule(IDENTICAL),
    "attention.layers": Rule(IDENTICAL, lambda v, m, ctx: None if isinstance(v, int) and v > 0 else
                             "no rlk attention op in the graph" if v == 0 else None),
    "attention.num_heads": Rule(IDENTICAL), "attention.num_kv_heads": Rule(IDENTICAL),
    "attention.head_dim": Rule(IDENTICAL, _want("head_dim", "head_dim")),
    "attention.dtype": Rule(SEMANTIC, _m_dtype),
    "attention.causal": Rule(SEMANTIC, _want("causal", "causal")),
    "attention.softmax_scale": Rule(SEMANTIC, _m_scale),
    "attention.split_kv": Rule(SEMANTIC, _m_split),
    "attention.split_plan": Rule(SEMANTIC, _m_plan),
    "attention.lse_dtype": Rule(SEMANTIC, _want("lse_dtype", "lse dtype")),
    "attention.lse_domain": Rule(SEMANTIC, _want("lse_domain", "LSE domain")),
    "attention.accumulation": Rule(SEMANTIC, _want("accumulation", "accumulation")),
    "attention.p_rounding": Rule(SEMANTIC, _want("p_rounding", "P rounding")),
    "attention.reduction_order": Rule(SEMANTIC),
    "attention.fallback": Rule(SEMANTIC, lambda v, m, ctx: None if v is False else "a fallback is not strict"),
    "attention.metadata": Rule(SEMANTIC, lambda v, m, ctx: None if v == "whole" else
                               "the sequence metadata reaches attention reordered or in part"),
    "attention.op": Rule(RECORDED), "attention.backend": Rule(RECORDED), "attention.kernel": Rule(RECORDED),
    "path.stages": Rule(SEMANTIC, _m_stages), "path.ops": Rule(RECORDED), "path.flow": Rule(SEMANTIC),
    "norm.eps": Rule(SEMANTIC, _want("rms_norm_eps", "eps")),
    "norm.weight": Rule(SEMANTIC),
    "rope.theta": Rule(SEMANTIC, _want("rope_theta", "theta")),
    "rope.rotary_dim": Rule(SEMANTIC, _want("rotary_dim", "rotary_dim")),
    "rope.style": Rule(SEMANTIC, lambda v, m, ctx: None if v == "rotate_half" else "the mandate is rotate_half"),
    "rope.positions": Rule(SEMANTIC),
    "model.op_args": Rule(SEMANTIC), "model.op_inputs": Rule(SEMANTIC), "model.outputs": Rule(SEMANTIC),
    "graph.input_writes": Rule(SEMANTIC),
    "ops.fallback": Rule(SEMANTIC, lambda v, m, ctx: None if v is False else "a fallback is not strict", True),
    "ops.determinism": Rule(SEMANTIC, _m_spec, True),
    "ops.backend": Rule(RECORDED, None, True),
    "graph.recompiles": Rule(SEMANTIC, lambda v, m, ctx: None if v == 0 else
                             "graphs compiled for later warm-up calls were not analysed"),
    "graph.reruns": Rule(SEMANTIC, lambda v, m, ctx: None if v == 0 else
                         "a compiled graph ran more than once in one call (Dynamo reused it for another frame "
                         "after a graph break: its nodes name the first run's tensors only) or not at all"),
    "graph.outside_calls": Rule(SEMANTIC, lambda v, m, ctx: None if v == {} else
                                "rlk calls ran outside the analysed graphs (torch.compiler.disable, or a frame "
                                "compiled before): their arguments were never seen"),
    "graph.eager_equal": Rule(SEMANTIC, lambda v, m, ctx: None if v is True else
                              "the compiled call's outputs are not bitwise an eager run's of the same call: the "
                              "analysed graph is not what the entry computes run eagerly"),
    "graph.breaks": Rule(RECORDED), "graph.leaks": Rule(RECORDED),
    "runtime.mode": Rule(RECORDED), "runtime.page_size": Rule(RECORDED), "runtime.compiled": Rule(RECORDED),
    "runtime.strict": Rule(RECORDED), "runtime.devices": Rule(RECORDED),
    "env.blocking": Rule(SEMANTIC), "env.recorded": Rule(RECORDED),
}


# ------------------------------------------------------------------------ facts
@dataclass
class Fact:
    value: Any
    rule: str
    source: str


def _shape(desc: str) -> tuple[str, list]:
    dtype, _, dims = desc.partition("[")
    return dtype, [int(d) if d.isdigit() else d for d in dims.rstrip("]").split("x") if d]


def _param(node: dict, arg: str) -> str | None:
    """The module parameter ``node`` takes as ``arg`` (BoundaryReport sources: its dotted path
    under the compiled callable's root), or None if the graph does not show one (older
    side files carry no sources; a weight computed in the graph has none)."""
    src = (node.get("sources") or {}).get(arg)
    return src if src is not None and not src.startswith("input:") else None


_NO_MAPS = "a side file written before session 36 (no element maps in its graph)"


def _edge(node: dict, arg: str, form: str, rows: bool | tuple = True):
    """What ``node`` takes as ``arg``, from its element map (compile/element_maps.py) read as rows of
    ``form`` ("0", "1", "2") or, for a weight, "w": text that does not depend on the batch layout, or
    Unobservable. ``rows``: whether the row order is part of it (the attention paths' tensors hold
    every token in order on both sides; ``("last", b, s)``, for the logits projection: every row, or exactly
    each of b sequences' last of s tokens, picked by a slice or an index the graph fixes
    (``x[arange(b) * s + s - 1]``, vLLM's last-token logits; any rising subset bound before, each
    sequence's first token too: a session 37 audit). A projection's output reads as its input and the
    weight rows behind the columns taken (element_maps.product_label), which a fused and a separate
    weight share."""
    maps = node.get("maps")
    if maps is None:
        return Unobservable(_NO_MAPS)
    m = maps.get(arg)
    if m is None:
        return Unobservable(f"{node['op']} has no element map for {arg!r}")
    if "unresolved" in m:
        return Unobservable(f"{node['op']}.{arg}: the element map was not resolved ({m['unresolved']})")
    if "w" in m:
        return _runs_text(m["w"])
    v = m.get(form)
    if v is None:
        return Unobservable(f"{node['op']}.{arg} has no element map in form {form!r}")
    if "mixed" in v:
        return f"mixed {v['mixed']}"
    if "#unresolved" in v["leaf"]:
        return Unobservable(f"{node['op']}.{arg}: a computing node or projection it takes could not be named (one "
                            "of its arguments' element maps was not resolved)")
    span = v["cols"] if isinstance(v["cols"], str) else _runs_text(v["cols"], rows=True) if labelled(v) else \
        ",".join(f"{a}:{b}" for a, b in v["cols"])
    # a graph input that is no parameter is named by Dynamo after the caller's spelling (l_positions_,
    # l_args_1_ through a functools.partial): compared by the role the describe step gave it, else only
    # as "a graph input"
    leaf = input_name(v["leaf"])
    order = v["rows"]
    if isinstance(rows, tuple):   # ("last", b, s): every row, or each of b sequences' last of s tokens
        order = "every token, or each sequence's last" if order == "in order" or order == \
            f"{rows[1]} of {rows[1] * rows[2]} in order ({last_tokens_digest(rows[1], rows[2])})" else order
    return leaf + f"[{span}]" + (f" rows {order}" if rows else "")


def _runs_text(runs, limit: int = 16, rows: bool = False) -> str:
    """Runs ``[label, start, stop]`` as text (``rows``: of weight rows, a product's columns)."""
    if isinstance(runs, str):
        return f"permuted {runs}"
    parts = [f"{label}[{'rows ' if rows else ''}{a}:{b}]" for label, a, b in runs]
    return " + ".join(parts) if len(parts) <= limit else \
        f"{len(parts)} runs sha256:{hashlib.sha256(repr(runs).encode()).hexdigest()[:16]}"


def _products(node: dict) -> list[list] | None:
    """An rlk::linear call's output columns as runs ``[weight (+ bias), first row, stop]``; None for another
    op, or a weight that is not whole parameter rows."""
    if node["op"] != "rlk::linear" or not node.get("outputs"):
        return None
    n_out = _shape(node["outputs"][0])[1][-1:]
    cols = product_columns(node["maps"], n_out[0]) if n_out and isinstance(n_out[0], int) else None
    return cols if isinstance(cols, list) else None


def _outputs(graph: dict):
    """What the entry hands back (its output structure, then the graph's user outputs in order): for the last
    rlk op's product moved or cast (the logits), its columns, exactly which rows, and any narrowing cast,
    the projection's input left out (``model.linear.inputs`` judges it); for anything else its element
    map's text (a computing node's digest: log-probs made in the graph). A vocabulary reordered after
    ``lm_head`` bound until session 37. UNOBSERVABLE in an entry with graph breaks: what it returns may be
    made in a later graph, or outside any (``torch.compiler.disable``)."""
    maps = graph.get("output_maps")
    if maps is None:
        return Unobservable(graph.get("outputs_note") or "a side file written before session 37 (no output_maps "
                            "in its graph)")
    if graph.get("graph_breaks"):
        return Unobservable(f"the entry has {graph['graph_breaks']} graph break(s): what it returns may be made "
                            "after the graph analysed, in another graph or outside any")
    out = [f"structure {graph['output_structure']}"] if graph.get("output_structure") else []
    for m in maps:   # which rows, exactly: a sampler reads the rows handed back (each sequence's first token
        # instead of its last, or a sequence dropped, bound as "some rows": a session 37 audit)
        text = _edge({"op": "graph output", "maps": {"out": m}}, "out", "1" if "1" in m else "0")
        if isinstance(text, Unobservable):
            return text
        v = m.get("1") or {}
        if labelled(v):   # a product as it is: its columns and rows, and any lossy cast on the way
            leaf = v["leaf"]   # (the label ends at its last parenthesis; a cast's name follows it)
            text = leaf[leaf.rfind(")") + 1:] + text[len(input_name(leaf)):]
        out.append(text)
    return out


def _writes(graph: dict):
    """What the graphs write into their inputs other than an rlk op's output as it is (paged_kv_append's
    cache): none on either side. A rollout that changed its KV cache after the logits (``v_cache.mul_(2)``,
    read by the next step) bound until session 37."""
    maps = graph.get("write_maps")
    if maps is None:
        return Unobservable("a side file written before session 37, or graphs whose outputs are not known (no "
                            "write_maps)")
    out = []
    for m in maps:
        f0 = m.get("0")
        if whole(f0) and f0["leaf"].startswith("rlk:"):
            continue
        text = _edge({"op": "graph input write", "maps": {"in": m}}, "in", "0")
        if isinstance(text, Unobservable):
            return text
        out.append(text)
    return out


def _merged(runs: list[list]) -> list[list]:
    """Runs sorted by weight and row, adjacent ones joined (a row taken twice stays twice)."""
    out = []
    for r in sorted(runs, key=lambda r: (r[0], r[1], r[2])):
        append_run(out, *r)
    return out


_METADATA = ("cu_seqlens_q", "cu_seqlens_k", "page_table", "seq_lens")


def _metadata(node: dict):
    """How an attention call takes its sequence metadata (cu_seqlens; the paged ops' page table and
    lengths): "whole" when each is the front of its leaf (rows in order from the first, columns from the
    first), whatever made the leaf (a graph input, the allocator's tables built in the graph, a wider
    persistent buffer; ``cat([zeros(1), cumsum(lengths)])``: whole leaves one after another). Else their
    element maps: a page table with two sequences' rows swapped, or transposed, by views bound (session 36
    audits). How computing ops made the metadata is not judged: rows swapped by ``flip`` or an index
    still bind."""
    maps = node.get("maps")
    if maps is None:
        return Unobservable(_NO_MAPS)
    odd = {}
    for arg in _METADATA:
        m = maps.get(arg)
        if m is None:
            continue
        if not _prefix(m.get("1", m.get("0"))):
            odd[arg] = _edge(node, arg, "1" if "1" in m else "0")
    bad = next((v for v in odd.values() if isinstance(v, Unobservable)), None)
    return bad or (odd if odd else "whole")


def _prefix(v) -> bool:
    """Rows in order from the first, each from its first column: the leaf, or the front of a wider buffer
    (vLLM's ``block_table[:num_reqs]``, a CUDA-graph buffer)."""
    return isinstance(v, dict) and "leaf" in v and isinstance(v["cols"], list) and len(v["cols"]) == 1 \
        and v["cols"][0][0] == 0 and (v["rows"] == "in order" or v["rows"].startswith("the first "))


def _layer(nodes: list[dict], idx: int) -> int:
    """The attention calls before node ``idx``: element_maps.node_label's layer."""
    return sum(n["op"].split("::")[1] in ATTENTION_OPS for n in nodes[:idx])


def _cache_read(attention: dict, arg: str, out: int, layer: int):
    """How paged attention reads the cache ``paged_kv_append`` wrote: None when it takes the cache as
    written (each slot's row in order, every column), else the element map's text (a rollout that
    handed attention a transposed copy of the cache computed other logits and bound: a session 36 review)."""
    maps = attention.get("maps")
    if maps is None:
        return Unobservable(_NO_MAPS)
    v = (maps.get(arg) or {}).get("2")
    if whole(v, leaf_name("paged_kv_append", out, node_label(layer, None))):   # output ``out`` as written
        return None
    return _edge(attention, arg, "2")


def _chain(nodes: list[dict], start, visited: set, consumer: tuple[dict, str]):
    """Follow a tensor back from attention to its projection. Returns the stages in forward order,
    the norm/rope nodes' arguments (in order), the op names, and the flow: what each stage takes
    from the one before, as element maps (``_edge``), in forward order: at the projection its input,
    the rows of its weight, its bias and its output's rows. ``consumer``: the attention node and its
    argument."""
    stages, args, ops, flow = [], [], [], []
    cur = start
    while cur is not None:
        idx, out = cur
        visited.add(idx)
        node = nodes[idx]
        name = node["op"].split("::")[1]
        ops.append(node["op"])
        if name == "paged_kv_append":  # output 1/2 is the k/v cache the tensor was written into
            arg = {1: "k", 2: "v"}.get(out, "")
            read = _cache_read(consumer[0], consumer[1], out, _layer(nodes, idx))
            if read is not None:
                flow.append(read if isinstance(read, Unobservable) else f"cache read: {read}")
            cur, consumer = node["producers"].get(arg), (node, arg)
            continue
        if name == "linear":   # the product's leaf names its input and the weight rows behind the columns taken
            outp = _edge(*consumer, "2")   # (compile/element_maps.product_label): a fused cat([Wq, Wk, Wv]) split
            flow.append(outp if isinstance(outp, Unobservable) else f"projection: {outp}")   # after the product
            stages.append("linear")                                          # and three linears name the same rows
            break
        flow.append(_edge(*consumer, "2"))
        if name == "rope":
            stages.append("rope")
            args.append({"rope": node["args"], "positions": _edge(node, "positions", "0")})
        elif name == "qk_rmsnorm":
            stages.append("rmsnorm")
            args.append({"rmsnorm": node["args"], "weight": _param(node, "weight")})
        elif name == "qk_norm_rope":  # fused: bitwise the two ops in sequence (its spec)
            stages += ["rope", "rmsnorm"]
            a = node["args"]
            args += [{"rope": {"theta": a["theta"], "rotary_dim": a["rotary_dim"]},
                      "positions": _edge(node, "positions", "0")},
                     {"rmsnorm": {"eps": a["eps"]}, "weight": _param(node, "q_weight" if out == 0 else "k_weight")}]
            # inside the op rope takes the norm's rows in order, every column: the edge the two ops in
            # sequence show (else a fused side never bound a split one)
            _, shape = _shape(node["inputs"][out]) if len(node["inputs"]) > out else ("", [])
            feat = shape[-1] * shape[-2] if len(shape) >= 2 and all(isinstance(d, int) for d in shape[-2:]) \
                else "?"
            w = (node.get("sources") or {}).get("q_weight" if out == 0 else "k_weight")
            flow.append(leaf_name("qk_rmsnorm", 0, node_label(_layer(nodes, idx), w))   # the split norm's name
                        + f"[0:{feat}] rows in order")
            arg = "q" if out == 0 else "k"
            cur, consumer = node["producers"].get(arg), (node, arg)
            continue
        else:
            stages.append(name)
            break
        cur, consumer = node["producers"].get("x"), (node, "x")
    if cur is None:
        stages.append("graph input")
        flow.append(_edge(consumer[0], consumer[1], "2"))
    return stages[::-1], args[::-1], ops[::-1], flow[::-1]


def _entry_facts(entry: dict, plans: list[dict]) -> dict[str, Fact]:
    facts: dict[str, Fact] = {}

    def put(name, rule, value, source):
        facts[name] = Fact(value, rule, source)

    graph = entry.get("graph")
    records = entry.get("provenance") or []
    if graph is None:
        put("attention.layers", "attention.layers",
            Unobservable("no compiled graph: this entry point was configured, never executed"), "side description")
        return facts
    fwd = graph["forward"]
    g = "FX forward graph"
    put("graph.recompiles", "graph.recompiles", graph["recompiles"], "BoundaryReport.recompiles")
    put("graph.breaks", "graph.breaks", graph["graph_breaks"], "BoundaryReport.graph_breaks")
    put("graph.leaks", "graph.leaks", len(graph["leaks"]), "BoundaryReport.leaks")
    older = "a side file written before session 32 (no {} in its graph)"
    runs = graph.get("graph_runs")
    put("graph.reruns", "graph.reruns", Unobservable(older.format("graph_runs")) if runs is None else
        sum(abs(r - 1) for k in ("forward", "backward") for r in runs[k]), "BoundaryReport.graph_runs")
    put("graph.outside_calls", "graph.outside_calls", Unobservable(older.format("outside_calls"))
        if graph.get("outside_calls") is None else graph["outside_calls"], "BoundaryReport.outside_calls")
    eager = graph.get("eager_equal")
    put("graph.eager_equal", "graph.eager_equal", eager if eager is not None else Unobservable(
        older.format("eager_equal") if "eager_equal" not in graph else "the compiled call was not compared with "
        f"an eager run: {graph.get('eager_note') or 'inspect_boundary without eager='}"),
        "BoundaryReport.eager_equal" + (f" ({graph['eager_note']})" if graph.get("eager_note") else ""))
    put("runtime.devices", "runtime.devices", sorted({r["device"] for r in records}), "provenance")
    by_op: dict[str, list[dict]] = {}
    for r in records:
        by_op.setdefault(r["op"], []).append(r)
    attn = [n for n in fwd if n["op"].split("::")[1] in ATTENTION_OPS]
    put("attention.layers", "attention.layers", len(attn), g)
    visited: set[int] = set()
    modes, pages = [], []
    for i, n in enumerate(attn):
        L = f"layer[{i}]"
        op = n["op"].split("::")[1]
        src = f"{g}: node #{n['index']} {n['op']}"
        visited.add(n["index"])
        q_dtype, q = _shape(n["inputs"][0])
        _, k = _shape(n["inputs"][1])
        a = n["args"]
        put(f"{L}.attention.op", "attention.op", n["op"], src)
        put(f"{L}.attention.num_heads", "attention.num_heads", q[-2], src + " q shape")
        put(f"{L}.attention.num_kv_heads", "attention.num_kv_heads", k[-2], src + " k shape")
        put(f"{L}.attention.head_dim", "attention.head_dim", q[-1], src + " q shape")
        put(f"{L}.attention.dtype", "attention.dtype", q_dtype, src + " q dtype")
        put(f"{L}.attention.causal", "attention.causal", bool(a["causal"]) if "causal" in a else True,
            src + (" args" if "causal" in a else " (causal by the op's definition)"))
        put(f"{L}.attention.softmax_scale", "attention.softmax_scale", _as_run(a.get("softmax_scale"), q_dtype),
            src + " args" + ("" if q_dtype == "float64" else " (as float32: every backend scales in float32)"))
        policy = a.get("split_kv") or ("auto" if op == "paged_attention_auto" else None)
        put(f"{L}.attention.split_kv", "attention.split_kv",
            policy if policy is not None else Unobservable(f"{n['op']} passes no split_kv"),
            src + (" args" if "split_kv" in a else " (the auto lane by definition)"))
        put(f"{L}.attention.lse_dtype", "attention.lse_dtype", _shape(n["outputs"][1])[0], src + " lse output")
        if op == "attention_fwd":  # inputs lists only the tensors passed: cu_seqlens follow q, k, v
            modes.append("prefill (packed varlen)" if len(n["inputs"]) > 3 else "prefill (dense)")
        else:
            modes.append("decode" if q[1] == 1 else ("chunked prefill" if isinstance(q[1], int) else "symbolic"))
            pages.append(k[1])
        _backend_facts(put, L, op, n, by_op.get(op), plans, policy, q_dtype)
        put(f"{L}.attention.metadata", "attention.metadata", _metadata(n),
            f"{g}: element maps of {n['op']}'s sequence metadata")
        q_src = n["producers"].get("q")
        k_src = n["producers"].get("k" if op == "attention_fwd" else "k_cache")
        v_src = n["producers"].get("v" if op == "attention_fwd" else "v_cache")
        paged = op != "attention_fwd"
        for name, start in (("q", q_src), ("k", k_src), ("v", v_src)):
            stages, args, ops, flow = _chain(fwd, start, visited,
                                             (n, f"{name}_cache" if paged and name != "q" else name))
            # a path that starts at a graph input in a graph with breaks: what made that input ran in another
            # graph, not followed here; its stages are not "absent" but unseen (session 32 audit)
            cut = Unobservable(f"the {name} path starts at a graph input and the entry has graph breaks: the "
                               f"stages before the break ran in another graph") \
                if stages[0] == "graph input" and graph["graph_breaks"] else None
            put(f"{L}.{name}.stages", "path.stages", cut or ">".join(stages), f"{g}: producers of {n['op']}.{name}")
            put(f"{L}.{name}.ops", "path.ops", " > ".join(ops), f"{g}: producers")
            gone = next((x for x in flow if isinstance(x, Unobservable)), None)
            put(f"{L}.{name}.flow", "path.flow", cut or gone or flow,
                f"{g}: element maps along the {name} path (compile/element_maps.py)")
            if name == "v":
                continue
            norms = [x["rmsnorm"] for x in args if "rmsnorm" in x]
            ropes = [x["rope"] for x in args if "rope" in x]
            absent = cut or f"absent (no RMSNorm on the {name} path)"
            put(f"{L}.{name}_norm.eps", "norm.eps", _one([x["eps"] for x in norms], absent), f"{g}: rmsnorm args")
            weights = [x["weight"] for x in args if "rmsnorm" in x]
            put(f"{L}.{name}_norm.weight", "norm.weight",
                Unobservable(f"the graph shows no module parameter as the {name} norm's weight (a weight "
                             "computed or sliced in the graph, graph inputs not matched to the model, or a "
                             "side file without sources)")
                if None in weights else _one(weights, absent), f"{g}: rmsnorm weight source (module path)")
            absent = cut or f"absent (no RoPE on the {name} path)"
            put(f"{L}.{name}_rope.theta", "rope.theta", _one([x["theta"] for x in ropes], absent), f"{g}: rope args")
            put(f"{L}.{name}_rope.rotary_dim", "rope.rotary_dim", _one([x["rotary_dim"] for x in ropes], absent),
                f"{g}: rope args")
            pos = [x["positions"] for x in args if "rope" in x]
            put(f"{L}.{name}_rope.positions", "rope.positions",
                next((p for p in pos if isinstance(p, Unobservable)), None) or _one(pos, absent),
                f"{g}: element map of rope's positions")
            put(f"{L}.{name}_rope.style", "rope.style", "rotate_half" if ropes else absent,
                "op definition: rlk::rope and rlk::qk_norm_rope rotate half (NeoX/Qwen3)")
    put("runtime.mode", "runtime.mode", _one(sorted(set(modes)), None), g + " attention op and q shape")
    put("runtime.page_size", "runtime.page_size", _one(sorted(set(pages), key=str), None), g + " k_cache shape")
    rest: dict[str, list] = {}
    inputs: dict[str, list] = {}
    groups: dict[str, list] = {}   # a linear's input -> the weight rows of every linear taking it
    tokens = next(((d[0], d[1]) for d in (_shape(n["inputs"][0])[1] for n in attn)   # (sequences, tokens each)
                   if len(d) == 4 and all(isinstance(x, int) for x in d[:2])), (0, 0))   # of a [B, S, H, D] q
    last = fwd[-1]["index"] if fwd else None   # the logits projection of a decoder's forward (and linears with
    shards = {n["index"] for n in fwd if n["op"] == fwd[-1]["op"] == "rlk::linear"   # its input: vocab-parallel)
              and (n.get("maps") or {}).get("x") == (fwd[-1].get("maps") or {}).get("x")} if fwd else set()
    norms = [n["index"] for n in fwd if n["op"] == "rlk::qk_rmsnorm" and n["index"] not in visited]
    if shards and norms:   # the final norm (the last one off the attention paths) may norm only the rows the
        shards.add(norms[-1])   # logits projection takes: it is row-wise (a session 37 audit)
    for n in fwd:  # the model's other rlk ops with scalars (layer norms): their scalars and the parameters
        # they take must agree too, call by call in graph order (a set of distinct values let one side move
        # an eps to another layer, or drop a call whose values another call also had)
        params = {a: _param(n, a) for a in (n.get("sources") or {}) if _param(n, a) is not None}
        if n["index"] in visited:
            continue
        if n["args"]:
            rest.setdefault(n["op"], []).append(json.dumps({**n["args"], **({"params": params} if params else {})},
                                                           sort_keys=True))
        # and which elements of what each tensor argument holds (o_proj's weight, the MLP's fused gate_up
        # cat): linears have no scalars, and before session 36 o_proj.weight.t() bound
        if n.get("maps") is None:
            inputs.setdefault(n["op"], []).append(Unobservable(_NO_MAPS))
            continue
        seen = {}
        for a, m in sorted(n["maps"].items()):
            form = next((f for f in ("1", "0") if f in m), "w")
            # rows in order, as on the paths (o_proj or the MLP reading other tokens' rows bound: a session 36
            # audit); the graph's last rlk op (the logits) and its vocabulary shards: every row, or exactly
            # each sequence's last (vLLM projects only those)
            seen[a] = _edge(n, a, form, rows=("last", *tokens) if n["index"] == last or n["index"] in shards
                            else True)
        bad = next((v for v in seen.values() if isinstance(v, Unobservable)), None)
        products = _products(n) if bad is None and "x" in seen else None
        if products is not None:   # a linear as the weight rows it multiplies its input by, merged over every
            if seen["x"] not in groups:   # linear with that input (session 37): a fused gate_up, gate and up
                inputs.setdefault(n["op"], []).append(seen["x"])   # in either order, shards, o_proj in halves
            groups.setdefault(seen["x"], []).extend(products)
            continue
        inputs.setdefault(n["op"], []).append(bad or json.dumps(seen, sort_keys=True))
    for x, runs in groups.items():
        at = inputs["rlk::linear"].index(x)
        inputs["rlk::linear"][at] = json.dumps({"x": x, "columns": _runs_text(_merged(runs), rows=True)},
                                               sort_keys=True)
    put("model.outputs", "model.outputs", _outputs(graph), f"{g}: element maps of the graph's user outputs")
    put("graph.input_writes", "graph.input_writes", _writes(graph), f"{g}: element maps of what the graphs write "
        "into their inputs")
    for op, args in rest.items():
        put(f"model.{op.split('::')[1]}.args", "model.op_args", args,
            f"{g}: {op} nodes outside the attention paths, in graph order")
    for op, maps in inputs.items():
        bad = next((v for v in maps if isinstance(v, Unobservable)), None)
        put(f"model.{op.split('::')[1]}.inputs", "model.op_inputs", bad or maps,
            f"{g}: element maps of the tensor arguments of {op} nodes outside the attention paths, in graph order")
    _op_facts(put, graph, by_op)
    return facts


def _one(values: list, absent):
    if not values:
        return absent
    return values[0] if all(v == values[0] for v in values) else values


def _backend_facts(put, L, op, node, recs, plans, policy, dtype):
    src = "provenance of the executed calls"
    if not recs:
        why = Unobservable(f"{node['op']} is in the graph but no call was recorded: compiled, never executed")
        for f in ("backend", "kernel", "fallback", "accumulation", "p_rounding", "lse_domain", "reduction_order",
                  "split_plan"):
            put(f"{L}.attention.{f}", f"attention.{f}", why, src)
        return
    put(f"{L}.attention.backend", "attention.backend",
        _one(sorted({f"{r['requested_backend']}->{r['actual_backend']}" for r in recs}), None), src)
    # what computed it inside the backend (provenance.note_kernel; older records: the backend's own)
    put(f"{L}.attention.kernel", "attention.kernel",
        _one(sorted({r.get("kernel") or r["actual_backend"] for r in recs}), None), src)
    falls = [f"requested {r['requested_backend']}, ran {r['actual_backend']}: {r['fallback_reason']}"
             for r in recs if r["fallback"]]
    put(f"{L}.attention.fallback", "attention.fallback", _one(falls, False), src)
    actual = sorted({r["actual_backend"] for r in recs})
    for f in ("accumulation", "p_rounding", "lse_domain", "reduction_order"):
        vals = []
        for b in actual:
            num = ATTENTION_NUMERICS.get(b)
            if num is None:
                vals = Unobservable(f"no numerics record for backend {b!r} (binding.ATTENTION_NUMERICS)")
                break
            vals.append("fp64" if f == "accumulation" and b == "cpu" and dtype == "float64" else num[f])
        put(f"{L}.attention.{f}", f"attention.{f}",
            vals if isinstance(vals, Unobservable) else _one(vals, None), f"backend numerics of {actual} ({src})")
    put(f"{L}.attention.split_plan", "attention.split_plan", _plan(op, actual, policy, plans),
        "plan records of the backend, else its construction")


def _plan(op: str, backends: list[str], policy, plans: list[dict]):
    recorded = sorted({p["plan"] for p in plans if p.get("op") == op})
    if recorded:
        return _one(recorded, None)
    try:
        p = SplitKVPolicy.parse(policy)
    except (ValueError, TypeError):
        return Unobservable(f"split_kv {policy!r} is not a policy")
    out = []
    for b in backends:
        make = _PLAN_BY_CONSTRUCTION.get((b, p.kind))
        if make is None:
            return Unobservable(f"backend {b!r} recorded no split plan for {p} and has none by construction")
        out.append(make(p))
    return _one(sorted(set(out)), None)


def _op_facts(put, graph: dict, by_op: dict[str, list[dict]]) -> None:
    in_graph = {n["op"].split("::")[1] for n in graph["forward"] + graph["backward"]}
    for op in sorted(in_graph | set(by_op)):
        recs = by_op.get(op)
        src = "provenance + meta/specs.py REGISTRY"
        if not recs:
            why = Unobservable(f"rlk::{op} is in the compiled graph but no call was recorded: compiled, never executed")
            put(f"ops.{op}.determinism", "ops.determinism", why, src)
            continue
        put(f"ops.{op}.backend", "ops.backend",
            _one(sorted({f"{r['requested_backend']}->{r['actual_backend']}" for r in recs}), None), "provenance")
        falls = [f"requested {r['requested_backend']}, ran {r['actual_backend']}: {r['fallback_reason']}"
                 for r in recs if r["fallback"]]
        put(f"ops.{op}.fallback", "ops.fallback", _one(falls, False), "provenance")
        specs = []
        for b in sorted({r["actual_backend"] for r in recs}):
            spec = REGISTRY.get(op)
            det = spec.backends.get(b) if spec else None
            if det is None:
                specs = Unobservable(f"no determinism spec for rlk::{op} on backend {b!r} (meta/specs.py)")
                break
            d = det.as_dict()
            d.pop("notes")
            d["backend"] = b
            d["nondeterministic_bitwise"] = not spec.deterministic
            specs.append(d)
        put(f"ops.{op}.determinism", "ops.determinism", specs if isinstance(specs, Unobservable) else
            _one(specs, None), src)


def _merge_entries(per_entry: list[tuple[str, dict[str, Fact]]]) -> dict[str, Fact]:
    """One side's facts over its entry points (e.g. rollout prefill and decode): a
    value all entries agree on, else a per-entry dict (which cannot equal the other
    side's single value, so a side that disagrees with itself fails)."""
    names = list(dict.fromkeys(n for _, f in per_entry for n in f))
    merged = {}
    for name in names:
        present = [(e, f[name]) for e, f in per_entry if name in f]
        first = present[0][1]
        vals = [_jsonable(f.value) for _, f in present]
        rule = RULES[first.rule]
        unseen = next((f.value for _, f in present if isinstance(f.value, Unobservable)), None)
        if unseen is not None and rule.tier != RECORDED:   # unseen in one entry: unseen for the side
            value = unseen
        elif rule.tier == RECORDED:
            value = _one(list(dict.fromkeys(json.dumps(v, sort_keys=True) for v in vals)), None)
            value = json.loads(value) if isinstance(value, str) else [json.loads(v) for v in value]
        elif all(v == vals[0] for v in vals) and (len(present) == len(per_entry) or rule.one_sided):
            # a one-sided field (an op) that only some entry points run, e.g. the K/V gather of
            # canonical:C chunked prefill that decode does not need, is judged where it runs
            value = first.value
        else:
            value = {e: _jsonable(f[name].value) if name in f else "missing" for e, f in per_entry}
        merged[name] = Fact(value, first.rule, first.source)
    return merged


def side_facts(side: dict) -> dict[str, Fact]:
    """Every named field of one side, derived from its evidence."""
    entries = side.get("entries") or []
    facts = _merge_entries([(e.get("name", str(i)), _entry_facts(e, side.get("plans") or []))
                            for i, e in enumerate(entries)]) if entries else {
        "attention.layers": Fact(Unobservable("the side has no executed entry point"), "attention.layers",
                                 "side description")}
    model = side.get("model") or {}
    facts["model.id"] = Fact(model.get("id") or Unobservable("no model id and no weight hash"), "model.id",
                             f"side description: {model.get('kind', 'missing')}")
    topo = side.get("topology") or {}
    tp, cp = topo.get("tp", 1), topo.get("cp", 1)
    src = "side description: topology (explicit input)"
    facts["topology.tp"] = Fact(tp, "topology.tp", src)
    facts["topology.cp"] = Fact(cp, "topology.cp", src)
    heads = facts.get("layer[0].attention.num_heads")
    kv = facts.get("layer[0].attention.num_kv_heads")
    own = topo.get("head_ownership")
    if own is None and tp == 1 and heads and kv and isinstance(heads.value, int) and isinstance(kv.value, int):
        own, src_h = {"q": [0, heads.value], "kv": [0, kv.value]}, "tp == 1: every head of the graph"
    else:
        src_h = src
    facts["topology.head_ownership"] = Fact(own if own is not None else Unobservable(
        f"tp={tp} but the side does not state which heads it owns"), "topology.head_ownership", src_h)
    seq = topo.get("sequence_ownership") or ("whole" if cp == 1 else None)
    facts["topology.sequence_ownership"] = Fact(seq if seq is not None else Unobservable(
        f"cp={cp} but the side does not state which tokens it owns"), "topology.sequence_ownership", src)
    runtime = side.get("runtime") or {}
    facts["runtime.compiled"] = Fact(runtime.get("compiled"), "runtime.compiled", "side description")
    facts["runtime.strict"] = Fact(runtime.get("strict"), "runtime.strict", "side description")
    return facts


def _records(side: dict) -> list[dict]:
    return [r for e in side.get("entries") or [] for r in e.get("provenance") or []]


# --------------------------------------------------------------------- compare
@dataclass
class FieldResult:
    field: str
    tier: str
    train: Any
    rollout: Any
    status: str  # ok | recorded | differs | violates | unobservable
    detail: str
    source: str

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "recorded")

    def message(self) -> str:
        return (f"[{self.tier}] {self.field}: train={_show(self.train)} rollout={_show(self.rollout)}: "
                f"{self.status}{' - ' + self.detail if self.detail else ''}")


@dataclass
class BindingResult:
    comparable: bool
    passed: bool
    fields: list[FieldResult] = field(default_factory=list)

    @property
    def failures(self) -> list[FieldResult]:
        return [f for f in self.fields if not f.ok]

    def failure(self, name: str) -> FieldResult | None:
        return next((f for f in self.failures if f.field == name), None)

    def to_json(self) -> dict:
        tiers = {t: sum(f.tier == t for f in self.fields) for t in (IDENTICAL, SEMANTIC, RECORDED)}
        return {
            "comparable": self.comparable, "passed": self.passed, "verdict": self.verdict(), "fields_by_tier": tiers,
            "failures": [self._row(f) for f in self.failures],
            "recorded_differences": [self._row(f) for f in self.fields
                                     if f.tier == RECORDED and _jsonable(f.train) != _jsonable(f.rollout)],
            "fields": [self._row(f) for f in self.fields],
        }

    @staticmethod
    def _row(f: FieldResult) -> dict:
        return {"field": f.field, "tier": f.tier, "train": _jsonable(f.train), "rollout": _jsonable(f.rollout),
                "status": f.status, "detail": f.detail, "source": f.source}

    def verdict(self) -> str:
        if self.passed:
            return "PASS (comparable, every IDENTICAL and SEMANTIC field holds)"
        if not self.comparable:
            return f"NOT COMPARABLE ({len(self.failures)} failing fields)"
        return f"FAIL ({len(self.failures)} failing fields)"

    def summary(self, limit: int = 20) -> str:
        d = self.to_json()
        lines = [f"binding: {self.verdict()}; fields: " +
                 ", ".join(f"{n} {t}" for t, n in d["fields_by_tier"].items())]
        lines += ["  " + f.message() for f in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"  ... and {len(self.failures) - limit} more")
        for r in d["recorded_differences"]:
            if "not run on this side" in (r["train"], r["rollout"]):
                continue  # an op only one side runs (attention_fwd / paged_attention): expected
            lines.append(f"  recorded: {r['field']}: train={_show(r['train'])} rollout={_show(r['rollout'])}")
        return "\n".join(lines)


def _jsonable(v):
    if isinstance(v, Unobservable):
        return v.as_json()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _show(v) -> str:
    if isinstance(v, Unobservable):
        return f"UNOBSERVABLE({v.reason})"
    return json.dumps(_jsonable(v), sort_keys=True) if not isinstance(v, str) else repr(v)


def _heads_check(facts: dict[str, Fact]):
    def check(own):
        heads = facts.get("layer[0].attention.num_heads")
        kv = facts.get("layer[0].attention.num_kv_heads")
        try:
            nq, nkv = own["q"][1] - own["q"][0], own["kv"][1] - own["kv"][0]
        except (KeyError, TypeError, IndexError):
            return f"head_ownership must be {{'q': [start, stop], 'kv': [start, stop]}}, got {own!r}"
        if heads and kv and (heads.value, kv.value) != (nq, nkv):
            return f"owns {nq} q / {nkv} kv heads but the graph runs {heads.value} / {kv.value}"
        return None
    return check


def _judge(name: str, rule: Rule, a: Fact | None, b: Fact | None, mandate: Mandate, ctxs) -> FieldResult:
    missing = "not run on this side" if rule.one_sided else Unobservable("no such field on this side")
    va = a.value if a else missing
    vb = b.value if b else missing
    source = (a or b).source
    if rule.tier == RECORDED:
        return FieldResult(name, rule.tier, va, vb, "recorded", "", source)
    if rule.one_sided and (a is None or b is None):
        present = [(s, f.value, c) for s, f, c in (("train", a, ctxs[0]), ("rollout", b, ctxs[1])) if f]
    else:
        present = [("train", va, ctxs[0]), ("rollout", vb, ctxs[1])]
    unobs = [f"{s}: {v.reason}" for s, v, _ in present if isinstance(v, Unobservable)]
    if unobs:
        return FieldResult(name, rule.tier, va, vb, "unobservable", "; ".join(unobs), source)
    problems = []
    for s, v, ctx in present:
        why = rule.mandate(v, mandate, {**ctx, "name": name}) if rule.mandate else None
        if why:
            problems.append(f"{s} violates the mandate: {why}")
    if len(present) == 2 and _jsonable(va) != _jsonable(vb):
        return FieldResult(name, rule.tier, va, vb, "differs", "; ".join(problems), source)
    if problems:
        return FieldResult(name, rule.tier, va, vb, "violates", "; ".join(problems), source)
    return FieldResult(name, rule.tier, va, vb, "ok", "", source)


def _env_results(train: dict, rollout: dict) -> list[FieldResult]:
    paths = []
    for side in (train, rollout):
        topo = side.get("topology") or {}
        paths.append(path_of(_records(side), topo.get("tp", 1), topo.get("cp", 1)))
    env_a, env_b = train.get("environment"), rollout.get("environment")
    # every key the probe writes, present or not: a blocking key dropped from both files was never judged
    # and bound (a session 35 audit); missing on a side, it is unobservable there
    keys = list(dict.fromkeys([*probe_keys(), *(env_a or {}), *(env_b or {})]))
    out = []
    for key in keys:
        why = blocking(key, paths[0]) or blocking(key, paths[1])
        rule = RULES["env.blocking" if why else "env.recorded"]
        fa = Fact(env_a[key], "", "") if env_a and key in env_a else \
            Fact(Unobservable("not in the side's environment probe"), "", "")
        fb = Fact(env_b[key], "", "") if env_b and key in env_b else \
            Fact(Unobservable("not in the side's environment probe"), "", "")
        res = _judge(f"env.{key}", rule, fa, fb, Mandate(), ({}, {}))
        res.source = "environment probe (meta/probe.py)"
        if why and not res.ok:
            res.detail = (res.detail + "; " if res.detail else "") + f"blocking: {why}"
        out.append(res)
    return out


class SideFormatError(ValueError):
    """A side description that is not shaped as ``probe.describe_side`` writes it."""


_SIDE_DICTS = ("model", "topology", "runtime", "environment")
_NODE_KEYS = ("op", "index", "inputs", "outputs", "producers", "args")
_RECORD_KEYS = ("op", "device", "requested_backend", "actual_backend", "fallback", "fallback_reason")


_TENSOR_DESC = re.compile(r"[A-Za-z0-9_]+\[[^\[\]]*\]")           # "bfloat16[2x1x4x16]" (dims may be symbols)
# the scalar arguments binding reads, per op (a missing one was a KeyError inside bind)
_NEEDED_ARGS = {"rope": ("theta", "rotary_dim"), "qk_rmsnorm": ("eps",), "qk_norm_rope": ("eps", "theta", "rotary_dim")}
_SCALAR = (int, float, str, type(None))


def check_side(side, where: str) -> None:
    """The structure ``bind`` reads, checked before it reads it: a malformed file once
    raised a bare KeyError ('forward', 'device', 'args'), IndexError, TypeError or AttributeError
    from inside the binding, or looped forever on a producer cycle. Raises ``SideFormatError``
    naming ``where`` and the path of the first problem."""
    def bad(path, want, got):
        raise SideFormatError(f"{where}: {path} must be {want}, got {type(got).__name__} {repr(got)[:80]}")

    def string(path, value, optional=False):
        if not (isinstance(value, str) or (optional and value is None)):
            bad(path, "a string or null" if optional else "a string", value)

    if not isinstance(side, dict):
        bad("the side description", "a JSON object", side)
    for key in _SIDE_DICTS:
        if side.get(key) is not None and not isinstance(side[key], dict):
            bad(key, "an object", side[key])
    topo = side.get("topology") or {}
    for key in ("tp", "cp"):
        if key in topo and not (isinstance(topo[key], int) and not isinstance(topo[key], bool) and topo[key] >= 1):
            bad(f"topology.{key}", "an int >= 1", topo[key])
    if side.get("plans") is not None and not isinstance(side["plans"], list):
        bad("plans", "a list", side["plans"])
    for i, p in enumerate(side.get("plans") or []):
        if not isinstance(p, dict) or "plan" not in p:
            bad(f"plans[{i}]", "an object with plan", p)
        string(f"plans[{i}].plan", p["plan"])
        string(f"plans[{i}].op", p.get("op"), optional=True)
    entries = side.get("entries")
    if not isinstance(entries, list):
        bad("entries", "a list", entries)
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            bad(f"entries[{i}]", "an object", e)
        string(f"entries[{i}].name", e.get("name"), optional=True)
        records = e.get("provenance")
        if records is not None and not isinstance(records, list):
            bad(f"entries[{i}].provenance", "a list", records)
        for j, r in enumerate(records or []):
            if not isinstance(r, dict) or any(k not in r for k in _RECORD_KEYS):
                bad(f"entries[{i}].provenance[{j}]", f"an object with {', '.join(_RECORD_KEYS)}", r)
            for k in ("op", "device", "requested_backend", "actual_backend"):
                string(f"entries[{i}].provenance[{j}].{k}", r[k])
            if not isinstance(r["fallback"], bool):
                bad(f"entries[{i}].provenance[{j}].fallback", "a bool", r["fallback"])
            string(f"entries[{i}].provenance[{j}].fallback_reason", r["fallback_reason"], optional=True)
            string(f"entries[{i}].provenance[{j}].kernel", r.get("kernel"), optional=True)  # since session 31
        graph = e.get("graph")
        if graph is None:
            continue
        if not isinstance(graph, dict):
            bad(f"entries[{i}].graph", "an object or null", graph)
        for key in ("recompiles", "graph_breaks"):
            v = graph.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(f"entries[{i}].graph.{key}", "an int >= 0", v)
        for key in ("forward", "backward", "leaks"):
            if not isinstance(graph.get(key), list):
                bad(f"entries[{i}].graph.{key}", "a list", graph.get(key))
        runs = graph.get("graph_runs")   # these three: written since session 32 (absent: unobservable)
        if runs is not None and not (isinstance(runs, dict) and all(
                isinstance(runs.get(k), list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                      for r in runs[k])
                for k in ("forward", "backward"))):
            bad(f"entries[{i}].graph.graph_runs", "an object of forward and backward run counts (ints >= 0)", runs)
        if runs is not None and isinstance(graph.get("graphs"), int) and len(runs["forward"]) < graph["graphs"]:
            # an empty list summed to 0 reruns and bound (a session 35 audit); more counts than graphs (a
            # compile Dynamo restarted) are judged by graph.reruns: a count of 0 fails it
            bad(f"entries[{i}].graph.graph_runs.forward", f"a run count for each of the {graph['graphs']} compiled "
                "graphs", runs["forward"])
        outside = graph.get("outside_calls")
        if outside is not None and not (isinstance(outside, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in outside.items())):
            bad(f"entries[{i}].graph.outside_calls", "an object of op name -> call count (> 0)", outside)
        if not isinstance(graph.get("eager_equal"), (bool, type(None))):
            bad(f"entries[{i}].graph.eager_equal", "a bool or null", graph.get("eager_equal"))
        string(f"entries[{i}].graph.eager_note", graph.get("eager_note"), optional=True)
        string(f"entries[{i}].graph.outputs_note", graph.get("outputs_note"), optional=True)
        string(f"entries[{i}].graph.output_structure", graph.get("output_structure"), optional=True)
        for key in ("output_maps", "write_maps"):   # since session 37 (absent: unobservable)
            if graph.get(key) is not None and not isinstance(graph[key], list):
                bad(f"entries[{i}].graph.{key}", "a list of element maps", graph[key])
            for j, m in enumerate(graph.get(key) or []):
                _check_map(bad, f"entries[{i}].graph.{key}[{j}]", m)
        for key in ("forward", "backward"):
            for j, n in enumerate(graph[key]):
                _check_node(bad, f"entries[{i}].graph.{key}[{j}]", j, n)


def _check_node(bad, where_: str, j: int, n) -> None:
    if not isinstance(n, dict) or any(k not in n for k in _NODE_KEYS) or not isinstance(n["op"], str) \
            or "::" not in n["op"] or not isinstance(n["args"], dict) or not isinstance(n["index"], int) \
            or not isinstance(n["producers"], dict) or any(
                not isinstance(n[k], list) or not all(isinstance(t, str) for t in n[k]) for k in ("inputs", "outputs")):
        bad(where_, "a node object with op 'ns::name', index (an int), inputs and outputs (lists of "
            "tensor descriptions), producers and args (objects)", n)
    if n["index"] != j:   # binding reads nodes by position and marks them visited by index
        bad(f"{where_}.index", f"its position in the list ({j})", n["index"])
    for k, v in n["args"].items():
        if not isinstance(v, _SCALAR) and not (isinstance(v, list) and all(isinstance(x, _SCALAR) for x in v)):
            bad(f"{where_}.args.{k}", "a number, string, null or a list of them", v)
        # NaN == NaN compared equal inside lists (one shared NaN object), so a NaN eps or theta on both
        # sides bound (a session 35 audit); no op records a non-finite scalar
        if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, list) else [v])):
            bad(f"{where_}.args.{k}", "finite (no op records NaN or an infinity)", v)
    name = n["op"].split("::")[1]
    if name in ATTENTION_OPS:   # read: inputs[0..1], outputs[1]
        if len(n["inputs"]) < 2 or len(n["outputs"]) < 2:
            bad(f"{where_} ({n['op']})", "an attention node with q, k inputs and out, lse outputs",
                {"inputs": n["inputs"], "outputs": n["outputs"]})
        for k, desc in (("inputs[0]", n["inputs"][0]), ("inputs[1]", n["inputs"][1]), ("outputs[1]", n["outputs"][1])):
            if not _TENSOR_DESC.fullmatch(desc) or (k != "outputs[1]" and len(_shape(desc)[1]) < 2):
                bad(f"{where_}.{k}", "a tensor description 'dtype[d0x...]' (q and k with 2 dims or more)", desc)
        if name in ("attention_fwd", "attention_bwd") and "causal" not in n["args"]:
            # their schemas always record it: absent, it meant causal silently (the paged ops are causal
            # by definition and take no such argument)
            bad(f"{where_}.args", f"an object with causal ({n['op']})", n["args"])
        causal = n["args"].get("causal", True)
        if not (isinstance(causal, bool) or causal in (0, 1)):   # bool("0") is True
            bad(f"{where_}.args.causal", "a bool or 0 / 1", causal)
    if name == "linear" and len(n["inputs"]) > 1 and not (
            _TENSOR_DESC.fullmatch(n["inputs"][1]) and len(_shape(n["inputs"][1])[1]) >= 1):
        # a weight with no dims has no rows to name
        bad(f"{where_}.inputs[1]", "a tensor description 'dtype[d0x...]' of the weight (1 dim or more)",
            n["inputs"][1])
    for arg in _NEEDED_ARGS.get(name, ()):
        if arg not in n["args"]:
            bad(f"{where_}.args", f"an object with {', '.join(_NEEDED_ARGS[name])} ({n['op']})", n["args"])
    sources = n.get("sources")
    if sources is not None and not (isinstance(sources, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in sources.items())):
        bad(f"{where_}.sources", "an object of tensor argument -> source name (strings)", sources)
    maps = n.get("maps")   # since session 36 (absent: the flow fields are unobservable)
    if maps is not None:
        if not isinstance(maps, dict) or not all(isinstance(k, str) for k in maps):
            bad(f"{where_}.maps", "an object of tensor argument -> element map", maps)
        for arg, m in maps.items():
            _check_map(bad, f"{where_}.maps.{arg}", m)
    for arg, src in n["producers"].items():
        # an earlier node: graphs are in topological order, and a cycle made binding's path walk loop forever
        if src is not None and not (isinstance(src, list) and len(src) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in src) and 0 <= src[0] < j and 0 <= src[1] < 64):
            bad(f"{where_}.producers.{arg}", f"null or a [node index < {j}, output index 0..63] pair (an earlier "
                "node)", src)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_map(bad, where_: str, m) -> None:
    """One element map as compile/element_maps.py writes it."""
    if not isinstance(m, dict) or not set(m) <= {"w", "0", "1", "2", "unresolved"}:
        bad(where_, "an object with keys among w, 0, 1, 2, unresolved", m)
    if "unresolved" in m and not isinstance(m["unresolved"], str):
        bad(f"{where_}.unresolved", "a string", m["unresolved"])
    w = m.get("w")
    if w is not None and not isinstance(w, str) and not (isinstance(w, list) and all(
            isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and _is_int(r[1]) and _is_int(r[2])
            and r[1] < r[2] for r in w)):
        bad(f"{where_}.w", "a digest string or a list of [parameter, start, stop] runs", w)
    for f in ("0", "1", "2"):
        v = m.get(f)
        if v is None:
            continue
        if isinstance(v, dict) and set(v) == {"mixed"} and isinstance(v["mixed"], str):
            continue
        if not (isinstance(v, dict) and set(v) == {"leaf", "cols", "width", "rows"} and isinstance(v["leaf"], str)
                and isinstance(v["rows"], str) and _is_int(v["width"]) and (isinstance(v["cols"], str) or (
                    isinstance(v["cols"], list) and v["cols"] and (all(_span(c) for c in v["cols"]) or all(
                        isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and _span(c[1:])
                        for c in v["cols"]))))):
            bad(f"{where_}.{f}", "{leaf, cols (a digest, [start, stop] runs or a product's [weight, first row, "
                "stop] runs), width, rows} or {mixed}", v)


def _span(c) -> bool:
    return isinstance(c, list) and len(c) == 2 and _is_int(c[0]) and _is_int(c[1]) and c[0] < c[1]


def bind(train: dict, rollout: dict, mandate: Mandate | None = None) -> BindingResult:
    """Classify every field of the pair; see the module docstring. A side that is not
    shaped as ``probe.describe_side`` writes it raises ``SideFormatError``."""
    mandate = mandate or Mandate()
    check_side(train, "the training side")
    check_side(rollout, "the rollout side")
    fa, fb = side_facts(train), side_facts(rollout)
    ctxs = ({n: f.value for n, f in fa.items()} | {"heads_check": _heads_check(fa)},
            {n: f.value for n, f in fb.items()} | {"heads_check": _heads_check(fb)})
    results = []
    for name in dict.fromkeys([*fa, *fb]):
        a, b = fa.get(name), fb.get(name)
        results.append(_judge(name, RULES[(a or b).rule], a, b, mandate, ctxs))
    results += _env_results(train, rollout)
    comparable = all(r.ok for r in results if r.tier == IDENTICAL)
    passed = comparable and all(r.ok for r in results if r.tier == SEMANTIC)
    return BindingResult(comparable, passed, results)


def load_side(path: str, side_name: str | None = None) -> dict:
    """A side description from ``path``; with ``side_name`` ("train" or "rollout") it must
    describe that side (a rollout file given as the training side binds nothing)."""
    try:
        with open(path) as f:
            side = json.load(f)
    except RecursionError as e:   # nesting deeper than the parser's stack: a traceback with exit 1 before
        raise ValueError(f"{path}: not a side description (JSON nested too deeply to read)") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:   # the parser's text named neither file nor flag
        raise ValueError(f"{path}: not a side description (not JSON text: {e})") from e
    if not isinstance(side, dict) or side.get("format") != "rlk_ops.binding.side/1":
        raise ValueError(f"{path}: not a side description (format must be 'rlk_ops.binding.side/1')")
    if side_name is not None and side.get("side") != side_name:
        raise ValueError(f"{path}: describes the {side.get('side')!r} side, expected the {side_name!r} side")
    if not isinstance(side.get("entries"), list):
        raise ValueError(f"{path}: not a side description (entries must be a list, got "
                         f"{type(side.get('entries')).__name__})")
    check_side(side, path)
    return side


def bind_model(model, *, page_size: int = 16, mandate: Mandate | None = None, model_id: str | None = None,
               topology=None, rollout_compiled: bool = False) -> tuple[BindingResult, dict, dict]:
    """Describe both entry points of ``model`` (a small warm-up compile + provenance
    capture of each: training fwd+bwd, rollout prefill and decode) and bind them.
    ``rollout_compiled``: whether the rollout's production path runs under torch.compile
    (recorded as the side's ``runtime.compiled``). Returns (result, train side, rollout side)."""
    from rlk_ops.meta.probe import describe_rollout, describe_train

    train = describe_train(model, model_id=model_id, topology=topology)
    rollout = describe_rollout(model, page_size=page_size, model_id=model_id, topology=topology,
                               compiled=rollout_compiled)
    return bind(train, rollout, mandate), train, rollout
