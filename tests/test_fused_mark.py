"""A trial that starts from a checkpoint trained fused is marked fused (``trials.fused``) in the
transaction that adds it: a PBT clone of a fused donor (also after the driver is killed and the
search resumed), a child inheriting its parent's weights; never a clone of an unfused trial."""
import json

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import EXAMPLE, FixedMLP
from retiarii.engine.jobs.reports import PlanRecord
from retiarii.engine.runner.trial import Trial
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.strategies import PBT, Continuous

space = rt.ModelSpace(FixedMLP(), example_input=EXAMPLE)


class DriverKilled(BaseException):
    """The driver is dead (BaseException: nothing in the engine may catch it)."""


def _experiment(db, executor=None):
    # one architecture, four learning rates: the first generation trains as one fused unit
    pbt = PBT("val_acc", "max", {"lr": Continuous(0.003, 0.3)}, population_size=4,
              steps_per_trial=1, max_generations=2, seed=0)
    return rt.Experiment(space, rt.strategies.Random(seed=0),
                         rt.Trainer(dataset="digits", epochs=2, batch_size=256), store=str(db),
                         seed=0, scheduler=pbt, executor=executor or InProcessExecutor(),
                         optimize=True, fuse=True)


def _marks(db):
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = {t["id"]: t for t in store.trials()}
        return trials, PlanTable(store).fused_trials(), store.get_experiment()["status"]


def _check_clones_marked(db):
    trials, fused, status = _marks(db)
    assert status == "done"
    roots = [t for t in trials.values() if t["parent"] is None]
    clones = [t for t in trials.values() if t["parent"] is not None]
    assert len(roots) == 4 and len(clones) == 4
    assert all(t["fused"] == 1 for t in roots), trials  # the generation trained fused
    for clone in clones:  # each starts from a fused donor's checkpoint: it rounds as fused
        assert clone["fused"] == 1, clone
    assert fused == set(trials)  # what status and the fused tolerance read


def test_a_pbt_clone_of_a_fused_donor_is_marked_fused(tmp_path):
    db = tmp_path / "pbt.db"
    _experiment(db).run()
    _check_clones_marked(db)


def test_the_clones_mark_survives_a_driver_killed_after_adding_it(tmp_path, monkeypatch):
    db = tmp_path / "pbt.db"
    added = Store.trial_added
    killed = []

    def dying_trial_added(self, trial):
        added(self, trial)  # committed: the clone and its mark, or neither
        if trial.parent is not None and not killed:
            killed.append(trial.trial_id)
            self.db.conn.close()  # what was not committed is lost, as in a dead process
            self.db = None
            raise DriverKilled(trial.trial_id)

    monkeypatch.setattr(Store, "trial_added", dying_trial_added)
    try:
        _experiment(db).run()
    except DriverKilled:
        pass
    assert killed
    trials, _, status = _marks(db)
    assert status != "done" and trials[killed[0]]["fused"] == 1  # marked before it ran
    monkeypatch.setattr(Store, "trial_added", added)
    _experiment(db).resume()  # the first clone re-spawned, the others added by this driver
    _check_clones_marked(db)


def _store_with_donor(tmp_path, fused, in_plans=False):
    """A store holding trial ``d`` with its step-1 checkpoint; ``fused``: its mark (None: a
    store from before schema 11 knows it only from a plans row, ``in_plans``)."""
    tmp_path.mkdir(exist_ok=True)
    store = Store(tmp_path / "s.db")
    store.add_experiment({"metric": "val_acc"}, seed=0)
    store.trial_added(Trial("d", {}))
    store.checkpoint("d", 1, "d/step-000001", fused=bool(fused))
    if fused is None:
        store.db.execute("UPDATE trials SET fused = NULL WHERE id = 'd'")
    if in_plans:
        PlanTable(store).add(PlanRecord.from_json({
            "job_id": "j", "trials": ["d", "e"], "status": "merged",
            "units": [{"trials": ["d", "e"], "fused": True}]}))
    return store


def _clone_mark(store, trial):
    store.trial_added(trial)
    return store.db.execute("SELECT fused FROM trials WHERE id = ?", [trial.trial_id]).fetchone()[0]


def test_the_store_marks_clones_and_inheritors_of_fused_checkpoints_only(tmp_path):
    pbt_clone = Trial("c", {}, parent="d", parent_step=1, donor="d/step-000001", spawned=True)
    with _store_with_donor(tmp_path / "a", fused=True) as store:
        assert _clone_mark(store, pbt_clone) == 1
        # a child of a strategy inheriting its parent's weights: no parent field, the spec names
        # the checkpoint
        assert _clone_mark(store, Trial("i", {"inherit": "d/step-000001"})) == 1
        assert not _clone_mark(store, Trial("fresh", {}))  # starts afresh: its own rounding
    with _store_with_donor(tmp_path / "b", fused=False) as store:
        assert not _clone_mark(store, pbt_clone)
        assert not _clone_mark(store, Trial("i", {"inherit": "d/step-000001"}))
    with _store_with_donor(tmp_path / "c", fused=None, in_plans=True) as store:  # a v10 store
        assert _clone_mark(store, pbt_clone) == 1
        assert json.loads(store.db.execute("SELECT units FROM plans").fetchone()[0])[0]["fused"]


def test_a_clone_of_a_clone_inherits_the_mark(tmp_path):
    with _store_with_donor(tmp_path, fused=True) as store:
        assert _clone_mark(store, Trial("c", {}, parent="d", parent_step=1,
                                        donor="d/step-000001", spawned=True)) == 1
        store.checkpoint("c", 2, "c/step-000002")  # trained on unfused: still fused rounding
        assert _clone_mark(store, Trial("g", {}, parent="c", parent_step=2,
                                        donor="c/step-000002", spawned=True)) == 1
