"""WANN's search (Gaier & Ha, NeurIPS 2019): evolution from minimal networks, parents chosen by
tournament over WANN's ranking of mean performance, max performance and connections.

A :class:`~retiarii.strategies.RegularizedEvolution` with ``initial="base"`` (the population
grows from the minimal network) whose tournament ranks by
:func:`retiarii.weight_agnostic.wann_order`: each tournament draws whether it ranks by
(mean, connections), with probability 0.8, or by (mean, max). It needs the three objectives,
in this order: ``Experiment(metric=["val_acc", "connections", "val_acc_max"], mode=["max",
"min", "max"])`` with :class:`~retiarii.weight_agnostic.WANNTrainer`'s metrics.
"""
from __future__ import annotations

from typing import Any

from ...enums import Mode
from ...weight_agnostic import P_CONNECTIONS, wann_order
from .base import Draw
from .evolution import RegularizedEvolution

__all__ = ["WANN"]

_MODES = (Mode.MAX, Mode.MIN, Mode.MAX)


class WANN(RegularizedEvolution):
    """Regularized evolution with WANN's ranking (see the module docstring).

    Args:
        population_size, sample_size, seed, ...: see RegularizedEvolution (``initial`` is
            ``"base"``: WANN starts from minimal networks).
    """

    def __init__(self, population_size: int = 20, sample_size: int = 5, *,
                 seed: int | None = None, **common: Any):
        common.pop("initial", None)
        super().__init__(population_size, sample_size, initial="base", seed=seed, **common)

    def use_objectives(self, modes, names=None):
        modes = tuple(Mode.parse(m, "WANN") for m in modes)
        if modes != _MODES:
            raise ValueError("WANN ranks by mean accuracy, connections and max accuracy: run it "
                             "with metric=['val_acc', 'connections', 'val_acc_max'], "
                             "mode=['max', 'min', 'max'] (WANNTrainer's metrics)")
        super().use_objectives(modes, names)

    def _propose(self, space: Any) -> Draw:
        if self.objectives is None:
            raise ValueError("WANN needs its three objectives: metric=['val_acc', "
                             "'connections', 'val_acc_max'], mode=['max', 'min', 'max']")
        if len(self._population) < self.population_size:
            return self._from_base(space)
        # WANN ranks the whole population, then a tournament takes the best-ranked contestant
        population = list(self._population)
        by_connections = self._rng.random() < P_CONNECTIONS
        # Scored points are minimized: (-mean, connections, -max)
        scores = [(-s.point[0], -s.point[2], s.point[1]) for _, s in population]
        position = {population[i][0]: r for r, i in enumerate(wann_order(scores, by_connections))}
        contestants = self._rng.sample(population, self.sample_size)
        parent = min(contestants, key=lambda member: position[member[0]])[0]
        return self._mutate(space, parent)
