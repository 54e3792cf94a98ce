"""Predictor-guided search: a surrogate of the metric, trained on the models told so far, picks
the most promising of many candidates (Neural Predictor, Wen et al., ECCV 2020; ChamNet, Dai et
al., CVPR 2019; the accuracy predictor of Once-for-All, Cai et al., ICLR 2020)."""
from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np

from ...objectives import Scored, hypervolume, nsga_keys, pareto_indices
from ...sampler import RandomSampler, ReplaySampler, index_of, sample_key
from .base import Draw, Strategy, draw
from .evolution import mutable_labels

SURROGATES = ("gbt", "mlp")


class Encoder:
    """One-hot encoding of samples: one block per label, one column per key met for it.

    The columns grow as traces are added (a conditional choice adds its block when first met);
    a sample without a label has zeros in its block, so samples of different depths compare.

    Example:
        >>> enc = Encoder()
        >>> enc.add([("op", ["conv", "pool"]), ("n", [1, 2])])
        >>> enc.encode([{"op": "pool", "n": 1}, {"op": "conv"}]).tolist()
        [[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    """

    def __init__(self):
        self.columns: dict[str, int] = {}  # json([label, key]) -> column

    def add(self, trace: list[tuple[str, list]] | None) -> None:
        """Make columns for every (label, candidate) of ``trace``."""
        for label, candidates in trace or ():
            for key in candidates:
                self.columns.setdefault(json.dumps([label, key]), len(self.columns))

    def encode(self, samples: list[dict]) -> np.ndarray:
        """(N samples) -> (N, columns) of 0/1."""
        out = np.zeros((len(samples), len(self.columns)))
        for row, sample in enumerate(samples):
            for label, key in sample.items():
                column = self.columns.get(json.dumps([label, key]))
                if column is not None:
                    out[row, column] = 1.0
        return out


def fit_surrogate(x: np.ndarray, y: np.ndarray, kind: str, seed: int):
    """A regressor of ``y`` on ``x`` (``predict`` method), deterministic for a ``seed``.

    ``"gbt"``: gradient-boosted trees (robust on the few dozen points of a search's start);
    ``"mlp"``: a two-layer perceptron (the Neural Predictor paper's MLP baseline).
    """
    if kind == "gbt":
        from sklearn.ensemble import GradientBoostingRegressor

        # shallow trees and subsampling: few points, so fit the trend rather than the noise
        model = GradientBoostingRegressor(n_estimators=100, max_depth=3, learning_rate=0.1,
                                          subsample=0.8, random_state=seed)
    elif kind == "mlp":
        from sklearn.neural_network import MLPRegressor

        model = MLPRegressor(hidden_layer_sizes=(64, 64), alpha=1e-3, max_iter=500,
                             random_state=seed)
    else:
        raise ValueError(f"unknown surrogate {kind!r}; expected one of {SURROGATES}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an MLP stopped at max_iter still ranks well
        model.fit(x, y)
    return model


def rank(encoder: Encoder, told: list[tuple[dict, float]], candidates: list[Draw], kind: str,
         seed: int) -> list[int]:
    """Indices of ``candidates`` from best to worst predicted score (ties: draw order), by a
    surrogate fitted on ``told`` (sample, score higher-is-better)."""
    for c in candidates:
        encoder.add(c.trace)
    x = encoder.encode([s for s, _ in told])
    y = np.array([v for _, v in told])
    model = fit_surrogate(x, y, kind, seed)
    predicted = model.predict(encoder.encode([c.sample for c in candidates]))
    return sorted(range(len(candidates)), key=lambda i: (-predicted[i], i))


def improvement_order(front: list[tuple[float, ...]], predicted: list[tuple[float, ...]],
                      reference: tuple[float, ...]) -> list[int]:
    """Indices of ``predicted`` points (to minimize) from the largest hypervolume improvement
    over ``front`` to the smallest; ties (none improves, say) by NSGA-II's crowded comparison
    among the predicted points, then by index.

    Example:
        >>> improvement_order([(1.0, 1.0)], [(2.0, 2.0), (0.0, 3.0), (0.5, 0.5)], (4.0, 4.0))
        [2, 1, 0]
    """
    base = hypervolume(front, reference)
    gain = [hypervolume([*front, p], reference) - base for p in predicted]
    keys = nsga_keys(predicted)
    return sorted(range(len(predicted)), key=lambda i: (-gain[i], keys[i], i))


def rank_objectives(encoder: Encoder, told: list[tuple[dict, Scored]], candidates: list[Draw],
                    kind: str, seed: int) -> list[int]:
    """Several objectives: indices of ``candidates`` from best to worst by one surrogate per
    objective, fitted on ``told`` (sample, :class:`Scored`), and the hypervolume improvement
    of each candidate's predicted point over the told front (:func:`improvement_order`)."""
    for c in candidates:
        encoder.add(c.trace)
    x = encoder.encode([s for s, _ in told])
    y = np.array([score.point for _, score in told])  # (N, M), to minimize
    xc = encoder.encode([c.sample for c in candidates])
    columns = [fit_surrogate(x, y[:, m], kind, seed + m).predict(xc) for m in range(y.shape[1])]
    predicted = [tuple(float(col[i]) for col in columns) for i in range(len(candidates))]
    told_points = [score.point for _, score in told]
    front = [told_points[i] for i in pareto_indices(told_points,
                                                    [score.violation for _, score in told])]
    every = np.array(told_points + predicted)  # the reference: past the worst of both
    spread = every.max(axis=0) - every.min(axis=0)
    reference = tuple(every.max(axis=0) + np.where(spread > 0, 0.1 * spread, 1.0))
    return improvement_order(front, predicted, reference)


def neighbour(strategy: Strategy, space: Any, parent_key: str) -> Draw:
    """``parent`` with one choice (among those with two candidates or more) changed at random;
    choices the change opens are drawn at random."""
    parent = strategy._records[parent_key].sample
    labels = mutable_labels(strategy._trace(parent_key, space) or [])
    if not labels:
        return strategy._random_draw(space)
    target = labels[strategy._rng.randrange(len(labels))]

    def change(candidates: list, old: Any) -> int:
        others = [i for i in range(len(candidates)) if i != index_of(candidates, old)]
        return others[strategy._rng.randrange(len(others))]

    child = draw(space, ReplaySampler(parent, fallback=RandomSampler(strategy._rng),
                                      overrides={target: change}))
    child.parent = dict(parent)
    return child


class Predictor(Strategy):
    """Proposes the best-predicted of many candidates, by a surrogate of the told results.

    The first ``n_startup`` proposals are random. Afterwards, each proposal draws
    ``n_candidates`` candidates, a ``local_fraction`` of them neighbours (one choice changed)
    of the best told models and the rest random models of the space; it fits a surrogate
    (gradient-boosted trees or an MLP, over the one-hot encoding of each sample's choices,
    :class:`Encoder`) on every told result, and proposes the candidate predicted best that
    is new. Failed models are left out of the fit; pending ones are ignored.

    This is the multi-trial form of Neural Predictor (there a GCN over NAS-Bench-101 cells,
    trained on a first batch of random models), ChamNet's accuracy predictor and Once-for-All's
    predictor-guided search; the surrogate here is generic over samples, not specific to a
    space. Its state is the told results and the random generator (the surrogate is refitted
    from them, deterministically, at each proposal), so a restored search continues the same.

    Several objectives (``Experiment(metric=[...], mode=[...])``, :meth:`use_objectives`):
    one surrogate per objective; the candidate proposed is the one whose predicted point adds
    the most hypervolume to the front of the told models (:func:`improvement_order`), and the
    neighbours are drawn around the told models best by NSGA-II's crowded comparison
    (feasible first). The search's result is its front (:meth:`pareto`).

    Foreign samples are accepted (``tell`` of a sample never proposed): results of an earlier
    run train the surrogate too.

    Example:
        >>> from retiarii.strategies import Predictor
        >>> class Space:
        ...     ops = ["conv", "pool", "skip"]
        ...     def sample(self, sampler):
        ...         s = {}
        ...         for i in range(4):
        ...             s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> s = Predictor(seed=0, n_startup=8)
        >>> for _ in range(20):
        ...     sample = s.ask(Space())
        ...     s.tell(sample, sum(op == "conv" for op in sample.values()))
        >>> s.best()[1] >= 3
        True

    Args:
        seed: seeds the generator (equal seeds, equal searches in any process).
        n_startup: random models before the surrogate is used (Neural Predictor trains its
            predictor on a first batch of random models too).
        n_candidates: candidates scored per proposal; more is greedier and slower (each costs
            one ``space.sample`` call).
        local_fraction: share of the candidates that are neighbours of the best told models
            (a local search around them) rather than random models.
        surrogate: ``"gbt"`` (gradient-boosted trees, default) or ``"mlp"``.
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    accepts_foreign = True
    multi_objective = True
    # one proposal already skips known candidates: repeats mean the candidates ran out
    max_duplicate_tries = 4

    def __init__(self, *, seed: int | None = None, n_startup: int = 10, n_candidates: int = 100,
                 local_fraction: float = 0.5, surrogate: str = "gbt", **common: Any):
        super().__init__(seed=seed, **common)
        if not isinstance(n_startup, int) or n_startup < 2:
            raise ValueError(f"Predictor: n_startup must be an int >= 2, got {n_startup!r}")
        if not isinstance(n_candidates, int) or n_candidates < 1:
            raise ValueError(f"Predictor: n_candidates must be a positive int, "
                             f"got {n_candidates!r}")
        if not 0 <= local_fraction <= 1:
            raise ValueError(f"Predictor: local_fraction must be in [0, 1], "
                             f"got {local_fraction!r}")
        if surrogate not in SURROGATES:
            raise ValueError(f"Predictor: surrogate must be one of {SURROGATES}, "
                             f"got {surrogate!r}")
        self.n_startup, self.n_candidates = n_startup, n_candidates
        self.local_fraction, self.surrogate = local_fraction, surrogate

    def _fitted_data(self, space: Any) -> tuple[Encoder, list[tuple[dict, float]], list[str]]:
        """The encoder over every told sample's choices, the (sample, score) pairs, and the
        keys of the told samples from best to worst."""
        encoder, told, keys = Encoder(), [], []
        violations = self._violations() if self.objectives is not None else {}
        for key, value in self._told:
            if value is not None:
                encoder.add(self._trace(key, space))
                told.append((self._records[key].sample,
                             self._score(value, violations.get(key, 0.0))))
                keys.append(key)
        if self.objectives is not None:
            nsga = nsga_keys([s.point for _, s in told], [s.violation for _, s in told])
            order = sorted(range(len(told)), key=lambda i: (nsga[i], i))
        else:
            order = sorted(range(len(told)), key=lambda i: (-told[i][1], i))
        return encoder, told, [keys[i] for i in order]

    def _propose(self, space: Any) -> Draw:
        encoder, told, best_first = self._fitted_data(space)
        if len(told) < self.n_startup:
            return self._random_draw(space)
        n_local = round(self.local_fraction * self.n_candidates)
        parents = best_first[:max(1, self.n_startup // 2)]
        candidates, seen = [], set()
        for i in range(self.n_candidates):
            c = neighbour(self, space, parents[i % len(parents)]) if i < n_local \
                else self._random_draw(space)
            key = sample_key(c.sample)
            if key not in seen and not (self.dedup and key in self._records):
                seen.add(key)
                candidates.append(c)
        if not candidates:  # every candidate known: the base class asks again, then random
            return self._random_draw(space)
        ranking = rank if self.objectives is None else rank_objectives
        order = ranking(encoder, told, candidates, self.surrogate, self._rng.randrange(2 ** 31))
        return candidates[order[0]]

    def random_startup(self) -> tuple[int, str] | None:
        return self.n_startup, f"n_startup={self.n_startup}"

    def config(self) -> dict:
        return {**super().config(), "n_startup": self.n_startup,
                "n_candidates": self.n_candidates, "local_fraction": self.local_fraction,
                "surrogate": self.surrogate}
