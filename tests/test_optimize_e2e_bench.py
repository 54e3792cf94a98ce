"""Smoke tests of benchmarks/optimize_e2e.py (issue #26 item 7), so the whole-search benchmark
cannot rot: its --quick mode runs real searches (Experiment.run() with a local worker) of the
workloads in benchmarks/e2e_workloads.py, writes its CSV and figure, and optimize=True gives
every model the metrics of optimize=False bit for bit where nothing fuses (grouping without
fusion is exact on a CPU)."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "optimize_e2e.py")
COLUMNS = ["case", "workers", "threads", "device", "models", "quick", "target", "mode", "run", "wall_s",
           "ratio_to_off", "same_as_off", "max_rel_diff_vs_off", "same_as_first_run",
           "grouped_jobs", "merged_trials", "fused_trials", "measured_speedup", "slower_kept",
           "load", "passes"]


def _bench(tmp_path, *flags: str) -> list[dict]:
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(tmp_path), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reruns identical:" in done.stdout and "target >=" in done.stdout
    with open(tmp_path / "optimize_e2e-cpu-w1-quick.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert (tmp_path / "optimize_e2e-cpu-w1-quick.png").stat().st_size > 0
    return rows


def _check_exact_where_nothing_fuses(rows: list[dict], cases: list[str], runs: int) -> None:
    assert sorted({r["case"] for r in rows}) == sorted(cases)
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        # every mode ran --runs times, interleaved, plus its median row
        assert [(r["mode"], r["run"]) for r in mine] == [
            (m, str(i)) for m in ("off", "on", "auto") for i in [*range(1, runs + 1), "median"]]
        for r in mine:
            assert float(r["wall_s"]) > 0 and r["target"] != ""
            if r["mode"] == "off":  # the baseline against itself, and seeded reruns
                assert r["same_as_off"] == "True" and r["same_as_first_run"] == "True"
            if r["mode"] == "on" and r["fused_trials"] == "0":
                assert r["same_as_off"] == "True", (case, r)
                assert float(r["max_rel_diff_vs_off"]) == 0.0
            if r["mode"] == "on":  # optimize=True groups them (the default may keep them apart)
                assert int(r["merged_trials"]) > 0, (case, r)
        median = next(r for r in mine if r["mode"] == "auto" and r["run"] == "median")
        assert median["passes"] in ("True", "False")
        assert median["passes"] == str(float(median["ratio_to_off"]) >= float(median["target"]))


def test_quick_heads_and_mlps_run_and_grouping_is_exact(tmp_path):
    rows = _bench(tmp_path, "--workload", "a", "c64", "--heads", "4", "--runs", "1")
    _check_exact_where_nothing_fuses(rows, ["a4", "c64"], 1)


@pytest.mark.slow
def test_quick_every_workload_twice(tmp_path):
    """All of (a)-(e), two interleaved runs per mode (48 searches: 7 minutes at load 5)."""
    rows = _bench(tmp_path, "--workload", "all", "--runs", "2")
    _check_exact_where_nothing_fuses(rows, ["a4", "a8", "b", "bfreeze", "c64", "c512", "d", "e"], 2)


def test_metric_comparison_by_hand():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from optimize_e2e import max_rel_diff

    a = {"m1": {"train_loss": [2.0, 1.0], "val_loss": [2.0, 1.5], "val_acc": [0.5, 0.8]}}
    assert max_rel_diff(a, a) == 0.0
    b = {"m1": {"train_loss": [9.0, 1.1], "val_loss": [2.0, 1.5], "val_acc": [0.5, 0.8]}}
    assert max_rel_diff(b, a) == pytest.approx(0.1)  # finals only: |1.1 - 1.0| / 1.0
    assert max_rel_diff({**a, "m2": a["m1"]}, a) == math.inf  # other models
    short = {"m1": {k: v[:1] for k, v in a["m1"].items()}}
    assert max_rel_diff(short, a) == math.inf  # other epochs


def test_bad_runs_is_refused_by_name():
    done = subprocess.run([sys.executable, SCRIPT, "--runs", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2 and "--runs must be at least 1" in done.stderr
