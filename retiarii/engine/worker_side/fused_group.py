"""Fused grouped jobs: trials of one grouped job with one architecture train as one fused model.

A :class:`FusedGroup` is a :class:`~.grouped.TrainingGroup` (one loader pass per epoch, each
trial's ``training_step`` on a proxy, each trial's end of epoch, validation, RNG streams and
checkpoint) whose module is :func:`~retiarii.optim.fuse_models` over the trials' models and
whose optimizer step is one :class:`~retiarii.optim.FusedOptimizer` over theirs::

    for batch in trainer.train_dataloader(hparams, epoch):       # once for every model
        out = fused(x, rng=[ctx_t ...])                          # (K, B, ...): out[k] is trial k's
        loss[t] = trainer.training_step(proxy[t], batch, hp[t])  #   in t's RNG streams
        sum(loss.values()).backward()                            # slice k gets loss k's gradient
        fused_optimizer.step()                                   # each trial's own settings
        scheduler[t].step() ...                                  # drives its proxy's lr

The models' tensors are views of the stacked ones, so each run's ``state_dict()`` (its
checkpoint) has the layout of training alone; values equal training alone within the fused
kernels' rounding (docs/optimization.md, "Fused training of same-shape models"). A trial that
fails leaves alone: :func:`~retiarii.optim.unfuse` copies its tensors and optimizer state into
storage of its own, and the others are fused again (their current values restacked), in the
middle of an epoch if need be. One left is trained by its own optimizer.

Which trials fuse is the worker's decision (:func:`fusable_sets`): equal
:func:`~retiarii.optim.fusion_family` (one architecture up to its activations and the places
where its models hold other operators, each model's own there) within one group
of :func:`~.group_candidates.group_tasks` (one space, trainer, data key and position); building the
group then checks the modules and the optimizers (``FusionError``: those trials train as a
CSE-grouped :class:`~.grouped.TrainingGroup` instead). A frozen part of identical
architectures is identical too; it is fused like the rest (computed K times in one kernel,
where CSE computes it once).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ...optim import FusedOptimizer, fuse_models, fusion_family, fusion_key, unfuse
from .training_group import TrainingGroup
from ..jobs.reports import UnitReport
from ..trainers.trial_training import TrialRun

__all__ = ["FusedGroup", "fusable_sets", "fused_backward", "fused_step", "fused_unit"]


def fusable_sets(models: Mapping[str, Any], excluded: Iterable[str] = (),
                 places: bool = True) -> list[tuple[str, ...]]:
    """The trials that may train fused: two or more with an equal :func:`fusion_family`
    (one architecture, or architectures differing in their activations or, with ``places``,
    at places), in input order; ``excluded`` trials (fusion reverted for them) never fuse.

    Example::

        fusable_sets({"a": m1, "b": m1_other_seed, "c": m1_gelu, "d": m2})   # [("a", "b", "c")]
    """
    out: dict[str, list[str]] = {}
    skip = set(excluded)
    family: dict[str, str] = {}  # one architecture, one family (whatever its history)
    for trial, model in models.items():
        if trial not in skip:
            key = family.setdefault(fusion_key(model), fusion_family(model, places))
            out.setdefault(key, []).append(trial)
    return [tuple(ids) for ids in out.values() if len(ids) > 1]


class _Fused(nn.Module):
    """A fused model in the interface of a :class:`~retiarii.optim.GroupModule`:
    ``module(*inputs, rng={trial: ctx}, errors={})`` -> {trial: its output}. The fused
    forward is one computation: an error in it is every trial's."""

    def __init__(self, fused: nn.Module, trials: list[str]):
        super().__init__()
        self.fused, self.order = fused, trials

    def forward(self, *inputs: Any, rng: Mapping, errors: dict) -> dict[str, Any]:
        try:
            out = self.fused(*inputs, rng=[rng[t] for t in self.order])  # (K, B, ...)
        except Exception as err:  # noqa: BLE001 (not attributable: every trial's)
            errors.update({t: err for t in self.order})
            return {}
        return {t: out[k] for k, t in enumerate(self.order)}


class _One(nn.Module):
    """The last trial of a fused group, unfused: its model in its own streams."""

    def __init__(self, trial: str, model: nn.Module):
        super().__init__()
        self.trial, self.model = trial, model

    def forward(self, *inputs: Any, rng: Mapping, errors: dict) -> dict[str, Any]:
        try:
            with rng[self.trial]():
                return {self.trial: self.model(*inputs)}
        except Exception as err:  # noqa: BLE001 (fails this trial only)
            errors[self.trial] = err
            return {}


class FusedGroup(TrainingGroup):
    """Trial runs of one architecture, trainer and data key, trained one epoch at a time as
    one fused model (see the module docstring).

    Example::

        group = FusedGroup({t: runs[t] for t in ids}, trainer)   # FusionError: not fusable
        outcome = group.train_epoch()   # {trial: metrics, or the exception that failed it}

    Args:
        runs: trial id -> its :class:`TrialRun`, two or more, all at the same (epoch, batch),
            their models of one architecture on one device.
        trainer: the trainer every run shares.
        profile: as for :class:`~.grouped.TrainingGroup`.
    """

    def __init__(self, runs: Mapping[str, TrialRun], trainer: Any,
                 profile: Iterable[str] | None = None):
        self._fopt: FusedOptimizer | None = None
        super().__init__(None, runs, trainer, profile)

    def report(self) -> UnitReport:
        """:meth:`TrainingGroup.report`, ``fused``: the times are the fused unit's."""
        return dataclasses.replace(super().report(), fused=True)

    def drop(self, trials: Iterable[str]) -> None:
        """Leave ``trials`` out from now on: each gets storage of its own (:func:`unfuse`),
        the others are fused again."""
        gone = set(trials) & set(self.runs)
        for t in gone:
            unfuse(self.runs[t].model, self.runs[t].optimizer)
        super().drop(gone)

    def _build(self) -> nn.Module:
        module, self._fopt = fused_unit(self.runs)
        return module

    def _optimize(self, losses: Mapping[str, torch.Tensor]) -> dict[str, Exception]:
        """Backward over the sum of ``losses``, one fused step of every model, then each
        trial's per-step LR scheduler (:func:`fused_backward`, :func:`fused_step`). A trial
        without a loss in this step (its ``training_step`` failed) leaves the group right
        after it."""
        if self._fopt is None:
            return super()._optimize(losses)
        fused_backward(self._fopt, losses)
        return fused_step(self._fopt, self.runs, losses)


def fused_unit(runs: Mapping[str, TrialRun]) -> tuple[nn.Module, FusedOptimizer | None]:
    """The module training ``runs`` as one fused model (``module(*inputs, rng=, errors=)``,
    the interface of a :class:`~retiarii.optim.GroupModule`) and its
    :class:`~retiarii.optim.FusedOptimizer`; one run: its model alone (its storage its own
    again) and None.

    Raises:
        FusionError: not fusable after all (every model and optimizer then has storage of
            its own again: :func:`~retiarii.optim.fuse_models` may have stacked some layers
            before the one it refused).
    """
    if len(runs) == 1:
        (trial, run), = runs.items()
        unfuse(run.model, run.optimizer)
        return _One(trial, run.model), None
    try:
        fused = fuse_models([run.model for run in runs.values()])
        fopt = FusedOptimizer(fused, [run.optimizer for run in runs.values()])
    except Exception:
        for run in runs.values():
            unfuse(run.model, run.optimizer)
        raise
    return _Fused(fused, list(runs)), fopt


def fused_backward(fopt: FusedOptimizer, losses: Mapping[str, torch.Tensor]) -> None:
    """Backward over the sum of ``losses`` into the stacked parameters (nothing is stepped);
    the gradients a ``training_step`` gave the models' own parameters outside their forward
    (a weight penalty) are added to their slices (:meth:`~retiarii.optim.FusedOptimizer.
    fold_grads`), as training each model alone sums them."""
    fopt.zero_grad()
    if losses:
        # Model k's output depends only on slice k: loss k alone gives slice k its gradient.
        sum(losses.values()).backward()
    fopt.fold_grads()


def fused_step(fopt: FusedOptimizer, runs: Mapping[str, TrialRun],
               losses: Mapping[str, torch.Tensor]) -> dict[str, Exception]:
    """One fused optimizer step of every model (after :func:`fused_backward`), then the
    per-step LR scheduler of each trial with a loss; the trials whose scheduler failed."""
    fopt.step()
    failed: dict[str, Exception] = {}
    for trial in losses:
        run = runs[trial]
        try:
            if run.scheduler is not None and run.interval == "step":
                run.scheduler.step()
        except Exception as err:  # noqa: BLE001 (fails this trial only)
            failed[trial] = err
    return failed
