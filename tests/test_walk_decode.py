"""rlk_ops/kernels/triton/walk_decode.py: the TMA walk's decode states.

On the GPU (``cuda``, SM90): every pair's out, lse and length equal FA4's own pair call and the
routed pair kernel's, at pages 128 and 256, several C, lengths on and off block and chunk
boundaries, with NaN in every cache slot past a sequence in its last page (the tiles read them);
empty sequences; batch 64; run to run and batch invariant; each launch variant, the one-warp
``rows=True`` (walk_rows.py) included, and with rows=True 16 query heads per KV head. On any
machine: the shapes and options it refuses, by name.
"""
import math

import pytest
import torch

from conftest import bitwise_equal

pytest.importorskip("triton.experimental.gluon")

from test_triton_pair_decode import D, HQ, _fa4_ready as _fa4_loads, _inputs, poison as _poison  # noqa: E402


def test_refused_shapes_are_named():
    from rlk_ops.kernels.triton import walk_decode as wd

    q, kc, vc, table, sl = _inputs([300], 16, seed=0, device="cpu")
    with pytest.raises(ValueError, match="page_size 16 is not a multiple of 128"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256)
    q, kc, vc, table, sl = _inputs([300], 128, seed=0, device="cpu")
    with pytest.raises(ValueError, match="chunk_size 200 is not a multiple of 128"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 200)
    with pytest.raises(ValueError, match=r"the cache dtype torch.float16 is not bfloat16"):
        wd.walk_decode(q, kc.half(), vc.half(), table, sl, 1.0, 256)
    with pytest.raises(ValueError, match="the cache is not contiguous"):
        wd.walk_decode(q, torch.zeros(*kc.shape[:-1], 2 * D, dtype=kc.dtype)[..., :D], vc, table, sl, 1.0, 256)
    with pytest.raises(ValueError, match=r"Hq / Hkv <= 8 query heads per KV head, got Hq 48, Hkv 4"):
        wd.walk_decode(torch.zeros(1, 1, 48, D, dtype=torch.bfloat16), kc, vc, table, sl, 1.0, 256)
    with pytest.raises(ValueError, match=r"merge=True takes up to 64 chunks per sequence, got 65"):
        wd.walk_decode(q, kc, vc, torch.zeros(1, 65, dtype=torch.int32), sl, 1.0, 128, merge=True)
    with pytest.raises(ValueError, match=r"probe must be 0, 1 \(the ring alone\), 2 \(KV heads apart\) or 3 .*, got 4"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256, probe=4)
    with pytest.raises(ValueError, match=r"walk_decode warps must be 4 or 8, got 2"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256, warps=2)
    with pytest.raises(ValueError, match=r"walk_decode ws=True runs without probes, got probe=1"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256, probe=1, ws=True)
    with pytest.raises(ValueError, match=r"rows=True is one warp per program without probes or a producer warp, "
                                         r"got probe=0, ws=True, warps=4"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256, rows=True, ws=True)
    with pytest.raises(ValueError, match=r"rows=True needs Hq / Hkv <= 16 query heads per KV head, got Hq 68, Hkv 4"):
        wd.walk_decode(torch.zeros(1, 1, 68, D, dtype=torch.bfloat16), kc, vc, table, sl, 1.0, 256, rows=True)
    with pytest.raises(ValueError, match="walk_decode needs a CUDA device"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256, rows=True)
    with pytest.raises(ValueError, match="walk_decode needs a CUDA device"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_other_architectures_are_refused_by_name(monkeypatch):
    from rlk_ops.kernels.triton import walk_decode as wd

    q, kc, vc, table, sl = _inputs([300], 128, seed=0, device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"needs an SM90 GPU .* got compute capability 8\.0"):
        wd.walk_decode(q, kc, vc, table, sl, 1.0, 256)


# the walk's launch variants, each checked for the same bits: 4 warps (the default), 8 warps
# (session 25), a producer warp issuing the TMA loads (ws=True, session 25), one warp with the
# queries on M (rows=True, walk_rows.py, session 26). The same with its ring in half tiles
# (halves=True, session 27) held these bits on an H100 but ran slower (session 29); removed.
VARIANTS = [{}, {"warps": 8}, {"ws": True}, {"rows": True}]
VARIANT_IDS = ["4warps", "8warps", "producer", "rows"]


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _fa4_ready():
    return _sm90() and _fa4_loads()


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs an SM90 GPU with FA4 (the walk is compared with it)")
@pytest.mark.parametrize("ps,chunk", [(128, 128), (128, 256), (128, 768), (128, 1024), (128, 2048), (256, 256),
                                      (256, 768), (256, 2048)])
@pytest.mark.parametrize("opts", VARIANTS, ids=VARIANT_IDS)
def test_cuda_every_pair_equals_fa4s_pair_call_and_the_pair_kernel(ps, chunk, opts):
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs
    from rlk_ops.kernels.triton.pair_decode import pair_decode, step_launch
    from rlk_ops.kernels.triton.walk_decode import walk_decode

    lens = [1, 127, 128, 129, chunk - 1, chunk, chunk + 1, 3 * chunk + 200, 4100, 8192]
    q, kc, vc, table, sl = _inputs(lens, ps, seed=chunk + ps, device="cuda")
    scale = D ** -0.5
    qp, ptab, ref_lens, klens, n_ref = decode_pairs(q, table, sl, ps, chunk)
    ref_out, ref_lse = pair_attention(qp, kc, vc, ptab, klens, scale)
    _poison(kc, vc, table, lens, ps)
    out, lse, plens, n = walk_decode(q, kc, vc, table, sl, scale, chunk, **opts)
    assert n == n_ref and bitwise_equal(plens, ref_lens)
    full = plens > 0
    assert bitwise_equal(out[full], ref_out[full]) and bitwise_equal(lse[full], ref_lse[full])
    assert bool((lse[~full] == -math.inf).all()) and bool((out[~full] == 0).all())
    routed = pair_decode(q, kc, vc, table, sl, scale, chunk, layout="keys", **step_launch(q, kc, n))
    assert all(bitwise_equal(a, b) for a, b in zip((out, lse, plens), routed[:3]))


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("hq", [8, 16, 32])
@pytest.mark.parametrize("opts", VARIANTS, ids=VARIANT_IDS)
def test_cuda_equals_the_pair_kernel_with_empty_sequences_and_other_group_sizes(hq, opts):
    from rlk_ops.kernels.triton.pair_decode import pair_decode
    from rlk_ops.kernels.triton.walk_decode import walk_decode

    lens = [700, 0, 3, 1300, 0, 2048]
    q, kc, vc, table, sl = _inputs(lens, 128, seed=hq, device="cuda", hq=hq)
    got = walk_decode(q, kc, vc, table, sl, D ** -0.5, 512, **opts)
    ref = pair_decode(q, kc, vc, table, sl, D ** -0.5, 512, layout="keys")
    assert got[3] == ref[3] and all(bitwise_equal(a, b) for a, b in zip(got[:3], ref[:3]))


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs an SM90 GPU with FA4 (the walk is compared with it)")
def test_cuda_rows_takes_16_query_heads_per_kv_head():
    """rows=True holds up to 16 query heads of a KV head on mma.sync's M (the others up to 8):
    every pair equal to FA4's pair call, and its own merge to the merge op."""
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs, merge_attn_states
    from rlk_ops.kernels.triton.walk_decode import walk_decode

    lens, hq, chunk = [700, 0, 3, 1300, 2048], 64, 256
    q, kc, vc, table, sl = _inputs(lens, 128, seed=hq, device="cuda", hq=hq)
    qp, ptab, ref_lens, klens, n_ref = decode_pairs(q, table, sl, 128, chunk)
    ref_out, ref_lse = pair_attention(qp, kc, vc, ptab, klens, D ** -0.5)
    _poison(kc, vc, table, lens, 128)
    got = walk_decode(q, kc, vc, table, sl, D ** -0.5, chunk, rows=True, merge=True)
    assert got[3] == n_ref and bitwise_equal(got[2], ref_lens)
    full = got[2] > 0
    assert bitwise_equal(got[0][full], ref_out[full]) and bitwise_equal(got[1][full], ref_lse[full])
    n = got[3]
    ro, rl = merge_attn_states(got[0].view(n, len(lens), 1, hq, D), got[1].view(n, len(lens), hq, 1),
                               state_lens=got[2].view(n, len(lens)))
    assert bitwise_equal(got[4], ro) and bitwise_equal(got[5].view(-1), rl.reshape(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("ps,chunk,lens", [(128, 768, [8192, 300, 0, 129, 768, 7000]), (128, 128, [1, 129, 5000]),
                                           (256, 2048, [30000, 2048, 2049, 0])])
@pytest.mark.parametrize("opts", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("hq", [HQ, 32])
def test_cuda_in_program_merge_equals_the_merge_op(ps, chunk, lens, opts, hq):
    from rlk_ops.kernels.triton.merge import merge_attn_states
    from rlk_ops.kernels.triton.walk_decode import walk_decode

    q, kc, vc, table, sl = _inputs(lens, ps, seed=chunk, device="cuda", hq=hq)
    _poison(kc, vc, table, lens, ps)
    out, lse, plens, n, mo, ml = walk_decode(q, kc, vc, table, sl, D ** -0.5, chunk, merge=True, **opts)
    states = walk_decode(q, kc, vc, table, sl, D ** -0.5, chunk, **opts)
    assert all(bitwise_equal(a, b) for a, b in zip((out, lse, plens), states[:3]))
    ro, rl = merge_attn_states(out.view(n, len(lens), 1, hq, D), lse.view(n, len(lens), hq, 1),
                               state_lens=plens.view(n, len(lens)))
    assert bitwise_equal(mo, ro) and bitwise_equal(ml.view(-1), rl.reshape(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
@pytest.mark.parametrize("opts", VARIANTS, ids=VARIANT_IDS)
def test_cuda_batch_64_run_to_run_and_batch_invariant(opts):
    from rlk_ops.kernels.triton.pair_decode import pair_decode
    from rlk_ops.kernels.triton.walk_decode import walk_decode

    lens = [8192 - 37 * i for i in range(64)]
    q, kc, vc, table, sl = _inputs(lens, 128, seed=64, device="cuda")
    a = walk_decode(q, kc, vc, table, sl, D ** -0.5, 768, **opts)
    b = walk_decode(q, kc, vc, table, sl, D ** -0.5, 768, **opts)
    assert all(bitwise_equal(x, y) for x, y in zip(a[:3], b[:3]))
    ref = pair_decode(q, kc, vc, table, sl, D ** -0.5, 768, layout="keys")
    assert all(bitwise_equal(x, y) for x, y in zip(a[:3], ref[:3]))
    one = walk_decode(q[5:6], kc, vc, table[5:6], sl[5:6], D ** -0.5, 768, **opts)
    rows = torch.arange(a[3], device="cuda") * len(lens) + 5
    assert bitwise_equal(one[0], a[0][rows]) and bitwise_equal(one[1], a[1][rows])
