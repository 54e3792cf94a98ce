"""The engine's side of several objectives and constraints: what a finished trial's metrics
make of its model (:class:`Outcomes`), and the store's rows for it (:class:`FrontTable`).

A trial's final metrics, merged with the costs measured for its model (engine/costs.py),
give each objective and constraint metric its value. With one metric and no constraint
nothing changes: the model's value is its metric, the strategy is told it. With several
objectives the strategy is told the list of their values and the constraints' violation;
the model's ``values`` and ``violation`` are kept, and the experiment's Pareto front
(``experiments.front``) is updated in the same transaction. With one metric and
constraints, a model that misses one is told to the strategy as failed (``None``: the
strategies of one metric know no violation) and is kept ``trained`` with its violation, so
``status`` ranks only feasible models.

Example::

    outcomes = Outcomes(Objectives.of(["val_acc", "latency_ms"], ["max", "min"]))
    o = outcomes.judge({"val_acc": 0.9}, costs={"latency_ms": 3.0})
    o.told, o.violation        # [0.9, 3.0], 0.0
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from ...objectives import Objectives, ParetoFront
from .segments_table import finite

__all__ = ["FrontTable", "Outcome", "Outcomes"]


@dataclass(frozen=True)
class Outcome:
    """What a finished trial makes of its model."""

    value: float | None  # models.value: the first objective (None: the model failed)
    told: Any  # what the strategy is told: a value, a list of values, or None
    violation: float  # of the constraints; 0.0 when there are none or all are met
    values: dict  # every objective and constraint metric known, final
    error: str | None  # why the model failed; None when it did not


class Outcomes:
    """Judges finished trials against the experiment's :class:`~retiarii.objectives.Objectives`
    and keeps its Pareto front."""

    def __init__(self, objectives: Objectives):
        self.objectives = objectives
        self.front = ParetoFront()

    @property
    def extended(self) -> bool:
        """Whether models keep values beyond the one metric (several objectives, constraints)."""
        return self.objectives.multi or bool(self.objectives.constraints)

    def judge(self, metrics: dict, costs: dict | None = None) -> Outcome:
        """The outcome of a trial whose last result is ``metrics``; ``costs``: its model's
        measured costs (a metric the trial reports itself wins over a cost of the same name)."""
        obj = self.objectives
        merged = {**(costs or {}), **metrics}
        values = {m: finite(merged.get(m)) for m in obj.needed if merged.get(m) is not None}
        bad = [m for m in obj.metrics if values.get(m) is None]
        if bad:
            m = bad[0]
            reported = merged.get(m)
            error = (f"{m} = {reported!r}: not a finite number" if reported is not None
                     else f"the trial reported no {m}")
            return Outcome(None, None, 0.0, values, error)
        violation = obj.violation(values)
        value = values[obj.metrics[0]]
        if obj.multi:
            told = [values[m] for m in obj.metrics]
        else:  # one metric: an infeasible model is told as failed (see the module docstring)
            told = value if violation == 0 else None
        return Outcome(value, told, violation, values, None)

    def ruled_out(self, costs: dict) -> str | None:
        """Why a model must not be trained, its costs (measured before training) missing a
        constraint on them; None when they meet every one they can be checked against.

        Example::

            Outcomes(Objectives.of("val_acc", constraints=["params <= 100"])).ruled_out(
                {"params": 120.0})   # 'not trained: params = 120 misses params <= 100 ...'
        """
        for c in self.objectives.constraints:
            if c.metric in costs and not c.met(costs[c.metric]):
                return (f"not trained: {c.metric} = {costs[c.metric]:.6g} misses the "
                        f"constraint {c} (measured before training)")
        return None

    def known(self, row: dict) -> tuple[Any, float]:
        """``(told, violation)`` of a finished model of the store, to tell a strategy that
        proposes its structure again (dedup)."""
        if not self.extended:
            return row.get("value"), 0.0
        values = row.get("values")
        if isinstance(values, str):
            values = json.loads(values)
        if row.get("value") is None or not values:
            return None, 0.0
        outcome = self.judge(values)
        return outcome.told, outcome.violation

    def add_to_front(self, model_id: int, outcome: Outcome) -> bool:
        """Adds a trained model; True when it joins the front."""
        if outcome.value is None or not self.objectives.multi:
            return False
        return self.front.add(model_id, self.objectives.point(outcome.values), outcome.violation)


class FrontTable:
    """The current experiment's multi-objective rows of a :class:`~.store.Store`: models'
    ``values`` and ``violation``, the experiment's ``front``, and the ``costs`` cache."""

    def __init__(self, store):
        self.store = store

    def set_values(self, model_id: int, values: dict, violation: float) -> None:
        self.store.flush()
        self.store.db.execute("UPDATE models SET \"values\" = ?, violation = ? WHERE id = ?",
                              [json.dumps(values), violation, model_id])

    def set_front(self, model_ids) -> None:
        self.store.flush()
        self.store.db.execute("UPDATE experiments SET front = ? WHERE id = ?",
                              [json.dumps(sorted(model_ids)), self.store.experiment_id])

    def front_ids(self) -> list[int] | None:
        """The ids on the front, or None for an experiment with one metric."""
        row = self.store.db.execute("SELECT front FROM experiments WHERE id = ?",
                                    [self.store.experiment_id]).fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def models(self) -> list[dict]:
        """The experiment's trained models with their ``values`` decoded, oldest first:
        ``model_id``, ``sample``, ``hash``, ``values``, ``violation``, ``updated``."""
        self.store.flush()
        rows = self.store.db.execute(
            "SELECT id, sample, hash, \"values\", violation, updated FROM models "
            "WHERE experiment_id = ? AND status = 'trained' AND \"values\" IS NOT NULL "
            "ORDER BY updated, id", [self.store.experiment_id]).fetchall()
        return [{"model_id": r[0], "sample": json.loads(r[1]), "hash": r[2],
                 "values": json.loads(r[3]), "violation": r[4] or 0.0, "updated": r[5]}
                for r in rows]

    def front(self) -> list[dict]:
        """The models on the front (:meth:`models` rows), in id order."""
        ids = set(self.front_ids() or [])
        return sorted((m for m in self.models() if m["model_id"] in ids),
                      key=lambda m: m["model_id"])

    # ---- the costs measured once per architecture and device ----------------------------------

    def costs(self, structure: str, device: str) -> dict[str, tuple[float, float | None]]:
        """name -> (value, spread) measured for the structural hash on ``device``."""
        rows = self.store.db.execute(
            "SELECT name, value, spread FROM costs WHERE hash = ? AND device = ?",
            [structure, device]).fetchall()
        return {name: (value, spread) for name, value, spread in rows}

    def add_costs(self, structure: str, device: str,
                  costs: dict[str, tuple[float, float | None]]) -> None:
        self.store.flush()
        now = time.time()
        with self.store.db.atomic():  # a savepoint inside a trial end's transaction
            self.store.db.conn.executemany(
                "INSERT OR REPLACE INTO costs (hash, device, name, value, spread, time) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(structure, device, name, value,
                  None if spread is None or not math.isfinite(spread) else spread, now)
                 for name, (value, spread) in costs.items()])
