"""Where the trial runner writes what happens, before it takes effect: the :class:`Journal`
protocol (the SQLite store implements it) and :class:`MemoryJournal`, its in-memory twin."""
from __future__ import annotations

import json
from typing import Protocol

from .trial import Trial, TrialState

__all__ = ["Journal", "MemoryJournal"]


class Journal(Protocol):
    """Where the runner writes what happens, before it takes effect (the SQLite store).

    ``scheduler_state`` receives ``{"scheduler": scheduler.state_dict(), "fed": [[trial, step],
    ...], "known": n, "append_only": ["fed"]}`` (each step the scheduler was fed, in order, and
    how many trials it knew of); only the latest one matters, and a store may keep the lists
    that ``append_only`` names incrementally (docs/store.md). ``records()`` returns
    what was written as ``(kind, payload)`` pairs with the payloads of :class:`MemoryJournal`:
    ``trial_added`` in creation order, each trial's transitions, results and checkpoints in the
    order written (no order is needed *between* trials or kinds), and the latest
    ``scheduler_state``. :meth:`TrialRunner.resume` folds them. Checkpoints are journaled by
    name, relative to the runner's ``checkpoint_dir`` (:class:`~.checkpoint.CheckpointDir`);
    ``forget_checkpoint`` withdraws one found unreadable (a journal may instead leave it out of
    ``records()``, as the store does, or record ``("forget_checkpoint", {trial_id, step})``).
    """

    def trial_added(self, trial: Trial) -> None: ...
    def transition(self, trial_id: str, old: TrialState, new: TrialState, reason: str) -> None: ...
    def result(self, trial_id: str, step: int, metrics: dict, time: float) -> None: ...
    def checkpoint(self, trial_id: str, step: int, path: str,
                   fused: bool = False) -> None: ...  # path: a name; fused: trained fused
    def forget_checkpoint(self, trial_id: str, step: int) -> None: ...  # unreadable: not used
    def scheduler_state(self, state: dict) -> None: ...
    def worker(self, trial_id: str, worker: str) -> None: ...  # where a segment runs (info)
    def records(self) -> list[tuple[str, dict]]: ...


class MemoryJournal:
    """An in-memory :class:`Journal` for tests; payloads go through JSON, as in a store.

    Example:
        >>> j = MemoryJournal()
        >>> j.checkpoint("t1", 3, "ckpt/t1/3")
        >>> j.records()
        [('checkpoint', {'trial_id': 't1', 'step': 3, 'path': 'ckpt/t1/3'})]
    """

    def __init__(self):
        self._records: list[tuple[str, dict]] = []
        self.workers: dict[str, str] = {}  # trial -> the worker of its latest segment

    def _write(self, kind: str, payload: dict) -> None:
        self._records.append((kind, json.loads(json.dumps(payload, allow_nan=False))))

    def trial_added(self, trial: Trial) -> None:
        self._write("trial_added", trial.to_record())

    def transition(self, trial_id, old, new, reason) -> None:
        self._write("transition", {"trial_id": trial_id, "old": old.value, "new": new.value,
                                   "reason": reason})

    def result(self, trial_id, step, metrics, time) -> None:
        self._write("result", {"trial_id": trial_id, "step": step, "metrics": metrics,
                               "time": time})

    def checkpoint(self, trial_id, step, path, fused=False) -> None:
        self._write("checkpoint", {"trial_id": trial_id, "step": step, "path": path,
                                   **({"fused": True} if fused else {})})

    def forget_checkpoint(self, trial_id, step) -> None:
        self._write("forget_checkpoint", {"trial_id": trial_id, "step": step})

    def scheduler_state(self, state: dict) -> None:
        self._write("scheduler_state", {"state": state})

    def worker(self, trial_id: str, worker: str) -> None:
        self.workers[trial_id] = worker  # information only: resume does not need it

    def records(self) -> list[tuple[str, dict]]:
        return list(self._records)
