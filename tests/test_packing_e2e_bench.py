"""Smoke test of benchmarks/packing_e2e.py: its --quick mode runs the three searches (4
models, packs of 2, 100 JPEGs through a DataLoader) and checks they give every model the same
results. Marked slow: three experiments each start their worker processes (about a minute on
2 busy cores)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_mode_runs_and_every_mode_gives_the_same_results():
    script = os.path.join(ROOT, "benchmarks", "packing_e2e.py")
    done = subprocess.run([sys.executable, script, "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(os.path.join(ROOT, "benchmarks", "out", "packing_e2e-dataloader-cpu-quick.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["exclusive", "pack", "ours"]
    assert all(r["same_results"] == "True" and r["models"] == "4" for r in rows)
    assert all(r["images"] == "100" and float(r["load_ms_per_image"]) > 0 for r in rows)
    assert int(rows[2]["packs"]) >= 1
