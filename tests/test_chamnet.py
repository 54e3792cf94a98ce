"""ChamNet's search: the Gaussian process, the genetic search under a latency constraint, the
strategy's resume and `retiarii nas run chamnet`'s cost term."""
from __future__ import annotations

import random

import numpy as np
import pytest

from retiarii import nas
from retiarii.objectives import ObjectiveError
from retiarii.strategies import ChamNet, SpaceExhausted
from retiarii.strategies.multi_trial.chamnet import ArchEncoder, fit_gp, genetic_search

WIDTHS = [1, 2, 3]
LUT = {"base": 4.0, "choices": {f"w{i}": [[1, 0.0], [2, 1.0], [3, 2.0]] for i in range(5)}}


class Space:
    """Five widths; the 'accuracy' below grows with them, the latency (LUT) too."""

    def sample(self, sampler):
        s = {}
        for i in range(5):
            s[f"w{i}"] = WIDTHS[sampler.choose(f"w{i}", WIDTHS, dict(s))]
        return type("Model", (), {"sample": s})()

    def size(self):
        return 3 ** 5


def accuracy(sample: dict) -> float:
    # earlier layers weigh more: the best model under a bound is not any model of that sum
    return sum((5 - i) * (w - 1) for i, w in enumerate(sample.values())) / 30


def test_the_gaussian_process_interpolates_its_training_points():
    # a smooth function on 7 hand-made points of [0, 1]
    x = np.linspace(0, 1, 7)[:, None]
    y = np.sin(3 * x[:, 0])
    gp = fit_gp(x, y, seed=0)
    assert np.allclose(gp.predict(x), y, atol=1e-2)
    # between two training points the prediction lies near the function, not the prior mean
    mid = np.array([[0.5 / 6 + 2 / 6]])
    assert abs(gp.predict(mid)[0] - np.sin(3 * mid[0, 0])) < 0.05
    # and far from any point it returns to the mean of y (normalize_y)
    far = gp.predict(np.array([[40.0]]))[0]
    assert abs(far - y.mean()) < 1e-3


def test_the_encoder_scales_numeric_choices_and_marks_missing_ones():
    enc = ArchEncoder([("res", [8, 7, 9]), ("op", ["a", "b"])])
    assert enc.encode([{"res": 9, "op": "a"}, {"res": 8}]).tolist() == [
        [1.0, 1.0, 0.0], [0.5, -1.0, -1.0]]


def test_the_genetic_search_finds_the_constrained_optimum_and_keeps_the_constraint():
    genome = [(f"w{i}", WIDTHS) for i in range(5)]
    lut = ChamNet(latency=LUT, constraints=["predicted_latency_ms <= 8"])
    ranked = genetic_search(genome, lambda ss: [accuracy(s) for s in ss], lut.feasible,
                            random.Random(0), population=16, generations=15)
    assert all(lut.predicted_latency(s) <= 8 for s, _ in ranked)
    # hand-computed optimum: 4 ms of width to spend, 2 each on the two heaviest layers
    assert ranked[0][0] == {"w0": 3, "w1": 3, "w2": 1, "w3": 1, "w4": 1}


def drive(strategy, steps: int) -> list[dict]:
    out = []
    for _ in range(steps):
        s = strategy.ask(Space())
        strategy.tell(s, accuracy(s))
        out.append(s)
    return out


def test_no_proposal_misses_the_constraint_and_the_search_finds_the_best_under_it():
    s = ChamNet(seed=1, n_startup=5, latency=LUT, constraints=["predicted_latency_ms <= 8"])
    proposed = drive(s, 15)
    assert all(s.predicted_latency(p) <= 8 for p in proposed)
    assert s.best()[0] == {"w0": 3, "w1": 3, "w2": 1, "w3": 1, "w4": 1}


def test_a_resumed_search_equals_an_uninterrupted_one():
    def make():
        return ChamNet(seed=4, n_startup=4, population=12, generations=4, latency=LUT,
                       constraints=["predicted_latency_ms <= 9"])

    whole = drive(make(), 14)
    first = make()
    head = drive(first, 7)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + drive(resumed, 7) == whole


def test_a_constraint_no_model_meets_ends_the_search_and_bad_settings_are_refused():
    s = ChamNet(seed=0, latency=LUT, constraints=["predicted_latency_ms <= 3"])
    with pytest.raises(SpaceExhausted, match="constraints"):
        s.ask(Space())
    with pytest.raises(ObjectiveError, match="params"):
        ChamNet(latency=LUT, constraints=["params <= 5"])
    with pytest.raises(ObjectiveError, match="lookup table"):
        ChamNet(constraints=["predicted_latency_ms <= 5"])
    with pytest.raises(ValueError, match="population"):
        ChamNet(population=0)


def test_nas_run_chamnet_bounds_latency_by_the_median_of_random_models(tmp_path, monkeypatch):
    from retiarii import nas_latency

    monkeypatch.setattr(nas_latency, "latency_target", lambda *a, **k: 1.25)
    monkeypatch.setattr(nas_latency, "latency_lut", lambda *a, **k: LUT)
    kwargs: dict = {}
    options = nas_latency.cost_term("chamnet", None, "small", str(tmp_path / "s.db"),
                                    {"n_startup": 4}, kwargs)
    assert options == {"latency": LUT, "constraints": ["predicted_latency_ms <= 1.25"],
                       "n_startup": 4}
    assert kwargs == {"constraints": ["predicted_latency_ms <= 1.25"]}
    row = nas.get("chamnet")
    assert row.status == "faithful" and row.runs_with == "ChamNet"
    strategy = nas.strategy("chamnet", options=options)
    assert isinstance(strategy, ChamNet) and strategy.n_startup == 4
