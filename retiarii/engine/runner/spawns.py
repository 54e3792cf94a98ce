"""A scheduler's spawn checked before it becomes a trial: what it is, the parent checkpoint it
starts from, and, after a restart, that it is the very spawn the journal holds.

PBT spawns trials (:class:`~retiarii.strategies.Spawn`: hyper-parameters, a parent and the
parent's step to start from). A spawn that cannot work is the scheduler's bug, refused here
with the trial, the parent and the step named, before anything is journaled.

Example::

    check_spawn(spawn, "PBT")
    donor, step = spawn_start(spawn, runner.trials.get(spawn.parent), max_steps=20)
"""
from __future__ import annotations

from typing import Any

from ...strategies.schedulers.base import Spawn
from .trial import Trial

__all__ = ["check_respawn", "check_spawn", "spawn_start"]


def check_spawn(spawn: Any, scheduler: str) -> None:
    """``spawn`` is a :class:`Spawn` (``scheduler`` names who returned it)."""
    if not isinstance(spawn, Spawn):
        raise TypeError(f"{scheduler}.next_spawn() returned {spawn!r}; return a "
                        f"retiarii.strategies.Spawn or None")


def check_respawn(trial: Trial, spawn: Spawn) -> None:
    """A trial spawned again after a restart (already journaled as ``trial``) is the same
    spawn: same parent and hyper-parameters (an experiment's spec holds them in ``hparams``)."""
    hparams = trial.config.get("hparams") or {}
    same = trial.config == dict(spawn.config) or all(
        hparams.get(k) == v for k, v in spawn.config.items())
    if trial.parent != spawn.parent or not same:
        raise ValueError(f"the scheduler re-spawned {trial.trial_id!r} differently after a "
                         f"restart (parent/config changed): its state is inconsistent")


def spawn_start(spawn: Spawn, parent: Trial | None, max_steps: int | None,
                trial_id: str) -> tuple[str | None, int | None]:
    """(the checkpoint the spawned trial ``trial_id`` starts from, its step): the parent's at
    ``spawn.parent_step``, else its latest; (None, None) for a spawn from scratch."""
    donor, step = None, None
    if spawn.parent is not None:
        if parent is None:
            raise ValueError(f"spawn of {trial_id!r} names parent {spawn.parent!r}, which is "
                             f"not a trial of this run")
        step = spawn.parent_step if spawn.parent_step is not None else max(
            parent.checkpoints, default=None)
        donor = parent.checkpoints.get(step)
        if donor is None:
            raise ValueError(f"spawn of {trial_id!r} needs a checkpoint of {spawn.parent!r} at "
                             f"step {step}, but it has {sorted(parent.checkpoints)}")
    if max_steps is not None and (step or 0) >= max_steps:
        raise ValueError(f"spawn of {trial_id!r} starts at step {step}, but the runner's "
                         f"max_steps={max_steps} leaves it nothing to train: raise "
                         f"max_steps or end the scheduler sooner (PBT: max_generations)")
    return donor, step
