"""The runner's records of what is in flight: a segment of one trial (:class:`Flight`), a job
(:class:`JobFlight`), what the scheduler decided for it before it ended (:class:`Outcome`), and
how an ERRORED transition's reason reads back as a failure kind (:func:`failure_of`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..jobs.job import FailureKind, TrialTask

__all__ = ["Flight", "JobFlight", "Outcome", "failure_of", "result_dict"]


def failure_of(reason: str) -> FailureKind:
    """The kind of failure an ERRORED transition's reason records (``"model error: ..."``,
    ``"environment error: ..."``, ``"checkpoint error: ..."``, ``"worker lost: ..."``; the
    ``"error: ..."`` of older stores counts as the model's)."""
    for kind in FailureKind:
        if reason.startswith(f"{kind.value} error:"):
            return kind
    if reason.startswith("group error:"):  # a merged job failed: its trials retry alone
        return FailureKind.ENVIRONMENT
    return FailureKind.ENVIRONMENT if reason.startswith("worker lost") else FailureKind.MODEL


def result_dict(step: int, metrics: dict) -> dict:
    """What a scheduler sees: the metrics (with ``time_total_s``) and ``training_iteration``."""
    return {**metrics, "training_iteration": step}


class Outcome(enum.Enum):
    """What the scheduler decided for a running segment before it ended."""

    STOP = "stop"
    PAUSE = "pause"


@dataclass
class Flight:
    """A submitted segment of one trial (one task of a job)."""

    trial_id: str
    task: TrialTask
    job_id: str
    worker: str | None = None
    started: float | None = None
    mark: float = 0.0  # clock of the last result (time accounting)
    buffered: dict | None = None  # the segment's last result, fed once its checkpoint exists
    outcome: Outcome | None = None  # once decided, the segment only finishes
    done: bool = False  # its segment's checkpoint arrived: it finished, whatever the job does


@dataclass
class JobFlight:
    """A submitted job: the trials it trains (one, or a group)."""

    trials: list[str]
    grouped: bool = False
    units: tuple = ()  # what the worker reported of a grouped job (JobProfiled)
    started: float | None = None
    extra: dict = field(default_factory=dict)
