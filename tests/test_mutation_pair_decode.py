"""Mutation audit (session 41) of rlk_ops/kernels/triton/pair_decode.py: tests that kill the
mutants test_triton_pair_decode.py let through on the Triton interpreter.

Its transcription test puts a 0 score at the start of every key block and takes scale_log2 = 1,
with every sum exact: so the running max is 0 in every block (the rescale factor is 1 after the
first block), the softmax scale multiplies by 1, lse's ``m * scale_log2`` term is 0, and no
summation order can change a bit. Mutants that dropped the running max, O's rescale, the scale
in P or the max in lse, or reordered a thread sum, passed it. Here: block maxima that differ
(rises of the running max mid-walk, pairs whose max is -1) at scale_log2 = 2 with every value
still exact, and scores spread so wide that the thread sums round (order decides the bits).
Plus two host-side boundaries: chunk_size a multiple of the page but not of 128, and routable's
16-block / 2**31-element limits. Interpreter only (TRITON_INTERPRET=1, triton importable).
"""
import math
import os

import pytest
import torch

from conftest import bitwise_equal

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (runs the kernel on CPU tensors)", allow_module_level=True)

from test_triton_pair_decode import D, HKV, _inputs, compare_with_transcription  # noqa: E402

LAYOUTS = [("keys", 3, {}), ("keys", 0, {}), ("keys", 1, {}), ("rows", None, {}), ("tile", None, {}),
           ("keys", 3, {"ahead": True, "slices": 2})]


def _run_and_compare(lens, ps, chunk, layout, prefetch, extra, scale, scores, vc):
    """pair_decode on ``scores`` (the K column 0 of every cache row; q's column 0 is 1, so a key's
    score is that value) against _transcribed, out / lse / row sums bit for bit."""
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    q, kc, _, table, sl = _inputs(lens, ps, seed=7, device="cpu")
    q = torch.zeros_like(q)
    q[..., 0] = 1.0
    kc = torch.zeros_like(kc)
    rows = kc.view(-1, HKV, D)
    rows[..., 0] = scores(rows.shape[0], table, lens).to(torch.bfloat16)
    vc = vc(kc)
    result = pair_decode(q, kc, vc, table, sl, scale, chunk, sums=True, layout=layout, prefetch=prefetch, **extra)
    compare_with_transcription(result, q, rows, vc, table, lens, ps, chunk, scale)


@pytest.mark.parametrize("layout,prefetch,extra", LAYOUTS, ids=lambda v: v if isinstance(v, str) else None)
def test_rising_running_max_at_scale_log2_two(layout, prefetch, extra):
    """Key block j of sequence b (position block g = pos // 128) peaks at -((b + g) % 2), its other
    scores down to 3 below: walked last to first, the running max rises from -1 to 0 mid-pair
    (rescale 1/4) for even b, stays at 0 over a lower block for odd b, and a one-block pair of
    odd b ends at max -1 (lse's m term). scale_log2 = 2:
    P = 2^(2(s - m)) in [2^-8, 1], r in {0, 1/4, 1}, V small integers: every sum exact."""
    from rlk_ops.kernels.triton.pair_decode import scale_log2

    scale = 2.0 / math.log2(math.e)
    assert scale_log2(scale) == 2.0
    lens, ps, chunk = [300, 200, 260, 17], 16, 256
    gen = torch.Generator().manual_seed(11)

    def scores(n_rows, table, lens):
        s = torch.zeros(n_rows, HKV)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            idx = table[b, pos // ps].long() * ps + pos % ps
            peak = -((b + pos // 128) % 2).float()
            s[idx] = peak[:, None] - torch.randint(0, 4, (n, HKV), generator=gen).float()
            s[idx[pos % 128 == 0]] = peak[pos % 128 == 0][:, None]
        return s

    def vc(kc):
        return torch.randint(-4, 5, kc.shape, generator=gen).to(torch.bfloat16)

    _run_and_compare(lens, ps, chunk, layout, prefetch, extra, scale, scores, vc)


@pytest.mark.parametrize("layout,prefetch,extra", LAYOUTS, ids=lambda v: v if isinstance(v, str) else None)
def test_thread_sum_order_decides_rounded_sums(layout, prefetch, extra):
    """Scores 0 (one per block, and at random) or -22 .. -25: P is 1 or 2^-22 .. 2^-25, so the fp32
    thread sums, their pairing in L and the block order round (1 + 2^-24 + 2^-24 is not
    2^-24 + 2^-24 + 1), and only the documented order gives the transcription's row sums and lse
    (V = 0: out is 0 whatever the P @ V order)."""
    scale = 1.0 / math.log2(math.e)
    lens, ps, chunk = [300, 129, 260], 16, 256
    gen = torch.Generator().manual_seed(12)

    def scores(n_rows, table, lens):
        s = torch.tensor([0.0, -22.0, -23.0, -24.0, -25.0])[torch.randint(0, 5, (n_rows, HKV), generator=gen)]
        for b, n in enumerate(lens):
            for start in range(0, n, 128):
                s[int(table[b, start // ps]) * ps + start % ps] = 0.0
        return s

    _run_and_compare(lens, ps, chunk, layout, prefetch, extra, scale, scores, torch.zeros_like)


def test_chunk_size_must_be_a_multiple_of_the_key_block():
    """A page multiple that is no multiple of 128 (chunk 144 at page 16) is refused: the kernels'
    block walk and preloaded token rows assume whole key blocks per chunk."""
    from rlk_ops.kernels.triton.pair_decode import pair_decode

    q, kc, vc, table, sl = _inputs([5], 16, seed=5, device="cpu")
    with pytest.raises(ValueError, match=r"chunk_size a multiple of page_size 16 and of 128, got 144"):
        pair_decode(q, kc, vc, table, sl, 1.0, 144, layout="keys")


def test_routable_limits_are_inclusive_exclusive_as_documented(monkeypatch):
    """routable: at most MAX_PRELOADED_BLOCKS (16) key blocks per chunk (C = 2048 yes, 2176 no)
    and a cache of fewer than 2**31 elements (meta tensors: no memory)."""
    from rlk_ops.kernels.triton import _common
    from rlk_ops.kernels.triton.pair_decode import routable

    monkeypatch.setattr(_common, "INTERPRET", False)   # never routable on the interpreter itself

    def case(chunk=768, pages=64):
        return routable(torch.empty(2, 1, 16, 128, dtype=torch.bfloat16, device="meta"),
                        torch.empty(pages, 16, 4, 128, dtype=torch.bfloat16, device="meta"), chunk, "sm90")

    assert case(chunk=2048) and not case(chunk=2176)
    per_page = 16 * 4 * 128
    assert case(pages=2 ** 31 // per_page - 1) and not case(pages=2 ** 31 // per_page)


def test_out_rounds_half_to_even():
    """The interpreter's fp32 -> bf16 of out (``_bf16``: round to nearest even on the bits, as
    cvt.rn on the GPU) on exact ties: two keys of score 0 (P = 1 each, L = 2); KV head 0's V rows
    1 + 2^-7 and 1 + 2^-6 give O / L = 1 + 3 * 2^-8, halfway between 1 + 2^-7 (odd) and 1 + 2^-6
    (even: rounded up), head 1's 1 and 1 + 2^-7 give 1 + 2^-8, between 1 (even: rounded down) and
    1 + 2^-7."""
    scale = 1.0 / math.log2(math.e)

    def vc(kc):
        even = torch.tensor([1.0 + 2.0 ** -7, 1.0, 1.0, 1.0]).view(1, 1, HKV, 1)
        odd = torch.tensor([1.0 + 2.0 ** -6, 1.0 + 2.0 ** -7, 1.0, 1.0]).view(1, 1, HKV, 1)
        rows = torch.arange(kc.shape[0] * kc.shape[1]).view(kc.shape[0], kc.shape[1], 1, 1)
        return torch.where(rows % 2 == 0, even, odd).expand(kc.shape).to(torch.bfloat16)

    _run_and_compare([2, 130], 16, 256, "keys", 3, {}, scale, lambda n, table, lens: torch.zeros(n, HKV), vc)


def test_fused_merge_leaves_its_counters_zero(monkeypatch):
    """merge=True: off CUDA ``_counts`` hands out fresh zeros, so a launch that left its counters
    non-zero would go unseen; here one persistent buffer (as the GPU's per-stream one) must be
    zero after each of two launches, and both launches merge."""
    from rlk_ops.kernels.triton import pair_decode as pd
    from test_triton_pair_decode import _merged_both_ways

    buf = torch.zeros(4096, dtype=torch.int32)
    monkeypatch.setattr(pd, "_counts", lambda device, size: buf)
    q, kc, vc, table, sl = _inputs([300, 129], 16, seed=4, device="cpu")
    for _ in range(2):
        (m_out, m_lse), (ref_out, ref_lse) = _merged_both_ways(q, kc, vc, table, sl, D ** -0.5, 128, prefetch=3)
        assert bitwise_equal(m_out, ref_out) and bitwise_equal(m_lse, ref_lse)
        assert int(buf.abs().sum()) == 0
