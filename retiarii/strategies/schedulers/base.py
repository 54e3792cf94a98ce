"""Training control: the decision a scheduler returns, and the FIFO scheduler every other extends.

A scheduler is the training-control half of a strategy. It never touches the engine: it is told
about trials and their streamed results and answers with a :class:`Decision` (continue, pause or
stop the trial that reported), picks which waiting trial runs next, may ask for a new trial to be
started from a parent's checkpoint (:class:`Spawn`, used by PBT), and may name waiting trials it
has given up on (:meth:`Scheduler.trials_to_stop`, used by synchronous Hyperband).

Every scheduler can be driven with plain numbers, in Ray Tune's convention::

    >>> from retiarii.strategies.schedulers.base import Decision, Scheduler
    >>> s = Scheduler()                    # FIFO: never stops anything
    >>> s.on_trial_add("a", {"lr": 0.1})
    >>> s.on_trial_result("a", {"training_iteration": 1, "loss": 0.9})
    <Decision.CONTINUE: 'CONTINUE'>
    >>> s.choose_trial_to_run(["b", "a"])
    'b'

Its whole state is a JSON-serializable dict (trial ids are strings, non-finite floats are written
as the strings ``"nan"``, ``"inf"``, ``"-inf"``), so a resumed experiment continues the same search.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable


class Decision(enum.Enum):
    """What happens to a trial after it reports a result."""

    CONTINUE = "CONTINUE"  # keep training (next segment)
    PAUSE = "PAUSE"  # checkpoint, free the worker; the trial may be resumed later
    STOP = "STOP"  # terminate the trial


@dataclass(frozen=True)
class Spawn:
    """Start a new trial, warm-started from a parent's checkpoint (PBT reproduction).

    Args:
        parent: trial id whose checkpoint the child starts from; None starts from scratch.
        config: the child's hyper-parameters (its spec).
        trial_id: the id the child must get; None lets the runner name it.
        parent_step: the step of the parent's checkpoint to start from (the pinned donor
            checkpoint); None means the parent's latest checkpoint.
        initiator: the trial whose reproduction made this one (PBT's initiator, the seed
            paper's ``initiator_parent_trial_id``); it differs from ``parent`` when an
            opponent won the tournament. None for a trial of the first generation.
    """

    parent: str | None
    config: dict[str, Any] = field(default_factory=dict)
    trial_id: str | None = None
    parent_step: int | None = None
    initiator: str | None = None


# ---- helpers shared by the schedulers ------------------------------------------------------


def json_float(x: float | None) -> float | str | None:
    """A float as strict JSON allows it (NaN and infinities become strings)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def from_json_float(x: float | str | None) -> float | None:
    """Inverse of :func:`json_float`."""
    return None if x is None else float(x)


def metric_value(result: dict, metric: str) -> float:
    """The metric of a result as a float; NaN when it is missing or None."""
    v = result.get(metric)
    return math.nan if v is None else float(v)


def check_state(state: dict, kind: str) -> dict:
    """Refuse a state dict written by another scheduler class (a likely mix-up on resume)."""
    got = state.get("kind") if isinstance(state, dict) else None
    if got != kind:
        raise ValueError(
            f"cannot load a {got!r} scheduler state into {kind}: resume the experiment with "
            f"the scheduler it was started with"
        )
    return state


def replay_log(log: list, handlers: dict[str, Callable[..., Any]], owner: str) -> None:
    """Replay a saved event log: each event ``[kind, *args]`` calls ``handlers[kind](*args)``,
    in order. A state whose log grows (ASHA, Hyperband, PBT, strategies) is rebuilt this way.

    Example::

        replay_log([["add", "t1"], ["res", "t1", 1, 0.5]],
                   {"add": self._add, "res": self._result}, "Hyperband")

    Raises:
        ValueError: an event of a kind no handler takes (naming the event and ``owner``).
    """
    for event in log:
        handler = handlers.get(event[0]) if event else None
        if handler is None:
            raise ValueError(f"unknown event {event!r} in a saved {owner} state")
        handler(*event[1:])


# ---- the base class --------------------------------------------------------------------------


class Scheduler:
    """FIFO training control, and the interface every scheduler implements.

    Trials run in the order they are offered and always continue. Subclasses override the
    callbacks they need. The runner's side of the contract:

    * ``on_trial_add`` once per trial, before it first runs (spawned trials included);
    * ``on_trial_result`` once per new step of a running trial (a step replayed after a retry
      is not reported again);
    * ``on_trial_complete`` when a running trial terminates, whether it reached its last step
      or was stopped (Ray Tune does the same);
    * ``on_trial_error`` when a trial has failed for good (after its retries);
    * ``choose_trial_to_run`` when a worker is free: ``candidates`` holds the PENDING trials in
      creation order followed by the PAUSED ones; the runner launches what it returns, so a
      scheduler may update its books (promotions) when it answers;
    * ``next_spawn`` when a worker is free and ``choose_trial_to_run`` returned None;
    * ``trials_to_stop`` after every other call: ids of waiting (or running) trials the
      scheduler has given up on; the runner terminates them.

    Example:
        >>> s = Scheduler()
        >>> s.on_trial_result("t0", {"training_iteration": 3, "acc": 0.5}).name
        'CONTINUE'
    """

    #: True for schedulers that create every trial themselves (PBT): an experiment then asks
    #: its strategy for an architecture only when the scheduler spawns a fresh trial.
    spawns_trials: bool = False

    #: False when :meth:`deletable_checkpoints` decides about each trial's checkpoints from that
    #: trial alone (the rule below): an experiment then collects the garbage of a trial when it
    #: ends, in time independent of the run's length. True (PBT, whose trials start from
    #: others' checkpoints) makes it look at every checkpoint each time.
    checkpoints_shared: bool = False

    def on_trial_add(self, trial_id: str, config: dict) -> None:
        """A trial exists and may be run."""

    def on_trial_result(self, trial_id: str, result: dict) -> Decision:
        """A running trial reported ``result``; decide its fate."""
        return Decision.CONTINUE

    def on_trial_complete(self, trial_id: str, result: dict) -> None:
        """A running trial terminated; ``result`` is its last result."""

    def on_trial_error(self, trial_id: str) -> None:
        """A trial failed for good."""

    def choose_trial_to_run(self, candidates: list[str]) -> str | None:
        """One of ``candidates`` (PENDING first, then PAUSED) to run next, or None."""
        return candidates[0] if candidates else None

    def next_spawn(self) -> Spawn | None:
        """A new trial to create and run now, or None."""
        return None

    def trials_to_stop(self) -> list[str]:
        """Trials to terminate now (each id is returned once)."""
        return []

    def deletable_checkpoints(self, checkpoints, states, keep_lineage_of=None) -> set[str]:
        """Paths of checkpoints garbage collection may delete: all but the latest of each
        trial (a paused trial resumes from its latest; a finished one is exported from it).
        Schedulers whose trials start from others' checkpoints (PBT) keep more.

        Args:
            checkpoints: ``(trial_id, step, path)`` of every checkpoint that exists.
            states: trial id -> state (unused here; PBT reads it).
            keep_lineage_of: unused here (PBT: trials whose lineage must stay replayable).
        """
        latest: dict[str, int] = {}
        for trial_id, step, _ in checkpoints:
            latest[trial_id] = max(step, latest.get(trial_id, step))
        return {path for trial_id, step, path in checkpoints if step < latest[trial_id]}

    def state_dict(self) -> dict:
        """Everything needed to continue the same search, as JSON-serializable data."""
        return {"kind": type(self).__name__}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        check_state(state, type(self).__name__)
