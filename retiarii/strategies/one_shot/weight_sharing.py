"""Weight sharing for any multi-trial strategy: each model the strategy asks for trains a few
batches on a super-graph and is told its validation metric with the inherited weights (the
paper's §5.1 "Super-Graph for Weight Sharing", with SPOS's one batch per model)."""
from __future__ import annotations

import json
from typing import Any

import torch

from ...enums import Mode
from ...sampler import sample_key
from ..multi_trial.base import SpaceExhausted, Strategy
from .base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .shared_training import (ExportsInherited, SharedTraining, check_positive, check_shared,
                              check_state, ready, take)


class WeightSharing(ExportsInherited, OneShot):
    """A multi-trial strategy (``ask``/``tell``) run as a one-shot search on shared weights.

    Every ``batches_per_model`` training batches, the inner strategy is asked for a model; its
    path of the super-graph trains on those batches (trainer's loss and optimizer, weights
    handed on to the next model with no checkpoint in between), then ``metric`` over the first
    ``eval_batches`` validation batches (the same batches for every model, so values compare)
    is told to the strategy. Each told model is an :class:`EvaluatedModel` of the segment.
    When the strategy has nothing left to propose (:class:`~retiarii.strategies.SpaceExhausted`,
    its ``max_models`` or ``max_time``), the search is over: the segment ends there and later
    segments do nothing. A strategy with ``dedup=True`` (the default) stops after every model
    of the space was proposed once; pass ``dedup=False`` to let it revisit models while the
    shared weights train.

    :meth:`selected` is the told model whose latest value is best (a model told several times
    is judged on its last value, measured on the most trained weights); before any tell, the
    space's default sample.

    This is what ``Experiment(..., weight_sharing=True)`` runs a multi-trial strategy with.

    Example (``space`` a ModelSpace, ``trainer`` a Trainer)::

        s = WeightSharing(Random(seed=0, dedup=False), batches_per_model=1, segments=5)
        s.setup(space, trainer, {}, torch.device("cpu"))
        for seg in range(s.num_segments()):
            s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
        model = space.build(s.selected())

    Args:
        strategy: a multi-trial :class:`~retiarii.strategies.Strategy` (Random,
            RegularizedEvolution, TPE, PolicyBasedRL, ...); its ``mode`` says which way
            ``metric`` is better.
        batches_per_model: training batches per asked model (SPOS: 1).
        eval_batches: validation batches per told value (``None``: the whole loader).
        segments: segments (epochs) of the search; ``None``: the trainer's epochs under the
            hparams given to :meth:`setup`.
        metric: the validation metric told to the strategy.
        seed: seeds the shared weights and the training's RNG streams (the strategy has its
            own seed).
        shared: annotate which operators share weights, as ``fnmatch`` patterns of their
            module paths (``["stem", "cells.*"]``); the others are private to each
            architecture. None (default): every operator shares weights
            (``Experiment(weight_sharing=[...])`` passes its patterns here).
    """

    def __init__(self, strategy: Strategy, batches_per_model: int = 1,
                 eval_batches: int | None = 1, *, segments: int | None = None,
                 metric: str = "val_acc", seed: int = 0, shared: list[str] | None = None):
        if getattr(strategy, "one_shot", False):
            raise TypeError(f"WeightSharing wraps a multi-trial strategy; "
                            f"{type(strategy).__name__} is already one-shot: run it directly")
        if not (callable(getattr(strategy, "ask", None)) and callable(getattr(strategy, "tell",
                                                                                None))):
            raise TypeError(f"WeightSharing wraps a multi-trial strategy with ask/tell (e.g. "
                            f"Random(dedup=False)); got {type(strategy).__name__}")
        check_positive("WeightSharing", batches_per_model=batches_per_model)
        if eval_batches is not None:
            check_positive("WeightSharing", eval_batches=eval_batches)
        if segments is not None:
            check_positive("WeightSharing", segments=segments)
        if not isinstance(seed, int):
            raise ValueError(f"WeightSharing: seed must be an int, got {seed!r}")
        self.strategy = strategy
        self.batches_per_model = batches_per_model
        self.eval_batches = eval_batches
        self.segments = segments
        self.metric = metric
        self.seed = seed
        self.shared = check_shared("WeightSharing", shared)
        self._shared: SharedTraining | None = None
        self._space: Any = None
        self._num_segments: int | None = segments
        self._exhausted = False
        self._latest: dict[str, tuple[dict, float]] = {}  # key -> (sample, latest value)

    def config(self) -> dict:
        """The constructor's keyword arguments, as JSON: the inner strategy as the nested
        ``{"class": ref, "config": ...}`` spec that the engine's workers rebuild it from (its
        ``config()`` plus its ``seed``, which multi-trial configs leave to the saved state)."""
        from ...refs import ref_of

        inner = _plain(self.strategy.config())
        if "seed" not in inner and hasattr(self.strategy, "seed"):
            inner["seed"] = self.strategy.seed
        return {"strategy": {"class": ref_of(type(self.strategy)), "config": inner},
                "batches_per_model": self.batches_per_model, "eval_batches": self.eval_batches,
                "segments": self.segments, "metric": self.metric, "seed": self.seed,
                "shared": self.shared}

    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        self._space = space
        if self.segments is None:
            self._num_segments = int(trainer.num_epochs(hparams))
        self._shared = SharedTraining(space, trainer, hparams, device, self.seed,
                                      shared=self.shared)
        self._exhausted, self._latest = False, {}

    def num_segments(self) -> int:
        if self._num_segments is None:
            raise RuntimeError("WeightSharing(segments=None) takes the trainer's epochs: call "
                               "setup(space, trainer, hparams, device) first, or pass segments=")
        return self._num_segments

    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        shared = ready(self, self._shared, ctx)
        if ctx.world > 1:
            raise ValueError("WeightSharing runs on one rank: its strategy decides models one "
                             "at a time from each told value; use SPOS or ENAS for mixed "
                             "parallelism")
        valid = take(ctx.valid_batches(), self.eval_batches)
        models: list[EvaluatedModel] = []
        losses: list[float] = []
        with shared.own_rng():
            batches = iter(ctx.train_batches())
            while not self._exhausted and not ctx.should_stop():
                group = take(batches, self.batches_per_model)
                if not group:
                    break
                try:
                    sample = self.strategy.ask(self._space)
                except SpaceExhausted:
                    self._exhausted = True
                    break
                model_losses = [shared.train(sample, batch, ctx) for batch in group]
                metrics = shared.evaluate(sample, valid)
                if self.metric not in metrics:
                    raise KeyError(f"WeightSharing tells {self.metric!r} but the trainer's "
                                   f"validation_step returned {sorted(metrics)}; pass metric= "
                                   f"one of those")
                self.strategy.tell(sample, metrics[self.metric])
                self._latest[sample_key(sample)] = (dict(sample), metrics[self.metric])
                losses += model_losses
                models.append(EvaluatedModel(dict(sample), {
                    **metrics, "train_loss": sum(model_losses) / len(model_losses),
                    "train_batches": len(group)}))
            shared.end_segment()
        return SegmentResult({"train_loss": sum(losses) / max(len(losses), 1),
                              "models": len(models), "exhausted": int(self._exhausted)}, models)

    def selected(self) -> dict:
        if self._latest:
            sign = Mode(self.strategy.mode).sign
            sample, _ = max(self._latest.values(), key=lambda sv: sign * sv[1])
            return dict(sample)
        if self._space is None:
            raise RuntimeError("WeightSharing.selected(): call setup(space, ...) first")
        return self._space.default_sample()

    def state_dict(self) -> dict:
        if self._shared is None:
            raise RuntimeError("WeightSharing.state_dict(): call setup(space, ...) first")
        return {"strategy": "WeightSharing", "config": self.config(),
                "shared": self._shared.state_dict(),
                "inner": _plain(self.strategy.state_dict()),
                "latest": [[s, v] for s, v in self._latest.values()],
                "exhausted": self._exhausted}

    def load_state_dict(self, state: dict) -> None:
        if self._shared is None:
            raise RuntimeError("WeightSharing.load_state_dict(): call setup(space, ...) first, "
                               "then load the state")
        check_state("WeightSharing", state, self.config())
        self._shared.load_state_dict(state["shared"])
        self.strategy.load_state_dict(state["inner"])
        self._latest = {sample_key(s): (dict(s), v) for s, v in state["latest"]}
        self._exhausted = bool(state["exhausted"])


def _plain(state: dict) -> dict:
    """A multi-trial strategy's JSON state as plain JSON types (its ``mode`` is a string enum):
    the engine loads a unit with ``torch.load(weights_only=True)``, which rebuilds no enum."""
    return json.loads(json.dumps(state))
