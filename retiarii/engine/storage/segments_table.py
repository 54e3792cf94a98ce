"""The store's side of a one-shot search: its segments, the models they evaluated, its result.

A one-shot search (:mod:`.one_shot`) trains one set of shared weights segment by segment.
When a segment is done, :meth:`SegmentTable.commit` writes in **one transaction** the models
the segment evaluated (rows of ``models`` with ``segment`` and ``metrics``) and the segment's
row in ``segments`` (its unit, the file that holds the whole state after it; the strategy's
metrics; the architecture it selects then). A driver killed at any moment has therefore
recorded a segment and its models together or neither, and a resumed search, which starts
from the last recorded unit, records each model once. At the end the selected architecture
becomes the experiment's result model (``experiments.result_model``), which
``retiarii export`` writes out. A search that fails for its own reason (a space the strategy
cannot handle) keeps the reason in ``experiments.error``.

Example::

    table = SegmentTable(store)
    table.commit(1, "e1-one-shot/step-000001", {"loss": 0.4},
                 {"op": "conv3x3"}, [{"sample": {"op": "conv3x3"}, "metrics": {"val_acc": 0.8}}],
                 metric="val_acc")
    table.last()["segment"]     # 1
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

from ...enums import Mode, ModelStatus
from .selection_notes import selection_warnings

__all__ = ["SegmentTable", "finite"]


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


class SegmentTable:
    """The current experiment's segments, evaluated models and result in a
    :class:`~.store.Store`."""

    def __init__(self, store):
        self.store = store

    # ---- writes (each one transaction) --------------------------------------------------------
    def commit(self, segment: int, unit: str, metrics: dict, selected: dict,
               models: list[dict], *, metric: str, seconds: float = 0.0) -> list[int]:
        """Record segment ``segment`` (1-based) as done, with its ``unit`` (a checkpoint name
        inside the run's folder) and the ``models`` it evaluated (``{"sample", "metrics"}``
        each; a model's value is its ``metric``, when a finite number); returns their ids.
        A segment already recorded is refused (it would record its models twice)."""
        with self.store.transaction():
            row = self.store.db.execute(
                "SELECT 1 FROM segments WHERE experiment_id = ? AND segment = ?",
                [self.store.experiment_id, segment]).fetchone()
            if row is not None:
                raise ValueError(f"segment {segment} of experiment {self.store.experiment_id} "
                                 f"is already recorded")
            ids = [self._insert_model(segment, m["sample"], m.get("metrics") or {}, metric)
                   for m in models]
            self.store.db.execute(
                "INSERT INTO segments (experiment_id, segment, unit, metrics, selected, models, "
                "seconds, time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [self.store.experiment_id, segment, unit, _json(metrics), _json(selected),
                 len(ids), seconds, time.time()])
        return ids

    def _insert_model(self, segment: int, sample: dict, metrics: dict, metric: str) -> int:
        now = time.time()
        value = finite(metrics.get(metric))
        # a metric reported as NaN or inf (a diverged path) ranks nowhere: that model failed
        failed = metrics.get(metric) is not None and value is None
        status = ModelStatus.FAILED if failed else ModelStatus.TRAINED
        return self.store.db.execute(
            "INSERT INTO models (experiment_id, sample, status, value, segment, metrics, "
            "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [self.store.experiment_id, _json(sample), status.value, value, segment,
             _json(metrics), now, now]).lastrowid

    def record_result(self, sample: dict, graph: dict | None, hash: str | None,
                      value: float | None) -> int:
        """Record the architecture the search selected as the experiment's result model
        (``segment`` NULL: no segment evaluated it as such); returns its id."""
        now = time.time()
        with self.store.transaction():
            model_id = self.store.db.execute(
                "INSERT INTO models (experiment_id, sample, graph, hash, status, value, created, "
                "updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [self.store.experiment_id, _json(sample), None if graph is None else
                 json.dumps(graph), hash, ModelStatus.TRAINED.value, value, now, now]).lastrowid
            self.store.db.execute("UPDATE experiments SET result_model = ?, updated = ? "
                                  "WHERE id = ?", [model_id, now, self.store.experiment_id])
        return model_id

    def fail(self, error: str) -> None:
        """Mark the experiment failed, keeping ``error`` (why) in ``experiments.error``."""
        with self.store.transaction():
            self.store.db.execute("UPDATE experiments SET status = 'failed', error = ?, "
                                  "updated = ? WHERE id = ?",
                                  [error, time.time(), self.store.experiment_id])

    def clear_error(self) -> None:
        """Forget a recorded failure (a resumed search tries again)."""
        with self.store.transaction():
            self.store.db.execute("UPDATE experiments SET error = NULL WHERE id = ?",
                                  [self.store.experiment_id])

    # ---- reads ------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """Every segment recorded, in order, JSON columns decoded."""
        self.store.flush()
        return [{**r, "metrics": json.loads(r["metrics"] or "{}"),
                 "selected": json.loads(r["selected"] or "{}")}
                for r in self.store.db["segments"].rows_where(
                    "experiment_id = ?", [self.store.experiment_id], order_by="segment")]

    def last(self) -> dict | None:
        """The last segment recorded, or None."""
        rows = self.rows()
        return rows[-1] if rows else None

    def evaluated(self) -> list[dict]:
        """The models the segments evaluated, oldest first: id, segment, sample, metrics,
        value, status."""
        self.store.flush()
        rows = self.store.db.execute(
            "SELECT id, segment, sample, metrics, value, status FROM models WHERE "
            "experiment_id = ? AND segment IS NOT NULL ORDER BY id",
            [self.store.experiment_id]).fetchall()
        return [{"id": r[0], "segment": r[1], "sample": json.loads(r[2]),
                 "metrics": json.loads(r[3] or "{}"), "value": r[4], "status": r[5]}
                for r in rows]

    def best(self, mode: Mode | str = "max", k: int | None = 5) -> list[dict]:
        """The ``k`` best architectures the segments evaluated, each listed once: a sample
        evaluated several times (ENAS' controller draws the same path again and again) is
        judged on its latest value (the most trained weights, as the result is) and says how
        many times it was evaluated (``count``); ties: the earlier first. ``k=None``: all."""
        rows = self.store.db.execute(
            "SELECT id, segment, sample, value FROM models WHERE experiment_id = ? AND "
            "segment IS NOT NULL AND value IS NOT NULL ORDER BY id",
            [self.store.experiment_id]).fetchall()
        latest: dict[str, dict] = {}
        for model_id, segment, sample, value in rows:
            first = latest.get(sample, {}).get("first", model_id)
            count = latest.get(sample, {}).get("count", 0) + 1
            latest[sample] = {"model_id": model_id, "segment": segment, "value": value,
                              "count": count, "first": first}
        sign = Mode.parse(mode).sign
        ranked = sorted(latest.items(), key=lambda kv: (-sign * kv[1]["value"], kv[1]["first"]))
        return [{"model_id": r["model_id"], "segment": r["segment"], "sample": json.loads(key),
                 "value": r["value"], "count": r["count"]} for key, r in ranked[:k]]

    def result(self) -> dict | None:
        """The result model's row (``sample``, ``graph`` decoded), or None before the end."""
        row = self.store.db.execute("SELECT result_model FROM experiments WHERE id = ?",
                                    [self.store.experiment_id]).fetchone()
        if row is None or row[0] is None:
            return None
        return self.store.get_model(row[0])

    def error(self) -> str | None:
        row = self.store.db.execute("SELECT error FROM experiments WHERE id = ?",
                                    [self.store.experiment_id]).fetchone()
        return None if row is None else row[0]

    def summary(self, segments: int | None, mode: Mode | str = "max", k: int = 5) -> dict:
        """What ``retiarii status`` shows: segment k of n, models evaluated, best so far, the
        selected architecture (the result's once the search is done, else the last
        segment's), and the error of a failed search."""
        last = self.last()
        result = self.result()
        count = self.store.db.execute(
            "SELECT count(*) FROM models WHERE experiment_id = ? AND segment IS NOT NULL",
            [self.store.experiment_id]).fetchone()[0]
        selected = result["sample"] if result is not None else \
            (last["selected"] if last is not None else None)
        candidates = self.best(mode, None)
        config = self.store.get_experiment()["config"]
        value = result["value"] if result is not None else next(
            (c["value"] for c in candidates if c["sample"] == selected), None)
        return {"segment": last["segment"] if last else 0, "segments": segments,
                "models": count, "best": candidates[:k], "selected": selected,
                "result_model": None if result is None else result["id"],
                "metrics": last["metrics"] if last else {}, "error": self.error(),
                "warnings": selection_warnings(candidates, value, config.get("chance"),
                                               config.get("metric", "val_acc"), mode)}
