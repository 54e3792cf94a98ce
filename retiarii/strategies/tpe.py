"""TPE, the Tree-structured Parzen Estimator (Bergstra et al., NeurIPS 2011), over the choices
of a sample."""
from __future__ import annotations

import math
from typing import Any

from .base import Draw, Strategy, draw, index_of


def parzen_categorical(keys: list, candidates: list, prior_weight: float) -> list[float]:
    """Smoothed frequencies of ``keys`` over ``candidates``: each observation weighs 1 and a
    uniform prior of total weight ``prior_weight`` keeps every candidate possible.

    Example:
        >>> parzen_categorical(["a", "a", "b"], ["a", "b", "c"], prior_weight=3.0)
        [0.5, 0.3333333333333333, 0.16666666666666666]
    """
    weights = [prior_weight / len(candidates)] * len(candidates)
    for key in keys:
        i = index_of(candidates, key)
        if i is not None:  # a key no longer among the candidates says nothing here
            weights[i] += 1.0
    total = sum(weights)
    return [w / total for w in weights]


class _TPESampler:
    """Decides each choice with the good/bad density ratio of the observations having it."""

    def __init__(self, good: list[dict], bad: list[dict], strategy: "TPE"):
        self.good, self.bad, self.s = good, bad, strategy

    def choose(self, label: str, candidates: list, context: dict) -> int:
        s = self.s
        good = [sample[label] for sample in self.good if label in sample]
        bad = [sample[label] for sample in self.bad if label in sample]
        if not good:  # a choice no good model had (a new branch): nothing to go on
            return s._rng.randrange(len(candidates))
        l = parzen_categorical(good, candidates, s.prior_weight)  # noqa: E741 (the paper's l)
        g = parzen_categorical(bad, candidates, s.prior_weight)
        # Draw from l(x) and keep the draw with the largest l(x) / g(x), the expected
        # improvement criterion of the paper.
        draws = s._rng.choices(range(len(candidates)), weights=l, k=s.n_ei_candidates)
        return max(draws, key=lambda i: l[i] / g[i])


class TPE(Strategy):
    """Tree-structured Parzen Estimator over the choices of a sample (independent per label).

    After ``n_startup`` random models, the told models are split into the best ``gamma``
    fraction (good) and the rest (bad). Each choice, as the space reaches it, gets a smoothed
    categorical density from the good models that had that label, l(x), and one from the bad
    models, g(x); ``n_ei_candidates`` draws from l(x) are made and the one maximising
    l(x) / g(x) is chosen. Choices are modelled independently (as Optuna's default TPE); a
    conditional choice only learns from the models in which it existed, and a choice that no
    good model had is drawn at random. Pending models are ignored; dedup keeps asynchronous
    asks distinct.

    This is our own implementation rather than a wrapper of Optuna's ``TPESampler``: samples
    here are purely categorical, and a wrapper would have to rebuild an Optuna study and reach
    into its private random state to save and restore a search exactly, which this class does
    with a list of results and one ``random.Random`` state. ``benchmarks/strategies.py``
    compares the two.

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
            more; 0.25 is the paper's and Hyperopt's value.
        prior_weight: total weight of the uniform prior in each density; keeps every
            candidate possible (Optuna's default 1.0).
        n_ei_candidates: draws from l(x) per choice; more is greedier (Optuna's default 24).
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True

    def __init__(self, *, seed: int | None = None, n_startup: int = 10, gamma: float = 0.25,
                 prior_weight: float = 1.0, n_ei_candidates: int = 24, **common: Any):
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

    def _propose(self, space: Any) -> Draw:
        observations = list(self._observations())
        if len(observations) < self.n_startup:
            return self._random_draw(space)
        # Sort by score, best first; ties keep the tell order (sorted is stable).
        observations.sort(key=lambda o: -o[1])
        n_good = max(1, math.ceil(self.gamma * len(observations)))
        good = [sample for sample, _ in observations[:n_good]]
        bad = [sample for sample, _ in observations[n_good:]]
        return draw(space, _TPESampler(good, bad, self))

    def _config(self) -> dict:
        return {**super()._config(), "n_startup": self.n_startup, "gamma": self.gamma,
                "prior_weight": self.prior_weight, "n_ei_candidates": self.n_ei_candidates}
