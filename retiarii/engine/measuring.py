"""Measuring a candidate group's layouts on the segment's real first batches (issue #13 item 3).

The first grouped job of a group key and device that has a choice to make (``cse`` or
``batching``, ``fused`` or not, or apart) trains its first batches in the merged candidates in
turn, on the trials' own models, and times them: those batches are training that happens
anyway, so what the measurement costs is only the difference between the layouts over a few
batches, not a probe paid on top of the segment. Every merged layout trains each model as
training it alone does (CSE and batching are bit for bit on the CPU: docs/optimization.md),
so the trials' losses and checkpoints are those of separate training whichever layout a batch
ran in (``tests/test_measuring.py``).

What cannot train on the real models without changing their values, or would not be training:

- **apart** (``separate``): each model's step alone. A lower bound comes free: every model
  alone computes the group's shared frozen part, which the real batches time (the group's
  ``shared`` cell, computed once per batch), so apart costs at least ``N * (shared + load)``
  per batch. When that bound already puts the best merged layout over the margin (the frozen
  trunk: 16 trunks apart against one), no model is profiled alone; otherwise one trial per
  architecture is profiled on copies (:meth:`~.grouped.TrainingGroup._profile`).
- **fused**: fused kernels round differently, so fusion is measured on copies
  (:func:`~.layouts.step_times`: a warm-up, then one timed step, stopped at the warm-up when
  it is far slower than the best merged step), unless the profile rules it out: on a CPU a
  fused unit of K models computes their frozen part K times (one grouped kernel, K times the
  arithmetic), so a fused layout whose frozen parts alone would cost over the best merged
  step (:data:`FUSED_CPU_BOUND`) is not measured. On a GPU, where K trunks in one kernel can
  cost about one, that bound does not hold. On any device, fusion is not measured either
  when its per-model work rules it out: every fused
  step pays each model's share of a grouped step (its ``training_step`` through a proxy,
  its RNG streams), at least what the CSE step costs beyond the models' steps alone and
  the shared part, and that alone is over the best step (tiny models, whose grouped steps
  are mostly that work).

Schedule: one warm-up batch per merged candidate, then :data:`TIMED` timed batches each,
interleaved (a machine whose load drifts moves all of them alike); the decision comes before
the next batch, or at the end of the epoch when the epoch is shorter. The rest of the
segment trains in the best layout that keeps every model's values (``cse``, ``batching``,
or, for ``separate``, each model's own ``TrialRun.train_epoch``, carrying its loss so far);
a choice of ``fused`` that fuses every trial into one unit takes the rest of the segment
too: a :class:`~.fused.FusedGroup` over the same runs goes on from the next batch, carrying
each trial's loss so far (fused kernels round otherwise: from that batch on the values are
those of fused training, within its tolerance, as any fused segment's). A choice of
``fused`` for part of the trials applies from the next segment.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..optim import build_group
from ..optim.cost import MARGIN, Layout, choose_layout, probe_speedups
from ..optim.plan import LogicalPlan, Role
from . import checkpoint as ckpt
from .grouped import TrainingGroup, _sync

__all__ = ["ABORT_REAL", "BOUND_SAFETY", "FUSED_CPU_BOUND", "MeasuringGroup", "PER_MODEL_BOUND",
           "TIMED"]

# Timed batches per merged candidate, after one warm-up each (the least is kept: a machine's
# other work only adds).
TIMED = 2
# A candidate whose warm-up batch takes over this many times apart's batch gets no timed
# batches: a first step seldom costs more than twice a later one, so it could not win.
ABORT_REAL = 2.0
# The lower bound of apart must put the best merged layout this much over the margin to skip
# the alone profiles (the shared part's time is itself measured, with noise).
BOUND_SAFETY = 1.1
# On a CPU a fused unit of K models costs at least this share of K times their frozen part
# (K times the arithmetic in one grouped kernel; half, for what one thread's caches save).
FUSED_CPU_BOUND = 0.5
# A fused step costs at least this share of the per-model work a CSE step measured beyond
# the models' own steps (proxies, RNG streams; the whole of it: a fused step pays it too).
PER_MODEL_BOUND = 1.0


class _Apart(Exception):
    """Raised out of the group's batch loop when the measurement chose ``separate``."""


class _Fuse(Exception):
    """Raised out of the group's batch loop when the measurement chose ``fused`` for all."""


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


class MeasuringGroup(TrainingGroup):
    """A grouped unit that measures its merged candidate layouts on its first real batches,
    then decides the group key's layout (see the module docstring).

    Example::

        group = MeasuringGroup({Layout.CSE: cse_plan, Layout.BATCHING: batched_plan}, runs,
                               trainer, models=models, fusable=[("a", "b")], data_key=key,
                               alone_s={}, want_alone=["a", "c"], choice=choice)
        group.train_epoch()       # choice["order"], choice["speedups"] are filled in

    Args:
        plans: merged layout -> the group's plan in it (each covering every run), the first
            the one it starts in.
        runs, trainer: as for :class:`~.grouped.TrainingGroup`.
        models: trial -> its model (IR), for the fused candidate.
        fusable: the trials that fuse under ``FUSED`` (empty: fusion is no candidate).
        data_key: what the trials share.
        alone_s: trial -> its step time alone, already known (not measured again).
        want_alone: the trials to profile alone when the bound does not decide (one per
            architecture; :attr:`twins` spreads their times).
        choice: the job's choice record (``layouts.group_units``), filled in when decided.
    """

    def __init__(self, plans: Mapping[Layout, LogicalPlan], runs: Mapping, trainer: Any, *,
                 models: Mapping, fusable: list[tuple[str, ...]], data_key: str,
                 alone_s: Mapping[str, float], want_alone: list[str], choice: dict,
                 step_times: Any = None):
        # how fused is timed on copies (layouts.step_times, handed in: layouts imports this
        # module, so this one does not import it back); None: fused is never measured
        self._step_times = step_times
        self._plans = dict(plans)
        self._layout = next(iter(self._plans))
        super().__init__(self._plans[self._layout], runs, trainer, profile=[])
        self._modules: dict[Layout, Any] = {self._layout: self._group}
        self._models, self._fusable, self._data_key = models, fusable, data_key
        self._known = dict(alone_s)
        self._want_alone = list(want_alone)
        self.choice = choice
        # one warm-up batch per candidate, then TIMED timed ones each, interleaved
        self._schedule = list(self._plans) * (1 + TIMED)
        self._position = 0
        self._times: dict[Layout, list[float]] = {lay: [] for lay in self._plans}
        self._warm: dict[Layout, list[float]] = {lay: [] for lay in self._plans}
        self._shared: list[float] = []  # the shared cell's time per batch (CSE batches)
        self._due, self._decided = False, False
        self._last: Any = None
        self._fuse_pending = False  # fused chosen for every trial: from the next batch
        self._fused: Any = None  # the FusedGroup training the rest (once fused)
        # A plan that shares no frozen layer cannot bound apart (its shared part is the data
        # alone): the alone profiles are taken before the first step, so a candidate far
        # slower than apart stops at its warm-up batch.
        cse = self._plans.get(Layout.CSE)
        if cse is not None and not any(cse.nodes[k].role is Role.FROZEN for k in cse.shared):
            missing = set(self._want_alone) - set(self._known)
            self._to_profile = missing & set(self.runs)

    @property
    def layout(self) -> Layout:
        """The merged layout it trains in now."""
        return self._layout

    def _use(self, layout: Layout) -> None:
        """Train the next batches in ``layout`` (its module built over the current runs);
        ``SEPARATE``: each trial's own ``train_epoch`` (:meth:`train_epoch`)."""
        if layout is Layout.SEPARATE:
            self._layout = layout
            self.extra["layout"] = layout.value
            return
        if self._modules.get(layout) is None:
            self._modules[layout] = build_group(self._plans[layout].restrict(self.runs),
                                                {t: r.model for t, r in self.runs.items()})
        self._layout, self._plan, self._group = layout, self._plans[layout], self._modules[layout]
        self.extra["layout"] = layout.value

    def drop(self, trials) -> None:
        """:meth:`TrainingGroup.drop`; the other candidates' modules are rebuilt when used."""
        if self._fused is not None:  # the fused unit trains them now: it unfuses the gone
            self._fused.drop(trials)
            for t in set(trials) & set(self.runs):
                del self.runs[t]
            return
        before = len(self.runs)
        super().drop(trials)
        if len(self.runs) != before:
            self._modules = {self._layout: self._group}

    def _step(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception]:
        self._sums = sums  # the epoch's losses so far, carried when it ends apart
        failed = self._step_in(batch, sums)
        self._failures.update(failed)  # reported with the epoch's outcome
        return failed

    def _step_in(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception]:
        if self._position >= len(self._schedule):
            return super()._step(batch, sums)
        layout = self._schedule[self._position]
        self._use(layout)
        device = next(iter(self.runs.values())).device
        _sync(device)
        t0 = time.perf_counter()
        failed = super()._step(batch, sums)
        _sync(device)
        seconds = time.perf_counter() - t0
        warm = self._position < len(self._plans)
        if not failed:  # a step with a failed trial measured fewer models
            (self._warm if warm else self._times)[layout].append(seconds)
        apart = self._apart_s()
        if warm and apart is not None and seconds > ABORT_REAL * apart:
            # far slower than apart at its warm-up: it cannot win; no timed batches for it
            rest = self._schedule[self._position + 1:]
            self._schedule = self._schedule[:self._position + 1] + [
                x for x in rest if x is not layout]
        self._position += 1
        self._last = batch
        self._due = self._position >= len(self._schedule)
        return failed

    def _alone_now(self) -> dict[str, float]:
        """Each trial's step time alone known so far (given, or profiled here: one trial
        per architecture, its twins sharing its time)."""
        alone = {t: self._known[t] for t in self.runs if t in self._known}
        alone.update({t: s for t, s in self._alone_s.items() if t in self.runs})
        for trial, others in self.twins.items():
            if trial in self._alone_s:
                alone.update({t: self._alone_s[trial] for t in others if t in self.runs})
        return alone

    def _apart_s(self) -> float | None:
        """One batch of every trial apart (their alone steps and N - 1 more loads than the
        group's one), when every trial's alone time is known."""
        alone = self._alone_now()
        if len(alone) < len(self.runs):
            return None
        return sum(alone.values()) + (len(self.runs) - 1) * _median(self._loads)

    def _ahead(self, batch: Any) -> Any:
        """While measuring in CSE: the shared cell computed here, timed (what every model
        alone computes too: the lower bound of apart). Exact: the same call the group's
        forward makes (``GroupModule.forward``), under ``no_grad`` as there."""
        if self._position >= len(self._schedule) or self._layout is not Layout.CSE:
            return None
        group = self._group
        device = next(iter(self.runs.values())).device

        def common(inputs: tuple) -> tuple:
            _sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = group.shared(*inputs)
            _sync(device)
            self._shared.append(time.perf_counter() - t0)
            return out

        return common

    def _before_step(self, batch: Any) -> bool:
        did = super()._before_step(batch)
        if self._due and not self._decided and self.runs:
            self._decide(batch)
            if self._layout is Layout.SEPARATE:
                raise _Apart  # the rest of the epoch: each model alone (train_epoch)
            if self._fuse_pending:
                raise _Fuse  # the rest of the epoch: one fused unit (train_epoch)
            return True
        return did

    def train_epoch(self):
        """One epoch of every trial (:meth:`TrainingGroup.train_epoch`); once the
        measurement chose ``separate``, the rest of it, and any later epoch of the job,
        is each trial's own ``TrialRun.train_epoch`` (its streams swapped in once, as
        alone), carrying the loss its batches in the group summed."""
        self._failures: dict[str, Exception] = {}
        self._sums: dict[str, list] = {}
        if self._decided and self._layout is Layout.SEPARATE:
            return self._train_apart()
        if self._fused is not None or (self._fuse_pending and self._start_fused()):
            return self._train_fused()
        try:
            outcome = super().train_epoch()
        except _Apart:
            return self._train_apart()
        except _Fuse:
            if self._start_fused():
                return self._train_fused()
            outcome = super().train_epoch(carry=self._sums)  # not fusable: on in this layout
        if not self._decided and self.runs and self._last is not None:
            self._decide(self._last)  # a short epoch: what its batches measured
        return outcome

    def _start_fused(self) -> bool:
        """Fuse the trials for the rest of the job (:class:`~.fused.FusedGroup` over the same
        runs, their optimizers' state stacked); whether it could. Not fusable after all: each
        model keeps storage of its own and the job goes on in its merged layout."""
        from .fused import FusedGroup  # fused.py imports grouped.py, as this module does

        self._fuse_pending = False
        live = {t: r for t, r in self.runs.items() if t not in self._failures}
        for run in live.values():  # last step's gradients: each step sets its own anew
            for p in run.model.parameters():
                p.grad = None
        try:
            self._fused = FusedGroup(live, self.trainer)
        except Exception as err:  # noqa: BLE001 (FusedGroup gave their storage back)
            self.choice["fused_from"] = f"the next segment: fusing failed here ({err})"[:300]
            return False
        self.choice["fused_from"] = f"batch {next(iter(live.values())).batch} of this segment"
        return True

    def _train_fused(self) -> dict[str, Any]:
        """The rest of the epoch (and the job's later epochs) in the fused unit, carrying
        each trial's loss of the batches trained here."""
        outcome: dict[str, Any] = dict(self._failures)
        outcome.update(self._fused.train_epoch(carry=self._sums or None))
        self.drop([t for t in self.runs if t not in self._fused.runs])  # failed in it
        return outcome

    def _train_apart(self) -> dict[str, Any]:
        outcome: dict[str, Any] = dict(self._failures)
        for trial, run in list(self.runs.items()):
            carried = self._sums.get(trial)
            try:
                outcome[trial] = run.train_epoch(
                    carry=(carried[0], carried[1]) if carried else None)
            except Exception as err:  # noqa: BLE001 (fails this trial only)
                outcome[trial] = err
        self.drop([t for t, o in outcome.items() if isinstance(o, Exception)])
        return outcome

    def _decide(self, batch: Any) -> None:
        """Rank the layouts from the batches measured (and copies where needed), record the
        choice and train on in the best merged layout."""
        start = time.perf_counter()
        self._decided, self._due = True, False
        speedups = self._speedups(batch)
        if speedups is None:
            return
        ranked = choose_layout(speedups)
        self.choice.update(
            order=[x.value for x in ranked.order], probed=True, measured_on="first batches",
            probe_s=time.perf_counter() - start,
            speedups={k.value: v for k, v in ranked.speedups.items()})
        # the rest of the segment: fused from the next batch when it takes every trial
        # (train_epoch); else the best layout that keeps every model's values (a fused
        # choice for part of them applies from the next segment)
        if ranked.order[0] is Layout.FUSED and len(self._fusable) == 1 \
                and set(self._fusable[0]) == set(self.runs):
            self._fuse_pending = True
            return
        self._use(next((x for x in ranked.order if x is Layout.SEPARATE or x in self._plans),
                       self._layout))

    def _speedups(self, batch: Any) -> dict[Layout, float] | None:
        """Each candidate's speed-up over apart per batch: the merged ones from the batches
        timed, apart from the alone profiles or its lower bound (then ``choice["bound_s"]``),
        fused on copies unless ruled out (then ``choice["skipped"]`` says why); None when no
        batch was timed."""
        steps = {lay: min(self._times[lay] or self._warm[lay]) for lay in self._plans
                 if self._times[lay] or self._warm[lay]}
        if not steps:
            return None
        ids = list(self.runs)
        load = _median(self._loads)
        shared = min(self._shared) if self._shared else 0.0
        best = min(steps.values())
        alone = self._alone_now()
        # apart costs at least N * (shared + load): every model alone computes the shared part
        floor = probe_speedups({t: shared for t in ids}, {Layout.CSE: best}, load)
        bounded = len(alone) < len(ids) and floor.get(Layout.CSE, 0.0) >= MARGIN * BOUND_SAFETY
        outer = ckpt.native_rng()
        try:
            early = dict(self._alone_s)  # profiled before the first step, if it was
            if (len(alone) < len(ids) and not bounded) or early:
                # profiled now, next to the steps it is compared with (a shared machine's
                # load moves between the first batch and this one): the least of the two
                self._to_profile = set(self._want_alone) & set(self.runs)
                self._profile(batch)  # on copies, RNG streams restored
                self._alone_s.update({t: min(s, self._alone_s.get(t, s))
                                      for t, s in early.items()})
                alone = self._alone_now()
            estimate = {t: alone.get(t, shared) for t in ids}
            skipped = ""
            if self._fusable:
                device = next(iter(self.runs.values())).device
                frozen = FUSED_CPU_BOUND * shared * sum(len(u) for u in self._fusable)
                apart = sum(estimate.values()) + (len(ids) - 1) * load
                # A fused step pays each model's own share of a grouped step too (its
                # training_step through a proxy, its RNG streams): at least what the CSE step
                # costs beyond the models' steps alone and the shared part.
                per_model = (steps[Layout.CSE] - sum(estimate.values()) - shared
                             if Layout.CSE in steps and not bounded else 0.0)
                if device.type == "cpu" and frozen >= best:
                    skipped = f"fused not measured: its frozen parts alone {frozen:.3f}s"
                elif PER_MODEL_BOUND * per_model >= min(best, apart):
                    skipped = (f"fused not measured: a grouped step's per-model work alone "
                               f"{per_model:.3f}s")
                elif self._step_times is None:
                    skipped = "fused not measured: the group was given no way to time copies"
                else:  # stopped at its warm-up when far slower than the best so far
                    fused = self._step_times(ids, self._models, self.runs, self.trainer,
                                             self._data_key, [Layout.FUSED], self._fusable,
                                             estimate, batch, min(best, apart))
                    steps.update(fused)
        finally:
            ckpt.set_native_rng(outer)
        self.choice["steps_s"] = {k.value: v for k, v in steps.items()}  # per batch, all N
        if bounded:  # apart was not profiled: the speed-ups are lower bounds
            self.choice["bound_s"] = shared
        if skipped:
            self.choice["skipped"] = skipped
        return probe_speedups(estimate, steps, load)
