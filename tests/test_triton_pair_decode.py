"""rlk_ops/kernels/triton/pair_decode.py: canonical:C decode pairs in FA4's arithmetic.

On the GPU (``cuda``): every pair's out and lse equal FA4's own pair call (the route it
replaces), for page sizes 16 and 128, several C, batches, lengths on and off block and chunk
boundaries, empty pairs, and inputs with a wide exponent range (subnormal exponentials).
On the Triton interpreter (TRITON_INTERPRET=1, triton importable; CI has no triton): the
kernel equals a torch transcription of the documented steps bit for bit, row sums included,
which checks the block order, the masking, the paging and the per-thread summation order
(the interpreter has no PTX approximations: both sides use its exp2/log2, 1/x).
"""
import math
import os

import pytest
import torch

from conftest import bitwise_equal

triton = pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HQ, HKV, D, G = 16, 4, 128, 4


def _inputs(lens, ps, seed, device, wide=False, hq=HQ):
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    per = -(-max(lens) // ps) + 2                 # padding entries past every sequence
    pages = bsz * per + 3
    scale = 2.0 ** torch.randint(-6, 5, (pages, ps, HKV, 1), generator=gen) if wide else 1.0
    kc = (torch.randn(pages, ps, HKV, D, generator=gen) * scale).to(torch.bfloat16)
    vc = torch.randn(pages, ps, HKV, D, generator=gen).to(torch.bfloat16)
    table = torch.randperm(pages, generator=gen)[:bsz * per].view(bsz, per).to(torch.int32)
    for b, n in enumerate(lens):
        table[b, -(-n // ps):] = -7               # never read
    q = (torch.randn(bsz, 1, hq, D, generator=gen) * (4.0 if wide else 1.0)).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, table, sl)]


def poison(kc, vc, table, lens, ps):
    """NaN in every cache slot past a sequence in its last page (kernels that read whole tiles
    must mask them)."""
    for b, n in enumerate(lens):
        if n % ps:
            last = int(table[b, n // ps])
            kc[last, n % ps:] = math.nan
            vc[last, n % ps:] = math.nan


def _option_id(value):
    """Test ids name the kernel options (``-k ahead``, ``-k l2_prefetch``) and launch configs
    (``-k 4x1x128``)."""
    if isinstance(value, dict):
        return "+".join(value) or "plain"
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return None


# --------------------------------------------------------------- interpreter
def _transcribed(q, k, v, n_keys, scale):
    """The kernel docstring's steps in torch, one IEEE op at a time (q [G, D], k/v [L, D])."""
    from rlk_ops.kernels.triton.pair_decode import BLOCK_N, scale_log2

    sl2 = torch.tensor(scale_log2(scale), dtype=torch.float32)
    nb = -(-n_keys // BLOCK_N)
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, nb * BLOCK_N - n_keys))
    vp = torch.nn.functional.pad(v.float(), (0, 0, 0, nb * BLOCK_N - n_keys))
    cols = torch.tensor([[8 * j + 2 * t + e for j in range(16) for e in range(2)] for t in range(4)])
    m = torch.full((G,), -math.inf)
    part = torch.zeros(G, 4)
    o = torch.zeros(G, D)
    for j in range(nb - 1, -1, -1):
        s = q.float() @ kp[j * BLOCK_N:(j + 1) * BLOCK_N].T
        s[:, torch.arange(BLOCK_N) >= n_keys - j * BLOCK_N] = -math.inf
        prev, m = m, torch.maximum(s.max(dim=1).values, m)
        cur = torch.where(m == -math.inf, torch.zeros_like(m), m)
        arg = (s.double() * sl2.double() - (cur * sl2).double()[:, None]).float()  # one rounding: fma
        p = torch.exp2(arg)
        r = torch.exp2((prev - cur) * sl2)
        part = part * r[:, None]
        for kk in range(32):
            part = part + p[:, cols[:, kk]]
        o = o * r[:, None] + p.to(torch.bfloat16).float() @ vp[j * BLOCK_N:(j + 1) * BLOCK_N]
    total = (part[:, 0] + part[:, 1]) + (part[:, 2] + part[:, 3])
    out = (o * (1.0 / total)[:, None]).to(torch.bfloat16)
    import numpy as np

    lg2 = torch.from_numpy(np.log2(total.numpy()))  # the interpreter's log2 (numpy, fp32)
    lse = ((m.double() * sl2.double() + lg2.double()).float()) * math.log(2.0)
    return out, lse, total


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)")
@pytest.mark.parametrize("ps,chunk,lens", [(16, 256, [300, 129, 1]), (128, 256, [520, 256, 17]),
                                           (16, 128, [5, 130, 260])])
@pytest.mark.parametrize("layout,prefetch,extra", [
    ("rows", None, {}), ("keys", 0, {}), ("keys", 1, {}), ("keys", 2, {}), ("keys", 3, {}), ("tile", None, {}),
    ("keys", 0, {"ahead": True}), ("keys", 3, {"ahead": True}), ("keys", 3, {"ahead": True, "l2_prefetch": True}),
    ("keys", 3, {"slices": 4}), ("keys", 0, {"slices": 2, "ahead": True}), ("keys", 3, {"slices": 8, "heads_first": True}),
    ("keys", 3, {"state_evict": "evict_last", "heads_first": True}), ("keys", 3, {"early_table": True}),
    ("keys", 2, {"early_table": True, "slices": 2, "heads_first": True})],
    ids=_option_id)
def test_interpreter_matches_the_transcribed_steps(ps, chunk, lens, layout, prefetch, extra):
    """Exact scores (integers in [-12, 0], a 0 in every block, scale_log2 = 1) and small-integer
    values make every exponential, product and sum exact, so neither the interpreter's math
    library nor its BLAS decides a bit: the row sums, out and lse must equal the transcription
    bit for bit (which keys, masks, blocks and steps the kernel takes); empty pairs give out 0,
    lse -inf. The rounding order itself is checked against FA4 on the GPU (the CUDA tests)."""
    _check_transcribed(ps, chunk, lens, layout, prefetch, extra)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)")
@pytest.mark.parametrize("ps,chunk,lens", [(128, 256, [520, 256, 17]), (256, 512, [700, 512, 3, 0, 1300])])
@pytest.mark.parametrize("extra", [{}, {"slices": 2}, {"ahead": True}, {"slices": 4, "heads_first": True}],
                         ids=_option_id)
def test_interpreter_tma_tiles_match_the_transcribed_steps(ps, chunk, lens, extra):
    """prefetch 4 (K and V tiles by tensor descriptor, pages a multiple of 128 keys) gives the
    transcription's bits too, with NaN in every cache slot past a sequence in its last page (a
    TMA tile reads them: the scores there are masked and V's rows zeroed)."""
    _check_transcribed(ps, chunk, lens, "keys", 4, extra, poison=True)


def _check_transcribed(ps, chunk, lens, layout, prefetch, extra, poison=False):
    from rlk_ops.kernels.triton.pair_decode import BLOCK_N, pair_decode, scale_log2

    q, kc, vc, table, sl = _inputs(lens, ps, seed=1, device="cpu")
    gen = torch.Generator().manual_seed(2)
    q = torch.zeros_like(q)
    q[..., 0] = 1.0
    kc = torch.zeros_like(kc)
    kc[..., 0] = -torch.randint(0, 13, kc.shape[:3], generator=gen).to(torch.bfloat16)
    # small integers: every P @ V sum is exact (multiples of 2**-12 below 2**11), whatever its order;
    # the interpreter's tl.dot is numpy's matmul, whose order follows the machine's BLAS kernel
    # (session 17: random bf16 values gave 1-ulp differences on an AVX2 machine, none on AVX-512)
    vc = torch.randint(-4, 5, vc.shape, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.log2(math.e)
    assert scale_log2(scale) == 1.0
    rows = kc.view(-1, HKV, D)
    for b, n in enumerate(lens):  # a 0 score at every block start of every chunk
        for start in range(0, n, BLOCK_N):
            rows[int(table[b, start // ps]) * ps + start % ps, :, 0] = 0.0
        if poison and n % ps:  # the rest of the sequence's last page
            last = int(table[b, n // ps]) * ps
            rows[last + n % ps:last + ps] = math.nan
            vc.view(-1, HKV, D)[last + n % ps:last + ps] = math.nan
    result = pair_decode(q, kc, vc, table, sl, scale, chunk, sums=True, layout=layout, prefetch=prefetch, **extra)
    compare_with_transcription(result, q, rows, vc, table, lens, ps, chunk, scale)


def compare_with_transcription(result, q, rows, vc, table, lens, ps, chunk, scale):
    """pair_decode's ``(out, lse, pair lengths, chunks, row sums)`` (``sums=True``) against
    ``_transcribed`` for every non-empty pair and KV head, bit for bit; empty pairs give out 0, lse -inf.
    ``rows``: the K cache viewed as [slots, HKV, D]."""
    out, lse, plens, n_chunks, sums = result
    for c in range(n_chunks):
        for b, n in enumerate(lens):
            p, length = c * len(lens) + b, max(0, min(n - c * chunk, chunk))
            assert int(plens[p]) == length
            if length == 0:
                assert bool((out[p] == 0).all()) and bool((lse[p] == -math.inf).all())
                continue
            pos = c * chunk + torch.arange(length)
            idx = table[b, pos // ps].long() * ps + pos % ps
            for h in range(HKV):
                o, l, total = _transcribed(q[b, 0, h * G:(h + 1) * G], rows[idx, h], vc.view(-1, HKV, D)[idx, h],
                                           length, scale)
                assert bitwise_equal(sums[p, h * G:(h + 1) * G], total), (c, b, h)
                assert bitwise_equal(out[p, 0, h * G:(h + 1) * G], o), (c, b, h)
                assert bitwise_equal(lse[p, h * G:(h + 1) * G, 0], l), (c, b, h)


def _merged_both_ways(q, kc, vc, table, sl, scale, chunk, **kw):
    """The fused launch's merged (out, lse) and the merge op over the same launch's states."""
    from rlk_ops.kernels.triton.merge import merge_attn_states
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    out, lse, plens, n, m_out, m_lse = pair_decode(q, kc, vc, table, sl, scale, chunk, layout="keys", merge=True,
                                                   **kw)
    bsz = q.shape[0]
    ref_out, ref_lse = merge_attn_states(out.view(n, bsz, 1, HQ, D), lse.view(n, bsz, HQ, 1),
                                         state_lens=plens.view(n, bsz))
    return (m_out, m_lse), (ref_out, ref_lse)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)")
@pytest.mark.parametrize("seq_major", [False, True])
def test_interpreter_fused_merge_equals_the_merge_op(seq_major, monkeypatch):
    """merge=True: the last program of each (sequence, KV head) merges the chunk states with
    the merge op's steps, states side by side (head_dim in several slices here: VEC_TILE
    shrunk), programs in chunk- or sequence-major order; twice in a row (the counters are left
    at zero for the next launch)."""
    from rlk_ops.kernels.triton import pair_decode as pd

    monkeypatch.setattr(pd, "VEC_TILE", 1024)   # 5 chunks: NP 8, DSL 32 (4 slices of head_dim)
    q, kc, vc, table, sl = _inputs([300, 129, 1, 520], 16, seed=4, device="cpu")
    for _ in range(2):
        (m_out, m_lse), (ref_out, ref_lse) = _merged_both_ways(q, kc, vc, table, sl, D ** -0.5, 128, prefetch=2,
                                                               seq_major=seq_major)
        assert bitwise_equal(m_out, ref_out) and bitwise_equal(m_lse, ref_lse)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)")
def test_interpreter_sequence_major_order_changes_no_state():
    """seq_major=True runs the programs in another order and stores every state in the same
    place: out, lse and pair lengths equal the chunk-major launch's, heads_first or not."""
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    q, kc, vc, table, sl = _inputs([300, 129, 1, 520], 16, seed=5, device="cpu")
    ref = pair_decode(q, kc, vc, table, sl, D ** -0.5, 128, layout="keys", prefetch=3)
    for heads_first in (False, True):
        got = pair_decode(q, kc, vc, table, sl, D ** -0.5, 128, layout="keys", prefetch=3, seq_major=True,
                          heads_first=heads_first)
        assert got[3] == ref[3] and all(bitwise_equal(a, b) for a, b in zip(got[:3], ref[:3]))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)")
@pytest.mark.parametrize("ps,chunk", [(16, 128), (16, 256), (128, 256), (16, 1 << 20), (128, 1 << 20)])
def test_interpreter_decode_layout_equals_the_cpu_layout(ps, chunk):
    """merge.decode_pairs (one launch) lays out the pairs as cpu.canonical.decode_pairs: the
    same pair table, lengths and N, the query copied per pair, kernel lengths max(len, 1);
    a chunk wider than the table (C = 2^20) takes the table's width, not C / page_size."""
    from rlk_ops.kernels.cpu import canonical
    from rlk_ops.kernels.triton.merge import decode_pairs

    q, _, _, table, sl = _inputs([300, 129, 1, 520, 0], ps, seed=ps + chunk % 1000, device="cpu")
    qp, ptab, plens, klens, n = decode_pairs(q, table, sl, ps, chunk)
    ref_tab, ref_lens, n_ref = canonical.decode_pairs(table, sl, ps, chunk)
    assert n == n_ref and ptab.shape[1] == min(chunk // ps, table.shape[1])
    assert bitwise_equal(ptab, ref_tab) and bitwise_equal(plens, ref_lens)
    assert bitwise_equal(klens, ref_lens.clamp(min=1))
    assert bitwise_equal(qp.view(n, *q.shape), q[None].expand(n, *q.shape))


def test_decode_launch_splits_the_head_dim_only_within_one_wave(monkeypatch):
    """The measured rule (pair_decode.decode_launch, SLICES_ONE_WAVE, PDL_ONE_WAVE): 8 warps and
    2 head-dim slices while twice the programs fit one per SM, 8 warps up to one wave, then 4
    warps with one pair's heads adjacent; the merge by PDL up to one wave; SLICES_ONE_WAVE = 1
    turns the slices off; PDL_ONE_WAVE off leaves PDL to merge.PDL everywhere."""
    from rlk_ops.kernels.triton import merge as tm
    from rlk_ops.kernels.triton import pair_decode as pd

    cpu = torch.device("cpu")   # 4 "SMs" off CUDA
    one_wave = {"config": (8, 3), "heads_first": False, "pdl": True, "state_evict": "",
                "early_table": pd.EARLY_TABLE_ONE_WAVE}
    assert pd.decode_launch(2, cpu) == {**one_wave, "slices": 2}
    assert pd.decode_launch(3, cpu) == {**one_wave, "slices": 1}
    assert pd.decode_launch(4, cpu)["slices"] == 1
    assert pd.decode_launch(5, cpu) == {"config": (4, 2), "heads_first": True, "slices": 1, "pdl": False,
                                        "state_evict": "", "early_table": False}
    for early in (True, False):   # the early page table follows EARLY_TABLE_ONE_WAVE, within one wave only
        monkeypatch.setattr(pd, "EARLY_TABLE_ONE_WAVE", early)
        assert pd.decode_launch(4, cpu)["early_table"] is early and pd.decode_launch(5, cpu)["early_table"] is False
    monkeypatch.setattr(pd, "SLICES_ONE_WAVE", 1)
    assert pd.decode_launch(2, cpu)["slices"] == 1
    monkeypatch.setattr(pd, "PDL_ONE_WAVE", False)
    assert pd.decode_launch(2, cpu)["pdl"] is False and pd.decode_launch(5, cpu)["pdl"] is False
    monkeypatch.setattr(tm, "PDL", True)
    assert pd.decode_launch(2, cpu)["pdl"] is True and pd.decode_launch(5, cpu)["pdl"] is True


def test_decode_launch_keeps_small_states_in_l2_past_one_wave(monkeypatch):
    """STATE_EVICT_MAX_BYTES: past one wave, states of at most that many bytes are stored
    evict_last; larger ones, unknown sizes (0) and one-wave launches store plainly; 0 turns it
    off. ``state_bytes`` counts out and lse of every pair."""
    from rlk_ops.kernels.triton import pair_decode as pd

    cpu = torch.device("cpu")   # 4 "SMs" off CUDA
    q = torch.zeros((64, 1, 16, 128), dtype=torch.bfloat16)
    assert pd.state_bytes(q, 11) == 11 * 64 * 16 * (128 * 2 + 4)
    limit = pd.STATE_EVICT_MAX_BYTES
    assert pd.decode_launch(5, cpu, limit)["state_evict"] == "evict_last"
    assert pd.decode_launch(5, cpu, limit + 1)["state_evict"] == ""
    assert pd.decode_launch(5, cpu)["state_evict"] == ""
    assert pd.decode_launch(4, cpu, 1)["state_evict"] == ""
    assert pd.step_launch(q, torch.zeros((1, 16, 4, 128)), 11) == pd.decode_launch(11 * 64 * 4, cpu,
                                                                                   pd.state_bytes(q, 11))
    monkeypatch.setattr(pd, "STATE_EVICT_MAX_BYTES", 0)
    assert pd.decode_launch(5, cpu, 1)["state_evict"] == ""


def test_launch_constants_do_not_depend_on_the_chunk_count(monkeypatch):
    """A decode step's compile-time constants are the same whatever its number of chunks (a
    sequence growing past a chunk boundary must not compile the kernel again); only the fused
    merge specialises on it (its states side by side)."""
    from rlk_ops.kernels.triton import pair_decode as pd

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append({k: v for k, v in kw.items() if k.isupper()})

    monkeypatch.setattr(pd, "_pair_decode_keys", Recorder())
    q, kc, vc, _, sl = _inputs([5], 16, seed=5, device="cpu")
    for width in (8, 24, 72):   # 1, 3 and 9 chunks of 128 keys (pages of 16)
        table = torch.zeros((1, width), dtype=torch.int32)
        pd.pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=3, heads_first=True)
        pd.pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=3, merge=True)
    plain, fused = seen[0::2], seen[1::2]
    assert all(c == plain[0] for c in plain)
    assert len({(c["NMAX"], c["LOG_NP"], c["DSL"]) for c in fused}) == 3


def test_pdl_follows_the_merge_switch(monkeypatch):
    """The pair kernel lets the merge launch early (PDL) exactly when merge.PDL launches the merge
    that way (or ``pdl=`` says so); off, its compile-time constants are those of before."""
    from rlk_ops.kernels.triton import _common
    from rlk_ops.kernels.triton import merge as tm
    from rlk_ops.kernels.triton import pair_decode as pd

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append({k: v for k, v in kw.items() if k.isupper()})

    monkeypatch.setattr(pd, "_pair_decode_keys", Recorder())
    monkeypatch.setattr(_common, "INTERPRET", False)   # on the interpreter PDL is never passed
    q, kc, vc, table, sl = _inputs([5], 16, seed=5, device="cpu")
    for switch, pdl in ((False, None), (True, None), (True, False), (False, True)):
        monkeypatch.setattr(tm, "PDL", switch)
        pd.pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=3, pdl=pdl)
    assert [c.get("PDL", 0) for c in seen] == [0, 1, 0, 1]


def test_the_merge_follows_its_pdl_argument(monkeypatch):
    """merge_attn_states(pdl=...) launches the merge by PDL or not whatever merge.PDL says (the
    pair route passes decode_launch's choice); pdl=None follows merge.PDL; the kernel's PDL
    constant matches the launch."""
    from rlk_ops.kernels.triton import _common
    from rlk_ops.kernels.triton import merge as tm

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw.get("launch_pdl", False), kw["PDL"]))

    monkeypatch.setattr(tm, "_merge_vec", Recorder())
    monkeypatch.setattr(tm, "_merge_fwd", Recorder())
    monkeypatch.setattr(_common, "INTERPRET", False)
    n, bsz = 3, 2
    out = torch.zeros((n, bsz, 1, HQ, D), dtype=torch.bfloat16)
    lse = torch.zeros((n, bsz, HQ, 1), dtype=torch.float32)
    for switch, pdl in ((False, True), (True, False), (True, None), (False, None)):
        monkeypatch.setattr(tm, "PDL", switch)
        tm.merge_attn_states(out, lse, pdl=pdl)
        tm.merge_attn_states(out, lse, config=(16, 1, 0), vec=0, pdl=pdl)
    assert seen == [(True, True)] * 2 + [(False, False)] * 2 + [(True, True)] * 2 + [(False, False)] * 2


def test_the_merges_eager_default_is_per_kernel(monkeypatch):
    """Without config[4], _merge_vec takes merge.VEC_EAGER and the walk merge.EAGER_LOADS (each
    switch reaches only its own kernel); an explicit config[4] wins over both."""
    from rlk_ops.kernels.triton import merge as tm

    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((self.name, kw.get("EAGER", 0)))

    monkeypatch.setattr(tm, "_merge_vec", Recorder("vec"))
    monkeypatch.setattr(tm, "_merge_fwd", Recorder("walk"))
    out = torch.zeros((3, 2, 1, HQ, D), dtype=torch.bfloat16)
    lse = torch.zeros((3, 2, HQ, 1), dtype=torch.float32)
    for vec_eager, walk_eager in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(tm, "VEC_EAGER", vec_eager)
        monkeypatch.setattr(tm, "EAGER_LOADS", walk_eager)
        seen.clear()
        tm.merge_attn_states(out, lse)                                   # merge_route: _merge_vec
        tm.merge_attn_states(out, lse, config=(16, 1, 0), vec=0)         # the walk
        tm.merge_attn_states(out, lse, config=(1, 4, 0, 0, True))        # explicit eager on _merge_vec
        tm.merge_attn_states(out, lse, config=(16, 1, 0, 0, False), vec=0)
        assert seen == [("vec", int(vec_eager)), ("walk", int(walk_eager)), ("vec", 1), ("walk", 0)]


def test_the_op_route_hands_the_merge_its_launch(monkeypatch):
    """fa4 canonical.paged_attention on the Triton pair route, with the merge dispatch really hands
    over (the Triton backend's wrapper, kernels/triton/__init__.py): the merge is launched with the
    pair kernel's PDL choice (the wrapper forwards ``pdl``; until session 15 it dropped it, so the
    op never took the one-wave PDL merge). Kernels are recorded, not run, so this holds without a
    GPU."""
    from rlk_ops.kernels import triton as triton_backend
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.triton import merge as tm
    from rlk_ops.kernels.triton import pair_decode as pd

    bsz, chunk = 3, 256
    q, kc, vc, table, sl = _inputs([700, 5, 300], 16, seed=3, device="cpu")
    n = -(-table.shape[1] * 16 // chunk)
    calls, merges = [], []

    def pairs(q, k_cache, v_cache, page_table, seq_lens, scale, chunk_size, **kw):
        calls.append(kw)
        out = torch.zeros((n * bsz, HQ, D), dtype=q.dtype)
        lse = torch.zeros((n * bsz, HQ), dtype=torch.float32)
        lens = torch.ones((n * bsz,), dtype=torch.int32)
        return out, lse, lens, n

    def merge(out_parts, lse_parts, state_lens=None, config=None, vec=None, pdl=None):
        merges.append((state_lens is not None, pdl))
        return out_parts[0], lse_parts[0]

    monkeypatch.setattr(fa4_canonical, "kernel_for", lambda op, device: triton_backend.merge_attn_states)
    monkeypatch.setattr(fa4_canonical, "DECODE_PAIRS", "triton")
    monkeypatch.setattr(pd, "routable", lambda *a: True)
    monkeypatch.setattr(pd, "pair_decode", pairs)
    monkeypatch.setattr(tm, "merge_attn_states", merge)
    for pdl in (True, False):
        launch = {"config": (4, 2), "heads_first": True, "slices": 1, "pdl": pdl}
        monkeypatch.setattr(pd, "decode_launch", lambda *a, launch=launch: dict(launch))
        fa4_canonical.paged_attention(q, kc, vc, table, sl, 1.0, chunk, attend_paged=None)
        assert calls[-1] == {"layout": "keys", **launch} and merges[-1] == (True, pdl)
    assert len(calls) == len(merges) == 2


NEED_KEYS = "merge, l2_prefetch, ahead, slices, seq_major, pdl, state_evict and early_table need layout='keys'"


@pytest.mark.skipif(INTERPRET, reason="never routable on the interpreter")
def test_routable_only_where_the_gpu_checked_the_bits():
    """Until session 29 routable took G up to 8 and any page size dividing C, but the CUDA tests
    ran G = 4 and pages 16, 128, 256 only (review): other shapes take the FA4 pair route. Since
    session 30 also G = 1, 2, 5, 8 at pages 16 and 128 (test_cuda_pairs_at_other_group_sizes
    passed on an H100), not at 256 (not run there)."""
    from rlk_ops.kernels.triton.pair_decode import routable

    def case(hq=16, hkv=4, page=16, chunk=768, sq=1, arch="sm90"):
        return routable(torch.empty(2, sq, hq, 128, dtype=torch.bfloat16),
                        torch.empty(64, page, hkv, 128, dtype=torch.bfloat16), chunk, arch)

    assert case() and case(page=128) and case(page=256, chunk=1024) and case(hq=32, hkv=8)
    # sm90 only: the kernel transcribes FA4's SM90 arithmetic (a session 34 audit: sm80 and sm100 took it)
    assert not case(arch="sm80") and not case(arch="sm100") and not case(arch=None)
    for hq in (32, 8, 4, 20):   # G = 8, 2, 1, 5
        assert case(hq=hq) and case(hq=hq, page=128, chunk=1024) and not case(hq=hq, page=256, chunk=1024)
    assert not case(hq=12) and not case(hq=48)   # G = 3, 12: never checked
    assert not case(page=1) and not case(page=32) and not case(page=64) and not case(sq=2)


def test_bad_arguments_are_named():
    """Checked before any launch (wherever triton imports): the argument, what it must be and
    what it was."""
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    q, kc, vc, table, sl = _inputs([5], 16, seed=5, device="cpu")
    with pytest.raises(ValueError, match=r"chunk_size a multiple of page_size 16 and of 128, got 200"):
        pair_decode(q, kc, vc, table, sl, 1.0, 200)
    with pytest.raises(ValueError, match=r"layout must be one of \['keys', 'rows', 'tile'\], got 'cols'"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="cols")
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="rows", merge=True)
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="tile", ahead=True)
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="rows", slices=2)
    with pytest.raises(ValueError, match="slices must be 1, 2, 4 or 8 with head_dim / slices >= 16, got 3"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", slices=3)
    with pytest.raises(ValueError, match="merge=True needs slices=1, got 2"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", merge=True, slices=2)
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="tile", seq_major=True)
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="rows", pdl=True)
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="tile", state_evict="evict_last")
    with pytest.raises(ValueError, match=r"state_evict must be one of \('', 'evict_first', 'evict_last'\), "
                                         r"got 'evict_normal'"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", state_evict="evict_normal")
    with pytest.raises(ValueError, match=NEED_KEYS):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="rows", early_table=True)
    with pytest.raises(ValueError, match="early_table=True needs prefetch 2 or 3, got 0"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=0, early_table=True)
    with pytest.raises(ValueError, match="prefetch must be 0, 1, 2, 3 or 4, got 5"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=5)
    with pytest.raises(ValueError, match=r"prefetch=4 \(TMA tiles\) needs contiguous caches with page_size a multiple "
                                         r"of 128, got page_size 16, contiguous True and True"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=4)
    with pytest.raises(ValueError, match="l2_prefetch=True needs prefetch 2 or 3, got 4"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=4, l2_prefetch=True)
    wide = torch.zeros((1, 129 * 8), dtype=torch.int32)   # 129 chunks of 128 keys (pages of 16)
    with pytest.raises(ValueError, match="merge=True takes up to 128 chunks per sequence, got 129"):
        pair_decode(q, kc, vc, wide, sl, 1.0, 128, layout="keys", merge=True)
    with pytest.raises(ValueError, match="l2_prefetch=True needs prefetch 2 or 3, got 1"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=1, l2_prefetch=True)
    with pytest.raises(ValueError, match="ahead=True needs prefetch 0, 2 or 3, got 1"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", prefetch=1, ahead=True)
    with pytest.raises(ValueError, match=r"config must be \(num_warps, num_stages\[, maxnreg\]\), got \(4,\)"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="keys", config=(4,))
    with pytest.raises(ValueError, match="heads_first=True needs layout 'keys' or 'tile'"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="rows", heads_first=True)
    with pytest.raises(ValueError, match=r"layout 'tile' needs num_warps 4, got config \(8, 2\)"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="tile", config=(8, 2))
    with pytest.raises(ValueError, match="init_fma=False needs layout 'rows' or 'keys'"):
        pair_decode(q, kc, vc, table, sl, 1.0, 128, layout="tile", init_fma=False)


# ------------------------------------------------------------------------ GPU
def _fa4_ready():
    if INTERPRET or not torch.cuda.is_available():
        return False
    try:
        from rlk_ops.kernels.fa4 import loader

        loader.load()
        return True
    except Exception:  # noqa: BLE001 - no FA4 here: the GPU comparison is skipped
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU with FA4 (the kernel is compared with it)")
@pytest.mark.parametrize("ps", [16, 128])
@pytest.mark.parametrize("chunk", [128, 256, 1024, 2048])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("layout,prefetch,config,heads_first,extra", [
    ("rows", None, None, False, {}), ("keys", 0, (4, 2), False, {}), ("keys", 2, (4, 3), False, {}),
    ("keys", 3, (4, 2), False, {}), ("keys", 3, (8, 2), False, {}), ("keys", 3, (8, 3), False, {}),
    ("keys", 3, (8, 3), True, {}), ("tile", None, (4, 2), False, {}), ("tile", None, (4, 2), True, {}),
    ("keys", 3, (8, 3), False, {"ahead": True}), ("keys", 3, (8, 3), False, {"l2_prefetch": True}),
    ("keys", 3, (4, 2), True, {"ahead": True, "l2_prefetch": True}), ("keys", 0, (4, 2), False, {"ahead": True}),
    ("keys", 3, (4, 1, 128), True, {}), ("keys", 3, (8, 3), False, {"slices": 4}),
    ("keys", 3, (4, 2), True, {"slices": 2}), ("keys", 0, (8, 3), False, {"slices": 8, "ahead": True}),
    ("keys", 3, (4, 2), True, {"state_evict": "evict_last"}), ("keys", 3, (8, 3), False, {"early_table": True,
                                                                                       "slices": 2}),
    ("keys", 3, (4, 2), True, {"early_table": True})],
    ids=_option_id)
def test_cuda_every_pair_equals_fa4s_pair_call(ps, chunk, wide, layout, prefetch, config, heads_first, extra):
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    lens = [1, 127, 128, 129, chunk - 1, chunk, chunk + 1, 3 * chunk + 200, 4100, 8192][: 10 if chunk < 2048 else 8]
    q, kc, vc, table, sl = _inputs(lens, ps, seed=chunk + ps + wide, device="cuda", wide=wide)
    scale = D ** -0.5
    out, lse, plens, n = pair_decode(q, kc, vc, table, sl, scale, chunk, layout=layout, prefetch=prefetch,
                                     config=config, heads_first=heads_first, **extra)
    qp, ptab, ref_lens, klens, n_ref = decode_pairs(q, table, sl, ps, chunk)
    ref_out, ref_lse = pair_attention(qp, kc, vc, ptab, klens, scale)
    assert n == n_ref and bitwise_equal(plens, ref_lens)
    full = plens > 0
    assert bitwise_equal(out[full], ref_out[full]) and bitwise_equal(lse[full], ref_lse[full])
    assert bool((lse[~full] == -math.inf).all()) and bool((out[~full] == 0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU with FA4 (the kernel is compared with it)")
@pytest.mark.parametrize("hq", [4, 8, 20, 32])   # G = 1, 2, 5, 8 (Hkv 4): Qwen3's other group sizes
@pytest.mark.parametrize("ps,chunk", [(16, 256), (128, 1024)])
def test_cuda_pairs_at_other_group_sizes(hq, ps, chunk):
    """The routed launch at query-head groups the other CUDA tests never ran (they use G = 4);
    pair_decode.routable took G = 4 only until this passed on the GPU (session 29: written, not
    yet run)."""
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs
    from rlk_ops.kernels.triton.pair_decode import pair_count, pair_decode, step_launch

    lens = [1, 129, chunk - 1, chunk + 1, 3 * chunk + 200, 4100]
    q, kc, vc, table, sl = _inputs(lens, ps, seed=hq + ps, device="cuda", hq=hq)
    launch = step_launch(q, kc, pair_count(table.shape[1], ps, chunk))
    out, lse, plens, n = pair_decode(q, kc, vc, table, sl, D ** -0.5, chunk, layout="keys", **launch)
    qp, ptab, ref_lens, klens, n_ref = decode_pairs(q, table, sl, ps, chunk)
    ref_out, ref_lse = pair_attention(qp, kc, vc, ptab, klens, D ** -0.5)
    assert n == n_ref and bitwise_equal(plens, ref_lens)
    full = plens > 0
    assert bitwise_equal(out[full], ref_out[full]) and bitwise_equal(lse[full], ref_lse[full])


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU with FA4 (the kernel is compared with it)")
@pytest.mark.parametrize("ps,chunk", [(128, 128), (128, 256), (128, 1024), (128, 2048), (256, 256), (256, 1024),
                                      (256, 2048)])
@pytest.mark.parametrize("config,heads_first,extra", [
    ((4, 2), True, {}), ((4, 2, 168), True, {}), ((8, 3), False, {"slices": 2}), ((8, 3), False, {"ahead": True}),
    ((4, 3), False, {"slices": 4})], ids=_option_id)
def test_cuda_tma_tiles_equal_fa4s_pair_call(ps, chunk, config, heads_first, extra):
    """prefetch 4 (K and V tiles by TMA, pages a multiple of 128 keys; not routed): every pair's
    out and lse equal FA4's pair call, with NaN written after the reference into every cache
    slot past a sequence in its last page (the tiles read them: masked scores, zeroed V rows)."""
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    lens = [1, 127, 128, 129, chunk - 1, chunk, chunk + 1, 3 * chunk + 200, 4100, 8192]
    q, kc, vc, table, sl = _inputs(lens, ps, seed=chunk + ps, device="cuda")
    scale = D ** -0.5
    qp, ptab, ref_lens, klens, n_ref = decode_pairs(q, table, sl, ps, chunk)
    ref_out, ref_lse = pair_attention(qp, kc, vc, ptab, klens, scale)
    poison(kc, vc, table, lens, ps)
    out, lse, plens, n = pair_decode(q, kc, vc, table, sl, scale, chunk, layout="keys", prefetch=4, config=config,
                                     heads_first=heads_first, **extra)
    assert n == n_ref and bitwise_equal(plens, ref_lens)
    full = plens > 0
    assert bitwise_equal(out[full], ref_out[full]) and bitwise_equal(lse[full], ref_lse[full])
    assert bool((lse[~full] == -math.inf).all()) and bool((out[~full] == 0).all())


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU with FA4")
@pytest.mark.parametrize("layout", ["rows", "keys", "tile"])
def test_cuda_run_to_run_and_batch_invariant(layout):
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    lens = [8192, 300, 2049, 1]
    q, kc, vc, table, sl = _inputs(lens, 16, seed=3, device="cuda")
    a = pair_decode(q, kc, vc, table, sl, D ** -0.5, 1024, layout=layout)
    b = pair_decode(q, kc, vc, table, sl, D ** -0.5, 1024, layout=layout)
    assert all(bitwise_equal(x, y) for x, y in zip(a[:3], b[:3]))
    one = pair_decode(q[2:3], kc, vc, table[2:3], sl[2:3], D ** -0.5, 1024, layout=layout)
    rows = torch.arange(a[3]) * len(lens) + 2
    assert bitwise_equal(one[0], a[0][rows]) and bitwise_equal(one[1], a[1][rows])


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU with FA4")
@pytest.mark.parametrize("ps", [16, 128])
@pytest.mark.parametrize("config", [(4, 2), (8, 2)])
@pytest.mark.parametrize("seq_major,chunk", [(False, 1024), (True, 1024), (True, 256), (False, 128)])
def test_cuda_fused_merge_equals_the_merge_op(ps, config, seq_major, chunk):
    """merge=True on the GPU: merged out and lse equal the merge op over the same states, for
    every sequence (empty pairs included), launch after launch (counters reset), and equal
    the FA4 route (pair layout + FA4's pair call + the merge op); C = 1024, 256 and 128 (9, 33
    and 65-66 states: head_dim in 1, 4 and 8 slices), chunk- or sequence-major programs."""
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs, merge_attn_states

    lens = [1, 127, 1024, 1025, 3000, 8192]
    q, kc, vc, table, sl = _inputs(lens, ps, seed=ps + config[0], device="cuda")
    for _ in range(3):
        (m_out, m_lse), (ref_out, ref_lse) = _merged_both_ways(q, kc, vc, table, sl, D ** -0.5, chunk, config=config,
                                                               seq_major=seq_major, heads_first=seq_major)
        assert bitwise_equal(m_out, ref_out) and bitwise_equal(m_lse, ref_lse)
    qp, ptab, plens, klens, n = decode_pairs(q, table, sl, ps, chunk)
    o, l = pair_attention(qp, kc, vc, ptab, klens, D ** -0.5)
    fa4_out, fa4_lse = merge_attn_states(o.view(n, len(lens), 1, HQ, D), l.view(n, len(lens), HQ, 1),
                                         state_lens=plens.view(n, len(lens)))
    assert bitwise_equal(m_out, fa4_out) and bitwise_equal(m_lse, fa4_lse)
