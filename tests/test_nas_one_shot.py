"""The weight-sharing rows of `retiarii nas`: each runs its one-shot strategy through the
engine's one-shot host (segments, models and the selected architecture in the store), the
table and `nas show` say so; no row runs a multi-trial stand-in.

The runs are tiny: the small preset on the first 40 digits (one training batch, one
validation batch), one segment, the smallest search budget (``options``).
"""
from __future__ import annotations

import json
import os

import pytest

from engine_helpers import InProcessExecutor
from retiarii import nas
from retiarii.cli import main
from retiarii.engine.trainers import trainer as trainer_module
from retiarii.engine.storage.segments_table import SegmentTable
from retiarii.engine.storage.store import Store

ONE_SHOT_ROWS = [row.name for row in nas.ROWS if row.one_shot]
# the smallest budget of each strategy: a tiny run that still searches
TINY = {"SPOS": {"search_population": 2, "search_generations": 1},
        "FairNAS": {"search_population": 2, "search_generations": 1},
        "ENAS": {"controller_steps": 2},
        "OnceForAll": {"predictor_samples": 2, "predictor_steps": 10, "search_population": 2,
                       "search_generations": 1}}
# rows whose tiny run takes ~10 s or more on the shared 2-core machine (the darts cell and the
# 22 FBNet layers compute every candidate of every choice)
HEAVY = {"darts", "fbnet"}


@pytest.fixture
def few_digits(monkeypatch):
    """The digits data set cut to its first 40 images (32 train, 8 validation)."""
    x, y = trainer_module.load_dataset("digits")
    monkeypatch.setitem(trainer_module._DATASETS, "digits", (x[:40], y[:40]))


def test_every_weight_sharing_row_runs_a_one_shot_strategy_or_says_why_not():
    # the rows whose paper shares weights (issue #15's list)
    weight_sharing = {"enas_cnn", "spos", "enas_rnn", "oneshot", "darts", "darts_rnn", "fbnet",
                      "proxylessnas", "fairnas", "scarlet_nas", "single_path_nas",
                      "once_for_all"}
    assert set(ONE_SHOT_ROWS) == weight_sharing
    expected = {"enas_cnn": "ENAS", "enas_rnn": "ENAS", "spos": "SPOS", "fairnas": "FairNAS",
                "scarlet_nas": "FairNAS", "oneshot": "PathDropout", "once_for_all": "OnceForAll",
                "darts": "DARTS", "darts_rnn": "DARTS", "fbnet": "GumbelDARTS",
                "proxylessnas": "ProxylessNAS", "single_path_nas": "SinglePathNAS"}
    assert {name: nas.get(name).runs_with for name in ONE_SHOT_ROWS} == expected
    for row in nas.ROWS:
        assert "not landed" not in row.note
        strategy = nas.strategy(row.name, seed=3, epochs=4)
        assert bool(getattr(strategy, "one_shot", False)) == row.one_shot, row.name
        if row.one_shot:
            assert type(strategy).__name__ == row.runs_with
            # SPOS adds its search segment; OnceForAll runs 4 phases of 4, then searches
            assert strategy.num_segments() in ((17,) if row.runs_with == "OnceForAll"
                                               else (4, 5))
            assert strategy.seed == 3
    # the rows' own settings reach the strategy
    assert nas.strategy("fairnas").fair and nas.strategy("scarlet_nas").fair  # FairNAS's
    assert not nas.strategy("spos").fair
    assert nas.strategy("oneshot").final_rate == 0.5  # the row's path dropout reaches r = 0.5
    assert nas.strategy("spos", options={"search_population": 3}).search_population == 3


def test_table_and_show_say_what_runs(capsys):
    table = {cells[1]: cells[3] for cells in nas.table()}
    for name in ONE_SHOT_ROWS:
        row = nas.get(name)
        assert table[name] == f"{row.strategy} ({row.runs_with}, one-shot)"
        assert main(["nas", "show", name]) == 0
        out = capsys.readouterr().out
        assert f"{row.runs_with}({{" in out and "one-shot: segments" in out
        assert row.note[:40] in out
    assert table["darts_rnn"] == "differentiable (DARTS, one-shot)"
    assert table["nasbench201"] == "any (RegularizedEvolution)"
    assert main(["nas", "show", "no_such_row"]) == 2
    assert "nasbench201" in capsys.readouterr().err


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in ONE_SHOT_ROWS])
def test_a_one_shot_row_runs_through_the_experiment_and_records_its_models(
        name, tmp_path, few_digits):
    row = nas.get(name)
    db = str(tmp_path / f"{name}.db")
    exp = nas.experiment(name, epochs=1, store=db, executor=InProcessExecutor(),
                         options=TINY.get(row.runs_with))
    search = exp.run()["one_shot"]
    assert search["segment"] == search["segments"] == exp.strategy.num_segments()
    assert search["models"] >= 1 and search["result_model"] is not None
    # the selected architecture is a model of the row's space, and the store holds it
    space = nas.build_space(name, "small")
    assert space.replay(search["selected"]).sample == search["selected"]
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        config = store.get_experiment()["config"]
        assert config["strategy"]["class"].endswith(":" + row.runs_with)
        evaluated = SegmentTable(store).evaluated()
        assert len(evaluated) == search["models"]
        assert all(m["value"] is not None and 0 <= m["value"] <= 1 for m in evaluated)
        assert SegmentTable(store).result()["sample"] == search["selected"]


def test_nas_run_of_a_one_shot_row_from_the_cli_status_export_resume(
        tmp_path, capsys, few_digits, in_process):
    db = str(tmp_path / "enas_rnn.db")
    assert main(["nas", "run", "enas_rnn", "--max-models", "3", "--store", db]) == 2
    err = capsys.readouterr().err
    assert "--max-models: enas_rnn runs the one-shot ENAS" in err and "Traceback" not in err
    assert not os.path.exists(db)
    assert main(["nas", "run", "enas_rnn", "--epochs", "2", "--retrain-epochs", "0",
                 "--store", db]) == 0
    out = capsys.readouterr()
    assert "segment 2/2" in out.err  # the one-shot progress line
    assert "selected architecture: {" in out.out
    assert main(["status", db, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["strategy"] == "ENAS" and status["status"] == "done"
    assert status["one_shot"]["segments"] == 2 and status["one_shot"]["models"] > 0
    assert main(["resume", db]) == 0  # finished: nothing runs again
    capsys.readouterr()
    assert main(["status", db, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["one_shot"] == status["one_shot"]
    assert main(["export", db, "--out", str(tmp_path / "out")]) == 0
    exported = [f for f in os.listdir(tmp_path / "out") if f.endswith(".pt")]
    assert len(exported) == 1  # the weights it inherits from the super-network


def test_max_models_of_a_one_shot_row_is_refused_in_python():
    with pytest.raises(ValueError, match="max_models=3: fairnas runs the one-shot FairNAS"):
        nas.experiment("fairnas", max_models=3)
