"""Several objectives and constraints end to end: the store keeps every value and the front,
the front equals the one recomputed from the values, costs are the built model's, resume
checks the objectives and continues the front, and an old store migrates."""
import json
import re

import pytest
import torch

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii.engine.storage import store as store_module
from retiarii.engine.driver.costs import CostMeter
from retiarii.engine.driver.experiment import ExperimentError
from retiarii.engine.storage.pareto import FrontTable
from retiarii.engine.storage.store import Store
from retiarii.objectives import Objectives, pareto_indices

TRAINER = rt.Trainer(dataset="digits", epochs=1, batch_size=256,
                     lr=rt.ValueChoice([0.01, 0.03, 0.1], label="lr"))
OBJ = dict(metric=["val_acc", "params"], mode=["max", "min"], constraints=["flops <= 3000"])


def _exp(db, max_models, strategy=None, **kw):
    return rt.Experiment(space, strategy or rt.strategies.Random(seed=0), TRAINER,
                         store=str(db), workers=1, max_models=max_models,
                         executor=InProcessExecutor(), optimize=False, **{**OBJ, **kw})


def _front_and_values(db):
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        table = FrontTable(store)
        return table.front_ids(), table.models()


def _params(sample):
    hidden = sample["hidden"]
    return 64 * hidden + hidden + hidden * 10 + 10


def test_front_is_the_pareto_front_of_the_stored_values(tmp_path):
    db = tmp_path / "mo.db"
    summary = _exp(db, 8).run()
    front, models = _front_and_values(db)
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        every = store.models()
        trials = store.db.execute("SELECT count(*) FROM trials").fetchone()[0]
    # hidden=32 has 4480 flops > 3000: measured when proposed, recorded and never trained
    skipped = [m for m in every if m["status"] == "failed"]
    assert len(every) == 8 and skipped and len(models) == 8 - len(skipped) == trials
    for m in skipped:
        assert m["sample"]["hidden"] == 32
        assert re.fullmatch(r"not trained: flops = (\d+) misses the constraint flops <= 3000 "
                            r"\(measured before training\)", m["error"])
        assert int(m["error"].split()[4]) > 3000
    obj = Objectives.of(**OBJ)
    for m in models:
        # the costs are the built model's: parameters by hand; flops of one forward pass
        # at batch 1 (2 per multiply-add of the two linear layers)
        assert m["values"]["params"] == _params(m["sample"])
        assert m["values"]["flops"] == 2 * (64 * m["sample"]["hidden"] + m["sample"]["hidden"] * 10)
        assert m["violation"] == obj.violation(m["values"])
    points = [obj.point(m["values"]) for m in models]
    expected = [models[i]["model_id"] for i in pareto_indices(points,
                                                              [m["violation"] for m in models])]
    assert sorted(front) == sorted(expected) and front
    assert all(m["sample"]["hidden"] == 16 for m in models)
    assert summary["pareto"] and {r["model_id"] for r in summary["pareto"]} == set(front)


def test_resumed_search_keeps_the_front_of_an_uninterrupted_one(tmp_path):
    whole, parts = tmp_path / "whole.db", tmp_path / "parts.db"
    _exp(whole, 8, rt.strategies.RegularizedEvolution(4, 2, seed=1)).run()
    _exp(parts, 4, rt.strategies.RegularizedEvolution(4, 2, seed=1)).run()
    _exp(parts, 8, rt.strategies.RegularizedEvolution(4, 2, seed=1)).resume()
    (fa, ma), (fb, mb) = _front_and_values(whole), _front_and_values(parts)
    assert [m["sample"] for m in ma] == [m["sample"] for m in mb]
    assert [m["values"] for m in ma] == [m["values"] for m in mb]  # bit for bit on CPU
    assert fa == fb


def test_resume_checks_the_objectives(tmp_path):
    db = tmp_path / "mo.db"
    loose = ["flops <= 9000"]  # (3000 rules out both models this seed draws: nothing trains)
    _exp(db, 2, constraints=loose).run()
    for other in (dict(mode=["max", "max"], constraints=loose),
                  dict(constraints=["flops <= 4000"]),
                  dict(metric="val_acc", mode="max", constraints=None)):
        with pytest.raises(ExperimentError, match="objectives"):
            _exp(db, 4, **other).resume()


def test_bad_objectives_are_refused_before_anything_is_written(tmp_path):
    db = tmp_path / "bad.db"
    with pytest.raises(ExperimentError, match="PolicyBasedRL optimizes one metric; for "
                                              "several objectives give it reward="):
        _exp(db, 2, rt.strategies.PolicyBasedRL(seed=0))
    with pytest.raises(ExperimentError, match="one mode per metric"):
        _exp(db, 2, mode=["max"])
    with pytest.raises(ExperimentError, match="METRIC OP NUMBER"):
        _exp(db, 2, constraints=["flops < lots"])
    with pytest.raises(ExperimentError, match="params is measured by the engine"):
        _exp(db, 2, costs={"params": len})
    assert not db.exists()


def test_one_metric_with_a_constraint_tells_infeasible_models_as_failed(tmp_path):
    db = tmp_path / "one.db"
    strategy = rt.strategies.Random(seed=0)
    exp = _exp(db, 6, strategy, metric="val_acc", mode="max", constraints=["my_width <= 16"],
               costs={"my_width": lambda m: m.fc1.out_features})
    exp.run()
    _, models = _front_and_values(db)
    told = dict((json.dumps(s, sort_keys=True), v) for s, v in
                ((strategy._records[k].sample, v) for k, v in strategy._told))
    for m in models:
        key = json.dumps(m["sample"], sort_keys=True)
        assert (told[key] is None) == (m["values"]["my_width"] > 16)
    best = exp.summary()["best"]
    assert best and all(b["sample"]["hidden"] == 16 for b in best)


def test_costs_are_measured_once_per_architecture(tmp_path, monkeypatch):
    calls = []
    real = CostMeter.measure_module

    def counting(self, module, names):
        calls.append(list(names))
        return real(self, module, names)

    monkeypatch.setattr(CostMeter, "measure_module", counting)
    _exp(tmp_path / "c.db", 8).run()
    # 8 models of 4 architectures (x 3 learning rates): at most 4 measurements
    assert 1 <= len(calls) <= 4
    with Store(tmp_path / "c.db") as store:
        rows = store.db.execute("SELECT count(DISTINCT hash) FROM costs").fetchone()[0]
    assert rows == len(calls)


def test_latency_and_memory_costs_by_hand():
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(256, 10))
    meter = CostMeter(None, torch.zeros(2, 1, 8, 8), 16, [])
    out = meter.measure_module(net, ["params", "flops", "peak_mem_mb", "latency_ms",
                                     "latency_batch_ms"])
    assert out["params"] == (4 * 9 + 4 + 2560 + 10, None)
    assert out["flops"][0] == 2 * 256 * 9 + 2 * 256 * 10  # conv (no bias counted) + linear
    # weights, then the conv's and the ReLU's outputs live together (1 KiB each) at the peak
    assert out["peak_mem_mb"][0] * 2 ** 20 == 4 * 2610 + 2 * 1024
    for name in ("latency_ms", "latency_batch_ms"):
        median, spread = out[name]
        assert median > 0 and spread >= 0


def test_a_version_7_store_migrates(tmp_path, monkeypatch):
    path = tmp_path / "v7.db"
    with monkeypatch.context() as m:
        m.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:7])
        m.setattr(store_module, "SCHEMA_VERSION", 7)
        with Store(path) as s:
            s.add_experiment({"space": "x"}, seed=0)
            model = s.add_model({"op": "a"}, {"nodes": []}, "h1")
            s.set_model_status(model, "trained", value=0.5)
    with Store(path) as s:
        assert s.schema_version == store_module.SCHEMA_VERSION >= 9
        s.use_experiment(1)
        assert s.get_model(model)["value"] == 0.5
        assert s.get_model(model)["values"] is None and FrontTable(s).front_ids() is None
        assert FrontTable(s).models() == []  # one metric: nothing to rank
        FrontTable(s).add_costs("h1", "cpu", {"params": (3.0, None)})
        assert FrontTable(s).costs("h1", "cpu") == {"params": (3.0, None)}


def test_cli_run_status_resume_with_several_objectives(tmp_path, capsys):
    from retiarii.cli import main

    db = str(tmp_path / "cli.db")
    base = ["--strategy", "random", "--metric", "val_acc,params", "--mode", "max,min",
            "--constraint", "flops<=9000", "--workers", "1", "--store", db]
    assert main(["run", "tests/exp_space.py", "--max-models", "2", *base]) == 0
    assert main(["resume", db, "--max-models", "3"]) == 0  # rebuilt with its objectives
    capsys.readouterr()
    assert main(["status", db, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["models"] == 3 and out["objectives"]["constraints"] == ["flops <= 9000"]
    front, models = _front_and_values(db)
    assert sorted(r["model_id"] for r in out["pareto"]) == sorted(front)
    assert main(["status", db, "--pareto"]) == 0
    assert "Pareto front of val_acc (max), params (min)" in capsys.readouterr().out
    one = str(tmp_path / "one.db")
    assert main(["run", "tests/exp_space.py", "--max-models", "1",
                 "--workers", "1", "--store", one]) == 0
    assert main(["status", one, "--pareto"]) == 2
    assert "optimizes one metric" in capsys.readouterr().err
