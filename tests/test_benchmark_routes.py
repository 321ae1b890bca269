"""benchmarks/canonical.py --route: a decode route switch set for one run (so a route not yet
taken is timed against FlashInfer next to the routed one), checked and recorded in the report."""
from __future__ import annotations

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import canonical as cb  # noqa: E402

from rlk_ops.kernels.triton import merge as tm  # noqa: E402
from rlk_ops.kernels.triton import pair_decode as pd  # noqa: E402


def test_settings_parse_to_typed_values():
    assert cb.route_setting("EARLY_TABLE_ONE_WAVE=1") == ("EARLY_TABLE_ONE_WAVE", True)
    assert cb.route_setting("VEC_EAGER=false") == ("VEC_EAGER", False)
    assert cb.route_setting("STATE_EVICT_MAX_BYTES=0") == ("STATE_EVICT_MAX_BYTES", 0)
    assert cb.route_setting("SLICES_ONE_WAVE=4") == ("SLICES_ONE_WAVE", 4)


@pytest.mark.parametrize("text, words", [("EAGER", "NAME=VALUE"), ("NOPE=1", "EARLY_TABLE_ONE_WAVE"),
                                         ("VEC_EAGER=2", "0, 1, true or false"),
                                         ("SLICES_ONE_WAVE=two", "integer"), ("SLICES_ONE_WAVE=-1", "integer")])
def test_bad_settings_are_named(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words) as e:
        cb.route_setting(text)
    assert repr(text) in str(e.value)


def test_settings_reach_the_modules_and_the_report(monkeypatch):
    for name, (mod, _) in cb.ROUTES.items():   # restored after the test
        monkeypatch.setattr(tm if mod.endswith("merge") else pd, name, getattr(tm if mod.endswith("merge") else pd, name))
    routes = cb.apply_routes([("EARLY_TABLE_ONE_WAVE", True), ("VEC_EAGER", True), ("SLICES_ONE_WAVE", 1)])
    assert pd.EARLY_TABLE_ONE_WAVE is True and tm.VEC_EAGER is True and pd.SLICES_ONE_WAVE == 1
    assert routes["EARLY_TABLE_ONE_WAVE"] is True and routes["SLICES_ONE_WAVE"] == 1
    assert set(routes) == set(cb.ROUTES) and routes["PDL_ONE_WAVE"] == pd.PDL_ONE_WAVE
    assert pd.decode_launch(1, pd.torch.device("cpu"))["early_table"] is True


def test_the_report_names_the_settings():
    md = cb.markdown({"routes_set": {"VEC_EAGER": True}, "shapes": {}})
    assert "Route switches set for this run (--route): VEC_EAGER=True" in md
    assert "Route switches" not in cb.markdown({"routes_set": {}, "shapes": {}})


@pytest.mark.parametrize("script", ["attention", "canonical"])
def test_dry_run_routes_attention_to_the_stand_in_on_cpu(script):
    """``--dry-run`` checks a benchmark script on the CPU against a stand-in FA4: since the device gate (FA4 runs
    on CUDA tensors) every section failed with StrictModeError, and no test saw it (a session 39 audit). A
    subprocess: the dry run sets process-wide backends."""
    import subprocess

    code = (f"import sys, torch; sys.path.insert(0, 'benchmarks'); import {script} as s; s.install_dry_run(); "
            "import rlk_ops; from rlk_ops.meta import provenance\n"
            "q, k, v = (torch.randn(1, 9, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))\n"
            "with provenance.capture() as rec:\n"
            "    rlk_ops.attention(q, k, v, causal=True)\n"
            "print(sorted({(r.op, r.actual_backend) for r in rec.records()}))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "RLK_FA4_DRY_RUN": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "('attention_fwd', 'fa4')" in out.stdout
