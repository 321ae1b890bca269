"""Triton paged KV cache append and gather: pure data movement (exact).

append: one program per (token, BLOCK chunk of H_kv*D), writes k and v rows to
``slot = page * page_size + offset`` of the flat cache; slot -1 skips the row (masked
store). The op layer has already rejected out-of-range and duplicate slots (value
checks), so no two programs write one slot and the result does not depend on order.

gather: one program per (sequence, page chunk): copies the page's rows of tokens
below seq_len and writes zeros past it. Page table entries past a sequence's last
page are never read (they are padding and may hold anything).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_ops.kernels.triton import _common as C

BLOCK = 2048  # elements per program


@triton.jit(do_not_specialize=["n_tok"])
def _append_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_tok, HD: tl.constexpr, BLOCK_: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_ + tl.arange(0, BLOCK_)
    slot = tl.load(slot_ptr + t)
    mask = (offs < HD) & (slot >= 0)
    src = t * HD + offs
    dst = slot * HD + offs
    tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _gather_kernel(kc_ptr, vc_ptr, table_ptr, lens_ptr, k_ptr, v_ptr, max_pages,
                   PS: tl.constexpr, HD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    page_chunk = tl.program_id(0)
    j = page_chunk // CHUNKS
    offs = (page_chunk % CHUNKS) * BLOCK_ + tl.arange(0, BLOCK_)  # within the page's PS*HD elements
    n = tl.load(lens_ptr + b)
    in_page = offs < PS * HD
    valid = in_page & ((j * PS + offs // HD) < n)
    # only a page that holds a token below seq_len is read; padding entries are never read
    page = tl.load(table_ptr + b * max_pages + j, mask=j * PS < n, other=0).to(tl.int64)
    src = page * (PS * HD) + offs
    dst = (b * max_pages + j) * (PS * HD) + offs
    kv = tl.load(kc_ptr + src, mask=valid, other=0.0)
    vv = tl.load(vc_ptr + src, mask=valid, other=0.0)
    tl.store(k_ptr + dst, kv, mask=in_page)
    tl.store(v_ptr + dst, vv, mask=in_page)


def paged_kv_append(k_cache, v_cache, k, v, slot_mapping):
    t = k.shape[0]
    if t == 0:
        return None
    hd = k.shape[1] * k.shape[2]
    k, v, slots = C.aligned(k), C.aligned(v), C.aligned(slot_mapping)
    _append_kernel[(t, triton.cdiv(hd, BLOCK))](k, v, k_cache, v_cache, slots, t, HD=hd, BLOCK_=BLOCK, **C.LAUNCH)
    return None


def paged_kv_gather(k_cache, v_cache, page_table, seq_lens):
    bsz, max_pages = page_table.shape
    _, ps, h, d = k_cache.shape
    shape = (bsz, max_pages * ps, h, d)
    k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    v = torch.empty(shape, dtype=v_cache.dtype, device=v_cache.device)
    if k.numel() == 0:
        return k, v
    chunks = triton.cdiv(ps * h * d, BLOCK)
    _gather_kernel[(max_pages * chunks, bsz)](
        k_cache.contiguous(), v_cache.contiguous(), C.aligned(page_table), C.aligned(seq_lens), k, v, max_pages,
        PS=ps, HD=h * d, CHUNKS=chunks, BLOCK_=BLOCK, **C.LAUNCH)
    return k, v
