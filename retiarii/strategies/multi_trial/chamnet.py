"""ChamNet's search (Dai et al., CVPR 2019): a Gaussian-process accuracy predictor, a latency
lookup table and a genetic search of the predicted accuracy under a latency constraint."""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from ...cost_terms import LUT_METRIC, CandidateFilter
from ...objectives import Constraint, ObjectiveError
from ...sampler import RandomSampler, ReplaySampler, index_of, sample_key
from .base import Draw, SpaceExhausted, Strategy, draw

Genome = list  # [(label, candidates)], in the order the space asks them


def _numeric(candidates: Sequence) -> bool:
    return len(candidates) > 1 and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) for c in candidates)


class ArchEncoder:
    """A sample as a vector of its hyper-parameters, as ChamNet's predictors read one: a
    numeric choice (widths, depths, expansions, resolution) is one column, its value scaled to
    [0, 1] over its candidates; any other choice is one-hot; a label the sample lacks (a
    conditional choice not taken) reads -1, away from every candidate.

    Example:
        >>> enc = ArchEncoder([("width", [100, 75, 125]), ("op", ["conv", "pool"])])
        >>> enc.encode([{"width": 75, "op": "pool"}, {"width": 125}]).tolist()
        [[0.0, 0.0, 1.0], [1.0, -1.0, -1.0]]
    """

    def __init__(self, genome: Genome):
        self.genome = genome
        self.width = sum(1 if _numeric(c) else len(c) for _, c in genome)

    def encode(self, samples: list[dict]) -> np.ndarray:
        """(N samples) -> (N, width)."""
        out = np.zeros((len(samples), self.width))
        for row, sample in enumerate(samples):
            col = 0
            for label, candidates in self.genome:
                n = 1 if _numeric(candidates) else len(candidates)
                numeric = n == 1 and _numeric(candidates)
                if label not in sample or numeric and not _numeric([sample[label]] * 2):
                    out[row, col:col + n] = -1.0
                elif numeric:
                    low, high = min(candidates), max(candidates)
                    out[row, col] = (sample[label] - low) / (high - low)
                else:
                    i = index_of(list(candidates), sample[label])
                    if i is not None:
                        out[row, col + i] = 1.0
                col += n
        return out


def fit_gp(x: np.ndarray, y: np.ndarray, seed: int):
    """Gaussian-process regression of ``y`` on ``x`` (scikit-learn's), deterministic for a
    ``seed``: a Matern-5/2 kernel (smooth, yet not as rigid as an RBF over hyper-parameters),
    its amplitude and length scale fitted by marginal likelihood, plus a white-noise term for
    the seed noise of trained accuracies; ``y`` normalised, so the prior mean is its mean."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    kernel = (ConstantKernel(1.0, (1e-2, 1e2)) * Matern(1.0, (1e-2, 1e2), nu=2.5)
              + WhiteKernel(1e-3, (1e-8, 1e0)))
    model = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=2,
                                     random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a bound reached by the optimizer still predicts
        model.fit(x, y)
    return model


def genetic_search(genome: Genome, fitness: Callable[[list[dict]], Sequence[float]],
                   feasible: Callable[[dict], bool], rng, seeds: Sequence[dict] = (),
                   population: int = 32, generations: int = 10,
                   mutation_rate: float | None = None) -> list[tuple[dict, float]]:
    """Maximizes ``fitness`` over the samples of ``genome`` that are ``feasible``.

    The first population is ``seeds`` (up to half of it) and random feasible samples; each
    generation breeds ``population`` children, two parents by binary tournament on fitness,
    each choice from either parent (uniform crossover), then each choice redrawn with
    probability ``mutation_rate`` (default one over the number of choices); an infeasible or
    repeated child is discarded (it never joins, so no member misses the constraint); the
    best ``population`` of parents and children survive.

    Returns every distinct feasible sample it evaluated with its fitness, best first.

    Example:
        >>> import random
        >>> g = [(f"b{i}", [0, 1]) for i in range(6)]
        >>> best = genetic_search(g, lambda ss: [sum(s.values()) for s in ss],
        ...                       lambda s: sum(s.values()) <= 4, random.Random(0))
        >>> best[0][1]    # the fittest sum the constraint allows
        4.0
    """
    rate = 1.0 / max(1, len(genome)) if mutation_rate is None else mutation_rate
    known: dict[str, tuple[dict, float]] = {}

    def score(samples: list[dict]) -> None:
        new = [s for s in samples if sample_key(s) not in known]
        for s, f in zip(new, fitness(new) if new else ()):
            known[sample_key(s)] = (s, float(f))

    def random_member() -> dict:
        return {label: c[rng.randrange(len(c))] for label, c in genome}

    members: dict[str, dict] = {}
    for s in seeds[:population // 2]:
        s = {label: s.get(label, c[rng.randrange(len(c))]) for label, c in genome}
        if feasible(s):
            members.setdefault(sample_key(s), s)
    for _ in range(50 * population):
        if len(members) >= population:
            break
        s = random_member()
        if feasible(s):
            members.setdefault(sample_key(s), s)
    if not members:
        return []
    pool = list(members.values())
    score(pool)

    def tournament() -> dict:
        a, b = pool[rng.randrange(len(pool))], pool[rng.randrange(len(pool))]
        return a if known[sample_key(a)][1] >= known[sample_key(b)][1] else b

    for _ in range(generations):
        children: dict[str, dict] = {}
        for _ in range(20 * population):
            if len(children) >= population:
                break
            mother, father = tournament(), tournament()
            child = {}
            for label, c in genome:
                key = (mother if rng.random() < 0.5 else father).get(label, c[0])
                if rng.random() < rate and len(c) > 1:
                    others = [k for k in c if index_of([key], k) is None]
                    key = others[rng.randrange(len(others))]
                child[label] = key
            k = sample_key(child)
            if k not in members and k not in children and feasible(child):
                children[k] = child
        score(list(children.values()))
        members.update(children)
        # (mu + lambda) survival; equal fitness keeps the older member (insertion order)
        ranked = sorted(members, key=lambda k: -known[k][1])[:population]
        members = {k: members[k] for k in ranked}
        pool = list(members.values())
    return sorted(known.values(), key=lambda sf: -sf[1])


class ChamNet(Strategy):
    """ChamNet's platform-aware search: a Gaussian process predicts accuracy, a latency lookup
    table predicts latency, and a genetic algorithm proposes the model of highest predicted
    accuracy under the latency constraint.

    The first ``n_startup`` proposals are random models that meet the constraints (the
    paper's initial sample to fit its predictor). Afterwards each proposal refits the
    Gaussian process (:func:`fit_gp`) on every told result, over the encoding of each
    sample's hyper-parameters (:class:`ArchEncoder`), and runs :func:`genetic_search` of its
    predicted mean, seeded with the best told models, over the choices the space has shown;
    the proposal is the best-predicted new model it found. A candidate the lookup table
    ``latency`` predicts over ``constraints`` is discarded before anything trains it: no
    proposal misses them (the startup's random models neither). Failed models are left out of
    the fit. The state is the told results and the random generator (the process refits from
    them), so a restored search continues the same.

    Example:
        >>> from retiarii.strategies import ChamNet
        >>> class Space:
        ...     def sample(self, sampler):
        ...         s = {}
        ...         for i in range(4):
        ...             s[f"w{i}"] = [1, 2, 3][sampler.choose(f"w{i}", [1, 2, 3], dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> lut = {"base": 4.0, "choices": {f"w{i}": [[1, 0.0], [2, 1.0], [3, 2.0]] for i in range(4)}}
        >>> s = ChamNet(seed=0, n_startup=5, latency=lut, constraints=["predicted_latency_ms <= 8"])
        >>> for _ in range(12):
        ...     sample = s.ask(Space())
        ...     s.tell(sample, sum(sample.values()))
        >>> s.best()[1]   # the constraint allows a total width of 8 at most
        8.0

    Args:
        latency: the latency lookup table (``LatencyLUT.of(space, OpLatencyTable(store))
            .to_json()``; ``retiarii nas run chamnet`` measures it on this machine).
        constraints: bounds on its prediction, ``["predicted_latency_ms <= 1.5"]``.
        n_startup: random models before the predictor is used.
        population, generations: the genetic search's, per proposal (the paper's search is
            larger; each generation costs one prediction of ``population`` samples).
        mutation_rate: probability that a child's choice is redrawn (default: one over the
            number of choices, one change per child on average).
        seed, mode, dedup, max_models, max_time, clock: see
            :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True
    max_duplicate_tries = 4  # a proposal is new already; repeats mean the space ran out

    def __init__(self, *, latency: dict | None = None, constraints: list[str] | None = None,
                 n_startup: int = 10, population: int = 32, generations: int = 10,
                 mutation_rate: float | None = None, seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        other = [c for c in (constraints or []) if Constraint.parse(c).metric != LUT_METRIC]
        if other:
            raise ObjectiveError(f"ChamNet: constraints {other} name another metric than "
                                 f"{LUT_METRIC!r}, the latency its lookup table predicts "
                                 f"before training; give the others to the Experiment")
        self._filter = CandidateFilter(constraints or [], latency)
        if not isinstance(n_startup, int) or n_startup < 2:
            raise ValueError(f"ChamNet: n_startup must be an int >= 2, got {n_startup!r}")
        for name, v in (("population", population), ("generations", generations)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ChamNet: {name} must be a positive int, got {v!r}")
        if mutation_rate is not None and not 0 <= mutation_rate <= 1:
            raise ValueError(f"ChamNet: mutation_rate must be in [0, 1], got {mutation_rate!r}")
        self.constraints = [str(c) for c in self._filter.constraints]
        self.latency = None if self._filter.lut is None else self._filter.lut.to_json()
        self.n_startup, self.population, self.generations = n_startup, population, generations
        self.mutation_rate = mutation_rate

    def feasible(self, sample: dict) -> bool:
        """Whether the lookup table predicts ``sample`` within the constraints."""
        return self._filter.feasible(sample)

    def predicted_latency(self, sample: dict) -> float:
        """The lookup table's latency of ``sample`` (ms)."""
        if self._filter.lut is None:
            raise ValueError("ChamNet.predicted_latency: no latency table was given")
        return self._filter.lut.predict(sample)

    def _new(self, d: Draw) -> bool:
        return self.feasible(d.sample) and not (self.dedup and
                                                sample_key(d.sample) in self._records)

    def _random_feasible(self, space: Any) -> Draw:
        """A random new model within the constraints; the unseen ones of a finite space's
        enumeration when random draws keep missing."""
        for _ in range(200):
            d = self._random_draw(space)
            if self._new(d):
                return d
        size = self._space_size(space)
        if self.dedup and len(self._records) >= size:
            raise SpaceExhausted(f"ChamNet: all {size} models of the space were proposed")
        if size != math.inf and callable(getattr(space, "enumerate", None)):
            unseen = [m.sample for m in space.enumerate()
                      if self._new(Draw(m.sample, None))]
            if unseen:
                return draw(space, ReplaySampler(unseen[self._rng.randrange(len(unseen))]))
        raise SpaceExhausted(f"ChamNet: 200 random models all missed the constraints "
                             f"{self.constraints} or were proposed already; loosen them")

    def _genome(self, space: Any) -> Genome:
        """Every choice the told and proposed models have shown, first candidates list kept."""
        genome: dict[str, list] = {}
        for key in self._records:
            for label, candidates in self._trace(key, space) or ():
                genome.setdefault(label, list(candidates))
        return list(genome.items())

    def _propose(self, space: Any) -> Draw:
        told = [(self._records[k].sample, self._score(v)) for k, v in self._told
                if v is not None]
        if len(told) < self.n_startup:
            return self._random_feasible(space)
        genome = self._genome(space)
        encoder = ArchEncoder(genome)
        gp = fit_gp(encoder.encode([s for s, _ in told]), np.array([v for _, v in told]),
                    self._rng.randrange(2 ** 31))
        best_told = [s for s, _ in sorted(told, key=lambda sv: -sv[1])]
        ranked = genetic_search(genome, lambda ss: gp.predict(encoder.encode(ss)),
                                self.feasible, self._rng, best_told, self.population,
                                self.generations, self.mutation_rate)
        tries = 0
        for sample, _ in ranked:
            if self.dedup and sample_key(sample) in self._records:
                continue
            # the space decides what the sample means (a conditional choice, a key gone)
            d = draw(space, ReplaySampler(sample, fallback=RandomSampler(self._rng)))
            if self._new(d):
                return d
            tries += 1
            if tries >= 20:
                break
        return self._random_feasible(space)

    def random_startup(self) -> tuple[int, str] | None:
        return self.n_startup, f"n_startup={self.n_startup}"

    def config(self) -> dict:
        config = {**super().config(), "n_startup": self.n_startup,
                  "population": self.population, "generations": self.generations,
                  "mutation_rate": self.mutation_rate, "constraints": self.constraints}
        if self.latency is not None:
            config["latency"] = self.latency
        return config
