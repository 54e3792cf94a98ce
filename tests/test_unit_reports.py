"""The typed reports of grouped jobs (retiarii/engine/jobs/reports.py): one codec, rows of older
stores read back, and a layout the device model chose never carries a time verdict."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import test_grouped_jobs as g
import test_measuring as tm
from retiarii.engine.jobs.contract import GroupOrder, HeldLayout
from retiarii.engine.jobs.job import Job, JobFinished, JobProfiled
from retiarii.engine.jobs.reports import PlanRecord, UnitChoice, UnitJudgement, UnitReport
from retiarii.engine.runner import planner
from retiarii.engine.storage.plans_table import PlanTable
from retiarii.engine.storage.store import Store
from retiarii.engine.worker_side import measuring_group as measuring
from retiarii.optim.cost import Layout

# A plans row as the store wrote it before the reports were typed (dict units, "decided": true)
OLD_UNITS = [
    {"trials": ["a", "b"], "merged": True, "fused": True, "batches": 4, "load_s": 0.2,
     "first_load_s": 0.1, "produce_s": 0.0, "compute_s": 0.8, "setup_s": 0.01, "start_s": 0.0,
     "alone_s": {"a": 0.3}, "spread": 0.02, "step_s": 0.2, "alone_by_arch": {"k": 0.3},
     "layout": "fused", "decided": True,
     "choice": {"device": "cpu", "probed": False, "order": ["fused", "cse"], "speedups": {},
                "predicted": ["2 models: predicted 2.00x fused, fused"]},
     "fused_speedup": 0.5, "fusion_verdict": "0.50x", "fusion_reverted": True,
     "strikes": {"fusion": 1}, "slower": True,
     "decision": {"group_key": "k1", "order": ["cse"], "speedups": {"cse": 1.3},
                  "reverted": [], "reason": "cse 1.30x", "strikes": {}}},
    {"trials": ["c"], "merged": False, "reason": "the plan gives it no input in common",
     "layout": "separate", "choice": {"device": "cpu", "probed": False, "order": ["cse"],
                                      "speedups": {}}},
]


def test_a_row_written_in_the_old_dict_form_reads_back(tmp_path):
    with Store(tmp_path / "old.db") as store:
        store.use_experiment(store.add_experiment({}))
        store.db["plans"].insert({
            "experiment_id": store.experiment_id, "job_id": "j", "trials": '["a", "b", "c"]',
            "passes": '["cse", "fusion"]', "status": "merged", "reason": "", "alone": "[]",
            "speedup": 1.5, "seconds": 2.0, "units": json.dumps(OLD_UNITS), "packing": None,
            "time": 1.0})
        table = PlanTable(store)
        record, = table.records()
        fused, alone = record.units
        assert fused.decided and fused.fusion_reverted and fused.judgement.fused_speedup == 0.5
        assert alone.reason.startswith("the plan") and not alone.merged and not alone.decided
        assert record.unfused == ("a", "b") and table.unfused_trials() == {"a", "b"}
        assert table.fused_trials() == {"a", "b"} and table.alone_profiles() == {"a": 0.3}
        assert table.layout_decisions() == {"k1": {"cpu": HeldLayout(
            order=("cse",), speedups={"cse": 1.3}, reason="cse 1.30x")}}
        summary = table.summary()
        assert summary["jobs"] == {"merged": 1} and summary["layouts"] == ["cpu: cse 1.30x"]
        assert summary["predicted"] == ["cpu: 2 models: predicted 2.00x fused, fused"]
        # written again through the codec, the row reads the same, and its JSON keeps every
        # old key and value (the choice names the layouts the device model chose besides)
        again = PlanRecord.from_row(record.row())
        assert again == replace(record, time=None)
        for old, new in zip(OLD_UNITS, table.rows()[0]["units"]):
            assert {k: v for k, v in new.items() if k in old and k != "choice"} == {
                k: v for k, v in old.items() if k != "choice"}
            assert new["choice"].items() >= old["choice"].items()


def test_the_codec_round_trips_every_field():
    choice = UnitChoice("cpu", probed=True, order=("batching", "separate"),
                        speedups={"batching": 1.4, "separate": 1.0}, probe_s=0.2,
                        measured_on="first batches", steps_s={"batching": 0.1}, bound_s=0.01,
                        bounds={"cse": 1.2}, skipped="fused not measured: x")
    unit = UnitReport(("a", "b"), merged=True, layout="batching", choice=choice, batches=3,
                      load_s=0.1, compute_s=0.5, alone_s={"a": 0.2}, spread=0.1, step_s=0.15,
                      judged_batches=2, shared_nodes=4, executions=9, dedicated=("trunk",),
                      dedicated_device="thread",
                      judgement=UnitJudgement(verdict="1.40x", slower=False,
                                              strikes={"batching": 0}, group_key="k",
                                              decision=HeldLayout(order=("batching",))))
    assert UnitReport.from_json(json.loads(json.dumps(unit.to_json()))) == unit
    record = PlanRecord("j", ("a", "b"), "merged", units=(unit,), alone=("a",),
                        packing={"models": 2}, passes=("cse", "batching"))
    assert PlanRecord.from_row(record.row()) == record


def test_a_layout_the_device_model_chose_or_the_user_forced_cannot_carry_a_time_verdict():
    decided = UnitReport(("a", "b"), merged=True, layout="batching",
                         choice=UnitChoice("cpu", device_chosen=("batching",)))
    assert decided.decided
    with pytest.raises(ValueError, match="never judged by time"):
        decided.judged(UnitJudgement(verdict="0.80x", slower=True))
    assert decided.judged(UnitJudgement(slower=False)).judgement.slower is False
    forced = UnitReport(("a", "b"), merged=True, fused=True, layout="fused",
                        choice=UnitChoice("cpu", forced=("fused",)))  # fuse=True
    assert forced.decided and UnitReport.from_json(forced.to_json()) == forced
    with pytest.raises(ValueError, match="never judged by time"):
        forced.judged(UnitJudgement(verdict="0.50x", slower=True))
    rest = replace(forced, fused=False, layout="cse")  # the forced job's unfused models
    assert not rest.decided
    measured = UnitReport(("a", "b"), merged=True, layout="batching",
                          choice=UnitChoice("cpu"))  # batching="measure": time judges it
    assert measured.judged(UnitJudgement(verdict="0.80x")).verdict == "0.80x"


def test_batching_the_device_model_chose_is_decided_when_measured_on_the_first_batches(
        tmp_path, monkeypatch):
    """Under ``fuse="auto"`` a group with one merged layout measures it against apart on its
    first batches (a MeasuringGroup). When that layout is batching set ``"auto"`` (chosen by
    the device model, rounding unlike apart), the unit that trains batched is decided: never
    judged or reverted by time, as it is under ``fuse=False``. (It used to report no
    ``"decided"``, and the runner judged its segment by time.)"""
    monkeypatch.setattr(measuring.MeasuringGroup, "_speedups",
                        lambda group, batch: {Layout.BATCHING: 3.0})
    tasks = [tm._adapter_task(t, tmp_path, "m-") for t in tm.SAMPLES]
    meta = {"group": GroupOrder(passes={"batching": "auto"}, fuse="auto",
                                profile=tuple(tm.SAMPLES))}
    events = g._run(Job("m", tasks, meta=meta))
    assert isinstance(events[-1], JobFinished), events[-1]
    unit, = next(e for e in events if isinstance(e, JobProfiled)).units
    assert unit.layout == "batching" and unit.choice.measured_on == "first batches"
    assert unit.decided and unit.to_json()["decided"] is True
    assert not planner._judged(unit)  # the runner gives it no time verdict
