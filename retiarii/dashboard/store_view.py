"""The dashboard's read side: read-only SQLite queries of a run's store, one function per page.

Every function takes a connection from :func:`connect` (a ``mode=ro`` URI: a WAL reader that
never writes, never migrates and never takes the driver's lock, so a running search goes on
undisturbed) and returns plain JSON: scalars, ``charts`` data and ``tables``, each table
``{"columns": [...], "rows": [[...]]}`` (what the pages draw and what ``.csv`` downloads).

Example::

    with connect("runs/demo.db") as db:
        overview(db, latest_experiment(db))["best"]
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import urllib.parse

__all__ = ["StoreUnavailable", "NotInStore", "connect", "loads_json", "sample_columns",
           "experiments", "latest_experiment", "stamp", "overview", "trials", "trial", "compare",
           "table"]

STATES = ("PENDING", "RUNNING", "PAUSED", "TERMINATED", "ERRORED")


class StoreUnavailable(Exception):
    """The store cannot be read (missing, not SQLite, not a retiarii store, no such
    experiment): the pages show the message, which names the culprit and the fix."""


class NotInStore(StoreUnavailable):
    """A page asked for an experiment, trial or model the store does not hold (a 404)."""


@contextlib.contextmanager
def connect(path: str):
    """A read-only connection to the store ``path``, closed on exit."""
    if not os.path.exists(path):
        raise StoreUnavailable(f"{path} does not exist (yet): start a search with `retiarii run "
                               f"... --store {path}`; this page updates once it does")
    if not os.path.isfile(path):
        raise StoreUnavailable(f"{path} is not a file: give the SQLite file of a run")
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        # timeout: wait for a checkpoint of the WAL rather than fail the page
        db = sqlite3.connect(uri, uri=True, timeout=5, check_same_thread=False)
    except sqlite3.Error as err:
        raise StoreUnavailable(f"{path} cannot be opened: {err}") from None
    try:
        try:
            app = db.execute("SELECT value FROM meta WHERE key = 'application'").fetchone()
        except sqlite3.DatabaseError as err:
            raise StoreUnavailable(f"{path} is not a retiarii store ({err}): give the SQLite "
                                   f"file a `retiarii run --store` wrote") from None
        if not app or app[0] != "retiarii":
            raise StoreUnavailable(f"{path} is an SQLite file but not a retiarii store (its "
                                   f"meta table names no retiarii application)")
        yield db
    finally:
        db.close()


def _rows(db, sql: str, params=()) -> list[dict]:
    cur = db.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def loads_json(text, default=None):
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return default


def table(columns: list[str], rows: list[list]) -> dict:
    return {"columns": columns, "rows": rows}


def _has_column(db, tbl: str, column: str) -> bool:
    return any(r[1] == column for r in db.execute(f"PRAGMA table_info({tbl})"))


def experiments(db) -> list[dict]:
    """Every experiment of the store, with its config decoded."""
    rows = _rows(db, "SELECT * FROM experiments ORDER BY id")
    for r in rows:
        r["config"] = loads_json(r["config"], {})
    return rows


def latest_experiment(db) -> int:
    row = db.execute("SELECT max(id) FROM experiments").fetchone()
    if row[0] is None:
        raise StoreUnavailable("the store holds no experiment yet: start one with `retiarii "
                               "run`; this page updates once it does")
    return row[0]


def experiment(db, exp_id: int) -> dict:
    for e in experiments(db):
        if e["id"] == exp_id:
            return e
    ids = ", ".join(str(e["id"]) for e in experiments(db)) or "none"
    raise NotInStore(f"experiment {exp_id} is not in the store (it holds {ids}): pick one "
                           f"on the experiments page")


def metric_of(config: dict) -> tuple[str, str]:
    """The experiment's first objective and its direction (val_acc, max for old stores)."""
    objectives = config.get("objectives") or {}
    if objectives.get("metrics"):
        return objectives["metrics"][0], objectives["modes"][0]
    return config.get("metric") or "val_acc", config.get("mode") or "max"


def objectives_of(config: dict) -> dict:
    """Every objective with its direction, and the constraints (one metric for old stores)."""
    spec = config.get("objectives") or {}
    if spec.get("metrics"):
        return {"metrics": list(spec["metrics"]), "modes": list(spec["modes"]),
                "constraints": list(spec.get("constraints") or [])}
    metric, mode = metric_of(config)
    return {"metrics": [metric], "modes": [mode], "constraints": []}


def _front(e: dict) -> list | None:
    """The ids of the models on the experiment's Pareto front, or None (one objective)."""
    return loads_json(e.get("front")) if len(objectives_of(e["config"])["metrics"]) > 1 else None


def stamp(db, exp_id: int) -> str:
    """What changes whenever the store gains a row the pages show: the pages poll this (one
    cheap query, index lookups only) and fetch their data again when it changes."""
    parts = db.execute(
        "SELECT (SELECT max(id) FROM events), (SELECT max(rowid) FROM metrics), "
        "(SELECT max(id) FROM models), (SELECT max(id) FROM plans), "
        "(SELECT updated || status FROM experiments WHERE id = ?), "
        "(SELECT max(updated) FROM models WHERE experiment_id = ?)", [exp_id, exp_id]).fetchone()
    return "/".join(str(p) for p in parts)


def experiment_list(db) -> dict:
    """The experiments page: one row per experiment with its progress and best value."""
    rows = []
    for e in experiments(db):
        metric, mode = metric_of(e["config"])
        n_models, n_trials = db.execute(
            "SELECT (SELECT count(*) FROM models WHERE experiment_id = ?), "
            "(SELECT count(*) FROM trials WHERE experiment_id = ?)", [e["id"], e["id"]]).fetchone()
        best = _best(db, e["id"], mode)
        strategy = (e["config"].get("strategy") or {}).get("class", "?").rsplit(":", 1)[-1]
        rows.append([e["id"], e["name"], e["status"], strategy, metric, mode, n_models, n_trials,
                     best["value"] if best else None, e["created"]])
    return {"tables": {"experiments": table(
        ["id", "name", "status", "strategy", "metric", "mode", "models", "trials", "best",
         "created"], rows)}}


def _best(db, exp_id: int, mode: str) -> dict | None:
    order = "DESC" if mode == "max" else "ASC"
    rows = _rows(db, f"SELECT id AS model_id, value, sample FROM models WHERE experiment_id = ? "
                     f"AND value IS NOT NULL AND status = 'trained' ORDER BY value {order}, id "
                     f"LIMIT 1", [exp_id])
    if not rows:
        return None
    rows[0]["sample"] = loads_json(rows[0]["sample"], {})
    return rows[0]


def _budget(config: dict) -> int | None:
    cli = ((config.get("origin") or {}).get("cli") or {})
    return cli.get("max_models")


def best_so_far(db, exp_id: int, mode: str) -> dict:
    """The best value after each finished model, by model count and by wall time."""
    rows = db.execute("SELECT id, value, updated FROM models WHERE experiment_id = ? AND "
                      "status = 'trained' AND value IS NOT NULL ORDER BY updated, id",
                      [exp_id]).fetchall()
    better = max if mode == "max" else min
    best, out = None, {"models": [], "seconds": [], "best": [], "model_ids": []}
    start = db.execute("SELECT created FROM experiments WHERE id = ?", [exp_id]).fetchone()[0]
    for i, (model_id, value, updated) in enumerate(rows, 1):
        best = value if best is None else better(best, value)
        out["models"].append(i)
        out["seconds"].append(round((updated or start) - start, 3))
        out["best"].append(best)
        out["model_ids"].append(model_id)
    return out


def overview(db, exp_id: int) -> dict:
    """The overview page: config, status, budget, best model, best-so-far, states, errors."""
    e = experiment(db, exp_id)
    metric, mode = metric_of(e["config"])
    counts = dict.fromkeys(STATES, 0)
    for state, n in db.execute("SELECT state, count(*) FROM trials WHERE experiment_id = ? "
                               "GROUP BY state", [exp_id]):
        counts[state] = n
    models = dict(db.execute("SELECT status, count(*) FROM models WHERE experiment_id = ? "
                             "GROUP BY status", [exp_id]).fetchall())
    errors = []
    why_model = "error" if _has_column(db, "models", "error") else "NULL"
    for r in _rows(db, f"SELECT m.id, m.sample, {why_model} AS merror, (SELECT t.error FROM "
                       f"trials t WHERE t.model_id = m.id AND t.error IS NOT NULL ORDER BY t.seq "
                       f"DESC LIMIT 1) AS terror, (SELECT t.id FROM trials t WHERE t.model_id = "
                       f"m.id ORDER BY t.seq DESC LIMIT 1) AS trial FROM models m WHERE "
                       f"m.experiment_id = ? AND m.status = 'failed' ORDER BY m.id", [exp_id]):
        why = (r["merror"] or r["terror"] or "(no reason recorded)").strip()
        errors.append([r["id"], r["trial"], why.splitlines()[0], why, r["sample"]])
    done = models.get("trained", 0) + models.get("failed", 0)
    return {"experiment": exp_id, "name": e["name"], "status": e["status"], "seed": e["seed"],
            "config": e["config"], "metric": metric, "mode": mode, "created": e["created"],
            "objectives": objectives_of(e["config"]), "front": _front(e),
            "updated": e["updated"], "error": e.get("error"),
            "budget": {"models_done": done, "models": sum(models.values()),
                       "max_models": _budget(e["config"])},
            "trials_by_state": counts, "models_by_status": models,
            "best": _best(db, exp_id, mode), "best_so_far": best_so_far(db, exp_id, mode),
            "tables": {"errors": table(["model", "trial", "reason", "error", "sample"], errors),
                       "states": table(["state", "trials"], [[k, v] for k, v in counts.items()])}}


def sample_columns(samples: list[dict]) -> list[str]:
    labels: list[str] = []
    for s in samples:
        for k in s:
            if k not in labels:
                labels.append(k)
    return labels


def trials(db, exp_id: int) -> dict:
    """The trials page: one row per trial (state, value, epochs, duration, worker, choices,
    parent, checkpoint) and every trial's curve of the experiment's metric."""
    e = experiment(db, exp_id)
    metric, _ = metric_of(e["config"])
    rows = _rows(db, "SELECT t.id, t.seq, t.model_id, t.state, t.step, t.worker, t.parent, "
                     "t.checkpoint, t.attempts, t.started, t.ended, t.updated, t.hparams, "
                     "m.sample, m.parent AS model_parent, (SELECT value FROM metrics x WHERE "
                     "x.trial_id = t.id AND x.name = ? ORDER BY x.step DESC LIMIT 1) AS value "
                     "FROM trials t LEFT JOIN models m ON m.id = t.model_id "
                     "WHERE t.experiment_id = ? ORDER BY t.seq", [metric, exp_id])
    samples = [loads_json(r["sample"], {}) or {} for r in rows]
    labels = sample_columns(samples)
    out = []
    for r, s in zip(rows, samples):
        duration = None
        if r["started"] is not None:
            duration = round((r["ended"] or r["updated"] or r["started"]) - r["started"], 3)
        out.append([r["id"], r["model_id"], r["state"], r["value"], r["step"], duration,
                    r["worker"], r["parent"], r["model_parent"], r["checkpoint"], r["attempts"],
                    *[_cell(s.get(k)) for k in labels]])
    curves: dict[str, list] = {}
    for trial_id, step, value in db.execute(
            "SELECT m.trial_id, m.step, m.value FROM metrics m JOIN trials t ON t.id = "
            "m.trial_id WHERE m.name = ? AND t.experiment_id = ? ORDER BY t.seq, m.step",
            [metric, exp_id]):
        curves.setdefault(trial_id, []).append([step, value])
    columns = ["trial", "model", "state", metric, "epochs", "duration_s", "worker",
               "parent_trial", "parent_model", "checkpoint", "attempts", *labels]
    return {"metric": metric, "choices": labels, "curves": curves,
            "tables": {"trials": table(columns, out)}}


def _cell(value):
    """A choice's value as a table cell: scalars as they are, the rest as JSON text."""
    return value if isinstance(value, (str, int, float, bool)) or value is None \
        else json.dumps(value)


def trial(db, exp_id: int, trial_id: str, checkpoint_dir: str) -> dict:
    """One trial: every metric's curve, its choices, parent, checkpoints (their files in
    ``checkpoint_dir``, the run's checkpoint folder) and events."""
    rows = _rows(db, "SELECT t.*, m.sample FROM trials t LEFT JOIN models m ON m.id = t.model_id "
                     "WHERE t.id = ? AND t.experiment_id = ?", [trial_id, exp_id])
    if not rows:
        raise NotInStore(f"trial {trial_id!r} is not in experiment {exp_id}: pick one on "
                               f"the trials page")
    r = rows[0]
    curves: dict[str, list] = {}
    points = []
    for step, name, value, time in db.execute("SELECT step, name, value, time FROM metrics "
                                              "WHERE trial_id = ? ORDER BY name, step",
                                              [trial_id]):
        curves.setdefault(name, []).append([step, value])
        points.append([name, step, value, time])
    checkpoints = [[c["step"], os.path.join(checkpoint_dir, c["path"]), c["time"]] for c in _rows(
        db, "SELECT step, path, time FROM checkpoints WHERE trial_id = ? ORDER BY step",
        [trial_id])]
    events = [[v["id"], v["old_state"], v["new_state"], v["reason"], v["worker"], v["time"]]
              for v in _rows(db, "SELECT * FROM events WHERE trial_id = ? ORDER BY id",
                             [trial_id])]
    return {"trial": trial_id, "model_id": r["model_id"], "state": r["state"],
            "step": r["step"], "worker": r["worker"], "parent": r["parent"],
            "initiator": r.get("initiator"),
            "checkpoint": r["checkpoint"] and os.path.join(checkpoint_dir, r["checkpoint"]),
            "error": r["error"], "attempts": r["attempts"],
            "sample": loads_json(r["sample"], {}), "hparams": loads_json(r["hparams"], {}),
            "curves": curves,
            "tables": {"choices": table(["choice", "value"], [
                           [k, _cell(v)] for k, v in {**(loads_json(r["sample"], {}) or {}),
                                                      **(loads_json(r["hparams"], {}) or {})}.items()]),
                       "metrics": table(["metric", "step", "value", "time"], points),
                       "checkpoints": table(["step", "path", "time"], checkpoints),
                       "events": table(["id", "from", "to", "reason", "worker", "time"],
                                       events)}}


def compare(db, a: int, b: int) -> dict:
    """Two experiments' best-so-far curves on one chart (each by its own metric)."""
    series, rows = [], []
    for exp_id in (a, b):
        e = experiment(db, exp_id)
        metric, mode = metric_of(e["config"])
        curve = best_so_far(db, exp_id, mode)
        series.append({"experiment": exp_id, "metric": metric, "mode": mode, **curve})
        rows += [[exp_id, metric, n, s, v] for n, s, v in
                 zip(curve["models"], curve["seconds"], curve["best"])]
    return {"series": series, "tables": {"best_so_far": table(
        ["experiment", "metric", "models", "seconds", "best"], rows)}}
