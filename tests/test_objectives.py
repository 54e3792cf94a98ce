"""Pareto maths against hand-computed fronts, ranks, crowding distances and hypervolumes, and
against brute force on random points (retiarii/objectives.py)."""
import doctest
import itertools
import math
import random

import pytest

from retiarii import objectives
from retiarii.objectives import (Constraint, ObjectiveError, Objectives, ParetoFront,
                                 crowding_distance, dominates, hypervolume, nondominated_sort,
                                 pareto_indices, ranks)


def test_doctests():
    assert doctest.testmod(objectives).failed == 0


def test_hand_computed_fronts_and_ranks():
    # minimized; (1,4) (2,2) (4,1) are the front; (3,3) is beaten by (2,2); (3,4) by (3,3)
    # and (2,2); (5,5) by all; (2,2) twice: equal points dominate neither
    pts = [(1, 4), (3, 3), (2, 2), (4, 1), (3, 4), (5, 5), (2, 2)]
    assert nondominated_sort(pts) == [[0, 2, 3, 6], [1], [4], [5]]
    assert ranks(pts) == [0, 1, 0, 0, 2, 3, 0]
    assert pareto_indices(pts) == [0, 2, 3, 6]


def test_constraints_rank_feasible_first_then_by_violation():
    pts = [(0, 0), (5, 5), (1, 1), (6, 6)]
    viol = [2.0, 0.0, 0.5, 0.0]
    # feasible (5,5) beats (6,6); then the infeasible by violation: 0.5 before 2.0
    assert nondominated_sort(pts, viol) == [[1], [3], [2], [0]]
    assert pareto_indices(pts, viol) == [1]
    assert pareto_indices(pts, [1.0] * 4) == []  # nothing feasible: no result


def test_crowding_distance_by_hand():
    # sorted by objective 0: a(0,10) b(1,6) c(3,3) d(10,0); ranges 10 and 10
    pts = [(3, 3), (0, 10), (10, 0), (1, 6)]
    d = crowding_distance(pts)
    assert d[1] == d[2] == math.inf
    assert d[3] == pytest.approx((3 - 0) / 10 + (10 - 3) / 10)   # b: neighbours a and c
    assert d[0] == pytest.approx((10 - 1) / 10 + (6 - 0) / 10)   # c: neighbours b and d
    assert crowding_distance([(1, 1), (2, 0)]) == [math.inf, math.inf]
    # an objective where all are equal adds nothing (no division by zero)
    assert crowding_distance([(0, 1), (1, 1), (2, 1)]) == [math.inf, 1.0, math.inf]


def test_hypervolume_by_hand():
    ref = (4, 4)
    # staircase: (4-1)*(4-3) + (4-2)*(3-2) + (4-3)*(2-1) = 3 + 2 + 1
    assert hypervolume([(1, 3), (2, 2), (3, 1)], ref) == 6.0
    # a dominated point and a point outside the box add nothing
    assert hypervolume([(1, 3), (2, 2), (3, 1), (3, 3), (5, 0)], ref) == 6.0
    assert hypervolume([], ref) == 0.0
    assert hypervolume([(4, 1)], ref) == 0.0  # on the reference: no volume
    # 3-D: two boxes [1,3]x[2,3]x[0,3] (6) and [2,3]x[1,3]x[1,3] (4), overlapping in
    # [2,3]x[2,3]x[1,3] (2): 6 + 4 - 2
    assert hypervolume([(1, 2, 0), (2, 1, 1)], (3, 3, 3)) == pytest.approx(8.0)


def _box_union_on_grid(points, ref):
    """Brute force: the union of the boxes [p, ref] on the grid of all coordinates."""
    axes = [sorted(set([p[d] for p in points] + [ref[d]])) for d in range(len(ref))]
    total = 0.0
    for cell in itertools.product(*[range(len(a) - 1) for a in axes]):
        low = [axes[d][c] for d, c in enumerate(cell)]
        if any(all(p[d] <= low[d] for d in range(len(ref))) for p in points):
            total += math.prod(axes[d][c + 1] - axes[d][c] for d, c in enumerate(cell))
    return total


@pytest.mark.parametrize("dims", [2, 3, 4])
def test_hypervolume_equals_brute_force(dims):
    rng = random.Random(dims)
    for _ in range(20):
        pts = [tuple(rng.randint(0, 6) for _ in range(dims)) for _ in range(rng.randint(1, 8))]
        ref = (7,) * dims
        assert hypervolume(pts, ref) == pytest.approx(_box_union_on_grid(pts, ref))


def test_sort_equals_brute_force_definition():
    rng = random.Random(0)
    for _ in range(30):
        pts = [(rng.randint(0, 4), rng.randint(0, 4), rng.randint(0, 4)) for _ in range(12)]
        fronts = nondominated_sort(pts)
        assert sorted(i for f in fronts for i in f) == list(range(12))
        seen = []
        for front in fronts:
            rest = [i for i in range(12) if i not in seen]
            assert front == [i for i in rest if not any(dominates(pts[j], pts[i]) for j in rest)]
            seen += front


def test_incremental_front_equals_batch_front():
    rng = random.Random(1)
    pts = [(rng.random(), rng.random()) for _ in range(60)]
    front = ParetoFront()
    for i, p in enumerate(pts):
        front.add(i, p)
    assert sorted(front.members) == pareto_indices(pts)
    assert front.add("x", (0.0, 0.0), violation=1.0) is False
    assert "x" not in front.members  # an infeasible point never joins


def test_objectives_parse_and_points():
    one = Objectives.of("val_acc", "max")
    assert not one.multi and one.point({"val_acc": 0.5}) == (-0.5,)
    obj = Objectives.of(["val_acc", "latency_ms"], ["max", "min"],
                        ["latency_ms<=5", "params <= 2e6"])
    assert obj.multi and obj.needed == ("val_acc", "latency_ms", "params")
    assert obj.point({"val_acc": 0.9}) is None  # a missing objective: no point
    assert obj.point({"val_acc": 0.9, "latency_ms": math.nan}) is None
    assert obj.violation({"latency_ms": 6, "params": 3e6}) == 1 + 1e6
    assert obj.feasible({"latency_ms": 5, "params": 1}) and obj.violation(
        {"latency_ms": 5, "params": 1}) == 0
    assert Constraint.parse("x < 5").violation(5) > 0  # a strict bound hit: infeasible
    assert Objectives.of(["a", "b"], "min").modes == ("min", "min")
    for bad, match in [(dict(metric=[]), "metric="), (dict(metric=["a", "a"]), "twice"),
                       (dict(metric=["a", "b"], mode=["max"]), "one mode per metric"),
                       (dict(metric="a", mode="up"), "'max' or 'min'"),
                       (dict(metric="a", constraints=["latency 5"]), "METRIC OP NUMBER")]:
        with pytest.raises(ObjectiveError, match=match):
            Objectives.of(**bad)
