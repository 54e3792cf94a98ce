"""How the :class:`~.trials.TrialRunner` packs trials into grouped jobs and ends them
(cross-model optimization in a search: docs/optimization.md, "In a search").

:class:`GroupedJobs` is the runner's half that knows about groups: which trials may share a
job (:meth:`~GroupedJobs._key`: the experiment's group key and the starting step), which
waiting or new trials join a batch (:meth:`~GroupedJobs._companions`), and what happens when a
grouped job ends (:meth:`~GroupedJobs._end_group`: the finished trials continue together, the
others rerun alone or fail by their own error, the group is kept, reverted or recorded as
failed in the plans record), and the layout chosen per group key and device
(:meth:`~GroupedJobs._group_meta` sends it with each job; :meth:`~GroupedJobs._choose`
keeps what a job measured, and reverts a layout measured slower over a segment).
It is a mixin of :class:`~.trials.TrialRunner`, whose state it
reads (``trials``, ``alone``, ``alone_s``, ``unfused``, ``layouts``, ``batch_models``,
``group_key``, ...)
and whose lifecycle methods it calls (``_move``, ``_fail``, ``_feed``, ``_continue``); it adds
no state of its own. Its ``job`` arguments are the runner's ``_JobFlight`` records and its
``flights`` the runner's ``_Flight`` s (typed ``Any`` here: importing them back from
``trials`` would make a cycle).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Hashable

from ..optim.cost import Layout, choose_layout, describe
from ..optim.passes import LayoutPasses, get_pass, pass_ref
from .executors.base import FailureKind, JobFailed, TrialTask
from .job_contract import GroupOrder, HeldLayout
from .trial import Trial, TrialState

__all__ = ["GroupedJobs"]


class GroupedJobs:
    """The grouping half of :class:`~.trials.TrialRunner` (see the module docstring)."""

    def _key(self, trial: Trial) -> Hashable | None:
        """What must be equal for trials to train in one job (None: alone): the group key
        and the step the trial starts from."""
        if self.batch_models < 2 or self.group_key is None or trial.trial_id in self.alone:
            return None
        key = self.group_key(trial)
        if key is None:
            return None
        chosen = self.layouts.get(key_id(key))
        if chosen and all(c.order[0] == Layout.SEPARATE.value for c in chosen.values()):
            return None  # measured faster apart on every device: each model its own job
        return (key, trial.resume_point()[0])

    def _group_meta(self, tasks: list[TrialTask]) -> dict[str, Any]:
        """What a grouped job of ``tasks`` is told (``meta["group"]``, a
        :class:`~.job_contract.GroupOrder`): the passes and fusion settings, the trials whose
        fusion was reverted, whom to profile, and the layouts already chosen for their group
        key (device -> :class:`~.job_contract.HeldLayout`; the worker measures the others)."""
        refs = {n: pass_ref(get_pass(n)) for n in self.passes}
        key = self.group_key(self.trials[tasks[0].trial_id]) if self.group_key else None
        chosen = self.layouts.get(key_id(key), {}) if key is not None else {}
        # a key whose apart is bounded from below (measuring.py) profiles nobody alone
        bounded = any(c.bound_s is not None for c in chosen.values())
        measured: dict[str, Any] = {}
        if self.profile or self._measures():  # measure the group
            measured["profile"] = () if bounded else tuple(  # each member never profiled
                t.trial_id for t in tasks if t.trial_id not in self.alone_s)
            measured["alone_s"] = {t.trial_id: self.alone_s[t.trial_id] for t in tasks
                                   if t.trial_id in self.alone_s}
            # step times alone per architecture: not measured again
            measured["alone_by_arch"] = {d: dict(list(a.items())[-512:])
                                         for d, a in self.alone_arch.items()}
        order = GroupOrder(
            passes=dict(self.passes), pass_refs={n: r for n, r in refs.items() if r},
            fuse=self.fuse, unfused=tuple(sorted(t.trial_id for t in tasks
                                                 if self.fuse and t.trial_id in self.unfused)),
            layouts={device: HeldLayout(order=c.order, speedups=c.speedups)
                     for device, c in chosen.items()},
            dedicated=tuple(self.dedicated.get("dedicated") or ()),
            dedicated_device=self.dedicated.get("dedicated_device"), **measured)
        return {"group": order}

    def _choose(self, key: str, units: list[dict]) -> None:
        """Keep the layout choices of a job's units for group key ``key``: a choice the
        worker measured replaces the one held for its device (the layouts reverted stay
        reverted), and a layout whose segment's verdict reverts it (``"slower": True``,
        :func:`~retiarii.optim.cost.judge_segment`) is reverted; the slower segments in a
        row per layout (``"strikes"``) are kept with the choice, so a resumed search counts
        on. Each unit's ``"decision"`` is then the choice now in force. A job that measured
        nothing, reverted nothing and counted no slower segment leaves the key undecided (a
        later job, with other trials, may have a choice to measure)."""
        for unit in units:
            choice = unit.get("choice")
            if not choice:
                continue
            device = choice["device"]
            held = self.layouts.get(key, {}).get(device)
            counted = unit.get("strikes") or {}
            if choice.get("probed"):
                speedups = dict(choice.get("speedups") or {})
            elif held is not None:
                speedups = dict(held.speedups)
            elif unit.get("slower") or any(counted.values()):
                speedups = {}
            else:
                continue
            reverted = set(held.reverted) if held else set()
            if unit.get("slower") and unit.get("layout"):
                reverted.add(unit["layout"])
            strikes = {**(held.strikes if held else {}), **counted}
            probed = bool(choice.get("probed"))
            bound = choice.get("bound_s") if probed else (held.bound_s if held else None)
            # layouts not measured because their upper bound lost (measuring.py, fused first)
            bounds = choice.get("bounds") if probed else (held.bounds if held else None)
            ranked = choose_layout({Layout(k): v for k, v in speedups.items()}, reverted)
            reason = describe(ranked.layout, ranked.speedups, reverted, bounds)
            strikes = {k: v for k, v in strikes.items() if v}
            counted_now = ", ".join(f"{k} {v}" for k, v in sorted(strikes.items()))
            self.layouts.setdefault(key, {})[device] = HeldLayout(
                order=tuple(x.value for x in ranked.order), speedups=speedups,
                reverted=tuple(sorted(reverted)), reason=reason + (
                    f"; slower segments in a row: {counted_now}" if strikes else ""),
                strikes=strikes, bound_s=bound, bounds=bounds or None)
        for unit in units:
            decided = self.layouts.get(key, {}).get((unit.get("choice") or {}).get("device"))
            if decided is not None:
                unit["decision"] = {"group_key": key, **decided.to_json()}

    def _companions(self, batch: list[Trial], limit: int | None = None) -> list[Trial]:
        """Trials to train with ``batch`` (same key), until there are ``limit`` in all
        (default ``batch_models``): the waiting ones first, in the scheduler's order, then new
        ones. A new trial that does not match ends the search; it waits for a slot of its own."""
        key = self._key(batch[0])
        out: list[Trial] = []
        if key is None:
            return out
        limit = self.batch_models if limit is None else limit
        taken = frozenset(t.trial_id for t in batch)
        # A new trial starts at step 0: it can join a batch that starts there, never one that
        # continues (asking the strategy then would only move its proposals earlier).
        fresh = key[1] == 0
        while len(batch) + len(out) < limit and not self.budget_hit():
            trial = self._next_trial(key, taken, new=fresh)
            if trial is None:
                break
            self._after_scheduler()
            if trial.state not in (TrialState.PENDING, TrialState.PAUSED):
                continue  # the scheduler stopped it meanwhile
            if self._key(trial) != key:
                break
            out.append(trial)
            taken = taken | {trial.trial_id}
        return out

    def _end_group(self, event, job: Any, flights: list[Any]) -> None:
        """A grouped job ended. Its trials that finished their segment continue (planned
        again together); any that did not are retried alone with nothing charged to them
        (a merged job that fails reruns its models separately, so a failure lands on the
        model that caused it), except after a lost worker, which is every trial's
        environment; the group's record goes to ``on_group``, reverted when measured slower
        than its models apart."""
        failed = isinstance(event, JobFailed)
        live = [f for f in flights if f.outcome is None
                and self.trials[f.trial_id].state is TrialState.RUNNING]
        unfinished = [f for f in live if failed and not f.done]
        errors = {t: (kind, err) for t, kind, err in getattr(event, "failures", ())}
        # One error shared by every unfinished member (the joint backward, the group's own
        # memory) is the group's; a model's own error the worker attributed is that model's.
        joint = len(unfinished) > 1 and len(
            {errors.get(f.trial_id, (None, event.error))[1] for f in unfinished}) == 1
        record = self._group_record(event, job, joint or any(
            f.trial_id not in errors for f in unfinished))
        continuing: list[Trial] = []
        for flight in live:
            trial = self.trials[flight.trial_id]
            if flight in unfinished:
                kind, error = errors.get(trial.trial_id, (None, event.error))
                if event.worker_lost:
                    self._fail(trial, FailureKind.ENVIRONMENT, event.error, flight.task, lost=True)
                elif kind is FailureKind.MODEL and not joint:
                    self._fail(trial, kind, error, flight.task)
                else:
                    self.alone.add(trial.trial_id)
                    record["alone"].append(trial.trial_id)
                    self._retry_alone(trial, error)
                continue
            if flight.buffered is not None:  # an executor that wrote no checkpoint
                self._feed(trial, flight.buffered, None)
            continuing.append(trial)
        if record["status"] == "reverted":
            self.alone.update(job.trials)
            record["alone"] = list(job.trials)
        self.unfused.update(record["unfused"])
        if self.on_group is not None:
            self.on_group(record)
        self._continue(continuing, flights[0].worker)

    def _group_record(self, event, job: Any, group_failed: bool) -> dict:
        """What the plans table keeps of a grouped job (see :meth:`_end_group`);
        ``group_failed``: the job failed as a group, not by its models' own errors."""
        from ..optim.cost import fused_speedup, judge_segment, merged_speedup

        for unit in job.units:
            self.alone_s.update(unit.get("alone_s") or {})
            if unit.get("choice") and unit.get("alone_by_arch"):
                self.alone_arch.setdefault(unit["choice"]["device"], {}).update(
                    unit["alone_by_arch"])
        units = [dict(u) for u in job.units]
        merged = [u for u in units if u.get("merged")]
        key = self.group_key(self.trials[job.trials[0]]) if self.group_key else None
        alone = {id(u): self._alone_or_bound(key, u) for u in merged}
        speedups = [merged_speedup(u, alone[id(u)]) for u in merged]
        held = self._held_strikes(key_id(key) if key is not None else None)
        # A layout is reverted on evidence only (cost.judge_segment): a segment slower than
        # apart beyond its measured noise, or two slower segments in a row; one noisy
        # segment counts a strike and keeps the layout. A fused unit measured slower than
        # its models grouped unfused is not reverted to alone: its trials train unfused from
        # now on, and that grouping is measured in turn.
        unfused: list[str] = []
        for unit in merged:
            if unit.get("fused"):
                unit["fused_speedup"] = fused_speedup(unit, alone[id(unit)])
                if self.fuse == "auto":
                    verdict = judge_segment(unit["fused_speedup"], unit.get("spread"),
                                            held(unit, "fusion"), margin=1.0)
                    unit["fusion_verdict"] = verdict.reason
                    unit.setdefault("strikes", {})["fusion"] = verdict.strikes
                    if verdict.revert:
                        unit["fusion_reverted"] = True
                        unfused.extend(unit["trials"])
        if self.profile or self._measures():
            for unit, s in zip(merged, speedups):  # the layout measured slower is reverted
                if not _judged(unit):
                    unit["slower"] = bool(unit.get("fusion_reverted"))
                    continue
                verdict = judge_segment(s, unit.get("spread"), held(unit, unit.get("layout")))
                if self.profile:
                    unit["verdict"] = verdict.reason
                    if unit.get("layout"):
                        unit.setdefault("strikes", {})[unit["layout"]] = verdict.strikes
                unit["slower"] = bool(unit.get("fusion_reverted")) or bool(
                    self.profile and verdict.revert)
        judged = [s for u, s in zip(merged, speedups) if not u.get("fusion_reverted")]
        if key is not None:
            self._choose(key_id(key), units)
        known = [s for s in speedups if s is not None]
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
                sorted({u.get("reason", "") for u in job.units}))[:500]
        elif self.profile and any(u.get("slower") for u in merged
                                  if not u.get("fusion_reverted")):
            status = "reverted"
            worst = min(s for s in judged if s is not None)
            why = next(u["verdict"] for u in merged if u.get("slower")
                       and not u.get("fusion_reverted"))
            reason = (f"measured {worst:.2f}x of training its models apart ({why}): they "
                      f"train alone from now on")
        if status == "not merged" and all(u.get("layout") == Layout.SEPARATE.value
                                          and u.get("decision") for u in units):
            reason = f"layout: {units[0]['decision']['reason']}"[:500]
        if unfused and status == "merged":
            worst = min(u["fused_speedup"] for u in merged if u.get("fusion_reverted"))
            reason = (f"fusion reverted: measured {worst:.2f}x of training its models grouped "
                      f"unfused: {', '.join(unfused)} train unfused from now on")[:500]
        seconds = None if job.started is None else self.executor.now() - job.started
        return {"job_id": event.job_id, "trials": list(job.trials), "status": status,
                "reason": reason, "speedup": min(known) if known else None,
                "seconds": seconds, "units": units, "errors": errors,
                "alone": [], "unfused": unfused, "packing": job.extra.get("packing"),
                "passes": [] if not self.merge else self._passes_of(merged)}

    def _measures(self) -> bool:
        """Whether grouped jobs measure a layout choice (fusion or a pass set ``"auto"``)."""
        return self.fuse == "auto" or "auto" in self.passes.values()

    def _passes_of(self, merged: list[dict]) -> list[str]:
        """The passes a grouped job's merged units ran, in order (the plans row's
        ``passes``): the required ones; those set True when a unit merged; those set
        ``"auto"`` when a unit trained in their layout (``batching``); ``fusion`` when a unit
        trained fused."""
        lp = LayoutPasses(self.passes)
        names = list(lp.of(Layout.BATCHING) if any(u.get("layout") == Layout.BATCHING.value
                                                    for u in merged)
                     else lp.forced if merged else lp.required)
        if any(u.get("fused") or u.get("layout") == Layout.FUSED.value for u in merged):
            names.append("fusion")
        return names

    def _alone_or_bound(self, key: Any, unit: dict) -> dict[str, float]:
        """Each of the unit's trials' step time alone: profiled, else the lower bound its
        layout choice measured (``bound_s``: the shared part every model alone computes;
        measuring.py), so a bounded key's segments are judged on a lower bound of apart."""
        choice = unit.get("choice") or {}
        bound = choice.get("bound_s")
        if bound is None and key is not None:
            held = self.layouts.get(key_id(key), {}).get(choice.get("device"))
            bound = held.bound_s if held is not None else None
        if bound is None:
            return self.alone_s
        return {**{t: bound for t in unit.get("trials") or ()}, **self.alone_s}

    def _held_strikes(self, key: str | None):
        """``strikes(unit, name)``: the slower segments in a row held for ``name`` (a layout,
        or ``"fusion"``) on the unit's device under group key ``key`` (0 when none)."""
        held = self.layouts.get(key, {}) if key is not None else {}

        def strikes(unit: dict, name: str | None) -> int:
            device = (unit.get("choice") or {}).get("device")
            layout = held.get(device)
            return int(layout.strikes.get(name, 0)) if layout is not None else 0
        return strikes

    def _retry_alone(self, trial: Trial, error: str) -> None:
        """A trial that did not finish its segment in a failed grouped job: back to PENDING
        from its last checkpoint, to train alone; not counted as its failure."""
        trial.attempts += 1
        first = (error.strip().splitlines() or [""])[0]
        self._move(trial, TrialState.ERRORED, f"group error: {first}")
        step, _ = trial.resume_point()
        self._move(trial, TrialState.PENDING, f"retry {trial.attempts} alone from step {step}")


def _judged(unit: dict) -> bool:
    """Whether a unit's segment says anything of its layout: not when it trained apart
    (its models' own steps in turn), nor when the segment measured the layouts on its first
    batches and ended in one that is not the choice (it trained there only until the next
    segment's switch: measuring.py)."""
    choice = unit.get("choice") or {}
    if unit.get("layout") == Layout.SEPARATE.value:
        return False
    return not (choice.get("measured_on") and choice.get("order")
                and unit.get("layout") != choice["order"][0])


def key_id(key: Hashable) -> str:
    """A group key as the plans table names it: a short hash of its JSON (stable across
    processes and resumes: the experiment's keys are JSON strings)."""
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]
