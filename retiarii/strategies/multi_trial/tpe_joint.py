"""TPE's joint (multivariate) densities over the choices of a sample: one kernel per
observation over all its choices at once, so a good model's choices are drawn together.

TPE's default densities are one per choice, independent (a product of marginals). With
several objectives the good set is a front whose ends differ in every choice (the fastest
model has no convolution, the most accurate has several): a product of marginals mixes the
ends and draws the middle of the front. Joint densities keep each good model's choices
together, as Optuna's ``TPESampler(multivariate=True)`` and BOHB's KDE do: a mixture of a
uniform prior and one kernel per observation, each kernel a product over the choices of an
Aitchison-Aitken kernel around the observation's candidate.

A kernel of an observation among ``N`` (of a set) puts ``1 + prior_weight / N`` on its
candidate and ``prior_weight / N`` on every candidate, normalised (Optuna's categorical
kernel: the bandwidth shrinks as observations accrue). A choice the observation did not have
(a conditional choice) or whose candidate is gone is uniform under its kernel.

Example:
    >>> kernel_probs(["a", "b", "c", "d"], "b", prior_weight=1.0, n=4)
    [0.125, 0.625, 0.125, 0.125]
    >>> # (1 x 1/2 + 3 x 3/4 + 1 x 1/4) / (1 + 3 + 1): the prior, a's kernel, b's kernel
    >>> d = JointDensity([{"op": "a"}, {"op": "b"}], [3.0, 1.0], prior_weight=1.0)
    >>> round(math.exp(d.log_density([("op", ["a", "b"])], {"op": "a"})), 4)
    0.6
"""
from __future__ import annotations

import math
from typing import Sequence

from ...sampler import index_of

__all__ = ["JointDensity", "JointSampler", "kernel_probs"]


def kernel_probs(candidates: list, observed, prior_weight: float, n: int) -> list[float]:
    """The kernel of one observation (of ``n`` in its set) at one choice: the probability
    of each candidate. Uniform when ``observed`` is not a candidate (or is None: the
    observation did not have this choice)."""
    k = len(candidates)
    i = None if observed is None else index_of(candidates, observed)
    if i is None:
        return [1.0 / k] * k
    smooth = prior_weight / n
    total = 1.0 + k * smooth
    return [(smooth + (1.0 if j == i else 0.0)) / total for j in range(k)]


class JointDensity:
    """A mixture: a uniform prior of weight ``prior_weight`` and one kernel per observation of
    weight ``weights[k]`` (1.0 each by default; MOTPE's hypervolume weights for the good
    set).

    Args:
        observations: samples (label -> candidate key).
        weights: each observation's weight, > 0.
        prior_weight: the uniform component's weight and the kernels' smoothing.
    """

    def __init__(self, observations: Sequence[dict], weights: Sequence[float] | None,
                 prior_weight: float):
        self.observations = list(observations)
        self.weights = [1.0] * len(self.observations) if weights is None else list(weights)
        self.prior_weight = prior_weight

    def log_density(self, trace: list[tuple[str, list]], sample: dict) -> float:
        """log of the mixture's probability of ``sample`` (whose choices ``trace`` lists)."""
        n = max(1, len(self.observations))
        uniform = sum(-math.log(len(c)) for _, c in trace)
        terms = [math.log(self.prior_weight) + uniform]
        for obs, w in zip(self.observations, self.weights):
            term = math.log(w)
            for label, candidates in trace:
                probs = kernel_probs(candidates, obs.get(label), self.prior_weight, n)
                term += math.log(probs[index_of(candidates, sample[label])])
            terms.append(term)
        top = max(terms)
        total = self.prior_weight + sum(self.weights)
        return top + math.log(sum(math.exp(t - top) for t in terms)) - math.log(total)


class JointSampler:
    """Draws one sample from a :class:`JointDensity`: a component first (the prior or an
    observation, by weight), then each choice from that component's kernel as the space
    reaches it."""

    def __init__(self, density: JointDensity, rng):
        self.density, self.rng = density, rng
        weights = [density.prior_weight, *density.weights]
        k = rng.choices(range(len(weights)), weights=weights)[0]
        self.center = None if k == 0 else density.observations[k - 1]

    def choose(self, label: str, candidates: list, context: dict) -> int:
        if self.center is None:  # the prior component: uniform
            return self.rng.randrange(len(candidates))
        n = max(1, len(self.density.observations))
        probs = kernel_probs(candidates, self.center.get(label), self.density.prior_weight, n)
        return self.rng.choices(range(len(candidates)), weights=probs)[0]
