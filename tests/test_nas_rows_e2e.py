"""The oneshot and efficientnet rows through ``retiarii nas run NAME`` at a tiny scale, the
retrain included: each ran its paper's method (Bender et al.'s path dropout reaching r, then
the selection retrained; EfficientNet's grid on a fixed B0, then the scaled selection
retrained, never a phase-1 model), and the store's result model is what the retrain trains."""
from __future__ import annotations

import json

import pytest
import torch

from retiarii import nas, nas_retrain
from retiarii.cli import main
from retiarii.engine.storage.result_model import record_selection
from retiarii.engine.storage.store import Store

SCALING = ("scaling/depth", "scaling/width", "scaling/resolution")


def _experiments(db):
    with Store(db) as store:
        return [(e["id"], e["status"], e.get("result_model"), e["config"].get("origin") or {})
                for e in store.experiments()]


def _models(db, experiment):
    with Store(db) as store:
        store.use_experiment(experiment)
        return store.models()


def test_a_named_selection_becomes_the_result_model_nas_retrain_retrains(tmp_path):
    db = str(tmp_path / "s.db")
    with Store(db) as store:
        store.add_experiment({"strategy": "compound_scaling", "metric": ["val_acc", "flops"],
                              "mode": ["max", "min"]}, seed=0)
        ids = [store.add_model({"k": k}) for k in (3, 5, 7)]
        for model_id, value in zip(ids, (0.9, 0.8, 0.7)):  # val_acc
            store.set_model_status(model_id, "trained", value)
        assert record_selection(store, None) is None  # a strategy that names nothing
        assert store.get_experiment()["result_model"] is None
        assert record_selection(store, {"k": 9}) is None  # never trained: nothing recorded
        assert record_selection(store, {"k": 5}) == ids[1]
    model_id, sample, value = nas_retrain.selected_model(db, 1)
    # the named one, not the most accurate (k=3), with its value
    assert (model_id, sample, value) == (ids[1], {"k": 5}, 0.8)


def test_oneshot_row_trains_with_path_dropout_up_to_r_then_retrains_its_selection(
        tmp_path, few_digits, in_process, capsys):
    db = str(tmp_path / "oneshot.db")
    assert main(["nas", "run", "oneshot", "--epochs", "2", "--retrain-epochs", "1",
                 "--store", db, "--workers", "1"]) == 0
    assert "oneshot: search" in capsys.readouterr().out
    (search, status, result, _), (retrain, r_status, _, r_origin) = _experiments(db)
    assert status == r_status == "done" and result is not None
    with Store(db) as store:
        segments = [json.loads(m) for (m,) in store.db.execute(
            "SELECT metrics FROM segments WHERE experiment_id = ? ORDER BY segment",
            [search]).fetchall()]
        selected = store.get_model(result)["sample"]
    # the schedule: below r after the first epoch, r = 0.5 at the last training step
    rates = [s["dropout_rate"] for s in segments if "dropout_rate" in s]
    assert len(rates) == 2 and rates[0] < 0.5 and rates[1] == pytest.approx(0.5)
    assert segments[-1]["candidates"] == 24  # then 24 random architectures ranked
    assert r_origin["nas_retrain"]["model"] == result
    assert [m["sample"] for m in _models(db, retrain)] == [selected]


def test_efficientnet_row_searches_b0_in_mnasnets_space_then_scales_it_in_order(
        tmp_path, few_digits, in_process, capsys):
    # a tiny budget: the 2 baseline models, then 2 of the 8 grid points
    db = str(tmp_path / "efficientnet.db")
    assert main(["nas", "run", "efficientnet", "--epochs", "1", "--retrain-epochs", "1",
                 "--max-models", "4", "--store", db, "--workers", "1"]) == 0
    assert "efficientnet: search" in capsys.readouterr().out
    (search, status, result, _), (retrain, r_status, _, r_origin) = _experiments(db)
    assert status == r_status == "done"
    models = _models(db, search)
    assert len(models) == 4
    phase1, phase2 = models[:2], models[2:]
    for m in phase1:  # MnasNet's per-stage choices, the scaling at 1
        assert {f"stage{s}/{c}" for s in range(1, 8) for c in ("kernel", "se", "layers")} \
            <= set(m["sample"])
        assert [str(m["sample"][k]) for k in SCALING] == ["100", "100", "8"]
    b0 = {k: v for k, v in phase2[0]["sample"].items() if k not in SCALING}
    assert b0 in [{k: v for k, v in m["sample"].items() if k not in SCALING} for m in phase1]
    space = nas.build_space("efficientnet", "small")
    for m in phase2:  # the found B0's SE and layers kept, its layer counts scaled by depth
        assert {k: v for k, v in m["sample"].items() if k not in SCALING} == b0
        d, w = (int(m["sample"][k]) for k in SCALING[:2])
        r = float(m["sample"]["scaling/resolution"]) / 8
        assert abs(d * w * w / 1e6 * r * r - 2) <= 0.2  # a grid point, not B0 itself
        net = space.build(m["sample"])
        for s in range(1, 8):  # stage s: layers.{2s-2} searched, layers.{2s-1} the extras
            depthwise = sum(1 for name, mod in net.named_modules()
                            if name.split(".")[:2] in (["layers", str(2 * s - 2)],
                                                       ["layers", str(2 * s - 1)])
                            and isinstance(mod, torch.nn.Conv2d) and mod.groups > 1)
            assert depthwise == -(-b0[f"stage{s}/layers"] * d // 100)
    # the retrained model is a scaled one, never a phase-1 model
    assert result in {m["id"] for m in phase2} and r_origin["nas_retrain"]["model"] == result


@pytest.mark.slow
def test_efficientnet_row_scales_a_fixed_b0_and_retrains_the_scaled_selection(
        tmp_path, few_digits, in_process, capsys):
    db = str(tmp_path / "efficientnet.db")
    assert main(["nas", "run", "efficientnet", "--epochs", "1", "--retrain-epochs", "1",
                 "--store", db, "--workers", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("efficientnet: search"))
    assert " 10 models" in line
    (search, status, result, _), (retrain, r_status, _, r_origin) = _experiments(db)
    assert status == r_status == "done"
    models = _models(db, search)
    assert len(models) == nas.MODELS["efficientnet"] == 10  # the default budget: both phases
    phase1, phase2 = models[:2], models[2:]
    base = ["100", "100", "8"]  # the small preset's first candidates: coefficients 1
    for m in phase1:  # the baseline's search holds the scaling at 1
        assert [str(m["sample"][k]) for k in SCALING] == base
    b0 = {k: v for k, v in phase2[0]["sample"].items() if k not in SCALING}
    assert b0 in [{k: v for k, v in m["sample"].items() if k not in SCALING} for m in phase1]
    for m in phase2:  # B0 fixed, each grid point within 10% of alpha * beta^2 * gamma^2 = 2
        assert {k: v for k, v in m["sample"].items() if k not in SCALING} == b0
        d, w = (float(m["sample"][k]) / 100 for k in SCALING[:2])
        r = float(m["sample"]["scaling/resolution"]) / float(base[2])
        assert abs(d * w * w * r * r - 2) <= 0.2
    assert len({json.dumps(m["sample"], sort_keys=True) for m in phase2}) == 8
    # the retrained model is the most accurate scaled model, not any phase-1 model
    best = max(phase2, key=lambda m: m["value"])  # val_acc, the first objective
    assert result == best["id"] and r_origin["nas_retrain"]["model"] == result
    assert [m["sample"] for m in _models(db, retrain)] == [best["sample"]]

