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


def test_won_tied_lost_and_sign_test_by_hand():
    # 3 wins, 2 ties (left out), 1 loss: p = 2 * P(X <= 1), X ~ Bin(4, 1/2) = 2 * 5/16
    assert mo._wins([0.003, 0.003, 0.0, -0.003, 0.0, 0.006]) == "3/2/1 (sign p=0.625)"
    # all tied: no evidence either way
    assert mo._wins([0.0, 0.0]) == "0/2/0 (sign p=1.000)"
    # 6 of 6 untied won: 2 / 64
    assert mo._wins([0.1] * 6 + [0.0]) == "6/1/0 (sign p=0.031)"


def test_mnasnet_soft_reward_prefers_the_fastest_model_of_the_table(table):
    # why the benchmark also runs the hard reward: the soft one's best model lies far under the
    # target and is less accurate than the best model under it, which the judgment measures
    def best(reward):
        return max(table.values.values(),
                   key=lambda v: reward({"val_acc": v[0], "latency_ms": v[1]}))

    under = max(a for a, la in table.values.values() if la <= table.target)
    soft = best(mo.MnasNetReward("val_acc", "latency_ms", target=table.target))
    hard = best(mo.MnasNetReward("val_acc", "latency_ms", target=table.target, alpha=0.0,
                                 beta=-1.0))
    assert soft[1] < 0.6 * table.target and soft[0] < under
    assert hard[1] <= table.target and hard[0] == under
