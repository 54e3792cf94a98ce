"""The worker's half of choosing a layout: how one candidate group of a grouped job trains.

A candidate group (tasks with one space, trainer, data key and start:
:func:`~.group_candidates.group_tasks`) can train in one of the
:class:`~retiarii.optim.cost.Layout` s: each model alone (``separate``), one CSE-planned
group (``cse``), the same with the batching pass (``batching``), or its same-architecture
trials fused and the others in the best of the rest (``fused``). :func:`group_units` builds
the units of the layout the job's :class:`~.job_contract.GroupOrder` (``told``) asks for:

- ``told.layouts[device]``: a decision the runner already holds for this group key on this
  kind of device (from an earlier job, or read back from the plans table on a resume): its
  ``order`` is applied, nothing is measured again;
- else, when the job may measure (``told.profile``) and there is a choice to make
  (``fuse="auto"`` with two or more trials of one architecture, or ``batching="auto"`` with a
  plan the batching pass changes), :func:`probe` measures the candidates on the group's first
  batch: each layout is built over **copies** of the trials' models and optimizers and steps a
  few times, each model alone too, under saved RNG states (what the trials train is
  unchanged), and :func:`~retiarii.optim.cost.choose_layout` ranks them;
- else the forced settings (``fuse=True``, ``batching=True``) or the default (CSE, and fusion
  under ``fuse="auto"``, measured over the segment afterwards).

Every unit's report (a :class:`~..jobs.reports.UnitReport`) then says which layout it trained
in (``layout``) and the choice (a :class:`~..jobs.reports.UnitChoice`: device, order, measured
speed-ups, whether this job measured them, the layouts the device model chose), which the
runner keeps per (group key, device) in the plans table.
Whatever the layout, each trial's results are what that layout computes (all proven equal to
training alone: docs/optimization.md); a layout is chosen before the segment's first step.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import time
from dataclasses import replace
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...optim import fusion_key
from ...optim.cost import Layout, choose_layout, probe_speedups
from ...optim.device_model import CSE_MARGIN, CSE_TAKE, fuses_places
from ...optim.passes import LayoutPasses, PassManager, get_pass
from ...optim.plan import Role
from ...rng import swapped_in
from ..storage import checkpoint as ckpt
from .fused_group import FusedGroup, fusable_sets
from ..jobs.contract import GroupOrder, HeldLayout
from ..jobs.reports import UnitChoice, UnitReport
from .auto_layout import resolve
from .group_candidates import plan_group
from .training_group import MAX_REPEATS, MIN_TIMED_S, TrainingGroup, step_seconds
from .measuring_group import MeasuringGroup
from ...training import to_device as _to_device
from .compute_clock import compute_clock

__all__ = ["ABORT", "ABORT_CPU", "device_label", "group_units", "job_passes", "probe", "step_times"]

_END = object()
_MERGED = (Layout.CSE, Layout.BATCHING)  # the layouts of the trials that do not fuse


def device_label(device: torch.device) -> str:
    """The kind of device a choice holds for: ``"cpu"``, or ``"cuda:"`` and the GPU's name
    (two GPUs of one model share their measurements)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


class _Copy:
    """A trial's model and optimizer copied, in the interface a group reads of a
    :class:`~.trial_run.TrialRun`: stepping it changes nothing of the trial's."""

    scheduler, interval = None, "epoch"  # an LR scheduler's step costs next to nothing

    def __init__(self, run: Any):
        self.model, self.optimizer = copy.deepcopy((run.model, run.optimizer))  # one memo
        self.hparams, self.device = run.hparams, run.device
        self.epoch, self.batch = run.epoch, run.batch
        # the trial's streams as they are (a snapshot: what the copy draws stays here)
        self._rng = getattr(run, "_rng", None)

    def _own_rng(self):
        # Swapped in per step as a grouped step swaps each trial's: that swap is part of
        # what a layout costs per model (a few tiny models' steps cost little more), so a
        # copy that skipped it measured fused 16 MLPs 1.3x faster than their real segment.
        if self._rng is None:
            return contextlib.nullcontext()
        return swapped_in(self)


def _first_batch(trainer: Any, run: Any) -> tuple[Any, float] | None:
    """The segment's first batch and the loader's time for one batch (the second's, when
    there is one: the first also pays starting the loader); None for an empty epoch."""
    batches = iter(itertools.islice(iter(trainer.train_dataloader(run.hparams, run.epoch)),
                                    run.batch, None))
    t0 = time.perf_counter()
    first = next(batches, _END)
    t1 = time.perf_counter()
    if first is _END:
        return None
    second = next(batches, _END)
    load = t1 - t0 if second is _END else time.perf_counter() - t1
    return _to_device(first, run.device), load


def _units_of(layout: Layout, ids: list[str], models: Mapping, runs: Mapping, trainer: Any,
              data_key: str, fusable: list[tuple[str, ...]], rest: Layout,
              profile: Any, make_group: Callable = TrainingGroup,
              passes: LayoutPasses = LayoutPasses()) -> tuple[list[TrainingGroup], dict[str, str]]:
    """The groups of ``layout`` over ``ids`` and the trials it leaves alone (-> why).
    ``rest``: the layout of the trials that do not fuse under ``FUSED``; ``passes``: what
    each merged layout's plan runs."""
    groups: list[TrainingGroup] = []
    lone: dict[str, str] = {}
    if layout is Layout.SEPARATE:
        return groups, {t: "separate: the layout chosen for this group" for t in ids}
    todo = list(ids)
    if layout is Layout.FUSED:
        for members in fusable:
            try:
                groups.append(FusedGroup({t: runs[t] for t in members}, trainer, profile=profile))
            except Exception:  # noqa: BLE001 (not fusable after all: grouped unfused instead)
                continue
        fused = {t for g in groups for t in g.trials}
        todo = [t for t in ids if t not in fused]
        if len(todo) == 1:
            return groups, {todo[0]: "the others of its group train fused (another architecture)"}
        if rest is Layout.SEPARATE:
            return groups, {t: "separate: the layout chosen for this group" for t in todo}
        layout = rest
    if not todo:
        return groups, lone
    plan = plan_group({t: models[t] for t in todo}, data_key, {t: runs[t].hparams for t in todo},
                      passes=passes.of(layout))
    for members in plan.groups():
        if len(members) == 1:
            lone[members[0]] = "the plan gives it no input in common with the others"
        else:
            groups.append(make_group(plan.restrict(members), runs, trainer, profile))
    return groups, lone


def probe(ids: list[str], models: Mapping, runs: Mapping, trainer: Any, data_key: str,
          candidates: list[Layout], fusable: list[tuple[str, ...]],
          alone_s: Mapping[str, float], passes: LayoutPasses = LayoutPasses()
          ) -> tuple[dict[Layout, float], dict[str, float]] | None:
    """Measure ``candidates`` on the group's first batch: (layout -> speed-up over apart,
    the alone step times it measured), or None when there is no batch. Each layout steps
    copies of the trials (a warm-up, then the least of a few timed steps); a layout that fails
    to build or step is left unmeasured. The process's RNG streams are restored after.

    Args:
        ids: the candidate group's trials; models, runs: their models (IR) and runs.
        trainer, data_key: what they share.
        candidates: the layouts to measure (``SEPARATE`` is measured by the alone steps).
        fusable: the trials that fuse under ``FUSED``.
        alone_s: alone step times already known (not measured again).
        passes: what each merged layout's plan runs.
    """
    outer = ckpt.native_rng()
    try:
        first = _first_batch(trainer, runs[ids[0]])
        if first is None:
            return None
        batch, load = first
        measured: dict[str, float] = {}
        for t in ids:
            if alone_s.get(t) is None and t not in measured:
                measured[t] = step_seconds(trainer, runs[t], batch, repeats=1)  # on copies
                # one architecture, one step time: its twins are not measured again
                measured.update(_twins(t, ids, models, measured[t], alone_s))
        alone = {t: alone_s.get(t, measured.get(t)) for t in ids}
        apart = sum(alone.values()) + (len(ids) - 1) * load  # a step's worth, apart
        steps = step_times(ids, models, runs, trainer, data_key, candidates, fusable, alone,
                           batch, apart, passes)
        return probe_speedups(alone, steps, load), measured
    finally:
        ckpt.set_native_rng(outer)


def step_times(ids: list[str], models: Mapping, runs: Mapping, trainer: Any, data_key: str,
               candidates: list[Layout], fusable: list[tuple[str, ...]],
               alone: Mapping[str, float], batch: Any, best_s: float,
               passes: LayoutPasses = LayoutPasses()) -> dict[Layout, float]:
    """Seconds of one step of every trial of the group in each of ``candidates`` on
    ``batch``, on **copies** of the trials' models and optimizers (a warm-up, then one timed
    step); a candidate whose warm-up takes over :data:`ABORT` times ``best_s`` (or the best
    measured so far) is left out, and so is one that fails to build or step. The caller
    saves and restores the RNG streams; each layout's are restored here too.

    Args:
        alone: every trial's step time alone (for the trials a layout leaves alone).
        best_s: the best step of the group known so far (apart, or a merged layout).
        passes: what each merged layout's plan runs.
    """
    outer = ckpt.native_rng()
    steps: dict[Layout, float] = {}
    for layout in candidates:
        if layout is Layout.SEPARATE:
            continue
        copies = {t: _Copy(runs[t]) for t in ids}
        groups: list = []
        try:
            groups, lone = _units_of(layout, ids, models, copies, trainer, data_key,
                                     fusable, Layout.CSE, None, passes=passes)
            # a layout whose warm-up is far slower than the best so far is not timed
            abort = ABORT_CPU if torch.device(runs[ids[0]].device).type == "cpu" else ABORT
            limit = abort * min([best_s, *steps.values()]) / max(len(groups), 1)
            times: list[float] = []
            for group in groups:  # stop at the first group over the limit
                seconds = _group_step_seconds(group, batch, limit=limit)
                if seconds is None:
                    break
                times.append(seconds)
            else:
                steps[layout] = sum(times) + sum(alone[t] for t in lone)
        except Exception:  # noqa: BLE001 (this layout stays unmeasured)
            pass
        finally:
            ckpt.set_native_rng(outer)
            del copies  # one layout's copies at a time (device memory)
            groups = []
    return steps


def _twins(trial: str, ids: list[str], models: Mapping, seconds: float,
           known: Mapping[str, float]) -> dict[str, float]:
    """``seconds`` for every other trial of ``ids`` with ``trial``'s architecture (an equal
    :func:`~retiarii.optim.fusion_key`: the same operations and shapes, so the same step
    time alone) whose time is not ``known``."""
    key = fusion_key(models[trial])
    return {t: seconds for t in ids if t != trial and known.get(t) is None
            and fusion_key(models[t]) == key}


# A candidate layout whose warm-up step takes this many times the best step measured so far
# is not timed further (left unmeasured: ranked after the measured ones). A first step pays
# for allocations and kernel selection, seldom more than twice a later one; a layout this
# much slower could not win, and timing it costs most of the probe (K frozen trunks fused
# where CSE computes one).
ABORT = 4.0
# The same on a CPU, where no kernel is selected or compiled at the first step (allocations
# and optimizer state only): a warm-up over twice the best step cannot win.
ABORT_CPU = 2.0


def _group_step_seconds(group: TrainingGroup, batch: Any, repeats: int = 1,
                        limit: float | None = None) -> float | None:
    """One batch of a group (every trial's forward, loss, backward and optimizer step): a
    warm-up step, then the least of ``repeats`` (the machine's other work only adds; one by
    default: each costs a step of every model, and a segment measured slower reverts a
    choice a noisy step got wrong; more for a short step, as ``grouped.step_seconds``
    does); None when the warm-up alone took over ``limit``."""
    sums = {t: [torch.zeros((), device=r.device), 0] for t, r in group.runs.items()}
    device = next(iter(group.runs.values())).device
    times: list[float] = []
    clock = compute_clock(device)
    while len(times) < 1 + repeats or (sum(times[1:]) < MIN_TIMED_S and len(times) < 1 + MAX_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        failed = group._step(batch, sums)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if failed:
            raise next(iter(failed.values()))
        times.append(clock() - t0)
        if limit is not None and times[0] > limit:
            return None
    return min(times[1:])


def _measured_matters(given: HeldLayout | None) -> bool:
    """Whether a group's layout can depend on the ``"auto"`` passes' layout (``BATCHING``)
    being a candidate: always unless a choice is given whose order ranks it after
    ``separate`` or ``cse`` (one of those is then used before it; planning the passes costs
    milliseconds a job)."""
    if given is None:
        return True
    for layout in given.order:
        if layout == Layout.BATCHING.value:
            return True
        if layout in (Layout.SEPARATE.value, Layout.CSE.value):
            return False
    return True


def _live_plans(merged: list[Layout], ids: list[str], models: Mapping, runs: Mapping,
                data_key: str, dedicated: bool, passes: LayoutPasses) -> dict[Layout, Any] | None:
    """Merged layout -> the group's plan in it, when the candidates can be measured on the
    real first batches (:class:`~.measuring.MeasuringGroup`): a plain group (not one with
    a dedicated device: ``GroupOrder.dedicated``), every candidate plan one group of every
    trial; else None (the probe on copies measures them)."""
    if dedicated:
        return None
    plans = {}
    for layout in merged:
        plan = plan_group({t: models[t] for t in ids}, data_key,
                          {t: runs[t].hparams for t in ids}, passes=passes.of(layout))
        if plan.groups() != [tuple(ids)]:
            return None
        plans[layout] = plan
    return plans


def group_units(told: GroupOrder, ids: list[str], models: Mapping, runs: Mapping, trainer: Any,
                data_key: str, profile: list[str] | None,
                alone: Callable[[str, str, dict], Any],
                make_group: Callable = TrainingGroup) -> list:
    """The units of one candidate group (two or more trials) in the layout ``told`` asks
    for or the probe chooses (see the module docstring).

    Args:
        told: the job's :class:`~.job_contract.GroupOrder` (``fuse``, ``passes``, ``unfused``,
            ``layouts``, ``alone_s``,
            ``alone_by_arch``: device -> architecture (``fusion_key``) -> step time alone).
        ids, models, runs: the group's trials, their models (IR) and runs.
        trainer, data_key: what they share.
        profile: trials whose alone step time to measure (None: measure nothing).
        alone: ``alone(trial, why, report)`` -> the worker's unit training one trial alone
            (``report``: its :class:`~..jobs.reports.UnitReport`).
        make_group: ``make_group(plan, runs, trainer, profile)`` -> the unit training a merged
            group (a :class:`TrainingGroup`, or the worker's dedicated-device group).
    """
    passes = job_passes(told)
    device = device_label(runs[ids[0]].device)
    # under "auto" on a device where models differing at places never fuse (a CPU), their
    # families are not formed: finding places costs a trace of every model per job
    places = told.fuse != "auto" or fuses_places(runs[ids[0]].device)
    fusable = (fusable_sets({t: models[t] for t in ids}, told.unfused, places)
               if told.fuse in ("auto", "measure", True) else [])
    # fusion and batching under "auto": the device model's decision (layout_model.py)
    resolved = resolve(told.fuse, fusable, passes, ids, models, runs, trainer, data_key)
    fuse, fusable, passes = resolved.fuse, resolved.fusable, resolved.passes
    merged = passes.merged()
    given = told.layouts.get(device)
    if passes.measured and _measured_matters(given):
        base = plan_group({t: models[t] for t in ids}, data_key,
                          {t: runs[t].hparams for t in ids}, passes=passes.of(Layout.CSE))
        # one fused unit of every trial sharing nothing frozen measures fused first (its
        # K-model kernels batch every operation, weighted ones too): batching only their
        # weightless operations (what a GPU's rule admits) is not measured beside it
        one_unit = (fuse == "auto" and len(fusable) == 1 and set(fusable[0]) == set(ids)
                    and not any(base.nodes[k].role is Role.FROZEN for k in base.shared))
        if not one_unit and passes.worth_measuring(PassManager(passes.measured).run(base),
                                                   runs[ids[0]].device):
            merged = [Layout.CSE, Layout.BATCHING]
    # the layouts the device model chose: never judged by time (their values round unlike
    # training alone), however the unit came to train in them (measured or not)
    chosen = (((Layout.FUSED.value,) if told.fuse == "auto" else ())
              + ((Layout.BATCHING.value,) if "auto" in told.passes.values() else ())
              ) if resolved.decided else ()
    # fuse=True: the user's layout, never reverted by time either (apart would round
    # otherwise, and reruns of one seeded search would differ with the machine's load)
    choice = UnitChoice(device=device, predicted=tuple(resolved.predicted),
                        device_chosen=chosen,
                        forced=(Layout.FUSED.value,) if told.fuse is True else ())
    # One architecture, one step time alone: a trial whose architecture was measured (in
    # this job or an earlier one on this kind of device) is not measured again.
    arch = {t: fusion_key(models[t]) for t in ids}
    by_arch = dict(told.alone_by_arch.get(device) or {})
    known = dict(told.alone_s)
    by_arch.update({arch[t]: known[t] for t in ids if t in known})
    measured = {t: by_arch[arch[t]] for t in ids if known.get(t) is None and arch[t] in by_arch}
    # The default's groups that CSE cannot pay for (nothing frozen to compute once, a loader
    # too quick to matter: the device model's bound under CSE_MARGIN) train apart, nothing
    # measured: their first job measured CSE slower than apart for nothing (the demo)
    bounded = (told.fuse == "auto" and not fuse and len(merged) == 1 and given is None
               and not told.dedicated and resolved.cse_bound is not None)
    apart = bounded and merged == [Layout.CSE] and resolved.cse_bound < CSE_MARGIN
    # ... and those whose CSE gains at least CSE_TAKE whatever a measurement would say (the
    # frozen layers their prefixes hold alike computed once, one loader, against what a group
    # costs: device_model.cse_floor) take their merged layout unmeasured, as optimize=True
    # does: measuring it against apart cost workloads (b) and (d) a tenth of their search
    take = bounded and not apart and resolved.cse_floor >= CSE_TAKE
    if take:
        profile = None  # nothing to judge a segment against: the floor decided
    live = None  # merged layout -> plan, when measured on the real first batches
    if given is None and not (apart or take) and profile is not None and fuse is not True and (
            len(merged) > 1 or (fuse == "auto" and fusable) or fuse == "auto" or passes.measured
            or told.fuse == "auto"):
        # under "auto" a group with one merged layout still chooses between it and apart
        live = _live_plans(merged, ids, models, runs, data_key, bool(told.dedicated),
                           passes)
    if apart:
        order = [Layout.SEPARATE]
        choice = replace(choice, order=(Layout.SEPARATE.value, Layout.CSE.value), apart=True,
                         predicted=(
            *choice.predicted, f"{len(ids)} models: cse at most {resolved.cse_bound:.2f}x "
            f"(under {CSE_MARGIN}x: nothing frozen to share, the loader's pace): apart, "
            f"not measured"))
    elif take:
        order = [*merged, Layout.SEPARATE]
        choice = replace(choice, order=tuple(x.value for x in order), predicted=(
            *choice.predicted, f"{len(ids)} models: cse at least {resolved.cse_floor:.2f}x "
            f"(at or over {CSE_TAKE}x: frozen layers computed once, one loader): "
            f"{merged[0].value}, not measured"))
    elif live is not None:  # measured while training (measuring.py): decided after a few batches
        order = list(live)
        choice = replace(choice, order=tuple(x.value for x in order))
    elif given is not None:
        order = [Layout(x) for x in given.order]
        choice = replace(choice, order=tuple(given.order), speedups=dict(given.speedups))
    elif profile is not None and (len(merged) > 1 or (fuse == "auto" and fusable)):
        candidates = [Layout.SEPARATE, *merged] + ([Layout.FUSED] if fuse == "auto" and fusable else [])
        clock = compute_clock(runs[ids[0]].device)  # the clock the worker's setup is on
        start = clock()
        result = probe(ids, models, runs, trainer, data_key, candidates, fusable,
                       {**known, **measured}, passes)
        speedups, probed = result if result is not None else ({}, {})
        measured.update(probed)
        ranked = choose_layout(speedups)
        order = list(ranked.order)
        choice = replace(choice, order=tuple(x.value for x in order), probed=True,
                         probe_s=clock() - start,
                         speedups={k.value: v for k, v in ranked.speedups.items()})
    else:
        order = ([Layout.FUSED] if fuse in ("auto", True) else []) + merged
        choice = replace(choice, order=tuple(x.value for x in order))
    if fuse is True:  # forced: fused whatever was measured; the rest as ranked
        order = [Layout.FUSED] + [x for x in order if x is not Layout.FUSED]
    twins: dict[str, list[str]] = {}
    if profile:  # one trial per architecture is profiled; its twins get its time
        reps: dict[str, str] = {}
        for t in profile:
            if t in measured:
                continue
            rep = reps.setdefault(arch[t], t)
            if rep != t:
                twins.setdefault(rep, []).append(t)
        profile = list(reps.values())
    if live is not None:
        group = MeasuringGroup(live, runs, trainer, models=models, fusable=fusable if fuse == "auto"
                               else [], data_key=data_key, alone_s={**known, **measured},
                               want_alone=list(profile or ()), choice=choice,
                               step_times=functools.partial(step_times, passes=passes))
        group._alone_s.update({t: measured[t] for t in group.members if t in measured})
        group.twins, group.arch, group.produce_s = twins, arch, resolved.produce_s
        group.start_s = resolved.start_s
        group.trained_layout = group.layout.value
        return [group]
    usable = [x for x in order if x is Layout.SEPARATE or x in merged
              or (x is Layout.FUSED and fusable)]
    layout = usable[0] if usable else merged[0]
    rest = next((x for x in usable if x is not Layout.FUSED), merged[0])
    groups, lone = _units_of(layout, ids, models, runs, trainer, data_key, fusable, rest, profile,
                             make_group, passes)
    units: list = []
    for group in groups:
        group._alone_s.update({t: measured[t] for t in group.members if t in measured})
        group.twins, group.arch, group.produce_s = twins, arch, resolved.produce_s
        group.start_s = resolved.start_s
        kind = Layout.FUSED if isinstance(group, FusedGroup) else (
            rest if layout is Layout.FUSED else layout)
        group.trained_layout, group.choice = kind.value, choice
        units.append(group)
    for trial, why in lone.items():
        mine = {trial: measured[trial]} if trial in measured else {}
        units.append(alone(trial, why, UnitReport(
            (trial,), merged=False, reason=why, layout=Layout.SEPARATE.value, choice=choice,
            alone_s=mine, alone_by_arch={arch[t]: v for t, v in mine.items()})))
    return units


def job_passes(order: GroupOrder) -> LayoutPasses:
    """The optional passes' settings a grouped job's order carries (``order.passes``: name ->
    True or ``"auto"``), each pass registered in this process first when the driver sent its
    reference (``order.pass_refs``: a pass registered outside the package)."""
    settings = dict(order.passes)
    refs = order.pass_refs
    for name in settings:
        get_pass(name, refs.get(name))
    return LayoutPasses(settings)
