"""Smoke tests of benchmarks/held_out.py (issue #26 item 5 on searches the engine was not tuned
for): its workloads build as a user wrote them, and a real run (Experiment.run() with a local
worker, the three modes) writes its CSV with the default and optimize=True equal to
optimize=False bit for bit where nothing fuses."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "held_out.py")


def test_the_workloads_have_the_sizes_the_docstring_gives():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import held_out

    sizes = {name: held_out.setup(name, quick=True)["models"] for name in held_out.WORKLOADS}
    assert sizes == {"lr8": 8, "rnn": 8, "tfm": 8, "depth": 6}
    for name in held_out.WORKLOADS:  # every sample builds and runs on its example input
        case = held_out.setup(name, quick=True)
        space = held_out._build(f"SPACE_{name.upper()}")
        sample = space.random_sample(0).sample
        net = space.build(sample)
        x, _ = next(iter(case["trainer"].train_dataloader({}, 0)))
        assert net(x[:4]).shape[0] == 4


def test_one_run_of_each_mode_is_exact_where_nothing_fuses(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--workload", "depth", "--runs", "1",
                           "--workers", "1", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "item 5 (auto >= 0.95 of the best): depth" in done.stdout
    with open(tmp_path / "held_out-w1.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["run"]) for r in rows] == [
        (m, run) for m in ("off", "on", "auto") for run in ("1", "median")]
    for r in rows:
        assert float(r["wall_s"]) > 0
        if "fused" not in r["plans"]:  # grouping without fusion is exact on a CPU
            assert r["same_as_off"] == "True", r
    medians = {r["mode"]: r for r in rows if r["run"] == "median"}
    assert float(medians["off"]["ratio_to_off"]) == 1.0
    assert medians["auto"]["reruns_identical"] == "True"
