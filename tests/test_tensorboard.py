"""``retiarii run/resume --tensorboard DIR``: every trial's metrics as TensorBoard event files,
read back with TensorBoard's own ``EventAccumulator`` and compared with the store."""
from __future__ import annotations

import os

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space, trainer
from retiarii.cli import main
from retiarii.engine.storage.store import Store

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed: pip install -e .[dashboard]")


def _scalars(folder: str) -> dict:
    """{tag: [(step, value), ...]} of one run folder, as TensorBoard reads it."""
    acc = event_accumulator.EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _store_curves(db: str) -> dict:
    with Store(db) as s:
        out = {}
        for e in s.experiments():
            s.use_experiment(e["id"])
            for t in s.trials():
                out[t["id"]] = {name: s.learning_curve(t["id"], name) for name in
                                ("val_acc", "val_loss", "train_loss")}
        return out


def _search(db, models):
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=db, seed=0,
                        executor=InProcessExecutor(), max_models=models, optimize=False)
    return exp.resume() if os.path.exists(db) else exp.run()


def test_a_resumed_search_appends_only_its_new_results(tmp_path):
    from retiarii.tensorboard_log import TensorBoardLog

    db, tb = str(tmp_path / "r.db"), str(tmp_path / "tb")
    _search(db, 2)
    assert TensorBoardLog(db, tb).sync() > 0
    _search(db, 3)
    log = TensorBoardLog(db, tb)  # a new process: the mark says what was written
    log.close()
    curves = _store_curves(db)
    assert sorted(os.listdir(tb)) == sorted([*curves, "retiarii-written.json"])
    for trial_id, by_name in curves.items():
        scalars = _scalars(os.path.join(tb, trial_id))
        for name, curve in by_name.items():  # each step once: nothing written twice
            assert [st for st, _ in scalars[name]] == [st for st, _ in curve]
            assert [v for _, v in scalars[name]] == pytest.approx([v for _, v in curve])
    assert log.sync() == 0


@pytest.mark.slow  # worker processes start: ~30 s on a loaded machine
def test_cli_run_writes_each_trial(tmp_path, capsys):
    db, tb = str(tmp_path / "c.db"), str(tmp_path / "tb")
    assert main(["run", "demo", "--max-models", "2", "--epochs", "2", "--workers", "1",
                 "--optimize", "off", "--store", db, "--tensorboard", tb]) == 0
    curves = _store_curves(db)
    assert len(curves) == 2
    for trial_id, by_name in curves.items():
        scalars = _scalars(os.path.join(tb, trial_id))
        assert [s for s, _ in scalars["val_acc"]] == [1, 2]
        assert [v for _, v in scalars["val_acc"]] == pytest.approx(
            [v for _, v in by_name["val_acc"]])
