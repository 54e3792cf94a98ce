"""Failures are never hidden: every failed model keeps its reason and traceback in the store
(``models.error``, schema v7, migrated from older files), ``status`` shows them, and a search
whose every model failed raises :class:`SearchFailed` (``retiarii run``: exit status 1)."""
import json
import os
import sqlite3

import pytest
import sqlite_utils

import retiarii as rt
from engine_helpers import InProcessExecutor
from failing_spaces import always_fails, half_builds
from retiarii import cli
from retiarii.engine.storage import schema as store_schema
from retiarii.engine.storage.store import Store

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = rt.Trainer(dataset="digits", epochs=1, batch_size=512)


def _models(db):
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return store.models(), store.get_experiment()["status"]


def test_a_search_whose_every_model_fails_raises_search_failed_with_the_reason(tmp_path):
    db = tmp_path / "all.db"
    exp = rt.Experiment(always_fails, rt.strategies.GridSearch(), FAST, store=str(db),
                        executor=InProcessExecutor(), max_models=3)
    with pytest.raises(rt.SearchFailed) as err:
        exp.run()
    text = str(err.value)
    assert "all 3 models failed" in text
    assert "most common reason (3 of 3): ZeroDivisionError: the training step divided by " \
           "zero" in text and "--errors" in text
    assert err.value.failures["failed"] == 3 and err.value.summary["trials"]["ERRORED"] == 3
    assert isinstance(err.value, rt.ExperimentError)  # code catching those still catches it
    models, status = _models(db)
    assert status == "failed"
    assert all("Traceback" in m["error"] and "ZeroDivisionError" in m["error"] for m in models)


def test_a_model_that_cannot_be_built_keeps_its_reason_and_traceback(tmp_path):
    db = tmp_path / "half.db"
    summary = rt.Experiment(half_builds, rt.strategies.GridSearch(), FAST, store=str(db),
                            executor=InProcessExecutor(), max_models=2).run()
    assert summary["failures"]["failed"] == 1 and summary["failures"]["trained"] == 1
    failed = [m for m in _models(db)[0] if m["status"] == "failed"]
    assert [m["sample"] for m in failed] == [{"h": 32}]
    error = failed[0]["error"]
    assert error.startswith("cannot be built: ShapeMismatchError: shape mismatch at node 'out'")
    assert "Traceback (most recent call last)" in error


def test_status_shows_every_failed_model_by_reason(tmp_path, capsys):
    db = tmp_path / "half.db"
    rt.Experiment(half_builds, rt.strategies.GridSearch(), FAST, store=str(db),
                  executor=InProcessExecutor(), max_models=2).run()
    capsys.readouterr()
    assert cli.main(["status", str(db)]) == 0
    out = capsys.readouterr().out
    assert "failed models (1 of 2), by reason:" in out
    assert '- model 2 {"h": 32}: cannot be built: ShapeMismatchError' in out
    assert "Traceback" not in out
    assert cli.main(["status", str(db), "--errors"]) == 0
    assert "Traceback (most recent call last)" in capsys.readouterr().out
    assert cli.main(["status", str(db), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["failures"]["reasons"][0][1] == 1
    assert status["failed_models"][0]["sample"] == {"h": 32}


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr("retiarii.engine.executors.local.LocalExecutor.for_search",
                        lambda *args, **kwargs: InProcessExecutor())


def test_cli_run_of_a_search_that_trains_nothing_exits_1_with_the_reason(
        tmp_path, capsys, in_process):
    space_file = tmp_path / "space.py"
    space_file.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\n"
                          f"from failing_spaces import always_fails as space\n")
    db = tmp_path / "cli.db"
    code = cli.main(["run", str(space_file), "--strategy", "grid", "--max-models", "2",
                     "--epochs", "1", "--store", str(db)])
    err = capsys.readouterr().err
    assert code == 1
    assert "all 2 models failed" in err and "ZeroDivisionError" in err


def test_cli_run_says_how_many_models_failed_when_others_trained(tmp_path, capsys, in_process):
    space_file = tmp_path / "space.py"
    space_file.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\n"
                          f"from failing_spaces import half_builds as space\n")
    code = cli.main(["run", str(space_file), "--strategy", "grid", "--max-models", "2",
                     "--epochs", "1", "--store", str(tmp_path / "h.db")])
    assert code == 0
    assert "1 of 2 models failed; most common reason (1): cannot be built: " \
           "ShapeMismatchError" in capsys.readouterr().err


def _old_store(path):
    """A store written by schema version 6 (before models.error): an experiment with a
    trained model and a failed one whose trial errored."""
    db = sqlite_utils.Database(str(path))
    for migrate in store_schema.MIGRATIONS[:6]:
        migrate(db)
    db["meta"].insert_all([{"key": "application", "value": "retiarii"},
                           {"key": "schema_version", "value": "6"}])
    config = {"metric": "val_acc", "mode": "max", "strategy": {"class": "x:Random"}}
    db["experiments"].insert({"id": 1, "name": "old", "config": json.dumps(config), "seed": 0,
                              "status": "done", "created": 1.0, "updated": 1.0})
    for mid, status, value in ((1, "trained", 0.5), (2, "failed", None)):
        db["models"].insert({"id": mid, "experiment_id": 1, "sample": json.dumps({"h": mid}),
                             "status": status, "value": value, "created": 1.0, "updated": 1.0})
        db["trials"].insert({"id": f"t{mid}", "seq": mid, "experiment_id": 1, "model_id": mid,
                             "spec": "{}", "state": "TERMINATED" if value else "ERRORED",
                             "attempts": 1, "step": 1,
                             "error": None if value else "model error: RuntimeError: old"})
    db.conn.close()


def test_an_old_store_migrates_to_models_error_and_status_reads_it(tmp_path, capsys):
    path = tmp_path / "old.db"
    _old_store(path)
    assert "error" not in [r[1] for r in sqlite3.connect(path).execute(
        "PRAGMA table_info(models)")]
    with Store(path) as store:  # migrates
        assert store.schema_version == store_schema.SCHEMA_VERSION
        store.use_experiment(1)
        models = {m["id"]: m for m in store.models()}
        assert models[1]["error"] is None and models[2]["error"] is None  # nothing invented
    assert cli.main(["status", str(path)]) == 0
    out = capsys.readouterr().out
    # the failed model's reason comes from its trial's error
    assert "failed models (1 of 2), by reason:\n     1  RuntimeError: old" in out
    with Store(path) as store:  # the new column is written and read back
        store.use_experiment(1)
        store.set_model_status(2, "failed", error="RuntimeError: newer")
        assert store.get_model(2)["error"] == "RuntimeError: newer"
