"""The typed contract of grouped jobs: what the runner tells a worker, and the layout it holds.

A grouped job (docs/optimization.md, "In a search") crosses two boundaries: the runner tells
the worker how to train it (:class:`GroupOrder`, sent as ``Job.meta["group"]``), and the
runner keeps, per group key and kind of device, the layout decision in force
(:class:`HeldLayout`: sent back to later jobs in :attr:`GroupOrder.layouts`, written in each
unit's ``"decision"`` of the plans table, read back on resume). Both are frozen dataclasses
with one codec each (``to_json`` / ``from_json``), and this module is the only place their
fields are spelled. What grouped jobs taught the runner (:class:`GroupMemory`) is what the plans
table reads back for it on resume: it lives here so that the store need not import the runner.

Example::

    order = GroupOrder(fuse="auto", passes={"batching": "auto"}, profile=("t1", "t2"))
    job = Job("j", tasks, meta={"group": order})
    group_order(job.meta)           # the order, whatever form meta["group"] takes
    GroupOrder.from_json(order.to_json()) == order
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GroupMemory", "GroupOrder", "HeldLayout", "group_order"]


@dataclass(frozen=True)
class HeldLayout:
    """The layout decision in force for one group key on one kind of device.

    Args:
        order: layouts (:class:`~retiarii.optim.cost.Layout` values) best first; a job applies
            the first that applies to it.
        speedups: layout -> measured speed-up over training apart (None: not measured).
        reverted: layouts measured slower over a whole segment: never chosen again.
        reason: one line for ``retiarii status`` (``cost.describe``).
        strikes: layout (or ``"fusion"``) -> slower segments in a row (a resumed search counts
            on from them).
        bound_s: the lower bound of a step alone the choice was measured against, when apart
            was not profiled (measuring.py).
        bounds: layouts left unmeasured because their upper bound lost -> that bound.
    """

    order: tuple[str, ...]
    speedups: Mapping[str, float | None] = field(default_factory=dict)
    reverted: tuple[str, ...] = ()
    reason: str = ""
    strikes: Mapping[str, int] = field(default_factory=dict)
    bound_s: float | None = None
    bounds: Mapping[str, Any] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"order": list(self.order), "speedups": dict(self.speedups),
                               "reverted": list(self.reverted), "reason": self.reason,
                               "strikes": dict(self.strikes)}
        if self.bound_s is not None:
            out["bound_s"] = self.bound_s
        if self.bounds:
            out["bounds"] = dict(self.bounds)
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> HeldLayout:
        """Read one back (a plans row's ``decision``; keys this version does not know are
        ignored, missing ones take their defaults: rows of older stores read as well)."""
        return cls(order=tuple(data.get("order") or ()),
                   speedups=dict(data.get("speedups") or {}),
                   reverted=tuple(data.get("reverted") or ()), reason=data.get("reason") or "",
                   strikes=dict(data.get("strikes") or {}), bound_s=data.get("bound_s"),
                   bounds=data.get("bounds") or None)


@dataclass(frozen=True)
class GroupOrder:
    """How a worker trains a grouped job (``Job.meta["group"]``).

    Args:
        passes: the optional plan passes' settings (name -> True or ``"auto"``;
            :mod:`retiarii.optim.passes`).
        pass_refs: name -> import reference of a pass registered outside the package
            (:func:`~retiarii.optim.passes.pass_ref`): the worker imports it.
        fuse: whether same-architecture trials may train fused (True, False, ``"auto"``).
        unfused: trials whose fusion was reverted: they train unfused.
        profile: trials to profile alone (one per architecture is); None: measure nothing.
        alone_s: trial -> its step time alone, already known.
        alone_by_arch: device -> architecture (``fusion_key``) -> step time alone.
        layouts: device -> the decision held for the job's group key (applied, not measured).
        dedicated: module patterns computed on a device of their own (engine/dedicated.py).
        dedicated_device: which device (``"process"``, ``"thread"``, ``"cuda:N"``; None: per
            worker).
    """

    passes: Mapping[str, Any] = field(default_factory=dict)
    pass_refs: Mapping[str, str] = field(default_factory=dict)
    fuse: Any = False
    unfused: tuple[str, ...] = ()
    profile: tuple[str, ...] | None = None
    alone_s: Mapping[str, float] = field(default_factory=dict)
    alone_by_arch: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    layouts: Mapping[str, HeldLayout] = field(default_factory=dict)
    dedicated: tuple[str, ...] = ()
    dedicated_device: str | None = None

    @property
    def measures(self) -> bool:
        """Whether the worker measures this job (``profile`` given, even empty)."""
        return self.profile is not None

    def to_json(self) -> dict:
        return {"passes": dict(self.passes), "pass_refs": dict(self.pass_refs),
                "fuse": self.fuse, "unfused": list(self.unfused),
                "profile": None if self.profile is None else list(self.profile),
                "alone_s": dict(self.alone_s),
                "alone_by_arch": {d: dict(a) for d, a in self.alone_by_arch.items()},
                "layouts": {d: c.to_json() for d, c in self.layouts.items()},
                "dedicated": list(self.dedicated), "dedicated_device": self.dedicated_device}

    @classmethod
    def from_json(cls, data: Mapping) -> GroupOrder:
        profile = data.get("profile")
        return cls(passes=dict(data.get("passes") or {}),
                   pass_refs=dict(data.get("pass_refs") or {}), fuse=data.get("fuse", False),
                   unfused=tuple(data.get("unfused") or ()),
                   profile=None if profile is None else tuple(profile),
                   alone_s=dict(data.get("alone_s") or {}),
                   alone_by_arch={d: dict(a) for d, a in (data.get("alone_by_arch") or {}).items()},
                   layouts={d: HeldLayout.from_json(c)
                            for d, c in (data.get("layouts") or {}).items()},
                   dedicated=tuple(data.get("dedicated") or ()),
                   dedicated_device=data.get("dedicated_device"))


def group_order(meta: Mapping) -> GroupOrder | None:
    """The :class:`GroupOrder` of a job's ``meta``: None for a job whose trials train each
    alone; ``meta["group"] = True`` (a group with every default: CSE, nothing measured) and
    its JSON form read as well."""
    order = meta.get("group")
    if not order:
        return None
    if isinstance(order, GroupOrder):
        return order
    if order is True:
        return GroupOrder()
    if isinstance(order, Mapping):
        return GroupOrder.from_json(order)
    raise TypeError(f"job meta['group'] = {order!r}: give a GroupOrder (or True)")


@dataclass
class GroupMemory:
    """What grouped jobs taught the planner; restored from the plans table on resume."""

    alone: set[str] = field(default_factory=set)  # reverted or failed groups' trials: alone
    unfused: set[str] = field(default_factory=set)  # fusion reverted: unfused from now on
    alone_s: dict[str, float] = field(default_factory=dict)  # trial -> step time alone
    layouts: dict[str, dict[str, HeldLayout]] = field(default_factory=dict)  # key -> device ->
    alone_arch: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> arch -> s
