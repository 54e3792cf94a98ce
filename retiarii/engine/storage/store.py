"""The store: everything the engine knows about a run, in one SQLite file (via sqlite-utils).

Experiments, models (sample, graph, structural hash), trials and their lifecycle events, metrics,
checkpoints, and the strategy's and scheduler's saved state. Kill the driver at any moment and
the file says where every trial stood, because the trial runner journals each state transition
here *before* it takes effect (:meth:`Store.transition`). ``docs/store.md`` documents every table
and column for querying a finished run with the ``sqlite-utils`` command.

The file runs in WAL mode with ``synchronous=NORMAL``: a commit is an append to the log, readers
(``retiarii status`` while a run goes on) never block the writer, and a crash of the process
loses nothing committed (a power cut may lose the last commits, never consistency). Metric rows
are buffered and written in batches; the buffer is flushed before any other write and any read,
so a checkpoint row is never on disk before the metrics that led to it.
The schema carries a version; :data:`MIGRATIONS` upgrades older files on open, in order.

Checkpoints are recorded by name, relative to the run's checkpoint folder next to the file
(``runs/exp.db`` -> ``runs/exp.checkpoints/``, :attr:`Store.checkpoint_dir`), so a run folder can
be moved or copied and resumed; the absolute paths older stores hold are read back as names of
this folder (:func:`~.checkpoint.legacy_name`), and nothing outside it is ever handed out.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import time as _time
from typing import Any, Callable, Iterable


from .checkpoint_rows import CheckpointRows
from .fused_marks import checkpoint_sources, inherit_fused
from .state_tables import StateTables
from .sqlite_import import import_sqlite_utils
from .queries import StoreQueries, decode_json_columns, encode_state, json_text, not_found_error
from .journal_records import read_records
from .schema import MIGRATIONS, SCHEMA_VERSION, STATES, StoreError, migrate, unusable
from ...enums import ModelStatus

__all__ = ["Store", "StoreError", "SCHEMA_VERSION", "MIGRATIONS", "STATES"]

_log = logging.getLogger("retiarii.engine")


class Store(StoreQueries, CheckpointRows):
    """A run's SQLite file: open (or create) it, journal trials, query results.

    Example::

        store = Store("runs/exp.db")
        exp = store.add_experiment({"strategy": "random"}, seed=0)
        model = store.add_model({"op": "conv3x3"}, graph={"nodes": []}, hash="ab12")
        store.trial_added(trial)                  # the TrialRunner's journal calls ...
        store.transition(trial.trial_id, "PENDING", "RUNNING", "scheduled")
        store.result(trial.trial_id, 1, {"val_acc": 0.91}, time=3.2)
        store.best_models("val_acc", mode="max", k=5)
        store.close()

    Args:
        path: the database file; created with the current schema when missing or empty.
        batch_size: buffered metric rows that trigger a write.
        flush_interval: seconds after which buffered metric rows are written at the next call.
    """

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 2000,
                 flush_interval: float = 1.0):
        self.path = os.fspath(path)
        self.batch_size, self.flush_interval = batch_size, flush_interval
        self.experiment_id: int | None = None  # the experiment journal calls attach to
        self._buffer: list[tuple] = []
        self._buffered_since = 0.0
        # model id -> (row, writes) kept until the trial that trains it is journaled
        self._staged: dict[int, tuple[list, list[Callable[[], None]]]] = {}
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.db = None  # type: ignore[assignment]
        try:
            sqlite_utils = import_sqlite_utils()  # here, not with the package; without pandas
            self.db = sqlite_utils.Database(self.path)
            self.db.execute("PRAGMA busy_timeout=10000")  # a second opener waits, not fails
            self.db.enable_wal()
            self.db.execute("PRAGMA synchronous=NORMAL")
            migrate(self.db, self.path, MIGRATIONS)
            self._states = StateTables(self.db, self.path)
        except sqlite3.DatabaseError as err:
            if self.db is not None:
                self.db.close()
            raise unusable(self.path, err) from err
        except BaseException:
            if self.db is not None:
                self.db.close()
            raise

    @property
    def schema_version(self) -> int:
        """The file's schema version."""
        return int(self.db["meta"].get("schema_version")["value"])

    def close(self) -> None:
        """Write buffered metrics and close the file. Idempotent."""
        if self.db is not None:
            self.flush()
            self.db.close()
            self.db = None  # type: ignore[assignment]

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- experiments and models ---------------------------------------------------------

    def add_experiment(self, config: dict, seed: int | None = None, *, name: str | None = None,
                       status: str = "running") -> int:
        """Record a new experiment and make it the current one; returns its id."""
        now = _time.time()
        self.flush()
        table = self.db["experiments"].insert(
            {"name": name, "config": json_text(config), "seed": seed, "status": status,
             "created": now, "updated": now})
        self.experiment_id = table.last_pk
        return self.experiment_id

    def use_experiment(self, experiment_id: int) -> dict:
        """Make an existing experiment current (resuming a run); returns it."""
        experiment = self.get_experiment(experiment_id)
        self.experiment_id = experiment_id
        return experiment

    def get_experiment(self, experiment_id: int | None = None) -> dict:
        """An experiment row, ``config`` decoded; the current one by default."""
        experiment_id = self._experiment(experiment_id)
        try:
            return decode_json_columns(self.db["experiments"].get(experiment_id), "config")
        except not_found_error():
            raise StoreError(f"{self.path} has no experiment {experiment_id}") from None

    def experiments(self) -> list[dict]:
        """All experiments, oldest first."""
        return [decode_json_columns(r, "config") for r in self.db["experiments"].rows_where(order_by="id")]

    def set_experiment_status(self, status: str, experiment_id: int | None = None) -> None:
        """Mark an experiment ``running``, ``done``, ``interrupted``, ..."""
        self.flush()
        self.db["experiments"].update(self._experiment(experiment_id),
                                      {"status": status, "updated": _time.time()})

    def add_model(self, sample: dict, graph: dict | None = None, hash: str | None = None, *,
                  parent: int | None = None, status: ModelStatus | str = "pending",
                  error: str | None = None) -> int:
        """Record a model of the current experiment; returns its id.

        Args:
            sample: the choices (label -> key) that rebuild it from the space.
            graph: its Graph IR as JSON-ready data.
            hash: its structural hash, for deduplication.
            parent: the model it was mutated from (evolution), if any.
            status: a :class:`~retiarii.enums.ModelStatus` (stored as its string: ``pending``,
                ``training``, ``trained`` or ``failed``).
            error: why a failed model failed (reason, then traceback).
        """
        status = ModelStatus(status).value
        now = _time.time()
        self.flush()
        # Plain SQL here and in the other calls the engine makes for every model: sqlite-utils'
        # insert/update/upsert re-read the table's schema on each call (several times slower).
        return self.db.execute(
            "INSERT INTO models (experiment_id, sample, graph, hash, parent, status, created, "
            "updated, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [self.experiment_id, json_text(sample), json_text(graph), hash, parent, status, now, now,
             error]).lastrowid

    def stage_model(self, sample: dict, graph: dict | None = None, hash: str | None = None, *,
                    parent: int | None = None,
                    with_it: Iterable[Callable[[], None]] = ()) -> int:
        """Reserve a model id for a model about to be trained and keep its row (status
        ``training``) until :meth:`trial_added` journals the trial whose spec names that id:
        both are written in one transaction, so a crash leaves neither a model without its
        trial nor a trial without its model. ``with_it`` are more writes that belong to that
        transaction (the strategy's state after the proposal), run at that moment.

        Example::

            model_id = store.stage_model(sample, graph, hash,
                                         with_it=[lambda: store.save_strategy_state(s)])
            store.trial_added(trial)      # trial.config["model_id"] == model_id: all committed
        """
        self.flush()
        top = self.db.execute("SELECT coalesce(max(id), 0) FROM models").fetchone()[0]
        model_id = max([top, *self._staged]) + 1
        row = [model_id, self.experiment_id, json_text(sample), json_text(graph), hash, parent,
               "training"]
        self._staged[model_id] = (row, list(with_it))
        return model_id

    @contextlib.contextmanager
    def transaction(self):
        """Group the calls inside into one transaction: all of them are on disk, or none.

        Example::

            with store.transaction():
                store.set_model_status(model_id, "trained", 0.93)
                store.save_strategy_state(strategy.state_dict())
        """
        self.flush()
        with self.db.atomic():
            yield self

    def get_model(self, model_id: int) -> dict:
        """A model row with ``sample`` and ``graph`` decoded."""
        try:
            return decode_json_columns(self.db["models"].get(model_id), "sample", "graph")
        except not_found_error():
            raise StoreError(f"{self.path} has no model {model_id}") from None

    def set_model_status(self, model_id: int, status: ModelStatus | str,
                         value: float | None = None, error: str | None = None) -> None:
        """Set a model's status and, once known, ``value``: the result its strategy was told;
        ``error``: why a failed model failed."""
        status = ModelStatus(status).value
        self.flush()
        if error is not None:
            self.db.execute("UPDATE models SET error = ? WHERE id = ?", [error, model_id])
        if value is None:
            cursor = self.db.execute("UPDATE models SET status = ?, updated = ? WHERE id = ?",
                                     [status, _time.time(), model_id])
        else:
            cursor = self.db.execute("UPDATE models SET status = ?, updated = ?, value = ? "
                                     "WHERE id = ?", [status, _time.time(), value, model_id])
        if cursor.rowcount == 0:
            raise StoreError(f"{self.path} has no model {model_id}")

    def drop_untrained_orphans(self) -> list[int]:
        """Delete the current experiment's models that are ``training`` with no trial: what a
        crash between writing a model and its trial left in a store written before both went
        into one transaction (:meth:`stage_model`). Such a model never trained; deleting it lets
        the strategy propose it again. Returns the ids deleted."""
        self.flush()
        where, params = self._scope("models")
        with self.db.atomic():
            ids = [r[0] for r in self.db.execute(
                f"SELECT id FROM models WHERE {where} AND status = 'training' AND NOT EXISTS "
                f"(SELECT 1 FROM trials WHERE trials.model_id = models.id)", params).fetchall()]
            self.db.execute(f"DELETE FROM models WHERE id IN ({', '.join('?' * len(ids))})", ids)
        return ids

    def models(self, status: str | None = None) -> list[dict]:
        """The current experiment's models (all when none is current), oldest first, decoded."""
        self.flush()
        where, params = self._scope("models")
        if status is not None:
            where, params = f"{where} AND status = ?", [*params, status]
        return [decode_json_columns(r, "sample", "graph")
                for r in self.db["models"].rows_where(where, params, order_by="id")]

    def finished_hashes(self, statuses: Iterable[str] = ("trained", "failed")) -> set[str]:
        """Structural hashes of the current experiment's models in ``statuses`` (all
        experiments when none is current): what a strategy should not propose again."""
        statuses = list(statuses)
        where = f"hash IS NOT NULL AND status IN ({', '.join('?' * len(statuses))})"
        params: list = list(statuses)
        if self.experiment_id is not None:
            where += " AND experiment_id = ?"
            params.append(self.experiment_id)
        return {r["hash"] for r in self.db["models"].rows_where(where, params, select="hash")}

    # ---- the journal the TrialRunner writes, before each change takes effect ------------

    def trial_added(self, trial: Any) -> None:
        """Record a new trial: ``.trial_id``, ``.config`` (what a worker rebuilds it from: the
        ``spec`` column), ``.parent``, ``.initiator`` (PBT; optional), ``.state``; the model id
        from ``.model_id`` or ``config["model_id"]``. ``.to_record()``, when the trial has it,
        is kept verbatim (but for its config, which is the ``spec`` column) for
        :meth:`records`."""
        state, now = encode_state(trial.state), _time.time()
        spec = trial.config if trial.config is not None else {}
        model_id = getattr(trial, "model_id", None)
        if model_id is None and isinstance(spec, dict):
            model_id = spec.get("model_id")
        record = dict(trial.to_record()) if hasattr(trial, "to_record") else \
            {"trial_id": trial.trial_id, "parent": trial.parent}
        record.pop("config", None)  # the spec column holds it: keep one copy
        hparams = spec.get("hparams") if isinstance(spec, dict) else None
        self.flush()
        staged = self._staged.pop(model_id, None)
        try:
            with self.db.atomic():
                if staged is not None:
                    row, writes = staged
                    self.db.execute(
                        "INSERT INTO models (id, experiment_id, sample, graph, hash, parent, "
                        "status, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [*row, now, now])
                    for write in writes:
                        write()
                seq = self.db.execute("SELECT coalesce(max(seq), 0) + 1 FROM trials").fetchone()[0]
                self.db.execute(
                    "INSERT INTO trials (id, seq, experiment_id, model_id, spec, hparams, parent, "
                    "record, state, attempts, step, created, updated) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?)",
                    [trial.trial_id, seq, self.experiment_id, model_id, json_text(spec),
                     json_text(hparams), trial.parent, json_text(record), state, now, now])
                initiator = getattr(trial, "initiator", None)
                if initiator is not None:  # a PBT child (schema v8)
                    self.db.execute("UPDATE trials SET initiator = ? WHERE id = ?",
                                    [initiator, trial.trial_id])
                # a clone of a fused checkpoint carries its rounding: marked with it, now
                inherit_fused(self.db, trial.trial_id, checkpoint_sources(self.db, record, spec))
                self.db.execute("INSERT INTO events (trial_id, old_state, new_state, reason, "
                                "time) VALUES (?, NULL, ?, 'added', ?)",
                                [trial.trial_id, state, now])
        except sqlite3.IntegrityError:
            raise StoreError(f"trial {trial.trial_id!r} is already in {self.path}; trial ids "
                             "must be unique within a store") from None

    def transition(self, trial_id: str, old_state: Any, new_state: Any, reason: str = "", *,
                   worker: str | None = None) -> None:
        """Record ``old_state -> new_state`` (an ``events`` row and the trial's new state, in
        one transaction). Entering ERRORED counts an attempt and keeps ``reason`` as the error;
        ``worker`` names the slot a RUNNING trial went to."""
        old, new, now = encode_state(old_state), encode_state(new_state), _time.time()
        self.flush()
        with self.db.atomic():
            row = self.db.execute("SELECT state, started FROM trials WHERE id = ?",
                                  [trial_id]).fetchone()
            if row is None:
                raise StoreError(f"transition of unknown trial {trial_id!r}; journal "
                                 "trial_added(trial) first")
            if row[0] != old:
                raise StoreError(f"trial {trial_id!r} is {row[0]} in the store, but the "
                                 f"transition {old} -> {new} starts from {old}")
            # Plain SQL: this runs on every state change of every trial, and sqlite-utils'
            # insert/update re-read the table schema each call (4x slower here).
            self.db.execute(
                "INSERT INTO events (trial_id, old_state, new_state, reason, worker, time) "
                "VALUES (?, ?, ?, ?, ?, ?)", [trial_id, old, new, reason, worker, now])
            changes: dict[str, Any] = {"state": new, "updated": now,
                                       "ended": now if new in ("TERMINATED", "ERRORED") else None}
            if new == "RUNNING":
                changes["worker"] = worker
                if row[1] is None:
                    changes["started"] = now
            if new == "ERRORED":
                changes["error"] = reason
            assignments = ", ".join(f"{column} = ?" for column in changes)
            if new == "ERRORED":
                assignments += ", attempts = attempts + 1"
            self.db.execute(f"UPDATE trials SET {assignments} WHERE id = ?",
                            [*changes.values(), trial_id])

    def result(self, trial_id: str, step: int, metrics: dict[str, Any], time: float) -> None:
        """Buffer one metric row per entry of ``metrics`` (NaN is stored as NULL)."""
        if not self._buffer:
            self._buffered_since = _time.monotonic()
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise StoreError(f"metric {name!r} of trial {trial_id!r} at step {step} is "
                                 f"{value!r}, not a number; report numbers only") from None
            self._buffer.append((trial_id, int(step), str(name),
                                 None if math.isnan(number) else number, float(time)))
        if len(self._buffer) >= self.batch_size or \
                _time.monotonic() - self._buffered_since >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Write buffered metric rows in one transaction."""
        if not self._buffer:
            return
        rows, self._buffer = self._buffer, []
        # executemany of tuples: sqlite-utils' insert_all builds and inspects a dict per row,
        # 1.3-2x slower end to end (benchmarks/store.py); this is the engine's hottest write.
        with self.db.atomic():
            self.db.conn.executemany(
                "INSERT OR REPLACE INTO metrics (trial_id, step, name, value, time) "
                "VALUES (?, ?, ?, ?, ?)", rows)

    def worker(self, trial_id: str, worker: str) -> None:
        """Record the worker a trial's current segment runs on (``trials.worker``)."""
        self.flush()
        if self.db.execute("UPDATE trials SET worker = ? WHERE id = ?",
                           [worker, trial_id]).rowcount == 0:
            raise StoreError(f"worker of unknown trial {trial_id!r}; journal trial_added(trial) "
                             "first")

    def scheduler_state(self, state: dict) -> None:
        """Save the scheduler's ``state_dict()`` for the current experiment (latest wins)."""
        self._save_state("scheduler_state", state)

    def records(self) -> list[tuple[str, dict]]:
        """The journal read back, for ``TrialRunner.resume``: ``trial_added`` payloads in
        creation order, then each trial's transitions, results and checkpoints in the order
        written, then the latest ``scheduler_state`` (the payloads of ``MemoryJournal``)."""
        self.flush()
        where, params = self._scope()
        out = read_records(self.db, where, params, self.checkpoint_dir)
        state = self.load_scheduler_state()
        if state is not None:
            out.append(("scheduler_state", {"state": state}))
        return out

    # ---- saved algorithm state ------------------------------------------------------------

    def save_strategy_state(self, state: dict) -> None:
        """Save the strategy's ``state_dict()`` for the current experiment (latest wins)."""
        self._save_state("strategy_state", state)

    def load_strategy_state(self) -> dict | None:
        return self._load_state("strategy_state")

    def load_scheduler_state(self) -> dict | None:
        return self._load_state("scheduler_state")

    def _save_state(self, table: str, state: dict) -> None:
        """Write ``state`` as the latest of ``table`` for the current experiment
        (:meth:`.state_store.StateTables.save`: only new items of its append-only lists)."""
        self.flush()  # the results a scheduler has seen are on disk before its state
        self._states.save(table, self.experiment_id or 0, state)  # 0: a store without experiments

    def _load_state(self, table: str) -> dict | None:
        return self._states.load(table, self.experiment_id or 0)
