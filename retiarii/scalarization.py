"""Scalarizations: several objectives made one number to maximize, as a stated rule.

A scalarization reads named metrics from a dict (a trial's result, a model's values) and
returns one float, higher is better, NaN when a metric it reads is missing or not finite. RL
learns from one (MnasNet's reward), and :class:`~retiarii.strategies.Scalarized` runs any
single-metric scheduler (median stopping, HyperTrick) on one.

Example:
    >>> reward = MnasNetReward("val_acc", "latency_ms", target=5.0)
    >>> round(reward({"val_acc": 0.8, "latency_ms": 10.0}), 4)   # 0.8 * 2 ** -0.07
    0.7621
    >>> WeightedSum({"val_acc": 1.0, "latency_ms": -0.01})({"val_acc": 0.8, "latency_ms": 10.0})
    0.7000000000000001

Framework-free: imports nothing of retiarii.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MnasNetReward", "WeightedSum", "scalarization_from_json"]


def _finite(values: dict, name: str) -> float | None:
    value = values.get(name)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass(frozen=True)
class MnasNetReward:
    """MnasNet's reward ``ACC(m) * (LAT(m) / target) ** w`` (Tan et al., CVPR 2019, Eq. 2):
    ``w = alpha`` when the latency meets the target, ``beta`` when it misses it.

    The defaults are the paper's soft constraint (``alpha = beta = -0.07``: a model twice as
    slow as the target needs about 5% more accuracy to be worth as much); ``alpha=0,
    beta=-1`` is its hard constraint (no reward for being faster than the target, a sharp
    penalty beyond it).

    Example:
        >>> hard = MnasNetReward("acc", "lat", target=2.0, alpha=0.0, beta=-1.0)
        >>> hard({"acc": 0.9, "lat": 1.0}), hard({"acc": 0.9, "lat": 4.0})
        (0.9, 0.45)

    Args:
        accuracy: the metric to maximize (``val_acc``).
        latency: the cost (``latency_ms``, or ``flops``, ``params``: any positive cost).
        target: the cost aimed at, > 0 (MnasNet: 75 ms on a Pixel phone).
        alpha, beta: the exponents below and above the target (<= 0).
    """

    accuracy: str
    latency: str
    target: float
    alpha: float = -0.07
    beta: float = -0.07

    def __post_init__(self):
        if not (isinstance(self.target, (int, float)) and math.isfinite(self.target)
                and self.target > 0):
            raise ValueError(f"MnasNetReward: target must be a positive number (the "
                             f"{self.latency} aimed at), got {self.target!r}")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value <= 0):
                raise ValueError(f"MnasNetReward: {name} must be a number <= 0 (the paper: "
                                 f"-0.07), got {value!r}")

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.accuracy, self.latency)

    def __call__(self, values: dict) -> float:
        acc, lat = _finite(values, self.accuracy), _finite(values, self.latency)
        if acc is None or lat is None or lat <= 0:
            return math.nan
        w = self.alpha if lat <= self.target else self.beta
        return acc * (lat / self.target) ** w

    def to_json(self) -> dict:
        return {"kind": "mnasnet", "accuracy": self.accuracy, "latency": self.latency,
                "target": self.target, "alpha": self.alpha, "beta": self.beta}


@dataclass(frozen=True)
class WeightedSum:
    """``sum(weight * metric)``, higher is better: give a cost a negative weight.

    Example:
        >>> round(WeightedSum({"acc": 1.0, "params": -1e-6})({"acc": 0.9, "params": 2e5}), 6)
        0.7
    """

    weights: dict

    def __post_init__(self):
        if not isinstance(self.weights, dict) or not self.weights or not all(
                isinstance(k, str) and isinstance(w, (int, float)) and math.isfinite(w)
                for k, w in self.weights.items()):
            raise ValueError(f"WeightedSum: give a dict metric -> finite weight (negative "
                             f"for a cost), got {self.weights!r}")

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def __call__(self, values: dict) -> float:
        total = 0.0
        for name, weight in self.weights.items():
            value = _finite(values, name)
            if value is None:
                return math.nan
            total += weight * value
        return total

    def __hash__(self):
        return hash(tuple(self.weights.items()))

    def to_json(self) -> dict:
        return {"kind": "weighted", "weights": dict(self.weights)}


def scalarization_from_json(data: Any) -> MnasNetReward | WeightedSum:
    """Inverse of ``to_json``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "mnasnet":
        return MnasNetReward(data["accuracy"], data["latency"], data["target"],
                             data["alpha"], data["beta"])
    if kind == "weighted":
        return WeightedSum(dict(data["weights"]))
    raise ValueError(f"not a saved scalarization: {data!r}")
