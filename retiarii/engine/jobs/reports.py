"""The typed reports of grouped jobs: what a worker says of each unit, and the plans record.

A grouped job's worker reports every unit it trained (:class:`UnitReport`, in
:class:`~.job.JobProfiled`): its layout and the layout choice it trained under
(:class:`UnitChoice`), what it measured (batches, loader and compute seconds, step times
alone). The runner judges each unit (:class:`UnitJudgement`: the measured speed-ups' verdicts
and the layout decision now in force) and writes one :class:`PlanRecord` per job in the plans
table. They are frozen dataclasses with one codec each (``to_json`` / ``from_json``), and
this module is the only place their fields are spelled; the JSON is the plans table's
``units`` column as older versions wrote it (``from_json`` reads rows of older stores: keys
it does not know are ignored, missing ones take their defaults).

A layout the device model chose (fused under ``fuse="auto"``, batching set ``"auto"``:
:mod:`~retiarii.engine.worker_side.auto_layout`) or the user forced (fused under
``fuse=True``) rounds unlike training alone, so time never judges it:
:attr:`UnitReport.decided` is derived from the choice (``device_chosen``, ``forced``), and a
decided report cannot carry a time verdict (:meth:`UnitReport.judged` raises).

Example::

    choice = UnitChoice(device="cpu", order=("cse",))
    unit = UnitReport(("a", "b"), merged=True, layout="cse", choice=choice, batches=4)
    UnitReport.from_json(unit.to_json()) == unit
    unit.judged(UnitJudgement(verdict="1.30x", slower=False))
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from .contract import HeldLayout

__all__ = ["PlanRecord", "UnitChoice", "UnitJudgement", "UnitReport"]


def _present(obj: Any, always: tuple[str, ...] = ()) -> dict:
    """The fields of ``obj`` that differ from their defaults, and ``always`` whatever they
    hold: the JSON older versions wrote left unset keys out."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if f.name in always or (value is not None and value != default):
            out[f.name] = list(value) if isinstance(value, tuple) else (
                dict(value) if isinstance(value, Mapping) else value)
    return out


def _tuple(value: Any) -> tuple:
    return tuple(value or ())


@dataclass(frozen=True)
class UnitChoice:
    """The layout choice a unit trained under, for one kind of device.

    Args:
        device: the kind of device (``worker_side.group_layouts.device_label``).
        probed: whether this job measured the layouts (then ``speedups`` are its own).
        order: layouts (``Layout`` values) best first.
        speedups: layout -> measured speed-up over apart (None: not measured).
        device_chosen: the layouts the device model chose (rounding unlike training alone:
            never judged by time).
        forced: the layouts the user forced (``fused`` under ``fuse=True``): never judged
            by time either.
        predicted: one line per fusable set the device model judged.
        probe_s: seconds the measurement cost (on ``worker_side.compute_clock``'s clock).
        measured_on: ``"first batches"`` when measured on the segment's real batches.
        steps_s: layout -> seconds of one batch of every trial.
        bound_s: apart's lower bound per model (apart not profiled: the speed-ups are bounds).
        bounds: layouts left unmeasured because their upper bound lost -> that bound.
        skipped: why fusion was not measured.
        fused_from: where fused training began (or begins).
        fused_failed: why fusing failed here (fused is then no candidate).
        apart: the device model sent the group apart, nothing measured (fusing nothing, and
            CSE bounded under ``device_model.CSE_MARGIN``): a decision, not a measurement,
            so the runner trains these trials alone from now on.
    """

    device: str
    probed: bool = False
    order: tuple[str, ...] = ()
    speedups: Mapping[str, float | None] = field(default_factory=dict)
    device_chosen: tuple[str, ...] = ()
    forced: tuple[str, ...] = ()
    predicted: tuple[str, ...] = ()
    probe_s: float | None = None
    measured_on: str | None = None
    steps_s: Mapping[str, float] | None = None
    bound_s: float | None = None
    bounds: Mapping[str, float] | None = None
    skipped: str | None = None
    fused_from: str | None = None
    fused_failed: str | None = None
    apart: bool = False

    def to_json(self) -> dict:
        return _present(self, always=("device", "probed", "order", "speedups"))

    @classmethod
    def from_json(cls, data: Mapping) -> UnitChoice:
        return cls(device=data.get("device") or "", probed=bool(data.get("probed")),
                   order=_tuple(data.get("order")), speedups=dict(data.get("speedups") or {}),
                   device_chosen=_tuple(data.get("device_chosen")),
                   forced=_tuple(data.get("forced")),
                   predicted=_tuple(data.get("predicted")), probe_s=data.get("probe_s"),
                   measured_on=data.get("measured_on"), steps_s=data.get("steps_s"),
                   bound_s=data.get("bound_s"), bounds=data.get("bounds"),
                   skipped=data.get("skipped"), fused_from=data.get("fused_from"),
                   fused_failed=data.get("fused_failed"), apart=bool(data.get("apart")))


@dataclass(frozen=True)
class UnitJudgement:
    """What the runner made of one unit's segment (``JobPlanner``).

    Args:
        fused_speedup: a fused unit's speed-up over its models grouped unfused.
        fusion_verdict: why fusion was kept or reverted (``fuse="measure"``).
        fusion_reverted: fusion measured slower: its trials train unfused from now on.
        verdict: the time verdict on the unit's layout (``cost.judge_segment``).
        slower: the unit's trials train alone from now on (its layout, or fusion, reverted).
        strikes: layout (or ``"fusion"``) -> slower segments in a row.
        group_key: the group key the decision holds for (``key_id``).
        decision: the layout decision in force for its key and device after this job.
    """

    fused_speedup: float | None = None
    fusion_verdict: str | None = None
    fusion_reverted: bool = False
    verdict: str | None = None
    slower: bool | None = None
    strikes: Mapping[str, int] = field(default_factory=dict)
    group_key: str | None = None
    decision: HeldLayout | None = None

    def to_json(self) -> dict:
        out = _present(self)
        out.pop("group_key", None)
        out.pop("decision", None)
        if self.slower is not None:
            out["slower"] = self.slower
        if "fused_speedup" in out or self.fused_speedup is not None:
            out["fused_speedup"] = self.fused_speedup
        if self.decision is not None:  # as plans rows spell it: the key inside the decision
            out["decision"] = {"group_key": self.group_key, **self.decision.to_json()}
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> UnitJudgement | None:
        keys = ("fused_speedup", "fusion_verdict", "fusion_reverted", "verdict", "slower",
                "strikes", "decision")
        if not any(k in data for k in keys):
            return None
        decision = data.get("decision")
        return cls(fused_speedup=data.get("fused_speedup"),
                   fusion_verdict=data.get("fusion_verdict"),
                   fusion_reverted=bool(data.get("fusion_reverted")),
                   verdict=data.get("verdict"), slower=data.get("slower"),
                   strikes=dict(data.get("strikes") or {}),
                   group_key=(decision or {}).get("group_key"),
                   decision=HeldLayout.from_json(decision) if decision else None)


@dataclass(frozen=True)
class UnitReport:
    """What a worker measured of one unit of a grouped job (a merged or fused group, or a
    trial alone), and, once the runner judged it, :attr:`judgement`.

    Args:
        trials: the unit's trials, every one it started with.
        merged: trained as one group (False: alone, and ``reason`` says why).
        fused: trained as one fused model.
        reason: why a trial trained alone.
        layout: the layout it trained in (a ``Layout`` value; None: no layout choice).
        choice: the layout choice it trained under.
        batches, load_s, first_load_s, produce_s, compute_s, setup_s, start_s: what its
            segment measured (``optim.cost.merged_speedup``).
        alone_s: trial -> its step time alone, profiled in this job.
        alone_by_arch: architecture (``fusion_key``) -> step time alone.
        spread: relative spread of its step times (the noise; None: too few).
        step_s: its typical step (None: too few).
        judged_batches: batches its verdict is judged on (a measured segment's).
        shared_nodes, executions: what the plan's passes left (nodes computed once,
            evaluations per step).
        dedicated, dedicated_device: modules computed on a dedicated device, and where.
        judgement: the runner's judgement (None until judged).
    """

    trials: tuple[str, ...]
    merged: bool
    fused: bool = False
    reason: str | None = None
    layout: str | None = None
    choice: UnitChoice | None = None
    batches: int = 0
    load_s: float = 0.0
    first_load_s: float = 0.0
    produce_s: float = 0.0
    compute_s: float = 0.0
    setup_s: float = 0.0
    start_s: float = 0.0
    alone_s: Mapping[str, float] = field(default_factory=dict)
    alone_by_arch: Mapping[str, float] = field(default_factory=dict)
    spread: float | None = None
    step_s: float | None = None
    judged_batches: int | None = None
    shared_nodes: int | None = None
    executions: int | None = None
    dedicated: tuple[str, ...] | None = None
    dedicated_device: str | None = None
    judgement: UnitJudgement | None = None

    def __post_init__(self):
        if self.decided and self.judgement is not None and self.judgement.verdict is not None:
            raise ValueError(f"unit {list(self.trials)}: its layout {self.layout!r} was chosen "
                             "by the device model and is never judged by time; it cannot "
                             f"carry the time verdict {self.judgement.verdict!r}")

    @property
    def decided(self) -> bool:
        """Whether the device model chose this unit's layout or the user forced it (values
        that round unlike training alone: a measurement must not change them, so time never
        judges it)."""
        return (self.choice is not None and self.layout is not None
                and self.layout in (*self.choice.device_chosen, *self.choice.forced))

    @property
    def device(self) -> str | None:
        return self.choice.device if self.choice is not None else None

    @property
    def verdict(self) -> str | None:
        return self.judgement.verdict if self.judgement is not None else None

    @property
    def slower(self) -> bool:
        return bool(self.judgement is not None and self.judgement.slower)

    @property
    def fusion_reverted(self) -> bool:
        return bool(self.judgement is not None and self.judgement.fusion_reverted)

    @property
    def decision(self) -> HeldLayout | None:
        return self.judgement.decision if self.judgement is not None else None

    def judged(self, judgement: UnitJudgement) -> UnitReport:
        """This report with the runner's judgement (raises for a time verdict on a
        decided unit: see the class docstring)."""
        return replace(self, judgement=judgement)

    def measurements(self) -> dict:
        """What :func:`~retiarii.optim.cost.merged_speedup` and ``fused_speedup`` read (the
        cost model is plain arithmetic over plain values)."""
        return {"trials": list(self.trials), "merged": self.merged, "fused": self.fused,
                "batches": self.batches, "load_s": self.load_s, "compute_s": self.compute_s,
                "setup_s": self.setup_s, "produce_s": self.produce_s, "start_s": self.start_s,
                "step_s": self.step_s}

    def to_json(self) -> dict:
        out = _present(self, always=("trials", "merged"))
        out.pop("judgement", None)
        out.pop("choice", None)
        if self.merged:  # the measured fields, as a merged unit always wrote them
            out.update(fused=self.fused, batches=self.batches, load_s=self.load_s,
                       first_load_s=self.first_load_s, produce_s=self.produce_s,
                       compute_s=self.compute_s, setup_s=self.setup_s, start_s=self.start_s,
                       alone_s=dict(self.alone_s), alone_by_arch=dict(self.alone_by_arch),
                       spread=self.spread, step_s=self.step_s)
        if self.dedicated is not None:
            out["dedicated_device"] = self.dedicated_device
        if self.choice is not None:
            out["choice"] = self.choice.to_json()
        if self.decided:
            out["decided"] = True
        if self.judgement is not None:
            out.update(self.judgement.to_json())
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> UnitReport:
        """Read one back (a ``JobProfiled`` unit or a plans row's; older rows say
        ``"decided": true`` where newer ones name the layout in ``device_chosen``)."""
        choice = UnitChoice.from_json(data["choice"]) if data.get("choice") else None
        if data.get("decided") and choice is not None and data.get("layout") \
                and data["layout"] not in (*choice.device_chosen, *choice.forced):
            choice = replace(choice, device_chosen=(*choice.device_chosen, data["layout"]))
        dedicated = data.get("dedicated")
        return cls(trials=_tuple(data.get("trials")), merged=bool(data.get("merged")),
                   fused=bool(data.get("fused")), reason=data.get("reason"),
                   layout=data.get("layout"), choice=choice,
                   batches=int(data.get("batches") or 0),
                   **{k: float(data.get(k) or 0.0) for k in (
                       "load_s", "first_load_s", "produce_s", "compute_s", "setup_s",
                       "start_s")},
                   alone_s=dict(data.get("alone_s") or {}),
                   alone_by_arch=dict(data.get("alone_by_arch") or {}),
                   spread=data.get("spread"), step_s=data.get("step_s"),
                   judged_batches=data.get("judged_batches"),
                   shared_nodes=data.get("shared_nodes"), executions=data.get("executions"),
                   dedicated=None if dedicated is None else tuple(dedicated),
                   dedicated_device=data.get("dedicated_device"),
                   judgement=UnitJudgement.from_json(data))


@dataclass(frozen=True)
class PlanRecord:
    """One grouped job's row of the plans table (``JobPlanner.end``; ``PlanTable.add``).

    Args:
        job_id: the job.
        trials: every trial of it.
        status: ``"merged"``, ``"reverted"``, ``"failed"``, ``"not merged"`` or ``"packed"``.
        reason: one line on the status (empty when merged as planned).
        speedup: the least measured speed-up of its merged units over apart (None: unknown).
        seconds: the job's wall time.
        units: its units' reports, judged.
        errors: trial -> its own error (not stored).
        alone: trials that train alone from now on.
        unfused: trials that train unfused from now on (not stored: read from ``units``).
        packing: the packing decision (device slot, models, predicted time, balance).
        passes: the passes its merged units ran, in order.
        time: when the row was written (read back only).
    """

    job_id: str | None
    trials: tuple[str, ...]
    status: str
    reason: str = ""
    speedup: float | None = None
    seconds: float | None = None
    units: tuple[UnitReport, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    alone: tuple[str, ...] = ()
    unfused: tuple[str, ...] = ()
    packing: Mapping[str, Any] | None = None
    passes: tuple[str, ...] = ("cse",)
    time: float | None = None

    def to_json(self) -> dict:
        """The record as the plans table holds it, its JSON columns decoded (``errors`` and
        ``unfused`` are not stored: ``unfused`` is read from the units)."""
        return {"job_id": self.job_id, "trials": list(self.trials),
                "passes": list(self.passes), "status": self.status, "reason": self.reason or "",
                "alone": list(self.alone), "speedup": self.speedup, "seconds": self.seconds,
                "units": [u.to_json() for u in self.units],
                "packing": dict(self.packing) if self.packing else None, "time": self.time}

    @classmethod
    def from_json(cls, data: Mapping) -> PlanRecord:
        """Read :meth:`to_json`'s form back (rows of older stores: units in their older
        form, no ``packing`` column; see :meth:`UnitReport.from_json`)."""
        units = tuple(UnitReport.from_json(u) for u in data.get("units") or ())
        return cls(job_id=data.get("job_id"), trials=_tuple(data.get("trials")),
                   status=data["status"], reason=data.get("reason") or "",
                   speedup=data.get("speedup"), seconds=data.get("seconds"), units=units,
                   alone=_tuple(data.get("alone")),
                   unfused=tuple(t for u in units if u.fusion_reverted for t in u.trials),
                   packing=data.get("packing") or None, passes=_tuple(data.get("passes")),
                   time=data.get("time"))

    def row(self) -> dict:
        """The plans table's columns: :meth:`to_json` with its JSON columns encoded."""
        out = self.to_json()
        out.pop("time")
        for name in ("trials", "passes", "alone", "units"):
            out[name] = json.dumps(out[name])
        out["packing"] = json.dumps(out["packing"]) if out["packing"] else None
        return out

    @classmethod
    def from_row(cls, row: Mapping) -> PlanRecord:
        """Read a plans row back (its JSON columns decoded, then :meth:`from_json`)."""
        data = dict(row)
        for name in ("trials", "passes", "alone", "units", "packing"):
            text = data.get(name)
            data[name] = None if text in (None, "") else json.loads(text)
        return cls.from_json(data)
