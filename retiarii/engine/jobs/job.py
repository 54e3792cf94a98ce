"""The executor interface: how the engine hands training work to workers and hears back.

The engine trains a trial in *segments*. A :class:`Job` trains one or more trials (several
models in one job is how cross-model optimization runs merged models) from their last
checkpoint up to a step, reporting a result after every step and writing a checkpoint at the
end of the segment. Pausing a trial is simply not submitting its next segment, so a paused and
resumed trial follows the trajectory of an uninterrupted one.

Every executor (local processes, the simulator with its virtual clock, Ray) implements
:class:`Executor`; the engine never knows which one it drives. Events come back through
:meth:`Executor.next_event`, which blocks on a queue (no sleep-polling anywhere).
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any
from .reports import UnitReport


@dataclass
class TrialTask:
    """One trial's share of a job."""

    trial_id: str
    spec: dict[str, Any]  # JSON: what a worker rebuilds the model and trainer from
    start_step: int  # steps already trained (0 = fresh start)
    stop_step: int  # train until this step, then checkpoint
    checkpoint_in: str | None = None  # resume from here (None: fresh, or PBT donor given in spec)
    checkpoint_out: str | None = None  # write the end-of-segment checkpoint here


@dataclass
class Job:
    """A unit of work for one executor slot: one or more trials trained together."""

    job_id: str
    tasks: list[TrialTask]
    attempt: int = 0  # retries of the same work after a failure
    meta: dict[str, Any] = field(default_factory=dict)


# ---- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobStarted:
    job_id: str
    worker: str  # a stable name of the slot ("local-0", "sim-3", a Ray node id)


@dataclass(frozen=True)
class TrialResult:
    """Metrics of one trial after one step (an epoch, a rung)."""

    job_id: str
    trial_id: str
    step: int  # the step just completed, 1-based
    metrics: dict[str, float]
    time: float = 0.0  # executor clock when the step ended (virtual in the simulator)


@dataclass(frozen=True)
class TrialCheckpointed:
    job_id: str
    trial_id: str
    step: int
    path: str
    # the segment trained fused (rounding unlike training alone): the driver marks the trial
    # with the checkpoint, in one transaction, since the job's unit report may never come
    fused: bool = False


@dataclass(frozen=True)
class JobFinished:
    job_id: str


class FailureKind(enum.Enum):
    """Whose fault a failure is, which decides whether retrying can help."""

    MODEL = "model"  # the trial's own (shape error, NaN loss, bad spec): deterministic
    ENVIRONMENT = "environment"  # checkpoint I/O (OSError), out of memory, a lost worker
    CHECKPOINT = "checkpoint"  # the checkpoint to resume from is missing or unreadable


@dataclass(frozen=True)
class JobFailed:
    """A job that could not finish. ``trial_id`` names the culprit when one trial raised;
    ``worker_lost`` is true when the worker process itself died (retry elsewhere); ``kind``
    says whose fault it was (default: ENVIRONMENT when the worker was lost, else MODEL)."""

    job_id: str
    trial_id: str | None
    error: str
    worker_lost: bool = False
    kind: FailureKind | None = None
    # (trial, kind, error) of every trial that failed, when the worker knows (a job of
    # several tasks); a trial of the job named neither here nor by a TrialCheckpointed at
    # its stop step did not finish its segment for a reason not its own.
    failures: tuple[tuple[str, FailureKind, str], ...] = ()

    def __post_init__(self):
        if self.kind is None:
            lost = FailureKind.ENVIRONMENT if self.worker_lost else FailureKind.MODEL
            object.__setattr__(self, "kind", lost)


@dataclass(frozen=True)
class JobProfiled:
    """What the worker measured of a grouped job (before its terminal event): one
    :class:`~.reports.UnitReport` per unit it trained (the runner judges them:
    ``runner/planner.py``). Executors pass it on like any event."""

    job_id: str
    units: tuple[UnitReport, ...]


@dataclass(frozen=True)
class SegmentDone:
    """A one-shot segment's outcome (:mod:`retiarii.engine.driver.one_shot_host`), emitted before its
    unit's ``TrialCheckpointed``: the strategy's metrics, the models it evaluated (each
    ``{"sample": {...}, "metrics": {...}}``, in order) and the architecture it selects now."""

    job_id: str
    trial_id: str
    segment: int  # segments completed, 1-based
    metrics: dict
    models: tuple[dict, ...]
    selected: dict
    seconds: float = 0.0  # the segment's wall time in the worker


def pick_slot(idle: list, job: Job):
    """The slot of ``idle`` (each with a ``name``; least recently used first) that ``job``
    goes to: the one ``job.meta["worker"]`` names (the runner's hint to continue a trial
    where its last segment ran, so its files and caches are warm), else the first."""
    hinted = [slot for slot in idle if slot.name == job.meta.get("worker")]
    return hinted[0] if hinted else idle[0]


def combined_kind(kinds) -> FailureKind:
    """One kind for a job several of whose tasks failed: retrying is the safe side, so an
    environment's failure wins over a checkpoint's, which wins over a model's."""
    kinds = set(kinds)
    for kind in (FailureKind.ENVIRONMENT, FailureKind.CHECKPOINT):
        if kind in kinds:
            return kind
    return FailureKind.MODEL


Event = (JobStarted | TrialResult | TrialCheckpointed | JobProfiled | SegmentDone | JobFinished
         | JobFailed)


class Executor(abc.ABC):
    """Runs jobs on ``num_slots`` slots; reports :data:`Event` s in the order they happen."""

    num_slots: int

    @abc.abstractmethod
    def submit(self, job: Job) -> None:
        """Queue ``job``; it starts as soon as a slot is free."""

    @abc.abstractmethod
    def next_event(self, timeout: float | None = None) -> Event | None:
        """Block until the next event, or ``timeout`` seconds (None: forever); None on timeout."""

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None:
        """Stop a queued or running job; it ends with :class:`JobFailed` (error ``"cancelled"``)."""

    def now(self) -> float:
        """The executor's clock in seconds (virtual for the simulator)."""
        import time

        return time.monotonic()

    def slot_memory(self) -> float:
        """Bytes each slot lends to the models of its jobs (packing places within it;
        engine/placing.py); ``inf`` when the executor cannot tell."""
        return float("inf")

    def close(self) -> None:
        """Release workers. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
