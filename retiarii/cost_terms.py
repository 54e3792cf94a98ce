"""The papers' cost terms: a latency lookup table over a space's choices, FBNet's latency
loss and a constraint check of candidates before they are evaluated.

A :class:`LatencyLUT` predicts a sample's latency as the base model's (every choice at its
first candidate) plus, for each choice, what its candidate adds when only that choice
changes: FBNet's and ProxylessNAS's per-layer lookup table, built from the per-operator table
(:mod:`retiarii.engine.driver.op_latency`). It is exact when the choices' operators do not interact
(one block per layer: the mobile spaces), an approximation otherwise.

Example:
    >>> lut = LatencyLUT(1.0, {"l1": [["k3", 0.0], ["k5", 0.5]], "l2": [["a", 0.0], ["b", 0.25]]})
    >>> lut.predict({"l1": "k5", "l2": "b"})
    1.75
    >>> round(fbnet_factor(lut.predict({"l1": "k5", "l2": "b"}) * 1000, 0.2, 0.6), 4)
    0.6682
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .objectives import Constraint, ObjectiveError
from .sampler import index_of

__all__ = ["LatencyLUT", "CandidateFilter", "fbnet_factor", "median_predicted_latency",
           "LUT_METRIC"]

# the metric a constraint on a LatencyLUT's prediction names: the per-operator table's
# prediction, as the engine's cost of the same name (docs/multi_objective.md)
LUT_METRIC = "predicted_latency_ms"


@dataclass(frozen=True)
class LatencyLUT:
    """``base`` (ms) and ``choices``: label -> ``[[candidate key, ms over base], ...]`` (lists,
    so that keys of any JSON type survive a round trip through JSON)."""

    base: float
    choices: dict

    @classmethod
    def of(cls, space, table, device: str | None = None) -> "LatencyLUT":
        """From the per-operator table ``table`` (an ``OpLatencyTable``) of ``space``."""
        from .engine.driver.op_latency import choice_latencies

        deltas = choice_latencies(space, table, device)
        example = space.example_input
        example = (example[0] if isinstance(example, (tuple, list)) else example)[:1]
        # the base model (every choice at its first candidate) is the zero of every delta
        base_sample = space.sample(_FirstCandidates()).sample
        base = table.predict(space.instantiate(base_sample).to_module(), example, device)
        return cls(float(base), {label: [[k, float(v)] for k, v in costs.items()]
                                 for label, costs in deltas.items()})

    @classmethod
    def from_json(cls, data: Any) -> "LatencyLUT":
        if isinstance(data, LatencyLUT):
            return data
        if not (isinstance(data, dict) and "base" in data and "choices" in data):
            raise ValueError(f"a latency lookup table is {{'base': ms, 'choices': {{label: "
                             f"[[key, ms], ...]}}}} (LatencyLUT.to_json()), got {data!r}")
        return cls(float(data["base"]), {label: [[k, float(v)] for k, v in rows]
                                         for label, rows in data["choices"].items()})

    def to_json(self) -> dict:
        return {"base": self.base, "choices": {k: [list(r) for r in v]
                                               for k, v in self.choices.items()}}

    def costs(self, label: str, candidates: Sequence) -> list[float]:
        """What each of ``candidates`` of ``label`` adds (0.0 for a key the table lacks)."""
        out = [0.0] * len(candidates)
        for key, value in self.choices.get(label, ()):
            i = index_of(list(candidates), key)
            if i is not None:
                out[i] = value
        return out

    def predict(self, sample: dict) -> float:
        """The predicted latency (ms) of ``sample``."""
        total = self.base
        for label, rows in self.choices.items():
            if label in sample:
                for key, value in rows:
                    if index_of([key], sample[label]) == 0:
                        total += value
                        break
        return total


def median_predicted_latency(space, table, models: int = 16, seed: int = 0) -> float:
    """The median predicted latency (ms, the per-operator ``table``) of ``models`` random
    models of ``space`` drawn with ``seed``: MnasNet's target in ``retiarii nas run``."""
    import random
    import statistics

    from .sampler import RandomSampler

    example = space.example_input
    example = (example[0] if isinstance(example, (tuple, list)) else example)[:1]
    rng = random.Random(seed)
    return statistics.median(table.predict(space.sample(RandomSampler(rng)).to_module(),
                                           example) for _ in range(models))


class _FirstCandidates:
    """Every choice at its first candidate (the base model of a space)."""

    def choose(self, label: str, candidates: list, context: dict) -> int:
        return 0


def fbnet_factor(latency: float, alpha: float, beta: float) -> float:
    """FBNet's latency factor ``alpha * log(LAT) ** beta`` (Wu et al., CVPR 2019, Eq. 2):
    the loss is ``CE * factor``. ``LAT`` must exceed 1 (the log is then positive).

    Example:
        >>> round(fbnet_factor(math.e ** 2, 0.2, 0.5), 6)   # 0.2 * 2 ** 0.5
        0.282843
    """
    if not latency > 1:
        raise ValueError(f"FBNet's latency loss needs LAT > 1 (log LAT > 0), got {latency!r}: "
                         f"raise latency_scale (LAT = latency_scale x the table's ms)")
    return alpha * math.log(latency) ** beta


class CandidateFilter:
    """Which candidates meet ``constraints`` on the lookup table's prediction
    (:data:`LUT_METRIC`), before anything evaluates them.

    Example:
        >>> lut = LatencyLUT(1.0, {"l1": [["k3", 0.0], ["k5", 0.5]]})
        >>> f = CandidateFilter(["predicted_latency_ms <= 1.2"], lut)
        >>> f.feasible({"l1": "k3"}), f.feasible({"l1": "k5"})
        (True, False)
    """

    def __init__(self, constraints: Sequence[Any], latency: LatencyLUT | dict | None):
        self.constraints = [Constraint.parse(c) for c in constraints]
        other = [str(c) for c in self.constraints if c.metric != LUT_METRIC]
        if other:
            raise ObjectiveError(f"constraints {other}: a one-shot search checks candidates "
                                 f"before evaluating them by the latency lookup table only: "
                                 f"name {LUT_METRIC!r}")
        if self.constraints and latency is None:
            raise ObjectiveError(f"constraints {[str(c) for c in self.constraints]} need a "
                                 f"latency lookup table: pass latency=LatencyLUT.of(space, "
                                 f"OpLatencyTable(store)).to_json()")
        self.lut = None if latency is None else LatencyLUT.from_json(latency)

    def feasible(self, sample: dict) -> bool:
        if not self.constraints:
            return True
        value = self.lut.predict(sample)
        return all(c.met(value) for c in self.constraints)
