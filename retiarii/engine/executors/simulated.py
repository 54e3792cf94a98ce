"""A simulated executor: K virtual workers, a virtual clock, trials given by learning curves.

It implements the same :class:`~.base.Executor` interface as the local pool, so the trial
runner and every scheduler run on it unchanged; thousands of trials take seconds. Training a
step costs ``step_time / speed`` virtual seconds on a worker of that speed; its metrics come
from a learning-curve function, a table, or a stateful model. Checkpoints are records (which
trial, which step, the model state) kept in a dict that plays the disk, and ``checkpoint_in``
is honoured: a task resumes only from a checkpoint that exists and holds its ``start_step``.
Jobs of several tasks follow the rules every executor keeps (docs/architecture.md): a task that
fails stops only itself, a lost worker (``failures`` returning ``(message, True)``, or
:meth:`SimulatedExecutor.kill_worker`) stops the whole job at that instant.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..jobs.job import (
    Event, Executor, FailureKind, Job, JobFailed, JobFinished, JobStarted, TrialCheckpointed,
    TrialResult, TrialTask, combined_kind,
)

Curve = Callable[[dict, int], Mapping[str, float]]
Model = Callable[[dict, int, Any], tuple[Mapping[str, float], Any]]
Failure = Callable[[TrialTask, int, int], "str | tuple | None"]


@dataclass
class _Running:
    job: Job
    worker: int
    start: float
    end: float
    pending_ckpt: dict  # trial id -> the record its checkpoint will hold
    history_index: int


@dataclass(frozen=True)
class _WorkerFree:
    worker: int
    job_id: str
    early: bool = False  # freed by a cancel or a lost worker, before the job's planned end


def _table_curve(table: Mapping[str, Sequence[Any]], key: str, metric: str) -> Curve:
    def curve(spec: dict, step: int) -> Mapping[str, float]:
        if key not in spec:
            raise KeyError(f"the trial spec has no {key!r} to look up in the table "
                           f"(spec keys: {sorted(spec)}); pass table_key=")
        rows = table[spec[key]]
        if step > len(rows):
            raise IndexError(f"the table holds {len(rows)} steps for {spec[key]!r}, step {step} "
                             f"was asked for")
        row = rows[step - 1]
        return dict(row) if isinstance(row, Mapping) else {metric: float(row)}
    return curve


class SimulatedExecutor(Executor):
    """Run jobs on ``num_workers`` virtual workers in virtual time.

    A job starts on the worker named by ``job.meta["worker"]`` if that one is free (the runner
    asks for it when a trial continues), else on the lowest-numbered free worker, else queues.
    Each of its steps takes ``step_time`` (a number, or ``step_time(spec, step)``) divided by
    the worker's speed; after each step it reports a :class:`TrialResult`, then writes its
    checkpoint (``checkpoint_time`` later), then finishes (the worker is free at that instant).
    Events come out of :meth:`next_event` in virtual-time order (ties in the order they were
    produced) and :meth:`now` is the time of the last one. Give exactly one of ``curve``,
    ``table`` or ``model``.

    Example:
        >>> from retiarii.engine.jobs.job import Job, TrialTask
        >>> ex = SimulatedExecutor(2, curve=lambda spec, step: {"loss": spec["lr"] / step})
        >>> ex.submit(Job("j", [TrialTask("t", {"lr": 1.0}, 0, 2)]))
        >>> [type(e).__name__ for e in iter(ex.next_event, None)]
        ['JobStarted', 'TrialResult', 'TrialResult', 'TrialCheckpointed', 'JobFinished']
        >>> ex.now()
        2.0

    Args:
        num_workers: K.
        curve: ``curve(spec, step) -> metrics`` (step is 1-based, global across segments).
        table: ``{spec[table_key]: [metrics or float per step]}``.
        model: ``model(spec, step, state) -> (metrics, state)``: training with a state that
            travels in checkpoints (``state`` is None at a fresh start), e.g. for PBT.
        speeds: per-worker speed factors (default all 1.0).
        step_time: virtual seconds of one step at speed 1, or ``step_time(spec, step)``.
        checkpoint_time: virtual seconds to write a checkpoint.
        failures: ``failures(task, step, attempt)`` returns None, an error message (the
            model's own failure), ``(message, worker_lost)`` or ``(message, worker_lost, kind)``
            (a :class:`~.base.FailureKind`) to make that step fail. A missing or mismatched
            ``checkpoint_in`` fails with kind ``CHECKPOINT``.
        checkpoints: the dict that plays the disk (share it with a second executor to resume).
        start_time: the clock's initial value.
        table_key, table_metric: how ``table`` is indexed and what a bare float in it means.
    """

    def __init__(self, num_workers: int, curve: Curve | None = None, *,
                 table: Mapping[str, Sequence[Any]] | None = None, model: Model | None = None,
                 speeds: Sequence[float] | None = None,
                 step_time: float | Callable[[dict, int], float] = 1.0,
                 checkpoint_time: float = 0.0, failures: Failure | None = None,
                 checkpoints: dict[str, dict] | None = None, start_time: float = 0.0,
                 table_key: str = "id", table_metric: str = "loss"):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if sum(x is not None for x in (curve, table, model)) != 1:
            raise ValueError("give exactly one of curve=, table= or model=")
        speeds = [1.0] * num_workers if speeds is None else [float(s) for s in speeds]
        if len(speeds) != num_workers or any(s <= 0 for s in speeds):
            raise ValueError(f"speeds must be {num_workers} positive numbers, got {speeds}")
        if table is not None:
            curve = _table_curve(table, table_key, table_metric)
        if curve is not None:
            model = lambda spec, step, state, _c=curve: (_c(spec, step), state)  # noqa: E731
        self.num_slots = num_workers
        self.speeds = speeds
        self._model = model
        self._step_time = step_time
        self._checkpoint_time = checkpoint_time
        self._failures = failures
        self.checkpoints = {} if checkpoints is None else checkpoints
        self._clock = float(start_time)
        self._seq = itertools.count()
        self._heap: list[tuple[float, int, Any]] = []
        self._queue: list[Job] = []
        self._free = list(range(num_workers))
        self._running: dict[str, _Running] = {}
        self._cut: dict[str, JobFailed] = {}  # jobs ended early (cancel, lost worker): their end
        self._over: set[str] = set()  # jobs whose last event went out
        self.history: list[dict] = []  # one record per job run: what tests and plots read
        self.busy_time = [0.0] * num_workers
        self._closed = False

    # ---- the executor interface ------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self._closed:
            raise RuntimeError("submit() on a closed SimulatedExecutor")
        if not job.tasks:
            raise ValueError(f"job {job.job_id!r} has no tasks")
        if job.job_id in self._running or any(j.job_id == job.job_id for j in self._queue):
            raise ValueError(f"job id {job.job_id!r} is already queued or running")
        self._queue.append(job)
        self._dispatch()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event in virtual time; None when nothing is pending (nothing ever will be)
        or when the next event is more than ``timeout`` virtual seconds away (the clock then
        advances by ``timeout``)."""
        while self._heap:
            when, _, item = self._heap[0]
            if timeout is not None and when > self._clock + timeout:
                self._clock += timeout
                return None
            heapq.heappop(self._heap)
            if self._stale(item):
                continue
            self._clock = max(self._clock, when)
            if isinstance(item, _WorkerFree):
                self._free.append(item.worker)
                self._free.sort()
                self._dispatch()
                continue
            if isinstance(item, TrialCheckpointed):
                run = self._running[item.job_id]
                self.checkpoints[item.path] = dict(run.pending_ckpt[item.trial_id])
            if isinstance(item, (JobFinished, JobFailed)):
                self._running.pop(item.job_id, None)
                self._over.add(item.job_id)
            return item
        return None

    def cancel(self, job_id: str) -> None:
        for i, job in enumerate(self._queue):
            if job.job_id == job_id:
                del self._queue[i]
                self._push(self._clock, JobFailed(job_id, None, "cancelled"))
                return
        run = self._running.get(job_id)
        if run is not None and job_id not in self._cut:  # else already over: nothing to do
            self._end_now(run, JobFailed(job_id, None, "cancelled"))

    def kill_worker(self, worker: str) -> None:
        """The simulator's worker death (what SIGKILL does to a LocalExecutor worker): the job
        running on ``worker`` ("sim-0", ...) ends now with ``JobFailed(worker_lost=True)``,
        what it would have done later never happens, and the worker is at once available again
        (as a replacement process would be). An idle worker: no-op."""
        index = next((w for w in range(self.num_slots) if f"sim-{w}" == worker), None)
        if index is None:
            raise ValueError(f"no worker named {worker!r}; workers are sim-0 .. "
                             f"sim-{self.num_slots - 1}")
        run = next((r for r in self._running.values()
                    if r.worker == index and r.job.job_id not in self._cut), None)
        if run is not None:
            self._end_now(run, JobFailed(run.job.job_id, None,
                                         f"worker {worker} was killed at t={self._clock}",
                                         worker_lost=True))

    def now(self) -> float:
        return self._clock

    def close(self) -> None:
        self._closed = True
        self._queue.clear()

    # ---- internals -------------------------------------------------------------------------

    def _push(self, when: float, item: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), item))

    def _stale(self, item: Any) -> bool:
        """Events of a job that already ended (failed, cancelled, lost its worker) are dropped."""
        if isinstance(item, _WorkerFree):
            return item.job_id in self._cut and not item.early
        if item.job_id in self._over:
            return True
        return item.job_id in self._cut and item is not self._cut[item.job_id]

    def _end_now(self, run: _Running, event: JobFailed) -> None:
        """End a running job at the current time with ``event``, dropping its later events."""
        job_id = run.job.job_id
        self._cut[job_id] = event
        self.history[run.history_index]["end"] = self._clock
        cancelled = event.error == "cancelled" and not event.worker_lost
        self.history[run.history_index]["cancelled" if cancelled else "failed"] = True
        self.busy_time[run.worker] -= run.end - self._clock
        self._push(self._clock, event)
        self._push(self._clock, _WorkerFree(run.worker, job_id, early=True))

    def _duration(self, spec: dict, step: int, worker: int) -> float:
        base = self._step_time(spec, step) if callable(self._step_time) else self._step_time
        return float(base) / self.speeds[worker]

    def _dispatch(self) -> None:
        while self._queue and self._free:
            job = self._queue.pop(0)
            hint = job.meta.get("worker")  # the runner's wish: continue where it ran
            worker = next((w for w in self._free if f"sim-{w}" == hint), self._free[0])
            self._free.remove(worker)
            self._start(job, worker)

    def _start(self, job: Job, worker: int) -> None:
        """Lay out the job's whole event sequence on the virtual timeline.

        Its tasks train side by side (one step of each in turn, as ``worker.run_job`` does), so
        a task that fails stops only itself: the others run to their end, and the job lasts
        as long as its slowest task. A failure that loses the worker ends every task at that
        instant instead."""
        t = self._clock
        self._push(t, JobStarted(job.job_id, f"sim-{worker}"))
        pending_ckpt: dict[str, dict] = {}
        timeline: list[tuple[float, int, Any]] = []  # (time, task index, event)
        errors: dict[str, tuple[str, FailureKind]] = {}  # trial id -> why its task failed
        lost: tuple[float, int, str] | None = None  # the first worker loss: (time, task, why)
        end = t
        for index, task in enumerate(job.tasks):
            tt, (error, state) = t, self._resume_state(task)
            kind = FailureKind.CHECKPOINT  # (of an error at the start: its checkpoint_in)
            step, cut = task.start_step, False  # cut: its worker was lost during this task
            while error is None and not cut and step < task.stop_step:
                step += 1
                tt += self._duration(task.spec, step, worker)
                fail = self._failures(task, step, job.attempt) if self._failures else None
                if fail is not None:
                    message, worker_lost, *given = (fail, False) if isinstance(fail, str) else fail
                    if worker_lost:
                        if lost is None or (tt, index) < lost[:2]:
                            lost = (tt, index, message)
                        cut = True
                        break
                    error, kind = message, (given[0] if given else FailureKind.MODEL)
                    break
                try:
                    metrics, state = self._model(task.spec, step, state)
                except Exception as exc:  # noqa: BLE001 (a broken curve fails this trial, not the run)
                    error, kind = f"{type(exc).__name__}: {exc}", FailureKind.MODEL
                    break
                timeline.append((tt, index, TrialResult(
                    job.job_id, task.trial_id, step, {k: float(v) for k, v in metrics.items()},
                    tt)))
            if error is not None or cut:
                if error is not None:
                    errors[task.trial_id] = (error, kind)
                end = max(end, tt)
                continue
            path = task.checkpoint_out or f"sim://{task.trial_id}/step-{task.stop_step}"
            pending_ckpt[task.trial_id] = {"trial_id": task.trial_id, "step": task.stop_step,
                                           "state": state, "spec": dict(task.spec)}
            tt += self._checkpoint_time
            timeline.append((tt, index, TrialCheckpointed(job.job_id, task.trial_id,
                                                          task.stop_step, path)))
            end = max(end, tt)
        if lost is not None:
            # The worker died at that instant: what its tasks did before it stands (at that
            # same instant, the steps of the tasks before the culprit, which ran first).
            end, culprit, message = lost
            timeline = [item for item in timeline
                        if item[0] < end or (item[0] == end and item[1] < culprit)]
            terminal: Event = JobFailed(job.job_id, None, message, worker_lost=True)
        elif not errors:
            terminal = JobFinished(job.job_id)
        elif len(errors) == 1:
            (trial_id, (message, kind)), = errors.items()
            terminal = JobFailed(job.job_id, trial_id, message, kind=kind)
        else:
            terminal = JobFailed(job.job_id, None,
                                 "\n".join(f"trial {t}: {e}" for t, (e, _) in errors.items()),
                                 kind=combined_kind(k for _, k in errors.values()))
        for when, _, event in sorted(timeline, key=lambda item: item[:2]):  # stable: in order
            self._push(when, event)
        # The worker is free before the job's last event, so a segment submitted in reply
        # can go straight back onto it.
        self._push(end, _WorkerFree(worker, job.job_id))
        self._push(end, terminal)
        failed = isinstance(terminal, JobFailed)
        self._running[job.job_id] = _Running(job, worker, t, end, pending_ckpt, len(self.history))
        self.busy_time[worker] += end - t
        self.history.append({"job_id": job.job_id, "worker": worker, "start": t, "end": end,
                             "tasks": [dict(vars(task)) for task in job.tasks],
                             "failed": failed, "cancelled": False})

    def _resume_state(self, task: TrialTask) -> tuple[str | None, Any]:
        """(why the task cannot start, or None; the model state it starts from)."""
        if task.spec.get("inherit") and task.start_step == 0:
            return None, None  # a child inheriting weights: its results are the table's
        if task.checkpoint_in is not None:
            rec = self.checkpoints.get(task.checkpoint_in)
            if rec is None:
                return (f"checkpoint {task.checkpoint_in!r} of trial {task.trial_id!r} does "
                        f"not exist"), None
            if rec["step"] != task.start_step:
                return (f"checkpoint {task.checkpoint_in!r} holds step {rec['step']} but the "
                        f"task of trial {task.trial_id!r} starts at step {task.start_step}"), None
            return None, rec["state"]
        if task.start_step != 0:
            return (f"trial {task.trial_id!r} starts at step {task.start_step} without a "
                    f"checkpoint_in"), None
        return None, None
