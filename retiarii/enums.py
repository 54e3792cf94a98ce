"""The small vocabularies the packages share, as enums: which way a metric is better
(:class:`Mode`), where a trial is in its lifecycle (:class:`TrialState`) and what became of a
model (:class:`ModelStatus`).

This module imports nothing of retiarii, so strategies and schedulers use these without
importing the engine. ``Mode`` and ``ModelStatus`` are string enums: their members compare
equal to, print as and serialize (JSON, SQLite) as the strings they replace.

Example:
    >>> Mode.parse("min").sign
    -1.0
    >>> TrialState("PAUSED") is TrialState.PAUSED
    True
"""
from __future__ import annotations

import enum
from typing import Any


class Mode(enum.StrEnum):
    """Whether a higher (``"max"``) or a lower (``"min"``) metric is better."""

    MAX = "max"
    MIN = "min"

    @classmethod
    def parse(cls, mode: Any, where: str | None = None) -> "Mode":
        """``mode`` (a Mode or its string) as a Mode; a clear error for anything else.

        Args:
            where: who asks (a class name), to start the error message with.
        """
        try:
            return cls(mode)
        except ValueError:
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}mode must be 'max' or 'min', got {mode!r}") from None

    @property
    def sign(self) -> float:
        """+1.0 for MAX, -1.0 for MIN: ``sign * value`` is higher-is-better."""
        return 1.0 if self is Mode.MAX else -1.0


class TrialState(enum.Enum):
    """A trial's place in its lifecycle (the allowed moves are in ``engine/trials.py``)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    TERMINATED = "TERMINATED"
    ERRORED = "ERRORED"


class ModelStatus(enum.StrEnum):
    """What became of a model of an experiment (the store's ``models.status``)."""

    PENDING = "pending"  # recorded, no trial yet
    TRAINING = "training"  # its trial runs (or will resume)
    TRAINED = "trained"  # its trial ended with a finite final metric
    FAILED = "failed"  # not buildable, its trial failed for good, or a non-finite metric
