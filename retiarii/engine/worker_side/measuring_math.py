"""The arithmetic of measuring layouts on a segment's first batches (engine/measuring.py):
what a measured segment is judged on, when a call is close enough to profile the models
alone again, and fused-first's rivals. Plain numbers in, numbers out (tests drive them by
hand: tests/test_measuring.py).

Example::

    judged_steps([2.0, 0.05, 0.06, 0.1, 0.1, 0.1], measured_to=3, warm_after=0, timed=[0.05])
    # {"step_s": 0.1, "spread": 0.0, "judged_batches": 3}
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ...optim.cost import Layout, probe_speedups, relative_spread

__all__ = ["close_call", "fused_rivals", "judged_steps", "median"]


def median(values: Sequence[float]) -> float:
    """The upper median of ``values`` (0 when empty)."""
    return sorted(values)[len(values) // 2] if values else 0.0


def judged_steps(steps: Sequence[float], measured_to: int, warm_after: int,
                 timed: Iterable[float]) -> dict:
    """The typical step and spread a measured segment is judged on (``cost.judge_segment``):
    the batches it trained in the chosen layout after the decision (``steps[measured_to:]``),
    its first left out when that layout had trained none before (``warm_after`` 1: a
    warm-up); when none followed the decision, the chosen layout's ``timed`` batches. A
    warm-up, or a batch of another candidate, never counts (mixed in, they read as 92% noise
    and kept a group measured at 0.54x). ``step_s`` None: nothing to judge on."""
    after = list(steps[measured_to + warm_after:]) or list(timed)
    return {"step_s": median(after) if after else None, "spread": relative_spread(after),
            "judged_batches": len(after)}


def close_call(alone: Mapping[str, float], ids: list[str], merged: Mapping[Layout, float],
               load: float, produce: float, start: float, margin: float,
               decisive: float) -> bool:
    """Whether the alone profiles taken so far leave the call close, so that they are worth
    taking again next to the batches: some model's time alone is unknown, or the best
    ``merged`` layout's speed-up over apart is within ``decisive`` of ``margin``, either way.
    Profiling every architecture again costs steps of each on copies: on workload (d), 64
    architectures, a share of the run the measuring must not take when it decides nothing."""
    if len(alone) < len(ids):
        return True
    got = probe_speedups({t: alone[t] for t in ids}, merged, load, produce, start)
    return margin / decisive < max(got.values(), default=0.0) < margin * decisive


def fused_rivals(alone: Mapping[str, float], steps: Mapping[Layout, float], ids: list[str],
                 load: float, cse_floor: float) -> dict[Layout, float]:
    """Fused measured first: each layout measured's speed-up over apart and, for CSE, the
    most it could reach (its step at least ``cse_floor`` times the models' steps alone);
    CSE unbounded (measure it) while some model's time alone is unknown."""
    if len(alone) < len(ids):  # apart unknown: CSE is measured (it may win)
        return {Layout.CSE: float("inf")}
    total = sum(alone[t] for t in ids)
    out = probe_speedups({t: alone[t] for t in ids}, dict(steps), load)
    if total + load > 0.0:
        out[Layout.CSE] = (total + len(ids) * load) / (cse_floor * total + load)
    return out
