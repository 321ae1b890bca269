"""The FA4 chunk walk (rlk_ops/kernels/fa4/walk_sm90.py) builds for sm_90a on a machine without a
GPU: FA4 and the CUTLASS DSL compile under torch's FakeTensorMode (FA4's own CPU-only mode:
FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH). ``make test`` runs this file in its own pytest process with
FA4 and the DSL on PYTHONPATH (.cute-gpu, see the Makefile); elsewhere it is skipped. The bits and
the speed are checked on the GPU (tests/test_fa4_walk.py, benchmarks/probe_fa4_walk.py).
"""
import glob
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

# An offline-build check: skipped where FA4 is not on the path (the main pytest run) and on a GPU
# machine, before it sets the variables below, which would steer every FA4 compile of the process
# (FA4's kernel choice and SM count, the DSL's target and PTX dumps)
if torch.cuda.is_available():
    pytest.skip("builds the walk without a GPU; on a GPU tests/test_fa4_walk.py runs it", allow_module_level=True)
if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("cutlass") is None:
    pytest.skip("FA4 and the CUTLASS DSL are not on this path (make test puts them there)", allow_module_level=True)
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
# read when the DSL is imported: every compile below writes its PTX here
DUMP = os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="rlk-walk-ptx-"))
os.environ.setdefault("CUTE_DSL_KEEP", "ptx")

pytest.importorskip("flash_attn.cute")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def _ptx(monkeypatch, chunk, merge, hq=32, hkv=8):
    from rlk_ops.kernels.cpu.canonical import pair_count
    from rlk_ops.kernels.fa4 import walk

    monkeypatch.setattr(walk, "_COMPILED", {})
    shutil.rmtree(DUMP, ignore_errors=True)
    os.makedirs(DUMP)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(64, 1, hq, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(64 * 64, 128, hkv, 128, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(64, 64, dtype=torch.int32, device="cuda")
        lens = torch.empty(64, dtype=torch.int32, device="cuda")
        outs = walk.decode(q, kc, kc, table, lens, 128 ** -0.5, chunk, merge=merge)
    n = pair_count(64, 128, chunk)
    assert [tuple(t.shape) for t in outs] == [(64, 1, hq, 128), (64, hq, 1), (n, 64, 1, hq, 128), (n, 64, hq, 1)]
    files = glob.glob(os.path.join(DUMP, "*CanonicalWalkSm90*.ptx"))
    assert len(files) == 1, f"expected the walk's PTX in {DUMP}, found {os.listdir(DUMP)}"
    with open(files[0]) as f:
        return f.read()


@pytest.mark.parametrize("chunk", [128, 768])
def test_walk_builds_for_sm90_with_its_merge_in_single_roundings(monkeypatch, chunk):
    ptx = _ptx(monkeypatch, chunk, merge=True)
    assert ".target sm_90a" in ptx
    # the merge of kernels/cpu/merge.py: rint (Cody-Waite exp), div.rn (out = acc / L), the fp64 log
    for instr in ("cvt.rni.f32.f32", "div.rn.f32", "div.rn.f64", "cvt.rn.f32.f64"):
        assert instr in ptx, instr
    # the partial's 2 rows x 32 values per thread stored as bf16, then read back by the merge
    assert ptx.count("st.global.b16") == 64 and ptx.count("ld.global.b16") == 64


def test_walk_without_its_merge_builds_without_the_merge(monkeypatch):
    ptx = _ptx(monkeypatch, 768, merge=False)
    assert "cvt.rni.f32.f32" not in ptx and "div.rn.f64" not in ptx
    assert ptx.count("st.global.b16") == 64 and ptx.count("ld.global.b16") == 0
