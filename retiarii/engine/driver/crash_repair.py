"""What a resume repairs of a driver killed at any moment (docs/engine.md, "Crashes"): each
write of the driver is a transaction, but some steps of the driver are two writes, or a file
and a write, and a crash between them leaves the first without the second. The resume
finishes or undoes each such pair before the runner reads the store:

- models staged without their trial (:func:`drop_untrained_orphans`);
- checkpoint files half-written by workers killed with the driver, and checkpoint rows whose
  files are gone: a deletion cut short (file first, row second), or files removed by hand
  (:func:`repair_checkpoints`);
- trials whose end was journaled but whose effects were not written, and finished trials
  whose old checkpoints were not yet collected (:func:`finish_half_ended`)."""
from __future__ import annotations

import logging
from typing import Any

from ...enums import TrialState

__all__ = ["drop_untrained_orphans", "finish_half_ended", "repair_checkpoints"]

_log = logging.getLogger("retiarii.engine")


def drop_untrained_orphans(store: Any) -> None:
    """Drop the models a crash recorded without their trial (they never trained)."""
    dropped = store.drop_untrained_orphans()
    if dropped:
        _log.warning("dropped models %s: recorded without their trial by a crash (they never "
                     "trained; the strategy may propose them again)", dropped)


def repair_checkpoints(store: Any, folder: Any) -> None:
    """Remove the temporaries of workers killed mid-write, and drop the rows of checkpoint
    files that are gone (each such trial goes on from its checkpoint before)."""
    folder.remove_temporaries()
    gone = store.forget_missing_checkpoints()
    if gone:
        _log.warning("%d checkpoint file(s) are gone (a deletion cut short by a crash, or "
                     "removed by hand): their rows are dropped, and those trials resume from "
                     "their checkpoint before: %s", len(gone),
                     ", ".join(f"{t} step {s}" for t, s in gone[:5]))


def finish_half_ended(store: Any, runner: Any, proposals: Any, scheduler: Any) -> None:
    """Complete the end of trials whose ending the driver journaled but whose effects (the
    model's status, the strategy told) it died before writing: those are written in one
    transaction (:meth:`.Proposals.on_trial_end`), so a model still ``training`` means none
    were; and collect the finished trials' checkpoints the scheduler no longer needs."""
    training = {row["id"] for row in store.models("training")}
    finished = [t for t in runner.trials.values()
                if t.state is TrialState.TERMINATED or t.state is TrialState.ERRORED]
    ended = [t for t in finished if t.config.get("model_id") in training]
    if ended and not scheduler.spawns_trials:
        # (PBT's trials share models: a model's status follows its last trial)
        order = {row["id"]: row["ended"] or 0.0 for row in store.trials()}
        for trial in sorted(ended, key=lambda t: order.get(t.trial_id, 0.0)):
            proposals.on_trial_end(trial, report=False)
    # An end's transaction commits before its checkpoints are collected: a driver killed
    # between the two left a finished trial's older checkpoints on disk, which nothing else
    # would delete. Collecting again is idempotent (what is left is what the scheduler keeps);
    # a scheduler whose trials share checkpoints lists them all at once.
    for trial in finished[:1] if scheduler.checkpoints_shared else finished:
        proposals.collect_garbage(trial)
