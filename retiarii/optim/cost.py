"""The cost model of a merged job: is training these models as one group faster than apart?

Pure arithmetic over what a worker measured (a :class:`~retiarii.engine.executors.base.JobProfiled`
unit) and each model's profiled separate step time; the engine reverts a group whose
estimated speed-up is below 1 (paper §5.2, §6: a merged job slower than its models trained
separately is reverted for the rest of the search).

A merged segment costs what the worker measured: planning and building the group once
(``setup_s``), then per batch the loader's time once (one data pipeline feeds every model) and
the group's compute (the shared part once, every model's own part, backward and optimizer
steps). Trained apart, each model would pay its own loader and its own step per batch (and
its own model building, which the merged job pays too, so it is in neither)::

    separate = batches * (sum(alone_s[m] for m in models) + N * load_s / batches)
    merged   = setup_s + load_s + compute_s
    speedup  = separate / merged

So a group whose segment is short (a few batches on a fast device) is not worth its setup, and
is reverted, even when each of its batches is faster merged.

A **fused** unit (``"fused": True``: same-architecture models trained as one fused model) is
compared with the same models grouped but unfused, which pays the loader once per batch and
every model's own step (what training alone measured)::

    unfused = load_s + batches * sum(alone_s[m] for m in models)
    fused   = load_s + compute_s
    fused_speedup = unfused / fused        # <= merged_speedup's "apart" too: N loaders >= 1

Setup is left out of both (fusing and building a group module cost alike), and so is what CSE
would save on a frozen part the models share (its separate steps include it): a fused unit of
models with a large frozen part is estimated a little better than it is against CSE.

Example::

    >>> unit = {"trials": ["a", "b"], "merged": True, "batches": 10, "load_s": 1.0,
    ...         "compute_s": 1.0, "setup_s": 0.0}
    >>> merged_speedup(unit, {"a": 0.08, "b": 0.08})   # 10 * (0.16 + 2 * 0.1) / 2.0
    1.8
    >>> round(merged_speedup({**unit, "setup_s": 2.0}, {"a": 0.08, "b": 0.08}), 3)
    0.9
    >>> fused_speedup({**unit, "fused": True}, {"a": 0.08, "b": 0.08})   # (1 + 10 * 0.16) / 2
    1.3
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["fused_speedup", "fusion_slower", "merged_speedup", "slower_than_apart"]


def _measured(unit: Mapping, alone_s: Mapping[str, float]) -> tuple[list[str], int] | None:
    """The unit's trials and batches when it was merged, measured and every trial profiled."""
    trials = list(unit.get("trials") or ())
    batches = unit.get("batches") or 0
    if not unit.get("merged") or batches <= 0 or len(trials) < 2:
        return None
    if any(alone_s.get(t) is None for t in trials):
        return None
    return trials, batches


def fused_speedup(unit: Mapping, alone_s: Mapping[str, float]) -> float | None:
    """Estimated time of the unit's models grouped unfused / fused (see the module
    docstring); None for a unit that was not fused, or when something is missing.

    Args:
        unit: a fused unit's report (``"fused": True``, with the keys of
            :func:`merged_speedup`).
        alone_s: trial -> its separate step time (seconds per batch), measured alone.
    """
    measured = _measured(unit, alone_s) if unit.get("fused") else None
    if measured is None:
        return None
    trials, batches = measured
    load = float(unit["load_s"])
    fused = load + float(unit["compute_s"])
    if fused <= 0.0:
        return None
    return (load + batches * sum(float(alone_s[t]) for t in trials)) / fused


def fusion_slower(speedup: float | None, margin: float = 1.0) -> bool:
    """Whether fusion is reverted for a fused unit with this :func:`fused_speedup`: below
    ``margin``. 1 by default: fused and unfused groups share the rest of a job (the loader,
    validation, each trial's bookkeeping), so no allowance is needed. Unknown never reverts.

    Example::

        >>> fusion_slower(0.7), fusion_slower(1.3), fusion_slower(None)
        (True, False, False)
    """
    return speedup is not None and speedup < margin


def merged_speedup(unit: Mapping, alone_s: Mapping[str, float]) -> float | None:
    """Estimated time apart / time merged of one unit; None when something is missing (no
    batch measured, a model without a separate profile, a unit that was not merged).

    Args:
        unit: ``{"trials", "merged", "batches", "load_s", "compute_s", "setup_s"}`` as the
            worker reports (totals over the job's segment; ``setup_s`` missing counts as 0).
        alone_s: trial -> its separate step time (seconds per batch), measured alone.
    """
    measured = _measured(unit, alone_s)
    if measured is None:
        return None
    trials, batches = measured
    load = float(unit["load_s"])
    merged = float(unit.get("setup_s") or 0.0) + load + float(unit["compute_s"])
    if merged <= 0.0:
        return None
    separate = batches * sum(float(alone_s[t]) for t in trials) + len(trials) * load
    return separate / merged


# What a grouped job costs beyond what the estimate measures (validation through the proxies,
# each trial's end-of-epoch bookkeeping in turn): about 10% of a job on the demo search, whose
# models share nothing but an in-memory data set (benchmarks/optimize_e2e.py). A group must
# be estimated at least this much faster to be kept.
MARGIN = 1.1


def slower_than_apart(speedup: float | None, margin: float = MARGIN) -> bool:
    """Whether a unit with this estimated speed-up is reverted: below ``margin`` (the default
    :data:`MARGIN` allows for what the estimate leaves out). An unknown speed-up never reverts
    (nothing measured says it is slower).

    Example::

        >>> slower_than_apart(0.7), slower_than_apart(1.3), slower_than_apart(None)
        (True, False, False)
    """
    return speedup is not None and speedup < margin
