"""Executor health: a cluster that can no longer run anything stops the search cleanly.

When the workers cannot start (LocalExecutor), the only raylet is SIGKILLed with its workers
(an out-of-memory kill), or the node with every CPU leaves a two-node Ray cluster, the executor
raises :class:`EnvironmentFailure`; the experiment ends ``stopped`` with a one-line message
naming what was lost and how to resume, no model failed, no retry charged to the trials the
cluster took down, and ``retiarii resume`` (on a new instance, or ``--executor local``) ends
with the models and metrics of an uninterrupted run. A live Ray actor that hangs is killed when
its heartbeat deadline passes and its trial is retried. Each of these waited forever before.

The Ray tests start their own instances (the raylet test kills one) and are slow-marked.
"""
from __future__ import annotations

import collections
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor, ref
from retiarii.engine import EnvironmentFailure
from retiarii.engine.jobs.job import Job, JobFailed, JobFinished, TrialResult, TrialTask
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.storage.store import Store
from retiarii.engine.worker_side.worker import run_job

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "retiarii.cli"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
       "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE),
                                      os.environ.get("PYTHONPATH", "")])}


def _latest(db) -> tuple[dict, list[dict], list[dict]]:
    """(experiment, models, trials) of the latest experiment of ``db``."""
    with Store(str(db)) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return store.get_experiment(), store.models(), store.trials()


def _trained(db) -> list[tuple]:
    """(choices, {step: val_acc}) of every trial of the latest experiment, in order."""
    with Store(str(db)) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return [(t["spec"]["choices"], dict(store.learning_curve(t["id"], "val_acc")))
                for t in store.trials()]


def _uninterrupted(tmp_path, max_models: int, demo: bool = False) -> list[tuple]:
    """An uninterrupted search of exp_space (or of the demo, as ``--epochs 3 --optimize
    off`` runs it) in this process: the reference of every resumed run here."""
    from exp_space import space, trainer

    if demo:
        from retiarii.engine.trainers.trainer import ClassifierTrainer

        space, trainer = "retiarii.demo:space", ClassifierTrainer(dataset="digits", epochs=3)
    whole = rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                          store=str(tmp_path / "whole.db"), max_models=max_models, seed=0,
                          executor=InProcessExecutor(), optimize=False)
    whole.run()
    return _trained(whole.path)


def _assert_stopped_clean(db, message: str, lost: str) -> None:
    """The run stopped, said so in one line naming ``lost`` and the resume command, and
    charged nothing: no model failed, no trial counted a failure."""
    experiment, models, trials = _latest(db)
    assert experiment["status"] == "stopped"
    assert "\n" not in message.strip(), message
    assert lost in message and "stopped" in message and f"retiarii resume {db}" in message
    assert [m["status"] for m in models if m["status"] == "failed"] == []
    assert [(t["id"], t["attempts"]) for t in trials if t["attempts"]] == []


# ---- LocalExecutor: workers that cannot start ---------------------------------------------------


def test_local_workers_that_cannot_start_stop_the_experiment_cleanly(tmp_path):
    """LocalExecutor gives up after 3 failed starts: the experiment stops (not a RuntimeError
    out of the loop with the run left 'running'), and a resume finishes the search."""
    from exp_space import space, trainer

    db = tmp_path / "exp.db"
    with LocalExecutor(1, devices=[], startup_timeout=0.05,
                       start_method="spawn") as broken:  # killed before torch
        exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db),
                            max_models=3, seed=0, executor=broken, optimize=False)
        with pytest.raises(EnvironmentFailure) as stop:
            exp.run()
    _assert_stopped_clean(db, str(stop.value), "local-0 failed to start 3 times")
    again = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db),
                          max_models=3, seed=0, executor=InProcessExecutor(), optimize=False)
    again.resume()
    assert _latest(db)[0]["status"] == "done"
    assert _trained(db) == _uninterrupted(tmp_path, 3)


def test_a_one_shot_search_whose_workers_cannot_start_stops_then_resumes(tmp_path):
    """The same for a one-shot search: its segment loop stops, the resume equals a search
    never stopped."""
    from one_shot_helpers import PerArchitecture, space, trainer

    def experiment(path, executor):
        return rt.Experiment(space, PerArchitecture(epochs=2), trainer, store=str(path),
                             workers=1, seed=0, executor=executor)

    db = tmp_path / "one_shot.db"
    with LocalExecutor(1, devices=[], startup_timeout=0.05, start_method="spawn") as broken:
        with pytest.raises(EnvironmentFailure) as stop:
            experiment(db, broken).run()
    message = str(stop.value)
    assert _latest(db)[0]["status"] == "stopped" and "\n" not in message
    assert "local-0 failed to start 3 times" in message and f"retiarii resume {db}" in message
    resumed = experiment(db, InProcessExecutor()).resume()
    whole = experiment(tmp_path / "whole.db", InProcessExecutor()).run()
    assert _latest(db)[0]["status"] == "done"
    assert resumed["one_shot"] == whole["one_shot"]


def test_resume_executor_flag_is_checked(tmp_path):
    """`resume --executor local --address X` is refused, naming the clash."""
    db = tmp_path / "run.db"
    done = subprocess.run(CLI + ["run", str(HERE / "exp_space.py"), "--strategy", "random",
                                 "--max-models", "1", "--workers", "1",
                                 "--store", str(db), "--optimize", "off"],
                          env=ENV, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    bad = subprocess.run(CLI + ["resume", str(db), "--executor", "local", "--address",
                                "127.0.0.1:6379"], env=ENV, capture_output=True, timeout=120)
    assert bad.returncode == 2 and b"--address names a Ray cluster" in bad.stderr


# ---- the Ray executor's deadlines, with plain numbers --------------------------------------------


def test_ray_deadlines_tell_hung_and_unstartable_slots():
    pytest.importorskip("ray", reason="Ray is not installed")
    from retiarii.engine.executors import ray_health

    def slot(ready, beat, warned=False):
        return SimpleNamespace(actor=object(), ready=ready, beat=beat, start_warned=warned)

    busy, hung, starting, warned = slot(True, 100.0), slot(True, 0.0), slot(False, 50.0), \
        slot(False, 0.0, warned=True)
    slots = [busy, hung, starting, warned]
    assert ray_health.next_deadline(slots, heartbeat_timeout=120, startup_timeout=300) == 120
    assert ray_health.overdue(slots, 119.9, 120, 300) == []
    assert ray_health.overdue(slots, 120.0, 120, 300) == [(hung, "hung")]
    assert ray_health.overdue(slots, 350.0, 120, 300) == [(busy, "hung"), (hung, "hung"),
                                                          (starting, "start")]
    assert ray_health.overdue(slots, 1e9, None, 300) == [(starting, "start")]  # no heartbeat
    gone = SimpleNamespace(actor=None, ready=False, beat=0.0, start_warned=False)
    assert ray_health.next_deadline([gone], 120, 300) is None


# ---- Ray: the raylet and its workers SIGKILLed, a node removed, a hung actor ----------------------


def _tree(root: int) -> list[int]:
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, stack = [], [root]
    while stack:
        out.extend(children[stack[-1]])
        stack.extend(children[stack.pop()])
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def _count(db, sql: str) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute(sql).fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_raylet_and_workers_sigkilled_stop_the_run_then_resume_on_local(tmp_path):
    """`retiarii run --executor ray` on its private instance; once a model has trained, the
    raylet and every Ray worker are SIGKILLed (an out-of-memory kill). The driver exits 2 with
    one line naming the lost node and the resume command (it waited forever before); then
    `retiarii resume --executor local` ends with an uninterrupted run's models and metrics."""
    pytest.importorskip("ray", reason="Ray is not installed")
    db = tmp_path / "ray.db"
    run = subprocess.Popen(
        CLI + ["run", "demo", "--strategy", "random", "--seed", "0", "--epochs", "3",
               "--max-models", "8", "--workers", "2", "--store", str(db), "--optimize", "off",
               "--executor", "ray"],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline and _count(
                db, "SELECT count(*) FROM models WHERE status = 'trained'") < 1:
            time.sleep(0.2)
        assert run.poll() is None, run.stderr.read().decode()[-3000:]
        raylets = [p for p in _tree(run.pid) if _cmdline(p).split(" ")[0].endswith("/raylet")]
        workers = [p for p in _tree(run.pid) if _cmdline(p).startswith("ray::")]
        assert len(raylets) == 1 and workers, (raylets, workers)
        victims = raylets + workers
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            code = run.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail("the driver still waits 240 s after its Ray node was SIGKILLed")
        err = run.stderr.read().decode().strip()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    last = err.splitlines()[-1]
    assert code == 2, err[-3000:]
    assert last.startswith("retiarii run: ") and "no live node left" in last, err[-3000:]
    _assert_stopped_clean(db, last.removeprefix("retiarii run: "), "127.0.0.1")
    done = subprocess.run(CLI + ["resume", str(db), "--executor", "local"], env=ENV,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert _latest(db)[0]["status"] == "done"
    assert _trained(db) == _uninterrupted(tmp_path, 8, demo=True)


@pytest.mark.slow
def test_a_node_removed_from_a_two_node_cluster_stops_then_resumes_on_a_new_node(tmp_path):
    """Two nodes on loopback, the head without CPUs: the worker node leaves mid-search (its
    actors die with it). No live node has room for an actor, so after ``startup_timeout`` the
    run stops, clean (waited forever before); with a new node it resumes to an uninterrupted
    run's models and metrics. The trials on the lost node were retried (one attempt each:
    the cluster lived on), nothing else."""
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from ray.cluster_utils import Cluster

    from retiarii.engine.executors.ray import RayExecutor
    from retiarii.engine.trainers.trainer import ClassifierTrainer

    space, trainer = "retiarii.demo:space", ClassifierTrainer(dataset="digits", epochs=3)

    loopback = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**loopback, "num_cpus": 0})
    try:
        node = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2)
        ray.init(address=cluster.address)
        db, outcome = tmp_path / "cluster.db", {}

        def remove_node_once(summary):  # the first trained model: the node leaves
            if not outcome.get("removed"):
                outcome["removed"] = True
                cluster.remove_node(node, allow_graceful=False)

        def search():
            executor = RayExecutor(2, num_cpus=1, startup_timeout=20)
            try:
                exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db),
                                    max_models=8, seed=0, executor=executor, optimize=False,
                                    progress=remove_node_once)
                exp.run()
                outcome["error"] = None
            except EnvironmentFailure as err:
                outcome["error"] = err
            finally:
                executor.close()

        thread = threading.Thread(target=search, daemon=True)  # bounded below, not forever
        thread.start()
        thread.join(timeout=300)
        assert not thread.is_alive(), "the search still waits 300 s after its node left"
        message = str(outcome["error"])
        assert "no worker actor became ready within 20 s" in message, message
        experiment, models, trials = _latest(db)
        assert experiment["status"] == "stopped" and "\n" not in message
        assert f"retiarii resume {db}" in message
        assert [m for m in models if m["status"] == "failed"] == []
        assert {t["attempts"] for t in trials} <= {0, 1}  # the lost node's trials: one each
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2)
        with RayExecutor(2, num_cpus=1) as executor:
            rt.Experiment(space, rt.strategies.Random(seed=0), trainer, store=str(db),
                          max_models=8, seed=0, executor=executor, optimize=False).resume()
        assert _latest(db)[0]["status"] == "done"
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert _trained(db) == _uninterrupted(tmp_path, 8, demo=True)


@pytest.mark.slow
def test_a_hung_actor_is_killed_at_its_heartbeat_deadline_and_its_job_retried(tmp_path):
    """An actor stopped (SIGSTOP) in its job's second epoch answers nothing, not even its
    empty long poll: after ``heartbeat_timeout`` it is killed and the job ends as a lost
    worker (it waited forever before); the retry trains as an uninterrupted job does."""
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    from retiarii.engine.executors.ray import RayExecutor

    marker = tmp_path / "hung"
    spec = {"space": ref("SPACE"), "sample": {"width": 4}, "trainer": ref("HANGING"),
            "hparams": {"hang_marker": str(marker), "hang_in_epoch": 1}, "seed": 0}
    with RayExecutor(1, num_cpus=1, poll_wait=1.0, heartbeat_timeout=8.0) as ex:
        try:
            events, ends = [], []
            for attempt in range(2):
                ex.submit(Job(f"j{attempt}", [TrialTask("t", spec, 0, 3)]))
                while True:
                    event = ex.next_event(timeout=120)
                    assert event is not None, f"no event in 120 s after {events}"
                    events.append(event)
                    if isinstance(event, (JobFinished, JobFailed)):
                        ends.append(len(events) - 1)
                        break
            first, second = ends
            lost = events[first]
            assert isinstance(lost, JobFailed) and lost.worker_lost, lost
            assert "stopped answering for 8 s" in lost.error
            assert isinstance(events[second], JobFinished)
            hung_pid = int(marker.read_text())
            assert ex.worker_pids()["ray-0"] != hung_pid
        finally:
            if marker.exists():  # never leave a stopped process behind
                try:
                    os.kill(int(marker.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        retried = [e.metrics for e in events[first + 1:] if isinstance(e, TrialResult)]
    assert not ray.is_initialized()
    alone = []  # the same job, never hung, in this process
    run_job(Job("a", [TrialTask("t", {**spec, "trainer": ref("FAST")}, 0, 3)]), alone.append)
    assert retried == [e.metrics for e in alone if isinstance(e, TrialResult)]
