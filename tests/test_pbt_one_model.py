"""Population-based training of one fixed architecture (the seed paper's case study: only the
learning rate is flexible) with the default duplicate filters, and each PBT trial's initiator
in ``Spawn``, ``lineage()`` and the store (``trials.initiator``, schema v8)."""
import json
import sqlite3

import pytest
import sqlite_utils
from torch import nn

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import EXAMPLE, FixedMLP
from retiarii.engine.storage import schema as store_schema
from retiarii.engine.storage.store import Store
from retiarii.strategies import PBT, Continuous


def res(step, value):
    return {"training_iteration": step, "acc": value}


def test_spawn_and_lineage_name_the_initiator_when_an_opponent_wins():
    pbt = PBT("acc", "max", {"lr": Continuous(0.1, 1.0)}, population_size=3, steps_per_trial=1,
              max_generations=2, seed=0)
    a, b, c = (pbt.next_spawn() for _ in range(3))
    assert (a.initiator, b.initiator, c.initiator) == (None, None, None)  # generation 0
    for s, v in [(a, 0.9), (b, 0.1), (c, 0.8)]:
        pbt.on_trial_result(s.trial_id, res(1, v))
    children = [pbt.next_spawn() for _ in range(3)]
    # b (0.1) loses to either opponent: its child starts from the winner's checkpoint, and
    # the initiator (b) is what only `initiator` says
    by_initiator = {child.initiator: child for child in children}
    assert set(by_initiator) == {a.trial_id, b.trial_id, c.trial_id}
    child_of_b = by_initiator[b.trial_id]
    assert child_of_b.parent in (a.trial_id, c.trial_id)
    entry = pbt.lineage(child_of_b.trial_id)[-1]
    assert (entry["parent"], entry["initiator"]) == (child_of_b.parent, b.trial_id)
    assert pbt.lineage(a.trial_id)[0]["initiator"] is None




class TwoWidths(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = rt.ValueChoice([8, 16], label="hidden")
        self.net = nn.Sequential(nn.Flatten(), rt.nn.Linear(64, hidden), nn.ReLU(),
                                 rt.nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


fixed_space = rt.ModelSpace(FixedMLP(), example_input=EXAMPLE)
two_widths = rt.ModelSpace(TwoWidths(), example_input=EXAMPLE)


def _pbt(population):
    return PBT("val_acc", "max", {"lr": Continuous(0.003, 0.3)}, population_size=population,
               steps_per_trial=1, max_generations=2, seed=0)


def test_pbt_over_the_learning_rate_of_one_architecture_runs_with_the_defaults(tmp_path):
    """Issue #28: the strategy's and the experiment's duplicate filters (both at their
    defaults) refused the one architecture a second time; the documented rule counts the
    trial's hyper-parameters, which PBT makes differ."""
    db = tmp_path / "pbt.db"
    pbt = _pbt(population=4)
    exp = rt.Experiment(fixed_space, rt.strategies.Random(seed=0),
                        rt.Trainer(dataset="digits", epochs=2, batch_size=256), store=str(db),
                        seed=0, scheduler=pbt, executor=InProcessExecutor())
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        trials = {t["id"]: t for t in store.trials()}
        models = {m["id"]: m for m in store.models()}
    assert len(trials) == 4 + 4  # generation 0, then one child per member
    assert all(t["state"] == "TERMINATED" for t in trials.values())
    assert len({m["hash"] for m in models.values()}) == 1  # one architecture throughout
    roots = [t for t in trials.values() if t["parent"] is None]
    assert len({t["spec"]["hparams"]["lr"] for t in roots}) == 4  # each its own rate
    for t in trials.values():
        # the store keeps what Spawn and lineage() say, for every trial
        entry = pbt.lineage(t["id"])[-1]
        assert (t["parent"], t["initiator"]) == (entry["parent"], entry["initiator"])
        if t["parent"] is not None:
            assert t["initiator"] in trials and t["record"]["initiator"] == t["initiator"]


def test_a_population_larger_than_the_space_takes_its_architectures_in_turn(tmp_path):
    db = tmp_path / "pbt2.db"
    exp = rt.Experiment(two_widths, rt.strategies.Random(seed=0),
                        rt.Trainer(dataset="digits", epochs=2, batch_size=256), store=str(db),
                        seed=0, scheduler=_pbt(population=5), executor=InProcessExecutor())
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        fresh = [m["sample"]["hidden"] for m in store.models() if m["parent"] is None]
    assert len(fresh) == 5
    assert sorted(fresh[:2]) == [8, 16]  # the strategy's two architectures first ...
    assert fresh[2:] == [fresh[0], fresh[1], fresh[0]]  # ... then each again, in turn


def _v7_store(path):
    db = sqlite_utils.Database(str(path))
    for migrate in store_schema.MIGRATIONS[:7]:
        migrate(db)
    db["meta"].insert_all([{"key": "application", "value": "retiarii"},
                           {"key": "schema_version", "value": "7"}])
    db["experiments"].insert({"id": 1, "name": "old", "config": json.dumps({"metric": "acc"}),
                              "seed": 0, "status": "done", "created": 1.0, "updated": 1.0})
    db["trials"].insert({"id": "pbt-0002", "seq": 1, "experiment_id": 1, "spec": "{}",
                         "parent": "pbt-0001", "state": "TERMINATED", "attempts": 0,
                         "step": 2})
    db.conn.close()


def test_a_v7_store_migrates_to_trials_initiator(tmp_path):
    path = tmp_path / "old.db"
    _v7_store(path)
    assert "initiator" not in [r[1] for r in sqlite3.connect(path).execute(
        "PRAGMA table_info(trials)")]
    with Store(path) as store:  # migrates
        assert store.schema_version == store_schema.SCHEMA_VERSION
        store.use_experiment(1)
        (old,) = store.trials()
        assert old["parent"] == "pbt-0001" and old["initiator"] is None  # nothing invented

        class New:
            trial_id, config, parent, initiator, state = "pbt-0003", {}, "pbt-0001", \
                "pbt-0002", "PENDING"
        store.trial_added(New())
        assert {t["id"]: t["initiator"] for t in store.trials()} == {
            "pbt-0002": None, "pbt-0003": "pbt-0002"}


if __name__ == "__main__":
    pytest.main([__file__])
