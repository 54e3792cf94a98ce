"""benchmarks/one_shot.py runs end to end in its --quick mode (about 10 s of CPU, more wall
time on a busy machine, hence slow)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_one_shot_benchmark_quick_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "one_shot.py"),
                          "--quick"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "retrained" in line]
    assert [line.split()[0] for line in lines] == ["SPOS", "ENAS", "WeightSharing(Random)",
                                                   "Random,"]
    assert "one_shot-cpu-quick.csv" in out.stdout
