"""Packed parameters: a rollout engine's fused weights named by the checkpoint's parameters (session 37).

vLLM loads ``q_proj``, ``k_proj`` and ``v_proj`` into one ``qkv_proj`` parameter, and ``gate_proj``
and ``up_proj`` into ``gate_up_proj``, stacked along dim 0. The binding names weights by parameter
path, and the model id hashes the state dict by name, so such a side never bound a trainer that holds
the checkpoint's own parameters, whatever it computed. A side states its packing,

    packed = {"qkv_proj": [("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)],
              "gate_up_proj": [("gate_proj", 12288), ("up_proj", 12288)]}

(module name -> its parts in dim-0 order, each with its rows), and the describe step then reads every
parameter of a module of that name (weight and bias alike) as those parts:

* the weight hash (``probe.weights_id``) hashes the parts under the parts' names, so a side whose
  declared packing is wrong (k and v in the other order) has another model id and is not comparable;
* the element maps (``compile/element_maps.py``) name the elements of the fused parameter as rows of
  the parts: ``layers.0.self_attn.qkv_proj.weight`` rows 64:96 read as ``layers.0.self_attn.k_proj.weight``
  rows 0:32, as the trainer's own parameter.

A given checkpoint id (``model_id=``) is the caller's word for the values, as without packing: then
only the element maps check the packing against what the graph does.
"""
from __future__ import annotations

import re

import torch

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # a module name, as Python spells attributes

Packing = dict[str, list[tuple[str, int]]]


def check(packed, module: torch.nn.Module | None) -> Packing:
    """``packed`` validated against ``module``'s parameters and buffers: each key a module name that some
    parameter's path has as its owner (``...self_attn.qkv_proj.weight``), each part a (module name, rows)
    pair with rows > 0, the rows summing to each such parameter's dim 0, no part's name already a
    parameter or made from two of them, and only state-dict entries packed (the weight hash reads the state
    dict). Raises ValueError naming the argument, the expected and the actual value."""
    if packed is None or (isinstance(packed, dict) and not packed):
        return {}
    if not isinstance(packed, dict):
        raise ValueError(f"packed must be a dict {{module name: [(part, rows), ...]}} or None, "
                         f"got {type(packed).__name__} {packed!r:.80}")
    out: Packing = {}
    for key, parts in packed.items():
        if not isinstance(key, str) or not _NAME.fullmatch(key):
            raise ValueError(f"packed: a key must be a module name, letters, digits and '_' (e.g. 'qkv_proj'), "
                             f"got {key!r}")
        if not isinstance(parts, (list, tuple)) or len(parts) < 2:
            raise ValueError(f"packed[{key!r}] must list at least two (part, rows) pairs, got {parts!r:.80}")
        norm = []
        for p in parts:
            if not (isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and _NAME.fullmatch(p[0])
                    and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] > 0):
                raise ValueError(f"packed[{key!r}]: each part must be (a module name of letters, digits and '_', "
                                 f"rows > 0), got {p!r}")
            norm.append((p[0], p[1]))
        if len({n for n, _ in norm}) != len(norm) or key in {n for n, _ in norm}:
            raise ValueError(f"packed[{key!r}]: part names must be distinct and differ from the key, got {parts!r}")
        out[key] = norm
    if module is None:
        raise ValueError("packed: needs the model whose parameters it names")
    named = dict(_named(module))
    state = module.state_dict(keep_vars=True)
    seen, made = set(), {}
    for name, t in named.items():
        parts = _parts_of(name, out)
        if parts is None:
            continue
        if name not in state:   # the weight hash reads the state dict: a tensor outside it (a non-persistent
            raise ValueError(    # buffer) renamed as checkpoint parts would bind unhashed (a session 37 audit)
                f"packed: {name} is not in the model's state_dict (a non-persistent buffer?): only state-dict "
                "entries can be read as checkpoint parts")
        seen.add(name.rsplit(".", 2)[-2])
        rows = sum(r for _, r in parts)
        if t.dim() == 0 or t.shape[0] != rows:
            raise ValueError(f"packed[{name.rsplit('.', 2)[-2]!r}]: the parts' rows must sum to {name}'s dim 0, "
                             f"expected {t.shape[0] if t.dim() else 'a tensor with a dim 0'}, got {rows}")
        for part, _ in parts:
            new = _rename(name, part)
            if new in named:
                raise ValueError(f"packed: part {new} is already a parameter of the model: a module cannot "
                                 f"hold both the packed parameter and its parts")
            if new in made:   # two packed parameters naming one part: both would read as it (a session 37 audit)
                raise ValueError(f"packed: part {new} would be made from both {made[new]} and {name}, expected "
                                 "each part from one parameter")
            made[new] = name
    missing = sorted(set(out) - seen)
    if missing:
        raise ValueError(f"packed: no parameter of the model belongs to a module named {missing[0]!r}, expected "
                         f"one of the model's module names")
    return out


def _named(module: torch.nn.Module):
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _parts_of(name: str, packed: Packing):
    """The parts of parameter ``name`` (``<prefix>.<module>.<leaf>``) when its module is packed."""
    bits = name.split(".")
    return packed.get(bits[-2]) if len(bits) >= 2 else None


def _rename(name: str, part: str) -> str:
    bits = name.split(".")
    return ".".join([*bits[:-2], part, bits[-1]])


def parts(name: str, t: torch.Tensor, packed: Packing) -> list[tuple[str, int, int]] | None:
    """Parameter ``name`` as its parts: (part's name, first row, stop) in dim-0 order, or None."""
    got = _parts_of(name, packed)
    if got is None:
        return None
    out, at = [], 0
    for part, rows in got:
        out.append((_rename(name, part), at, at + rows))
        at += rows
    return out


def state_items(module: torch.nn.Module, packed: Packing):
    """``module.state_dict()`` items with every packed entry replaced by its parts (rows along dim 0)."""
    for name, t in module.state_dict().items():
        split = parts(name, t, packed) if packed else None
        if split is None:
            yield name, t
        else:
            for part, a, b in split:
                yield part, t[a:b]


def labels(module: torch.nn.Module, names: dict[int, str], packed: Packing) -> dict[int, str]:
    """``names`` (id -> dotted path, ``boundary.parameter_names``) with each packed parameter named as its
    parts for the element maps (``element_maps.packed_label``)."""
    from rlk_ops.compile.element_maps import packed_label

    if not packed:
        return names
    out = dict(names)
    for name, t in _named(module):
        path = names.get(id(t))
        split = parts(path, t, packed) if path is not None else None
        if split is not None:
            row = t[0].numel() if t.dim() else 1
            out[id(t)] = packed_label([(part, (b - a) * row) for part, a, b in split])
    return out
