"""Triton backend (CUDA): accuracy against the CPU reference, bitwise run-to-run and
batch invariance, exact data movement. CUDA tests are marked ``cuda`` and skip without
a GPU; the CPU tests check that the backend refuses cleanly where it cannot run."""
import pytest
import torch

import rlk_ops
from rlk_ops.kernels import cpu
from rlk_ops.kernels.dispatch import BackendUnavailable

from conftest import TOL, bitwise_equal, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HQ, HKV, D = 16, 4, 128  # Qwen3-8B TP=2 shard
T = 300                  # not a multiple of any tile (16, 32, 64, 128 rows)
ROWS = (0, 1, 15, 16, 17, 127, 128, 299)


def cuda_test(fn):
    return pytest.mark.cuda(needs_cuda(fn))


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=_g(seed)).to(dtype).cuda()


# ----------------------------------------------------------------------- CPU side
def _nan_globals(source: str) -> list[str]:
    """Module-level names bound to a NaN literal (float("nan"), math.nan, ... also inside
    tl.constexpr(...)), read from the source: no triton import needed."""
    import ast

    def is_nan(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "float" and n.args \
                    and isinstance(n.args[0], ast.Constant) and str(n.args[0].value).strip().lower() == "nan":
                return True
            if isinstance(n, ast.Attribute) and n.attr == "nan":
                return True
        return False

    return [t.id for node in ast.parse(source).body if isinstance(node, (ast.Assign, ast.AnnAssign))
            and node.value is not None and is_nan(node.value)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]


def test_kernel_modules_hold_no_nan_globals():
    """Triton re-checks a kernel's globals on every launch with ``!=``; a NaN global fails it
    ("Global variable _NAN has changed ... from constexpr[nan] to constexpr[nan]"), which
    only shows on a GPU (it broke every merge launch in one H200 run)."""
    import pathlib

    folder = pathlib.Path(rlk_ops.__file__).parent / "kernels" / "triton"
    files = sorted(folder.glob("*.py"))
    assert len(files) >= 6
    for f in files:
        assert _nan_globals(f.read_text()) == [], f"{f.name} binds a NaN global"
    assert _nan_globals('_NAN = tl.constexpr(float("nan"))\nX = math.nan\nY = 1.0\n') == ["_NAN", "X"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_check_available_refuses_without_cuda():
    from rlk_ops.kernels import triton as backend

    with pytest.raises(BackendUnavailable, match="torch.cuda is not available"):
        backend.check_available("qk_rmsnorm")
    with pytest.raises(BackendUnavailable, match="no kernel for rlk::attention_fwd"):
        backend.check_available("attention_fwd")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_strict_mode_refuses_triton_on_a_cpu_machine():
    x, w = torch.randn(3, 2, 8), torch.randn(8)
    with rlk_ops.use_backend(qk_rmsnorm="triton"):
        with pytest.raises(rlk_ops.StrictModeError, match=r"rlk::qk_rmsnorm on cpu: backend 'triton' unavailable"):
            rlk_ops.qk_rmsnorm(x, w)


def test_import_of_the_backend_package_needs_no_triton():
    import rlk_ops.kernels.triton as backend  # the kernels (and triton) load on first call

    assert callable(backend.qk_norm_rope) and callable(backend.linear)


# -------------------------------------------------------------- norm, rope (CUDA)
@cuda_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_rmsnorm_accuracy_and_invariance(dtype):
    x, w = _rand(T, HQ, D, dtype=dtype), _rand(D, dtype=dtype, seed=1)
    with rlk_ops.provenance.capture() as log:
        y = rlk_ops.qk_rmsnorm(x, w)
    assert [(r.requested_backend, r.actual_backend) for r in log.records()] == [("triton", "triton")]
    ref = cpu.qk_rmsnorm(x.cpu(), w.cpu(), 1e-6)
    assert rel_err(y.cpu(), ref) < TOL[dtype]
    assert bitwise_equal(rlk_ops.qk_rmsnorm(x, w), y)  # run to run
    for t in ROWS:
        assert bitwise_equal(rlk_ops.qk_rmsnorm(x[t:t + 1], w)[0], y[t])
    # the same rows seen as 2-D [rows, D] (another kernel decomposition) give the same bits
    assert bitwise_equal(rlk_ops.qk_rmsnorm(x.reshape(-1, D), w), y.reshape(-1, D))


@cuda_test
def test_qk_rmsnorm_backward_accuracy_and_run_to_run():
    x, w, dy = _rand(T, HKV, D), _rand(D, seed=1), _rand(T, HKV, D, seed=2)
    dx, dw = torch.ops.rlk.qk_rmsnorm_bwd(dy, x, w, 1e-6)
    rdx, rdw = cpu.qk_rmsnorm_bwd(dy.cpu(), x.cpu(), w.cpu(), 1e-6)
    assert rel_err(dx.cpu(), rdx) < TOL[torch.bfloat16] and rel_err(dw.cpu(), rdw) < TOL[torch.bfloat16]
    dx2, dw2 = torch.ops.rlk.qk_rmsnorm_bwd(dy, x, w, 1e-6)
    assert bitwise_equal(dx2, dx) and bitwise_equal(dw2, dw)  # dweight: fixed-order sum, no atomics
    for t in ROWS:  # dx is per row
        assert bitwise_equal(torch.ops.rlk.qk_rmsnorm_bwd(dy[t:t + 1], x[t:t + 1], w, 1e-6)[0][0], dx[t])


@cuda_test
@pytest.mark.parametrize("dtype,rd", [(torch.bfloat16, 128), (torch.bfloat16, 64), (torch.float32, 128)])
def test_rope_accuracy_and_invariance(dtype, rd):
    x = _rand(T, HQ, D, dtype=dtype)
    pos = torch.randint(0, 40000, (T,), generator=_g(5)).cuda()
    y = rlk_ops.rope(x, pos, 1e6, rd)
    ref = cpu.rope(x.cpu(), pos.cpu(), 1e6, rd)
    assert rel_err(y.cpu(), ref) < TOL[dtype]
    assert bitwise_equal(y[..., rd:], x[..., rd:])  # dims past rotary_dim pass through
    assert bitwise_equal(rlk_ops.rope(x, pos, 1e6, rd), y)
    for t in ROWS:
        assert bitwise_equal(rlk_ops.rope(x[t:t + 1], pos[t:t + 1], 1e6, rd)[0], y[t])
    dy = torch.ops.rlk.rope_bwd(x, pos, 1e6, rd)
    assert rel_err(dy.cpu(), cpu.rope_bwd(x.cpu(), pos.cpu(), 1e6, rd)) < TOL[dtype]
    # the spec's claims for the triton backward: run to run, and a token alone equals it in the batch
    assert bitwise_equal(torch.ops.rlk.rope_bwd(x, pos, 1e6, rd), dy)
    for t in ROWS:
        assert bitwise_equal(torch.ops.rlk.rope_bwd(x[t:t + 1], pos[t:t + 1], 1e6, rd)[0], dy[t])


@cuda_test
def test_rope_table_and_in_kernel_cos_sin_agree():
    from rlk_ops.kernels.triton.norm_rope import TABLE_LEN, TOK

    x = _rand(4 * TOK, HKV, D)
    pos = torch.randint(0, TABLE_LEN, (4 * TOK,), generator=_g(6))
    pos[TOK + 4] = TABLE_LEN + 12345  # the program of tokens TOK..2*TOK-1 computes cos/sin itself
    pos = pos.cuda()
    y = rlk_ops.rope(x, pos, 1e6)
    for t in range(TOK, 2 * TOK):  # alone, every one of them but TOK + 4 reads the table
        assert bitwise_equal(rlk_ops.rope(x[t:t + 1], pos[t:t + 1], 1e6)[0], y[t])
    assert rel_err(y.cpu(), cpu.rope(x.cpu(), pos.cpu(), 1e6, D)) < TOL[torch.bfloat16]


@cuda_test
def test_rope_dense_layout_equals_packed():
    x = _rand(2, 150, HKV, D)
    pos = torch.arange(150).repeat(2, 1).cuda()
    dense = rlk_ops.rope(x, pos, 1e6)
    packed = rlk_ops.rope(x.reshape(300, HKV, D), pos.reshape(300), 1e6)
    assert bitwise_equal(dense.reshape(300, HKV, D), packed)


# ------------------------------------------------------------ paged KV (CUDA)
def _cache(num_pages=40, ps=16, dtype=torch.bfloat16):
    return _rand(num_pages, ps, HKV, D, dtype=dtype, seed=7), _rand(num_pages, ps, HKV, D, dtype=dtype, seed=8)


@cuda_test
def test_paged_kv_append_is_exact():
    kc, vc = _cache()
    k, v = _rand(50, HKV, D, seed=9), _rand(50, HKV, D, seed=10)
    slots = torch.randperm(40 * 16, generator=_g(11))[:50]
    slots[[3, 17]] = -1
    slots = slots.cuda()
    kr, vr = kc.cpu(), vc.cpu()
    cpu.paged_kv_append(kr, vr, k.cpu(), v.cpu(), slots.cpu())
    rlk_ops.paged_kv_append(kc, vc, k, v, slots)
    assert bitwise_equal(kc.cpu(), kr) and bitwise_equal(vc.cpu(), vr)


@cuda_test
def test_paged_kv_gather_is_exact_and_batch_invariant():
    kc, vc = _cache()
    table = torch.randperm(40, generator=_g(12))[:36].reshape(4, 9).int()
    table[2, 5:] = -3  # padding past the last used page may hold anything
    lens = torch.tensor([144, 1, 70, 17], dtype=torch.int32)
    k, v = rlk_ops.paged_kv_gather(kc, vc, table.cuda(), lens.cuda())
    rk, rv = cpu.paged_kv_gather(kc.cpu(), vc.cpu(), table, lens)
    assert bitwise_equal(k.cpu(), rk) and bitwise_equal(v.cpu(), rv)
    for b in range(4):
        k1, v1 = rlk_ops.paged_kv_gather(kc, vc, table[b:b + 1].cuda(), lens[b:b + 1].cuda())
        assert bitwise_equal(k1[0], k[b]) and bitwise_equal(v1[0], v[b])


# ------------------------------------------------------------------ linear (CUDA)
@cuda_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_accuracy_and_row_invariance(dtype):
    x, w, b = _rand(T, 512, dtype=dtype), _rand(384, 512, dtype=dtype, seed=1), _rand(384, dtype=dtype, seed=2)
    y = rlk_ops.linear(x, w, b)
    assert rel_err(y.cpu(), cpu.linear(x.cpu(), w.cpu(), b.cpu())) < TOL[dtype]
    assert bitwise_equal(rlk_ops.linear(x, w, b), y)
    for t in ROWS:
        assert bitwise_equal(rlk_ops.linear(x[t:t + 1], w, b)[0], y[t])
    assert bitwise_equal(rlk_ops.linear(x[:16], w, b), y[:16])
    assert bitwise_equal(rlk_ops.linear(x.view(3, 100, 512), w, b).view(T, 384), y)


@cuda_test
def test_linear_rows_equal_across_batch_sizes_past_one_wave():
    """At M = 4096, K = 4096, N = 3072 (a QKV projection) there are more output tiles than SMs, so the
    persistent programs loop over several tiles each: a row's bits must not depend on which program,
    or which of its tiles, computed it. (The test above stays within one wave: a kernel that walked K
    backwards on a program's later tiles passed it; a session 33 audit.)"""
    from rlk_ops.kernels.triton import _common as tc
    from rlk_ops.kernels.triton import gemm

    m, k, n = 4096, 4096, 3072
    x, w = _rand(m, k), _rand(n, k, seed=1)
    cfg = gemm.CONFIG
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    assert tiles > tc.num_sms(torch.cuda.current_device()), (tiles, "not past one wave")
    y = rlk_ops.linear(x, w, None)
    rows = torch.randperm(m, generator=_g(5))[:24].tolist() + [0, m - 1]
    for r in rows:
        assert bitwise_equal(rlk_ops.linear(x[r:r + 1], w, None)[0], y[r]), r
    for size in (16, 256, 1000):
        assert bitwise_equal(rlk_ops.linear(x[m - size:], w, None), y[m - size:]), size


@cuda_test
def test_linear_backward_accuracy_and_run_to_run():
    x, w, b = _rand(T, 256), _rand(192, 256, seed=1), _rand(192, seed=2)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = rlk_ops.linear(xr, wr, br)
    dy = _rand(T, 192, seed=3)
    grads = torch.autograd.grad(y, (xr, wr, br), dy)
    ref = cpu.linear_bwd(dy.cpu(), x.cpu(), w.cpu()) + (cpu.linear_bias_bwd(dy.cpu()),)
    for g, r in zip(grads, ref):
        assert rel_err(g.cpu(), r) < TOL[torch.bfloat16]
    again = torch.autograd.grad(rlk_ops.linear(xr, wr, br), (xr, wr, br), dy)
    assert all(bitwise_equal(a, g) for a, g in zip(again, grads))


@cuda_test
def test_linear_weight_gradient_past_int32_offsets():
    """dW = dy^T @ x reads dy^T with its K (the tokens) strided by N: at 16384 tokens of a 151936-word
    lm_head, (tokens - 1) * N passes 2^31, and the kernel's int32 K offsets wrapped (session 32 audit:
    a wrong dW). ~15 GB of GPU memory."""
    m, n, k = 16384, 151936, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    _, dw = torch.ops.rlk.linear_bwd(dy, x, w)
    ref = dy.float().t() @ x.float()
    assert (m - 1) * n >= 2 ** 31
    for rows in (slice(0, 1024), slice(n - 1024, n)):   # the first rows and the last (the largest offsets)
        assert rel_err(dw[rows].float(), ref[rows]) < TOL[torch.bfloat16], rows
    del dy, ref


@cuda_test
def test_linear_rejects_float64_with_a_clear_error():
    x, w = torch.randn(4, 8, dtype=torch.float64).cuda(), torch.randn(6, 8, dtype=torch.float64).cuda()
    with pytest.raises(ValueError, match="triton linear kernel supports bfloat16, float16 and float32, got "
                                         "torch.float64"):
        rlk_ops.linear(x, w)
