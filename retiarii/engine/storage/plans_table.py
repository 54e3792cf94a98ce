"""The ``plans`` table: what cross-model optimization did, one row per grouped job.

The runner reports each grouped job as it ends (:meth:`~.trials.TrialRunner` ``on_group``);
the experiment writes it here. A row says which trials trained together, which passes
applied, whether the group was kept (``merged``), ``reverted`` (measured slower than its
models apart: they train alone from then on), ``failed`` (its failed trials retry alone) or
``not merged`` (the worker could not plan them together, and why), with the measured
speed-up and the worker's measurements (each unit's report in ``units``: a fused unit has
``"fused": true``, its ``fused_speedup`` over grouped unfused and, when measured slower,
``"fusion_reverted": true``; the row's reason then says so; each unit's ``"layout"`` says how
it trained and ``"decision"`` the layout choice in force for its group key and device, with the
measured speed-ups: docs/optimization.md, "Choosing a layout"), and with packing the job's
packing decision (``packing``: its device slot, models, predicted time per iteration, the
placement's balance; status ``packed`` for a job packed without merging). ``retiarii status`` summarises it
(:func:`plan_summary`); a resumed experiment reads back which trials must stay alone and the
profiles already measured (:func:`alone_trials`, :func:`alone_profiles`).

Example::

    plans = PlanTable(store)
    plans.add(PlanRecord("j", ("a", "b"), "merged", speedup=1.8))
    plans.summary()["merged_trials"]     # 2
    plans.records()[0].units             # the units' reports (jobs/reports.py)
"""
from __future__ import annotations

import statistics
import time

from ..jobs.contract import GroupMemory, HeldLayout
from ..jobs.reports import PlanRecord

__all__ = ["PlanTable"]

class PlanTable:
    """The current experiment's rows of ``plans`` in a :class:`~.store.Store`."""

    def __init__(self, store):
        self.store = store

    def add(self, record: PlanRecord) -> None:
        """Write one grouped job's record (what ``TrialRunner.on_group`` gives), through its
        codec (:meth:`PlanRecord.row`)."""
        self.store.flush()  # after the trials' own rows: a row never names a trial not written
        self.store.db["plans"].insert({"experiment_id": self.store.experiment_id,
                                       **record.row(), "time": time.time()})

    def records(self) -> list[PlanRecord]:
        """Every row of the current experiment, oldest first, read back through the codec
        (:meth:`PlanRecord.from_row`: rows of older stores read as well)."""
        self.store.flush()
        return [PlanRecord.from_row(row) for row in self.store.db["plans"].rows_where(
            "experiment_id = ?", [self.store.experiment_id], order_by="id")]

    def rows(self) -> list[dict]:
        """:meth:`records` in their JSON form (:meth:`PlanRecord.to_json`): what a plans row
        holds, its JSON columns decoded."""
        return [record.to_json() for record in self.records()]

    def alone_trials(self) -> set[str]:
        """Trials of reverted groups, and those a failed group sent to retry alone: they
        train alone for the rest of the search."""
        return {t for row in self.records() for t in row.alone}

    def fused_trials(self) -> set[str]:
        """Trials that trained fused in some segment: those of a fused unit of a row, and those
        whose checkpoint says so (``trials.fused``: a job killed before its row was written)."""
        marked = {r[0] for r in self.store.db.execute(
            "SELECT id FROM trials WHERE experiment_id = ? AND fused = 1",
            [self.store.experiment_id])}
        return marked | {t for row in self.records() for unit in row.units if unit.fused
                         for t in unit.trials}

    def unfused_trials(self) -> set[str]:
        """Trials whose fused unit was measured slower than grouped unfused (a unit whose
        judgement says ``fusion_reverted``): they train unfused for the rest of the search."""
        return {t for row in self.records() for unit in row.units if unit.fusion_reverted
                for t in unit.trials}

    def layout_decisions(self) -> dict[str, dict[str, HeldLayout]]:
        """Group key -> device -> the layout decision in force (the last one a unit's
        judgement records): a resumed search applies them without measuring again."""
        out: dict[str, dict[str, HeldLayout]] = {}
        for row in self.records():
            for unit in row.units:
                if unit.decision is not None:
                    out.setdefault(unit.judgement.group_key, {})[unit.device] = unit.decision
        return out

    def memory(self) -> GroupMemory:
        """What the search's grouped jobs taught its planner, for a resumed search: the trials
        that train alone or unfused from now on, the step times alone, the layout decisions."""
        return GroupMemory(alone=self.alone_trials(), unfused=self.unfused_trials(),
                           alone_s=self.alone_profiles(), layouts=self.layout_decisions())

    def alone_profiles(self) -> dict[str, float]:
        """Trial -> its separate step time, as profiled in a grouped job."""
        out: dict[str, float] = {}
        for row in self.records():
            for unit in row.units:
                out.update(unit.alone_s)
        return out

    def summary(self) -> dict:
        """What ``retiarii status`` shows: grouped jobs by status, how many trials trained
        merged, and the measured speed-up of the kept groups (median and range)."""
        rows = self.records()
        by_status: dict[str, int] = {}
        for row in rows:
            by_status[row.status] = by_status.get(row.status, 0) + 1
        merged = [row for row in rows if row.status == "merged"]
        speedups = [row.speedup for row in merged if row.speedup is not None]
        out = {"jobs": by_status,
               "merged_trials": len({t for row in merged for t in row.trials}),
               "alone_after_revert_or_failure": len(self.alone_trials()),
               "fused_trials": len(self.fused_trials()),
               "unfused_after_revert": len(self.unfused_trials())}
        packed = [row.packing for row in rows if row.packing]
        if packed:  # the packing decisions (engine/placing.py) and how busy they kept slots
            balances = [p["balance"] for p in packed if p.get("balance") is not None]
            out["packing"] = {"packs": len(packed),
                              "models_per_pack": round(statistics.median(
                                  p["models"] for p in packed), 1),
                              "balance": round(statistics.median(balances), 3) if balances else None,
                              "unmerged_packs": by_status.get("packed", 0)}
        if speedups:
            out["speedup"] = {"median": round(statistics.median(speedups), 3),
                              "min": round(min(speedups), 3), "max": round(max(speedups), 3),
                              "measured_jobs": len(speedups)}
            # apart would have taken speedup x a job's seconds: the difference is time saved
            out["saved_s"] = round(sum(row.seconds * (row.speedup - 1) for row in merged
                                       if row.speedup is not None and row.seconds), 2)
            out["slower_kept"] = sum(1 for x in speedups if x < 1.0)
        units = [u for row in merged for u in row.units if u.merged]
        shared = [u.shared_nodes for u in units if u.shared_nodes is not None]
        if shared:  # what the passes left computed once, and for how many models
            out["shared"] = {"nodes": statistics.median(shared), "models": statistics.median(
                len(u.trials) for u in units if u.shared_nodes is not None)}
        layouts = self.layout_decisions()
        if layouts:  # "cpu: fused 2.40x (cse 1.30x)" per group key and device
            out["layouts"] = [f"{device}: {c.reason}" for key in sorted(layouts)
                              for device, c in sorted(layouts[key].items())]
        predicted = {f"{u.device}: {line}" for row in rows for u in row.units
                     for line in (u.choice.predicted if u.choice is not None else ())}
        if predicted:  # fusion decided by the device model (engine/worker_side/auto_layout.py)
            out["predicted"] = sorted(predicted)[:5]
        reasons = sorted({row.reason for row in rows if row.status != "merged" and row.reason})
        if reasons:
            out["why_not_merged"] = reasons[:5]
        return out
