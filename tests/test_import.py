import subprocess
import sys


def test_import_needs_no_cuda_package():
    """rlk_ops imports (and its compile and demo modules) with the CUDA-side packages made
    unimportable, whether or not they are installed (torch itself imports triton when it is),
    and none of them is left imported."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('flash_attn', 'flashinfer', 'triton', 'cutlass'):\n"
            "            raise ImportError(f'{name} blocked by the test')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import rlk_ops, rlk_ops.compile, rlk_ops.rollout.demo\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'flashinfer', 'triton', 'cutlass')]\n"
            "print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
