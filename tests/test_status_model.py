"""``retiarii status DB --model ID``: one model in full (issue #28: the status table cuts a
sample at 90 characters)."""
from __future__ import annotations

import json

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space, trainer
from retiarii.cli import main
from retiarii.engine.storage.store import Store


def _search(tmp_path) -> str:
    db = str(tmp_path / "m.db")
    rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                  executor=InProcessExecutor(), max_models=2, optimize=False).run()
    return db


def test_status_model_shows_one_model_in_full(tmp_path, capsys):
    db = _search(tmp_path)
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        model = store.models()[0]
        (trial,) = [t for t in store.trials() if t["model_id"] == model["id"]]
        curve = store.learning_curve(trial["id"], "val_acc")
    assert main(["status", db, "--model", str(model["id"])]) == 0
    out = capsys.readouterr().out
    for label, key in model["sample"].items():  # every choice on a line of its own, uncut
        assert any(line.split() == [label, json.dumps(key)] for line in out.splitlines()), out
    assert f"trial {trial['id']} TERMINATED at step {len(curve)}" in out
    assert main(["status", db, "--model", str(model["id"]), "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["sample"] == model["sample"] and detail["status"] == "trained"
    assert [tuple(p) for p in detail["trials"][0]["curve"]] == [tuple(p) for p in curve]


def test_status_model_refuses_an_unknown_id(tmp_path, capsys):
    db = _search(tmp_path)
    assert main(["status", db, "--model", "99"]) == 2
    err = capsys.readouterr().err
    assert "--model 99" in err and "has no model 99" in err and "lists the models" in err
