"""Cross-model optimization in the engine: the runner packs trials that read the same batches
into grouped jobs, plans them again at every segment, reverts groups measured slower than
their models apart, reruns the models of a failed group alone, and records every group in the
plans table. The reference throughout: the same search with ``optimize=False``. Fusion and
batching are off here (``fuse=False, batching=False``: no layout to choose, so the measured
revert is all that decides); fused searches are in test_fused_jobs.py, chosen layouts in
test_layouts.py."""
from __future__ import annotations

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import failing_space, space
from retiarii.engine.jobs.job import FailureKind, JobFailed, JobFinished, JobProfiled, JobStarted
from retiarii.engine.jobs.reports import UnitReport
from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.engine.runner.trial_runner import TrialRunner, TrialState
from retiarii.optim.cost import merged_speedup, slower_than_apart
from retiarii.strategies import Scheduler
from retiarii.strategies.schedulers.base import Decision
from retiarii.engine.runner.planner import JobPlanner

TRAINER = rt.Trainer(dataset="digits", epochs=3, batch_size=256,
                     lr=rt.ValueChoice([0.01, 0.03, 0.1], label="lr"))


class Recording(InProcessExecutor):
    """InProcessExecutor that keeps every job it was given (tasks per job, meta)."""

    def __init__(self):
        super().__init__()
        self.submitted = []

    def submit(self, job):
        self.submitted.append(job)
        super().submit(job)


def _run(tmp_path, name, executor=None, **kwargs):
    db = tmp_path / f"{name}.db"
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), kwargs.pop("trainer", TRAINER),
                        store=str(db), executor=executor or Recording(), seed=0,
                        **{"max_models": 6, "fuse": False, "batching": False, **kwargs})
    exp.run()
    return db, exp


def _curves(db) -> dict[str, list]:
    """Every model's metrics at every step, keyed by its sample (the same in both runs)."""
    import json

    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        out = {}
        for t in store.trials():
            metrics = {}
            for name in ("train_loss", "val_loss", "val_acc"):
                metrics[name] = store.learning_curve(t["id"], name)
            out[json.dumps(t["spec"]["choices"], sort_keys=True)] = (t["state"], metrics)
        return out


def _plans(db) -> list[dict]:
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return PlanTable(store).rows()


# ---- the cost model (hand-computed) ------------------------------------------------------------


def test_merged_speedup_is_separate_time_over_merged_time():
    unit = {"trials": ["a", "b", "c"], "merged": True, "batches": 4, "load_s": 2.0, "compute_s": 1.2}
    # per batch: load 0.5, merged compute 0.3 -> merged 0.8; apart 0.2 + 0.3 + 0.1 + 3 * 0.5 = 2.1
    assert merged_speedup(unit, {"a": 0.2, "b": 0.3, "c": 0.1}) == pytest.approx(2.1 / 0.8)
    # a compute-bound group whose models are cheap apart: slower merged
    unit = {"trials": ["a", "b"], "merged": True, "batches": 10, "load_s": 0.0, "compute_s": 5.0}
    assert merged_speedup(unit, {"a": 0.1, "b": 0.1}) == pytest.approx(0.4)
    assert slower_than_apart(0.4) and not slower_than_apart(1.2) and not slower_than_apart(None)
    assert slower_than_apart(1.05)  # within the margin for what the estimate leaves out
    # planning and building the group is paid once per segment: a short one is not worth it
    unit = {"trials": ["a", "b"], "merged": True, "batches": 2, "load_s": 0.2, "compute_s": 0.2,
            "setup_s": 1.0}
    # apart 2 * (0.1 + 0.1) + 2 * 0.2 = 0.8; merged 1.0 + 0.2 + 0.2 = 1.4
    assert merged_speedup(unit, {"a": 0.1, "b": 0.1}) == pytest.approx(0.8 / 1.4)
    # nothing measured, a model never profiled, a unit not merged: unknown, never reverted
    assert merged_speedup({**unit, "batches": 0}, {"a": 0.1, "b": 0.1}) is None
    assert merged_speedup(unit, {"a": 0.1}) is None
    assert merged_speedup({"trials": ["a"], "merged": False, "reason": "x"}, {"a": 1.0}) is None


# ---- the runner (simulated clock) --------------------------------------------------------------


def test_the_runner_packs_up_to_batch_models_per_job_and_results_are_unchanged():
    configs = [{"a": float(i + 1)} for i in range(7)]

    def run(batch_models):
        ex = SimulatedExecutor(2, curve=lambda spec, step: {"loss": spec["a"] / step})
        jobs = []
        submit = ex.submit
        ex.submit = lambda job: (jobs.append(job), submit(job))[1]
        runner = TrialRunner(ex, Scheduler(), max_steps=3, planner=JobPlanner(
            batch_models=batch_models, group_key=lambda trial: "same data"))
        for c in configs:
            runner.add_trial(c)
        assert runner.run()
        return runner, jobs

    alone, alone_jobs = run(1)
    grouped, grouped_jobs = run(3)
    assert all(len(j.tasks) == 1 and "group" not in j.meta for j in alone_jobs)
    sizes = [len(j.tasks) for j in grouped_jobs]
    assert max(sizes) == 3 and all(j.meta.get("group") for j in grouped_jobs if len(j.tasks) > 1)
    # every trial trained all its steps, and its results are those of training it alone
    assert {t: (tr.state, tr.step, tr.last_result["loss"]) for t, tr in grouped.trials.items()} == \
        {t: (tr.state, tr.step, tr.last_result["loss"]) for t, tr in alone.trials.items()}
    # the trials of one group start together and continue together, segment after segment
    first = grouped_jobs[0]
    members = [t.trial_id for t in first.tasks]
    assert [[t.trial_id for t in j.tasks] for j in grouped_jobs
            if j.tasks[0].trial_id == members[0]] == [members] * 3


def test_the_group_key_and_the_start_step_decide_who_trains_together():
    ex = SimulatedExecutor(1, curve=lambda spec, step: {"loss": spec["a"] / step})
    jobs = []
    submit = ex.submit
    ex.submit = lambda job: (jobs.append(job), submit(job))[1]
    runner = TrialRunner(ex, Scheduler(), max_steps=2, planner=JobPlanner(
        batch_models=8, group_key=lambda t: t.config.get("data")))
    for i, data in enumerate(["x", "y", "x", None, "y", "x"]):
        runner.add_trial({"a": float(i + 1), "data": data})
    assert runner.run()
    groups = {tuple(t.config["data"] for t in (runner.trials[k.trial_id] for k in j.tasks))
              for j in jobs}
    assert groups == {("x", "x", "x"), ("y", "y"), (None,)}


# ---- the experiment ------------------------------------------------------------------------------


def test_an_optimized_search_trains_the_same_models_to_the_same_results(tmp_path):
    off_db, _ = _run(tmp_path, "off", optimize=False)
    ex = Recording()
    on_db, exp = _run(tmp_path, "on", executor=ex, optimize=True)
    assert _curves(on_db) == _curves(off_db)  # bit for bit on CPU, every step of every model
    assert max(len(j.tasks) for j in ex.submitted) == 6  # one job trained all six at once
    rows = _plans(on_db)
    assert rows and all(r["status"] == "merged" for r in rows)
    assert {t for r in rows for t in r["trials"]} == set(exp.runner.trials)
    assert exp.summary()["optimization"]["merged_trials"] == 6


class StopTheSecond(Scheduler):
    """Stops the second trial after its first step; every other continues."""

    def on_trial_result(self, trial_id, result):
        stop = trial_id.endswith("trial-0002") and result["training_iteration"] == 1
        return Decision.STOP if stop else Decision.CONTINUE


def test_a_scheduler_stops_one_model_of_a_group_and_the_others_train_on_unchanged(tmp_path):
    off_db, _ = _run(tmp_path, "off", optimize=False, scheduler=StopTheSecond(), max_models=4)
    ex = Recording()
    on_db, _ = _run(tmp_path, "on", executor=ex, optimize=True, scheduler=StopTheSecond(),
                    max_models=4)
    curves = _curves(on_db)
    assert curves == _curves(off_db)
    assert sorted(len(c[1]["val_acc"]) for c in curves.values()) == [1, 3, 3, 3]
    # after the stop, the three others continue as one group of three
    assert [len(j.tasks) for j in ex.submitted] == [4, 3, 3]


class PauseTheSecondOnce(Scheduler):
    """Pauses the second trial after its first step, once; it resumes when a slot is free."""

    def __init__(self):
        self.paused = False

    def on_trial_result(self, trial_id, result):
        if trial_id.endswith("trial-0002") and not self.paused:
            self.paused = True
            return Decision.PAUSE
        return Decision.CONTINUE


def test_a_trial_paused_out_of_its_group_resumes_alone_as_if_never_paused(tmp_path):
    plain_db, _ = _run(tmp_path, "plain", optimize=False, max_models=4)
    ex = Recording()
    db, exp = _run(tmp_path, "paused", executor=ex, optimize=True, scheduler=PauseTheSecondOnce(),
                   max_models=4)
    assert _curves(db) == _curves(plain_db)  # its trajectory, and the others', unchanged
    second = next(t for t in exp.runner.trials if t.endswith("trial-0002"))
    # planned again at the segment's end: FIFO resumes the paused trial at once, and at the
    # same step as the others it rejoins them, from its own checkpoint
    assert [len(j.tasks) for j in ex.submitted] == [4, 4, 4]
    task = next(t for t in ex.submitted[1].tasks if t.trial_id == second)
    assert task.start_step == 1 and task.checkpoint_in.endswith("step-000001")
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        moves = [(e["old_state"], e["new_state"]) for e in store.events(second)]
    assert ("RUNNING", "PAUSED") in moves and ("PAUSED", "RUNNING") in moves


class PauseTheSecondUntilTheOthersEnd(PauseTheSecondOnce):
    """Also keeps the paused trial waiting until the three others have ended."""

    def __init__(self):
        super().__init__()
        self.ended = 0

    def on_trial_complete(self, trial_id, result):
        self.ended += 1

    def choose_trial_to_run(self, candidates):
        ready = [c for c in candidates if not c.endswith("trial-0002") or self.ended >= 3]
        return ready[0] if ready else None


def test_a_trial_paused_out_of_its_group_resumes_alone_later_as_if_never_paused(tmp_path):
    plain_db, _ = _run(tmp_path, "plain", optimize=False, max_models=4)
    ex = Recording()
    db, exp = _run(tmp_path, "paused", executor=ex, optimize=True, max_models=4,
                   scheduler=PauseTheSecondUntilTheOthersEnd())
    assert _curves(db) == _curves(plain_db)
    second = next(t for t in exp.runner.trials if t.endswith("trial-0002"))
    assert [len(j.tasks) for j in ex.submitted] == [4, 3, 3, 1, 1]
    assert [(t.trial_id, t.start_step) for j in ex.submitted[3:] for t in j.tasks] == \
        [(second, 1), (second, 2)]


def test_a_model_failing_in_a_group_fails_alone_and_its_group_runs_on(tmp_path):
    db = tmp_path / "f.db"
    exp = rt.Experiment(failing_space, rt.strategies.Random(seed=1), TRAINER, store=str(db),
                        executor=Recording(), max_models=6, optimize=True, fuse=False)
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = store.trials()
    failed = [t for t in trials if t["state"] == "ERRORED"]
    assert failed and all(t["spec"]["choices"]["act"] == "nan" for t in failed)
    assert all(t["attempts"] == 1 for t in failed)  # attributed by the worker: not rerun
    assert all(t["state"] == "TERMINATED" and t["step"] == 3 for t in trials if t not in failed)
    assert all(r["status"] == "merged" for r in _plans(db))  # the others were not sent alone


class FailsGroups(Recording):
    """Every grouped job fails as a group (what running out of memory in the joint backward
    looks like to the runner); jobs of one task run normally."""

    def next_event(self, timeout=None):
        if not self.events and self.jobs and self.jobs[0].meta.get("group"):
            job = self.jobs.pop(0)
            err = "OutOfMemoryError: CUDA out of memory (the group's joint backward)"
            self.events += [JobStarted(job.job_id, "w"), JobFailed(
                job.job_id, None, err, kind=FailureKind.ENVIRONMENT,
                failures=tuple((t.trial_id, FailureKind.ENVIRONMENT, err) for t in job.tasks))]
        return super().next_event(timeout)


def test_a_failed_group_reruns_its_models_alone_and_nothing_is_charged_to_them(tmp_path):
    off_db, _ = _run(tmp_path, "off", optimize=False, max_models=4)
    ex = FailsGroups()
    on_db, exp = _run(tmp_path, "on", executor=ex, optimize=True, max_models=4)
    assert _curves(on_db) == _curves(off_db)  # every model trained, to the same results
    assert [len(j.tasks) for j in ex.submitted] == [4] + [1] * 12  # then alone, 3 segments each
    rows = _plans(on_db)
    assert [r["status"] for r in rows] == ["failed"] and "out of memory" in rows[0]["reason"]
    assert sorted(rows[0]["alone"]) == sorted(exp.runner.trials)
    with Store(on_db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert all(t["attempts"] == 1 and t["state"] == "TERMINATED" for t in store.trials())
        reasons = [e["reason"] for e in store.events() if e["new_state"] == "ERRORED"]
    assert len(reasons) == 4 and all(r.startswith("group error:") for r in reasons)


class SaysSlower(Recording):
    """Reports every grouped job as measured at ``speedup`` of its models apart (the worker's
    own JobProfiled is replaced), and interrupts the driver after ``stop_after`` jobs."""

    def __init__(self, speedup, stop_after=None):
        super().__init__()
        self.speedup, self.stop_after, self.done = speedup, stop_after, 0

    def next_event(self, timeout=None):
        event = super().next_event(timeout)
        if isinstance(event, JobProfiled):
            trials = event.units[0].trials
            # alone 0.1 s per step each; merged per batch such that apart / merged = speedup
            merged = 0.1 * len(trials) / self.speedup
            return JobProfiled(event.job_id, (UnitReport(
                trials, merged=True, batches=1, load_s=0.0, compute_s=merged,
                alone_s={t: 0.1 for t in trials}),))
        if isinstance(event, (JobFinished, JobFailed)):
            self.done += 1
            if self.stop_after is not None and self.done >= self.stop_after:
                raise KeyboardInterrupt
        return event


def test_a_group_measured_slower_is_reverted_and_stays_apart_after_a_resume(tmp_path):
    off_db, _ = _run(tmp_path, "off", optimize=False, max_models=4)
    ex = SaysSlower(0.5, stop_after=2)  # the group's first segment, then one alone segment
    db = tmp_path / "auto.db"

    def exp():
        return rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(db),
                             executor=ex, seed=0, max_models=4, optimize="auto", fuse=False,
                             batching=False)

    with pytest.raises(KeyboardInterrupt):
        exp().run()
    assert [len(j.tasks) for j in ex.submitted][:2] == [4, 1]
    assert ex.submitted[0].meta["group"].profile  # the group asked its models to be profiled
    rows = _plans(db)
    assert [r["status"] for r in rows] == ["reverted"] and "0.50x" in rows[0]["reason"]
    ex.submitted.clear()
    ex.stop_after, ex.done = None, 0
    exp().resume()
    assert ex.submitted and all(len(j.tasks) == 1 for j in ex.submitted)  # still apart
    assert _curves(db) == _curves(off_db)


def test_a_group_measured_faster_is_kept(tmp_path):
    ex = SaysSlower(2.0)
    db, exp = _run(tmp_path, "fast", executor=ex, optimize="auto", max_models=4)
    assert [len(j.tasks) for j in ex.submitted] == [4, 4, 4]
    rows = _plans(db)
    assert [r["status"] for r in rows] == ["merged"] * 3
    assert [r["speedup"] for r in rows] == [pytest.approx(2.0)] * 3
    # profiled once: later segments do not profile the same models again
    assert ex.submitted[0].meta["group"].profile and ex.submitted[1].meta["group"].profile == ()
    summary = exp.summary()["optimization"]
    assert summary["merged_trials"] == 4 and summary["speedup"]["median"] == pytest.approx(2.0)


def test_the_worker_measures_a_grouped_job_without_changing_what_it_trains(tmp_path):
    """A real grouped job asked to profile: its units report batches, loader and compute
    time and each model's separate step time, and the results equal an unprofiled run."""
    on_db, _ = _run(tmp_path, "auto", optimize="auto", max_models=4,
                    trainer=rt.Trainer(dataset="digits", epochs=2, batch_size=256))
    off_db, _ = _run(tmp_path, "off", optimize=False, max_models=4,
                     trainer=rt.Trainer(dataset="digits", epochs=2, batch_size=256))
    assert _curves(on_db) == _curves(off_db)
    rows = _plans(on_db)
    unit = rows[0]["units"][0]
    assert unit["merged"] and unit["batches"] > 0 and unit["compute_s"] > 0 and unit["setup_s"] > 0
    assert sorted(unit["alone_s"]) == sorted(rows[0]["trials"])
    assert rows[0]["speedup"] is not None and rows[0]["speedup"] > 0
    assert rows[0]["status"] in ("merged", "reverted")  # whichever the machine measured


def test_cli_status_summarises_the_optimization(tmp_path, capsys):
    from retiarii import cli

    db, _ = _run(tmp_path, "s", optimize=True, max_models=3)
    assert cli.main(["status", str(db)]) == 0
    out = capsys.readouterr().out
    assert "cross-model optimization: grouped jobs 3 merged; 3 trials trained merged" in out


def test_bad_optimize_arguments_are_refused():
    with pytest.raises(rt.ExperimentError, match="optimize='yes'"):
        rt.Experiment(space, rt.strategies.Random(), TRAINER, optimize="yes")
    with pytest.raises(rt.ExperimentError, match="batch_models=0"):
        rt.Experiment(space, rt.strategies.Random(), TRAINER, batch_models=0)


class NoKey(rt.Trainer):
    """A trainer that does not say what decides its batches: its trials share nothing."""

    def data_key(self, hparams):
        return None


NOKEY = NoKey(dataset="digits", epochs=1, batch_size=256)

def test_trials_that_never_group_train_as_before(tmp_path):
    ex = Recording()
    db, _ = _run(tmp_path, "nokey", executor=ex, optimize=True, max_models=3,
                 trainer=NOKEY)
    assert [len(j.tasks) for j in ex.submitted] == [1, 1, 1] and _plans(db) == []
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        assert all(t["state"] == TrialState.TERMINATED.value for t in store.trials())


class SlowFirstBatch(rt.Trainer):
    """Digits, with a loader whose first batch of each epoch takes 0.3 s longer (a data set
    read into a cache, workers starting): what every model pays once, not per batch."""

    def train_dataloader(self, hparams, epoch):
        import time

        for i, batch in enumerate(super().train_dataloader(hparams, epoch)):
            if i == 0:
                time.sleep(0.3)
            yield batch

    def data_key(self, hparams):  # the batches are digits', in digits' order: say so
        return f"slow-first/{self.value('batch_size', hparams)}/{self.value('seed', hparams)}"


SLOW_FIRST = SlowFirstBatch(dataset="digits", epochs=1, batch_size=256)


def test_a_loaders_first_batch_is_not_charged_to_every_model_apart(tmp_path):
    db, _ = _run(tmp_path, "slow", optimize="auto", max_models=4, trainer=SLOW_FIRST)
    unit = _plans(db)[0]["units"][0]
    assert unit["first_load_s"] >= 0.3
    # every batch counted at the median of the others: the 0.3 s is not in the estimate
    assert unit["load_s"] < 0.3 / 2


def test_the_batching_pass_is_opt_in_and_recorded(tmp_path):
    off_db, _ = _run(tmp_path, "off", optimize=False, max_models=3)
    db, _ = _run(tmp_path, "batching", optimize=True, batching=True, max_models=3)
    assert _curves(db) == _curves(off_db)  # exact on CPU either way
    assert all(r["passes"] == ["cse", "batching"] for r in _plans(db))
    plain, _ = _run(tmp_path, "plain", optimize=True, max_models=3)
    assert all(r["passes"] == ["cse"] for r in _plans(plain))
    with pytest.raises(rt.ExperimentError, match="batching='yes'"):
        rt.Experiment(space, rt.strategies.Random(), TRAINER, batching="yes")


def test_progress_counts_jobs_and_models(tmp_path):
    """With grouped jobs a worker trains several models at once: the progress line says jobs
    and models ("1 job, 3 models training"), not "3 running" on a machine with one worker."""
    from retiarii.cli_common import running_text

    seen = []
    _run(tmp_path, "progress", optimize=True, max_models=4, progress=seen.append)
    grouped = [s for s in seen if s["jobs"] < s["running"]]
    assert grouped, [(s["jobs"], s["running"]) for s in seen]
    # a job whose trials all ended trains nothing: never more jobs than models
    assert all(s["jobs"] <= s["running"] for s in seen), [(s["jobs"], s["running"]) for s in seen]
    assert running_text({"running": 3, "jobs": 1}) == "1 job, 3 models training"
    assert running_text({"running": 2, "jobs": 2}) == "2 models training"
    assert running_text({"running": 1}) == "1 model training"
