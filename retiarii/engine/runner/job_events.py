"""The runner's side that hears the executor: every event of a job in flight (started,
profiled, a step's result, a checkpoint, finished, failed; a grouped job's end as its
:class:`~.grouping.JobPlanner` decides) becomes a journaled transition, a scheduler decision
applied, or a retry (the base class of :class:`~.trials.TrialRunner`, which owns
the trials, the journal and the executor).

A result is fed to the scheduler at once, except a segment's last, which waits for the
segment's checkpoint (a decision to continue must find one to continue from).

The failure policy (:meth:`TrialEvents._fail`): a failure's
:class:`~.executors.base.FailureKind` decides the retry. The model's own failure is
deterministic, so it fails the trial at once (unless ``model_retries`` asks otherwise); the
environment's (I/O, a lost worker, out of memory) is retried ``max_failures`` times in a row,
and when it persists the runner stops cleanly with the reason (``stop_reason``), leaving the
trial resumable; an unreadable checkpoint is dropped and the trial resumes from its newest
earlier one. Any other move than the lifecycle's raises :class:`~.trial.IllegalTransition`.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from ...strategies.schedulers.base import Decision
from ..storage.checkpoint import CheckpointPathError
from ..jobs.job import (
    FailureKind, JobFailed, JobFinished, JobProfiled, JobStarted, TrialCheckpointed, TrialResult,
    TrialTask,
)
from .flights import Flight, JobFlight, Outcome, result_dict
from .planner import Step
from .trial import Trial, TrialState

__all__ = ["TrialEvents"]

_log = logging.getLogger("retiarii.engine")


class TrialEvents:
    """Events of jobs in flight; see the module docstring."""

    # ---- events ---------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        job = self._inflight.get(event.job_id)
        if job is None:
            return  # an event of a job we no longer track (cancelled)
        if isinstance(event, JobStarted):
            job.started = self.executor.now()
            for trial_id in job.trials:
                flight = self._flights[trial_id]
                flight.worker, flight.started = event.worker, job.started
                flight.mark = flight.started
                if self.journal is not None:
                    self.journal.worker(trial_id, event.worker)
        elif isinstance(event, JobProfiled):
            job.units = tuple(event.units)
        elif isinstance(event, (TrialResult, TrialCheckpointed)):
            flight = self._flights.get(event.trial_id)
            if flight is None or flight.job_id != event.job_id:
                return  # not a task of this job: ignored
            trial = self.trials[event.trial_id]
            if isinstance(event, TrialResult):
                self._on_result(trial, flight, event)
            else:
                self._on_checkpoint(trial, flight, event)
        elif isinstance(event, (JobFinished, JobFailed)):
            self._inflight.pop(event.job_id)
            flights = [self._flights.pop(t) for t in job.trials]
            for flight in flights:
                self.timeline.append({"job_id": event.job_id, "trial_id": flight.trial_id,
                                      "worker": flight.worker, "start": flight.started,
                                      "end": self.executor.now(),
                                      "failed": isinstance(event, JobFailed) and not flight.done})
            if job.grouped:
                self._end_group(event, job, flights)
                return
            flight, = flights
            trial = self.trials[flight.trial_id]
            if flight.outcome is not None:
                return  # stopped or paused: the slot is simply free again
            if isinstance(event, JobFailed):
                if trial.state is TrialState.RUNNING:
                    self._fail(trial, event.kind, event.error, flight.task, event.worker_lost)
                return
            if flight.buffered is not None:  # an executor that wrote no checkpoint
                self._feed(trial, flight.buffered, None)
            self._continue([trial], flight.worker)

    def _end_group(self, event: Any, job: JobFlight, flights: list[Flight]) -> None:
        """A grouped job ended: apply what the planner decides (:meth:`~.grouping.JobPlanner.
        end`) in order (a failure by the failure policy, a group's failure by a retry alone,
        a finished segment by feeding its last result), record the job, continue the rest."""
        end = self.planner.end(
            event, job, flights, lambda t: self.trials[t].state is TrialState.RUNNING,
            self.trials[job.trials[0]], self.executor.now())
        by_id = {f.trial_id: f for f in flights}
        continuing: list[Trial] = []
        for trial_id, step, kind, error, lost in end.steps:
            trial, flight = self.trials[trial_id], by_id[trial_id]
            if step is Step.FAIL:
                self._fail(trial, kind, error, flight.task, lost=lost)
            elif step is Step.RETRY_ALONE:
                self._retry_alone(trial, error)
            else:
                if flight.buffered is not None:  # an executor that wrote no checkpoint
                    self._feed(trial, flight.buffered, None)
                continuing.append(trial)
        if self.on_group is not None:
            self.on_group(end.record)
        self._continue(continuing, flights[0].worker)

    def _retry_alone(self, trial: Trial, error: str) -> None:
        """A trial that did not finish its segment in a failed grouped job: back to PENDING
        from its last checkpoint, to train alone; not counted as its failure."""
        trial.attempts += 1
        first = (error.strip().splitlines() or [""])[0]
        self._move(trial, TrialState.ERRORED, f"group error: {first}")
        step, _ = trial.resume_point()
        self._move(trial, TrialState.PENDING, f"retry {trial.attempts} alone from step {step}")

    def _on_checkpoint(self, trial: Trial, flight: Flight, event: TrialCheckpointed) -> None:
        try:
            name = self.folder.name(event.path)
        except CheckpointPathError as err:  # not where it was asked to go: never used
            _log.error("trial %s: %s reported a checkpoint outside the run: %s",
                       trial.trial_id, type(self.executor).__name__, err)
            return
        if event.step == flight.task.stop_step:
            flight.done = True
        if flight.outcome is not None and event.step > self._fed.get(trial.trial_id, 0):
            return  # decided before it: steps the scheduler never saw (a group trains on)
        if self.journal is not None:  # a fused segment's mark goes with it (TrialCheckpointed)
            self.journal.checkpoint(trial.trial_id, event.step, name,
                                    **({"fused": True} if event.fused else {}))
        trial.checkpoints[event.step] = name
        trial.env_failures = 0  # progress: the environment works again
        if (flight.buffered is not None and flight.outcome is None
                and event.step == flight.task.stop_step):
            result, flight.buffered = flight.buffered, None
            self._feed(trial, result, flight)

    def _on_result(self, trial: Trial, flight: Flight, event: TrialResult) -> None:
        self.steps_trained += 1
        trial.time_total += max(0.0, event.time - flight.mark)
        flight.mark = event.time
        if flight.outcome is not None or event.step <= self._fed.get(trial.trial_id, 0):
            return  # decided already, or a step replayed after a retry
        metrics = {**event.metrics, "time_total_s": trial.time_total}
        # journaled again when a retry replays a step never fed (a lost segment's last): the
        # retry's values replace the lost attempt's, which another layout (fused) may have
        # rounded otherwise; the checkpoint the trial goes on from is the retry's
        if self.journal is not None:
            self.journal.result(trial.trial_id, event.step, metrics, event.time)
        self._journaled[trial.trial_id] = max(self._journaled.get(trial.trial_id, 0), event.step)
        trial.step, trial.last_result = event.step, result_dict(event.step, metrics)
        if event.step == flight.task.stop_step:
            flight.buffered = trial.last_result  # decide once the checkpoint exists
        else:
            self._feed(trial, trial.last_result, flight)

    def _feed(self, trial: Trial, result: dict, flight: Flight | None) -> None:
        """Ask the scheduler about one result and apply its decision (journal first)."""
        step = result["training_iteration"]
        decision = self.scheduler.on_trial_result(trial.trial_id, result)
        if not isinstance(decision, Decision):
            raise TypeError(f"{type(self.scheduler).__name__}.on_trial_result returned "
                            f"{decision!r}; return a retiarii.strategies.Decision")
        self._fed[trial.trial_id] = step
        self._fed_log.append([trial.trial_id, step])
        if self.on_result is not None:
            self.on_result(trial, result)
        mid_segment = flight is not None and step < flight.task.stop_step
        done = trial.max_steps is not None and step >= trial.max_steps
        if trial.state is not TrialState.RUNNING:  # replaying a decision already journaled
            if trial.state is TrialState.TERMINATED:
                self.scheduler.on_trial_complete(trial.trial_id, result)
        elif decision is Decision.STOP or done:
            self._stop_running(trial, "stopped by scheduler" if decision is Decision.STOP
                               else f"completed max_steps={trial.max_steps}")
        elif decision is Decision.PAUSE:
            self._move(trial, TrialState.PAUSED, "paused by scheduler")
            if flight is not None:
                flight.outcome = Outcome.PAUSE
                if mid_segment:  # resumes from the last checkpoint, redoing these steps
                    self._cancel_if_unwanted(flight.job_id)
        self._after_scheduler()

    def _fail(self, trial: Trial, kind: FailureKind, error: str, task: TrialTask | None = None,
              lost: bool = False) -> None:
        """A RUNNING trial failed: retry it, fail it for good, or stop the run (see the module
        docstring for which)."""
        trial.attempts += 1
        trial.error = error
        unreadable = None  # the step of its own checkpoint the segment could not start from
        if kind is FailureKind.CHECKPOINT:
            start = task.start_step if task is not None else None
            name = trial.checkpoints.get(start)
            if name is not None and task.checkpoint_in == os.path.join(self.folder.root, name):
                unreadable = start
            else:  # a PBT donor: the user must bring it back (or it is the executor's fault)
                kind = FailureKind.ENVIRONMENT
        if kind is FailureKind.MODEL:
            trial.model_failures += 1
            retry = trial.model_failures <= self.model_retries
        elif kind is FailureKind.ENVIRONMENT:
            trial.env_failures += 1
            retry = trial.env_failures <= self.max_failures
        else:
            retry = True  # bounded: each such failure removes one checkpoint
        final = kind is FailureKind.MODEL and not retry
        self._move(trial, TrialState.ERRORED,
                   f"{'worker lost' if lost else kind.value + ' error'}: {error}", final=final)
        if unreadable is not None:
            self._forget(trial, unreadable, error)
        if retry:
            step, _ = trial.resume_point()
            self._move(trial, TrialState.PENDING, f"retry {trial.attempts} from step {step}")
        elif final:
            self.scheduler.on_trial_error(trial.trial_id)
            self._after_scheduler()
        else:  # the environment keeps failing: stop cleanly; resume() retries the trial
            first = (error.strip().splitlines() or [""])[0]
            self.stop_reason = (f"trial {trial.trial_id} failed {trial.env_failures} times "
                                f"because of its environment, last with: {first}")
            _log.error("stopping: %s. Fix the cause, then resume: the trial is retried.",
                       self.stop_reason)

    def _forget(self, trial: Trial, step: int, error: str) -> None:
        """Stop using ``trial``'s checkpoint of ``step`` (missing or unreadable): its next
        segment starts from its newest earlier checkpoint. The file is left as it is."""
        name = trial.checkpoints.pop(step)
        if self.journal is not None and hasattr(self.journal, "forget_checkpoint"):
            self.journal.forget_checkpoint(trial.trial_id, step)
        back, _ = trial.resume_point()
        first = (error.strip().splitlines() or [""])[0]
        _log.warning("trial %s: its checkpoint of step %d (%s) cannot be read (%s); resuming "
                     "from step %d instead", trial.trial_id, step,
                     os.path.join(self.folder.root, name), first, back)
