"""The multi-objective benchmark (benchmarks/multi_objective.py, issue #30): the shipped costs
cover the table, the normalisation and hypervolumes obey their definitions, MOASHA's replay
never beats running everything and accounts its epochs, and the predictor beats random's
hypervolume on the table (paired by seed; the full 20-seed figures are in benchmarks/README)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import multi_objective as mo  # noqa: E402
from retiarii.objectives import hypervolume, pareto_indices  # noqa: E402


@pytest.fixture(scope="module")
def table():
    return mo.Table()


def test_costs_cover_the_table_and_normalise_to_the_unit_square(table):
    assert len(table.values) == 1024
    points = [table.point(v) for v in table.values.values()]
    for m in range(2):
        assert min(p[m] for p in points) == 0.0 and max(p[m] for p in points) == 1.0
    costs = mo.load_costs()
    assert all(c["params"] > 0 and c["flops"] > 0 and c["latency_ms"] > 0
               for c in costs.values())
    # the true front's hypervolume is the ceiling of any search's
    front = [points[i] for i in pareto_indices(points)]
    assert table.true_hv == hypervolume(front, (1.0, 1.0)) and 0.5 < table.true_hv < 1.0
    assert table.hv(list(table.values.values())) == pytest.approx(table.true_hv)


def test_moasha_replay_accounts_its_epochs(table):
    for seed in range(3):
        run = mo.moasha_replay(seed, 30, table)
        # rung 1 keeps floor(n/3) at each promotion: at least 10 of 30 go on, never all
        assert 10 <= run["finished"] < 30
        assert 0 < run["reclaimed"] < 1 - 30 / 90  # every model trains its first epoch
        assert 0 < run["hv_kept"] <= 1.0  # a subset of the same models


@pytest.mark.slow
def test_predictor_beats_random_hypervolume_on_the_table(table):
    gains = []
    for seed in range(6):
        hv = [table.hv(mo.replay(name, seed, 50, table)) for name in ("predictor", "random")]
        gains.append(hv[0] - hv[1])
    assert sum(gains) / len(gains) > 0 and sum(g > 0 for g in gains) >= 4, gains
