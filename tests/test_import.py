import subprocess
import sys


def test_import_needs_no_cuda_package():
    code = ("import sys, rlk_ops, rlk_ops.compile, rlk_ops.rollout.demo; bad = [m for m in sys.modules if "
            "m.split('.')[0] in ('flash_attn', 'flashinfer', 'triton', 'cutlass')]; print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
