"""Packing in the engine (engine/placing.py): the runner splits a batch over its free slots by
the trials' profiles, packed jobs give every model the results of training it alone (the
reference: the same search with ``optimize=False``), packing without merging trains each model
of a job alone, and the plans table records each packing decision."""
from __future__ import annotations

import json

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii.engine.executors.simulated import SimulatedExecutor
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.engine.runner.trial_runner import TrialRunner
from retiarii.strategies import Scheduler
from retiarii.engine.runner.planner import JobPlanner
from retiarii.engine.runner.packer import Packer

TRAINER = rt.Trainer(dataset="digits", epochs=2, batch_size=256,
                     lr=rt.ValueChoice([0.01, 0.03, 0.1], label="lr"))


class TwoSlots(InProcessExecutor):
    """Two slots, jobs run one after the other in this process; keeps every job."""

    num_slots = 2

    def __init__(self, memory: float = float("inf")):
        super().__init__()
        self.submitted, self.memory = [], memory

    def submit(self, job):
        self.submitted.append(job)
        super().submit(job)

    def slot_memory(self):
        return self.memory


def _run(tmp_path, name, **kwargs):
    db = tmp_path / f"{name}.db"
    executor = kwargs.pop("executor", None) or TwoSlots()
    exp = rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(db),
                        executor=executor, seed=0, max_models=8, fuse=False, **kwargs)
    exp.run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {json.dumps(t["spec"]["choices"], sort_keys=True):
                  {m: store.learning_curve(t["id"], m) for m in ("train_loss", "val_loss", "val_acc")}
                  for t in store.trials()}
        plans = PlanTable(store)
        return exp, executor, curves, plans.rows(), plans.summary()


def test_a_packed_search_gives_every_model_its_results_alone(tmp_path):
    _, _, alone, _, _ = _run(tmp_path, "alone", optimize=False)
    exp, executor, packed, rows, summary = _run(tmp_path, "packed", optimize=True, packing=True,
                                                batch_models=4)
    assert packed == alone and len(alone) == 8  # bit for bit, every metric of every model
    assert exp.runner.packer.placements, "the runner placed its batches by profile"
    first = exp.runner.packer.placements[0]
    assert set(first["devices"]) == {"slot-0", "slot-1"}
    assert any(len(job.tasks) > 1 and job.meta.get("group") for job in executor.submitted)
    notes = [row["packing"] for row in rows if row["packing"]]
    assert notes and {n["device"] for n in notes} <= {"slot-0", "slot-1"}
    assert all(n["models"] >= 2 and n["predicted_iter_s"] > 0 for n in notes)
    assert summary["packing"]["packs"] == len(notes)


def test_packing_without_merging_trains_each_model_alone_in_one_job(tmp_path):
    _, _, alone, _, _ = _run(tmp_path, "alone", optimize=False)
    _, executor, packed, rows, summary = _run(tmp_path, "pack", optimize="pack", packing=True,
                                              batch_models=4)
    assert packed == alone
    multi = [job for job in executor.submitted if len(job.tasks) > 1]
    assert multi and not any(job.meta.get("group") for job in multi)
    assert rows and {row["status"] for row in rows} == {"packed"}
    assert all(row["passes"] == [] for row in rows)
    assert summary["packing"]["unmerged_packs"] == len(rows)


def test_every_trial_carries_an_estimated_profile(tmp_path):
    exp, _, _, _, _ = _run(tmp_path, "est", optimize=True, packing=True, batch_models=4)
    profiles = [t.config["profile"] for t in exp.runner.trials.values()]
    assert all(p["units"] > 0 and p["memory"] > 0 for p in profiles)
    # hidden 32 models hold more than hidden 16 ones
    by_hidden = {}
    for t in exp.runner.trials.values():
        by_hidden.setdefault(t.config["sample"]["hidden"], []).append(t.config["profile"]["memory"])
    assert min(by_hidden[32]) > max(by_hidden[16])


def _runner(profiles: dict[str, tuple[float, float]], memory: float = float("inf"), batch_models=8):
    runner = TrialRunner(SimulatedExecutor(2, curve=lambda spec, step: {"loss": 1.0}), Scheduler(),
                         planner=JobPlanner(batch_models=batch_models, group_key=lambda t: "k"),
                         packer=Packer(True, memory, batch_models))
    trials = [runner.add_trial({"profile": {"units": u, "memory": m}}, trial_id=t)
              for t, (u, m) in profiles.items()]
    return runner, trials


def test_the_runner_packs_similar_trials_per_slot_within_memory():
    runner, trials = _runner({"s1": (100, 10), "s2": (100, 10), "f1": (20, 10), "f2": (20, 10),
                              "f3": (20, 10), "f4": (20, 10), "f5": (20, 10), "f6": (20, 10),
                              "f7": (20, 10), "f8": (20, 10), "f9": (20, 10), "f10": (20, 10)},
                             batch_models=12)
    packs = runner.packer.packs(trials, 2)
    names = sorted(sorted(t.trial_id for t in p) for p in packs)
    assert names == [sorted(f"f{i}" for i in range(1, 11)), ["s1", "s2"]]
    runner, trials = _runner({f"t{i}": (10, 40) for i in range(6)}, memory=100)
    packs = runner.packer.packs(trials, 2)
    assert all(len(p) <= 2 for p in packs) and sum(len(p) for p in packs) == 6


def test_measured_step_times_replace_estimates():
    """Once a worker measured some trials, the others' estimates are scaled by the median
    measured/estimated ratio, and the measured ones use their measurement."""
    runner, trials = _runner({"a": (100, 1), "b": (100, 1), "c": (100, 1)})
    runner.packer.packs(trials[:1], 1, {"a": 0.5, "b": 0.1})  # measured: a is five times b
    profiles = {p.trial_id: p.iter_s for p in runner.packer._profiles(trials)}
    assert profiles == {"a": 0.5, "b": 0.1, "c": pytest.approx(100 * 0.003)}


def test_without_profiles_or_packing_the_batch_spreads_evenly():
    runner, trials = _runner({"a": (1, 1), "b": (1, 1), "c": (1, 1)})
    trials[1].config.pop("profile")
    assert [[t.trial_id for t in p] for p in runner.packer.packs(trials, 2)] == [["a", "b"], ["c"]]
    runner.packer.packing = False
    trials[1].config["profile"] = {"units": 1, "memory": 1}
    assert [[t.trial_id for t in p] for p in runner.packer.packs(trials, 2)] == [["a", "b"], ["c"]]


@pytest.mark.parametrize("kwargs, match", [(dict(packing="yes"), "packing='yes'"),
                                           (dict(optimize="packed"), "optimize='packed'")])
def test_bad_packing_options_are_refused(tmp_path, kwargs, match):
    with pytest.raises(rt.engine.experiment.ExperimentError, match=match):
        rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(tmp_path / "x.db"),
                      **kwargs)


def test_auto_packs_by_profile_on_gpus_and_on_two_cpu_slots_or_more(tmp_path):
    class Slots:
        def __init__(self, devices, num_slots=1):
            self.devices, self.num_slots = devices, num_slots

    exp = rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(tmp_path / "a.db"))
    assert exp._packs(Slots([])) is False and exp._packs(Slots(["0"])) is True
    assert exp._packs(Slots([], 2)) is True  # two CPU workers: their packs balanced
    assert exp._packs(TwoSlots()) is True
    forced = rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER,
                           store=str(tmp_path / "b.db"), packing=True)
    assert forced._packs(Slots([])) is True
