import math
import os

import pytest
import torch
import torch.distributed as dist

import rlk_ops  # noqa: F401 - registers torch.ops.rlk

# One process: 2 intra-op threads. Under pytest-xdist (make test's runs over 2 workers) one thread per
# worker, so the workers do not share 2 cores among 4 threads; the tests that need 2 threads to be able to
# fail (a row sum split across threads) set 2 themselves.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def single_process_group():
    """A world-size-1 gloo group in the test process (for opcheck of the collectives)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, plus same dtype and shape (the claims are about bits of one dtype)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def fill_paged_cache(k, v, page_size, generator, extra_pages=5, pad=-7):
    """Write each sequence's K/V [B, S, Hkv, D] into shuffled, non-contiguous pages;
    random garbage in every other slot, ``pad`` in the unused page_table entries (they
    may hold anything). Returns (k_cache, v_cache, page_table)."""
    bsz, s, h_kv, d = k.shape
    per_seq = math.ceil(s / page_size)
    num_pages = bsz * per_seq + extra_pages
    k_cache = torch.randn(num_pages, page_size, h_kv, d, generator=generator).to(k.dtype)
    v_cache = torch.randn(num_pages, page_size, h_kv, d, generator=generator).to(k.dtype)
    perm = torch.randperm(num_pages, generator=generator)
    page_table = torch.full((bsz, per_seq + 2), pad, dtype=torch.int32)
    for b in range(bsz):
        pages = perm[b * per_seq:(b + 1) * per_seq]
        page_table[b, :per_seq] = pages.int()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:s]
        rlk_ops.paged_kv_append(k_cache, v_cache, k[b], v[b], slots)
    return k_cache, v_cache, page_table


def ref_attention(q, k, v, causal=True, scale=None):
    """float64 attention on dense [B, S, H, D] inputs: (out [B,Sq,Hq,D], lse [B,Hq,Sq])."""
    _, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    g = hq // hkv
    kk = k.double().repeat_interleave(g, 2)
    vv = v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    if causal:
        qp = torch.arange(sq) + sk - sq
        s = s.masked_fill(torch.arange(sk)[None, :] > qp[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    return out, lse


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# One tolerance table for accuracy against float64 math (invariance is always bitwise).
# Relative Frobenius error ||out - ref|| / ||ref||.
TOL = {
    # bf16 output rounding alone is 2**-9 relative per element (~2e-3 in norm);
    # P is fed to the PV product in bf16 as FA4 does: another ~2**-9.
    torch.bfloat16: 8e-3,
    torch.float16: 1e-3,   # 2**-11 per rounding
    torch.float32: 1e-5,   # fp32 accumulation over <= a few thousand terms
    torch.float64: 1e-12,
}
