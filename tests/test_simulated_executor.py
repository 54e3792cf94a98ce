"""The simulated executor: virtual time, heterogeneous workers, checkpoint semantics, cancel,
failures; plus the executor contract suite (tests/executor_contract.py) run against it."""
from __future__ import annotations

import pytest

from retiarii.engine.jobs.job import (
    Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult, TrialTask,
)
from retiarii.engine.executors.simulated import SimulatedExecutor

from executor_contract import ExecutorContract


def lin(spec, step):
    return {"loss": spec.get("a", 1.0) / step}


def drain(ex):
    return list(iter(ex.next_event, None))


def job(job_id, trial="t", start=0, stop=1, spec=None, ckpt_in=None, ckpt_out=None, attempt=0):
    return Job(job_id, [TrialTask(trial, spec or {}, start, stop, ckpt_in, ckpt_out)],
               attempt=attempt)


def planned(task, step, attempt):
    """The contract's failing tasks: raise in step ``hparams["raise_in_step"]``."""
    if task.spec.get("hparams", {}).get("raise_in_step") == step:
        return f"RuntimeError: planned failure in step {step}"
    return None


class TestSimulatedContract(ExecutorContract):
    LONG = 1000  # the simulator lays a job's events out when it starts

    @pytest.fixture
    def ex(self):
        return SimulatedExecutor(2, lin, failures=planned)

    def task(self, trial_id, stop, *, raise_in_step=None, checkpoint_out=None):
        return TrialTask(trial_id, {"hparams": {"raise_in_step": raise_in_step}}, 0, stop,
                         None, checkpoint_out)

    def kill_worker(self, ex, worker):
        ex.kill_worker(worker)


def test_virtual_time_speeds_and_lowest_free_worker():
    ex = SimulatedExecutor(2, lin, speeds=[1.0, 4.0], step_time=2.0)
    ex.submit(job("slow", trial="a", stop=2))  # worker 0: 2 s per step
    ex.submit(job("fast", trial="b", stop=2))  # worker 1: 0.5 s per step
    ex.submit(job("queued", trial="c", stop=1))  # waits for the first free worker (1, at t=1)
    events = drain(ex)
    times = [(type(e).__name__, e.job_id, e.time) for e in events if isinstance(e, TrialResult)]
    assert times == [("TrialResult", "fast", 0.5), ("TrialResult", "fast", 1.0),
                     ("TrialResult", "queued", 1.5), ("TrialResult", "slow", 2.0),
                     ("TrialResult", "slow", 4.0)]
    started = {e.job_id: e.worker for e in events if isinstance(e, JobStarted)}
    assert started == {"slow": "sim-0", "fast": "sim-1", "queued": "sim-1"}
    assert ex.now() == 4.0
    assert ex.busy_time == [4.0, 1.5]


def test_resume_continues_at_next_step_with_model_state():
    def model(spec, step, state):
        total = (state or 0) + step  # the state is the sum of steps trained so far
        return {"total": total}, total

    ex = SimulatedExecutor(1, model=model)
    ex.submit(job("a", start=0, stop=2, ckpt_out="ck/2"))
    drain(ex)
    assert ex.checkpoints["ck/2"]["step"] == 2 and ex.checkpoints["ck/2"]["state"] == 3
    ex.submit(job("b", start=2, stop=3, ckpt_in="ck/2", ckpt_out="ck/3"))
    results = [e for e in drain(ex) if isinstance(e, TrialResult)]
    assert [(r.step, r.metrics["total"]) for r in results] == [(3, 6.0)]  # 1+2 then +3


@pytest.mark.parametrize("ckpt_in,start,msg", [("nope", 2, "does not exist"),
                                               ("ck/2", 1, "holds step 2"),
                                               (None, 2, "without a checkpoint_in")])
def test_checkpoint_mismatch_fails_the_job_clearly(ckpt_in, start, msg):
    ex = SimulatedExecutor(1, lin)
    ex.submit(job("a", stop=2, ckpt_out="ck/2"))
    drain(ex)
    ex.submit(job("b", start=start, stop=start + 1, ckpt_in=ckpt_in))
    failed = [e for e in drain(ex) if isinstance(e, JobFailed)]
    assert len(failed) == 1 and msg in failed[0].error and failed[0].trial_id == "t"


def test_cancel_running_job_frees_worker_now_and_drops_its_events():
    ex = SimulatedExecutor(1, lin, step_time=10.0)
    ex.submit(job("a", stop=3))
    ex.submit(job("b", trial="u", stop=1))
    first = [ex.next_event(), ex.next_event()]  # started, result at 10
    assert isinstance(first[1], TrialResult) and ex.now() == 10.0
    ex.cancel("a")
    rest = drain(ex)
    assert isinstance(rest[0], JobFailed) and rest[0].error == "cancelled"
    assert not any(e.job_id == "a" for e in rest[1:])
    b_result = next(e for e in rest if isinstance(e, TrialResult))
    assert b_result.time == 20.0  # b started at the cancel (t=10), not when a would have ended
    assert ex.busy_time == [20.0]
    ex.cancel("a")  # cancelling a finished job is a no-op


def test_failures_and_worker_loss():
    def fail(task, step, attempt):
        if task.trial_id == "t" and step == 2 and attempt == 0:
            return "CUDA out of memory"
        if task.trial_id == "u":
            return ("node gone", True)
        return None

    ex = SimulatedExecutor(1, lin, failures=fail)
    ex.submit(job("a", stop=3))
    events = drain(ex)
    assert [type(e).__name__ for e in events] == ["JobStarted", "TrialResult", "JobFailed"]
    assert events[-1].error == "CUDA out of memory" and not events[-1].worker_lost
    assert ex.now() == 2.0  # the failing step's time is spent
    ex.submit(job("a2", start=0, stop=3, attempt=1))
    assert isinstance(drain(ex)[-1], JobFinished)
    ex.submit(job("b", trial="u"))
    lost = drain(ex)[-1]
    assert lost.worker_lost and lost.trial_id is None  # a lost worker blames no trial


def test_a_lost_worker_ends_every_task_of_its_job_at_that_instant():
    def fail(task, step, attempt):
        return ("node gone", True) if task.trial_id == "b" and step == 2 else None

    ex = SimulatedExecutor(1, lin, failures=fail)
    ex.submit(Job("j", [TrialTask(t, {}, 0, 3, None, f"ck/{t}") for t in "abc"]))
    events = drain(ex)
    shape = [(type(e).__name__, getattr(e, "trial_id", None), getattr(e, "step", None))
             for e in events]
    # Steps run one of each task in turn: a's step 2 came before b's, c's never happened.
    assert shape == [("JobStarted", None, None), ("TrialResult", "a", 1), ("TrialResult", "b", 1),
                     ("TrialResult", "c", 1), ("TrialResult", "a", 2), ("JobFailed", None, None)]
    assert events[-1].worker_lost and events[-1].error == "node gone" and ex.now() == 2.0
    assert ex.checkpoints == {} and ex.history[-1]["failed"]


def test_kill_worker_names_a_worker_and_spares_idle_ones():
    ex = SimulatedExecutor(2, lin)
    ex.kill_worker("sim-1")  # idle: nothing happens
    assert drain(ex) == []
    with pytest.raises(ValueError, match="no worker named 'local-0'"):
        ex.kill_worker("local-0")


def test_curve_errors_fail_the_trial_not_the_run():
    ex = SimulatedExecutor(1, lambda spec, step: {"loss": 1 / (step - 2)})
    ex.submit(job("a", stop=3))
    events = drain(ex)
    assert isinstance(events[-1], JobFailed) and "ZeroDivisionError" in events[-1].error


def test_table_input():
    ex = SimulatedExecutor(1, table={"x": [0.9, {"loss": 0.5, "acc": 0.7}]})
    ex.submit(job("a", spec={"id": "x"}, stop=2))
    metrics = [e.metrics for e in drain(ex) if isinstance(e, TrialResult)]
    assert metrics == [{"loss": 0.9}, {"loss": 0.5, "acc": 0.7}]
    ex.submit(job("b", spec={"id": "x"}, start=0, stop=3))
    assert "holds 2 steps" in drain(ex)[-1].error


def test_timeout_is_virtual_and_multi_task_jobs():
    ex = SimulatedExecutor(1, lin, step_time=5.0)
    ex.submit(Job("j", [TrialTask("a", {}, 0, 1), TrialTask("b", {}, 0, 2)]))
    assert isinstance(ex.next_event(timeout=1.0), JobStarted)
    assert ex.next_event(timeout=1.0) is None and ex.now() == 1.0  # next event is at t=5
    events = drain(ex)
    assert [(type(e).__name__, getattr(e, "trial_id", None)) for e in events] == [
        ("TrialResult", "a"), ("TrialCheckpointed", "a"), ("TrialResult", "b"),
        ("TrialResult", "b"), ("TrialCheckpointed", "b"), ("JobFinished", None)]
    assert ex.now() == 10.0  # the job lasts as long as its slowest trial


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match="exactly one"):
        SimulatedExecutor(2)
    with pytest.raises(ValueError, match="speeds"):
        SimulatedExecutor(2, lin, speeds=[1.0])
    ex = SimulatedExecutor(1, lin)
    ex.submit(job("a"))
    with pytest.raises(ValueError, match="already queued or running"):
        ex.submit(job("a"))
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit(job("z"))


def test_checkpointed_event_carries_record():
    ex = SimulatedExecutor(1, lin)
    ex.submit(job("a", spec={"a": 2.0}, stop=1))
    ck = next(e for e in drain(ex) if isinstance(e, TrialCheckpointed))
    assert ex.checkpoints[ck.path] == {"trial_id": "t", "step": 1, "state": None,
                                       "spec": {"a": 2.0}}
