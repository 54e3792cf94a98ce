"""LocalExecutor and the worker: the executor contract (tests/executor_contract.py), event order,
per-trial failures, lost workers (SIGKILL, silent heartbeats), cancel, close; plus run_job
itself, in process."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from engine_helpers import ref
from executor_contract import ExecutorContract, wait_for
from retiarii.engine.storage.checkpoint import load
from retiarii.engine.jobs.job import (
    Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult, TrialTask,
)
from retiarii.engine.executors.local import LocalExecutor
from retiarii.engine.storage.store import Store
from retiarii.engine.runner.trial_runner import TrialRunner
from retiarii.strategies.schedulers.base import Scheduler
from retiarii.engine.worker_side.worker import WorkerContext, run_job
from retiarii.refs import resolve_ref

TIMEOUT = 120  # seconds to wait for any one event: generous for a loaded 2-core machine


def spec(sample=None, seed=0, **over):
    base = {"space": ref("SPACE"), "sample": sample or {"width": 4}, "trainer": ref("FAST"),
            "hparams": {}, "seed": seed}
    return {**base, **over}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def ex():
    executor = LocalExecutor(num_workers=2, heartbeat_interval=0.2, heartbeat_timeout=4.0,
                             cancel_grace=1.0)
    yield executor
    executor.submit(Job("j-at-close", [TrialTask("c", spec(), 0, 100_000)]))  # busy at close
    pids = list(executor.worker_pids().values())
    executor.close()
    assert not any(alive(pid) for pid in pids)


class TestLocalContract(ExecutorContract):
    """The contract on the module's pool of two workers (tiny trainers: fast steps)."""

    def task(self, trial_id, stop, *, raise_in_step=None, checkpoint_out=None):
        return TrialTask(trial_id, spec(trainer=ref("FAILING"),
                                        hparams={"raise_in_step": raise_in_step}),
                         0, stop, None, checkpoint_out)

    def kill_worker(self, ex, worker):
        os.kill(ex.worker_pids()[worker], signal.SIGKILL)


def test_job_events_in_order_and_checkpoints_loadable(ex, tmp_path):
    out = {t: str(tmp_path / f"{t}.pt") for t in ("a", "b")}
    ex.submit(Job("j-order", [TrialTask("a", spec(), 0, 2, None, out["a"]),
                              TrialTask("b", spec({"width": 3}), 0, 1, None, out["b"])]))
    events = wait_for(ex, ["j-order"])
    shape = [(type(e).__name__, getattr(e, "trial_id", None), getattr(e, "step", None))
             for e in events]
    assert shape == [("JobStarted", None, None),
                     ("TrialResult", "a", 1), ("TrialResult", "b", 1), ("TrialCheckpointed", "b", 1),
                     ("TrialResult", "a", 2), ("TrialCheckpointed", "a", 2), ("JobFinished", None, None)]
    assert events[0].worker in ex.worker_pids()
    assert set(events[1].metrics) == {"train_loss", "val_loss", "val_acc"}
    assert events[1].time <= events[4].time <= ex.now()
    assert load(out["a"])["step"] == 2 and load(out["b"])["step"] == 1


def test_results_equal_an_in_process_run(ex, tmp_path):
    """The same job run by a worker and by run_job here reports the same numbers."""
    job = Job("j-same", [TrialTask("s", spec({"width": 5, "dropout": 0.1}, seed=4), 0, 2)])
    ex.submit(job)
    remote = [e for e in wait_for(ex, ["j-same"]) if isinstance(e, TrialResult)]
    local: list = []
    threads = torch.get_num_threads()
    torch.set_num_threads(ex.threads)  # the workers' thread count: same reduction order
    try:
        run_job(job, local.append)
    finally:
        torch.set_num_threads(threads)
    local = [e for e in local if isinstance(e, TrialResult)]
    assert [(e.step, e.metrics) for e in remote] == [(e.step, e.metrics) for e in local]


def test_a_raising_task_fails_only_its_trial(ex, tmp_path):
    ex.submit(Job("j-bad", [TrialTask("bad", spec({"fail": "shape"}), 0, 2, None, None),
                            TrialTask("good", spec(), 0, 1, None, str(tmp_path / "g.pt"))]))
    events = wait_for(ex, ["j-bad"])
    worker = events[0].worker
    pid = ex.worker_pids()[worker]
    failed = events[-1]
    assert isinstance(failed, JobFailed) and failed.trial_id == "bad" and not failed.worker_lost
    assert "mat1 and mat2 shapes cannot be multiplied" in failed.error.splitlines()[0]
    assert any(isinstance(e, TrialCheckpointed) and e.trial_id == "good" for e in events)
    # A NaN model fails the same way, and the worker that ran both is still the same process.
    ex.submit(Job("j-nan", [TrialTask("nan", spec({"fail": "nan"}), 0, 1)]))
    failed = wait_for(ex, ["j-nan"])[-1]
    assert failed.trial_id == "nan" and "training loss is nan" in failed.error
    assert ex.worker_pids()[worker] == pid and alive(pid)


def test_spec_errors_fail_the_trial_with_a_clear_message(ex):
    ex.submit(Job("j-spec", [TrialTask("nospace", {"sample": {}, "trainer": ref("FAST")}, 0, 1)]))
    ex.submit(Job("j-ref", [TrialTask("badref", spec(space=ref("NOT_THERE")), 0, 1)]))
    events = {e.job_id: e for e in wait_for(ex, ["j-spec", "j-ref"]) if isinstance(e, JobFailed)}
    assert "trial nospace: its spec lacks 'space'" in events["j-spec"].error
    assert "has no attribute 'NOT_THERE'" in events["j-ref"].error


def test_sigkilled_worker_is_reported_and_replaced(ex, tmp_path):
    ex.submit(Job("j-long", [TrialTask("long", spec(), 0, 50, None, None)]))
    started = ex.next_event(timeout=TIMEOUT)
    assert isinstance(started, JobStarted) and started.job_id == "j-long"
    first = ex.next_event(timeout=TIMEOUT)
    assert isinstance(first, TrialResult) and first.trial_id == "long"  # mid-job
    pid = ex.worker_pids()[started.worker]
    os.kill(pid, signal.SIGKILL)
    events = wait_for(ex, ["j-long"])
    lost = events[-1]
    assert isinstance(lost, JobFailed) and lost.worker_lost and lost.trial_id is None
    assert f"worker {started.worker} (pid {pid}) killed by SIGKILL" in lost.error
    assert all(e.step < 50 for e in events if isinstance(e, TrialResult))
    new_pid = ex.worker_pids()[started.worker]
    assert new_pid != pid and not alive(pid)
    # The replacement works: with the other slot held by a long job, a job must run on it.
    ex.submit(Job("j-block", [TrialTask("hold", spec(), 0, 100_000)]))  # never ends by itself
    ex.submit(Job("j-after", [TrialTask("x", spec(), 0, 1)]))
    events = []
    while not any(isinstance(e, JobFinished) and e.job_id == "j-after" for e in events):
        events.append(ex.next_event(timeout=TIMEOUT))
        assert events[-1] is not None
    ex.cancel("j-block")
    wait_for(ex, ["j-block"])
    assert {e.worker for e in events if isinstance(e, JobStarted)} == {"local-0", "local-1"}


def test_silent_worker_is_killed_after_heartbeat_timeout(ex):
    ex.submit(Job("j-stop", [TrialTask("stop", spec({"fail": "stop"}), 0, 1)]))
    lost = wait_for(ex, ["j-stop"])[-1]
    assert isinstance(lost, JobFailed) and lost.worker_lost
    assert "stopped sending heartbeats for 4.0 s and was killed" in lost.error


def test_cancel_running_and_queued_jobs(ex):
    ex.submit(Job("j-hang", [TrialTask("h", spec({"fail": "hang"}), 0, 1)]))
    ex.submit(Job("j-busy", [TrialTask("b", spec(), 0, 100_000)]))
    ex.submit(Job("j-queued", [TrialTask("q", spec(), 0, 1)]))  # no free slot: it waits
    started, workers = set(), {}
    while "j-busy" not in workers or len(started) < 2:  # both run, j-busy has trained a step
        event = ex.next_event(timeout=TIMEOUT)
        if isinstance(event, JobStarted):
            started.add(event.job_id)
        if isinstance(event, TrialResult):
            workers["j-busy"] = event
    assert started == {"j-hang", "j-busy"}
    pids = ex.worker_pids()
    for job_id in ("j-queued", "j-busy", "j-hang", "j-hang", "no-such-job"):
        ex.cancel(job_id)  # twice is harmless, as is an unknown id
    events = wait_for(ex, ["j-queued", "j-hang", "j-busy"])
    ends = {e.job_id: (e.error, e.worker_lost) for e in events if isinstance(e, JobFailed)}
    assert ends == {j: ("cancelled", False) for j in ("j-queued", "j-hang", "j-busy")}
    assert not any(isinstance(e, TrialResult) for e in events)  # none after the cancel
    assert ex.next_event(timeout=0.2) is None  # nothing else was running
    # j-busy stopped at a step boundary and kept its worker; the hung one was killed.
    assert sorted(pid == ex.worker_pids()[w] for w, pid in pids.items()) == [False, True]


def test_placement_hint_picks_the_named_idle_slot(ex):
    assert ex.wait_ready(TIMEOUT)  # both slots idle and ready: only the hint decides
    for target in ("local-1", "local-0", "local-1"):
        job_id = f"j-hint-{target}-{len(target)}-{id(object())}"
        ex.submit(Job(job_id, [TrialTask("h", spec(), 0, 1)], meta={"worker": target}))
        events = wait_for(ex, [job_id])
        assert events[0].worker == target and isinstance(events[-1], JobFinished)


def test_duplicate_job_id_is_refused(ex):
    ex.submit(Job("j-dup", [TrialTask("d", spec(), 0, 1)]))
    with pytest.raises(ValueError, match="'j-dup' is already submitted"):
        ex.submit(Job("j-dup", [TrialTask("d", spec(), 0, 1)]))
    wait_for(ex, ["j-dup"])


def test_ctrl_c_in_next_event_closes_the_executor():
    executor = LocalExecutor(num_workers=1, heartbeat_interval=0.2)
    pids = list(executor.worker_pids().values())

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    executor._events.get = interrupt  # Ctrl-C while blocked in next_event
    with pytest.raises(KeyboardInterrupt):
        executor.next_event()
    assert not any(alive(pid) for pid in pids)
    executor.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        executor.submit(Job("late", []))


def test_killed_trial_is_retried_from_its_checkpoint_to_the_same_result(ex, tmp_path):
    """Issue #4 item 7 end to end: TrialRunner + LocalExecutor + Store. A worker dies in the
    third epoch; the trial resumes from its step-2 checkpoint and ends exactly like a twin
    that was never interrupted."""
    store = Store(tmp_path / "run.db")
    runner = TrialRunner(ex, Scheduler(), store, max_steps=4, max_failures=2,
                         checkpoint_dir=str(tmp_path / "ckpt"))
    dying = spec(seed=3, trainer=ref("DYING"),
                 hparams={"die_marker": str(tmp_path / "died"), "die_in_epoch": 2})
    runner.add_trial(dying, trial_id="dies")
    runner.add_trial(spec(seed=3), trial_id="twin")
    assert runner.run()
    assert os.path.exists(tmp_path / "died")
    dies, twin = store.get_trial("dies"), store.get_trial("twin")
    assert (dies["state"], dies["attempts"], twin["state"]) == ("TERMINATED", 1, "TERMINATED")
    reasons = [e["reason"] for e in store.events("dies")]
    assert any(r.startswith("worker lost: worker local-") and "SIGKILL" in r for r in reasons)
    assert "retry 1 from step 2" in reasons
    for metric in ("train_loss", "val_loss", "val_acc"):
        assert store.learning_curve("dies", metric) == store.learning_curve("twin", metric)
    store.close()


def test_workers_that_never_start_make_next_event_raise():
    # spawned: killed before it has imported torch (a forked worker may be ready in 0.05 s)
    executor = LocalExecutor(num_workers=1, startup_timeout=0.05, start_method="spawn")
    try:
        with pytest.raises(RuntimeError, match="local-0 failed to start 3 times in a row .*not "
                                               "ready 0.05 s after starting"):
            executor.next_event(timeout=TIMEOUT)
        with pytest.raises(RuntimeError, match="failed to start"):  # and keeps saying so
            executor.next_event(timeout=TIMEOUT)
        assert executor.wait_ready(timeout=1)  # returns at once: nothing more will start
    finally:
        executor.close()


# ---- run_job in this process ----------------------------------------------------------------


def test_tasks_of_one_job_train_as_if_alone(tmp_path):
    """Interleaved epochs with separate RNG streams: each trial matches its solo run."""
    def task(tid, width, seed, stop, where):
        return TrialTask(tid, spec({"width": width, "dropout": 0.3}, seed=seed), 0, stop, None,
                         str(tmp_path / f"{tid}-{where}.pt"))

    together: list = []
    run_job(Job("both", [task("a", 4, 1, 2, "both"), task("b", 6, 2, 3, "both")]), together.append)
    for tid, width, seed, stop in (("a", 4, 1, 2), ("b", 6, 2, 3)):
        alone: list = []
        run_job(Job(tid, [task(tid, width, seed, stop, "alone")]), alone.append)
        assert [e.metrics for e in together if isinstance(e, TrialResult) and e.trial_id == tid] \
            == [e.metrics for e in alone if isinstance(e, TrialResult)]
        both = load(str(tmp_path / f"{tid}-both.pt"))["model"]
        solo = load(str(tmp_path / f"{tid}-alone.pt"))["model"]
        assert all(torch.equal(both[k], solo[k]) for k in both)


def test_several_failures_in_one_job_name_every_culprit():
    events: list = []
    run_job(Job("j", [TrialTask("x", spec({"fail": "shape"}), 0, 1),
                      TrialTask("y", spec({"fail": "nan"}), 0, 1),
                      TrialTask("z", spec(), 0, 1)]), events.append)
    end = events[-1]
    assert isinstance(end, JobFailed) and end.trial_id is None
    assert "trial x: RuntimeError" in end.error and "trial y: TrainingError" in end.error
    assert [e.trial_id for e in events if isinstance(e, TrialResult)] == ["z"]


def test_trainer_spec_forms_and_references():
    context = WorkerContext()
    trainer = context.trainer({"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
                               "config": {"epochs": 2, "lr": 0.01}})
    assert trainer.config.lr == 0.01
    assert context.trainer({"class": "retiarii.engine.trainers.trainer:ClassifierTrainer",
                            "config": {"lr": 0.01, "epochs": 2}}) is trainer  # cached
    assert context.trainer(ref("TRAINER")).config.epochs == 4
    assert resolve_ref("retiarii.engine.storage.store:Store.close").__name__ == "close"
    with pytest.raises(ValueError, match="must be absolute"):
        resolve_ref("relative/file.py:X")
    with pytest.raises(ValueError, match="must look like"):
        resolve_ref("no_colon")
    with pytest.raises(TypeError, match="no build"):
        context.space("retiarii.engine.storage.store:Store")
    with pytest.raises(TypeError, match="not a Trainer subclass"):
        context.trainer({"class": "retiarii.engine.storage.store:Store"})


def test_pump_thread_blocks_without_polling(ex):
    """Idle, the pump sleeps in one wait call: the executor answers None on timeout, fast."""
    assert ex.next_event(timeout=0.05) is None
    assert any(t.name == "retiarii-local-executor" for t in threading.enumerate())


def test_each_worker_sees_its_own_gpu_round_robin():
    """devices=[...]: worker i gets CUDA_VISIBLE_DEVICES = devices[i % len(devices)] before
    torch is imported (CUDA then numbers that GPU 0 in the worker); devices=[] gives CPU-only
    workers (an empty CUDA_VISIBLE_DEVICES). Checked through what the workers' processes see,
    which needs no GPU."""
    with LocalExecutor(num_workers=3, devices=[5, 7], threads_per_worker=1) as ex:
        assert [s.device for s in ex._slots] == ["5", "7", "5"]
        ex.wait_ready(timeout=TIMEOUT)
        jobs = [f"j-dev-{i}" for i in range(6)]
        for job_id in jobs:
            ex.submit(Job(job_id, [TrialTask(job_id, spec(trainer=ref("DEVICE_REPORTING")),
                                             0, 1)]))
        events = wait_for(ex, jobs)
    seen = {}
    started = {e.job_id: e.worker for e in events if isinstance(e, JobStarted)}
    for event in events:
        if isinstance(event, TrialResult):
            seen.setdefault(started[event.job_id], set()).add(event.metrics["visible_device"])
            assert event.metrics["threads"] == 1.0
    assert all(len(devices) == 1 for devices in seen.values()), seen
    assert {d for devices in seen.values() for d in devices} <= {5.0, 7.0}
    assert {worker: devices.pop() for worker, devices in seen.items()} == \
        {name: float(d) for name, d in zip(["local-0", "local-1", "local-2"], [5, 7, 5])
         if name in seen}
    with LocalExecutor(num_workers=1, devices=[]) as ex:
        ex.submit(Job("j-cpu", [TrialTask("j-cpu", spec(trainer=ref("DEVICE_REPORTING")), 0, 1)]))
        result = next(e for e in wait_for(ex, ["j-cpu"]) if isinstance(e, TrialResult))
    assert result.metrics["visible_device"] == -1.0


@pytest.mark.parametrize("inherited, count, expected", [
    (None, 2, ["0", "1"]),  # this process sees every GPU: CUDA's own numbering
    ("3,5", 2, ["3", "5"]),  # this process was given GPUs 3 and 5: its workers get those
    ("GPU-a1, GPU-b2", 2, ["GPU-a1", "GPU-b2"]),  # UUIDs pass through
    ("4,9", 1, ["4"]),  # CUDA stops at an invalid entry: only the GPUs torch counts
    ("", 0, []),  # no GPU for this process: CPU-only workers
])
def test_default_devices_are_this_processs_own_gpus(monkeypatch, inherited, count, expected):
    """A driver started with CUDA_VISIBLE_DEVICES=3,5 must hand its workers "3" and "5", not
    "0" and "1" (which would name the machine's first GPUs, another job's perhaps)."""
    from retiarii.engine.executors.local import visible_gpus

    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert visible_gpus() == expected
