"""What a run reports: its trials by state, best models, front, optimization or one-shot search.

The summary is what ``Experiment.run()``/``resume()`` return, what ``progress`` gets after each
trial and what ``retiarii run`` prints; it is read from the store (the driver's open one, or
the file again once the driver has ended), plus what only the live driver knows (the models
proposed so far, the trials and jobs running now).

Example::

    summary = run_summary(exp)   # {"store", "models", "trials", "best", "running", "jobs", ...}
"""
from __future__ import annotations

from typing import Any

from ..storage.pareto import FrontTable
from ..storage.plans_table import PlanTable
from ..storage.segments_table import SegmentTable
from ..storage.store import Store

__all__ = ["run_summary"]


def run_summary(exp: Any) -> dict:
    """Experiment ``exp``'s summary: trials by state, the best finished models (feasible ones
    under constraints), models proposed, trials running now; the Pareto front with several
    objectives, the grouped jobs' summary when any ran; a one-shot search's own summary."""
    if exp.store is not None and exp.store.db is None:  # the driver has ended
        with Store(exp.path) as store:
            store.use_experiment(exp.store.experiment_id)
            return _summary(exp, store)
    return _summary(exp, exp.store)


def _summary(exp: Any, store: Store) -> dict:
    if exp.one_shot:
        search = SegmentTable(store).summary(exp.strategy.num_segments(), exp.mode)
        return {"store": exp.path, "models": search["models"], "trials": {},
                "best": search["best"], "running": 0, "max_models": None, "one_shot": search}
    counts = store.counts_by_state()
    proposed = exp.proposals.count
    if exp.objectives.constraints:  # the best feasible models only
        feasible = {m["model_id"] for m in FrontTable(store).models() if m["violation"] == 0}
        best = [b for b in store.best_models(exp.metric, exp.mode, max(proposed, 5),
                                             finished=True)
                if b["model_id"] in feasible][:5]
    else:
        best = store.best_models(exp.metric, exp.mode, 5, finished=True)
    runner = exp.runner
    running, jobs = ((runner.running, runner.jobs_running) if runner is not None
                     else (counts.get("RUNNING", 0),) * 2)
    out = {"store": exp.path, "models": proposed, "trials": counts, "best": best,
           "running": running, "jobs": jobs, "max_models": exp.max_models}
    if exp.objectives.multi:  # the result: every model on the front
        out["pareto"] = FrontTable(store).front()
        out["objectives"] = exp.objectives.to_json()
    plans = PlanTable(store).summary()
    if plans["jobs"]:
        out["optimization"] = plans
    return out
