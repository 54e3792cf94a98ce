"""The control loop that steers trials with a scheduler's decisions: the :class:`TrialRunner`.

A :class:`~.trial.Trial` moves through ``PENDING -> RUNNING -> PAUSED <-> RUNNING -> TERMINATED``, with
``RUNNING -> ERRORED -> PENDING`` on a retry (the failure policy: :mod:`.trial_events`).

The :class:`TrialRunner` keeps every executor slot busy: it trains each trial one *segment*
(a :class:`~.executors.Job`) at a time, asks the scheduler for a
:class:`~retiarii.strategies.Decision` after every step and applies it, hands a freed slot to
the next trial in the same step (reclaim, repack, relaunch), creates the trials a scheduler
spawns from their parent's checkpoint, and retries failed trials. Every transition is written to
the journal before it takes effect, and :meth:`TrialRunner.resume` rebuilds the run from the
journal after the driver dies.

The runner knows nothing of the executor beyond its interface and nothing of the scheduler
beyond :class:`~retiarii.strategies.schedulers.base.Scheduler`.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Hashable

from ...strategies.schedulers.base import Scheduler, Spawn
from ..storage.checkpoint import CheckpointDir, CheckpointPathError, check_trial_id
from ..jobs.job import Executor, FailureKind, Job, TrialTask
from .flights import Flight, JobFlight, Outcome, failure_of, result_dict
from .planner import JobPlanner
from .packer import Packer
from .journal import Journal, MemoryJournal
from .trial import ALLOWED, IllegalTransition, Trial, TrialState
from .job_events import TrialEvents
from .journal_replay import read_journal
from .spawns import check_respawn, check_spawn, spawn_start
from .waiting import WaitingTrials

# Trial, its lifecycle and the journals live in trial.py and journal.py; imported from here too.
__all__ = ["TrialRunner", "failure_of", "Trial", "TrialState", "ALLOWED", "IllegalTransition",
           "Journal", "MemoryJournal"]

_log = logging.getLogger("retiarii.engine")

TIMELINE_JOBS = 10_000  # finished jobs TrialRunner.timeline keeps (Gantt charts): ~5 MiB


class TrialRunner(TrialEvents):
    """Drive trials on an executor under a scheduler until no work is left or a budget is hit.

    Example:
        >>> from retiarii.engine.executors.simulated import SimulatedExecutor
        >>> from retiarii.strategies.schedulers.base import Scheduler
        >>> ex = SimulatedExecutor(2, curve=lambda spec, step: {"loss": spec["lr"] / step})
        >>> runner = TrialRunner(ex, Scheduler(), max_steps=3)
        >>> for lr in (0.1, 0.2, 0.3):
        ...     _ = runner.add_trial({"lr": lr})
        >>> runner.run()
        True
        >>> [t.state.name for t in runner.trials.values()], ex.now()
        (['TERMINATED', 'TERMINATED', 'TERMINATED'], 6.0)

    Args:
        executor: where segments run (its ``num_slots`` is the number of workers).
        scheduler: the training-control algorithm.
        journal: written before every transition; None keeps nothing.
        max_failures: retries of a trial (from its last checkpoint) after failures of its
            environment (an ``OSError`` such as a read-only checkpoint folder, a lost worker,
            out of memory); one more and the runner stops (:attr:`stop_reason`), leaving the
            trial ERRORED but resumable: :meth:`resume` retries it.
        model_retries: retries after the model's own failure (a shape error, a NaN loss). Such
            a failure is deterministic, so by default (0) the trial fails for good at once.
        segment: steps per job. The scheduler still decides after every step; a PAUSE or STOP
            before a segment's end cancels it (a paused trial then resumes from its last
            checkpoint, redoing those steps), so keep it 1 or a divisor of the rung length.
        max_steps: default length of a trial (None: until the scheduler stops it).
        max_total_steps: compute budget in steps; max_time: budget on the executor's clock.
            Once hit, no segment starts and running trials pause at their segment's end.
        checkpoint_dir: the folder checkpoints are written to, and the only one they are read
            from or named in: the journal records names relative to it, and a name or trial id
            that would reach outside it is refused.
        source: asked for the config of a new trial whenever a slot is free and the scheduler
            has nothing to resume or spawn (an exploration strategy's instantiation control);
            None when it has nothing more.
        on_result: called with (trial, result) after every result the scheduler saw.
        on_trial_end: called with the trial once it is TERMINATED, or ERRORED for good.
        id_prefix: prepended to generated trial ids.
        spawn_config: turns a scheduler's :class:`Spawn` (hyper-parameters) and its parent
            trial into the config the child trial runs with (the experiment makes a worker
            spec of it); default: the spawn's config as it is.
        planner: which trials train as one job, in which layout, and what a grouped job's
            end decides (:class:`~.grouping.JobPlanner`: cross-model optimization,
            docs/optimization.md). None: a job per trial.
        packer: how a batch of trials is split over the free slots (:class:`~.placing.Packer`;
            None: as evenly as they go).
        on_group: called with the :class:`~..jobs.reports.PlanRecord` of every grouped job
            once it ends (trials, status ``merged``/``reverted``/``failed``, why, measured
            speed-up, its units' reports): the plans table.
    """

    def __init__(self, executor: Executor, scheduler: Scheduler, journal: Journal | None = None,
                 *, max_failures: int = 3, model_retries: int = 0, segment: int = 1,
                 max_steps: int | None = None,
                 max_total_steps: int | None = None, max_time: float | None = None,
                 checkpoint_dir: str = "checkpoints",
                 source: Callable[[], dict | None] | None = None,
                 on_result: Callable[[Trial, dict], None] | None = None,
                 on_trial_end: Callable[[Trial], None] | None = None, id_prefix: str = "",
                 spawn_config: Callable[[Spawn, "Trial | None"], dict] | None = None,
                 planner: JobPlanner | None = None, packer: Packer | None = None,
                 on_group: Callable[[Any], None] | None = None):
        if segment < 1:
            raise ValueError(f"segment must be >= 1 step, got {segment}")
        self.executor, self.scheduler, self.journal = executor, scheduler, journal
        self.max_failures, self.segment, self.max_steps = max_failures, segment, max_steps
        self.model_retries = model_retries
        self.max_total_steps, self.max_time = max_total_steps, max_time
        self.checkpoint_dir = checkpoint_dir.rstrip("/")
        self.folder = CheckpointDir(checkpoint_dir)
        self.stop_reason: str | None = None  # why the run stopped with work left (environment)
        self.trials: dict[str, Trial] = {}
        self.steps_trained = 0  # every step any job reported, replays included
        self.timeline: collections.deque[dict] = collections.deque(maxlen=TIMELINE_JOBS)  # latest
        self._order: dict[str, int] = {}
        self._inflight: dict[str, JobFlight] = {}  # job id -> its trials
        self._flights: dict[str, Flight] = {}  # trial id -> its segment in flight
        self._fed: dict[str, int] = {}  # trial -> last step the scheduler saw
        self._fed_log: list[list] = []  # [trial, step] each time _fed changed (journaled)
        self._journaled: dict[str, int] = {}
        self._orphans: dict[str, Trial] = {}
        self._waiting = WaitingTrials()
        self._jobs = 0
        self._ids = 0
        self.source, self.on_result, self.on_trial_end = source, on_result, on_trial_end
        self.id_prefix = id_prefix  # trial ids are unique per store: one prefix per experiment
        self.spawn_config = spawn_config or (lambda spawn, parent: dict(spawn.config))
        self.planner = planner or JobPlanner()
        self.packer = packer or Packer(batch_models=self.planner.batch_models)
        self.on_group = on_group

    # ---- public API -----------------------------------------------------------------------

    def add_trial(self, config: dict, trial_id: str | None = None,
                  max_steps: int | None = None) -> Trial:
        """Add a PENDING trial (a fresh start) and tell the scheduler."""
        trial_id = trial_id or self._new_id()
        if trial_id in self.trials or trial_id in self._orphans:
            raise ValueError(f"a trial named {trial_id!r} already exists")
        trial = Trial(trial_id, dict(config), max_steps=max_steps or self.max_steps)
        self._register(trial)
        self._after_scheduler()
        return trial

    def run(self, max_events: int | None = None) -> bool:
        """Process events until no work is left (True), or ``max_events`` were handled, or the
        environment kept failing (False; :attr:`stop_reason` says why)."""
        self._fill()
        handled = 0
        while self._inflight:
            if max_events is not None and handled >= max_events:
                return False
            event = self.executor.next_event()
            if event is None:
                raise RuntimeError(f"{type(self.executor).__name__}.next_event() returned None "
                                   f"while {len(self._inflight)} job(s) are in flight")
            self._on_event(event)
            handled += 1
            self._fill()
        if self.stop_reason is not None:
            return False
        if not self.budget_hit():
            self._close_leftovers()
        return True

    def budget_hit(self) -> bool:
        return ((self.max_total_steps is not None and self.steps_trained >= self.max_total_steps)
                or (self.max_time is not None and self.executor.now() >= self.max_time))

    def checkpoints(self) -> list[tuple[str, int, str]]:
        """(trial, step, name: ``self.folder.path(name)``) of every checkpoint written."""
        return [(t, s, p) for t, tr in self.trials.items()
                for s, p in sorted(tr.checkpoints.items())]

    @property
    def running(self) -> int:
        """Trials training now: a segment in flight, the trial RUNNING."""
        return len(self._training())

    @property
    def jobs_running(self) -> int:  # a grouped job trains several; one all ended trains none
        return len({f.job_id for f in self._training()})

    def _training(self) -> list[Flight]:
        return [f for f in self._flights.values()
                if f.trial_id in self.trials and self.trials[f.trial_id].state is TrialState.RUNNING]

    def states(self) -> dict[str, TrialState]:
        return {t: tr.state for t, tr in self.trials.items()}

    @classmethod
    def resume(cls, executor: Executor, scheduler: Scheduler, journal: Journal,
               **kwargs: Any) -> "TrialRunner":
        """Rebuild a runner from ``journal`` after the driver died; the scheduler gets its saved
        state back, RUNNING trials go back to PENDING and continue from their last checkpoint."""
        runner = cls(executor, scheduler, journal, **kwargs)
        replay = read_journal(journal, runner._usable)
        runner.trials, runner._journaled = replay.trials, replay.journaled
        runner._order = {trial_id: i for i, trial_id in enumerate(replay.trials)}
        saved, results, failed_by = replay.saved, replay.results, replay.failed_by
        known = 0
        if saved is not None:
            scheduler.load_state_dict(saved["scheduler"])
            runner._fed_log = [list(e) for e in saved["fed"]]
            runner._fed = {trial_id: step for trial_id, step in runner._fed_log}
            known = saved["known"]
        for trial_id, index in runner._order.items():
            trial = runner.trials[trial_id]
            if index >= known and trial.state is TrialState.PENDING:  # the scheduler never knew it
                if trial.spawned:  # adopted if the scheduler spawns it again
                    runner._orphans[trial_id] = runner.trials.pop(trial_id)
                    continue
                scheduler.on_trial_add(trial_id, trial.config)
            runner._track(trial)
        for trial, p in {(t.trial_id, p["step"]): (t, p) for t, p in results}.values():  # undecided
            if (trial.trial_id in runner.trials and p["step"] > runner._fed.get(trial.trial_id, 0)
                    and p["step"] <= max(trial.checkpoints, default=0)):
                runner._feed(trial, result_dict(p["step"], p["metrics"]), None)
        for trial in runner.trials.values():
            if trial.state is TrialState.RUNNING:
                runner._move(trial, TrialState.PENDING, "driver restarted")
            elif trial.state is TrialState.ERRORED and (
                    failed_by.get(trial.trial_id) is not FailureKind.MODEL
                    or trial.model_failures <= runner.model_retries):
                # the environment failed it (the user may have fixed it since), or a retry of
                # the model's own failure was due when the driver died
                runner._move(trial, TrialState.PENDING, "retry after driver restart")
        runner._after_scheduler()
        return runner

    # ---- bookkeeping ----------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            self._ids += 1
            trial_id = f"{self.id_prefix}trial-{self._ids:04d}"
            if trial_id not in self.trials and trial_id not in self._orphans:
                return trial_id

    def _usable(self, trial: Trial, name: str) -> bool:
        """Whether a checkpoint name read back from the journal stays inside the checkpoint
        folder; one that does not is refused, and said so."""
        try:
            self.folder.path(name)
            return True
        except CheckpointPathError as err:
            _log.error("trial %s: ignoring a checkpoint the journal names: %s", trial.trial_id,
                       err)
            return False

    def _register(self, trial: Trial) -> None:
        check_trial_id(trial.trial_id)  # its checkpoints go in a folder named after it
        if self.journal is not None:
            self.journal.trial_added(trial)
        self.trials[trial.trial_id] = trial
        self._order[trial.trial_id] = len(self._order)
        self._track(trial)
        self.scheduler.on_trial_add(trial.trial_id, trial.config)

    def _move(self, trial: Trial, new: TrialState, reason: str, final: bool = False) -> None:
        """Journal, then apply, one lifecycle transition (``final``: an ERRORED trial that
        will not be retried)."""
        if new not in ALLOWED[trial.state]:
            trial.move(new)  # raises with the trial named
        if self.journal is not None:
            self.journal.transition(trial.trial_id, trial.state, new, reason)
        trial.move(new)
        self._track(trial)
        final = new is TrialState.TERMINATED or (new is TrialState.ERRORED and final)
        if final and self.on_trial_end is not None:
            self.on_trial_end(trial)

    def _track(self, trial: Trial) -> None:
        """Keep the waiting lists in step with the trial's state."""
        self._waiting.track(trial.trial_id, trial.state, self._order[trial.trial_id])

    def _after_scheduler(self) -> None:
        """Apply the scheduler's stop list, then save its state (with what it has seen)."""
        for trial_id in self.scheduler.trials_to_stop():
            trial = self.trials.get(trial_id)
            if trial is None:
                raise ValueError(f"{type(self.scheduler).__name__}.trials_to_stop() named "
                                 f"{trial_id!r}, which is not a trial of this run")
            if trial.state in (TrialState.PENDING, TrialState.PAUSED):
                self._move(trial, TrialState.TERMINATED, "stopped by scheduler")
            elif trial.state is TrialState.RUNNING:
                self._stop_running(trial, "stopped by scheduler")
        if self.journal is not None:
            # "fed" only ever grows at its end (as may lists of the scheduler's own state):
            # the store writes what is new, not the whole history, each time.
            self.journal.scheduler_state({"scheduler": self.scheduler.state_dict(),
                                          "fed": list(self._fed_log), "known": len(self._order),
                                          "append_only": ["fed"]})

    def _stop_running(self, trial: Trial, reason: str) -> None:
        self._move(trial, TrialState.TERMINATED, reason)
        flight = self._flights.get(trial.trial_id)
        if flight is not None and flight.outcome is None:
            flight.outcome = Outcome.STOP
            if trial.step < flight.task.stop_step or flight.buffered is not None:
                self._cancel_if_unwanted(flight.job_id)
        self.scheduler.on_trial_complete(trial.trial_id, trial.last_result or {})

    def _cancel_if_unwanted(self, job_id: str) -> None:
        """Cancel a job once none of its trials wants the rest of its segment (a job of one
        trial at once; a group only when every member is decided: the others train on, and
        the decided one's later results and checkpoints are ignored)."""
        job = self._inflight.get(job_id)
        if job is not None and all(self._flights[t].outcome is not None or self._flights[t].done
                                   for t in job.trials):
            self.executor.cancel(job_id)

    # ---- launching ------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """PENDING trials in creation order, then PAUSED ones (none with a job in flight)."""
        return self._waiting.candidates(busy=self._flights)

    def _fill(self) -> None:
        """Give every free slot a job: the scheduler's pick (else a spawned or new trial),
        with the trials that can train in one job with it (:meth:`_companions`). Slots come
        first: trials that can group are spread over the free slots (:attr:`packer`),
        before any job takes more than one (``batch_models`` each at most)."""
        while (len(self._inflight) < self.executor.num_slots and not self.budget_hit()
               and self.stop_reason is None):
            trial = self._next_trial()
            if trial is None:
                self._after_scheduler()
                return
            self._after_scheduler()
            if trial.state not in (TrialState.PENDING, TrialState.PAUSED):
                continue
            free = self.executor.num_slots - len(self._inflight)
            batch = [trial, *self._companions([trial], free * self.planner.batch_models)]
            # placing.py: evenly, or packed by profiles
            for pack in self.packer.packs(batch, free, self.planner.memory.alone_s):
                self._launch(pack)
                flight, note = self._flights.get(pack[0].trial_id), self.packer.take_note(
                    pack[0].trial_id)  # the pack's decision, kept on its job for the plans table
                if note is not None and flight is not None and flight.job_id in self._inflight:
                    self._inflight[flight.job_id].extra["packing"] = note

    def _next_trial(self, key: Hashable | None = None, taken: frozenset = frozenset(),
                    new: bool = True) -> Trial | None:
        """The next trial to run: the scheduler's pick among the waiting ones, else a spawn,
        else a new one from the source (``new=False``: waiting ones only); with ``key``, only
        waiting trials of that group key are offered (a new or spawned trial may still not
        match: the caller checks)."""
        candidates = [c for c in self._candidates() if c not in taken
                      and (key is None or self.planner.key(self.trials[c]) == key)]
        pick = self.scheduler.choose_trial_to_run(candidates) if candidates else None
        if pick is not None and pick not in candidates:
            raise ValueError(f"{type(self.scheduler).__name__}.choose_trial_to_run returned "
                             f"{pick!r}, which is not one of the PENDING/PAUSED candidates")
        if pick is not None:
            return self.trials[pick]
        if not new:
            return None
        spawn = self.scheduler.next_spawn()
        if spawn is not None:
            return self._add_spawn(spawn)
        config = self.source() if self.source else None
        if config is None:
            return None
        trial = Trial(self._new_id(), dict(config), max_steps=self.max_steps)
        self._register(trial)
        return trial

    def _add_spawn(self, spawn: Spawn) -> Trial:
        check_spawn(spawn, type(self.scheduler).__name__)
        trial_id = spawn.trial_id or self._new_id()
        if trial_id in self._orphans:  # re-spawned after a restart: it is already journaled
            trial = self._orphans.pop(trial_id)
            check_respawn(trial, spawn)
            self.trials[trial_id] = trial
            self._track(trial)
            self.scheduler.on_trial_add(trial_id, trial.config)
            return trial
        if trial_id in self.trials:
            raise ValueError(f"{type(self.scheduler).__name__} spawned {trial_id!r}, which exists")
        donor, step = spawn_start(spawn, self.trials.get(spawn.parent), self.max_steps, trial_id)
        config = self.spawn_config(spawn, self.trials.get(spawn.parent))
        trial = Trial(trial_id, config, parent=spawn.parent, parent_step=step,
                      donor=donor, max_steps=self.max_steps, spawned=True,
                      initiator=spawn.initiator)
        self._register(trial)
        return trial

    def _launch(self, batch: list[Trial], worker: str | None = None) -> None:
        for trial in batch:
            if trial.state is not TrialState.RUNNING:
                resumed = trial.state is TrialState.PAUSED
                self._move(trial, TrialState.RUNNING, "resumed" if resumed else "started")
        self._submit(batch, worker)

    def _submit(self, batch: list[Trial], worker: str | None = None) -> None:
        """One job training the next segment of every trial of ``batch`` (RUNNING); two or
        more train as a group (``meta["group"]``)."""
        tasks: list[TrialTask] = []
        for trial in batch:
            start, ckpt = trial.resume_point()
            stop = start + self.segment
            if trial.max_steps is not None:
                stop = min(stop, trial.max_steps)
            if stop <= start:
                self._stop_running(trial, f"already at max_steps={trial.max_steps}")
                continue
            try:  # checked again as the files are used: a symlink may have appeared since
                ckpt = None if ckpt is None else self.folder.path(ckpt)
                out = self.folder.path(self.folder.name_for(trial.trial_id, stop))
            except CheckpointPathError as err:
                self._fail(trial, FailureKind.ENVIRONMENT, str(err))
                continue
            tasks.append(TrialTask(trial.trial_id, trial.config, start, stop, ckpt, out))
        if not tasks:
            return
        self._jobs += 1
        first = tasks[0]
        more = f"+{len(tasks) - 1}" if len(tasks) > 1 else ""
        job_id = f"{first.trial_id}{more}@{first.stop_step}#{self._jobs}"
        grouped = len(tasks) > 1
        self._inflight[job_id] = JobFlight([t.trial_id for t in tasks], grouped)
        now = self.executor.now()
        for task in tasks:
            self._flights[task.trial_id] = Flight(task.trial_id, task, job_id, mark=now)
        meta: dict[str, Any] = {} if worker is None else {"worker": worker}  # a placement hint
        if grouped and self.planner.merge:
            meta["group"] = self.planner.order(tasks, self.trials[tasks[0].trial_id])
        attempt = max(self.trials[t.trial_id].attempts for t in tasks)
        self.executor.submit(Job(job_id, tasks, attempt=attempt, meta=meta))

    def _continue(self, trials: list[Trial], worker: str | None) -> None:
        """Segments ended with CONTINUE: train the next ones at once, preferably on the same
        worker (or pause on budget). Trials that still share a key continue as one job,
        filled up with waiting trials of that key; the others each in their own."""
        go: list[Trial] = []
        for trial in trials:
            if trial.state is not TrialState.RUNNING:
                continue
            if self.stop_reason is not None:
                self._move(trial, TrialState.PAUSED, "run stopped: the environment keeps failing")
            elif self.budget_hit():
                self._move(trial, TrialState.PAUSED, "budget exhausted")
            else:
                go.append(trial)
        batches: dict[Hashable, list[Trial]] = {}
        for trial in go:
            key = self.planner.key(trial)
            batches.setdefault(("alone", trial.trial_id) if key is None else key, []).append(trial)
        size = self.planner.batch_models
        for i, batch in enumerate(batches.values()):
            chunks = [batch[j:j + size] for j in range(0, len(batch), size)]
            for k, chunk in enumerate(chunks):
                if self.planner.key(chunk[0]) is not None:
                    chunk = [*chunk, *self._companions(chunk)]
                self._launch(chunk, worker if i == 0 and k == 0 else None)


    def _companions(self, batch: list[Trial], limit: int | None = None) -> list[Trial]:
        """Trials to train with ``batch`` (same key), until there are ``limit`` in all
        (default ``batch_models``): the waiting ones first, in the scheduler's order, then new
        ones. A new trial that does not match ends the search; it waits for a slot of its own."""
        key = self.planner.key(batch[0])
        out: list[Trial] = []
        if key is None:
            return out
        limit = self.planner.batch_models if limit is None else limit
        taken = frozenset(t.trial_id for t in batch)
        # A new trial starts at step 0: it can join a batch that starts there, never one that
        # continues (asking the strategy then would only move its proposals earlier).
        fresh = key[1] == 0
        while len(batch) + len(out) < limit and not self.budget_hit():
            trial = self._next_trial(key, taken, new=fresh)
            if trial is None:
                break
            self._after_scheduler()
            if trial.state not in (TrialState.PENDING, TrialState.PAUSED):
                continue  # the scheduler stopped it meanwhile
            if self.planner.key(trial) != key:
                break
            out.append(trial)
            taken = taken | {trial.trial_id}
        return out

    def _close_leftovers(self) -> None:
        """The search is over: trials the scheduler never ran again are terminated."""
        for trial in self._orphans.values():
            self.trials[trial.trial_id] = trial
            self._track(trial)
        self._orphans.clear()
        for trial in self.trials.values():
            if trial.state in (TrialState.PENDING, TrialState.PAUSED):
                self._move(trial, TrialState.TERMINATED, "search finished without running it")
