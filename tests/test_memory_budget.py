"""A merged job stays within its memory budget (issue #26 item 6): the runner cuts a batch of
trials whose estimated memory (each model's alone, from the IR: merging only shares) is over
what a job may use of its slot into jobs that fit; results are unchanged."""
from __future__ import annotations

import pytest

import retiarii as rt
import test_optimize as o
from engine_helpers import InProcessExecutor
from exp_space import lr_trainer, mlp_space
from retiarii.engine.runner.packer import Packer
from retiarii.engine.driver.proposals import Proposals
from retiarii.engine.runner.trial import Trial

GB = 1 << 30


def _trials(memory):
    return [Trial(f"t{i}", {"profile": {"units": 1.0, "memory": m}}) for i, m in enumerate(memory)]


def test_a_batch_over_the_budget_is_cut_into_jobs_that_fit_by_hand():
    packer = Packer(slot_memory=10 * GB, batch_models=8, memory_budget=0.3)  # 3 GB a job
    packs = packer.packs(_trials([1 * GB] * 7), slots=1)
    assert [[t.trial_id for t in p] for p in packs] == [["t0", "t1", "t2"], ["t3", "t4", "t5"],
                                                          ["t6"]]
    assert packer.take_note("t3") == {"split": "memory", "budget_bytes": 3 * GB, "models": 3,
                                      "of": 7}
    # a model over the budget alone trains alone; one without an estimate counts nothing
    packs = Packer(slot_memory=10 * GB, batch_models=8, memory_budget=2 * GB).packs(
        _trials([1 * GB, 5 * GB, 0, 1 * GB]), slots=1)
    assert [[t.trial_id for t in p] for p in packs] == [["t0"], ["t1"], ["t2", "t3"]]
    # an unknown slot memory (inf) puts no limit
    assert len(Packer(batch_models=8, memory_budget=0.8).packs(_trials([GB] * 4), 1)) == 1


def test_the_budget_is_checked():
    with pytest.raises(ValueError, match="memory_budget"):
        rt.OptimizeConfig(memory_budget=0)
    assert rt.OptimizeConfig().memory_budget == 0.8
    assert rt.OptimizeConfig.from_json(rt.OptimizeConfig(memory_budget=2e9).to_json()
                                       ).memory_budget == 2e9


class SmallSlots(InProcessExecutor):
    def slot_memory(self):
        return 2.5 * 1000 / 0.8  # the default budget holds two models of 1000 bytes, not three


def test_a_search_under_a_small_budget_splits_its_jobs_and_trains_the_same(tmp_path,
                                                                           monkeypatch):
    # every model estimated at 1000 bytes (the estimate itself: tests/test_packing*.py)
    monkeypatch.setattr(Proposals, "estimate", lambda self, model: {"units": 1.0,
                                                                    "memory": 1000})
    db = tmp_path / "small.db"
    rt.Experiment(mlp_space, rt.strategies.GridSearch(), lr_trainer, store=str(db),
                  executor=SmallSlots(), seed=0, max_models=4, fuse=False).run()
    rows = o._plans(db)
    assert rows and all(len(r["trials"]) <= 2 for r in rows)
    assert any((r.get("packing") or {}).get("split") == "memory" for r in rows)
    off = tmp_path / "off.db"
    rt.Experiment(mlp_space, rt.strategies.GridSearch(), lr_trainer, store=str(off),
                  executor=InProcessExecutor(), seed=0, max_models=4, optimize=False).run()
    assert o._curves(db) == o._curves(off)
