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


def test_latency_target_is_a_quantile_of_the_table(table):
    import statistics

    lats = sorted(la for _, la in table.values.values())
    # the first quartile (inclusive method, 1,024 values): a quarter of the way from the 256th
    # latency to the 257th, so exactly 256 models meet it and 768 miss it
    assert table.target_quantile == 0.25
    assert lats[255] < table.target < lats[256]
    assert table.target == pytest.approx(0.25 * lats[255] + 0.75 * lats[256], rel=1e-12)
    assert sum(la <= table.target for la in lats) == 256
    # the most accurate model of the table misses the budget: the constraint binds
    best = max(table.values.values())
    assert best[1] > table.target
    # 0.5 is the median target used before: halfway between the 512th and 513th
    median = mo.Table(0.5).target
    assert median == pytest.approx(statistics.median(lats), rel=1e-12)
    assert sum(la <= median for la in lats) == 512
    for bad in (0.0, 1.0, 0.255, -0.1):
        with pytest.raises(ValueError, match="target_quantile"):
            mo.Table(bad)


def test_mnasnet_soft_reward_prefers_the_fastest_model_of_the_table(table):
    # why the benchmark also runs the hard reward: the soft one's best model is the fastest of
    # the table, less accurate than the best model under the target, which the judgment
    # measures; and with alpha == beta the target only scales the soft reward
    # (acc * lat**w * target**-w), so the soft reward ranks models alike for any target
    def best(reward):
        return max(table.values.values(),
                   key=lambda v: reward({"val_acc": v[0], "latency_ms": v[1]}))

    soft_best = []
    for target in (table.target, mo.Table(0.5).target):
        under = max(a for a, la in table.values.values() if la <= target)
        soft = best(mo.MnasNetReward("val_acc", "latency_ms", target=target))
        hard = best(mo.MnasNetReward("val_acc", "latency_ms", target=target, alpha=0.0,
                                     beta=-1.0))
        assert soft[1] < 0.34 and soft[0] < under  # among the 4 fastest of the table
        soft_best.append(soft)
        assert hard[1] <= target and hard[0] == under
    assert soft_best[0] == soft_best[1]
    # the scale: 0.9 at 1 ms, target 2 or 4: 0.9 * 2**0.07 and 0.9 * 4**0.07
    a, b = (mo.MnasNetReward("acc", "lat", target=t)({"acc": 0.9, "lat": 1.0}) for t in (2, 4))
    assert a == pytest.approx(0.9 * 1.049717) and b / a == pytest.approx(2 ** 0.07)


def test_latency_is_judged_against_the_median_of_rounds(monkeypatch):
    # the reference of each model is the median of its rounds, taken in rounds over the
    # calibration and judged models: all four measure 1, then 3, then 2 ms, so the reference
    # is 2 ms, the first round alone 1 ms, and two rounds differ by 2 ms of 1
    answers = iter([1.0] * 4 + [3.0] * 4 + [2.0] * 4)
    fitted = []

    class Meter:
        def __init__(self, *args):
            pass

        def measure_module(self, module, names):
            return {"latency_ms": (next(answers), 0.0)}

    monkeypatch.setattr(mo, "CostMeter", Meter)
    def calibrate(self, modules, x, measured=None):
        fitted.append(measured)
        return 1.0, 0.0

    monkeypatch.setattr(mo.OpLatencyTable, "calibrate", calibrate)
    monkeypatch.setattr(mo.OpLatencyTable, "predict",
                        lambda self, module, x, device=None, calibrated=True: 2.0)
    import _out

    monkeypatch.setattr(_out, "write_csv", lambda rows, name: "-")
    row = mo.latency(n_models=2, calibration_models=2, rounds=3)
    assert row["vs_measured_median_abs"] == 0.0
    assert row["vs_one_round_median_abs"] == 1.0
    assert row["measurement_repeat_median_abs"] == 2.0
    # once timed on its own, once from the calibration models' medians of the same rounds
    assert fitted == [None, [2.0, 2.0]]
    with pytest.raises(ValueError, match="rounds"):
        mo.latency(n_models=2, rounds=0)
