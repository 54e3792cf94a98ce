"""Which trials train as one job, in which layout, and what a grouped job's end decides: the
runner's :class:`JobPlanner` (cross-model optimization in a search: docs/optimization.md, "In a
search").

The :class:`~.trials.TrialRunner` holds one planner and asks it three things: a trial's group
key (:meth:`JobPlanner.key`: the experiment's group key and the starting step; None trains
alone), what a grouped job of some tasks is told (:meth:`JobPlanner.order`, a
:class:`~.job_contract.GroupOrder`), and, when a grouped job ends, what follows
(:meth:`JobPlanner.end`, a :class:`GroupEnd`: the plans record, and per trial in order whether
it fails, retries alone, or continues). The planner keeps what grouped jobs taught it (trials
that train alone or unfused from now on, step times alone, the layout decision per group key
and device: :class:`GroupMemory`), which a resumed experiment restores from the plans table.
It knows trials only by the few fields it reads (id, config, resume point) and never calls
back into the runner.
"""
from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Hashable

from ...optim.cost import Layout, choose_layout, describe
from ...optim.passes import LayoutPasses, get_pass, parse_settings, pass_ref
from ..jobs.job import FailureKind, JobFailed, TrialTask
from ..jobs.contract import GroupMemory, GroupOrder, HeldLayout
from ..jobs.reports import PlanRecord, UnitJudgement, UnitReport
from .trial import Trial

# A later job of a key whose layout is chosen profiles at most this many of its trials alone,
# to judge its segment (the others count at their mean: :func:`sampled_alone`). Every model
# profiled alone cost the 64 distinct architectures of workload (d) about 8 s of a 66 s
# search (two steps of each on a copy); a decided key needs an estimate of apart, not each.
JUDGE_SAMPLE = 2

__all__ = ["GroupEnd", "GroupMemory", "JUDGE_SAMPLE", "JobPlanner", "Step", "key_id", "sampled_alone"]


class Step(enum.Enum):
    """What happens to one trial of a grouped job that ended (:class:`GroupEnd`)."""

    FAIL = "fail"  # its own (or its environment's) failure: the runner's failure policy
    RETRY_ALONE = "retry alone"  # the group failed, not the trial: retried alone, not charged
    CONTINUE = "continue"  # finished its segment: fed its last result, trains on


@dataclass(frozen=True)
class GroupEnd:
    """What follows a grouped job's end, in the order to apply it.

    Args:
        record: the plans table's row of the job (``on_group``).
        steps: (trial, :class:`Step`, failure kind, error, worker lost) per live trial, in
            the job's order.
    """

    record: PlanRecord
    steps: tuple[tuple[str, Step, FailureKind | None, str, bool], ...]


class JobPlanner:
    """Groups trials into jobs and learns from grouped jobs (see the module docstring).

    Args:
        batch_models: the most trials one job trains.
        group_key: ``group_key(trial)``: what must be equal for trials to share a job (None:
            alone). None: nothing groups.
        profile: measure grouped jobs and revert a layout measured slower than its models
            apart.
        fuse: whether same-architecture trials may train fused (True, False, ``"auto"``).
        passes: the optional plan passes' settings (name -> True or ``"auto"``).
        merge: False packs trials into one job without merging them (each trains alone).
        dedicated: ``{"dedicated": patterns, "dedicated_device": ...}`` (engine/dedicated.py).
        slots: the executor's slots (workers). With two or more, a group the device model
            sends apart trains alone from its next segment (each to the first free slot);
            with one, it stays one job (fewer jobs, nothing to balance).
    """

    def __init__(self, *, batch_models: int = 1,
                 group_key: Callable[[Trial], Hashable | None] | None = None,
                 profile: bool = False, fuse: bool | str = False,
                 passes: Mapping[str, Any] | None = None, merge: bool = True,
                 dedicated: Mapping[str, Any] | None = None, slots: int = 1):
        if batch_models < 1:
            raise ValueError(f"batch_models must be >= 1 trial per job, got {batch_models}")
        self.batch_models, self.group_key, self.profile = batch_models, group_key, profile
        self.fuse, self.merge, self.dedicated = fuse, merge, dict(dedicated or {})
        self.slots = slots
        self.passes = {k: v for k, v in parse_settings(dict(passes or {})).items() if v}
        # how workers find a pass registered outside the package: resolved once, not per job
        refs = {n: pass_ref(get_pass(n)) for n in self.passes}
        self._pass_refs = {n: r for n, r in refs.items() if r}
        self.memory = GroupMemory()

    def restore(self, memory: GroupMemory) -> None:
        """Continue from what an earlier run of the search learned (the plans table)."""
        self.memory = memory

    @property
    def unfused(self) -> set[str]:
        return self.memory.unfused

    def key(self, trial: Trial) -> Hashable | None:
        """What must be equal for trials to train in one job (None: alone): the group key
        and the step the trial starts from."""
        if self.batch_models < 2 or self.group_key is None or trial.trial_id in self.memory.alone:
            return None
        key = self.group_key(trial)
        if key is None:
            return None
        chosen = self.memory.layouts.get(key_id(key))
        if chosen and all(c.order[0] == Layout.SEPARATE.value for c in chosen.values()) \
                and self.fuse != "auto":
            # measured faster apart on every device: each model its own job. Not under
            # fuse="auto": which models fuse is the device model's decision, made in each
            # job, and must not depend on whether a measurement sent them apart first
            return None
        return (key, trial.resume_point()[0])

    def order(self, tasks: list[TrialTask], trial: Trial) -> GroupOrder:
        """What a grouped job of ``tasks`` (``trial``: the first task's) is told
        (``meta["group"]``): the passes and fusion settings, the trials whose fusion was
        reverted, whom to profile, and the layouts already chosen for their group key (device
        -> :class:`~.job_contract.HeldLayout`; the worker measures the others)."""
        mem = self.memory
        key = self.group_key(trial) if self.group_key else None
        chosen = mem.layouts.get(key_id(key), {}) if key is not None else {}
        # a key whose apart is bounded from below (measuring.py) profiles nobody alone
        bounded = any(c.bound_s is not None for c in chosen.values())
        measured: dict[str, Any] = {}
        if self.profile or self._measures():  # measure the group
            fresh = [t.trial_id for t in tasks if t.trial_id not in mem.alone_s]
            if chosen:  # the layout is chosen: a sample is enough to judge the segment
                fresh = fresh[:JUDGE_SAMPLE]
            measured["profile"] = () if bounded else tuple(fresh)  # never profiled before
            measured["alone_s"] = {t.trial_id: mem.alone_s[t.trial_id] for t in tasks
                                   if t.trial_id in mem.alone_s}
            # step times alone per architecture: not measured again
            measured["alone_by_arch"] = {d: dict(list(a.items())[-512:])
                                         for d, a in mem.alone_arch.items()}
        order = GroupOrder(
            passes=dict(self.passes), pass_refs=self._pass_refs,
            fuse=self.fuse, unfused=tuple(sorted(t.trial_id for t in tasks
                                                 if self.fuse and t.trial_id in mem.unfused)),
            layouts={device: HeldLayout(order=c.order, speedups=c.speedups)
                     for device, c in chosen.items()},
            dedicated=tuple(self.dedicated.get("dedicated") or ()),
            dedicated_device=self.dedicated.get("dedicated_device"), **measured)
        return order

    def _choose(self, key: str, units: list[UnitReport]) -> list[UnitReport]:
        """Keep the layout choices of a job's units for group key ``key``: a choice the
        worker measured replaces the one held for its device (the layouts reverted stay
        reverted), and a layout whose segment's verdict reverts it (``slower``,
        :func:`~retiarii.optim.cost.judge_segment`) is reverted; the slower segments in a
        row per layout (``strikes``) are kept with the choice, so a resumed search counts
        on. Each unit's ``decision`` is then the choice now in force (the units returned). A
        job that measured nothing, reverted nothing and counted no slower segment leaves the
        key undecided (a later job, with other trials, may have a choice to measure)."""
        for unit in units:
            choice = unit.choice
            if choice is None:
                continue
            device = choice.device
            held = self.memory.layouts.get(key, {}).get(device)
            counted = unit.judgement.strikes if unit.judgement is not None else {}
            if choice.probed:
                speedups = dict(choice.speedups)
            elif held is not None:
                speedups = dict(held.speedups)
            elif unit.slower or any(counted.values()):
                speedups = {}
            else:
                continue
            reverted = set(held.reverted) if held else set()
            if unit.slower and unit.layout:
                reverted.add(unit.layout)
            strikes = {**(held.strikes if held else {}), **counted}
            bound = choice.bound_s if choice.probed else (held.bound_s if held else None)
            # layouts not measured because their upper bound lost (measuring.py, fused first)
            bounds = choice.bounds if choice.probed else (held.bounds if held else None)
            ranked = choose_layout({Layout(k): v for k, v in speedups.items()}, reverted)
            reason = describe(ranked.layout, ranked.speedups, reverted, bounds)
            strikes = {k: v for k, v in strikes.items() if v}
            counted_now = ", ".join(f"{k} {v}" for k, v in sorted(strikes.items()))
            self.memory.layouts.setdefault(key, {})[device] = HeldLayout(
                order=tuple(x.value for x in ranked.order), speedups=speedups,
                reverted=tuple(sorted(reverted)), reason=reason + (
                    f"; slower segments in a row: {counted_now}" if strikes else ""),
                strikes=strikes, bound_s=bound, bounds=dict(bounds) if bounds else None)
        out = []
        for unit in units:
            decided = self.memory.layouts.get(key, {}).get(unit.device)
            if decided is not None:
                unit = unit.judged(replace(unit.judgement or UnitJudgement(), group_key=key,
                                           decision=decided))
            out.append(unit)
        return out

    def end(self, event: Any, job: Any, flights: list[Any], running: Callable[[str], bool],
            trial: Trial, now: float) -> GroupEnd:
        """A grouped job ended (``event``: its terminal event; ``job``: the runner's
        ``JobFlight``; ``flights``: its trials' ``Flight`` s; ``running(trial_id)``: whether a
        trial is still RUNNING; ``trial``: its first trial; ``now``: the executor's clock).
        Its trials that finished their segment continue (planned again together); any that
        did not are retried alone with nothing charged to them (a merged job that fails
        reruns its models separately, so a failure lands on the model that caused it), except
        after a lost worker, which is every trial's environment, or a model's own error the
        worker attributed; the group is kept, reverted or recorded as failed."""
        failed = isinstance(event, JobFailed)
        live = [f for f in flights if f.outcome is None and running(f.trial_id)]
        unfinished = [f for f in live if failed and not f.done]
        errors = {t: (kind, err) for t, kind, err in getattr(event, "failures", ())}
        # One error shared by every unfinished member (the joint backward, the group's own
        # memory) is the group's; a model's own error the worker attributed is that model's.
        joint = len(unfinished) > 1 and len(
            {errors.get(f.trial_id, (None, event.error))[1] for f in unfinished}) == 1
        record = self._record(event, job, joint or any(
            f.trial_id not in errors for f in unfinished), trial, now)
        steps: list[tuple[str, Step, FailureKind | None, str, bool]] = []
        alone: list[str] = []
        for flight in live:
            if flight in unfinished:
                kind, error = errors.get(flight.trial_id, (None, event.error))
                if event.worker_lost:
                    steps.append((flight.trial_id, Step.FAIL, FailureKind.ENVIRONMENT,
                                  event.error, True))
                elif kind is FailureKind.MODEL and not joint:
                    steps.append((flight.trial_id, Step.FAIL, kind, error, False))
                else:
                    self.memory.alone.add(flight.trial_id)
                    alone.append(flight.trial_id)
                    steps.append((flight.trial_id, Step.RETRY_ALONE, None, error, False))
                continue
            steps.append((flight.trial_id, Step.CONTINUE, None, "", False))
        if record.status == "reverted":
            # the trials of the units measured slower; a unit whose layout the device model
            # chose (fused, batched: other rounding) is never reverted by a measurement, so
            # its trials stay together and every run of the search trains them alike
            alone = [t for u in record.units if u.slower for t in u.trials]
            self.memory.alone.update(alone)
        elif self.slots > 1 and record.status == "not merged" and record.units and all(
                u.choice is not None and u.choice.apart for u in record.units):
            # the device model sent the group apart (fusing nothing, CSE bounded under its
            # margin): a decision on these models, not a measurement, and the same models
            # grouped again get it again. Grouped, they would still train one after another
            # on one worker while another idles (held-out spaces at workers=2: 0.84x of
            # optimize=False); alone, each segment goes to the first free worker. With one
            # worker the group stays one job: fewer jobs, each paying its own set-up
            # (the held-out depth space: 12 jobs alone took 1 s more than 2 grouped).
            going = {f.trial_id for f in live}
            alone += [t for u in record.units for t in u.trials if t in going and t not in alone]
            self.memory.alone.update(alone)
        self.memory.unfused.update(record.unfused)
        return GroupEnd(replace(record, alone=tuple(alone)), tuple(steps))

    def _record(self, event: Any, job: Any, group_failed: bool, trial: Trial,
                now: float) -> PlanRecord:
        """What the plans table keeps of a grouped job (see :meth:`end`); ``group_failed``:
        the job failed as a group, not by its models' own errors."""
        from ...optim.cost import fused_speedup, judge_segment, merged_speedup

        mem = self.memory
        for unit in job.units:
            mem.alone_s.update(unit.alone_s)
            if unit.choice is not None and unit.alone_by_arch:
                mem.alone_arch.setdefault(unit.choice.device, {}).update(unit.alone_by_arch)
        units: list[UnitReport] = list(job.units)
        key = self.group_key(trial) if self.group_key else None
        held = self._held_strikes(key_id(key) if key is not None else None)
        # A layout is reverted on evidence only (cost.judge_segment): a segment slower than
        # apart beyond its measured noise, or two slower segments in a row; one noisy
        # segment counts a strike and keeps the layout. A fused unit measured slower than
        # its models grouped unfused is not reverted to alone: its trials train unfused from
        # now on, and that grouping is measured in turn.
        unfused: list[str] = []
        speedups: list[float | None] = []
        for i, unit in enumerate(units):
            if not unit.merged:
                continue
            alone = self._alone_or_bound(key, unit)
            speedup = merged_speedup(unit.measurements(), alone)
            speedups.append(speedup)
            judgement = UnitJudgement()
            if unit.fused:
                judgement = replace(judgement, fused_speedup=fused_speedup(
                    unit.measurements(), alone))
                if self.fuse == "measure":  # under "auto" the device model decided it
                    verdict = judge_segment(judgement.fused_speedup, unit.spread,
                                            held(unit, "fusion"), margin=1.0)
                    judgement = replace(judgement, fusion_verdict=verdict.reason,
                                        strikes={"fusion": verdict.strikes},
                                        fusion_reverted=verdict.revert)
                    if verdict.revert:
                        unfused.extend(unit.trials)
            if self.profile or self._measures():  # the layout measured slower is reverted
                if not _judged(unit):
                    judgement = replace(judgement, slower=judgement.fusion_reverted)
                else:
                    verdict = judge_segment(speedup, unit.spread, held(unit, unit.layout))
                    if self.profile:
                        judgement = replace(judgement, verdict=verdict.reason, strikes={
                            **judgement.strikes, **({unit.layout: verdict.strikes}
                                                    if unit.layout else {})})
                    judgement = replace(judgement, slower=judgement.fusion_reverted or bool(
                        self.profile and verdict.revert))
            if judgement != UnitJudgement():
                units[i] = unit.judged(judgement)
        merged = [u for u in units if u.merged]
        judged = [s for u, s in zip(merged, speedups) if not u.fusion_reverted]
        if key is not None:
            units = self._choose(key_id(key), units)
            merged = [u for u in units if u.merged]
        # a unit that measured its layouts and then trained apart says nothing of a merged
        # speed-up: the row's figure is the merged units' alone
        known = [s for u, s in zip(merged, speedups) if s is not None
                 and u.layout != Layout.SEPARATE.value]
        errors = {t: f"{kind.value} error: {err}" for t, kind, err in
                  getattr(event, "failures", ())}
        status, reason = "merged", ""
        if (isinstance(event, JobFailed) and group_failed and not event.worker_lost
                and event.error != "cancelled"):
            status = "failed"
            reason = (event.error.strip().splitlines() or [""])[0][:500]
        elif not self.merge:  # packed without merging (engine/placing.py): nothing to judge
            status, reason = "packed", "packed without merging: each model trained alone"
        elif not merged and job.units:
            status, reason = "not merged", "; ".join(
                sorted({u.reason or "" for u in job.units}))[:500]
        elif self.profile and any(u.slower for u in merged if not u.fusion_reverted):
            status = "reverted"
            worst = min(s for s in judged if s is not None)
            why = next(u.verdict for u in merged if u.slower and not u.fusion_reverted)
            reason = (f"measured {worst:.2f}x of training its models apart ({why}): they "
                      f"train alone from now on")
        if status == "not merged" and all(u.layout == Layout.SEPARATE.value
                                          and u.decision for u in units):
            reason = f"layout: {units[0].decision.reason}"[:500]
        if unfused and status == "merged":
            worst = min(u.judgement.fused_speedup for u in merged if u.fusion_reverted)
            reason = (f"fusion reverted: measured {worst:.2f}x of training its models grouped "
                      f"unfused: {', '.join(unfused)} train unfused from now on")[:500]
        seconds = None if job.started is None else now - job.started
        return PlanRecord(
            job_id=event.job_id, trials=tuple(job.trials), status=status, reason=reason,
            speedup=min(known) if known else None, seconds=seconds, units=tuple(units),
            errors=errors, unfused=tuple(unfused), packing=job.extra.get("packing"),
            passes=() if not self.merge else tuple(self._passes_of(merged)))

    def _measures(self) -> bool:
        """Whether grouped jobs measure a layout choice (fusion or a pass set ``"auto"``)."""
        return self.fuse in ("auto", "measure") or any(
            v in ("auto", "measure") for v in self.passes.values())

    def _passes_of(self, merged: list[UnitReport]) -> list[str]:
        """The passes a grouped job's merged units ran, in order (the plans row's
        ``passes``): the required ones; those set True when a unit merged; those set
        ``"auto"`` when a unit trained in their layout (``batching``); ``fusion`` when a unit
        trained fused."""
        lp = LayoutPasses(self.passes)
        names = list(lp.of(Layout.BATCHING) if any(u.layout == Layout.BATCHING.value
                                                    for u in merged)
                     else lp.forced if merged else lp.required)
        if any(u.fused or u.layout == Layout.FUSED.value for u in merged):
            names.append("fusion")
        return names

    def _alone_or_bound(self, key: Any, unit: UnitReport) -> Mapping[str, float]:
        """Each of the unit's trials' step time alone: profiled, else the lower bound its
        layout choice measured (``bound_s``: the shared part every model alone computes;
        measuring.py), so a bounded key's segments are judged on a lower bound of apart."""
        bound = unit.choice.bound_s if unit.choice is not None else None
        if bound is None and key is not None:
            held = self.memory.layouts.get(key_id(key), {}).get(unit.device)
            bound = held.bound_s if held is not None else None
        alone = self.memory.alone_s if bound is None else {
            **{t: bound for t in unit.trials}, **self.memory.alone_s}
        return sampled_alone(unit.trials, alone)

    def _held_strikes(self, key: str | None):
        """``strikes(unit, name)``: the slower segments in a row held for ``name`` (a layout,
        or ``"fusion"``) on the unit's device under group key ``key`` (0 when none)."""
        held = self.memory.layouts.get(key, {}) if key is not None else {}

        def strikes(unit: UnitReport, name: str | None) -> int:
            layout = held.get(unit.device)
            return int(layout.strikes.get(name, 0)) if layout is not None else 0
        return strikes

def sampled_alone(trials: Iterable[str], alone_s: Mapping[str, float]) -> Mapping[str, float]:
    """``alone_s``, with each of ``trials`` never profiled alone given the mean of those of
    ``trials`` that were (a later job of a key whose layout is chosen profiles a sample of
    its trials: :data:`JUDGE_SAMPLE`); unchanged when none or all were.

    Example::

        >>> sampled_alone(["a", "b", "c"], {"a": 0.1, "b": 0.3})["c"]
        0.2
    """
    trials = list(trials)
    known = [float(alone_s[t]) for t in trials if t in alone_s]
    missing = [t for t in trials if t not in alone_s]
    if not known or not missing:
        return alone_s
    mean = sum(known) / len(known)
    return {**alone_s, **{t: mean for t in missing}}


def _judged(unit: UnitReport) -> bool:
    """Whether a unit's segment says anything of its layout: not when it trained apart
    (its models' own steps in turn), nor when the device model chose its layout
    (``decided``: fused or batched, whose values differ by rounding: a measurement must
    not change them), nor when the segment measured the layouts on its first batches and
    ended in one that is not the choice (it trained there only until the next segment's
    switch: measuring.py)."""
    choice = unit.choice
    if unit.layout == Layout.SEPARATE.value or unit.decided:
        return False
    return not (choice is not None and choice.measured_on and choice.order
                and unit.layout != choice.order[0])


def key_id(key: Hashable) -> str:
    """A group key as the plans table names it: a short hash of its JSON (stable across
    processes and resumes: the experiment's keys are JSON strings)."""
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]
