"""One batch's shared forward in a grouped step: whose RNG streams the process holds, the group's
forward that every trial's proxy reads, and the proxies ``training_step`` gets.

:class:`~.training_group.TrainingGroup` runs each trial's ``training_step`` on a
:class:`Proxy`; the first proxy called runs the group's one forward (:class:`GroupForward`),
every part in its trial's RNG streams (:class:`Streams`, switched lazily), and every later one
reads its trial's output of it. A ``training_step`` that calls its model twice, with tensors
that are not the batch's, or with keywords, is refused by name (run that trainer ungrouped).

Example::

    forward = GroupForward(group_module, runs, batch, Streams(runs))
    loss = trainer.training_step(Proxy("a", runs["a"].model, forward), batch, hparams)
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..storage import checkpoint as ckpt
from ..trainers.trial_training import TrainingError, TrialRun

__all__ = ["GroupForward", "Proxy", "Streams", "tensors_of"]


class Streams:
    """Whose RNG streams the process holds during one grouped step, switched lazily.

    Alone, a trial draws from its own streams (``TrialRun._rng``, swapped in around its
    epoch). In a group, each trial's ``training_step`` and each of its model's cells that may
    draw (``Cell.random``) run in its streams, interleaved with the other trials'. Swapping in
    and back out around each of them costs four state copies (about 0.35 ms: NumPy's legacy
    state dominates); switching only when the owner changes costs two, and none while one
    trial goes on drawing. :meth:`release` saves the last owner's streams and puts back the
    ones the step started with. A trainer whose steps draw nothing
    (:meth:`~.trainer.Trainer.steps_draw_random`) has its steps run in whichever streams are
    held: then only the cells that may draw switch."""

    def __init__(self, runs: Mapping[str, Any], steps_draw: bool = True):
        self.runs = runs
        self.steps_draw = steps_draw
        self.current: str | None = None  # the trial whose streams the process holds (None:
        # the step's own, saved in ``outer`` while a trial's are held)
        self.outer: Any = None

    def use(self, trial: str | None) -> None:
        """Hold ``trial``'s streams; None, or a run without streams of its own (a layout's
        copy), holds the ones the step started with."""
        if trial is not None and getattr(self.runs[trial], "_rng", None) is None:
            trial = None
        if trial == self.current:
            return
        state = ckpt.native_rng()
        if self.current is None:
            self.outer = state
        else:
            self.runs[self.current]._rng = state
        ckpt.set_native_rng(self.outer if trial is None else self.runs[trial]._rng)
        self.current = trial

    @contextlib.contextmanager
    def held(self, trial: str):
        """``use(trial)`` for a block; on the way out nothing is switched back (lazily)."""
        self.use(trial)
        yield

    def step(self, trial: str | None) -> None:
        """Before ``trial``'s training or validation step (or back to it after the group's
        forward): its streams when the trainer's steps may draw; else nothing switches."""
        if self.steps_draw:
            self.use(trial)

    def release(self) -> None:
        """Save the last owner's streams and hold the ones the step started with."""
        self.use(None)


class GroupForward:
    """One batch's group forward, run on the first proxy call and read by every proxy."""

    def __init__(self, group: nn.Module, runs: Mapping[str, TrialRun], batch: Any,
                 streams: Streams, ahead: Any = None):
        self.group, self.runs, self.streams = group, runs, streams
        self.ahead = ahead  # inputs -> the shared part's outputs computed ahead, or None
        self.batch_tensors = {id(t) for t in tensors_of(batch)}
        self.active: str | None = None  # the trial whose training_step runs now
        self.inputs: tuple | None = None
        self.outs: dict[str, Any] = {}
        self.errors: dict[str, Exception] = {}
        self.calls: dict[str, int] = {}

    def output(self, trial: str, inputs: tuple) -> Any:
        self.calls[trial] = self.calls.get(trial, 0) + 1
        if self.calls[trial] > 1:
            raise TrainingError(f"trial {trial}: training_step called the model twice on one "
                                "batch; a grouped job runs each model once per batch (run "
                                "this trainer ungrouped)")
        if self.inputs is None:
            if not all(id(a) in self.batch_tensors for a in inputs if isinstance(a, torch.Tensor)):
                raise TrainingError(f"trial {trial}: training_step called the model with "
                                    "tensors that are not the batch's; a grouped job shares "
                                    "one forward per batch (run this trainer ungrouped)")
            self.inputs = inputs
            common = self.ahead(inputs) if self.ahead is not None else None
            extra = {} if common is None else {"common": common}  # computed ahead: dedicated.py
            try:
                self.outs = self.group(*inputs, rng={t: (lambda t=t: self.streams.held(t))
                                                     for t in self.runs},
                                       errors=self.errors, **extra)
            finally:  # back to the streams of the trial whose training_step called it
                self.streams.step(self.active)
        elif len(inputs) != len(self.inputs) or any(a is not b for a, b in zip(inputs, self.inputs)):
            raise TrainingError(f"trial {trial}: training_step called the model with other "
                                "inputs than the group's other trials on the same batch")
        if trial in self.errors:
            raise self.errors[trial]
        return self.outs[trial]


class Proxy(nn.Module):
    """What ``training_step`` gets for one trial: ``proxy(x)`` is that trial's output of the
    group's forward on ``x`` (the batch's own tensors); parameters are its model's."""

    def __init__(self, trial: str, model: nn.Module, forward: GroupForward):
        super().__init__()
        self.__dict__.update(_trial=trial, _model=model, _forward=forward)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TrainingError(f"trial {self._trial}: a grouped job passes the model its batch "
                                f"positionally; training_step gave keywords {sorted(kwargs)}")
        return self._forward.output(self._trial, inputs)

    def parameters(self, recurse: bool = True):
        return self._model.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self._model.named_parameters(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_model"], name)


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch (nested lists, tuples and dicts), in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in tensors_of(b)]
    if isinstance(batch, dict):
        return [t for b in batch.values() for t in tensors_of(b)]
    return []
