"""What ``retiarii status``, ``export`` and ``plot`` show of a search of several objectives:
its Pareto front, and its hypervolume as models finished (docs/multi_objective.md).

The hypervolume is taken on objectives normalised to [0, 1] over the run's feasible models
(0 the best value seen, 1 the worst), with the reference point at 1 in every objective (the
worst value of each), so that runs of one store compare and no unit dominates the sum.
"""
from __future__ import annotations

import json

from .objectives import Objectives, hypervolume, pareto_indices

__all__ = ["front_rows", "hypervolume_history", "objectives_of", "print_front"]


def objectives_of(config: dict) -> Objectives | None:
    """The experiment's objectives when it has several or constraints (None: one metric)."""
    spec = config.get("objectives")
    if not spec:
        return None
    return Objectives.of(spec["metrics"], spec["modes"], spec["constraints"])


def front_rows(store) -> list[dict]:
    """The models on the front, each with the id of the trial that trained it (its last)."""
    from .engine.storage.pareto import FrontTable

    rows = FrontTable(store).front()
    for row in rows:
        trial = store.db.execute("SELECT id FROM trials WHERE model_id = ? ORDER BY seq DESC "
                                 "LIMIT 1", [row["model_id"]]).fetchone()
        row["trial_id"] = trial[0] if trial else None
    return rows


def print_front(store, objectives: Objectives, table) -> None:
    rows = front_rows(store)
    names = list(objectives.metrics)
    shown = [[r["model_id"], r["trial_id"], *[_fmt(r["values"].get(m)) for m in names],
              json.dumps(r["sample"])[:70]] for r in rows]
    where = ", ".join(f"{m} ({d})" for m, d in zip(names, objectives.modes))
    print(f"\nPareto front of {where} ({len(rows)} models):")
    print(table(shown, ["model", "trial", *names, "sample"]) if rows
          else "(no feasible finished model yet)")
    if objectives.constraints:
        print("constraints: " + ", ".join(map(str, objectives.constraints)))


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def hypervolume_history(models: list[dict], objectives: Objectives) -> list[float]:
    """The normalised hypervolume of the front after each model of ``models`` (rows of
    :meth:`~.engine.pareto.FrontTable.models`, in the order they finished)."""
    feasible = [objectives.point(m["values"]) for m in models if m["violation"] == 0]
    if not feasible:
        return [0.0] * len(models)
    lo = [min(p[d] for p in feasible) for d in range(len(feasible[0]))]
    hi = [max(p[d] for p in feasible) for d in range(len(feasible[0]))]

    def norm(p):
        return tuple((x - a) / (b - a) if b > a else 0.0 for x, a, b in zip(p, lo, hi))

    ref = (1.0,) * len(lo)
    out, seen = [], []
    for m in models:
        if m["violation"] == 0:
            seen.append(norm(objectives.point(m["values"])))
            seen = [seen[i] for i in pareto_indices(seen)]  # the front so far suffices
        out.append(hypervolume(seen, ref))
    return out


def plot_front(store, objectives: Objectives, axes) -> bool:
    """The front of the first two objectives on ``axes[0]`` (every finished model, the
    infeasible ones marked), the hypervolume by models finished on ``axes[1]``; False when no
    model has finished."""
    from .engine.storage.pareto import FrontTable

    models = FrontTable(store).models()
    if not models:
        return False
    x, y = objectives.metrics[:2]
    ok = [m for m in models if m["violation"] == 0]
    bad = [m for m in models if m["violation"] != 0]
    axes[0].scatter([m["values"][x] for m in ok], [m["values"][y] for m in ok], s=12,
                    color="0.6", label="feasible")
    if bad:
        axes[0].scatter([m["values"][x] for m in bad], [m["values"][y] for m in bad], s=14,
                        marker="x", color="tab:red", label="infeasible")
    ids = set(FrontTable(store).front_ids() or [])
    front = sorted((m for m in ok if m["model_id"] in ids), key=lambda m: m["values"][x])
    axes[0].plot([m["values"][x] for m in front], [m["values"][y] for m in front],
                 marker="o", color="tab:blue", label="Pareto front")
    axes[0].set(xlabel=f"{x} ({objectives.modes[0]})", ylabel=f"{y} ({objectives.modes[1]})",
                title="Pareto front")
    axes[0].legend(fontsize=8)
    history = hypervolume_history(models, objectives)
    axes[1].plot(range(1, len(history) + 1), history, drawstyle="steps-post", marker=".")
    axes[1].set(xlabel="models trained", ylabel="hypervolume (normalised)",
                title="hypervolume over time")
    return True
