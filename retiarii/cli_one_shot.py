"""What the ``retiarii`` command does differently for one-shot (weight-sharing) searches.

``retiarii run SPACE --strategy darts|gumbel|proxyless|spos|enas`` (or a space file whose
``strategy`` is one-shot, or ``--weight-sharing`` with a multi-trial strategy) runs a search
segment by segment (:mod:`retiarii.engine.driver.one_shot_host`). ``status`` then shows the search
(segment k of n, models evaluated, the best so far, the selected architecture, the error of a
failed search) and ``export`` writes the selected architecture, with the weights it inherits
from the super-network when the strategy offers them. :mod:`retiarii.cli` calls these.
"""
from __future__ import annotations

import json
import os
import sys

__all__ = ["is_one_shot", "print_status", "print_result", "export", "plot", "progress_line",
           "split_by_scale"]


def is_one_shot(config: dict) -> bool:
    """Whether an experiment's stored config is a one-shot search's."""
    return bool((config.get("strategy") or {}).get("one_shot"))


def progress_line(summary: dict) -> str:
    """The CLI's progress line after a segment."""
    search = summary["one_shot"]
    best = f"{search['best'][0]['value']:.4f}" if search["best"] else "-"
    return (f"segment {search['segment']}/{search['segments']}, {search['models']} models "
            f"evaluated, best {best}, selected {json.dumps(search['selected'])[:80]}")


# Each architecture once: the latest of its evaluations, how many there were, and a * on the
# one selected (ENAS draws one path many times; DARTS selects by its alphas, not by value).
_BEST_HEADERS = ["rank", "model", "segment", "value", "evaluated", "sample"]


def _best_rows(best: list[dict], selected: dict | None = None) -> list[list]:
    return [[f"{i + 1}{' *' if b['sample'] == selected else ''}", b["model_id"], b["segment"],
             f"{b['value']:.4f}", f"{b.get('count', 1)}x", json.dumps(b["sample"])[:90]]
            for i, b in enumerate(best)]


def print_warnings(search: dict, file=None) -> None:
    """The selection's warnings (not better than chance, a tie), one line each."""
    for text in search.get("warnings") or []:
        print(f"warning: the selection is {text}", file=file or sys.stdout)


def print_result(summary: dict, table) -> None:
    """What ``retiarii run`` / ``resume`` print at the end of a one-shot search."""
    search = summary["one_shot"]
    if search["best"]:
        print(table(_best_rows(search["best"], search["selected"]), _BEST_HEADERS))
    print(f"\nselected architecture: {json.dumps(search['selected'])}")
    print_warnings(search)


def _summary(store) -> dict:
    from .engine.storage.segments_table import SegmentTable

    config = store.get_experiment()["config"]
    return SegmentTable(store).summary(config["strategy"].get("segments"),
                                       config.get("mode", "max"), 10)


def print_status(store, db: str, as_json: bool, table) -> None:
    """``retiarii status`` of a one-shot search."""
    exp = store.get_experiment()
    metric = exp["config"].get("metric", "val_acc")
    search = _summary(store)
    name = exp["config"]["strategy"]["class"].rsplit(":", 1)[-1]
    if as_json:
        print(json.dumps({"store": db, "experiment": exp["id"], "status": exp["status"],
                          "seed": exp["seed"], "strategy": name, "one_shot": search}, indent=2))
        return
    print(f"{db}: experiment {exp['id']} ({exp['status']}), one-shot search with {name}: "
          f"segment {search['segment']} of {search['segments']}, {search['models']} models "
          f"evaluated")
    if search["metrics"]:
        print("last segment: " + ", ".join(f"{k} {v:.4g}" for k, v in search["metrics"].items()))
    print(f"\nbest evaluated by {metric} (on the shared weights; each architecture once, "
          f"at its latest evaluation; * selected):")
    print(table(_best_rows(search["best"], search["selected"]), _BEST_HEADERS)
          if search["best"] else "(none yet)")
    what = "result (model %s)" % search["result_model"] if search["result_model"] else "so far"
    print(f"\nselected architecture, {what}: {json.dumps(search['selected'])}")
    print_warnings(search)
    if search["error"]:
        lines = search["error"].strip().splitlines() or ["(no reason recorded)"]
        print(f"\nfailed: {lines[0]}")


def export(store, db: str, out: str, error: type[Exception]) -> int:
    """``retiarii export`` of a one-shot search: the selected architecture as a standalone
    ``.py``, its ``.json``, and a ``.pt`` of the weights it inherits from the super-network
    when the strategy's last unit holds them (``export_state``); the source under the store's
    trust rule, as for any export (:mod:`retiarii.cli_source`)."""
    import torch

    from .engine.storage.checkpoint import CheckpointError
    from .engine.storage.checkpoint import load as load_checkpoint
    from .engine.storage.segments_table import SegmentTable
    from .cli_source import export_header, trusted_source
    from .refs import TrustedRefs

    table = SegmentTable(store)
    result = table.result()
    if result is None:
        search = _summary(store)
        raise error(f"{db}: the one-shot search has not selected its architecture yet (segment "
                    f"{search['segment']} of {search['segments']}): resume it to the end "
                    f"(retiarii resume {db})")
    rule = TrustedRefs((store.get_experiment()["config"].get("space") or {}).get("ref"))
    name = f"model_{result['id']}"
    source = trusted_source(result["graph"], f"Model{result['id']}", rule,
                            f"model {result['id']} of {db}", error)
    os.makedirs(out, exist_ok=True)
    files, note = f"{name}.py", ""
    unit = table.last()["unit"]
    try:
        weights = load_checkpoint(store.checkpoint_file(unit)).get("export", {}).get("weights")
    except (CheckpointError, OSError) as err:
        weights, note = None, f"; its unit {unit} cannot be read ({err})"
    if weights is not None:
        torch.save(weights, os.path.join(out, name + ".pt"))
        files += f", {name}.pt (weights inherited from the super-network)"
    elif not note:
        note = "; the strategy offers no inherited weights (export_state): train it from scratch"
    config = store.get_experiment()["config"]
    metric = config.get("metric", "val_acc")
    value = "" if result["value"] is None else f", {metric} {result['value']:.4f} on them"
    what = (f"the architecture selected by the one-shot search of {os.path.basename(db)} "
            f"(experiment {store.experiment_id}, model {result['id']})" +
            (f", with the weights it inherits from the super-network{value}"
             if weights is not None else ""))
    with open(os.path.join(out, name + ".py"), "w") as f:
        f.write(export_header(source, name, what, config, weights is not None))
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump({"selected": True, metric: result["value"], "sample": result["sample"],
                   "hash": result["hash"]}, f, indent=2)
    print(f"selected architecture: {files}" + (f"  (architecture alone{note})" if weights is None
                                                 else ""))
    if weights is None and note.startswith("; its unit"):
        print(f"warning: {name}: exported without weights{note}", file=sys.stderr)
    return 0


def plot(store, db: str, out: str, plt, error: type[Exception]) -> None:
    """``retiarii plot`` of a one-shot search: each evaluated model's value on the shared
    weights with the best so far, and the strategy's own metrics per segment."""
    from .engine.storage.segments_table import SegmentTable

    table = SegmentTable(store)
    config = store.get_experiment()["config"]
    metric, mode = config.get("metric", "val_acc"), config.get("mode", "max")
    values = [(i + 1, m["value"]) for i, m in enumerate(table.evaluated())
              if m["value"] is not None]
    rows = table.rows()
    if not values and not rows:
        raise error(f"{db}: the one-shot search has recorded no segment yet: nothing to plot")
    better = max if mode == "max" else min
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    best, ys = None, []
    for _, value in values:
        best = value if best is None else better(best, value)
        ys.append(best)
    axes[0].scatter([i for i, _ in values], [v for _, v in values], s=8, alpha=0.5,
                    label="evaluated")
    axes[0].plot([i for i, _ in values], ys, drawstyle="steps-post", label="best so far")
    axes[0].set(xlabel="models evaluated", ylabel=f"{metric} (shared weights)",
                title="models of the one-shot search")
    axes[0].legend()
    near, far = split_by_scale(rows, metric)
    other = axes[1].twinx() if far else None  # counts (controller_steps: 50) on their own axis
    for ax, names in ((axes[1], near), (other, far)):
        for name in names:  # one color per metric across both axes (a twin axis restarts them)
            points = [(r["segment"], r["metrics"][name]) for r in rows if name in r["metrics"]]
            ax.plot([p for p, _ in points], [v for _, v in points], marker=".",
                    linestyle="--" if ax is other else "-", label=name,
                    color=f"C{(near + far).index(name) % 10}")
        if names:
            ax.set_ylabel(", ".join(names))
            ax.legend(loc="upper left" if ax is axes[1] else "upper right")
    axes[1].set(xlabel="segment", title="the strategy's metrics per segment")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def split_by_scale(rows: list[dict], metric: str) -> tuple[list[str], list[str]]:
    """The strategy's per-segment metrics split by scale for the plot: those within 10x of the
    search metric's largest value (accuracies, losses) on its axis, the others (step counts,
    temperatures, sizes) on a second one, so neither flattens the other."""
    values: dict[str, list[float]] = {}
    for r in rows:
        for name, v in r["metrics"].items():
            if isinstance(v, (int, float)) and v == v:
                values.setdefault(name, []).append(abs(float(v)))
    ref = max(max(values.get(metric, [1.0])), 1.0)  # an accuracy's scale is 1 however low
    near = sorted(n for n, vs in values.items() if max(vs) <= 10 * ref)
    far = sorted(n for n in values if n not in near)
    return near, far
