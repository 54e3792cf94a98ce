"""Retraining a selected architecture: its choices fixed, every combination of the choices it
leaves open (the trainer's hyper-parameters) proposed once (or ``repeats`` times: independent
runs), in enumeration order."""
from __future__ import annotations

from typing import Any, Iterator

from ...sampler import PrefixSampler, ReplaySampler, SampleError, walk_choices
from .base import Draw, SpaceExhausted, Strategy


class _FixedView:
    """``space`` with the choices of ``fixed`` decided: what is left is enumerated."""

    def __init__(self, space: Any, fixed: dict):
        self.space, self.fixed = space, fixed

    def _run(self, prefix: list[int]) -> tuple[Any, list[int]]:
        free = PrefixSampler(prefix)
        model = self.space.sample(ReplaySampler(self.fixed, fallback=free))
        return model, free.arity

    def enumerate(self, repeats: int = 1) -> Iterator[Any]:
        for model in walk_choices(self._run):
            for _ in range(repeats):
                yield model


class FixedArchitecture(Strategy):
    """Proposes one architecture, with each combination of the choices ``sample`` leaves
    open: how a selected architecture is retrained from scratch (``retiarii retrain``), its
    trainer hyper-parameters searched (a one-shot search held them at their defaults).

    Example:
        >>> import torch, retiarii as rt
        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = rt.nn.Linear(4, rt.ValueChoice([8, 16], label="width"))
        ...     def forward(self, x):
        ...         return self.fc(x)
        >>> space = rt.ModelSpace(Net(), example_input=torch.zeros(1, 4)).with_hparams(
        ...     {"lr": rt.ValueChoice([0.01, 0.1], label="lr")})
        >>> s = rt.strategies.FixedArchitecture({"width": 16})
        >>> s.ask(space), s.ask(space)
        ({'width': 16, 'lr': 0.01}, {'width': 16, 'lr': 0.1})

    ``repeats=R`` proposes each combination R times in a row: R independent runs of the
    same training, told apart by their trial seeds (the experiment's seed, then + 1, ...:
    the initial weights and the model's own random draws, as dropout; the data order is the
    trainer's, its ``seed``), as papers report a retrained
    architecture's mean and spread over runs. Each run is a model of its own, so the
    experiment must not skip repeated structures: ``Experiment(..., dedup=False)``.

    Args:
        sample: label -> chosen key of the architecture (a stored model's ``sample``, or the
            ``.json`` that ``retiarii export`` writes, its ``"sample"``). Labels the space
            never asks for are refused on the first ``ask``.
        repeats: runs of each combination (default 1).
        seed, mode, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.

    Raises:
        TypeError: ``sample`` is not a dict of labels.
        ValueError: ``repeats`` is not a positive int.
    """

    max_duplicate_tries = None  # an enumeration never repeats itself (but by ``repeats``)

    def __init__(self, sample: dict, *, repeats: int = 1, seed: int | None = None,
                 **common: Any):
        if not isinstance(sample, dict) or not all(isinstance(k, str) for k in sample):
            raise TypeError(f"FixedArchitecture needs a sample (a dict of label -> chosen key), "
                            f"got {sample!r}")
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"FixedArchitecture: repeats is the number of runs of each "
                             f"training (1 or more), got {repeats!r}")
        if repeats > 1:  # the repeats are the point: the strategy proposes them all
            if common.get("dedup"):
                raise ValueError(f"FixedArchitecture(repeats={repeats}) proposes one sample "
                                 f"{repeats} times, which dedup=True refuses: leave dedup out")
            common["dedup"] = False
        super().__init__(seed=seed, **common)
        self.sample, self.repeats = dict(sample), repeats
        self._cursor = 0
        self._models: Iterator[Any] | None = None
        self._models_of: int | None = None

    def check(self, space: Any) -> None:
        super().check(space)
        replay = ReplaySampler(self.sample, fallback=PrefixSampler([]))
        space.sample(replay)
        unknown = sorted(set(self.sample) - replay.used - {"base"})
        if unknown:
            raise SampleError(f"FixedArchitecture: the sample has labels this space never asks "
                              f"for: {unknown}; is it a model of this space?")

    def _propose(self, space: Any) -> Draw:
        if self._models is None or self._models_of != id(space):
            view = _FixedView(space, self.sample)
            self._models = view.enumerate(self.repeats)
            for _ in range(self._cursor):  # a restored strategy skips what it proposed
                next(self._models, None)
            self._models_of = id(space)
        model = next(self._models, None)
        if model is None:
            raise SpaceExhausted(f"FixedArchitecture: all {self._cursor} trainings of the "
                                 f"architecture were proposed")
        self._cursor += 1
        return Draw(dict(model.sample), None)

    def config(self) -> dict:
        return {**super().config(), "sample": self.sample,
                **({"repeats": self.repeats} if self.repeats > 1 else {})}

    def _state(self) -> dict:
        return {"cursor": self._cursor}

    def _load_state(self, state: dict) -> None:
        self._cursor = state["cursor"]
        self._models = None
