"""The trials waiting for a slot: PENDING ones first, then PAUSED ones, each in creation order.

The runner asks for candidates every time a slot frees, so the lists are kept as trials move
(:meth:`WaitingTrials.track`) instead of scanning every trial; a list is sorted again only when
a trial older than its newest one comes back (a retry, a resume).

Example::

    waiting = WaitingTrials()
    waiting.track("t2", TrialState.PENDING, 2); waiting.track("t1", TrialState.PAUSED, 1)
    waiting.track("t0", TrialState.PENDING, 0)
    waiting.candidates(busy=set())          # ['t0', 't2', 't1']
"""
from __future__ import annotations

from typing import Container

from .trial import TrialState

__all__ = ["WaitingTrials"]


class WaitingTrials:
    """The waiting trials of a runner, in the order it offers them to the scheduler."""

    def __init__(self):
        # state -> {trial: creation index}, sorted lazily (see _unsorted)
        self._lists: dict[TrialState, dict[str, int]] = {TrialState.PENDING: {},
                                                         TrialState.PAUSED: {}}
        self._unsorted: set[TrialState] = set()

    def track(self, trial_id: str, state: TrialState, index: int) -> None:
        """Trial ``trial_id`` (created ``index``-th) is now in ``state``."""
        for kind, waiting in self._lists.items():
            if kind is state:
                if waiting and index < next(reversed(waiting.values())):
                    self._unsorted.add(kind)  # a retry or resume: not the newest trial
                waiting[trial_id] = index
            else:
                waiting.pop(trial_id, None)

    def candidates(self, busy: Container[str]) -> list[str]:
        """PENDING trials in creation order, then PAUSED ones, leaving out those in ``busy``
        (paused, their last segment still finishing)."""
        out = []
        for state, waiting in self._lists.items():
            if state in self._unsorted:
                self._lists[state] = waiting = dict(sorted(waiting.items(), key=lambda x: x[1]))
                self._unsorted.discard(state)
            out.extend(t for t in waiting if t not in busy)
        return out
