"""A long search keeps the driver's memory flat and its store linear in its metrics.

``benchmarks/long_run.py`` runs one Random search in phases on one store (the simulator for
the bulk, real local workers for a slice in the middle) while a thread samples the driver's
RSS and the store's size. Asserted here: every model of the budget is trained, with every
metric row of its epochs; the driver's RSS grows by less than 10 MiB over the last 40% of the
run (a leak of a few kilobytes per model, held by the runner, the strategy or the store,
would pass the bound within a few thousand models); and the store's bytes per metric row at
the end are at most 1.1x those at 60% (slack for SQLite's pages): its size grows
linearly with the metrics, not faster. Nothing is timed.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import long_run  # noqa: E402

EPOCHS = long_run.trainer.epochs
METRICS = 4  # train_loss, val_loss, val_acc and the runner's time_total_s, per epoch


def _check(rows: list[dict], models: int, rss_bound_mb: float) -> None:
    end = rows[-1]
    assert (end["models"], end["trials"]) == (models, models)
    assert end["metrics"] == models * EPOCHS * METRICS  # every epoch's rows, none twice
    # from 60%: past the real slice in the middle of the long run (its workers' pipes and
    # model code cost ~15 MiB once, then nothing more)
    half = next(r for r in rows if r["models"] >= models * 6 // 10)
    grown = max(r["rss_mb"] for r in rows if r["models"] >= half["models"]) - half["rss_mb"]
    assert grown < rss_bound_mb, (half, end)
    per_half = half["store_mb"] / half["metrics"]
    per_end = end["store_mb"] / end["metrics"]
    assert per_end <= 1.1 * per_half, (half, end)


def test_a_short_simulated_run_is_sampled_and_complete(tmp_path):
    rows = long_run.long_run(str(tmp_path / "long.db"), models=120, real=0, every=0.05)
    _check(rows, 120, rss_bound_mb=10)
    assert {r["phase"] for r in rows[1:]} == {"simulated"}


@pytest.mark.slow  # 2000 models, 24 of them trained by real workers: minutes on 2 busy cores
def test_two_thousand_models_keep_the_driver_flat_and_the_store_linear(tmp_path):
    rows = long_run.long_run(str(tmp_path / "long.db"), models=2000, real=24, every=0.5)
    assert "real" in {r["phase"] for r in rows}
    _check(rows, 2000, rss_bound_mb=10)
