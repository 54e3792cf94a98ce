"""The engine's errors that every layer may raise, executors included: kept apart from the
experiment so that an executor can say "the environment failed" without importing it."""
from __future__ import annotations

__all__ = ["EnvironmentFailure", "ExperimentError"]


class ExperimentError(RuntimeError):
    """An experiment that cannot start or resume as asked; the message says why and the fix."""


class EnvironmentFailure(ExperimentError):
    """The run stopped because its environment kept failing (an I/O error such as a read-only
    checkpoint folder, lost workers, out of memory) or can no longer run anything (an executor
    whose workers cannot start, a Ray cluster with no live node). Nothing is lost: fix the
    cause, then ``resume()``; the trials it interrupted are retried, charged nothing.

    An executor raises it from ``submit``/``next_event`` (its message names what was lost); the
    experiment then stops with status ``stopped`` and re-raises it with the resume command.
    """
