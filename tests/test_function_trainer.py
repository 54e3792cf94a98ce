"""FunctionTrainer: a user's own loop under the engine. Its search equals the same training
written as a Trainer subclass (bit for bit on CPU), under every scheduler; resume, PBT, a lost
worker and a killed driver continue from the function's own saves; misuse fails clearly."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import retiarii as rt
from engine_helpers import InProcessExecutor
from func_space import LRS, func_trainer, ref_trainer, space, train, tuner
from retiarii.engine.trainers.function_run import FunctionRun
from retiarii.engine.storage.store import Store
from retiarii.engine.trainers.trial_training import TrainingError

HERE = Path(__file__).resolve().parent
METRICS = ("train_loss", "val_loss", "val_acc")


def _trials(db):
    """Per trial, in creation order: choices, state, and every metric's curve."""
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return [(t["spec"]["choices"], t["state"], t["parent"],
                 {m: store.learning_curve(t["id"], m) for m in METRICS})
                for t in store.trials()]


def _search(db, trainer, scheduler=None, strategy=None, executor=None, **kw):
    exp = rt.Experiment(space, strategy or rt.strategies.Random(seed=0), trainer, store=str(db),
                        executor=executor or InProcessExecutor(), max_models=kw.pop("models", 6),
                        seed=0, metric="val_acc", scheduler=scheduler, **kw)
    exp.run()
    return _trials(db)


SCHEDULERS = {
    "none": lambda: None,
    "asha": lambda: rt.strategies.ASHA(metric="val_acc", mode="max", grace_period=1, max_t=4,
                                       reduction_factor=2),
    "median": lambda: rt.strategies.MedianStopping(metric="val_acc", mode="max",
                                                   grace_period=1, min_samples_required=2),
    "hyperband": lambda: rt.strategies.Hyperband(metric="val_acc", mode="max", max_t=4,
                                                 reduction_factor=2),
    "hypertrick": lambda: rt.strategies.HyperTrick(metric="val_acc", mode="max", num_workers=4,
                                                   num_phases=2, eviction_rate=0.5),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_function_search_equals_trainer_subclass_bit_for_bit(tmp_path, name):
    ref = _search(tmp_path / "ref.db", ref_trainer, SCHEDULERS[name]())
    got = _search(tmp_path / "func.db", func_trainer, SCHEDULERS[name]())
    assert [t[0] for t in got] == [t[0] for t in ref]  # the same models, in the same order
    assert [t[1] for t in got] == [t[1] for t in ref]  # stopped (or finished) alike
    assert [t[3] for t in got] == [t[3] for t in ref]  # every metric at every step, exactly
    if name == "asha":  # the scheduler really stopped some trials early: same ones, same step
        lengths = [len(t[3]["val_acc"]) for t in got]
        assert min(lengths) < 4 == max(lengths)
    if name == "hyperband":  # it paused trials, resumed later from their own saves
        with Store(tmp_path / "func.db") as store:
            store.use_experiment(store.experiments()[-1]["id"])
            assert any(e["new_state"] == "PAUSED" for e in store.events())


def _segments(hparams, cuts, ckpt_dir, trainer=func_trainer, seed=3):
    """Train a trial to its last cut, one FunctionRun per segment, through checkpoints."""
    sample = space.default_sample()
    out, ckpt = [], None
    for stop in cuts:
        run = FunctionRun(lambda: space.build(sample), trainer, hparams, stop_step=stop,
                          checkpoint=ckpt, seed=seed)
        while run.step < stop:
            out.append((run.step + 1, run.train_epoch()))
        ckpt = os.path.join(ckpt_dir, f"step-{stop}")
        run.save(ckpt)
    return out


def test_paused_and_resumed_equals_uninterrupted(tmp_path):
    whole = _segments({"lr": 0.05}, [4], tmp_path)
    assert [s for s, _ in whole] == [1, 2, 3, 4]
    # paused after every step, and after 1 then 3: the same trajectory, bit for bit
    assert _segments({"lr": 0.05}, [1, 2, 3, 4], tmp_path) == whole
    assert _segments({"lr": 0.05}, [1, 3, 4], tmp_path) == whole


def sparse(model, hparams, session):
    """Saves after every second step only: a restart replays the steps since its save."""
    session.calls = getattr(session, "calls", 0)
    state = session.load()
    start = 0 if state is None else state["step"]
    w = torch.zeros(()) if state is None else state["w"]
    for step in range(start, hparams["epochs"]):
        w = w + torch.rand(())  # the trial's torch stream: restored with the save
        if (step + 1) % 2 == 0:
            session.save({"w": w, "step": step + 1})
        session.report(step + 1, w=float(w))


def test_a_function_that_saves_sparsely_replays_to_the_same_result(tmp_path):
    trainer = rt.FunctionTrainer(sparse, epochs=5)
    whole = _segments({}, [5], tmp_path, trainer)
    for cuts in ([1, 2, 3, 4, 5], [3, 5], [1, 4, 5]):
        got = _segments({}, cuts, tmp_path, trainer)
        assert got == whole, cuts  # each step once, replays unseen by the engine


def test_pbt_children_start_from_their_parents_save_with_new_hparams(tmp_path):
    db = tmp_path / "pbt.db"
    pbt = rt.strategies.PBT("val_acc", "max", {"lr": rt.strategies.Continuous(0.02, 0.1)},
                            population_size=2, steps_per_trial=1, max_generations=3, seed=0)
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), func_trainer, store=str(db),
                        executor=InProcessExecutor(), seed=0, scheduler=pbt)
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = {t["id"]: t for t in store.trials()}
        children = [t for t in trials.values() if t["parent"] is not None]
        assert len(children) == 4 and all(t["state"] == "TERMINATED" for t in trials.values())
        for child in children:
            parent = trials[child["parent"]]
            donor = {c["step"]: c["path"] for c in store.checkpoints(parent["id"])}
            (step, first), = store.learning_curve(child["id"], "val_acc")
            assert child["spec"]["hparams"]["lr"] != parent["spec"]["hparams"]["lr"]
            # by hand: the parent's saved state at the donor step, the child's hparams
            sample = child["spec"]["sample"]
            run = FunctionRun(lambda: space.build(sample), func_trainer,
                              child["spec"]["hparams"], stop_step=step,
                              checkpoint=donor[step - 1], seed=child["spec"]["seed"])
            metrics = run.train_epoch()
            assert metrics["val_acc"] == first
            # and not what the parent's hparams give from there: the new ones were applied
            other = FunctionRun(lambda: space.build(sample), func_trainer,
                                parent["spec"]["hparams"], stop_step=step,
                                checkpoint=donor[step - 1], seed=child["spec"]["seed"])
            assert other.train_epoch()["train_loss"] != metrics["train_loss"]


def test_model_free_search_is_a_plain_tuner(tmp_path):
    db = tmp_path / "tune.db"
    exp = rt.Experiment(None, rt.strategies.GridSearch(), tuner, store=str(db),
                        executor=InProcessExecutor(), metric="score", seed=0)
    summary = exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
        assert len(trials) == 9 and all(t["state"] == "TERMINATED" for t in trials)
    best = summary["best"][0]
    assert (best["sample"]["x"], best["sample"]["y"]) == (0.3, 2)


def test_space_none_needs_a_function_trainer_and_one_shot_is_refused(tmp_path):
    with pytest.raises(rt.ExperimentError, match="needs a FunctionTrainer"):
        rt.Experiment(None, rt.strategies.Random(seed=0), ref_trainer, store=str(tmp_path / "a.db"))
    with pytest.raises(rt.ExperimentError, match="per-batch hooks"):
        rt.Experiment(space, rt.strategies.Random(seed=0), func_trainer,
                      store=str(tmp_path / "b.db"), weight_sharing=True)
    with pytest.raises(rt.ExperimentError, match="training function"):
        rt.Experiment(space, rt.strategies.Random(seed=0),
                      rt.FunctionTrainer(lambda m, h, s: None), store=str(tmp_path / "c.db"))


def flaky(model, hparams, session):
    if hparams["x"] == 0.6:
        raise ZeroDivisionError("the user's own bug")
    for step in range(hparams["epochs"]):
        session.save({"step": step + 1})
        session.report(step + 1, score=hparams["x"])


def silent(model, hparams, session):
    session.save({"nothing": 0})


def short(model, hparams, session):
    session.report(1, score=1.0)


def test_a_function_that_raises_fails_its_trial_alone_with_its_traceback(tmp_path):
    db = tmp_path / "flaky.db"
    trainer = rt.FunctionTrainer(flaky, epochs=2, x=rt.ValueChoice([0.0, 0.6, 0.3], label="x"))
    rt.Experiment(None, rt.strategies.GridSearch(), trainer, store=str(db),
                  executor=InProcessExecutor(), metric="score").run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = {t["spec"]["hparams"]["x"]: t for t in store.trials()}
    assert trials[0.0]["state"] == trials[0.3]["state"] == "TERMINATED"
    bad = trials[0.6]
    assert bad["state"] == "ERRORED"
    assert "ZeroDivisionError: the user's own bug" in bad["error"]
    assert "test_function_trainer.py" in bad["error"] and "in flaky" in bad["error"]


@pytest.mark.parametrize("function, message, in_segments", [
    (silent, r"returned without calling session.report\(step, \*\*metrics\)",
     "returned without calling session.report"),
    # in one-step segments its second segment replays step 1 from scratch and returns
    (short, r"returned after step 1, but the engine trains this trial to step 3",
     "returned after replaying to step 1, short of step 2: start the loop from the position"),
])
def test_a_function_that_does_not_report_gets_a_clear_error(tmp_path, function, message,
                                                            in_segments):
    trainer = rt.FunctionTrainer(function, epochs=3)
    run = FunctionRun(None, trainer, stop_step=3)
    with pytest.raises(TrainingError, match=message):
        while run.step < 3:
            run.train_epoch()
    db = tmp_path / "e.db"  # through the engine: that trial fails, with the same words
    with pytest.raises(rt.SearchFailed, match="all 1 models failed"):  # the only one
        rt.Experiment(None, rt.strategies.Random(seed=0), trainer, store=str(db),
                      metric="score", executor=InProcessExecutor(), max_models=1).run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        (trial,) = store.trials()
    assert trial["state"] == "ERRORED" and in_segments in trial["error"]


def _misuse(kind):
    def function(model, hparams, session):
        if kind == "skip":
            session.report(2, score=1.0)
        elif kind == "step":
            session.report(1.0, score=1.0)
        elif kind == "metric":
            session.report(1, score="high")
        elif kind == "none":
            session.report(1)
        elif kind == "again":
            session.report(1, score=1.0)
            session.report(1, score=1.0)
        elif kind == "save":
            session.save({"model": torch.nn.Linear(2, 2)})
    return function


@pytest.mark.parametrize("kind, error, message", [
    ("skip", ValueError, r"skips steps: trial trial is at step 0, so the next report is step 1"),
    ("step", TypeError, r"an int >= 1"),
    ("metric", TypeError, r"score='high'.*a metric is a number"),
    ("none", ValueError, r"gave no metric"),
    ("again", ValueError, r"report each step once, in order"),
    ("save", TypeError, r"state\['model'\] is a torch.nn.modules.linear.Linear.*state_dict"),
])
def test_misuse_of_the_session_names_the_fix(kind, error, message):
    run = FunctionRun(None, rt.FunctionTrainer(_misuse(kind), epochs=3), stop_step=3)
    with pytest.raises(error, match=message):
        while run.step < 3:
            run.train_epoch()


def test_a_cancelled_segment_ends_its_parked_function():
    run = FunctionRun(None, rt.FunctionTrainer(sparse, epochs=5), stop_step=5)
    run.train_epoch()
    thread = run._thread
    assert thread.is_alive()  # parked in report, waiting for the next step
    del run  # the job was cancelled: the worker drops the run
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_trainer_spec_round_trips_and_checks_its_settings():
    spec = func_trainer.to_spec()
    assert spec["config"]["train"] == "func_space:train" and spec["config"]["lr"] == LRS[0]
    rebuilt = rt.FunctionTrainer(**spec["config"])
    assert rebuilt.function is train and rebuilt.defaults() == func_trainer.defaults()
    with pytest.raises(TypeError, match="setting data=.* is not JSON"):
        rt.FunctionTrainer(train, data=torch.zeros(2)).to_spec()
    with pytest.raises(TypeError, match="epochs"):
        rt.FunctionTrainer(train, epochs=0)
    with pytest.raises(TypeError, match="no per-batch hooks"):
        func_trainer.train_dataloader({}, 0)


# ---- processes: a killed driver, a lost worker, the CLI, Ray -------------------------------


def _events(db) -> int:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_driver_sigkilled_mid_trial_then_resumed_equals_uninterrupted(tmp_path):
    whole = _search(tmp_path / "whole.db", func_trainer, SCHEDULERS["asha"](), models=4)
    db = tmp_path / "killed.db"
    driver = [sys.executable, str(HERE / "func_driver.py"), str(db)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    for mode, results in (("run", 3), ("resume", 7)):  # killed mid-search, twice
        proc = subprocess.Popen(driver + [mode], env=env, stderr=subprocess.PIPE,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and _events(db) < results and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = subprocess.run(driver + ["resume"], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert _trials(db) == whole


@pytest.mark.slow
def test_a_worker_killed_mid_trial_resumes_from_the_last_save(tmp_path):
    whole = _search(tmp_path / "whole.db", func_trainer, models=2)
    marker = tmp_path / "crashed"
    crashing = rt.FunctionTrainer(train, epochs=4, lr=rt.ValueChoice(LRS, label="lr"),
                                  crash_at=3, crash_marker=str(marker))
    got = _search(tmp_path / "lost.db", crashing, models=2, executor="local", workers=1)
    assert marker.exists()  # the worker really died at step 3, before saving it
    with Store(tmp_path / "lost.db") as store:
        store.use_experiment(store.experiments()[-1]["id"])
        reasons = " ".join(str(e["reason"]) for e in store.events())
    assert "worker lost" in reasons or "lost" in reasons
    assert got == whole


@pytest.mark.slow
def test_cli_run_status_plot_export_resume_model_free(tmp_path):
    script = tmp_path / "tune_me.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from func_space import tuner as trainer\n")
    cli = [sys.executable, "-m", "retiarii.cli"]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    db = tmp_path / "tune.db"
    run = subprocess.run(cli + ["run", str(script), "--strategy", "grid", "--scheduler", "asha",
                                "--metric", "score",
                                "--max-models", "4", "--workers", "1", "--store", str(db)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    status = subprocess.run(cli + ["status", str(db)], capture_output=True, text=True, env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("cross-model optimization") == 1
    assert "does not apply (a FunctionTrainer" in status.stdout
    as_json = json.loads(subprocess.run(cli + ["status", str(db), "--json"],
                                        capture_output=True, text=True, env=env).stdout)
    assert as_json["trials"]["TERMINATED"] == 4 and as_json["trials"]["ERRORED"] == 0
    plot = subprocess.run(cli + ["plot", str(db), "--out", str(tmp_path / "p.png")],
                          capture_output=True, text=True, env=env)
    assert plot.returncode == 0 and (tmp_path / "p.png").exists(), plot.stderr
    export = subprocess.run(cli + ["export", str(db), "--top", "1", "--out", str(tmp_path / "x")],
                            capture_output=True, text=True, env=env)
    assert export.returncode == 0, export.stderr
    chosen = json.loads(next((tmp_path / "x").glob("*.json")).read_text())["sample"]
    assert set(chosen) == {"x", "y"}
    more = subprocess.run(cli + ["resume", str(db), "--max-models", "6"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert more.returncode == 0, more.stderr[-3000:]
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert len(store.trials()) == 6


@pytest.mark.slow
def test_ray_executor_runs_function_trials_like_the_local_one(tmp_path):
    pytest.importorskip("ray", reason="the Ray executor needs ray installed")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    whole = _search(tmp_path / "whole.db", func_trainer, SCHEDULERS["asha"](), models=3)
    got = _search(tmp_path / "ray.db", func_trainer, SCHEDULERS["asha"](), models=3,
                  executor="ray", workers=1)
    assert got == whole


# ---- docs/function_trainer.md: its examples run, and resume bit for bit ---------------------


def _doc_example(name, folder):
    """The docs page's block that starts with `# docs example: NAME`, loaded as a module file
    (as `retiarii run` and the workers load one)."""
    from retiarii.refs import load_file_module

    text = (HERE.parent / "docs" / "function_trainer.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (code,) = [b for b in blocks if b.startswith(f"# docs example: {name}\n")]
    path = folder / f"doc_{name}.py"
    path.write_text(code)
    return str(path), load_file_module(str(path))


@pytest.mark.parametrize("name", ["plain", "lightning"])
def test_docs_examples_search_and_resume_bit_for_bit(tmp_path, name):
    path, module = _doc_example(name, tmp_path)
    space_ref = f"{path}:space" if hasattr(module, "space") else None
    hparams = {k: v.values[-1] for k, v in module.trainer.value_choices().items()}
    build = None
    if space_ref is not None:
        sample = module.space.default_sample()
        build = lambda: module.space.build(sample)  # noqa: E731

    def segments(cuts):
        out, ckpt = [], None
        for stop in cuts:
            run = FunctionRun(build, module.trainer, hparams, stop_step=stop, checkpoint=ckpt,
                              seed=5)
            while run.step < stop:
                out.append(run.train_epoch())
            ckpt = str(tmp_path / f"{name}-{stop}")
            run.save(ckpt)
        return out

    whole = segments([4])
    assert len(whole) == 4 and segments([1, 2, 3, 4]) == whole == segments([2, 4])
    db = tmp_path / f"{name}.db"
    summary = rt.Experiment(space_ref, rt.strategies.GridSearch(), module.trainer, store=str(db),
                            executor=InProcessExecutor(), max_models=4, seed=0,
                            scheduler=SCHEDULERS["asha"]()).run()
    assert summary["trials"]["TERMINATED"] == 4 and summary["best"][0]["value"] > 0.5
