"""The ``retiarii`` commands that read a finished (or running) run: ``status``, ``export``
and ``plot``. :mod:`retiarii.cli` parses the arguments and calls these."""
from __future__ import annotations

import json
import os
import sys
import time

from .cli_common import CliError, best_table, store_metric, open_store, positive_flag, format_table
from .cli_pareto import front_rows, objectives_of, plot_front, print_front
from .cli_source import export_header, trusted_source
from .engine.driver.failures import failure_summary, reason_of

__all__ = ["cmd_export", "cmd_plot", "cmd_status"]


def cmd_status(args) -> int:
    from .cli_one_shot import is_one_shot, print_status

    store = open_store(args.db, args.experiment)
    exp = store.get_experiment()
    experiments = store.experiments()
    if len(experiments) > 1 and not args.json:
        print(_experiments_table(experiments, exp["id"]) + "\n")
    if is_one_shot(exp["config"]):
        print_status(store, args.db, args.json, format_table)
        return 0
    if getattr(args, "model", None) is not None:  # one model in full
        from .cli_model import model_detail, print_model

        detail = model_detail(store, args.model)
        if args.json:
            print(json.dumps(detail, indent=2))
        else:
            print_model(detail)
        return 0
    metric, mode = store_metric(store)
    objectives = objectives_of(exp["config"])
    several = objectives is not None and objectives.multi
    if getattr(args, "pareto", False) and not several:
        raise CliError(f"--pareto: experiment {exp['id']} of {args.db} optimizes one metric "
                       f"({metric}); its result is its best models: leave --pareto out")
    errored = [t for t in store.trials() if t["state"] == "ERRORED"]
    models = store.models()
    failed = [m for m in models if m["status"] == "failed"]
    why = {t["model_id"]: t["error"] for t in errored}
    for m in failed:  # a store older than models.error: its trial's error says why
        m["error"] = m.get("error") or why.get(m["id"])
    out = {"store": args.db, "experiment": exp["id"], "status": exp["status"],
           "seed": exp["seed"], "trials": store.counts_by_state(),
           "models": len(models), "best": store.best_models(metric, mode, args.top),
           "errors": [{"trial_id": t["id"], "model_id": t["model_id"],
                       "error": t["error"] or ""} for t in errored],
           "failures": failure_summary(models),
           "failed_models": [{"model_id": m["id"], "sample": m["sample"],
                              "error": m.get("error") or ""} for m in failed],
           "experiments": [{"id": e["id"], "status": e["status"]} for e in experiments]}
    from .engine.storage.plans_table import PlanTable

    plans = PlanTable(store).summary()
    if plans["jobs"]:
        out["optimization"] = plans
    from .engine.trainers.function_trainer import NOT_OPTIMIZED, is_function_spec

    if is_function_spec(exp["config"].get("trainer")):  # said once, not per job or trial
        out["optimization_note"] = NOT_OPTIMIZED
    if several:  # the result of a search of several objectives is its front
        out["objectives"] = objectives.to_json()
        out["pareto"] = [{k: r[k] for k in ("model_id", "trial_id", "values", "sample")}
                         for r in front_rows(store)]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.db}: experiment {out['experiment']} ({out['status']}), {out['models']} models")
    print(format_table([[k, v] for k, v in out["trials"].items()], ["state", "trials"]))
    if several:
        print(f"\nseveral objectives: the result is a Pareto front of {len(out['pareto'])} "
              f"models" + ("" if args.pareto else f" (retiarii status {args.db} --pareto "
                                                   f"lists them)"))
        if args.pareto:
            print_front(store, objectives, format_table)
    else:
        print(f"\nbest by {metric} ({mode}):")
        print(best_table(out["best"]) if out["best"] else "(no finished result yet)")
    if failed:
        _print_failed(out, {t["model_id"] for t in errored}, args.errors)
    if errored:
        print(f"\nerrored trials ({len(errored)}):")
        for e in out["errors"]:
            lines = e["error"].strip().splitlines() or ["(no reason recorded)"]
            if args.errors:
                print(f"- {e['trial_id']} (model {e['model_id']}):")
                print("    " + "\n    ".join(lines))
            else:
                print(f"- {e['trial_id']} (model {e['model_id']}): {reason_of(e['error'])}")
        if not args.errors:
            print("(retiarii status --errors shows each whole traceback)")
    if "optimization" in out:
        print("\n" + optimization_line(out["optimization"]))
    if "optimization_note" in out:
        print("\n" + out["optimization_note"])
    return 0


def optimization_line(plans: dict) -> str:
    """One paragraph on cross-model optimization: grouped jobs, merged models, speed-up."""
    jobs = ", ".join(f"{n} {status}" for status, n in sorted(plans["jobs"].items()))
    text = f"cross-model optimization: grouped jobs {jobs}; {plans['merged_trials']} trials trained merged"
    if "speedup" in plans:  # the whole segments, as measured: one figure per run
        s = plans["speedup"]
        text += (f"; merged jobs ran at {s['median']}x the speed of their models apart (median "
                 f"of {s['measured_jobs']} jobs, {s['min']}x-{s['max']}x)")
        if plans.get("saved_s") is not None:
            saved = plans["saved_s"]
            text += f", saving {saved:.1f} s" if saved >= 0 else f", costing {-saved:.1f} s"
        if plans.get("slower_kept"):
            text += (f"; {plans['slower_kept']} of them slower than apart, kept until a second "
                     f"slower segment confirms it (one noisy segment reverts nothing)")
    if plans.get("shared"):
        text += (f"; each merged job computed {plans['shared']['nodes']:g} nodes once for "
                 f"{plans['shared']['models']:g} models (medians)")
    if plans.get("fused_trials"):
        text += f"; {plans['fused_trials']} trained fused"
    if plans.get("unfused_after_revert"):
        text += f"; fusion reverted for {plans['unfused_after_revert']}"
    if plans.get("alone_after_revert_or_failure"):
        text += f"; {plans['alone_after_revert_or_failure']} trials train alone after a revert or failure"
    for line in plans.get("layouts", []):  # measured on a group's first batches
        text += f"\n  layout chosen on first batches, {line}"
    for line in plans.get("predicted", []):  # fusion: the device model's, never timed
        text += f"\n  fusion by the device model, {line}"
    packing = plans.get("packing")
    if packing:
        text += (f"\n  packing: {packing['packs']} packs, {packing['models_per_pack']} models per "
                 f"pack (median), slowest slot {packing['balance']}x the mean (median)")
        if packing.get("unmerged_packs"):
            text += f"; {packing['unmerged_packs']} packed without merging"
    for why in plans.get("why_not_merged", []):
        text += f"\n  apart: {why}"
    return text


def _experiments_table(experiments: list[dict], shown: int) -> str:
    """The experiments of a store, the one shown marked (``--experiment N`` picks another)."""
    rows = [[("*" if e["id"] == shown else " ") + str(e["id"]), e["status"],
             (e["config"].get("strategy") or {}).get("class", "?").rsplit(":", 1)[-1],
             time.strftime("%Y-%m-%d %H:%M", time.localtime(e["created"] or 0))]
            for e in experiments]
    return (f"experiments ({len(experiments)}; * shown, --experiment N for another):\n"
            + format_table(rows, ["id", "status", "strategy", "created"]))


def _print_failed(out: dict, with_trial: set, whole: bool) -> None:
    """Failed models: how many by reason, then those no errored trial below accounts for
    (models that could not be built, non-finite metrics), each with its reason."""
    failures = out["failures"]
    print(f"\nfailed models ({failures['failed']} of {failures['models']}), by reason:")
    for reason, n in failures["reasons"]:
        print(f"  {n:>4}  {reason}")
    for m in out["failed_models"]:
        if m["model_id"] in with_trial:
            continue  # its errored trial is listed below
        if whole:
            print(f"- model {m['model_id']} {json.dumps(m['sample'])}:")
            print("    " + "\n    ".join(m["error"].strip().splitlines() or ["(no reason)"]))
        else:
            print(f"- model {m['model_id']} {json.dumps(m['sample'])[:60]}: "
                  f"{reason_of(m['error'])}")


def cmd_export(args) -> int:
    import torch

    from .engine.storage.checkpoint import CheckpointError
    from .engine.storage.checkpoint import load as load_checkpoint
    from .refs import TrustedRefs

    positive_flag(args.top, "--top")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a file; give a folder (created if missing)")
    store = open_store(args.db, args.experiment)
    from .cli_one_shot import export, is_one_shot

    if is_one_shot(store.get_experiment()["config"]):
        return export(store, args.db, args.out, CliError)
    metric, mode = store_metric(store)
    # A store is code: its graphs may name only torch, operator, math and the space's own code.
    rule = TrustedRefs((store.get_experiment()["config"].get("space") or {}).get("ref"))
    objectives = objectives_of(store.get_experiment()["config"])
    if getattr(args, "pareto", False):
        if objectives is None or not objectives.multi:
            raise CliError(f"--pareto: {args.db} optimizes one metric ({metric}): export its "
                           f"best models with --top K instead")
        best = [{**r, "value": r["values"].get(metric)} for r in front_rows(store)]
    else:
        best = store.best_models(metric, mode, args.top)
    if not best:
        raise CliError(f"{args.db} has no model with a result yet: nothing to export")
    os.makedirs(args.out, exist_ok=True)
    for rank, row in enumerate(best, 1):
        model = store.get_model(row["model_id"])
        name = f"model_{row['model_id']}"
        source = trusted_source(model["graph"], f"Model{row['model_id']}", rule,
                                f"model {row['model_id']} of {args.db}", CliError)
        files, weights = f"{name}.py", None
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
        what = (f"model {row['model_id']} of {os.path.basename(args.db)} (experiment "
                f"{store.experiment_id}), ranked {rank} by {metric} {row['value']:.4f}")
        with open(os.path.join(args.out, name + ".py"), "w") as f:
            f.write(export_header(source, name, what, store.get_experiment()["config"],
                                  weights is not None))
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"rank": rank, metric: row["value"], **row.get("values", {}),
                       "sample": row["sample"], "hash": row["hash"]}, f, indent=2)
        print(f"{rank}. {files}  ({metric} {row['value']:.4f})")
    return 0


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a folder; give the PNG file to write")
    store = open_store(args.db, args.experiment)
    from .cli_one_shot import is_one_shot, plot

    if is_one_shot(store.get_experiment()["config"]):
        plot(store, args.db, args.out, plt, CliError)
        print(f"wrote {args.out}")
        return 0
    metric, mode = store_metric(store)
    objectives = objectives_of(store.get_experiment()["config"])
    several = objectives is not None and objectives.multi
    better = max if mode == "max" else min
    finals = [f for f in store.final_values(metric) if f[2] is not None]
    curves = {t: c for t, c in store.learning_curves(metric).items() if c}
    if not finals and not curves:
        raise CliError(f"{args.db} has no {metric} values yet: nothing to plot")
    fig, grid = plt.subplots(2 if several else 1, 3, figsize=(15, 8 if several else 4))
    axes = grid[0] if several else grid
    if several:  # the result: the front, and how its hypervolume grew
        plot_front(store, objectives, grid[1])
        grid[1][2].axis("off")
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
