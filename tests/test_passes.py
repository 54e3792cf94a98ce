"""The pass manager (retiarii/optim/passes.py) and the optimization config object.

Every registered pass is held to the pass contract (idempotent, ``modified`` honest, the plan's
invariants kept); the manager runs passes in the registry's order and names a pass that breaks
an invariant; settings are validated with the registered names. Then the guide of
docs/optimization.md ("Adding a pass") is followed from this file alone: a pass is written
and registered here, and a search run with it uses it (its plans rows name it, its groups
share what it leaves shared), with every model's results those of separate training.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import retiarii as rt
from engine_helpers import InProcessExecutor
from exp_space import space
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.optim import PassResult, PlanModel, build_plan, cse
from retiarii.optim.cost import Layout
from retiarii.optim.passes import (
    LayoutPasses, Pass, PassManager, check_plan, get_pass, parse_settings, pass_ref, register_pass,
    registered_passes, unregister_pass,
)
from retiarii.optim.plan import PlanError

TRAINER = rt.Trainer(dataset="digits", epochs=2, batch_size=256,
                     lr=rt.ValueChoice([0.01, 0.03], label="lr"))


def _plan():
    """Four MLPs of the test space over one data key: CSE shares their input and flatten."""
    models = [space.replay({"hidden": h, "act": a}) for h in (16, 32) for a in ("relu", "tanh")]
    return build_plan([PlanModel(f"t{i}", m, "digits", {}) for i, m in enumerate(models)])


# ---- the pass written by the guide ----------------------------------------------------------


def inputs_only(plan):
    """Share the data pipeline's inputs alone: every shared node that is not a model's input
    is computed per model again (a pass that trades sharing for memory, say)."""
    roots = {k for m in plan.models for k in plan.data_roots(m.trial_id)}
    kept = frozenset(k for k in plan.shared if k in roots)
    if kept == plan.shared:
        return PassResult(plan, False)
    return PassResult(replace(plan, shared=kept), True)


INPUTS_ONLY = Pass("inputs_only", inputs_only, summary="share only the models' inputs")


@pytest.fixture
def registered():
    register_pass(INPUTS_ONLY)
    yield
    unregister_pass("inputs_only")


# ---- the contract every registered pass keeps -------------------------------------------------


@pytest.mark.parametrize("name", [p.name for p in registered_passes()])
def test_every_registered_pass_is_idempotent_and_honest(name):
    p = get_pass(name)
    plan = cse(_plan()).plan  # the plan later passes see
    first = p.run(plan)
    check_plan(first.plan, name)
    assert first.modified == (first.plan != plan)
    second = p.run(first.plan)
    assert not second.modified and second.plan == first.plan


def test_the_guide_pass_keeps_the_contract(registered):
    plan = cse(_plan()).plan
    assert len(plan.shared) == 2  # the input and the flatten
    result = PassManager(["cse", "inputs_only"]).run(_plan())
    assert result.modified and 0 < len(result.plan.shared) < len(plan.shared)
    assert not inputs_only(result.plan).modified
    assert result.plan.executions() > plan.executions()


def test_the_manager_runs_in_registry_order_and_names_a_pass_that_breaks_the_plan(registered):
    assert PassManager(["inputs_only", "cse"]).names == ["cse", "inputs_only"]

    def broken(plan):  # shares a node one model holds: an invariant broken
        own = next(k for k, n in plan.nodes.items() if len(n.holders) == 1)
        return PassResult(replace(plan, shared=plan.shared | {own}), True)

    with pytest.raises(PlanError, match="after pass 'broken'"):
        PassManager(["cse", Pass("broken", broken)]).run(_plan())
    with pytest.raises(PlanError, match="not a PassResult"):
        PassManager([Pass("wrong", lambda plan: plan)]).run(_plan())


def test_settings_are_checked_against_the_registry(registered):
    assert parse_settings("batching=auto, inputs_only=on") == {"batching": "auto",
                                                                "inputs_only": True}
    assert parse_settings({"inputs_only": False}) == {"inputs_only": False}
    with pytest.raises(PlanError, match="did you mean 'batching'"):
        parse_settings("batchin=auto")
    with pytest.raises(ValueError, match="required"):
        parse_settings({"cse": False})
    with pytest.raises(ValueError, match="give True, False, 'auto'"):
        parse_settings({"batching": "sometimes"})
    with pytest.raises(ValueError, match="registered already"):
        register_pass(INPUTS_ONLY)
    with pytest.raises(ValueError, match="required by the engine"):
        unregister_pass("cse")


def test_layout_passes_say_what_each_merged_layout_runs(registered):
    auto = LayoutPasses({"batching": "auto", "inputs_only": True})
    assert auto.of(Layout.CSE) == ("cse", "inputs_only")
    assert auto.of(Layout.BATCHING) == ("cse", "batching", "inputs_only")
    assert auto.merged() == [Layout.CSE]
    assert LayoutPasses({"inputs_only": True}).merged() == [Layout.BATCHING]
    assert LayoutPasses({}).merged() == [Layout.CSE] and LayoutPasses({}).of(Layout.BATCHING) == ("cse",)


# ---- the config object --------------------------------------------------------------------------


def test_optimize_config_equals_the_keyword_arguments(tmp_path):
    def exp(**kw):
        return rt.Experiment(space, rt.strategies.Random(), TRAINER,
                             store=str(tmp_path / "x.db"), **kw)

    a = exp(optimize=True, batching=True, batch_models=4)
    b = exp(optimize=rt.OptimizeConfig(mode=True, passes={"batching": True}, batch_models=4))
    assert a.optimization == b.optimization
    assert (b.fuse, b.batching, b.passes) == (False, True, {"batching": True})
    assert exp().passes == {"batching": "auto"} and exp(optimize=True).passes == {"batching": False}
    with pytest.raises(rt.ExperimentError, match="give fuse inside it"):
        exp(optimize=rt.OptimizeConfig(), fuse=True)
    with pytest.raises(rt.ExperimentError, match="batching=2"):
        exp(passes={"batching": 2})
    with pytest.raises(rt.ExperimentError, match="did you mean"):
        exp(passes={"batchng": True})
    assert not (tmp_path / "x.db").exists()  # nothing written by a refused experiment
    cfg = rt.OptimizeConfig(mode="pack", dedicated=["encoder"], passes={"batching": "auto"})
    assert rt.OptimizeConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


# ---- a search uses the registered pass ------------------------------------------------------------


def _search(tmp_path, name, executor=None, **kwargs):
    db = tmp_path / f"{name}.db"
    rt.Experiment(space, rt.strategies.Random(seed=0), TRAINER, store=str(db), seed=0,
                  executor=executor, max_models=4, fuse=False, **kwargs).run()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {json.dumps(t["spec"]["choices"], sort_keys=True):
                  [store.learning_curve(t["id"], m) for m in ("train_loss", "val_loss", "val_acc")]
                  for t in store.trials()}
        return curves, PlanTable(store).rows()


def test_a_search_uses_a_pass_registered_by_the_guide(tmp_path, registered):
    separate, _ = _search(tmp_path, "off", InProcessExecutor(), optimize=False)
    plain, plain_rows = _search(tmp_path, "cse", InProcessExecutor(), optimize=True)
    ours, rows = _search(tmp_path, "ours", InProcessExecutor(), optimize=True,
                         passes={"inputs_only": True})
    assert ours == separate == plain  # exact on CPU: sharing less changes no value
    assert rows and all(r["passes"] == ["cse", "inputs_only"] for r in rows if r["units"])
    assert all(r["passes"] == ["cse"] for r in plain_rows if r["units"])
    shared = {u["shared_nodes"] for r in rows for u in r["units"] if "shared_nodes" in u}
    before = {u["shared_nodes"] for r in plain_rows for u in r["units"] if "shared_nodes" in u}
    assert shared and before and max(shared) < min(before)  # the pass ran in the worker


def test_worker_processes_import_a_pass_registered_outside_the_package(tmp_path, registered):
    """A real worker process has not run this file: it imports the pass by the reference
    the driver sends with the job (the module that registers it)."""
    assert pass_ref(get_pass("inputs_only")) == "test_passes:INPUTS_ONLY"
    ours, rows = _search(tmp_path, "workers", None, optimize=True, workers=1,
                         passes={"inputs_only": True})
    assert rows and all(r["status"] == "merged" and r["passes"] == ["cse", "inputs_only"]
                        for r in rows if r["units"]), [(r["status"], r["reason"], r["passes"])
                                                       for r in rows]
    # the models' one input, shared by every group: what the pass leaves
    assert {u["shared_nodes"] for r in rows for u in r["units"] if "shared_nodes" in u} == {1}
