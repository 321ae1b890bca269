"""Session 36: the binding compares which elements flow along the attention paths (element maps).

A session 35 audit found four rollouts that bound against the training side while their logits
differed: k and v projections swapped inside the fused weight, heads read through a transposing
view, rope fed doubled positions, o_proj's weight transposed. The q/k/v paths stopped at
rlk::linear; nothing said which rows of which weight, in which order, reached attention.
Each wrong rollout here is checked to compute other logits (so the failure is real) and each
respelling to compute the same bits (so binding it is right).

Session 37: rlk::linear outputs as products (input and weight rows), picks by an index the graph fixes,
packed parameters (vLLM's qkv_proj / gate_up_proj), the entry's outputs and its writes into its inputs.
"""
import json
import re
import types

import pytest
import torch

import rlk_ops
from rlk_ops.compile import element_maps
from rlk_ops.compile.block import Qwen3Attention
from rlk_ops.compile.boundary import inspect_boundary
from rlk_ops.meta import binding, probe
from rlk_ops.meta.binding import SEMANTIC, SideFormatError, Unobservable, bind
from rlk_ops.rollout.cache import PagedKVCache
from rlk_ops.rollout.glue import swiglu
from rlk_ops.rollout.model import TinyQwen3, TinyQwen3Config

# o_proj square (4 * 16 == 64), so its transpose type-checks
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
            head_dim=16)


def _model():
    return TinyQwen3(TinyQwen3Config(**TINY), seed=0)


@pytest.fixture(scope="module")
def train():
    return probe.describe_train(_model(), backward=False)


def _logits(model):
    """The rollout's logits for one chunked prefill then one decode step, on a fresh cache."""
    cfg = model.config
    cache = PagedKVCache(cfg.num_layers, 6, 4, cfg.num_kv_heads, cfg.head_dim, seed=3)
    g = torch.Generator().manual_seed(4)
    out = []
    with torch.no_grad():
        for s in (0, 1):
            cache.add(s)
        slots = torch.cat([cache.reserve(s, 5) for s in (0, 1)])
        tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=g)
        out.append(model.forward_rollout(tokens, torch.arange(5).expand(2, 5).contiguous(), cache, [0, 1], slots))
        slots = torch.cat([cache.reserve(s, 1) for s in (0, 1)])
        tokens = torch.randint(0, cfg.vocab_size, (2, 1), generator=g)
        out.append(model.forward_rollout(tokens, torch.full((2, 1), 5), cache, [0, 1], slots))
    return torch.cat([o.reshape(-1, cfg.vocab_size) for o in out])


STOCK = None


def _stock_logits():
    global STOCK
    if STOCK is None:
        STOCK = _logits(_model())
    return STOCK


# ---------------------------------------------------------------- q/k/v spellings (Qwen3Attention._qkv)
def _qkv(weight=None, view=None, positions=None, separate=False, fused=False):
    """A ``_qkv`` with one step replaced: ``weight(self)`` the fused weight, ``view(q, n, h, d)`` how q's
    heads are read, ``positions(p)`` what rope gets, ``separate``: three linears instead of one,
    ``fused``: rlk::qk_norm_rope instead of the norms and ropes."""
    def qkv(self, x, pos):
        cfg = self.config
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if separate:
            q, k, v = (rlk_ops.linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj))
        else:
            w = weight(self) if weight else torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            q, k, v = rlk_ops.linear(x, w).split([hq * d, hkv * d, hkv * d], dim=-1)
        n = x.shape[0]
        q = view(q, n, hq, d) if view else q.reshape(n, hq, d)
        if fused:
            q, k = rlk_ops.qk_norm_rope(q, k.reshape(n, hkv, d), self.q_norm.weight, self.k_norm.weight, pos,
                                        cfg.rms_norm_eps, cfg.rope_theta, cfg.rotary_dim)
            return q, k, v.reshape(n, hkv, d)
        q = rlk_ops.qk_rmsnorm(q, self.q_norm.weight, cfg.rms_norm_eps)
        k = rlk_ops.qk_rmsnorm(k.reshape(n, hkv, d), self.k_norm.weight, cfg.rms_norm_eps)
        pos = positions(pos) if positions else pos
        q = rlk_ops.rope(q, pos, cfg.rope_theta, cfg.rotary_dim)
        k = rlk_ops.rope(k, pos, cfg.rope_theta, cfg.rotary_dim)
        return q, k, v.reshape(n, hkv, d)
    return qkv


def _forward(rope_positions=None, k_cache_read=None, page_table_read=None, o_weight=None, seq_lens_read=None):
    """Qwen3Attention.forward_rollout (TINY has no bias) with one step replaced: ``rope_positions(positions,
    slot_mapping)`` what q and k are rotated by (the cache write keeps the positions: its own check refuses
    others), ``k_cache_read(k_cache)``, ``page_table_read(page_table)``, ``seq_lens_read(seq_lens)`` what
    attention reads,
    ``o_weight(weight)`` o_proj's weight."""
    def forward(self, hidden_states, positions, k_cache, v_cache, page_table, seq_lens, slot_mapping,
                return_attention=False):
        b, sq, hidden = hidden_states.shape
        pos = rope_positions(positions, slot_mapping) if rope_positions else positions.reshape(b * sq)
        q, k, v = self._qkv(hidden_states.reshape(b * sq, hidden), pos)
        rlk_ops.paged_kv_append(k_cache, v_cache, k.detach(), v.detach(), slot_mapping, page_table, seq_lens,
                                positions)
        attn, lse = rlk_ops.paged_attention(q.detach().reshape(b, sq, *q.shape[1:]),
                                            k_cache_read(k_cache) if k_cache_read else k_cache, v_cache,
                                            page_table_read(page_table) if page_table_read else page_table,
                                            seq_lens_read(seq_lens) if seq_lens_read else seq_lens,
                                            split_kv=self.config.split_kv)
        weight = o_weight(self.o_proj.weight) if o_weight else self.o_proj.weight
        out = rlk_ops.linear(attn.reshape(b * sq, attn.shape[2] * attn.shape[3]), weight).reshape(b, sq, hidden)
        return (out, attn, lse) if return_attention else out
    return forward


def _transposed_copy(k_cache):
    """The k cache with its [Hkv, D] rows reinterpreted as [D, Hkv] and transposed back: same shape, other
    elements."""
    p, ps, h, d = k_cache.shape
    return k_cache.reshape(p, ps, d, h).transpose(-1, -2).contiguous()


def _mlp_scaled(self, x):
    """The MLP's output scaled before the residual add: compute outside any rlk op."""
    return rlk_ops.linear(swiglu(rlk_ops.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))),
                          self.down_proj.weight) * 1.5


def _mlp_halves_swapped(self, x):
    """SwiGLU fed [up, gate] instead of [gate, up]: the halves swapped by views after the product."""
    gate_up = rlk_ops.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
    half = gate_up.shape[-1] // 2
    return rlk_ops.linear(swiglu(torch.cat([gate_up[..., half:], gate_up[..., :half]], -1)), self.down_proj.weight)


def _mlp_separate(swap=False):
    """Gate and up as two linears, cat for the SwiGLU op (``swap``: [up, gate])."""
    def mlp(self, x):
        gate, up = rlk_ops.linear(x, self.gate_proj.weight), rlk_ops.linear(x, self.up_proj.weight)
        return rlk_ops.linear(swiglu(torch.cat([up, gate] if swap else [gate, up], -1)), self.down_proj.weight)
    return mlp


def _mlp_hf(fused=False, swap=False):
    """The MLP as HF writes it, ``silu(gate) * up`` in aten ops: two linears, or (``fused``) one over
    ``cat([Wg, Wu])`` split after the product as vLLM's gate_up; ``swap``: gate and up exchanged."""
    def mlp(self, x):
        if fused:
            gate, up = rlk_ops.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, -1)
        else:
            gate, up = rlk_ops.linear(x, self.gate_proj.weight), rlk_ops.linear(x, self.up_proj.weight)
        if swap:
            gate, up = up, gate
        return rlk_ops.linear(torch.nn.functional.silu(gate) * up, self.down_proj.weight)
    return mlp


def _mlp_respelled(how):
    """The stock MLP's numbers with its products spelled otherwise (a session 37 audit's false FAILs)."""
    def mlp(self, x):
        wg, wu = self.gate_proj.weight, self.up_proj.weight
        if how == "up first":
            up = rlk_ops.linear(x, wu)
            gate_up = torch.cat([rlk_ops.linear(x, wg), up], -1)
        elif how == "fused up then gate":
            ug = rlk_ops.linear(x, torch.cat([wu, wg]))
            gate_up = torch.cat([ug[..., 128:], ug[..., :128]], -1)
        else:   # two column-parallel shards, each half of gate and half of up
            a, b = (rlk_ops.linear(x, torch.cat([wg[s], wu[s]])) for s in (slice(0, 64), slice(64, 128)))
            gate_up = torch.cat([a[..., :64], b[..., :64], a[..., 64:], b[..., 64:]], -1)
        return rlk_ops.linear(swiglu(gate_up), self.down_proj.weight)
    return mlp


def _rollout_model(qkv=None, forward=None, mlp=None):
    m = _model()
    if mlp is not None:
        m.layers[0].mlp.forward = types.MethodType(mlp, m.layers[0].mlp)
    attn = m.layers[0].self_attn
    if qkv is not None:
        attn._qkv = types.MethodType(qkv, attn)
    if forward is not None:
        attn.forward_rollout = types.MethodType(forward, attn)
    return m


def _kv_swapped(self):
    return torch.cat([self.q_proj.weight, self.v_proj.weight, self.k_proj.weight])


# a wrong product feeds the residual add, whose digest names it: the next norm's input differs too (session 37)
RESIDUAL = {"model.qk_rmsnorm.inputs": ("computed:aten.add.Tensor#", "computed:aten.add.Tensor#")}

WRONG = {   # name: (rollout model, {failing field: (train substring, rollout substring)})
    "k and v swapped in the fused weight": (
        lambda: _rollout_model(_qkv(weight=_kv_swapped)),
        {"layer[0].k.flow": ("k_proj.weight[rows 0:32]", "v_proj.weight[rows 0:32]"),
         "layer[0].v.flow": ("v_proj.weight[rows 0:32]", "k_proj.weight[rows 0:32]")}),
    "q heads read through a transpose": (
        lambda: _rollout_model(_qkv(view=lambda q, n, h, d: q.reshape(n, d, h).transpose(-1, -2))),
        {"layer[0].q.flow": ("q_proj.weight[rows 0:64]", "[64 runs sha256:")}),
    "rope positions doubled": (
        lambda: _rollout_model(_qkv(positions=lambda p: p * 2)),
        {"layer[0].q_rope.positions": ("graph input positions[0:1] rows in order", "computed:aten.mul.Tensor#"),
         "layer[0].k_rope.positions": ("graph input positions[0:1] rows in order", "computed:aten.mul.Tensor#")}),
    "rope fed the slot mapping as positions": (
        lambda: _rollout_model(forward=_forward(rope_positions=lambda positions, slots: slots)),
        {"layer[0].q_rope.positions": ("graph input positions[0:1]", "graph input slot_mapping[0:1]"),
         "layer[0].k_rope.positions": ("graph input positions[0:1]", "graph input slot_mapping[0:1]")}),
    "attention reading a transposed copy of the k cache": (
        lambda: _rollout_model(forward=_forward(k_cache_read=_transposed_copy)),
        {"layer[0].k.flow": ("rlk:rope@L0[0:32] rows in order", "cache read: rlk:kv_cache.k@L0[0:1,2:3,")}),
    "only q's rows cast through float8": (
        lambda: _rollout_model(_qkv(weight=lambda self: torch.cat([
            self.q_proj.weight.to(torch.float8_e4m3fn).to(torch.bfloat16), self.k_proj.weight, self.v_proj.weight]))),
        {"layer[0].q.flow": ("q_proj.weight[rows 0:64]",
                             "q_proj.weight via lossy casts bfloat16->float8_e4m3fn[rows 0:64]")}),
    "attention reading the other sequence's page table row": (
        lambda: _rollout_model(forward=_forward(page_table_read=lambda t: torch.stack([t[1], t[0]]))),
        {"layer[0].attention.metadata": ("whole", "rows sha256:")}),
    "attention reading one more key of the second sequence (lengths rebuilt by a cat)": (
        lambda: _rollout_model(forward=_forward(seq_lens_read=lambda n: torch.cat([n[:1], n[1:] + 1]))),
        {"layer[0].attention.metadata": ("whole", "mixed sha256:")}),
    "v's rows of the fused weight bit-cast through float16": (
        lambda: _rollout_model(_qkv(weight=lambda self: torch.cat(
            [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight.view(torch.float16).to(torch.bfloat16)]))),
        {f"layer[0].{p}.flow": ("rows 0:", "weight cat(layers.0.self_attn.q_proj.weight + layers.0.self_attn.k_proj"
                                           ".weight + computed:aten.view.dtype#") for p in "qkv"}),
    "the MLP's output scaled before the residual add": (
        lambda: _rollout_model(mlp=_mlp_scaled),
        {"model.qk_rmsnorm.inputs": ("computed:aten.add.Tensor#", "computed:aten.add.Tensor#")}),
    "SwiGLU fed the gate and up halves swapped": (
        lambda: _rollout_model(mlp=_mlp_halves_swapped),
        {"model.linear.inputs": ("computed:rlk_model.swiglu.default#", "computed:rlk_model.swiglu.default#"),
         **RESIDUAL}),
    "separate gate and up linears fed to SwiGLU swapped": (
        lambda: _rollout_model(mlp=_mlp_separate(swap=True)),
        {"model.linear.inputs": ("computed:rlk_model.swiglu.default#", "computed:rlk_model.swiglu.default#"),
         **RESIDUAL}),
    "o_proj's weight with one half cast through float8": (   # one parameter reached by two routes
        lambda: _rollout_model(forward=_forward(o_weight=lambda w: torch.cat(
            [w[:32].to(torch.float8_e4m3fn).to(torch.bfloat16), w[32:]]))),
        {"model.linear.inputs": ("o_proj.weight[rows 0:64]", "reached through different lossy casts"), **RESIDUAL}),
    "o_proj weight transposed": (
        lambda: _rollout_model(forward=_forward(o_weight=lambda w: w.t())),
        {"model.linear.inputs": ("layers.0.self_attn.o_proj.weight[rows 0:64]", "4096 runs sha256:"), **RESIDUAL}),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_rollout_computing_other_numbers_fails_binding(train, name):
    make, fields = WRONG[name]
    m = make()
    assert not torch.equal(_logits(m), _stock_logits()), "the variant must really compute other logits"
    result = bind(train, probe.describe_rollout(m))
    assert result.comparable and not result.passed
    assert {f.field for f in result.failures} == set(fields), result.summary()
    for field, (want_train, want_rollout) in fields.items():
        f = result.failure(field)
        assert f.tier == SEMANTIC
        assert want_train in json.dumps(binding._jsonable(f.train)), f.message()
        assert want_rollout in json.dumps(binding._jsonable(f.rollout)), f.message()


def _view_narrow(self, x, pos):
    """The fused product read as one [n, Hq + 2 Hkv, D] view and narrowed per projection."""
    cfg = self.config
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads = rlk_ops.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight], dim=0))
    heads = heads.view(x.shape[0], hq + 2 * hkv, d)
    q = rlk_ops.qk_rmsnorm(heads.narrow(1, 0, hq), self.q_norm.weight, cfg.rms_norm_eps)
    k = rlk_ops.qk_rmsnorm(heads.narrow(1, hq, hkv), self.k_norm.weight, cfg.rms_norm_eps)
    return (rlk_ops.rope(q, pos, cfg.rope_theta, cfg.rotary_dim), rlk_ops.rope(k, pos, cfg.rope_theta, cfg.rotary_dim),
            heads.narrow(1, hq + hkv, hkv))


def _front(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the front of a wider and taller buffer (vLLM's persistent block table)."""
    pad = (0, 3, 0, 2) if t.dim() == 2 else (0, 2)
    return torch.nn.functional.pad(t, pad)[tuple(slice(0, n) for n in t.shape)]


SAME = {
    "view and narrow instead of split and reshape": _view_narrow,
    "three projections instead of one fused": _qkv(separate=True),
    "rlk::qk_norm_rope instead of the norms and ropes": _qkv(fused=True),
    "the fused weight through float32 and back": _qkv(weight=lambda self: torch.cat(
        [self.q_proj.weight.float(), self.k_proj.weight.float(), self.v_proj.weight.float()]).to(torch.bfloat16)),
}


MLP_SAME = {
    "separate gate and up linears instead of the fused gate_up": _mlp_separate(),
    "separate linears, up computed first": _mlp_respelled("up first"),
    "one linear over [Wu; Wg], its halves exchanged after": _mlp_respelled("fused up then gate"),
    "two column-parallel shards of gate and up": _mlp_respelled("shards"),
}


FORWARD_SAME = {
    "page table and lengths read from the front of wider buffers":
        _forward(page_table_read=_front, seq_lens_read=_front),
}


@pytest.mark.parametrize("name", list(SAME) + list(MLP_SAME) + list(FORWARD_SAME))
def test_the_same_numbers_spelled_otherwise_still_bind(train, name):
    m = _rollout_model(SAME[name]) if name in SAME else _rollout_model(mlp=MLP_SAME[name]) if name in MLP_SAME \
        else _rollout_model(forward=FORWARD_SAME[name])
    assert torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert result.passed, result.summary()


def test_an_hf_mlp_binds_fused_or_separate_and_fails_with_gate_and_up_swapped():
    """``silu(gate) * up`` (HF's Qwen3MLP) on both sides. Until session 37 every linear of a layer was one leaf
    name, ``rlk:linear@L1``, so the product's digest was the same with gate and up exchanged: that rollout bound
    while its logits differed. Now a linear's output is named by its input and the weight rows behind each
    column, so the exchange fails, and a vLLM-style fused gate_up split after the product binds two linears."""
    train_model = _rollout_model(mlp=_mlp_hf())
    train = probe.describe_train(train_model, backward=False)
    fused = _rollout_model(mlp=_mlp_hf(fused=True))
    assert torch.equal(_logits(fused), _logits(train_model))
    result = bind(train, probe.describe_rollout(fused))
    assert result.passed, result.summary()
    swapped = _rollout_model(mlp=_mlp_hf(swap=True))
    assert not torch.equal(_logits(swapped), _logits(train_model))
    result = bind(train, probe.describe_rollout(swapped))
    assert result.comparable and not result.passed
    assert {f.field for f in result.failures} == {"model.linear.inputs", "model.qk_rmsnorm.inputs"}
    assert "computed:aten.mul.Tensor#" in json.dumps(result.failure("model.linear.inputs").rollout)


def test_a_linear_output_names_the_weight_rows_behind_its_columns():
    """The product leaf's columns, checked by hand: a fused [Wg; Wu] split after the product and two separate
    linears name the same rows; a bias rides on its weight rows, shifted when its elements are not the rows'."""
    mod = torch.nn.Module()
    for name, shape in (("g", (3, 4)), ("u", (3, 4)), ("b", (6,))):
        mod.register_parameter(name, torch.nn.Parameter(torch.randn(*shape)))

    def fused(self, x):
        gate, up = rlk_ops.linear(x, torch.cat([self.g, self.u]), self.b).chunk(2, -1)
        return rlk_ops.qk_rmsnorm(torch.stack([up, gate], 1), torch.ones(3), 1e-6)

    def separate(self, x):
        gate, up = rlk_ops.linear(x, self.g, self.b[:3]), rlk_ops.linear(x, self.u, self.b[3:])
        return rlk_ops.qk_rmsnorm(torch.stack([up, gate], 1), torch.ones(3), 1e-6)

    def shifted(self, x):   # u's rows with g's bias elements: other columns than the fused up's
        return rlk_ops.qk_rmsnorm(rlk_ops.linear(x, self.u, self.b[:3]).unsqueeze(1), torch.ones(3), 1e-6)
    x = torch.randn(5, 4)
    want = {"leaf": "rlk:linear@L0(x: graph input whole; rows of 4)", "cols": [["u + b@+3", 0, 3], ["g + b", 0, 3]],
            "width": 6, "rows": "in order"}
    maps = []
    for fn in (fused, separate):
        norm = inspect_boundary(types.MethodType(fn, mod), x, backward=False).forward[-1]
        assert norm.maps["x"]["2"] == want, fn.__name__
        maps.append(norm.maps["x"])
    assert maps[0] == maps[1]   # the other forms too: digests of labels and rows, not of the merge's numbering

    def gate_alone(self, x):   # one linear's product (3 columns) against the gate half of the fused one (6)
        return rlk_ops.qk_rmsnorm(rlk_ops.linear(x, self.g).unsqueeze(1), torch.ones(3), 1e-6)

    def gate_of_fused(self, x):
        return rlk_ops.qk_rmsnorm(rlk_ops.linear(x, torch.cat([self.g, self.u]))[:, :3].unsqueeze(1), torch.ones(3),
                                  1e-6)
    maps = [inspect_boundary(types.MethodType(fn, mod), x, backward=False).forward[-1].maps["x"]
            for fn in (gate_alone, gate_of_fused)]
    assert maps[0]["2"]["width"] == 3 and maps[1]["2"]["width"] == 6   # the merged product's, never compared
    no_width = [{f: {k: x for k, x in v.items() if k != "width"} for f, v in m.items()} for m in maps]
    assert no_width[0] == no_width[1]
    norm = inspect_boundary(types.MethodType(shifted, mod), x, backward=False).forward[-1]
    assert norm.maps["x"]["2"]["cols"] == [["u + b", 0, 3]]


def _paged_head(head):
    """``forward_paged`` with its last step replaced: ``head(model, h, b, sq)`` makes the logits from the
    residual ``h`` [b, sq, hidden]."""
    def forward_paged(self, tokens, positions, k_caches, v_caches, page_table, seq_lens, slot_mapping, trace=None):
        b, sq = tokens.shape
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn.forward_rollout(layer.input_layernorm(h), positions, k_caches[i], v_caches[i],
                                                    page_table, seq_lens, slot_mapping)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return head(self, h, b, sq)
    return forward_paged


def _last_token_logits(rows=lambda m, h: m.norm(h), pick=None):
    """``forward_paged`` projecting logits for each sequence's last token only, through an index
    (vLLM's ``hidden_states[logits_indices]``); ``rows(model, h)``: what the index picks from; ``pick(b, sq)``:
    another index (then the logits have b * sq rows)."""
    def head(self, h, b, sq):
        last = torch.arange(b, device=h.device) * sq + (sq - 1) if pick is None else pick(b, sq)
        logits = rlk_ops.linear(rows(self, h).reshape(b * sq, -1)[last], self.lm_head.weight)
        return logits.unsqueeze(0)   # [1, rows picked, vocab]
    return _paged_head(head)


def test_logits_through_an_index_bind_and_pick_rows_of_the_final_norm(train):
    """A rollout that projects only each sequence's last token through an index computes those tokens'
    logits bitwise (the projection is batch invariant) and binds: the graph fixes the index from sizes
    (``arange(b) * sq + sq - 1``), so the pick is replayed as some of the final norm's rows, in order. Until
    session 37 the index was a computing node and the pair failed. Picking the rows from the residual
    before the final norm, or token 0 for every token, or the sequences exchanged, computes other logits
    and fails."""
    stock = _stock_logits()   # 2 sequences x 5 prefill tokens, then 2 x 1 decode token
    last = stock[[4, 9, 10, 11]]
    m = _model()
    m.forward_paged = types.MethodType(_last_token_logits(), m)
    assert torch.equal(_logits(m), last)
    result = bind(train, probe.describe_rollout(m))
    assert result.passed, result.summary()
    field = next(f for f in result.fields if f.field == "model.linear.inputs")
    lm_head = json.loads(field.rollout[-1])   # prefill and decode agree: one list
    assert lm_head["x"] == "rlk:qk_rmsnorm@L1(norm.weight)[0:64] rows every token, or each sequence's last"

    m = _model()
    m.forward_paged = types.MethodType(_last_token_logits(rows=lambda m, h: h), m)
    assert not torch.equal(_logits(m), last)
    result = bind(train, probe.describe_rollout(m))
    assert {f.field for f in result.failures} == {"model.linear.inputs", "model.qk_rmsnorm.args",   # no final
                                                  "model.qk_rmsnorm.inputs"}                       # norm call
    lm_head = json.loads(result.failure("model.linear.inputs").rollout[-1])
    assert lm_head["x"].startswith("computed:aten.add.Tensor#") and lm_head["x"].endswith("each sequence's last")
    for pick in (lambda b, sq: torch.zeros(b * sq, dtype=torch.long),                  # token 0 for every token
                 lambda b, sq: (torch.arange(b * sq) + sq) % (b * sq),               # the sequences exchanged
                 lambda b, sq: torch.arange(b) * sq,                                 # each sequence's first token
                 lambda b, sq: torch.tensor([sq - 1])):                              # the first sequence only
        m = _model()
        m.forward_paged = types.MethodType(_last_token_logits(pick=pick), m)
        assert not torch.equal(_logits(m), stock)
        result = bind(train, probe.describe_rollout(m))
        assert {f.field for f in result.failures} == {"model.linear.inputs"}, result.summary()


def test_the_element_map_of_a_row_selection():
    """``x[idx]`` and ``index_select(x, 0, idx)`` by an index the graph fixes from sizes (``arange``): replayed
    with its values, so rising picks are some rows in order and others a digest (token 0 for every token, the
    rows reversed); by an index that is data (a graph input): a computing node."""
    w = torch.randn(3, 8)

    def pick(how, idx):
        def fn(x, i):
            j = idx(x)
            return rlk_ops.linear(x[j] if how == "index" else torch.index_select(x, 0, j), w)
        return inspect_boundary(fn, torch.randn(5, 8), torch.tensor([3, 1]), backward=False).forward[0].maps["x"]["1"]
    for how in ("index", "index_select"):
        for idx in (lambda x: torch.arange(2, device=x.device) * 2 + 1, lambda x: torch.tensor([1, 3])):   # sizes,
            assert pick(how, idx) == {"leaf": "input:l_x_", "cols": [[0, 8]], "width": 8,              # a constant
                                      "rows": f"2 of 5 in order ({element_maps._digest(torch.tensor([1, 3]))})"}
        assert pick(how, lambda x: torch.zeros(5, dtype=torch.long))["rows"].startswith("sha256:")
        assert pick(how, lambda x: torch.arange(4, -1, -1))["rows"].startswith("sha256:")
    assert inspect_boundary(lambda x: rlk_ops.linear(torch.index_select(x, -2, torch.tensor([1, 3])), w),
                            torch.randn(5, 8), backward=False).forward[0].maps["x"]["1"]["rows"].startswith("2 of 5 in")
    data = inspect_boundary(lambda x, i: rlk_ops.linear(x[i], w), torch.randn(5, 8), torch.tensor([3, 1]),
                            backward=False).forward[0].maps["x"]["1"]
    assert data["leaf"].startswith("computed:aten.index.Tensor#")


PACKED = {"qkv_proj": [("q_proj", 64), ("k_proj", 32), ("v_proj", 32)], "gate_up_proj": [("gate_proj", 128),
                                                                                        ("up_proj", 128)]}


def _vllm_model(order=("q_proj", "k_proj", "v_proj")):
    """The tiny model with vLLM's fused parameters: ``qkv_proj.weight`` (the checkpoint's q, k, v projections
    stacked in ``order``) and ``gate_up_proj.weight``, the separate ones gone."""
    m = _model()
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    attn.qkv_proj = torch.nn.Linear(64, 128, bias=False)
    attn.qkv_proj.weight = torch.nn.Parameter(torch.cat([getattr(attn, n).weight for n in order]).detach().clone())
    mlp.gate_up_proj = torch.nn.Linear(64, 256, bias=False)
    mlp.gate_up_proj.weight = torch.nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().clone())
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    attn._qkv = types.MethodType(_qkv(weight=lambda self: self.qkv_proj.weight), attn)
    mlp.forward = types.MethodType(
        lambda self, x: rlk_ops.linear(swiglu(rlk_ops.linear(x, self.gate_up_proj.weight)), self.down_proj.weight), mlp)
    return m


def test_fused_parameters_bind_under_a_declared_packing(train):
    """vLLM's ``qkv_proj`` and ``gate_up_proj`` parameters, declared as their checkpoint parts, bind against
    the trainer's own parameters: the model id hashes the parts, and the element maps name their rows. Until
    session 37 such a side was never comparable. Undeclared, it is still not comparable (other names, other
    hash); declared in the wrong order, the hash says so; and with a given checkpoint id (the caller's word
    for the values) the element maps still see k read from what the declaration calls v_proj."""
    m = _vllm_model()
    assert torch.equal(_logits(m), _stock_logits())
    side = probe.describe_rollout(m, packed=PACKED)
    assert side["model"]["id"] == train["model"]["id"] and side["model"]["packed"]["qkv_proj"][1] == ["k_proj", 32]
    result = bind(train, side)
    assert result.passed, result.summary()
    assert not bind(train, probe.describe_rollout(m)).comparable
    wrong = {**PACKED, "qkv_proj": [("q_proj", 64), ("v_proj", 32), ("k_proj", 32)]}
    result = bind(train, probe.describe_rollout(m, packed=wrong))
    assert not result.comparable and result.failure("model.id") is not None
    result = bind(probe.describe_train(_model(), backward=False, model_id="ckpt"),
                  probe.describe_rollout(m, packed=wrong, model_id="ckpt"))
    assert result.comparable and not result.passed
    assert "layers.0.self_attn.v_proj.weight[rows 0:32]" in json.dumps(result.failure("layer[0].k.flow").rollout)


@pytest.mark.parametrize("packed, match", [
    ({"qkv": [("q_proj", 64), ("k_proj", 32), ("v_proj", 32)]}, "no parameter of the model belongs to a module "
                                                               "named 'qkv'"),
    ({"qkv_proj": [("q_proj", 64), ("k_proj", 32), ("v_proj", 31)]}, "sum to layers.0.self_attn.qkv_proj.weight's "
                                                                     "dim 0, expected 128, got 127"),
    ({"qkv_proj": [("q_proj", 64), ("k_proj", 0), ("v_proj", 64)]}, r"rows > 0\), got \('k_proj', 0\)"),
    ({"qkv_proj": [("q_proj", 128)]}, "at least two"),
    ({"qkv_proj": [("o_proj", 64), ("k_proj", 64)]}, "o_proj.weight is already a parameter"),
    ({"a.qkv_proj": [("q_proj", 64), ("k_proj", 64)]}, "a key must be a module name"),
    ({"qkv_proj": [("q|proj", 64), ("k_proj", 32), ("v_proj", 32)]}, r"each part must be \(a module name"),
    ({"qkv_proj": [("q_proj=5", 64), ("k_proj", 32), ("v_proj", 32)]}, r"each part must be \(a module name"),
    ({**PACKED, "o_proj": [("q_proj", 32), ("x_proj", 32)]}, "q_proj.weight would be made from both"),
    ([("qkv_proj", 128)], "must be a dict"),
])
def test_a_bad_packing_is_refused(packed, match):
    with pytest.raises(ValueError, match=match):
        probe.describe_rollout(_vllm_model(), packed=packed)


def test_a_buffer_outside_the_state_dict_cannot_be_packed(train):
    """A non-persistent buffer read as checkpoint parts would bind unhashed: the weight hash reads the state
    dict, and this copy of qkv has v's rows where k's belong (a session 37 audit: it bound)."""
    m = _vllm_model()
    attn = m.layers[0].self_attn
    attn.shadow = torch.nn.Module()
    w = attn.qkv_proj.weight.detach().clone()
    w[64:96] = w[96:128]
    attn.shadow.register_buffer("weight", w, persistent=False)
    attn._qkv = types.MethodType(_qkv(weight=lambda self: self.shadow.weight), attn)
    with pytest.raises(ValueError, match="layers.0.self_attn.shadow.weight is not in the model's state_dict"):
        probe.describe_rollout(m, packed={**PACKED, "shadow": [("q_proj", 64), ("k_proj", 32), ("v_proj", 32)]})


def test_o_proj_in_two_halves_binds(train):
    """o_proj as two linears over halves of its weight's rows, outputs side by side (row-parallel shards
    gathered): one product of the attention output, the same rows."""
    def forward(self, hidden_states, positions, k_cache, v_cache, page_table, seq_lens, slot_mapping,
                return_attention=False):
        b, sq, hidden = hidden_states.shape
        q, k, v = self._qkv(hidden_states.reshape(b * sq, hidden), positions.reshape(b * sq))
        rlk_ops.paged_kv_append(k_cache, v_cache, k.detach(), v.detach(), slot_mapping, page_table, seq_lens,
                                positions)
        attn, lse = rlk_ops.paged_attention(q.detach().reshape(b, sq, *q.shape[1:]), k_cache, v_cache, page_table,
                                            seq_lens, split_kv=self.config.split_kv)
        a = attn.reshape(b * sq, attn.shape[2] * attn.shape[3])
        w = self.o_proj.weight
        out = torch.cat([rlk_ops.linear(a, w[:32]), rlk_ops.linear(a, w[32:])], -1).reshape(b, sq, hidden)
        return (out, attn, lse) if return_attention else out
    m = _rollout_model(forward=forward)
    assert torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert result.passed, result.summary()


def test_a_linear_output_read_unchanged_needs_no_replay(train, monkeypatch):
    """gate_up into SwiGLU, down into the residual: maps written from the call's columns, not replayed, so a
    product over the replay limit still binds (Qwen3-8B's gate_up output is [T, 24576]: over 2730 tokens it
    was unresolved after the first products commit, a session 37 audit). Here the limit is lowered below
    the gate_up output's 2560 elements."""
    monkeypatch.setattr(element_maps, "LIMIT", 2000)
    rollout = probe.describe_rollout(_model())
    gate_up = [n for n in rollout["entries"][0]["graph"]["forward"] if n["op"] == "rlk::linear"][2]
    assert "unresolved" not in json.dumps(gate_up["maps"])
    result = bind(probe.describe_train(_model(), backward=False), rollout)
    assert result.passed, result.summary()


def test_a_product_read_unchanged_maps_as_its_replay():
    """A linear output taken as it is (written from the call's columns) and through a view (replayed) have
    one map, every form."""
    mod = torch.nn.Module()
    mod.register_parameter("w", torch.nn.Parameter(torch.randn(6, 8)))
    w2 = torch.randn(4, 6)
    maps = [inspect_boundary(types.MethodType(fn, mod), torch.randn(5, 8), backward=False).forward[1].maps["x"]
            for fn in (lambda self, x: rlk_ops.linear(rlk_ops.linear(x, self.w), w2),
                       lambda self, x: rlk_ops.linear(rlk_ops.linear(x, self.w).view(5, 6).contiguous(), w2))]
    assert maps[0] == maps[1] and maps[0]["1"]["cols"] == [["w", 0, 6]] and "mixed" in maps[0]["0"]
    w3 = torch.randn(4, 12)   # a weight row twice: both read as the replay reads them
    maps = [inspect_boundary(types.MethodType(fn, mod), torch.randn(5, 8), backward=False).forward[1].maps["x"]
            for fn in (lambda self, x: rlk_ops.linear(rlk_ops.linear(x, torch.cat([self.w, self.w])), w3),
                       lambda self, x: rlk_ops.linear(rlk_ops.linear(x, torch.cat([self.w, self.w])).clone(), w3))]
    assert maps[0] == maps[1]


def test_a_product_names_its_rows_width():
    """Weight "rows" are counted in the product's input width: ``linear(x, w)[:, :3]`` and
    ``linear(x.reshape(-1, 4), w.reshape(12, 4))[:, :3]`` both take "rows 0:3", of 8 and of 4 elements."""
    mod = torch.nn.Module()
    mod.register_parameter("w", torch.nn.Parameter(torch.randn(6, 8)))

    def whole_rows(self, x):
        return rlk_ops.qk_rmsnorm(rlk_ops.linear(x, self.w)[:, :3], torch.ones(3), 1e-6)

    def half_rows(self, x):
        return rlk_ops.qk_rmsnorm(rlk_ops.linear(x.reshape(-1, 4), self.w.reshape(12, 4))[:, :3], torch.ones(3),
                                  1e-6)
    leaves = [inspect_boundary(types.MethodType(fn, mod), torch.randn(5, 8), backward=False).forward[-1]
              .maps["x"]["1"]["leaf"] for fn in (whole_rows, half_rows)]
    assert leaves[0].endswith("rows of 8)") and leaves[1].endswith("rows of 4)")


def test_a_linear_without_an_input_map_fails_closed(train):
    """A side file whose linear has no map for x binds nothing on that call (it once raised KeyError)."""
    side = json.loads(json.dumps(probe.describe_rollout(_model())))
    for e in side["entries"]:
        [n for n in e["graph"]["forward"] if n["op"] == "rlk::linear"][-1]["maps"].pop("x")
    result = bind(train, side)
    assert result.comparable and {f.field for f in result.failures} == {"model.linear.inputs"}


def test_logits_reordered_after_the_projection_fail(train):
    """A rollout that hands back its logits with the vocabulary halves exchanged samples from other
    numbers; every rlk call is as the trainer's, so until session 37 it bound (a session 37 audit): now the
    graph's outputs that hold lm_head's elements are compared (``model.outputs``)."""
    m = _model()
    paged = m.forward_paged
    m.forward_paged = lambda *a, **k: (lambda y: torch.cat([y[..., 32:], y[..., :32]], -1))(paged(*a, **k))
    assert not torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert {f.field for f in result.failures} == {"model.outputs"}
    assert result.failure("model.outputs").rollout == [
        "structure *", "[lm_head.weight[rows 32:64] + lm_head.weight[rows 0:32]] rows in order"]


def _returning(model, after):
    """``model`` whose training and rollout entries hand back ``after(logits)``."""
    train, paged = model.forward_train, model.forward_paged   # bound to the model: its parameters are named
    model.forward_train = types.MethodType(lambda self, *a, **k: after(train(*a, **k)), model)
    model.forward_paged = types.MethodType(lambda self, *a, **k: after(paged(*a, **k)), model)
    return model


def _log_softmax(y):
    return torch.log_softmax(y.float(), -1)


def _break_then_reorder(y):
    torch._dynamo.graph_break()
    return torch.cat([y[..., 32:], y[..., :32]], -1)


@torch.compiler.disable
def _reorder_outside_the_graph(y):
    return torch.cat([y[..., 32:], y[..., :32]], -1)


def _square(y):
    return y.float() * y.float()


@pytest.mark.parametrize("after, train_after, field_text", [
    (lambda y: y.to(torch.float8_e4m3fn).to(torch.bfloat16), None, " via lossy casts bfloat16->float8_e4m3fn["),
    (lambda y: y.long(), None, " via lossy casts bfloat16->int64["),   # the last cast is named too
    (_break_then_reorder, None, "graph break"),
    (lambda y: _reorder_outside_the_graph(y), None, "graph break"),     # torch.compiler.disable: no graph after
    (lambda y: _square(torch.cat([y[..., 32:], y[..., :32]], -1)), _square, "computed:aten.mul.Tensor"),
    (lambda y: _log_softmax(torch.cat([y[..., 32:], y[..., :32]], -1)), _log_softmax, "computed:aten._log_softmax"),
    (lambda y: _log_softmax(2 * y), _log_softmax, "computed:aten._log_softmax"),
])
def test_what_the_entry_makes_of_the_logits_is_compared(after, train_after, field_text):
    """Each rollout hands back other numbers than its trainer: the logits cast through float8, reordered in a
    graph after a break (the field is unobservable: the later graph is not analysed), or log-probs of
    reordered or doubled logits against a trainer's log-probs (computed outputs compare by their digest;
    both read "no output holds the logits" before: a session 37 audit). Only the user outputs count: a
    trainer's graph also hands back what its backward keeps (the squares' factors), which once made the
    same squares fail."""
    base = _model() if train_after is None else _returning(_model(), train_after)
    train = probe.describe_train(base, backward=False)
    m = _returning(_model(), after)
    assert not torch.equal(_logits(m), _logits(base))
    result = bind(train, probe.describe_rollout(m))
    assert {f.field for f in result.failures} == {"model.outputs"}, result.summary()
    assert field_text in json.dumps(binding._jsonable(result.failure("model.outputs").rollout))
    if train_after is not None:   # the same log-probs bind
        same = _returning(_model(), train_after)
        assert torch.equal(_logits(same), _logits(base))
        assert bind(train, probe.describe_rollout(same)).passed


def _logits_and_logprobs(y):
    return {"logits": y, "logprobs": torch.log_softmax(y.float(), -1)}


@pytest.mark.parametrize("after, train_after", [
    (lambda y: y[:1], None),                                                          # a sequence dropped
    (lambda y: y[:, :1], None),                                                       # token 0 of each
    (lambda y: {"logprobs": y, "logits": _logits_and_logprobs(y)["logprobs"]}, _logits_and_logprobs),   # keys
])
def test_what_rows_and_keys_are_handed_back_is_compared(after, train_after):
    """Rows dropped after lm_head, or the output's keys exchanged, bound as "some rows" / by position only (a
    session 37 audit): the outputs' rows are compared exactly, and so is their structure."""
    train = probe.describe_train(_returning(_model(), train_after) if train_after else _model(), backward=False)
    result = bind(train, probe.describe_rollout(_returning(_model(), after)))
    assert {f.field for f in result.failures} == {"model.outputs"}, result.summary()


def test_the_final_norm_of_the_picked_rows_only_binds(train):
    """The final norm applied to each sequence's last token only (the pick before the norm): the same logits
    (the norm is row-wise); it failed on the norm's input until the third session 37 audit."""
    m = _model()
    m.forward_paged = types.MethodType(_paged_head(lambda self, h, b, sq: rlk_ops.linear(
        self.norm(h.reshape(b * sq, -1)[torch.arange(b) * sq + sq - 1]), self.lm_head.weight)), m)
    assert torch.equal(_logits(m), _stock_logits()[[4, 9, 10, 11]])
    assert bind(train, probe.describe_rollout(m)).passed
    m.forward_paged = types.MethodType(_paged_head(lambda self, h, b, sq: rlk_ops.linear(   # first tokens: fails
        self.norm(h.reshape(b * sq, -1)[torch.arange(b) * sq]), self.lm_head.weight)), m)
    assert {f.field for f in bind(train, probe.describe_rollout(m)).failures} == {"model.qk_rmsnorm.inputs"}


def test_the_last_token_picked_along_the_sequence_dim_binds(train):
    """HF's last-token logits on ``[B, S, D]``: ``index_select(h, 1, [s - 1])`` is each sequence's last token."""
    m = _model()
    m.forward_paged = types.MethodType(_paged_head(lambda self, h, b, sq: rlk_ops.linear(
        torch.index_select(self.norm(h), 1, torch.tensor([sq - 1])), self.lm_head.weight)), m)
    assert torch.equal(_logits(m), _stock_logits()[[4, 9, 10, 11]])
    assert bind(train, probe.describe_rollout(m)).passed


def test_every_output_is_compared():
    """An entry handing back a second tensor: it is compared too (only outputs made from the last rlk op
    were, a session 37 audit)."""
    train = probe.describe_train(_returning(_model(), lambda y: (y, y * 2)), backward=False)
    result = bind(train, probe.describe_rollout(_returning(_model(), lambda y: (y, y * 3))))
    assert {f.field for f in result.failures} == {"model.outputs"}, result.summary()
    assert bind(train, probe.describe_rollout(_returning(_model(), lambda y: (y, y * 2)))).passed


def test_a_cache_changed_outside_the_rlk_ops_fails(train):
    """A rollout that scales its v cache after the logits: this step's logits are right, the next step's are
    not; every rlk call is as the trainer's, so it bound (a session 37 audit). What the graphs write into
    their inputs must be rlk outputs as they are (``graph.input_writes``)."""
    m = _model()
    paged = m.forward_paged

    def forward_paged(self, tokens, positions, k_caches, v_caches, *a, **k):
        y = paged(tokens, positions, k_caches, v_caches, *a, **k)
        v_caches[0].mul_(2)
        return y
    m.forward_paged = types.MethodType(forward_paged, m)
    assert not torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert {f.field for f in result.failures} == {"graph.input_writes"}, result.summary()
    assert "computed:aten.mul.Tensor#" in json.dumps(result.failure("graph.input_writes").rollout)
    stock = probe.describe_rollout(_model())
    assert next(f for f in bind(train, stock).fields if f.field == "graph.input_writes").rollout == []


def test_a_vocabulary_parallel_lm_head_binds(train):
    """lm_head as two linears over halves of the vocabulary, outputs side by side: one product of the final
    norm, the same logits."""
    m = _model()
    m.forward_paged = types.MethodType(_vocab_parallel(), m)
    assert torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert result.passed, result.summary()


def _vocab_parallel():
    def head(self, h, b, sq):
        x, w = self.norm(h), self.lm_head.weight
        return torch.cat([rlk_ops.linear(x, w[:32]), rlk_ops.linear(x, w[32:])], -1)
    return _paged_head(head)


def test_a_lossy_cast_inside_a_fused_weight_fails(train):
    """bf16 -> float8 -> bf16 on the cat: every element keeps its place, not its value. The weight has no
    single source, so the sources' cast check never saw it; the element map names the cast on the leaves."""
    m = _rollout_model(_qkv(weight=lambda self: torch.cat(
        [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).to(torch.float8_e4m3fn).to(torch.bfloat16)))
    assert not torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    assert {f.field for f in result.failures} == {"layer[0].q.flow", "layer[0].k.flow", "layer[0].v.flow"}
    assert "k_proj.weight via lossy casts bfloat16->float8_e4m3fn[rows 0:32]" in json.dumps(
        result.failure("layer[0].k.flow").rollout)


def test_weights_outside_the_parameters_fail_closed(train):
    """A rollout reading an equal copy of the fused weight from a non-persistent buffer computes the same
    bits, but nothing shows that the copy holds the checkpoint's values (the model id hashes the state
    dict, which has no such buffer): the weight is named as what it is, and binding fails."""
    m = _model()
    attn = m.layers[0].self_attn
    attn.register_buffer("fused", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                         persistent=False)
    attn._qkv = types.MethodType(_qkv(weight=lambda self: self.fused), attn)
    assert torch.equal(_logits(m), _stock_logits())
    result = bind(train, probe.describe_rollout(m))
    f = result.failure("layer[0].k.flow")
    assert f is not None and "layers.0.self_attn.fused[rows 64:96]" in json.dumps(f.rollout)


def test_element_maps_of_a_small_graph():
    """What the report writes, on graphs small enough to check by hand: a fused weight split after the
    product, a transposing view, a cast through a narrower dtype, as_strided, a prefix of the rows."""
    lin_a, lin_b = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 2, bias=False)
    mod = torch.nn.Module()
    mod.a, mod.b = lin_a, lin_b
    mod.register_parameter("norm_w", torch.nn.Parameter(torch.ones(2)))
    mod.register_parameter("w", torch.nn.Parameter(torch.randn(4, 8)))

    def fn(self, x):
        y = rlk_ops.linear(x, torch.cat([self.b.weight, self.a.weight]))        # [T, 8]: b's 2 rows, then a's 6
        h = y[:, 2:].reshape(x.shape[0], 2, 3)[..., :2].transpose(-1, -2)       # [T, 2, 2] from a's columns
        n = rlk_ops.qk_rmsnorm(h.contiguous(), self.norm_w.to(torch.float16).to(torch.float32), 1e-6)
        # as_strided over a fresh copy of a strided slice: the copy's storage, not the slice's
        w = self.w[:, 2:6].to(torch.float64).as_strided((4, 4), (4, 1)).to(torch.float32)
        return n, rlk_ops.linear(x[:-1, :4], w)

    report = inspect_boundary(types.MethodType(fn, mod), torch.randn(5, 8), backward=False)
    lin, norm, lin2 = report.forward
    assert lin.maps["weight"] == {"w": [["b.weight", 0, 16], ["a.weight", 0, 48]]}
    assert lin.maps["x"]["1"] == {"leaf": "input:l_x_", "cols": [[0, 8]], "width": 8, "rows": "in order"}
    # element (i, j) of a token's [2, 2] is column 2 + 3 * j + i of the product
    # (session 37: named as the rows of a.weight behind those columns: 0, 3, 1, 4)
    assert norm.maps["x"]["2"] == {"leaf": "rlk:linear@L0(x: graph input whole; rows of 8)",
                                   "cols": [["a.weight", 0, 1], ["a.weight", 3, 4], ["a.weight", 1, 2], ["a.weight", 4, 5]],
                                   "width": 8, "rows": "in order"}
    assert "mixed" in norm.maps["x"]["1"]   # read as rows of 2, each row takes other columns
    assert norm.maps["weight"] == {"w": [["norm_w via lossy casts float32->float16", 0, 2]]}
    assert lin2.maps["weight"] == {"w": [["w", 2, 6], ["w", 10, 14], ["w", 18, 22], ["w", 26, 30]]}
    assert lin2.maps["x"]["1"] == {"leaf": "input:l_x_", "cols": [[0, 4]], "width": 8,
                                   "rows": "the first 4 of 5 in order"}

    def split(self, x):   # one parameter split, one piece through float64 and back: exact, so one name
        a, b = self.w.split([2, 2])
        return rlk_ops.linear(x[:, :8], torch.cat([a.double().float(), b]))
    m = inspect_boundary(types.MethodType(split, mod), torch.randn(5, 8), backward=False).forward[0].maps
    assert m["weight"] == {"w": [["w", 0, 32]]}

    def strided(self, x):   # as_strided straight over the slice: storage the coordinates do not share
        return rlk_ops.linear(x[:, :4], self.w[:, 2:6].as_strided((4, 4), (8, 1)))
    m = inspect_boundary(types.MethodType(strided, mod), torch.randn(5, 8), backward=False).forward[0].maps
    assert "as_strided" in m["weight"]["unresolved"]


def test_unresolved_maps_and_older_side_files_fail_closed(train, monkeypatch):
    rollout = probe.describe_rollout(_model())
    assert bind(train, rollout).passed
    old = json.loads(json.dumps(rollout))          # a side file written before session 36
    for e in old["entries"]:
        for n in e["graph"]["forward"]:
            n.pop("maps")
    result = bind(train, old)
    f = result.failure("layer[0].q.flow")
    assert f is not None and isinstance(f.rollout, Unobservable) and "session 36" in f.rollout.reason
    assert isinstance(result.failure("model.linear.inputs").rollout, Unobservable)
    with monkeypatch.context() as mp:   # the weights' fast path off: every map replayed
        mp.setattr(element_maps, "_flat_runs", lambda node, leaves: None)
        replayed = probe.describe_rollout(_model())
    monkeypatch.setattr(element_maps, "LIMIT", 16)  # nothing replays: maps with movement ops unresolved
    small = probe.describe_rollout(_model())
    result = bind(train, small)
    f = result.failure("layer[0].k.flow")
    assert f is not None and isinstance(f.rollout, Unobservable) and "not resolved" in f.rollout.reason \
        and "leaf elements" in f.rollout.reason
    # ...but an argument that is a parameter, or whole parameters concatenated (lm_head; the fused QKV and
    # gate_up weights), is read off the graph, whatever its size: as the replay had it
    weights = 0
    for full, again, cut in zip(*(side["entries"][0]["graph"]["forward"] for side in (rollout, replayed, small))):
        assert again["maps"] == full["maps"]
        if "weight" in full["maps"]:
            weights += 1
            assert cut["maps"]["weight"] == full["maps"]["weight"] and "w" in cut["maps"]["weight"]
    assert weights == 10   # 5 norms (2 layer norms, q_norm, k_norm, the final one), 5 linears (fused QKV, o_proj,
    # gate_up, down, lm_head)


@pytest.mark.parametrize("maps, where", [
    (5, "maps"),
    ({"x": {"w": [["a", 3, 1]]}}, "maps.x.w"),
    ({"x": {"2": {"leaf": "rlk:linear", "cols": [[0, 2]]}}}, "maps.x.2"),
    ({"x": {"1": {"leaf": "rlk:linear", "cols": [[0, "2"]], "width": 2, "rows": "in order"}}}, "maps.x.1"),
    ({"x": {"1": {"leaf": "rlk:linear", "cols": [[0, 2]], "width": -1, "rows": "in order"}}}, "maps.x.1"),
    ({1: {"w": []}}, "maps"),
    ({"x": {"huh": 1}}, "maps.x"),
])
def test_malformed_element_maps_are_refused(train, maps, where):
    side = json.loads(json.dumps(train))
    side["entries"][0]["graph"]["forward"][0]["maps"] = maps
    with pytest.raises(SideFormatError, match=re.escape(f"forward[0].{where} must be")):
        bind(side, side)
