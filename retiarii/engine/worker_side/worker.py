"""What runs inside a worker: rebuild each trial of a :class:`Job` from its spec and train it.

A worker never receives a pickled model. A :class:`TrialTask` carries a JSON ``spec``::

    {
      "space":   "package.module:attr" | "/abs/path/file.py:attr",   # an object with .build(sample)
      "sample":  {...},                                              # the choices, as space.py defines
      "trainer": "package.module:attr"                               # a Trainer instance (or class)
               | {"class": "retiarii.engine.trainers.trainer:ClassifierTrainer", "config": {...}},
      "hparams": {...},                                              # the trial's hyper-parameters
      "seed":    0,                                                  # optional; seeds the trial's RNG
    }

:func:`run_job` trains the tasks of a job side by side in this process, one epoch of each in
turn, every task with its own model, optimizer, RNG streams and metrics, and reports events
through ``emit``. It is the same code whichever executor hosts it. A job whose
``meta["one_shot"]`` is true is a segment of a one-shot search, run by
:func:`~.one_shot_worker.run_segment_job` instead. When ``job.meta["group"]``
is true, the tasks that can share one data pipeline (same space, trainer, data key and start)
train as one group instead (:mod:`.grouped`): one loader pass feeds every model, the shared
frozen part runs once, and every event, metric and checkpoint is what training alone gives.
When ``job.meta["fuse"]`` is also "auto" or True, the tasks of such a group whose models have
one architecture train as one fused model (:mod:`.fused`), except those in
``job.meta["unfused"]``: the same events and checkpoints, values within float rounding.
Which layout a group trains in (separate, CSE, batching, fused) is :mod:`.layouts`' choice.

Events of one job, in order: ``JobStarted``; ``TrialResult`` after every step of every task;
``TrialCheckpointed`` when a task reaches its ``stop_step`` (and has a ``checkpoint_out``); then
exactly one terminal event. A task that raises stops only that task; the others run on. The job
then ends with ``JobFinished`` when no task failed, ``JobFailed(trial_id=X)`` when trial X alone
failed, and ``JobFailed(trial_id=None)`` naming every culprit in ``error`` when several did; its
``kind`` says whose fault it was (:func:`classify_error`). In
every ``JobFailed``, the trials that did not report ``TrialCheckpointed`` are the ones that did
not finish their segment.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from typing import Any, Callable

from ...determinism import DeterminismError, deterministic, spec_wants
from ...refs import resolve_ref  # the one resolver: the references the driver made (refs.py)
from ..storage.checkpoint import CheckpointError
from ..jobs.contract import GroupOrder, group_order
from .compute_clock import compute_clock
from ..jobs.reports import UnitReport
from ..jobs.job import (
    Event, FailureKind, Job, JobFailed, JobFinished, JobProfiled, JobStarted, TrialCheckpointed,
    TrialResult, TrialTask, combined_kind,
)

__all__ = ["resolve_ref", "WorkerContext", "run_job", "describe_error", "classify_error"]

_MAX_ERROR_CHARS = 4000  # a traceback tail: enough to find the line, small enough for the store


class WorkerContext:
    """Per-process caches of the spaces and trainers that specs refer to.

    Example::

        context = WorkerContext()
        space, trainer = context.space(spec["space"]), context.trainer(spec["trainer"])
    """

    def __init__(self) -> None:
        # How a one-shot segment's K ranks run (mixed parallelism): ``run_ranks(build, state,
        # world, keep=...) -> (result, state)`` as ``run_segment_on_ranks``; ``keep``: more
        # segments of the search follow (ranks may be kept for them). None: K local processes
        # (:func:`~retiarii.engine.executors.local_ranks.run_segment_on_ranks`); the Ray
        # worker actor sets rank actors in a placement group (:mod:`.executors.ray_ranks`).
        self.run_ranks: Callable[..., tuple[Any, dict]] | None = None
        self._spaces: dict[str, Any] = {}
        self._trainers: dict[str, Any] = {}

    def space(self, ref: str) -> Any:
        """The space object ``ref`` names; it must have ``build(sample)``."""
        if ref not in self._spaces:
            space = resolve_ref(ref)
            if not callable(getattr(space, "build", None)):
                raise TypeError(f"spec['space'] = {ref!r} names a {type(space).__name__}, which has "
                                "no build(sample) method; point it at a ModelSpace")
            self._spaces[ref] = space
        return self._spaces[ref]

    def trainer(self, spec: Any) -> Any:
        """The trainer of ``spec['trainer']``: a reference, or ``{"class": ref, "config": {...}}``."""
        from ..trainers.trainer import Trainer

        key = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        if key in self._trainers:
            return self._trainers[key]
        if isinstance(spec, str):
            trainer = resolve_ref(spec)
            if isinstance(trainer, type) and issubclass(trainer, Trainer):
                trainer = trainer()
        elif isinstance(spec, dict) and "class" in spec:
            cls = resolve_ref(spec["class"])
            if not (isinstance(cls, type) and issubclass(cls, Trainer)):
                raise TypeError(f"spec['trainer']['class'] = {spec['class']!r} is not a Trainer subclass")
            trainer = cls(**(spec.get("config") or {}))
        else:
            raise TypeError("spec['trainer'] must be an import reference to a Trainer, or "
                            f"{{'class': ref, 'config': {{...}}}}; got {spec!r}")
        if not isinstance(trainer, Trainer):
            raise TypeError(f"spec['trainer'] = {spec!r} names a {type(trainer).__name__}, "
                            "not a retiarii Trainer")
        self._trainers[key] = trainer
        return trainer


def describe_error(err: BaseException) -> str:
    """``Type: message`` and the tail of the traceback, for events and the store."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return f"{type(err).__name__}: {err}\n{text[-_MAX_ERROR_CHARS:]}"


def classify_error(err: BaseException, *, loading: bool = False) -> FailureKind:
    """Whose fault ``err`` is: an ``OSError`` (checkpoint I/O, a full or read-only disk) or
    running out of memory is the environment's, and may pass; a checkpoint that cannot be read
    while ``loading`` is the checkpoint's; anything else (a shape error, a NaN loss) is the
    model's, and would happen again.

    Example::

        classify_error(PermissionError(13, "Permission denied"))   # FailureKind.ENVIRONMENT
    """
    if isinstance(err, (OSError, MemoryError)) or _out_of_memory(err):
        return FailureKind.ENVIRONMENT
    if loading and isinstance(err, CheckpointError):
        return FailureKind.CHECKPOINT
    return FailureKind.MODEL


def _out_of_memory(err: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError on GPUs; the CPU allocator raises a plain RuntimeError.
    text = str(err)
    return type(err).__name__ == "OutOfMemoryError" or (
        isinstance(err, RuntimeError) and ("out of memory" in text
                                           or "can't allocate memory" in text))


def _open_task(task: TrialTask, context: WorkerContext):
    """A :class:`TrialRun` for ``task``, at ``task.start_step``."""
    from ..trainers.trial_training import TrialRun, check_segment

    spec = task.spec
    for key in ("space", "sample", "trainer"):
        if key not in spec:
            raise KeyError(f"trial {task.trial_id}: its spec lacks {key!r} (see "
                           "retiarii.engine.worker_side.worker for the spec format)")
    space, trainer = context.space(spec["space"]), context.trainer(spec["trainer"])
    from ..trainers.function_trainer import FunctionTrainer, open_function_task

    if isinstance(trainer, FunctionTrainer):  # the user's own loop (engine/function_run.py)
        return open_function_task(task, space, trainer)
    sample = spec["sample"]
    if "frozen" in spec:  # frozen values are read in each process: they must be the driver's
        space.check_frozen(spec["frozen"])
    # The driver already checked this sample's shapes (spec "checked"): do not run it twice.
    build_kwargs = {"check": False} if spec.get("checked") else {}
    built: dict[str, Any] = {}

    def build():
        if not hasattr(space, "build_with_model"):  # any object with build(sample)
            return space.build(sample, **build_kwargs)
        built["model"], module = space.build_with_model(sample, **build_kwargs)
        return module

    # A child's first segment starts from its parent's checkpoint (the trial's donor) with
    # only the tensors that fit (engine/trainers/inheritance.py), not resumed from it.
    inherit = bool(spec.get("inherit")) and task.start_step == 0 and task.checkpoint_in
    checkpoint = None if inherit else task.checkpoint_in
    run = TrialRun(build, trainer, spec.get("hparams") or {},
                   seed=int(spec.get("seed") or 0), checkpoint=checkpoint,
                   trial_id=task.trial_id)
    if inherit:
        from ..trainers.inheritance import inherit_from

        inherit_from(run, task.checkpoint_in)
    # The IR the module was emitted from: grouped jobs plan on it (no second replay).
    run.ir = built.get("model")
    check_segment(run, task.start_step, task.stop_step, checkpoint)
    return run


def run_job(job: Job, emit: Callable[[Event], None], *, worker: str = "inline",
            context: WorkerContext | None = None, clock: Callable[[], float] = time.monotonic,
            cancelled: Callable[[], bool] = lambda: False) -> None:
    """Train every task of ``job`` and report through ``emit`` (see the module docstring),
    in deterministic mode when a task's spec asks for it (``"deterministic": true``:
    :mod:`retiarii.determinism`; the process's settings are restored after the job).

    Example::

        events = []
        run_job(Job("j1", [TrialTask("t1", spec, 0, 2, None, "/tmp/t1-2.pt")]), events.append)

    Args:
        job: the tasks to train.
        emit: called with each event, in order.
        worker: the name that ``JobStarted`` reports.
        context: caches of spaces and trainers, kept for the life of the process.
        clock: the timestamp of ``TrialResult`` (the executor's clock).
        cancelled: asked before every step; True ends the job there with
            ``JobFailed(error="cancelled")``.
    """
    with contextlib.ExitStack() as mode:
        try:
            mode.enter_context(deterministic(spec_wants(task.spec for task in job.tasks)))
        except (ValueError, DeterminismError) as err:  # a bad spec; cuBLAS started without it
            kind = FailureKind.ENVIRONMENT if isinstance(err, DeterminismError) else \
                FailureKind.MODEL
            error = describe_error(err)
            emit(JobStarted(job.job_id, worker))
            emit(JobFailed(job.job_id, None, error, kind=kind, failures=tuple(
                (task.trial_id, kind, error) for task in job.tasks)))
            return
        _run_job(job, emit, worker, context, clock, cancelled)


def _run_job(job: Job, emit: Callable[[Event], None], worker: str, context: WorkerContext | None,
             clock: Callable[[], float], cancelled: Callable[[], bool]) -> None:
    context = context or WorkerContext()
    emit = _guarded(emit)
    if job.meta.get("one_shot"):  # a segment of a one-shot search (engine/one_shot.py)
        _run_one_shot(job, emit, worker, context, cancelled)
        _release_cuda_cache()
        return
    emit(JobStarted(job.job_id, worker))
    failures: dict[str, str] = {}
    kinds: dict[str, FailureKind] = {}
    runs = {}
    for task in job.tasks:
        try:
            runs[task.trial_id] = _open_task(task, context)
        except Exception as err:  # noqa: BLE001 (bad spec, build error, bad checkpoint, I/O)
            failures[task.trial_id] = describe_error(err)
            kinds[task.trial_id] = classify_error(err, loading=task.checkpoint_in is not None)
    tasks = {task.trial_id: task for task in job.tasks}
    units = _units(job, [task for task in job.tasks if task.trial_id in runs], runs, context)
    reports = [unit for unit in units if hasattr(unit, "report")]
    while units:
        for unit in list(units):  # one step of each unit (a task alone, or a group) in turn
            if cancelled():
                emit(JobFailed(job.job_id, None, "cancelled"))
                return
            members = unit.trials
            outcome = unit.train_epoch()
            ended = []
            for trial in members:
                task, run, result = tasks[trial], runs[trial], outcome.get(trial)
                if isinstance(result, Exception):
                    failures[trial] = describe_error(result)
                    kinds[trial] = classify_error(result)
                else:
                    if result is not None:
                        emit(TrialResult(job.job_id, trial, run.step, result, clock()))
                    try:
                        if run.step >= task.stop_step and task.checkpoint_out is not None:
                            run.save(task.checkpoint_out)
                    except Exception as err:  # noqa: BLE001 (fails this trial only)
                        failures[trial] = describe_error(err)
                        kinds[trial] = classify_error(err)
                if trial in failures or run.step >= task.stop_step:
                    ended.append(trial)
            fused = _trained_fused(unit)  # as the unit trained this step, before it drops any
            unit.drop(ended)
            for trial in ended:
                del runs[trial]  # free the model before the others' next epochs
                task = tasks[trial]
                if trial not in failures and task.checkpoint_out is not None:
                    emit(TrialCheckpointed(job.job_id, trial, task.stop_step,
                                           task.checkpoint_out, fused=fused))
            if not unit.trials:
                units.remove(unit)
    _release_cuda_cache()
    if group_order(job.meta) is not None:
        emit(JobProfiled(job.job_id, tuple(unit.report() for unit in reports)))
    every = tuple((t, kinds[t], e) for t, e in failures.items())
    if not failures:
        emit(JobFinished(job.job_id))
    elif len(failures) == 1:
        (trial_id, error), = failures.items()
        emit(JobFailed(job.job_id, trial_id, error, kind=kinds[trial_id], failures=every))
    else:
        emit(JobFailed(job.job_id, None,
                       "\n".join(f"trial {t}: {e}" for t, e in failures.items()),
                       kind=combined_kind(kinds.values()), failures=every))


def _trained_fused(unit) -> bool:
    """Whether ``unit`` trains its models fused (a unit report's ``fused``, or a measuring
    group whose layout is fused): values then round unlike training alone."""
    from .fused_group import FusedGroup

    return isinstance(unit, FusedGroup) or getattr(unit, "trained_layout", None) == "fused"


def _run_one_shot(job: Job, emit: Callable[[Event], None], worker: str, context: WorkerContext,
                  cancelled: Callable[[], bool]) -> None:
    """One segment of a one-shot search (:mod:`.one_shot_worker`): ``JobStarted``, then its
    ``SegmentDone``, ``TrialCheckpointed`` and ``JobFinished``, or one ``JobFailed``."""
    from .one_shot_segment import UnitError, finish_segment, open_segment, run_ranked_segment

    emit(JobStarted(job.job_id, worker))
    task, started = job.tasks[0], time.perf_counter()
    if int(task.spec.get("ranks") or 1) > 1:  # mixed parallelism: the ranks build their own
        try:
            events = run_ranked_segment(job, context, started)
        except Exception as err:  # noqa: BLE001 (a rank's failure names the rank)
            kind = FailureKind.CHECKPOINT if isinstance(err, UnitError) else classify_error(err)
            emit(JobFailed(job.job_id, task.trial_id, describe_error(err), kind=kind))
            return
        for event in events:
            emit(event)
        return
    try:
        strategy, ctx = open_segment(task, context)
    except Exception as err:  # noqa: BLE001 (bad spec, a space the strategy refuses, bad unit)
        kind = FailureKind.CHECKPOINT if isinstance(err, UnitError) else \
            classify_error(err, loading=task.checkpoint_in is not None)
        emit(JobFailed(job.job_id, task.trial_id, describe_error(err), kind=kind))
        return
    ctx.should_stop = cancelled
    try:
        events = finish_segment(job, strategy, ctx, started)
    except Exception as err:  # noqa: BLE001 (the strategy's or the disk's fault)
        emit(JobFailed(job.job_id, task.trial_id, describe_error(err), kind=classify_error(err)))
        return
    for event in events:
        emit(event)


class _Alone:
    """One task trained by its :class:`TrialRun` alone, in the interface of a
    :class:`~.grouped.TrainingGroup` (``trials``, ``train_epoch``, ``drop``; ``report`` when
    a grouped job trains it alone, saying why)."""

    def __init__(self, task: TrialTask, run: Any, why: str | None = None,
                 report: UnitReport | None = None):
        self.task, self.run = task, run
        self.trials: tuple[str, ...] = (task.trial_id,)
        if why is not None:  # report: with the layout and its choice (group_layouts.py)
            said = report or UnitReport((task.trial_id,), merged=False, reason=why)
            self.report = lambda: said

    def train_epoch(self) -> dict[str, Any]:
        if self.run.step >= self.task.stop_step:  # nothing to train: only the checkpoint
            return {}
        try:
            return {self.task.trial_id: self.run.train_epoch()}
        except Exception as err:  # noqa: BLE001 (fails this trial only)
            return {self.task.trial_id: err}

    def drop(self, trials: Any) -> None:
        if self.task.trial_id in set(trials):
            self.trials = ()


def _trainer_key(spec: Any) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)


def _units(job: Job, tasks: list[TrialTask], runs: dict, context: WorkerContext) -> list:
    """What the job trains, in task order: each task alone, or, when ``job.meta["group"]``
    asks, the tasks that :func:`~.group_candidates.group_tasks` and the plan group as one
    :class:`~.grouped.TrainingGroup` (planning that fails falls back to training alone)."""
    order = group_order(job.meta)
    if order is None:
        return [_Alone(task, runs[task.trial_id]) for task in tasks]
    from .group_candidates import GroupCandidate, group_tasks
    from .training_group import TrainingGroup
    from .group_layouts import group_units

    by_id = {task.trial_id: task for task in tasks}
    keys = {}
    for task in tasks:
        run = runs[task.trial_id]
        try:
            keys[task.trial_id] = run.trainer.data_key(run.hparams)
        except Exception:  # noqa: BLE001 (a trainer that cannot say: shares nothing)
            keys[task.trial_id] = None
    candidates = [GroupCandidate(
        t.trial_id, t.spec["space"] if isinstance(t.spec["space"], str) else repr(t.spec["space"]),
        _trainer_key(t.spec["trainer"]), keys[t.trial_id],
        (runs[t.trial_id].epoch, runs[t.trial_id].batch), t.stop_step - runs[t.trial_id].step)
        for t in tasks]
    # None: not measured; a list: measured, these alone too
    profile = None if order.profile is None else list(order.profile)
    units: list = []
    for ids in group_tasks(candidates):
        if len(ids) == 1:
            c = next(c for c in candidates if c.trial_id == ids[0])
            why = ("its trainer's data_key is None: it shares no data pipeline" if c.data_key is None
                   else "no other task of the job has its space, trainer, data key and position")
            units.append(_Alone(by_id[ids[0]], runs[ids[0]], why))
            continue
        try:
            # setup is timed on the clock the steps are (CPU time on a one-thread CPU): wall
            # time counted the machine's other work, and on a loaded machine a setup of 0.1 s
            # CPU read 0.3 s, over a short segment's steps, and reverted a faster layout
            clock = compute_clock(runs[ids[0]].device)
            start = clock()
            grouped = []
            space = context.space(by_id[ids[0]].spec["space"])
            models = {t: getattr(runs[t], "ir", None) or space.replay(by_id[t].spec["sample"])
                      for t in ids}
            grouped = group_units(
                order, list(ids), models, runs, runs[ids[0]].trainer, keys[ids[0]], profile,
                lambda t, why, report: _Alone(by_id[t], runs[t], why, report),
                make_group=lambda plan, rs, trainer, prof: _training_group(
                    order, plan, rs, trainer, prof))
            merged = [g for g in grouped if isinstance(g, TrainingGroup)]
            # what merging cost before the first batch (planning, building the group module):
            # paid on top of building each model, which training alone pays too. Not measuring
            # the layouts: that is paid once per group key and device, not once per job.
            choice = merged[0].choice if merged else None
            probe_s = (choice.probe_s or 0.0) if choice is not None else 0.0
            setup = max(0.0, clock() - start - probe_s)
            for g in merged:
                g.setup_s = setup / len(merged)
        except Exception as err:  # noqa: BLE001 (cannot plan or build them together: alone)
            for g in grouped:
                g.drop(g.trials)  # a fused group gives its models storage of their own back
            why = f"planning or building the group failed: {type(err).__name__}: {err}"[:500]
            grouped = [_Alone(by_id[t], runs[t], why) for t in ids]
        units.extend(grouped)
    return units


def _training_group(order: GroupOrder, plan: Any, runs: dict, trainer: Any, profile: Any) -> Any:
    """A :class:`~.grouped.TrainingGroup`, or with ``order.dedicated`` (patterns naming
    modules) a :class:`~.dedicated.DedicatedGroup`: its shared cell, when it holds such a
    module, on a dedicated device (``order.dedicated_device``, default: another GPU, a side
    stream of the only one, or a process on a CPU-only machine)."""
    from .training_group import TrainingGroup

    patterns = list(order.dedicated)
    if not patterns:
        return TrainingGroup(plan, runs, trainer, profile=profile)
    from .dedicated_group import DedicatedGroup, default_device

    first = next(iter(runs.values()))
    device = order.dedicated_device or default_device(first.device)
    return DedicatedGroup(plan, runs, trainer, profile=profile, patterns=patterns, device=device)


class _EmitError(ConnectionError):
    """Reporting failed (the driver is gone): not the trial's fault, so never blamed on it;
    an OSError, so the worker loop exits quietly."""


def _guarded(emit: Callable[[Event], None]) -> Callable[[Event], None]:
    def guarded(event: Event) -> None:
        try:
            emit(event)
        except Exception as err:
            raise _EmitError(f"could not report {type(event).__name__}: {err}") from err
    return guarded


def _release_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # after an OOM the next job should not inherit the fragments
