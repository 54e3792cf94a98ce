"""DARTS' derivation of a discrete cell from the mixed operations' weights (Liu et al., 2019).

In the relaxed cell every edge ``i -> j`` carries a softmax over its candidate operations,
one of which is ``none`` (the zero op). The discrete cell keeps, for each intermediate node,
its ``keep`` strongest incoming edges, an edge's strength being the weight of its strongest
operation other than ``none``, and gives each kept edge that operation; every other edge
becomes ``none``. DARTS keeps 2 edges per node in its convolutional cells and 1 in its
recurrent cell. The maths is plain numbers: the strategy hands in the probabilities.

Example::

    >>> rule = EdgeDerivation(nodes=(("n0", ("e0", "e1", "e2")),), keep=2)
    >>> probs = {"e0": [0.9, 0.1, 0.0], "e1": [0.2, 0.3, 0.5], "e2": [0.1, 0.6, 0.3]}
    >>> keys = {label: ["none", "conv", "pool"] for label in probs}
    >>> rule(probs, keys)     # e0's best non-none op weighs 0.1: dropped, although none wins
    {'e0': 0, 'e1': 2, 'e2': 1}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["EdgeDerivation", "DerivationError"]


class DerivationError(ValueError):
    """A derivation rule that does not fit the relaxed space it is applied to."""


@dataclass(frozen=True)
class EdgeDerivation:
    """Top-``keep`` incoming edges per node by strongest non-``none`` op weight.

    Args:
        nodes: ``(node, (edge label, ...))`` pairs: each intermediate node and the labels of
            its incoming edges, in input order (ties go to the earlier edge, as a stable sort).
        keep: edges kept per node (DARTS: 2 in a CNN cell, 1 in the recurrent cell).
        none: the candidate key of the zero operation.
    """

    nodes: tuple
    keep: int = 2
    none: str = "none"

    def edges(self) -> list[str]:
        return [label for _, labels in self.nodes for label in labels]

    def check(self, keys: dict[str, list]) -> None:
        """Raise :class:`DerivationError` when an edge label is missing from the relaxed space
        or lacks the ``none`` candidate or any other."""
        for node, labels in self.nodes:
            if len(labels) < self.keep:
                raise DerivationError(f"node {node!r} has {len(labels)} incoming edges, fewer "
                                      f"than the {self.keep} the derivation keeps")
            for label in labels:
                if label not in keys:
                    raise DerivationError(f"edge {label!r} of node {node!r} is not a label of "
                                          f"the relaxed space (its labels: {sorted(keys)[:6]}...)")
                if self.none not in keys[label] or len(keys[label]) < 2:
                    raise DerivationError(f"edge {label!r} must offer {self.none!r} and at "
                                          f"least one other operation; it offers {keys[label]}")

    def __call__(self, probs: dict[str, Sequence[float]],
                 keys: dict[str, list]) -> dict[str, int]:
        """label -> candidate index of the derived cell, for every edge label."""
        self.check(keys)
        out: dict[str, int] = {}
        for _, labels in self.nodes:
            best: dict[str, tuple[float, int]] = {}  # edge -> (strength, its best op)
            for label in labels:
                none = keys[label].index(self.none)
                weights = [float(w) for w in probs[label]]
                op = max((i for i in range(len(weights)) if i != none), key=lambda i: weights[i])
                best[label] = (weights[op], op)
                out[label] = none
            ranked = sorted(labels, key=lambda label: -best[label][0])  # stable: ties in order
            for label in ranked[:self.keep]:
                out[label] = best[label][1]
        return out
