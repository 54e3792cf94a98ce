"""RayExecutor on a local Ray instance: event order, per-trial failures, cancel, lost actors,
checkpoints through the object store, experiments equal to LocalExecutor's, a killed driver
resumed, and a private instance that listens on loopback only.

One Ray instance for the whole file (starting one takes 15-20 s here): the first executor,
``ex``, starts it and owns it; every other executor of the file attaches to it. Tests live in
:class:`TestRayExecutor`, whose ``make``, ``spec`` and ``kill_worker`` are the seams an
executor contract suite plugs into.
"""
from __future__ import annotations

import collections
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'retiarii[ray]')")

import retiarii as rt  # noqa: E402
from engine_helpers import InProcessExecutor, ref  # noqa: E402
from executor_contract import ExecutorContract, wait_for  # noqa: E402
from retiarii.engine.storage.checkpoint import load  # noqa: E402
from retiarii.engine.jobs.job import (  # noqa: E402
    Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult, TrialTask,
)
from retiarii.engine.executors.local import LocalExecutor  # noqa: E402
from retiarii.engine.executors.ray import RayExecutor  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402
from retiarii.engine.runner.trial_runner import TrialRunner  # noqa: E402
from retiarii.engine.worker_side.worker import run_job  # noqa: E402
from retiarii.strategies.schedulers.base import Scheduler  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 120  # seconds to wait for any one event: generous for a loaded 2-core machine
SLOT_CPUS = 0.25  # logical CPUs per test actor: several executors share the 2-CPU instance


# ---- what the test cluster's processes listen on (read from /proc, no psutil needed) ---------


def _process_tree(root: int) -> list[int]:
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children[ppid].append(int(entry))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children[pid])
    return tree


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _address(hex_ip: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return ipaddress.ip_address(socket.inet_ntop(socket.AF_INET, raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return ipaddress.ip_address(socket.inet_ntop(socket.AF_INET6, words))


def _bound_sockets() -> dict[int, tuple[str, str, int]]:
    """inode -> (protocol, address, port) of every listening TCP and bound UDP socket."""
    out = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{proto}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            ip, port = fields[1].split(":")
            listening = fields[3] == "0A" if proto.startswith("tcp") else int(port, 16) != 0
            if listening:
                out[int(fields[9])] = (proto, str(_address(ip)), int(port, 16))
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is none or it is a
    zombie: with a pid_max of 32768 a busy machine reuses pids within seconds, so a pid alone
    does not name a process for long."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])  # state, ..., starttime (field 22)


_BIRTHS: dict[int, int | None] = {}  # pid -> start time, when the test first named the pid


def _note(pids) -> None:
    """Remember which processes ``pids`` name now (see :func:`_started`)."""
    for pid in pids:
        _BIRTHS[pid] = _started(pid)


def _alive(pid: int) -> bool:
    """Whether the process the test first saw as ``pid`` still runs (not a later one)."""
    born = _BIRTHS.setdefault(pid, _started(pid))
    return born is not None and _started(pid) == born


def _gone(pids, timeout=90.0) -> bool:
    """True once none of ``pids`` is alive (Ray kills and shuts down asynchronously)."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---- helpers ------------------------------------------------------------------------------------


def _of(events, job_id):
    return [e for e in events if e.job_id == job_id]


@pytest.fixture(scope="module")
def ex():
    """The executor that starts (and at the end shuts down) the file's Ray instance."""
    # Processes this test process had before Ray (a multiprocessing resource tracker, an
    # earlier test's pool): not Ray's, and not expected to end with it.
    before = set(_process_tree(os.getpid()))
    executor = RayExecutor(num_workers=2, num_cpus=SLOT_CPUS)
    assert not ray.is_initialized()
    assert executor.wait_ready(timeout=300)
    assert ray.is_initialized() and executor._owns_ray and executor.shared_storage
    cluster = [p for p in _process_tree(os.getpid()) if p not in before]
    _note(cluster)
    temp_dir = executor._temp_dir
    yield executor
    executor.submit(Job("j-at-close", [TrialTask("c", TestRayExecutor.spec(), 0, 100_000)]))
    executor.close()
    executor.close()  # idempotent
    assert not ray.is_initialized()
    assert _gone(cluster), "Ray's processes outlived close()"
    assert not os.path.exists(temp_dir)


@pytest.fixture(scope="module")
def moving(ex):
    """A one-slot executor that moves checkpoints through the object store (its actor starts
    while the first tests run)."""
    with TestRayExecutor.make(1, shared_storage=False) as executor:
        executor.wait_ready(timeout=0)  # connects and creates the actor, without waiting
        yield executor


class TestRayContract(ExecutorContract):
    """The executor contract every executor passes (tests/executor_contract.py), on the
    file's two-actor executor."""

    def task(self, trial_id, stop, *, raise_in_step=None, checkpoint_out=None):
        return TrialTask(trial_id, TestRayExecutor.spec(trainer=ref("FAILING"),
                                                        hparams={"raise_in_step": raise_in_step}),
                         0, stop, None, checkpoint_out)

    def kill_worker(self, ex, worker):
        TestRayExecutor.kill_worker(ex, worker)


class TestRayExecutor:
    """RayExecutor's own promises, beyond the contract: ``make``, ``spec`` and ``kill_worker``
    serve both."""

    @staticmethod
    def make(num_slots, **options):
        """A new executor on the file's Ray instance (``ex`` must exist)."""
        return RayExecutor(num_workers=num_slots, num_cpus=SLOT_CPUS, **options)

    @staticmethod
    def spec(sample=None, seed=0, **over):
        base = {"space": ref("SPACE"), "sample": sample or {"width": 4}, "trainer": ref("FAST"),
                "hparams": {}, "seed": seed}
        return {**base, **over}

    @staticmethod
    def kill_worker(ex, worker):
        """SIGKILL the process of the actor ``worker`` names; its pid."""
        pid = ex.worker_pids()[worker]
        os.kill(pid, signal.SIGKILL)
        return pid

    # ---- the Ray instance ---------------------------------------------------------------------

    def test_the_private_instance_listens_on_loopback_only(self, ex, moving):
        assert ex.wait_ready(TIMEOUT)  # (an actor killed by a contract test is replaced)
        sockets = _bound_sockets()
        tree = _process_tree(os.getpid())
        bound = [(pid, sockets[i]) for pid in tree for i in _socket_inodes(pid) if i in sockets]
        # GCS, raylet (two), the runtime-env agent, each worker: all found, all on loopback
        assert len({pid for pid, _ in bound}) >= 4, bound
        assert all(_is_loopback(address) for _, (_, address, _) in bound), \
            [b for b in bound if not _is_loopback(b[1][1])]
        assert ex._temp_dir and any(name.startswith("session") for name in os.listdir(ex._temp_dir))
        assert set(ex.worker_pids()) == {"ray-0", "ray-1"}
        assert set(ex.worker_pids().values()) <= set(tree)

    # ---- jobs ---------------------------------------------------------------------------------

    def test_job_events_in_order_and_results_equal_an_in_process_run(self, ex, tmp_path):
        out = {t: str(tmp_path / f"{t}.pt") for t in ("a", "b")}
        job = Job("j-order", [TrialTask("a", self.spec({"width": 5}, seed=4), 0, 2, None, out["a"]),
                              TrialTask("b", self.spec({"width": 3}), 0, 1, None, out["b"])])
        ex.submit(job)
        events = wait_for(ex, ["j-order"])
        shape = [(type(e).__name__, getattr(e, "trial_id", None), getattr(e, "step", None))
                 for e in events]
        assert shape == [("JobStarted", None, None),
                         ("TrialResult", "a", 1), ("TrialResult", "b", 1),
                         ("TrialCheckpointed", "b", 1),
                         ("TrialResult", "a", 2), ("TrialCheckpointed", "a", 2),
                         ("JobFinished", None, None)]
        assert events[0].worker in ex.worker_pids()
        assert events[1].time <= events[4].time
        assert load(out["a"])["step"] == 2 and load(out["b"])["step"] == 1
        local: list = []  # the same job in this process (one torch thread, as the actors)
        run_job(Job("j-order", [TrialTask(t.trial_id, t.spec, 0, t.stop_step) for t in job.tasks]),
                local.append)
        assert [(e.trial_id, e.step, e.metrics) for e in events if isinstance(e, TrialResult)] \
            == [(e.trial_id, e.step, e.metrics) for e in local if isinstance(e, TrialResult)]

    def test_one_failing_task_and_several(self, ex, tmp_path):
        ex.submit(Job("j-one", [TrialTask("bad", self.spec({"fail": "shape"}), 0, 2),
                                TrialTask("good", self.spec(), 0, 1, None,
                                          str(tmp_path / "g.pt"))]))
        ex.submit(Job("j-many", [TrialTask("x", self.spec({"fail": "shape"}), 0, 1),
                                 TrialTask("y", self.spec({"fail": "nan"}), 0, 1),
                                 TrialTask("z", self.spec(), 0, 1)]))
        events = wait_for(ex, ["j-one", "j-many"])
        one, many = _of(events, "j-one"), _of(events, "j-many")
        assert isinstance(one[-1], JobFailed) and one[-1].trial_id == "bad"
        assert not one[-1].worker_lost
        assert "mat1 and mat2 shapes cannot be multiplied" in one[-1].error.splitlines()[0]
        assert any(isinstance(e, TrialCheckpointed) and e.trial_id == "good" for e in one)
        end = many[-1]
        assert isinstance(end, JobFailed) and end.trial_id is None and not end.worker_lost
        assert "trial x: RuntimeError" in end.error and "trial y: TrainingError" in end.error
        assert [e.trial_id for e in many if isinstance(e, TrialResult)] == ["z"]

    def test_cancel_running_and_queued_jobs_kills_the_actors(self, ex):
        assert ex.wait_ready(TIMEOUT)
        ex.submit(Job("j-hang", [TrialTask("h", self.spec({"fail": "hang"}), 0, 1)]))
        ex.submit(Job("j-busy", [TrialTask("b", self.spec(), 0, 100_000)]))
        ex.submit(Job("j-queued", [TrialTask("q", self.spec(), 0, 1)]))  # no free slot
        started, busy_stepped = set(), False
        while not busy_stepped or len(started) < 2:
            event = ex.next_event(timeout=TIMEOUT)
            assert event is not None
            started |= {event.job_id} if isinstance(event, JobStarted) else set()
            busy_stepped |= isinstance(event, TrialResult) and event.job_id == "j-busy"
        assert started == {"j-hang", "j-busy"}
        pids = ex.worker_pids()
        _note(pids.values())
        for job_id in ("j-queued", "j-busy", "j-hang", "j-hang", "no-such-job"):
            ex.cancel(job_id)  # twice is harmless, as is an unknown id
        events = wait_for(ex, ["j-queued", "j-hang", "j-busy"])
        assert [(e.job_id, e.error, e.worker_lost) for e in events] == \
            [(j, "cancelled", False) for j in ("j-queued", "j-busy", "j-hang")]
        assert _gone(pids.values()), "a cancelled job's actor is still running"
        assert ex.next_event(timeout=0.2) is None  # nothing else runs
        # The replacements work, and keep the slots' names (placement hints still apply).
        assert ex.wait_ready(TIMEOUT)
        ex.submit(Job("j-after", [TrialTask("x", self.spec(), 0, 1)], meta={"worker": "ray-1"}))
        events = wait_for(ex, ["j-after"])
        assert events[0].worker == "ray-1" and isinstance(events[-1], JobFinished)
        assert set(ex.worker_pids().values()).isdisjoint(pids.values())

    def test_a_killed_actor_is_a_lost_worker_and_is_replaced(self, ex):
        ex.submit(Job("j-long", [TrialTask("long", self.spec(), 0, 50)]))
        started = ex.next_event(timeout=TIMEOUT)
        assert isinstance(started, JobStarted) and started.job_id == "j-long"
        first = ex.next_event(timeout=TIMEOUT)
        assert isinstance(first, TrialResult) and first.trial_id == "long"  # mid-job
        pid = self.kill_worker(ex, started.worker)
        events = wait_for(ex, ["j-long"])
        lost = events[-1]
        assert isinstance(lost, JobFailed) and lost.worker_lost and lost.trial_id is None
        assert f"worker {started.worker} (pid {pid}," in lost.error and "ActorDiedError" in lost.error
        assert all(e.step < 50 for e in events if isinstance(e, TrialResult))
        assert ex.worker_pids()[started.worker] != pid  # a new actor (starting: None)

    def test_an_idle_actor_that_dies_is_replaced_before_it_gets_a_job(self, ex):
        assert ex.wait_ready(TIMEOUT)
        ex.submit(Job("j-hold", [TrialTask("hold", self.spec(), 0, 60)], meta={"worker": "ray-0"}))
        assert isinstance(ex.next_event(timeout=TIMEOUT), JobStarted)
        pid = self.kill_worker(ex, "ray-1")  # idle: no job of it will ever fail
        events = []
        while ex.worker_pids()["ray-1"] == pid and not events[-1:] == [JobFinished("j-hold")]:
            events.append(ex.next_event(timeout=TIMEOUT))  # the hold job's results meanwhile
        assert ex.worker_pids()["ray-1"] != pid  # noticed while the other actor trained
        events += wait_for(ex, ["j-hold"]) if events[-1] != JobFinished("j-hold") else []
        assert [type(e) for e in events] == [TrialResult] * 60 + [JobFinished]

    def test_duplicate_job_id_is_refused(self, ex):
        ex.submit(Job("j-dup", [TrialTask("d", self.spec(), 0, 1)]))
        with pytest.raises(ValueError, match="'j-dup' is already submitted"):
            ex.submit(Job("j-dup", [TrialTask("d", self.spec(), 0, 1)]))
        wait_for(ex, ["j-dup"])

    # ---- checkpoints ----------------------------------------------------------------------

    def test_checkpoints_travel_through_the_object_store(self, moving, tmp_path, monkeypatch):
        """shared_storage=False: the paths are relative to the *driver's* directory, which the
        actors do not run in, so the checkpoints can only get there (and back) as bytes."""
        monkeypatch.chdir(tmp_path)
        spec = self.spec({"width": 5, "dropout": 0.2}, seed=7)
        moving.submit(Job("j-seg1", [TrialTask("m", spec, 0, 1, None, "ck/m-1.pt")]))
        first = wait_for(moving, ["j-seg1"])
        moving.submit(Job("j-seg2", [TrialTask("m", spec, 1, 2, "ck/m-1.pt", "ck/m-2.pt")]))
        second = wait_for(moving, ["j-seg2"])
        moving.submit(Job("j-gone", [TrialTask("m", spec, 1, 2, "ck/nope.pt", None)]))
        missing = wait_for(moving, ["j-gone"])[-1]
        assert [e.path for e in first + second if isinstance(e, TrialCheckpointed)] == \
            ["ck/m-1.pt", "ck/m-2.pt"]
        assert load(tmp_path / "ck/m-2.pt")["step"] == 2
        assert sorted(os.listdir(tmp_path / "ck")) == ["m-1.pt", "m-2.pt"]  # no temporaries
        # two segments through the object store = one uninterrupted run, bit for bit
        whole: list = []
        run_job(Job("w", [TrialTask("m", spec, 0, 2, None, str(tmp_path / "w.pt"))]), whole.append)
        assert [e.metrics for e in first + second if isinstance(e, TrialResult)] == \
            [e.metrics for e in whole if isinstance(e, TrialResult)]
        assert all(torch.equal(v, load(tmp_path / "w.pt")["model"][k])
                   for k, v in load(tmp_path / "ck/m-2.pt")["model"].items())
        assert missing.trial_id == "m" and "checkpoint ck/nope.pt does not exist" in missing.error

    def test_a_trial_whose_actor_dies_resumes_from_its_checkpoint_on_another(self, ex, tmp_path):
        """TrialRunner + RayExecutor + Store: the actor's process is SIGKILLed (by the trial's
        own trainer, with os.kill on its pid) in the third epoch; the trial continues from its
        step-2 checkpoint on a new actor and ends exactly like a twin never interrupted."""
        starts = []  # (trial, pid of the actor it started on)

        class Watched:  # records which actor process each job started on
            num_slots = ex.num_slots

            def __getattr__(self, name):
                return getattr(ex, name)

            def next_event(self, timeout=None):
                event = ex.next_event(timeout)
                if isinstance(event, JobStarted):
                    starts.append((event.job_id, ex.worker_pids()[event.worker]))
                return event

        store = Store(tmp_path / "run.db")
        runner = TrialRunner(Watched(), Scheduler(), store, max_steps=4, max_failures=2,
                             checkpoint_dir=str(tmp_path / "ckpt"))
        dying = self.spec(seed=3, trainer=ref("DYING"),
                          hparams={"die_marker": str(tmp_path / "died"), "die_in_epoch": 2})
        runner.add_trial(dying, trial_id="dies")
        runner.add_trial(self.spec(seed=3), trial_id="twin")
        assert runner.run()
        assert os.path.exists(tmp_path / "died")
        dies, twin = store.get_trial("dies"), store.get_trial("twin")
        assert (dies["state"], dies["attempts"], twin["state"]) == ("TERMINATED", 1, "TERMINATED")
        reasons = [e["reason"] for e in store.events("dies")]
        assert any(r.startswith("worker lost: worker ray-") and "ActorDiedError" in r
                   for r in reasons), reasons
        assert "retry 1 from step 2" in reasons
        for metric in ("train_loss", "val_loss", "val_acc"):
            assert store.learning_curve("dies", metric) == store.learning_curve("twin", metric)
        store.close()
        ran_it = {pid for job, pid in starts if job.startswith("dies@")}
        assert any(not _alive(p) for p in ran_it) and any(_alive(p) for p in ran_it), ran_it

    # ---- experiments ----------------------------------------------------------------------

    def test_an_experiment_on_ray_equals_one_on_local_processes(self, ex, tmp_path):
        from exp_space import space, trainer

        def trained(executor, name):
            exp = rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                                store=str(tmp_path / f"{name}.db"), workers=1, max_models=3,
                                seed=0, executor=executor)
            exp.run()
            return _trained(exp.path)

        with LocalExecutor(1, devices=[], threads_per_worker=1) as local:
            on_local = trained(local, "local")
        on_ray = trained("ray", "ray")  # a RayExecutor(1): one thread, on the running instance
        assert ray.is_initialized()  # the experiment's executor left the instance running
        assert [t for _, _, t in on_ray] == ["TERMINATED"] * 3, _errors(tmp_path / "ray.db")
        assert [s for s, _, _ in on_ray] == [s for s, _, _ in on_local]  # the same models
        assert [c for _, c, _ in on_ray] == [c for _, c, _ in on_local]  # same metrics, exactly

    def test_the_driver_killed_then_resumed_on_ray(self, ex, tmp_path):
        """`retiarii run --executor ray --address` on the running instance, SIGKILLed while its
        trials train (its actors die with it), then `retiarii resume`: the run ends with the
        models and metrics of an uninterrupted run."""
        db = tmp_path / "killed.db"
        address = ray.get_runtime_context().gcs_address
        cli = [sys.executable, "-m", "retiarii.cli"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.Popen(
            cli + ["run", str(HERE / "exp_space.py"), "--strategy", "random", "--seed", "0",
                   "--max-models", "3", "--workers", "1", "--store", str(db),
                   "--executor", "ray", "--address", address],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 180
        while run.poll() is None and _results(db) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None, run.stderr.read().decode()[-3000:]  # killed mid-run
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        done = subprocess.run(cli + ["resume", str(db)], env=env, capture_output=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        with Store(db) as store:
            store.use_experiment(store.experiments()[-1]["id"])
            origin = store.get_experiment()["config"]["origin"]["cli"]
            reasons = [e["reason"] for e in store.events()]
            assert store.get_experiment()["status"] == "done"
        assert (origin["executor"], origin["address"]) == ("ray", address)
        # (the kill lands after a result is on disk: inside a trial, or between two; the
        # equality below is what proves nothing was lost or trained twice)
        assert reasons.count("added") == 3
        from exp_space import space, trainer

        whole = rt.Experiment(space, rt.strategies.Random(seed=0), trainer,
                              store=str(tmp_path / "whole.db"), max_models=3, seed=0,
                              executor=InProcessExecutor())
        whole.run()
        assert [(s, c) for s, c, _ in _trained(db)] == \
            [(s, c) for s, c, _ in _trained(whole.path)]


def _results(db) -> int:
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT count(*) FROM metrics").fetchone()[0]
    except sqlite3.Error:
        return 0  # not created yet


def _errors(store_path):
    with Store(store_path) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return [t["error"] for t in store.trials()]


def _trained(store_path):
    """(choices, {step: val_acc}, state) of every trial of the latest experiment."""
    with Store(store_path) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        return [(t["spec"]["choices"], dict(store.learning_curve(t["id"], "val_acc")), t["state"])
                for t in store.trials()]


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="at least one worker"):
        RayExecutor(num_workers=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        RayExecutor(num_gpus=-1)
    from exp_space import space, trainer
    from retiarii.engine.driver.experiment import ExperimentError

    with pytest.raises(ExperimentError, match="unknown executor 'dask'; valid: local, ray"):
        rt.Experiment(space, rt.strategies.Random(seed=0), trainer, executor="dask")
    assert json.dumps(RayExecutor().worker_pids()) == '{"ray-0": null, "ray-1": null}'
