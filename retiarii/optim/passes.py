"""The pass manager: the registered optimization passes over a logical plan, in their order.

Every cross-model optimization that rewrites a :class:`~.plan.LogicalPlan` is a **pass**: a
pure function ``plan -> PassResult(plan', modified)`` in a file of its own (:mod:`.cse`,
:mod:`.batching`). This module holds the one ordered list of them (as torch.fx's
``PassManager`` holds its passes) and runs a chosen subset in that order, checking the plan
between passes (:func:`check_plan`), so a pass that breaks an invariant is named at once.

A pass is either **required** (``optional=False``: every merged plan runs it; CSE, without
which nothing is merged) or **optional**: an experiment's setting turns it on (``True``), off
(``False``) or leaves it to measurement (``"auto"``: a group's layouts with and without it are
measured on its first batches and the faster kept; docs/optimization.md, "Choosing a layout").
The engine reads nothing of a pass but this record: a new pass is one file that defines its
function and calls :func:`register_pass`, with no edit to the runner, the worker or the CLI
(``--passes NAME=auto``). A worker finds a pass registered outside the package by the
reference the driver sends with the job (:func:`pass_ref`: the module-level :class:`Pass`, or
its function's module, which registers it on import).

Example::

    from retiarii.optim.passes import Pass, register_pass, PassManager

    def unshare_dropout(plan):            # a pass: plan -> PassResult
        ...

    register_pass(Pass("unshare_dropout", unshare_dropout, summary="..."))
    PassManager(["cse", "unshare_dropout"]).run(plan)   # PassResult(plan', modified)
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .batching import batching, worth_measuring
from .cost import Layout
from .cse import cse
from .plan import LogicalPlan, PassResult, PlanError

__all__ = ["LayoutPasses", "Pass", "PassManager", "Setting", "check_plan", "get_pass", "optional_passes",
           "parse_settings", "pass_ref", "register_pass", "registered_passes", "unregister_pass"]

Setting = Any  # True, False, "auto" (the device model decides) or "measure"
_SETTINGS = (True, False, "auto", "measure")


@dataclass(frozen=True)
class Pass:
    """One registered pass.

    Args:
        name: how settings, records and the CLI name it (``--passes NAME=auto``).
        run: ``plan -> PassResult``: pure, idempotent (a second run changes nothing), and
            ``modified`` honest (tests/test_passes.py holds every registered pass to it).
        optional: False for a pass every merged plan runs (CSE); True for one a setting
            chooses.
        default: an optional pass's setting when the experiment names none, under
            ``optimize="auto"`` (under ``optimize=True`` every optional pass is off unless
            named: nothing is measured there). False (opt-in) unless the pass has earned
            ``"auto"`` on the benchmarks.
        worth_measuring: under ``"auto"``, whether the pass's result on a group is worth
            measuring on ``device`` (a ``torch.device``); None: whenever it modified the plan.
        summary: one line for ``retiarii status`` and the docs.
    """

    name: str
    run: Callable[[LogicalPlan], PassResult]
    optional: bool = True
    default: Setting = False
    worth_measuring: Callable[[PassResult, Any], bool] | None = None
    summary: str = ""

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"pass name {self.name!r}: give a word of letters, digits and _")
        if self.default not in _SETTINGS:
            raise ValueError(f"pass {self.name!r}: default={self.default!r}: give True, False "
                             f"or 'auto'")


_REGISTRY: dict[str, Pass] = {}


def register_pass(p: Pass, *, before: str | None = None, replace: bool = False) -> Pass:
    """Add ``p`` to the ordered list (at the end, or just before the pass named ``before``).
    A name already registered is refused unless ``replace`` (which keeps its place). Returns
    ``p``."""
    if p.name in _REGISTRY and not replace:
        raise ValueError(f"a pass named {p.name!r} is registered already "
                         f"(register_pass(..., replace=True) replaces it)")
    if before is not None and before not in _REGISTRY:
        raise ValueError(f"register_pass(before={before!r}): {_unknown(before)}")
    if p.name in _REGISTRY or before is None:
        _REGISTRY[p.name] = p
        return p
    items = list(_REGISTRY.items())
    at = [n for n, _ in items].index(before)
    items.insert(at, (p.name, p))
    _REGISTRY.clear()
    _REGISTRY.update(items)
    return p


def unregister_pass(name: str) -> None:
    """Remove a registered pass (what a test that registered one calls when done)."""
    if name not in _REGISTRY:
        raise ValueError(f"unregister_pass({name!r}): {_unknown(name)}")
    if not _REGISTRY[name].optional:
        raise ValueError(f"pass {name!r} is required by the engine and cannot be removed")
    del _REGISTRY[name]


def registered_passes() -> tuple[Pass, ...]:
    """Every registered pass, in the order they run."""
    return tuple(_REGISTRY.values())


def optional_passes() -> tuple[Pass, ...]:
    """The passes a setting chooses, in their order."""
    return tuple(p for p in _REGISTRY.values() if p.optional)


def pass_ref(p: Pass) -> str | None:
    """How another process finds ``p`` (what the driver sends a worker with a job): None for
    the package's own passes (registered by importing retiarii); else an import reference to
    the :class:`Pass` (a module-level variable holding it) or, failing that, to its function,
    whose module registers it when imported. Raises ``EncodeError`` naming the fix when
    neither can be imported (a pass made inside a function)."""
    if str(getattr(p.run, "__module__", "")).startswith("retiarii."):
        return None
    from ..refs import EncodeError, ref_of  # the one producer of references
    try:
        return ref_of(p)
    except EncodeError:
        return ref_of(p.run)


def get_pass(name: str, ref: str | None = None) -> Pass:
    """The pass named ``name``; with ``ref`` (:func:`pass_ref`, sent by the driver), imported
    first when this process has not registered it (a worker)."""
    if name not in _REGISTRY and ref is not None:
        from ..refs import resolve_ref
        found = resolve_ref(ref)  # importing its module may register it already
        if isinstance(found, Pass) and found.name == name and name not in _REGISTRY:
            register_pass(found)
    if name not in _REGISTRY:
        raise PlanError(f"pass {name!r}: {_unknown(name)}")
    return _REGISTRY[name]


def _unknown(name: str) -> str:
    names = list(_REGISTRY)
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"no such pass (registered: {', '.join(names)}){hint}"


def parse_settings(settings: Mapping[str, Setting] | Iterable[str] | str | None,
                   ) -> dict[str, Setting]:
    """Optional pass -> setting, from a mapping, ``["name=auto", ...]`` or the CLI's
    ``"batching=auto,mine=true"``. Unknown names and settings are refused, naming the valid
    ones; required passes cannot be set."""
    if settings is None:
        return {}
    if isinstance(settings, str):
        settings = [s for s in settings.split(",") if s.strip()]
    if not isinstance(settings, Mapping):
        pairs = {}
        for item in settings:
            name, sep, value = str(item).partition("=")
            if not sep:
                raise ValueError(f"passes: {item!r}: give NAME=SETTING, e.g. batching=auto")
            low = value.strip().lower()
            pairs[name.strip()] = {"true": True, "on": True, "false": False,
                                   "off": False}.get(low, low)
        settings = pairs
    out: dict[str, Setting] = {}
    for name, value in settings.items():
        p = get_pass(name)
        if not p.optional:
            raise ValueError(f"pass {name!r} is required (it always runs): set only the "
                             f"optional ones: {', '.join(o.name for o in optional_passes())}")
        if value not in _SETTINGS or isinstance(value, (int, float)) and not isinstance(
                value, bool):
            raise ValueError(f"pass {name!r}: setting {value!r}: give True, False, 'auto' "
                             f"or 'measure'")
        out[name] = value
    return out


def check_plan(plan: LogicalPlan, after: str = "") -> None:
    """The plan's invariants, checked between passes: every shared key names a node held by
    two or more models and computed from shared inputs only; every batched pair names a node
    its model holds, not shared, one ``op_key`` per batch, each pair in one batch at most.
    Raises :class:`PlanError` naming the pass (``after``) that broke one."""
    where = f" after pass {after!r}" if after else ""
    for key in plan.shared:
        node = plan.nodes.get(key)
        if node is None:
            raise PlanError(f"shared key {key!r} is not a node of the plan{where}")
        if len(node.holders) < 2:
            raise PlanError(f"node {node.name!r} is shared but held by one model{where}")
        for src in node.inputs:
            if src not in plan.shared:
                raise PlanError(f"shared node {node.name!r} reads {plan.nodes[src].name!r}, "
                                f"which is not shared{where}")
    seen: set[tuple[str, str]] = set()
    for batch in plan.batches:
        if len({plan.nodes[k].op_key for _, k in batch if k in plan.nodes}) != 1:
            raise PlanError(f"a batch mixes operations{where}: {batch}")
        for trial, key in batch:
            node = plan.nodes.get(key)
            if node is None or trial not in node.holders:
                raise PlanError(f"batched pair ({trial}, {key}) is no node of {trial}{where}")
            if key in plan.shared:
                raise PlanError(f"node {node.name!r} is both shared and batched{where}")
            if (trial, key) in seen:
                raise PlanError(f"({trial}, {node.name}) is in two batches{where}")
            seen.add((trial, key))


@dataclass(frozen=True)
class LayoutPasses:
    """Which passes the plan of each merged layout runs, from an experiment's settings of
    the optional passes (name -> True or ``"auto"``; a pass set False or left out does not
    run).

    ``Layout.CSE`` runs the required passes and those set True; ``Layout.BATCHING`` (named
    for the first optional pass, and kept so for the plans tables already written) runs
    those and the passes set ``"auto"`` too. With nothing ``"auto"`` and something set True,
    the group trains in ``BATCHING`` (the same passes: records say a pass applied).

    Example::

        >>> lp = LayoutPasses({"batching": "auto"})
        >>> lp.of(Layout.CSE), lp.of(Layout.BATCHING)
        (('cse',), ('cse', 'batching'))
    """

    settings: Mapping[str, Setting] = field(default_factory=dict)

    @property
    def forced(self) -> tuple[str, ...]:
        return tuple(p.name for p in registered_passes()
                     if not p.optional or self.settings.get(p.name) is True)

    @property
    def measured(self) -> tuple[str, ...]:
        return tuple(p.name for p in registered_passes() if p.optional
                     and self.settings.get(p.name) in ("auto", "measure"))

    def of(self, layout: Layout) -> tuple[str, ...]:
        """The passes the plan of merged ``layout`` runs, in order."""
        if layout is Layout.BATCHING:
            order = {p.name: i for i, p in enumerate(registered_passes())}
            return tuple(sorted(self.forced + self.measured, key=order.__getitem__))
        return self.forced

    def merged(self) -> list[Layout]:
        """The merged layout a group trains in when nothing is measured."""
        if not self.measured and len(self.forced) > len(self.required):
            return [Layout.BATCHING]
        return [Layout.CSE]

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(p.name for p in registered_passes() if not p.optional)

    def worth_measuring(self, result: PassResult, device: Any) -> bool:
        """Whether the plan with the measured passes (``result``, from the plan of
        ``Layout.CSE``) is worth measuring against the plan without them."""
        if not result.modified:
            return False
        return any(get_pass(n).worth_measuring is None or get_pass(n).worth_measuring(
            result, device) for n in self.measured)


class PassManager:
    """Run passes in the registry's order, checking the plan after each.

    Args:
        passes: the passes to run (names or :class:`Pass` es); they run in the registry's
            order whatever order they are given in (a pass unregistered here runs last, in
            the order given).
        check: call :func:`check_plan` after every pass (on by default: it costs microseconds
            against a plan's milliseconds).
    """

    def __init__(self, passes: Sequence[str | Pass], check: bool = True):
        chosen = [p if isinstance(p, Pass) else get_pass(p) for p in passes]
        order = {name: i for i, name in enumerate(_REGISTRY)}
        self.passes = sorted(chosen, key=lambda p: order.get(p.name, len(order)))
        self.check = check

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, plan: LogicalPlan) -> PassResult:
        """``PassResult(plan', modified)``: every pass in order; ``modified`` when any
        modified the plan."""
        modified = False
        for p in self.passes:
            result = p.run(plan)
            if not isinstance(result, PassResult):
                raise PlanError(f"pass {p.name!r} returned {type(result).__name__}, not a "
                                f"PassResult(plan, modified)")
            if self.check:
                check_plan(result.plan, p.name)
            plan, modified = result.plan, modified or result.modified
        return PassResult(plan, modified)


register_pass(Pass("cse", cse, optional=False,
                   summary="common subexpressions: a frozen part the models compute alike "
                           "from the same data runs once"))
register_pass(Pass("batching", batching, default="auto", worth_measuring=worth_measuring,
                   summary="operator batching: a frozen per-example layer the models feed "
                           "with other values runs once on their concatenated inputs"))
