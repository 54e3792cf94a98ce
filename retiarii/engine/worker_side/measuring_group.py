"""Measuring a candidate group's layouts on the segment's real first batches (issue #13 item 3).

The first grouped job of a group key and device that has a choice to make (``cse`` or
``batching``, ``fused`` or not, or apart) trains its first batches in the candidates in
turn, on the trials' own models, and times them: those batches are training that happens
anyway, so what the measurement costs is only the difference between the layouts over a few
batches, not a probe paid on top of the segment. CSE and batching train each model as
training it alone does (bit for bit on the CPU: docs/optimization.md), so a segment measured
in them alone has the losses and checkpoints of separate training (``tests/test_measuring.py``).

**Fused first.** A group of one architecture (one fused unit of every trial) whose CSE plan
shares nothing frozen measures fused first, on its own models (:attr:`MeasuringGroup.
fuse_first`): CSE could save only the loader there, and a merged step of such models costs
at least ``measuring_speedups.CSE_FLOOR`` of their steps alone, so CSE's speed-up has an
upper bound; when fused measures above it (and above apart) fused goes on from batch 0 and
CSE is never built, else the models are unfused and CSE is measured on the next batches.
Such a group's first batches train fused: its values are separate training's within the
fused tolerance whatever the choice (what ``fuse="auto"`` admits; ``fuse=False`` keeps them
bit for bit). Its first fused step is guarded: when every trial fails in it before the
fused optimizer steps, it is undone exactly (:mod:`.fused_undo`) and the batch trains again
in CSE; fused is then no candidate.

What the real batches do not measure is bounded or measured on copies
(:mod:`.measuring_speedups`): apart from a lower bound (every model alone computes the shared
frozen part the batches time) or one profile per architecture on copies, fused on copies
(:func:`~.group_layouts.step_times`) unless its bounds rule it out.

Schedule: one warm-up batch per candidate, then :data:`TIMED` timed batches each (the merged
ones interleaved: a machine whose load drifts moves all of them alike; fused on its own,
first); the decision comes before the next batch, or at the end of the epoch when the epoch
is shorter. The rest of the segment trains in the best layout (``cse``, ``batching``,
``fused`` when it fuses every trial into one unit, or, for ``separate``, each model's own
``TrialRun.train_epoch``, carrying its loss so far). A ``fused`` choice made after merged
batches fuses the same runs from the next batch (from that batch on the values are those of
fused training, within its tolerance, as any fused segment's); where the real models cannot
fuse (sharing a frozen module after CSE) the segment goes on in its merged layout. A choice
of ``fused`` for part of the trials applies from the next segment.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...optim import build_group, unfuse
from ...optim.cost import Layout, choose_layout
from ...optim.plan import LogicalPlan, Role
from ..storage import checkpoint as ckpt
from .fused_group import fused_backward, fused_step, fused_unit
from .fused_undo import FusedUndo
from .training_group import TrainingGroup, sync_device
from .compute_clock import compute_clock
from ..jobs.reports import UnitChoice, UnitReport
from .measuring_math import judged_steps, median as _median
from .measuring_speedups import Profiles, Timed, fused_first_speedups, merged_speedups

__all__ = ["ABORT_REAL", "ABORT_REAL_FUSED_GPU", "MeasuringGroup", "TIMED"]

# Timed batches per merged candidate, after one warm-up each (the least is kept: a machine's
# other work only adds).
TIMED = 2
# A candidate whose first timed batch takes over this many times apart's batch gets no more:
# it could not win. A warm-up never decides (c512's took 2 s against 33 ms apart).
ABORT_REAL = 2.0
# The same for a fused batch on a GPU (as layouts.ABORT allows fused copies there).
ABORT_REAL_FUSED_GPU = 4.0


class _Apart(Exception):
    """Raised out of the group's batch loop when the measurement chose ``separate``."""


class MeasuringGroup(TrainingGroup):
    """A grouped unit that measures its candidate layouts on its first real batches, then
    decides the group key's layout (see the module docstring).

    Example::

        group = MeasuringGroup({Layout.CSE: cse_plan, Layout.BATCHING: batched_plan}, runs,
                               trainer, models=models, fusable=[("a", "b")], data_key=key,
                               alone_s={}, want_alone=["a", "c"], choice=choice)
        group.train_epoch()       # group.choice.order, .speedups are filled in

    Args:
        plans: merged layout -> the group's plan in it (each covering every run), the first
            the one it starts in (unless it starts fused: :attr:`fuse_first`).
        runs, trainer: as for :class:`~.grouped.TrainingGroup`.
        models: trial -> its model (IR), for the fused candidate on copies.
        fusable: the trials that fuse under ``FUSED`` (empty: fusion is no candidate).
        data_key: what the trials share.
        alone_s: trial -> its step time alone, already known (not measured again).
        want_alone: the trials to profile alone when the bound does not decide (one per
            architecture; :attr:`twins` spreads their times).
        choice: the job's :class:`~..jobs.reports.UnitChoice` (``group_units``); the group
            holds it (:attr:`choice`), filled in when decided.
        step_times: how fused is timed on copies (``layouts.step_times``, handed in:
            layouts imports this module); None: fusion is never measured.
    """

    def __init__(self, plans: Mapping[Layout, LogicalPlan], runs: Mapping, trainer: Any, *,
                 models: Mapping, fusable: list[tuple[str, ...]], data_key: str,
                 alone_s: Mapping[str, float], want_alone: list[str], choice: UnitChoice,
                 step_times: Any = None):
        self._step_times = step_times
        self._plans = dict(plans)
        first = next(iter(self._plans))
        trials = {m.trial_id for m in self._plans[first].models}
        cse = self._plans.get(Layout.CSE)
        shares_frozen = cse is not None and any(cse.nodes[k].role is Role.FROZEN
                                                for k in cse.shared)
        # Fused on the real batches, first: one architecture (one fused unit of every
        # trial) whose CSE plan shares nothing frozen, so CSE can gain only the loader and
        # what CSE_FLOOR leaves; fused on copies otherwise (a shared frozen part is computed
        # once in CSE and K times fused: its time, measured in CSE, may rule fusion out).
        self.fuse_first = (step_times is not None and set(self._plans) == {Layout.CSE}
                           and not shares_frozen and len(fusable) == 1
                           and set(fusable[0]) == trials)
        self._fopt: Any = None  # the fused optimizer while the layout is FUSED
        self._guard: FusedUndo | None = None  # what the first fused step may have to undo
        self._fused_ok = False  # a fused step of these runs succeeded
        self._fused_at: int | None = None  # the batch fused training began at
        self._moved = False  # this step's fused optimizer step ran (nothing left to undo)
        self._layout = Layout.FUSED if self.fuse_first else first
        self._built = False  # whether the group module is the current layout's
        self._plan_first = first
        self._fallback = first  # where a fused layout that cannot fuse goes instead
        self._modules: dict[Layout, Any] = {}  # merged layout -> its module, once built
        self._schedule: list[Layout] = []  # set below (empty: constructing)
        super().__init__(self._plans[first], runs, trainer, profile=[])
        if not self.fuse_first:
            self._modules[first] = self._group
        self._models, self._fusable, self._data_key = models, fusable, data_key
        self._known = dict(alone_s)
        self._want_alone = list(want_alone)
        self.choice = choice
        # one warm-up batch per candidate, then TIMED timed ones each, interleaved; fused
        # first on its own (fusing and unfusing between batches would cost copies)
        self._schedule = ([Layout.FUSED] if self.fuse_first else list(self._plans)) * (1 + TIMED)
        self._position = 0
        self._stepped: set[Layout] = set()  # the layouts that have had their warm-up batch
        self._times: dict[Layout, list[float]] = {lay: [] for lay in [*self._plans, Layout.FUSED]}
        self._warm: dict[Layout, list[float]] = {lay: [] for lay in [*self._plans, Layout.FUSED]}
        self._shared: list[float] = []  # the shared cell's time per batch (CSE batches)
        self._due, self._decided = False, False
        self._last: Any = None
        self._probe_s = 0.0  # deciding (profiles on copies included)
        self._measured_to, self._warm_after = None, 0  # steps before the decision; 1: a warm-up
        # A plan that shares no frozen layer cannot bound apart: the alone profiles are taken
        # before the first step (a candidate far slower stops at its first timed batch).
        if cse is not None and not shares_frozen:
            missing = set(self._want_alone) - set(self._known)
            self._to_profile = missing & set(self.runs)

    @property
    def layout(self) -> Layout:
        """The layout it trains in now."""
        return self._layout

    def report(self) -> UnitReport:
        """:meth:`TrainingGroup.report`; once decided, judged on the chosen layout's own
        batches (:func:`~.measuring_math.judged_steps`)."""
        out = super().report()
        if self._measured_to is not None:
            out = replace(out, **judged_steps(self._steps, self._measured_to, self._warm_after,
                                              self._times.get(self._layout) or ()))
        return out

    # ---- building and switching layouts --------------------------------------------------

    def _build(self) -> nn.Module:
        """The module of the current layout and runs. Fused before the first fused batch is
        due: nothing yet (the alone profiles copy the models unfused first); fusing that
        fails goes back to the merged layout it left, or the first (:meth:`_fusion_failed`)."""
        if self._layout is Layout.FUSED:
            if not self._schedule:  # constructing: fused when first used
                return nn.Module()
            module = self._build_fused()
            if module is not None:
                return module
            if self._modules.get(self._layout) is not None:  # fell back to a built one
                self._built = True
                return self._modules[self._layout]
        self._fopt = None
        self._built = self._layout is not Layout.SEPARATE
        plan = self._plans[self._layout] if self._layout in self._plans else self._plan
        return build_group(plan.restrict(self.runs), {t: r.model for t, r in self.runs.items()})

    def _build_fused(self) -> nn.Module | None:
        """The runs fused, or None when they cannot fuse (:meth:`_fusion_failed`). Before
        the first fused step of these runs, what fusing replaces is kept (:class:`FusedUndo`)."""
        for run in self.runs.values():  # a merged step's gradients: each step sets its own
            for tensor in itertools.chain(run.model.parameters(), run.model.buffers()):
                tensor.grad = None
        undo = None if self._fused_ok else FusedUndo(self.runs)
        try:
            module, self._fopt = fused_unit(self.runs)
        except Exception as err:  # noqa: BLE001 (fused_unit gave their storage back)
            self._fusion_failed(f"fusing failed here ({err})")
            return None
        self._built = True
        if not self._fused_ok:
            self._guard = undo
        return module

    def _use(self, layout: Layout) -> None:
        """Train the next batches in ``layout`` (its module built over the current runs);
        ``SEPARATE``: each trial's own ``train_epoch`` (:meth:`train_epoch`)."""
        if layout is self._layout and (self._built or layout is Layout.SEPARATE):
            return
        if self._layout is Layout.FUSED and self._built:
            self._leave_fused()
        if layout is Layout.FUSED:  # where to go if it cannot fuse: the layout it leaves
            self._fallback = self._layout if self._layout in self._plans else self._plan_first
        self._layout = layout
        if layout is Layout.SEPARATE:
            self.trained_layout = layout.value
            return
        if layout is Layout.FUSED:
            self._group = self._build()  # falls back to a merged layout if it cannot fuse
            if self._layout is not Layout.FUSED:
                self._modules[self._layout] = self._group
                self._plan = self._plans[self._layout]
            else:  # fused training (re)starts at this batch
                self._fused_at = next(iter(self.runs.values())).batch
        else:
            if self._modules.get(layout) is None:
                self._modules[layout] = self._build()
            self._plan, self._group = self._plans[layout], self._modules[layout]
            self._built = True
        self.trained_layout = self._layout.value

    def _leave_fused(self) -> None:
        """Every model and optimizer storage of its own again (:func:`unfuse`)."""
        for run in self.runs.values():
            unfuse(run.model, run.optimizer)
        self._fopt, self._guard, self._built = None, None, False

    def _fusion_failed(self, why: str) -> None:
        """Fusing these runs failed: fused is no candidate any more; the layout goes back to
        the merged one it left, or the first (measured next, when fused was first)."""
        self.choice = replace(self.choice, fused_failed=why[:300])
        self._fopt, self._guard = None, None
        self._layout, self._built = self._fallback, False
        rest = [x for x in self._schedule[self._position:] if x is not Layout.FUSED]
        if not any(x in self._plans for x in rest) and not self._stepped & set(self._plans):
            rest += list(self._plans) * (1 + TIMED)
        self._schedule = self._schedule[:self._position] + rest
        self._due = self._position >= len(self._schedule)

    def drop(self, trials) -> None:
        """:meth:`TrainingGroup.drop`; fused, the trials leaving get storage of their own
        first (the others are fused again); the other candidates' modules are rebuilt when
        used."""
        gone = set(trials) & set(self.runs)
        if not gone:
            return
        if self._layout is Layout.FUSED and self._built:
            for t in gone:
                unfuse(self.runs[t].model, self.runs[t].optimizer)
        super().drop(gone)
        self._modules = {} if self._layout in (Layout.FUSED, Layout.SEPARATE) else {
            self._layout: self._group}

    def _optimize(self, losses: Mapping[str, torch.Tensor]) -> dict[str, Exception]:
        if self._fopt is None:
            return super()._optimize(losses)
        if not losses:
            return {}
        fused_backward(self._fopt, losses)
        self._moved = True
        return fused_step(self._fopt, self.runs, losses)

    # ---- the measured batches --------------------------------------------------------------

    def _step(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception]:
        self._sums = sums  # the epoch's losses so far, carried when it ends apart
        failed = self._step_in(batch, sums)
        self._failures.update(failed)  # reported with the epoch's outcome
        return failed

    def _step_in(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception]:
        if self._position >= len(self._schedule):
            failed = self._guarded(batch, sums)
            if failed is None:  # fused undone: this batch again, in the layout it fell back to
                self._use(self._layout)
                return self._step_in(batch, sums)
            return failed
        layout = self._schedule[self._position]
        self._use(layout)
        if self._layout is not layout:  # fused that cannot fuse: the schedule moved on
            return self._step_in(batch, sums)
        device = next(iter(self.runs.values())).device
        sync_device(device)
        t0 = (clock := compute_clock(device))()
        failed = self._guarded(batch, sums)
        if failed is None:  # fused undone: this batch again, in the next layout
            return self._step_in(batch, sums)
        sync_device(device)
        seconds = clock() - t0
        warm = layout not in self._stepped
        self._stepped.add(layout)
        if not failed:  # a step with a failed trial measured fewer models
            (self._warm if warm else self._times)[layout].append(seconds)
        apart = self._apart_s()
        abort = (ABORT_REAL_FUSED_GPU if layout is Layout.FUSED and device.type != "cpu"
                 else ABORT_REAL)
        if not warm and apart is not None and seconds > abort * apart:
            # far slower than apart on a timed batch: it cannot win; no more batches for it
            rest = self._schedule[self._position + 1:]
            self._schedule = self._schedule[:self._position + 1] + [
                x for x in rest if x is not layout]
        self._position += 1
        self._last = batch
        self._due = self._position >= len(self._schedule)
        return failed

    def _guarded(self, batch: Any, sums: dict[str, list]) -> dict[str, Exception] | None:
        """One batch of every trial; the first fused step is undone when every trial failed
        in it before the fused optimizer stepped (then None: fused is no candidate, and the
        batch runs again in another layout)."""
        guard = self._guard if self._layout is Layout.FUSED else None
        if guard is None:
            return TrainingGroup._step(self, batch, sums)
        guard.before_step(self.runs)
        self._moved = False
        failed = TrainingGroup._step(self, batch, sums)
        self._guard = None
        if failed and set(failed) >= set(self.runs) and not self._moved:
            guard.undo(self.runs)
            self._fusion_failed(f"fused training failed on its first batch ("
                                f"{next(iter(failed.values()))})")
            return None
        self._fused_ok = True
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
        """One batch of every trial apart, each with its own loader (None: an alone unknown)."""
        alone = self._alone_now()
        if len(alone) < len(self.runs):
            return None
        load, produce = _median(self._loads), getattr(self, "produce_s", 0.0)
        start = getattr(self, "start_s", 0.0)  # compared with a step that pays none of it
        return sum(max(s + load, produce) + start for s in alone.values()) - load - start

    def _ahead(self, batch: Any) -> Any:
        """While measuring in CSE: the shared cell computed here, timed (what every model
        alone computes too: the lower bound of apart). Exact: the same call the group's
        forward makes (``GroupModule.forward``), under ``no_grad`` as there."""
        if self._position >= len(self._schedule) or self._layout is not Layout.CSE:
            return None
        group, device = self._group, next(iter(self.runs.values())).device

        def common(inputs: tuple) -> tuple:
            sync_device(device)
            t0 = (clock := compute_clock(device))()
            with torch.no_grad():
                out = group.shared(*inputs)
            sync_device(device)
            self._shared.append(clock() - t0)
            return out

        return common

    def _before_step(self, batch: Any) -> bool:
        did = super()._before_step(batch)
        if self._due and not self._decided and self.runs:
            self._decide(batch)
            if self._decided and self._layout is Layout.SEPARATE:
                raise _Apart  # the rest of the epoch: each model alone (train_epoch)
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
        try:
            outcome = super().train_epoch()
        except _Apart:
            return self._train_apart()
        if not self._decided and self.runs and self._last is not None:
            self._decide(self._last, final=True)  # a short epoch: what its batches measured
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

    def _decide(self, batch: Any, final: bool = False) -> None:
        """Rank the layouts from the batches measured (and copies where needed), record the
        choice and train on in the best. A merged layout not measured yet whose bound ranks
        it first (fused measured first: :attr:`fuse_first`) is measured on the next batches
        instead, unless the epoch has ended (``final``: decided on what was measured)."""
        clock = compute_clock(next(iter(self.runs.values())).device)  # as the worker's setup
        start = clock()
        self._due = False
        speedups = self._speedups(batch)
        if speedups is None:
            self._decided = True
            return
        ranked = choose_layout(speedups)
        unmeasured = [x for x in self._plans if x not in self._stepped]
        if ranked.order[0] in unmeasured and not final:
            self._schedule += unmeasured * (1 + TIMED)  # its figure is a bound: measure it
            self._probe_s += clock() - start
            return
        self._decided, self._measured_to = True, len(self._steps)  # measured: not judged
        bounds = {x.value: speedups.pop(x) for x in unmeasured if x in speedups}
        if bounds:  # the most they could reach: not measured, ranked as unknown
            self.choice = replace(self.choice, bounds=bounds)
            ranked = choose_layout(speedups)
        # the rest of the segment: the best layout here (fused for every trial: from the
        # next batch, or on from the fused batches measured; fused for part of them applies
        # from the next segment)
        best = next((x for x in ranked.order if x is Layout.SEPARATE or x in self._plans
                     or (x is Layout.FUSED and self._fuses_all())), self._layout)
        self._warm_after = 0 if best in self._stepped else 1  # its first batch: a warm-up
        self._use(best)
        if best is Layout.FUSED:
            self.choice = replace(self.choice, fused_from=(
                f"batch {self._fused_at} of this segment" if self._layout is Layout.FUSED else
                f"the next segment: {self.choice.fused_failed or 'fusing failed here'}"
            )[:300])
        self.choice = replace(
            self.choice, order=tuple(x.value for x in ranked.order), probed=True,
            measured_on="first batches", probe_s=self._probe_s + clock() - start,
            speedups={k.value: v for k, v in ranked.speedups.items()})

    def _fuses_all(self) -> bool:
        """Whether fusion takes every trial of the group in one unit (then fused trains
        here; for part of them, from the next segment), and has not failed here."""
        return (len(self._fusable) == 1 and set(self._fusable[0]) >= set(self.runs)
                and self.choice.fused_failed is None)

    def _speedups(self, batch: Any) -> dict[Layout, float] | None:
        """Each candidate's speed-up over apart per batch (:mod:`.measuring_speedups`), the
        choice recording its steps, apart's bound (``choice.bound_s``) and why fused was not
        measured (``choice.skipped``). None when no batch was timed (a warm-up is no
        evidence: the key stays undecided)."""
        steps = {lay: min(self._times[lay]) for lay in self._times if self._times[lay]}
        if not steps:
            return None
        timed = Timed(steps, frozenset(self._plans), tuple(self.runs), _median(self._loads),
                      min(self._shared) if self._shared else 0.0, getattr(self, "produce_s", 0.0),
                      getattr(self, "start_s", 0.0), tuple(tuple(u) for u in self._fusable),
                      next(iter(self.runs.values())).device.type, self.choice.fused_failed)
        time_fused = None if self._step_times is None else (
            lambda estimate, limit: self._step_times(
                list(self.runs), self._models, self.runs, self.trainer, self._data_key,
                [Layout.FUSED], self._fusable, estimate, batch, limit))
        profiles = Profiles(self._alone_now, dict(self._alone_s),  # early: before the 1st step
                            lambda early: self._reprofile(batch, early), time_fused)
        if not set(steps) & set(self._plans):  # fused first (the profiles restore the streams)
            got = fused_first_speedups(timed, profiles)
        else:
            outer = ckpt.native_rng()
            try:
                got = merged_speedups(timed, profiles)
            finally:
                ckpt.set_native_rng(outer)
        self.choice = replace(
            self.choice, steps_s=got.steps_s,
            bound_s=got.bound_s if got.bound_s is not None else self.choice.bound_s,
            skipped=got.skipped or self.choice.skipped)
        return got.speedups

    def _reprofile(self, batch: Any, early: Mapping[str, float]) -> None:
        """The trials to profile alone, profiled now (on copies, RNG streams restored); each
        keeps the least of this and its ``early`` time."""
        self._to_profile = set(self._want_alone) & set(self.runs)
        self._profile(batch)
        self._alone_s.update({t: min(s, self._alone_s.get(t, s)) for t, s in early.items()})
