"""Grid search: every model of a finite space once, in the space's enumeration order."""
from __future__ import annotations

import itertools
import math
from typing import Any

from .base import Draw, SpaceExhausted, Strategy


class GridSearch(Strategy):
    """Proposes the models of ``space.enumerate()`` one after the other, each exactly once.

    The order is the space's (deterministic) enumeration order, so ``seed`` changes nothing; it
    is accepted so that every strategy is built the same way. Once every model was proposed,
    ``ask`` raises :class:`~retiarii.strategies.SpaceExhausted`. An unbounded space
    (``space.size()`` is ``math.inf``) is refused on the first ``ask`` (or ``check``), before
    anything runs. Results do not steer a grid; ``tell`` only completes the bookkeeping.

    Example:
        >>> from retiarii.strategies import GridSearch
        >>> class Space:
        ...     ops = ["conv", "pool"]
        ...     class Model:
        ...         def __init__(self, sample): self.sample = sample
        ...     def sample(self, sampler):
        ...         return self.Model({"op": self.ops[sampler.choose("op", self.ops, {})]})
        ...     def enumerate(self):
        ...         return (self.Model({"op": op}) for op in self.ops)
        ...     def size(self):
        ...         return 2
        >>> s = GridSearch()
        >>> [s.ask(Space()), s.ask(Space())]
        [{'op': 'conv'}, {'op': 'pool'}]

    Args:
        seed: accepted for a uniform interface; the grid order does not depend on it.
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    # The grid never repeats itself, so no random fallback: a repeat (a model the strategy
    # was told about before a restore, say) is simply skipped.
    max_duplicate_tries = None
    multi_objective = True  # it never reads the values: any number of objectives

    def __init__(self, *, seed: int | None = None, **common: Any):
        super().__init__(seed=seed, **common)
        self._cursor = 0  # how many models of the enumeration were consumed
        self._models = None  # live iterator over space.enumerate(), positioned at _cursor
        self._models_of: int | None = None  # id of the space that iterator walks

    def check(self, space: Any) -> None:
        super().check(space)
        size = self._space_size(space)
        if size == math.inf or not callable(getattr(space, "enumerate", None)):
            raise ValueError(
                f"GridSearch needs a finite space it can enumerate, but this "
                f"{type(space).__name__} is unbounded (size() is {size}); use Random, "
                f"RegularizedEvolution, PolicyBasedRL or TPE, or bound the space")

    def _propose(self, space: Any) -> Draw:
        if self._models is None or self._models_of != id(space):
            # A fresh (or restored) grid: start the enumeration again and skip what was used.
            self._models = itertools.islice(space.enumerate(), self._cursor, None)
            self._models_of = id(space)
        model = next(self._models, None)
        if model is None:
            raise SpaceExhausted(f"GridSearch: all {self._cursor} models of the space were "
                                 f"proposed")
        self._cursor += 1
        return Draw(dict(model.sample), None)

    def _state(self) -> dict:
        return {"cursor": self._cursor}

    def _load_state(self, state: dict) -> None:
        self._cursor = state["cursor"]
        self._models = None
