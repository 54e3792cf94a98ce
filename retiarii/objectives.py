"""Several objectives and constraints: what a search optimizes, and the Pareto maths on it.

Framework-free: points are tuples of floats, every one of them to be *minimized* (the
literature's convention; :meth:`Objectives.point` turns a model's metrics into one, negating
the objectives to maximize). Constraints give each point a *violation*, 0 when it meets them
all; Deb's constrained domination ranks every feasible point before every infeasible one,
and infeasible ones by their violation.

Example:
    >>> obj = Objectives.of(["val_acc", "latency_ms"], ["max", "min"], ["latency_ms <= 5"])
    >>> obj.point({"val_acc": 0.9, "latency_ms": 3.0}), obj.violation({"latency_ms": 7.0})
    ((-0.9, 3.0), 2.0)
    >>> nondominated_sort([(1, 3), (2, 2), (3, 1), (2, 3), (3, 3)])
    [[0, 1, 2], [3], [4]]
    >>> hypervolume([(1, 3), (2, 2), (3, 1)], reference=(4, 4))
    6.0

This module imports nothing of retiarii but :mod:`retiarii.enums`: strategies, schedulers,
the engine and the command line all use it.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .enums import Mode

__all__ = ["Constraint", "Objectives", "ObjectiveError", "ParetoFront", "Scored",
           "constrained_dominates",
           "crowding_distance", "dominates", "hypervolume", "hypervolume_contributions",
           "nondominated_sort", "nsga_keys",
           "pareto_indices", "ranks"]

Point = Sequence[float]


class ObjectiveError(ValueError):
    """An objective, mode or constraint that cannot work (the message names it and the fix)."""


# ---- constraints and objectives ------------------------------------------------------------

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(<=|>=|<|>)\s*([-+0-9.eE_]+)\s*$")


@dataclass(frozen=True)
class Constraint:
    """``metric op bound`` (``"latency_ms <= 5"``): a model meets it or misses it by
    :meth:`violation`.

    Example:
        >>> c = Constraint.parse("params <= 2e6")
        >>> c.violation(1e6), c.violation(2.5e6), str(c)
        (0.0, 500000.0, 'params <= 2000000')
    """

    metric: str
    op: str  # one of <=, >=, <, >
    bound: float

    @classmethod
    def parse(cls, text: Any) -> "Constraint":
        if isinstance(text, Constraint):
            return text
        match = _CONSTRAINT.match(text) if isinstance(text, str) else None
        if match is None:
            raise ObjectiveError(f"constraint {text!r}: write it as 'METRIC OP NUMBER' with OP "
                                 f"one of <=, >=, <, > (e.g. 'latency_ms <= 5')")
        try:
            bound = float(match.group(3))
        except ValueError:
            raise ObjectiveError(f"constraint {text!r}: {match.group(3)!r} is not a number") \
                from None
        if not math.isfinite(bound):
            raise ObjectiveError(f"constraint {text!r}: the bound must be finite")
        return cls(match.group(1), match.group(2), bound)

    def violation(self, value: float | None) -> float:
        """0.0 when ``value`` meets the constraint, else by how much it misses the bound (a
        strict bound hit exactly misses by the smallest positive step, so that a violation of 0
        always means feasible); a missing or non-finite value misses by infinity."""
        if value is None or not math.isfinite(value):
            return math.inf
        if _OPS[self.op](value, self.bound):
            return 0.0
        return abs(value - self.bound) or math.ulp(abs(self.bound))

    def met(self, value: float | None) -> bool:
        return value is not None and math.isfinite(value) and _OPS[self.op](value, self.bound)

    def __str__(self) -> str:
        bound = int(self.bound) if self.bound.is_integer() else self.bound
        return f"{self.metric} {self.op} {bound}"


@dataclass(frozen=True)
class Objectives:
    """The metrics a search optimizes, their directions and its constraints.

    ``Objectives.of("val_acc", "max")`` is today's single-metric search; a list of metrics
    makes it multi-objective (:attr:`multi`): its result is a Pareto front.
    """

    metrics: tuple[str, ...]
    modes: tuple[Mode, ...]
    constraints: tuple[Constraint, ...] = ()

    @classmethod
    def of(cls, metric: Any, mode: Any = "max", constraints: Any = None) -> "Objectives":
        """From ``Experiment``'s ``metric``, ``mode`` and ``constraints`` arguments: a name or a
        list of names; a mode or a list of as many modes (one mode for several metrics applies
        to each); constraints as strings or :class:`Constraint`."""
        metrics = [metric] if isinstance(metric, str) else list(metric or [])
        if not metrics or not all(isinstance(m, str) and m for m in metrics):
            raise ObjectiveError(f"metric={metric!r}: give the name of a metric the trainer "
                                 f"reports ('val_acc') or a list of names")
        if len(set(metrics)) != len(metrics):
            raise ObjectiveError(f"metric={metric!r} names a metric twice")
        modes = [mode] * len(metrics) if isinstance(mode, (str, Mode)) else list(mode or [])
        if len(modes) != len(metrics):
            raise ObjectiveError(f"mode={mode!r}: give one mode per metric ({len(metrics)}: "
                                 f"{', '.join(metrics)}), each 'max' or 'min'")
        try:
            parsed = tuple(Mode.parse(m) for m in modes)
        except ValueError as err:
            raise ObjectiveError(f"mode={mode!r}: {err}") from None
        if constraints is None:
            constraints = []
        elif isinstance(constraints, (str, Constraint)):
            constraints = [constraints]
        return cls(tuple(metrics), parsed, tuple(Constraint.parse(c) for c in constraints))

    @property
    def multi(self) -> bool:
        """Several objectives: the search's result is a front, not one best model."""
        return len(self.metrics) > 1

    @property
    def extended(self) -> bool:
        """More than one plain metric (several objectives, or constraints): what a search's
        config and store record beyond a single value."""
        return self.multi or bool(self.constraints)

    @property
    def needed(self) -> tuple[str, ...]:
        """Every metric the objectives and constraints read, objectives first."""
        extra = [c.metric for c in self.constraints if c.metric not in self.metrics]
        return self.metrics + tuple(dict.fromkeys(extra))

    def point(self, values: dict) -> tuple[float, ...] | None:
        """The objectives as a point to minimize, or None when one is missing or not finite."""
        out = []
        for metric, mode in zip(self.metrics, self.modes):
            value = values.get(metric)
            if value is None or isinstance(value, bool) or not math.isfinite(value):
                return None
            out.append(-mode.sign * float(value))
        return tuple(out)

    def violation(self, values: dict) -> float:
        """The summed violation of every constraint (0.0: feasible)."""
        return sum(c.violation(values.get(c.metric)) for c in self.constraints)

    def feasible(self, values: dict) -> bool:
        return all(c.met(values.get(c.metric)) for c in self.constraints)

    def to_json(self) -> dict:
        return {"metrics": list(self.metrics), "modes": [str(m) for m in self.modes],
                "constraints": [str(c) for c in self.constraints]}


@dataclass(frozen=True)
class Scored:
    """One model's result in a multi-objective search: its objectives as a point to minimize
    and the violation of the constraints (0.0: feasible). Strategies learn from these."""

    point: tuple[float, ...]
    violation: float = 0.0


# ---- domination and sorting ------------------------------------------------------------------


def dominates(a: Point, b: Point) -> bool:
    """Whether ``a`` is no worse than ``b`` in every objective and better in one (minimized).

    Example:
        >>> dominates((1, 2), (1, 3)), dominates((1, 3), (2, 2)), dominates((1, 2), (1, 2))
        (True, False, False)
    """
    better = False
    for x, y in zip(a, b):
        if x > y:
            return False
        better = better or x < y
    return better


def constrained_dominates(a: Point, va: float, b: Point, vb: float) -> bool:
    """Deb's constrained domination: a feasible point (violation 0) dominates every infeasible
    one, of two infeasible ones the smaller violation dominates, two feasible ones compare by
    :func:`dominates`."""
    if va == 0 and vb == 0:
        return dominates(a, b)
    if va == 0:
        return True
    if vb == 0:
        return False
    return va < vb


def nondominated_sort(points: Sequence[Point],
                      violations: Sequence[float] | None = None) -> list[list[int]]:
    """The fronts of ``points`` (indices, each front in index order): front 0 is dominated by
    no point, front k by points of fronts < k only (NSGA-II's fast non-dominated sort,
    O(M N^2)); with ``violations``, by constrained domination.

    Example:
        >>> nondominated_sort([(1, 1), (0, 2), (2, 2)], violations=[1.0, 0.0, 0.0])
        [[1], [2], [0]]
    """
    n = len(points)
    viol = [0.0] * n if violations is None else list(violations)
    beats: list[list[int]] = [[] for _ in range(n)]
    beaten = [0] * n
    for i in range(n):
        for j in range(i + 1, n):
            if constrained_dominates(points[i], viol[i], points[j], viol[j]):
                beats[i].append(j)
                beaten[j] += 1
            elif constrained_dominates(points[j], viol[j], points[i], viol[i]):
                beats[j].append(i)
                beaten[i] += 1
    fronts: list[list[int]] = []
    current = [i for i in range(n) if beaten[i] == 0]
    while current:
        fronts.append(sorted(current))
        following = []
        for i in current:
            for j in beats[i]:
                beaten[j] -= 1
                if beaten[j] == 0:
                    following.append(j)
        current = following
    return fronts


def ranks(points: Sequence[Point], violations: Sequence[float] | None = None) -> list[int]:
    """Each point's non-dominated rank (0: on the Pareto front)."""
    out = [0] * len(points)
    for k, front in enumerate(nondominated_sort(points, violations)):
        for i in front:
            out[i] = k
    return out


def pareto_indices(points: Sequence[Point],
                   violations: Sequence[float] | None = None) -> list[int]:
    """The indices of the Pareto front: the non-dominated *feasible* points (none when no
    point is feasible: an infeasible model is not a result)."""
    viol = [0.0] * len(points) if violations is None else list(violations)
    feasible = [i for i in range(len(points)) if viol[i] == 0]
    return [i for i in feasible
            if not any(dominates(points[j], points[i]) for j in feasible if j != i)]


def crowding_distance(points: Sequence[Point]) -> list[float]:
    """NSGA-II's crowding distance of each point of one front: the sum over objectives of the
    gap between its two neighbours, divided by the objective's range; the extremes of each
    objective get infinity (so a front's ends are always kept).

    Example:
        >>> crowding_distance([(0, 4), (1, 2), (4, 0)])
        [inf, 2.0, inf]
    """
    n = len(points)
    if n <= 2:
        return [math.inf] * n
    distance = [0.0] * n
    for m in range(len(points[0])):
        order = sorted(range(n), key=lambda i: (points[i][m], i))
        low, high = points[order[0]][m], points[order[-1]][m]
        distance[order[0]] = distance[order[-1]] = math.inf
        if high == low:
            continue  # every point equal here: this objective separates nothing
        for k in range(1, n - 1):
            distance[order[k]] += (points[order[k + 1]][m] - points[order[k - 1]][m]) / (
                high - low)
    return distance


def nsga_keys(points: Sequence[Point],
              violations: Sequence[float] | None = None) -> list[tuple[int, float]]:
    """NSGA-II's crowded comparison as sort keys, lower is better: ``(rank, -crowding)``,
    the crowding distance taken within the point's own front.

    Example:
        >>> nsga_keys([(0, 4), (1, 2), (4, 0), (2, 3)])
        [(0, -inf), (0, -2.0), (0, -inf), (1, -inf)]
    """
    keys: list[tuple[int, float]] = [(0, 0.0)] * len(points)
    for rank, front in enumerate(nondominated_sort(points, violations)):
        for i, d in zip(front, crowding_distance([points[i] for i in front])):
            keys[i] = (rank, -d)
    return keys


# ---- hypervolume ---------------------------------------------------------------------------


def hypervolume(points: Iterable[Point], reference: Point) -> float:
    """The volume dominated by ``points`` and bounded by ``reference`` (minimized: a point
    counts where it is below the reference in every objective). Exact: a sweep in 2-D, slicing
    by the last objective (HSO) above, fine for the fronts of a search (tens of points).

    Example:
        >>> hypervolume([(1, 1, 1)], reference=(2, 3, 4))
        6.0
    """
    ref = tuple(float(r) for r in reference)
    inside = [tuple(float(x) for x in p) for p in points
              if len(p) == len(ref) and all(x < r for x, r in zip(p, ref))]
    if not inside:
        return 0.0
    keep = pareto_indices(inside)
    return _volume(sorted(set(inside[i] for i in keep)), ref)


def hypervolume_contributions(points: Sequence[Point], reference: Point) -> list[float]:
    """Each point's exclusive hypervolume: what the set loses without it (0 for a point
    another one dominates or repeats).

    Example:
        >>> hypervolume_contributions([(0, 4), (1, 2), (4, 0)], reference=(5, 5))
        [1.0, 6.0, 2.0]
    """
    whole = hypervolume(points, reference)
    return [whole - hypervolume([p for j, p in enumerate(points) if j != i], reference)
            for i in range(len(points))]


def _volume(points: list[tuple[float, ...]], ref: tuple[float, ...]) -> float:
    d = len(ref)
    if d == 1:
        return ref[0] - min(p[0] for p in points)
    if d == 2:
        # sorted by the first objective; on a front the second then decreases
        total, last = 0.0, ref[1]
        for x, y in sorted(points):
            if y < last:
                total += (ref[0] - x) * (last - y)
                last = y
        return total
    # Slices between consecutive values of the last objective: in each, the points at or
    # below its bottom dominate a (d-1)-dimensional volume that extends to the next level.
    levels = sorted(set(p[-1] for p in points)) + [ref[-1]]
    total = 0.0
    for k in range(len(levels) - 1):
        below = [p[:-1] for p in points if p[-1] <= levels[k]]
        front = [below[i] for i in pareto_indices(below)]
        total += _volume(sorted(set(front)), ref[:-1]) * (levels[k + 1] - levels[k])
    return total


# ---- a front kept as results arrive --------------------------------------------------------


class ParetoFront:
    """The non-dominated feasible points among those added, updated in O(front) per point.

    Example:
        >>> front = ParetoFront()
        >>> [front.add(k, p) for k, p in [("a", (2, 2)), ("b", (1, 3)), ("c", (1, 1))]]
        [True, True, True]
        >>> sorted(front.members)
        ['c']
    """

    def __init__(self):
        self.members: dict[Any, tuple[float, ...]] = {}

    def add(self, key: Any, point: Point, violation: float = 0.0) -> bool:
        """Adds ``key`` at ``point``; True when it joins the front (members it dominates leave).
        An infeasible point never joins."""
        point = tuple(float(x) for x in point)
        if violation != 0:
            return False
        if any(dominates(p, point) or p == point for p in self.members.values()):
            return False
        self.members = {k: p for k, p in self.members.items() if not dominates(point, p)}
        self.members[key] = point
        return True
