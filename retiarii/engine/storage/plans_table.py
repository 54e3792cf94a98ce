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
    plans.add({"job_id": "j", "trials": ["a", "b"], "status": "merged", "speedup": 1.8})
    plans.summary()["merged_trials"]     # 2
"""
from __future__ import annotations

import json
import statistics
import time

from ..jobs.contract import GroupMemory, HeldLayout

__all__ = ["PlanTable"]

PASSES = ["cse"]  # the default passes (plan_group; docs/optimization.md); records name theirs


class PlanTable:
    """The current experiment's rows of ``plans`` in a :class:`~.store.Store`."""

    def __init__(self, store):
        self.store = store

    def add(self, record: dict) -> None:
        """Write one grouped job's record (what ``TrialRunner.on_group`` gives)."""
        self.store.flush()  # after the trials' own rows: a row never names a trial not written
        self.store.db["plans"].insert({
            "experiment_id": self.store.experiment_id, "job_id": record.get("job_id"),
            "trials": json.dumps(list(record["trials"])),
            "passes": json.dumps(record.get("passes", PASSES)),
            "status": record["status"], "reason": record.get("reason") or "",
            "alone": json.dumps(list(record.get("alone") or [])),
            "speedup": record.get("speedup"), "seconds": record.get("seconds"),
            "units": json.dumps(record.get("units") or []),
            "packing": json.dumps(record["packing"]) if record.get("packing") else None,
            "time": time.time()})

    def rows(self) -> list[dict]:
        """Every row of the current experiment, oldest first, JSON columns decoded."""
        self.store.flush()
        out = []
        for row in self.store.db["plans"].rows_where("experiment_id = ?", [self.store.experiment_id],
                                                    order_by="id"):
            out.append({**row, "trials": json.loads(row["trials"]),
                        "alone": json.loads(row["alone"] or "[]"),
                        "passes": json.loads(row["passes"] or "[]"),
                        "units": json.loads(row["units"] or "[]"),
                        "packing": json.loads(row.get("packing") or "null")})
        return out

    def alone_trials(self) -> set[str]:
        """Trials of reverted groups, and those a failed group sent to retry alone: they
        train alone for the rest of the search."""
        return {t for row in self.rows() for t in row["alone"]}

    def fused_trials(self) -> set[str]:
        """Trials that trained fused in some segment: those of a fused unit of a row, and those
        whose checkpoint says so (``trials.fused``: a job killed before its row was written)."""
        marked = {r[0] for r in self.store.db.execute(
            "SELECT id FROM trials WHERE experiment_id = ? AND fused = 1",
            [self.store.experiment_id])}
        return marked | {t for row in self.rows() for unit in row["units"] if unit.get("fused")
                         for t in unit["trials"]}

    def unfused_trials(self) -> set[str]:
        """Trials whose fused unit was measured slower than grouped unfused (a unit with
        ``"fusion_reverted"``): they train unfused for the rest of the search."""
        return {t for row in self.rows() for unit in row["units"] if unit.get("fusion_reverted")
                for t in unit["trials"]}

    def layout_decisions(self) -> dict[str, dict[str, HeldLayout]]:
        """Group key -> device -> the layout decision in force (the last one a unit's
        ``"decision"`` records, read through :meth:`HeldLayout.from_json`): a resumed search
        applies them without measuring again."""
        out: dict[str, dict[str, HeldLayout]] = {}
        for row in self.rows():
            for unit in row["units"]:
                decision = unit.get("decision")
                if decision:
                    out.setdefault(decision["group_key"], {})[unit["choice"]["device"]] = (
                        HeldLayout.from_json(decision))
        return out

    def memory(self) -> GroupMemory:
        """What the search's grouped jobs taught its planner, for a resumed search: the trials
        that train alone or unfused from now on, the step times alone, the layout decisions."""
        return GroupMemory(alone=self.alone_trials(), unfused=self.unfused_trials(),
                           alone_s=self.alone_profiles(), layouts=self.layout_decisions())

    def alone_profiles(self) -> dict[str, float]:
        """Trial -> its separate step time, as profiled in a grouped job."""
        out: dict[str, float] = {}
        for row in self.rows():
            for unit in row["units"]:
                out.update(unit.get("alone_s") or {})
        return out

    def summary(self) -> dict:
        """What ``retiarii status`` shows: grouped jobs by status, how many trials trained
        merged, and the measured speed-up of the kept groups (median and range)."""
        rows = self.rows()
        by_status: dict[str, int] = {}
        for row in rows:
            by_status[row["status"]] = by_status.get(row["status"], 0) + 1
        merged = [row for row in rows if row["status"] == "merged"]
        speedups = [row["speedup"] for row in merged if row["speedup"] is not None]
        out = {"jobs": by_status,
               "merged_trials": len({t for row in merged for t in row["trials"]}),
               "alone_after_revert_or_failure": len(self.alone_trials()),
               "fused_trials": len(self.fused_trials()),
               "unfused_after_revert": len(self.unfused_trials())}
        packed = [row["packing"] for row in rows if row.get("packing")]
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
            out["saved_s"] = round(sum(row["seconds"] * (row["speedup"] - 1) for row in merged
                                       if row["speedup"] is not None and row["seconds"]), 2)
            out["slower_kept"] = sum(1 for x in speedups if x < 1.0)
        units = [u for row in merged for u in row["units"] if u.get("merged")]
        shared = [u["shared_nodes"] for u in units if u.get("shared_nodes") is not None]
        if shared:  # what the passes left computed once, and for how many models
            out["shared"] = {"nodes": statistics.median(shared), "models": statistics.median(
                len(u.get("trials") or ()) for u in units if u.get("shared_nodes") is not None)}
        layouts = self.layout_decisions()
        if layouts:  # "cpu: fused 2.40x (cse 1.30x)" per group key and device
            out["layouts"] = [f"{device}: {c.reason}" for key in sorted(layouts)
                              for device, c in sorted(layouts[key].items())]
        predicted = {f"{(u.get('choice') or {}).get('device')}: {line}" for row in rows
                     for u in row["units"] for line in (u.get("choice") or {}).get("predicted", ())}
        if predicted:  # fusion decided by the device model (engine/worker_side/auto_layout.py)
            out["predicted"] = sorted(predicted)[:5]
        reasons = sorted({row["reason"] for row in rows
                          if row["status"] != "merged" and row["reason"]})
        if reasons:
            out["why_not_merged"] = reasons[:5]
        return out
