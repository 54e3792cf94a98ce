"""The store: schema, journal, metrics, queries (against plain-Python references), migrations,
and clear errors on files it cannot use."""
from __future__ import annotations

import enum
import random
import sqlite3
from types import SimpleNamespace

import pytest
import sqlite_utils

from retiarii.engine.storage import store as store_module
from retiarii.engine.storage.store import SCHEMA_VERSION, STATES, Store, StoreError
from retiarii.strategies import Random
from toy_spaces import flat_space


class TrialState(enum.Enum):  # the TrialRunner's enum has these values
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    TERMINATED = "TERMINATED"
    ERRORED = "ERRORED"


def trial(trial_id, config=None, parent=None, state=TrialState.PENDING, **extra):
    return SimpleNamespace(trial_id=trial_id, config=config or {}, parent=parent,
                           state=state, **extra)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "run.db")
    s.add_experiment({"strategy": "random"}, seed=7, name="test")
    yield s
    s.close()


def test_fresh_store_has_schema_wal_and_version(tmp_path):
    path = tmp_path / "new" / "run.db"  # the directory is created too
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert {"meta", "experiments", "models", "trials", "events", "metrics", "checkpoints",
                "strategy_state", "scheduler_state"} <= set(s.db.table_names())
        assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s.db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with Store(path) as again:  # reopening an up-to-date file changes nothing
        assert again.schema_version == SCHEMA_VERSION


def test_experiment_and_model_round_trip(store):
    exp = store.get_experiment()
    assert (exp["config"], exp["seed"], exp["status"], exp["name"]) == \
        ({"strategy": "random"}, 7, "running", "test")
    sample = {"b": 2, "a": "conv3x3"}  # order of choices is meaningful and must survive
    model_id = store.add_model(sample, graph={"nodes": [1, 2]}, hash="h1")
    child = store.add_model({"b": 3}, hash="h2", parent=model_id)
    got = store.get_model(child)
    assert got["parent"] == model_id and got["status"] == "pending"
    assert list(store.get_model(model_id)["sample"]) == ["b", "a"]
    assert store.get_model(model_id)["graph"] == {"nodes": [1, 2]}
    store.set_experiment_status("done")
    assert store.get_experiment()["status"] == "done"
    with pytest.raises(StoreError, match="no model 999"):
        store.get_model(999)


def test_finished_hashes_by_status_and_experiment(store):
    for h, status in [("a", "trained"), ("b", "failed"), ("c", "training"), ("d", "pending")]:
        store.set_model_status(store.add_model({"x": h}, hash=h), status,
                               value=0.5 if status == "trained" else None)
    assert store.finished_hashes() == {"a", "b"}
    assert [(m["hash"], m["value"]) for m in store.models()] == \
        [("a", 0.5), ("b", None), ("c", None), ("d", None)]
    assert [m["sample"] for m in store.models(status="failed")] == [{"x": "b"}]
    assert store.finished_hashes(["training", "pending"]) == {"c", "d"}
    store.add_experiment({}, seed=1)  # a new experiment starts with nothing finished
    store.set_model_status(store.add_model({"x": "e"}, hash="e"), "trained")
    assert store.finished_hashes() == {"e"}


def test_journal_writes_events_and_trial_state(store):
    model_id = store.add_model({"op": 1}, hash="m")
    store.trial_added(trial("t1", config={"lr": 0.1, "model_id": model_id}))
    store.trial_added(trial("t2", parent="t1", model_id=model_id))
    store.transition("t1", TrialState.PENDING, TrialState.RUNNING, "scheduled", worker="local-1")
    store.transition("t1", "RUNNING", "ERRORED", "NaN loss")
    store.transition("t1", "ERRORED", "PENDING", "retry 1")
    store.transition("t1", "PENDING", "RUNNING", "scheduled", worker="local-0")
    store.transition("t1", "RUNNING", "TERMINATED", "max_t")

    t1 = store.get_trial("t1")
    assert (t1["state"], t1["attempts"], t1["error"], t1["worker"]) == \
        ("TERMINATED", 1, "NaN loss", "local-0")
    assert t1["spec"] == {"lr": 0.1, "model_id": model_id} and t1["model_id"] == model_id
    assert "config" not in t1["record"]  # the spec column is the trial's config: one copy
    assert store.records()[0] == ("trial_added", {"trial_id": "t1", "parent": None,
                                                  "config": {"lr": 0.1, "model_id": model_id}})
    assert t1["started"] <= t1["ended"]
    assert store.get_trial("t2")["parent"] == "t1" and store.get_trial("t2")["model_id"] == model_id
    path = [(e["old_state"], e["new_state"]) for e in store.events("t1")]
    assert path == [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "ERRORED"),
                    ("ERRORED", "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "TERMINATED")]
    assert store.counts_by_state() == {"PENDING": 1, "RUNNING": 0, "PAUSED": 0,
                                       "TERMINATED": 1, "ERRORED": 0}


def test_journal_is_committed_before_the_call_returns(store):
    """Written before it takes effect: another connection sees it without any close/flush."""
    store.trial_added(trial("t1"))
    store.transition("t1", "PENDING", "RUNNING", "go")
    reader = sqlite3.connect(store.path)
    assert reader.execute("SELECT state FROM trials WHERE id='t1'").fetchone() == ("RUNNING",)
    assert reader.execute("SELECT count(*) FROM events WHERE trial_id='t1'").fetchone() == (2,)
    reader.close()


def test_transition_is_one_transaction(store):
    """If the trial update fails, the events row is not written either."""
    store.trial_added(trial("t1"))
    store.db.execute("CREATE TRIGGER no_pause BEFORE UPDATE OF state ON trials "
                     "WHEN NEW.state = 'PAUSED' BEGIN SELECT RAISE(ABORT, 'refused'); END")
    with pytest.raises(sqlite3.IntegrityError, match="refused"):
        store.transition("t1", "PENDING", "PAUSED", "test")
    assert [e["new_state"] for e in store.events("t1")] == ["PENDING"]
    assert store.get_trial("t1")["state"] == "PENDING"


def test_journal_rejects_contradictions(store):
    store.trial_added(trial("t1"))
    with pytest.raises(StoreError, match="already in"):
        store.trial_added(trial("t1"))
    with pytest.raises(StoreError, match="is PENDING in the store"):
        store.transition("t1", "RUNNING", "PAUSED", "")
    with pytest.raises(StoreError, match="unknown trial 'nope'"):
        store.transition("nope", "PENDING", "RUNNING", "")
    with pytest.raises(StoreError, match="unknown trial state 'DONE'"):
        store.transition("t1", "PENDING", "DONE", "")
    with pytest.raises(StoreError, match="unknown trial 'nope'"):
        store.checkpoint("nope", 1, "nope/step-000001")
    assert store.db["checkpoints"].count == 0  # nothing of the refused call was written
    with pytest.raises(StoreError, match="unknown trial 'nope'"):
        store.worker("nope", "local-0")
    with pytest.raises(StoreError, match="has no model 99"):
        store.set_model_status(99, "trained", 0.5)
    with pytest.raises(StoreError, match="'val_acc' of trial 't1' at step 1 is 'high'"):
        store.result("t1", 1, {"val_acc": "high"}, time=0.0)


def test_metrics_are_batched_flushed_and_replaced_on_retry(tmp_path):
    s = Store(tmp_path / "m.db", batch_size=5, flush_interval=3600)
    s.trial_added(trial("t1"))
    reader = sqlite3.connect(s.path)
    count = lambda: reader.execute("SELECT count(*) FROM metrics").fetchone()[0]  # noqa: E731
    s.result("t1", 1, {"a": 1.0, "b": 2}, time=1.0)
    assert count() == 0  # buffered
    s.result("t1", 2, {"a": 1.5, "b": 3, "c": float("nan")}, time=2.0)
    assert count() == 5  # batch full: written
    s.result("t1", 2, {"a": 9.0}, time=3.0)  # step 2 again: a retried attempt's value wins
    s.checkpoint("t1", 2, "t1/step-000002")  # flushes first: metrics precede the row
    assert count() == 5
    assert s.learning_curve("t1", "a") == [(1, 1.0), (2, 9.0)]
    assert s.learning_curve("t1", "c") == [(2, None)]  # NaN is NULL
    s.result("t1", 3, {"a": 2.0}, time=4.0)
    s.close()  # flushes
    assert reader.execute("SELECT value FROM metrics WHERE step=3").fetchone() == (2.0,)
    reader.close()


def test_state_blobs_latest_wins_per_experiment(store):
    assert store.load_scheduler_state() is None
    store.scheduler_state({"rungs": [1, 3]})
    store.scheduler_state({"rungs": [1, 3, 9]})
    store.save_strategy_state({"population": [{"a": 1}]})
    first = store.experiment_id
    store.add_experiment({}, seed=0)
    assert store.load_scheduler_state() is None and store.load_strategy_state() is None
    store.use_experiment(first)
    assert store.load_scheduler_state() == {"rungs": [1, 3, 9]}
    assert store.load_strategy_state() == {"population": [{"a": 1}]}


def test_checkpoints_latest_and_forgotten(store):
    store.trial_added(trial("t1"))
    folder = store.checkpoint_dir
    assert folder == str(store.path).replace(".db", ".checkpoints")
    for step in (1, 2):
        store.checkpoint("t1", step, f"t1/step-{step}")  # a name in the run's folder
    store.checkpoint("t1", 3, os.path.join(folder, "t1", "step-3"))  # a file in it: its name
    t1 = store.get_trial("t1")
    assert (t1["step"], t1["checkpoint"]) == (3, "t1/step-3")
    last = store.last_checkpoint("t1")
    assert (last["name"], last["path"]) == ("t1/step-3", os.path.join(folder, "t1", "step-3"))
    assert [(c["step"], c["name"]) for c in store.checkpoints("t1")] == \
        [(1, "t1/step-1"), (2, "t1/step-2"), (3, "t1/step-3")]
    store.forget_checkpoint("t1", 2)
    assert [c["step"] for c in store.checkpoints("t1")] == [1, 3]
    store.forget_checkpoint("t1", 3)  # the trial's columns fall back to its newest remaining
    assert (store.get_trial("t1")["step"], store.get_trial("t1")["checkpoint"]) == (1, "t1/step-1")
    for outside in ("/ck/t1-4.pt", "../elsewhere/t1-4", "t1/../../t1-4"):
        with pytest.raises(StoreError, match="refused"):
            store.checkpoint("t1", 4, outside)


def _reference_best(curves, models, metric_mode, reduce):
    """Plain Python: per trial the last (or best) value, per model its best trial."""
    sign = 1 if metric_mode == "max" else -1
    per_trial = {}
    for tid, points in curves.items():
        points = [(s, v) for s, v in points if v is not None]
        if not points:
            continue
        if reduce == "last":
            step, value = max(points)
        else:
            step, value = min(points, key=lambda p: (-sign * p[1], p[0]))
        per_trial[tid] = (value, step)
    trials = sorted(per_trial, key=lambda t: (-sign * per_trial[t][0], t))
    best_models, seen = [], set()
    for tid in trials:
        if models[tid] not in seen:
            seen.add(models[tid])
            best_models.append((models[tid], tid, *per_trial[tid]))
    return [(t, *per_trial[t]) for t in trials], best_models


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize("reduce", ["last", "best"])
def test_best_trials_and_models_match_reference(store, mode, reduce):
    rng = random.Random(f"{mode}{reduce}")
    model_ids = [store.add_model({"i": i}, hash=f"h{i}") for i in range(6)]
    curves, models = {}, {}
    for n in range(25):
        tid = f"t{n:02d}"
        models[tid] = rng.choice(model_ids)
        store.trial_added(trial(tid, config={"model_id": models[tid]}))
        steps = rng.randint(0, 6)  # some trials never reported
        curves[tid] = [(s, round(rng.random(), 3) if rng.random() > 0.1 else None)
                       for s in range(1, steps + 1)]
        for s, v in curves[tid]:
            store.result(tid, s, {"score": float("nan") if v is None else v, "other": 1.0}, time=s)
    want_trials, want_models = _reference_best(curves, models, mode, reduce)
    got = store.best_trials("score", mode, k=10, reduce=reduce)
    assert [(r["trial_id"], r["value"], r["step"]) for r in got] == want_trials[:10]
    got = store.best_models("score", mode, k=4, reduce=reduce)
    assert [(r["model_id"], r["trial_id"], r["value"], r["step"]) for r in got] == want_models[:4]
    assert got[0]["sample"] == store.get_model(got[0]["model_id"])["sample"]
    curves_got = store.learning_curves("score")
    assert curves_got == {t: c for t, c in curves.items() if c}


def test_queries_are_scoped_to_the_current_experiment(store):
    store.trial_added(trial("a1"))
    store.result("a1", 1, {"acc": 0.9}, time=0)
    store.add_experiment({}, seed=2)
    store.trial_added(trial("b1"))
    store.result("b1", 1, {"acc": 0.1}, time=0)
    assert [r["trial_id"] for r in store.best_trials("acc")] == ["b1"]
    assert [t["id"] for t in store.trials()] == ["b1"]
    assert sum(store.counts_by_state().values()) == 1
    with pytest.raises(ValueError, match="mode must be 'max' or 'min'"):
        store.best_trials("acc", mode="largest")


def test_reopen_keeps_everything(tmp_path):
    with Store(tmp_path / "r.db") as s:
        exp = s.add_experiment({"k": 1}, seed=3)
        s.trial_added(trial("t1", config={"hparams": {"lr": 1e-3}}))
        s.result("t1", 1, {"acc": 0.5}, time=1.0)
        s.scheduler_state({"x": 1})
    with Store(tmp_path / "r.db") as s:
        s.use_experiment(exp)
        assert s.get_trial("t1")["hparams"] == {"lr": 1e-3}
        assert s.learning_curve("t1", "acc") == [(1, 0.5)]
        assert s.load_scheduler_state() == {"x": 1}
        assert [t["id"] for t in s.trials(states=[TrialState.PENDING])] == ["t1"]


# ---- saved states with append-only lists -------------------------------------------------


def _growing(n, extra=None):
    """A state whose 'log' and 'names' only grow at their end, plus ordinary keys."""
    return {"rng": [n, "abc"], "log": [["ask", i, {"v": i / 3}] for i in range(n)],
            "names": [f"n{i}" for i in range(n // 2)], "counts": extra or {"n": n},
            "append_only": ["log", "names"]}


def _item_rows(store, name="log"):
    return store.db.execute("SELECT count(*) FROM state_items WHERE name = ?", [name]).fetchone()[0]


def test_append_only_lists_round_trip_and_only_new_items_are_written(store):
    for n in (0, 1, 5, 5, 12, 40):
        store.save_strategy_state(_growing(n))
        assert store.load_strategy_state() == _growing(n)
        assert _item_rows(store) == n and _item_rows(store, "names") == n // 2
    # Items already saved are not written again: an edit to an old row survives the next save.
    store.db.execute("UPDATE state_items SET item = '\"edited\"' WHERE name = 'log' AND idx = 3")
    store.save_strategy_state(_growing(45))
    want = _growing(45)
    want["log"][3] = "edited"
    assert store.load_strategy_state() == want


def test_a_list_changed_before_its_end_is_rewritten(store):
    store.save_strategy_state(_growing(10))
    changed = _growing(12)
    changed["log"][9] = ["changed"]  # the last saved item differs: not an extension
    store.save_strategy_state(changed)
    assert store.load_strategy_state() == changed
    store.save_strategy_state(_growing(4))  # shorter: rewritten too
    assert store.load_strategy_state() == _growing(4) and _item_rows(store) == 4


def test_append_only_state_survives_reopening_and_each_experiment_has_its_own(tmp_path):
    path = tmp_path / "s.db"
    with Store(path) as s:
        first = s.add_experiment({}, seed=0)
        s.save_strategy_state(_growing(6))
        s.scheduler_state(_growing(3))
        second = s.add_experiment({}, seed=1)
        s.save_strategy_state(_growing(2))
    with Store(path) as s:  # a new process: what is on disk is the starting point
        s.use_experiment(first)
        assert s.load_strategy_state() == _growing(6)
        s.save_strategy_state(_growing(9))
        assert s.load_strategy_state() == _growing(9)
        assert s.load_scheduler_state() == _growing(3)
        s.use_experiment(second)
        assert s.load_strategy_state() == _growing(2)


def test_a_strategy_state_saved_as_the_engine_does_restores_the_same_search(store):
    from retiarii.strategies import RegularizedEvolution

    from toy_spaces import conditional_space

    space = conditional_space()
    strategy = RegularizedEvolution(population_size=4, sample_size=2, seed=1)
    for i in range(12):
        sample = strategy.ask(space)
        strategy.tell(sample, float(i % 5))
        store.save_strategy_state(strategy.state_dict())  # once per model, as the engine
    restored = RegularizedEvolution(population_size=4, sample_size=2, seed=1)
    restored.load_state_dict(store.load_strategy_state())
    assert [restored.ask(space) for _ in range(6)] == [strategy.ask(space) for _ in range(6)]


def test_append_only_lists_of_a_nested_state(store):
    """The runner's journal holds the scheduler's state inside its own: both declare lists."""
    def runner_state(n):
        return {"scheduler": _growing(n), "fed": [[f"t{i}", 1] for i in range(n)],
                "known": n, "append_only": ["fed"]}

    for n in (0, 3, 8):
        store.scheduler_state(runner_state(n))
        assert store.load_scheduler_state() == runner_state(n)
    paths = {r[0] for r in store.db.execute("SELECT DISTINCT name FROM state_items")}
    assert paths == {"fed", "scheduler/log", "scheduler/names"}
    row = store.db.execute("SELECT state FROM scheduler_state").fetchone()[0]
    assert len(row) < 250  # the lists are not in the state row


def test_missing_items_are_reported(store):
    store.save_strategy_state(_growing(5))
    store.db.execute("DELETE FROM state_items WHERE idx = 4 AND name = 'log'")
    with pytest.raises(StoreError, match="lists 5 items of 'log' but state_items holds 4"):
        store.load_strategy_state()


def test_append_only_must_name_lists(store):
    with pytest.raises(StoreError, match="names 'rng', which is not a list"):
        store.save_strategy_state({"rng": 3, "append_only": ["rng"]})


# ---- migrations and unusable files --------------------------------------------------------


def _add_notes_column(db):
    db["trials"].add_column("notes", str)


def test_migrations_upgrade_an_old_file_in_order(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    with Store(path) as s:
        s.trial_added(trial("t1"))
    applied = []

    def v3(db):
        applied.append(3)
        assert "notes" in db["trials"].columns_dict  # v2 ran first
        db["trials"].update("t1", {"notes": "migrated"})

    monkeypatch.setattr(store_module, "MIGRATIONS",
                        [*store_module.MIGRATIONS, _add_notes_column, v3])
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", SCHEMA_VERSION + 2)
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION + 2 and applied == [3]
        assert s.get_trial("t1")["notes"] == "migrated"
    with Store(path) as s:  # nothing is applied twice
        assert applied == [3]


def test_version_2_files_lose_the_unused_pinned_column(tmp_path, monkeypatch):
    """Schema 3 drops ``checkpoints.pinned`` (garbage collection is the scheduler's
    ``deletable_checkpoints``); the checkpoints a version-2 file holds survive."""
    path = tmp_path / "v2.db"
    with monkeypatch.context() as m:
        m.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:2])
        m.setattr(store_module, "SCHEMA_VERSION", 2)
        with Store(path) as s:
            s.trial_added(trial("t1"))
            s.db.execute("INSERT INTO checkpoints (trial_id, step, path, pinned, time) "
                         "VALUES ('t1', 1, 't1/step-1', 1, 0), ('t1', 2, 't1/step-2', 0, 0)")
            s.db.conn.commit()
    with Store(path) as s:
        assert s.schema_version == SCHEMA_VERSION
        assert "pinned" not in s.db["checkpoints"].columns_dict
        assert s.db["plans"].count == 0  # version 4: the plans table, empty in an old run
        assert "packing" in s.db["plans"].columns_dict  # version 6: plans.packing
        assert [c["name"] for c in s.checkpoints("t1")] == ["t1/step-1", "t1/step-2"]
        s.checkpoint("t1", 3, "t1/step-3")
        assert s.last_checkpoint("t1")["name"] == "t1/step-3"


def test_failed_migration_leaves_the_file_at_its_old_version(tmp_path, monkeypatch):
    path = tmp_path / "old.db"
    Store(path).close()

    def broken(db):
        db["trials"].add_column("half_done", str)
        raise RuntimeError("migration bug")

    monkeypatch.setattr(store_module, "MIGRATIONS", [*store_module.MIGRATIONS, broken])
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(RuntimeError, match="migration bug"):
        Store(path)
    db = sqlite_utils.Database(path)
    assert db["meta"].get("schema_version")["value"] == str(SCHEMA_VERSION)
    assert "half_done" not in db["trials"].columns_dict
    db.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "future.db"
    with Store(path) as s:
        s.db["meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION + 5)}, pk="key")
    with pytest.raises(StoreError, match=f"version {SCHEMA_VERSION + 5}.*newer retiarii"):
        Store(path)


def test_corrupt_or_foreign_files_are_refused_by_name(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    with pytest.raises(StoreError, match="garbage.db is not a usable SQLite database"):
        Store(garbage)
    foreign = tmp_path / "other_app.db"
    sqlite_utils.Database(foreign)["people"].insert({"name": "ada"})
    with pytest.raises(StoreError, match="other_app.db is a SQLite database but not a retiarii"):
        Store(foreign)


def test_states_match_the_lifecycle():
    assert set(STATES) == {s.value for s in TrialState}


# ---- the store as the TrialRunner's journal --------------------------------------------------

from retiarii.engine.executors.simulated import SimulatedExecutor  # noqa: E402
from retiarii.engine.runner.trial_runner import MemoryJournal, TrialRunner  # noqa: E402
from retiarii.strategies.schedulers.asha import ASHA  # noqa: E402


def _curve(spec, step):
    return {"loss": spec["a"] / step + spec["b"], "acc": 1 - spec["b"]}


CONFIGS = [{"a": 1.0 + (i * 7) % 10 / 3, "b": (i * 3) % 4 / 10} for i in range(10)]


class Tee:
    """Writes every journal call to two journals."""

    def __init__(self, *journals):
        self.journals = journals

    def __getattr__(self, name):
        def call(*args):
            for journal in self.journals:
                getattr(journal, name)(*args)
        return call


def _by_trial(records):
    """What the journal contract orders: trial_added overall, the rest per trial and kind."""
    added = [p for k, p in records if k == "trial_added"]
    per = {}
    for kind, p in records:
        if kind not in ("trial_added", "scheduler_state"):
            per.setdefault((kind, p["trial_id"]), []).append(p)
    latest = [p for k, p in records if k == "scheduler_state"][-1:]
    return added, per, latest


def _start(journal, checkpoints=None):
    ex = SimulatedExecutor(2, _curve, checkpoints=checkpoints)
    runner = TrialRunner(ex, ASHA("loss", "min", 1, 8, 2, promotion=True), journal, max_steps=8,
                         max_failures=1)
    return ex, runner


def test_records_equal_the_memory_journal(tmp_path):
    memory, store = MemoryJournal(), Store(tmp_path / "j.db")
    ex, runner = _start(Tee(memory, store))
    for i, config in enumerate(CONFIGS):
        runner.add_trial(config, trial_id=f"t{i}")
    runner.run()
    assert _by_trial(store.records()) == _by_trial(memory.records())
    store.close()


@pytest.mark.parametrize("kill_after", [5, 23, 61])
def test_runner_resumes_from_the_store_after_the_driver_dies(tmp_path, kill_after):
    _, full = _start(None)
    for i, config in enumerate(CONFIGS):
        full.add_trial(config, trial_id=f"t{i}")
    full.run()
    expected = {t: (tr.state, tr.step, tr.last_result["loss"]) for t, tr in full.trials.items()}

    store = Store(tmp_path / "run.db", flush_interval=3600)  # buffered metrics die with it
    ex, runner = _start(store)
    for i, config in enumerate(CONFIGS):
        runner.add_trial(config, trial_id=f"t{i}")
    assert not runner.run(max_events=kill_after)
    del store, runner  # the driver dies: no close(), no flush
    reopened = Store(tmp_path / "run.db")
    ex2 = SimulatedExecutor(2, _curve, checkpoints=ex.checkpoints)  # the disk survives
    resumed = TrialRunner.resume(ex2, ASHA("loss", "min", 1, 8, 2, promotion=True), reopened,
                                 max_steps=8, max_failures=1)
    assert resumed.run()
    got = {t: (tr.state, tr.step, tr.last_result["loss"]) for t, tr in resumed.trials.items()}
    assert got == expected
    assert sum(reopened.counts_by_state().values()) == len(CONFIGS)
    ended = reopened.final_values("loss")
    assert {t for t, _, _ in ended} == set(expected)
    assert all(v == pytest.approx(expected[t][2]) for t, _, v in ended)
    reopened.close()


# ---- docs/store.md is complete and its examples run ------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "store.md")


def _documented_columns():
    """{table: {column, ...}} from the doc's '### `table`' sections and their column tables."""
    out, table = {}, None
    for line in open(DOC, encoding="utf-8"):
        heading = re.match(r"### (.+)", line)
        if heading:
            tables = re.findall(r"`(\w+)`", heading.group(1))
            table = tables
            for t in tables:
                out[t] = set()
        elif table and line.startswith("| `"):
            for t in table:
                out[t] |= set(re.findall(r"`(\w+)`", line.split("|")[1]))
    return out


def test_every_table_and_column_is_documented(tmp_path):
    with Store(tmp_path / "s.db") as s:
        schema = {t: set(s.db[t].columns_dict) for t in s.db.table_names()}
    documented = _documented_columns()
    assert documented.keys() == schema.keys()
    for table, columns in schema.items():
        assert documented[table] == columns, table


def _example_store(path):
    with Store(path) as s:
        s.add_experiment({"space": "x"}, seed=0)
        for i in range(3):
            model = s.add_model({"op": ["conv", "pool"][i % 2]}, {"nodes": []}, f"h{i}")
            tid = f"e1-trial-000{7 + i}"
            s.trial_added(trial(tid, config={"model_id": model, "hparams": {"lr": 0.1}}))
            s.transition(tid, "PENDING", "RUNNING", "started")
            for step in (1, 2):
                s.result(tid, step, {"val_acc": 0.5 + i / 10 + step / 100, "val_loss": 1 / step},
                         time=step)
            s.checkpoint(tid, 2, f"{tid}/step-000002")
            s.transition(tid, "RUNNING", "ERRORED" if i == 2 else "TERMINATED", "error: boom")
            s.set_model_status(model, "trained", value=0.5 + i / 10)
        strategy, space = Random(seed=0), flat_space()
        for i in range(3):
            strategy.tell(strategy.ask(space), i / 10)
        s.save_strategy_state(strategy.state_dict())
        from retiarii.engine.jobs.reports import PlanRecord
        from retiarii.engine.storage.plans_table import PlanTable  # a grouped job of the first two trials

        PlanTable(s).add(PlanRecord("e1-trial-0007+1@2#1", ("e1-trial-0007", "e1-trial-0008"),
                                    "merged", speedup=1.7, seconds=2.0))


def test_the_docs_examples_run(tmp_path):
    from click.testing import CliRunner
    from sqlite_utils.cli import cli

    path = str(tmp_path / "exp.db")
    _example_store(path)
    text = open(DOC, encoding="utf-8").read()
    bash = "\n\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
    commands = 0
    for paragraph in bash.split("\n\n"):
        lines = [ln for ln in paragraph.splitlines() if not ln.startswith("#")]
        argv = shlex.split(" ".join(lines).replace("\\ ", " "))
        assert argv[0] == "sqlite-utils"
        argv = [path if a == "runs/exp.db" else a for a in argv[1:]]
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, (argv, result.output)
        assert result.output.strip() not in ("", "[]"), argv  # each example finds something
        commands += 1
    assert commands == 11  # every example of docs/store.md, the plans one included
    python = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(python.replace("runs/exp.db", path), {})
