"""Checks on compile/boundary.py (inspect_boundary) and compile/element_maps.py that a mutation-testing
pass (session 40) found missing: each test here failed on a deliberate breakage of the library that the
rest of the suite let through (leaks of the backward graph, rlk calls outside the graphs counted per
call, casts as leaks, sign of zero in the eager comparison, producers through computing ops, layer
labels, a norm's weight in its label, and element maps of transposed, bit-cast, column-concatenated,
packed, shifted-bias, column-sliced or randomly picked arguments)."""
import json
import types

import torch

import rlk_ops
from rlk_ops.compile import element_maps
from rlk_ops.compile.boundary import eager_outputs, inspect_boundary


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _mod(**params):
    mod = torch.nn.Module()
    for name, t in params.items():
        mod.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return mod


def _fwd(fn, mod, *args):
    with torch.no_grad():
        return inspect_boundary(types.MethodType(fn, mod), *args, backward=False).forward


# ------------------------------------------------------------------ boundary report
def test_backward_leaks_are_reported_as_the_backward_graphs():
    """A computing node outside the rlk ops leaks in both graphs: the backward's mul is a leak too, and is
    attributed to the backward graph (not dropped, not named forward)."""
    w = torch.nn.Parameter(torch.randn(8, 16, generator=_g()))

    def fn(x):
        return rlk_ops.linear(x, w) * 3.0

    report = inspect_boundary(fn, torch.randn(4, 16, generator=_g(1)), backward=True)
    assert report.backward_ops, "a backward ran"
    graphs = sorted({leak.graph for leak in report.leaks})
    assert graphs == ["backward", "forward"]
    assert [leak.target for leak in report.leaks if leak.graph == "forward"] == ["aten.mul.Tensor"]


def test_rlk_calls_outside_the_graphs_are_counted_per_call():
    """Two linear calls in a frame Dynamo may not compile (torch.compiler.disable), one in the graph: two
    calls outside, not zero (the capture's record counts calls; a record is not one call)."""
    w = torch.randn(16, 16, generator=_g())

    @torch.compiler.disable
    def outside(x):
        return rlk_ops.linear(rlk_ops.linear(x, w), w)

    def fn(x):
        return rlk_ops.linear(outside(x), w)

    with torch.no_grad():
        report = inspect_boundary(fn, torch.randn(4, 16, generator=_g(1)), backward=False)
    assert report.forward_ops == ["rlk::linear"]
    assert report.outside_calls == {"rlk::linear": 2}
    assert "rlk calls outside the reported graphs" in report.table()


def test_a_cast_inside_the_boundary_is_a_leak():
    """``.to(bfloat16)`` of an fp32 activation rounds: a leak (aten._to_copy), not movement."""
    w = torch.randn(8, 16, generator=_g()).bfloat16()

    def fn(x):
        return rlk_ops.linear(x.to(torch.bfloat16), w)

    with torch.no_grad():
        report = inspect_boundary(fn, torch.randn(4, 16, generator=_g(1)), backward=False)
    assert [leak.target for leak in report.leaks] == ["aten._to_copy.default"]
    assert "_to_copy" not in report.movement_nodes


def test_eager_comparison_tells_minus_zero_from_plus_zero():
    """Bitwise means bitwise: an output that is -0.0 compiled and +0.0 eagerly is not equal."""
    nw = torch.ones(8)

    def fn(x):
        sign = -1.0 if torch.compiler.is_compiling() else 1.0
        return rlk_ops.qk_rmsnorm(x, nw, 1e-6), torch.zeros(3) * sign

    x = torch.randn(2, 2, 8, generator=_g())
    with torch.no_grad():
        report = inspect_boundary(fn, x, backward=False, eager=eager_outputs(fn, (x,)))
    assert report.eager_equal is False and report.eager_note == "outputs"


def test_a_producer_is_not_followed_through_a_computing_node():
    """``qk_rmsnorm((y * 2).view(...))``: its input is the mul's output, not the linear's."""
    w, nw = torch.randn(16, 8, generator=_g()), torch.ones(4)

    def fn(x):
        y = rlk_ops.linear(x, w)
        a = rlk_ops.qk_rmsnorm(y.view(3, 4, 4), nw, 1e-6)
        b = rlk_ops.qk_rmsnorm((y * 2).view(3, 4, 4), nw, 1e-6)
        return a, b

    with torch.no_grad():
        report = inspect_boundary(fn, torch.randn(3, 8, generator=_g(1)), backward=False)
    lin, a, b = report.forward
    assert a.producers["x"] == [0, 0]
    assert b.producers["x"] is None


def _attn_inputs():
    g = _g(2)
    q, k, v = (torch.randn(6, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    return q, k, v, cu


def test_attentions_second_output_is_named_as_the_lse():
    """A consumer of attention's lse: its producer is output 1 and its element map's leaf is
    ``rlk:attention.lse``, not the attention output."""
    q, k, v, cu = _attn_inputs()
    out, lse = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    w = torch.randn(4, lse.shape[-1], generator=_g(3), dtype=lse.dtype)

    def fn(self, q, k, v):
        o, l = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
        return rlk_ops.linear(l, self.w), o

    attn, lin = _fwd(fn, _mod(w=w), q, k, v)
    assert lin.producers["x"] == [0, 1]
    assert lin.maps["x"]["1"]["leaf"].startswith("rlk:attention.lse@L0")


def test_layer_labels_count_attention_calls_across_a_graph_break():
    """A projection after the first attention is layer 1 (``@L1``), in the same graph or after a break."""
    q, k, v, cu = _attn_inputs()
    w, nw = torch.randn(8, 16, generator=_g(4)), torch.ones(4)

    def same(self, q, k, v):
        o, _ = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
        y = rlk_ops.linear(o.reshape(6, 16), self.w)
        return rlk_ops.qk_rmsnorm(y.view(6, 2, 4), self.nw, 1e-6)

    def broken(self, q, k, v):
        o, _ = rlk_ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
        torch._dynamo.graph_break()
        y = rlk_ops.linear(o.reshape(6, 16), self.w)
        return rlk_ops.qk_rmsnorm(y.view(6, 2, 4), self.nw, 1e-6)

    for fn in (same, broken):
        norm = _fwd(fn, _mod(w=w, nw=nw), q, k, v)[-1]
        assert norm.maps["x"]["2"]["leaf"].startswith("rlk:linear@L1("), (fn.__name__, norm.maps["x"])


def test_a_norm_output_names_its_weight():
    """A projection of a norm's output reads ``rlk:qk_rmsnorm@L0(<the norm's weight>)``."""
    w, nw = torch.randn(4, 8, generator=_g()), torch.ones(4)

    def fn(self, x):
        n = rlk_ops.qk_rmsnorm(x, self.norm_w, 1e-6)
        return rlk_ops.linear(n.reshape(3, 8), self.w)

    norm, lin = _fwd(fn, _mod(w=w, norm_w=nw), torch.randn(3, 2, 4, generator=_g(1)))
    assert norm.sources["weight"] == "norm_w"
    assert lin.maps["x"]["1"] == {"leaf": "rlk:qk_rmsnorm@L0(norm_w)", "cols": [[0, 8]], "width": 8,
                                  "rows": "in order"}


# ------------------------------------------------------------------ element maps
def test_a_weight_cast_through_float16_to_bfloat16_is_lossy():
    """fp16 -> bf16 rounds (bf16 has fewer mantissa bits): the cast is named on the weight."""
    nw = torch.ones(4, dtype=torch.float16)

    def fn(self, x):
        return rlk_ops.qk_rmsnorm(x, self.norm_w.to(torch.bfloat16).to(torch.float32), 1e-6)

    (norm,) = _fwd(fn, _mod(norm_w=nw), torch.randn(3, 2, 4, generator=_g(1)))
    assert norm.maps["weight"] == {"w": [["norm_w via lossy casts float16->bfloat16", 0, 4]]}
    assert element_maps.holds(torch.float32, torch.bfloat16) and not element_maps.holds(torch.bfloat16,
                                                                                         torch.float16)


def test_a_weight_concatenated_along_its_columns_is_interleaved():
    """``cat([A, B], dim=1)``: each row is A's row then B's, not all of A then all of B."""
    a, b = torch.randn(4, 3, generator=_g()), torch.randn(4, 5, generator=_g(1))

    def fn(self, x):
        return rlk_ops.linear(x, torch.cat([self.a, self.b], 1))

    (lin,) = _fwd(fn, _mod(a=a, b=b), torch.randn(2, 8, generator=_g(2)))
    want = []
    for i in range(4):
        want += [["a", 3 * i, 3 * i + 3], ["b", 5 * i, 5 * i + 5]]
    assert lin.maps["weight"] == {"w": want}


def test_a_transposed_weight_is_not_the_weight():
    """``w.t()``: element (i, j) is w's (j, i), one-element runs, and its source says the permute."""
    w = torch.randn(8, 4, generator=_g())

    def fn(self, x):
        return rlk_ops.linear(x, self.w.t())

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(2, 8, generator=_g(1)))
    want = [["w", j * 4 + i, j * 4 + i + 1] for i in range(4) for j in range(8)]
    assert lin.maps["weight"] == {"w": want}
    assert lin.sources["weight"] == "w.permute(1, 0)"


def test_packed_runs_split_at_the_parts_and_keep_their_casts():
    label = element_maps.packed_label([("q", 4), ("k", 4), ("v", 2)])
    assert element_maps._unpack([[label, 2, 9]]) == [["q", 2, 4], ["k", 0, 4], ["v", 0, 1]]
    lossy = label + " via lossy casts float32->float16"
    assert element_maps._unpack([[lossy, 3, 5], ["other", 0, 2]]) == [
        ["q via lossy casts float32->float16", 3, 4], ["k via lossy casts float32->float16", 0, 1],
        ["other", 0, 2]]


def test_one_weight_reached_with_and_without_a_lossy_cast_is_unresolved():
    """``cat([w, w.half().float()])``: the same parameter's elements with two names cannot be written
    as one; the map is unresolved rather than naming both halves alike."""
    w = torch.randn(2, 8, generator=_g())

    def fn(self, x):
        return rlk_ops.linear(x, torch.cat([self.w, self.w.half().float()]))

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(3, 8, generator=_g(1)))
    assert "different lossy casts" in lin.maps["weight"]["unresolved"]


def test_a_weight_viewed_as_another_dtype_is_computed():
    """``w.view(torch.float16)`` of a bf16 weight reinterprets its bits: not the weight's elements."""
    w = torch.randn(4, 8, generator=_g()).bfloat16()

    def fn(self, x):
        return rlk_ops.linear(x, self.w.view(torch.float16))

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(2, 8, generator=_g(1)).half())
    assert "w" not in lin.maps["weight"] and "weight" not in lin.sources
    assert lin.maps["weight"]["1"]["leaf"].startswith("computed:aten.view.dtype")


def test_a_shifted_bias_is_named_with_its_shift():
    """bias ``cat([b[1:], b[:1]])``: column c adds b's element c + 1, said as ``@+1`` in the product's
    columns."""
    w, b, nw = torch.randn(4, 8, generator=_g()), torch.randn(4, generator=_g(1)), torch.ones(2)

    def fn(self, x):
        y = rlk_ops.linear(x, self.w, torch.cat([self.b[1:], self.b[:1]]))
        return rlk_ops.qk_rmsnorm(y.view(3, 2, 2), self.nw, 1e-6)

    lin, norm = _fwd(fn, _mod(w=w, b=b, nw=nw), torch.randn(3, 8, generator=_g(2)))
    assert norm.maps["x"]["2"]["cols"] == [["w + b@+1", 0, 3], ["w + b@-3", 3, 4]]


def test_a_weight_that_is_not_whole_rows_names_no_rows():
    """A [4, 8] weight cut from w's flat elements 2:34 is not rows 0:4 of w: no product columns."""
    w, nw = torch.randn(5, 8, generator=_g()), torch.ones(2)

    def fn(self, x):
        y = rlk_ops.linear(x, self.w.reshape(-1)[2:34].reshape(4, 8))
        return rlk_ops.qk_rmsnorm(y.view(3, 2, 2), self.nw, 1e-6)

    lin, norm = _fwd(fn, _mod(w=w, nw=nw), torch.randn(3, 8, generator=_g(2)))
    assert lin.maps["weight"] == {"w": [["w", 2, 34]]}
    leaf = norm.maps["x"]["2"]["leaf"]
    assert "weight [['w', 2, 34]]" in leaf and not element_maps.labelled(norm.maps["x"]["2"])


def test_a_random_pick_is_not_fixed_by_the_graph():
    """``x[torch.randperm(5)]`` draws its rows: a computing node, not a pick evaluated once."""
    w = torch.randn(2, 8, generator=_g())

    def fn(self, x):
        return rlk_ops.linear(x[torch.randperm(5)], self.w)

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(5, 8, generator=_g(1)))
    assert lin.maps["x"]["1"]["leaf"].startswith("computed:aten.index.Tensor"), lin.maps["x"]


def test_a_computing_node_is_labelled_with_its_dtype():
    """The same op on the same elements in fp32 and in bf16 computes other numbers: other labels."""
    def label(dtype):
        w = torch.randn(2, 8, generator=_g()).to(dtype)

        def fn(self, x):
            return rlk_ops.linear(x * 2, self.w)
        (lin,) = _fwd(fn, _mod(w=w), torch.randn(3, 8, generator=_g(1)).to(dtype))
        return lin.maps["x"]["1"]["leaf"]

    a, b = label(torch.float32), label(torch.bfloat16)
    assert a.startswith("computed:aten.mul.Tensor#") and b.startswith("computed:aten.mul.Tensor#") and a != b


def test_one_column_of_a_leaf_row_keeps_the_leafs_row_width():
    """``x[:, 2:3]`` read as rows of its last dim: column 2 of each of x's rows of 8, in order."""
    w = torch.randn(2, 1, generator=_g())

    def fn(self, x):
        return rlk_ops.linear(x[:, 2:3], self.w)

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(5, 8, generator=_g(1)))
    assert lin.maps["x"]["1"] == {"leaf": "input:l_x_", "cols": [[2, 3]], "width": 8, "rows": "in order"}


def test_positions_from_two_inputs_one_reordered_are_mixed():
    """``cat([p[[1, 0]], r])``: not the two leaves whole one after another."""
    h, w = torch.randn(4, 2, 8, generator=_g()), torch.ones(8)

    def fn(self, h, p, r):
        pos = torch.cat([p[torch.tensor([1, 0])], r])
        return rlk_ops.rope(rlk_ops.qk_rmsnorm(h, self.w, 1e-6), pos, 1e4, 8)

    norm, rope = _fwd(fn, _mod(w=w), h, torch.arange(2), torch.arange(2, 4))
    assert "mixed" in rope.maps["positions"]["0"], rope.maps["positions"]


def test_index_select_along_the_last_dim_picks_columns():
    w = torch.randn(2, 4, generator=_g())

    def fn(self, x):
        return rlk_ops.linear(torch.index_select(x, 1, torch.tensor([0, 2, 4, 6])), self.w)

    (lin,) = _fwd(fn, _mod(w=w), torch.randn(5, 8, generator=_g(1)))
    assert lin.maps["x"]["1"] == {"leaf": "input:l_x_", "cols": [[0, 1], [2, 3], [4, 5], [6, 7]], "width": 8,
                                  "rows": "in order"}


def test_a_mutating_ops_cache_arguments_are_read_through_auto_functionalized():
    """auto_functionalized_v2 passes a mutated tensor as an index into ``_all_bases``: paged_kv_append's
    caches are still named (sources) and mapped, as its other tensor arguments are."""
    from rlk_ops.compile import Qwen3Attention
    from rlk_ops.compile.examples import decode_batch, init_block

    block = init_block(Qwen3Attention(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32))
    with torch.no_grad():
        report = inspect_boundary(block.forward_rollout, *decode_batch(block, [3]), backward=False)
    (append,) = [n for n in report.forward if n.op == "rlk::paged_kv_append"]
    assert {"k_cache", "v_cache"} <= set(append.sources) and {"k_cache", "v_cache"} <= set(append.maps)
    assert append.sources["k_cache"] != append.sources["v_cache"]


# ------------------------------------------------------------------ outputs and writes
def test_output_maps_are_the_user_outputs_only():
    """With a backward, AOT's forward graph also returns what the backward keeps: the entry's outputs are
    the user outputs alone (one here: the linear's)."""
    w = torch.nn.Parameter(torch.randn(8, 16, generator=_g()))
    mod = torch.nn.Module()
    mod.w = w

    def fn(self, x):
        return rlk_ops.linear(x, self.w)

    report = inspect_boundary(types.MethodType(fn, mod), torch.randn(4, 16, generator=_g(1)), backward=True)
    assert report.backward_ops, "a backward ran"
    assert len(report.output_maps) == 1 and report.output_maps[0]["1"]["leaf"].startswith("rlk:linear@L0(")


def test_a_graph_after_the_last_rlk_op_leaves_the_outputs_unknown():
    """What a graph after a break makes of the last rlk op's output is not in the maps: None, and why."""
    w = torch.randn(8, 16, generator=_g())

    def fn(x):
        y = rlk_ops.linear(x, w)
        torch._dynamo.graph_break()
        return y * 2

    with torch.no_grad():
        report = inspect_boundary(fn, torch.randn(4, 16, generator=_g(1)), backward=False)
    assert report.graphs == 2
    assert report.output_maps is None and "graph break" in report.outputs_note


def test_write_maps_name_a_copy_into_an_input_and_only_that():
    """``cache.copy_(y)`` writes a graph input: the copy_ into it is mapped (the linear's output), besides the
    mutated input AOT returns. A copy into a fresh buffer writes no input."""
    w = torch.randn(8, 16, generator=_g())

    def into_input(x, cache):
        y = rlk_ops.linear(x, w)
        cache.copy_(y)
        return y

    def into_buffer(x):
        buf = torch.empty(x.shape)
        buf.copy_(x)
        return rlk_ops.linear(buf, w)

    x = torch.randn(4, 16, generator=_g(1))
    with torch.no_grad():
        report = inspect_boundary(into_input, x, torch.zeros(4, 8), backward=False)
        leaves = [m["1"]["leaf"] for m in report.write_maps]
        assert [x for x in leaves if x.startswith("rlk:")] == [
            "rlk:linear@L0(x: graph input whole; weight graph input whole)"], leaves
        assert inspect_boundary(into_buffer, x, backward=False).write_maps == []


def test_kv_cache_leaves_name_k_and_v():
    assert element_maps.leaf_name("paged_kv_append", 1, "@L0") == "rlk:kv_cache.k@L0"
    assert element_maps.leaf_name("paged_kv_append", 2) == "rlk:kv_cache.v"
    assert element_maps.leaf_name("attention_fwd", 0, "@L2") == "rlk:attention@L2"


def test_as_strided_over_an_input_that_starts_inside_its_storage_is_unresolved():
    """``x.as_strided(..., storage_offset=0)`` with x = base[2:] reads base's rows 0:2, elements outside x:
    the coordinates (x's own, from 0) cannot say so, so the map is unresolved."""
    w, base = torch.randn(2, 4, generator=_g()), torch.randn(6, 4, generator=_g(1))

    def fn(x):
        return rlk_ops.linear(x.as_strided((2, 4), (4, 1), 0), w)

    with torch.no_grad():
        (lin,) = inspect_boundary(fn, base[2:], backward=False).forward
    assert "not contiguous from offset 0" in lin.maps["x"]["unresolved"]
