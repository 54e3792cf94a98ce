"""The store's read side: trials, events, counts, learning curves and the best trials and
models of the current experiment (a mixin of :class:`~.store.Store`, which owns the
connection; every query flushes buffered metric rows first), and the row helpers both sides
use."""
from __future__ import annotations

import json
from typing import Any, Iterable


from ...enums import Mode
from .schema import STATES, StoreError

__all__ = ["StoreQueries", "not_found_error"]


def encode_state(state: Any) -> str:
    """A state as its string (TrialState enum members carry the string as their value)."""
    name = getattr(state, "value", state)
    if name not in STATES:
        raise StoreError(f"unknown trial state {state!r}; states are {', '.join(STATES)}")
    return name


def json_text(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj)


def decode_json_columns(row: dict, *columns: str) -> dict:
    for column in columns:
        if row.get(column) is not None:
            row[column] = json.loads(row[column])
    return row


_TRIAL_JSON = ("spec", "hparams", "record")


def _order(mode: Mode | str) -> str:
    return "DESC" if Mode.parse(mode) is Mode.MAX else "ASC"


class StoreQueries:
    """Queries of the current experiment; see the module docstring."""

    def _experiment(self, experiment_id: int | None) -> int:
        experiment_id = self.experiment_id if experiment_id is None else experiment_id
        if experiment_id is None:
            raise StoreError("no current experiment: call add_experiment() or use_experiment()")
        return experiment_id

    def _scope(self, alias: str = "t") -> tuple[str, list]:
        """SQL restricting trials to the current experiment (nothing when there is none)."""
        if self.experiment_id is None:
            return "1", []
        return f"{alias}.experiment_id = ?", [self.experiment_id]

    def get_trial(self, trial_id: str) -> dict:
        """A trial row with ``spec``, ``hparams`` and ``record`` decoded."""
        self.flush()
        try:
            return decode_json_columns(self.db["trials"].get(trial_id), *_TRIAL_JSON)
        except not_found_error():
            raise StoreError(f"{self.path} has no trial {trial_id!r}") from None

    def trials(self, states: Iterable[Any] | None = None) -> list[dict]:
        """The current experiment's trials (decoded), optionally only those in ``states``."""
        self.flush()
        where, params = self._scope("trials")
        if states is not None:
            names = [encode_state(s) for s in states]
            where += f" AND state IN ({', '.join('?' * len(names))})"
            params += names
        return [decode_json_columns(r, *_TRIAL_JSON)
                for r in self.db["trials"].rows_where(where, params, order_by="seq")]

    def events(self, trial_id: str | None = None) -> list[dict]:
        """State transitions in the order they were journaled."""
        self.flush()
        if trial_id is None:
            return list(self.db["events"].rows_where(order_by="id"))
        return list(self.db["events"].rows_where("trial_id = ?", [trial_id], order_by="id"))

    def counts_by_state(self) -> dict[str, int]:
        """How many of the current experiment's trials are in each state (all five keys)."""
        self.flush()
        where, params = self._scope()
        counts = dict.fromkeys(STATES, 0)
        for state, n in self.db.execute(
                f"SELECT state, count(*) FROM trials t WHERE {where} GROUP BY state", params):
            counts[state] = n
        return counts

    def learning_curve(self, trial_id: str, metric: str) -> list[tuple[int, float | None]]:
        """``[(step, value), ...]`` of one trial's metric, by step."""
        self.flush()
        return [tuple(r) for r in self.db.execute(
            "SELECT step, value FROM metrics WHERE trial_id = ? AND name = ? ORDER BY step",
            [trial_id, metric])]

    def learning_curves(self, metric: str) -> dict[str, list[tuple[int, float | None]]]:
        """Every trial's curve of ``metric`` in the current experiment."""
        self.flush()
        where, params = self._scope()
        curves: dict[str, list] = {}
        for trial_id, step, value in self.db.execute(
                f"SELECT m.trial_id, m.step, m.value FROM metrics m JOIN trials t ON t.id = m.trial_id "
                f"WHERE m.name = ? AND {where} ORDER BY m.trial_id, m.step", [metric, *params]):
            curves.setdefault(trial_id, []).append((step, value))
        return curves

    def final_values(self, metric: str) -> list[tuple[str, float, float | None]]:
        """``(trial_id, end time, value at its last step)`` of every ended trial (TERMINATED,
        or ERRORED for good), in the order they ended; for best-so-far plots."""
        self.flush()
        where, params = self._scope()
        return [tuple(r) for r in self.db.execute(
            f"SELECT t.id, t.ended, (SELECT m.value FROM metrics m WHERE m.trial_id = t.id AND "
            f"m.name = ? ORDER BY m.step DESC LIMIT 1) FROM trials t WHERE t.ended IS NOT NULL "
            f"AND {where} ORDER BY t.ended, t.seq", [metric, *params])]

    def best_trials(self, metric: str, mode: str = "max", k: int = 10,
                    reduce: str = "last", finished: bool = False) -> list[dict]:
        """The ``k`` best trials by ``metric``: its value at the trial's last step
        (``reduce="last"``) or its best value over all steps (``"best"``). ERRORED trials never
        rank (their last value is not a result); ``finished=True`` ranks TERMINATED trials
        only (a best that never goes down while trials run).
        Rows: trial_id, model_id, value, step."""
        order = _order(mode)
        if reduce not in ("last", "best"):
            raise ValueError(f"reduce must be 'last' or 'best', got {reduce!r}")
        within = "m.step DESC" if reduce == "last" else f"m.value {order}, m.step"
        where, params = self._scope()
        where += " AND t.state = 'TERMINATED'" if finished else " AND t.state != 'ERRORED'"
        self.flush()
        sql = f"""
            SELECT trial_id, model_id, value, step FROM (
                SELECT m.trial_id, t.model_id, m.value, m.step,
                       ROW_NUMBER() OVER (PARTITION BY m.trial_id ORDER BY {within}) AS rn
                FROM metrics m JOIN trials t ON t.id = m.trial_id
                WHERE m.name = ? AND m.value IS NOT NULL AND {where})
            WHERE rn = 1 ORDER BY value {order}, trial_id LIMIT ?"""
        return list(self.db.query(sql, [metric, *params, int(k)]))

    def best_models(self, metric: str, mode: str = "max", k: int = 10,
                    reduce: str = "last", finished: bool = False) -> list[dict]:
        """The ``k`` best models, each scored by its best trial (see :meth:`best_trials`).
        Rows: model_id, trial_id, value, step, sample (decoded), hash, status."""
        trials = self.best_trials(metric, mode, k=-1, reduce=reduce,  # LIMIT -1: all
                                  finished=finished)
        best: dict[int, dict] = {}
        for row in trials:  # already sorted best first: the first row per model wins
            if row["model_id"] is not None and row["model_id"] not in best:
                best[row["model_id"]] = row
        out = []
        for model_id, row in list(best.items())[:k if k >= 0 else None]:
            model = self.get_model(model_id)
            out.append({"model_id": model_id, "trial_id": row["trial_id"], "value": row["value"],
                        "step": row["step"], "sample": model["sample"], "hash": model["hash"],
                        "status": model["status"]})
        return out


def not_found_error() -> type:
    """sqlite_utils's error for a missing row (imported by then: a store is open)."""
    from sqlite_utils.db import NotFoundError

    return NotFoundError
