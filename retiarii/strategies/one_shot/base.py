"""The one-shot (weight-sharing) strategy interface: what the engine hosts, segment by segment.

A multi-trial strategy (:mod:`retiarii.strategies.multi_trial.base`) proposes models that the engine trains
one trial each. A **one-shot** strategy trains many models at once on shared weights (a
super-graph, :mod:`retiarii.optim.supergraph`, or a continuous relaxation of the space,
:mod:`retiarii.optim.relax`) and finally selects one architecture. The engine cannot see inside
that loop, so it hosts the strategy instead: it builds it in a worker, runs it one **segment**
(an epoch) at a time, checkpoints its whole state (shared weights, optimizers, architecture
parameters, controller, RNG, position) as one unit after each segment, records in the store the
models the segment evaluated (sample and metrics), and on resume loads the last unit and goes
on. Nothing else of the engine changes: the same trainer gives the data, the loss and the
metrics.

A one-shot strategy subclasses :class:`OneShot` and fills in:

* ``setup(space, trainer, hparams, device)``: build the shared weights and optimizers;
* ``run_segment(ctx) -> SegmentResult``: train (and evaluate) for segment ``ctx.segment``;
* ``state_dict()`` / ``load_state_dict(state)``: everything needed to continue bit for bit
  (tensors allowed; the engine saves it with ``torch.save``);
* ``selected() -> dict``: the sample of the architecture it picks now (a key of
  ``space.replay``), exportable like any model.

Example (by hand, without an engine)::

    s = rt.strategies.DARTS(epochs=10)
    s.setup(space, trainer, {}, torch.device("cpu"))
    for seg in range(s.num_segments()):
        result = s.run_segment(SegmentContext(seg, trainer, {}, torch.device("cpu")))
    best = space.build(s.selected())
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

__all__ = ["EvaluatedModel", "OneShot", "SegmentContext", "SegmentResult"]


@dataclass
class SegmentContext:
    """What a segment of a one-shot strategy gets from the engine.

    ``train``/``valid`` default to the trainer's loaders (``trainer.train_dataloader(hparams,
    segment)`` and ``trainer.val_dataloader(hparams)``); a mixed-parallel job hands each rank
    its own share. ``rank``/``world`` and ``group`` (a ``torch.distributed`` process group or
    None) are set when the segment runs on several ranks (see
    :mod:`retiarii.optim.mixed_parallel`); on one process they are 0, 1 and None.
    """

    segment: int
    trainer: Any  # retiarii.Trainer
    hparams: dict
    device: torch.device
    train: Iterable | None = None
    valid: Iterable | None = None
    arch: Iterable | None = None  # architecture-step batches (None: see arch_batches)
    rank: int = 0
    world: int = 1
    group: Any = None
    should_stop: Callable[[], bool] = lambda: False  # the engine asks to stop early (cancel)
    # bytes of a device the shared weights may take (None: no limit); a strategy that supports
    # it splits a larger super-graph over the ranks (retiarii.optim.split)
    device_memory: float | None = None

    def train_batches(self) -> Iterable:
        data = self.train if self.train is not None else \
            self.trainer.train_dataloader(self.hparams, self.segment)
        return data

    def valid_batches(self) -> Iterable:
        return self.valid if self.valid is not None else self.trainer.val_dataloader(self.hparams)

    def arch_batches(self) -> Iterable:
        """Batches for architecture steps: ``arch`` when given, else the trainer's
        ``arch_dataloader(hparams, segment)`` where it has one (a part of the training data
        kept apart from the reported validation split: :mod:`retiarii.arch_split`), else the
        validation batches."""
        if self.arch is not None:
            return self.arch
        loader = getattr(self.trainer, "arch_dataloader", None)
        return loader(self.hparams, self.segment) if loader is not None else self.valid_batches()


@dataclass
class EvaluatedModel:
    """A model a segment trained or evaluated on the shared weights: a model of the store."""

    sample: dict
    metrics: dict  # numbers, e.g. {"val_acc": 0.91, "train_batches": 1}


@dataclass
class SegmentResult:
    """The outcome of one segment: the strategy's own metrics (supernet loss, architecture
    entropy, ...) and the models it evaluated, in order."""

    metrics: dict = field(default_factory=dict)
    models: list[EvaluatedModel] = field(default_factory=list)


class OneShot(abc.ABC):
    """Base class of one-shot strategies; see the module docstring."""

    one_shot = True
    metric = "val_acc"  # the validation metric that ranks architectures (higher is better)

    @abc.abstractmethod
    def setup(self, space: Any, trainer: Any, hparams: dict, device: torch.device) -> None:
        """Build the shared weights, architecture parameters and optimizers for ``space``."""

    @abc.abstractmethod
    def num_segments(self) -> int:
        """How many segments (epochs) the whole search takes."""

    @abc.abstractmethod
    def run_segment(self, ctx: SegmentContext) -> SegmentResult:
        """Train (and evaluate) for one segment."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to continue exactly (tensors allowed)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after :meth:`setup`)."""

    @abc.abstractmethod
    def selected(self) -> dict:
        """The sample of the architecture this strategy picks now."""

    def config(self) -> dict:
        """The constructor arguments, as JSON (the engine stores them to rebuild the strategy
        in a worker and on resume). By default the public attributes set in ``__init__``."""
        plain = (int, float, str, bool, type(None))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()
                if not k.startswith("_") and (isinstance(v, plain) or (
                    isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v)))}
