"""Grouped jobs: the trials of one job that can share a data pipeline train as one module.

Which tasks may group is decided in :mod:`.group_candidates`; :class:`TrainingGroup` is the
execution: a few :class:`~.trial_run.TrialRun` objects, planned (``build_plan``, ``cse``,
``batching``), built into one :class:`~retiarii.optim.GroupModule`, trained one epoch at a
time through **one** loader::

    for batch in trainer.train_dataloader(hparams, epoch):       # once for every model
        outs = group(x)                                          # the shared frozen part once,
        loss[t] = trainer.training_step(proxy[t], batch, hp[t])  #   each part in t's RNG streams
        sum(loss.values()).backward()                            # each loss gets gradient 1
        optimizer[t].step() ...                                  # each trial's own

Each trial keeps what ``TrialRun.train_epoch`` keeps alone (its optimizer, LR scheduler, RNG
streams, data position, the epoch's mean loss and NaN check, validation on its own model), so
its metrics and checkpoint equal those of training it alone, bit for bit on CPU
(``tests/test_grouped_jobs.py``). ``training_step`` still computes each trial's loss: it gets
a proxy module whose ``forward`` returns that trial's output of the group's one forward
pass on this batch (:mod:`.group_forward`). A trial that fails (an exception in its part,
its ``training_step`` or its optimizer; a NaN epoch loss) fails alone: the group is rebuilt
without it, in the middle of an epoch if need be, and the others run on. One exception is
not attributable: an error in the joint ``backward`` fails every trial of the group in that
step.

Exactness needs what a data key promises (docs/optimization.md "Data keys"): the batches do
not depend on the trial, and ``training_step`` draws no random numbers before it calls the
model (the group's forward runs every part when the first trial calls its proxy).
"""
from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...optim import build_group
from ...optim.cost import relative_spread
from ..storage import checkpoint as ckpt
from ...optim.plan import LogicalPlan
from ...training import to_device as _to_device
from ..trainers.trial_training import TrainingError, TrialRun, batch_size_of, paced, set_training
from .compute_clock import compute_clock
from .group_forward import GroupForward, Proxy, Streams
from ..jobs.reports import UnitChoice, UnitReport

__all__ = ["step_seconds", "sync_device", "TrainingGroup"]


_END = object()


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer reads work done rather than queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainingGroup:
    """Trial runs with one trainer and one data key, trained one epoch at a time as one group.

    Example::

        group = TrainingGroup(plan.restrict(ids), {t: runs[t] for t in ids}, trainer)
        outcome = group.train_epoch()   # {trial: metrics, or the exception that failed it}

    Args:
        plan: the group's plan after the passes (``plan.restrict(ids)``); None for a subclass
            whose :meth:`_build` needs none (:class:`~.fused.FusedGroup`).
        runs: trial id -> its :class:`TrialRun`, all at the same (epoch, batch) (with a
            plan: the plan's trials; without: every run, in order).
        trainer: the trainer every run shares.
        profile: trials whose separate step time to measure (:meth:`_profile`), on copies of
            their model and optimizer at the first batch, outside every RNG stream: what they
            train is unchanged. Given (even empty), the group's own times are measured with
            the device synchronized at each batch; None times without synchronizing.
    """

    def __init__(self, plan: LogicalPlan | None, runs: Mapping[str, TrialRun], trainer: Any,
                 profile: Iterable[str] | None = None):
        self._plan, self.trainer = plan, trainer
        order = list(runs) if plan is None else [m.trial_id for m in plan.models]
        self.runs = {t: runs[t] for t in order}
        self.members = tuple(self.runs)  # every trial it started with (the report names them)
        self._group = self._build()
        self._modes_of: nn.Module | None = None  # the group _mode_modules were listed for
        self._mode_list()  # listed with the build, not in the first epoch
        self._steps_draw = trainer.steps_draw_random()  # else steps switch no streams
        self._measure = profile is not None
        self._to_profile = set(profile or ()) & set(self.runs)
        self._batches, self._compute_s = 0, 0.0
        self._loads: list[float] = []  # seconds waiting for each batch
        self._steps: list[float] = []  # seconds of each batch's step (their spread: the noise)
        self._alone_s: dict[str, float] = {}
        self.setup_s = 0.0  # planning and building it, as the worker measured
        self.trained_layout: str | None = None  # the layout it trains in (group_layouts.py)
        self.choice: UnitChoice | None = None  # the layout choice it trains under
        self.twins: dict[str, list[str]] = {}  # profiled trial -> others of its architecture
        self.arch: dict[str, str] = {}  # trial -> its architecture (fusion_key), when known

    def report(self) -> UnitReport:
        """What this group measured while it trained (a :class:`~..jobs.job.JobProfiled`
        unit): batches, seconds waiting for the loader and computing (the shared part once,
        every model's own part, backward, optimizer steps), and each profiled trial's separate
        step time, and the relative spread of its step times (the first, a warm-up, left
        out: :func:`~retiarii.optim.cost.relative_spread`): how noisy the measurement is."""
        # A loader's first batch pays what is paid once (a data set cached, workers starting):
        # every batch counts at the median wait of the others, not charged N times apart.
        loads = self._loads
        typical = sorted(loads[1:])[len(loads[1:]) // 2] if len(loads) > 1 else sum(loads)
        alone = dict(self._alone_s)
        for trial, others in self.twins.items():  # one architecture, one step time alone
            if trial in alone:
                alone.update({t: alone[trial] for t in others if t not in alone})
        built = self._built_plan() if self._plan is not None else None
        return UnitReport(
            tuple(self.members), merged=True, batches=self._batches,
            load_s=typical * len(loads), first_load_s=loads[0] if loads else 0.0,
            produce_s=getattr(self, "produce_s", 0.0), compute_s=self._compute_s,
            setup_s=self.setup_s, alone_s=alone, start_s=getattr(self, "start_s", 0.0),
            spread=relative_spread(self._steps[1:]), step_s=self._typical_step_s(),
            alone_by_arch={self.arch[t]: s for t, s in alone.items() if t in self.arch},
            # what the plan's passes left it: nodes computed once, evaluations per step
            # (the group's own plan: frozen BatchNorms keyed by their statistics)
            shared_nodes=None if built is None else len(built.shared),
            executions=None if built is None else built.executions(),
            layout=self.trained_layout, choice=self.choice)

    def _built_plan(self) -> LogicalPlan:
        """The plan the group module was built from (``GroupModule.plan``), else the one given."""
        return getattr(self._group, "plan", None) or self._plan

    def _typical_step_s(self) -> float | None:
        """The median of the segment's steps after the first (None before two steps): its
        first step's warm-up (allocations, kernel choice, optimizer state) is paid by each
        model alone too and left out of its profiled step time, and a step the machine's
        other work delayed says nothing of the layout; the cost model counts this per batch."""
        steps = self._steps[1:]
        return sorted(steps)[len(steps) // 2] if steps else None

    @property
    def trials(self) -> tuple[str, ...]:
        return tuple(self.runs)

    def drop(self, trials: Iterable[str]) -> None:
        """Leave ``trials`` out from now on: the group is rebuilt over the others."""
        gone = set(trials) & set(self.runs)
        if not gone:
            return
        for t in gone:
            del self.runs[t]
        self._group = None  # free the old parts before building the new ones
        if self.runs:
            self._group = self._build()

    def _build(self) -> nn.Module:
        """The module of the current runs: ``module(*inputs, rng={trial: ctx}, errors={})``
        returns {trial: its output} (a :class:`~retiarii.optim.GroupModule`)."""
        return build_group(self._plan.restrict(self.runs), {t: r.model for t, r in self.runs.items()})

    def _set_training(self, mode: bool) -> None:
        """Every model's and the group's modules in train (True) or eval mode, each once (the
        models share their frozen modules, and the group holds theirs)."""
        set_training(self._mode_list(), mode)

    def _mode_list(self) -> list[nn.Module]:
        """The modules of the models and of the group, each once, in pre-order (listed when
        the group is built, and again after it is rebuilt)."""
        if self._modes_of is not self._group:
            roots = [*(run.model for run in self.runs.values()), self._group]
            self._mode_modules = list({id(m): m for root in roots
                                       for m in root.modules()}.values())
            self._modes_of = self._group
        return self._mode_modules

    def train_epoch(self) -> dict[str, dict[str, float] | Exception]:
        """One epoch of every trial (what ``TrialRun.train_epoch`` does for each alone):
        trial -> its metrics, or the exception that failed it (it has left the group)."""
        outcome: dict[str, dict[str, float] | Exception] = {}
        first = next(iter(self.runs.values()))
        self._set_training(True)
        sums = {t: [torch.zeros((), device=r.device), 0] for t, r in self.runs.items()}
        # The data key promises the batches do not depend on the trial or its RNG streams.
        batches: Iterable = self.trainer.train_dataloader(first.hparams, first.epoch)
        if first.batch:  # resuming mid-epoch: every run is at the same position
            batches = itertools.islice(iter(batches), first.batch, None)
        batches = paced(self._feed(iter(batches)))  # (a cost measured here pauses them)
        sync, clock = sync_device if self._measure else (lambda device: None), compute_clock(first.device)
        while True:
            sync(first.device)
            t0 = time.perf_counter()
            batch = next(batches, _END)  # the loader's time: what one shared pipeline saves
            if batch is _END:
                break
            batch = _to_device(batch, first.device)
            load = time.perf_counter() - t0  # before any work on copies: neither load nor compute
            self._before_step(batch)  # measured on copies: not the group's time
            t1 = clock()
            failed = self._step(batch, sums)
            sync(first.device)
            self._batches += 1
            self._loads.append(load)
            self._steps.append(clock() - t1)
            self._compute_s += self._steps[-1]
            outcome.update(failed)
            self.drop(failed)
            if not self.runs:
                return outcome
        losses: dict[str, float] = {}
        for trial, run in list(self.runs.items()):
            try:
                losses[trial] = self._end_training(run, *sums[trial])
            except Exception as err:  # noqa: BLE001 (fails this trial only)
                outcome[trial] = err
        self.drop(t for t, o in outcome.items() if isinstance(o, Exception))
        if self.runs:
            for trial, metrics in self._validate().items():
                if isinstance(metrics, Exception):
                    outcome[trial] = metrics
                    continue
                run = self.runs[trial]
                outcome[trial] = {"train_loss": losses[trial], **metrics}
                run.epoch, run.batch = run.epoch + 1, 0
        self.drop(t for t, o in outcome.items() if isinstance(o, Exception))
        return outcome

    def _feed(self, batches: Iterator) -> Iterator:
        """The epoch's batches as the loop reads them (a subclass reads ahead:
        :class:`~.dedicated.DedicatedGroup`)."""
        return batches

    def _ahead(self, batch: Any) -> Any:
        """For one batch: ``inputs -> the shared part's outputs`` computed ahead, or None."""
        return None

    def _before_step(self, batch: Any) -> bool:
        """Work on copies before a batch's step, not counted as the group's time (the alone
        profiles: :meth:`_profile`); whether there was any."""
        if not self._to_profile:
            return False
        self._profile(batch)
        return True

    def _profile(self, batch: Any) -> None:
        """Each trial to profile, trained alone for a few steps on ``batch``: a copy of its
        model and optimizer, under saved RNG states (the trial's own streams never move), so
        the real training is what it would be unprofiled. A trial whose copy fails is not
        profiled (its own training will say what is wrong)."""
        outer = ckpt.native_rng()
        try:
            for trial in sorted(self._to_profile & set(self.runs)):
                try:
                    self._alone_s[trial] = step_seconds(self.trainer, self.runs[trial], batch)
                except Exception:  # noqa: BLE001 (unprofiled; never fails the trial)
                    pass
                finally:
                    ckpt.set_native_rng(outer)
        finally:
            self._to_profile.clear()
            ckpt.set_native_rng(outer)

    @torch.no_grad()
    def _validate(self) -> dict[str, dict[str, float] | Exception]:
        """``TrialRun._validate`` for every run at once: each validation batch goes through
        the group (the shared part once), and each trial's ``validation_step`` gets a proxy of
        its output, in its own RNG streams; trial -> its metrics, or what failed it."""
        first = next(iter(self.runs.values()))
        self._set_training(False)
        sums: dict[str, dict[str, float]] = {t: {} for t in self.runs}
        failed: dict[str, Exception] = {}
        count = 0
        for batch in self.trainer.val_dataloader(first.hparams):
            batch = _to_device(batch, first.device)
            n = batch_size_of(batch)
            forward = GroupForward(self._group, self.runs, batch, Streams(self.runs, self._steps_draw))

            def validate(trial: str, run: Any) -> None:
                values = self.trainer.validation_step(Proxy(trial, run.model, forward), batch)
                for name, value in values.items():
                    sums[trial][name] = sums[trial].get(name, 0.0) + float(value) * n

            failed.update(self._each_trial(forward, validate, skip=failed))
            count += n
        return {t: failed[t] if t in failed else
                {name: total / max(count, 1) for name, total in sums[t].items()}
                for t in self.runs}

    def _each_trial(self, forward: GroupForward, step: Any,
                    skip: Mapping[str, Exception] | None = None) -> dict[str, Exception]:
        """``step(trial, run)`` for every trial not in ``skip``, in its RNG streams (switched
        lazily: :class:`Streams`) and as the active trial of ``forward``; the trials whose
        step raised, with what they raised (it fails that trial only)."""
        failed: dict[str, Exception] = {}
        try:
            for trial, run in self.runs.items():
                if skip is not None and trial in skip:
                    continue
                forward.active = trial
                try:
                    forward.streams.step(trial)
                    step(trial, run)
                except Exception as err:  # noqa: BLE001 (fails this trial only)
                    failed[trial] = err
                finally:
                    forward.active = None
        finally:
            forward.streams.release()
        return failed

    def _step(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception]:
        """One batch for every trial; the trials that failed in it."""
        forward = GroupForward(self._group, self.runs, batch, Streams(self.runs, self._steps_draw),
                           self._ahead(batch))
        losses: dict[str, torch.Tensor] = {}

        def train(trial: str, run: Any) -> None:
            loss = self.trainer.training_step(Proxy(trial, run.model, forward), batch,
                                              run.hparams)
            if trial not in forward.calls:
                raise TrainingError(f"trial {trial}: training_step never called the model")
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TrainingError(f"trial {trial}: training_step must return a scalar "
                                    f"loss tensor, got {type(loss).__name__}")
            losses[trial] = loss

        failed = self._each_trial(forward, train)
        try:
            failed.update(self._optimize(losses))
        except Exception as err:  # noqa: BLE001 (not attributable: fails the group's step)
            return {**failed, **{t: err for t in losses}}
        n = batch_size_of(batch)
        for trial, loss in losses.items():
            if trial in failed:
                continue
            run = self.runs[trial]
            sums[trial][0] += loss.detach().reshape(()) * n  # no .item(): no sync per batch
            sums[trial][1] += n
            run.batch += 1
        return failed

    def _optimize(self, losses: Mapping[str, torch.Tensor]) -> dict[str, Exception]:
        """Backward over the sum of ``losses`` and every trial's optimizer (and per-step LR
        scheduler) step; the trials whose own step failed. An exception it raises (the joint
        backward) cannot be attributed: it fails every trial of the step."""
        for trial in losses:
            self.runs[trial].optimizer.zero_grad(set_to_none=True)
        # The models' graphs are disjoint (the shared part ran without grad), so each
        # loss gets gradient exactly 1 and each model's weights only its own loss's.
        if losses:
            sum(losses.values()).backward()
        failed: dict[str, Exception] = {}
        for trial in losses:
            run = self.runs[trial]
            try:
                run.optimizer.step()
                if run.scheduler is not None and run.interval == "step":
                    run.scheduler.step()
            except Exception as err:  # noqa: BLE001 (fails this trial only)
                failed[trial] = err
        return failed

    @staticmethod
    def _end_training(run: TrialRun, total: torch.Tensor, count: int) -> float:
        """What ``TrialRun.train_epoch`` does after its batches, before validation."""
        with run._own_rng():
            return run.end_training(total, count)


# A step timed once or twice on a shared machine is at the mercy of one preemption when it
# lasts a millisecond: short steps are repeated until the timed ones add up to MIN_TIMED_S
# (at most MAX_REPEATS): a few milliseconds for them.
MIN_TIMED_S = 0.02
MAX_REPEATS = 10


def step_seconds(trainer: Any, run: Any, batch: Any, repeats: int = 2) -> float:
    """Seconds of one training step of ``run``'s model alone on ``batch`` (forward, loss,
    backward, optimizer step), on a copy of its model and optimizer: a warm-up step (caches,
    allocators), then the least of ``repeats`` (the machine's other work only adds), more
    for a step so short that a preempted one would decide (up to :data:`MAX_REPEATS`, until
    the timed steps add up to :data:`MIN_TIMED_S`). The caller restores the RNG streams
    (dropout draws from them).

    Args:
        trainer: its ``training_step`` computes the loss.
        run: a :class:`TrialRun` (or anything with ``model``, ``optimizer``, ``hparams``,
            ``device``).
        batch: on the run's device.
    """
    model, opt = copy.deepcopy((run.model, run.optimizer))  # one memo: opt -> the copies
    times, clock = [], compute_clock(run.device)
    while len(times) < 1 + repeats or (sum(times[1:]) < MIN_TIMED_S
                                       and len(times) < 1 + MAX_REPEATS):
        sync_device(run.device)
        t0 = clock()
        loss = trainer.training_step(model, batch, run.hparams)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync_device(run.device)
        times.append(clock() - t0)
    return min(times[1:])
