"""TPE, the Tree-structured Parzen Estimator (Bergstra et al., NeurIPS 2011), over the choices
of a sample; with several objectives MOTPE (Ozaki et al., GECCO 2020)."""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

from ...objectives import hypervolume, hypervolume_contributions, nondominated_sort
from ...sampler import sample_key
from .base import Draw, Strategy, draw
from .tpe_joint import JointDensity, JointSampler


def reference_point(points: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Past the worst value of each objective (minimized) by a tenth of its range, or by 1
    where the range is 0: every point of a front then contributes some hypervolume.

    Example:
        >>> reference_point([(0, 4), (4, 0), (2, 2)])
        (4.4, 4.4)
    """
    out = []
    for m in range(len(points[0])):
        values = [p[m] for p in points]
        spread = max(values) - min(values)
        out.append(max(values) + (0.1 * spread if spread > 0 else 1.0))
    return tuple(out)


def motpe_weights(points: Sequence[Sequence[float]], reference: Sequence[float]) -> list[float]:
    """Weights of the good observations in l(x) (Ozaki et al.'s weighting, JAIR 2022): each
    point's hypervolume contribution within the good set, over their mean, so that the ends
    and the sparse parts of the front pull the density as much as its crowded middle; a
    point that contributes nothing (dominated within the set) keeps a tenth of the mean.

    Example:
        >>> motpe_weights([(0, 4), (1, 2), (4, 0)], reference=(5, 5))   # contributions 1, 6, 2
        [0.3333333333333333, 2.0, 0.6666666666666666]
    """
    contribution = hypervolume_contributions(points, reference)
    mean = sum(contribution) / len(contribution) if contribution else 0.0
    if mean <= 0:
        return [1.0] * len(points)
    return [max(c / mean, 0.1) for c in contribution]


def hypervolume_subset(points: Sequence[Sequence[float]], k: int,
                       reference: Sequence[float]) -> list[int]:
    """The greedy answer to the hypervolume subset selection problem: the indices of ``k``
    points chosen one at a time, each the point that adds the most hypervolume to those chosen
    before it (ties: the earlier index), as MOTPE (Ozaki et al., GECCO 2020) and Optuna's TPE
    fill the good set from the front that does not fit whole. Unlike ranking by exclusive
    contribution (what each point adds to *all* the others), it starts from the point that
    dominates the most alone, so two close points of a large box are not both passed over.

    Example:
        >>> hypervolume_subset([(0, 4), (1, 1), (1.1, 0.9), (4, 0.2)], 2, reference=(5, 5))
        [0, 1]
    """
    chosen: list[int] = []
    left = list(range(len(points)))
    volume = 0.0
    for _ in range(min(k, len(points))):
        gains = [hypervolume([points[j] for j in chosen] + [points[i]], reference) - volume
                 for i in left]
        best = max(range(len(left)), key=lambda n: (gains[n], -left[n]))
        volume += gains[best]
        chosen.append(left.pop(best))
    return sorted(chosen)


def motpe_split(points: Sequence[Sequence[float]], violations: Sequence[float],
                n_good: int) -> list[int]:
    """MOTPE's good set: the indices of ``n_good`` points (to minimize), whole non-dominated
    fronts first (Deb's constraints: feasible before infeasible); of the front that does not
    fit whole, the greedy hypervolume subset of it (:func:`hypervolume_subset`), the
    reference point past the worst value of each objective over all points
    (:func:`reference_point`).

    Example:
        >>> motpe_split([(0, 4), (1, 2), (4, 0), (2, 3)], [0, 0, 0, 0], 2)   # (1, 2) and (4, 0)
        [1, 2]
    """
    good: list[int] = []
    for front in nondominated_sort(points, violations):
        if len(good) + len(front) <= n_good:
            good.extend(front)
            continue
        need = n_good - len(good)
        if need > 0:
            subset = hypervolume_subset([points[i] for i in front], need,
                                        reference_point(points))
            good.extend(front[k] for k in subset)
        break
    return sorted(good)


def parzen_categorical(keys: list, candidates: list, prior_weight: float,
                       weights: list[float] | None = None) -> list[float]:
    """Smoothed frequencies of ``keys`` over ``candidates``: each observation weighs 1 (or its
    entry of ``weights``) and a uniform prior of total weight ``prior_weight`` keeps every
    candidate possible.

    Example:
        >>> parzen_categorical(["a", "a", "b"], ["a", "b", "c"], prior_weight=3.0)
        [0.5, 0.3333333333333333, 0.16666666666666666]
    """
    position = {json.dumps(c): i for i, c in enumerate(candidates)}  # JSON: 1 and True differ
    mass = [prior_weight / len(candidates)] * len(candidates)
    for n, key in enumerate(keys):
        i = position.get(json.dumps(key))
        if i is not None:  # a key no longer among the candidates says nothing here
            mass[i] += 1.0 if weights is None else weights[n]
    total = sum(mass)
    return [w / total for w in mass]


class _Densities:
    """l(x) and g(x) of each choice (a label with its candidates), computed once per proposal."""

    def __init__(self, good: list[dict], bad: list[dict], prior_weight: float,
                 good_weights: list[float] | None = None):
        self.good, self.bad, self.prior_weight = good, bad, prior_weight
        self.good_weights = good_weights or [1.0] * len(good)
        self.cache: dict[str, tuple[list[float], list[float]] | None] = {}

    def __call__(self, label: str, candidates: list):
        name = json.dumps([label, candidates])
        if name not in self.cache:
            had = [(s[label], w) for s, w in zip(self.good, self.good_weights) if label in s]
            good = [key for key, _ in had]
            bad = [sample[label] for sample in self.bad if label in sample]
            self.cache[name] = None if not good else (
                parzen_categorical(good, candidates, self.prior_weight,
                                   [w for _, w in had]),
                parzen_categorical(bad, candidates, self.prior_weight))
        return self.cache[name]


class _TPESampler:
    """Draws each choice from l(x) and sums log l(x) - log g(x) over the choices drawn."""

    def __init__(self, densities: _Densities, rng):
        self.densities, self.rng = densities, rng
        self.log_ratio = 0.0

    def choose(self, label: str, candidates: list, context: dict) -> int:
        densities = self.densities(label, candidates)
        if densities is None:  # no good model had this choice (a new branch): no preference
            return self.rng.randrange(len(candidates))
        l, g = densities  # noqa: E741 (the paper's names)
        index = self.rng.choices(range(len(candidates)), weights=l)[0]
        self.log_ratio += math.log(l[index]) - math.log(g[index])
        return index


class TPE(Strategy):
    """Tree-structured Parzen Estimator over the choices of a sample (independent per label).

    After ``n_startup`` random models, the told models are split into the best ``gamma``
    fraction (good) and the rest (bad). Each choice, as the space reaches it, gets a smoothed
    categorical density from the good models that had that label, l(x), and one from the bad
    models, g(x). ``n_ei_candidates`` whole samples are drawn choice by choice from l(x), and
    the one maximising the product of l(x) / g(x) over its choices (the expected improvement
    criterion of the paper) is proposed; with ``dedup`` the known samples are left out of that
    contest, so TPE keeps proposing its best *new* guess instead of repeating itself. The
    densities of the choices are independent (as Optuna's default TPE); a conditional choice
    only learns from the models in which it existed, and a choice that no good model had is
    drawn at random. Pending models are ignored; dedup keeps asynchronous asks distinct.

    This is our own implementation rather than a wrapper of Optuna's ``TPESampler``: samples
    here are purely categorical, and a wrapper would have to rebuild an Optuna study and reach
    into its private random state to save and restore a search exactly, which this class does
    with a list of results and one ``random.Random`` state. ``benchmarks/strategies.py``
    compares the two.

    Several objectives (``Experiment(metric=[...], mode=[...])``, :meth:`use_objectives`):
    MOTPE. The split into good and bad is by non-dominated rank instead of by value (whole
    fronts, feasible models first by Deb's rule, then a greedy hypervolume subset of the front
    that does not fit, :func:`motpe_split`), the good ones weighted
    by their hypervolume contribution (:func:`motpe_weights`), and l(x) and g(x) are joint
    over the choices (``multivariate``, :mod:`~retiarii.strategies.multi_trial.tpe_joint`): a front's
    ends differ in every choice, and independent densities would mix them into its middle.
    The search's result is its front (:meth:`pareto`).

    Foreign samples are accepted: ``tell`` of a sample this strategy never proposed adds an
    observation (e.g. results of an earlier run to warm-start from).

    Example:
        >>> from retiarii.strategies import TPE
        >>> class Space:
        ...     lrs = [0.1, 0.01, 0.001]
        ...     def sample(self, sampler):
        ...         s = {}
        ...         for name in ("lr", "lr_head"):
        ...             s[name] = self.lrs[sampler.choose(name, self.lrs, dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> s = TPE(seed=0, mode="min", n_startup=3)
        >>> for _ in range(8):
        ...     sample = s.ask(Space())
        ...     s.tell(sample, abs(sample["lr"] - 0.01) + abs(sample["lr_head"] - 0.01))
        >>> s.best()
        ({'lr': 0.01, 'lr_head': 0.01}, 0.0)

    Args:
        seed: seeds the generator (equal seeds, equal searches in any process).
        n_startup: random models before the densities are used (Optuna's default is 10).
        gamma: fraction of told models that count as good (at least one). Larger explores
            more. 0.15 lies between Optuna's 0.1 and the paper's 0.25 and did best of the
            three on ``benchmarks/strategies.py``.
        prior_weight: total weight of the uniform prior in each density; keeps every
            candidate possible (Optuna's default 1.0).
        n_ei_candidates: samples drawn from l(x) per proposal; more is greedier (Optuna's
            default 24). Each costs one ``space.sample`` call.
        multivariate: joint densities over a sample's choices (a kernel per observation,
            :mod:`~retiarii.strategies.multi_trial.tpe_joint`) instead of one per choice. None (default):
            joint with several objectives, where it lifted MOTPE's hypervolume gain over
            random at 100 models from +1.3 to +1.6 s.e. (+2.8 with the greedy subset split,
            benchmarks/README.md), independent
            with one (the setting ``benchmarks/strategies.py`` measured).
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True
    multi_objective = True
    # One proposal already weighs n_ei_candidates draws and skips the known ones, so a few
    # proposals that still repeat mean the densities are stuck: go random sooner.
    max_duplicate_tries = 4

    def __init__(self, *, seed: int | None = None, n_startup: int = 10, gamma: float = 0.15,
                 prior_weight: float = 1.0, n_ei_candidates: int = 24,
                 multivariate: bool | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        if not isinstance(n_startup, int) or n_startup < 1:
            raise ValueError(f"TPE: n_startup must be a positive int, got {n_startup!r}")
        if not 0 < gamma < 1:
            raise ValueError(f"TPE: gamma must be in (0, 1), got {gamma!r}")
        if not prior_weight > 0:
            raise ValueError(f"TPE: prior_weight must be positive, got {prior_weight!r}")
        if not isinstance(n_ei_candidates, int) or n_ei_candidates < 1:
            raise ValueError(f"TPE: n_ei_candidates must be a positive int, "
                             f"got {n_ei_candidates!r}")
        self.n_startup = n_startup
        self.gamma = gamma
        self.prior_weight = prior_weight
        self.n_ei_candidates = n_ei_candidates
        if multivariate not in (None, True, False):
            raise ValueError(f"TPE: multivariate must be True, False or None (joint with "
                             f"several objectives), got {multivariate!r}")
        self.multivariate = multivariate

    @property
    def joint(self) -> bool:
        """Whether l(x) and g(x) are joint over the choices (see ``multivariate``)."""
        if self.multivariate is None:
            return self.objectives is not None
        return self.multivariate

    def _propose(self, space: Any) -> Draw:
        observations = list(self._observations())
        if len(observations) < self.n_startup:
            return self._random_draw(space)
        n_good = max(1, math.ceil(self.gamma * len(observations)))
        good_weights = None
        if self.objectives is not None:
            good, bad, good_weights = self._split_by_rank(n_good)
        else:
            # Sort by score, best first; ties keep the tell order (sorted is stable).
            observations.sort(key=lambda o: -o[1])
            good = [sample for sample, _ in observations[:n_good]]
            bad = [sample for sample, _ in observations[n_good:]]
        if self.joint:
            lower = JointDensity(good, good_weights, self.prior_weight)
            upper = JointDensity(bad, None, self.prior_weight)
        else:
            densities = _Densities(good, bad, self.prior_weight, good_weights)
        best, best_ratio = None, -math.inf
        for _ in range(self.n_ei_candidates):
            sampler = JointSampler(lower, self._rng) if self.joint else \
                _TPESampler(densities, self._rng)
            candidate = draw(space, sampler)
            if self.dedup and sample_key(candidate.sample) in self._records:
                continue  # known already: let a new candidate win
            if self.joint:
                ratio = (lower.log_density(candidate.trace, candidate.sample)
                         - upper.log_density(candidate.trace, candidate.sample))
            else:
                ratio = sampler.log_ratio
            if ratio > best_ratio:
                best, best_ratio = candidate, ratio
        # Every candidate known: return one; the base class counts it as a repeat and asks
        # again (then falls back to a random new sample).
        return best if best is not None else candidate

    def _split_by_rank(self, n_good: int) -> tuple[list[dict], list[dict], list[float]]:
        """MOTPE's good and bad samples (:func:`motpe_split`) of the successful tells, and
        the weights of the good ones (:func:`motpe_weights`)."""
        violations = self._violations()
        told = [(k, v) for k, v in self._told if v is not None]
        points = [self._score(v).point for _, v in told]
        chosen = motpe_split(points, [violations.get(k, 0.0) for k, _ in told], n_good)
        good = [self._records[told[i][0]].sample for i in chosen]
        rest = set(range(len(told))) - set(chosen)
        bad = [self._records[k].sample for i, (k, _) in enumerate(told) if i in rest]
        weights = motpe_weights([points[i] for i in chosen], reference_point(points))
        return good, bad, weights

    def random_startup(self) -> tuple[int, str] | None:
        return self.n_startup, f"n_startup={self.n_startup}"

    def config(self) -> dict:
        config = {**super().config(), "n_startup": self.n_startup, "gamma": self.gamma,
                  "prior_weight": self.prior_weight, "n_ei_candidates": self.n_ei_candidates}
        if self.multivariate is not None:  # (configs saved before the option still match)
            config["multivariate"] = self.multivariate
        return config
