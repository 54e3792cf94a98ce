"""What a runner's journal says after the driver died: its trials as they were, their results,
the scheduler's saved state, read back in order (:meth:`.trial_runner.TrialRunner.resume`
then applies it to a fresh runner and its scheduler).

Reading is kept apart from applying: this module only folds the journal's records (trials
added, transitions, results, checkpoints kept and forgotten, scheduler states) into a
:class:`Replay`; it decides nothing about retries or the scheduler.

Example::

    replay = read_journal(store, usable=lambda trial, name: True)
    replay.trials["e1-trial-0001"].state, replay.saved is not None
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..jobs.job import FailureKind
from .flights import failure_of, result_dict
from .journal import Journal
from .trial import Trial, TrialState

__all__ = ["Replay", "read_journal"]


@dataclasses.dataclass
class Replay:
    """A journal read back."""

    #: trial id -> the trial as the journal leaves it, in the order the trials were added
    trials: dict[str, Trial] = dataclasses.field(default_factory=dict)
    #: the scheduler's last saved state ({"scheduler", "fed", "known"}), None if never saved
    saved: dict | None = None
    #: every result journaled, in order: (its trial, the record)
    results: list[tuple[Trial, dict]] = dataclasses.field(default_factory=list)
    #: trial id -> the kind of its last failure
    failed_by: dict[str, FailureKind] = dataclasses.field(default_factory=dict)
    #: trial id -> the last step whose result is journaled
    journaled: dict[str, int] = dataclasses.field(default_factory=dict)


def read_journal(journal: Journal, usable: Callable[[Trial, str], bool]) -> Replay:
    """Fold ``journal``'s records into a :class:`Replay`; ``usable(trial, name)`` says whether
    a checkpoint (or a spawned trial's donor) the journal names may be read."""
    out = Replay()
    for kind, p in journal.records():
        if kind == "trial_added":
            if p["trial_id"] not in out.trials:
                out.trials[p["trial_id"]] = trial = Trial.from_record(p)
                if trial.donor is not None and not usable(trial, trial.donor):
                    trial.donor = None  # refused (logged): the child starts afresh
        elif kind == "scheduler_state":
            out.saved = p["state"]
        elif kind == "transition":
            _transition(out, out.trials[p["trial_id"]], p)
        elif kind == "result":
            trial = out.trials[p["trial_id"]]
            out.results.append((trial, p))
            out.journaled[trial.trial_id] = max(out.journaled.get(trial.trial_id, 0), p["step"])
            trial.step, trial.last_result = p["step"], result_dict(p["step"], p["metrics"])
            trial.time_total = trial.last_result.get("time_total_s", trial.time_total)
        elif kind == "checkpoint":
            trial = out.trials[p["trial_id"]]
            if usable(trial, p["path"]):
                trial.checkpoints[p["step"]] = p["path"]
        elif kind == "forget_checkpoint":
            out.trials[p["trial_id"]].checkpoints.pop(p["step"], None)
    return out


def _transition(out: Replay, trial: Trial, p: dict[str, Any]) -> None:
    trial.state = TrialState(p["new"])
    if trial.state is TrialState.ERRORED:
        trial.attempts, trial.error = trial.attempts + 1, p["reason"]
        out.failed_by[trial.trial_id] = failure_of(p["reason"])
        if out.failed_by[trial.trial_id] is FailureKind.MODEL:
            trial.model_failures += 1
