"""The speed-ups a measuring group decides on: its timed batches, apart's lower bound, fused on
copies or ruled out by its bounds (``measuring_group.MeasuringGroup`` supplies the timings).

What the real batches do not measure is bounded or measured on copies:

- **apart** (``separate``): each model's step alone. A lower bound comes free: every model
  alone computes the group's shared frozen part, which the real batches time (the group's
  ``shared`` cell, computed once per batch), so apart costs at least ``N * (shared + load)``
  per batch. When that bound already puts the best merged layout over the margin by
  :data:`BOUND_SAFETY` (the frozen trunk: 16 trunks apart against one), no model is profiled
  alone; otherwise one trial per architecture is profiled on copies (``profiles.reprofile``).
- **fused** when it does not go first: measured on copies (``profiles.time_fused``) unless
  its bounds rule it out: on a CPU a fused unit of K models computes their frozen part K
  times (:data:`FUSED_CPU_BOUND`), and on any device every fused step pays each model's share
  of a grouped step (its ``training_step`` through a proxy, its RNG streams), at least what
  the CSE step costs beyond the models' steps alone and the shared part
  (:data:`PER_MODEL_BOUND`).
- **CSE** when fused went first (one architecture sharing nothing frozen): its step costs at
  least :data:`CSE_FLOOR` of the models' steps alone, so its speed-up has an upper bound.

Example::

    timed = Timed(steps={Layout.CSE: 0.011}, merged=frozenset({Layout.CSE}),
                  ids=("a", "b", "c", "d"), load=0.0, shared=0.008)
    estimate = merged_speedups(timed, Profiles(alone=dict, early={}, reprofile=print))
    estimate.bound_s   # 0.008: apart not profiled, the speed-ups are lower bounds
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...optim.cost import MARGIN, Layout, probe_speedups
from .measuring_math import close_call, fused_rivals

__all__ = ["BOUND_SAFETY", "CSE_FLOOR", "DECISIVE", "Estimate", "FUSED_CPU_BOUND",
           "PER_MODEL_BOUND", "Profiles", "Timed", "fused_first_speedups", "merged_speedups"]

# The lower bound of apart must put the best merged layout this much over the margin to skip
# the alone profiles (the shared part's time is itself measured, with noise).
BOUND_SAFETY = 1.1
# On a CPU a fused unit of K models costs at least this share of K times their frozen part
# (K times the arithmetic in one grouped kernel; half, for what one thread's caches save).
FUSED_CPU_BOUND = 0.5
# A fused step costs at least this share of the per-model work a CSE step measured beyond
# the models' own steps (proxies, RNG streams; the whole of it: a fused step pays it too).
PER_MODEL_BOUND = 1.0
# A merged step of models that share nothing frozen (each model's own part, one loader) costs
# at least this share of their steps alone: measured 0.98-0.99 for 16 MLPs and 16 small CNNs
# on a CPU (one backward over the summed losses saves N - 1 autograd calls, the proxies and
# RNG switches add about as much). So CSE can gain at most the loader and this much on apart,
# and a fused layout measured above that needs no CSE batch to win. Assumed on a GPU too
# (unmeasured there), where fused same-shape models usually beat CSE by far more (6-7x for
# 16 MLPs or small CNNs on an H100: benchmarks/README.md), and a fused segment slower than
# apart is reverted all the same.
CSE_FLOOR = 0.9
# A choice measured fused-first stands on the alone profiles taken before the first batch
# when it beats its rival (apart by the margin, CSE's bound) by this factor; closer, the
# models are profiled alone again next to the batches (a shared machine's load moves).
DECISIVE = 1.25


@dataclass(frozen=True)
class Timed:
    """What a measuring group's first batches timed (plain values).

    Args:
        steps: layout -> its least timed batch (every model's step).
        merged: the merged layouts the group can train in (its plans).
        ids: the group's trials.
        load: the loader's typical wait per batch.
        shared: the shared cell's least time per batch (0: none timed).
        produce, start: the pipeline's per-batch production and start-up seconds.
        fusable: the fusion units (trial ids) the group may fuse.
        device_type: ``"cpu"``, ``"cuda"``, ...
        fused_failed: why fusing failed here (fused is then no candidate).
    """

    steps: Mapping[Layout, float]
    merged: frozenset[Layout]
    ids: tuple[str, ...]
    load: float
    shared: float
    produce: float = 0.0
    start: float = 0.0
    fusable: tuple[tuple[str, ...], ...] = ()
    device_type: str = "cpu"
    fused_failed: str | None = None


@dataclass(frozen=True)
class Profiles:
    """The alone profiles as the group holds them, and the measurements it can take.

    Args:
        alone: () -> each trial's step time alone known now.
        early: the profiles taken before the first batch (trial -> seconds).
        reprofile: (early) -> None: profile the trials alone now, next to the batches, each
            keeping the least of that and its ``early`` time.
        time_fused: (estimate, limit) -> ``{Layout.FUSED: seconds}`` timed on copies
            (stopped when far over ``limit``); None: the group cannot time copies.
    """

    alone: Callable[[], dict[str, float]]
    early: Mapping[str, float]
    reprofile: Callable[[Mapping[str, float]], None]
    time_fused: Callable[[dict[str, float], float], Mapping[Layout, float]] | None = None


@dataclass(frozen=True)
class Estimate:
    """Each candidate's speed-up over apart per batch, and what the choice records of it."""

    speedups: dict[Layout, float]
    steps_s: dict[str, float] = field(default_factory=dict)  # layout -> per batch, all N
    bound_s: float | None = None  # apart not profiled: the speed-ups are lower bounds
    skipped: str = ""  # why fused was not measured


def _fused_skipped(timed: Timed, estimate: Mapping[str, float], best: float, apart: float,
                   bounded: bool) -> str:
    """Why fused is not measured on copies ("" when it is)."""
    frozen = FUSED_CPU_BOUND * timed.shared * sum(len(u) for u in timed.fusable)
    # A fused step pays each model's own share of a grouped step too (its training_step
    # through a proxy, its RNG streams): at least what the CSE step costs beyond the models'
    # steps alone and the shared part.
    per_model = (timed.steps[Layout.CSE] - sum(estimate.values()) - timed.shared
                 if Layout.CSE in timed.steps and not bounded else 0.0)
    if timed.fused_failed is not None:
        return f"fused not measured: {timed.fused_failed}"
    if timed.device_type == "cpu" and frozen >= best:
        return f"fused not measured: its frozen parts alone {frozen:.3f}s"
    if PER_MODEL_BOUND * per_model >= min(best, apart):
        return f"fused not measured: a grouped step's per-model work alone {per_model:.3f}s"
    return ""


def merged_speedups(timed: Timed, profiles: Profiles) -> Estimate:
    """The speed-ups of the layouts measured (a merged one among them): apart from the alone
    profiles or, when they are missing and it decides, its lower bound; the alone profiles
    taken again next to the batches when the call is close; fused on copies unless ruled
    out (see the module docstring)."""
    steps, ids, load, shared = dict(timed.steps), list(timed.ids), timed.load, timed.shared
    best = min(steps.values())
    alone = profiles.alone()
    # apart costs at least N * (shared + load): every model alone computes the shared part
    floor = probe_speedups({t: shared for t in ids}, {Layout.CSE: best}, load)
    bounded = len(alone) < len(ids) and floor.get(Layout.CSE, 0.0) >= MARGIN * BOUND_SAFETY
    early = dict(profiles.early)
    if (len(alone) < len(ids) and not bounded) or (early and close_call(
            alone, ids, {k: v for k, v in steps.items() if k in timed.merged}, load,
            timed.produce, timed.start, MARGIN, DECISIVE)):
        # profiled now, next to the steps it is compared with (a shared machine's load moves
        # between the first batch and this one), when the call is close
        profiles.reprofile(early)
        alone = profiles.alone()
    estimate = {t: alone.get(t, shared) for t in ids}
    skipped = ""
    if timed.fusable and Layout.FUSED not in steps:
        apart = sum(estimate.values()) + (len(ids) - 1) * load
        skipped = _fused_skipped(timed, estimate, best, apart, bounded)
        if not skipped and profiles.time_fused is None:
            skipped = "fused not measured: the group was given no way to time copies"
        elif not skipped:  # stopped at its warm-up when far slower than the best so far
            steps.update(profiles.time_fused(estimate, min(best, apart)))
    return Estimate(probe_speedups(estimate, steps, load, timed.produce, timed.start),
                    steps_s={k.value: v for k, v in steps.items()},
                    bound_s=shared if bounded else None, skipped=skipped)


def fused_first_speedups(timed: Timed, profiles: Profiles) -> Estimate:
    """Fused measured on the real batches, no merged layout yet: fused's speed-up over apart
    and, for CSE, the most it could reach (its step at least :data:`CSE_FLOOR` times the
    models' steps alone: they share nothing frozen), which the group measures when it ranks
    first. The alone profiles taken before the first batch are taken again next to these
    batches only when the call is close (within :data:`DECISIVE` of its rival)."""
    ids, early = list(timed.ids), dict(profiles.early)
    if len(profiles.alone()) < len(ids):
        profiles.reprofile(early)
        early = {}
    out = fused_rivals(profiles.alone(), timed.steps, ids, timed.load, CSE_FLOOR)
    rival = max(MARGIN, out.get(Layout.CSE, 0.0))
    if early and Layout.FUSED in out and rival / DECISIVE < out[Layout.FUSED] < rival * DECISIVE:
        profiles.reprofile(early)
        out = fused_rivals(profiles.alone(), timed.steps, ids, timed.load, CSE_FLOOR)
    return Estimate(out, steps_s={k.value: v for k, v in timed.steps.items()})
