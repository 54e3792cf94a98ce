"""Regularized (aging) evolution, Real et al., "Regularized Evolution for Image Classifier
Architecture Search", AAAI 2019."""
from __future__ import annotations

from collections import deque
from typing import Any

from ...objectives import Scored, nsga_keys
from ...sampler import RandomSampler, ReplaySampler, index_of, sample_key
from .base import Draw, Strategy, draw


def mutable_labels(trace: list[tuple[str, list]]) -> list[str]:
    """Labels of a sample that a mutation can change (two candidates or more)."""
    return [label for label, candidates in trace if len(candidates) > 1]


def tournament(population: list[tuple[str, float]], sample_size: int, rng) -> str:
    """The key of the best of ``sample_size`` members drawn without replacement.

    Example:
        >>> import random
        >>> tournament([("a", 0.1), ("b", 0.9), ("c", 0.5)], 3, random.Random(0))
        'b'
    """
    contestants = rng.sample(population, sample_size)
    # max() keeps the first of equal scores, and contestants come in a seeded order.
    return max(contestants, key=lambda member: member[1])[0]


def crowded_tournament(population: list[tuple[str, Scored]], sample_size: int, rng) -> str:
    """The key of the best of ``sample_size`` members drawn without replacement, by NSGA-II's
    crowded comparison over the whole population: the lowest non-dominated rank (feasible
    before infeasible), then the largest crowding distance.

    Example:
        >>> import random
        >>> pop = [("a", Scored((1.0, 3.0))), ("b", Scored((2.0, 4.0))), ("c", Scored((0.0, 0.0), 1.0))]
        >>> crowded_tournament(pop, 3, random.Random(0))   # c is infeasible, b dominated by a
        'a'
    """
    keys = nsga_keys([s.point for _, s in population], [s.violation for _, s in population])
    order = {member[0]: keys[i] for i, member in enumerate(population)}
    contestants = rng.sample(population, sample_size)
    # min() keeps the first of equal keys, and contestants come in a seeded order.
    return min(contestants, key=lambda member: order[member[0]])[0]


class _FirstSampler:
    """Every choice at its first candidate: the base model of a space."""

    def choose(self, label: str, candidates: list, context: dict) -> int:
        return 0


class RegularizedEvolution(Strategy):
    """Aging evolution: a tournament picks a parent, its child changes one choice, and the
    oldest member of the population dies.

    The population holds the last ``population_size`` told models, oldest first. Until it is
    full, proposals are random (the initial population). Afterwards each proposal draws
    ``sample_size`` members at random, takes the best as parent, and mutates one of its choices
    picked uniformly (among those with two candidates or more) to a different candidate. The
    child keeps every other choice of the parent whose key is still a candidate; a choice the
    parent did not have (a conditional choice opened by the mutation) is drawn at random.
    Telling the child's result appends it to the population and removes the oldest member.

    Asynchronous use (several ``ask`` before the ``tell`` s): pending children are not members;
    the tournament runs over the told population only, so while the initial population waits
    for its results, extra asks stay random. Failed models (``tell(sample, None)``) never join.

    Evolving spaces: with ``initial="base"`` the initial population grows from the space's
    base model (every choice at its first candidate, ``space.base_model()``) instead of
    random models: the base model is proposed first, then children of it, one choice
    changed each, until the population is full. In an open-ended space (the evolving
    mutators of ``retiarii.mutators.evolving``) a random model is a random number of growth
    steps away from the base; starting from the base makes the search grow from minimal
    networks, as NEAT and Weight Agnostic Networks do.

    Several objectives (``Experiment(metric=[...], mode=[...])``, :meth:`use_objectives`):
    the tournament compares members as NSGA-II does, by non-dominated rank within the
    population (constraints by Deb's rule: feasible first), then by crowding distance, so the
    population spreads along the front; and the member that leaves when a child joins is
    the worst by that comparison (NSGA-II's elitist survival, one child at a time; ties: the
    oldest) instead of the oldest. The search's result is its front (:meth:`pareto`).

    Foreign samples are accepted: ``tell`` of a sample this strategy never proposed (a known
    good architecture, results imported from another run) adds it to the population like a
    child of its own.

    Example:
        >>> from retiarii.strategies import RegularizedEvolution
        >>> class Space:
        ...     ops = ["conv", "pool", "skip"]
        ...     def sample(self, sampler):
        ...         s = {}
        ...         for i in range(3):
        ...             s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> s = RegularizedEvolution(population_size=4, sample_size=2, seed=0)
        >>> for _ in range(12):
        ...     sample = s.ask(Space())
        ...     s.tell(sample, sum(op == "conv" for op in sample.values()))
        >>> s.best()[1] >= 2
        True

    Args:
        population_size: P, the number of live members. The default 20 suits budgets of a few
            hundred models; the paper uses 100 over 20000 models. The first P are random.
        sample_size: S, members per tournament, ``1 <= S <= P``; larger S is greedier
            (default 5: the paper's ratio S/P = 25/100).
        initial: ``"random"`` (default: random models until the population is full) or
            ``"base"`` (the base model, then its children; see above).
        kill: ``"oldest"`` (default: aging, Regularized Evolution's rule) or ``"worse"``
            (Large-Scale Evolution's, Real et al. 2017: a proposal's tournament also kills
            its worst contestant, the better reproduces, and nothing ages; the population
            refills with the children as they are told, and the tournament kills no more
            while only ``sample_size`` members are left).
        inherit: each child starts training from its parent's trained weights, every
            parameter and buffer whose name and shape the mutation left unchanged (the
            engine's weight inheritance, Large-Scale Evolution's; changed layers start
            fresh, and the child trains its full budget from there). Default False: every
            model trains from scratch (Regularized Evolution's rule).
        seed: seeds the generator (equal seeds, equal searches in any process).
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True
    multi_objective = True
    # children start from their parents' trained tensors that fit (the driver reads it:
    # engine/trainers/inheritance.py); set by inherit=
    inherit_weights = False

    def __init__(self, population_size: int = 20, sample_size: int = 5, *,
                 initial: str = "random", kill: str = "oldest", inherit: bool = False,
                 seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        if kill not in ("oldest", "worse"):
            raise ValueError(f"RegularizedEvolution: kill must be 'oldest' or 'worse', got "
                             f"{kill!r}")
        self.kill = kill
        if not isinstance(inherit, bool):
            raise ValueError(f"RegularizedEvolution: inherit must be True or False, got "
                             f"{inherit!r}")
        self.inherit_weights = inherit
        if initial not in ("random", "base"):
            raise ValueError(f"RegularizedEvolution: initial must be 'random' or 'base', got "
                             f"{initial!r}")
        self.initial = initial
        if not isinstance(population_size, int) or population_size < 1:
            raise ValueError(f"RegularizedEvolution: population_size must be a positive int, "
                             f"got {population_size!r}")
        if not isinstance(sample_size, int) or not 1 <= sample_size <= population_size:
            raise ValueError(f"RegularizedEvolution: sample_size must be an int in "
                             f"[1, population_size={population_size}], got {sample_size!r}")
        self.population_size = population_size
        self.sample_size = sample_size
        # (sample key, score), oldest first; deque(maxlen) drops the oldest on append (with
        # kill="worse" tournaments remove members instead: no maxlen)
        self._population: deque[tuple[str, float]] = deque(maxlen=self._maxlen())
        self._grown = False  # kill="worse": the population was full once (tournaments began)
        self._doomed: str | None = None  # kill="worse": the loser of the pending tournament

    def _maxlen(self) -> int | None:
        return self.population_size if self.kill == "oldest" else None

    def _propose(self, space: Any) -> Draw:
        if len(self._population) < self.population_size and not self._grown:
            if self.initial == "base":
                return self._from_base(space)
            return self._random_draw(space)
        if self.kill == "worse":
            return self._mutate(space, self._pair_tournament())
        if self.objectives is not None:
            parent_key = crowded_tournament(list(self._population), self.sample_size,
                                            self._rng)
        else:
            parent_key = tournament(list(self._population), self.sample_size, self._rng)
        return self._mutate(space, parent_key)

    def _pair_tournament(self) -> str:
        """Large-Scale Evolution's tournament: ``sample_size`` members drawn (the paper: 2),
        the best reproduces and the worst is killed (kept while only ``sample_size`` are
        left); returns the parent's key."""
        self._grown = True
        members = list(self._population)
        contestants = self._rng.sample(members, min(self.sample_size, len(members)))
        if self.objectives is not None:  # NSGA-II's crowded comparison, as crowded_tournament
            keys = nsga_keys([s.point for _, s in members], [s.violation for _, s in members])
            rank = {m[0]: keys[i] for i, m in enumerate(members)}
            parent = min(contestants, key=lambda m: rank[m[0]])[0]
            loser = max(contestants, key=lambda m: rank[m[0]])[0]
        else:  # max() / min() keep the first of equal scores: seeded order
            parent = max(contestants, key=lambda m: m[1])[0]
            loser = min(contestants, key=lambda m: m[1])[0]
        # killed once ask() accepts the child (a duplicate child is drawn again, with a new
        # tournament: only the accepted one's loser dies)
        self._doomed = loser if len(members) > self.sample_size and loser != parent else None
        return parent

    def ask(self, space: Any) -> dict:
        self._doomed = None
        sample = super().ask(space)
        if self._doomed is not None:
            self._population = deque(m for m in self._population if m[0] != self._doomed)
            self._doomed = None
        return sample

    def _from_base(self, space: Any) -> Draw:
        """The base model (every choice's first candidate), then children of it."""
        base = draw(space, _FirstSampler())
        key = sample_key(base.sample)
        if key not in self._records:
            return base
        return self._mutate(space, key)

    def _mutate(self, space: Any, parent_key: str) -> Draw:
        parent = self._records[parent_key].sample
        labels = mutable_labels(self._trace(parent_key, space))
        if not labels:  # every choice has one candidate: the space has one model
            return self._random_draw(space)
        target = labels[self._rng.randrange(len(labels))]

        def mutate(candidates: list, old_key: Any) -> int:
            old = index_of(candidates, old_key)
            others = [i for i in range(len(candidates)) if i != old]
            return others[self._rng.randrange(len(others))]

        sampler = ReplaySampler(parent, fallback=RandomSampler(self._rng),
                                overrides={target: mutate})
        child = draw(space, sampler)
        child.parent = dict(parent)
        return child

    def _on_tell(self, key: str, score: float | None) -> None:
        if score is None:
            return
        if self.objectives is None or len(self._population) < self.population_size:
            self._population.append((key, score))  # one metric: the oldest dies (aging)
            return
        # Several objectives: NSGA-II's survival, steady-state: of the population and the
        # child, the worst by the crowded comparison leaves (ties: the oldest). Aging here
        # killed the front's members after P models, so the tournaments no longer drew the
        # elite NSGA-II breeds from (benchmarks/README.md, #30: +1.5 -> +2.1 s.e. over random)
        members = [*self._population, (key, score)]
        keys = nsga_keys([s.point for _, s in members], [s.violation for _, s in members])
        worst = max(range(len(members)), key=lambda i: (keys[i], -i))
        self._population = deque((m for i, m in enumerate(members) if i != worst),
                                 maxlen=self.population_size)

    def random_startup(self) -> tuple[int, str] | None:
        return self.population_size, f"population_size={self.population_size}"

    def config(self) -> dict:
        config = {**super().config(), "population_size": self.population_size,
                  "sample_size": self.sample_size}
        if self.initial != "random":  # (states saved before the option existed still load)
            config["initial"] = self.initial
        if self.inherit_weights:
            config["inherit"] = True
        if self.kill != "oldest":
            config["kill"] = self.kill
        return config

    def _state(self) -> dict:
        grown = {"grown": True} if self._grown else {}  # (kill="worse" only)
        if self.objectives is not None:  # [key, point, violation]
            return {"population": [[k, list(s.point), s.violation]
                                   for k, s in self._population], **grown}
        return {"population": [list(member) for member in self._population], **grown}

    def _load_state(self, state: dict) -> None:
        if self.objectives is not None:
            members = ((m[0], Scored(tuple(m[1]), m[2])) for m in state["population"])
        else:
            members = ((k, s) for k, s in state["population"])
        self._population = deque(members, maxlen=self._maxlen())
        self._grown = bool(state.get("grown", False))

