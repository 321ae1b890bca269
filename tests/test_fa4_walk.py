"""rlk_ops/kernels/fa4/walk.py: canonical:C decode as FA4's own SM90 kernel walking the chunks.

On the GPU (``cuda``, SM90, FA4 installed): every chunk's partial (out and lse) equals FA4's pair
call over that chunk, and the merged row equals the canonical:C op's routed decode (pairs + the
merge op), bit for bit, at several C, lengths on and off block and chunk boundaries, an empty
sequence, batch 64; run to run. On any machine: which shapes the walk takes.
"""
import pytest
import torch

from conftest import bitwise_equal

from test_triton_pair_decode import D, HQ, _fa4_ready as _fa4_loads, _inputs  # noqa: E402


def _fa4_ready():
    """An SM90 GPU with FA4 (the walk is FA4's SM90 kernel)."""
    return _fa4_loads() and torch.cuda.get_device_capability()[0] == 9


def test_supported_shapes():
    from rlk_ops.kernels.fa4.walk import supported

    q = torch.zeros(2, 1, HQ, D, dtype=torch.bfloat16)
    kc = torch.zeros(4, 128, 4, D, dtype=torch.bfloat16)
    assert supported(q, kc, 768, "sm90")
    assert not supported(q, kc, 768, None)                                   # not on a GPU
    assert not supported(q, kc, 768, "sm100")
    assert not supported(q, kc, 700, "sm90")                                 # C not a multiple of 128
    assert not supported(q, torch.zeros(4, 16, 4, D, dtype=torch.bfloat16), 768, "sm90")   # page 16
    assert not supported(torch.zeros(2, 2, HQ, D, dtype=torch.bfloat16), kc, 768, "sm90")  # 2 query tokens
    assert not supported(q[..., :64], kc[..., :64], 768, "sm90")           # head_dim 64
    assert not supported(q[:, :, :8], kc, 768, "sm90")                      # G = 2
    assert not supported(q.float(), kc.float(), 768, "sm90")


def _pairs_reference(q, kc, vc, table, sl, chunk):
    from rlk_ops.kernels.fa4.kernels import pair_attention
    from rlk_ops.kernels.triton.merge import decode_pairs

    qp, ptab, lens, klens, n = decode_pairs(q, table, sl, kc.shape[1], chunk)
    out, lse = pair_attention(qp, kc, vc, ptab, klens, D ** -0.5)
    return out.view(n, q.shape[0], 1, q.shape[2], D), lse.view(n, q.shape[0], q.shape[2], 1), lens.view(n, -1)


def _check(lens, chunk, seed, monkeypatch):
    import rlk_ops
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical
    from rlk_ops.kernels.fa4 import walk

    monkeypatch.setattr(fa4_canonical, "DECODE_WALK", None)   # the op's reference: pairs + merge op

    q, kc, vc, table, sl = _inputs(lens, 128, seed=seed, device="cuda")
    out, lse, pout, plse = walk.decode(q, kc, vc, table, sl, D ** -0.5, chunk)
    ref_out, ref_lse, plens = _pairs_reference(q, kc, vc, table, sl, chunk)
    full = plens > 0
    assert pout.shape == ref_out.shape and plse.shape == ref_lse.shape
    assert bitwise_equal(pout[full], ref_out[full]) and bitwise_equal(plse[full], ref_lse[full])
    # the op checks page-table values; the entries past a sequence (-7 here, never read) as 0
    op_out, op_lse = rlk_ops.paged_attention(q, kc, vc, table.clamp_min(0), sl, split_kv=f"canonical:{chunk}")
    assert bitwise_equal(out, op_out) and bitwise_equal(lse, op_lse.view_as(lse))
    again = walk.decode(q, kc, vc, table, sl, D ** -0.5, chunk)
    assert bitwise_equal(again[0], out) and bitwise_equal(again[1], lse)
    states = walk.decode(q, kc, vc, table, sl, D ** -0.5, chunk, merge=False)
    assert bitwise_equal(states[2][full], ref_out[full]) and bitwise_equal(states[3][full], ref_lse[full])
    return out, lse


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs an SM90 GPU with FA4 (the walk is compared with it)")
@pytest.mark.parametrize("chunk", [128, 256, 768, 1024, 2048])
def test_cuda_walk_equals_pairs_and_op(chunk, monkeypatch):
    _check([1, 127, 128, 129, chunk - 1, chunk, chunk + 1, 3 * chunk + 200, 4100, 8192], chunk, seed=chunk,
           monkeypatch=monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not _fa4_ready(), reason="needs an SM90 GPU with FA4 (the walk is compared with it)")
def test_cuda_walk_empty_sequence_and_batch_64(monkeypatch):
    """An empty sequence (not the first: FA4's producer reads the table entry before its row) gives
    out 0, lse -inf, as the merge of no states; the op refuses it, so the pairs + merge op
    reference runs with value checks off. (The merge's skipped-state path.)"""
    import rlk_ops
    with rlk_ops.value_checks(False):
        out, lse = _check([700, 0, 3, 1300], 512, seed=5, monkeypatch=monkeypatch)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    gen = torch.Generator().manual_seed(9)
    _check(torch.randint(1, 5000, (64,), generator=gen).tolist(), 768, seed=9, monkeypatch=monkeypatch)


def test_bad_arguments_are_named():
    from rlk_ops.kernels.fa4 import walk

    q, kc, vc, table, sl = _inputs([300, 40], 128, seed=0, device="cpu")
    with pytest.raises(ValueError, match=r"seq_lens must be int32, got torch.int64"):
        walk.decode(q, kc, vc, table, sl.long(), 1.0, 256)
    with pytest.raises(ValueError, match=r"page_table must be int32"):
        walk.decode(q, kc, vc, table.long(), sl, 1.0, 256)
    with pytest.raises(ValueError, match=r"must share dtype"):
        walk.decode(q, kc, vc.half(), table, sl, 1.0, 256)
    with pytest.raises(ValueError, match=r"k_cache must be contiguous in its last dim"):
        walk.decode(q, kc.transpose(-1, -2).contiguous().transpose(-1, -2), vc, table, sl, 1.0, 256)
    with pytest.raises(ValueError, match=r"must have q's batch 2 rows"):
        walk.decode(q, kc, vc, table, sl[:1], 1.0, 256)
    with pytest.raises(ValueError, match=r"C a multiple of 128; got .* C 200"):
        walk.decode(q, kc, vc, table, sl, 1.0, 200)


def test_decode_walk_setting_is_checked(monkeypatch):
    """fa4 canonical.DECODE_WALK: None (the default: the pair route), "merged" or "states"; anything
    else is named before any kernel is looked up."""
    from rlk_ops.kernels.fa4 import canonical as fa4_canonical

    q = torch.zeros(2, 1, HQ, D, dtype=torch.bfloat16)
    kc = torch.zeros(4, 128, 4, D, dtype=torch.bfloat16)
    assert fa4_canonical.DECODE_WALK is None and not fa4_canonical.walk_routed(q, kc, 768)
    monkeypatch.setattr(fa4_canonical, "DECODE_WALK", "fused")
    with pytest.raises(ValueError, match=r"DECODE_WALK must be 'merged', 'states' or None, got 'fused'"):
        fa4_canonical.walk_routed(q, kc, 768)
