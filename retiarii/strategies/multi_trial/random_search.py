"""Random search: every choice uniformly at random, conditional choices included."""
from __future__ import annotations

from typing import Any

from .base import Draw, Strategy


class Random(Strategy):
    """Picks each choice uniformly among its candidates, independently, as the space reaches it.

    Over a space without conditional choices this is uniform over models. With conditional
    choices it is uniform per choice (a branch with more models beneath it is not favoured),
    which is what the NAS literature calls random search. With ``dedup=True`` (default) a
    repeat is redrawn, so the search samples without replacement and ends with
    :class:`~retiarii.strategies.SpaceExhausted` once every model was proposed.

    Example:
        >>> from retiarii.strategies import Random
        >>> class Space:
        ...     def sample(self, sampler):
        ...         ops = ["conv3x3", "conv5x5", "maxpool"]
        ...         op = ops[sampler.choose("op", ops, {})]
        ...         return type("Model", (), {"sample": {"op": op}})()
        ...     def size(self):
        ...         return 3
        >>> s = Random(seed=1)
        >>> sorted(s.ask(Space())["op"] for _ in range(3))
        ['conv3x3', 'conv5x5', 'maxpool']

    Args:
        seed: seeds the generator (equal seeds, equal searches in any process).
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    multi_objective = True  # it never reads the values: any number of objectives

    def __init__(self, *, seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)

    def _propose(self, space: Any) -> Draw:
        return self._random_draw(space)
