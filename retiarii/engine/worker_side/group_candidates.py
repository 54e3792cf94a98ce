"""Which tasks of a job may train as one group, and a candidate group's plan after the passes.

:func:`group_tasks` is the decision (pure: plain values in, trial ids out); :func:`plan_group`
plans the models of one candidate group (``build_plan``, then the registered passes), whose
``groups()`` say which of them really share the pipeline (the worker's second, model-level
check).

Example::

    group_tasks([GroupCandidate("a", "s", "t", "d", (0, 0), 2),
                 GroupCandidate("b", "s", "t", "d", (0, 0), 1)])   # [("a", "b")]
    plan = plan_group({"a": model_a, "b": model_b}, "d", {"a": {}, "b": {}})
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Hashable

from ...optim import build_plan
from ...optim.passes import PassManager
from ...optim.plan import LogicalPlan, PlanModel

__all__ = ["GroupCandidate", "group_tasks", "plan_group"]


@dataclass(frozen=True)
class GroupCandidate:
    """What the decision needs to know of one task (all plain, comparable values)."""

    trial_id: str
    space: Hashable  # the space reference of the spec
    trainer: Hashable  # the trainer reference (or its config, as canonical JSON)
    data_key: str | None  # Trainer.data_key(hparams); None never groups
    position: tuple[int, int]  # (epoch, batch) the task starts from
    steps: int  # epochs to train (stop_step - start_step); 0 trains nothing


def group_tasks(candidates: Iterable[GroupCandidate]) -> list[tuple[str, ...]]:
    """The tasks that may train as one group: same space, trainer, data key (not None) and
    starting position, with something to train; each other task alone. In input order.

    The plan may still split a group (``LogicalPlan.groups()``: a model whose input is not
    the shared pipeline); that is the worker's second, model-level check.

    Example::

        group_tasks([GroupCandidate("a", "s", "t", "d", (0, 0), 2),
                     GroupCandidate("b", "s", "t", "d", (0, 0), 1),
                     GroupCandidate("c", "s", "t", None, (0, 0), 2)])   # [("a", "b"), ("c",)]
    """
    out: dict[Hashable, list[str]] = {}
    for c in candidates:
        joins = c.data_key is not None and c.steps > 0
        key = ("group", c.space, c.trainer, c.data_key, c.position) if joins else ("alone", c.trial_id)
        out.setdefault(key, []).append(c.trial_id)
    return [tuple(ids) for ids in out.values()]


def plan_group(models: Mapping[str, Any], data_key: str,
               hparams: Mapping[str, dict], batch_ops: bool = False,
               passes: Sequence[str] | None = None) -> LogicalPlan:
    """The plan of one candidate group after the passes (by default ``cse``, then, with
    ``batch_ops``, ``batching``: a frozen per-example layer the models feed with other values
    runs once on their concatenated inputs); its ``groups()`` say which models really share
    the pipeline.

    Args:
        models: trial id -> its :class:`~retiarii.space.Model` (``space.replay(sample)``).
        data_key: the trainer's data key, the same for every trial.
        hparams: trial id -> its hparams.
        batch_ops: run the batching pass too (opt-in: on a CPU it saves per-call overhead
            only, and costs concatenations: benchmarks/README.md).
        passes: the registered passes to run (:mod:`retiarii.optim.passes`; they run in the
            registry's order); given, it replaces ``batch_ops``.
    """
    if passes is None:
        passes = ["cse", "batching"] if batch_ops else ["cse"]
    plan = build_plan([PlanModel(t, m, data_key, dict(hparams[t])) for t, m in models.items()])
    return PassManager(passes).run(plan).plan
