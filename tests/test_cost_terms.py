"""The papers' cost terms on hand-computed values: the latency lookup table, FBNet's latency
loss in GumbelDARTS, SPOS's search under a latency constraint, MnasNet's reward as the mnasnet
row's default and ChamNet's Gaussian-process predictor under a latency constraint."""
from __future__ import annotations

import json
import math
import sys
import os

import pytest
import torch

from retiarii.cost_terms import CandidateFilter, LatencyLUT, fbnet_factor
from retiarii.objectives import ObjectiveError
from retiarii.strategies import SPOS, GumbelDARTS

sys.path.insert(0, os.path.dirname(__file__))
from one_shot_task import BEST, LinearTask, make_space, run  # noqa: E402
from test_darts import Regression, _space  # noqa: E402

CPU = torch.device("cpu")


def test_lookup_table_by_hand():
    lut = LatencyLUT(2.0, {"op": [["linear", 0.5], ["skip", -0.25]], "n": [[1, 0.0], [2, 1.0]]})
    assert lut.predict({"op": "linear", "n": 2}) == 3.5
    assert lut.predict({"op": "skip", "n": 1}) == 1.75
    assert lut.predict({"op": "conv"}) == 2.0   # a key the table lacks adds nothing
    assert lut.costs("n", [2, 1, 3]) == [1.0, 0.0, 0.0]
    again = LatencyLUT.from_json(json.loads(json.dumps(lut.to_json())))
    assert again == lut and again.predict({"n": 2}) == 3.0   # int keys survive JSON
    with pytest.raises(ValueError, match="LatencyLUT.to_json"):
        LatencyLUT.from_json({"op": {"linear": 1.0}})


def test_fbnet_factor_by_hand():
    # 0.2 * log(1000) ** 0.6 = 0.2 * 6.9078 ** 0.6 = 0.2 * exp(0.6 * 1.93266) = 0.2 * 3.18861
    assert fbnet_factor(1000.0, 0.2, 0.6) == pytest.approx(0.2 * 6.907755 ** 0.6)
    assert fbnet_factor(1000.0, 0.2, 0.6) == pytest.approx(0.63772, abs=1e-5)
    with pytest.raises(ValueError, match="latency_scale"):
        fbnet_factor(0.5, 0.2, 0.6)


def test_fbnet_loss_is_ce_times_the_latency_factor_of_the_gumbel_weights():
    lut = LatencyLUT(0.5, {"op": [["identity", 0.0], ["relu", 0.1], ["linear", 0.4],
                                  ["tanh", 0.2]]})
    s = GumbelDARTS(epochs=1, latency=lut.to_json())
    s.setup(_space(), Regression(0), {}, CPU)
    s.relaxation.set_mode(**s.step_mode("arch", 0))
    s.relaxation(torch.randn(4, 8))            # one forward: the Gumbel weights m
    m = s.relaxation.mixing["op"].detach()
    keys = s.relaxation.keys["op"]
    costs = {"identity": 0.0, "relu": 0.1, "linear": 0.4, "tanh": 0.2}
    lat = 1000 * (0.5 + sum(float(m[i]) * costs[k] for i, k in enumerate(keys)))
    ce = torch.tensor(1.5)
    assert float(s.arch_loss(ce).detach()) == pytest.approx(1.5 * 0.2 * math.log(lat) ** 0.6, rel=1e-5)
    # the gradient reaches the alphas through m: a costlier candidate's alpha is pushed down
    s.relaxation(torch.randn(4, 8))
    s.arch_loss(torch.tensor(1.0)).backward()
    grad = s.relaxation.alpha("op").grad
    assert grad[keys.index("linear")] > grad[keys.index("identity")]
    # the config rebuilds it (the engine rebuilds strategies from it), the table included
    config = json.loads(json.dumps(s.config()))
    assert GumbelDARTS(**config).config() == config and config["latency_alpha"] == 0.2
    # no table: the plain loss
    plain = GumbelDARTS(epochs=1)
    assert plain.arch_loss(ce) is ce


def test_fbnet_latency_table_names_a_wrong_label():
    s = GumbelDARTS(epochs=1, latency={"base": 1.0, "choices": {"nope": [["linear", 1.0]]}})
    with pytest.raises(ValueError, match="'nope'.*labels are"):
        s.setup(_space(), Regression(0), {}, CPU)


def test_spos_never_evaluates_a_candidate_over_the_constraint():
    # linear is the best op but the table makes it too slow: the search must never evaluate it
    lut = LatencyLUT(1.0, {"op": [["linear", 5.0]]})
    s = SPOS(train_segments=2, search_population=4, search_generations=3, search_parents=2,
             eval_batches=2, seed=0, constraints=["predicted_latency_ms <= 2"],
             latency=lut.to_json())
    space, trainer = make_space(), LinearTask()
    s.setup(space, trainer, {}, CPU)
    results = run(s, space, trainer)
    evaluated = [m.sample for m in results[-1].models]
    assert evaluated and all(sample["op"] != "linear" for sample in evaluated)
    assert results[-1].metrics["rejected_by_constraints"] > 0
    assert s.selected()["op"] != "linear" and s.selected() != BEST
    config = json.loads(json.dumps(s.config()))
    assert SPOS(**config).config() == config
    assert "constraints" not in SPOS().config()   # old configs still match


def test_constraints_refuse_what_a_one_shot_search_cannot_check():
    with pytest.raises(ObjectiveError, match="lookup table"):
        CandidateFilter(["predicted_latency_ms <= 2"], None)
    with pytest.raises(ObjectiveError, match="val_acc"):
        SPOS(constraints=["val_acc >= 0.5"], latency={"base": 1.0, "choices": {}})


def _fake_timing(monkeypatch):
    from retiarii.engine.driver import op_latency

    timed = []

    def fake(repeat, device, config=None):  # every distinct operator call: a new latency
        timed.append(1)
        return 0.001 * len(timed), 0.0

    monkeypatch.setattr(op_latency, "time_call", fake)
    return timed


def test_nas_mnasnet_rewards_the_predicted_latency_by_default(tmp_path, monkeypatch):
    from retiarii import nas, nas_latency
    from retiarii.scalarization import MnasNetReward

    timed = _fake_timing(monkeypatch)
    db = str(tmp_path / "m.db")
    exp = nas.experiment("mnasnet", epochs=1, workers=1, store=db, max_models=2)
    reward = exp.strategy.reward
    assert isinstance(reward, MnasNetReward) and (reward.alpha, reward.beta) == (-0.07, -0.07)
    assert reward.metrics == ("val_acc", "predicted_latency_ms")
    assert reward.target == nas_latency.latency_target(nas.SPACES.mnasnet, "small", db) > 0
    assert exp.objectives.metrics == ("val_acc", "predicted_latency_ms")
    measured = len(timed)
    again = nas.experiment("mnasnet", epochs=1, workers=1, store=db, max_models=2)
    assert len(timed) == measured and again.strategy.reward == reward  # the store's table
    assert nas.get("mnasnet").status == "faithful"
    # the user's own objectives win
    mine = nas.experiment("mnasnet", epochs=1, workers=1, store=db, max_models=2,
                          metric="val_acc")
    assert mine.strategy.reward is None


@pytest.mark.slow  # ~30 s: the lookup table builds each of 22 layers' 10 candidates
def test_nas_fbnet_gets_its_latency_loss_by_default(tmp_path, monkeypatch):
    from retiarii import nas

    _fake_timing(monkeypatch)
    exp = nas.experiment("fbnet", epochs=1, workers=1, store=str(tmp_path / "f.db"))
    lut = LatencyLUT.from_json(exp.strategy.latency)
    assert sorted(lut.choices) == sorted(f"layer{i}" for i in range(1, 23)) and lut.base > 0
    assert (exp.strategy.latency_alpha, exp.strategy.latency_beta) == (0.2, 0.6)
    assert nas.get("fbnet").status == "faithful"
