"""The ``retiarii`` commands that read a finished (or running) run: ``status``, ``export``
and ``plot``. :mod:`retiarii.cli` parses the arguments and calls these."""
from __future__ import annotations

import json
import os
import sys

from .cli_common import CliError, _best_table, _metric, _open, _positive, _table
from .cli_source import trusted_source

__all__ = ["cmd_export", "cmd_plot", "cmd_status"]


def cmd_status(args) -> int:
    from .cli_one_shot import is_one_shot, print_status

    store = _open(args.db)
    exp = store.get_experiment()
    if is_one_shot(exp["config"]):
        print_status(store, args.db, args.json, _table)
        return 0
    metric, mode = _metric(store)
    errored = [t for t in store.trials() if t["state"] == "ERRORED"]
    out = {"store": args.db, "experiment": exp["id"], "status": exp["status"],
           "seed": exp["seed"], "trials": store.counts_by_state(),
           "models": len(store.models()), "best": store.best_models(metric, mode, args.top),
           "errors": [{"trial_id": t["id"], "model_id": t["model_id"],
                       "error": t["error"] or ""} for t in errored]}
    from .engine.plans import PlanTable

    plans = PlanTable(store).summary()
    if plans["jobs"]:
        out["optimization"] = plans
    from .engine.function_trainer import NOT_OPTIMIZED, is_function_spec

    if is_function_spec(exp["config"].get("trainer")):  # said once, not per job or trial
        out["optimization_note"] = NOT_OPTIMIZED
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.db}: experiment {out['experiment']} ({out['status']}), {out['models']} models")
    print(_table([[k, v] for k, v in out["trials"].items()], ["state", "trials"]))
    print(f"\nbest by {metric} ({mode}):")
    print(_best_table(out["best"]) if out["best"] else "(no finished result yet)")
    if errored:
        print(f"\nerrored trials ({len(errored)}):")
        for e in out["errors"]:
            lines = e["error"].strip().splitlines() or ["(no reason recorded)"]
            if args.errors:
                print(f"- {e['trial_id']} (model {e['model_id']}):")
                print("    " + "\n    ".join(lines))
            else:
                print(f"- {e['trial_id']} (model {e['model_id']}): {_reason(lines)}")
        if not args.errors:
            print("(retiarii status --errors shows each whole traceback)")
    if "optimization" in out:
        print("\n" + _optimization_line(out["optimization"]))
    if "optimization_note" in out:
        print("\n" + out["optimization_note"])
    return 0


def _optimization_line(plans: dict) -> str:
    """One paragraph on cross-model optimization: grouped jobs, merged models, speed-up."""
    jobs = ", ".join(f"{n} {status}" for status, n in sorted(plans["jobs"].items()))
    text = f"cross-model optimization: grouped jobs {jobs}; {plans['merged_trials']} trials trained merged"
    if "speedup" in plans:
        s = plans["speedup"]
        text += (f"; measured speed-up {s['median']}x (median of {s['measured_jobs']} jobs, "
                 f"{s['min']}x-{s['max']}x)")
    if plans.get("fused_trials"):
        text += f"; {plans['fused_trials']} trained fused"
    if plans.get("unfused_after_revert"):
        text += f"; fusion reverted for {plans['unfused_after_revert']}"
    if plans.get("alone_after_revert_or_failure"):
        text += f"; {plans['alone_after_revert_or_failure']} trials train alone after a revert or failure"
    for line in plans.get("layouts", []):
        text += f"\n  layout {line}"
    packing = plans.get("packing")
    if packing:
        text += (f"\n  packing: {packing['packs']} packs, {packing['models_per_pack']} models per "
                 f"pack (median), slowest slot {packing['balance']}x the mean (median)")
        if packing.get("unmerged_packs"):
            text += f"; {packing['unmerged_packs']} packed without merging"
    for why in plans.get("why_not_merged", []):
        text += f"\n  apart: {why}"
    return text


def _reason(lines: list[str]) -> str:
    """The line of an error that says what happened: a traceback's last line, else the
    first."""
    if lines[0].startswith("Traceback"):
        return lines[-1]
    return lines[0]


def cmd_export(args) -> int:
    import torch

    from .engine.checkpoint import CheckpointError
    from .engine.checkpoint import load as load_checkpoint
    from .refs import TrustedRefs

    _positive(args.top, "--top")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a file; give a folder (created if missing)")
    store = _open(args.db)
    from .cli_one_shot import export, is_one_shot

    if is_one_shot(store.get_experiment()["config"]):
        return export(store, args.db, args.out, CliError)
    metric, mode = _metric(store)
    # A store is code: its graphs may name only torch, operator, math and the space's own code.
    rule = TrustedRefs((store.get_experiment()["config"].get("space") or {}).get("ref"))
    best = store.best_models(metric, mode, args.top)
    if not best:
        raise CliError(f"{args.db} has no model with a result yet: nothing to export")
    os.makedirs(args.out, exist_ok=True)
    for rank, row in enumerate(best, 1):
        model = store.get_model(row["model_id"])
        name = f"model_{row['model_id']}"
        source = trusted_source(model["graph"], f"Model{row['model_id']}", rule,
                                f"model {row['model_id']} of {args.db}", CliError)
        with open(os.path.join(args.out, name + ".py"), "w") as f:
            f.write(source)
        files = f"{name}.py"
        ckpt = store.last_checkpoint(row["trial_id"])
        if ckpt is not None:
            try:
                weights = load_checkpoint(ckpt["path"])["model"]
            except (CheckpointError, OSError, KeyError) as err:
                print(f"warning: {name}: its checkpoint {ckpt['path']} cannot be read ({err}); "
                      f"exported without weights", file=sys.stderr)
            else:
                torch.save(weights, os.path.join(args.out, name + ".pt"))
                files += f", {name}.pt"
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"rank": rank, metric: row["value"], "sample": row["sample"],
                       "hash": row["hash"]}, f, indent=2)
        print(f"{rank}. {files}  ({metric} {row['value']:.4f})")
    return 0


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a folder; give the PNG file to write")
    store = _open(args.db)
    from .cli_one_shot import is_one_shot, plot

    if is_one_shot(store.get_experiment()["config"]):
        plot(store, args.db, args.out, plt, CliError)
        print(f"wrote {args.out}")
        return 0
    metric, mode = _metric(store)
    better = max if mode == "max" else min
    finals = [f for f in store.final_values(metric) if f[2] is not None]
    curves = {t: c for t, c in store.learning_curves(metric).items() if c}
    if not finals and not curves:
        raise CliError(f"{args.db} has no {metric} values yet: nothing to plot")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    best, ys, ts = None, [], []
    t0 = finals[0][1] if finals else 0.0
    for _, end, value in finals:
        best = value if best is None else better(best, value)
        ys.append(best)
        ts.append(end - t0)
    axes[0].plot(range(1, len(ys) + 1), ys, drawstyle="steps-post", marker=".")
    axes[0].set(xlabel="models trained", ylabel=f"best {metric}", title="best so far")
    axes[1].plot(ts, ys, drawstyle="steps-post", marker=".")
    axes[1].set(xlabel="wall time (s)", ylabel=f"best {metric}", title="best so far")
    for curve in curves.values():
        # markers: a trial stopped after one epoch is a single point, invisible as a line
        axes[2].plot([s for s, _ in curve], [v for _, v in curve], alpha=0.4, lw=1,
                     marker=".", markersize=4)
    axes[2].set(xlabel="epoch", ylabel=metric, title="learning curves")
    for ax in (axes[0], axes[2]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # models and epochs count
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0
