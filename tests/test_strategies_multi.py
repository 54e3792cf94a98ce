"""Strategies with several objectives: the tell protocol, fronts, NSGA-II selection, saved
state, and the search quality of evolution against random on a toy trade-off."""
import math
import random
import statistics

import pytest

from retiarii.objectives import Scored, hypervolume, pareto_indices
from retiarii.scalarization import MnasNetReward, WeightedSum, scalarization_from_json
from retiarii.strategies import (
    TPE, GridSearch, PolicyBasedRL, Predictor, Random, RegularizedEvolution,
)
from retiarii.sampler import sample_key
from retiarii.strategies.multi_trial.evolution import crowded_tournament
from retiarii.strategies.multi_trial.predictor import improvement_order
from retiarii.strategies.multi_trial.tpe import (
    hypervolume_subset, motpe_split, motpe_weights, reference_point,
)

OPS = list(range(4))
N = 6
_rng = random.Random(42)
# acc rises with each choice's weight, cost with another: a trade-off with a real front
W_ACC = [[_rng.random() for _ in OPS] for _ in range(N)]
W_COST = [[w + 0.5 * _rng.random() for w in row] for row in W_ACC]


class Space:
    def sample(self, sampler):
        s = {f"c{i}": OPS[sampler.choose(f"c{i}", OPS, {})] for i in range(N)}
        return type("Model", (), {"sample": s})()

    def size(self):
        return len(OPS) ** N


def values(sample):
    acc = sum(W_ACC[i][sample[f"c{i}"]] for i in range(N))
    cost = sum(W_COST[i][sample[f"c{i}"]] for i in range(N)) ** 2
    return [acc, cost]


def search(strategy, n, space=None, constraint=None):
    space = space or Space()
    strategy.use_objectives(["max", "min"])
    told = []
    for _ in range(n):
        sample = strategy.ask(space)
        v = values(sample)
        violation = max(0.0, v[1] - constraint) if constraint is not None else 0.0
        strategy.tell(sample, v, violation)
        told.append((v, violation))
    return told


def test_one_metric_strategies_refuse_several_objectives():
    with pytest.raises(ValueError, match="PolicyBasedRL optimizes one metric; for several "
                                         "objectives give it reward=MnasNetReward"):
        PolicyBasedRL(seed=0).use_objectives(["max", "min"])
    with pytest.raises(ValueError, match="two modes or more"):
        Random(seed=0).use_objectives(["max"])


def test_tell_checks_the_values():
    s = Random(seed=0)
    s.use_objectives(["max", "min"])
    sample = s.ask(Space())
    for bad in (0.5, [0.5], [0.5, float("nan")], [0.5, "x"]):
        with pytest.raises(ValueError, match="a list of 2 finite numbers"):
            s.tell(sample, bad)
    with pytest.raises(ValueError, match="violation must be a number >= 0"):
        s.tell(sample, [0.5, 1.0], violation=-1)
    s.tell(sample, None)  # a failed model is still None


def test_pareto_of_the_told_models_by_hand():
    s = Random(seed=0)
    s.use_objectives(["max", "min"])
    space = Space()
    samples = [s.ask(space) for _ in range(5)]
    # (acc max, cost min): a (0.9, 5) and b (0.8, 2) are the front; c (0.7, 3) is beaten by
    # b; d (0.95, 1) would beat all but misses a constraint; e failed
    for sample, v, viol in zip(samples, [[0.9, 5], [0.8, 2], [0.7, 3], [0.95, 1], None],
                               [0, 0, 0, 2.0, 0]):
        s.tell(sample, v, viol)
    assert s.pareto() == [(samples[0], [0.9, 5.0]), (samples[1], [0.8, 2.0])]
    assert s.best() == (samples[0], [0.9, 5.0])
    with pytest.raises(ValueError, match="one metric; use best"):
        Random(seed=0).pareto()


def test_crowded_tournament_by_hand():
    # a, b, c on the front (crowding inf, 2.0, inf within it); d dominated by b
    pop = [("a", Scored((0.0, 4.0))), ("b", Scored((1.0, 2.0))), ("c", Scored((4.0, 0.0))),
           ("d", Scored((2.0, 3.0)))]
    rng = random.Random(0)
    assert crowded_tournament(pop, 4, rng) in ("a", "c")  # the extremes win on crowding
    # b against d: b's rank is lower
    assert crowded_tournament([pop[3], pop[1]], 2, rng) == "b"
    # an infeasible point loses to any feasible one, however good its objectives
    assert crowded_tournament([("x", Scored((-9.0, -9.0), 0.1)), pop[3]], 2, rng) == "d"


@pytest.mark.parametrize("make", [
    lambda: RegularizedEvolution(8, 3, seed=3), lambda: Random(seed=3),
    lambda: TPE(seed=3, n_startup=5), lambda: Predictor(seed=3, n_startup=5, n_candidates=8),
    lambda: PolicyBasedRL(seed=3, reward=MnasNetReward("acc", "cost", target=10.0))],
    ids=["evolution", "random", "motpe", "predictor", "rl"])
def test_saved_and_restored_search_equals_uninterrupted(make):
    whole = make()
    search(whole, 40, constraint=8.0)
    first = make()
    search(first, 20, constraint=8.0)
    state = first.state_dict()
    second = make()
    second.use_objectives(["max", "min"])
    second.load_state_dict(state)
    space, rest = Space(), []
    for _ in range(20):
        sample = second.ask(space)
        v = values(sample)
        second.tell(sample, v, max(0.0, v[1] - 8.0))
        rest.append(sample)
    assert second.state_dict()["log"] == whole.state_dict()["log"]
    assert second.pareto() == whole.pareto()
    # a state saved with other objectives is refused
    other = make()
    other.use_objectives(["max", "max"])
    with pytest.raises(ValueError, match="construct it with the saved settings"):
        other.load_state_dict(state)


def test_grid_takes_several_objectives():
    class Small(Space):
        def enumerate(self):
            for a in OPS:
                yield type("M", (), {"sample": {**{f"c{i}": 0 for i in range(N)}, "c0": a}})()

        def size(self):
            return len(OPS)

    s = GridSearch()
    told = search(s, 4, space=Small())
    assert len(told) == 4 and len(s.pareto()) >= 1


def _hv(told):
    points = [(-v[0], v[1]) for v, viol in told if viol == 0]
    front = [points[i] for i in pareto_indices(points)]
    return hypervolume(front, reference=(0.0, 60.0))


def test_nsga_evolution_beats_random_on_a_trade_off():
    """Paired by seed over 10 seeds at 120 models (deterministic: seeded strategies)."""
    gains = []
    for seed in range(10):
        evo = _hv(search(RegularizedEvolution(16, 4, seed=seed), 120))
        rnd = _hv(search(Random(seed=seed), 120))
        gains.append(evo - rnd)
    assert statistics.mean(gains) > 2 * statistics.stdev(gains) / len(gains) ** 0.5, gains


# ---- MOTPE ------------------------------------------------------------------------------------


def test_motpe_split_by_hand():
    # fronts: {0, 1, 2}, then {3} (dominated by 1), then the infeasible 4 (Deb: last)
    points = [(0, 4), (1, 2), (4, 0), (2, 3), (-1, -1)]
    violations = [0, 0, 0, 0, 1.0]
    assert motpe_split(points, violations, 4) == [0, 1, 2, 3]
    assert motpe_split(points, violations, 5) == [0, 1, 2, 3, 4]
    # front 0 does not fit: reference (4 + 0.5, 4 + 0.5) past the worst of all five points;
    # greedy subset: alone (0, 4) covers 4.5 * 0.5 = 2.25, (1, 2) 3.5 * 2.5 = 8.75, (4, 0)
    # 2.25: (1, 2) first; then (0, 4) adds 1 * 0.5 = 0.5 and (4, 0) adds 0.5 * 2 = 1: (4, 0)
    assert reference_point(points) == (4.5, 4.5)
    assert motpe_split(points, violations, 1) == [1]
    assert motpe_split(points, violations, 2) == [1, 2]
    assert motpe_split(points, violations, 3) == [0, 1, 2]


def test_motpe_split_greedy_subset_by_hand():
    # one front; b = (1, 1) and b2 = (1.1, 0.9) crowd the middle. Reference: the worst value
    # of each objective + a tenth of its range = (4 + 0.4, 4 + 0.38). Alone: a = (0, 4) covers
    # 4.4 * 0.38 = 1.672, b 3.4 * 3.38 = 11.492, b2 3.3 * 3.48 = 11.484, d = (4, 0.2) 0.4 *
    # 4.18 = 1.672: b first. Then a adds (1 - 0) * (4.38 - 4) = 0.38, b2 (4.4 - 1.1) * (1 -
    # 0.9) = 0.33, d (4.4 - 4) * (1 - 0.2) = 0.32: a. Then b2 (0.33 > 0.32). Ranking by
    # exclusive contribution instead (a 1 * 0.38, b 0.1 * 3, b2 2.9 * 0.1, d 0.4 * 0.7) would
    # pick a alone first and leave out b, the point that covers the most.
    points = [(0, 4), (1, 1), (1.1, 0.9), (4, 0.2)]
    assert reference_point(points) == pytest.approx((4.4, 4.38))
    assert motpe_split(points, [0] * 4, 1) == [1]
    assert motpe_split(points, [0] * 4, 2) == [0, 1]
    assert motpe_split(points, [0] * 4, 3) == [0, 1, 2]
    assert hypervolume_subset(points, 1, (4.4, 4.38)) == [1]
    # a dominated point is on a later front: whole fronts come first, then the greedy subset
    assert motpe_split([*points, (2, 2)], [0] * 5, 4) == [0, 1, 2, 3]
    assert motpe_split([(2, 2), *points], [0] * 5, 1) == [2]


def test_motpe_weights_by_hand():
    assert motpe_weights([(0, 4), (1, 2), (4, 0)], (5, 5)) == [1 / 3, 2.0, 2 / 3]
    # with (2, 3), dominated by (1, 2), in the set (reference (5, 5)): the hypervolume is 15,
    # 11 without (1, 2), 14 without (0, 4), 13 without (4, 0): contributions 1, 4, 2, 0 (mean
    # 7/4); the dominated point keeps a tenth of the mean, never zero
    weights = motpe_weights([(0, 4), (1, 2), (4, 0), (2, 3)], (5, 5))
    assert weights == pytest.approx([4 / 7, 16 / 7, 8 / 7, 0.1])


class Dominated:
    """'good' = a beats b in both objectives; the other choices are noise."""

    def sample(self, sampler):
        s = {"good": ["a", "b"][sampler.choose("good", ["a", "b"], {})]}
        for i in range(3):
            s[f"n{i}"] = OPS[sampler.choose(f"n{i}", OPS, dict(s))]
        return type("Model", (), {"sample": s})()

    def size(self):
        return 2 * len(OPS) ** 3


def _dominated_values(sample):
    noise = sum(sample[f"n{i}"] for i in range(3)) / 30
    return ([0.9 - noise, 1.0 + noise] if sample["good"] == "a" else
            [0.5 - noise, 3.0 + noise])


@pytest.mark.parametrize("make", [lambda: TPE(seed=0, n_startup=6),
                                  lambda: Predictor(seed=0, n_startup=6, n_candidates=16)],
                         ids=["motpe", "predictor"])
def test_model_based_strategies_learn_the_dominating_choice(make):
    """After its start-up, a strategy of several objectives proposes the choice that
    dominates far more often than random's half."""
    s = make()
    s.use_objectives(["max", "min"])
    picks = []
    for n in range(30):
        sample = s.ask(Dominated())
        s.tell(sample, _dominated_values(sample))
        if n >= 6:
            picks.append(sample["good"] == "a")
    assert sum(picks) / len(picks) >= 0.7, picks


# ---- RL with MnasNet's reward ---------------------------------------------------------------


def test_mnasnet_reward_by_hand():
    soft = MnasNetReward("acc", "lat", target=5.0)
    assert soft({"acc": 0.8, "lat": 5.0}) == 0.8
    assert soft({"acc": 0.8, "lat": 10.0}) == pytest.approx(0.8 * 2 ** -0.07)
    assert soft({"acc": 0.8, "lat": 2.5}) == pytest.approx(0.8 * 0.5 ** -0.07)
    hard = MnasNetReward("acc", "lat", target=5.0, alpha=0.0, beta=-1.0)
    assert hard({"acc": 0.8, "lat": 1.0}) == 0.8 and hard({"acc": 0.8, "lat": 10.0}) == 0.4
    assert math.isnan(soft({"acc": 0.8})) and math.isnan(soft({"acc": 0.8, "lat": float("nan")}))
    assert WeightedSum({"acc": 1.0, "lat": -0.1})({"acc": 0.8, "lat": 2.0}) == pytest.approx(0.6)
    for r in (soft, hard, WeightedSum({"acc": 2.0})):
        assert scalarization_from_json(r.to_json()) == r
    with pytest.raises(ValueError, match="target must be a positive number"):
        MnasNetReward("acc", "lat", target=0)
    with pytest.raises(ValueError, match="alpha must be a number <= 0"):
        MnasNetReward("acc", "lat", target=1, alpha=0.5)
    with pytest.raises(ValueError, match="metric -> finite weight"):
        WeightedSum({})


def test_rl_learns_mnasnet_reward_by_metric_name():
    reward = MnasNetReward("val_acc", "latency_ms", target=2.0, alpha=0.0, beta=-1.0)
    # dedup=False: 60 proposals would otherwise use up the 64 models with b
    s = PolicyBasedRL(seed=0, reward=reward, dedup=False)
    # the objectives in another order than the reward's: read by name
    s.use_objectives(["min", "max"], ["latency_ms", "val_acc"])
    assert s.scalar_reward([4.0, 0.8]) == 0.4
    with pytest.raises(ValueError, match="make every metric of the reward an objective"):
        PolicyBasedRL(seed=0, reward=reward).use_objectives(["max", "min"], ["val_acc", "x"])

    # "a" is accurate and slow (0.9, 4 ms: reward 0.45), "b" less accurate and fast
    # (0.8, 1 ms: reward 0.8): MnasNet's reward prefers b, plain accuracy a
    def told(sample):
        return [1.0, 0.8] if sample["good"] == "b" else [4.0, 0.9]

    picks = []
    for _ in range(60):
        sample = s.ask(Dominated())
        s.tell(sample, told(sample))
        picks.append(sample["good"])
    assert picks[-20:].count("b") >= 17, picks


# ---- Predictor: one surrogate per objective -------------------------------------------------


def test_improvement_order_by_hand():
    # front {(1, 1)}, reference (4, 4): hypervolume 9; (0.5, 0.5) adds 3.25, (0, 3) adds 1,
    # (2, 2) adds nothing
    assert improvement_order([(1.0, 1.0)], [(2.0, 2.0), (0.0, 3.0), (0.5, 0.5)],
                             (4.0, 4.0)) == [2, 1, 0]
    # nobody improves: NSGA-II order among the predictions (front first, its ends first)
    assert improvement_order([(0.0, 0.0)], [(2.0, 2.0), (1.0, 3.0), (3.0, 1.0), (2.0, 2.5)],
                             (4.0, 4.0)) == [1, 2, 0, 3]


# ---- MOTPE's joint densities ----------------------------------------------------------------


def test_joint_kernel_and_density_by_hand():
    from retiarii.strategies.multi_trial.tpe_joint import JointDensity, kernel_probs

    # 3 candidates, prior 1 over 2 observations: smoothing 1/2, total 1 + 3/2
    assert kernel_probs(["a", "b", "c"], "c", 1.0, 2) == pytest.approx([0.2, 0.2, 0.6])
    assert kernel_probs(["a", "b", "c"], None, 1.0, 2) == pytest.approx([1 / 3] * 3)
    assert kernel_probs(["a", "b", "c"], "gone", 1.0, 2) == pytest.approx([1 / 3] * 3)
    # two choices; observations (a, x) weight 2 and (b, y) weight 1; kernels 3/4 vs 1/4
    d = JointDensity([{"p": "a", "q": "x"}, {"p": "b", "q": "y"}], [2.0, 1.0], 1.0)
    trace = [("p", ["a", "b"]), ("q", ["x", "y"])]
    # P(a, x) = (1 * 1/4 + 2 * 3/4 * 3/4 + 1 * 1/4 * 1/4) / 4; (a, y) mixes the two ends
    assert math.exp(d.log_density(trace, {"p": "a", "q": "x"})) == pytest.approx(
        (0.25 + 2 * 0.5625 + 0.0625) / 4)
    assert math.exp(d.log_density(trace, {"p": "a", "q": "y"})) == pytest.approx(
        (0.25 + 2 * 0.1875 + 0.1875) / 4)
    total = sum(math.exp(d.log_density(trace, {"p": p, "q": q}))
                for p in "ab" for q in "xy")
    assert total == pytest.approx(1.0)


def test_motpe_joint_keeps_a_fronts_ends_whole():
    """Two good models at the ends of a front, (0, 0, 0) and (1, 1, 1): joint densities draw
    mostly whole ends; a product of marginals draws as many mixes as ends."""
    from retiarii.strategies.multi_trial.tpe_joint import JointDensity, JointSampler
    from retiarii.strategies.base import draw

    class Bits:
        def sample(self, sampler):
            s = {f"b{i}": [0, 1][sampler.choose(f"b{i}", [0, 1], {})] for i in range(3)}
            return type("Model", (), {"sample": s})()

    d = JointDensity([{"b0": 0, "b1": 0, "b2": 0}, {"b0": 1, "b1": 1, "b2": 1}], None, 1.0)
    rng = random.Random(0)
    drawn = [draw(Bits(), JointSampler(d, rng)).sample for _ in range(400)]
    whole = sum(len(set(s.values())) == 1 for s in drawn) / len(drawn)
    # the prior (1/3) draws a whole end with 2/8; a kernel (2/3) of 2 candidates with
    # smoothing 1/2 puts 3/4 on its own: (3/4)^3 + (1/4)^3
    expected = (1 / 3) * (2 / 8) + (2 / 3) * (0.75 ** 3 + 0.25 ** 3)
    assert expected == pytest.approx(0.375) and abs(whole - expected) < 0.06
    assert whole > 0.3   # a product of the marginals (1/2 each) draws whole ends 2/8 = 0.25
    assert TPE(seed=0).config() == TPE(seed=0, multivariate=None).config()
    with pytest.raises(ValueError, match="multivariate"):
        TPE(multivariate="yes")


def test_nsga_evolution_keeps_the_front_where_aging_would_drop_its_oldest():
    """Hand-made: P=2 holds (1, 3) and (3, 1), both on the front; a dominated child joins
    and is the one that leaves (aging would drop (1, 3)); a child that dominates both
    leaves them one front behind, tied, and the older of the two leaves."""
    evo = RegularizedEvolution(2, 1, seed=0)
    evo.use_objectives(["min", "min"])
    for i, point in enumerate([(1.0, 3.0), (3.0, 1.0), (4.0, 4.0)]):
        evo.tell({"op": i}, list(point))
    assert [k for k, _ in evo._population] == [sample_key({"op": 0}), sample_key({"op": 1})]
    evo.tell({"op": 3}, [0.5, 0.5])   # dominates both: the older of the two, equal, leaves
    assert {k for k, _ in evo._population} == {sample_key({"op": 1}), sample_key({"op": 3})}
