"""The engine end to end: real worker processes on digits, the store, kills and resumes."""
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
from exp_driver import experiment
from exp_space import failing_space, space, trainer
from retiarii.engine.storage.store import Store

HERE = Path(__file__).resolve().parent
FINAL = {"TERMINATED", "ERRORED"}


def _trained(store_path):
    """(sample, {step: val_acc}) of every model of the latest experiment, in creation order."""
    with Store(store_path) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        out = []
        for trial in store.trials():
            curve = dict(store.learning_curve(trial["id"], "val_acc"))
            out.append((trial["spec"]["choices"], curve, trial["state"]))
        return out


def _invariants(store_path, max_models, epochs=2):
    with Store(store_path) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials, models = store.trials(), store.models()
        assert all(t["state"] in FINAL for t in trials), [t["state"] for t in trials]
        assert len(models) == max_models
        # the same structure may come back with other hyper-parameters, never with the same
        keys = [(m["hash"], m["sample"].get("lr")) for m in models]
        assert len(set(keys)) == len(keys), "a model was trained twice"
        per_model = {}
        for t in trials:
            per_model.setdefault(t["model_id"], []).append(t)
        assert all(len(ts) == 1 for ts in per_model.values()), "a model got a second trial"
        for t in trials:
            if t["state"] == "TERMINATED":
                steps = [s for s, _ in store.learning_curve(t["id"], "val_acc")]
                assert steps == list(range(1, epochs + 1)), (t["id"], steps)  # continuous
        events = store.events()
        assert all(e["new_state"] for e in events)
        return trials, models


def test_experiment_end_to_end_on_digits(tmp_path):
    db = tmp_path / "e2e.db"
    summary = experiment(str(db), max_models=5, workers=2).run()
    trials, models = _invariants(db, 5)
    assert summary["models"] == 5 and summary["trials"]["TERMINATED"] == 5
    assert all(m["status"] == "trained" for m in models)
    assert 0.3 < summary["best"][0]["value"] <= 1.0  # digits learns something in 2 epochs
    samples = [json.dumps(m["sample"], sort_keys=True) for m in models]
    assert len(set(samples)) == 5
    with Store(db) as store:  # every transition journaled, in lifecycle order
        states = [e["new_state"] for e in store.events(trials[0]["id"])]
    assert states == ["PENDING", "RUNNING", "TERMINATED"]


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole.db"
    experiment(str(whole), max_models=4, workers=1).run()
    parts = tmp_path / "parts.db"
    experiment(str(parts), max_models=2, workers=1).run()
    experiment(str(parts), max_models=4, workers=1).resume()  # a new object, as after a crash
    a, b = _trained(whole), _trained(parts)
    assert [s for s, _, _ in a] == [s for s, _, _ in b]  # the same models, in the same order
    assert [c for _, c, _ in a] == [c for _, c, _ in b]  # the same metrics, bit for bit


def _events(db) -> int:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT count(*) FROM events").fetchone()[0]
    except sqlite3.Error:
        return 0  # not created yet


def test_driver_sigkilled_at_many_moments_then_resumed(tmp_path):
    db = tmp_path / "killed.db"
    driver = [sys.executable, str(HERE / "exp_driver.py"), str(db)]
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    # Kill points are progress marks: the driver is killed once it has journaled `step` more
    # transitions than there were when it started (right after a trial is added or starts,
    # while trials run, as they end and the next ones start).
    kills, ends = 0, []
    for i, step in enumerate([1, 3, 5, 2, 4, 6]):
        mode = "run" if i == 0 else "resume"
        start = _events(db)
        proc = subprocess.Popen(driver + [mode, "6", "2"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and _events(db) < start + step and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and its workers, at once
            kills += 1
        proc.wait()
        err = proc.stderr.read().decode()
        ends.append((mode, step, proc.returncode, err[-1500:]))
        assert proc.returncode in (0, -signal.SIGKILL), ends[-1]  # killed, or finished cleanly
    assert kills >= 5, ends
    done = subprocess.run(driver + ["resume", "6", "2"], env=env, capture_output=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    _invariants(db, 6)
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert store.get_experiment()["status"] == "done"
        reasons = [e["reason"] for e in store.events()]
    assert "driver restarted" in reasons  # RUNNING trials were requeued, not lost


def test_a_model_that_always_fails_fails_alone(tmp_path):
    db = tmp_path / "failing.db"
    exp = rt.Experiment(failing_space, rt.strategies.Random(seed=0), trainer, store=str(db),
                        workers=2, max_models=6, seed=0, max_failures=1)
    summary = exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
        failed = [t for t in trials if t["state"] == "ERRORED"]
        ok = [t for t in trials if t["state"] == "TERMINATED"]
        assert failed and ok and len(failed) + len(ok) == 6
        assert all(t["spec"]["choices"]["act"] == "nan" for t in failed)
        assert all(t["spec"]["choices"]["act"] != "nan" for t in ok)
        assert all("loss is nan" in (t["error"] or "") for t in failed)
        # a NaN loss is the model's own, deterministic failure: not retried (max_failures
        # is for the environment's), and said so
        assert all(t["attempts"] == 1 for t in failed)
        assert all(t["error"].startswith("model error: ") for t in failed)
        assert {m["status"] for m in store.models() if m["sample"]["act"] == "nan"} == {"failed"}
    assert summary["trials"]["ERRORED"] == len(failed)


def test_resuming_with_another_config_is_refused(tmp_path):
    db = tmp_path / "cfg.db"
    experiment(str(db), max_models=1, workers=1).run()
    other = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db),
                          workers=1, max_models=2, seed=1)
    with pytest.raises(rt.ExperimentError, match=r"differs from the stored one in \['seed'\]"):
        other.resume()


def test_cli_run_status_plot_export_round_trip(tmp_path):
    from retiarii.cli import main

    db, out = tmp_path / "cli.db", tmp_path / "best"
    space_file = HERE / "exp_space.py"
    assert main(["run", str(space_file), "--strategy", "random", "--max-models", "3",
                 "--workers", "2", "--store", str(db)]) == 0
    assert main(["status", str(db), "--json"]) == 0
    assert main(["plot", str(db), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert main(["export", str(db), "--top", "2", "--out", str(out)]) == 0
    exported = sorted(out.glob("model_*.py"))
    assert len(exported) == 2
    x = torch.randn(4, 1, 8, 8)
    torch.save(x, tmp_path / "x.pt")
    for py in exported:
        info = json.loads(py.with_suffix(".json").read_text())
        # the reference: the space's own model of that sample with the exported weights
        from retiarii.refs import resolve_ref

        ref_space = resolve_ref(f"{space_file}:space")
        arch = {k: v for k, v in info["sample"].items() if k != "lr"}  # lr: a trainer choice
        ref = ref_space.build(arch)
        ref.load_state_dict(torch.load(py.with_suffix(".pt"), weights_only=True))
        ref.eval()
        script = (f"import torch, importlib.util, sys\n"
                  f"class Block:\n"
                  f"    def find_spec(self, name, path=None, target=None):\n"
                  f"        if name.split('.')[0] == 'retiarii':\n"
                  f"            raise ImportError('retiarii is not installed here')\n"
                  f"sys.meta_path.insert(0, Block())\n"
                  f"try:\n    import retiarii\n    sys.exit('retiarii importable')\n"
                  f"except ImportError:\n    pass\n"
                  f"torch.set_num_threads(1)\n"
                  f"spec = importlib.util.spec_from_file_location('m', {str(py)!r})\n"
                  f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                  f"cls = [v for k, v in vars(m).items() if k.startswith('Model')][0]\n"
                  f"net = cls(); net.load_state_dict(torch.load({str(py.with_suffix('.pt'))!r}))\n"
                  f"net.eval()\n"
                  f"torch.save(net(torch.load({str(tmp_path / 'x.pt')!r})), "
                  f"{str(tmp_path / 'y.pt')!r})\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True,
                             text=True, timeout=120, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        with torch.no_grad():
            assert torch.equal(torch.load(tmp_path / "y.pt"), ref(x))


def test_pbt_runs_inside_an_experiment_with_lineage_and_gc(tmp_path):
    db = tmp_path / "pbt.db"
    pbt = rt.strategies.PBT("val_acc", "max", {"lr": rt.strategies.Continuous(0.003, 0.3)},
                            population_size=2, steps_per_trial=1, max_generations=3, seed=0)
    fixed = rt.Trainer(dataset="digits", epochs=3, batch_size=128)
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), fixed, store=str(db), workers=2,
                        seed=0, scheduler=pbt)
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = {t["id"]: t for t in store.trials()}
        assert len(trials) == 2 + 2 * 2  # generation 0, then two children per generation
        assert all(t["state"] == "TERMINATED" for t in trials.values())
        for t in trials.values():
            steps = [s for s, _ in store.learning_curve(t["id"], "val_acc")]
            if t["parent"] is None:
                assert steps == [1]
                continue
            parent = trials[t["parent"]]
            # a child trains the parent's architecture from the parent's last step, with new
            # hparams: a model of its own, derived from the parent's (models.parent)
            child_model = store.get_model(t["model_id"])
            parent_model = store.get_model(parent["model_id"])
            assert t["model_id"] != parent["model_id"]
            assert child_model["parent"] == parent_model["id"]
            assert child_model["hash"] == parent_model["hash"]
            assert child_model["status"] == "trained"
            assert steps == [max(s for s, _ in store.learning_curve(parent["id"], "val_acc")) + 1]
            lr, parent_lr = t["spec"]["hparams"]["lr"], parent["spec"]["hparams"]["lr"]
            assert any(lr == pytest.approx(min(0.3, max(0.003, parent_lr * f)))
                       for f in (0.8, 1.2))  # the paper's perturbation, clipped
            assert t["spec"]["sample"] == parent["spec"]["sample"]
        kept = {(c["trial_id"], c["step"]): c["path"] for t in trials
                for c in store.checkpoints(t)}
    # garbage collection kept what PBT can still need and deleted the rest from disk and store
    for path in kept.values():
        assert os.path.exists(path)
    on_disk = {str(p) for p in Path(str(db).replace(".db", ".checkpoints")).rglob("step-*")}
    assert on_disk == set(kept.values())
    best = pbt.best_trial()
    lineage = pbt.lineage(best)
    assert lineage[-1]["trial_id"] == best and lineage[0]["parent"] is None


@pytest.mark.parametrize("strategy, replays", [(rt.strategies.Random(seed=3), 0),
                                                (rt.strategies.TPE(seed=3, n_startup=2), 0),
                                                (rt.strategies.GridSearch(), 4)])
def test_the_driver_checks_the_model_the_strategy_drew_instead_of_rebuilding_it(
        tmp_path, monkeypatch, strategy, replays):
    """A drawing strategy's model is shape-checked as drawn; one that proposes without drawing
    (grid search enumerates) is instantiated from its sample. Either way the store holds each
    sample's own graph."""
    instantiated = []
    original = rt.ModelSpace.instantiate
    monkeypatch.setattr(rt.ModelSpace, "instantiate",
                        lambda self, sample: (instantiated.append(sample), original(self, sample))[1])
    exp = rt.Experiment(space, strategy, rt.Trainer(dataset="digits", epochs=1, batch_size=512),
                        store=str(tmp_path / "x.db"), executor=InProcessExecutor())
    exp.run(max_models=4)
    assert len(instantiated) == replays
    with Store(tmp_path / "x.db") as store:
        store.use_experiment(store.experiments()[-1]["id"])
        models = store.models()
    assert len(models) == 4 and all(m["status"] == "trained" for m in models)
    for m in models:
        assert m["hash"] == original(space, m["sample"]).structural_hash()


def test_a_non_finite_final_metric_fails_the_model_and_the_strategy_hears_it(tmp_path, caplog):
    """Issue #11.8: a NaN or inf final value is logged and its model marked failed (the strategy
    told None), never left pending in the strategy."""
    from retiarii.engine.executors.simulated import SimulatedExecutor

    def curve(spec, step):
        choices = spec["choices"]
        if choices["act"] == "tanh":
            return {"val_acc": float("nan") if choices["hidden"] == 16 else float("inf")}
        return {"val_acc": 0.5 + choices["hidden"] / 1000 + choices["lr"]}

    strategy = rt.strategies.Random(seed=0)
    exp = rt.Experiment(space, strategy, trainer, store=str(tmp_path / "nan.db"),
                        executor=SimulatedExecutor(2, curve))
    with caplog.at_level("WARNING", logger="retiarii.engine"):
        exp.run(max_models=12)
    with Store(tmp_path / "nan.db") as store:
        store.use_experiment(store.experiments()[-1]["id"])
        models = store.models()
    assert len(models) == 12
    for m in models:
        bad = m["sample"]["act"] == "tanh"
        assert (m["status"], m["value"] is None) == (("failed", True) if bad else ("trained", False))
    log = strategy.state_dict()["log"]
    assert sum(e[0] == "ask" for e in log) == sum(e[0] == "tell" for e in log) == 12
    assert sorted(e[2] is None for e in log if e[0] == "tell") == [False] * 6 + [True] * 6
    assert sum("not a finite number" in r.getMessage() for r in caplog.records) == 6
    assert strategy.best()[1] == pytest.approx(0.5 + 0.032 + 0.1)


def test_a_trainer_says_how_workers_rebuild_it():
    """Issue #11.8: Trainer.to_spec() and value_choices(), no special case in the engine."""
    from retiarii.engine.driver.experiment import trainer_spec

    spec, choices = trainer_spec(trainer)
    assert spec["class"] == "retiarii.engine.trainers.trainer:ClassifierTrainer"
    assert spec["config"]["lr"] == 0.01 and set(choices) == {"lr"}  # the choice's default

    class Described(rt.Trainer):  # local: no import reference reaches it, its spec does
        def to_spec(self):
            return {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer", "config": {"lr": 0.5}}

    assert trainer_spec(Described()) == ({"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
                                         "config": {"lr": 0.5}}, {})
    with pytest.raises(rt.ExperimentError, match="module-level"):
        trainer_spec(rt.Trainer(dataset=(torch.zeros(4, 1, 8, 8), torch.zeros(4).long())))


class _Scores(rt.strategies.GridSearch):
    """Grid search that records what the experiment tells it, per sample."""

    def __init__(self):
        super().__init__()
        self.told: dict[str, float | None] = {}

    def tell(self, sample, score, *args, **kwargs):
        self.told[json.dumps(sample, sort_keys=True)] = score
        return super().tell(sample, score, *args, **kwargs)


def test_a_trainer_choice_labelled_otherwise_than_its_setting_is_not_a_duplicate(tmp_path):
    # Found by a search written as a new user does: batch_size=ValueChoice(..., label="bs").
    # The dedup key read the sample by the setting's name, not by the choice's label, so every
    # batch size of one architecture was "the same model": the search stopped at one model
    # per architecture and told the strategy one model's score for the others.
    labelled = rt.Trainer(dataset="digits", epochs=1, batch_size=rt.ValueChoice(
        [64, 128], label="bs"), lr=rt.ValueChoice([0.01, 0.03], label="rate"))
    strategy = _Scores()
    db = tmp_path / "labels.db"
    summary = rt.Experiment(space, strategy, labelled, store=str(db),
                            executor=InProcessExecutor(), seed=0).run()
    assert summary["models"] == 16  # 4 architectures x 2 batch sizes x 2 learning rates
    with Store(str(db)) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
        assert len({json.dumps(t["spec"]["choices"], sort_keys=True) for t in trials}) == 16
        assert {(t["spec"]["hparams"]["batch_size"], t["spec"]["hparams"]["lr"])
                for t in trials} == {(64, 0.01), (64, 0.03), (128, 0.01), (128, 0.03)}
        # each sample's own score reached the strategy: its trial's last val_acc
        for t in trials:
            own = store.learning_curve(t["id"], "val_acc")[-1][1]
            assert strategy.told[json.dumps(t["spec"]["choices"], sort_keys=True)] == own
