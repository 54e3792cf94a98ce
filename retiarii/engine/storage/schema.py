"""The store's schema: its tables, one function per version, and the migrations between them.

``MIGRATIONS[i]`` takes a file from schema version ``i`` to ``i + 1``; a fresh file runs them
all, an older one the ones it lacks (:func:`migrate`, each in one transaction).
``docs/store.md`` documents every table and column.
"""
from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the driver imports it with the store
    import sqlite_utils


__all__ = ["StoreError", "SCHEMA_VERSION", "MIGRATIONS", "STATES", "APPLICATION", "migrate",
           "unusable"]

STATES = ("PENDING", "RUNNING", "PAUSED", "TERMINATED", "ERRORED")
APPLICATION = "retiarii"


class StoreError(RuntimeError):
    """A store file that cannot be used (corrupt, not ours, too new) or a journal call that
    contradicts what the store holds."""


def unusable(path: str, err: sqlite3.DatabaseError) -> StoreError:
    """Why SQLite could not open the store ``path``, and the fix: a file or folder that is not
    writable, or a file that is not a database (corrupt, another kind)."""
    text = str(err).lower()
    if isinstance(err, sqlite3.OperationalError) and any(
            word in text for word in ("readonly", "read-only", "unable to open", "permission",
                                      "disk i/o")):
        folder = os.path.dirname(os.path.abspath(path))
        return StoreError(f"{path} cannot be opened for writing ({err}): the file and its "
                          f"folder {folder} must be writable (SQLite keeps its journal beside "
                          f"the file); fix the permissions or copy the run to a writable place")
    return StoreError(f"{path} is not a usable SQLite database ({err}); it is corrupt or "
                      "another kind of file: give a new path, or restore it from a backup")


# ---- schema and migrations ------------------------------------------------------------------


def _schema_v1(db: sqlite_utils.Database) -> None:
    """The first schema: every table of docs/store.md."""
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["experiments"].create(
        {"id": int, "name": str, "config": str, "seed": int, "status": str,
         "created": float, "updated": float}, pk="id", not_null=["status"])
    db["models"].create(
        {"id": int, "experiment_id": int, "sample": str, "graph": str, "hash": str,
         "parent": int, "status": str, "value": float, "created": float, "updated": float},
        pk="id", foreign_keys=[("experiment_id", "experiments", "id")], not_null=["status"])
    db["models"].create_index(["hash"])
    db["models"].create_index(["experiment_id", "status"])
    db["trials"].create(
        {"id": str, "seq": int, "experiment_id": int, "model_id": int, "spec": str,
         "hparams": str, "parent": str, "record": str, "state": str, "attempts": int,
         "worker": str, "step": int, "checkpoint": str, "error": str, "created": float,
         "started": float, "updated": float, "ended": float},
        pk="id", not_null=["seq", "state", "attempts", "step"], defaults={"attempts": 0, "step": 0},
        foreign_keys=[("experiment_id", "experiments", "id"), ("model_id", "models", "id")])
    db["trials"].create_index(["seq"], unique=True)
    db["trials"].create_index(["experiment_id", "state"])
    db["trials"].create_index(["model_id"])
    db["events"].create(
        {"id": int, "trial_id": str, "old_state": str, "new_state": str, "reason": str,
         "worker": str, "time": float},
        pk="id", foreign_keys=[("trial_id", "trials", "id")], not_null=["new_state"])
    db["events"].create_index(["trial_id"])
    # One value per (trial, metric, step): a retried step replaces what the failed attempt wrote.
    db["metrics"].create(
        {"trial_id": str, "step": int, "name": str, "value": float, "time": float},
        pk=("trial_id", "name", "step"), foreign_keys=[("trial_id", "trials", "id")])
    db["checkpoints"].create(
        {"trial_id": str, "step": int, "path": str, "pinned": int, "time": float},
        pk=("trial_id", "step"), not_null=["path", "pinned"], defaults={"pinned": 0},
        foreign_keys=[("trial_id", "trials", "id")])
    db["checkpoints"].create_index(["path"])
    for table in ("strategy_state", "scheduler_state"):
        db[table].create({"experiment_id": int, "state": str, "time": float}, pk="experiment_id")


def _schema_v2(db: sqlite_utils.Database) -> None:
    """Saved states keep their append-only lists (``state["append_only"]``) as one row per
    item, so saving a growing state writes only what is new."""
    db["state_items"].create(
        {"kind": str, "experiment_id": int, "name": str, "idx": int, "item": str},
        pk=("kind", "experiment_id", "name", "idx"), not_null=["item"])


def _schema_v3(db: sqlite_utils.Database) -> None:
    """Drop ``checkpoints.pinned``: which checkpoints to keep is the scheduler's decision
    (``Scheduler.deletable_checkpoints``), never a column; nothing ever set it but tests."""
    db.execute("ALTER TABLE checkpoints DROP COLUMN pinned")  # (SQLite >= 3.35)


def _schema_v4(db: sqlite_utils.Database) -> None:
    """``plans``: every grouped job the engine ran (cross-model optimization), its trials,
    the passes, what it measured and whether it was kept, reverted or failed (plans.py)."""
    db["plans"].create(
        {"id": int, "experiment_id": int, "job_id": str, "trials": str, "passes": str,
         "status": str, "reason": str, "alone": str, "speedup": float, "seconds": float,
         "units": str, "time": float},
        pk="id", not_null=["trials", "status"], foreign_keys=[("experiment_id", "experiments", "id")])
    db["plans"].create_index(["experiment_id", "status"])


def _schema_v5(db: sqlite_utils.Database) -> None:
    """One-shot searches (engine/one_shot.py): ``segments``, one row per segment done (its
    unit, the strategy's metrics, the architecture selected then), committed with the models
    the segment evaluated (``models.segment``, ``models.metrics``); ``experiments.error`` (why
    a search failed) and ``experiments.result_model`` (the architecture a one-shot search
    selected)."""
    db["segments"].create(
        {"experiment_id": int, "segment": int, "unit": str, "metrics": str, "selected": str,
         "models": int, "seconds": float, "time": float},
        pk=("experiment_id", "segment"), not_null=["unit"],
        foreign_keys=[("experiment_id", "experiments", "id")])
    db["models"].add_column("segment", int)
    db["models"].add_column("metrics", str)
    db["experiments"].add_column("error", str)
    db["experiments"].add_column("result_model", int)


def _schema_v6(db: sqlite_utils.Database) -> None:
    """``plans.packing``: the packing decision of a job (its device, models, the predicted
    time per iteration and the placement's balance; engine/placing.py), JSON or NULL."""
    db["plans"].add_column("packing", str)


def _schema_v7(db: sqlite_utils.Database) -> None:
    """``models.error``: why a failed model failed (its reason on the first line, then the
    traceback), whether it could not be built or its trial failed; NULL otherwise. Models
    of older files keep NULL (their trials' ``error`` still says why)."""
    db["models"].add_column("error", str)


def _schema_v8(db: sqlite_utils.Database) -> None:
    """``trials.initiator``: the trial whose reproduction made a PBT trial (the seed paper's
    ``initiator_parent_trial_id``; ``parent`` is the tournament's winner, whose checkpoint it
    starts from); NULL for any other trial. Trials of older files keep NULL: which trial
    initiated them was never written down."""
    db["trials"].add_column("initiator", str)


def _schema_v9(db: sqlite_utils.Database) -> None:
    """Several objectives (retiarii/objectives.py, docs/multi_objective.md): ``models.values``
    (JSON: every objective, constraint and cost metric of the model, final), ``models.violation``
    (by how much it misses the constraints; 0: feasible), ``experiments.front`` (JSON: the ids
    of the models on the Pareto front) and ``costs``: the costs measured once per architecture
    (structural hash) and device (engine/costs.py). Older files keep NULL (one metric)."""
    db["models"].add_column("values", str)
    db["models"].add_column("violation", float)
    db["experiments"].add_column("front", str)
    db["costs"].create({"hash": str, "device": str, "name": str, "value": float,
                        "spread": float, "time": float}, pk=("hash", "device", "name"),
                       not_null=["value"])


def _schema_v10(db: sqlite_utils.Database) -> None:
    """``base_graphs``: each experiment's base models as graph IR JSON (engine/storage/base_graphs.py),
    what the dashboard shows a model's changes against. Older files have none (their model
    pages compare with the parent or the first model)."""
    db["base_graphs"].create({"experiment_id": int, "idx": int, "name": str, "graph": str,
                              "hash": str}, pk=("experiment_id", "idx"), not_null=["graph"],
                             foreign_keys=[("experiment_id", "experiments", "id")])


def _schema_v11(db: sqlite_utils.Database) -> None:
    """``trials.fused``: 1 once a segment of the trial trained fused (its values round unlike
    training alone), set with that segment's checkpoint in one transaction, so a job whose
    ``plans`` row was never written (its driver or worker killed first) still says so. Older
    files keep NULL (their ``plans`` rows are all they know)."""
    db["trials"].add_column("fused", int)


# MIGRATIONS[i] takes a file from schema version i to i + 1. Append, never edit a released one.
MIGRATIONS = [_schema_v1, _schema_v2, _schema_v3, _schema_v4, _schema_v5, _schema_v6,
              _schema_v7, _schema_v8, _schema_v9, _schema_v10, _schema_v11]
SCHEMA_VERSION = 11


def migrate(db: sqlite_utils.Database, path: str, migrations: list) -> None:
    """Bring the store ``db`` (the file ``path``) to schema version ``len(migrations)``: a
    fresh file runs every migration, an older one those it lacks, each in one transaction
    with the version it reaches (a failed one leaves the file at its old version). A file
    that is not a retiarii store, or of a newer version, is refused."""
    latest = len(migrations)
    tables = set(db.table_names())
    if not tables:
        version = 0
    elif "meta" not in tables:
        raise StoreError(f"{path} is a SQLite database but not a retiarii store (it has "
                         f"tables {sorted(tables)[:5]}, no 'meta'); give a new path")
    else:
        meta = {r["key"]: r["value"] for r in db["meta"].rows}
        if meta.get("application") != APPLICATION:
            raise StoreError(f"{path} is a SQLite database but not a retiarii store")
        version = int(meta.get("schema_version", 0))
    if version > latest:
        raise StoreError(f"{path} has store schema version {version}, written by a newer "
                         f"retiarii; this one reads up to version {latest}: upgrade "
                         "retiarii to open it")
    for target in range(version + 1, latest + 1):
        with db.atomic():  # a failed migration leaves the file at its old version
            migrations[target - 1](db)
            db["meta"].upsert_all(
                [{"key": "application", "value": APPLICATION},
                 {"key": "schema_version", "value": str(target)}], pk="key")
