"""CPU reference attention: forward, backward and paged forward.

One core (``_forward`` / ``_backward``) serves the dense, packed-varlen and paged
forms. Its definition of a query row's result, which every form reproduces bit for
bit:

* keys are visited in blocks of ``BLOCK`` = 128 aligned to absolute key position 0,
  in ascending order (FA4 on SM90 uses the same 128-key tiles, but visits them last to
  first, so the two agree to rounding, not bitwise);
* per block: scores ``s = rowsum(q * k) * scale`` (numerics.rowsum: order fixed by
  head_dim), masked keys -> -inf, then the online-softmax update in fp32
  ``m' = max(m, max s); a = exp(m - m'); p = exp(s - m'); l = l*a + rowsum(p);
  acc = acc*a + rowsum(p16 * v)`` where ``p16`` is p rounded to the input dtype for
  16-bit inputs (as FA4 feeds P to its tensor-core MMA);
* ``out = acc / l`` rounded once to the input dtype; ``lse = m + log(l)`` (natural log).

Every operation is elementwise or a per-row reduction, so a row's bits depend only
on its own query, its keys and its absolute position: not on how many rows, which
other sequences, padding, or which pages held the keys. Blocks a row cannot see
(beyond its causal position) are exact identities (a = exp(0) = 1, p = 0), so
processing them for a neighbouring row changes nothing.

Causal masking is bottom-right aligned: query row i of Sq sits at absolute position
``Sk - Sq + i``. float64 inputs accumulate (and return lse) in float64: that path
exists for gradcheck; every other dtype accumulates in float32.

``split_kv="canonical:C"`` (kernels/cpu/canonical.py) computes a row as partial states
over C-key chunks, each exactly this core over the chunk's keys, merged by
``rlk::merge_attn_states``; ``"disabled"`` is the single pass above.
"""
from __future__ import annotations

import math

import torch

from rlk_ops.kernels.cpu import canonical
from rlk_ops.kernels.cpu import numerics as nx
from rlk_ops.meta.contract import SplitKVPolicy
from rlk_ops.ops._validate import RlkInputError

BLOCK = 128
# elements of the largest temporary product per step (fp32: 16 MiB); the backward's, per KV head
# (its row chunks must not depend on the head count: _backward), so Hkv x that there
_BUDGET = 1 << 22



def _mm_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round an fp32 MMA operand to the 16-bit input dtype, as tensor cores consume it."""
    if dtype in (torch.bfloat16, torch.float16):
        return x.to(dtype).to(torch.float32)
    return x


def _pad_blocks(x: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[B, Sk, H, D] -> [B, H, n_keys, D] in acc dtype, zero beyond Sk (n_keys % BLOCK == 0)."""
    b, sk, h, d = x.shape
    out = x.new_zeros((b, n_keys, h, d), dtype=nx.acc_dtype(x.dtype))
    n = min(sk, n_keys)
    out[:, :n] = x[:, :n]
    return out.permute(0, 2, 1, 3).contiguous()


def _chunks(batch: int, rows: int, group: int, h_kv: int, d: int):
    """Yield (b0, b1, s0, s1): pieces small enough for one temporary product."""
    cap = max(group, _BUDGET // (h_kv * BLOCK * d))  # rows (q rows x group) per step
    if rows * group <= cap:
        per = max(1, cap // (rows * group))
        for b0 in range(0, batch, per):
            yield b0, min(batch, b0 + per), 0, rows
    else:
        step = max(1, cap // group)
        for b in range(batch):
            for s0 in range(0, rows, step):
                yield b, b + 1, s0, min(rows, s0 + step)


def _rows(x: torch.Tensor, h_kv: int, acc: torch.dtype) -> torch.Tensor:
    """[B, S, Hq, D] -> [B, Hkv, S*G, D] (row = s*G + g), acc dtype, contiguous."""
    b, s, hq, d = x.shape
    g = hq // h_kv
    return x.reshape(b, s, h_kv, g, d).permute(0, 2, 1, 3, 4).reshape(b, h_kv, s * g, d).to(acc).contiguous()


def _unrows(x: torch.Tensor, s: int, hq: int) -> torch.Tensor:
    """[B, Hkv, S*G, D] -> [B, S, Hq, D]."""
    b, h_kv, _, d = x.shape
    return x.reshape(b, h_kv, s, hq // h_kv, d).permute(0, 2, 1, 3, 4).reshape(b, s, hq, d)


def _row_lse(x: torch.Tensor, s: int, hq: int) -> torch.Tensor:
    """[B, Hkv, S*G] -> [B, Hq, S]."""
    b, h_kv, _ = x.shape
    return x.reshape(b, h_kv, s, hq // h_kv).permute(0, 1, 3, 2).reshape(b, hq, s)


def _lse_rows(lse: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[B, Hq, S] -> [B, Hkv, S*G]."""
    b, hq, s = lse.shape
    return lse.reshape(b, h_kv, hq // h_kv, s).permute(0, 1, 3, 2).reshape(b, h_kv, s * (hq // h_kv))


def _scores(q_rows, k_blk, pos, k_len, j0, causal, scale):
    """Masked, scaled scores [b, Hkv, R, BLOCK] of one key block."""
    s = nx.rowsum(q_rows[:, :, :, None, :] * k_blk[:, :, None, :, :]) * scale
    key_pos = torch.arange(j0, j0 + BLOCK)
    valid = key_pos.view(1, 1, 1, BLOCK) < k_len.view(-1, 1, 1, 1)
    if causal:
        valid = valid & (key_pos.view(1, 1, 1, BLOCK) <= pos[:, None, :, None])
    return torch.where(valid, s, -math.inf)


def _limit(pos: torch.Tensor, k_len: torch.Tensor, causal: bool) -> int:
    """Number of keys the rows of a chunk can see (max over rows)."""
    if causal:
        lim = torch.minimum(pos.max(dim=-1).values + 1, k_len)
    else:
        lim = k_len
    return int(lim.max()) if lim.numel() else 0


def _forward(q, k, v, q_pos, k_len, causal, scale):
    """q [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D]; q_pos [B, Sq] int64; k_len [B] int64.
    Returns out [B, Sq, Hq, D] (q.dtype) and lse [B, Hq, Sq] (fp32; fp64 for fp64)."""
    bsz, sq, hq, d = q.shape
    h_kv = k.shape[2]
    g = hq // h_kv
    acc_t = nx.acc_dtype(q.dtype)
    out = q.new_empty((bsz, sq, hq, d))
    lse = torch.empty((bsz, hq, sq), dtype=acc_t)
    if bsz == 0 or sq == 0:
        return out, lse
    n_keys = max(BLOCK, math.ceil(int(k_len.max()) / BLOCK) * BLOCK)
    k_all = _pad_blocks(k, n_keys)                                # [B, Hkv, N, D]
    v_all = _pad_blocks(v, n_keys).transpose(-1, -2).contiguous()  # [B, Hkv, D, N]
    for b0, b1, s0, s1 in _chunks(bsz, sq, g, h_kv, d):
        rows = _rows(q[b0:b1, s0:s1], h_kv, acc_t)
        pos = q_pos[b0:b1, s0:s1].repeat_interleave(g, dim=1)   # [b, R]
        kl = k_len[b0:b1]
        r = rows.shape[2]
        m = torch.full((b1 - b0, h_kv, r), -math.inf, dtype=acc_t)
        l = torch.zeros((b1 - b0, h_kv, r), dtype=acc_t)
        acc = torch.zeros((b1 - b0, h_kv, r, d), dtype=acc_t)
        for j0 in range(0, _limit(pos, kl, causal), BLOCK):
            s = _scores(rows, k_all[b0:b1, :, j0:j0 + BLOCK], pos, kl, j0, causal, scale)
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = nx.exp(m - m_safe)
            p = nx.exp(s - m_safe[..., None])
            l = l * alpha + nx.rowsum(p)
            pv = nx.rowsum(_mm_round(p, q.dtype)[:, :, :, None, :] * v_all[b0:b1, :, None, :, j0:j0 + BLOCK])
            acc = acc * alpha[..., None] + pv
            m = m_new
        # 0 only for a row that saw no key (l == 0); an overflowing score makes l NaN, and the row NaN
        # as in SDPA and the merge (`l > 0` was False for NaN: a finite 0 row; a session 34 audit)
        o = torch.where(l[..., None] == 0, 0.0, acc / l[..., None])
        out[b0:b1, s0:s1] = _unrows(o, s1 - s0, hq).to(q.dtype)
        lse[b0:b1, :, s0:s1] = _row_lse(m + nx.log(l), s1 - s0, hq)
    return out, lse


def _backward(dout, q, k, v, out, lse, dlse, q_pos, k_len, causal, scale):
    """Gradients of ``_forward`` (dlse: gradient w.r.t. lse, or None).
    dk/dv sum over query rows: rows in ascending chunks, each chunk in rowsum order."""
    bsz, sq, hq, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    g = hq // h_kv
    acc_t = nx.acc_dtype(q.dtype)
    n_keys = max(BLOCK, math.ceil(max(sk, 1) / BLOCK) * BLOCK)
    dq = torch.zeros((bsz, sq, hq, d), dtype=q.dtype)
    dk = torch.zeros((bsz, h_kv, n_keys, d), dtype=acc_t)
    dv = torch.zeros((bsz, h_kv, n_keys, d), dtype=acc_t)
    if bsz and sq:
        k_all = _pad_blocks(k, n_keys)
        k_all_t = k_all.transpose(-1, -2).contiguous()            # [B, Hkv, D, N]
        v_all = _pad_blocks(v, n_keys)                             # [B, Hkv, N, D]
        lse_rows = _lse_rows(lse.to(acc_t), h_kv)
        dlse_rows = None if dlse is None else _lse_rows(dlse.to(acc_t), h_kv)
        # dk/dv add up the query rows chunk by chunk: the chunks are sized as for one KV head, so
        # their bounds (and the bits) do not depend on how many KV heads this call holds. Sized for
        # all of them, a tensor-parallel rank (fewer heads) chunked its rows differently from one
        # device and its dk/dv differed (a session 31 audit); the temporaries now grow with Hkv.
        for b0, b1, s0, s1 in _chunks(bsz, sq, g, 1, d):
            rows = _rows(q[b0:b1, s0:s1], h_kv, acc_t)
            rows_t = rows.transpose(-1, -2).contiguous()          # [b, Hkv, D, R]
            do = _rows(dout[b0:b1, s0:s1], h_kv, acc_t)
            do_t = _mm_round(do, q.dtype).transpose(-1, -2).contiguous()
            o = _rows(out[b0:b1, s0:s1], h_kv, acc_t)
            r = rows.shape[2]
            rsl = slice(s0 * g, s1 * g)
            lse_c = lse_rows[b0:b1, :, rsl]
            delta = nx.rowsum(do * o)
            if dlse_rows is not None:
                delta = delta - dlse_rows[b0:b1, :, rsl]
            pos = q_pos[b0:b1, s0:s1].repeat_interleave(g, dim=1)
            kl = k_len[b0:b1]
            lse_safe = torch.where(lse_c == -math.inf, math.inf, lse_c)
            dq_acc = torch.zeros((b1 - b0, h_kv, r, d), dtype=acc_t)
            for j0 in range(0, _limit(pos, kl, causal), BLOCK):
                blk = slice(j0, j0 + BLOCK)
                s = _scores(rows, k_all[b0:b1, :, blk], pos, kl, j0, causal, scale)
                p = nx.exp(s - lse_safe[..., None])
                dp = nx.rowsum(do[:, :, :, None, :] * v_all[b0:b1, :, None, blk, :])
                # a key the row does not see contributes 0, whatever dp is: unmasked, a huge finite V there
                # made dp inf and 0 * inf NaN, so a row's dq depended on which key blocks its chunk walked
                ds = torch.where(s == -math.inf, 0.0, p * (dp - delta[..., None]))
                ds_mm = _mm_round(ds, q.dtype)
                dq_acc = dq_acc + nx.rowsum(ds_mm[:, :, :, None, :] * k_all_t[b0:b1, :, None, :, blk])
                ds_t = ds_mm.transpose(-1, -2).contiguous()        # [b, Hkv, BLOCK, R]
                p_t = _mm_round(p, q.dtype).transpose(-1, -2).contiguous()
                dk[b0:b1, :, blk] += nx.rowsum(ds_t[:, :, :, None, :] * rows_t[:, :, None, :, :])
                dv[b0:b1, :, blk] += nx.rowsum(p_t[:, :, :, None, :] * do_t[:, :, None, :, :])
            dq[b0:b1, s0:s1] = _unrows(dq_acc * scale, s1 - s0, hq).to(q.dtype)
    dk = (dk * scale)[:, :, :sk].permute(0, 2, 1, 3).to(k.dtype)
    dv = dv[:, :, :sk].permute(0, 2, 1, 3).to(v.dtype)
    return dq, dk.contiguous(), dv.contiguous()


def _dense_positions(bsz: int, sq: int, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_pos = (torch.arange(sq, dtype=torch.int64) + (sk - sq)).expand(bsz, sq)
    return q_pos, torch.full((bsz,), sk, dtype=torch.int64)


def _varlen_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _policy(op: str, split_kv: str) -> SplitKVPolicy:
    policy = SplitKVPolicy.parse(split_kv)
    if policy.kind not in ("disabled", "canonical"):
        raise RlkInputError(f"rlk::{op}: split_kv {split_kv!r} is not implemented by the cpu backend "
                            f"(supported: disabled, canonical:C)")
    return policy


def attention_fwd(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  split_kv="disabled"):
    policy = _policy("attention_fwd", split_kv)
    if policy.kind == "canonical":
        return canonical.attention_fwd(q, k, v, bool(causal), softmax_scale, cu_seqlens_q, cu_seqlens_k,
                                       policy.size, attend_into=canonical.gathered(attention_fwd))
    if cu_seqlens_q is None:
        q_pos, k_len = _dense_positions(q.shape[0], q.shape[1], k.shape[1])
        out, lse = _forward(q, k, v, q_pos, k_len, bool(causal), softmax_scale)
        return out, lse.float() if q.dtype != torch.float64 else lse
    total, hq, _ = q.shape
    acc_t = nx.acc_dtype(q.dtype)
    out = q.new_empty(q.shape)
    lse = torch.empty((hq, total), dtype=acc_t)
    for q0, q1, k0, k1 in _varlen_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        q_pos, k_len = _dense_positions(1, q1 - q0, k1 - k0)
        o, l = _forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], q_pos, k_len, bool(causal), softmax_scale)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, dlse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, split_kv="disabled"):
    # canonical:C needs no code of its own here. Its forward is the same function of
    # (q, k, v) as single pass (the merge is exact algebra; only the rounding differs),
    # so its exact gradient is this backward evaluated at the forward's own (out, lse):
    # the chain rule through the merge hands chunk c the row term
    # p_c * (rowsum(dout * out) - dlse) with p_c = exp(lse_c - lse), and
    # p_c * exp(s - lse_c) = exp(s - lse), the single-pass P. One deterministic pass, no
    # per-chunk states, fewer roundings than going chunk by chunk; tests/test_canonical.py
    # checks it against that explicit chain rule and with gradcheck.
    _policy("attention_bwd", split_kv)
    if cu_seqlens_q is None:
        q_pos, k_len = _dense_positions(q.shape[0], q.shape[1], k.shape[1])
        return _backward(dout, q, k, v, out, lse, dlse, q_pos, k_len, bool(causal), softmax_scale)
    # contiguous, as the fake says (zeros_like would keep a permuted q/k/v's strides)
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for q0, q1, k0, k1 in _varlen_bounds(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue  # keys of a sequence without queries get no gradient
        q_pos, k_len = _dense_positions(1, q1 - q0, k1 - k0)
        dl = None if dlse is None else dlse[None, :, q0:q1]
        a, b, c = _backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                            out[None, q0:q1], lse[None, :, q0:q1], dl, q_pos, k_len, bool(causal), softmax_scale)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = a[0], b[0], c[0]
    return dq, dk, dv


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, n_pages: int) -> torch.Tensor:
    """[num_pages, page_size, H, D] -> [B, n_pages * page_size, H, D] (exact copy)."""
    bsz = page_table.shape[0]
    _, ps, h, d = cache.shape
    pages = page_table[:, :n_pages].long().clamp(0, cache.shape[0] - 1)
    return cache[pages.reshape(-1)].reshape(bsz, n_pages * ps, h, d)


def _logical_kv(k_cache, v_cache, page_table, k_len):
    """Each sequence's keys and values [B, n_pages * page_size, Hkv, D], zero past its length."""
    ps = k_cache.shape[1]
    n_pages = max(1, math.ceil(int(k_len.max()) / ps)) if k_len.numel() else 1
    k = gather_pages(k_cache, page_table, n_pages)
    v = gather_pages(v_cache, page_table, n_pages)
    # keys past seq_len (stale page contents) must not reach the arithmetic: zero them
    valid = torch.arange(n_pages * ps).view(1, -1) < k_len.view(-1, 1)
    return torch.where(valid[:, :, None, None], k, 0), torch.where(valid[:, :, None, None], v, 0)


def paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, split_kv="disabled"):
    policy = _policy("paged_attention", split_kv)
    if policy.kind == "canonical":
        return canonical.paged_attention(q, k_cache, v_cache, page_table, seq_lens, softmax_scale, policy.size,
                                         attend_into=canonical.gathered(attention_fwd),
                                         attend_paged=paged_attention)
    sq = q.shape[1]
    k_len = seq_lens.to(torch.int64)
    k, v = _logical_kv(k_cache, v_cache, page_table, k_len)
    q_pos = k_len.view(-1, 1) - sq + torch.arange(sq, dtype=torch.int64).view(1, -1)
    out, lse = _forward(q, k, v, q_pos, k_len, True, softmax_scale)
    return out, lse if q.dtype == torch.float64 else lse.float()
