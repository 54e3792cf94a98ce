"""The cost model of a merged job: is training these models as one group faster than apart?

Pure arithmetic over what a worker measured (a :class:`~retiarii.engine.executors.base.JobProfiled`
unit) and each model's profiled separate step time; the engine reverts a group whose
estimated speed-up is below 1 (paper §5.2, §6: a merged job slower than its models trained
separately is reverted for the rest of the search).

A merged step costs what the worker measured per batch: the loader's time once (one data
pipeline feeds every model) plus the group's compute (the shared part once, every model's own
part, backward and optimizer steps). Trained apart, each model would pay its own loader and
its own step::

    separate = sum(alone_s[m] for m in models) + N * load_s / batches
    merged   = (load_s + compute_s) / batches
    speedup  = separate / merged

Example::

    >>> unit = {"trials": ["a", "b"], "merged": True, "batches": 10, "load_s": 1.0,
    ...         "compute_s": 1.0}
    >>> merged_speedup(unit, {"a": 0.08, "b": 0.08})   # (0.16 + 2 * 0.1) / 0.2
    1.8
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["merged_speedup", "slower_than_apart"]


def merged_speedup(unit: Mapping, alone_s: Mapping[str, float]) -> float | None:
    """Estimated time apart / time merged of one unit; None when something is missing (no
    batch measured, a model without a separate profile, a unit that was not merged).

    Args:
        unit: ``{"trials", "merged", "batches", "load_s", "compute_s"}`` as the worker reports.
        alone_s: trial -> its separate step time (seconds per batch), measured alone.
    """
    trials = list(unit.get("trials") or ())
    batches = unit.get("batches") or 0
    if not unit.get("merged") or batches <= 0 or len(trials) < 2:
        return None
    if any(alone_s.get(t) is None for t in trials):
        return None
    load = float(unit["load_s"]) / batches
    merged = load + float(unit["compute_s"]) / batches
    if merged <= 0.0:
        return None
    separate = sum(float(alone_s[t]) for t in trials) + len(trials) * load
    return separate / merged


def slower_than_apart(speedup: float | None, margin: float = 1.0) -> bool:
    """Whether a unit with this estimated speed-up is reverted: below ``margin`` (1.0: any
    slowdown). An unknown speed-up never reverts (nothing measured says it is slower).

    Example::

        >>> slower_than_apart(0.7), slower_than_apart(1.3), slower_than_apart(None)
        (True, False, False)
    """
    return speedup is not None and speedup < margin
