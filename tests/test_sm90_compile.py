"""Every decode-pair kernel variant still builds for sm90, on a machine without a GPU.

The interpreter tests (TRITON_INTERPRET=1) check the kernels' arithmetic but never compile them,
and the CUDA tests run only where a GPU is lent. Session 24 found the 'rows' and 'tile' layouts
broken on the GPU since session 19 (``_finish`` grew a constexpr parameter whose default the
compiler rejected) while every interpreter test passed. Here Triton compiles each variant for
sm90 down to a cubin (its bundled ptxas), as benchmarks/pair_decode_sm90_offline.py does;
`make test` runs this file under the venv's Triton and again under the GPU's (3.6.0, from
.triton-gpu, RLK_SM90_TRITON naming it).
"""
import os
import sys

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for sm90: not under the interpreter", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import pair_decode_sm90_offline as offline  # noqa: E402


def _has_ptxas():
    try:
        offline.ptxas()
        return True
    except SystemExit:  # the offline script's answer where this Triton bundles no ptxas
        return False


@pytest.mark.skipif("RLK_SM90_TRITON" not in os.environ, reason="no Triton version asked for (make test's "
                    "third run asks for the GPU's)")
def test_runs_under_the_triton_asked_for():
    assert triton.__version__ == os.environ["RLK_SM90_TRITON"], (
        f"RLK_SM90_TRITON asks for Triton {os.environ['RLK_SM90_TRITON']}, this run imports {triton.__version__} "
        f"from {triton.__file__}")


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas")
@pytest.mark.parametrize("argv", [
    ["--layout", "rows"],
    ["--layout", "tile"], ["--layout", "tile", "--page", "128", "--heads-first", "--off64"],
    ["--layout", "keys", "--prefetch", "3", "--warps", "8"],               # the routed kernel (one wave)
    ["--layout", "keys", "--prefetch", "3", "--warps", "4", "--stages", "2", "--heads-first"],  # past one wave
    ["--layout", "keys", "--prefetch", "0", "--ahead", "--l2"],
    ["--layout", "keys", "--prefetch", "4"],                                # K/V tiles by TMA
    ["--layout", "keys", "--merge", "--slices", "2", "--pdl", "--early"],
], ids=lambda a: "_".join(x.lstrip("-") for x in a))
def test_variant_builds_for_sm90(argv):
    kernel, consts = offline.build(offline.parser().parse_args(argv))
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx and "mma" in ptx
    assert kernel.asm.get("cubin"), "no cubin: ptxas did not assemble the PTX"


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas")
@pytest.mark.parametrize("argv,arithmetic", [([], True), (["--merge"], True), (["--page", "256", "--chunk", "2048"], True),
                                             (["--probe", "2"], True), (["--probe", "1"], False),
                                             (["--probe", "3"], False), (["--warps", "8"], True),
                                             (["--warps", "8", "--merge"], True), (["--ws"], True),
                                             (["--ws", "--merge"], True), (["--rows"], True),
                                             (["--rows", "--merge"], True), (["--rows", "--page", "256", "--chunk",
                                                                             "2048"], True)],
                         ids=lambda a: ("_".join(x.lstrip("-") for x in a) or "plain") if isinstance(a, list)
                         else ("mma" if a else "ring_only"))
def test_walk_builds_for_sm90(argv, arithmetic):
    pytest.importorskip("triton.experimental.gluon")
    import walk_decode_sm90_offline as walk_offline

    kernel = walk_offline.build(walk_offline.parser().parse_args(argv))
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx and "cp.async.bulk.tensor" in ptx
    assert ("mma.sync" in ptx) == arithmetic         # probes 1 and 3: the ring without arithmetic
    assert ("setmaxnreg" in ptx) == ("--ws" in argv)  # the producer warp's partition: its own register budget
    assert kernel.asm.get("cubin"), "no cubin: ptxas did not assemble the PTX"


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas")
@pytest.mark.parametrize("kernel_name,consts", [
    ("_table_kernel", {"PS": 16, "FILL": True, "BLOCK": 256}),
    ("_table_kernel", {"PS": 128, "FILL": False, "BLOCK": 256}),
    ("_rows_kernel", {"PS": 16, "PLACE": True, "POS": True, "BLOCK": 256}),
    ("_rows_kernel", {"PS": 1, "PLACE": False, "POS": False, "BLOCK": 256}),
], ids=lambda v: v if isinstance(v, str) else "_".join(f"{k}{int(x)}" for k, x in v.items()))
def test_index_checks_build_for_sm90(kernel_name, consts):
    """The paged-KV value checks' kernels (rlk_ops/kernels/triton/index_checks.py): their int64
    atomics and the int32 (row, page) bits assemble for sm90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlk_ops.kernels.triton import index_checks

    fn = getattr(index_checks, kernel_name)
    types = {"table_ptr": "*i32", "lens_ptr": "*i32", "fill_ptr": "*i32", "bits_ptr": "*i32", "flag_ptr": "*i64",
             "slot_ptr": "*i64", "mark_ptr": "*i64", "pos_ptr": "*i64", "n_slots": "i64"}
    sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx and "atom.global" in ptx
    assert kernel.asm.get("cubin"), "no cubin: ptxas did not assemble the PTX"


@pytest.mark.skipif(not _has_ptxas(), reason="this Triton has no ptxas")
@pytest.mark.parametrize("tempered", [False, True])
@pytest.mark.parametrize("logits", ["*bf16", "*fp32"])
def test_logprobs_kernel_builds_for_sm90_without_fma(logits, tempered):
    """The CUDA log-probs' kernel (rlk_ops/kernels/triton/logprobs.py) assembles for sm90, and its
    arithmetic is the IEEE steps as written: no fp32 FMA (contraction off), the division rounded
    (div.rn), exp's rounding by libdevice's rint."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlk_ops.kernels.triton import logprobs

    fn = logprobs._lse_kernel
    consts = {"BLOCK_": logprobs.BLOCK, "TEMPERED": tempered, "HAS_TOK": True, "LIBDEVICE": True}
    types = {"x_ptr": logits, "tok_ptr": "*i64", "lse_ptr": "*fp32", "logp_ptr": "*fp32", "V": "i32",
             "temperature": "fp32", "c_ptr": "*fp64"}
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": logprobs.NUM_WARPS, "enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    assert ".target sm_90" in ptx and kernel.asm.get("cubin")
    assert "fma.rn.f32" not in ptx
    assert ("div.rn.f32" in ptx) == tempered
    assert "cvt.rni" in ptx   # (numerics.exp's round-half-even of x * log2(e), libdevice's rint)
