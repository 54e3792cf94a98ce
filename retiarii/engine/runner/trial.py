"""One trial: its config, where it stands in the lifecycle, and how to resume it.

A :class:`Trial` moves through ``PENDING -> RUNNING -> PAUSED <-> RUNNING -> TERMINATED``, with
``RUNNING -> ERRORED -> PENDING`` on a retry from its last checkpoint (:data:`ALLOWED`); any
other move raises :class:`IllegalTransition`. The :class:`~.trials.TrialRunner` makes the moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...enums import TrialState  # defined below the engine, so schedulers can import it too

__all__ = ["Trial", "TrialState", "ALLOWED", "IllegalTransition"]

_S = TrialState
ALLOWED = {  # RUNNING -> PENDING only when a restarted driver requeues what was running
    _S.PENDING: {_S.RUNNING, _S.TERMINATED},
    _S.RUNNING: {_S.PAUSED, _S.TERMINATED, _S.ERRORED, _S.PENDING},
    _S.PAUSED: {_S.RUNNING, _S.TERMINATED},
    _S.ERRORED: {_S.PENDING},
    _S.TERMINATED: set(),
}


class IllegalTransition(ValueError):
    """A trial was asked to move between two states the lifecycle does not connect."""


@dataclass
class Trial:
    """One training run: its spec, where it stands, and how to resume it."""

    trial_id: str
    # What a worker rebuilds the model and trainer from: the executor's TrialTask.spec and
    # the store's trials.spec column (an experiment's worker spec; plain hparams in tests).
    config: dict[str, Any]
    state: TrialState = TrialState.PENDING
    parent: str | None = None  # PBT: the trial whose checkpoint this one starts from
    parent_step: int | None = None  # ... and the step of that checkpoint (the donor)
    donor: str | None = None  # ... and its path
    initiator: str | None = None  # PBT: the trial whose reproduction made this one
    max_steps: int | None = None  # complete after this step (None: the scheduler decides)
    spawned: bool = False  # created by the scheduler's next_spawn
    step: int = 0  # last step reported
    checkpoints: dict[int, str] = field(default_factory=dict)  # step -> name in checkpoint_dir
    attempts: int = 0  # failures so far, of every kind
    model_failures: int = 0  # ... of them the model's own (FailureKind.MODEL)
    env_failures: int = 0  # ... the environment's in a row (since its last checkpoint)
    error: str | None = None
    last_result: dict[str, Any] | None = None
    time_total: float = 0.0  # executor seconds spent training this trial

    def move(self, new: TrialState) -> None:
        """Change state, refusing moves the lifecycle does not allow."""
        if new not in ALLOWED[self.state]:
            raise IllegalTransition(f"trial {self.trial_id!r} cannot go from {self.state.name} to "
                                    f"{new.name}")
        self.state = new

    def resume_point(self) -> tuple[int, str | None]:
        """(step, checkpoint name) the next segment starts from: its own latest checkpoint, else
        the donor's, else its parent's when its spec inherits (step 0), else a fresh start."""
        if self.checkpoints:
            step = max(self.checkpoints)
            return step, self.checkpoints[step]
        if self.donor is not None:
            return int(self.parent_step or 0), self.donor
        if self.config.get("inherit"):  # a child starting from its parent's tensors that fit
            return 0, self.config["inherit"]  # (engine/trainers/inheritance.py)
        return 0, None

    def to_record(self) -> dict[str, Any]:
        """The immutable part, as the journal stores it when the trial is added."""
        return {"trial_id": self.trial_id, "config": self.config, "parent": self.parent,
                "parent_step": self.parent_step, "donor": self.donor,
                "max_steps": self.max_steps, "spawned": self.spawned,
                "initiator": self.initiator}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Trial":
        return cls(rec["trial_id"], dict(rec["config"]), parent=rec.get("parent"),
                   parent_step=rec.get("parent_step"), donor=rec.get("donor"),
                   max_steps=rec.get("max_steps"), spawned=bool(rec.get("spawned")),
                   initiator=rec.get("initiator"))
