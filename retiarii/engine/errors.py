"""The engine's errors that every layer may raise, executors included: kept apart from the
experiment so that an executor can say "the environment failed" without importing it."""
from __future__ import annotations

import os
import sys

__all__ = ["EnvironmentFailure", "ExperimentError", "main_guard_hint", "stopped"]


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


def stopped(path: str, why: str) -> EnvironmentFailure:
    """The failure a stopped run raises: why, and how it goes on (here, on another Ray
    cluster, or moved to the other executor)."""
    return EnvironmentFailure(
        f"{path}: stopped, {why}. Nothing is lost: fix the cause, then resume (retiarii resume "
        f"{path} [--address HOST:PORT] [--executor local|ray], or Experiment.resume())")


def main_guard_hint() -> str:
    """What to say when the driver runs a script: a worker process imports that script again
    (Python's spawn and forkserver do), and a script that starts the search at import time,
    not under ``if __name__ == "__main__":``, makes every worker fail at start (Python raises
    "An attempt has been made to start a new process before ... bootstrapping phase")."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return ""
    return (f", and that {os.path.basename(path)} starts the search under "
            f"`if __name__ == \"__main__\":` (each worker process imports it again)")
