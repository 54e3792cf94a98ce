"""The dashboard's analyses of a store: the search space (choices vs the metric, each choice's
importance, the lineage of an evolution or PBT search), the engine's grouped jobs and scheduler
decisions, and the Pareto front of several objectives.

Importance is scikit-learn's: a random forest fit on the one-hot choices, scored by permutation
importance of each choice (all its one-hot columns permuted together, by permuting the raw
column in front of the encoder), a well-kept estimator rather than one written here.
"""
from __future__ import annotations

import json
import math

from ..engine.jobs.reports import UnitReport
from .store_view import experiment, loads_json, metric_of, sample_columns, table

__all__ = ["search_space", "importance", "engine", "pareto"]

MIN_MODELS_FOR_IMPORTANCE = 6  # fewer finished models than this: a forest says nothing


def _finished_models(db, exp_id: int) -> list[dict]:
    rows = db.execute("SELECT id, sample, value, parent, status FROM models WHERE "
                      "experiment_id = ? ORDER BY id", [exp_id]).fetchall()
    return [{"id": i, "sample": loads_json(s, {}) or {}, "value": v, "parent": p, "status": st}
            for i, s, v, p, st in rows]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def importance(samples: list[dict], values: list[float], labels: list[str],
               seed: int = 0) -> list[list]:
    """``[[label, importance, spread], ...]`` (largest first) of the choices that vary, or []
    when there are too few models; the importance is the drop in the forest's R^2 when the
    choice is shuffled (scikit-learn's ``permutation_importance``, mean and std of 10 repeats)."""
    import numpy as np
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.inspection import permutation_importance
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder

    varying = [k for k in labels if len({json.dumps(s.get(k)) for s in samples}) > 1]
    if len(values) < MIN_MODELS_FOR_IMPORTANCE or not varying:
        return []
    # every choice as text: a category, whatever its type (an int width is a category too)
    x = np.array([[json.dumps(s.get(k)) for k in varying] for s in samples], dtype=object)
    y = np.asarray(values, dtype=float)
    model = make_pipeline(OneHotEncoder(handle_unknown="ignore"),
                          RandomForestRegressor(n_estimators=100, random_state=seed))
    model.fit(x, y)
    result = permutation_importance(model, x, y, n_repeats=10, random_state=seed)
    out = [[k, float(m), float(s)] for k, m, s in
           zip(varying, result.importances_mean, result.importances_std)]
    return sorted(out, key=lambda r: -r[1])


def search_space(db, exp_id: int) -> dict:
    """The search-space page: the finished models' choices and values (parallel coordinates),
    each choice's importance, and the lineage (models' and trials' parents)."""
    e = experiment(db, exp_id)
    metric, mode = metric_of(e["config"])
    models = _finished_models(db, exp_id)
    done = [m for m in models if m["status"] == "trained" and _finite(m["value"])]
    labels = sample_columns([m["sample"] for m in models])
    dims = []
    for k in labels:
        values = [m["sample"].get(k) for m in done]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            dims.append({"label": k, "numeric": True, "values": values})
        else:
            texts = [json.dumps(v) if not isinstance(v, str) else v for v in values]
            keys = sorted(set(texts))
            dims.append({"label": k, "numeric": False, "keys": keys,
                         "values": [keys.index(t) for t in texts]})
    ranked = importance([m["sample"] for m in done], [m["value"] for m in done], labels,
                        seed=e["seed"] or 0)
    edges = [[m["parent"], m["id"]] for m in models if m["parent"] is not None]
    trial_edges = [list(r) for r in db.execute(
        "SELECT parent, id FROM trials WHERE experiment_id = ? AND parent IS NOT NULL "
        "ORDER BY seq", [exp_id])]
    return {"metric": metric, "mode": mode, "dimensions": dims,
            "values": [m["value"] for m in done], "model_ids": [m["id"] for m in done],
            "importance_note": None if ranked else
            f"importance needs {MIN_MODELS_FOR_IMPORTANCE} finished models whose choices vary "
            f"(this search has {len(done)})",
            "lineage": {"models": [[m["id"], m["value"], m["status"]] for m in models],
                        "edges": edges, "trial_edges": trial_edges},
            "tables": {
                "importance": table(["choice", "importance", "std"], ranked),
                "models": table(["model", metric, "status", "parent", *labels],
                                [[m["id"], m["value"], m["status"], m["parent"],
                                  *[m["sample"].get(k) if not isinstance(
                                      m["sample"].get(k), (list, dict))
                                    else json.dumps(m["sample"].get(k)) for k in labels]]
                                 for m in models]),
                "lineage": table(["parent", "child", "kind"],
                                 [[a, b, "model"] for a, b in edges]
                                 + [[a, b, "trial"] for a, b in trial_edges])}}


def lineage_dot(lineage: dict, mode: str) -> str | None:
    """The lineage as Graphviz source (None when no model has a parent): models as nodes
    labelled with their value, the best one filled."""
    if not lineage["edges"] and not lineage["trial_edges"]:
        return None
    values = [v for _, v, _ in lineage["models"] if _finite(v)]
    best = (max if mode == "max" else min)(values) if values else None
    lines = ["digraph lineage {", "rankdir=LR;", 'node [shape=box, style="rounded,filled", '
             'fillcolor="#ffffff", fontname="Helvetica", fontsize=10];']
    linked = {x for e in lineage["edges"] for x in e}
    for model_id, value, status in lineage["models"]:
        if model_id not in linked:
            continue
        label = f"model {model_id}\\n" + (f"{value:.4f}" if _finite(value) else status)
        fill = "#ffd54f" if value is not None and value == best else (
            "#ef9a9a" if status == "failed" else "#e3f2fd")
        lines.append(f'm{model_id} [label="{label}", fillcolor="{fill}", '
                     f'URL="model?id={model_id}"];')
    for parent, child in lineage["edges"]:
        lines.append(f"m{parent} -> m{child};")
    if lineage["trial_edges"] and not lineage["edges"]:  # PBT: trials continue trials
        for parent, child in lineage["trial_edges"]:
            lines.append(f'"{parent}" -> "{child}";')
    lines.append("}")
    return "\n".join(lines)


def _scheduler_decisions(db, exp_id: int, config: dict) -> tuple[list, float]:
    """Events where the scheduler stopped, paused or resumed a trial, and the epochs a stop
    reclaimed (the trainer's epochs minus the epochs the trial had trained)."""
    epochs = ((config.get("trainer") or {}).get("config") or {}).get("epochs")
    rows, reclaimed = [], 0.0
    for t, old, new, reason, worker, when, step in db.execute(
            "SELECT e.trial_id, e.old_state, e.new_state, e.reason, e.worker, e.time, t.step "
            "FROM events e JOIN trials t ON t.id = e.trial_id WHERE t.experiment_id = ? AND "
            "(e.reason LIKE '%scheduler%' OR e.new_state = 'PAUSED' OR (e.old_state = 'PAUSED' "
            "AND e.new_state != 'ERRORED')) ORDER BY e.id", [exp_id]):
        saved = None
        if "stopped" in (reason or "") and isinstance(epochs, int):
            saved = max(0, epochs - (step or 0))
            reclaimed += saved
        rows.append([t, old, new, reason, worker, when, saved])
    return rows, reclaimed


def engine(db, exp_id: int) -> dict:
    """The engine page: every grouped job (what it shared, its measured speed-up, revert or
    failure, layout, packing and the layout decision in force after it), and the scheduler's
    decisions with the epochs they reclaimed."""
    e = experiment(db, exp_id)
    jobs, speedups = [], []
    has_packing = any(r[1] == "packing" for r in db.execute("PRAGMA table_info(plans)"))
    for r in db.execute(f"SELECT id, job_id, trials, passes, status, reason, alone, speedup, "
                        f"seconds, units, time, {'packing' if has_packing else 'NULL'} FROM plans "
                        f"WHERE experiment_id = ? ORDER BY id", [exp_id]):
        pid, job, trial_ids, passes, status, reason, alone, speedup, seconds, units, when, \
            packing = r
        # the units' reports through their codec (older stores' rows read as well)
        units = [UnitReport.from_json(u) for u in loads_json(units, []) or []]
        packing = loads_json(packing, {}) or {}
        decision = units[0].decision.reason if units and units[0].decision else None
        shared = sum(u.shared_nodes or 0 for u in units)
        layout = ", ".join(sorted({u.layout for u in units if u.layout}))
        jobs.append([pid, job, len(loads_json(trial_ids, []) or []), ", ".join(loads_json(passes, []) or []),
                     status, reason, ", ".join(loads_json(alone, []) or []), speedup, seconds,
                     shared, layout, decision, packing.get("device"),
                     packing.get("predicted_iter_s"), packing.get("balance"), when])
        if speedup is not None:
            speedups.append([pid, job, speedup, status])
    by_status: dict[str, int] = {}
    for row in jobs:
        by_status[row[4]] = by_status.get(row[4], 0) + 1
    decisions, reclaimed = _scheduler_decisions(db, exp_id, e["config"])
    segs = one_shot_segments(db, exp_id)
    return {"jobs_by_status": by_status, "speedups": speedups, "reclaimed_epochs": reclaimed,
            "segments": segs["series"], "tables": {"segments": segs["table"],
                "jobs": table(["id", "job", "trials", "passes", "status", "reason", "alone_after",
                               "speedup", "seconds", "shared_nodes", "layout", "decision",
                               "device", "predicted_iter_s", "balance", "time"], jobs),
                "scheduler": table(["trial", "from", "to", "reason", "worker", "time",
                                    "epochs_reclaimed"], decisions)}}


def one_shot_segments(db, exp_id: int) -> dict:
    """A one-shot search's segments (one super-network job each): the strategy's numeric
    metrics per segment as series, and a row per segment (unit, seconds, the models it
    evaluated with their best value, the architecture selected then)."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'segments'").fetchone():
        return {"series": {}, "table": table(["segment"], [])}
    rows = db.execute("SELECT segment, unit, metrics, selected, models, seconds, time FROM "
                      "segments WHERE experiment_id = ? ORDER BY segment", [exp_id]).fetchall()
    series: dict[str, list] = {}
    names: list[str] = []
    decoded = []
    for seg, unit, metrics, selected, models, seconds, when in rows:
        metrics = loads_json(metrics, {}) or {}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if k not in series:
                    series[k], names = [], names + [k]
                series[k].append([seg, v])
        decoded.append((seg, unit, metrics, selected, models, seconds, when))
    best = dict(db.execute("SELECT segment, max(value) FROM models WHERE experiment_id = ? AND "
                           "segment IS NOT NULL GROUP BY segment", [exp_id]).fetchall())
    body = [[seg, unit, seconds, models, best.get(seg), *[metrics.get(k) for k in names],
             selected, when] for seg, unit, metrics, selected, models, seconds, when in decoded]
    return {"series": series, "table": table(
        ["segment", "unit", "seconds", "models_evaluated", "best_evaluated", *names,
         "selected", "time"], body)}


def pareto(db, exp_id: int) -> dict:
    """The Pareto page: every finished model's objective values, the front marked."""
    e = experiment(db, exp_id)
    spec = e["config"].get("objectives") or {}
    names = list(spec.get("metrics") or [])
    if len(names) < 2:
        metric, _ = metric_of(e["config"])
        return {"objectives": names or [metric], "modes": [], "points": [], "tables": {},
                "note": f"experiment {exp_id} optimizes one metric ({metric}): no Pareto front"}
    front = set(loads_json(e.get("front"), []) or [])
    points, rows = [], []
    for model_id, values, violation, sample in db.execute(
            'SELECT id, "values", violation, sample FROM models WHERE experiment_id = ? AND '
            'status = \'trained\' AND "values" IS NOT NULL ORDER BY id', [exp_id]):
        values = loads_json(values, {}) or {}
        point = [values.get(n) for n in names]
        points.append({"model": model_id, "values": point, "front": model_id in front,
                       "violation": violation})
        rows.append([model_id, model_id in front, violation, *point, sample])
    return {"objectives": names, "modes": list(spec.get("modes") or []),
            "constraints": spec.get("constraints") or [], "points": points, "note": None,
            "tables": {"models": table(["model", "on_front", "violation", *names, "sample"],
                                       rows)}}
