"""examples/tp_cp_attention.py under torchrun: 4 processes, a 2x2 (tp, cp) mesh on gloo."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]


def _row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(name + " "))
    return line[len(name):].split()


def test_example_under_torchrun_prints_its_bitwise_table(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", str(ROOT / "examples" / "tp_cp_attention.py"),
           "--json", str(tmp_path / "cmp.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    tables = out.split("mesh (tp=2, cp=2), ")[1:]
    assert [t.split(",")[0].split(";")[0] for t in tables] == ["contiguous", "zigzag", "zigzag"], out
    for table in tables[:2]:  # default mode: attention out, lse, dQ bitwise; the rest deterministic
        for name in ("attention out", "lse", "dQ"):
            assert _row(table, name)[:2] == ["yes", "yes"], table
        for name in ("dK", "dV", "block output y", "d o_proj.weight"):
            assert _row(table, name)[0] == "no" and _row(table, name)[4] == "yes", table
    assert "canonical chunks=8" in tables[2]
    body = tables[2].split("compiled==eager\n")[1].split("claims hold")[0]
    assert len(body.splitlines()) == 13 and all(line.split()[-6:-4] == ["yes", "yes"] for line in body.splitlines()), tables[2]
    assert "world 4, device cpu" in out and "ALL CLAIMS HOLD" in out
    assert (tmp_path / "cmp.json").exists()
