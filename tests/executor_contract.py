"""The executor contract (docs/architecture.md, "Jobs and executors"): one suite that every
executor subclasses, as Optuna's storages share ``pytest_storages.py``.

A subclass provides an ``ex`` fixture (an executor with at least two slots, which the tests
leave idle), ``task(...)`` (a trial of that executor that trains, or raises in a given step),
``kill_worker(ex, worker)`` (the worker process dies mid-job) and ``LONG`` (steps of a task
that only ends when it is cancelled or its worker dies). Jobs here hold several tasks, as merged
jobs of cross-model optimization will.
"""
from __future__ import annotations

from retiarii.engine.jobs.job import (
    Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed, TrialResult, TrialTask,
)

TIMEOUT = 120  # seconds to wait for any one event: generous for a loaded 2-core machine
QUIET = 0.5  # seconds without an event that show nothing more is coming


def wait_for(ex, job_ids) -> list:
    """Events until every job in ``job_ids`` has ended; fails the test on a stall."""
    pending, events = set(job_ids), []
    while pending:
        event = ex.next_event(timeout=TIMEOUT)
        assert event is not None, f"no event in {TIMEOUT}s; still waiting for {pending}"
        events.append(event)
        if isinstance(event, (JobFinished, JobFailed)):
            pending.discard(event.job_id)
    return events


def wait_for_result(ex, job_id) -> list:
    """Events until the first TrialResult of ``job_id`` (the job is then mid-way)."""
    events = []
    while not (events and isinstance(events[-1], TrialResult) and events[-1].job_id == job_id):
        event = ex.next_event(timeout=TIMEOUT)
        assert event is not None, f"no event in {TIMEOUT}s; {job_id} never reported a result"
        assert not (isinstance(event, (JobFinished, JobFailed)) and event.job_id == job_id), event
        events.append(event)
    return events


def check_job(events: list, job: Job) -> list:
    """The events of ``job`` among ``events``, checked against the event order every executor
    promises; returns them."""
    mine = [e for e in events if e.job_id == job.job_id]
    ends = [e for e in mine if isinstance(e, (JobFinished, JobFailed))]
    assert len(ends) == 1 and mine[-1] is ends[0], f"one terminal event, last: {mine}"
    started = [e for e in mine if isinstance(e, JobStarted)]
    if started:
        assert len(started) == 1 and mine[0] is started[0]
    else:  # cancelled before it started
        assert mine == [JobFailed(job.job_id, None, "cancelled")]
    for task in job.tasks:
        steps = [e.step for e in mine if isinstance(e, TrialResult) and e.trial_id == task.trial_id]
        assert steps == list(range(task.start_step + 1, task.start_step + 1 + len(steps)))
        assert all(step <= task.stop_step for step in steps)
        ckpts = [i for i, e in enumerate(mine)
                 if isinstance(e, TrialCheckpointed) and e.trial_id == task.trial_id]
        assert len(ckpts) <= 1
        if ckpts:
            assert steps[-1] == task.stop_step and mine[ckpts[0]].step == task.stop_step
            last = max(i for i, e in enumerate(mine)
                       if isinstance(e, TrialResult) and e.trial_id == task.trial_id)
            assert ckpts[0] > last
        elif isinstance(ends[0], JobFinished):
            assert task.checkpoint_out is None, f"{task.trial_id} finished without checkpoint"
    return mine


def checkpointed(events: list) -> set[str]:
    return {e.trial_id for e in events if isinstance(e, TrialCheckpointed)}


def results(events: list, trial_id: str) -> list[int]:
    return [e.step for e in events if isinstance(e, TrialResult) and e.trial_id == trial_id]


class ExecutorContract:
    """What every executor must do; see the module docstring for what subclasses provide."""

    LONG = 100_000

    def task(self, trial_id: str, stop: int, *, raise_in_step: int | None = None,
             checkpoint_out: str | None = None) -> TrialTask:
        raise NotImplementedError  # pragma: no cover - subclasses provide it

    def kill_worker(self, ex, worker: str) -> None:
        raise NotImplementedError  # pragma: no cover - subclasses provide it

    def quiet(self, ex) -> None:
        """Every job has ended: nothing more may come."""
        assert ex.next_event(timeout=QUIET) is None

    def test_multi_task_job_event_order(self, ex, tmp_path):
        job = Job("c-order", [self.task("a", 2, checkpoint_out=str(tmp_path / "a.ckpt")),
                              self.task("b", 1, checkpoint_out=str(tmp_path / "b.ckpt"))])
        ex.submit(job)
        events = check_job(wait_for(ex, [job.job_id]), job)
        shape = [(type(e).__name__, getattr(e, "trial_id", None), getattr(e, "step", None))
                 for e in events]
        assert shape == [("JobStarted", None, None),
                         ("TrialResult", "a", 1), ("TrialResult", "b", 1),
                         ("TrialCheckpointed", "b", 1),
                         ("TrialResult", "a", 2), ("TrialCheckpointed", "a", 2),
                         ("JobFinished", None, None)]
        assert events[-2].path == str(tmp_path / "a.ckpt")
        self.quiet(ex)

    def test_one_failing_task_lets_the_others_finish(self, ex, tmp_path):
        job = Job("c-one", [self.task("a", 2, checkpoint_out=str(tmp_path / "a.ckpt")),
                            self.task("bad", 3, raise_in_step=2,
                                      checkpoint_out=str(tmp_path / "bad.ckpt")),
                            self.task("c", 3, checkpoint_out=str(tmp_path / "c.ckpt"))])
        ex.submit(job)
        events = check_job(wait_for(ex, [job.job_id]), job)
        end = events[-1]
        assert isinstance(end, JobFailed) and end.trial_id == "bad" and not end.worker_lost
        assert "planned failure in step 2" in end.error
        assert checkpointed(events) == {"a", "c"}
        assert (results(events, "a"), results(events, "bad"), results(events, "c")) == \
            ([1, 2], [1], [1, 2, 3])
        self.quiet(ex)

    def test_several_failing_tasks_name_every_culprit(self, ex, tmp_path):
        job = Job("c-several", [self.task("x", 2, raise_in_step=1),
                                self.task("y", 2, raise_in_step=2),
                                self.task("z", 2, checkpoint_out=str(tmp_path / "z.ckpt"))])
        ex.submit(job)
        events = check_job(wait_for(ex, [job.job_id]), job)
        end = events[-1]
        assert isinstance(end, JobFailed) and end.trial_id is None and not end.worker_lost
        assert "trial x: " in end.error and "trial y: " in end.error
        assert "trial z" not in end.error
        assert checkpointed(events) == {"z"}
        assert (results(events, "x"), results(events, "y"), results(events, "z")) == \
            ([], [1], [1, 2])
        self.quiet(ex)

    def test_worker_lost_mid_job_fails_the_whole_job(self, ex, tmp_path):
        job = Job("c-lost", [self.task("a", self.LONG), self.task("b", self.LONG)])
        ex.submit(job)
        events = wait_for_result(ex, job.job_id)
        worker = next(e.worker for e in events if isinstance(e, JobStarted))
        self.kill_worker(ex, worker)
        events += wait_for(ex, [job.job_id])
        events = check_job(events, job)
        end = events[-1]
        assert isinstance(end, JobFailed) and end.worker_lost and end.trial_id is None
        assert not checkpointed(events)
        assert 1 in results(events, "a") and max(results(events, "b") or [0]) < self.LONG
        # The executor goes on: a new job runs (on a replacement of the lost worker, or not).
        after = Job("c-after-lost", [self.task("n", 1, checkpoint_out=str(tmp_path / "n.ckpt"))])
        ex.submit(after)
        assert isinstance(check_job(wait_for(ex, [after.job_id]), after)[-1], JobFinished)
        self.quiet(ex)

    def test_cancel_a_running_multi_task_job(self, ex, tmp_path):
        job = Job("c-cancel", [self.task("a", self.LONG), self.task("b", self.LONG)])
        ex.submit(job)
        events = wait_for_result(ex, job.job_id)
        ex.cancel(job.job_id)
        ex.cancel(job.job_id)  # twice is harmless
        events += wait_for(ex, [job.job_id])
        events = check_job(events, job)
        assert events[-1] == JobFailed(job.job_id, None, "cancelled")
        assert not checkpointed(events)
        ex.cancel(job.job_id)  # after its end: a no-op
        ex.cancel("no-such-job")
        after = Job("c-after-cancel", [self.task("n", 1)])
        ex.submit(after)
        assert isinstance(check_job(wait_for(ex, [after.job_id]), after)[-1], JobFinished)
        self.quiet(ex)

    def test_cancel_a_queued_job(self, ex):
        blockers = [Job(f"c-block-{i}", [self.task(f"h{i}", self.LONG)])
                    for i in range(ex.num_slots)]
        for job in blockers:
            ex.submit(job)
        queued = Job("c-queued", [self.task("q", 1), self.task("r", 1)])
        ex.submit(queued)
        ex.cancel(queued.job_id)
        for job in blockers:
            ex.cancel(job.job_id)
        events = wait_for(ex, [queued.job_id] + [job.job_id for job in blockers])
        assert check_job(events, queued) == [JobFailed(queued.job_id, None, "cancelled")]
        for job in blockers:
            assert check_job(events, job)[-1] == JobFailed(job.job_id, None, "cancelled")
        self.quiet(ex)
