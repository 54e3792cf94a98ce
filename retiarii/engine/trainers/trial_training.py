"""One trial's training state: a model trained by a :class:`~.trainer.Trainer`, epoch by epoch.

:class:`TrialRun` holds one trial's training state in memory and trains it epoch by epoch; it
saves and restores that state through :mod:`retiarii.engine.storage.checkpoint`. Each run owns its own
python/numpy/torch RNG streams, swapped in around every epoch, so several trials can share a
process (one job, several models) and a resumed trial draws exactly the numbers it would have
drawn had it never stopped. :func:`train_trial` is the one-call form: train steps
``[start, stop)`` from a checkpoint and write the next one.

The trainer is used through its methods only (``configure_optimizers``, ``training_step``, ...),
so this module imports no trainer (``trainer: Any`` below is a :class:`~.trainer.Trainer`):
``trainer.py`` re-exports this module's names, and an import back would be a cycle.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..storage import checkpoint as ckpt
from ...rng import swapped_in
from ...training import batch_size as batch_size_of  # noqa: F401 (engine modules import these)
from ...training import parse_optimizers as _parse_optimizers
from ...training import to_device as _to_device
from ..jobs.measure_lock import paced

__all__ = ["TrialRun", "TrainingError", "train_trial", "check_segment", "set_training"]


class TrainingError(RuntimeError):
    """A trial's training went wrong (NaN loss, a bad ``training_step``); fails that trial only."""


# ---- one trial's training state -------------------------------------------------------------


class TrialRun:
    """One trial's model, optimizer, LR scheduler, RNG streams and position, trained per epoch.

    Example::

        run = TrialRun(lambda: space.build(sample), ClassifierTrainer(epochs=4), seed=0)
        for _ in range(2):
            print(run.step + 1, run.train_epoch())
        run.save("t1.pt")                       # later, perhaps in another process:
        run = TrialRun(lambda: space.build(sample), ClassifierTrainer(epochs=4), checkpoint="t1.pt")

    Args:
        build: makes the model; called with the trial's RNG seeded, so initial weights follow
            from ``seed``.
        trainer: a :class:`Trainer`.
        hparams: the trial's hyper-parameters, handed to every trainer call.
        seed: seeds the trial's python, numpy and torch RNG streams on a fresh start.
        checkpoint: resume from this file. When its hparams differ from ``hparams`` (a PBT
            child), optimizer settings come from the new hparams, the learning rate scaled by
            new/old initial lr so an LR schedule keeps its position; weights, moments and RNG
            streams come from the checkpoint.
        device: where to train; the first visible GPU when there is one, else the CPU.
        trial_id: names the trial in errors and in the checkpoint.
    """

    def __init__(self, build: Callable[[], nn.Module], trainer: Any, hparams: dict | None = None,
                 *, seed: int = 0, checkpoint: str | None = None,
                 device: str | torch.device | None = None, trial_id: str = "trial"):
        self.trainer, self.hparams, self.trial_id = trainer, dict(hparams or {}), trial_id
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.epoch, self.batch = 0, 0  # data position: epochs done, batches done in this epoch
        # The Model (graph IR) the module was emitted from, when the builder kept it (the
        # worker does: grouped jobs plan on it instead of replaying the sample again).
        self.ir: Any = None
        outer = ckpt.native_rng()
        try:
            ckpt.seed_rng(seed)
            model = build()
            if not isinstance(model, nn.Module):
                raise TypeError(f"trial {trial_id}: building the model gave a "
                                f"{type(model).__name__}, not a torch.nn.Module")
            self.model = model.to(self.device)
            self.optimizer, self.scheduler, self.interval = _parse_optimizers(
                trainer.configure_optimizers(self.model, self.hparams))
            self._rng = ckpt.native_rng()  # this trial's streams while it is swapped out
            if checkpoint is not None:
                self._load(checkpoint)
        finally:
            ckpt.set_native_rng(outer)

    @property
    def step(self) -> int:
        """Steps (epochs) completed."""
        return self.epoch

    @contextlib.contextmanager
    def _own_rng(self):
        """Swap this trial's RNG streams in for the duration of the block."""
        with swapped_in(self):
            yield

    def train_epoch(self, carry: tuple[torch.Tensor, int] | None = None) -> dict[str, float]:
        """Train the rest of the current epoch, validate, and return the epoch's metrics.

        Args:
            carry: ``(loss total, examples)`` of this epoch's batches already trained
                elsewhere in this process (a grouped job that hands the rest of a segment to
                each model alone: engine/measuring.py), accumulated as here; None: from 0.
        """
        trainer, model, opt = self.trainer, self.model, self.optimizer
        with self._own_rng():
            batches: Iterable = trainer.train_dataloader(self.hparams, self.epoch)
            if self.batch:  # resuming mid-epoch: the order is a function of the epoch, so skip
                batches = itertools.islice(iter(batches), self.batch, None)
            set_training(model.modules(), True)
            total, count = carry if carry is not None else (
                torch.zeros((), device=self.device), 0)
            for batch in paced(batches):  # (a cost measured on this machine pauses it)
                batch = _to_device(batch, self.device)
                loss = trainer.training_step(model, batch, self.hparams)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TrainingError(f"trial {self.trial_id}: training_step must return a "
                                        f"scalar loss tensor, got {type(loss).__name__}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if self.scheduler is not None and self.interval == "step":
                    self.scheduler.step()
                n = batch_size_of(batch)
                total += loss.detach().reshape(()) * n  # no .item(): no device sync per batch
                count += n
                self.batch += 1
            train_loss = self.end_training(total, count)
            metrics = {"train_loss": train_loss, **self._validate()}
        self.epoch, self.batch = self.epoch + 1, 0
        return metrics

    def end_training(self, total: torch.Tensor, count: int) -> float:
        """The end of an epoch's training (before validation): the mean loss over ``count``
        examples whose losses sum to ``total``, checked finite, and the epoch's LR step.
        Call it with this trial's RNG streams in (a grouped job calls it for each trial)."""
        if count == 0:
            raise TrainingError(f"trial {self.trial_id}: train_dataloader gave no batch "
                                f"for epoch {self.epoch}")
        train_loss = float(total) / count
        if not math.isfinite(train_loss):
            raise TrainingError(
                f"trial {self.trial_id}: training loss is {train_loss} in epoch "
                f"{self.epoch + 1}; the model diverged (lower the learning rate, or check "
                "the model for an unstable operation)")
        if self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()
        return train_loss

    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        set_training(self.model.modules(), False)
        sums: dict[str, float] = {}
        count = 0
        for batch in self.trainer.val_dataloader(self.hparams):
            batch = _to_device(batch, self.device)
            n = batch_size_of(batch)
            for name, value in self.trainer.validation_step(self.model, batch).items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            count += n
        return {name: total / max(count, 1) for name, total in sums.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step reads (see :mod:`retiarii.engine.storage.checkpoint`)."""
        return {
            "trial_id": self.trial_id,
            "step": self.step,
            "data_position": {"epoch": self.epoch, "batch": self.batch},
            "hparams": self.hparams,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "rng": ckpt.portable_rng(self._rng),
        }

    def save(self, path: str) -> None:
        """Write the checkpoint atomically to ``path``."""
        ckpt.save(path, self.state_dict())

    def _load(self, path: str) -> None:
        # Read onto the CPU whatever the device: the RNG states must be CPU tensors (torch and
        # numpy take no others), and load_state_dict moves weights and optimizer moments to
        # their parameters' device. So a checkpoint written on a GPU resumes anywhere.
        state = ckpt.load(path, map_location="cpu")
        try:
            self.model.load_state_dict(state["model"])
            fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(state["optimizer"])
            if (self.scheduler is None) != (state["lr_scheduler"] is None):
                raise ValueError("the checkpoint and the trainer disagree on having an LR scheduler")
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state["lr_scheduler"])
        except (RuntimeError, ValueError, KeyError) as err:
            raise ckpt.CheckpointError(f"checkpoint {path} does not fit trial {self.trial_id}'s "
                                       f"model or optimizer: {err}") from err
        if state.get("hparams") != self.hparams:  # exploit & explore: the new settings win
            for group, new in zip(self.optimizer.param_groups, fresh):
                old_initial = group.get("initial_lr", group["lr"])
                new_initial = new.get("initial_lr", new["lr"])
                lr = group["lr"] * new_initial / old_initial if old_initial else new["lr"]
                group.update(new)
                group["lr"] = lr
            if self.scheduler is not None:
                self.scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in fresh]
        self.epoch = int(state["data_position"]["epoch"])
        self.batch = int(state["data_position"]["batch"])
        self._rng = ckpt.native_from_portable(state["rng"])


def set_training(modules: Iterable[nn.Module], mode: bool) -> None:
    """``module.train(mode)`` for each of ``modules`` (all to set, children included, each
    once: ``model.modules()``). The flag is written directly, and ``train`` itself called only
    where a class overrides it: ``Module.train`` pays ``__setattr__``'s checks on every module
    of the tree (8 ms for 8 MobileNetV2s, 0.1 ms this way). ``modules`` in pre-order (as
    ``modules()`` gives them): an override sets its own subtree (a BatchNorm it keeps in eval
    mode stays so), which is then left alone."""
    done: set[int] = set()  # the subtrees of overrides
    for module in modules:
        if id(module) in done:
            continue
        if type(module).train is nn.Module.train:
            module.__dict__["training"] = mode
        else:
            module.train(mode)
            done.update(id(m) for m in module.modules())


def train_trial(build: Callable[[], nn.Module], trainer: Any, hparams: dict | None = None, *,
                start_step: int = 0, stop_step: int, checkpoint_in: str | None = None,
                checkpoint_out: str | None = None,
                report: Callable[[int, dict[str, float]], None] | None = None,
                seed: int = 0, trial_id: str = "trial") -> TrialRun:
    """Train one trial for steps ``[start_step, stop_step)`` and checkpoint it.

    Example::

        train_trial(build, ClassifierTrainer(epochs=4), stop_step=2, checkpoint_out="a.pt",
                    report=lambda step, m: print(step, m["val_acc"]))
        train_trial(build, ClassifierTrainer(epochs=4), start_step=2, stop_step=4,
                    checkpoint_in="a.pt", checkpoint_out="b.pt")

    Args:
        build, trainer, hparams, seed, trial_id: as for :class:`TrialRun`.
        start_step: steps already done; must equal the step of ``checkpoint_in`` (0 when fresh).
        stop_step: train until this many steps are done.
        checkpoint_in: resume from this checkpoint (None: a fresh start).
        checkpoint_out: write the end-of-segment checkpoint here (None: don't).
        report: called as ``report(step, metrics)`` after every step, step 1-based.
    """
    run = TrialRun(build, trainer, hparams, seed=seed, checkpoint=checkpoint_in, trial_id=trial_id)
    check_segment(run, start_step, stop_step, checkpoint_in)
    while run.step < stop_step:
        metrics = run.train_epoch()
        if report is not None:
            report(run.step, metrics)
    if checkpoint_out is not None:
        run.save(checkpoint_out)
    return run


def check_segment(run: TrialRun, start_step: int, stop_step: int, checkpoint_in: str | None) -> None:
    """Raise a clear error when a segment's bounds disagree with the run's position."""
    if run.step != start_step:
        where = f"checkpoint {checkpoint_in} is at step {run.step}" if checkpoint_in \
            else "a fresh start is at step 0 (give checkpoint_in to resume)"
        raise ValueError(f"trial {run.trial_id}: the task starts at step {start_step} but {where}")
    if stop_step < start_step:
        raise ValueError(f"trial {run.trial_id}: stop_step {stop_step} is before start_step {start_step}")
