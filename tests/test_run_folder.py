"""A run touches only its own folder, and tells its own failures from its environment's.

Issue #10, items 3 and 5: checkpoints are recorded relative to the run's checkpoint folder, so a
copied run resumes from its own files and never reads or deletes the original's; forged rows,
``..`` trial ids and symlinks are refused; leftovers of killed writers are cleaned at resume;
an environmental failure (a read-only checkpoint folder) stops the run resumably instead of
failing models, and an unreadable newest checkpoint falls back to the one before.
"""
import hashlib
import logging
import os
import shutil

import pytest

import retiarii as rt
from exp_space import space
from retiarii.engine import EnvironmentFailure
from retiarii.engine.storage.checkpoint import CheckpointDir, CheckpointPathError
from retiarii.engine.jobs.job import Executor, JobFailed, TrialCheckpointed
from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.engine.storage.store import Store
from retiarii.engine.runner.trial_runner import MemoryJournal, Trial, TrialRunner, TrialState
from retiarii.engine.worker_side.worker import WorkerContext, run_job
from retiarii.strategies import Scheduler

TRAINER = rt.Trainer(dataset="digits", epochs=3, batch_size=512)


class InProcess(Executor):
    """One slot running each job with ``worker.run_job`` in this process; raises
    KeyboardInterrupt (Ctrl-C in the driver) once ``interrupt_after`` checkpoints were reported."""

    num_slots = 1

    def __init__(self, interrupt_after=None):
        self.jobs, self.events, self.context, self.tasks = [], [], WorkerContext(), []
        self.interrupt_after, self.checkpointed = interrupt_after, 0

    def submit(self, job):
        self.jobs.append(job)
        self.tasks.extend(job.tasks)

    def next_event(self, timeout=None):
        if self.interrupt_after is not None and self.checkpointed >= self.interrupt_after:
            raise KeyboardInterrupt
        if not self.events and self.jobs:
            run_job(self.jobs.pop(0), self.events.append, context=self.context)
        event = self.events.pop(0) if self.events else None
        self.checkpointed += isinstance(event, TrialCheckpointed)
        return event

    def cancel(self, job_id):
        self.jobs = [j for j in self.jobs if j.job_id != job_id]
        self.events = [e for e in self.events if e.job_id != job_id]
        self.events.append(JobFailed(job_id, None, "cancelled"))


def experiment(db, executor, **kwargs):
    # One trial per job (optimize=False): the scripts below interrupt and damage given trials
    # at given steps, which assumes the trials run one after the other. Grouped jobs resumed
    # from their checkpoints: tests/test_optimize.py and tests/test_crash_torture.py.
    kwargs.setdefault("optimize", False)
    return rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(db),
                         executor=executor, max_models=3, seed=0, **kwargs)


def interrupted_run(db, after=5):
    """Trial 1 finished (3 epochs, its older checkpoints collected), trial 2 interrupted after
    epoch 2 with checkpoints of steps 1 and 2."""
    exp = experiment(db, InProcess(interrupt_after=after))
    with pytest.raises(KeyboardInterrupt):
        exp.run()
    exp.store.close()  # the driver's process ends


def snapshot(folder):
    """{file: (sha256, mtime_ns)} of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def final_states(db):
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return {t["id"]: t["state"] for t in store.trials()}


@pytest.mark.parametrize("legacy", [False, True])
def test_a_copied_run_resumes_from_its_own_checkpoints_and_leaves_the_original_alone(
        tmp_path, legacy):
    a, b = tmp_path / "a", tmp_path / "b"
    interrupted_run(a / "exp.db")
    with Store(a / "exp.db") as store:
        names = [r[0] for r in store.db.execute("SELECT path FROM checkpoints")]
    assert names and not any(os.path.isabs(n) for n in names)  # recorded by name
    shutil.copytree(a, b)
    if legacy:  # what older versions wrote: absolute paths, here the original's folder
        with Store(b / "exp.db") as store:
            store.db.execute("UPDATE checkpoints SET path = ? || '/' || path",
                             [str(a / "exp.checkpoints")])
            store.db.conn.commit()
    before = snapshot(a)
    executor = InProcess()
    experiment(b / "exp.db", executor).resume()

    assert snapshot(a) == before  # not one file of the original read-written or deleted
    first = executor.tasks[0]  # the interrupted trial, continued from the copy's checkpoint
    own = str(b / "exp.checkpoints" / "e1-trial-0002" / "step-000002")
    assert (first.trial_id, first.start_step, first.checkpoint_in) == ("e1-trial-0002", 2, own)
    assert all(t.checkpoint_out.startswith(str(b / "exp.checkpoints") + os.sep)
               for t in executor.tasks)
    assert set(final_states(b / "exp.db").values()) == {"TERMINATED"}
    with Store(b / "exp.db") as store:
        store.use_experiment(1)
        for trial_id in final_states(b / "exp.db"):
            last = store.last_checkpoint(trial_id)
            assert last["path"].startswith(str(b)) and os.path.exists(last["path"])


def test_forged_checkpoint_rows_are_refused_never_read_or_deleted(tmp_path, caplog):
    db = tmp_path / "run" / "exp.db"
    interrupted_run(db)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "step-000001").write_text("also precious")
    folder = tmp_path / "run" / "exp.checkpoints"
    os.symlink(outside, folder / "link")
    with Store(db) as store:  # the interrupted trial's older checkpoint row, forged
        store.db.execute("UPDATE checkpoints SET path = ? WHERE trial_id = ? AND step = 1",
                         [str(victim), "e1-trial-0002"])
        store.db.execute("INSERT INTO checkpoints (trial_id, step, path, time) "
                         "VALUES ('e1-trial-0001', 1, '../../victim', 0), "
                         "('e1-trial-0001', 2, 'link/step-000001', 0)")
        store.db.conn.commit()
        store.use_experiment(1)
        assert [c["step"] for c in store.checkpoints("e1-trial-0001")] == [3]  # refused
    with caplog.at_level(logging.ERROR, "retiarii.engine"):
        experiment(db, InProcess()).resume()
    assert victim.read_text() == "precious"
    assert (outside / "step-000001").read_text() == "also precious"
    assert set(final_states(db).values()) == {"TERMINATED"}
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any(str(victim) in m for m in refused) and any("../../victim" in m for m in refused)
    assert any("symlink" in m for m in refused)


def test_trial_ids_cannot_climb_out_of_the_checkpoint_folder(tmp_path):
    ex = SimulatedExecutor(1, lambda spec, step: {"loss": 1.0 / step})
    runner = TrialRunner(ex, Scheduler(), max_steps=2, checkpoint_dir=str(tmp_path / "ckpt"))
    for bad in ("../evil", "a/../../evil", "..", "/abs"):
        with pytest.raises(ValueError, match="checkpoint folder"):
            runner.add_trial({}, trial_id=bad)
    # a journal (a store someone edited) naming such a trial: refused where it would write
    journal = MemoryJournal()
    runner = TrialRunner(ex, Scheduler(), journal, max_steps=2,
                         checkpoint_dir=str(tmp_path / "ckpt"))
    runner.add_trial({}, trial_id="good")
    journal._records = [(k, {**p, "trial_id": "../evil"} if p.get("trial_id") == "good" else p)
                        for k, p in journal._records]
    resumed = TrialRunner.resume(ex, Scheduler(), journal, max_steps=2, max_failures=1,
                                 checkpoint_dir=str(tmp_path / "ckpt"))
    assert not resumed.run() and "../evil" in resumed.stop_reason
    assert ex.history == []  # nothing was ever submitted, so nothing written anywhere
    with pytest.raises(CheckpointPathError):
        CheckpointDir(tmp_path).path("../x")


def test_leftovers_of_killed_writers_are_removed_at_resume_inside_the_run_only(tmp_path):
    db = tmp_path / "run" / "exp.db"
    interrupted_run(db)
    folder = tmp_path / "run" / "exp.checkpoints"
    litter = folder / "e1-trial-0002" / "step-000003.tmp-4242"
    litter.write_bytes(b"half a checkpoint")
    foreign = tmp_path / "elsewhere"
    foreign.mkdir()
    (foreign / "x.tmp-1").write_bytes(b"not ours")
    (tmp_path / "run" / "notes.tmp-7").write_bytes(b"not in the checkpoint folder")
    os.symlink(foreign, folder / "link")
    experiment(db, InProcess()).resume()
    assert not litter.exists()
    assert (foreign / "x.tmp-1").exists() and (tmp_path / "run" / "notes.tmp-7").exists()
    assert not [p for p in folder.rglob("*.tmp-*") if "link" not in p.parts]


def _break_folder(folder):
    """Make the checkpoint folder unwritable for real: read-only, or (root ignores modes) a
    plain file where the folder should be."""
    if os.geteuid() != 0:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o500)
        return lambda: folder.chmod(0o700)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("not a folder")
    return folder.unlink


def test_an_unwritable_checkpoint_folder_stops_the_run_resumably(tmp_path):
    db = tmp_path / "run" / "exp.db"
    fix = _break_folder(tmp_path / "run" / "exp.checkpoints")
    executor = InProcess()
    with pytest.raises(EnvironmentFailure, match="e1-trial-0001 failed 3 times.*resume"):
        experiment(db, executor, max_failures=2).run()
    assert len(executor.tasks) == 3  # one trial tried three times, no other model spent
    with Store(db) as store:
        store.use_experiment(1)
        assert store.get_experiment()["status"] == "stopped"
        (trial,) = store.trials()
        assert trial["state"] == "ERRORED" and trial["attempts"] == 3
        assert trial["error"].startswith("environment error: ")
        assert [m["status"] for m in store.models()] == ["training"]  # not charged to it
    fix()
    experiment(db, InProcess(), max_failures=2).resume()
    assert list(final_states(db).values()) == ["TERMINATED"] * 3
    with Store(db) as store:
        store.use_experiment(1)
        assert [m["status"] for m in store.models()] == ["trained"] * 3
        steps = [s for s, _ in store.learning_curve("e1-trial-0001", "val_acc")]
        assert steps == [1, 2, 3]


def test_garbage_collection_survives_a_folder_it_cannot_delete_from(tmp_path, monkeypatch):
    db = tmp_path / "exp.db"
    real_remove = os.remove

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "exp.checkpoints")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refuse)
    experiment(db, InProcess()).run()
    assert set(final_states(db).values()) == {"TERMINATED"}
    with Store(db) as store:  # what could not be deleted is still recorded
        store.use_experiment(1)
        assert [c["step"] for c in store.checkpoints("e1-trial-0001")] == [1, 2, 3]


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog, damage):
    db = tmp_path / "exp.db"
    interrupted_run(db)
    newest = tmp_path / "exp.checkpoints" / "e1-trial-0002" / "step-000002"
    if damage == "corrupt":
        newest.write_bytes(b"\0garbage")
    else:
        newest.unlink()
    executor = InProcess()
    with caplog.at_level(logging.WARNING, "retiarii.engine"):
        experiment(db, executor).resume()
    starts = [(t.start_step, t.checkpoint_in and os.path.basename(t.checkpoint_in))
              for t in executor.tasks if t.trial_id == "e1-trial-0002"]
    if damage == "corrupt":  # the newest fails to load: the trial redoes step 2 from step 1
        assert starts == [(2, "step-000002"), (1, "step-000001"), (2, "step-000002")]
        said = "resuming from step 1 instead"
    else:  # a missing file's row is dropped when the run resumes: no attempt is wasted on it
        assert starts == [(1, "step-000001"), (2, "step-000002")]
        said = "e1-trial-0002 step 2"
    assert set(final_states(db).values()) == {"TERMINATED"}
    assert any(said in r.getMessage() for r in caplog.records), [r.getMessage()
                                                                 for r in caplog.records]
    with Store(db) as store:
        store.use_experiment(1)
        assert [s for s, _ in store.learning_curve("e1-trial-0002", "val_acc")] == [1, 2, 3]
        assert store.get_trial("e1-trial-0002")["attempts"] == (damage == "corrupt")


def test_the_runner_falls_back_when_the_simulated_disk_lost_a_checkpoint():
    ex = SimulatedExecutor(1, lambda spec, step: {"loss": 1.0 / step})
    journal = MemoryJournal()
    runner = TrialRunner(ex, Scheduler(), journal, max_steps=4)
    runner.add_trial({}, trial_id="t")
    assert not runner.run(max_events=8)  # two segments done
    assert sorted(runner.trials["t"].checkpoints) == [1, 2]
    del ex.checkpoints[runner.folder.path("t/step-000002")]
    resumed = TrialRunner.resume(SimulatedExecutor(1, lambda s, step: {"loss": 1.0 / step},
                                                   checkpoints=ex.checkpoints),
                                 Scheduler(), journal, max_steps=4, max_failures=0)
    assert resumed.run() and resumed.trials["t"].state is TrialState.TERMINATED
    assert ("forget_checkpoint", {"trial_id": "t", "step": 2}) in journal.records()


def test_names_and_the_absolute_paths_of_older_stores(tmp_path):
    from retiarii.engine.storage.checkpoint import legacy_name

    root = str(tmp_path / "b" / "exp.checkpoints")
    folder = CheckpointDir(root)
    assert folder.name(os.path.join(root, "t1", "step-000002")) == "t1/step-000002"
    assert folder.path("t1/step-000002") == os.path.join(root, "t1", "step-000002")
    for bad in ("/etc/passwd", "t1/../../x", "./t1", "t1//x"):
        with pytest.raises(CheckpointPathError):
            folder.path(bad)
    # an older store's paths: this folder's, a moved run's folder, anything else (refused later)
    assert legacy_name(os.path.join(root, "t1", "step-000002"), root) == "t1/step-000002"
    assert legacy_name("/old/place/exp.checkpoints/t1/step-000002", root) == "t1/step-000002"
    assert legacy_name("/tmp/victim", root) == "/tmp/victim"
    assert legacy_name("t1/step-000002", root) == "t1/step-000002"
    with Store(tmp_path / "b" / "exp.db") as store:  # a PBT child's donor is read the same way
        child = Trial("c", {"x": 1}, parent="p", parent_step=2,
                      donor="/old/place/exp.checkpoints/p/step-000002")
        store.trial_added(child)
        (added,) = [p for k, p in store.records() if k == "trial_added"]
        assert added["donor"] == "p/step-000002"
