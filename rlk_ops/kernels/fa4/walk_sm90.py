"""The chunk walk's kernel (kernels/fa4/walk.py says what it computes): FA4's SM90 forward with
its consumer loop replaced. Imports FA4 and the CUTLASS DSL at import: kernels/fa4/walk.py imports
this module only when it compiles the walk. (Module level, not a closure: the DSL re-parses a jit
method's source and resolves its names in the module's globals.)"""
from __future__ import annotations

import math
import struct

from functools import partial
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr
from cutlass import pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.softmax import Softmax
from quack import layout_utils, sm90_utils


def _f32(v: float) -> float:
    """v rounded to fp32 (round to nearest even), as a Python float: the constant the Triton merge
    uses for a Python literal."""
    return struct.unpack("f", struct.pack("f", v))[0]


def asm(ret, text, constraints, *args):
    return llvm.inline_asm(ret, [a.ir_value() for a in args], text, constraints, has_side_effects=False,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def f32op(op: str, a, b, *, loc=None, ip=None):
    return Float32(asm(T.f32(), f"{op}.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b)))


@dsl_user_op
def f64op(op: str, a, b, *, loc=None, ip=None):
    return Float64(asm(T.f64(), f"{op}.rn.f64 $0, $1, $2;", "=d,d,d", Float64(a), Float64(b)))


@dsl_user_op
def rint(a, *, loc=None, ip=None):
    return Float32(asm(T.f32(), "cvt.rni.f32.f32 $0, $1;", "=f,f", Float32(a)))


@dsl_user_op
def pow2(n, *, loc=None, ip=None):
    """2**n for an integral fp32 n in the normal range: the exponent field written directly."""
    return Float32(asm(T.f32(), "{ .reg .s32 t; cvt.rzi.s32.f32 t, $1; add.s32 t, t, 127; "
                                "shl.b32 t, t, 23; mov.b32 $0, t; }", "=f,f", Float32(n)))


@dsl_user_op
def to_f64(a, *, loc=None, ip=None):
    return Float64(asm(T.f64(), "cvt.f64.f32 $0, $1;", "=d,f", Float32(a)))


@dsl_user_op
def to_f32(a, *, loc=None, ip=None):
    return Float32(asm(T.f32(), "cvt.rn.f32.f64 $0, $1;", "=f,d", Float64(a)))


@dsl_user_op
def frexp_parts(x, *, loc=None, ip=None):
    """For a positive normal fp64 x: (m, e) with x = m * 2**e, m in [0.5, 1), e as fp64."""
    m = Float64(asm(T.f64(), "{ .reg .b64 b; mov.b64 b, $1; and.b64 b, b, 0x000FFFFFFFFFFFFF; "
                             "or.b64 b, b, 0x3FE0000000000000; mov.b64 $0, b; }", "=d,d", Float64(x)))
    e = Float64(asm(T.f64(), "{ .reg .b64 b; .reg .s64 s; mov.b64 b, $1; shr.u64 b, b, 52; "
                             "and.b64 b, b, 0x7FF; sub.s64 s, b, 1022; cvt.rn.f64.s64 $0, s; }", "=d,d",
                    Float64(x)))
    return m, e


LO, HI = _f32(-126 * math.log(2.0)), _f32(127 * math.log(2.0))
LOG2E, LN2_HI, LN2_LO = _f32(1.4426950408889634), _f32(6.93145752e-01), _f32(1.42860677e-06)
EXP_C = [_f32(1.0 / math.factorial(k)) for k in range(7, -1, -1)]
LOG_C = [1.0 / (2 * k + 1) for k in range(10, -1, -1)]   # numerics.log: 11 terms, Horner order
LN2, SQRT_HALF = math.log(2.0), math.sqrt(0.5)


@cute.jit
def exp_f32(x: Float32) -> Float32:
    """numerics.exp (fp32) for x <= 127 ln 2, the steps of kernels/triton/merge._exp."""
    xc = x if x >= LO else Float32(LO)
    xc = xc if xc <= HI else Float32(HI)
    n = rint(f32op("mul", xc, LOG2E))
    r = f32op("sub", f32op("sub", xc, f32op("mul", n, LN2_HI)), f32op("mul", n, LN2_LO))
    p = Float32(EXP_C[0])
    for c in cutlass.range_constexpr(1, len(EXP_C)):
        p = f32op("add", f32op("mul", p, r), EXP_C[c])
    y = f32op("mul", p, pow2(n))
    y = y if x >= LO else Float32(0.0)
    y = y if x <= HI else Float32(math.inf)
    return y if x == x else x


@cute.jit
def log_f32(x: Float32) -> Float32:
    """numerics.log: in fp64 from x's exact value, rounded once to fp32 (x >= 0 here)."""
    xd = to_f64(x)
    m, e = frexp_parts(xd)
    small = m < SQRT_HALF
    m = f64op("mul", m, 2.0) if small else m
    e = f64op("sub", e, 1.0) if small else e
    f = f64op("div", f64op("sub", m, 1.0), f64op("add", m, 1.0))
    f2 = f64op("mul", f, f)
    p = Float64(LOG_C[0])
    for k in cutlass.range_constexpr(1, len(LOG_C)):
        p = f64op("add", f64op("mul", p, f2), LOG_C[k])
    y = f64op("add", f64op("mul", f64op("mul", 2.0, f), p), f64op("mul", e, LN2))
    res = to_f32(y)
    res = res if x != 0.0 else Float32(-math.inf)
    return res if x != math.inf else x


class CanonicalWalkSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward whose consumer walks canonical:C chunks (module docstring)."""

    def __init__(self, *args, chunk_blocks: int, merge: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.intra_wg_overlap and self.pack_gqa and not self.is_local
        self.chunk_blocks = chunk_blocks
        self.merge = merge

    @cute.jit
    def close_chunk(self, c, softmax, acc_O, tOcO, mPairO, mPairLSE, batch_idx, head_idx, seqlen_k, top_lse):
        """Chunk c's partial: FA4's finalize and rescale, rounded as FA4's epilogue rounds, stored
        to the pair buffers (the thread's rows of the query's heads only); its lse into top_lse's max."""
        softmax.rescale_O(acc_O, softmax.finalize())
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        rO_mn = layout_utils.reshape_acc_to_mn(rO)
        group = self.qhead_per_kvhead
        for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO[r, 0][0]
            if row < group:
                h = head_idx * group + row
                for j in cutlass.range_constexpr(cute.size(rO_mn, mode=[1])):
                    mPairO[c, batch_idx, h, tOcO[r, j][1]] = rO_mn[r, j]
                # an empty sequence (block -1: FA4's mask takes it as block 0 and masks every
                # column, so finalize already gives -inf): no keys, skipped by the merge, as the
                # pair route skips it through its lengths; said here rather than left to the mask
                lse_c = softmax.row_sum[r] if seqlen_k > 0 else -Float32.inf
                mPairLSE[c, batch_idx, h] = lse_c
                top_lse[r] = utils.fmax(top_lse[r], lse_c)

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_O, tma_atom_O, tidx, softmax_scale_log2, softmax_scale,
            block_info, SeqlenInfoCls, AttentionMaskCls, TileSchedulerCls, blocksparse_tensors,
            aux_data=utils.AuxData(), fastdiv_mods=None):
        mPairO, mPairLSE = aux_data.tensors   # [N, B, Hq, D] (out dtype), [N, B, Hq] fp32
        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)
        wg_layout = cute.make_layout(self.num_wg_mma, stride=self.num_threads_per_warp_group)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg_idx))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg_idx))
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
            wg_mma_qk, (self.tile_m, self.tile_n, self.tile_hdim), sQ, sK)
        mma_qk_fn = partial(sm90_utils.gemm_zero_init, tiled_mma_qk, (self.tile_m, self.tile_n), tSrQ, tSrK)
        acc_O, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(
            wg_mma_pv, (self.tile_m, self.tile_hdimv, self.tile_n), sP, sVt)
        mma_pv_fn = partial(sm90_utils.gemm_w_idx, tiled_mma_pv, acc_O, tOrP, tOrVt)
        store_P = cute.make_tiled_copy_C(
            utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype), tiled_mma_qk
        ).get_slice(tidx)
        smem_copy = SimpleNamespace(smem_thr_copy_P=store_P,
                                    tPsP=store_P.partition_D(sP) if const_expr(sP is not None) else None)
        self.mma_init()
        q_phase = Int32(0)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        scheduler = TileSchedulerCls()
        work = scheduler.initial_work_tile_info()
        softmax = Softmax.create(softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1],
                                 softmax_scale=softmax_scale)
        scores_scale = None
        if const_expr(self.rescale_O_before_gemm):
            scores_scale = cute.make_rmem_tensor_like(softmax.row_max, Float32)
        step = partial(self.mma_one_n_block_intrawg_overlap, mma_qk_fn=mma_qk_fn, pipeline_k=pipeline_k,
                       pipeline_v=pipeline_v, acc_O=acc_O, tOrP=tOrP, smem_copy_params=smem_copy,
                       check_inf=True, scores_scale=scores_scale, softmax=softmax)
        first = partial(self.first_half_block_overlap, mma_qk_fn=mma_qk_fn, pipeline_k=pipeline_k, tOrP=tOrP,
                        smem_copy_params=smem_copy, scores_scale=scores_scale, softmax=softmax, acc_O=acc_O)
        last = partial(self.last_half_block_overlap, pipeline_v=pipeline_v, mma_pv_fn=mma_pv_fn,
                       scores_scale=scores_scale, softmax=softmax, acc_O=acc_O)
        # (row, col) of every accumulator element this thread holds, rows as FA4's packed GQA rows
        tOcO = layout_utils.reshape_acc_to_mn(
            thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        acc_mn = layout_utils.reshape_acc_to_mn(acc_O)
        n_rows = cute.size(acc_mn, mode=[0])
        n_cols = cute.size(acc_mn, mode=[1])
        group = self.qhead_per_kvhead
        CB = self.chunk_blocks
        while work.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            mask = AttentionMaskCls(seqlen)
            mask_fn = partial(mask.apply_mask, batch_idx=batch_idx, head_idx=head_idx, m_block=m_block,
                              thr_mma=thr_mma_qk, mask_causal=self.is_causal, mask_local=False,
                              aux_data=aux_data, fastdiv_mods=fastdiv_mods)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            pipeline_q.consumer_wait_w_index_phase(0, q_phase)
            # chunks top to bottom; an empty sequence still takes one block (block -1, which FA4's
            # producer loads for it, reading page_table[b, -1]: the op refuses seq_lens < 1)
            n_chunks = cutlass.max((n_block_max + CB - 1) // CB, 1)
            top_lse = cute.make_rmem_tensor_like(softmax.row_max, Float32)
            top_lse.fill(-Float32.inf)
            close = partial(self.close_chunk, softmax=softmax, acc_O=acc_O, tOcO=tOcO, mPairO=mPairO,
                            mPairLSE=mPairLSE, batch_idx=batch_idx, head_idx=head_idx, seqlen_k=seqlen.seqlen_k,
                            top_lse=top_lse)
            for ci in cutlass.range(n_chunks, unroll=1):
                c = n_chunks - 1 - ci
                hi = cutlass.min(n_block_max, (c + 1) * CB)
                kv_state = first(n_block=hi - 1, seqlen=seqlen, kv_consumer_state=kv_state,
                                 mask_fn=partial(mask_fn, mask_mod=None), score_mod_fn=None, is_first_block=True)
                started = False
                for n_tile in cutlass.range(hi - 1 - c * CB, unroll=1):
                    kv_state = step(kv_state, n_block=hi - 2 - n_tile, seqlen=seqlen,
                                    mma_pv_fn=partial(mma_pv_fn, zero_init=not started), mask_fn=None)
                    started = True
                kv_state = last(kv_consumer_state=kv_state, zero_init=not started)
                close(c)
            pipeline_q.consumer_release_w_index(0)
            q_phase ^= 1
            if const_expr(self.merge):
                # kernels/cpu/merge.py, ascending chunks, from the stored partials (each thread reads
                # back the out values it wrote; the lse every lane of its quad wrote, the same value)
                for r in cutlass.range_constexpr(n_rows):
                    row = tOcO[r, 0][0]
                    total = Float32(0.0)
                    for j in cutlass.range_constexpr(n_cols):
                        acc_mn[r, j] = Float32(0.0)
                    if row < group:
                        h = head_idx * group + row
                        m = top_lse[r]
                        m_safe = m if m != -Float32.inf else Float32(0.0)
                        for c in cutlass.range(n_chunks, unroll=1):
                            lse_c = mPairLSE[c, batch_idx, h]
                            if lse_c != -Float32.inf:
                                w = exp_f32(f32op("sub", lse_c, m_safe))
                                total = f32op("add", total, w)
                                for j in cutlass.range_constexpr(n_cols):
                                    o = Float32(mPairO[c, batch_idx, h, tOcO[r, j][1]])
                                    acc_mn[r, j] = f32op("add", acc_mn[r, j], f32op("mul", w, o))
                        for j in cutlass.range_constexpr(n_cols):
                            acc_mn[r, j] = f32op("div", acc_mn[r, j], total) if total != 0.0 else Float32(0.0)
                        softmax.row_sum[r] = f32op("add", m, log_f32(total))
            self.epilogue(acc_O, softmax.row_sum, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                          tiled_mma_pv, tidx, m_block, head_idx, batch_idx)
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()

