import json
import subprocess
import sys


def test_demo_cli_reports_zero_mismatches(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "rlk_ops", "demo", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["mismatched_tokens"] == 0 and report["tokens"] >= 64


def test_import_needs_no_cuda_package():
    code = ("import sys, rlk_ops; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('flash_attn', 'flashinfer', 'triton', 'cutlass')]; print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
