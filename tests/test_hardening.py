"""What a careful user tries: copy or move a run and resume it, two drivers on one store,
half-written stores, evolution's lineage, and the CLI's errors for everything a user gets wrong."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii import cli
from retiarii.engine.driver.experiment import ExperimentError
from retiarii.engine.storage.store import Store

FAST = rt.Trainer(dataset="digits", epochs=1, batch_size=512)

SPACE_FILE = '''
import torch
from torch import nn
import retiarii as rt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.fc1 = nn.Linear(64, 16)
        self.act = rt.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flat(x))))


space = rt.ModelSpace(Net(), example_input=torch.zeros(2, 1, 8, 8))
trainer = rt.Trainer(dataset="digits", epochs=1, batch_size=512,
                     lr=rt.ValueChoice([0.01, 0.1], label="lr"))
'''


def _digest(folder: Path) -> dict:
    """Every file under ``folder`` with the hash of its content."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _models(db) -> list[dict]:
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return store.models()


def _cli(*argv, capsys=None) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err if capsys is not None else ""
    return code, err


def test_resume_resumes_the_store_given_and_a_copied_or_moved_run_resumes_alone(
        tmp_path, monkeypatch, capsys):
    run1 = tmp_path / "run1"
    run1.mkdir()
    (run1 / "space.py").write_text(SPACE_FILE)
    monkeypatch.chdir(run1)  # relative paths, as a user types them
    assert _cli("run", "space.py", "--max-models", 2, "--workers", 1, "--store", "runs/a.db",
                "--strategy", "random") == (0, "")
    capsys.readouterr()
    original = _digest(run1)
    run2 = tmp_path / "run2"
    shutil.copytree(run1, run2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, err = _cli("resume", "../run2/runs/a.db", "--max-models", 3, capsys=capsys)
    assert code == 0, err
    assert len(_models(run2 / "runs" / "a.db")) == 3  # the copy went on ...
    assert _digest(run1) == original  # ... and the original was not touched at all
    assert list(elsewhere.iterdir()) == []  # no stray store where the command ran
    run3 = tmp_path / "moved"
    run2.rename(run3)  # a moved run directory resumes too
    code, err = _cli("resume", run3 / "runs" / "a.db", "--max-models", 4, capsys=capsys)
    assert code == 0, err
    models = _models(run3 / "runs" / "a.db")
    assert len(models) == 4 and all(m["status"] == "trained" for m in models)
    assert _digest(run1) == original


def test_a_second_driver_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(
        tmp_path, capsys):
    db = tmp_path / "x.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from retiarii.engine.storage.lock import StoreLock
            StoreLock({str(db)!r}).acquire()
            print("locked", flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        exp = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                            executor=InProcessExecutor(), max_models=1)
        with pytest.raises(ExperimentError, match=rf"in use by another driver \(pid {holder.pid} "
                                                   rf"on host .+ since \d{{4}}-"):
            exp.run()
        assert not db.exists()  # refused before anything was written
        code, err = _cli("resume", db, capsys=capsys)  # (no store yet: says so)
        assert code == 2 and "does not exist" in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without releasing anything: its lock is taken over safely
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                        executor=InProcessExecutor(), max_models=2)
    assert exp.run()["models"] == 2
    assert json.loads((tmp_path / "x.db.lock").read_text() or "{}") == {}  # released at the end


def test_two_concurrent_resumes_cannot_both_drive_a_store(tmp_path):
    db = tmp_path / "x.db"
    rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                  executor=InProcessExecutor(), max_models=1).run()
    first = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                          executor=InProcessExecutor(), max_models=2)
    second = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                           executor=InProcessExecutor(), max_models=2)
    first._open()  # the first driver is running (holds the store)
    try:
        with pytest.raises(ExperimentError, match=f"pid {os.getpid()}"):
            second.resume()
    finally:
        first._lock.release()
    assert second.resume()["models"] == 2


def test_a_model_staged_without_its_trial_is_never_written(tmp_path):
    db = tmp_path / "x.db"
    with Store(db) as store:
        store.add_experiment({})
        model_id = store.stage_model({"op": "a"}, None, "h1")
    # the driver died before the trial was journaled: nothing of the model is on disk
    with Store(db) as store:
        assert store.models() == []
        assert store.stage_model({"op": "a"}, None, "h1") == model_id  # the id is free again


def test_resume_drops_models_an_older_crash_left_without_their_trial(tmp_path):
    db = tmp_path / "x.db"
    rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                  executor=InProcessExecutor(), max_models=2).run()
    with Store(db) as store:  # what a crash between the two writes left in older stores
        store.use_experiment(store.experiments()[-1]["id"])
        orphan = store.add_model({"act": "tanh", "hidden": 32, "lr": 0.01}, None, "x",
                                 status="training")
    summary = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                            executor=InProcessExecutor(), max_models=3).resume()
    models = _models(db)
    assert orphan not in [m["id"] for m in models[:2]] and len(models) == 3
    assert all(m["status"] == "trained" for m in models)  # nothing stays "training" forever
    assert summary["models"] == 3


def test_evolution_writes_each_childs_parent(tmp_path):
    db = tmp_path / "x.db"
    strategy = rt.strategies.RegularizedEvolution(population_size=2, sample_size=1, seed=0)
    # optimize=False: one model per job, so each child is asked after its parent's result
    # (a grouped job asks for up to batch_models models before any is told)
    rt.Experiment(space, strategy, FAST, store=str(db), executor=InProcessExecutor(),
                  max_models=6, optimize=False).run()
    models = _models(db)
    by_id = {m["id"]: m for m in models}
    assert [m["parent"] for m in models[:2]] == [None, None]  # the random initial population
    children = models[2:]
    assert all(m["parent"] in by_id and m["parent"] < m["id"] for m in children)
    for child in children:  # a child changes one choice of its parent
        parent = by_id[child["parent"]]["sample"]
        changed = [k for k in child["sample"] if child["sample"][k] != parent.get(k)]
        assert len(changed) == 1, (parent, child["sample"])


# ---- the CLI's errors: one line naming the culprit and the fix, exit 2, nothing written -------


@pytest.mark.parametrize("argv, says", [
    (["run", "demo", "--workers", "0"], "--workers must be 1 or more"),
    (["run", "demo", "--max-models", "0"], "--max-models must be 1 or more"),
    (["run", "demo", "--max-models", "-3"], "--max-models must be 1 or more"),
    (["run", "nowhere.py"], "neither 'demo' nor a Python file"),
    (["resume", "missing.db"], "missing.db does not exist"),
    (["status", "missing.db"], "missing.db does not exist"),
    (["export", "missing.db", "--out", "o"], "missing.db does not exist"),
    (["export", "missing.db", "--out", "o", "--top", "0"], "--top must be 1 or more"),
])
def test_cli_refuses_bad_arguments_before_writing_anything(tmp_path, monkeypatch, capsys, argv,
                                                           says):
    monkeypatch.chdir(tmp_path)
    code, err = _cli(*argv, capsys=capsys)
    assert code == 2 and says in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content, says", [
    ("x = (\n", "line 1: syntax error"),
    ("y = 1\n", "defines no module-level `space`"),
    ("raise RuntimeError('boom')\n", "failed while it was imported: RuntimeError: boom"),
    (SPACE_FILE + "strategy = 'randm'\n", "did you mean 'random'?"),
])
def test_cli_says_what_is_wrong_with_a_space_file(tmp_path, monkeypatch, capsys, content, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.py").write_text(content)
    code, err = _cli("run", "space.py", "--store", "r/x.db", capsys=capsys)
    assert code == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_epochs_with_a_space_file_that_has_its_trainer_is_an_error(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.py").write_text(SPACE_FILE)
    code, err = _cli("run", "space.py", "--epochs", 3, "--store", "r/x.db", capsys=capsys)
    assert code == 2 and "defines its own `trainer`" in err
    assert not (tmp_path / "r").exists()


def test_cli_reports_stores_it_cannot_use(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.db").write_text("not a database at all " * 100)
    code, err = _cli("status", "notes.db", capsys=capsys)
    assert code == 2 and "not a usable SQLite database" in err
    sqlite3.connect(tmp_path / "other.db").execute("CREATE TABLE t (x)").connection.close()
    code, err = _cli("resume", "other.db", capsys=capsys)
    assert code == 2 and "not a retiarii store" in err
    (tmp_path / "folder.db").mkdir()
    code, err = _cli("status", "folder.db", capsys=capsys)
    assert code == 2 and "is not a file" in err
    Store(tmp_path / "empty.db").close()
    for argv in (["status", "empty.db"], ["export", "empty.db", "--out", "o"],
                 ["plot", "empty.db", "--out", "p.png"]):
        code, err = _cli(*argv, capsys=capsys)
        assert code == 2 and "holds no experiment" in err, argv


@pytest.fixture
def finished_store(tmp_path):
    """A store with two trained models and one that always fails (NaN)."""
    from exp_space import failing_space

    db = tmp_path / "f.db"
    strategy = rt.strategies.GridSearch()
    rt.Experiment(failing_space, strategy, FAST, store=str(db), executor=InProcessExecutor(),
                  max_models=6, max_failures=0).run()
    return db


def test_status_shows_why_trials_errored_and_never_ranks_them(finished_store, capsys):
    with Store(finished_store) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        errored = [t for t in store.trials() if t["state"] == "ERRORED"]
        assert errored  # the grid reaches the NaN model
        # an ERRORED trial's metrics never make it a best model
        store.result(errored[0]["id"], 1, {"val_acc": 2.0}, time=0.0)
        best = store.best_models("val_acc", "max", 10)
    assert errored[0]["model_id"] not in [b["model_id"] for b in best]
    code, _ = _cli("status", finished_store)
    out = capsys.readouterr().out
    assert code == 0 and f"errored trials ({len(errored)})" in out
    assert "Traceback" not in out and "loss" in out.lower()  # the reason, in one line
    code, _ = _cli("status", finished_store, "--errors")
    assert code == 0 and "Traceback" in capsys.readouterr().out
    status = json.loads((_cli("status", finished_store, "--json"),
                         capsys.readouterr().out)[1])
    assert len(status["errors"]) == len(errored)
    assert all(b["value"] <= 1.0 for b in status["best"])


def test_export_skips_an_unreadable_checkpoint_and_refuses_a_file_as_folder(
        finished_store, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, err = _cli("export", finished_store, "--out", tmp_path / "afile", capsys=capsys)
    assert code == 2 and "is a file" in err
    with Store(finished_store) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        best = store.best_models("val_acc", "max", 2)
        broken = store.last_checkpoint(best[0]["trial_id"])["path"]
    Path(broken).write_bytes(b"garbage")
    code, err = _cli("export", finished_store, "--out", tmp_path / "out", "--top", 2,
                     capsys=capsys)
    assert code == 0 and "cannot be read" in err
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    first, second = (f"model_{b['model_id']}" for b in best)
    assert f"{first}.py" in files and f"{first}.pt" not in files  # exported without weights
    assert f"{second}.py" in files and f"{second}.pt" in files  # the rest as usual


def test_plot_draws_single_point_trials(finished_store, tmp_path, capsys):
    out = tmp_path / "p.png"
    code, _ = _cli("plot", finished_store, "--out", out, capsys=capsys)
    assert code == 0 and out.stat().st_size > 1000
    code, err = _cli("plot", finished_store, "--out", tmp_path, capsys=capsys)
    assert code == 2 and "is a folder" in err


def test_progress_best_counts_finished_trials_only(tmp_path):
    lines = []
    db = tmp_path / "x.db"
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(db),
                        executor=InProcessExecutor(), max_models=4, progress=lines.append,
                        optimize=False)
    exp.run()
    bests = [s["best"][0]["value"] for s in lines if s["best"]]
    assert bests == sorted(bests)  # never goes down
    # one slot, and the trial whose end is reported no longer counts as running
    assert [s["running"] for s in lines] == [0] * 4
    # grouped (the default): the four share one job, so three still run when the first ends
    lines.clear()
    rt.Experiment(space, rt.strategies.Random(seed=0), FAST, store=str(tmp_path / "g.db"),
                  executor=InProcessExecutor(), max_models=4, progress=lines.append).run()
    assert [s["running"] for s in lines] == [3, 2, 1, 0]


def test_epochs_as_a_choice_is_refused_naming_the_longest_and_a_scheduler(tmp_path):
    # found by a new user's search: Trainer(epochs=ValueChoice) failed deep in the runner with
    # "Object of type ValueChoice is not JSON serializable"
    from exp_space import space as small_space

    trainer = rt.Trainer(dataset="digits", epochs=rt.ValueChoice([1, 3, 2], label="ep"))
    with pytest.raises(rt.ExperimentError, match=r"epochs=3, and let a scheduler.*ASHA"):
        rt.Experiment(small_space, rt.strategies.GridSearch(), trainer,
                      store=str(tmp_path / "e.db"))
    assert not (tmp_path / "e.db").exists()  # refused before anything is written


class _WithAux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        return logits, logits.mean()


def test_a_model_returning_a_tuple_is_told_what_the_classifier_needs():
    from retiarii.engine.trainers.trial_training import TrialRun

    run = TrialRun(_WithAux, rt.Trainer(dataset="digits", epochs=1), {}, seed=0)
    with pytest.raises(TypeError, match=r"returns tuple of 2: return the logits alone, or "
                                        r"subclass rt.Trainer and override training_step"):
        run.train_epoch()
