"""The cost model of a merged job: is training these models as one group faster than apart?

Pure arithmetic over what a worker measured (a :class:`~retiarii.engine.jobs.job.JobProfiled`
unit) and each model's profiled separate step time (a warm step: the unit's compute is
counted as its typical step, ``step_s``, times its batches, for the same reason); the
engine reverts a group whose estimated speed-up is below the margin, on evidence
(:func:`judge_segment`; paper §5.2, §6: a merged job slower than its models trained
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

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Layout", "LayoutChoice", "Verdict", "choose_layout", "describe", "fused_speedup",
           "fusion_slower", "judge_segment", "merged_speedup", "probe_speedups", "relative_spread",
           "slower_than_apart"]


def _measured(unit: Mapping, alone_s: Mapping[str, float]) -> tuple[list[str], int] | None:
    """The unit's trials and batches when it was merged, measured and every trial profiled."""
    trials = list(unit.get("trials") or ())
    batches = unit.get("batches") or 0
    if not unit.get("merged") or batches <= 0 or len(trials) < 2:
        return None
    if any(alone_s.get(t) is None for t in trials):
        return None
    return trials, batches


def _compute(unit: Mapping) -> float:
    """The unit's compute over its segment: its typical step (``step_s``, the median after
    the first) times its batches when the worker measured one, else ``compute_s``. The
    first step's warm-up is paid by each model alone too and left out of its profiled step
    time (on a short segment it would outweigh the rest), and a step the machine's other
    work delayed says nothing of the layout."""
    if unit.get("step_s") is not None:
        return float(unit["step_s"]) * int(unit["batches"])
    return float(unit["compute_s"])


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
    fused = load + _compute(unit)
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
            worker reports (totals over the job's segment; ``setup_s`` missing counts as 0),
            with ``produce_s`` (the loader's own pace per batch) and ``start_s`` (a job's
            loader starts per epoch, per batch of the epoch: paid by every model alone and
            once by the unit) when known.
        alone_s: trial -> its separate step time (seconds per batch), measured alone.
    """
    measured = _measured(unit, alone_s)
    if measured is None:
        return None
    trials, batches = measured
    load = float(unit["load_s"])
    # what each model's job pays once per epoch beyond its batches (its loaders' starts),
    # spread over the batches: every model alone pays it, the merged unit once
    starts = batches * float(unit.get("start_s") or 0.0)
    merged = float(unit.get("setup_s") or 0.0) + load + _compute(unit) + starts
    if merged <= 0.0:
        return None
    # a model alone waits for its loader's batches when it steps faster than they come
    produce = batches * float(unit.get("produce_s") or 0.0)
    separate = sum(max(batches * float(alone_s[t]) + load, produce) + starts for t in trials)
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


# ---- choosing a layout per group key and device ---------------------------------------------


class Layout(str, enum.Enum):
    """How the trials of one candidate group train (docs/optimization.md, "Choosing a layout").

    ``SEPARATE``: each model alone; ``CSE``: one grouped job, the shared frozen part once;
    ``BATCHING``: the same plus the batching pass; ``FUSED``: same-architecture trials fused,
    the others of the group in the best of the other layouts. Listed simplest first: on a tie
    the simpler (and, for ``FUSED``, the bit-exact) layout is kept.
    """

    SEPARATE = "separate"
    CSE = "cse"
    BATCHING = "batching"
    FUSED = "fused"


@dataclass(frozen=True)
class LayoutChoice:
    """What :func:`choose_layout` decided: the layouts in the order to try them (best first;
    a job applies the first one that applies to it: ``FUSED`` needs two trials of one
    architecture), each one's speed-up over ``SEPARATE`` (None: not measured) and why."""

    order: tuple[Layout, ...]
    speedups: Mapping[Layout, float | None]
    reason: str

    @property
    def layout(self) -> Layout:
        return self.order[0]


def choose_layout(speedups: Mapping[Layout, float | None], reverted: Iterable[Layout] = (),
                  margin: float = MARGIN) -> LayoutChoice:
    """Rank the layouts of a group by measured speed-up over training its models apart.

    A merged layout must beat ``SEPARATE`` by ``margin`` (what a per-batch measurement leaves
    out: validation through the group, each trial's bookkeeping); one merged layout replaces
    another only when strictly faster; ties keep the simpler one (the order of
    :class:`Layout`). A layout not measured (None or missing) ranks after every measured one
    in :class:`Layout` order, except that with nothing measured ``CSE`` comes first (an unknown
    group is kept merged, as :func:`slower_than_apart` keeps it). ``reverted`` layouts (measured
    slower over a whole segment) are never chosen again; ``SEPARATE`` always remains.

    Example::

        >>> choose_layout({Layout.CSE: 1.3, Layout.FUSED: 2.4}).layout.value
        'fused'
        >>> choose_layout({Layout.CSE: 1.3, Layout.FUSED: 0.64}).order[:2]
        (<Layout.CSE: 'cse'>, <Layout.SEPARATE: 'separate'>)
        >>> choose_layout({Layout.CSE: 1.05}).layout.value   # within the margin: apart
        'separate'

    Args:
        speedups: layout -> its measured speed-up over ``SEPARATE`` (per batch, with the
            loader: apart pays one per model); ``SEPARATE`` is 1 by definition.
        reverted: layouts measured slower than apart over a segment.
        margin: see above (:data:`MARGIN` by default).
    """
    gone = {Layout(r) for r in reverted} - {Layout.SEPARATE}
    known = {Layout(k): float(v) for k, v in speedups.items()
             if v is not None and Layout(k) not in gone}
    known[Layout.SEPARATE] = 1.0

    def rank(layout: Layout) -> float:
        # a merged layout counts only what it is measured above the margin over apart
        s = known[layout]
        return s if layout is Layout.SEPARATE or s >= margin else 0.0

    measured = sorted(known, key=lambda lay: (-rank(lay), list(Layout).index(lay)))
    rest = [lay for lay in Layout if lay not in known and lay not in gone]
    if len(known) == 1 and Layout.CSE in rest:  # nothing measured: merged, as before
        rest.remove(Layout.CSE)
        measured.insert(0, Layout.CSE)
    order = tuple(measured + rest)
    given = {Layout(k): v for k, v in speedups.items()}
    shown = {lay: known.get(lay, given.get(lay)) for lay in Layout if lay in known or lay in given}
    return LayoutChoice(order, shown, describe(order[0], shown, gone))


def describe(layout: Layout | str, speedups: Mapping, reverted: Iterable = (),
             bounds: Mapping | None = None) -> str:
    """One line for the plans table and ``retiarii status``: the layout kept and its measured
    speed-up over apart, and the others measured (``"fused 2.40x (cse 1.30x)"``,
    ``"separate: cse 1.02x, fused 0.64x"``), fastest first; a reverted one reads ``reverted``;
    one not measured because its upper bound already lost (``bounds``: layout -> the most
    it could reach) reads ``at most``.

    Example::

        >>> describe("separate", {"fused": 0.64, "cse": 1.02, "separate": 1.0})
        'separate: cse 1.02x, fused 0.64x'
        >>> describe("fused", {"fused": 2.4}, bounds={"cse": 1.11})
        'fused 2.40x (cse at most 1.11x)'
    """
    layout = Layout(layout)
    gone = {Layout(r) for r in reverted}
    values = {Layout(k): v for k, v in speedups.items()}
    others = [f"{lay.value} {values[lay]:.2f}x" + (" reverted" if lay in gone else "")
              for lay in sorted(values, key=lambda lay: -(values[lay] or 0.0))
              if lay is not layout and lay is not Layout.SEPARATE and values[lay] is not None]
    others += [f"{Layout(k).value} at most {v:.2f}x" for k, v in (bounds or {}).items()
               if values.get(Layout(k)) is None and Layout(k) not in gone]
    others += [f"{lay.value} reverted" for lay in gone if values.get(lay) is None]
    if layout is Layout.SEPARATE:
        return "separate" + (": " + ", ".join(others) if others else "")
    mine = values.get(layout)
    head = layout.value + (f" {mine:.2f}x" if mine is not None else " (not measured)")
    return head + (f" ({', '.join(others)})" if others else "")


def probe_speedups(alone_s: Mapping[str, float], steps_s: Mapping[Layout, float],
                   load_s: float, produce_s: float = 0.0,
                   start_s: float = 0.0) -> dict[Layout, float]:
    """Each measured layout's speed-up over ``SEPARATE`` from one batch's measurements: apart,
    each model pays its own loader and its own step; merged, one loader and the layout's step
    for every model of the group::

        speedup[L] = sum(max(alone_s[t] + load_s, produce_s) + start_s)
                     / (max(steps_s[L] + load_s, produce_s) + start_s)

    ``produce_s``: how long the loader takes to make a batch when nothing else waits for it
    (a DataLoader's worker decoding JPEGs): a model alone, whose step is shorter, waits for
    it at every batch, which the group's wait per batch (``load_s``, hidden by prefetching
    behind N models' steps) does not show.

    ``start_s``: what one model's job pays per epoch beyond its batches and the group pays
    once (its training loader's start, its validation loader's start and first batch: a
    DataLoader forks its decoding processes for each), divided by the epoch's batches: N
    models alone pay it N times (:func:`~retiarii.engine.layout_model.resolve` reads it).

    Example::

        >>> {k.value: round(v, 3) for k, v in probe_speedups(
        ...     {"a": 0.2, "b": 0.2}, {Layout.FUSED: 0.1}, 0.1).items()}   # (0.4 + 0.2) / 0.2
        {'fused': 3.0}

    Args:
        alone_s: trial -> its step time alone (every trial of the group).
        steps_s: layout -> seconds of one step of every trial of the group in it.
        load_s: seconds the loader takes for one batch.
        produce_s: seconds the loader takes to make one batch on its own (0: not known).
        start_s: a job's loader starts per epoch, per batch of the epoch (0: not known).
    """
    apart = sum(max(float(s) + load_s, produce_s) + start_s for s in alone_s.values())
    return {Layout(k): apart / (max(float(v) + load_s, produce_s) + start_s)
            for k, v in steps_s.items() if max(float(v) + load_s, produce_s) + start_s > 0.0}


# ---- reverting on evidence ------------------------------------------------------------------

# The least relative noise a segment's measurement is credited with, whatever its batches'
# spread says: a segment's speed-up divides two measurements (the group's segment and each
# model's step alone, profiled once), and on a shared machine either moves by a few percent
# from one minute to the next (benchmarks/README.md: +-15% between two runs of one search).
NOISE_FLOOR = 0.05
# A segment is *clearly* slower when its speed-up is below 1 (apart) by more than this many
# times its noise: one such segment reverts at once.
CLEAR = 2.0
# Segments in a row measured slower (below the margin, within the noise) that revert.
STRIKES = 2


@dataclass(frozen=True)
class Verdict:
    """What :func:`judge_segment` decided of one segment: revert the layout or keep it, the
    slower segments now counted in a row (``strikes``), and why (for the plans table)."""

    revert: bool
    strikes: int
    reason: str


def judge_segment(speedup: float | None, spread: float | None = None, strikes: int = 0,
                  margin: float = MARGIN) -> Verdict:
    """Whether a layout measured at ``speedup`` over one segment is reverted: only on
    evidence beyond the measurement's noise (``noise = max(spread, NOISE_FLOOR)``):

    - at or over ``margin``: kept, the count of slower segments back to 0;
    - below ``1 - CLEAR * noise`` (slower than apart, beyond the noise): reverted at once;
    - otherwise below the margin (not worth it, or slower within the noise): one more
      slower segment in a row, reverted at :data:`STRIKES` (two) in a row;
    - unknown (nothing measured): kept, the count unchanged.

    Example::

        >>> judge_segment(0.97, 0.02).revert       # one noisy slower segment: kept
        False
        >>> judge_segment(0.97, 0.02, strikes=1)   # the second in a row: reverted
        Verdict(revert=True, strikes=2, reason='2 segments in a row below 1.10x (0.97x)')
        >>> judge_segment(0.5, 0.02).reason        # clearly slower: at once
        '0.50x: slower than apart beyond the noise (5%)'

    Args:
        speedup: the segment's measured speed-up (:func:`merged_speedup`, or
            :func:`fused_speedup` against the models grouped unfused).
        spread: the relative spread of the segment's step times (:func:`relative_spread`);
            None counts as :data:`NOISE_FLOOR`.
        strikes: the slower segments in a row before this one.
        margin: what the layout must reach to count as faster (:data:`MARGIN` for a group
            against apart; 1 for fusion against the models grouped unfused).
    """
    if speedup is None:
        return Verdict(False, strikes, "not measured")
    noise = max(float(spread or 0.0), NOISE_FLOOR)
    if speedup >= margin:
        return Verdict(False, 0, f"{speedup:.2f}x")
    if speedup < 1.0 - CLEAR * noise:
        return Verdict(True, strikes + 1, f"{speedup:.2f}x: slower than apart beyond the "
                                          f"noise ({noise:.0%})")
    strikes += 1
    if strikes >= STRIKES:
        return Verdict(True, strikes, f"{strikes} segments in a row below {margin:.2f}x "
                                      f"({speedup:.2f}x)")
    return Verdict(False, strikes, f"{speedup:.2f}x, below {margin:.2f}x within the noise "
                                   f"({noise:.0%}): kept until {STRIKES} in a row")


def relative_spread(times: Iterable[float]) -> float | None:
    """The spread of a segment's step times relative to their median: the median absolute
    deviation over the median (robust to the one step a machine's other work delays); None
    with fewer than three times. The first step (warm-up: allocations, kernel choice) is the
    caller's to leave out.

    Example::

        >>> round(relative_spread([1.0, 1.1, 0.9, 1.0, 3.0]), 6)   # |dev| 0, .1, .1, 0, 2
        0.1
    """
    values = sorted(float(t) for t in times)
    if len(values) < 3:
        return None
    middle = values[len(values) // 2]
    if middle <= 0.0:
        return None
    deviations = sorted(abs(v - middle) for v in values)
    return deviations[len(deviations) // 2] / middle
